"""Where an engine job's time goes: torch.profiler around one LLM.generate, self CPU time per op.

npl prompts sharing a system prompt (each with its own short suffix), greedy, ignore_eos, default
model, after a warm-up job of the same shapes with other suffixes. Prints the top ops and each
one's share of the profiled self CPU time.

    python bench/profile_engine.py [--npl 64] [--tokens 24] [--top 12]
    python bench/profile_engine.py --quick   # 4 prompts x 4 tokens: a smoke run
"""
import argparse
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kvpage  # noqa: E402

SYSTEM_PROMPT = "You are a helpful assistant. " * 12  # 72 tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--npl", type=int, default=64, help="prompts")
    parser.add_argument("--tokens", type=int, default=24, help="output tokens per prompt")
    parser.add_argument("--top", type=int, default=12, help="ops to list")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 4 tokens (smoke run)")
    common.add_model_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.npl, args.tokens = 4, 4
    llm = kvpage.LLM(model=args.model, **(common.QUICK_ENGINE_ARGS if args.quick else {}))
    params = kvpage.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([f"{SYSTEM_PROMPT} Q{i}" for i in range(args.npl)], params, use_tqdm=False)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([f"{SYSTEM_PROMPT} R{i}" for i in range(args.npl)], params, use_tqdm=False)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{'op':36} {'calls':>7} {'self ms':>10} {'share':>7}")
    for e in events[:args.top]:
        print(f"{e.key[:36]:36} {e.count:7d} {e.self_cpu_time_total / 1e3:10.1f} {e.self_cpu_time_total / total:7.1%}")
    print(f"total self CPU {total / 1e6:.2f} s over {args.npl} prompts x {args.tokens} tokens")


if __name__ == "__main__":
    main()
