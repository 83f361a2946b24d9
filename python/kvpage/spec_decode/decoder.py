"""SpecDecode: the engine's speculative decoding, between the scheduler (proposals, one call per decoding
sequence) and the sampler (verification of the k + 1 logits rows a speculating sequence's step returns).

Back-off (so that work the proposals do not fit costs little): each sequence proposes at most its own k,
which shrinks to one past what was last accepted and grows back by two after a fully accepted run; after
runs with nothing accepted the sequence stops proposing for 2, 4, ... up to 32 steps, then tries again.
Speculation is off for requests whose logits depend on the tokens inside the run: beam search, penalties,
logit_bias / allowed_token_ids, bad_words, and min_tokens not yet reached. logprobs=k requests speculate: the
verification reports each kept token's log-probability, rank and top-k from its own logits row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .config import SpeculativeConfig
from .verify import SpecRow, Verified, Verifier

MAX_SKIP_STEPS = 32


@dataclass
class _Adaptive:
    k: int
    zero_streak: int = 0
    skip: int = 0


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # steps of one sequence that verified at least one draft token (vLLM's num_drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + the target's own token of each draft

    def as_dict(self) -> dict:
        d, t, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_decode_num_drafts": d, "spec_decode_num_draft_tokens": t,
                "spec_decode_num_accepted_tokens": a,
                "spec_decode_acceptance_rate": a / t if t else 0.0,
                # vLLM's mean acceptance length: tokens a draft step yields, the target's own one included.
                "spec_decode_mean_accepted_length": 1.0 + a / d if d else 0.0}


class SpecDecode:
    def __init__(self, config: SpeculativeConfig, proposer, params_of: Callable[[str], object | None],
                 max_model_len: int | None, seed: int = 0) -> None:
        self.config = config
        self.proposer = proposer
        self.params_of = params_of  # request id -> its SamplingParams (None: unknown to the engine)
        self.max_model_len = max_model_len
        self.verifier = Verifier(seed)
        self.stats = SpecDecodeStats()
        self._adaptive: dict[int, _Adaptive] = {}

    # -- the scheduler's hook ------------------------------------------------------------------

    def propose(self, decodes: list[tuple[object, object]]) -> list[list[int]]:
        """This step's draft tokens for each decoding (request, sequence) ([]: decode one token as usual), from
        one call to the proposer for all of them (a draft model runs them as one batch)."""
        ks = [self._num_drafts(request, seq) for request, seq in decodes]
        asked = [(seq, k) for (_, seq), k in zip(decodes, ks) if k]
        proposals = iter(self.proposer.propose(asked) if asked else ())
        return [next(proposals) if k else [] for k in ks]

    def _num_drafts(self, request, seq) -> int:
        """How many tokens the sequence proposes this step: 0 if it is ineligible or backing off."""
        params = self.params_of(request.request_id)
        if params is None or not eligible(params, len(seq.output_token_ids)):
            return 0
        state = self._adaptive.get(seq.seq_id)
        if state is None:
            state = self._adaptive[seq.seq_id] = _Adaptive(self.config.num_speculative_tokens)
        if state.skip:
            state.skip -= 1
            return 0
        # The run, accepted whole, plus the bonus token must fit max_tokens and the context limit.
        k = min(state.k, request.max_tokens - len(seq.output_token_ids) - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        return max(k, 0)

    # -- after the forward pass ----------------------------------------------------------------

    def verify(self, rows, logits: torch.Tensor,
               spec_row: Callable[[object], SpecRow]) -> tuple[torch.Tensor, dict[int, Verified]]:
        """rows: the step's sampling sequences, in order; logits: their rows (1 + drafts each) then any
        prompt-logit rows. Returns logits with one row per sequence (a speculating one's last), as the
        sampler and beam selection expect, and each speculating sequence's verified tokens."""
        if not any(s.spec_token_ids for s in rows):
            return logits, {}
        compact, spec_index, spec = [], [], []
        start = 0
        for s in rows:
            n = 1 + len(s.spec_token_ids)
            if s.spec_token_ids:
                spec_index.extend(range(start, start + n))
                spec.append(s)
            compact.append(start + n - 1)
            start += n
        compact.extend(range(start, logits.shape[0]))  # prompt-logit rows
        index = torch.tensor(compact, device=logits.device)
        results = self.verifier(logits[torch.tensor(spec_index, device=logits.device)], [spec_row(s) for s in spec])
        out = {}
        for s, result in zip(spec, results):
            out[s.seq_id] = result
            self._adapt(s.seq_id, len(s.spec_token_ids), result.num_accepted)
        return logits[index], out

    def _adapt(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        st.num_emitted_tokens += num_accepted + 1
        state = self._adaptive.get(seq_id)
        if state is None:
            return
        if num_accepted == num_drafts:
            state.k = min(self.config.num_speculative_tokens, state.k + 2)
        else:
            state.k = max(1, num_accepted + 1)
        if num_accepted == 0:
            state.zero_streak += 1
            state.skip = min(2 ** state.zero_streak, MAX_SKIP_STEPS)
        else:
            state.zero_streak = 0

    def forget(self, live_seq_ids) -> None:
        """Drop the back-off state of sequences that ended (called now and then by the engine)."""
        live = set(live_seq_ids)
        for seq_id in [i for i in self._adaptive if i not in live]:
            del self._adaptive[seq_id]
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(live)


def eligible(params, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may be speculated (see the module's docstring)."""
    return not (params.use_beam_search or params.uses_penalties or params.uses_token_bias or params.bad_words
                or num_output_tokens < params.min_tokens)


class NgramSeqProposer:
    """The n-gram proposer over a sequence's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        from .ngram import NgramProposer
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, batch: list[tuple[object, int]]) -> list[list[int]]:
        """(sequence, k) pairs -> up to k tokens each."""
        return [self.ngram.propose(seq.token_ids, k) for seq, k in batch]
