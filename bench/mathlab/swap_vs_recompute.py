"""Math lab 2, swap vs recompute on this machine: measured latency of each over sequence length,
fitted link bandwidth and per-transfer overhead, the measured crossover against the model's.

    python bench/mathlab/swap_vs_recompute.py [--threads 1] [--max-tokens 512] [--repeats 3]
    python bench/mathlab/swap_vs_recompute.py --quick    # up to 32 tokens, 1 repeat: a smoke run

Real ops on the default model (SmolLM2-135M, fp32, 45 KiB of KV per token), 1 torch thread unless
--threads says otherwise (see _common.set_threads for why):
  swap       one ops.swap_blocks call out (device pool -> host pool) and one back, moving ceil(T / 16)
             blocks of every layer's K and V: what the runner does for a swap preemption. On a CPU
             both pools are DRAM, so the "link" is memory itself.
  recompute  ModelRunner.execute of a T-token prefill from an empty block table: what re-admitting a
             recompute-preempted sequence costs when it is the only work in its step; and its marginal
             cost when it rides in a step that also decodes 4 running sequences (step - decode-only step),
             which is how the scheduler actually re-admits it.
Each point is the median of --repeats runs (5 at least for swaps). A near-empty call (64 bytes in
each of the 60 tensors) measures the per-call overhead, which 720 KiB blocks alone cannot resolve;
the bandwidth is fitted over the full-size calls on top of it. The swap points are also taken at 2 threads, where the
OpenMP fork/join of each call waits on a busy core: a fixed per-transfer overhead made visible.
The model side: kvpage.costmodel.SwapRecompute with this machine's constants (matmul FLOP rate,
fitted swap bandwidth and overhead), and the seed's case (Llama-3-8B on an H100 over PCIe) from presets.
"""
from __future__ import annotations

import argparse
import math

from _common import (add_smoke_arguments, figure, median, output_name, print_table, save_figure, set_threads,
                     write_result)

import torch  # noqa: E402

import kvpage  # noqa: E402
from kvpage import costmodel, ops  # noqa: E402
from kvpage.costmodel.device import fit_bandwidth, fit_linear, matmul_flops, memcpy_bandwidth  # noqa: E402
from kvpage.model import ModelInput, SequenceInput  # noqa: E402

BLOCK_SIZE = 16


def timed(fn, repeats: int) -> float:
    import time

    fn()  # warm-up: first-touch page faults, allocator
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def measure_swaps(llm, lengths, repeats: int) -> list[dict]:
    runner = llm.runner
    device = [t for kv in runner.kv_caches for t in kv]
    host = [t for kv in runner.host_kv_caches for t in kv]
    block_bytes = runner.kv_cache_bytes_per_block()
    rows = []
    for n in lengths:
        blocks = math.ceil(n / BLOCK_SIZE)
        # Scattered block ids, as the block manager hands them out.
        out_map = [(2 * i, 3 * i + 1) for i in range(blocks)]
        in_map = [(d, s) for s, d in out_map]
        t_out = timed(lambda: ops.swap_blocks(device, host, out_map), repeats)
        t_in = timed(lambda: ops.swap_blocks(host, device, in_map), repeats)
        rows.append({"tokens": n, "blocks": blocks, "bytes": blocks * block_bytes, "out_s": t_out, "in_s": t_in,
                     "round_trip_s": t_out + t_in})
    return rows


def measure_call_overhead(num_tensors: int, repeats: int) -> dict:
    """One swap_blocks call moving one 64-byte block in each of num_tensors tensors (as many as the
    model's K and V caches): the fixed part of a transfer, nearly free of bytes. Anchors the fit's
    intercept, which the model-sized points (720 KiB a block) cannot resolve on their own."""
    pools = [[ops.allocate_kv_cache(2, 1, 1, 16)[0] for _ in range(num_tensors)] for _ in range(2)]
    nbytes = num_tensors * 64
    seconds = timed(lambda: ops.swap_blocks(pools[0], pools[1], [(0, 1)]), repeats)
    return {"tokens": 0, "blocks": 1, "bytes": nbytes, "out_s": seconds, "in_s": seconds, "round_trip_s": 2 * seconds}


