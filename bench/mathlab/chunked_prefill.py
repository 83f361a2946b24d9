"""Math lab 6, chunked prefill: the inter-token latency of running decodes while a long prompt
arrives, chunked (a small token budget per step) vs not (a budget that takes the whole prompt).

    python bench/mathlab/chunked_prefill.py [--prompt-tokens 2048] [--chunk 512] [--threads 1]
    python bench/mathlab/chunked_prefill.py --quick    # a 128-token prompt in chunks of 64: a smoke run

What runs: the default model (SmolLM2-135M fp32, 1 torch thread, block 16). Four requests with
32-token prompts decode (greedy, ignore_eos, 48 tokens each); after 6 decode steps a long prompt
(random ids, max_tokens=1) arrives: 2,048 tokens by default, because one 4,096-token prefill takes
about 50 s on one shared core and the two runs then pass two minutes; `--prompt-tokens 4096` is the
issue's size (written as chunked_prefill_4096.json / .png). Run twice on fresh engines over the
same runner: max_num_batched_tokens = 512 (the prompt goes in chunks beside the decodes, which the
scheduler serves first every step) and = prompt + 4 (the whole prompt in one step). Every step of the engine is
timed; while anyone decodes, a step's time is their inter-token latency.
Model: kvpage.costmodel.chunked_prefill_steps on this machine's measured constants (roofline per
step), and the same with its FLOP rate calibrated on the measured one-step prefill, so the chunked
prediction tests how the model prices chunks (including their attention over the growing cached
prompt), not its absolute speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from _common import (add_smoke_arguments, figure, median, output_name, print_table, random_ids, save_figure,
                     this_device, write_result)

import kvpage  # noqa: E402
from kvpage import costmodel  # noqa: E402
from kvpage.engine.llm_engine import LLMEngine  # noqa: E402

NUM_DECODES, DECODE_PROMPT, DECODE_TOKENS, WARM_STEPS, BLOCK_SIZE = 4, 32, 48, 6, 16
DEFAULT_PROMPT = 2048


def run(llm, budget: int, long_prompt: list[int]) -> dict:
    engine = LLMEngine(llm.runner, llm.tokenizer,
                       dataclasses.replace(llm.llm_engine.config, max_num_batched_tokens=budget))
    composition, execute = [], llm.runner.execute

    def recording(batch):  # what each step ran: decode rows and tokens of the long prompt
        composition.append({"decodes": sum(1 for s in batch.scheduled if s.request_id != "long"),
                            "prompt_tokens": sum(len(s.token_ids) for s in batch.scheduled if s.request_id == "long")})
        return execute(batch)

    llm.runner.execute = recording
    try:
        for i in range(NUM_DECODES):
            engine.add_request(f"d{i}", random_ids(DECODE_PROMPT, seed=10 + i),
                               kvpage.SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True),
                               stream=False)
        steps, arrival_step, ttft = [], None, None
        while engine.has_unfinished_requests():
            if len(steps) == WARM_STEPS + 1:  # the decodes are past their prefill and 6 decode steps
                engine.add_request("long", long_prompt, kvpage.SamplingParams(temperature=0.0, max_tokens=1),
                                   stream=False)
                arrival_step, arrived = len(steps), time.perf_counter()
            t0 = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - t0)
            if any(o.request_id == "long" for o in outs):
                ttft = time.perf_counter() - arrived
    finally:
        del llm.runner.execute
    rows = [{"step": i, "seconds": t, **c} for i, (t, c) in enumerate(zip(steps, composition))]
    during = [r for r in rows if r["prompt_tokens"] and r["decodes"]]
    decode_only = [r for r in rows[2:] if not r["prompt_tokens"] and r["decodes"] == NUM_DECODES]
    return {"budget": budget, "rows": rows, "arrival_step": arrival_step, "long_ttft_s": ttft,
            "chunks": len([r for r in rows if r["prompt_tokens"]]),
            "itl_max_during_s": max(r["seconds"] for r in during),
            "itl_mean_during_s": sum(r["seconds"] for r in during) / len(during),
            "itl_decode_only_median_s": median([r["seconds"] for r in decode_only])}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens of the chunked run")
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_arguments(parser, "a 128-token prompt in chunks of 64")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.chunk = 128, 64
    device = this_device(args.threads)
    shape = costmodel.get_model("smollm2-135m")
    whole = args.prompt_tokens + NUM_DECODES
    llm = kvpage.LLM(model=args.model, num_kv_blocks=args.prompt_tokens // BLOCK_SIZE + 64, block_size=BLOCK_SIZE,
                     swap_space_gib=0)
    llm.generate([random_ids(64, seed=7)], kvpage.SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    long_prompt = random_ids(args.prompt_tokens, seed=1)
    runs = {"chunked": run(llm, args.chunk, long_prompt), "whole": run(llm, whole, long_prompt)}

    contexts = [DECODE_PROMPT + WARM_STEPS] * NUM_DECODES
    model = {name: costmodel.chunked_prefill_steps(shape, device, args.prompt_tokens, contexts, r["budget"], 4)
             for name, r in runs.items()}
    # Calibrate the FLOP rate on the measured one-step prefill (the step is compute-bound).
    measured_whole = runs["whole"]["itl_max_during_s"]
    eff = min(1.0, model["whole"][0] / measured_whole)
    cal_device = dataclasses.replace(device, flops_efficiency=eff)
    cal = {name: costmodel.chunked_prefill_steps(shape, cal_device, args.prompt_tokens, contexts, r["budget"], 4)
           for name, r in runs.items()}
    decode_model = costmodel.step_seconds(shape, device, [costmodel.Chunk(1, c) for c in contexts], 4)
    table = []
    for name, r in runs.items():
        table.append({"run": f"{name} (budget {r['budget']})", "chunks": r["chunks"],
                      "itl_max_s": r["itl_max_during_s"], "model_itl_max_s": max(model[name]),
                      "cal_model_itl_max_s": max(cal[name]), "itl_mean_s": r["itl_mean_during_s"],
                      "cal_model_itl_mean_s": sum(cal[name]) / len(cal[name]),
                      "decode_only_itl_s": r["itl_decode_only_median_s"], "model_decode_itl_s": decode_model,
                      "long_prompt_ttft_s": r["long_ttft_s"], "cal_model_ttft_s": sum(cal[name])})
    print(f"{NUM_DECODES} decodes + a {args.prompt_tokens}-token prompt; {args.threads} thread(s);"
          f" model FLOP rate calibrated to {eff:.0%} of the measured matmul rate")
    print_table([{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in t.items()} for t in table], list(table[0]))
    payload = {"config": vars(args), "num_decodes": NUM_DECODES, "decode_prompt_tokens": DECODE_PROMPT,
               "decode_max_tokens": DECODE_TOKENS, "arrives_after_decode_steps": WARM_STEPS, "device": device,
               "calibrated_flops_efficiency": eff, "table": table, "runs": runs,
               "model_steps_s": model, "calibrated_model_steps_s": cal}
    size = "" if args.prompt_tokens == DEFAULT_PROMPT or args.quick else f"_{args.prompt_tokens}"
    name = output_name(f"chunked_prefill{size}", args.quick)
    write_result(name, payload)
    plot(runs, cal, model, args, name)
    return payload


def plot(runs, cal, model, args, name: str) -> None:
    fig, axes = figure(1, 2)
    ax = axes[0][0]
    for i, (run_name, r) in enumerate(runs.items()):
        rows = r["rows"]
        ax.plot([x["step"] for x in rows], [x["seconds"] for x in rows], "o-", ms=3, color=f"C{i}",
                label=f"{run_name} (budget {r['budget']}), measured")
        start = r["arrival_step"]
        ax.plot(range(start, start + len(cal[run_name])), cal[run_name], "x--", color=f"C{i}",
                label=f"{run_name}, model (calibrated)")
    ax.set_yscale("log")
    ax.set_xlabel("engine step")
    ax.set_ylabel("step time = decodes' inter-token latency (s)")
    ax.set_title(f"{args.prompt_tokens}-token prompt arrives beside {NUM_DECODES} decodes")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    names = list(runs)
    x = range(len(names))
    ax.bar_label(ax.bar([i - 0.2 for i in x], [runs[n]["itl_max_during_s"] for n in names], 0.4, color="C3",
                        label="worst inter-token latency"), fmt="%.2f")
    ax.bar_label(ax.bar([i + 0.2 for i in x], [runs[n]["long_ttft_s"] for n in names], 0.4, color="C7",
                        label="long prompt's time to first token"), fmt="%.2f")
    ax.set_xticks(list(x), [f"{n}\n(budget {runs[n]['budget']})" for n in names])
    ax.set_ylabel("s")
    ax.legend(fontsize=8)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
