"""One step's inputs, from the scheduler's sequences to the tensors the forward reads: ONE int32 payload,
    token_ids[T] positions[T] slot_mapping[G*T] sample_rows[R]    (read as int64)
    query_start_loc[S+1] seq_lens[S] block_tables[G*S*W]        (read as int32)
    swap_out[2*A] swap_in[2*B] copy[2*C]                        (read on the host)
T tokens, S sequences, W the widest block table (0-padded), R rows whose logits are kept
(kvpage.core.scheduler_output.logits_rows), G KV-cache groups (group 0 first), A/B/C block pairs. One
host-to-device copy (from pinned memory on a GPU); the tensor-parallel broadcast sends the same payload.
"""
from __future__ import annotations

import array
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
    # A hybrid KV cache: one block table and slot mapping per KV-cache group, in layout order (group 0's
    # are block_table / slot_mapping). None: one group.
    block_tables: list[list[int]] | None = None
    slot_mappings: list[list[int]] | None = None

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
    num_groups: int = 1  # KV-cache groups whose slots and tables the payload carries

    def lengths(self) -> list[int]:
        """The fields' lengths, in the payload's order."""
        t, s, g = self.num_tokens, self.num_seqs, self.num_groups
        return [t, t, g * t, self.num_sampled, s + 1 if s else 0, s, g * s * self.width,
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
    groups = _group_fields(seqs)
    if groups is not None:
        return _pack_groups(batch, groups, block_size, pin_memory)
    width = max((len(s.block_table) for s in seqs), default=0) or 1
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, seq_lens, tables = [0], [], []
    for s in seqs:
        n = len(s.token_ids)
        _check_sequence(n, s.start, s.block_table, s.slot_mapping, block_size)
        tokens += s.token_ids
        positions += range(s.start, s.start + n)
        slots += s.slot_mapping
        starts.append(starts[-1] + n)
        seq_lens.append(s.start + n)
        tables += s.block_table
        tables += [0] * (width - len(s.block_table))
    return _payload(batch, tokens, positions, [slots], starts, seq_lens, [tables], width, pin_memory)


def _check_sequence(n: int, start: int, table: list[int], slots: list[int], block_size: int) -> None:
    if n == 0 or len(slots) != n or start < 0:
        raise ValueError(f"each scheduled sequence needs >= 1 token, one slot per token and start >= 0;"
                         f" got {n} tokens, {len(slots)} slots, start={start}")
    if start + n > len(table) * block_size:
        raise ValueError(f"block_table of {len(table)} blocks cannot hold {start + n} tokens")


def _group_fields(seqs) -> list[tuple[list[list[int]], list[list[int]]]] | None:
    """Each sequence's (block_tables, slot_mappings) where the step has several KV-cache groups; None for
    one group (the sequences' block_table / slot_mapping are then all there is)."""
    fields = [(getattr(s, "block_tables", None), getattr(s, "slot_mappings", None)) for s in seqs]
    counts = {len(t) if t is not None else 1 for t, _ in fields}
    if counts <= {1}:
        return None
    if len(counts) > 1:
        raise ValueError(f"every scheduled sequence must carry the same number of KV-cache groups' block tables,"
                         f" got {sorted(counts)}")
    for tables, slots in fields:
        if tables is None or slots is None or len(slots) != len(tables):
            raise ValueError("block_tables and slot_mappings must both be given, one per KV-cache group")
    return fields


def _pack_groups(batch, groups, block_size: int, pin_memory: bool) -> tuple[PayloadSizes, torch.Tensor]:
    """pack_payload for G > 1 KV-cache groups: slots and tables group after group."""
    seqs, num_groups = batch.scheduled, len(groups[0][0])
    width = max(len(t) for tables, _ in groups for t in tables)
    tokens: list[int] = []
    positions: list[int] = []
    starts, seq_lens = [0], []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    tables: list[list[int]] = [[] for _ in range(num_groups)]
    for s, (seq_tables, seq_slots) in zip(seqs, groups):
        n = len(s.token_ids)
        for g in range(num_groups):
            _check_sequence(n, s.start, seq_tables[g], seq_slots[g], block_size)
            slots[g] += seq_slots[g]
            tables[g] += seq_tables[g]
            tables[g] += [0] * (width - len(seq_tables[g]))
        tokens += s.token_ids
        positions += range(s.start, s.start + n)
        starts.append(starts[-1] + n)
        seq_lens.append(s.start + n)
    return _payload(batch, tokens, positions, slots, starts, seq_lens, tables, width, pin_memory)


def _payload(batch, tokens, positions, slots: list[list[int]], starts, seq_lens, tables: list[list[int]],
             width: int, pin_memory: bool) -> tuple[PayloadSizes, torch.Tensor]:
    """The fields, flattened into one int32 tensor, and their sizes. slots / tables: one list per group."""
    seqs = batch.scheduled
    sample_rows = logits_rows(seqs)  # sampled rows, then prompt_logprobs rows: all the LM head runs on
    moves = [[x for pair in pairs for x in pair]
             for pairs in (batch.blocks_to_swap_out, batch.blocks_to_swap_in, batch.blocks_to_copy)]
    starts = starts if seqs else []  # no sequence, no query_start_loc (PayloadSizes: S + 1 or 0)
    # An int32 array takes a Python list faster than torch.tensor does, and the tensor is a view of its buffer.
    flat = array.array("i")
    try:
        for part in (tokens, positions, *slots, sample_rows, starts, seq_lens, *tables, *moves):
            flat.extend(part)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"a step's token ids, positions, slots and block ids must be ints that fit in int32"
                         f" (|x| < 2**31): {e}") from e
    payload = torch.frombuffer(flat, dtype=torch.int32) if flat else torch.empty(0, dtype=torch.int32)
    if pin_memory:
        payload = payload.pin_memory()
    sizes = PayloadSizes(len(seqs), len(tokens), width if seqs else 0, len(sample_rows), len(moves[0]) // 2,
                         len(moves[1]) // 2, len(moves[2]) // 2, max((len(s.token_ids) for s in seqs), default=0),
                         max(seq_lens, default=0), len(tables) if seqs else 1)
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
        g, t = sizes.num_groups, sizes.num_tokens
        tables = tables.view(g, sizes.num_seqs, sizes.width)
        metadata = AttentionMetadata(slot_mapping=slots[:t], block_tables=tables[0], seq_lens=seq_lens,
                                     query_start_loc=qsl, max_query_len=sizes.max_query_len,
                                     max_seq_len=sizes.max_seq_len, group_block_tables=tables if g > 1 else None,
                                     group_slot_mappings=slots.view(g, t) if g > 1 else None)
    return Step(ids, pos, metadata, rows, _block_moves(sizes, payload[payload.numel() - sum(lengths[7:]):]))


def _block_moves(sizes: PayloadSizes, tail: torch.Tensor) -> ModelInput:
    """The swap and copy pairs, read from the payload's host copy (none in most steps: nothing to read)."""
    if tail.numel() == 0:
        return ModelInput()
    swap_out, swap_in, copy = (x.view(-1, 2).tolist() for x in tail.split([2 * sizes.swap_out, 2 * sizes.swap_in,
                                                                              2 * sizes.copy]))
    return ModelInput(blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in, blocks_to_copy=copy)
