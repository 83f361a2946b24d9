"""Math lab 4, copy-on-write: blocks held by n = 2/4/8 parallel samples and by beam width 4, with
sharing (the real engine) vs without (each sequence its own copy), against the cost model.

    python bench/mathlab/copy_on_write.py [--prompt-tokens 500] [--max-tokens 33] [--threads 1]
    python bench/mathlab/copy_on_write.py --quick    # a 40-token prompt, 5 tokens: a smoke run

What runs: the default model (SmolLM2-135M fp32, 1 torch thread, block 16) on one prompt of 500
random token ids. n samples: one request with SamplingParams(n, temperature=1, seed=0, ignore_eos,
max_tokens=33): the prompt is computed once and the samples fork onto its blocks. Beam search:
SamplingParams(beam_width=4, max_tokens=33, ignore_eos). At every forward pass the runner is wrapped
to read the block pool: blocks in use and how many generated tokens each sequence then holds in the
cache. Each run gets a fresh engine (an empty prefix cache) over the same runner.
Without sharing is measured on the real BlockManager alone (no model: block counts do not depend on
the values): n sequences of the same prompt plus the same number of generated tokens, prefix caching
off. The seed's example, two samples of a 500-token prompt at their first divergence, is run too,
and with a 512-token (block-aligned) prompt.
Model: kvpage.costmodel.cow.parallel_sampling / beam_search (bounds) at each step's token count.
"""
from __future__ import annotations

import argparse
import dataclasses

from _common import (add_smoke_arguments, figure, output_name, print_table, random_ids, save_figure, set_threads,
                     write_result)

import kvpage  # noqa: E402
from kvpage.core import BlockManager, Sequence  # noqa: E402
from kvpage.costmodel import cow  # noqa: E402
from kvpage.engine.llm_engine import LLMEngine  # noqa: E402

BLOCK_SIZE = 16


def fresh_engine(llm) -> None:
    llm.llm_engine = LLMEngine(llm.runner, llm.tokenizer, dataclasses.replace(llm.llm_engine.config))


def trace_blocks(llm, prompt_len: int, params) -> tuple[list[dict], int]:
    """Run one request. At each forward pass: blocks in use and generated tokens per sequence in the
    cache (all sequences decode in lockstep, so one number); and the run's copy-on-write block copies."""
    fresh_engine(llm)
    runner, bm = llm.runner, llm.llm_engine.block_manager
    trace, execute = [], runner.execute

    def recording(batch):
        generated = max(s.start + len(s.token_ids) for s in batch.scheduled) - prompt_len
        trace.append({"generated": generated, "seqs": len(batch.scheduled), "blocks": bm.device.num_used})
        return execute(batch)

    runner.execute = recording
    try:
        llm.generate([random_ids(prompt_len, seed=3)], params, use_tqdm=False)
    finally:
        del runner.execute  # back to the class's method
    return trace, bm.stats().num_copy_on_write


