"""kvpage with a float32 KV cache vs narrower ones (fp8 e4m3, bfloat16, float16) on bench/engine.py's
workload, paired in one process.

LLMs over the same weights take turns, round by round, in a rotating order (each round on its own
variant of the prompts, so no round hits another's prefix cache); reports each one's median output
tok/s, its speed over the float32 cache's per round, and how many completions it generates
identically to the float32 cache (greedy).

    python bench/kv_cache_dtype.py [--dtypes fp8,bfloat16] [--rounds 4] [--no-prefix-caching]
    python bench/kv_cache_dtype.py --quick   # 8 short requests, 1 round: a smoke run
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as engine_bench  # noqa: E402
from common import QUICK_ENGINE_ARGS, add_model_argument, write_json  # noqa: E402

import kvpage  # noqa: E402
from kvpage.engine.workload import Workload, make_workload, quick_workload, run_kvpage  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp8,bfloat16", help="comma list of kv_cache_dtype names beside auto")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--quick", action="store_true", help="8 short requests, 1 round (smoke run)")
    add_model_argument(parser)
    args = parser.parse_args(argv)
    dtypes = ["auto"] + [d for d in args.dtypes.split(",") if d and d != "auto"]
    workload, rounds = (quick_workload(), 1) if args.quick else (make_workload(), args.rounds)
    warmup, by_round = engine_bench.tokenized(workload, engine_bench._tokenizer(args.model), rounds)
    sizes = QUICK_ENGINE_ARGS if args.quick else {}
    base = kvpage.LLM(model=args.model, enable_prefix_caching=not args.no_prefix_caching, **sizes)
    llms = {d: base if d == "auto" else kvpage.LLM(model=base.model, tokenizer=base.tokenizer, kv_cache_dtype=d,
                                                   enable_prefix_caching=not args.no_prefix_caching, **sizes)
            for d in dtypes}
    for llm in llms.values():
        run_kvpage(llm, Workload(warmup, workload.output_lens))
    rates, identical = {d: [] for d in dtypes}, {d: [] for d in dtypes[1:]}
    for i, prompts in enumerate(by_round):
        outputs = {}
        for dtype in dtypes[i % len(dtypes):] + dtypes[:i % len(dtypes)]:
            result = run_kvpage(llms[dtype], Workload(prompts, workload.output_lens))
            rates[dtype].append(result["output_tok_s"])
            outputs[dtype] = [o.outputs[0].token_ids for o in result["outputs"]]
        for d in dtypes[1:]:
            identical[d].append(sum(a == b for a, b in zip(outputs["auto"], outputs[d])))
    res = {"prefix_caching": not args.no_prefix_caching, "requests": len(by_round[0]),
           "fp32_tok_s": statistics.median(rates["auto"]), "by_dtype": {}}
    print(f"fp32 KV {res['fp32_tok_s']:.1f} tok/s")
    for d in dtypes[1:]:
        ratios = [n / a for a, n in zip(rates["auto"], rates[d])]
        res["by_dtype"][d] = {"tok_s": statistics.median(rates[d]), "over_fp32": statistics.median(ratios),
                              "rounds": ratios, "identical_completions": identical[d]}
        print(f"{d} KV {res['by_dtype'][d]['tok_s']:.1f} tok/s, {d}/fp32 {statistics.median(ratios):.3f} (rounds "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); completions identical to fp32's per round: "
              f"{identical[d]} of {res['requests']}")
    write_json("kv_cache_dtype_quick" if args.quick else "kv_cache_dtype", res)
    return res


if __name__ == "__main__":
    main()
