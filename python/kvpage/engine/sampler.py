"""Turns one step's logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds,
allowed_token_ids, logit_bias, the penalties and min_tokens (engine/logits_processors.py), and logprobs.

Everything that can be is done on the whole batch at once (one argmax, one log-softmax, one sort for
the rows that filter); only seeded rows draw their noise one by one, from their own generator.
Sampling uses the exponential race (argmax of probs / Exp(1) noise, as vLLM does): one draw per
vocabulary entry from a generator, so a seeded row's token depends on nothing but its seed, its
sample index, its position and its logits, never on the rest of the batch.

Order, as vLLM's (v1) sampler: allowed_token_ids, logit_bias, min_tokens and the penalties on the
raw logits; temperature; min-p; top-k and top-p (so top-p measures its mass on what min-p left,
renormalised; HF and vLLM v0 apply min-p last, which differs only where both are set).
Log-probabilities (cumulative_logprob, logprobs) are the model's own: the log-softmax of the raw
logits, before any of that (vLLM's default, raw logprobs).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvpage.ops.layers import greedy_sample

from .logits_processors import apply_logits_processors, needs_processing
from .sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def seed_key(seed: int, sample_index: int, position: int) -> int:
    """A generator seed for one draw (splitmix64 finaliser): the stream does not depend on how many
    draws other rows made, or on preemption replaying this sequence's prefill."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK64


@dataclass
class SampleRow:
    """One logits row: draw num_samples tokens from it (n > 1 forks at the prompt's last token)."""

    params: SamplingParams
    num_samples: int = 1
    sample_index: int = 0  # of the first sample; the others follow
    position: int = 0  # output tokens the sequence already has
    # The penalties' token history, given only where params use them (nothing is built otherwise):
    # prompt_token_ids for repetition_penalty, output_token_ids for every penalty.
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # The ids that would end the sequence (eos unless ignore_eos, stop_token_ids): held back while
    # position < params.min_tokens.
    stop_token_ids: tuple[int, ...] = ()
    # params.bad_words as token ids (logits_processors.bad_words_token_ids); output_token_ids with them.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@dataclass
class TopLogprobs:
    """What logprobs=k reports for one sampled token. rank: 1 + the number of tokens the model makes
    strictly more likely (1 = most likely; a tie shares the better rank); token_ids / logprobs / ranks:
    the k most likely tokens, best first."""

    rank: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    def first(self, k: int) -> "TopLogprobs":
        """The same, with only the k most likely tokens."""
        return TopLogprobs(self.rank, self.token_ids[:k], self.logprobs[:k], self.ranks[:k])


@dataclass
class SamplerOutput:
    tokens: list[list[int]]  # per row, num_samples tokens
    logprobs: list[list[float]]  # the model's log-probability of each (before penalties/temperature/filters)
    # Per row and sample, for rows whose params.logprobs is set (None elsewhere); None if no row asked.
    top_logprobs: list[list[TopLogprobs | None]] | None = None


