"""LLMEngine: requests in, one scheduler step -> one forward pass -> sampled tokens, RequestOutputs out.

The engine owns no KV bookkeeping: the scheduler (kvpage.core) decides each step and the executor
(kvpage.engine.executor_base.Executor: a ModelRunner, or the tensor-parallel driver) carries it out. What is
left here is the per-request view: sampling parameters, log-probabilities, text and stop strings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch

from kvpage.core import BeamStep, FinishReason, Scheduler, SchedulerOutput
from kvpage.core.block_manager import CacheConfig
from kvpage.core.interrupts import deferred_interrupts
from kvpage.core.kv_cache_groups import KVCacheLayout
from kvpage.kv_offload.connector_api import KVLoadError

from .arg_utils import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from .beam_search import BeamSearchState, select_beams
from .cost_measurement import cost_model_stats, measured_cost_model, record_step_time
from .executor_base import Executor
from .output_processing import OutputProcessing
from .outputs import RequestOutput
from .request_intake import RequestIntake
from .request_state import RequestState, SampleState
from .sampler import Sampler, SampleRow, SamplerOutput
from .sampling_params import SamplingParams


@dataclass
class EngineConfig:
    num_kv_blocks: int
    block_size: int = 16
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    preemption_mode: str | None = None
    eos_token_ids: tuple[int, ...] = ()  # the first is the scheduler's eos; the rest stop like it
    seed: int = 0
    max_logprobs: int = 20  # vLLM's cap on logprobs / prompt_logprobs; -1: the whole vocabulary
    # The KV-cache groups (kvpage.core.KVCacheLayout; the runner's): the block manager keeps one block table
    # per group. None: one group of all layers.
    kv_cache_layout: KVCacheLayout | None = None
    # [kv tier] a KV offload tier behind the prefix cache (kvpage.kv_offload.attach_offloading): a disk tier under
    # kv_offloading_dir, else host memory; kv_offloading_size in GiB. Both None: no tier.
    kv_offloading_size: float | None = None
    kv_offloading_dir: str | None = None


class LLMEngine(RequestIntake, OutputProcessing):
    """add_request and its checks: RequestIntake; a step's records, text and outputs: OutputProcessing."""

    def __init__(self, runner: Executor, tokenizer, config: EngineConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.cost_model = measured_cost_model(runner, config.block_size)  # swap vs recompute, priced here
        cache = CacheConfig(config.num_kv_blocks, config.block_size, config.num_host_blocks,
                            config.enable_prefix_caching, config.kv_cache_layout)
        self.scheduler = Scheduler(cache, max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                                   preemption_mode=config.preemption_mode, cost_model=self.cost_model)
        self.sampler = Sampler(config.seed)
        self.kv_connector = None
        if config.kv_offloading_size is not None or config.kv_offloading_dir is not None:  # [kv tier]
            from kvpage.kv_offload import attach_offloading
            self.runner, self.kv_connector = attach_offloading(runner, tokenizer, self.scheduler.bm, self.scheduler,
                                                               config.kv_offloading_size, config.kv_offloading_dir)
        self._states: dict[str, RequestState] = {}
        self.spec_decode = None  # [spec decode] kvpage.spec_decode.SpecDecode: see attach_spec_decode
        self._token_text: dict[int, str] = {}  # decoded_token of logprobs, one tokenizer call per id
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._idle_steps = 0
        # After step() raised: the requests the failed step scheduled (requeued, or finished where recording
        # the step failed), or None where it failed before a step was formed.
        self.failed_request_ids: list[str] | None = None

    @property
    def block_manager(self):
        """The scheduler's block manager, for tests and the KV tier's wiring; the engine never calls it."""
        return self.scheduler.bm

    # -- requests (add_request: RequestIntake) -------------------------------------------------

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            with deferred_interrupts():
                if self._states.pop(rid, None) is not None:
                    self.scheduler.finish_requests(rid, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of streaming requests that advanced, and of every
        request that finished (its final output). If it raises, the scheduler has recovered the step
        (Scheduler.recover: its requests requeued, or finished where recording it failed), the engine
        goes on, and failed_request_ids names the step's requests."""
        self.settle()
        out = None
        try:
            out = self.scheduler.schedule()
            self.num_steps += 1
            rows = [s for s in out.scheduled if s.do_sample]
            keep = [i for i, s in enumerate(rows) if self._states[s.request_id].beam is None]  # not beam search
            plain = [rows[i] for i in keep]
            sample_rows, result, prompt_logprobs, beams, spec = [], None, [], {}, {}
            self._check_progress(out)
            if not out.is_empty:
                started = time.perf_counter()
                logits = self.runner.execute(out)  # the sampled rows, then any prompt_logprobs rows
                if self.spec_decode is not None:  # [spec decode] verified here, sampled no further
                    logits, spec = self._verify_spec(rows, logits)
                    keep = [i for i in keep if rows[i].seq_id not in spec]
                    plain = [rows[i] for i in keep]
                sample_rows = [self._sample_row(self._states[s.request_id], s) for s in plain]
                result = self.sampler(_rows_of(logits, keep), sample_rows) if plain else None
                beams = self._select_beams(rows, logits)
                # Sampling read tokens back, so the device has finished the step (a CPU's always has).
                record_step_time(self.cost_model, out, started, finished=bool(rows) or logits.device.type == "cpu")
                prompt_logprobs = self._prompt_logprobs(out.scheduled, logits[len(rows):])
            sampled = self._sampled(plain, result) | {seq_id: v.tokens for seq_id, v in spec.items()}
            # The commit: the scheduler's and the engine's records of the step land together.
            with deferred_interrupts():
                self.scheduler.update_from_output(out, sampled, {rid: step for rid, (_, step) in beams.items()})
                self._record_samples(plain, sample_rows, result)
                self._record_beams(beams)
                self._record_spec(rows, spec)
                for state, position, entries in prompt_logprobs:  # in order: no position comes twice
                    state.prompt_logprobs[position + 1:] = entries
                outputs = self._process(rows)
            return outputs
        except KVLoadError as error:  # [kv tier] before the forward pass: the step is recomputed, nothing is lost
            self._recompute_failed_load(error)
            return []
        except BaseException:
            self._fail_step(out)
            raise

    def settle(self) -> None:
        """End a failed step whose clean-up an interrupt cut short (a no-op otherwise)."""
        if self.scheduler.recover() is not None:
            self._drop_finished()

    def _fail_step(self, out: SchedulerOutput | None) -> None:
        with deferred_interrupts():
            if out is None:  # an interrupt may land after schedule() returned, before out was bound
                out = self.scheduler.pending
            if self.scheduler.recover() is None and out is not None:
                # The scheduler had recorded the step; the engine's own records of it failed part way.
                self.scheduler.finish_requests([s.request_id for s in out.scheduled], FinishReason.ABORT)
            self.failed_request_ids = None if out is None else sorted({s.request_id for s in out.scheduled})
            self._drop_finished()

    def _recompute_failed_load(self, error: KVLoadError) -> None:
        """[kv tier] A step whose KV tier load failed (KVLoadError: a disk tier's payload gone or corrupt when
        read into its blocks, before the forward pass): its requests are requeued as by recompute preemption
        (Scheduler.recover); the failed entries are misses from then on, so the next schedule recomputes them,
        and nothing of the step counts as a tier or cache hit (recomputed tokens are not cached ones)."""
        with deferred_interrupts():
            self.kv_connector.on_load_failed(error.block_ids)
            self.scheduler.undo_external_hits()
            self.scheduler.recover()

    def _drop_finished(self) -> None:
        """Forget the requests a failed step left finished without the engine reporting them."""
        for rid in [rid for rid, state in self._states.items() if state.request.status.is_finished]:
            del self._states[rid]

    # -- [spec decode] (kvpage.spec_decode) ---------------------------------------------------------

    def attach_spec_decode(self, speculative_config) -> None:
        """Speculative decoding per speculative_config (vLLM's; None: none): the scheduler asks it for each
        decode's proposed tokens, and step() verifies them against the target's logits."""
        from kvpage.spec_decode import build_spec_decode
        self.spec_decode = build_spec_decode(speculative_config, self._spec_params, self.runner.vocab_size,
                                             self.config.max_model_len, self.config.seed)
        self.scheduler.spec_proposer = None if self.spec_decode is None else self.spec_decode.propose

    def _spec_params(self, request_id: str) -> SamplingParams | None:
        state = self._states.get(request_id)
        return None if state is None else state.params

    def _verify_spec(self, rows, logits: torch.Tensor):
        """One logits row per sampling sequence (a speculating one's k + 1 collapsed to its last), and each
        speculating sequence's verified tokens by seq_id."""
        from kvpage.spec_decode.verify import SpecRow

        def spec_row(s) -> SpecRow:
            state = self._states[s.request_id]
            return SpecRow(s.spec_token_ids, state.params, state.index_of.get(s.seq_id, 0),
                           s.start + 1 - state.request.num_prompt_tokens)
        return self.spec_decode.verify(rows, logits, spec_row)

    def _record_spec(self, rows, spec: dict) -> None:
        """What _record_samples does for plain rows, for the speculating ones (their logprobs, counters)."""
        if not spec:
            return
        now = time.perf_counter()
        for s in rows:
            verified = spec.get(s.seq_id)
            state = self._states.get(s.request_id)
            if verified is None or state is None:
                continue
            if state.first_token_time is None:
                state.first_token_time = now
            index = state.index_of.get(s.seq_id, 0)
            seq = state.request.seqs[index]
            kept = max(0, seq.num_tokens - 1 - s.start)  # appended by the scheduler, up to the first stop
            self._add_spec_run(state.samples[index], seq.num_tokens, verified, kept)
            self.num_generation_tokens += kept
        if self.num_steps % 256 == 0:
            self.spec_decode.forget(seq.seq_id for seq in self.scheduler.sequences())

    def _add_spec_run(self, sample: SampleState, num_tokens: int, verified, kept: int) -> None:
        """[spec decode] The log-probabilities of the run's first `kept` tokens (those the sequence took), added
        one token at a time as decoding adds them, so that the sums agree."""
        sample.spec_run = (num_tokens, sample.cumulative_logprob, verified.logprobs[:kept])
        for k in range(kept):
            sample.cumulative_logprob += verified.logprobs[k]
            if sample.logprobs is not None:
                sample.logprobs.append(self._logprob_dict(verified.tokens[k], verified.logprobs[k],
                                                          verified.top_logprobs[k]))

    @staticmethod
    def _take_back_spec_run(seq, sample: SampleState, end: int) -> None:
        """[spec decode] A stop string at token count `end`, inside the last speculative step's run: the
        run's tokens past it leave the output's log-probabilities (the sum is redone, not subtracted from)."""
        if sample.spec_run is None or sample.spec_run[0] != seq.num_tokens or end >= seq.num_tokens:
            return
        _, cumulative, logprobs = sample.spec_run
        cut = min(seq.num_tokens - end, len(logprobs))
        for lp in logprobs[:len(logprobs) - cut]:
            cumulative += lp
        sample.cumulative_logprob = cumulative
        if sample.logprobs is not None:
            del sample.logprobs[len(sample.logprobs) - cut:]
        sample.spec_run = None

    def _check_progress(self, out: SchedulerOutput) -> None:
        self._idle_steps = 0 if not out.is_empty else self._idle_steps + 1
        if self._idle_steps > 2 and self.has_unfinished_requests():
            raise RuntimeError("the scheduler made no progress in 3 steps with requests pending"
                               f" ({self.scheduler.stats()}); this is a bug")

    def _select_beams(self, rows, logits: torch.Tensor) -> dict[str, tuple[BeamSearchState, BeamStep]]:
        """Each beam request whose beams sampled: its next state and the scheduler's BeamStep."""
        row_of = {s.seq_id: i for i, s in enumerate(rows)}
        searches = {}
        for rid in dict.fromkeys(s.request_id for s in rows):
            state = self._states[rid]
            if state.beam is not None:
                beams = state.request.live_seqs()  # the order of state.beam.scores
                searches[rid] = (state.beam, beams, [row_of[seq.seq_id] for seq in beams])
        if not searches:
            return {}
        return dict(zip(searches, select_beams(list(searches.values()), logits)))

    def _record_beams(self, beams: dict[str, tuple[BeamSearchState, BeamStep]]) -> None:
        now = time.perf_counter()
        for rid, (new, step) in beams.items():
            state = self._states[rid]
            state.beam = new
            if state.first_token_time is None:
                state.first_token_time = now
            self.num_generation_tokens += len(step.children)

    @staticmethod
    def _sample_row(state: RequestState, s) -> SampleRow:
        """One row for the sampler; the token history and stop ids only where the request's
        penalties or min_tokens read them (a plain row carries nothing extra)."""
        params = state.params
        index = 0 if s.num_samples > 1 else state.index_of[s.seq_id]
        position = s.context_len - state.request.num_prompt_tokens
        row = SampleRow(params, s.num_samples, index, position)
        if params.uses_penalties or state.bad_words_token_ids:
            seq = state.request.seqs[index]  # a fork's samples all start from seqs[0], the prompt
            if params.repetition_penalty != 1.0:
                row.prompt_token_ids = state.request.prompt_token_ids
            row.output_token_ids = seq.output_token_ids
            row.bad_words_token_ids = state.bad_words_token_ids
        if position < params.min_tokens:
            row.stop_token_ids = state.stop_ids
        return row

    @staticmethod
    def _sampled(rows, result: SamplerOutput | None) -> dict[int, int | list[int]]:
        """What update_from_output takes: per sequence its token, or its num_samples tokens (a fork)."""
        if result is None:
            return {}
        return {s.seq_id: tokens if s.num_samples > 1 else tokens[0] for s, tokens in zip(rows, result.tokens)}

    # -- statistics ----------------------------------------------------------------------------

    def stats(self) -> dict:
        s = self.scheduler.stats()
        b = s.blocks
        return {
            "num_kv_blocks": b.num_blocks, "block_size": self.config.block_size,
            "kv_blocks_used": b.num_used_blocks, "max_kv_blocks_used": b.max_num_used_blocks,
            "kv_blocks_used_per_group": list(b.num_used_blocks_per_group),
            "kv_cache_groups": kv_cache_groups_stats(b.kv_cache_layout),
            "kv_blocks_cached": b.num_cached_blocks, "num_host_blocks": b.num_host_blocks,
            "prefix_cache_queried_tokens": b.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": b.prefix_cache_hit_tokens, "prefix_cache_hit_rate": b.prefix_cache_hit_rate,
            "num_preemptions": s.num_preemptions, "num_swap_preemptions": s.num_swap_preemptions,
            "num_recompute_preemptions": s.num_recompute_preemptions,
            "num_swapped_out_blocks": b.num_swapped_out_blocks, "num_swapped_in_blocks": b.num_swapped_in_blocks,
            "num_copy_on_write": b.num_copy_on_write, "num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_swapped": s.num_swapped, "num_finished": s.num_finished, "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens, "num_generation_tokens": self.num_generation_tokens,
        } | cost_model_stats(self.cost_model, self.config.block_size, self.scheduler.preemption_mode,
                             b.num_host_blocks, self._mean_request_tokens(s.num_finished)) | self._kv_tier_stats() \
            | (self.spec_decode.stats.as_dict() if self.spec_decode is not None else {})  # [spec decode]

    def close_kv_tier(self) -> None:
        """[kv tier] Persist the pool's cached blocks to a disk tier and stop its writer (idempotent; no tier: nothing)."""
        if self.kv_connector is not None:
            from kvpage.kv_offload import close_offloading
            close_offloading(self.runner, self.kv_connector, self.scheduler.bm)

    def _kv_tier_stats(self) -> dict:
        """[kv tier] The tier's counters; prefix_cache_hit_tokens / _rate then count tier hits too (a
        prompt's blocks found in the pool or in the tier, on its first admission)."""
        if self.kv_connector is None:
            return {}
        b = self.scheduler.stats().blocks
        hits = b.prefix_cache_hit_tokens + self.kv_connector.hit_tokens
        q = b.prefix_cache_queried_tokens
        return self.kv_connector.stats() | {"prefix_cache_hit_tokens": hits, "prefix_cache_hit_rate": hits / q if q else 0.0}

    def _mean_request_tokens(self, num_finished: int) -> float | None:
        num_requests = num_finished + len(self._states)
        return (self.num_prompt_tokens + self.num_generation_tokens) / num_requests if num_requests else None


def kv_cache_groups_stats(layout: KVCacheLayout) -> list[dict]:
    """Each KV-cache group, in layout order: its window (None: full attention) and how many layers it holds."""
    return [{"sliding_window": g.sliding_window, "num_layers": len(g.layer_ids)} for g in layout.groups]


def _rows_of(logits: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """logits[keep]: a view, no copy, where keep is one run of rows (beam requests admitted before or after
    the others)."""
    if not keep or keep[-1] - keep[0] == len(keep) - 1:
        return logits[keep[0]:keep[-1] + 1] if keep else logits[:0]
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
