"""Math lab 5, victim policies under memory pressure on the real engine: "recent" (vLLM's default,
FCFS-style: preempt the most recently admitted) vs the progress-aware "least_progress" (preempt
whoever loses least; spare a request about to finish), on p50 / p99 request latency.

    python bench/mathlab/victim_policies.py [--num-requests 16] [--num-blocks 24] [--rate 0.4]
    python bench/mathlab/victim_policies.py --quick    # 6 requests, 5 simulated workloads: a smoke run

What runs: the default model (SmolLM2-135M fp32, 1 torch thread), a KV pool of only 24 blocks of 16
tokens (384 token slots) so that admitted requests outgrow it and get preempted, preemption by
recompute (the mode where a victim's progress is thrown away), max_num_batched_tokens 2048.
Workload: 16 requests, Poisson arrivals at 0.4 per engine step (request i is added once the engine
has run its arrival step; an idle engine takes the next one at once), ShareGPT-like lengths scaled
by 0.15 (prompt mean 24, output mean 51 tokens, each clipped to [4, 128]; random token ids, greedy,
ignore_eos so every request runs its full length). Latency = finish - arrival, in wall-clock seconds
and in scheduler steps (which the machine's load does not change); also normalised by output length
(the vLLM paper's normalised latency), since a long request is allowed to take long.
The victim policy has no public knob (LLM / EngineConfig do not take one), so each run builds an
LLMEngine over the same runner and swaps in a Scheduler with `policy=` before adding any request.
Model: the same arrivals through the bare Scheduler (identical decisions: under ignore_eos token
values never change them) with each step priced by kvpage.costmodel.step_seconds on this machine's
measured constants, its clock scaled once so the FCFS run's total matches; and the same comparison
over --sim-seeds other workloads, which says how often the policy matters at all.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time

from _common import (WORKLOAD_TEXT, add_smoke_arguments, figure, median, output_name, percentile, print_table,
                     save_figure, sharegpt_like, this_device, write_result)

import kvpage  # noqa: E402
from kvpage import costmodel  # noqa: E402
from kvpage.core import BlockManager, Scheduler  # noqa: E402
from kvpage.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402

POLICIES = ("recent", "least_progress")
BLOCK_SIZE, BUDGET, MAX_LEN, SCALE = 16, 2048, 256, 0.15


def scheduler_for(bm, config, policy: str) -> Scheduler:
    return Scheduler(bm, max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                     max_model_len=config.max_model_len, preemption_mode=config.preemption_mode, policy=policy)


def arrivals_due(arrival_steps: list[int], next_i: int, step: int, idle: bool) -> int:
    """Index past the requests that have arrived by `step`; an idle engine takes the next at once."""
    n = len(arrival_steps)
    if idle and next_i < n:
        step = max(step, arrival_steps[next_i])
    while next_i < n and arrival_steps[next_i] <= step:
        next_i += 1
    return next_i


def run_engine(llm, base_config, policy: str, prompts, output_lens, arrival_steps) -> dict:
    engine = LLMEngine(llm.runner, llm.tokenizer, base_config)
    engine.scheduler = scheduler_for(engine.block_manager, base_config, policy)  # the knob we lack
    start = time.perf_counter()
    added_s, added_step, finish_s, finish_step, nxt = {}, {}, {}, {}, 0
    while nxt < len(prompts) or engine.has_unfinished_requests():
        due = arrivals_due(arrival_steps, nxt, engine.num_steps, not engine.has_unfinished_requests())
        for i in range(nxt, due):
            params = kvpage.SamplingParams(temperature=0.0, max_tokens=output_lens[i], ignore_eos=True)
            engine.add_request(str(i), prompts[i], params, stream=False)
            added_s[i], added_step[i] = time.perf_counter(), engine.num_steps
        nxt = due
        for out in engine.step():
            if out.finished:
                i = int(out.request_id)
                finish_s[i], finish_step[i] = time.perf_counter() - added_s[i], engine.num_steps - added_step[i]
    stats = engine.stats()
    return _summary(finish_s, finish_step, output_lens) | {
        "seconds": time.perf_counter() - start, "steps": engine.num_steps, "preemptions": stats["num_preemptions"]}


def simulate(policy: str, prompts, output_lens, arrival_steps, config, shape, device) -> dict:
    """The same requests through the bare Scheduler, each step priced by the cost model's roofline."""
    bm = BlockManager(config.num_kv_blocks, BLOCK_SIZE, num_host_blocks=config.num_host_blocks,
                      enable_prefix_caching=config.enable_prefix_caching)
    sched = scheduler_for(bm, config, policy)
    clock, added_s, added_step, finish_s, finish_step, nxt, computed = 0.0, {}, {}, {}, {}, 0, 0
    while nxt < len(prompts) or sched.has_unfinished_requests():
        due = arrivals_due(arrival_steps, nxt, sched.step, not sched.has_unfinished_requests())
        for i in range(nxt, due):
            sched.add_request(str(i), prompts[i], max_tokens=output_lens[i], eos_token_id=None)
            added_s[i], added_step[i] = clock, sched.step
        nxt = due
        out = sched.schedule()
        chunks = [costmodel.Chunk(s.num_scheduled_tokens, s.start) for s in out.scheduled]
        clock += costmodel.step_seconds(shape, device, chunks, 4) if chunks else 0.0
        computed += out.num_batched_tokens
        for r in sched.update_from_output(out, {s.seq_id: 7 for s in out.scheduled if s.do_sample}):
            i = int(r.request_id)
            finish_s[i], finish_step[i] = clock - added_s[i], sched.step - added_step[i]
    return _summary(finish_s, finish_step, output_lens) | {
        "seconds": clock, "steps": sched.step, "preemptions": sched.stats().num_preemptions,
        "tokens_computed": computed}


