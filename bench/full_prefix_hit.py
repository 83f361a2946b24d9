"""A full prefix hit recomputing only the last token vs the whole last block (vLLM's rule), paired.

npl copies of one random pp-token prompt (pp a multiple of the block size), tg greedy tokens each,
on one LLM: rounds alternate between kvpage's rule and the old one (the match capped at
(len - 1) // block_size blocks, patched in for its rounds), each round on its own prompt.

    python bench/full_prefix_hit.py      # npl 32, 64; pp 128; tg 128; 2 rounds
    python bench/full_prefix_hit.py --quick   # npl 4, pp 32, tg 8, 1 round: a smoke run
"""
import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kvpage  # noqa: E402
from kvpage.core.block_manager import BlockManager  # noqa: E402
from kvpage.engine.workload import Workload, run_kvpage  # noqa: E402

FULL_HIT = BlockManager._match_prefix


def last_block_recomputed(self, seq, *args, **kwargs):
    return FULL_HIT(self, seq, *args, **kwargs)[: (len(seq.token_ids) - 1) // self.block_size]


def run(llm, rule, npl, pp, tg, rng) -> float:
    BlockManager._match_prefix = FULL_HIT if rule == "full_hit" else last_block_recomputed
    try:
        prompt = common.random_prompt(llm.tokenizer, pp, rng.randrange(1 << 30))
        return run_kvpage(llm, Workload([list(prompt) for _ in range(npl)], [tg] * npl))["output_tok_s"]
    finally:
        BlockManager._match_prefix = FULL_HIT


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--npl", default="32,64", help="comma list: copies of the prompt")
    parser.add_argument("--pp", type=int, default=128)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="npl 4, pp 32, tg 8, 1 round (smoke run)")
    common.add_model_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.npl, args.pp, args.tg, args.rounds = "4", 32, 8, 1
    llm = kvpage.LLM(model=args.model, **(common.QUICK_ENGINE_ARGS if args.quick else {}))
    rng = random.Random(0)
    run(llm, "full_hit", 8, args.pp, 8, rng)  # warm-up
    rows, results = [], []
    for npl in map(int, args.npl.split(",")):
        pairs = [(run(llm, "last_block", npl, args.pp, args.tg, rng), run(llm, "full_hit", npl, args.pp, args.tg, rng))
                 for _ in range(args.rounds)]
        ratios = [new / old for old, new in pairs]
        results.append({"npl": npl, "last_block_tok_s": [p[0] for p in pairs], "full_hit_tok_s": [p[1] for p in pairs]})
        rows.append({"npl": npl, "last block tok/s": " ".join(f"{p[0]:.1f}" for p in pairs),
                     "full hit tok/s": " ".join(f"{p[1]:.1f}" for p in pairs),
                     "full/last": f"{statistics.median(ratios):.2f}x (rounds "
                                  + ", ".join(f"{r:.2f}" for r in ratios) + ")"})
    common.print_table(rows, ["npl", "last block tok/s", "full hit tok/s", "full/last"])
    common.write_json("full_prefix_hit_quick" if args.quick else "full_prefix_hit",
                      {"pp": args.pp, "tg": args.tg, "results": results})


if __name__ == "__main__":
    main()
