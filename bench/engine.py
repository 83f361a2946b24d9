"""End-to-end throughput: kvpage vs vLLM's CPU backend, HF `generate_batch` and HF static `generate`.

Workload (kvpage.engine.workload, seed 0): 64 requests sharing a ~120-token system prompt, each with its own
short question, output lengths uniform in 16..128, greedy, ignore_eos. Default model (SmolLM2-135M-Instruct),
fp32, all threads, every system in this one benchmark run. Every engine gets the same prompt token ids and
first warms up on a workload of the same shapes with other tokens (nothing a prefix cache could reuse).
vLLM (with --vllm) runs in its own venv and process (bench/peers/); kvpage and vLLM run with prefix caching
on and off, each peer compared with kvpage at the same setting. Also the FLOP roofline: the model FLOPs
kvpage computed (prompt tokens not served from the prefix cache + output tokens) at the FLOP rate of the
fastest large fp32 matmul measured here (torch's, or kvpage's slab kernel). Writes
bench/results/engine.json and engine.png and prints a table.

This machine's speed drifts by +-15% over minutes, so kvpage and vLLM take turns: ROUNDS timed runs each
per setting, alternating (vLLM's engine stays up between its runs), every round on its own variant of the
prompts (another first token, so no round hits another's prefix cache; same shapes, same work). Reported:
each system's median run (of an even number, the slower middle one), and kvpage/vLLM as the median of
the per-round ratios (of an even number, the mean of the middle two). The HF baselines, ~5x
slower, run once.

    bash bench/peers/setup_vllm.sh    # once: vLLM CPU in ~/.cache/kvpage/vllm-venv
    python bench/engine.py --vllm     # full run (many minutes on 2 cores)
    python bench/engine.py            # kvpage and the HF baselines
    python bench/engine.py --quick    # 8 short requests: a smoke test
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUICK_ENGINE_ARGS, RESULTS_DIR, add_model_argument, hf_continuous_batching_config,  # noqa: E402
                    machine_info, model_dir, print_table, wait_until_idle, write_json)
from peers.vllm_launcher import VllmPeer  # noqa: E402

import kvpage  # noqa: E402
from kvpage.engine.workload import Workload, make_workload, percentile, quick_workload, run_kvpage  # noqa: E402
from kvpage.model import cpu_layout  # noqa: E402
from kvpage.ops import layers  # noqa: E402

STATIC_BATCH = 16
ROUNDS = 3
# First tokens of the warm-up set and of each round's variant of the prompts (distinct, and none is the
# system prompt's own first token), so nothing carries over in a prefix cache between them.
MARKER_WORDS = ("Note", "Memo", "Draft", "Copy", "Aside", "Brief", "Entry", "Record")


def matmul_flops_per_s(n: int = 1024, iters: int = 10, samples: int = 5) -> float:
    """The fp32 FLOP rate of the fastest n^3 matmul here: torch's (MKL's sgemm) or, where the CPU runs
    it, kvpage's slab kernel (on AMD CPUs MKL takes a slow path: 192 vs ~400 GFLOP/s on a Zen 5 VM, so
    MKL alone made a roofline kvpage ran above). Median of `samples` timings of `iters` products (one
    short sample swings by +-20% on this shared machine)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    products = [lambda: a @ b]
    if cpu_layout.slab_kernel_available():
        packed = layers.pack_linear_weight(b.t().contiguous())
        products.append(lambda: layers.packed_linear(a, packed, n))
    return max(_flop_rate(product, n, iters, samples) for product in products)


def _flop_rate(product, n: int, iters: int, samples: int) -> float:
    product()
    rates = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(iters):
            product()
        rates.append(2 * n**3 * iters / (time.perf_counter() - start))
    return statistics.median(rates)


