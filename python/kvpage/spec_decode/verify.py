"""Verification of proposed tokens against the target model's logits (vLLM's rejection sampler).

A speculating sequence's step returns k + 1 logits rows: row i is the target's distribution for the token
after the sequence's last token and the first i drafts. Greedy: drafts are accepted while they equal the
target's argmax, and the argmax at the first mismatch (or after the last draft: the bonus token) follows.
Sampled: draft i is accepted with probability min(1, p_i(d) / q_i(d)); the proposers here are deterministic
(q one-hot), so that is p_i(d), and a rejection draws from the residual max(0, p_i - q_i), i.e. p_i without d,
renormalised. Every emitted token is then distributed exactly as the target's p (Leviathan et al. 2023),
p after the request's temperature, min-p, top-k and top-p, as the sampler computes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.engine.sampler import TopLogprobs, _min_p, _scale, _top_k_top_p, rank_and_top, seed_key


@dataclass
class SpecRow:
    """One speculating sequence: its drafts, its request's params, and where its output stands."""
    drafts: list[int]
    params: object  # SamplingParams
    sample_index: int = 0
    position: int = 0  # output tokens the sequence had before this step


@dataclass
class Verified:
    tokens: list[int]  # accepted drafts, then the target's own token
    logprobs: list[float]  # each token's log-probability under the target's raw logits
    num_accepted: int
    top_logprobs: list[TopLogprobs] | None = None  # per token, where the request asks for logprobs=k


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The sampler's distribution for rows of one request: temperature, min-p, top-k / top-p, softmax."""
    n = logits.shape[0]
    scaled = _scale(logits, [params.temperature] * n)
    _min_p(scaled, [params.min_p] * n)
    if params.needs_filter:
        scaled = _top_k_top_p(scaled, [params] * n)
    return scaled.softmax(dim=-1)


class Verifier:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._row_generator = torch.Generator()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SpecRow]) -> list[Verified]:
        """logits: [sum(len(drafts) + 1), vocab], each row's block in order."""
        logits = logits.float().cpu()
        argmax = logits.argmax(dim=-1).tolist()
        logp = torch.log_softmax(logits, dim=-1)
        out, start = [], 0
        for row in rows:
            n = len(row.drafts) + 1
            if row.params.greedy:
                tokens, accepted = _accept_greedy(row.drafts, argmax[start:start + n])
            else:
                tokens, accepted = self._accept_sampled(logits[start:start + n], row)
            lps, top = _logprobs(logp[start:start + len(tokens)], tokens, row.params)
            out.append(Verified(tokens, lps, accepted, top))
            start += n
        return out

    def _accept_sampled(self, logits: torch.Tensor, row: SpecRow) -> tuple[list[int], int]:
        probs = target_probs(logits, row.params)
        tokens = []
        for i, d in enumerate(row.drafts):
            gen = self._generator(row, i)
            u = torch.rand((), generator=gen).item()
            if u < probs[i, d].item():
                tokens.append(d)
                continue
            residual = probs[i].clone()
            residual[d] = 0.0
            if residual.sum().item() <= 0.0:  # p is one-hot on d (u >= 1 cannot happen; rounding can)
                tokens.append(d)
                continue
            tokens.append(int(torch.multinomial(residual, 1, generator=gen).item()))
            return tokens, i
        k = len(row.drafts)
        tokens.append(int(torch.multinomial(probs[k], 1, generator=self._generator(row, k)).item()))
        return tokens, k

    def _generator(self, row: SpecRow, offset: int) -> torch.Generator:
        """A seeded request draws from its own keyed stream (per output position), the rest from the engine's."""
        seed = row.params.seed
        if seed is None:
            return self.generator
        return self._row_generator.manual_seed(seed_key(seed, row.sample_index, row.position + offset))


def _logprobs(logp: torch.Tensor, tokens: list[int], params) -> tuple[list[float], list[TopLogprobs] | None]:
    """The tokens' log-probabilities (rows of a log-softmax, one per token) and, for logprobs=k, each one's
    rank and top-k, as the sampler reports them for tokens decoded one at a time."""
    ids = torch.tensor(tokens)
    if params.logprobs is None:
        return logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist(), None
    own, top = rank_and_top(logp, ids, params.logprobs)
    return own.tolist(), top


def _accept_greedy(drafts: list[int], argmax: list[int]) -> tuple[list[int], int]:
    tokens = []
    for d, t in zip(drafts, argmax):
        if d != t:
            tokens.append(t)
            return tokens, len(tokens) - 1
        tokens.append(d)
    tokens.append(argmax[len(drafts)])
    return tokens, len(drafts)
