"""One step's inputs, from the scheduler's sequences to the tensors the forward reads.

Every step is flattened into ONE int32 payload, back to back:
    token_ids[T] positions[T] slot_mapping[T] sample_rows[R]     (read as int64)
    query_start_loc[S+1] seq_lens[S] block_tables[S*W]         (read as int32)
    swap_out[2*A] swap_in[2*B] copy[2*C]                       (read on the host)
T tokens, S sequences, W the widest block table (shorter ones padded with 0), R rows whose logits are
kept (sampled, then prompt_logprobs' rows: kvpage.core.scheduler_output.logits_rows), A/B/C block
pairs. On a GPU the payload is built in pinned memory and reaches the device in one asynchronous copy
(seven separate tensors would be seven synchronous ones); the forward reads views into it, the int64
fields through one conversion of their leading run. The tensor-parallel broadcast sends the same
payload to every rank (kvpage.distributed.protocol).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.core.scheduler_output import logits_rows

from .metadata import AttentionMetadata

BlockPairs = list[tuple[int, int]]


@dataclass
class SequenceInput:
    """One sequence's share of the step: tokens at positions [start, start + len(token_ids)).

    Same field names as kvpage.core.ScheduledSequence, so a SchedulerOutput runs as it is.
    """

    token_ids: list[int]
    start: int  # = num_computed_tokens: K/V of positions < start are already in the cache
    block_table: list[int]
    slot_mapping: list[int]  # cache slot of each new token (BlockManager.slot_mapping)
    do_sample: bool = True  # return logits for the last of token_ids
    prompt_logit_positions: range = range(0)  # positions whose logits come back too (prompt_logprobs)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class ModelInput:
    """One step's work, in SchedulerOutput's names (which is accepted in its place)."""

    scheduled: list[SequenceInput] = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)  # (host block, device block)
    blocks_to_copy: BlockPairs = field(default_factory=list)  # (src, dst) on the device


@dataclass(frozen=True)
class PayloadSizes:
    """What it takes to cut a payload into its fields (the broadcast header carries these)."""

    num_seqs: int
    num_tokens: int
    width: int  # of the block tables; 0 without sequences
    num_sampled: int
    swap_out: int  # block pairs
    swap_in: int
    copy: int
    max_query_len: int
    max_seq_len: int

    def lengths(self) -> list[int]:
        """The fields' lengths, in the payload's order."""
        t, s = self.num_tokens, self.num_seqs
        return [t, t, t, self.num_sampled, s + 1 if s else 0, s, s * self.width,
                2 * self.swap_out, 2 * self.swap_in, 2 * self.copy]


@dataclass
class Step:
    """One step as the forward runs it: views into the payload on the runner's device."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata | None  # None when no sequence runs (a step that only moves blocks)
    sample_rows: torch.Tensor  # int64 [R]: rows of the flat batch whose logits are kept
    blocks: ModelInput  # only the swap / copy pairs (ModelRunner._move_blocks' input)


def pack_payload(batch, block_size: int, pin_memory: bool = False) -> tuple[PayloadSizes, torch.Tensor]:
    """The sizes and int32 payload of a SchedulerOutput or ModelInput. Raises ValueError for a malformed
    step, before anything runs. pin_memory: build it in pinned memory (for a GPU's asynchronous copy)."""
    seqs = batch.scheduled
    width = max((len(s.block_table) for s in seqs), default=0) or 1
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, seq_lens, tables = [0], [], []
    for s in seqs:
        n = len(s.token_ids)
        if n == 0 or len(s.slot_mapping) != n or s.start < 0:
            raise ValueError(f"each scheduled sequence needs >= 1 token, one slot per token and start >= 0;"
                             f" got {n} tokens, {len(s.slot_mapping)} slots, start={s.start}")
        if s.start + n > len(s.block_table) * block_size:
            raise ValueError(f"block_table of {len(s.block_table)} blocks cannot hold {s.start + n} tokens")
        tokens += s.token_ids
        positions += range(s.start, s.start + n)
        slots += s.slot_mapping
        starts.append(starts[-1] + n)
        seq_lens.append(s.start + n)
        tables += s.block_table
        tables += [0] * (width - len(s.block_table))
    sample_rows = logits_rows(seqs)  # sampled rows, then prompt_logprobs rows: all the LM head runs on
    moves = [[x for pair in pairs for x in pair]
             for pairs in (batch.blocks_to_swap_out, batch.blocks_to_swap_in, batch.blocks_to_copy)]
    starts = starts if seqs else []  # no sequence, no query_start_loc (PayloadSizes: S + 1 or 0)
    flat = tokens + positions + slots + sample_rows + starts + seq_lens + tables + moves[0] + moves[1] + moves[2]
    try:
        payload = torch.tensor(flat, dtype=torch.int32, pin_memory=pin_memory)
    except (RuntimeError, OverflowError, TypeError, ValueError) as e:
        if isinstance(e, RuntimeError) and "overflow" not in str(e):
            raise  # not the values: pinned memory could not be had
        raise ValueError(f"a step's token ids, positions, slots and block ids must be ints that fit in int32"
                         f" (|x| < 2**31): {e}") from e
    sizes = PayloadSizes(len(seqs), len(tokens), width if seqs else 0, len(sample_rows), len(moves[0]) // 2,
                         len(moves[1]) // 2, len(moves[2]) // 2, max((len(s.token_ids) for s in seqs), default=0),
                         max(seq_lens, default=0))
    return sizes, payload


def unpack_payload(sizes: PayloadSizes, payload: torch.Tensor, device: torch.device) -> Step:
    """Views into the payload, in pack_payload's order: one host-to-device copy where the device is not
    the CPU (asynchronous from pinned memory); the block moves are read on the host."""
    lengths = sizes.lengths()
    if sum(lengths) != payload.numel():
        raise RuntimeError(f"step payload of {payload.numel()} ints does not match its sizes {sizes}")
    on_device = payload.to(device, non_blocking=True)  # the payload itself on the CPU
    wide = sum(lengths[:4])
    ids, pos, slots, rows = on_device[:wide].long().split(lengths[:4])
    qsl, seq_lens, tables, _ = on_device[wide:].split(lengths[4:7] + [sum(lengths[7:])])
    metadata = None
    if sizes.num_seqs:
        metadata = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(sizes.num_seqs, sizes.width),
                                     seq_lens=seq_lens, query_start_loc=qsl, max_query_len=sizes.max_query_len,
                                     max_seq_len=sizes.max_seq_len)
    return Step(ids, pos, metadata, rows, _block_moves(sizes, payload[payload.numel() - sum(lengths[7:]):]))


def _block_moves(sizes: PayloadSizes, tail: torch.Tensor) -> ModelInput:
    """The swap and copy pairs, read from the payload's host copy (none in most steps: nothing to read)."""
    if tail.numel() == 0:
        return ModelInput()
    swap_out, swap_in, copy = (x.view(-1, 2).tolist() for x in tail.split([2 * sizes.swap_out, 2 * sizes.swap_in,
                                                                              2 * sizes.copy]))
    return ModelInput(blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in, blocks_to_copy=copy)
