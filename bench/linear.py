"""The linear layers of one decode step, three ways: nn.Linear (sgemm), MKL's packed sgemm, kvpage's
slab kernel with q/k/v and gate/up fused (kvpage.model.cpu_layout's two packings), each matrix on its own
(4 KiB pages) and all of them in one buffer on huge pages, as the engine packs them; and that buffer in
bf16 (LLM(weight_dtype="bfloat16"): half the bytes, fp32 arithmetic) and, where the CPU has AVX512-BF16,
in bf16 pairs for bf16 dot products (matmul_precision="medium").

All 30 layers of SmolLM2-135M's shapes plus its vocab projection, random weights, each matrix used
once per pass so the weights come from memory as in the engine (a step streams ~540 MB of fp32
weights). Min of a few passes per row count M (the decode batch), same process, same threads; kvpage's
kernel is called as the engine calls it (the op, not ops.layers' Python wrapper). At M = 1 each system's
weight bytes over its best pass (GB/s) beside the machine's read bandwidth, a sum over a buffer of the
fp32 weights' size (a batch-1 step reads every weight once, so that bandwidth bounds it): each pass
follows its own sum, in rounds, and the share printed is the median of pass / sum over the rounds, so
a loaded machine's drifting bandwidth cancels (run it with OMP_WAIT_POLICY=passive there).

    python bench/linear.py [--rows 1 8 16 32 64 128 256] [--threads N]
    python bench/linear.py --quick    # 2 layers' matrices, rows 1 and 8: a smoke run
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from kvpage import ops  # noqa: E402
from kvpage.model import cpu_layout  # noqa: E402
from kvpage.ops._library import ops as kvpage_ops  # noqa: E402
from kvpage.ops.layers import bf16_dot_available, pack_linear_weight  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB = 30, 576, 1536, 192, 49152
# (out, in) per layer as HF holds them, and as the slab packing fuses them.
SEPARATE = [(HIDDEN, HIDDEN), (KV_WIDTH, HIDDEN), (KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN),
            (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
FUSED = [(HIDDEN + 2 * KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def engine_call(packed: torch.Tensor, out_features: int):
    """x @ W.T as the engine runs a packed linear (model/llama.py's Linear, or the C++ decoder layer):
    the op itself on a fresh output, without ops.layers.packed_linear's Python checks and reshapes."""
    # The wrapper's ~7 us a call is ~6% of a bf16 M = 1 pass over these 121 matrices (2-core Xeon), a
    # cost the engine never pays: timing it made the kernel look slower than it streams.
    op = kvpage_ops.packed_linear.default

    def call(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], out_features))
        op(out, x, packed, None)
        return out
    return call


def weights(shapes, layers=LAYERS):
    g = torch.Generator().manual_seed(0)
    per_layer = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in shapes]
    return per_layer + [torch.randn(VOCAB, HIDDEN, generator=g) * 0.02]


def sum_seconds(buffer: torch.Tensor) -> float:
    """One multithreaded sum over buffer (fp32): reading its bytes at this machine's read bandwidth now."""
    start = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - start


def pass_seconds(calls, inputs) -> float:
    start = time.perf_counter()
    for width, call in calls:
        call(inputs[width])
    return time.perf_counter() - start


def best_ms(calls, rows, passes=5):
    inputs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
    return min(pass_seconds(calls, inputs) for _ in range(passes)) * 1e3


