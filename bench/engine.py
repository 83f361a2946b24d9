"""End-to-end throughput: kvpage vs vLLM's CPU backend, HF `generate_batch` and HF static `generate`.

Workload (kvpage.engine.workload, seed 0): 64 requests sharing a ~120-token system prompt, each with its own
short question, output lengths uniform in 16..128, greedy, ignore_eos. Default model (SmolLM2-135M-Instruct),
fp32, all threads, every system in this one benchmark run. Every engine gets the same prompt token ids and
first warms up on a workload of the same shapes with other tokens (nothing a prefix cache could reuse).
vLLM (with --vllm) runs in its own venv and process (bench/peers/); kvpage and vLLM run with prefix caching
on and off, each peer compared with kvpage at the same setting. Also the FLOP roofline: the model FLOPs
kvpage computed (prompt tokens not served from the prefix cache + output tokens) at the FLOP rate of a large
fp32 matmul measured here. Writes bench/results/engine.json and engine.png and prints a table.

    bash bench/peers/setup_vllm.sh    # once: vLLM CPU in ~/.cache/kvpage/vllm-venv
    python bench/engine.py --vllm     # full run (many minutes on 2 cores)
    python bench/engine.py            # kvpage and the HF baselines
    python bench/engine.py --quick    # 8 short requests: a smoke test
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine_info, print_table, write_json  # noqa: E402
from peers.vllm_launcher import run_vllm  # noqa: E402

import kvpage  # noqa: E402
from kvpage.engine.workload import Workload, make_workload, percentile, quick_workload, run_kvpage  # noqa: E402
from kvpage.model.loader import default_model_dir  # noqa: E402

STATIC_BATCH = 16


def matmul_flops_per_s(n: int = 1024, iters: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n**3 * iters / (time.perf_counter() - start)


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
    own max_new_tokens, through the manager that generate_batch itself drives."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=None,
                              pad_token_id=tokenizer.eos_token_id)
    inputs = [tokenizer.encode(p) for p in workload.prompts]
    start = time.perf_counter()
    tokens, first = 0, {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
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


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["system"] for r in rows]
    ax.bar(names, [r["output_tok_s"] for r in rows])
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M fp32, 64 requests sharing a system prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 short requests (smoke run)")
    parser.add_argument("--no-peers", action="store_true", help="kvpage only")
    parser.add_argument("--vllm", action="store_true",
                        help="also vLLM's CPU backend (its own venv: bash bench/peers/setup_vllm.sh), and both"
                             " engines with prefix caching on and off")
    parser.add_argument("--no-hf", action="store_true", help="skip the two HF baselines")
    args = parser.parse_args(argv)
    workload = quick_workload() if args.quick else make_workload()
    tokenizer = _tokenizer()
    prompts, warmup = tokenized(workload, tokenizer)
    res = {}
    for caching in ((True, False) if args.vllm else (True,)):
        name = "kvpage" if caching else "kvpage_no_prefix_cache"
        llm = kvpage.LLM(enable_prefix_caching=caching)
        run_kvpage(llm, Workload(warmup, workload.output_lens))  # same shapes, other tokens: one-time costs
        res[name] = run_kvpage(llm, Workload(prompts, workload.output_lens))
        print(f"{name}: {res[name]['output_tok_s']:.1f} output tok/s ({res[name]['seconds']:.1f}s)", flush=True)
        if caching:
            res["roofline"] = roofline(llm.model.config, res[name], workload)
        del llm
        gc.collect()
    if args.vllm and not args.no_peers:
        for caching in (True, False):
            res["vllm" if caching else "vllm_no_prefix_cache"] = _run_peer(
                run_vllm, str(default_model_dir()), prompts, warmup, workload.output_lens, caching,
                kvpage.engine.llm.CPU_KV_CACHE_GIB, torch.get_num_threads())
    if not args.no_peers and not args.no_hf:
        hf, tok = _hf_model()
        for name, fn in (("hf_generate_batch", run_hf_generate_batch), ("hf_static_generate", run_hf_static)):
            res[name] = _run_peer(fn, hf, tok, workload)
    return report(res, workload, args.quick)


def tokenized(workload, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts as token ids (every engine gets the same ids), and a warm-up set of the same shapes
    whose tokens differ from the first on, so warming up leaves nothing in a prefix cache to hit."""
    prompts = [tokenizer.encode(p) for p in workload.prompts]
    marker = tokenizer.encode("Note:", add_special_tokens=False)[0]
    return prompts, [[marker] + p[1:] for p in prompts]


def roofline(config, kv_result: dict, workload) -> dict:
    flops = kvpage_flops(config, kv_result, workload)
    rate = matmul_flops_per_s()
    return {"model_gflop": flops / 1e9, "matmul_gflop_s": rate / 1e9, "roofline_seconds": flops / rate,
            "fraction": flops / rate / kv_result["seconds"]}


def _run_peer(fn, *args) -> dict:
    """A peer that fails is reported in the table (its error), not hidden and not fatal."""
    try:
        return fn(*args)
    except Exception as e:
        print(f"peer {getattr(fn, '__name__', fn)} failed: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def _hf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(default_model_dir())
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
        if "output_tok_s" in res[name] and "output_tok_s" in ours:
            ratio = ours["output_tok_s"] / res[name]["output_tok_s"]
            row["kvpage_speedup"] = f"{ratio:.2f}x"
            res[f"speedup_vs_{name}"] = ratio
        rows.append(row)
    roof, kv = res["roofline"], res["kvpage"]
    rows.append({"system": "roofline", "output_tok_s": f"{workload.num_output_tokens / roof['roofline_seconds']:.1f}",
                 "kvpage_speedup": f"kvpage at {100 * roof['fraction']:.0f}%"})
    print_table(rows, ["system", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "seconds", "kvpage_speedup"])
    print(f"prefix-cache hit rate {kv['prefix_cache_hit_rate']:.0%}, preemptions {kv['num_preemptions']},"
          f" peak KV blocks {kv['max_kv_blocks_used']}/{kv['num_kv_blocks']};"
          f" matmul {roof['matmul_gflop_s']:.0f} GFLOP/s")
    name = "engine_quick" if quick else "engine"
    payload = {"workload": {"num_requests": len(workload.prompts), "output_tokens": workload.num_output_tokens,
                            "seed": 0}, "machine": machine_info(), **res}
    write_json(name, payload)
    bars = [{"system": k, "output_tok_s": res[k]["output_tok_s"]} for k in SYSTEMS
            if "output_tok_s" in res.get(k, {})]
    plot(bars + [{"system": "roofline", "output_tok_s": workload.num_output_tokens / roof["roofline_seconds"]}],
         RESULTS_DIR / f"{name}.png")
    return payload


def _fmt(r: dict) -> dict:
    if "error" in r:
        return {"output_tok_s": r["error"][:60]}
    return {k: f"{r[k]:.3f}" if "ttft" in k or k == "seconds" else f"{r[k]:.1f}"
            for k in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "seconds")}


if __name__ == "__main__":
    main()