def unshared_blocks(num_seqs: int, prompt_len: int, generated: int) -> int:
    bm = BlockManager(num_seqs * (prompt_len + generated) // BLOCK_SIZE + num_seqs, BLOCK_SIZE,
                      enable_prefix_caching=False)
    for i in range(num_seqs):
        bm.allocate(Sequence(i, [5] * (prompt_len + generated)))
    return bm.device.num_used


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=33)
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_arguments(parser, "a 40-token prompt, 5 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.max_tokens = 40, 5
    set_threads(args.threads)
    P = args.prompt_tokens
    llm = kvpage.LLM(model=args.model, num_kv_blocks=512, block_size=BLOCK_SIZE, swap_space_gib=0)
    runs, rows = {}, []
    configs = [(f"n={n}", n, kvpage.SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=args.max_tokens,
                                                   ignore_eos=True)) for n in (2, 4, 8)]
    configs.append(("beam 4", 4, kvpage.SamplingParams(beam_width=4, max_tokens=args.max_tokens, ignore_eos=True)))
    for label, k, params in configs:
        trace, copies = trace_blocks(llm, P, params)
        decode = [t for t in trace if t["generated"] > 0]
        plan = (cow.beam_search if params.use_beam_search else cow.parallel_sampling)
        for t in decode:
            p = plan(k, P, t["generated"], BLOCK_SIZE)
            t.update(model=p.blocks_shared, model_min=p.blocks_shared_min, unshared_model=p.blocks_unshared)
        last = decode[-1]
        runs[label] = trace
        rows.append({"run": label, "generated_in_cache": last["generated"], "blocks_shared_measured": last["blocks"],
                     "blocks_shared_model": (f"{last['model_min']}-{last['model']}"
                                             if last["model_min"] != last["model"] else last["model"]),
                     "blocks_unshared_measured": unshared_blocks(k, P, last["generated"]),
                     "blocks_unshared_model": last["unshared_model"],
                     "saved": f"{1 - last['blocks'] / last['unshared_model']:.0%}", "block_copies": copies,
                     "steps_matching_model": sum(t["model_min"] <= t["blocks"] <= t["model"] for t in decode),
                     "decode_steps": len(decode)})
    # The seed's example: two samples at the moment they first diverge (one generated token in cache).
    diverge = []
    for prompt_len in (P, 512):
        params = kvpage.SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=2, ignore_eos=True)
        t = [x for x in trace_blocks(llm, prompt_len, params)[0] if x["generated"] > 0][-1]
        diverge.append({"prompt_tokens": prompt_len, "blocks_measured": t["blocks"],
                        "blocks_model": cow.parallel_sampling(2, prompt_len, 1, BLOCK_SIZE).blocks_shared,
                        "seed_statement": -(-prompt_len // BLOCK_SIZE) + 2,
                        "unshared": unshared_blocks(2, prompt_len, 1)})
    print(f"prompt {P} tokens, max_tokens {args.max_tokens}, block {BLOCK_SIZE}; counts at the last forward pass")
    print_table(rows, list(rows[0]))
    print("two samples at first divergence:")
    print_table(diverge, list(diverge[0]))
    payload = {"config": vars(args), "rows": rows, "first_divergence": diverge, "traces": runs}
    name = output_name("copy_on_write", args.quick)
    write_result(name, payload)
    plot(runs, rows, P, name)
    return payload


def plot(runs, rows, prompt_len, name: str) -> None:
    fig, axes = figure(1, 2)
    ax = axes[0][0]
    for i, (label, trace) in enumerate(runs.items()):
        decode = [t for t in trace if t["generated"] > 0]
        g = [t["generated"] for t in decode]
        ax.plot(g, [t["blocks"] for t in decode], "o", ms=3, color=f"C{i}", label=f"{label}, measured")
        ax.plot(g, [t["model"] for t in decode], "-", color=f"C{i}", alpha=0.6, label=f"{label}, model")
        if any(t["model_min"] != t["model"] for t in decode):
            ax.plot(g, [t["model_min"] for t in decode], ":", color=f"C{i}", label=f"{label}, model lower bound")
    ax.set_xlabel("generated tokens per sequence in the cache")
    ax.set_ylabel("KV blocks in use")
    ax.set_title(f"blocks over the run ({prompt_len}-token prompt)")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[0][1]
    x = range(len(rows))
    ax.bar_label(ax.bar([i - 0.2 for i in x], [r["blocks_unshared_measured"] for r in rows], 0.4, color="C3",
                        label="without sharing"))
    ax.bar_label(ax.bar([i + 0.2 for i in x], [r["blocks_shared_measured"] for r in rows], 0.4, color="C0",
                        label="copy-on-write (measured)"))
    ax.set_xticks(list(x), [r["run"] for r in rows])
    ax.set_ylabel("KV blocks at the last step")
    ax.legend()
    save_figure(fig, name)


if __name__ == "__main__":
    main()
