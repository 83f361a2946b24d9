"""A minimal greedy engine over ModelRunner + BlockManager, and the HF `generate` reference it must match.

The driver is the smallest honest scheduler: it admits prompts at their arrival step, splits prefills into
chunks under a per-step token budget (decodes go first, as in vLLM), and samples greedily; so one step can
mix prefill chunks, whole prefills and decodes. It ignores EOS, and so does the reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from kvpage.core import BlockManager, Sequence
from kvpage.model import ModelInput, ModelRunner, SequenceInput

# Two candidate tokens whose logits differ by less than this may legitimately swap places between two
# correct fp32 implementations (different summation orders); the comparison accepts either.
TIE_TOLERANCE = 1e-4


@dataclass
class GreedyRun:
    outputs: list[list[int]]
    logits: list[list[torch.Tensor]]  # per sequence, per generated token: the logits it was chosen from
    num_steps: int = 0
    max_tokens_per_step: int = 0
    mixed_steps: int = 0  # steps holding a prefill (chunk) and a decode together
    num_copies: int = 0  # copy-on-write block copies the runner made
    num_swapped: int = 0  # blocks swapped back in
    block_manager: BlockManager | None = field(default=None, repr=False)


def run_greedy(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, *,
               arrivals: list[int] | None = None, token_budget: int | None = None,
               enable_prefix_caching: bool = False, forks: dict[int, int] | None = None,
               swap_out: dict[int, int] | None = None, poison_free_blocks: bool = False) -> GreedyRun:
    """Greedy decoding of every prompt; outputs in prompt order, then forked children in fork order.

    poison_free_blocks: after every step, NaN into every device block no sequence holds (without prefix
    caching), among them those a window group dropped: a kernel that read one would show.

    forks {seq_id: k}: after its first token, seq_id forks k children sharing its blocks (copy-on-write).
    swap_out {step: seq_id}: that sequence is swapped to the host at that step and back two steps later;
    the device blocks it left free are poisoned with NaN, so a swap-in that did not copy back shows.
    """
    # The runner's KV-cache groups: with window groups the block manager drops the blocks that left a window.
    bm = BlockManager(runner.num_kv_blocks, runner.block_size, num_host_blocks=runner.num_host_blocks,
                      enable_prefix_caching=enable_prefix_caching, kv_cache_layout=runner.layout)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    arrivals = list(arrivals or [0] * len(prompts))
    forks, swap_out = forks or {}, swap_out or {}
    run = GreedyRun([[] for _ in prompts], [[] for _ in prompts], block_manager=bm)
    done: set[int] = set()
    swapped: dict[int, int] = {}  # seq_id -> step it comes back
    step = 0
    while len(done) < len(seqs):
        batch, scheduled_seqs = ModelInput(), []
        _swap(bm, seqs, step, swap_out, swapped, done, batch)
        active = [s for s in seqs if s.seq_id not in done and s.seq_id not in swapped and arrivals[s.seq_id] <= step]
        # Decodes (one uncomputed token) before prefills, so a small budget chunks prompts, not decodes.
        active.sort(key=lambda s: (s.num_uncomputed_tokens > 1, s.seq_id))
        budget = token_budget or 1 << 30
        for seq in active:
            entry = _schedule(bm, seq, budget, batch.blocks_to_copy)
            if entry is not None:
                batch.scheduled.append(entry)
                scheduled_seqs.append(seq)
                budget -= len(entry.token_ids)
        step += 1
        _record_shape(run, batch)
        sampled = iter(runner.execute(batch))
        _poison(runner, bm, batch.blocks_to_swap_out)
        for seq, entry in zip(scheduled_seqs, batch.scheduled):
            bm.mark_computed(seq, len(entry.token_ids))
            if not entry.do_sample:
                continue
            row = next(sampled)
            out = run.outputs[seq.seq_id]
            run.logits[seq.seq_id].append(row)
            out.append(int(row.argmax()))
            seq.append_token(out[-1])
            if len(out) == 1:
                _fork(bm, seq, forks.get(seq.seq_id, 0), seqs, arrivals, run, step)
            if len(out) == max_new_tokens:
                bm.free(seq)
                done.add(seq.seq_id)
        if poison_free_blocks:
            _poison_free(runner, bm)
    return run


def _poison_free(runner: ModelRunner, bm: BlockManager) -> None:
    assert not bm.enable_prefix_caching, "cached blocks are free but still meant to be read"
    free = [b for b, refs in enumerate(bm.device.ref_counts) if not refs]
    for key_cache, value_cache in runner.kv_cache_pairs:
        key_cache[free] = float("nan")
        value_cache[free] = float("nan")


def _swap(bm, seqs, step, swap_out, swapped, done, batch) -> None:
    # Out before in, as the runner executes them: a host block a swap-in frees must not be handed to a
    # swap-out of the same step, which would overwrite it before it is read.
    seq_id = swap_out.get(step)
    if seq_id is not None and seqs[seq_id].block_table and seq_id not in done:
        batch.blocks_to_swap_out += bm.swap_out(seqs[seq_id])
        swapped[seq_id] = step + 2
    for seq_id, back in list(swapped.items()):
        if back == step:
            batch.blocks_to_swap_in += bm.swap_in(seqs[seq_id])
            del swapped[seq_id]


def _poison(runner: ModelRunner, bm: BlockManager, swapped_out) -> None:
    """NaN into device blocks a swap-out left free (not those this step already handed to others,
    nor those the prefix cache keeps: their contents are still meant to be read)."""
    for device_block, _ in swapped_out:
        if bm.device.ref_counts[device_block] or bm.enable_prefix_caching:
            continue
        for key_cache, value_cache in runner.kv_cache_pairs:
            key_cache[device_block] = float("nan")
            value_cache[device_block] = float("nan")


def _fork(bm, parent, num_children, seqs, arrivals, run, step) -> None:
    for _ in range(num_children):
        child = parent.fork(len(seqs))
        bm.fork(parent, child)
        seqs.append(child)
        arrivals.append(step)
        run.outputs.append(list(run.outputs[parent.seq_id]))
        run.logits.append(list(run.logits[parent.seq_id]))


def _schedule(bm: BlockManager, seq: Sequence, budget: int, copies: list) -> SequenceInput | None:
    if budget <= 0:
        return None
    if not seq.block_table:
        cached = bm.lookup_prefix(seq)
        n = min(len(seq.token_ids) - cached, budget)
        bm.allocate(seq, n)
    else:
        n = min(seq.num_uncomputed_tokens, budget)
        copies += bm.append_slots(seq, n)
    start = seq.num_computed_tokens
    slot_mappings = bm.slot_mappings(seq, start, start + n)
    return SequenceInput(seq.token_ids[start:start + n], start, list(seq.block_table), slot_mappings[0],
                         do_sample=start + n == len(seq.token_ids),
                         block_tables=[list(t) for t in seq.block_tables], slot_mappings=slot_mappings)


def _record_shape(run: GreedyRun, batch: ModelInput) -> None:
    run.num_steps += 1
    run.num_copies += len(batch.blocks_to_copy)
    run.num_swapped += len(batch.blocks_to_swap_in)
    if not batch.scheduled:
        return
    lens = [len(e.token_ids) for e in batch.scheduled]
    run.max_tokens_per_step = max(run.max_tokens_per_step, sum(lens))
    if max(lens) > 1 and min(lens) == 1:
        run.mixed_steps += 1


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF generate, one prompt at a time (no padding), EOS ignored to match the driver."""
    # generate fills settings left None from model.generation_config, EOS included, so EOS is
    # switched off there for the duration.
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    saved_eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        return _generate_each(model, prompts, config)
    finally:
        model.generation_config.eos_token_id = saved_eos


def _generate_each(model, prompts, config) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.int64, device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def assert_same_greedy(run: GreedyRun, expected: list[list[int]]) -> int:
    """Token-for-token equality, except at a near-tie (within TIE_TOLERANCE) where either token is
    accepted and the rest of that sequence, now on a different path, is not compared. Returns ties."""
    ties = 0
    for seq_id, (got, want) in enumerate(zip(run.outputs, expected)):
        assert len(got) == len(want), f"seq {seq_id}: {len(got)} tokens, HF made {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            if a == b:
                continue
            row = run.logits[seq_id][i]
            gap = float(row[a] - row[b])
            assert abs(gap) < TIE_TOLERANCE, (
                f"seq {seq_id} token {i}: kvpage chose {a}, HF {b}; logit gap {gap:.3g} is no tie\n"
                f"kvpage {got}\nHF     {want}")
            ties += 1
            break
    return ties