def model_flops(config, num_tokens: int, context_sum: int, num_sampled: int) -> float:
    """Linear layers 2 * params per token, attention 4 * heads * head_dim per (query, key) pair,
    the vocab projection only for sampled tokens."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_token = 2 * layers * (h * q + 2 * h * kv + q * h + 3 * h * i)
    attention = 4 * layers * q * context_sum
    return per_token * num_tokens + attention + 2 * h * config.vocab_size * num_sampled


def kvpage_flops(config, res: dict, workload) -> float:
    prompt_lens = [len(o.prompt_token_ids) for o in res["outputs"]]
    computed_prompt = sum(prompt_lens) - res["prefix_cache_hit_tokens"]
    # Context each token attends over: prompt tokens ~ half their prompt, output tokens their position.
    ctx = sum(p * p // 2 for p in prompt_lens)
    ctx += sum(n * p + n * n // 2 for p, n in zip(prompt_lens, workload.output_lens))
    return model_flops(config, computed_prompt + workload.num_output_tokens, ctx, workload.num_output_tokens)


def run_hf_static(model, tokenizer, workload) -> dict:
    """HF generate in fixed batches of STATIC_BATCH, left padding: each batch runs to its longest output."""
    tokenizer.padding_side = "left"
    start, ttfts = time.perf_counter(), []
    for b in range(0, len(workload.prompts), STATIC_BATCH):
        prompts = workload.prompts[b:b + STATIC_BATCH]
        n = max(workload.output_lens[b:b + STATIC_BATCH])
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        batch_start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        # A static batch returns all at once: its first tokens are as late as the batch's prefill plus
        # everything before it; estimate the prefill as one decode step's share is not possible, so take
        # the batch's start (a lower bound).
        ttfts += [batch_start - start] * len(prompts)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": workload.num_output_tokens,
            "output_tok_s": workload.num_output_tokens / elapsed,
            "ttft_p50_s": percentile(sorted(ttfts), 50), "ttft_p99_s": percentile(sorted(ttfts), 99),
            "note": "TTFT is a lower bound (batch start); tokens past a request's length are not counted"}


def run_hf_generate_batch(model, tokenizer, workload) -> dict:
    """transformers' continuous batching (its default paged attention), one request per prompt with its
    own max_new_tokens, through the manager that generate_batch itself drives; its KV cache sized for the
    workload (common.hf_continuous_batching_config)."""
    from transformers import GenerationConfig

    # eos_token_id=-1: HF's own "no end of sequence" (None makes it warn, then set -1), so each request runs
    # to its length as kvpage's ignore_eos requests do.
    config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1,
                              pad_token_id=tokenizer.eos_token_id)
    inputs = [tokenizer.encode(p) for p in workload.prompts]
    start = time.perf_counter()
    tokens, first = 0, {}
    cb_config = hf_continuous_batching_config([len(x) for x in inputs], workload.output_lens)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                   continuous_batching_config=cb_config) as manager:
        ids = [manager.add_request(x, request_id=f"r{i}", max_new_tokens=n, streaming=True)
               for i, (x, n) in enumerate(zip(inputs, workload.output_lens))]
        done = set()
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped early")
                continue
            first.setdefault(result.request_id, time.perf_counter() - start)
            if result.is_finished():
                done.add(result.request_id)
                tokens += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    ttfts = sorted(first.values())
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def plot(rows, path, dtype: str = "fp32"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["system"] for r in rows]
    ax.bar(names, [r["output_tok_s"] for r in rows])
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M {dtype}, 64 requests sharing a system prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 short requests (smoke run)")
    parser.add_argument("--no-peers", action="store_true", help="kvpage only")
    parser.add_argument("--vllm", action="store_true",
                        help="also vLLM's CPU backend (its venv: bash bench/peers/setup_vllm.sh), and both"
                             " engines with prefix caching on and off")
    parser.add_argument("--no-hf", action="store_true", help="skip the two HF baselines")
    parser.add_argument("--rounds", type=int, default=None, help=f"timed runs per engine and setting"
                        f" (default {ROUNDS}, 1 with --quick)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="kvpage's KV cache dtype (fp8: float8_e4m3fn, not token-identical)")
    parser.add_argument("--bf16", action="store_true",
                        help="weights and KV cache in bfloat16: kvpage's weight_dtype and kv_cache_dtype"
                             " 'bfloat16' (float32 compute) against vLLM's dtype='bfloat16'")
    parser.add_argument("--matmul-precision", choices=("highest", "medium"), default="highest",
                        help="kvpage's matmul_precision (medium: bf16 dot products in the linears where the CPU"
                             " has AVX512-BF16; with --bf16, vLLM's bf16 arithmetic's counterpart)")
    add_model_argument(parser)
    args = parser.parse_args(argv)
    if args.bf16 and args.kv_cache_dtype != "auto":
        parser.error("--bf16 sets the KV cache dtype itself")
    workload = quick_workload() if args.quick else make_workload()
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    if not 1 <= rounds < len(MARKER_WORDS):
        parser.error(f"--rounds must be in 1..{len(MARKER_WORDS) - 1}")
    warmup, by_round = tokenized(workload, _tokenizer(args.model), rounds)
    engine_args = {"model": args.model, **(QUICK_ENGINE_ARGS if args.quick else {})}
    res = {"rounds": rounds}
    with_vllm = args.vllm and not args.no_peers
    for caching in ((True, False) if args.vllm else (True,)):
        res.update(compare(caching, with_vllm, workload, warmup, by_round, args.kv_cache_dtype, args.bf16,
                           args.matmul_precision, engine_args, args.quick))
        gc.collect()
    if not args.no_peers and not args.no_hf:
        hf, tok = _hf_model(args.model)
        baselines = (("hf_generate_batch", run_hf_generate_batch), ("hf_static_generate", run_hf_static))
        hf_workload = workload
        if args.quick:  # a smoke run: static generate on 2 requests of 4 tokens (generate_batch's set-up alone
            baselines, hf_workload = baselines[1:], make_workload(num_requests=2, min_out=4, max_out=4)  # ~20 s)
        for name, fn in baselines:
            res[name] = _run_peer(fn, hf, tok, hf_workload)
    res["bf16"], res["matmul_precision"] = args.bf16, args.matmul_precision
    return report(res, workload, args.quick)


def compare(caching: bool, with_vllm: bool, workload, warmup, by_round, kv_cache_dtype: str = "auto",
            bf16: bool = False, matmul_precision: str = "highest", engine_args: dict | None = None,
            quick: bool = False) -> dict:
    """kvpage (and vLLM) at one prefix-caching setting, taking turns round by round (kvpage's KV cache
    in kv_cache_dtype; vLLM's stays in the model's dtype). bf16: both store weights and K/V in bfloat16
    (vLLM computes in it too, kvpage in float32 unless matmul_precision is "medium"). engine_args: more of
    kvpage.LLM's arguments (model: --model's directory, also vLLM's; the smoke run's pool sizes).
    quick: a smoke run, which waits for no quiet machine and times the roofline's matmul briefly."""
    idle_wait_s = 0.0 if quick else 15.0
    engine_args = engine_args or {}
    name, peer_name = ("kvpage", "vllm") if caching else ("kvpage_no_prefix_cache", "vllm_no_prefix_cache")
    storage = dict(weight_dtype="bfloat16", kv_cache_dtype="bfloat16") if bf16 else dict(kv_cache_dtype=kv_cache_dtype)
    llm = kvpage.LLM(enable_prefix_caching=caching, matmul_precision=matmul_precision, **storage, **engine_args)
    run_kvpage(llm, Workload(warmup, workload.output_lens))  # same shapes, other tokens: one-time costs
    peer, peer_error = None, None
    if with_vllm:
        try:
            peer = VllmPeer(str(model_dir(engine_args.get("model"))), warmup, workload.output_lens, caching,
                            kvpage.engine.llm.CPU_KV_CACHE_GIB, torch.get_num_threads(),
                            dtype="bfloat16" if bf16 else "float32")
        except Exception as e:  # reported in the table, not fatal (no vLLM venv here: kvpage runs alone)
            peer_error = f"{type(e).__name__}: {e}"
            print(f"{peer_name} skipped: {peer_error}", flush=True)
    ours, theirs, roofs = [], [], []
    try:
        for prompts in by_round:
            wait_until_idle(idle_wait_s)  # each system's round starts on a quiet machine
            ours.append(run_kvpage(llm, Workload(prompts, workload.output_lens)))
            if caching:
                roofs.append(roofline(llm.model.config, ours[-1], workload, quick))
            ours[-1].pop("outputs")
            print(f"{name}: {ours[-1]['output_tok_s']:.1f} output tok/s ({ours[-1]['seconds']:.1f}s)", flush=True)
            if peer is not None and peer_error is None:
                try:
                    wait_until_idle(idle_wait_s)
                    theirs.append(peer.run(prompts))
                    print(f"{peer_name}: {theirs[-1]['output_tok_s']:.1f} output tok/s", flush=True)
                except Exception as e:
                    peer_error = f"{type(e).__name__}: {e}"
    finally:
        if peer is not None:
            peer.close()
    out = {name: median_run(ours)}
    if roofs:
        out["roofline"] = {**middle_run(roofs, "fraction"),
                           "fractions": [r["fraction"] for r in roofs]}
    if with_vllm:
        out[peer_name] = {"error": peer_error} if peer_error else median_run(theirs)
        if not peer_error:
            ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(ours, theirs)]
            out[f"paired_speedup_vs_{peer_name}"] = {"median": statistics.median(ratios), "rounds": ratios}
    return out


