"""Engine integrity under faults and threads: N random fault injections into one LLM's bookkeeping,
then M runs of 4 threads calling generate() on it at once.

A fault is a KeyboardInterrupt or an ordinary exception raised at a random traced line of the
scheduler, block manager, pools, engine, beam search or runner (tests/engine/integrity_helpers.py).
After each: the bookkeeping invariants, an idle engine holding no block, and every 10th time a greedy
control request with the tokens it gave before. Reports broken engines, leaked blocks and wrong outputs.

    python bench/engine_faults.py            # 1000 faults, 100 thread runs
    python bench/engine_faults.py --quick    # 20 faults, 4 thread runs
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the injector and the tiny model live with the tests

from common import machine_info, write_json  # noqa: E402
from integrity_helpers import (Injected, assert_whole_and_idle, control_tokens, count_lines,  # noqa: E402
                               run_with_fault, tiny_llm, workload)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def inject(num_faults: int, rng: random.Random) -> dict:
    counts = dict(faults=0, fired=0, broken=0, wrong_outputs=0, control_mismatches=0)
    for mode in ("swap", "recompute"):
        llm = tiny_llm(num_kv_blocks=10, preemption_mode=mode)
        prompts, params = workload()
        expected = _tokens(llm.generate(prompts, params, use_tqdm=False))
        control, lines = control_tokens(llm), count_lines(llm)
        for i in range(num_faults // 2):
            exc = rng.choice([KeyboardInterrupt, Injected])
            outputs = run_with_fault(llm, rng.randint(1, lines), exc)
            counts["faults"] += 1
            counts["fired"] += outputs is None
            counts["wrong_outputs"] += outputs is not None and _tokens(outputs) != expected
            try:
                assert_whole_and_idle(llm)
                if i % 10 == 9:
                    counts["control_mismatches"] += control_tokens(llm) != control
            except AssertionError as e:  # a broken engine: count it and go on with a fresh one
                print(f"broken after fault {i} ({mode}): {e}", file=sys.stderr)
                counts["broken"] += 1
                llm = tiny_llm(num_kv_blocks=10, preemption_mode=mode)
    return counts


def threads(num_runs: int, num_threads: int = 4) -> dict:
    llm = tiny_llm(num_kv_blocks=10)
    prompts, params = workload()
    expected = _tokens(llm.generate(prompts, params, use_tqdm=False))
    counts = dict(runs=num_runs, calls=0, failed_calls=0, wrong_outputs=0, broken=0)
    for _ in range(num_runs):
        results, errors = [], []

        def call():
            try:
                results.append(_tokens(llm.generate(prompts, params, use_tqdm=False)))
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(e)

        workers = [threading.Thread(target=call) for _ in range(num_threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        counts["calls"] += num_threads
        counts["failed_calls"] += len(errors)
        counts["wrong_outputs"] += sum(r != expected for r in results)
        try:
            assert_whole_and_idle(llm)
        except AssertionError:
            counts["broken"] += 1
            llm = tiny_llm(num_kv_blocks=10)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=1000)
    parser.add_argument("--thread-runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 faults and 4 thread runs")
    args = parser.parse_args()
    if args.quick:
        args.faults, args.thread_runs = 20, 4
    start = time.perf_counter()
    result = {"machine": machine_info(), "faults": inject(args.faults, random.Random(args.seed)),
              "threads": threads(args.thread_runs)}
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result, indent=2))
    write_json("engine_faults_quick" if args.quick else "engine_faults", result)
    bad = result["faults"]["broken"] + result["faults"]["wrong_outputs"] + result["faults"]["control_mismatches"]
    bad += sum(result["threads"][k] for k in ("failed_calls", "wrong_outputs", "broken"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