def poisson_steps(n: int, rate: float, seed: int) -> list[int]:
    """Arrival step of each request: Poisson arrivals at `rate` requests per engine step."""
    rng = random.Random(seed + 2)
    t, steps = 0.0, []
    for _ in range(n):
        steps.append(int(t))
        t += rng.expovariate(rate)
    return steps


def _summary(finish_s: dict, finish_step: dict, output_lens: list[int]) -> dict:
    """Latency percentiles, raw and normalised by output length (the vLLM paper's normalised latency:
    a long request is allowed to take long; preemption shows up as time per token)."""
    n = len(output_lens)
    lat = [finish_s[i] for i in range(n)]
    steps = [finish_step[i] for i in range(n)]
    norm = [finish_s[i] / output_lens[i] for i in range(n)]
    norm_steps = [finish_step[i] / output_lens[i] for i in range(n)]
    return {"latency_s": lat, "latency_steps": steps, "mean_s": sum(lat) / n,
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
            "p50_steps": percentile(steps, 50), "p99_steps": percentile(steps, 99),
            "norm_p50_s": percentile(norm, 50), "norm_p99_s": percentile(norm, 99),
            "norm_p99_steps": percentile(norm_steps, 99)}


def workload(args, seed: int):
    work = sharegpt_like(args.num_requests, MAX_LEN, seed, scale=SCALE)
    prompts = [[100 + t % 40000 for t in p] for p in work.prompts(seed)]
    return work, prompts, poisson_steps(args.num_requests, args.rate, seed)


