"""Scheduler under memory pressure: victim policies x preemption modes on a ShareGPT-like workload.

    PYTHONPATH=python python bench/scheduler_sim.py [--num-requests 400] [--num-blocks 1024]
    python bench/scheduler_sim.py --quick    # 40 requests on 256 blocks: a smoke run

No model runs: the real Scheduler and BlockManager make every decision, and a simulated clock
advances by a stated cost per step. Pure Python and CPU only; prints a table and writes
bench/results/scheduler_sim.json and scheduler_sim.png.

Workload (synthetic, ShareGPT-like): Poisson arrivals at --rate requests/s; prompt lengths
lognormal(mu=ln 160, sigma=1.0) clipped to [4, 2048]; output lengths lognormal(mu=ln 200, sigma=0.8)
clipped to [4, 1024], generated in full (no eos). Random token ids, so prefix hits come only from a
recompute-preempted request finding its own blocks still cached.

Models and machine (H100-class: 3 TB/s HBM, 25 GB/s host link, 20 us per transfer, bf16):
SmolLM2-135M (the cost model's defaults, 100 TFLOP/s achievable, arrivals 150/s) and a
Llama-3-8B shape (400 TFLOP/s achievable, arrivals 40/s). One step costs a roofline
    t = 2 ms fixed + max(2 * n_params * batched_tokens / FLOP rate,
                         (2 bytes * n_params + sum(context_len) * kv_bytes_per_token) / HBM bandwidth)
      + for each swap direction used: blocks * block_size * kv_bytes_per_token / link + 20 us
so recompute is paid as extra prefill tokens and swap as link time, both on the same clock.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import RESULTS_DIR, print_table, write_json  # noqa: E402
from kvpage.core import BlockManager, PreemptionCostModel, Scheduler  # noqa: E402

STEP_FIXED_S = 2e-3
HBM_BANDWIDTH = 3e12
POLICIES = ("recent", "least_progress")
MODES = ("swap", "recompute", None)  # None: the cost model picks per victim
MODELS = {  # name: (cost model, default arrival rate that loads the pool)
    "smollm2-135m": (PreemptionCostModel(), 150.0),
    "llama3-8b": (PreemptionCostModel(kv_bytes_per_token=2 * 32 * 8 * 128 * 2, n_params=8e9, flops_per_s=400e12,
                                      num_layers=32, hidden_size=4096), 40.0),
}


@dataclass
class Workload:
    arrival_s: list[float]
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(num_requests: int, rate: float, seed: int) -> Workload:
    rng = random.Random(seed)
    t, arrivals, prompts, outs = 0.0, [], [], []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
        n_prompt = min(2048, max(4, int(rng.lognormvariate(math.log(160), 1.0))))
        prompts.append([rng.randrange(1, 32000) for _ in range(n_prompt)])
        outs.append(min(1024, max(4, int(rng.lognormvariate(math.log(200), 0.8)))))
    return Workload(arrivals, prompts, outs)


def step_time(out, model: PreemptionCostModel, block_size: int) -> float:
    compute = 2 * model.n_params * out.num_batched_tokens / model.flops_per_s
    kv_bytes = sum(s.context_len for s in out.scheduled) * model.kv_bytes_per_token
    t = STEP_FIXED_S + max(compute, (2 * model.n_params + kv_bytes) / HBM_BANDWIDTH)
    for pairs in (out.blocks_to_swap_out, out.blocks_to_swap_in):
        if pairs:  # half of swap_cost's round trip: one direction, one transfer
            t += model.swap_cost(len(pairs), block_size) / 2
    return t


def simulate(work: Workload, model: PreemptionCostModel, policy: str, mode: str | None, num_blocks: int,
             num_host_blocks: int, block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> dict:
    bm = BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    sched = Scheduler(bm, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      policy=policy, preemption_mode=mode, cost_model=model)
    clock, nxt, n = 0.0, 0, len(work.prompts)
    finish, first_token, out_tokens = {}, {}, 0
    while nxt < n or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and work.arrival_s[nxt] > clock:
            clock = work.arrival_s[nxt]  # idle until the next arrival
        while nxt < n and work.arrival_s[nxt] <= clock:
            sched.add_request(str(nxt), work.prompts[nxt], max_tokens=work.output_lens[nxt], eos_token_id=None)
            nxt += 1
        out = sched.schedule()
        clock += step_time(out, model, block_size)
        # The fake sampler: any token id will do, since every request generates its full length.
        sampled = {s.seq_id: 7 for s in out.scheduled if s.do_sample}
        for s in out.scheduled:
            if s.do_sample:
                first_token.setdefault(int(s.request_id), clock)
        out_tokens += len(sampled)
        for request in sched.update_from_output(out, sampled):
            finish[int(request.request_id)] = clock
    latency = sorted(finish[i] - work.arrival_s[i] for i in range(n))
    ttft = sorted(first_token[i] - work.arrival_s[i] for i in range(n))
    stats = sched.stats()
    return {
        "policy": policy, "mode": mode or "cost-model", "sim_seconds": round(clock, 3),
        "throughput_tok_s": round(out_tokens / clock, 1),
        "latency_p50_s": round(_pct(latency, 50), 3), "latency_p99_s": round(_pct(latency, 99), 3),
        "ttft_p50_s": round(_pct(ttft, 50), 3), "ttft_p99_s": round(_pct(ttft, 99), 3),
        "preemptions": stats.num_preemptions, "swap": stats.num_swap_preemptions,
        "recompute": stats.num_recompute_preemptions, "swapped_blocks": stats.blocks.num_swapped_out_blocks,
        "prefix_hit_tokens": stats.blocks.prefix_cache_hit_tokens,
    }


def _pct(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(p / 100 * len(sorted_values)))]


def plot(results: dict[str, list[dict]], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("throughput_tok_s", "output tokens / s (sim)"), ("latency_p50_s", "p50 latency (s)"),
              ("latency_p99_s", "p99 latency (s)"))
    fig, axes = plt.subplots(len(results), 3, figsize=(15, 4.2 * len(results)), squeeze=False)
    for row_axes, (name, rows) in zip(axes, results.items()):
        labels = [f"{r['policy']}\n{r['mode']}" for r in rows]
        for ax, (key, title) in zip(row_axes, panels):
            ax.bar(range(len(rows)), [r[key] for r in rows],
                   color=["C0" if "recent" in lab else "C1" if "least" in lab else "C7" for lab in labels])
            ax.set_xticks(range(len(rows)), labels, fontsize=7)
            ax.set_title(f"{name}: {title}")
    fig.suptitle("Scheduler under memory pressure: victim policy x preemption mode (ShareGPT-like, simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--num-blocks", type=int, default=1024, help="device KV blocks (the pressure)")
    parser.add_argument("--num-host-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="40 requests on 256 blocks (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.num_blocks, args.num_host_blocks = 40, 256, 512
    common = dict(num_host_blocks=args.num_host_blocks, block_size=args.block_size,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    columns = ["policy", "mode", "throughput_tok_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s",
               "preemptions", "swap", "recompute", "swapped_blocks", "prefix_hit_tokens"]
    results, models = {}, {}
    for name in args.models.split(","):
        model, rate = MODELS[name]
        work = make_workload(args.num_requests, rate, args.seed)
        rows = [simulate(work, model, policy, mode, args.num_blocks, **common) for policy in POLICIES for mode in MODES]
        baseline = simulate(work, model, "recent", None, 16 * args.num_blocks, **common)  # what pressure costs
        baseline["policy"], baseline["mode"] = "16x-memory", "-"
        rows.append(baseline)
        print(f"\n{name}: {rate:g} requests/s, swap/recompute crossover at"
              f" {model.crossover_tokens(args.block_size)} tokens")
        print_table(rows, columns)
        results[name] = rows
        models[name] = {"arrival_rate": rate, "cost_model": vars(model),
                        "swap_recompute_crossover_tokens": model.crossover_tokens(args.block_size)}
    payload = {
        "config": vars(args),
        "workload": {"prompt_len": "lognormal(ln 160, 1.0) clipped [4, 2048]",
                     "output_len": "lognormal(ln 200, 0.8) clipped [4, 1024]", "arrivals": "Poisson"},
        "step_model": {"fixed_s": STEP_FIXED_S, "hbm_bytes_per_s": HBM_BANDWIDTH, "weights_bytes_per_param": 2},
        "models": models,
        "results": results,
    }
    name = "scheduler_sim_quick" if args.quick else "scheduler_sim"
    print(f"wrote {write_json(name, payload)}")
    png = RESULTS_DIR / f"{name}.png"
    plot(results, png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
