"""kvpage with a float32 vs an fp8 (e4m3) KV cache on bench/engine.py's workload, paired in one process.

Two LLMs over the same weights take turns, round by round (each round on its own variant of the prompts,
so no round hits another's prefix cache); reports each one's median output tok/s, fp8/fp32 per round and
how many completions the two caches generate identically (greedy).

    python bench/kv_cache_dtype.py [--rounds 4] [--no-prefix-caching]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as engine_bench  # noqa: E402
from common import write_json  # noqa: E402

import kvpage  # noqa: E402
from kvpage.engine.workload import Workload, make_workload, run_kvpage  # noqa: E402

DTYPES = ("auto", "fp8")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args(argv)
    workload = make_workload()
    warmup, by_round = engine_bench.tokenized(workload, engine_bench._tokenizer(), args.rounds)
    base = kvpage.LLM(enable_prefix_caching=not args.no_prefix_caching)
    llms = {"auto": base, "fp8": kvpage.LLM(model=base.model, tokenizer=base.tokenizer, kv_cache_dtype="fp8",
                                            enable_prefix_caching=not args.no_prefix_caching)}
    for llm in llms.values():
        run_kvpage(llm, Workload(warmup, workload.output_lens))
    rates, identical = {d: [] for d in DTYPES}, []
    for i, prompts in enumerate(by_round):
        outputs = {}
        for dtype in DTYPES if i % 2 == 0 else DTYPES[::-1]:
            result = run_kvpage(llms[dtype], Workload(prompts, workload.output_lens))
            rates[dtype].append(result["output_tok_s"])
            outputs[dtype] = [o.outputs[0].token_ids for o in result["outputs"]]
        identical.append(sum(a == b for a, b in zip(outputs["auto"], outputs["fp8"])))
    ratios = [f / a for a, f in zip(rates["auto"], rates["fp8"])]
    res = {"prefix_caching": not args.no_prefix_caching, "requests": len(by_round[0]),
           "fp32_tok_s": statistics.median(rates["auto"]), "fp8_tok_s": statistics.median(rates["fp8"]),
           "fp8_over_fp32": statistics.median(ratios), "rounds": ratios, "identical_completions": identical}
    print(f"fp32 KV {res['fp32_tok_s']:.1f} tok/s, fp8 KV {res['fp8_tok_s']:.1f} tok/s, fp8/fp32 "
          f"{res['fp8_over_fp32']:.3f} (rounds {', '.join(f'{r:.2f}' for r in ratios)}); completions identical "
          f"per round: {identical} of {res['requests']}")
    write_json("kv_cache_dtype", res)
    return res


if __name__ == "__main__":
    main()