def measure_recompute(llm, lengths, repeats: int) -> list[dict]:
    runner = llm.runner
    rows = []
    for n in lengths:
        table = list(range(math.ceil(n / BLOCK_SIZE)))
        batch = ModelInput([SequenceInput([100 + i % 1000 for i in range(n)], 0, table, list(range(n)))])
        rows.append({"tokens": n, "recompute_s": timed(lambda: runner.execute(batch), repeats)})
    return rows


def _finite(x: float):
    return x if math.isfinite(x) else None  # a flat fit: no measurable size dependence


def measure_marginal_recompute(llm, lengths, repeats: int, num_decodes: int = 4, context: int = 64) -> list[dict]:
    """Recompute as the engine re-admits a victim: its tokens ride in a step that also decodes
    `num_decodes` running sequences (context 64 each). Marginal cost = that step - the decode-only
    step, timed in alternating pairs (median of the differences) so load drifts cancel; the weight
    read the step pays anyway is not charged to the recompute."""
    import time

    runner = llm.runner
    blocks_per_decode = context // BLOCK_SIZE + 1
    decodes = [SequenceInput([7], context, list(range(d * blocks_per_decode, (d + 1) * blocks_per_decode)),
                             [d * blocks_per_decode * BLOCK_SIZE + context]) for d in range(num_decodes)]
    base_block = num_decodes * blocks_per_decode
    base = ModelInput(list(decodes))

    def seconds(batch) -> float:
        t0 = time.perf_counter()
        runner.execute(batch)
        return time.perf_counter() - t0

    rows = []
    for n in lengths:
        table = list(range(base_block, base_block + math.ceil(n / BLOCK_SIZE)))
        slots = [base_block * BLOCK_SIZE + i for i in range(n)]
        batch = ModelInput(list(decodes) + [SequenceInput([100 + i % 1000 for i in range(n)], 0, table, slots)])
        seconds(batch)  # warm-up
        pairs = [(seconds(base), seconds(batch)) for _ in range(repeats if n > 64 else 2 * repeats + 1)]
        rows.append({"tokens": n, "decode_only_s": median([p[0] for p in pairs]),
                     "step_s": median([p[1] for p in pairs]), "marginal_s": median([b - a for a, b in pairs])})
    return rows


