"""kvpage.LLM: the offline entry point (vLLM's `LLM`): load a model, size the KV cache, generate."""
from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time

import torch

from kvpage.core.context_parallel import check_context_parallel, check_dcp_attention, check_dcp_sizes
from kvpage.core.interrupts import call_locked, deferred_interrupts
from kvpage.core.policies import check_preemption_mode
from kvpage.kv_offload import check_offloading_options
from kvpage.spec_decode import parse_speculative_config

from .arg_utils import EngineOptions, engine_options, engine_signature, with_defaults
from .executor_base import Executor
from .generation_defaults import describe as describe_sampling_defaults
from .generation_defaults import model_sampling_defaults
from .llm_engine import EngineConfig, LLMEngine
from .model_config import eos_token_ids, max_model_len, resolve_dtype, resolve_seed, resolve_tokenizer
from .outputs import RequestOutput
from .prompt_inputs import PromptItem, chat_template_prompt, normalise_conversations, normalise_prompts, per_prompt_params
from .sampling_params import SamplingParams

logger = logging.getLogger("kvpage")

# KV-cache budget when num_kv_blocks is not given. CPU: a fixed 1 GiB (about 23k tokens of the default
# model in fp32; the pool is zero-filled up front, so it is real memory). GPU: half the memory free
# after the model is loaded, leaving the rest for activations.
CPU_KV_CACHE_GIB = 1.0
GPU_KV_CACHE_FRACTION = 0.5


