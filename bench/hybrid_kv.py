"""Hybrid KV cache on a Gemma-3-shaped model at 16k-token contexts: blocks per sequence, sequences that fit in
one pool, and decode step time, against the same model with every layer full attention.

    PYTHONPATH=python python bench/hybrid_kv.py                # the figures for docs/results.md
    PYTHONPATH=python python bench/hybrid_kv.py --quick        # a smoke run: 4k contexts, fewer rounds

Model: Gemma 3's real layer pattern (layer l is full attention where (l + 1) % 6 == 0, the other five of
each six a sliding window of 1,024), 12 layers, hidden 256, 4 query heads over 1 KV head of head_dim 128,
random weights (Gemma3ForCausalLM, transformers' modules with kvpage attention); the "all-full" model is
the same weights with every layer full attention. Block size 16, float32 cache.

(a) Capacity, no model run: the real Scheduler and BlockManager (kvpage.core) with a fake sampler fill a pool
    of fixed bytes with 16k-token prompts (chunked prefill of --chunk tokens, then --decode tokens each):
    block ids one sequence holds at its first decode step, in bytes against the all-full layout (a hybrid
    block id is group_size layers' block, an all-full one every layer's), and the most sequences decoding
    at once (requests decode --decode tokens, so the pool, not the step budget, limits how many overlap).
(b) Decode step time: ModelRunner.execute of one decode step of --batch sequences at --context tokens, the
    caches filled with random K/V instead of a 16k-token prefill (the step reads the same bytes either
    way); hybrid and all-full alternate within each round, the median over rounds of each round's ratio.
Writes bench/results/hybrid_kv.json (hybrid_kv_quick.json with --quick).
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from common import machine_info, print_table, write_json  # noqa: E402
from kvpage.core import NULL_BLOCK, BlockManager, Scheduler, kv_cache_layout  # noqa: E402
from kvpage.model import ModelInput, ModelRunner, SequenceInput  # noqa: E402
from kvpage.model.runner import model_kv_cache_layout  # noqa: E402

WINDOW, BLOCK = 1024, 16
NUM_LAYERS = 12


def layer_types(hybrid: bool) -> list[str]:
    return ["full_attention" if not hybrid or (l + 1) % 6 == 0 else "sliding_attention" for l in range(NUM_LAYERS)]


def gemma3_shaped(hybrid: bool, seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=NUM_LAYERS,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=128, sliding_window=WINDOW,
                              layer_types=layer_types(hybrid), max_position_embeddings=32768,
                              query_pre_attn_scalar=128, tie_word_embeddings=True)
    return Gemma3ForCausalLM(config).eval()


# -- (a) blocks per sequence and sequences in one pool -----------------------------------------------------

def fill_pool(layout, num_blocks: int, context: int, decode: int, chunk: int, num_requests: int) -> dict:
    """Run num_requests prompts of `context` tokens through the real scheduler on a pool of num_blocks;
    the block ids one sequence holds while decoding, and the most sequences decoding at once."""
    bm = BlockManager(num_blocks, BLOCK, kv_cache_layout=layout, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_batched_tokens=chunk, max_num_seqs=1024, preemption_mode="recompute")
    rng = random.Random(0)
    for i in range(num_requests):
        sched.add_request(str(i), [rng.randrange(3, 1000) for _ in range(context)], max_tokens=decode,
                          eos_token_id=None)
    most_decoding, held, steps = 0, None, 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        decoding = [s for s in out.scheduled if not s.is_prefill]
        most_decoding = max(most_decoding, len(decoding))
        if decoding and held is None and decoding[0].start >= context:
            held = sum(b != NULL_BLOCK for table in decoding[0].block_tables for b in table)
        sched.update_from_output(out, {s.seq_id: 7 for s in out.scheduled if s.do_sample})
    stats = sched.stats()
    return {"block_ids_per_seq": held, "most_decoding_at_once": most_decoding, "steps": steps,
            "preemptions": stats.num_preemptions}


def capacity(context: int, decode: int, chunk: int, full_seqs: int, num_requests: int) -> dict:
    hybrid_layout = model_kv_cache_layout(gemma3_shaped(True).config)
    full_layout = kv_cache_layout([None] * NUM_LAYERS)
    # A pool of the same bytes: room for full_seqs all-full sequences, in each layout's block ids.
    full_ids = full_seqs * -(-(context + decode) // BLOCK)
    hybrid_ids = full_ids * full_layout.group_size // hybrid_layout.group_size
    hybrid = fill_pool(hybrid_layout, hybrid_ids, context, decode, chunk, num_requests)
    full = fill_pool(full_layout, full_ids, context, decode, chunk, num_requests)
    layer_blocks = {name: r["block_ids_per_seq"] * layout.group_size
                    for name, r, layout in (("hybrid", hybrid, hybrid_layout), ("all_full", full, full_layout))}
    return {"pool_bytes_in_layer_blocks": full_ids * full_layout.group_size,
            "hybrid_groups": [[g.sliding_window, len(g.layer_ids)] for g in hybrid_layout.groups],
            "hybrid": hybrid, "all_full": full, "layer_blocks_per_seq": layer_blocks,
            "blocks_per_seq_ratio": round(layer_blocks["hybrid"] / layer_blocks["all_full"], 4),
            "sequences_ratio": round(hybrid["most_decoding_at_once"] / full["most_decoding_at_once"], 3)}


# -- (b) decode step time ----------------------------------------------------------------------------------

def decode_runner(hybrid: bool, batch: int, context: int) -> tuple[ModelRunner, ModelInput]:
    """A runner whose cache holds `batch` sequences of `context` tokens of random K/V, each in its own blocks
    (a window group only its window's, NULL_BLOCK before it), and one decode step for them."""
    model = gemma3_shaped(hybrid)
    layout = model_kv_cache_layout(model.config)
    need = -(-(context + 1) // BLOCK)
    first_kept = [0 if g.sliding_window is None else max(0, context - g.sliding_window + 1) // BLOCK
                  for g in layout.groups]
    per_seq = sum(need - k for k in first_kept)
    runner = ModelRunner(model, num_kv_blocks=batch * per_seq, block_size=BLOCK, kv_cache_layout=layout)
    gen = torch.Generator().manual_seed(0)
    for key, value in runner.kv_cache_pairs:
        key.normal_(generator=gen)
        value.normal_(generator=gen)
    next_id, seqs = 0, []
    for i in range(batch):
        tables = []
        for k in first_kept:
            tables.append([NULL_BLOCK] * k + list(range(next_id, next_id + need - k)))
            next_id += need - k
        slots = [t[context // BLOCK] * BLOCK + context % BLOCK for t in tables]
        seqs.append(SequenceInput([5 + i], context, tables[0], [slots[0]], block_tables=tables,
                                  slot_mappings=[[s] for s in slots]))
    return runner, ModelInput(seqs)


def time_steps(runner: ModelRunner, step: ModelInput, repeats: int) -> float:
    """The fastest of `repeats` decode steps (the same step: it rewrites the same slots)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        runner.execute(step)
        best = min(best, time.perf_counter() - t)
    return best


def decode_time(batch: int, context: int, rounds: int, repeats: int) -> dict:
    runners = {name: decode_runner(name == "hybrid", batch, context) for name in ("hybrid", "all_full")}
    for runner, step in runners.values():
        runner.execute(step)  # warm-up
    times = {name: [] for name in runners}
    for r in range(rounds):
        order = ("hybrid", "all_full") if r % 2 == 0 else ("all_full", "hybrid")  # alternate who goes first
        for name in order:
            times[name].append(time_steps(*runners[name], repeats))
    ratios = [h / f for h, f in zip(times["hybrid"], times["all_full"])]
    return {"batch": batch, "context": context, "rounds": rounds, "repeats_per_round": repeats,
            "hybrid_ms": [round(1e3 * t, 2) for t in times["hybrid"]],
            "all_full_ms": [round(1e3 * t, 2) for t in times["all_full"]],
            "ratio_per_round": [round(x, 3) for x in ratios], "ratio_median": round(statistics.median(ratios), 3),
            "hybrid_kv_cache_mib": round(sum(t.numel() * t.element_size() for kv in runners["hybrid"][0].kv_cache_pairs
                                             for t in kv) / 2**20, 1),
            "all_full_kv_cache_mib": round(sum(t.numel() * t.element_size()
                                               for kv in runners["all_full"][0].kv_cache_pairs for t in kv) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--decode", type=int, default=1024,
                        help="tokens each request decodes in (a): long enough that the admitted ones overlap")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens in (a)")
    parser.add_argument("--full-seqs", type=int, default=4, help="(a)'s pool: this many all-full sequences' bytes")
    parser.add_argument("--requests", type=int, default=32, help="(a): prompts submitted")
    parser.add_argument("--batch", type=int, default=4, help="(b): sequences in the decode step")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5, help="(b): steps per round and model (the fastest counts)")
    parser.add_argument("--quick", action="store_true", help="4k contexts, 3 rounds: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.context, args.decode, args.requests, args.rounds, args.repeats = 4096, 256, 12, 3, 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    cap = capacity(args.context, args.decode, args.chunk, args.full_seqs, args.requests)
    print(f"(a) {args.context}-token sequences, pool of {args.full_seqs} all-full sequences' bytes")
    print_table([{"layout": name, "block ids/seq": r["block_ids_per_seq"],
                  "layer-blocks/seq": cap["layer_blocks_per_seq"][name], "decoding at once": r["most_decoding_at_once"],
                  "preemptions": r["preemptions"]} for name, r in (("hybrid", cap["hybrid"]), ("all_full", cap["all_full"]))],
                ["layout", "block ids/seq", "layer-blocks/seq", "decoding at once", "preemptions"])
    print(f"blocks per sequence hybrid / all-full: {cap['blocks_per_seq_ratio']:.1%} (target <= 25%);"
          f" sequences at once: {cap['sequences_ratio']:.2f}x (target >= 4x)")
    dec = decode_time(args.batch, args.context, args.rounds, args.repeats)
    print(f"(b) decode step, {args.batch} sequences at {args.context} tokens: hybrid {dec['hybrid_ms']} ms,"
          f" all-full {dec['all_full_ms']} ms")
    print(f"hybrid / all-full step time: median {dec['ratio_median']:.3f} over {args.rounds} rounds"
          f" {dec['ratio_per_round']} (target <= 0.5)")
    path = write_json("hybrid_kv_quick" if args.quick else "hybrid_kv", {"args": vars(args), "machine": machine_info(), "capacity": cap, "decode": dec})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
