"""paged_prefill_attention over a long cached history (a chat turn's prefill, issue 48): time per call.

The shape of a turn-10 SmolLM2 chat prefill: --queries new tokens after --context cached ones, 9 query / 3 KV
heads x 64, block 16, fp32 (--dtype bfloat16: a 16-bit cache under a float32 query, as a float32 model with
kv_cache_dtype="bfloat16" runs it; with --query-dtype bfloat16 too: a bfloat16 query and output, as a bfloat16
model runs it), 1 thread timed by its CPU time (--threads N: N torch threads, timed by the wall clock). With
--against DIR it compares two builds of the extension: DIR holds another kvpage package (a copy of python/kvpage
with its own _C .so); paired rounds alternate which build runs first, each in its own process, and report the
per-round ratios (against / this tree) that a loaded machine skews least. Alone, it
also times the op's two matrix products as dense GEMMs in the query's dtype (torch.bmm: MKL's sgemm for float32,
oneDNN for bfloat16; each KV head's query rows against all the keys, no softmax, mask or paging): an op near
their time runs its products at the speed of the CPU's best GEMM library for that dtype.

    python bench/prefill_history.py [--context 1300] [--queries 130] [--dtype float32] [--calls 40]
    python bench/prefill_history.py --dtype bfloat16 --query-dtype bfloat16   # a bfloat16 model's prefill
    python bench/prefill_history.py --against /tmp/old_pkg --rounds 6
    python bench/prefill_history.py --threads 2 --against /tmp/old_pkg   # the op on two cores
    python bench/prefill_history.py --quick   # a smoke run: tiny shapes, one paired round of this tree against itself
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16


def clock(threads: int):
    """The timer for --threads: one thread's CPU time (what a loaded machine skews least), or the wall clock
    for several (CPU time would add the threads' times, and their spin waits, together). Wall-clock figures
    need a quiet machine: while other processes hold the other cores, a call waits out their scheduler
    quanta (a 2-core machine under load gave ~12 ms medians for a ~1.5 ms call)."""
    return time.process_time if threads == 1 else time.perf_counter


def time_op(args) -> float:
    """Median seconds of one call (clock(args.threads)), in this process."""
    import torch
    torch.set_num_threads(args.threads)
    from kvpage import ops

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_size, block_size = HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE
    seq_len = args.context + args.queries
    num_blocks = -(-seq_len // block_size)
    dtype = getattr(torch, args.dtype)
    key_cache, value_cache = (torch.randn(num_blocks + 7, kv_heads, block_size, head_size, generator=gen).to(dtype)
                              for _ in range(2))
    tables = torch.randperm(num_blocks + 7, generator=gen)[:num_blocks].to(torch.int32).view(1, -1)
    query = torch.randn(args.queries, heads, head_size, generator=gen).to(getattr(torch, args.query_dtype))
    starts = torch.tensor([0, args.queries], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    out = torch.empty_like(query)
    for _ in range(3):
        ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, seq_lens, out=out)
    now, times = clock(args.threads), []
    for _ in range(args.calls):
        start = now()
        ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, seq_lens, out=out)
        times.append(now() - start)
    return statistics.median(times)


def op_flops(args) -> int:
    """Multiply-adds x 2 of the op's two products: query i sees context + i + 1 keys (causal)."""
    keys_seen = sum(args.context + i + 1 for i in range(args.queries))
    return 2 * 2 * HEADS * HEAD_SIZE * keys_seen


def time_gemms(args) -> float:
    """Median seconds (clock(args.threads)) of the same products as dense GEMMs in the query's dtype: scores =
    q k^T, out = scores v, each KV head's group of query heads stacked as rows (the op's GQA rows), on
    args.threads threads."""
    import torch
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows, keys = args.queries * (HEADS // KV_HEADS), args.context + args.queries
    q = torch.randn(KV_HEADS, rows, HEAD_SIZE, generator=gen)
    k_t = torch.randn(KV_HEADS, HEAD_SIZE, keys, generator=gen)
    v = torch.randn(KV_HEADS, keys, HEAD_SIZE, generator=gen)
    q, k_t, v = (x.to(getattr(torch, args.query_dtype)) for x in (q, k_t, v))
    now, times = clock(args.threads), []
    for i in range(args.calls + 3):
        start = now()
        torch.bmm(torch.bmm(q, k_t), v)
        if i >= 3:
            times.append(now() - start)
    return statistics.median(times)


def beside_gemms(args, seconds: float) -> str:
    """The op's time and rate beside its products' as dense GEMMs (timed here, in this process)."""
    gemms = time_gemms(args)
    dense = 2 * 2 * HEADS * HEAD_SIZE * args.queries * (args.context + args.queries)
    return (f"{seconds * 1e3:.3f} ms, {op_flops(args) / seconds / 1e9:.1f} GFLOP/s; its two products as dense "
            f"{args.query_dtype} GEMMs (torch.bmm, no softmax / mask / paging): {gemms * 1e3:.3f} ms, "
            f"{dense / gemms / 1e9:.1f} GFLOP/s; "
            f"op / GEMMs {seconds / gemms:.2f}")


def run_in(package_parent: str, argv, threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": package_parent}
    cmd = [sys.executable, __file__, "--child", *argv]
    return float(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.split()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1300)
    parser.add_argument("--queries", type=int, default=130)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--query-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the query's (and output's) dtype; bfloat16 needs --dtype bfloat16 (a bfloat16 model)")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the op (and the GEMMs); above 1 the calls are timed by the wall clock")
    parser.add_argument("--against", default=None, help="directory holding another build's kvpage package")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: tiny shapes, one paired round of this tree against itself")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.query_dtype == "bfloat16" and args.dtype != "bfloat16":
        parser.error("--query-dtype bfloat16 needs --dtype bfloat16 (a 16-bit query reads a cache of its own dtype)")
    if args.quick:
        args.context, args.queries, args.calls, args.rounds = 64, 16, 3, 1
        args.against = args.against or str(ROOT / "python")
    if args.child:
        print(time_op(args))
        return
    if args.against is None:
        print(beside_gemms(args, time_op(args)))
        return
    child_argv = [f"--context={args.context}", f"--queries={args.queries}", f"--dtype={args.dtype}",
                  f"--query-dtype={args.query_dtype}", f"--calls={args.calls}", f"--threads={args.threads}"]
    builds = {"this tree": str(ROOT / "python"), "against": args.against}
    ratios, this_tree = [], []
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(builds)[::-1]
        ms = {name: run_in(builds[name], child_argv, args.threads) * 1e3 for name in order}
        ratios.append(ms["against"] / ms["this tree"])
        this_tree.append(ms["this tree"] / 1e3)
        print(f"round {r}: this tree {ms['this tree']:.3f} ms, against {ms['against']:.3f} ms, "
              f"against / this tree {ratios[-1]:.3f}")
    print(f"median ratio against / this tree: {statistics.median(ratios):.3f}")
    print("this tree (median):", beside_gemms(args, statistics.median(this_tree)))


if __name__ == "__main__":
    main()
