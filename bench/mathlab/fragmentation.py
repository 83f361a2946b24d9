"""Math lab 1, fragmentation: KV slots allocated vs used, paging vs reservation for the maximum length.

    python bench/mathlab/fragmentation.py [--num-requests 600] [--num-blocks 1456]
    python bench/mathlab/fragmentation.py --quick    # 60 requests in 256 blocks: a smoke run

Bookkeeping only (no model runs): the real BlockManager and Scheduler make every allocation.
Workload: ShareGPT-like (bench/mathlab/_common.py): prompt and output lengths lognormal with means 161
and 338 tokens, clipped to [4, 1024], max_len = 2048, all requests queued at once, every output
generated in full. Pool: 1456 blocks of 16 tokens, which is what the engine's default 1 GiB CPU
KV budget holds for the default model (SmolLM2-135M, fp32: 45 KiB per token).

  0. The block table of one 8,192-token sequence (real BlockManager; int32 entries, as the kernels
     take block_tables), and the token that first takes a second block.
  A. At completion: every sequence held at its final length. Slots allocated by paging (whole
     blocks, the real BlockManager) vs reserved (max_len each) vs used (its tokens), against the
     cost model's closed forms (paging wastes (block_size - 1) / 2 slots per sequence on average).
  B. Over a run: the Scheduler serves the workload in the fixed pool with paging, and again capped
     at pool / max_len running sequences, which is all a reserving server can admit. Each step
     records slots allocated and slots holding K/V, and the running sequences; the paged
     concurrency is compared with the cost model's pool / (time-averaged length + half a block).
"""
from __future__ import annotations

import argparse

from _common import (WORKLOAD_TEXT, add_smoke_arguments, figure, output_name, print_table, save_figure, sharegpt_like,
                     write_result)

from kvpage.core import BlockManager, Scheduler, Sequence
from kvpage.costmodel import memory

MAX_LEN = 2048