@contextlib.contextmanager
def _sampled_read(device: torch.device):
    """Reading the sampled results back to the host: the one device sync a step makes, allowed even under
    torch.cuda.set_sync_debug_mode("error") (tests/cuda/test_step_syncs.py), which catches any other."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Unseeded requests draw from one engine-wide stream: reproducible for a given workload.
        self.generator = torch.Generator().manual_seed(seed)
        self._row_generator = torch.Generator()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sample rows")
        logits = logits.float()
        # Expand rows that fork into one row per sample, so every later op is one batched call.
        expand = [i for i, row in enumerate(rows) for _ in range(row.num_samples)]
        if len(expand) != len(rows):
            logits = logits[torch.tensor(expand, device=logits.device)]
        flat = [(rows[i], k) for i, k in _with_offsets(rows)]
        greedy = [j for j, (row, _) in enumerate(flat) if row.params.greedy]
        if len(greedy) == len(flat) and not _needs_more_than_argmax(rows):
            # One fused pass: argmax and its log-softmax (argmax + gather + logsumexp otherwise), where the
            # logits are: from a GPU only [rows] tokens and logprobs come back, not [rows, vocab] logits.
            tokens, logprobs = greedy_sample(logits)
            with _sampled_read(logits.device):
                tokens, logprobs = tokens.tolist(), logprobs.tolist()
            return _regroup(tokens, logprobs, rows)
        # Everything else (processors, seeded generators, top-k/top-p) runs on the CPU, whose generators
        # draw the same noise whatever device produced the logits.
        with _sampled_read(logits.device):
            logits = logits.cpu()
        tokens = self._sample(logits, flat, greedy)
        logprobs, top = _logprobs(logits, tokens, [row for row, _ in flat])
        return _regroup(tokens.tolist(), logprobs, rows, top)

    def _sample(self, logits: torch.Tensor, flat: list, greedy: list[int]) -> torch.Tensor:
        """Greedy and random rows each work on their own copy of their logits rows (an index, not a
        view), which the logits processors then change in place: `logits` stays the model's."""
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        if greedy:
            g = torch.tensor(greedy)
            greedy_rows = [flat[j][0] for j in greedy]
            if any(needs_processing(row) for row in greedy_rows):
                tokens[g] = apply_logits_processors(logits[g], greedy_rows).argmax(dim=-1)
            elif len(greedy) == len(flat):  # e.g. greedy with logprobs: no copy to take
                tokens = logits.argmax(dim=-1)
            else:
                tokens[g] = logits[g].argmax(dim=-1)
        rand = [j for j, (row, _) in enumerate(flat) if not row.params.greedy]
        if not rand:
            return tokens
        r = torch.tensor(rand)
        rand_rows = [flat[j][0] for j in rand]
        scaled = _scale(_processed(logits[r], rand_rows), [row.params.temperature for row in rand_rows])
        _min_p(scaled, [row.params.min_p for row in rand_rows])
        filt = [k for k, row in enumerate(rand_rows) if row.params.needs_filter]
        if filt:
            f = torch.tensor(filt)
            scaled[f] = _top_k_top_p(scaled[f], [rand_rows[k].params for k in filt])
        probs = scaled.softmax(dim=-1)
        tokens[r] = probs.div_(self._noise(probs.shape, [flat[j] for j in rand])).argmax(dim=-1)
        return tokens

    def _noise(self, shape, flat: list) -> torch.Tensor:
        """Exp(1) noise: seeded rows from their own keyed generator, the rest from the engine's."""
        q = torch.empty(shape)
        unseeded = [k for k, (row, _) in enumerate(flat) if row.params.seed is None]
        if unseeded:
            q[torch.tensor(unseeded)] = torch.empty(len(unseeded), shape[1]).exponential_(generator=self.generator)
        for k, (row, offset) in enumerate(flat):
            if row.params.seed is not None:
                key = seed_key(row.params.seed, row.sample_index + offset, row.position)
                q[k].exponential_(generator=self._row_generator.manual_seed(key))
        return q


def _needs_more_than_argmax(rows: list[SampleRow]) -> bool:
    """Whether some greedy row needs its logits changed (penalties, token bias, min_tokens) or its logprobs. Cheaper
    than needs_processing (no stop-id test): this runs for every row of every greedy step."""
    for row in rows:
        p = row.params
        if (p.logprobs is not None or p.uses_penalties or p.uses_token_bias or p.bad_words
                or row.position < p.min_tokens):
            return True
    return False


def _processed(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """These rows' logits after the token bias, min_tokens and the penalties (changed in place: `logits` is a copy)."""
    if any(needs_processing(row) for row in rows):
        return apply_logits_processors(logits, rows)
    return logits


def _min_p(scaled: torch.Tensor, min_ps: list[float]) -> None:
    """-inf, in place, for every token whose probability (after temperature) is below min_p times its
    row's largest: vLLM's MinPLogitsProcessor, formula and all. The most likely token always stays."""
    keep = [k for k, m in enumerate(min_ps) if m > 0.0]
    if not keep:
        return
    k = torch.tensor(keep)
    rows = scaled[k]
    probs = rows.softmax(dim=-1)
    threshold = torch.tensor([min_ps[i] for i in keep]).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    scaled[k] = rows.masked_fill_(probs < threshold, float("-inf"))


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              rows: list[SampleRow]) -> tuple[list[float], list[TopLogprobs | None] | None]:
    """The sampled tokens' log-probabilities under the raw logits, and the rank and top-k of the rows
    that ask for logprobs: one log-softmax and one topk over those rows (a logsumexp for the others)."""
    want = [j for j, row in enumerate(rows) if row.params.logprobs is not None]
    if not want:
        return _sampled_logprobs(logits, tokens).tolist(), None
    sampled = torch.empty(len(rows))
    rest = [j for j, row in enumerate(rows) if row.params.logprobs is None]
    if rest:
        r = torch.tensor(rest)
        sampled[r] = _sampled_logprobs(logits[r], tokens[r])
    w = torch.tensor(want)
    logp = (logits if not rest else logits[w]).log_softmax(dim=-1)
    own, tops = rank_and_top(logp, tokens[w], max(rows[j].params.logprobs for j in want))
    sampled[w] = own
    top: list[TopLogprobs | None] = [None] * len(rows)
    for j, t in zip(want, tops):
        top[j] = t.first(rows[j].params.logprobs)
    return sampled.tolist(), top


