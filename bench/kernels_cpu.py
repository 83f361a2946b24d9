"""Paged attention kernels vs torch SDPA on the same data laid out contiguously (the dense baseline).

Decode: batch 1/8/32/64 x context 256/1024/4096 for SmolLM2's shape (9 query / 3 KV heads x 64)
and Llama-3-8B's (32 / 8 x 128); prefill: whole prompts, causal. Same process, same threads.
Also reports the KV bytes/s paged decode achieves against this machine's read bandwidth measured in
the same run. Targets (issue 2): paged decode <= 1.0x dense for context >= 1024; >= 70% of read
bandwidth once the cache is larger than the L3 cache.

Sliding window (issue 45): decode at a 16k context with a 1k window against no window over the same
cache (window_ratio = windowed / full time; the window reads 1/16 of the keys, so ~0.06 is the bound).

    python bench/kernels_cpu.py [--quick] [--dtype float32] [--threads N] [--fp8-cache] [--window-only]
    --fp8-cache: decode also over an fp8 (e4m3) copy of the cache, per-tensor scales from the data;
                 reports its time against the same-dtype cache's (fp8_speedup) and its error
    --window-only: only the sliding-window rows
    python bench/kernels_cpu.py --device cuda   # GPU benchmark (bench/kernels_cuda.py)
    python bench/kernels_cpu.py --range-check-cost [--quick] [--rounds N]
    --range-check-cost: what the range checks (off by default, KVPAGE_RANGE_CHECKS=1) cost the engine's CPU
                 steps: the default model, fp32, 8 greedy requests of bench/engine.py's workload, 64 tokens
                 each (--quick: its quick workload), prefix caching off so every run does the same work;
                 N paired rounds alternating which setting runs first; reports the median per-round ratios
                 of the run times, checks on / off: wall and this process's CPU time (steadier on a loaded
                 machine, with --threads 1)
"""
import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from kvpage import ops  # noqa: E402
from kvpage.ops import reference  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXTS = (256, 1024, 4096)
PREFILL_CASES = ((1, 1024), (4, 512), (1, 4096))  # (sequences, tokens each)
WINDOW_CASES = (("smollm2", 1), ("smollm2", 8), ("llama3-8b", 1))  # (shape, batch) at WINDOW_CONTEXT
WINDOW_CONTEXT, WINDOW = 16384, 1024
BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def l3_bytes():
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text.rstrip("K")) * 1024 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 32 << 20


def paged_copy(dense_k, dense_v, generator):
    """Lays dense [B, Hkv, L, D] K/V out in a paged cache with a shuffled block table."""
    batch, num_kv_heads, seq_len, head_size = dense_k.shape
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, num_kv_heads, head_size,
                                                   dtype=dense_k.dtype)
    block_tables = torch.randperm(num_blocks, generator=generator).to(torch.int32).view(batch, blocks_per_seq)
    pad = blocks_per_seq * BLOCK_SIZE - seq_len
    for cache, dense in ((key_cache, dense_k), (value_cache, dense_v)):
        tiles = F.pad(dense, (0, 0, 0, pad)).view(batch, num_kv_heads, blocks_per_seq, BLOCK_SIZE, head_size)
        cache[block_tables.long()] = tiles.permute(0, 2, 1, 3, 4)
    return key_cache, value_cache, block_tables


def fp8_copy(cache):
    """An fp8 cache holding cache's values, scaled so the largest magnitude maps to fp8's 448."""
    scale = max(cache.abs().max().item() / reference.FP8_MAX, 1e-12)
    fp8 = torch.empty(cache.shape, dtype=torch.float8_e4m3fn)
    fp8.copy_(reference.quantize_fp8(cache, scale))
    return fp8, scale