class LLM:
    def __init__(self, model=None, *, tokenizer=None, **options) -> None:
        """vLLM's LLM. Every keyword but tokenizer is an engine option declared once, with its default and what
        it does, in kvpage.engine.arg_utils.ENGINE_OPTIONS (`kvpage generate --help` lists them). Calls from
        several threads are safe: they run one at a time."""
        o = with_defaults(engine_options("LLM", {"model": model, **options}))
        cache_dtype, weight_dtype = _check_options(o)  # everything checkable, before the model loads (seconds)
        seed, tokenizer = resolve_seed(o.seed), resolve_tokenizer(tokenizer)
        self._load_model(o, tokenizer, cache_dtype, weight_dtype)
        self.tensor_parallel_size = o.tensor_parallel_size
        self.decode_context_parallel_size = o.decode_context_parallel_size
        self.runner = self._start_executor(o, weight_dtype)
        # Under DCP one block id holds block_size tokens on each of the group's D ranks.
        block_size = o.block_size * o.decode_context_parallel_size
        self.llm_engine = LLMEngine(self.runner, self.tokenizer, EngineConfig(
            num_kv_blocks=self.runner.num_kv_blocks, block_size=block_size, num_host_blocks=self.runner.num_host_blocks,
            enable_prefix_caching=o.enable_prefix_caching, max_num_batched_tokens=o.max_num_batched_tokens,
            max_num_seqs=o.max_num_seqs, max_model_len=self.context_limit, preemption_mode=o.preemption_mode,
            eos_token_ids=eos_token_ids(self.model, self.tokenizer), seed=seed, max_logprobs=o.max_logprobs,
            kv_cache_layout=self.kv_cache_layout, kv_offloading_size=o.kv_offloading_size,
            kv_offloading_dir=o.kv_offloading_dir))
        self._log_kv_cache(block_size)
        self.llm_engine.attach_spec_decode(o.speculative_config)  # [spec decode] None: no speculation
        self._counter = itertools.count()
        # One call at a time owns the engine: a second thread waits rather than stepping into its state.
        self._lock = threading.RLock()
        self._unfinished_call: list[str] = []  # the request ids of a call that has not returned

    __init__.__signature__ = engine_signature("model", inspect.Parameter("tokenizer", inspect.Parameter.KEYWORD_ONLY,
                                                                         default=None))

    def _load_model(self, o: EngineOptions, tokenizer, cache_dtype, weight_dtype) -> None:
        """The model and tokenizer, with the dtypes checked against the model, and what its config fixes:
        the KV-cache groups, the context limit, tensor / decode context parallelism's head split."""
        from kvpage.model import load_model
        from kvpage.model.runner import check_dtypes, model_kv_cache_layout

        self.model, loaded_tokenizer = load_model(o.model, dtype=resolve_dtype(o.dtype))
        self.kv_cache_dtype = cache_dtype or self.model.dtype
        # Here, not only in each rank's ModelRunner: a tensor-parallel rank's error would not reach the caller.
        check_dtypes(self.model.dtype, next(self.model.parameters()).device, self.kv_cache_dtype, weight_dtype,
                     o.matmul_precision)
        self.tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        self.default_sampling_fields = model_sampling_defaults(self.model, embedded=o.model is None)
        logger.info("kvpage: %s", describe_sampling_defaults(self.default_sampling_fields))
        config = self.model.config
        # The KV-cache groups (layers by sliding window; one group without windows): the block manager keeps a
        # block table per group, the runner a cache pair per group member, and a block id is that many layers.
        self.kv_cache_layout = model_kv_cache_layout(config)
        dcp = o.decode_context_parallel_size
        # DCP splits each window group's window over the ranks (core.context_parallel.check_dcp_attention).
        check_dcp_attention(dcp, o.dcp_kv_cache_interleave_size, self.kv_cache_layout.sliding_windows,
                            _has_attention_sinks(self.model))
        self.context_limit = _context_limit(config, o.max_model_len)
        check_context_parallel(o.tensor_parallel_size, dcp, o.dcp_kv_cache_interleave_size, o.block_size,
                               config.num_attention_heads,
                               getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    def _start_executor(self, o: EngineOptions, weight_dtype) -> Executor:
        """This process's ModelRunner, or the driver of N tensor-parallel ranks (self.model then rank 0's shard);
        the same decode CUDA graphs either way unless enforce_eager (kvpage.model.cuda_graphs)."""
        from kvpage.model.cuda_graphs import CudaGraphConfig

        swap_gib = 0.0 if o.preemption_mode == "recompute" else o.swap_space_gib
        graphs = None
        if not o.enforce_eager and self.context_limit is not None:
            graphs = CudaGraphConfig(o.max_num_seqs, self.context_limit)
        if o.tensor_parallel_size == 1:
            return self._start_runner(o, swap_gib, weight_dtype, graphs)
        executor = self._start_tensor_parallel(o, swap_gib, weight_dtype, graphs)
        self.model = executor.model
        return executor

    def _start_runner(self, o: EngineOptions, swap_gib: float, weight_dtype, graphs):
        """This process's ModelRunner, its pools sized from num_kv_blocks or the memory budget."""
        from kvpage.model import ModelRunner

        num_kv_blocks = o.num_kv_blocks or self._blocks_for_budget(o.block_size)
        num_host_blocks = (_blocks_for(self.model.config, swap_gib, o.block_size, self.kv_cache_dtype,
                                       self.kv_cache_layout) if swap_gib else 0)
        self._check_kv_memory(num_kv_blocks, num_host_blocks, o.block_size)
        return ModelRunner(self.model, num_kv_blocks, o.block_size, self.model.dtype, num_host_blocks,
                           kv_cache_dtype=self.kv_cache_dtype, weight_dtype=weight_dtype,
                           matmul_precision=o.matmul_precision, cuda_graphs=graphs, kv_cache_layout=self.kv_cache_layout)

    def _log_kv_cache(self, block_size: int) -> None:
        layout, num_kv_blocks = self.kv_cache_layout, self.runner.num_kv_blocks
        logger.info("kvpage: KV cache of %d blocks x %d tokens = %d concurrent tokens (%.2f GiB), host swap"
                    " pool %d blocks%s", num_kv_blocks, block_size, num_kv_blocks * block_size,
                    num_kv_blocks * self.runner.kv_cache_bytes_per_block() / 2**30, self.runner.num_host_blocks,
                    # Hybrid: a block id is one group's layers, and a window group holds only its window's blocks.
                    f"; {layout.num_groups} KV-cache groups of {layout.group_size} layers (windows"
                    f" {list(layout.sliding_windows)})" if layout.num_groups > 1 else "")

    def _check_kv_memory(self, num_kv_blocks: int, num_host_blocks: int, block_size: int) -> None:
        """ValueError naming num_kv_blocks / swap_space_gib where the caches cannot fit in the free memory
        (a CPU cache past it would be OOM-killed while zero-filling, not raise)."""
        from kvpage.model import kv_cache_bytes_per_block
        from kvpage.ops.memory import available_bytes, gib

        per_block = kv_cache_bytes_per_block(self.model.config, block_size, self.kv_cache_dtype,
                                             layout=self.kv_cache_layout)
        device = next(self.model.parameters()).device
        host = torch.device("cpu")
        needs = {device: num_kv_blocks * per_block}
        needs[host] = needs.get(host, 0) + num_host_blocks * per_block
        for where, need in needs.items():
            free = available_bytes(where)
            if free is not None and need > free:
                raise ValueError(f"the KV cache needs {gib(need)} on {where} (num_kv_blocks={num_kv_blocks}, host"
                                 f" swap pool {num_host_blocks} blocks from swap_space_gib) but only {gib(free)}"
                                 f" is free: lower num_kv_blocks or swap_space_gib")

    def _blocks_for_budget(self, block_size: int) -> int:
        device = next(self.model.parameters()).device
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        return _blocks_for(self.model.config, _kv_cache_gib(free), block_size, self.kv_cache_dtype,
                           self.kv_cache_layout)

    def _start_tensor_parallel(self, o: EngineOptions, swap_gib: float, weight_dtype, graphs):
        """Budgets are per rank, as vLLM's per-GPU ones: a rank's share of a block is its KV heads' share,
        and the block count is what the rank with the largest share fits (num_kv_blocks, if given, is used
        as is). Under torchrun, ranks other than 0 serve inside launch() and exit the process there."""
        from kvpage.distributed import launch

        block_size, num_kv_blocks = o.block_size, o.num_kv_blocks
        executor = launch(o.model, self.model, o.tensor_parallel_size, o.decode_context_parallel_size)
        try:
            per_block = max(executor.rank_bytes_per_block(block_size, self.kv_cache_dtype, self.kv_cache_layout))
            if num_kv_blocks is None:
                free = executor.min_free_device_bytes() if executor.device.type == "cuda" else None
                num_kv_blocks = int(_kv_cache_gib(free) * 2**30) // per_block
            executor.allocate(num_kv_blocks, block_size, int(swap_gib * 2**30) // per_block, self.kv_cache_dtype,
                              weight_dtype, o.matmul_precision, o.dcp_kv_cache_interleave_size, self.kv_cache_layout,
                              graphs)
        except BaseException:
            executor.shutdown()
            raise
        return executor

    def shutdown(self) -> None:
        """Release the tensor-parallel workers and process group, and persist a disk KV tier's blocks (nothing
        to release otherwise). The workers are also released when the LLM is garbage-collected and at exit."""
        self.llm_engine.close_kv_tier()  # [kv tier]
        self.runner.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json sampling defaults (kvpage.engine.generation_defaults);
        what generate() and chat() use when given no SamplingParams."""
        return SamplingParams(**self.default_sampling_fields)

    def _or_defaults(self, sampling_params):
        return self.get_default_sampling_params() if sampling_params is None else sampling_params

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt, beam search ones included, is checked
        before anything runs: a bad SamplingParams or a prompt too long for the model or the cache
        raises ValueError naming the prompt's index (vLLM's behaviour), and the engine stays usable.
        If a step raises anyway (the runner, a KeyboardInterrupt), this call's requests are withdrawn
        and their blocks freed before the exception propagates: the LLM then generates as before."""
        prompts = normalise_prompts(prompts)
        params = per_prompt_params(self._or_defaults(sampling_params), len(prompts))
        items = [PromptItem(text, ids, sp, salt) for (text, ids, salt), sp in zip(prompts, params)]
        return call_locked(self._lock, self._run, items, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        conversations = normalise_conversations(messages)
        params = per_prompt_params(self._or_defaults(sampling_params), len(conversations))
        return call_locked(self._lock, self._chat, conversations, params, chat_template, use_tqdm)

    def _chat(self, conversations, params, chat_template: str | None, use_tqdm: bool) -> list[RequestOutput]:
        # Under the lock: the tokenizer too is used by one thread at a time.
        prompts = [chat_template_prompt(self.tokenizer, c, chat_template) for c in conversations]
        return self._run([PromptItem(t, i, sp) for (t, i), sp in zip(prompts, params)], use_tqdm)

    def _run(self, items: list, use_tqdm: bool) -> list[RequestOutput]:
        """Queue every prompt, then step until each has finished (the step loop is here, not a helper: one
        Python frame less on every step, docs/internals.md)."""
        self.runner.check_open()  # a failed or shut-down tensor-parallel LLM says so before anything runs
        self._settle()
        engine, results, progress = self.llm_engine, {}, None
        # Filled by _add_all as it queues, so a failure anywhere withdraws them all (here, or next call).
        ids: list[str] = []
        self._unfinished_call = ids
        try:
            self._add_all(items, ids)
            progress = _Progress(len(ids), use_tqdm)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        progress.update(out)
        except BaseException:
            # A failed step (the engine has already discarded it) or a KeyboardInterrupt: withdraw this
            # call's requests, freeing their blocks, so the LLM goes on exactly as before this call.
            with deferred_interrupts():
                engine.abort_request(ids)
            raise
        finally:
            if progress is not None:
                progress.close()
        self._unfinished_call = []
        return [results[rid] for rid in ids]

    def _settle(self) -> None:
        """Finish what an interrupt cut short in the last call's clean-up: its requests withdrawn, no
        step left half done. Every call (stats() too) starts here, so none sees a half-failed engine."""
        if self._unfinished_call:
            self.llm_engine.abort_request(self._unfinished_call)
            self._unfinished_call = []
        self.llm_engine.settle()

    def _add_all(self, items: list, ids: list[str]) -> None:
        """Check and queue every prompt (beam search ones too: the scheduler batches them with the
        others), appending their request ids to `ids` (an id goes in before its request, so the
        caller can withdraw whatever got queued); on the first that cannot run raise, naming its index."""
        for index, item in enumerate(items):
            try:
                ids.append(str(next(self._counter)))
                self.llm_engine.add_request(ids[-1], item.prompt, item.params, prompt_token_ids=item.token_ids,
                                            stream=False, cache_salt=item.cache_salt)
            except (ValueError, TypeError) as e:
                # The scheduler's messages lead with the request id, which is internal: the index instead.
                message = str(e).removeprefix(f"request {ids[-1]!r}: ")
                raise type(e)(f"prompt {index}: {message}") from e

    def stats(self) -> dict:
        """The engine's statistics, plus tensor_parallel_size and kv_cache_bytes_per_rank: the KV-cache bytes
        (device pool) each rank allocated, measured on that rank. What the swap-versus-recompute cost model
        measured on this machine (kvpage.engine.cost_measurement), None where not measured:
        swap_bytes_per_s (one way, KV cache to host memory) and swap_overhead_s (fixed seconds per swap
        call), from a probe at start-up, in this process (not with tensor_parallel_size > 1);
        prefill_tokens_per_s: tokens per second a forward pass adds per extra token, fitted to the recent
        steps' timings (None before the first step); swap_preferred_from_tokens: the shortest victim, in
        tokens, the model would swap rather than recompute (None: never); preferred_preemption_mode:
        "swap" or "recompute" for a victim as long as the mean request so far (prompt plus output), or
        the mode fixed by preemption_mode (recompute without a host pool)."""
        stats = call_locked(self._lock, self._settled_stats)
        stats["tensor_parallel_size"] = self.tensor_parallel_size
        stats["decode_context_parallel_size"] = self.decode_context_parallel_size
        # Every rank holds one physical block per block id in use (a DCP group's ranks, each its share of it).
        stats["kv_blocks_used_per_rank"] = [stats["kv_blocks_used"]] * self.tensor_parallel_size
        stats["kv_cache_bytes_per_rank"] = self.runner.kv_cache_bytes_per_rank()
        return stats

    def _settled_stats(self) -> dict:
        self._settle()
        return self.llm_engine.stats()


def _has_attention_sinks(model) -> bool:
    """Whether the model's attention layers carry sinks (gpt-oss's per-head `sinks` parameter)."""
    return any(name.rsplit(".", 1)[-1] in ("sinks", "s_aux") for name, _ in model.named_parameters())


def _context_limit(config, requested: int | None) -> int | None:
    """max_model_len: the model's own limit, or a lower one asked for (vLLM refuses a higher one)."""
    limit = max_model_len(config)
    if requested is None:
        return limit
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's context of {limit} tokens")
    return requested


def _check_options(o: EngineOptions) -> tuple:
    """ValueError naming the option for any value LLM cannot take; the KV-cache and weight dtypes named."""
    if type(o.tensor_parallel_size) is not int or o.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {o.tensor_parallel_size!r}")
    _check_block_size(o.block_size)
    for name in ("num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"):
        _check_optional_positive(name, getattr(o, name))
    swap = o.swap_space_gib
    if swap is not None and not (isinstance(swap, (int, float)) and not isinstance(swap, bool)
                                 and 0 <= swap < float("inf")):
        raise ValueError(f"swap_space_gib must be a finite number >= 0 or None, got {swap!r}")
    for name in ("enable_prefix_caching", "enforce_eager"):
        if not isinstance(getattr(o, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(o, name)!r}")
    _check_optional_positive("max_model_len", o.max_model_len)
    if type(o.max_logprobs) is not int or o.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be an int >= 0, or -1 for no cap, got {o.max_logprobs!r}")
    check_dcp_sizes(o.decode_context_parallel_size, o.dcp_kv_cache_interleave_size, o.block_size)
    check_offloading_options(o.kv_offloading_size, o.kv_offloading_dir, o.tensor_parallel_size)  # [kv tier]
    check_preemption_mode(o.preemption_mode)
    parse_speculative_config(o.speculative_config)  # [spec decode] a bad config's key named before the model loads
    from kvpage.model.runner import dtypes_from_names  # torch: when an LLM is built

    return dtypes_from_names(o.kv_cache_dtype, o.weight_dtype, o.matmul_precision)


def _check_optional_positive(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


# The attention kernels take power-of-two blocks of up to 256 tokens (csrc/checks.cpp).
MAX_BLOCK_SIZE = 256


def _check_block_size(block_size) -> None:
    ok = isinstance(block_size, int) and not isinstance(block_size, bool)
    if not ok or not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size must be an int power of two from 1 to {MAX_BLOCK_SIZE}, got {block_size!r}")


def _kv_cache_gib(free_device_bytes: int | None) -> float:
    """The KV-cache budget where num_kv_blocks is not given: a share of a GPU's free bytes, or the CPU's GiB."""
    return CPU_KV_CACHE_GIB if free_device_bytes is None else GPU_KV_CACHE_FRACTION * free_device_bytes / 2**30


def _blocks_for(config, gib: float, block_size: int, dtype, layout) -> int:
    from kvpage.model.runner import num_blocks_for_memory
    return num_blocks_for_memory(config, gib, block_size, dtype, layout)


class _Progress:
    """generate()'s progress bar (tqdm, on stderr), requests finished and output tokens per second; nothing
    without use_tqdm."""

    def __init__(self, total: int, use_tqdm: bool) -> None:
        self.bar = None
        if use_tqdm and total:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start, self.generated = time.perf_counter(), 0

    def update(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.generated += sum(len(c.token_ids) for c in out.outputs)
        self.bar.update(1)
        self.bar.set_postfix_str(f"{self.generated / (time.perf_counter() - self.start):.1f} tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
