"""A request as the scheduler sees it: its sequences, stop conditions and where it is in its life."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sequence import Sequence, SequenceGroup


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued: no blocks (new, or preempted by recompute)
    RUNNING = "running"  # holds device blocks; scheduled whenever budget and blocks allow
    SWAPPED = "swapped"  # preempted by swap: its blocks sit in the host pool
    FINISHED_STOPPED = "stop"  # every sequence hit eos or a stop token id
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED})


class FinishReason(str, enum.Enum):
    """Why one sequence ended; the string values are the ones CompletionOutput.finish_reason reports."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """One prompt with n samples. Wraps a SequenceGroup instead of extending Sequence, so the block
    manager keeps seeing plain sequences.

    A request with n > 1 starts as a single sequence: the prompt is computed once, and the step that
    finishes it samples n tokens, forking the children onto the prompt's blocks.
    """

    request_id: str
    group: SequenceGroup
    max_tokens: int
    n: int = 1
    # > 1: beam search. The engine's beam selection picks the next beams after each step the beams
    # all sample in (Scheduler.update_from_output's `beams`), and decides when the request ends.
    beam_width: int = 1
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    arrival_order: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # First admission only: a request resumed after preemption keeps its place (see policies).
    admit_order: int = -1
    finish_reasons: dict[int, FinishReason] = field(default_factory=dict)
    # prompt_logprobs: the runner returns the logits of prompt positions [0, num_prompt_tokens - 1) once
    # each; num_prompt_logits_done counts the leading ones a taken step has delivered.
    wants_prompt_logits: bool = False
    num_prompt_logits_done: int = 0
    num_cached_tokens: int = -1  # prompt tokens its first admission read from the prefix cache (-1: not yet)
    num_preemptions: int = 0
    # Steps (schedule() calls) at arrival, first scheduled token and finish, for latency accounting.
    arrival_step: int = 0
    first_scheduled_step: int = -1
    finished_step: int = -1

    @property
    def seqs(self) -> list[Sequence]:
        return self.group.seqs

    @property
    def prompt_token_ids(self) -> list[int]:
        seq = self.seqs[0]
        return seq.token_ids[:seq.num_prompt_tokens]

    @property
    def num_prompt_tokens(self) -> int:
        return self.seqs[0].num_prompt_tokens

    @property
    def prompt_logits_pending(self) -> bool:
        """Prompt logits still owed: until then the prompt is computed, never taken from the prefix cache."""
        return self.wants_prompt_logits and self.num_prompt_logits_done < self.num_prompt_tokens - 1

    def prompt_logit_positions(self, start: int, end: int) -> range:
        """Of the positions [start, end) a step computes, those whose logits prompt_logprobs still needs."""
        if not self.wants_prompt_logits:
            return range(0)
        return range(max(start, self.num_prompt_logits_done), max(start, min(end, self.num_prompt_tokens - 1)))

    def live_seqs(self) -> list[Sequence]:
        return [seq for seq in self.group.seqs if seq.seq_id not in self.finish_reasons]

    @property
    def num_computed_tokens(self) -> int:
        return sum(seq.num_computed_tokens for seq in self.live_seqs())

    @property
    def num_tokens_left(self) -> int:
        """Output tokens still to generate, at most, over the live sequences."""
        return sum(self.max_tokens - len(seq.output_token_ids) for seq in self.live_seqs())

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    def holds_back_last_token(self, seq: Sequence) -> bool:
        """A beam that already has output tokens leaves its last token to a decode step: the beams'
        logits must all come back in one step for the selection, also after a recompute."""
        return self.beam_width > 1 and seq.num_tokens > seq.num_prompt_tokens

    @property
    def needs_fork(self) -> bool:
        """Whether the step that completes the prompt must sample n tokens and fork."""
        return self.n > 1 and len(self.group.seqs) == 1

    def stop_reason(self, seq: Sequence, max_model_len: int | None) -> FinishReason | None:
        """Stop conditions on token ids; string stop sequences are the engine's job."""
        token = seq.last_token_id
        if not self.ignore_eos and token == self.eos_token_id:
            return FinishReason.STOP
        if token in self.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= self.max_tokens:
            return FinishReason.LENGTH
        if max_model_len is not None and seq.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def final_status(self) -> RequestStatus:
        """Once every sequence has ended: stopped if any stopped by a token, else length."""
        reasons = set(self.finish_reasons.values())
        if FinishReason.ABORT in reasons:
            return RequestStatus.FINISHED_ABORTED
        if FinishReason.STOP in reasons:
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH
