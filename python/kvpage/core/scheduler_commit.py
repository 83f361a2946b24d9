"""After the step (the Scheduler's StepCommit): `update_from_output` checks what the runner and sampler
report, then records it in one commit section: tokens computed, sampled tokens appended (n > 1 samples
forked off the completed prompt), stops, beam search's selection, speculative decodes' verified tokens.
A failure inside the commit is a bug (its inputs were checked first): recover() aborts the step's requests."""
from __future__ import annotations

from typing import Mapping

from .interrupts import deferred_interrupts
from .request import FinishReason, Request
from .scheduler_output import BeamStep, ScheduledSequence, SchedulerOutput
from .scheduler_spec import check_spec_tokens
from .sequence import Sequence


class StepCommit:
    """Scheduler mixin. Reads the open step (`pending`, `_open`) and `requests`; appends tokens to the
    sequences, registers forks in `_seqs`, frees finished sequences' blocks in `bm`."""

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[int, int | list[int]],
                           beams: Mapping[str, BeamStep] | None = None) -> list[Request]:
        """Record the step `out` described: its tokens are computed, and each sampling sequence gets
        its sampled token(s) (a list of num_samples where that is > 1); each beam request whose beams
        sampled gets its selection in `beams` instead (by request id). Returns requests that finished."""
        if out is not self.pending:
            raise ValueError("update_from_output expects the SchedulerOutput of the latest schedule()")
        # Aborted after schedule(): its blocks are already free, and nothing it sampled matters.
        live = [(s, self.requests[s.request_id]) for s in out.scheduled
                if s.request_id in self.requests and s.seq_id not in self.requests[s.request_id].finish_reasons]
        # Check all first.
        tokens = {s.seq_id: self._sampled_tokens(s, sampled) for s, r in live if s.do_sample and not r.is_beam_search}
        selections = self._beam_steps(live, beams or {})
        try:
            with deferred_interrupts():
                self._open.committing = True
                finished = self._commit(live, tokens, selections)
                self._open = None
        except BaseException:
            self.recover()  # finishes the step's requests: their tokens may be half-appended
            raise
        if self.kv_connector is not None:  # [kv tier] the blocks this step filled are now worth keeping
            self.kv_connector.on_step_computed(self.bm)
        return finished

    def _commit(self, live, tokens: dict[int, list[int]], selections: list[tuple[Request, BeamStep]]) -> list[Request]:
        finished = []
        for s, request in live:
            seq = self._seqs[s.seq_id]
            if s.spec_token_ids:  # [spec decode] computed: the first token and the accepted drafts only
                self._commit_spec(request, seq, tokens[s.seq_id])
                if not request.live_seqs():
                    self._finish_request(request)
                    finished.append(request)
                continue
            self.bm.mark_computed(seq, s.num_scheduled_tokens)
            if s.prompt_logit_positions:
                request.num_prompt_logits_done = max(request.num_prompt_logits_done, s.prompt_logit_positions.stop)
            if s.do_sample and not request.is_beam_search:
                self._append_sampled(request, seq, tokens[s.seq_id])
                if not request.live_seqs():
                    self._finish_request(request)
                    finished.append(request)
        for request, step in selections:  # after every beam of the step is marked computed
            if self._apply_beam_step(request, step):
                finished.append(request)
        return finished

    def _beam_steps(self, live, beams: Mapping[str, BeamStep]) -> list[tuple[Request, BeamStep]]:
        """The selection of each beam request whose beams sampled this step, checked against them."""
        sampling: dict[str, tuple[Request, set[int]]] = {}
        for s, request in live:
            if s.do_sample and request.is_beam_search:
                sampling.setdefault(s.request_id, (request, set()))[1].add(s.seq_id)
        selections = []
        for rid, (request, seq_ids) in sampling.items():
            step = beams.get(rid)
            if not isinstance(step, BeamStep):
                raise ValueError(f"beams has no BeamStep for beam request {rid!r}, got {step!r}")
            if seq_ids != {seq.seq_id for seq in request.live_seqs()}:
                raise ValueError(f"beam request {rid!r}: its beams did not all sample in this step")
            if step.finish_reason is None:
                if not 1 <= len(step.children) <= request.beam_width or not all(
                        p in seq_ids and isinstance(t, int) and t >= 0 for p, t in step.children):
                    raise ValueError(f"beams[{rid!r}]: 1 to {request.beam_width} children (parent seq_id among"
                                     f" {sorted(seq_ids)}, token id >= 0) or a finish_reason, got {step!r}")
            elif step.finish_reason not in (FinishReason.STOP.value, FinishReason.LENGTH.value):
                raise ValueError(f"beams[{rid!r}].finish_reason must be 'stop' or 'length', got {step.finish_reason!r}")
            selections.append((request, step))
        return selections

    def _apply_beam_step(self, request: Request, step: BeamStep) -> bool:
        """Fork the next beams from their parents (blocks shared: copy-on-write when they write), free
        the old ones; or end the request. True if it finished."""
        old = request.live_seqs()
        if step.finish_reason is not None:
            for seq in old:
                request.finish_reasons[seq.seq_id] = FinishReason(step.finish_reason)
            self._finish_request(request)
            return True
        parents = {seq.seq_id: seq for seq in old}
        children = []
        for parent_id, token in step.children:
            child = self._fork(parents[parent_id])
            child.append_token(token)
            children.append(child)
        for seq in old:
            self.bm.free(seq)
            del self._seqs[seq.seq_id]
        request.group.seqs[:] = children
        return False

    @staticmethod
    def _sampled_tokens(s: ScheduledSequence, sampled: Mapping[int, int | list[int]]) -> list[int]:
        if s.seq_id not in sampled:
            raise ValueError(f"sampled has no token for seq {s.seq_id} (request {s.request_id!r})")
        tokens = sampled[s.seq_id]
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        if s.spec_token_ids:  # [spec decode]
            return check_spec_tokens(s, tokens)
        if len(tokens) != s.num_samples or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise ValueError(f"sampled[{s.seq_id}] must be {s.num_samples} non-negative int token id(s),"
                             f" got {sampled[s.seq_id]!r}")
        return tokens

    def _append_sampled(self, request: Request, seq: Sequence, tokens: list[int]) -> None:
        targets = [seq]
        for _ in tokens[1:]:  # the prompt just completed: fork the other samples onto its blocks
            child = self._fork(seq)
            request.group.seqs.append(child)
            targets.append(child)
        for target, token in zip(targets, tokens):
            target.append_token(token)
            reason = request.stop_reason(target, self.config.max_model_len)
            if reason is not None:
                request.finish_reasons[target.seq_id] = reason
                self._free_finished(target)

    def _fork(self, parent: Sequence) -> Sequence:
        """A new registered sequence sharing the parent's tokens and blocks (n > 1 samples, beams)."""
        child = parent.fork(self._next_seq_id)
        self._next_seq_id += 1
        self.bm.fork(parent, child)
        self._seqs[child.seq_id] = child
        return child