def middle_run(runs: list[dict], key: str) -> dict:
    """The run at the median of runs[key]; of an even number, the lower of the middle two (a run is
    reported whole, so it cannot be their mean; the upper one would flatter every system)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def median_run(runs: list[dict]) -> dict:
    """The run with the median output tokens/s (middle_run), and every run's figure."""
    return {**middle_run(runs, "output_tok_s"), "runs_tok_s": [r["output_tok_s"] for r in runs]}


def tokenized(workload, tokenizer, rounds: int):
    """Every engine gets the same token ids: a warm-up set of the workload's shapes whose tokens differ
    from the first on (warming up leaves nothing in a prefix cache to hit), and the prompts of each timed
    round: round 0 the workload's prompts, round r the same with its own first token."""
    prompts = [tokenizer.encode(p) for p in workload.prompts]
    markers = [tokenizer.encode(w, add_special_tokens=False)[0] for w in MARKER_WORDS]
    if len(set(markers)) != len(markers) or prompts[0][0] in markers:
        raise RuntimeError(f"MARKER_WORDS must start with distinct tokens, none the prompts' first: {markers}")

    def variant(marker):
        return [[marker] + p[1:] for p in prompts]

    return variant(markers[0]), [prompts] + [variant(m) for m in markers[1:rounds]]


