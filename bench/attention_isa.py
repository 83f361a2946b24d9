"""CPU paged attention with the AVX-512 build's kernels (4-row blocks at 16 lanes) against the AVX2
build's (8 lanes), paired in one process: the ISAs alternate call by call on the same data.

Decode over float32 and fp8 copies of the cache, and prefill, for SmolLM2's and Llama-3-8B's heads.
Needs a CPU with AVX-512 (kvpage.ops.available_cpu_isas()).

    python bench/attention_isa.py [--rounds 7]
    python bench/attention_isa.py --quick    # one decode and one prefill case, 1 round: a smoke run

On a CPU without AVX-512 it says so and exits 0 (nothing to compare).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_cpu import SHAPES, fp8_copy, paged_copy  # noqa: E402

from kvpage import ops  # noqa: E402

DECODE_CASES = (("smollm2", 64, 1024), ("smollm2", 32, 4096), ("llama3-8b", 8, 1024), ("llama3-8b", 32, 1024),
                ("llama3-8b", 64, 4096))
PREFILL_CASES = (("smollm2", 1, 1024), ("smollm2", 4, 512), ("llama3-8b", 1, 1024))
ISAS = ("avx2", "avx512")


def paired(fn, rounds, calls=3):
    """Median times per ISA and the median of per-round avx2/avx512 ratios."""
    times = {isa: [] for isa in ISAS}
    for i in range(rounds):
        for isa in ISAS if i % 2 == 0 else ISAS[::-1]:
            ops.set_cpu_isa(isa)
            fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[isa].append((time.perf_counter() - start) / calls)
    ratio = statistics.median(a / b for a, b in zip(times["avx2"], times["avx512"]))
    return statistics.median(times["avx2"]), statistics.median(times["avx512"]), ratio


def decode_rows(rounds, gen, cases=DECODE_CASES):
    for name, batch, context in cases:
        heads, kv_heads, head_size = SHAPES[name]
        key, value = (torch.randn(batch, kv_heads, context, head_size, generator=gen) for _ in range(2))
        key_cache, value_cache, tables = paged_copy(key, value, gen)
        del key, value
        (k8, k_scale), (v8, v_scale) = fp8_copy(key_cache), fp8_copy(value_cache)
        query, seq_lens = torch.randn(batch, heads, head_size, generator=gen), torch.full((batch,), context, dtype=torch.int32)
        out = torch.empty_like(query)
        for cache, args, scales in (("fp32", (key_cache, value_cache), {}),
                                    ("fp8", (k8, v8), dict(k_scale=k_scale, v_scale=v_scale))):
            result = paired(lambda: ops.paged_attention(query, *args, tables, seq_lens, out=out, **scales), rounds)
            yield ("decode", name, f"b{batch} c{context}", cache, *result)


def prefill_rows(rounds, gen, cases=PREFILL_CASES):
    for name, num_seqs, length in cases:
        heads, kv_heads, head_size = SHAPES[name]
        key, value = (torch.randn(num_seqs, kv_heads, length, head_size, generator=gen) for _ in range(2))
        key_cache, value_cache, tables = paged_copy(key, value, gen)
        query = torch.randn(num_seqs * length, heads, head_size, generator=gen)
        starts = torch.arange(0, num_seqs * length + 1, length, dtype=torch.int32)
        seq_lens = torch.full((num_seqs,), length, dtype=torch.int32)
        out = torch.empty_like(query)
        result = paired(lambda: ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, seq_lens,
                                                            out=out), max(3, rounds // 2), calls=1)
        yield ("prefill", name, f"{num_seqs}x{length}", "fp32", *result)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one decode and one prefill case, 1 round (smoke run)")
    args = parser.parse_args(argv)
    if not set(ISAS) <= set(ops.available_cpu_isas()):
        print(f"attention_isa skipped: needs {ISAS}, this CPU has {ops.available_cpu_isas()}")
        return
    previous = ops.cpu_isa()
    gen = torch.Generator().manual_seed(0)
    rounds = 1 if args.quick else args.rounds
    decode, prefill = (DECODE_CASES[:1], PREFILL_CASES[:1]) if args.quick else (DECODE_CASES, PREFILL_CASES)
    try:
        with ops.range_checks(False):
            for row in (*decode_rows(rounds, gen, decode), *prefill_rows(rounds, gen, prefill)):
                kind, name, size, cache, t8, t16, ratio = row
                print(f"{kind:8} {name:10} {size:12} {cache:5} avx2 {t8 * 1e3:8.2f} ms  avx512 {t16 * 1e3:8.2f} ms  "
                      f"avx512 speed-up {ratio:.3f}", flush=True)
    finally:
        ops.set_cpu_isa(previous)


if __name__ == "__main__":
    main()