def paired_bandwidth(systems, weight_bytes, read_bytes, rounds=7):
    """M = 1: each system's pass right after a sum over read_bytes, round after round, so each pass is
    set against the read bandwidth of the same moment (a loaded machine's drifts by 2x over a minute).
    Returns {name: (best ms, median of its passes' GB/s over their sums' GB/s)} and the best sum's GB/s."""
    buffer = torch.ones(read_bytes // 4)
    inputs = {k: torch.randn(1, k) for k in (HIDDEN, INTERMEDIATE)}
    for calls in systems.values():  # warm-up: first-call costs out of the timed rounds
        pass_seconds(calls, inputs)
    seconds, shares, best_sum = {name: [] for name in systems}, {name: [] for name in systems}, float("inf")
    for _ in range(rounds):
        for name, calls in systems.items():
            reading = sum_seconds(buffer)
            best_sum = min(best_sum, reading)
            seconds[name].append(pass_seconds(calls, inputs))
            shares[name].append((weight_bytes[name] / seconds[name][-1]) / (read_bytes / reading))
    return {name: (min(seconds[name]) * 1e3, statistics.median(shares[name])) for name in systems}, read_bytes / best_sum / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="2 layers' matrices, rows 1 and 8 (smoke run)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = 2 if args.quick else LAYERS
    if args.quick:
        args.rows = [1, 8]
    separate, fused = weights(SEPARATE, layers), weights(FUSED, layers)
    systems = {"nn.Linear": [(w.shape[1], lambda x, w=w: F.linear(x, w)) for w in separate]}
    if torch.backends.mkl.is_available():
        mkl = [(w, torch.ops.mkl._mkl_reorder_linear_weight(w, 64)) for w in separate]
        systems["MKL packed"] = [(w.shape[1], lambda x, w=w, p=p: torch.ops.mkl._mkl_linear(x, p, w, None, x.shape[0]))
                                 for w, p in mkl]
    slabs = [(w.shape[0], pack_linear_weight(w)) for w in fused]
    systems[f"kvpage slabs, fused ({ops.cpu_isa()})"] = [(p.shape[1], engine_call(p, n)) for n, p in slabs]
    # As the engine packs them: every matrix in one buffer on huge pages (cpu_layout.SlabArena).
    arena = cpu_layout.SlabArena([tuple(w.shape) for w in fused])
    in_arena = [(w.shape[0], pack_linear_weight(w, out=arena.view(i))) for i, w in enumerate(fused)]
    systems["kvpage slabs, huge pages"] = [(p.shape[1], engine_call(p, n)) for n, p in in_arena]
    # LLM(weight_dtype="bfloat16"): the same arena in bf16, widened to fp32 as loaded (same arithmetic).
    arena16 = cpu_layout.SlabArena([tuple(w.shape) for w in fused], torch.bfloat16)
    in_arena16 = [(w.shape[0], pack_linear_weight(w, out=arena16.view(i), dtype=torch.bfloat16))
                  for i, w in enumerate(fused)]
    systems["kvpage slabs, bf16 weights"] = [(p.shape[1], engine_call(p, n)) for n, p in in_arena16]
    if bf16_dot_available():  # matmul_precision="medium": bf16 dot products (inputs rounded to bf16 too)
        pairs = cpu_layout.SlabArena([tuple(w.shape) for w in fused], torch.bfloat16, bf16_dot=True)
        in_pairs = [(w.shape[0], w.shape[1], pack_linear_weight(w, out=pairs.view(i), bf16_dot=True))
                    for i, w in enumerate(fused)]
        systems["kvpage slabs, bf16 dot"] = [(k, engine_call(p, n)) for n, k, p in in_pairs]
    flops_per_row = 2 * sum(n * k for n, k in FUSED) * layers + 2 * VOCAB * HIDDEN
    weight_bytes = {name: 4 * flops_per_row // 2 for name in systems}  # fp32: 4 bytes per multiply-add
    weight_bytes.update({name: 2 * flops_per_row // 2 for name in systems if "bf16" in name})
    rows_out = []
    for rows in args.rows:
        bandwidth = None
        if rows == 1:
            paired, bandwidth = paired_bandwidth(systems, weight_bytes, weight_bytes["nn.Linear"])
            times = {name: ms for name, (ms, _) in paired.items()}
            print(f"M=1 read bandwidth {bandwidth:.1f} GB/s (best sum over {weight_bytes['nn.Linear'] / 1e6:.0f} MB); each"
                  " system's weight bytes over its best pass, and (median share of the sum just before each pass): "
                  + ", ".join(f"{name} {weight_bytes[name] / t / 1e6:.1f} GB/s ({share:.0%})"
                              for name, (t, share) in paired.items()), flush=True)
        else:
            times = {name: best_ms(calls, rows) for name, calls in systems.items()}
        base = times["nn.Linear"]
        row = {"rows": rows, **{name: f"{t:.1f}" for name, t in times.items()}}
        for name, t in times.items():
            if name != "nn.Linear":
                row[f"{name.split(' (')[0]} speed-up"] = f"{base / t:.2f}x"
        row["best GFLOP/s"] = f"{flops_per_row * rows / min(times.values()) / 1e6:.0f}"
        if bandwidth is not None:
            row["read GB/s"] = f"{bandwidth:.1f}"
            huge = "kvpage slabs, huge pages"  # as the engine holds fp32 weights
            row["fp32 slabs GB/s"] = f"{weight_bytes[huge] / times[huge] / 1e6:.1f}"
            for name, (_, share) in paired.items():
                row[f"{name.split(' (')[0]} % of read"] = f"{share:.0%}"
        rows_out.append(row)
        print(f"M={rows}: " + ", ".join(f"{k} {v} ms" for k, v in times.items()), flush=True)
    columns = list(dict.fromkeys(key for row in rows_out for key in row))
    common.print_table(rows_out, columns)
    path = common.write_json("linear_quick" if args.quick else "linear",
                             {"machine": common.machine_info(), "ms_per_step": rows_out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
