"""LLMEngine: requests in, one scheduler step -> one forward pass -> sampled tokens, RequestOutputs out.

The engine owns no KV bookkeeping: the scheduler (kvpage.core) decides each step and the executor
(kvpage.engine.executor_base.Executor: a ModelRunner, or the tensor-parallel driver) carries it out. What is
left here is the per-request view: sampling parameters, log-probabilities, text and stop strings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from kvpage.core import BeamStep, FinishReason, Request, Scheduler, SchedulerOutput
from kvpage.core.block_manager import CacheConfig
from kvpage.core.interrupts import deferred_interrupts
from kvpage.core.kv_cache_groups import KVCacheLayout

from .arg_utils import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from .beam_search import BeamSearchState, beam_output, new_beam_search, select_beams
from .cost_measurement import cost_model_stats, measured_cost_model, record_step_time
from .detokenizer import IncrementalDetokenizer, find_stop
from .executor_base import Executor
from .logits_processors import bad_words_token_ids, check_some_token_sampleable
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampler import Sampler, SampleRow, SamplerOutput, TopLogprobs, rank_and_top
from .sampling_params import SamplingParams, check_encodable


def cache_salt_keys(cache_salt: str | None) -> tuple:
    """The block-hash extra keys of a cache salt (kvpage.core.hashing): () without one."""
    if cache_salt is None:
        return ()
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be None or a non-empty string, got {cache_salt!r}")
    return ("cache_salt", cache_salt)


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


@dataclass
class _Sample:
    cumulative_logprob: float = 0.0
    detok: IncrementalDetokenizer | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per output token, where params.logprobs is set
    # [spec decode] the last speculative step's tokens: (token count after it, cumulative_logprob before it,
    # its tokens' logprobs), for a stop string inside the run to take back the tokens it cuts.
    spec_run: tuple[int, float, list[float]] | None = None


@dataclass
class _RequestState:
    request: Request | None  # the scheduler's (its sequences hold the token ids); set as it is queued
    prompt: str | None
    params: SamplingParams
    stream: bool
    samples: list[_Sample]
    index_of: dict[int, int]  # seq_id -> sample index (the order of the request's sequences)
    stop_ids: tuple[int, ...] = ()  # what min_tokens holds back: eos (unless ignore_eos) and stop_token_ids
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, position 1's, ...] so far
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    beam: BeamSearchState | None = None  # beam search: the search so far (the scheduler holds the beams)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    @property
    def needs_detok(self) -> bool:
        return self.stream or bool(self.params.stop)


class LLMEngine:
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
        self._states: dict[str, _RequestState] = {}
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

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None = None,
                    *, prompt_token_ids: list[int] | None = None, stream: bool = True,
                    cache_salt: str | None = None) -> None:
        """Queue a request. Raises ValueError (and queues nothing) if it can never run: a prompt longer
        than max_model_len, too long for the whole KV cache, or min_tokens with nothing but stop tokens
        to sample, as vLLM's add_request does (an output reaching max_model_len stops there, "length").
        stream=False: step() reports it only once finished, and its text is decoded once at the end.
        A beam request (beam_width > 1) is scheduled with the others and reported once finished.
        cache_salt (vLLM's): the request shares prefix-cache blocks only with requests of the same salt."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params = params.clone()  # checked again (fields may have been assigned), and the caller's may change now
        stream = stream and not params.use_beam_search  # the best beams are known only at the end
        text, token_ids = self.request_prompt(prompt, prompt_token_ids, params)
        eos, *more_eos = self.config.eos_token_ids or (None,)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(more_eos))
        # What min_tokens holds back: eos (unless ignore_eos) and every other stop token id.
        held_back = stop_ids | ({eos} if eos is not None and not params.ignore_eos else set())
        if params.min_tokens:
            self._check_min_tokens_reachable(params, held_back)
        self._check_logprobs(params)
        # n (or beam_width) sample records are built next: what the scheduler would refuse is refused first.
        self.scheduler.check_fits(request_id, len(token_ids), params.max_tokens, max(params.n, params.beam_width))
        extra_keys = cache_salt_keys(cache_salt)
        # Everything that can fail is done before the scheduler hears of the request (admission is
        # all-or-nothing); the two registrations then happen together, Ctrl-C deferred.
        state = self._new_state(text, token_ids, params, stream, held_back)
        check_some_token_sampleable(params, state.bad_words_token_ids, self.runner.vocab_size)
        if params.use_beam_search:
            state.beam = new_beam_search(params, len(token_ids), self.config.max_model_len, self.config.eos_token_ids)
        with deferred_interrupts():
            state.request = self.scheduler.add_request(
                request_id, token_ids, max_tokens=params.max_tokens, n=params.n, eos_token_id=eos,
                stop_token_ids=stop_ids, ignore_eos=params.ignore_eos,
                prompt_logits=params.prompt_logprobs is not None, extra_keys=extra_keys,
                beam_width=params.beam_width)
            state.index_of = {state.request.seqs[0].seq_id: 0}
            self._states[request_id] = state
            self.num_prompt_tokens += len(token_ids)

    def _new_state(self, text: str | None, token_ids: list[int], params: SamplingParams, stream: bool,
                   held_back: set[int]) -> _RequestState:
        """A request's engine-side state, its scheduler request still to be attached."""
        state = _RequestState(None, text, params, stream, [_Sample() for _ in range(params.n)], {})
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        if params.bad_words:
            state.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.min_tokens:
            state.stop_ids = tuple(sorted(held_back))
        for sample in state.samples:
            if state.needs_detok:
                sample.detok = IncrementalDetokenizer(len(token_ids), params.skip_special_tokens)
            if params.logprobs is not None:
                sample.logprobs = []
        return state

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's max_logprobs: more than that many alternatives per token is refused, not computed."""
        cap = self.config.max_logprobs if self.config.max_logprobs >= 0 else self.runner.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > cap:
                raise ValueError(f"{name}={k} exceeds max_logprobs={cap} (the most log-probabilities per token"
                                 " this engine returns; LLM(max_logprobs=...) raises it)")

    def request_prompt(self, prompt, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> tuple[str | None, list[int]]:
        """A request's (text, token ids): tokenized and checked, with its params' token ids checked
        against the vocabulary, and truncate_prompt_tokens applied (vLLM's left truncation)."""
        text, token_ids = self.tokenize_prompt(prompt, prompt_token_ids)
        self._check_token_options(params)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        return text, token_ids

    def _check_min_tokens_reachable(self, params: SamplingParams, stop_ids: set[int]) -> None:
        """min_tokens holds back every stop token; where nothing else may be sampled (allowed_token_ids,
        or the whole vocabulary, all stop tokens) no token could come out at all."""
        candidates = params.allowed_token_ids if params.allowed_token_ids is not None else range(self.runner.vocab_size)
        if all(t in stop_ids for t in candidates):
            raise ValueError(f"min_tokens={params.min_tokens}: every token the request may sample"
                             f" ({'allowed_token_ids' if params.allowed_token_ids is not None else 'the vocabulary'})"
                             f" is a stop token, which min_tokens holds back")

    def _check_token_options(self, params: SamplingParams) -> None:
        """Token ids the options name must lie in the vocabulary (an index past it would fail mid-step);
        bad_words need a tokenizer to become token ids."""
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model has none (use logit_bias to ban token ids)")
        vocab = self.runner.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name)
            if ids and max(ids) >= vocab:
                raise ValueError(f"{name} names token id {max(ids)}, outside the vocabulary (vocab_size={vocab})")

    def tokenize_prompt(self, prompt, prompt_token_ids: list[int] | None = None) -> tuple[str | None, list[int]]:
        """(text, checked token ids); with prompt_token_ids (already tokenised: chat templates) the prompt
        is just the text."""
        if prompt_token_ids is None:
            return self.tokenize(prompt)
        return prompt, self.tokenize(list(prompt_token_ids))[1]

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            check_encodable(prompt, "prompt")
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        else:
            text, token_ids = None, list(prompt) if isinstance(prompt, (list, tuple)) else []
            if not token_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt must be a string or a non-empty list of int token ids")
        vocab = self.runner.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            got = f"{min(token_ids)}..{max(token_ids)}"
            if text is not None:  # an index past the embedding would fail mid-step (on CUDA: a device assert)
                raise ValueError(f"the tokenizer gives this prompt token ids {got}, outside the model's vocabulary"
                                 f" [0, vocab_size={vocab}): is it another model's tokenizer?")
            raise ValueError(f"prompt token ids must lie in [0, vocab_size={vocab}), got {got}")
        return text, token_ids

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

    def _add_spec_run(self, sample: _Sample, num_tokens: int, verified, kept: int) -> None:
        """[spec decode] The log-probabilities of the run's first `kept` tokens (those the sequence took), added
        one token at a time as decoding adds them, so that the sums agree."""
        sample.spec_run = (num_tokens, sample.cumulative_logprob, verified.logprobs[:kept])
        for k in range(kept):
            sample.cumulative_logprob += verified.logprobs[k]
            if sample.logprobs is not None:
                sample.logprobs.append(self._logprob_dict(verified.tokens[k], verified.logprobs[k],
                                                          verified.top_logprobs[k]))

    @staticmethod
    def _take_back_spec_run(seq, sample: _Sample, end: int) -> None:
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
    def _sample_row(state: _RequestState, s) -> SampleRow:
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

    def _prompt_logprobs(self, scheduled, logits: torch.Tensor) -> list[tuple[_RequestState, int, list]]:
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
        touched: dict[str, _RequestState] = {}
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

    def _detokenize(self, state: _RequestState) -> None:
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

    def _detok_ends(self, seq, sample: _Sample):
        """The token counts to detokenize at: the sequence's own, or [spec decode] each one a step that
        appended several went through, so that a stop string ends the output where it would without."""
        if self.spec_decode is None or sample.detok.stopped:
            return (seq.num_tokens,)
        return range(min(seq.num_prompt_tokens + sample.detok.read_offset + 1, seq.num_tokens), seq.num_tokens + 1)

    def _finish_sequence(self, request: Request, seq) -> None:
        """Stop one sequence on a stop string: the scheduler only knows token-id stops."""
        self.scheduler.finish_sequences(request.request_id, [seq.seq_id], FinishReason.STOP)

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
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
    def _metrics(state: _RequestState) -> dict:
        metrics = {"arrival_time": state.arrival_time, "first_token_time": state.first_token_time}
        if state.first_token_time is not None:
            metrics["ttft"] = state.first_token_time - state.arrival_time
        return metrics

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
