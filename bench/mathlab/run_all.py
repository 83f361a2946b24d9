"""Run every math-lab experiment (bench/mathlab/*.py), each in its own process, then print one line
per claim from the JSON they wrote. docs/mathlab.md sets these numbers beside the seed's.

    python bench/mathlab/run_all.py [--only fragmentation,copy_on_write] [--skip chunked_prefill]
    python bench/mathlab/run_all.py --quick    # every experiment's smoke run (--model passes through)

About 7-8 minutes on 2 shared cores; every experiment states its sizes in its docstring. The model's
numbers for the seed's own cases: `kvpage plan --model llama-3-8b --device h100`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import HERE, RESULTS_DIR, add_smoke_arguments, output_name

EXPERIMENTS = ("fragmentation", "swap_vs_recompute", "prefix_caching", "copy_on_write", "victim_policies",
               "chunked_prefill")


def headline(name: str, quick: bool = False) -> str:
    d = json.loads((RESULTS_DIR / f"{output_name(name, quick)}.json").read_text())
    if name == "fragmentation":
        a = d["at_completion"]
        return (f"waste paged {a['paged_waste_measured']:.1%} vs reserved {a['reserved_waste_measured']:.1%};"
                f" sequences in the pool: paged {d['paged']['mean_running_saturated']:.1f} (model"
                f" {d['predicted_paged_concurrency']:.1f}) vs reserved {d['reservation_cap']}")
    if name == "swap_vs_recompute":
        s = d["summary"]
        return (f"swap {s['swap_fit']['bandwidth_gb_s']:.2f} GB/s + {s['swap_fit']['overhead_us']:.0f} us/call;"
                f" recompute {s['recompute_fit']['intercept_ms']:.0f} ms + {s['recompute_fit']['ms_per_token']:.2f}"
                f" ms/token; crossover measured {s['crossover_measured_tokens']} vs model"
                f" {s['crossover_model_tokens']} tokens (1 = swap wins from the first token)")
    if name == "prefix_caching":
        t = {r["quantity"]: r for r in d["table"]}
        ratio = t["mean TTFT off / on"]
        return (f"mean TTFT off/on {ratio['measured']:.1f}x measured (off extrapolated) vs {ratio['model']:.1f}x"
                f" model; prefix-cache hit tokens {d['measured']['on']['hit_tokens']} vs model"
                f" {sum(d['model']['hit_tokens_on'])}")
    if name == "copy_on_write":
        return "; ".join(f"{r['run']}: {r['blocks_shared_measured']} vs {r['blocks_unshared_measured']} blocks"
                         f" (model {r['blocks_shared_model']})" for r in d["rows"])
    if name == "victim_policies":
        return "; ".join(f"{r['policy']}: p99 {r['p99_s']:.1f} s / {r['p99_steps']} steps"
                         f" (model {r['model_p99_steps']}), {r['preemptions']} preemptions" for r in d["rows"])
    if name == "chunked_prefill":
        return "; ".join(f"{r['run']}: worst ITL {r['itl_max_s']:.2f} s (calibrated model"
                         f" {r['cal_model_itl_max_s']:.2f}), long-prompt TTFT {r['long_prompt_ttft_s']:.1f} s"
                         for r in d["table"])
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(EXPERIMENTS))
    parser.add_argument("--skip", default="")
    add_smoke_arguments(parser, "every experiment's --quick")
    args = parser.parse_args()
    passed = (["--quick"] if args.quick else []) + (["--model", args.model] if args.model else [])
    skip = set(filter(None, args.skip.split(",")))
    names = [n for n in args.only.split(",") if n not in skip]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        sys.exit(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    timings, failed = {}, []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / f"{name}.py"), *passed])
        timings[name] = time.perf_counter() - start
        if rc:
            failed.append(name)
    print("\n=== summary ===")
    for name in names:
        line = "FAILED" if name in failed else headline(name, args.quick)
        print(f"{name} ({timings[name]:.0f} s): {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