def fp8_decode_columns(query, key_cache, value_cache, block_tables, seq_lens, expected, t_paged, iters):
    (k8, k_scale), (v8, v_scale) = fp8_copy(key_cache), fp8_copy(value_cache)
    out = torch.empty_like(query)

    def paged_fp8():
        ops.paged_attention(query, k8, v8, block_tables, seq_lens, out=out, k_scale=k_scale, v_scale=v_scale)

    paged_fp8()
    t_fp8 = common.median_time(paged_fp8, iters)
    kv_bytes = 2 * int(seq_lens.sum()) * k8.shape[1] * k8.shape[3]
    return {"fp8_ms": t_fp8 * 1e3, "fp8_speedup": t_paged / t_fp8, "fp8_gbs": kv_bytes / t_fp8 / 1e9,
            "fp8_max_abs_diff": (out.float() - expected.float()).abs().max().item()}


def decode_case(shape_name, batch, context, dtype, generator, fp8_cache=False):
    num_heads, num_kv_heads, head_size = SHAPES[shape_name]
    dense_k = torch.randn(batch, num_kv_heads, context, head_size, generator=generator).to(dtype)
    dense_v = torch.randn(batch, num_kv_heads, context, head_size, generator=generator).to(dtype)
    query = torch.randn(batch, num_heads, head_size, generator=generator).to(dtype)
    key_cache, value_cache, block_tables = paged_copy(dense_k, dense_v, generator)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    out = torch.empty_like(query)

    def paged():
        ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out)

    def dense():
        return F.scaled_dot_product_attention(query.unsqueeze(2), dense_k, dense_v, enable_gqa=True)

    paged()
    error = (out.float() - dense().squeeze(2).float()).abs().max().item()
    iters = 5 if batch * context >= 64 * 1024 else 15
    t_paged, t_dense = common.median_time(paged, iters), common.median_time(dense, iters)
    kv_bytes = 2 * dense_k.numel() * dense_k.element_size()
    row = {"kind": "decode", "shape": shape_name, "batch": batch, "context": context,
           "paged_ms": t_paged * 1e3, "dense_ms": t_dense * 1e3, "ratio": t_paged / t_dense,
           "kv_bytes": kv_bytes, "paged_gbs": kv_bytes / t_paged / 1e9, "max_abs_diff": error}
    if fp8_cache:
        row.update(fp8_decode_columns(query, key_cache, value_cache, block_tables, seq_lens,
                                      dense().squeeze(2), t_paged, iters))
    return row


def window_case(shape_name, batch, dtype, generator):
    """Decode over one paged cache of WINDOW_CONTEXT tokens a sequence, with and without a window of
    WINDOW tokens; the windowed output checked against the reference."""
    num_heads, num_kv_heads, head_size = SHAPES[shape_name]
    dense_k, dense_v = (torch.randn(batch, num_kv_heads, WINDOW_CONTEXT, head_size, generator=generator).to(dtype)
                        for _ in range(2))
    query = torch.randn(batch, num_heads, head_size, generator=generator).to(dtype)
    key_cache, value_cache, block_tables = paged_copy(dense_k, dense_v, generator)
    del dense_k, dense_v
    seq_lens = torch.full((batch,), WINDOW_CONTEXT, dtype=torch.int32)
    out = torch.empty_like(query)

    def decode(window):
        return lambda: ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, out=out,
                                           sliding_window=window)

    decode(WINDOW)()
    expected = reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         sliding_window=WINDOW)
    error = (out.float() - expected.float()).abs().max().item()
    t_window, t_full = common.median_time(decode(WINDOW), 15), common.median_time(decode(None), 5)
    return {"kind": "decode-window", "shape": shape_name, "batch": batch, "context": WINDOW_CONTEXT,
            "window": WINDOW, "window_ms": t_window * 1e3, "full_ms": t_full * 1e3,
            "window_ratio": t_window / t_full, "max_abs_diff": error}


