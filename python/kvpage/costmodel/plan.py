"""`kvpage plan`: every section of the cost model for one model, device and workload, as text."""
from __future__ import annotations

from dataclasses import dataclass

from . import cow, memory
from .dcp import ParallelConfig, dcp_traffic, rank_capacity, tp_all_reduce_bytes
from .device import Device
from .model import ModelShape
from .prefix import prefix_cache_ttft, resident_blocks
from .preemption import SwapRecompute


@dataclass(frozen=True)
class Workload:
    context_len: int = 8192
    block_size: int = 16
    mean_len: float = 500.0  # ShareGPT-like: about 160 prompt + 340 output tokens
    memory_utilization: float = 0.9
    dtype_bytes: int | None = None  # None: the device's default
    prefix_requests: int = 50
    prefix_shared_tokens: int = 2000
    prefix_unique_tokens: int = 32
    max_num_batched_tokens: int = 2048
    cow_prompt_tokens: int = 500
    cow_generated_tokens: int = 64
    samples: tuple[int, ...] = (2, 4, 8)
    beam_width: int = 4
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1
    decode_batch_size: int = 1  # decode tokens in one step, for the bytes DCP moves


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _crossover(n: int | None) -> str:
    if n is None:
        return "never: recompute is cheaper at every length"
    if n <= 1:
        return "none: swap is cheaper at every length"
    return f"{n} tokens"


