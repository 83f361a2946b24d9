"""Math lab 3, prefix caching: time to first token for requests sharing a 2,000-token system prompt,
cache on vs off, measured on the real engine vs the cost model.

    python bench/mathlab/prefix_caching.py [--num-requests 50] [--off-requests 2] [--threads 1]
    python bench/mathlab/prefix_caching.py --quick    # 4 requests: a smoke run

What runs (default model, SmolLM2-135M fp32, 1 torch thread, block 16, max_num_batched_tokens 2048):
every request is the same 2,000 random token ids (the system prompt, 125 full blocks) followed by 16
of its own, max_tokens=1, greedy, all queued before the first step, so time to first token is prefill.
  cache on:  all --num-requests (50) requests, as the seed prices it.
  cache off: the first --off-requests (2) only: each costs a whole 2,016-token prefill (about 15 s on
             one shared core), so 50 would take over ten minutes. With the cache off every request
             is the same work served in turn, so request i's TTFT is (i + 1) x the per-request time;
             the 50-request figures are extrapolated from the measured slope, and the model's own
             prediction for those first requests is checked against the measured ones.
Model: kvpage.costmodel.prefix_cache_ttft on this machine (roofline step time from the measured
matmul FLOP rate and memcpy bandwidth), and the same model with its FLOP rate calibrated on the one
measured uncached prefill, which separates the model's structure (who hits, which step) from its
absolute speed. The seed's own case (Llama-3-8B on an H100) is printed from the presets.
"""
from __future__ import annotations

import argparse
import dataclasses

from _common import (add_smoke_arguments, figure, output_name, print_table, random_ids, save_figure, this_device,
                     write_result)

import kvpage  # noqa: E402
from kvpage import costmodel  # noqa: E402
from kvpage.engine.llm_engine import LLMEngine  # noqa: E402

SHARED_TOKENS, UNIQUE_TOKENS, BLOCK_SIZE, BUDGET = 2000, 16, 16, 2048


def run(llm, prompts) -> tuple[list[float], dict]:
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    before = llm.stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.stats()
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return [o.metrics["ttft"] for o in outs], {"hit_tokens": hits, "steps": after["num_steps"] - before["num_steps"],
                                               "peak_kv_blocks": after["max_kv_blocks_used"]}