def prefill_case(shape_name, num_seqs, seq_len, dtype, generator):
    num_heads, num_kv_heads, head_size = SHAPES[shape_name]
    dense_k = torch.randn(num_seqs, num_kv_heads, seq_len, head_size, generator=generator).to(dtype)
    dense_v = torch.randn(num_seqs, num_kv_heads, seq_len, head_size, generator=generator).to(dtype)
    dense_q = torch.randn(num_seqs, num_heads, seq_len, head_size, generator=generator).to(dtype)
    key_cache, value_cache, block_tables = paged_copy(dense_k, dense_v, generator)
    query = dense_q.transpose(1, 2).reshape(num_seqs * seq_len, num_heads, head_size)
    query_start_loc = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    out = torch.empty_like(query)

    def paged():
        ops.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                    out=out)

    def dense():
        return F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, enable_gqa=True)

    paged()
    expected = dense().transpose(1, 2).reshape_as(out)
    error = (out.float() - expected.float()).abs().max().item()
    t_paged, t_dense = common.median_time(paged, 5), common.median_time(dense, 5)
    return {"kind": "prefill", "shape": shape_name, "batch": num_seqs, "context": seq_len,
            "paged_ms": t_paged * 1e3, "dense_ms": t_dense * 1e3, "ratio": t_paged / t_dense,
            "max_abs_diff": error}


def judge(rows, bandwidth, l3):
    for r in rows:
        if r["kind"] != "decode":
            continue
        r["bw_fraction"] = r["paged_gbs"] / bandwidth
        r["beyond_l3"] = r["kv_bytes"] > l3
        checks = []
        if r["context"] >= 1024:
            checks.append(r["ratio"] <= 1.0)
        if r["beyond_l3"]:
            checks.append(r["bw_fraction"] >= 0.70)
        r["meets_target"] = all(checks) if checks else None


def plot(rows, bandwidth, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["kind"] == "decode"]
    labels = [f"{r['shape'][:5]} b{r['batch']} c{r['context']}" for r in decode]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, len(decode) * 0.45), 8), sharex=True)
    ax1.bar(range(len(decode)), [r["ratio"] for r in decode], color="tab:blue")
    ax1.axhline(1.0, color="red", linestyle="--", label="target 1.0x dense")
    ax1.set_ylabel("paged / dense SDPA time")
    ax1.legend()
    ax2.bar(range(len(decode)), [r["paged_gbs"] for r in decode], color="tab:green")
    ax2.axhline(bandwidth, color="black", label=f"read bandwidth {bandwidth:.1f} GB/s")
    ax2.axhline(0.7 * bandwidth, color="red", linestyle="--", label="70% target")
    ax2.set_ylabel("paged decode KV GB/s")
    ax2.set_xticks(range(len(decode)), labels, rotation=70, fontsize=7)
    ax2.legend()
    fig.suptitle("kvpage CPU paged decode vs dense SDPA")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def window_rows(dtype, generator):
    rows = [window_case(shape_name, batch, dtype, generator) for shape_name, batch in WINDOW_CASES]
    for r in rows:
        for key in ("window_ms", "full_ms", "window_ratio"):
            r[key] = round(r[key], 3)
    common.print_table(rows, ["kind", "shape", "batch", "context", "window", "window_ms", "full_ms",
                              "window_ratio", "max_abs_diff"])
    return rows


def run_window_only(args, dtype, generator):
    with ops.range_checks(args.range_checks):
        rows = window_rows(dtype, generator)
    print(f"isa {ops.cpu_isa()}, threads {torch.get_num_threads()}, dtype {args.dtype}")
    path = common.write_json("kernels_window", {"machine": common.machine_info(), "isa": ops.cpu_isa(),
                                                "dtype": args.dtype, "rows": rows})
    print(f"wrote {path}")


