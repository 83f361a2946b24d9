"""The step broadcast: one scheduler decision as two tensors, a fixed header then one int32 payload.

header  int64[HEADER_LEN]: kind, message number, then the sizes below (ALLOCATE reuses the size slots).
payload int32, back to back:
    token_ids[T] positions[T] slot_mapping[T] query_start_loc[S+1] seq_lens[S] block_tables[S*W]
    sample_rows[R] swap_out[2*A] swap_in[2*B] copy[2*C]
T tokens, S sequences, W the widest block table (shorter ones padded with 0), R rows whose logits are
kept (sampled, then prompt_logprobs' rows: kvpage.core.scheduler_output.logits_rows), A/B/C block
pairs. Every rank, the driver included, runs the step from the unpacked tensors, so all run identical
inputs; none of them sees a Python object per sequence. Cost: 8 * HEADER_LEN + 4 * len(payload) bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from kvpage.core.scheduler_output import logits_rows
from kvpage.model.metadata import AttentionMetadata
from kvpage.model.runner import ModelInput


class Kind(IntEnum):
    STEP = 1
    ALLOCATE = 2  # size the KV caches (no payload)
    SHUTDOWN = 3


# Header slots.
_SLOTS = ("kind", "message", "num_seqs", "num_tokens", "width", "num_sampled", "swap_out", "swap_in", "copy",
          "max_query_len", "max_seq_len", "payload_len")
KIND, MESSAGE, NUM_SEQS, NUM_TOKENS, WIDTH, NUM_SAMPLED, SWAP_OUT, SWAP_IN, COPY, MAX_QUERY_LEN, MAX_SEQ_LEN, \
    PAYLOAD_LEN = range(len(_SLOTS))
HEADER_LEN = len(_SLOTS)
# An ALLOCATE message's fields, in size slots (KV_CACHE_DTYPE: an index into CACHE_DTYPES, WEIGHT_DTYPE
# into WEIGHT_DTYPES; BLOCK_SIZE a rank's physical block; DCP_INTERLEAVE: dcp_kv_cache_interleave_size).
NUM_KV_BLOCKS, BLOCK_SIZE, NUM_HOST_BLOCKS, KV_CACHE_DTYPE, WEIGHT_DTYPE, MATMUL_PRECISION, DCP_INTERLEAVE = \
    NUM_SEQS, NUM_TOKENS, WIDTH, NUM_SAMPLED, SWAP_OUT, SWAP_IN, COPY
# The cache dtypes a rank can be asked for: None is the model's own.
CACHE_DTYPES = (None, torch.float8_e4m3fn, torch.bfloat16, torch.float16)
# The weight storage a rank can be asked for (ModelRunner's weight_dtype): None keeps the weights as loaded.
WEIGHT_DTYPES = (None, torch.bfloat16, torch.float16)
MATMUL_PRECISIONS = ("highest", "medium")  # ModelRunner's matmul_precision, by index
_INT32_MAX = 2**31 - 1


@dataclass
class Step:
    """One step as every rank runs it."""

    input_ids: torch.Tensor  # int64 [1, T]
    positions: torch.Tensor  # int64 [1, T]
    metadata: AttentionMetadata | None  # None when no sequence runs (a step that only moves blocks)
    sample_rows: torch.Tensor  # int64 [R]: rows of the flat batch whose logits are kept
    blocks: ModelInput  # only the swap / copy pairs (ModelRunner._move_blocks' input)


def header(kind: Kind, message: int, **sizes: int) -> torch.Tensor:
    """sizes: header slots by name (see _SLOTS)."""
    values = [0] * HEADER_LEN
    values[KIND], values[MESSAGE] = int(kind), message
    for name, value in sizes.items():
        values[_SLOTS.index(name)] = value
    return torch.tensor(values, dtype=torch.int64)


def allocate_header(message: int, num_kv_blocks: int, block_size: int, num_host_blocks: int,
                    cache_dtype: torch.dtype | None = None, weight_dtype: torch.dtype | None = None,
                    matmul_precision: str = "highest", dcp_interleave: int = 1) -> torch.Tensor:
    return header(Kind.ALLOCATE, message, num_seqs=num_kv_blocks, num_tokens=block_size, width=num_host_blocks,
                  num_sampled=CACHE_DTYPES.index(cache_dtype), swap_out=WEIGHT_DTYPES.index(weight_dtype),
                  swap_in=MATMUL_PRECISIONS.index(matmul_precision), copy=dcp_interleave)


def cache_dtype_of(h: torch.Tensor) -> torch.dtype | None:
    """An ALLOCATE header's cache dtype (None: the model's)."""
    return CACHE_DTYPES[int(h[KV_CACHE_DTYPE])]


def weight_dtype_of(h: torch.Tensor) -> torch.dtype | None:
    """An ALLOCATE header's weight storage dtype (None: the weights as loaded)."""
    return WEIGHT_DTYPES[int(h[WEIGHT_DTYPE])]