def block_table(block_size: int, context: int = 8192) -> dict:
    from array import array

    bm = BlockManager(context // block_size + 2, block_size, enable_prefix_caching=False)
    seq = Sequence(0, [1] * block_size)
    bm.allocate(seq)
    bm.mark_computed(seq, block_size)
    sizes = {block_size: len(seq.block_table)}
    seq.append_token(1)  # token block_size + 1
    bm.append_slots(seq, 1)
    sizes[block_size + 1] = len(seq.block_table)
    long = Sequence(1, [1] * context)
    bm.allocate(long)
    return {"context": context, "blocks": len(long.block_table),
            "table_bytes_int32": len(array("i", long.block_table).tobytes()),
            "blocks_after_tokens": sizes}


def at_completion(work, block_size: int) -> dict:
    lengths = [p + o for p, o in zip(work.prompt_lens, work.output_lens)]
    bm = BlockManager(sum(memory.blocks_per_sequence(n, block_size) for n in lengths), block_size,
                      enable_prefix_caching=False)
    for i, n in enumerate(lengths):
        bm.allocate(Sequence(i, [1] * n))
    used = sum(lengths)
    paged = bm.device.num_used * block_size
    reserved = memory.reserved_slots(lengths, MAX_LEN)
    mean = used / len(lengths)
    return {
        "num_sequences": len(lengths), "mean_len": mean, "used_slots": used,
        "paged_slots_measured": paged, "paged_slots_model": memory.paged_slots(lengths, block_size),
        "reserved_slots": reserved,
        "paged_waste_measured": 1 - used / paged,
        "paged_waste_model": 1 - mean / memory.expected_paged_tokens(mean, block_size),
        "reserved_waste_measured": 1 - used / reserved, "reserved_waste_model": 1 - mean / MAX_LEN,
    }


def serve(work, prompts, num_blocks: int, block_size: int, max_num_seqs: int, reserve: bool) -> dict:
    """Run the workload on the real Scheduler; per-step slots and concurrency."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=max_num_seqs, preemption_mode="recompute")
    for i, (p, o) in enumerate(zip(prompts, work.output_lens)):
        sched.add_request(str(i), p, max_tokens=o, eos_token_id=None)
    trace = {"allocated": [], "used": [], "running": [], "saturated": []}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        # Any token id will do: every request generates its full length.
        sched.update_from_output(out, {s.seq_id: 7 for s in out.scheduled if s.do_sample})
        running = [seq for r in sched.running for seq in r.live_seqs()]
        used = sum(seq.num_computed_tokens for seq in running)
        trace["used"].append(used)
        trace["allocated"].append(len(running) * MAX_LEN if reserve else bm.device.num_used * block_size)
        trace["running"].append(len(running))
        trace["saturated"].append(bool(sched.waiting))  # still a queue: the pool is the limit
    sat = [i for i, s in enumerate(trace["saturated"]) if s]
    stats = sched.stats()
    return {
        "steps": len(trace["used"]), "preemptions": stats.num_preemptions,
        "mean_running_saturated": sum(trace["running"][i] for i in sat) / max(1, len(sat)),
        "waste_saturated": 1 - sum(trace["used"][i] for i in sat) / max(1, sum(trace["allocated"][i] for i in sat)),
        "trace": trace,
    }


def running_mean_len(work) -> float:
    """Mean length of a running sequence at a random step: a request with prompt p and output o runs
    about o steps holding p + o/2 tokens on average, so weight each by o: E[o (p + o/2)] / E[o]."""
    num = sum(o * (p + o / 2) for p, o in zip(work.prompt_lens, work.output_lens))
    return num / sum(work.output_lens)


def predicted_running(work, pool_tokens: int, block_size: int) -> tuple[float, float]:
    """(concurrent sequences, waste fraction) while the pool is full: pool / slots per running
    sequence, which is its time-averaged length plus half a block."""
    slots = memory.expected_paged_tokens(running_mean_len(work), block_size)
    return pool_tokens / slots, 1 - running_mean_len(work) / slots


def plot(a: dict, paged: dict, reserved: dict, cap: int, predicted: float, name: str) -> None:
    fig, axes = figure(1, 3, width=16)
    ax = axes[0][0]
    labels = ["paging", "reservation"]
    x = range(2)
    for dx, key, label in ((-0.2, "model", "cost model"), (0.2, "measured", "measured (BlockManager)")):
        bars = ax.bar([i + dx for i in x], [100 * a[f"paged_waste_{key}"], 100 * a[f"reserved_waste_{key}"]], 0.4,
                      label=label)
        ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("% of allocated KV slots never written")
    ax.set_title(f"A. waste at completion ({a['num_sequences']} sequences)")
    ax.legend()
    ax = axes[0][1]
    for run, label, color in ((paged, "paging", "C0"), (reserved, f"reservation (cap {cap})", "C3")):
        t = run["trace"]
        ax.plot(t["allocated"], color=color, label=f"{label}: allocated")
        ax.plot(t["used"], color=color, linestyle="--", label=f"{label}: holding K/V")
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("KV slots (tokens)")
    ax.set_title("B. slots allocated vs used over the run")
    ax.legend(fontsize=7)
    ax = axes[0][2]
    bars = [("reservation\n(pool / max_len)", cap), ("paging\nmodel", predicted),
            ("paging\nmeasured", paged["mean_running_saturated"])]
    ax.bar_label(ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["C3", "C1", "C0"]), fmt="%.1f")
    ax.set_ylabel("concurrent sequences (pool saturated)")
    ax.set_title("B. sequences that fit in the pool")
    save_figure(fig, name)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--num-blocks", type=int, default=1456)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    add_smoke_arguments(parser, "60 requests in 256 blocks")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.num_blocks = 60, 256
    work = sharegpt_like(args.num_requests, MAX_LEN, args.seed)
    prompts = work.prompts(args.seed)
    bs = args.block_size
    table = block_table(bs)
    a = at_completion(work, bs)
    pool_tokens = args.num_blocks * bs
    cap = pool_tokens // MAX_LEN
    paged = serve(work, prompts, args.num_blocks, bs, max_num_seqs=256, reserve=False)
    reserved = serve(work, prompts, args.num_blocks, bs, max_num_seqs=cap, reserve=True)
    predicted, predicted_waste = predicted_running(work, pool_tokens, bs)
    print(f"workload: {WORKLOAD_TEXT}; {args.num_requests} requests, mean length {a['mean_len']:.0f} tokens")
    print_table([
        {"quantity": "blocks for an 8192-token sequence", "model": memory.blocks_per_sequence(8192, bs),
         "measured": table["blocks"]},
        {"quantity": "its block table, int32 bytes", "model": memory.block_table_bytes(8192, bs),
         "measured": table["table_bytes_int32"]},
        {"quantity": f"blocks after {bs} / {bs + 1} tokens", "model": "1 / 2",
         "measured": " / ".join(str(v) for v in table["blocks_after_tokens"].values())},
        {"quantity": "waste at completion, paging", "model": f"{a['paged_waste_model']:.2%}",
         "measured": f"{a['paged_waste_measured']:.2%}"},
        {"quantity": f"waste at completion, reserving {MAX_LEN}", "model": f"{a['reserved_waste_model']:.2%}",
         "measured": f"{a['reserved_waste_measured']:.2%}"},
        {"quantity": "waste over the run (saturated), paging", "model": f"{predicted_waste:.2%}",
         "measured": f"{paged['waste_saturated']:.2%}"},
        {"quantity": "waste over the run (saturated), reserving",
         "model": f"{1 - running_mean_len(work) / MAX_LEN:.2%}",
         "measured": f"{reserved['waste_saturated']:.2%}"},
        {"quantity": f"concurrent seqs in {pool_tokens} slots, reserving", "model": cap,
         "measured": f"{reserved['mean_running_saturated']:.1f}"},
        {"quantity": f"concurrent seqs in {pool_tokens} slots, paging", "model": f"{predicted:.1f}",
         "measured": f"{paged['mean_running_saturated']:.1f}"},
        {"quantity": "scheduler steps to finish, paging / reserving", "model": "-",
         "measured": f"{paged['steps']} / {reserved['steps']}"},
    ], ["quantity", "model", "measured"])
    payload = {"config": vars(args), "max_len": MAX_LEN, "workload": WORKLOAD_TEXT, "block_table": table,
               "at_completion": a, "pool_tokens": pool_tokens, "reservation_cap": cap,
               "running_mean_len": running_mean_len(work), "predicted_paged_concurrency": predicted,
               "predicted_paged_waste_running": predicted_waste,
               "paged": {k: v for k, v in paged.items() if k != "trace"},
               "reserved": {k: v for k, v in reserved.items() if k != "trace"},
               "trace_every_10_steps": {n: {k: v[::10] for k, v in r["trace"].items() if k != "saturated"}
                                        for n, r in (("paged", paged), ("reserved", reserved))}}
    name = output_name("fragmentation", args.quick)
    write_result(name, payload)
    plot(a, paged, reserved, cap, predicted, name)
    return payload


if __name__ == "__main__":
    main()
