"""Speculative decoding (issue 51): single-stream tokens/s with n-gram speculation on against off.

Two workloads, one request at a time through LLM.chat, greedy:
  copy   the answer repeats much of the prompt: fix the typos of a given text, rename a variable in given code,
         reformat a given list (target: >= 1.8x with speculation)
  chat   open-ended questions, little to copy (target: >= 0.95x: speculation backs off when it is not accepted)
Both engines are loaded once; rounds alternate which runs first, and each round times every prompt of the
workload on both (the machine's load drifts: a round's ratio compares like with like). Reported per workload:
the median over rounds of tokens/s and of the per-round ratio, whether the greedy tokens were the same on and
off, and the acceptance counters (llm.stats()).

    python bench/spec_decode.py [--rounds 3] [--k 4] [--lookup-max 4] [--max-tokens 256]
    python bench/spec_decode.py --quick   # a tiny random model, 1 round of short answers: a smoke run

Writes bench/results/spec_decode.json (spec_decode_quick.json with --quick).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK_ENGINE_ARGS, add_model_argument, machine_info, model_dir, print_table, write_json  # noqa: E402

TEXT = ("Teh history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined"
        " several existing technologies into a single sistem. His movable type was cast from a lead alloy, and"
        " his press was adapted from the screw presses used to make wine. Within a few decades, printing shops"
        " had spread to more then two hundred cities across Europe, and the price of books fell dramaticaly."
        " Scholars could now compare identical copies of a text, which made it easier to correct errors and to"
        " build on the work of others. Some historians argue that the press helped to start the Reformation, the"
        " Scientific Revolution and the growth of literacy among ordinary people.")
CODE = '''def total(x):
    s = 0
    for v in x:
        if v > 0:
            s += v
    return s


def average(x):
    if not x:
        return 0.0
    return total(x) / len(x)


def largest(x):
    best = None
    for v in x:
        if best is None or v > best:
            best = v
    return best
'''
ITEMS = ("apples, bread, milk, eggs, butter, cheese, tomatoes, onions, garlic, rice, pasta, olive oil, coffee, tea,"
         " sugar, flour, yoghurt, oranges, bananas, carrots")
COPY = [
    f"Rewrite the following text with the spelling mistakes corrected. Reply with the corrected text only.\n\n{TEXT}",
    f"Rename the parameter `x` to `values` in this Python code. Reply with the whole code only.\n\n```python\n{CODE}```",
    f"Turn this shopping list into a numbered list, one item per line, in the same order:\n\n{ITEMS}",
]
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are some good ways to stay focused while studying?",
    "Describe your ideal weekend in a few sentences.",
]
WORKLOADS = {"copy": COPY, "chat": CHAT}


def ngram_config(k: int, lookup_max: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": lookup_max}


def time_prompts(llm, prompts: list[str], params) -> tuple[float, int, list[list[int]]]:
    """(seconds, generated tokens, each answer's tokens), one request at a time."""
    seconds, tokens, answers = 0.0, 0, []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        answers.append(list(out.token_ids))
    return seconds, tokens, answers


def spec_counters(llm) -> dict:
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_argument(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--workloads", default="copy,chat")
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts of each workload")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 1, 16

    import kvpage
    from kvpage import SamplingParams

    path = str(model_dir(args.model))
    engine = dict(QUICK_ENGINE_ARGS) if args.quick else {"num_kv_blocks": 512, "swap_space_gib": 0}
    # Prefix caching off: every round computes its prompts again, as the first round did.
    engine["enable_prefix_caching"] = False
    llms = {"off": kvpage.LLM(model=path, **engine),
            "on": kvpage.LLM(model=path, speculative_config=ngram_config(args.k, args.lookup_max), **engine)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows, results = [], {}
    for name in args.workloads.split(","):
        prompts = WORKLOADS[name][:args.prompts]
        before = spec_counters(llms["on"])
        rates = {"off": [], "on": []}
        same = True
        for r in range(args.rounds):
            answers = {}
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                seconds, tokens, answers[mode] = time_prompts(llms[mode], prompts, params)
                rates[mode].append(tokens / seconds)
            same = same and answers["on"] == answers["off"]
            print(f"{name} round {r + 1}: off {rates['off'][-1]:.1f} tok/s, on {rates['on'][-1]:.1f} tok/s,"
                  f" same tokens: {answers['on'] == answers['off']}", flush=True)
        after = spec_counters(llms["on"])
        counters = {k: after[k] - before.get(k, 0) for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                             "spec_decode_num_accepted_tokens")}
        drafts, draft_tokens, accepted = counters.values()
        ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
        results[name] = {"tokens_per_s_off": rates["off"], "tokens_per_s_on": rates["on"], "ratios": ratios,
                         "median_ratio": statistics.median(ratios), "greedy_tokens_identical": same, **counters,
                         "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                         "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0}
        rows.append({"workload": name, "off tok/s": f"{statistics.median(rates['off']):.1f}",
                     "on tok/s": f"{statistics.median(rates['on']):.1f}",
                     "ratio (median)": f"{statistics.median(ratios):.2f}x", "same tokens": same,
                     "acceptance": f"{results[name]['acceptance_rate']:.2f}",
                     "mean accepted len": f"{results[name]['mean_accepted_length']:.2f}"})
    print_table(rows, list(rows[0]))
    write_json("spec_decode_quick" if args.quick else "spec_decode",
               {"machine": machine_info(), "args": vars(args), "workloads": results})


if __name__ == "__main__":
    main()