def roofline(config, kv_result: dict, workload, quick: bool = False) -> dict:
    flops = kvpage_flops(config, kv_result, workload)
    rate = matmul_flops_per_s(256, iters=2, samples=1) if quick else matmul_flops_per_s()
    return {"model_gflop": flops / 1e9, "matmul_gflop_s": rate / 1e9, "roofline_seconds": flops / rate,
            "fraction": flops / rate / kv_result["seconds"]}


def _run_peer(fn, *args) -> dict:
    """A peer that fails is reported in the table (its error), not hidden and not fatal."""
    try:
        return fn(*args)
    except Exception as e:
        print(f"peer {getattr(fn, '__name__', fn)} failed: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def _tokenizer(model: str | None = None):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir(model)))


def _hf_model(model: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(model_dir(model))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


# Each peer is compared with the kvpage run of the same prefix-caching setting.
PEERS = {"vllm": "kvpage", "vllm_no_prefix_cache": "kvpage_no_prefix_cache",
         "hf_generate_batch": "kvpage", "hf_static_generate": "kvpage"}
SYSTEMS = ("kvpage", "kvpage_no_prefix_cache", *PEERS)


def report(res: dict, workload, quick: bool) -> dict:
    rows = []
    for name in SYSTEMS:
        if name not in res:
            continue
        res[name].pop("outputs", None)
        row = {"system": name, **_fmt(res[name])}
        ours = res.get(PEERS.get(name), {})
        paired = res.get(f"paired_speedup_vs_{name}")
        if paired:  # alternating rounds: the median of the per-round ratios
            row["kvpage_speedup"] = f"{paired['median']:.2f}x (rounds " + \
                ", ".join(f"{r:.2f}" for r in paired["rounds"]) + ")"
            res[f"speedup_vs_{name}"] = paired["median"]
        elif "output_tok_s" in res[name] and "output_tok_s" in ours:
            ratio = ours["output_tok_s"] / res[name]["output_tok_s"]
            row["kvpage_speedup"] = f"{ratio:.2f}x"
            res[f"speedup_vs_{name}"] = ratio
        rows.append(row)
    roof, kv = res["roofline"], res["kvpage"]
    rows.append({"system": "roofline", "output_tok_s": f"{workload.num_output_tokens / roof['roofline_seconds']:.1f}",
                 "kvpage_speedup": f"kvpage at {100 * roof['fraction']:.0f}% (rounds "
                 + ", ".join(f"{100 * f:.0f}%" for f in roof["fractions"]) + ")"})
    print_table(rows, ["system", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "seconds", "kvpage_speedup"])
    print(f"prefix-cache hit rate {kv['prefix_cache_hit_rate']:.0%}, preemptions {kv['num_preemptions']},"
          f" peak KV blocks {kv['max_kv_blocks_used']}/{kv['num_kv_blocks']};"
          f" matmul {roof['matmul_gflop_s']:.0f} GFLOP/s")
    name = ("engine_quick" if quick else "engine") + ("_bf16" if res.get("bf16") else "") + \
        ("_medium" if res.get("matmul_precision") == "medium" else "")
    payload = {"workload": {"num_requests": len(workload.prompts), "output_tokens": workload.num_output_tokens,
                            "seed": 0}, "machine": machine_info(), **res}
    write_json(name, payload)
    bars = [{"system": k, "output_tok_s": res[k]["output_tok_s"]} for k in SYSTEMS
            if "output_tok_s" in res.get(k, {})]
    plot(bars + [{"system": "roofline", "output_tok_s": workload.num_output_tokens / roof["roofline_seconds"]}],
         RESULTS_DIR / f"{name}.png", "bf16" if res.get("bf16") else "fp32")
    return payload


def _fmt(r: dict) -> dict:
    if "error" in r:
        return {"output_tok_s": r["error"][:60]}
    return {k: f"{r[k]:.3f}" if "ttft" in k or k == "seconds" else f"{r[k]:.1f}"
            for k in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "seconds")}


if __name__ == "__main__":
    main()
