"""[spec decode] Speculative decoding in the scheduler (the Scheduler's SpecDecodeSteps; proposals come from
kvpage.spec_decode through `spec_proposer`): a decode's proposed tokens join its plan as extra query tokens in
lookahead slots where they fit, and after the step its verified tokens are committed up to the first stop.
Only accepted tokens are ever marked computed, so draft tokens never reach the prefix cache's hashes."""
from __future__ import annotations

from .request import Request
from .scheduler_output import ScheduledSequence
from .scheduler_planner import Budget
from .sequence import Sequence


class SpecDecodeSteps:
    """Scheduler mixin. Reads `spec_proposer` (a list of decoding (request, sequence) pairs -> each one's
    proposed tokens), `running`, `bm` and `config.max_model_len`; writes each decoding sequence's
    `spec_token_ids` (rewritten by every plan: recovery does not clear them)."""

    def _spec_proposals(self, budget: Budget) -> dict[int, list[int]]:
        """[spec decode] The proposed tokens of every running decode the step has room for, by seq_id, from one
        call to the proposer (a draft model proposes for all of them in one batch)."""
        if self.spec_proposer is None:
            return {}
        decodes = [(request, seq) for request in self.running for seq in self._decode_seqs(request)][:budget.seqs]
        return {seq.seq_id: tokens for (_, seq), tokens in zip(decodes, self.spec_proposer(decodes))}

    def _spec_plan(self, seqs: list[Sequence], proposals: dict[int, list[int]],
                   budget: Budget) -> list[tuple[Sequence, int]]:
        """[spec decode] Each decode's tokens: 1, plus its proposed tokens where the proposer gave some and
        they fit the budget and the free blocks as they are (lookahead never preempts anyone)."""
        if self.spec_proposer is None:
            return [(seq, 1) for seq in seqs]
        for seq in seqs:
            seq.spec_token_ids = proposals.get(seq.seq_id, [])
        plan = [(seq, 1 + len(seq.spec_token_ids)) for seq in seqs]
        if len(plan) != sum(n for _, n in plan) and not (
                budget.fits(sum(n for _, n in plan), len(plan))
                and self.bm.num_blocks_to_append(plan) <= self.bm.num_free_blocks):
            for seq in seqs:
                seq.spec_token_ids = []
            plan = [(seq, 1) for seq in seqs]
        return plan

    def _commit_spec(self, request: Request, seq: Sequence, tokens: list[int]) -> None:
        """[spec decode] A speculating decode's verified tokens (accepted drafts, then the target's own),
        appended one at a time up to the first stop (eos, a stop id, max_tokens, the context limit: the rest
        is dropped). Computed: every appended token but the last, whose K/V the step wrote from an accepted
        token; the rejected drafts' slots are past that count and the next step overwrites them."""
        seq.spec_token_ids = []
        reason = None
        for token in tokens:
            seq.append_token(token)
            reason = request.stop_reason(seq, self.config.max_model_len)
            if reason is not None:
                break
        self.bm.mark_computed(seq, seq.num_tokens - 1 - seq.num_computed_tokens)
        if reason is not None:
            request.finish_reasons[seq.seq_id] = reason
            self._free_finished(seq)


def check_spec_tokens(s: ScheduledSequence, tokens: list[int]) -> list[int]:
    """[spec decode] A speculating decode's tokens: a run of its proposed tokens (only those have the K/V the
    step wrote), then one more."""
    spec = s.spec_token_ids
    if not 1 <= len(tokens) <= len(spec) + 1 or tokens[:-1] != spec[:len(tokens) - 1] or not all(
            isinstance(t, int) and t >= 0 for t in tokens):
        raise ValueError(f"sampled[{s.seq_id}] must be a prefix of the proposed tokens {spec} then one more"
                         f" token id, got {tokens!r}")
    return tokens