def plan_text(model: ModelShape, device: Device, w: Workload = Workload()) -> str:
    dtype = w.dtype_bytes or device.dtype_bytes
    parallel = ParallelConfig(model, w.tensor_parallel_size, w.decode_context_parallel_size,
                              w.dcp_kv_cache_interleave_size, w.block_size)  # refuses bad sizes before any output
    lines = [f"kvpage plan: {model.name} on {device.name} ({device.description}), {dtype}-byte KV and weights",
             f"model: {model.num_layers} layers, {model.num_heads} heads / {model.num_kv_heads} KV heads x"
             f" {model.head_dim}, {model.num_params / 1e9:.3g} B params ({_bytes(model.weight_bytes(dtype))}),"
             f" {model.flops_per_token / 1e9:.3g} GFLOP per prefill token",
             f"device: memory {_bytes(device.memory_bytes)} at {device.memory_bandwidth / 1e9:.4g} GB/s,"
             f" {device.peak_flops / 1e12:.4g} TFLOP/s peak x {device.flops_efficiency:.0%} achievable,"
             f" host link {device.link_bandwidth / 1e9:.4g} GB/s ({device.link_to_memory_ratio:.3g}x slower than"
             f" memory), {_seconds(device.transfer_overhead_s)} per transfer", ""]

    per_token = memory.kv_bytes_per_token(model, dtype)
    # One block table per KV-cache group (one group without windows).
    table_bytes = memory.block_table_bytes(w.context_len, w.block_size) * model.kv_cache_layout.num_groups
    seq_bytes = (memory.seq_blocks(model, w.context_len, w.block_size) * memory.kv_bytes_per_block(model, w.block_size, dtype)
                 if model.kv_cache_layout.is_hybrid else per_token * w.context_len)
    cap = memory.capacity(model, device, w.context_len, w.mean_len, w.block_size, dtype, w.memory_utilization)
    lines += ["== Memory (paging vs reservation) ==",
              f"KV bytes per token                         {per_token} B ({_bytes(per_token)})",
              f"KV bytes per block of {w.block_size}                    "
              f"{_bytes(memory.kv_bytes_per_block(model, w.block_size, dtype))}",
              f"blocks per sequence at {w.context_len} tokens            "
              f"{memory.seq_blocks(model, w.context_len, w.block_size)}",
              f"block-table bytes per sequence (int32)     {table_bytes} B ({_bytes(table_bytes)})",
              f"KV per sequence at {w.context_len} tokens              {_bytes(seq_bytes)}",
              f"KV budget ({w.memory_utilization:.0%} of memory - weights)       "
              f"{_bytes(cap.kv_budget_bytes)} = {cap.budget_blocks} blocks = {cap.budget_tokens} tokens",
              f"sequences that fit, reserving {w.context_len}       {cap.seqs_reserved}"
              f"  (waste {cap.reserved_waste:.1%} at a mean length of {w.mean_len:g})",
              f"sequences that fit, paged (mean {w.mean_len:g})      {cap.seqs_paged}"
              f"  (waste {cap.paged_waste:.1%}: half a block each; {cap.paging_gain:.1f}x more)",
              *hybrid_lines(model, cap, w, dtype), ""]

    sr = SwapRecompute(model, device, dtype)
    lines += ["== Preemption: swap vs recompute ==",
              "per token, the seed's linear model         | whole blocks + overhead, recompute + attention",
              f"{'tokens':>8} {'swap':>9} {'swap+ovh':>9} {'recompute':>9} {'ratio':>6} {'ratio+ovh':>9} |"
              f" {'swap':>9} {'recompute':>9}  engine picks"]
    lengths = [n for n in (1, 2, 4, 8, 16, 64, 256, 1024, 4096, w.context_len) if n <= w.context_len]
    for r in sr.rows(sorted(set(lengths)), w.block_size):
        lines.append(f"{r['tokens']:>8} {_seconds(r['swap_no_overhead_s']):>9} {_seconds(r['swap_s']):>9}"
                     f" {_seconds(r['recompute_s']):>9} {r['ratio_no_overhead']:>6.2f} {r['ratio']:>9.2f} |"
                     f" {_seconds(r['swap_blocks_s']):>9} {_seconds(r['recompute_attention_s']):>9}"
                     f"  {r['engine_picks']}")
    exact = sr.crossover_exact()
    lines += [f"ratio recompute/swap without overhead, per token: {sr.ratio(w.context_len):.2f} at every length",
              f"crossover without overhead (per token):      {_crossover(sr.crossover_tokens(False))}",
              f"crossover with {_seconds(device.transfer_overhead_s)} overhead (per token):  "
              f"{_crossover(sr.crossover_tokens(True))}"
              + (f" (T* = {exact:.3g})" if exact else ""),
              f"crossover with overhead, whole blocks of {w.block_size}:  "
              f"{_crossover(sr.crossover_tokens(True, w.block_size))}", ""]

    pc = prefix_cache_ttft(model, device, w.prefix_requests, w.prefix_shared_tokens, w.prefix_unique_tokens,
                           w.block_size, w.max_num_batched_tokens, dtype)
    lines += [f"== Prefix cache: {w.prefix_requests} requests sharing a {w.prefix_shared_tokens}-token system"
              f" prompt (+{w.prefix_unique_tokens} own tokens, max_tokens=1, budget"
              f" {w.max_num_batched_tokens} tokens/step) ==",
              f"TTFT cache off: first {_seconds(pc.ttft_off_s[0])}, mean {_seconds(pc.mean_off_s)},"
              f" last {_seconds(pc.ttft_off_s[-1])}",
              f"TTFT cache on:  first {_seconds(pc.ttft_on_s[0])}, mean {_seconds(pc.mean_on_s)},"
              f" last {_seconds(pc.ttft_on_s[-1])}",
              f"mean TTFT {pc.speedup:.1f}x lower; prefill tokens saved {pc.saved_prefill_tokens}"
              f" ({sum(1 for h in pc.hit_tokens_on if h)} of {w.prefix_requests} requests hit)",
              "KV blocks while all are resident: {} with the cache, {} without".format(
                  *resident_blocks(w.prefix_requests, w.prefix_shared_tokens, w.prefix_unique_tokens, w.block_size)),
              ""]

    block_bytes = memory.kv_bytes_per_block(model, w.block_size, dtype)
    lines += [f"== Copy-on-write: {w.cow_prompt_tokens}-token prompt, {w.cow_generated_tokens} generated tokens"
              f" each ==", f"{'sequences':>12} {'shared':>8} {'unshared':>9} {'saved':>7}  memory saved"]
    plans = [("n=%d" % n, cow.parallel_sampling(n, w.cow_prompt_tokens, w.cow_generated_tokens, w.block_size))
             for n in w.samples]
    plans.append((f"beam {w.beam_width}", cow.beam_search(w.beam_width, w.cow_prompt_tokens,
                                                           w.cow_generated_tokens, w.block_size)))
    for label, p in plans:
        shared = (f"{p.blocks_shared_min}-{p.blocks_shared}" if p.blocks_shared_min != p.blocks_shared
                  else f"{p.blocks_shared}")
        lines.append(f"{label:>12} {shared:>8} {p.blocks_unshared:>9} {p.saved_fraction:>7.0%}"
                     f"  {_bytes(p.saved_blocks * block_bytes)}")
    at_fork = cow.parallel_sampling(2, w.cow_prompt_tokens, 1, w.block_size)
    lines.append(f"two samples at their first divergence: {at_fork.blocks_shared} blocks shared-and-copied vs"
                 f" {at_fork.blocks_unshared} duplicated")
    lines += ["", *parallel_lines(parallel, device, w, dtype)]
    return "\n".join(lines)


