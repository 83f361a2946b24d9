"""Output processing for LLMEngine: a step's samples recorded (log-probabilities, prompt log-probabilities),
text detokenized incrementally with stop strings applied, and RequestOutputs made."""
from __future__ import annotations

import time

import torch

from kvpage.core import FinishReason, Request

from .beam_search import beam_output
from .detokenizer import find_stop
from .outputs import CompletionOutput, Logprob, RequestOutput
from .request_state import RequestState, SampleState
from .sampler import SampleRow, SamplerOutput, TopLogprobs, rank_and_top


class OutputProcessing:
    """LLMEngine's side of a step's results once the scheduler took it (a mixin: state lives on the engine)."""

    def _record_samples(self, rows, sample_rows: list[SampleRow], result: SamplerOutput | None) -> None:
        """Log-probabilities and counters, only once the scheduler took the step (a failed step adds nothing)."""
        if result is None:
            return
        now = time.perf_counter()
        tops = result.top_logprobs or [None] * len(rows)
        for s, row, tokens, logprobs, top in zip(rows, sample_rows, result.tokens, result.logprobs, tops):
            state = self._states[s.request_id]
            if state.first_token_time is None:
                state.first_token_time = now
            for k, lp in enumerate(logprobs):
                sample = state.samples[row.sample_index + k]
                sample.cumulative_logprob += lp
                if top is not None and sample.logprobs is not None:
                    sample.logprobs.append(self._logprob_dict(tokens[k], lp, top[k]))
            self.num_generation_tokens += len(tokens)

    def _prompt_logprobs(self, scheduled, logits: torch.Tensor) -> list[tuple[RequestState, int, list]]:
        """(state, first position, one Logprob dict per position) for each sequence whose prompt logits
        came back: position p's row gives the log-probability of prompt token p + 1."""
        found, row = [], 0
        for s in scheduled:
            positions = s.prompt_logit_positions
            if not positions:
                continue
            chunk, row = logits[row:row + len(positions)], row + len(positions)
            if chunk.shape[0] != len(positions):
                raise RuntimeError(f"the runner returned {len(logits)} prompt-logit rows; the step asked for more"
                                   " (prompt_logit_positions: see kvpage.core.scheduler_output.logits_rows)")
            state = self._states.get(s.request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            targets = state.request.prompt_token_ids[positions.start + 1:positions.stop + 1]
            own, tops = rank_and_top(chunk.float().log_softmax(dim=-1), torch.tensor(targets, device=chunk.device),
                                     state.params.prompt_logprobs)
            entries = [self._logprob_dict(t, lp, top) for t, lp, top in zip(targets, own.tolist(), tops)]
            found.append((state, positions.start, entries))
        return found

    def _logprob_dict(self, token: int, logprob: float, top: TopLogprobs) -> dict[int, Logprob]:
        """vLLM's per-token dict: the sampled token first, then the top-k (one entry if it is among them)."""
        entries = {token: Logprob(logprob, top.rank, self._decoded(token))}
        for t, lp, rank in zip(top.token_ids, top.logprobs, top.ranks):
            if t not in entries:
                entries[t] = Logprob(lp, rank, self._decoded(t))
        return entries

    def _decoded(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def _process(self, rows) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        for s in rows:
            state = self._states.get(s.request_id)
            if state is None:
                continue
            if s.num_samples > 1:  # the scheduler just forked the samples, in order
                state.index_of = {seq.seq_id: i for i, seq in enumerate(state.request.seqs)}
            touched[s.request_id] = state
        outputs = []
        for rid, state in touched.items():
            if state.needs_detok:
                self._detokenize(state)
            finished = state.request.status.is_finished
            if finished and state.beam is not None:
                outputs.append(beam_output(state.beam, rid, state.prompt, state.request.prompt_token_ids,
                                           state.params, self.tokenizer, self._metrics(state)))
            elif finished or state.stream:
                outputs.append(self._make_output(state, finished))
            if finished:
                del self._states[rid]
        return outputs

    # -- text ----------------------------------------------------------------------------------

    def _detokenize(self, state: RequestState) -> None:
        params = state.params
        for seq, sample in zip(state.request.seqs, state.samples):
            for end in self._detok_ends(seq, sample):
                new = sample.detok.update(self.tokenizer, seq.token_ids[:end] if end < seq.num_tokens else seq.token_ids)
                # Before min_tokens output tokens exist a stop string ends nothing (vLLM's StopChecker).
                if not (new and params.stop) or end - seq.num_prompt_tokens < params.min_tokens:
                    continue
                span = find_stop(sample.detok.text, len(new), params.stop)
                if span is not None:
                    sample.detok.text = sample.detok.text[:span[1] if params.include_stop_str_in_output else span[0]]
                    sample.detok.stopped = True
                    self._finish_sequence(state.request, seq)
                    self._take_back_spec_run(seq, sample, end)  # [spec decode]
                    del seq.token_ids[end:]  # [spec decode] tokens a step accepted past the stop string
                    break

    def _detok_ends(self, seq, sample: SampleState):
        """The token counts to detokenize at: the sequence's own, or [spec decode] each one a step that
        appended several went through, so that a stop string ends the output where it would without."""
        if self.spec_decode is None or sample.detok.stopped:
            return (seq.num_tokens,)
        return range(min(seq.num_prompt_tokens + sample.detok.read_offset + 1, seq.num_tokens), seq.num_tokens + 1)

    def _finish_sequence(self, request: Request, seq) -> None:
        """Stop one sequence on a stop string: the scheduler only knows token-id stops."""
        self.scheduler.finish_sequences(request.request_id, [seq.seq_id], FinishReason.STOP)

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        request = state.request
        completions = []
        for i, (seq, sample) in enumerate(zip(request.seqs, state.samples)):
            token_ids = seq.output_token_ids
            reason = request.finish_reasons.get(seq.seq_id)
            if sample.detok is not None:
                if finished:
                    sample.detok.flush(self.tokenizer, seq.token_ids)
                text = sample.detok.text
            elif self.tokenizer is not None and finished:
                text = self.tokenizer.decode(token_ids, skip_special_tokens=state.params.skip_special_tokens)
            else:
                text = ""
            completions.append(CompletionOutput(i, text, list(token_ids), reason.value if reason else None,
                                                sample.cumulative_logprob,
                                                list(sample.logprobs) if sample.logprobs is not None else None))
        metrics = self._metrics(state)
        prompt_logprobs = list(state.prompt_logprobs) if state.prompt_logprobs is not None else None
        cached = request.num_cached_tokens if request.num_cached_tokens >= 0 else None
        return RequestOutput(request.request_id, state.prompt, request.prompt_token_ids, completions,
                             finished, metrics, prompt_logprobs, cached)

    @staticmethod
    def _metrics(state: RequestState) -> dict:
        metrics = {"arrival_time": state.arrival_time, "first_token_time": state.first_token_time}
        if state.first_token_time is not None:
            metrics["ttft"] = state.first_token_time - state.arrival_time
        return metrics