def rank_and_top(logp: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, list[TopLogprobs]]:
    """Rows of a log-softmax [R, vocab] and one token per row [R]: that token's log-probability [R],
    and per row its rank and the k most likely tokens. The token's value is read from the same
    tensor as the top-k, so a token has one number everywhere it is reported."""
    own = logp.gather(1, tokens.unsqueeze(1))
    k = min(k, logp.shape[1])
    values, ids = logp.topk(max(k, 1), dim=-1)  # k = 0 still ranks a token that is the most likely
    # Within a sorted top-k, 1 + the values strictly above each one: ties share a rank.
    top_ranks = torch.searchsorted(-values, -values, side="left") + 1
    ranks = _ranks(logp, own, ids == tokens.unsqueeze(1), top_ranks).tolist()
    values, ids, top_ranks = values[:, :k].tolist(), ids[:, :k].tolist(), top_ranks[:, :k].tolist()
    return own.squeeze(1), [TopLogprobs(*fields) for fields in zip(ranks, ids, values, top_ranks)]


def _sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _ranks(logp: torch.Tensor, own: torch.Tensor, in_top: torch.Tensor, top_ranks: torch.Tensor) -> torch.Tensor:
    """1 + the number of tokens more likely than the sampled one. A sampled token inside the top-k (a
    greedy one always is) has its rank there, since every more likely token is in the top-k too; only
    the others count over the whole vocabulary."""
    ranks = top_ranks.gather(1, in_top.int().argmax(dim=1, keepdim=True)).squeeze(1)
    missed = (~in_top.any(dim=1)).nonzero().squeeze(1)
    if missed.numel():
        ranks[missed] = (logp[missed] > own[missed]).sum(dim=-1) + 1
    return ranks


def _scale(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """logits / temperature, row by row, finite for any temperature > 0: the row's maximum goes to 0
    first (softmax does not change) and the divisor is at least float32's smallest normal, so a tiny
    temperature (1e-40 is a float32 subnormal, 1e-300 is 0) gives the argmax, not inf - inf = nan."""
    t = torch.tensor(temperatures).clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    return (logits - logits.max(dim=-1, keepdim=True).values) / t


def _with_offsets(rows: list[SampleRow]):
    for i, row in enumerate(rows):
        for k in range(row.num_samples):
            yield i, k


def _regroup(tokens: list[int], logprobs: list[float], rows: list[SampleRow],
             top: list[TopLogprobs | None] | None = None) -> SamplerOutput:
    out_t, out_l, out_top, j = [], [], [], 0
    for row in rows:
        out_t.append(tokens[j:j + row.num_samples])
        out_l.append(logprobs[j:j + row.num_samples])
        if top is not None:
            out_top.append(top[j:j + row.num_samples])
        j += row.num_samples
    return SamplerOutput(out_t, out_l, out_top if top is not None else None)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf (one sort for all rows)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).clamp(max=vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    sorted_logits.masked_fill_(ranks >= k.unsqueeze(1), float("-inf"))
    top_p = torch.tensor([float(p.top_p) for p in params]).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below top_p. The most likely token always stays, even
    # where top_p rounds to 0 in float32 (a top_p of 1e-46 passes the (0, 1] check): as vLLM and HF do.
    drop = probs.cumsum(dim=-1) - probs >= top_p
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