def matmul_precision_of(h: torch.Tensor) -> str:
    return MATMUL_PRECISIONS[int(h[MATMUL_PRECISION])]


def pack_step(batch, message: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a SchedulerOutput or ModelInput. Raises ValueError for a malformed step, before
    anything is sent, so no rank ever runs it."""
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
    starts = starts if seqs else []  # no sequence, no query_start_loc (unpack_step sizes it S + 1 or 0)
    flat = tokens + positions + slots + starts + seq_lens + tables + sample_rows + moves[0] + moves[1] + moves[2]
    try:
        payload = torch.tensor(flat, dtype=torch.int32)
    except (RuntimeError, OverflowError, TypeError) as e:
        raise ValueError(f"a step's token ids, positions, slots and block ids must be ints that fit in int32"
                         f" (|x| < 2**31): {e}") from e
    max_query_len = max((len(s.token_ids) for s in seqs), default=0)
    h = header(Kind.STEP, message, num_seqs=len(seqs), num_tokens=len(tokens), width=width if seqs else 0,
               num_sampled=len(sample_rows), swap_out=len(moves[0]) // 2, swap_in=len(moves[1]) // 2,
               copy=len(moves[2]) // 2, max_query_len=max_query_len, max_seq_len=max(seq_lens, default=0),
               payload_len=payload.numel())
    return h, payload


def unpack_step(h: torch.Tensor, payload: torch.Tensor, device: torch.device) -> Step:
    """Views into the payload (one host-to-device copy on CUDA), in pack_step's order."""
    fields = h.tolist()
    s, t, w, r = (fields[i] for i in (NUM_SEQS, NUM_TOKENS, WIDTH, NUM_SAMPLED))
    a, b, c = (fields[i] for i in (SWAP_OUT, SWAP_IN, COPY))
    sizes = [t, t, t, s + 1 if s else 0, s, s * w, r, 2 * a, 2 * b, 2 * c]
    if sum(sizes) != payload.numel():
        raise RuntimeError(f"step payload of {payload.numel()} ints does not match its header {h.tolist()}")
    on_device = payload.to(device, non_blocking=True) if device.type != "cpu" else payload
    ids, pos, slots, qsl, seq_lens, tables, rows, *_ = on_device.split(sizes)
    swap_out, swap_in, copy = (x.view(-1, 2).tolist() for x in payload.split(sizes)[7:])
    metadata = None
    if s:
        metadata = AttentionMetadata(slot_mapping=slots.long(), block_tables=tables.view(s, w), seq_lens=seq_lens,
                                     query_start_loc=qsl, max_query_len=fields[MAX_QUERY_LEN],
                                     max_seq_len=fields[MAX_SEQ_LEN])
    return Step(ids.long().unsqueeze(0), pos.long().unsqueeze(0), metadata, rows.long(),
                ModelInput(blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in, blocks_to_copy=copy))


def broadcast_message(h: torch.Tensor, payload: torch.Tensor | None, group) -> None:
    """Driver side (group: a Collectives): the header, then the payload if the header announces one."""
    group.broadcast(h)
    if payload is not None and payload.numel():
        group.broadcast(payload)


def receive_message(group) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker side: (header, payload); the payload is empty for messages without one."""
    h = torch.empty(HEADER_LEN, dtype=torch.int64)
    group.broadcast(h)
    payload = torch.empty(int(h[PAYLOAD_LEN]), dtype=torch.int32)
    if payload.numel():
        group.broadcast(payload)
    return h, payload


def message_bytes(h: torch.Tensor, payload: torch.Tensor | None) -> int:
    return h.numel() * h.element_size() + (payload.numel() * payload.element_size() if payload is not None else 0)
