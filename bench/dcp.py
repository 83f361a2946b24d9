"""Decode context parallelism on CPU: what D buys (KV capacity) and what it costs (bytes moved, step time).

Model: a random Llama-shaped MQA model (1 KV head, 8 query heads, head_dim 32, fp32; built from a config,
nothing downloaded) at tensor_parallel_size=4, so every rank holds the one KV head: D = 1, 2, 4 on the same
four processes, the same per-rank KV budget (num_kv_blocks blocks of block_size tokens on every rank).
  capacity   requests of a 64-token prompt decode (greedy, ignore_eos) until the first preemption; the most
             tokens the running sequences held in KV at once before it, and that against D=1 (target >= 0.95 D)
  step       decode steps of `--batch` sequences at a context of ~`--context` tokens (what D=1's budget holds):
             the mean step time on the driver (rounds alternate D=1, 2, 4 over the same live engines)
  bytes      what rank 0 received in the DCP group's collectives per decode step per layer (counted on the
             collectives themselves), beside what model/context_parallel.py's arithmetic predicts
On 2 cores four ranks share the machine, so step times are the cost of the extra collectives on a loaded host,
not a speed-up: DCP is for capacity.

    python bench/dcp.py            # a few minutes on 2 cores
    python bench/dcp.py --quick    # a smoke run (TP=2, D=1 and 2, a small budget, short contexts)

Writes bench/results/dcp.json (dcp_quick.json) and prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, machine_info, print_table, write_json  # noqa: E402

import kvpage  # noqa: E402

SIZES = (1, 2, 4)
QUICK_SIZES = (1, 2)  # --quick: two ranks, not four
LAYERS = 2
HEADS = 8


def mqa_model(max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=1, head_dim=32, max_position_embeddings=max_len,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


class CountingGroup:
    """The DCP collectives of rank 0, counting the bytes it receives (every other rank receives as much)."""

    def __init__(self, group) -> None:
        self.group, self.received = group, 0

    def all_gather(self, t):
        self.received += t.numel() * t.element_size() * (self.group.world_size - 1)
        return self.group.all_gather(t)

    def all_to_all(self, out, t):
        self.received += t.numel() * t.element_size() * (self.group.world_size - 1) // self.group.world_size
        self.group.all_to_all(out, t)


def predicted_bytes(size: int, tokens: int, heads_per_rank: int, head_dim: int, elt: int) -> int:
    """Per rank per layer: the gathered query, then the partial outputs and LSEs of its own heads."""
    return (size - 1) * tokens * heads_per_rank * (2 * head_dim * elt + 4)


def held_tokens(llm) -> int:
    """Tokens whose K/V the running sequences hold."""
    return sum(seq.num_computed_tokens for seq in llm.llm_engine.scheduler.sequences())


def capacity(llm, num_requests: int) -> int:
    """The most tokens held at once before the first preemption (all requests still unfinished then). Each
    request alone fits the cache (the scheduler refuses one that cannot); together they cannot."""
    engine = llm.llm_engine
    stats = engine.stats()
    fits = (stats["num_kv_blocks"] - 1) * stats["block_size"] - 64
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=fits, ignore_eos=True)
    ids = [f"cap{k}" for k in range(num_requests)]
    for k, rid in enumerate(ids):
        engine.add_request(rid, [(7 * k + j) % 500 + 3 for j in range(64)], params, stream=False)
    peak = 0
    while engine.has_unfinished_requests() and engine.stats()["num_preemptions"] == 0:
        engine.step()
        peak = max(peak, held_tokens(llm))
    assert engine.stats()["num_preemptions"] > 0, "the budget never filled: raise --capacity-requests"
    engine.abort_request(ids)
    return peak


def decode_steps(llm, batch: int, context: int, steps: int, counter: CountingGroup | None) -> tuple[float, float]:
    """(mean seconds of a decode step of `batch` sequences at about `context` tokens, bytes rank 0 received in
    DCP collectives per decode step per layer)."""
    engine = llm.llm_engine
    params = kvpage.SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [f"step{time.monotonic_ns()}_{k}" for k in range(batch)]
    for k, rid in enumerate(ids):
        engine.add_request(rid, [(11 * k + j) % 500 + 3 for j in range(context)], params, stream=False)
    while any(seq.num_computed_tokens < context for seq in engine.scheduler.sequences()):
        engine.step()  # the prefill, not timed
    before = counter.received if counter else 0
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    received = (counter.received - before) if counter else 0
    return statistics.mean(times), received / (len(times) * LAYERS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-kv-blocks", type=int, default=64, help="per rank (the same at every D)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--batch", type=int, default=2, help="decode batch; batch * (context + 17) must fit D=1's budget")
    ap.add_argument("--capacity-requests", type=int, default=4)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.num_kv_blocks, args.context = 1, 8, 48
    sizes = QUICK_SIZES if args.quick else SIZES
    tp = max(sizes)
    model = mqa_model(2 * args.num_kv_blocks * args.block_size * tp)
    llms, counters = {}, {}
    try:
        for d in sizes:
            llms[d] = kvpage.LLM(model=model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                                 max_num_seqs=64, preemption_mode="recompute", tensor_parallel_size=tp,
                                 decode_context_parallel_size=d, enable_prefix_caching=False)
            cp = llms[d].runner.runner.context_parallel
            if cp is not None:
                counters[d] = cp.group = CountingGroup(cp.group)
        rows = [{"D": d, "capacity_tokens": capacity(llms[d], args.capacity_requests)} for d in sizes]
        steps = {d: [] for d in sizes}
        received = {}
        batch = args.batch
        for _ in range(args.rounds):
            for d in sizes:
                seconds, received[d] = decode_steps(llms[d], batch, args.context, 4 if args.quick else 16,
                                                    counters.get(d))
                steps[d].append(seconds)
    finally:
        for llm in llms.values():
            llm.shutdown()
    base = rows[0]
    for row in rows:
        d = row["D"]
        row |= {"capacity_vs_D1": round(row["capacity_tokens"] / base["capacity_tokens"], 3),
                "target": round(0.95 * d, 2),
                "decode_step_ms": round(1e3 * statistics.median(steps[d]), 2),
                "step_vs_D1": round(statistics.median(steps[d]) / statistics.median(steps[1]), 3),
                "predicted_dcp_bytes_per_layer": predicted_bytes(d, batch, HEADS // tp, 32, 4),
                "received_dcp_bytes_per_layer": round(received[d])}
    payload = {"cpu": cpu_model(), "machine": machine_info(), "args": vars(args), "tensor_parallel_size": tp,
               "layers": LAYERS, "rows": rows}
    write_json("dcp_quick" if args.quick else "dcp", payload)
    print(f"CPU: {cpu_model()}  TP={tp}, MQA model, {args.num_kv_blocks} blocks x {args.block_size} tokens per rank")
    print_table(rows, ["D", "capacity_tokens", "capacity_vs_D1", "target", "decode_step_ms", "step_vs_D1",
                       "predicted_dcp_bytes_per_layer", "received_dcp_bytes_per_layer"])


if __name__ == "__main__":
    main()
