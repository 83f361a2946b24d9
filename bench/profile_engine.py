"""Where an engine job's time goes: torch.profiler around one LLM.generate, self CPU time per op; or, with
--split, the wall time of each part of a step (scheduling, the payload, the decoder layers, the LM head,
sampling, the commit with detokenization and output assembly, and the rest of the Python step).

npl prompts sharing a system prompt (each with its own short suffix), greedy, ignore_eos, default
model, after a warm-up job of the same shapes with other suffixes. Prints the top ops and each
one's share of the profiled self CPU time.

    python bench/profile_engine.py [--npl 64] [--tokens 24] [--top 12]
    python bench/profile_engine.py --split --npl 1 --tokens 128   # a batch-1 decode step, part by part
    python bench/profile_engine.py --split --npl 1 --weight-dtype=bfloat16 --num-kv-blocks=256   # engine options
    python bench/profile_engine.py --quick   # 4 prompts x 4 tokens: a smoke run
"""
import argparse
import ast
import contextlib
import sys
import time
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kvpage  # noqa: E402
from kvpage.model import llama, runner  # noqa: E402

SYSTEM_PROMPT = "You are a helpful assistant. " * 12  # 72 tokens


class StepSplit:
    """Wall seconds per part of a step, from timers wrapped around the engine's own functions (nested parts
    are subtracted from their parent, so the parts add up to the steps' total)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._stack = []

    @contextlib.contextmanager
    def part(self, name):
        self._stack.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            inner = self._stack.pop()
            self.seconds[name] += spent - inner
            if self._stack:
                self._stack[-1] += spent

    def wrap(self, owner, attr, name):
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.part(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)


def split_engine(llm) -> StepSplit:
    """Timers around the parts of LLMEngine.step (the engine's objects and modules patched in place)."""
    split = StepSplit()
    engine = llm.llm_engine
    split.wrap(engine, "step", "other Python in step")
    split.wrap(engine.scheduler, "schedule", "scheduling")
    split.wrap(runner, "pack_payload", "payload")
    split.wrap(runner, "unpack_payload", "payload")
    split.wrap(llama.LlamaForward, "__call__", "decoder layers")
    split.wrap(llama.LlamaForward, "compute_logits", "LM head")
    split.wrap(engine, "sampler", "sampling")
    split.wrap(engine.scheduler, "update_from_output", "commit (scheduler)")
    split.wrap(engine, "_process", "detokenization + outputs")
    return split


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--npl", type=int, default=64, help="prompts")
    parser.add_argument("--tokens", type=int, default=24, help="output tokens per prompt")
    parser.add_argument("--top", type=int, default=12, help="ops to list")
    parser.add_argument("--split", action="store_true", help="wall time per part of a step instead of per op")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 4 tokens (smoke run)")
    common.add_model_argument(parser)
    args, engine_args = parser.parse_known_args()
    if args.quick:
        args.npl, args.tokens = 4, 4
    extra = dict(common.QUICK_ENGINE_ARGS if args.quick else {})
    for item in engine_args:  # --weight-dtype=bfloat16 style engine options, passed through to LLM
        key, _, value = item.lstrip("-").partition("=")
        try:
            value = ast.literal_eval(value)  # numbers as numbers
        except (ValueError, SyntaxError):
            pass  # words (bfloat16) as strings
        extra[key.replace("-", "_")] = value
    llm = kvpage.LLM(model=args.model, **extra)
    params = kvpage.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([f"{SYSTEM_PROMPT} Q{i}" for i in range(args.npl)], params, use_tqdm=False)  # warm-up
    prompts = [f"{SYSTEM_PROMPT} R{i}" for i in range(args.npl)]
    if args.split:
        return print_split(llm, prompts, params, args)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{'op':36} {'calls':>7} {'self ms':>10} {'share':>7}")
    for e in events[:args.top]:
        print(f"{e.key[:36]:36} {e.count:7d} {e.self_cpu_time_total / 1e3:10.1f} {e.self_cpu_time_total / total:7.1%}")
    print(f"total self CPU {total / 1e6:.2f} s over {args.npl} prompts x {args.tokens} tokens")


def print_split(llm, prompts, params, args):
    """The step's parts over one job, decode steps only (the prefill step timed apart)."""
    engine = llm.llm_engine
    for request_id, prompt in enumerate(prompts):
        engine.add_request(f"split-{request_id}", prompt, params)
    engine.step()  # the prefill (and first token), outside the split
    split = split_engine(llm)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    timed = sum(split.seconds.values())
    split.seconds["outside step (generate loop)"] = wall - timed
    print(f"{'part':32} {'ms/step':>9} {'share':>7}")
    for name, seconds in sorted(split.seconds.items(), key=lambda kv: -kv[1]):
        print(f"{name:32} {seconds / steps * 1e3:9.3f} {seconds / wall:7.1%}")
    print(f"{steps} decode steps of {args.npl} sequence(s): {wall / steps * 1e3:.2f} ms/step,"
          f" {steps * args.npl / wall:.1f} tok/s")


if __name__ == "__main__":
    main()
