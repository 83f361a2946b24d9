"""GPU kernel benchmark: kvpage's CUDA ops against dense FlashAttention-2 and the device's own
copy bandwidth, measured in the same process run.

  python bench/kernels_cuda.py                 # the full issue-5 matrix (~2-3 min on an H200)
  python bench/kernels_cuda.py --quick         # a few shapes, for a smoke run
  python bench/kernels_cuda.py --flex          # also torch flex_attention over the paged cache

Decode: batch 1/16/64/256 x context 512/2048/8192; prefill: 1k and 4k tokens; Llama-3-8B
(32 q / 8 kv heads x 128) and SmolLM2 (9 / 3 x 64), fp16, block size 16, block tables a random
permutation of the cache (scattered pages). Baseline: torch SDPA with the FLASH backend on the
same K/V laid out contiguously. fp8 (e4m3) cache decode rows (Llama-3-8B shape, fp16 queries)
count bandwidth in fp8 bytes and compare with the fp16 cache at the same shape; fp8 prefill rows
(the same shape, 1k / 4k tokens) compare the two caches' prefill times. L2 is flushed (a
512 MiB memset) before every timed call; times are the median of CUDA-event timings. Decode
rows up to batch 64 also time fixed 512-token partitions against the automatic split.

Writes JSON to $OUT/kernels_cuda.json if $OUT is set, else bench/results/kernels_cuda.json, after
every row (a run cut short by a timeout still leaves what it measured), and prints a table with
the ratios the issue targets: decode GB/s vs measured copy GB/s, paged / dense time, swap GB/s
each way, copy_blocks vs copy. A case that raises is recorded (its row gets "error") and the run
goes on, unless the CUDA context is broken (illegal address, device assert): then it stops.
Importable and `--help`-able without CUDA (bench/kernels_cpu.py --device cuda runs it)."""
import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # (q heads, kv heads, head size)
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
PREFILL_TOKENS = (1024, 4096)
BLOCK_SIZE = 16
# fp8-cache decode cases (batch, context), Llama-3-8B shape; FP8_SCALE is k_scale = v_scale
# (N(0, 1) K/V over 0.02 use e4m3's range without saturating).
FP8_DECODE_CASES = ((64, 8192), (16, 2048), (1, 8192), (16, 8192), (64, 2048), (256, 2048), (256, 8192))
FP8_DECODE_QUICK = ((64, 8192), (16, 2048))
FP8_SCALE = 0.02
# Decode rows up to this batch also time fixed 512-token partitions (the automatic split's A/B).
FIXED_PARTITION_MAX_BATCH = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    p.add_argument("--flex", action="store_true", help="also time torch flex_attention over the paged cache")
    p.add_argument("--sweep-partitions", action="store_true",
                   help="decode rows also time every fixed partition size (the data behind the automatic split)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    p.add_argument("--out", default=None, help="JSON path (default $OUT/kernels_cuda.json or bench/results/)")
    return p.parse_args(argv)


class Timer:
    """Median CUDA-event time of fn, with L2 flushed before every call."""

    def __init__(self, torch, iters):
        self.torch, self.iters = torch, iters
        self.flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, warmup=2):
        torch = self.torch
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(times)


def copy_bandwidth(torch, timer, gib=2):
    """Device-to-device copy, bytes read + written per second: the roofline decode is held to."""
    a = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = timer(lambda: b.copy_(a))
    return 2 * a.numel() / t


def paged_cache(torch, ops, num_seqs, ctx, kv_heads, head_size, gen):
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, kv_heads, head_size,
                                                   dtype=torch.float16, device="cuda")
    key_cache.normal_(generator=gen), value_cache.normal_(generator=gen)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(num_seqs, blocks_per_seq).int()
    return key_cache, value_cache, tables


def dense_kv(cache, tables):
    """[num_seqs, kv_heads, ctx, D] contiguous copy of each sequence's paged K or V."""
    tiles = cache[tables.long()]  # [S, nb, H, bs, D]
    s, nb, h, bs, d = tiles.shape
    return tiles.permute(0, 2, 1, 3, 4).reshape(s, h, nb * bs, d).contiguous()