def run_cpu(args):
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(0)
    if args.window_only:
        return run_window_only(args, dtype, generator)
    batches = (1, 8) if args.quick else DECODE_BATCHES
    contexts = (1024,) if args.quick else DECODE_CONTEXTS
    rows = []
    with ops.range_checks(args.range_checks):
        for shape_name in SHAPES:
            for batch in batches:
                for context in contexts:
                    rows.append(decode_case(shape_name, batch, context, dtype, generator, args.fp8_cache))
            for num_seqs, seq_len in PREFILL_CASES[: 1 if args.quick else None]:
                rows.append(prefill_case(shape_name, num_seqs, seq_len, dtype, generator))
    bandwidth, l3 = common.read_bandwidth_gbs(1 << 28 if args.quick else 1 << 30), l3_bytes()
    judge(rows, bandwidth, l3)
    for r in rows:
        for key in ("paged_ms", "dense_ms", "ratio", "paged_gbs", "bw_fraction", "fp8_ms", "fp8_speedup",
                    "fp8_gbs"):
            if key in r:
                r[key] = round(r[key], 3)
    fp8_columns = ["fp8_ms", "fp8_speedup", "fp8_gbs", "fp8_max_abs_diff"] if args.fp8_cache else []
    common.print_table(rows, ["kind", "shape", "batch", "context", "paged_ms", "dense_ms", "ratio",
                              "paged_gbs", "max_abs_diff", *fp8_columns])
    print(f"read bandwidth {bandwidth:.2f} GB/s, L3 {l3 >> 20} MiB, isa {ops.cpu_isa()}, "
          f"threads {torch.get_num_threads()}, dtype {args.dtype}")
    decode = [r for r in rows if r["kind"] == "decode" and r["meets_target"] is not None]
    print(f"decode rows meeting target: {sum(r['meets_target'] for r in decode)}/{len(decode)}")
    if not args.quick:
        with ops.range_checks(args.range_checks):
            rows += window_rows(dtype, generator)
    payload = {"machine": common.machine_info(), "isa": ops.cpu_isa(), "dtype": args.dtype,
               "read_bandwidth_gbs": bandwidth, "l3_bytes": l3, "rows": rows}
    path = common.write_json("kernels_quick" if args.quick else "kernels", payload)
    plot(rows, bandwidth, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _timed_run(llm, workload, checks: bool) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one run of the workload with the range checks on or off."""
    from kvpage.engine.workload import run_kvpage

    with ops.range_checks(checks):
        cpu = time.process_time()
        wall = run_kvpage(llm, workload)["seconds"]
        return wall, time.process_time() - cpu


def run_range_check_cost(args):
    import kvpage
    from kvpage.engine.workload import make_workload, quick_workload

    workload = quick_workload() if args.quick else make_workload(num_requests=8, min_out=64, max_out=64)
    llm = kvpage.LLM(enable_prefix_caching=False)
    _timed_run(llm, workload, False)  # warm-up
    runs = {False: [], True: []}
    for r in range(args.rounds or (2 if args.quick else 6)):
        for checks in ((False, True) if r % 2 == 0 else (True, False)):
            runs[checks].append(_timed_run(llm, workload, checks))
    rows = [{"round": i, "off_s": off[0], "on_s": on[0], "wall_on_over_off": on[0] / off[0],
             "off_cpu_s": off[1], "on_cpu_s": on[1], "cpu_on_over_off": on[1] / off[1]}
            for i, (off, on) in enumerate(zip(runs[False], runs[True]))]
    ratios = {key: statistics.median(r[key] for r in rows) for key in ("wall_on_over_off", "cpu_on_over_off")}
    rows = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    common.print_table(rows, list(rows[0]))
    print(f"range checks on / off, median of {len(rows)} paired rounds: wall {ratios['wall_on_over_off']:.4f}, "
          f"process CPU time {ratios['cpu_on_over_off']:.4f} ({workload.num_output_tokens} output tokens a run, "
          f"isa {ops.cpu_isa()}, threads {torch.get_num_threads()})")
    path = common.write_json("kernels_range_checks", {"machine": common.machine_info(), "isa": ops.cpu_isa(),
                                                      "threads": torch.get_num_threads(), "rows": rows, **ratios})
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at context 1024, one prefill (smoke run)")
    parser.add_argument("--range-checks", action="store_true", help="turn the range checks on (off by default)")
    parser.add_argument("--fp8-cache", action="store_true", help="decode also over an fp8 copy of the cache")
    parser.add_argument("--window-only", action="store_true", help="only the sliding-window decode rows")
    parser.add_argument("--range-check-cost", action="store_true",
                        help="the engine's CPU run time with the range checks on / off (paired rounds)")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds of --range-check-cost (6; --quick: 2)")
    args, rest = parser.parse_known_args()
    if args.device == "cuda":
        cuda_bench = Path(__file__).resolve().parent / "kernels_cuda.py"
        sys.exit(subprocess.call([sys.executable, str(cuda_bench), *rest]))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.range_check_cost:
        run_range_check_cost(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