def calibrated(device, shape, measured_full_s: float):
    """The device with its FLOP rate scaled so one uncached prompt's prefill takes what was measured."""
    prompt = SHARED_TOKENS + UNIQUE_TOKENS
    predicted = costmodel.step_seconds(shape, device, [costmodel.Chunk(prompt, 0)], 4)
    return dataclasses.replace(device, flops_efficiency=min(1.0, predicted / measured_full_s))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--off-requests", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_arguments(parser, "4 requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests = 4
    device = this_device(args.threads)
    shared = random_ids(SHARED_TOKENS, seed=1)
    prompts = [shared + random_ids(UNIQUE_TOKENS, seed=100 + i) for i in range(args.num_requests)]
    llm = kvpage.LLM(model=args.model, num_kv_blocks=512, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
                     enable_prefix_caching=True, swap_space_gib=0)
    llm.generate([random_ids(64, seed=7)], kvpage.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    ttft_on, on_stats = run(llm, prompts)
    # Cache off: a second engine over the same runner (weights and KV pool), prefix caching disabled.
    llm.llm_engine = LLMEngine(llm.runner, llm.tokenizer,
                               dataclasses.replace(llm.llm_engine.config, enable_prefix_caching=False))
    ttft_off, off_stats = run(llm, prompts[:args.off_requests])

    n = args.num_requests
    per_request = sum(ttft_off) / sum(range(1, len(ttft_off) + 1))  # least squares through the origin
    off_extrapolated = [per_request * (i + 1) for i in range(n)]
    shape = costmodel.get_model("smollm2-135m")
    model = costmodel.prefix_cache_ttft(shape, device, n, SHARED_TOKENS, UNIQUE_TOKENS, BLOCK_SIZE, BUDGET, 4)
    cal = costmodel.prefix_cache_ttft(shape, calibrated(device, shape, ttft_off[0]), n, SHARED_TOKENS,
                                      UNIQUE_TOKENS, BLOCK_SIZE, BUDGET, 4)
    seed_case = costmodel.prefix_cache_ttft(costmodel.get_model("llama-3-8b"), costmodel.get_device("h100"), 50,
                                            SHARED_TOKENS, UNIQUE_TOKENS, BLOCK_SIZE, BUDGET)

    # Every request but the first hits (in its step or a later one), so all share one copy.
    resident = costmodel.resident_blocks(n, SHARED_TOKENS, UNIQUE_TOKENS, BLOCK_SIZE)

    def mean(xs):
        return sum(xs) / len(xs)

    rows = [
        {"quantity": "TTFT off, request 1 (s)", "measured": ttft_off[0], "model": model.ttft_off_s[0],
         "model_calibrated": cal.ttft_off_s[0]},
        {"quantity": f"TTFT off, request {args.off_requests} (s)", "measured": ttft_off[-1],
         "model": model.ttft_off_s[args.off_requests - 1], "model_calibrated": cal.ttft_off_s[args.off_requests - 1]},
        {"quantity": f"TTFT off, mean of {n} (s)", "measured": f"{mean(off_extrapolated):.3f} (extrap.)",
         "model": model.mean_off_s, "model_calibrated": cal.mean_off_s},
        {"quantity": f"TTFT off, request {n} (s)", "measured": f"{off_extrapolated[-1]:.3f} (extrap.)",
         "model": model.ttft_off_s[-1], "model_calibrated": cal.ttft_off_s[-1]},
        {"quantity": "TTFT on, request 1 (s)", "measured": ttft_on[0], "model": model.ttft_on_s[0],
         "model_calibrated": cal.ttft_on_s[0]},
        {"quantity": f"TTFT on, mean of {n} (s)", "measured": mean(ttft_on), "model": model.mean_on_s,
         "model_calibrated": cal.mean_on_s},
        {"quantity": f"TTFT on, request {n} (s)", "measured": ttft_on[-1], "model": model.ttft_on_s[-1],
         "model_calibrated": cal.ttft_on_s[-1]},
        {"quantity": "mean TTFT off / on", "measured": mean(off_extrapolated) / mean(ttft_on), "model": model.speedup,
         "model_calibrated": cal.speedup},
        {"quantity": "prefix-cache hit tokens (cache on)", "measured": on_stats["hit_tokens"],
         "model": model.saved_prefill_tokens, "model_calibrated": cal.saved_prefill_tokens},
        {"quantity": "peak KV blocks, cache on", "measured": on_stats["peak_kv_blocks"],
         "model": f"<= {resident[0]} (all {n} resident)", "model_calibrated": "-"},
        {"quantity": f"KV blocks if all {n} were resident, cache off", "measured": "-", "model": resident[1],
         "model_calibrated": "-"},
    ]
    fmt = [{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    print(f"{n} requests x ({SHARED_TOKENS} shared + {UNIQUE_TOKENS} own) tokens, max_tokens=1,"
          f" budget {BUDGET} tokens/step; {args.threads} thread(s); cache off measured on {args.off_requests}")
    print_table(fmt, ["quantity", "measured", "model", "model_calibrated"])
    print(f"seed's case (model, Llama-3-8B on H100, bf16): mean TTFT {seed_case.mean_off_s * 1e3:.0f} ms off,"
          f" {seed_case.mean_on_s * 1e3:.0f} ms on ({seed_case.speedup:.1f}x), last request"
          f" {seed_case.ttft_off_s[-1] * 1e3:.0f} -> {seed_case.ttft_on_s[-1] * 1e3:.0f} ms;"
          f" {seed_case.saved_prefill_tokens} prefill tokens saved")
    payload = {
        "config": {**vars(args), "shared_tokens": SHARED_TOKENS, "unique_tokens": UNIQUE_TOKENS,
                   "block_size": BLOCK_SIZE, "max_num_batched_tokens": BUDGET},
        "device": device, "calibrated_flops_efficiency": calibrated(device, shape, ttft_off[0]).flops_efficiency,
        "measured": {"ttft_on_s": ttft_on, "ttft_off_s": ttft_off, "on": on_stats, "off": off_stats,
                     "off_per_request_s": per_request, "off_extrapolated_s": off_extrapolated},
        "model": model, "model_calibrated": cal, "seed_case_h100_llama3_8b": seed_case,
        "table": rows,
    }
    name = output_name("prefix_caching", args.quick)
    write_result(name, payload)
    plot(ttft_on, ttft_off, off_extrapolated, model, cal, name)
    return payload


def plot(ttft_on, ttft_off, off_extrapolated, model, cal, name: str) -> None:
    fig, axes = figure(1, 2)
    ax = axes[0][0]
    idx = range(1, len(ttft_on) + 1)
    ax.plot(idx, ttft_on, "o", color="C0", label="cache on, measured")
    ax.plot(idx, model.ttft_on_s, "--", color="C0", label="cache on, model")
    ax.plot(idx, cal.ttft_on_s, ":", color="C0", label="cache on, model (calibrated)")
    ax.plot(range(1, len(ttft_off) + 1), ttft_off, "s", color="C3", label="cache off, measured")
    ax.plot(idx, off_extrapolated, "-", color="C3", alpha=0.4, label="cache off, extrapolated")
    ax.plot(idx, model.ttft_off_s, "--", color="C3", label="cache off, model")
    ax.set_yscale("log")
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("this machine: SmolLM2-135M, 2,000-token shared prompt")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    labels = ["measured\n(off extrapolated)", "model", "model\ncalibrated"]
    off = [sum(off_extrapolated) / len(off_extrapolated), model.mean_off_s, cal.mean_off_s]
    on = [sum(ttft_on) / len(ttft_on), model.mean_on_s, cal.mean_on_s]
    x = range(3)
    ax.bar_label(ax.bar([i - 0.2 for i in x], off, 0.4, color="C3", label="cache off"), fmt="%.1f")
    ax.bar_label(ax.bar([i + 0.2 for i in x], on, 0.4, color="C0", label="cache on"), fmt="%.1f")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel(f"mean TTFT over {len(ttft_on)} requests (s)")
    ax.legend()
    save_figure(fig, name)


if __name__ == "__main__":
    main()