def sim_spread(args, base, shape, device) -> dict:
    """Over many simulated workloads (other seeds): p99 latency in steps, raw and normalised,
    least_progress / recent."""
    raw, norm = [], []
    for seed in range(1000, 1000 + args.sim_seeds):
        work, prompts, arrivals = workload(args, seed)
        try:
            runs = [simulate(p, prompts, work.output_lens, arrivals, base, shape, device) for p in POLICIES]
        except ValueError:  # a request longer than the whole pool: not this experiment's question
            continue
        raw.append(runs[1]["p99_steps"] / runs[0]["p99_steps"])
        norm.append(runs[1]["norm_p99_steps"] / runs[0]["norm_p99_steps"])
    out = {"workloads": len(raw)}
    for name, ratios in (("p99", sorted(raw)), ("norm_p99", sorted(norm))):
        out[name] = {"ratios": ratios, "lower": sum(r < 1 for r in ratios), "equal": sum(r == 1 for r in ratios),
                     "higher": sum(r > 1 for r in ratios), "median": median(ratios),
                     "p10": percentile(ratios, 10), "p90": percentile(ratios, 90)}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.4, help="arrivals per engine step (Poisson)")
    parser.add_argument("--mode", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-seeds", type=int, default=200, help="workloads for the model's distribution")
    parser.add_argument("--simulate-only", action="store_true", help="the model side only (seconds)")
    add_smoke_arguments(parser, "6 requests, 5 simulated workloads")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.sim_seeds = 6, 5
    device = this_device(args.threads)
    shape = costmodel.get_model("smollm2-135m")
    base = EngineConfig(num_kv_blocks=args.num_blocks, block_size=BLOCK_SIZE, num_host_blocks=4 * args.num_blocks,
                        max_num_batched_tokens=BUDGET, max_num_seqs=256, max_model_len=8192,
                        preemption_mode=args.mode, eos_token_ids=(2,))
    work, prompts, arrivals = workload(args, args.seed)
    sims = {p: simulate(p, prompts, work.output_lens, arrivals, base, shape, device) for p in POLICIES}
    spread = sim_spread(args, base, shape, device)
    real = {}
    if not args.simulate_only:
        llm = kvpage.LLM(model=args.model, num_kv_blocks=args.num_blocks, block_size=BLOCK_SIZE, swap_space_gib=0.2)
        base = dataclasses.replace(base, num_host_blocks=llm.runner.num_host_blocks)
        llm.generate([[100 + i for i in range(32)]], kvpage.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        real = {p: run_engine(llm, base, p, prompts, work.output_lens, arrivals) for p in POLICIES}
    # One clock scale, from the FCFS run's total time: the comparison that matters is between
    # policies, and the roofline alone is off by the engine's efficiency on this machine.
    scale = real["recent"]["seconds"] / sims["recent"]["seconds"] if real else 1.0
    rows = []
    for p in POLICIES:
        s = sims[p]
        row = {"policy": p, "model_p50_s": s["p50_s"] * scale, "model_p99_s": s["p99_s"] * scale,
               "model_p99_steps": s["p99_steps"], "model_norm_p99_steps": s["norm_p99_steps"],
               "model_preemptions": s["preemptions"]}
        if real:
            r = real[p]
            row |= {"p50_s": r["p50_s"], "p99_s": r["p99_s"], "norm_p99_s": r["norm_p99_s"],
                    "p99_steps": r["p99_steps"], "norm_p99_steps": r["norm_p99_steps"],
                    "preemptions": r["preemptions"], "steps": r["steps"], "seconds": r["seconds"]}
        rows.append(row)
    print(f"{args.num_requests} requests ({WORKLOAD_TEXT}, scaled by {SCALE}, max_len {MAX_LEN}), Poisson arrivals"
          f" at {args.rate} per step; pool {args.num_blocks} blocks x {BLOCK_SIZE}; preemption by {args.mode};"
          f" model clock x {scale:.2f}")
    print_table([{k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows], list(rows[0]))
    for name in ("p99", "norm_p99"):
        d = spread[name]
        print(f"model over {spread['workloads']} other workloads, {name} latency (steps) least_progress / recent:"
              f" lower in {d['lower']}, equal in {d['equal']}, higher in {d['higher']}; median {d['median']:.3f}"
              f" (p10 {d['p10']:.3f}, p90 {d['p90']:.3f})")
    payload = {"config": vars(args), "workload": {"text": WORKLOAD_TEXT, "scale": SCALE, "max_len": MAX_LEN,
                                                  "prompt_lens": work.prompt_lens, "output_lens": work.output_lens,
                                                  "arrival_steps": arrivals},
               "model_clock_scale": scale, "rows": rows, "model_spread": spread, "simulated": sims, "real": real}
    name = output_name("victim_policies", args.quick)
    write_result(name, payload)
    if real:
        plot(real, sims, scale, spread, name)
    return payload


def plot(real, sims, scale, spread, name: str) -> None:
    fig, axes = figure(1, 3, width=16)
    ax = axes[0][0]
    for i, p in enumerate(POLICIES):
        lat = sorted(real[p]["latency_s"])
        ax.plot(lat, [(k + 1) / len(lat) for k in range(len(lat))], "o-", color=f"C{i}", label=f"{p}, measured")
        sim = sorted(x * scale for x in sims[p]["latency_s"])
        ax.plot(sim, [(k + 1) / len(sim) for k in range(len(sim))], "--", color=f"C{i}", label=f"{p}, model")
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("fraction of requests finished")
    ax.set_title("latency CDF under memory pressure")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    x = range(len(POLICIES))
    for j, (key, label) in enumerate((("p50_s", "p50"), ("p99_s", "p99"))):
        ax.bar_label(ax.bar([i + (j - 0.5) * 0.4 for i in x], [real[p][key] for p in POLICIES], 0.4,
                            color=f"C{j + 2}", label=f"{label} measured"), fmt="%.1f")
    ax.set_xticks(list(x), [f"{p}\n({real[p]['preemptions']} preemptions)" for p in POLICIES])
    ax.set_ylabel("latency (s)")
    ax.set_title("this run (real engine)")
    ax.legend()
    ax = axes[0][2]
    ax.hist([spread["p99"]["ratios"], spread["norm_p99"]["ratios"]], bins=25, color=["C7", "C4"],
            label=["p99 latency", "p99 normalised latency"])
    ax.axvline(1.0, color="k", linewidth=1)
    ax.set_xlabel("least_progress / recent (steps)")
    ax.set_ylabel("simulated workloads")
    ax.set_title(f"model: {spread['workloads']} other workloads")
    ax.legend(fontsize=8)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
