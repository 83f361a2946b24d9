"""Beam search on the paged cache: an engine-level loop over the runner, beams forked by reference.

Each step the k running beams decode one token together in one forward pass; choosing the next
beams forks their parents' block tables (BlockManager.fork: shared blocks, reference counts), and the
one block a child then writes is copied first (append_slots' copy-on-write). The selection rules
are transformers' `_beam_search` (early_stopping=False): keep the 2k best continuations; those that
end (eos, stop id, length) among the first k enter the finished list scored sum_logprob /
generated_len ** length_penalty; the best k that do not end keep running; stop once no running
beam can beat the worst finished one (HF's heuristic), so the output matches HF token for token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpage.core import Sequence
from kvpage.core.interrupts import deferred_interrupts
from kvpage.core.block_table import num_blocks_for
from kvpage.core.scheduler_config import check_max_model_len

from .llm_engine import cache_salt_keys
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

_NEG = -1.0e9  # HF's "impossible" score
# Powers of the length up to e**700 (and down to e**-700) are plain floats; past that, log space.
_MAX_LOG = 700.0


def length_normalised(logprob: float, length: int, length_penalty: float) -> float:
    """logprob / length ** length_penalty (HF's beam score) for every finite length_penalty.

    Where the power fits a float this is HF's own arithmetic, so beams rank exactly as HF ranks them;
    where it would overflow (OverflowError) or underflow to 0 (ZeroDivisionError), the quotient is
    taken in log space and saturates at +-e**700 instead.
    """
    log_power = length_penalty * math.log(length)
    if abs(log_power) < _MAX_LOG:
        return logprob / length ** length_penalty
    if logprob == 0.0:
        return logprob
    return math.copysign(math.exp(min(math.log(abs(logprob)) - log_power, _MAX_LOG)), logprob)


@dataclass
class _Hypothesis:
    tokens: list[int]  # output tokens
    score: float  # length-penalised, as HF ranks them
    logprob: float  # the raw sum


class _BeamRun:
    def __init__(self, llm, prompt_ids: list[int], params: SamplingParams, extra_keys: tuple = ()) -> None:
        from kvpage.model import ModelInput, SequenceInput

        self._ModelInput, self._SequenceInput = ModelInput, SequenceInput
        self.engine, self.runner = llm.llm_engine, llm.runner
        self.bm = self.engine.block_manager
        self.k, self.params, self.prompt_len = params.beam_width, params, len(prompt_ids)
        self.max_len = check_max_model_len(self.prompt_len, params.max_tokens, self.engine.config.max_model_len)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.engine.config.eos_token_ids))
        self.stops = stops
        self.keep = max(2, 1 + len(stops)) * self.k
        need = self.k * num_blocks_for(self.max_len, self.bm.block_size)
        if need > self.bm.num_free_blocks:
            raise ValueError(f"beam search of beam_width={self.k} over {self.max_len} tokens needs {need} KV blocks;"
                             f" {self.bm.num_free_blocks} are free (num_kv_blocks)")
        self._next_id = -1  # negative seq ids: never clash with the scheduler's
        self.extra_keys = extra_keys  # a cache salt: the prefix cache shares blocks only within it
        # Sequences that may hold blocks (running beams, children being forked): freed however the run ends.
        self._holders: list[Sequence] = []
        self.running = [self._new_seq(prompt_ids)]
        self.scores = [0.0]
        self.finished: list[_Hypothesis] = []
        self.unsatisfied = True

    def _new_seq(self, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_id, list(token_ids), self.extra_keys)
        self._next_id -= 1
        self._holders.append(seq)
        return seq

    def run(self) -> list[_Hypothesis]:
        try:
            logits = self._prefill()
            cur_len = self.prompt_len
            while True:
                hits = self._select(logits, cur_len)
                cur_len += 1
                self._update_heuristic(cur_len)
                if not self.unsatisfied or all(hits):
                    break
                logits = self._decode()
            with deferred_interrupts():
                for seq in self._holders:
                    self.bm.free(seq)
        except BaseException:
            # Cut short anywhere (inside a fork or a free included): the beams' blocks are dropped by
            # rebuilding the pools from the tables the scheduler knows, which hold no beam.
            with deferred_interrupts():
                self.engine.scheduler.rebuild_block_accounting()
            raise
        return self.finished

    def _execute(self, seqs: list[Sequence], counts: list[int], copies) -> torch.Tensor:
        batch = self._ModelInput(blocks_to_copy=copies)
        for seq, n in zip(seqs, counts):
            start = seq.num_computed_tokens
            batch.scheduled.append(self._SequenceInput(seq.token_ids[start:start + n], start, list(seq.block_table),
                                                       self.bm.slot_mapping(seq, start, start + n)))
        logits = self.runner.execute(batch)
        for seq, n in zip(seqs, counts):
            self.bm.mark_computed(seq, n)
        return logits

    def _prefill(self) -> torch.Tensor:
        seq = self.running[0]
        self.bm.allocate(seq)
        return self._execute([seq], [seq.num_tokens - seq.num_computed_tokens], [])

    def _decode(self) -> torch.Tensor:
        copies = []
        for seq in self.running:
            copies += self.bm.append_slots(seq, 1)
        return self._execute(self.running, [1] * len(self.running), copies)

    def _select(self, logits: torch.Tensor, cur_len: int) -> list[bool]:
        """One HF iteration: top continuations, the next running beams, the finished list."""
        logprobs = logits.float().log_softmax(dim=-1)
        vocab = logprobs.shape[1]
        # Before the first decode every beam is the prompt: only beam 0 counts (HF scores the others -1e9).
        acc = (logprobs + torch.tensor(self.scores).unsqueeze(1)).reshape(-1)
        top_scores, top_idx = torch.topk(acc, k=min(self.keep, acc.numel()))
        cands = [(s, i // vocab, i % vocab) for s, i in zip(top_scores.tolist(), top_idx.tolist())]
        hits = [tok in self.stops or cur_len + 1 >= self.max_len for _, _, tok in cands]
        self._update_finished(cands, hits, cur_len)
        self._next_running(cands, hits)
        return hits

    def _next_running(self, cands, hits) -> None:
        masked = torch.tensor([s + (_NEG if h else 0.0) for (s, _, _), h in zip(cands, hits)])
        order = torch.topk(masked, k=self.k).indices.tolist()
        old = self.running
        new, scores = [], []
        for j in order:
            _, beam, tok = cands[j]
            child = self._new_seq(old[beam].token_ids)
            self.bm.fork(old[beam], child)
            child.append_token(tok)
            new.append(child)
            scores.append(masked[j].item())
        for seq in old:
            self.bm.free(seq)
        self.running, self.scores, self._holders = new, scores, list(new)

    def _update_finished(self, cands, hits, cur_len: int) -> None:
        """The k best of the finished list and the candidates that end among the first k. HF masks the
        others (and its list's empty slots) with -1e9 and takes a top-k; leaving them out picks the
        same beams, and a real hypothesis scoring below -1e9 (a large negative length_penalty) stays."""
        if not self.unsatisfied:
            return
        length = cur_len + 1 - self.prompt_len
        merged = list(self.finished)
        for (score, beam, tok), hit in zip(cands[:self.k], hits):
            if hit:
                tokens = self.running[beam].token_ids[self.prompt_len:] + [tok]
                merged.append(_Hypothesis(tokens, length_normalised(score, length, self.params.length_penalty), score))
        # HF's top-k over float32 scores: the same ties, the same order.
        order = torch.topk(torch.tensor([h.score for h in merged]), k=min(self.k, len(merged))).indices.tolist()
        self.finished = [merged[i] for i in order]

    def _update_heuristic(self, cur_len: int) -> None:
        if len(self.finished) < self.k:  # an open slot: any running beam can still get in
            return
        best = length_normalised(self.scores[0], cur_len - self.prompt_len, self.params.length_penalty)
        self.unsatisfied = self.unsatisfied and best > min(h.score for h in self.finished)


def check_beam_request(engine, prompt, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> tuple[str | None, list[int]]:
    """(text, token ids) of a beam request, or ValueError if it could never run: the checks
    LLMEngine.add_request makes, done before LLM.generate runs anything."""
    params.validate()
    text, token_ids = engine.request_prompt(prompt, prompt_token_ids, params)
    total = check_max_model_len(len(token_ids), params.max_tokens, engine.config.max_model_len)
    bm = engine.block_manager
    need = params.beam_width * num_blocks_for(total, bm.block_size)
    if need > bm.device.num_blocks:  # the run happens on the idle engine: every block may be free
        raise ValueError(f"beam search of beam_width={params.beam_width} over {total} tokens needs {need} KV"
                         f" blocks of {bm.block_size} tokens; the cache has {bm.device.num_blocks} (num_kv_blocks)")
    return text, token_ids


def beam_search(llm, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                request_id: str, cache_salt: str | None = None) -> RequestOutput:
    """Run one request's beam search to completion; its beam_width best beams, best first."""
    if llm.llm_engine.has_unfinished_requests():
        raise RuntimeError("beam search runs on an idle engine (LLM.generate runs it after the other requests)")
    hyps = _BeamRun(llm, prompt_ids, params, cache_salt_keys(cache_salt)).run()
    tokenizer = llm.tokenizer
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(llm.llm_engine.config.eos_token_ids))
    skip = params.skip_special_tokens
    outputs = [CompletionOutput(i, tokenizer.decode(h.tokens, skip_special_tokens=skip) if tokenizer else "",
                                h.tokens, "stop" if h.tokens and h.tokens[-1] in stops else "length", h.logprob)
               for i, h in enumerate(hyps)]
    return RequestOutput(request_id, prompt, list(prompt_ids), outputs, finished=True)
