"""KV-cache memory: bytes per token, blocks and block-table bytes, how many sequences fit.

Reservation (pre-paging servers) sets aside max_len tokens of KV per sequence up front; paging
takes a block only when the previous one fills, so a sequence wastes at most its last block's
unfilled slots.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvpage.core.kv_cache_groups import KVCacheLayout, num_blocks_per_group, num_blocks_per_seq

from .device import Device
from .model import ModelShape

BLOCK_TABLE_ENTRY_BYTES = 4  # int32 physical block ids, as the kernels take them


def kv_bytes_per_token(model: ModelShape, dtype_bytes: int = 2) -> int:
    """K and V, every layer, every KV head."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes


def kv_bytes_per_block(model: ModelShape, block_size: int, dtype_bytes: int = 2) -> int:
    """Bytes one block id takes: K and V of block_size tokens over the layers of one KV-cache group (every
    layer for a model without windows; group_size layers of a hybrid one)."""
    return block_size * 2 * model.kv_cache_layout.group_size * model.num_kv_heads * model.head_dim * dtype_bytes


def seq_blocks(model: ModelShape, num_tokens: int, block_size: int, max_step_tokens: int = 1) -> int:
    """Block ids one sequence of num_tokens holds at most, over all KV-cache groups, computing up to
    max_step_tokens per step (1: decoding; kvpage.core.num_blocks_per_seq, the engine's own count)."""
    check_positive("block_size", block_size)
    return num_blocks_per_seq(model.kv_cache_layout, num_tokens, block_size, max_step_tokens)


def expected_paged_blocks(layout: KVCacheLayout, mean_len: float, block_size: int) -> float:
    """Block ids per decoding sequence under paging, on average: a full group holds expected_paged_tokens,
    a window group at most the blocks its window spans (fewer while the sequence is shorter)."""
    full = expected_paged_tokens(mean_len, block_size) / block_size
    # Past the longest window, each window group holds the most it ever does: its window's blocks.
    longest = max((w for w in layout.sliding_windows if w is not None), default=0) + block_size
    steady = num_blocks_per_group(layout, longest, block_size)
    return sum(full if w is None else min(full, n) for w, n in zip(layout.sliding_windows, steady))


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    """Logical blocks a sequence of num_tokens holds: a new one only once the last is full."""
    check_positive("block_size", block_size)
    return -(-num_tokens // block_size)


def block_table_bytes(num_tokens: int, block_size: int, entry_bytes: int = BLOCK_TABLE_ENTRY_BYTES) -> int:
    return blocks_per_sequence(num_tokens, block_size) * entry_bytes


def paged_slots(lengths, block_size: int) -> int:
    """KV slots paging allocates for sequences of these lengths: whole blocks."""
    return sum(blocks_per_sequence(n, block_size) for n in lengths) * block_size


def reserved_slots(lengths, max_len: int) -> int:
    """KV slots reservation sets aside: max_len per sequence, whatever it ends up using."""
    return len(list(lengths)) * max_len


def expected_paged_tokens(mean_len: float, block_size: int) -> float:
    """Slots per sequence under paging, on average: its tokens plus a half-empty last block
    ((block_size - 1) / 2 unfilled slots when lengths are spread evenly over block offsets)."""
    return mean_len + (block_size - 1) / 2


@dataclass(frozen=True)
class Capacity:
    kv_budget_bytes: float
    bytes_per_token: int
    budget_tokens: int  # of every layer's KV: the pool's bytes over kv_bytes_per_token, in whole blocks
    budget_blocks: int  # block ids (one KV-cache group's layers each)
    context_len: int
    mean_len: float
    seqs_reserved: int  # each sequence holds context_len slots
    seqs_paged: int  # each holds its mean_len tokens in whole blocks (a window group: only its window's)
    reserved_waste: float  # fraction of reserved slots never written, at mean_len
    paged_waste: float  # fraction of paged slots never written (half a block per sequence)

    @property
    def paging_gain(self) -> float:
        return self.seqs_paged / self.seqs_reserved if self.seqs_reserved else float("inf")


def kv_budget_bytes(model: ModelShape, device: Device, dtype_bytes: int, memory_utilization: float = 0.9) -> float:
    """Device memory the KV cache gets: the utilised share (vLLM's gpu_memory_utilization) minus the weights.
    Activations are not subtracted; at these batch sizes they are a few hundred MiB."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization!r}")
    budget = device.memory_bytes * memory_utilization - model.weight_bytes(dtype_bytes)
    if budget <= 0:
        raise ValueError(f"{model.name} weights ({model.weight_bytes(dtype_bytes) / 2**30:.1f} GiB) do not fit in"
                         f" {memory_utilization:.0%} of {device.name}'s {device.memory_bytes / 2**30:.1f} GiB")
    return budget


def capacity(model: ModelShape, device: Device, context_len: int, mean_len: float, block_size: int = 16,
             dtype_bytes: int = 2, memory_utilization: float = 0.9) -> Capacity:
    """Sequences that fit in the KV budget with reservation for context_len vs with paging."""
    check_positive("context_len", context_len)
    check_positive("block_size", block_size)
    if not 0 < mean_len <= context_len:
        raise ValueError(f"mean_len must be in (0, context_len={context_len}], got {mean_len!r}")
    budget = kv_budget_bytes(model, device, dtype_bytes, memory_utilization)
    per_token = kv_bytes_per_token(model, dtype_bytes)
    tokens = int(budget // (per_token * block_size)) * block_size
    blocks = int(budget // kv_bytes_per_block(model, block_size, dtype_bytes))
    reserve = blocks_per_sequence(context_len, block_size) * block_size
    paged = expected_paged_tokens(mean_len, block_size)
    return Capacity(kv_budget_bytes=budget, bytes_per_token=per_token, budget_tokens=tokens, budget_blocks=blocks,
                    context_len=context_len, mean_len=mean_len, seqs_reserved=tokens // reserve,
                    seqs_paged=int(blocks // expected_paged_blocks(model.kv_cache_layout, mean_len, block_size)),
                    reserved_waste=1 - mean_len / reserve, paged_waste=1 - mean_len / paged)


def check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