def hybrid_lines(model: ModelShape, cap: memory.Capacity, w: Workload, dtype: int) -> list[str]:
    """A model with sliding-window layers (kvpage's hybrid KV cache): its KV-cache groups, and the blocks and
    sequences of context_len tokens against the same model with every layer full. None for other models."""
    layout = model.kv_cache_layout
    if not layout.is_hybrid:
        return []
    full, windowed = [g for g in layout.groups if g.sliding_window is None], [g for g in layout.groups if g.sliding_window]
    hybrid_blocks = memory.seq_blocks(model, w.context_len, w.block_size)
    # The same bytes in this pool's block ids (group_size layers each) with every layer full: each layer keeps
    # every block of the sequence.
    all_full_blocks = memory.blocks_per_sequence(w.context_len, w.block_size) * model.num_layers / layout.group_size
    windows = sorted({g.sliding_window for g in windowed})
    return [f"KV-cache groups (hybrid)                   {len(full)} full + {len(windowed)} window"
            f" ({', '.join(map(str, windows))}) of {layout.group_size} layers; a block id = {layout.group_size}"
            f" layers' block ({_bytes(memory.kv_bytes_per_block(model, w.block_size, dtype))})",
            f"blocks per sequence at {w.context_len}, every layer full {all_full_blocks:.0f}"
            f"  (hybrid: {hybrid_blocks}, {hybrid_blocks / all_full_blocks:.1%})",
            f"sequences of {w.context_len} tokens that fit        {cap.budget_blocks // hybrid_blocks} hybrid,"
            f" {int(cap.budget_blocks // all_full_blocks)} with every layer full"]


def parallel_lines(pc: ParallelConfig, device: Device, w: Workload, dtype: int) -> list[str]:
    """Per-rank KV under TP x DCP: what a rank stores per token, the context its budget holds, and what
    the DCP attention merge moves per decode step."""
    m, t, d = pc.model, pc.tensor_parallel_size, pc.decode_context_parallel_size
    per_token = pc.kv_bytes_per_token_per_rank(dtype)
    cap = rank_capacity(pc, device, dtype, w.mean_len, w.memory_utilization)
    spread = sorted({pc.tokens_on_rank(w.context_len, r) for r in range(d)})
    traffic = dcp_traffic(pc, dtype, w.decode_batch_size)
    max_pos = f" (max_position_embeddings {m.max_position_embeddings})" if m.max_position_embeddings else ""
    rows = [("KV heads per rank", f"{pc.kv_heads_per_rank} of {m.num_kv_heads}; KV-head replication"
                                  f" {pc.kv_head_replication} (TP ranks holding the same head)"),
            (f"DCP sizes the rules allow at TP={t}", ", ".join(map(str, pc.allowed_dcp_sizes))),
            ("KV bytes per token per rank", f"{per_token:g} B ({_bytes(per_token)})"),
            ("one block id covers", f"{pc.virtual_block_tokens} tokens, {pc.block_size} on each of {d} rank(s):"
                                    f" up to {pc.virtual_block_tokens - 1} unfilled per sequence"),
            (f"positions per rank at {w.context_len} tokens", "-".join(map(str, spread))),
            ("weights per rank", _bytes(pc.weight_bytes_per_rank(dtype))),
            ("KV budget per rank", f"{_bytes(cap.kv_budget_bytes)} = {cap.blocks_per_rank} blocks of"
                                   f" {_bytes(pc.rank_block_bytes(dtype))}"),
            ("max context the ranks' budget holds", f"{cap.max_context_tokens} tokens{max_pos}"),
            (f"sequences that fit, paged (mean {w.mean_len:g})", str(cap.seqs_paged)),
            (f"DCP bytes per decode step per layer", f"{traffic.total} B received per rank at"
                                                     f" {w.decode_batch_size} decode token(s):"),
            ("  query all-gather", f"{traffic.query_all_gather} B"),
            ("  outputs + LSE all-to-all", f"{traffic.output_all_to_all} B"),
            ("  over all layers", _bytes(traffic.total * m.num_layers)),
            ("  beside TP's two all-reduces (ring)", f"{tp_all_reduce_bytes(pc, dtype, w.decode_batch_size):.0f} B"
                                                     f" sent per rank per layer")]
    title = (f"== Tensor x decode context parallelism: TP={t}, DCP={d},"
             f" interleave {pc.dcp_kv_cache_interleave_size} ==")
    return [title, *(f"{label:<43}{value}" for label, value in rows)]