def sdpa_flash(torch, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def flex_paged_decode(torch, query, key_cache, value_cache, tables, seq_lens):
    """flex_attention over the physical cache: one query per sequence, mask = 'this page is mine
    and the slot is before my length'. Returns a callable, or raises where flex can't run."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    nb, h, bs, d = key_cache.shape
    owner = torch.full((nb,), -1, dtype=torch.int32, device="cuda")
    logical = torch.zeros(nb, dtype=torch.int32, device="cuda")
    rows, cols = tables.shape
    owner[tables.flatten().long()] = torch.arange(rows, device="cuda", dtype=torch.int32).repeat_interleave(cols)
    logical[tables.flatten().long()] = torch.arange(cols, device="cuda", dtype=torch.int32).repeat(rows)
    k = key_cache.permute(1, 0, 2, 3).reshape(1, h, nb * bs, d)
    v = value_cache.permute(1, 0, 2, 3).reshape(1, h, nb * bs, d)
    k = k.expand(rows, -1, -1, -1)
    v = v.expand(rows, -1, -1, -1)

    def mask_mod(b, hh, q_idx, kv_idx):
        page = kv_idx // bs
        return (owner[page] == b) & (logical[page] * bs + kv_idx % bs < seq_lens[b])

    mask = create_block_mask(mask_mod, rows, None, 1, nb * bs, device="cuda")
    flex = torch.compile(flex_attention)
    q = query.unsqueeze(2)
    fn = lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)  # noqa: E731
    fn()
    return fn


SWEEP_PARTITIONS = (128, 256, 512, 1024, 2048, 4096)


def bench_decode(torch, ops, timer, name, batch, ctx, copy_bw, flex, gen, sweep=False):
    hq, hkv, d = SHAPES[name]
    key_cache, value_cache, tables = paged_cache(torch, ops, batch, ctx, hkv, d, gen)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, hq, d, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty_like(query)
    t_paged = timer(lambda: ops.paged_attention(query, key_cache, value_cache, tables, seq_lens, out=out))
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    row = dict(kind="decode", shape=name, batch=batch, context=ctx, paged_s=t_paged,
               paged_gbps=kv_bytes / t_paged / 1e9, frac_of_copy_bw=kv_bytes / t_paged / copy_bw)
    if batch <= FIXED_PARTITION_MAX_BATCH:
        # The automatic split (partitions halved until the grid fills the SMs) against vLLM v2's
        # fixed 512-token partitions, the planner's previous choice at these batch sizes.
        row["fixed512_s"] = timer(lambda: ops.paged_attention(query, key_cache, value_cache, tables, seq_lens,
                                                              out=out, partition_size=512))
        row["auto_over_fixed512"] = t_paged / row["fixed512_s"]
    if sweep:
        # ctx itself: one partition, the single pass.
        row["partition_s"] = {size: timer(lambda: ops.paged_attention(query, key_cache, value_cache, tables, seq_lens,
                                                                      out=out, partition_size=size))
                              for size in SWEEP_PARTITIONS + (ctx,) if size <= ctx}
        best = min(row["partition_s"], key=row["partition_s"].get)
        row["best_partition"], row["auto_over_best"] = best, t_paged / row["partition_s"][best]
    k, v = dense_kv(key_cache, tables), dense_kv(value_cache, tables)
    q4 = query.unsqueeze(2)
    try:
        dense = sdpa_flash(torch, q4, k, v, causal=False)
        row["max_abs_err_vs_flash"] = (dense.squeeze(2) - out).abs().max().item()
        row["flash_s"] = timer(lambda: sdpa_flash(torch, q4, k, v, causal=False))
        row["paged_over_flash"] = t_paged / row["flash_s"]
    except RuntimeError as e:
        row["flash_error"] = str(e).splitlines()[0][:200]
    del k, v
    if flex:
        try:
            fn = flex_paged_decode(torch, query, key_cache, value_cache, tables, seq_lens)
            row["flex_s"] = timer(fn)
            row["paged_over_flex"] = t_paged / row["flex_s"]
        except Exception as e:  # flex is optional: record why it did not run
            row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return row


def quantize_cache_into(torch, fp8_cache, cache, scale, chunk_blocks=4096):
    """fp8_cache = reference.quantize_fp8(cache, scale), a few thousand blocks at a time (the fp32
    temporaries of a whole 8k x 256 cache would be tens of GB)."""
    from kvpage.ops import reference

    for start in range(0, cache.shape[0], chunk_blocks):
        chunk = slice(start, start + chunk_blocks)
        fp8_cache[chunk].copy_(reference.quantize_fp8(cache[chunk], scale))


def fp8_copy(torch, ops, key_cache, value_cache):
    """fp8 (e4m3) caches holding key_cache / value_cache quantised with FP8_SCALE."""
    num_blocks, hkv, _, d = key_cache.shape
    fp8_caches = ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, hkv, d, dtype=torch.float8_e4m3fn, device="cuda")
    for fp8_cache, cache in zip(fp8_caches, (key_cache, value_cache)):
        quantize_cache_into(torch, fp8_cache, cache, FP8_SCALE)
    return fp8_caches


def bench_decode_fp8(torch, ops, timer, batch, ctx, copy_bw, gen, name="llama3-8b"):
    """fp8 cache vs fp16 cache decode at one shape: the same K/V (the fp8 one quantised from the
    fp16 one), tables and fp16 queries, timed back to back."""
    hq, hkv, d = SHAPES[name]
    key_cache, value_cache, tables = paged_cache(torch, ops, batch, ctx, hkv, d, gen)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, hq, d, device="cuda", dtype=torch.float16, generator=gen)
    out16, out8 = torch.empty_like(query), torch.empty_like(query)
    t_fp16 = timer(lambda: ops.paged_attention(query, key_cache, value_cache, tables, seq_lens, out=out16))
    fp8_caches = fp8_copy(torch, ops, key_cache, value_cache)
    del key_cache, value_cache
    t_fp8 = timer(lambda: ops.paged_attention(query, *fp8_caches, tables, seq_lens, out=out8, k_scale=FP8_SCALE,
                                              v_scale=FP8_SCALE))
    kv_bytes = 2 * batch * ctx * hkv * d  # one byte per fp8 value
    return dict(kind="decode_fp8", shape=name, batch=batch, context=ctx, paged_s=t_fp8,
                paged_gbps=kv_bytes / t_fp8 / 1e9, frac_of_copy_bw=kv_bytes / t_fp8 / copy_bw,
                fp16_paged_s=t_fp16, fp8_over_fp16=t_fp8 / t_fp16,
                max_abs_err_vs_fp16=(out8.float() - out16.float()).abs().max().item(), scale=FP8_SCALE)


def bench_prefill(torch, ops, timer, name, tokens, gen):
    hq, hkv, d = SHAPES[name]
    key_cache, value_cache, tables = paged_cache(torch, ops, 1, tokens, hkv, d, gen)
    query = torch.randn(tokens, hq, d, device="cuda", dtype=torch.float16, generator=gen)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    run = lambda: ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, seq_lens, out=out)  # noqa: E731
    t_paged = timer(run)
    flops = 4 * hq * d * tokens * (tokens + 1) / 2  # causal QK^T and PV
    row = dict(kind="prefill", shape=name, tokens=tokens, paged_s=t_paged, paged_tflops=flops / t_paged / 1e12)
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = dense_kv(key_cache, tables), dense_kv(value_cache, tables)
    try:
        dense = sdpa_flash(torch, q, k, v, causal=True)
        row["max_abs_err_vs_flash"] = (dense.squeeze(0).transpose(0, 1) - out).abs().max().item()
        row["flash_s"] = timer(lambda: sdpa_flash(torch, q, k, v, causal=True))
        row["paged_over_flash"] = t_paged / row["flash_s"]
    except RuntimeError as e:
        row["flash_error"] = str(e).splitlines()[0][:200]
    return row


def bench_prefill_fp8(torch, ops, timer, name, tokens, gen):
    """fp8 cache vs fp16 cache prefill (both on tensor cores) at one shape: the same K/V (the fp8
    one quantised from the fp16 one), tables and fp16 queries, timed back to back."""
    hq, hkv, d = SHAPES[name]
    key_cache, value_cache, tables = paged_cache(torch, ops, 1, tokens, hkv, d, gen)
    query = torch.randn(tokens, hq, d, device="cuda", dtype=torch.float16, generator=gen)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    out16, out8 = torch.empty_like(query), torch.empty_like(query)
    t_fp16 = timer(lambda: ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, seq_lens,
                                                       out=out16))
    fp8_caches = fp8_copy(torch, ops, key_cache, value_cache)
    t_fp8 = timer(lambda: ops.paged_prefill_attention(query, *fp8_caches, tables, starts, seq_lens, out=out8,
                                                      k_scale=FP8_SCALE, v_scale=FP8_SCALE))
    flops = 4 * hq * d * tokens * (tokens + 1) / 2
    return dict(kind="prefill_fp8", shape=name, tokens=tokens, paged_s=t_fp8, paged_tflops=flops / t_fp8 / 1e12,
                fp16_paged_s=t_fp16, fp8_over_fp16=t_fp8 / t_fp16,
                max_abs_err_vs_fp16=(out8.float() - out16.float()).abs().max().item(), scale=FP8_SCALE)


def bench_swap_and_copy(torch, ops, timer, copy_bw, layers=8, blocks=4096, moved=2048):
    """Llama-3-8B blocks (16 tokens x 8 kv heads x 128, fp16 = 32 KiB per K or V)."""
    shape = (blocks, 8, BLOCK_SIZE, 128)
    gpu = [torch.zeros(shape, dtype=torch.float16, device="cuda") for _ in range(2 * layers)]
    host = [torch.zeros(shape, dtype=torch.float16).pin_memory() for _ in range(2 * layers)]
    perm = torch.randperm(blocks)
    mapping = torch.stack([perm[:moved], perm[moved:2 * moved]], 1)
    nbytes = moved * 2 * layers * gpu[0][0].numel() * 2
    rows = []
    for direction, src, dst in (("gpu->host", gpu, host), ("host->gpu", host, gpu)):
        t = timer(lambda: ops.swap_blocks(src, dst, mapping))
        rows.append(dict(kind="swap", direction=direction, bytes=nbytes, seconds=t, gbps=nbytes / t / 1e9))
    keys, values = gpu[:layers], gpu[layers:]
    half = mapping[: moved // 2]  # sources and destinations disjoint
    cbytes = 2 * half.shape[0] * 2 * layers * gpu[0][0].numel() * 2  # read + write
    t = timer(lambda: ops.copy_blocks(keys, values, half))
    rows.append(dict(kind="copy_blocks", bytes_moved=cbytes, seconds=t, gbps=cbytes / t / 1e9,
                     frac_of_copy_bw=cbytes / t / copy_bw))
    return rows


class Recorder:
    """The result dict, rewritten to path after every row (atomically: a reader or a timeout never
    sees half a file)."""

    def __init__(self, path, result):
        self.path, self.result = path, result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def add(self, rows):
        self.result["rows"] += rows if isinstance(rows, list) else [rows]
        self.save()

    def save(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)


# Errors after which the CUDA context is unusable: every later call would fail the same way.
_STICKY_MARKERS = ("illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
                   "misaligned address", "an illegal instruction", "invalid program counter",
                   "CUDA error: unknown")


def cuda_context_broken(torch, error):
    """Whether error (just raised by a case) left the CUDA context unusable."""
    if any(marker in str(error) for marker in _STICKY_MARKERS):
        return True
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return False
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True


def run_case(torch, recorder, describe, fn):
    """Runs one measured case; records its row(s), or a row with the error. False when the CUDA
    context broke (stop: every later case would fail)."""
    try:
        recorder.add(fn())
        return True
    except Exception as e:  # noqa: BLE001 - a failed case must not lose the others
        row = dict(describe, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}")
        broken = cuda_context_broken(torch, e)
        row["cuda_context_broken"] = broken
        recorder.add(row)
        print(f"kernels_cuda: {describe} FAILED: {row['error']}", file=sys.stderr)
        return not broken
    finally:
        if torch.cuda.is_initialized():
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a broken context: the caller stops anyway
                pass


def cases(args):
    """(description, callable(torch, ops, timer, copy_bw, gen)) in run order: the fp8 decode and
    prefill rows first (quick, and the newest kernels), then the fp16 matrix, then swap / copy_blocks."""
    shapes = [s for s in args.shapes.split(",") if s]
    batches, contexts, prefills = DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_TOKENS
    fp8_cases = FP8_DECODE_CASES
    if args.quick:
        batches, contexts, prefills, fp8_cases = (1, 64), (512, 8192), (1024,), FP8_DECODE_QUICK

    def fp8_decode(batch, ctx):
        return lambda torch, ops, timer, bw, gen: bench_decode_fp8(torch, ops, timer, batch, ctx, bw, gen)

    def decode(name, batch, ctx, flex):
        return lambda torch, ops, timer, bw, gen: bench_decode(torch, ops, timer, name, batch, ctx, bw, flex, gen,
                                                               args.sweep_partitions)

    def prefill(name, tokens):
        return lambda torch, ops, timer, bw, gen: bench_prefill(torch, ops, timer, name, tokens, gen)

    def fp8_prefill(tokens):
        return lambda torch, ops, timer, bw, gen: bench_prefill_fp8(torch, ops, timer, "llama3-8b", tokens, gen)

    out = [(dict(kind="decode_fp8", shape="llama3-8b", batch=b, context=c), fp8_decode(b, c)) for b, c in fp8_cases]
    out += [(dict(kind="prefill_fp8", shape="llama3-8b", tokens=t), fp8_prefill(t)) for t in prefills]
    for name in shapes:
        for batch in batches:
            for ctx in contexts:
                flex = args.flex and name == "llama3-8b" and batch == 64 and ctx == 8192  # one compile
                out.append((dict(kind="decode", shape=name, batch=batch, context=ctx), decode(name, batch, ctx, flex)))
        for tokens in prefills:
            out.append((dict(kind="prefill", shape=name, tokens=tokens), prefill(name, tokens)))
    out.append((dict(kind="swap_and_copy"), lambda torch, ops, timer, bw, gen: bench_swap_and_copy(torch, ops, timer, bw)))
    return out


def output_path(args):
    if args.out:
        return Path(args.out)
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    return base / "kernels_cuda.json"


def run(args, path=None):
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("kernels_cuda: no CUDA device")
    from kvpage import ops

    if not ops.built_with_cuda:
        raise SystemExit("kernels_cuda: kvpage was built without CUDA kernels")
    ops.set_range_checks(False)  # benchmarks feed known-good indices: no host sync per call
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = Timer(torch, args.iters)

    t0 = time.time()
    copy_bw = copy_bandwidth(torch, timer)
    recorder = Recorder(path or output_path(args),
                        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                             copy_gbps=copy_bw / 1e9, rows=[], complete=False))
    for describe, fn in cases(args):
        if not run_case(torch, recorder, describe, lambda: fn(torch, ops, timer, copy_bw, gen)):
            recorder.result["stopped"] = f"CUDA context broken at {describe}"
            break
        recorder.result["seconds"] = time.time() - t0
    else:
        recorder.result["complete"] = True
    recorder.result["seconds"] = time.time() - t0
    recorder.save()
    return recorder.result


def print_table(result):
    print(f"\n{result['device']}  torch {result['torch']}  CUDA {result['cuda']}  "
          f"device copy {result['copy_gbps']:.0f} GB/s (read + write)")
    print(f"{'op':8} {'shape':10} {'size':>12} {'kvpage':>10} {'GB/s|TF/s':>10} {'%copy':>6} "
          f"{'flash':>10} {'paged/fl':>8} {'flex/pg':>8} {'maxerr':>8}")
    fmt_t = lambda s: f"{s * 1e6:8.1f}us" if s is not None else f"{'-':>10}"  # noqa: E731
    for r in result["rows"]:
        if "error" in r:
            what = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("kind", "error", "cuda_context_broken"))
            print(f"{r['kind']:8} {what}  ERROR {r['error']}")
        elif r["kind"] == "decode_fp8":
            size = f"b{r['batch']}x{r['context']}"
            print(f"{'dec fp8':8} {r['shape']:10} {size:>12} {fmt_t(r['paged_s'])} {r['paged_gbps']:10.1f} "
                  f"{100 * r['frac_of_copy_bw']:5.0f}%  fp16 cache {fmt_t(r['fp16_paged_s'])}  "
                  f"fp8/fp16 {r['fp8_over_fp16']:5.2f}  maxerr vs fp16 {r['max_abs_err_vs_fp16']:8.1e}")
        elif r["kind"] == "prefill_fp8":
            size = f"{r['tokens']} tok"
            print(f"{'pre fp8':8} {r['shape']:10} {size:>12} {fmt_t(r['paged_s'])} {r['paged_tflops']:10.1f} "
                  f"{'':6} fp16 cache {fmt_t(r['fp16_paged_s'])}  "
                  f"fp8/fp16 {r['fp8_over_fp16']:5.2f}  maxerr vs fp16 {r['max_abs_err_vs_fp16']:8.1e}")
        elif r["kind"] in ("decode", "prefill"):
            size = f"b{r['batch']}x{r['context']}" if r["kind"] == "decode" else f"{r['tokens']} tok"
            rate = r.get("paged_gbps", r.get("paged_tflops"))
            frac = f"{100 * r['frac_of_copy_bw']:5.0f}%" if "frac_of_copy_bw" in r else f"{'':6}"
            flex = f"{r['flex_s'] / r['paged_s']:8.2f}" if "flex_s" in r else f"{'-':>8}"
            ratio = f"{r['paged_over_flash']:8.2f}" if "paged_over_flash" in r else f"{'n/a':>8}"
            err = f"{r['max_abs_err_vs_flash']:8.1e}" if "max_abs_err_vs_flash" in r else f"{'-':>8}"
            vs512 = f"  auto/p512 {r['auto_over_fixed512']:5.2f}" if "auto_over_fixed512" in r else ""
            if "best_partition" in r:
                vs512 += f"  auto/best {r['auto_over_best']:5.2f} (p{r['best_partition']})"
            print(f"{r['kind']:8} {r['shape']:10} {size:>12} {fmt_t(r['paged_s'])} {rate:10.1f} {frac} "
                  f"{fmt_t(r.get('flash_s'))} {ratio} {flex} {err}{vs512}")
            for key in ("flash_error", "flex_error"):
                if key in r:
                    print(f"{'':8} {key}: {r[key]}")
        elif r["kind"] == "swap":
            print(f"swap     {r['direction']:10} {r['bytes'] / 2**20:9.0f}MiB {fmt_t(r['seconds'])} {r['gbps']:10.1f}")
        else:
            print(f"copyblk  {'llama3-8b':10} {r['bytes_moved'] / 2**20:9.0f}MiB {fmt_t(r['seconds'])} "
                  f"{r['gbps']:10.1f} {100 * r['frac_of_copy_bw']:5.0f}%")


def main(argv=None):
    args = parse_args(argv)
    path = output_path(args)
    result = run(args, path)
    print_table(result)
    print(f"\nwrote {path}" + ("" if result.get("complete") else f" (INCOMPLETE: {result.get('stopped')})"),
          file=sys.stderr)
    failed = [r for r in result["rows"] if "error" in r]
    if failed or not result.get("complete"):
        raise SystemExit(f"kernels_cuda: {len(failed)} case(s) failed")


if __name__ == "__main__":
    main()