def first_swap_win(lengths, swap, recompute):
    for n, s, r in zip(lengths, swap, recompute):
        if s < r:
            return n
    return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    add_smoke_arguments(parser, "up to 32 tokens, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.repeats = 32, 1
    threads = set_threads(args.threads)
    lengths = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if n <= args.max_tokens]
    max_blocks = math.ceil(max(lengths) / BLOCK_SIZE)
    # Device pool: swaps use ids up to 2 * max_blocks, the marginal-recompute step 4 decodes of 5 blocks
    # plus the recomputed sequence.
    llm = kvpage.LLM(model=args.model, num_kv_blocks=3 * max_blocks + 22, swap_space_gib=0.1,
                     enable_prefix_caching=False)
    if llm.runner.num_host_blocks < 3 * max_blocks + 2:
        raise SystemExit("host pool too small for the largest swap; raise swap_space_gib")
    num_tensors = 2 * llm.runner.num_layers
    with ops.range_checks(False):  # the engine's hot path question, not argument validation
        swaps = measure_swaps(llm, lengths, max(args.repeats, 5))
        probe = measure_call_overhead(num_tensors, 15)
        recomputes = measure_recompute(llm, lengths, args.repeats)
        marginal = measure_marginal_recompute(llm, lengths, args.repeats)
        torch.set_num_threads(2)
        swaps_2t = measure_swaps(llm, lengths, max(args.repeats, 5))
        probe_2t = measure_call_overhead(num_tensors, 15)
        torch.set_num_threads(threads)

    # Fits: one-way swap = overhead + bytes / bandwidth per call, the overhead measured by the
    # near-empty call, the bandwidth fitted over both directions' full-size points.
    def fit_swaps(points, probe_point):
        seconds = [r["out_s"] for r in points] + [r["in_s"] for r in points]
        return fit_bandwidth([r["bytes"] for r in points] * 2, seconds, probe_point["out_s"])

    fit, fit_2t = fit_swaps(swaps, probe), fit_swaps(swaps_2t, probe_2t)
    rec_fit = fit_linear([r["tokens"] for r in recomputes], [r["recompute_s"] for r in recomputes])
    flops, membw = matmul_flops(), memcpy_bandwidth()
    shape = costmodel.get_model("smollm2-135m")
    this = costmodel.Device("this", f"this machine, {threads} thread(s), fp32", memory_bytes=16 * 2**30,
                            memory_bandwidth=membw, peak_flops=flops, link_bandwidth=fit.bandwidth,
                            transfer_overhead_s=fit.intercept_s, flops_efficiency=1.0, dtype_bytes=4)
    model = costmodel.SwapRecompute(shape, this, dtype_bytes=4)
    model_2t = costmodel.SwapRecompute(shape, this.with_overhead(fit_2t.intercept_s), dtype_bytes=4)
    rows = []
    for s, s2, r, m in zip(swaps, swaps_2t, recomputes, marginal):
        n = s["tokens"]
        roofline = costmodel.step_seconds(shape, this, [costmodel.Chunk(n, 0)], 4)
        rows.append({"tokens": n, "blocks": s["blocks"], "swap_ms": s["round_trip_s"] * 1e3,
                     "swap_2t_ms": s2["round_trip_s"] * 1e3,
                     "model_swap_ms": model.swap_seconds(n, True, BLOCK_SIZE) * 1e3,
                     "recompute_ms": r["recompute_s"] * 1e3, "recompute_marginal_ms": m["marginal_s"] * 1e3,
                     "model_recompute_linear_ms": model.recompute_seconds(n) * 1e3,
                     "model_recompute_roofline_ms": roofline * 1e3})
    measured_cross = first_swap_win(lengths, [r["swap_ms"] for r in rows], [r["recompute_ms"] for r in rows])
    measured_cross_2t = first_swap_win(lengths, [r["swap_2t_ms"] for r in rows], [r["recompute_ms"] for r in rows])
    measured_cross_marginal = first_swap_win(lengths, [r["swap_ms"] for r in rows],
                                             [r["recompute_marginal_ms"] for r in rows])
    h100 = costmodel.SwapRecompute(costmodel.get_model("llama-3-8b"), costmodel.get_device("h100"))
    summary = {
        "threads": threads, "matmul_gflop_s": flops / 1e9, "memcpy_gb_s": membw / 1e9,
        "call_overhead_us": probe["out_s"] * 1e6, "call_overhead_2_threads_us": probe_2t["out_s"] * 1e6,
        "swap_fit": {"bandwidth_gb_s": _finite(fit.bandwidth / 1e9), "overhead_us": fit.intercept_s * 1e6},
        "swap_fit_2_threads": {"bandwidth_gb_s": _finite(fit_2t.bandwidth / 1e9),
                               "overhead_us": fit_2t.intercept_s * 1e6},
        "recompute_fit": {"intercept_ms": rec_fit.intercept_s * 1e3, "ms_per_token": 1e3 / rec_fit.bandwidth},
        "model_recompute_ms_per_token": model.recompute_seconds(1) * 1e3,
        "ratio_recompute_over_swap_per_token_model": _finite(model.ratio(1024)),
        "ratio_recompute_over_swap_measured_at_max": rows[-1]["recompute_ms"] / rows[-1]["swap_ms"],
        "crossover_model_tokens": model.crossover_tokens(True, BLOCK_SIZE),
        "crossover_model_2_thread_overhead_tokens": model_2t.crossover_tokens(True, BLOCK_SIZE),
        "crossover_measured_tokens": measured_cross, "crossover_measured_2_thread_swap_tokens": measured_cross_2t,
        "crossover_measured_marginal_recompute_tokens": measured_cross_marginal,
        "decode_only_step_ms": marginal[0]["decode_only_s"] * 1e3,
        "h100_llama3_8b": {"ratio_no_overhead": h100.ratio(4096), "crossover_no_overhead": h100.crossover_tokens(False),
                           "crossover_20us_per_token": h100.crossover_tokens(True),
                           "crossover_20us_blocks": h100.crossover_tokens(True, BLOCK_SIZE),
                           "crossover_exact_tokens": h100.crossover_exact()},
    }
    print(f"{threads} thread(s); matmul {flops / 1e9:.1f} GFLOP/s, memcpy {membw / 1e9:.1f} GB/s")
    print_table([{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
                list(rows[0]))
    print(f"one near-empty swap_blocks call over {num_tensors} tensors: {probe['out_s'] * 1e6:.0f} us"
          f" ({probe_2t['out_s'] * 1e6:.0f} us at 2 threads)")
    print(f"swap fit ({threads} thread): {fit.bandwidth / 1e9:.2f} GB/s + {fit.intercept_s * 1e6:.0f} us per call;"
          f" at 2 threads: {fit_2t.bandwidth / 1e9:.2f} GB/s + {fit_2t.intercept_s * 1e6:.0f} us per call")
    print(f"recompute fit: {rec_fit.intercept_s * 1e3:.1f} ms + {1e3 / rec_fit.bandwidth:.3f} ms/token"
          f" (model, linear FLOPs: {model.recompute_seconds(1) * 1e3:.3f} ms/token)")
    print(f"crossover (smallest T at which swap is cheaper; 1 = from the first token): model"
          f" {summary['crossover_model_tokens']}, measured {measured_cross}; with the 2-thread swap: model"
          f" {summary['crossover_model_2_thread_overhead_tokens']}, measured {measured_cross_2t}")
    print(f"recompute riding in a 4-decode step ({marginal[0]['decode_only_s'] * 1e3:.0f} ms alone): swap cheaper from"
          f" {measured_cross_marginal} tokens (None = never at these lengths); marginal costs below ~20 ms are"
          f" within this machine's noise")
    print(f"seed's case, Llama-3-8B on H100 (model): recompute/swap = {h100.ratio(4096):.2f} at every length"
          f" without overhead; crossover with 20 us: {h100.crossover_tokens(True)} tokens"
          f" ({h100.crossover_tokens(True, BLOCK_SIZE)} swapping whole blocks)")
    payload = {"config": vars(args), "lengths": lengths, "rows": rows, "summary": summary,
               "raw": {"swap": swaps, "swap_2_threads": swaps_2t, "recompute": recomputes, "marginal": marginal,
                       "call_overhead_probe": [probe, probe_2t]}}
    name = output_name("swap_vs_recompute", args.quick)
    write_result(name, payload)
    plot(rows, h100, summary, name)
    return payload


def plot(rows, h100, summary, name: str) -> None:
    fig, axes = figure(1, 2)
    ax = axes[0][0]
    t = [r["tokens"] for r in rows]
    ax.loglog(t, [r["recompute_ms"] for r in rows], "o-", color="C1", label="recompute, measured")
    ax.loglog(t, [r["model_recompute_linear_ms"] for r in rows], ":", color="C1",
              label="recompute, model (linear FLOPs)")
    ax.loglog(t, [r["model_recompute_roofline_ms"] for r in rows], "--", color="C1",
              label="recompute, model (roofline: + weight read)")
    ax.loglog(t, [max(r["recompute_marginal_ms"], 1e-2) for r in rows], "^-", color="C5",
              label="recompute, measured, marginal in a 4-decode step")
    ax.loglog(t, [r["swap_ms"] for r in rows], "o-", color="C0",
              label=f"swap round trip, measured ({summary['threads']} thread)")
    ax.loglog(t, [r["model_swap_ms"] for r in rows], "--", color="C0", label="swap, model (fitted)")
    ax.loglog(t, [r["swap_2t_ms"] for r in rows], "s-", color="C2", alpha=0.7, label="swap round trip, 2 threads")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("ms")
    ax.set_title("this machine: SmolLM2-135M fp32")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    t = [2**i for i in range(0, 14)]
    ax.loglog(t, [h100.recompute_seconds(n) * 1e6 for n in t], color="C1", label="recompute (linear FLOPs)")
    ax.loglog(t, [h100.swap_seconds(n, False) * 1e6 for n in t], ":", color="C0", label="swap, no overhead")
    ax.loglog(t, [h100.swap_seconds(n, True) * 1e6 for n in t], "--", color="C0", label="swap + 20 us per transfer")
    ax.loglog(t, [h100.swap_seconds(n, True, BLOCK_SIZE) * 1e6 for n in t], "-", color="C0",
              label="swap + 20 us, whole 16-token blocks")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("us")
    ax.set_title(f"model: Llama-3-8B, H100, PCIe 5 (ratio {h100.ratio(4096):.1f}x)")
    ax.legend(fontsize=7)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
