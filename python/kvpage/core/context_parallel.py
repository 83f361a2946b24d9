"""Where a sequence's token positions live under decode context parallelism (DCP), as the driver accounts them.

Under tensor parallelism a model with K KV heads on T > K ranks holds each KV head T / K times over. DCP turns
that replication into capacity: the D ranks of a DCP group share the same KV heads, and each keeps only the
positions p with (p // I) % D == its DCP rank (I: the interleave size). As in vLLM, the block manager sees
one *virtual* block of block_size * D tokens per block id, and that id names one block_size block on every
rank of the group: the pool, ref counts, prefix cache, copy-on-write and swap all stay as they are, and each
rank turns the driver's virtual slots into its own (model/context_parallel.py). Pure arithmetic, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContextParallelPlacement:
    size: int  # D: ranks in a DCP group
    interleave: int  # I: consecutive positions kept together on one rank (vLLM's dcp_kv_cache_interleave_size)
    block_size: int  # a rank's physical block, in tokens

    @property
    def virtual_block_size(self) -> int:
        """Tokens one block id holds across the group: the block manager's block size."""
        return self.block_size * self.size

    def rank_of(self, position: int) -> int:
        return (position // self.interleave) % self.size

    def tokens_on_rank(self, length: int, rank: int) -> int:
        """How many of positions [0, length) live on `rank`."""
        cycle = self.interleave * self.size
        return (length // cycle) * self.interleave + min(max(length % cycle - rank * self.interleave, 0),
                                                         self.interleave)

    def local_slot(self, slot: int, rank: int) -> int:
        """The physical slot on `rank` of virtual slot `slot` (block id * virtual block size + offset), or
        -1 when that position lives on another rank."""
        block, offset = divmod(slot, self.virtual_block_size)
        chunk, within = divmod(offset, self.interleave)
        if chunk % self.size != rank:
            return -1
        return block * self.block_size + (chunk // self.size) * self.interleave + within


def kv_head_replication(tensor_parallel_size: int, num_kv_heads: int) -> int:
    """Tensor-parallel ranks holding copies of the same KV head: T / K once T exceeds the KV heads, else 1."""
    return max(1, tensor_parallel_size // num_kv_heads)


def check_dcp_sizes(decode_context_parallel_size, dcp_kv_cache_interleave_size, block_size: int) -> None:
    """The rules that need no model (LLM checks them before loading one): D and I positive ints, I
    dividing block_size. ValueErrors naming the argument."""
    d, i = decode_context_parallel_size, dcp_kv_cache_interleave_size
    for name, value in (("decode_context_parallel_size", d), ("dcp_kv_cache_interleave_size", i)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if block_size % i:
        raise ValueError(f"dcp_kv_cache_interleave_size={i} must divide block_size={block_size}")


def check_dcp_attention(decode_context_parallel_size: int, dcp_kv_cache_interleave_size: int, layer_windows,
                        has_sinks: bool) -> None:
    """What DCP needs of a model's attention (LLM checks it before any worker starts), as ValueErrors naming
    the argument. A sliding window W with W % (I * D) == 0 holds exactly W / D positions of every rank, the
    last W / D it keeps at or before the query (contiguous in its local order), so each rank attends within
    a window of W / D local keys; any other W does not split evenly. Attention sinks are refused: the merge
    of the ranks' partials would count a sink once per rank. layer_windows: each layer's window or None."""
    d, i = decode_context_parallel_size, dcp_kv_cache_interleave_size
    if d == 1:
        return
    for window in sorted({w for w in layer_windows if w is not None}):
        if window % (i * d):
            raise ValueError(f"sliding_window={window} must be a multiple of dcp_kv_cache_interleave_size *"
                             f" decode_context_parallel_size = {i} * {d} (each rank then holds window / {d}"
                             f" of every window's positions); use other DCP sizes or decode_context_parallel_size=1")
    if has_sinks:
        raise ValueError(f"decode_context_parallel_size={d} does not support attention sinks (the merge of the"
                         f" ranks' partial results would count the sink once per rank); use"
                         f" decode_context_parallel_size=1")


def check_context_parallel(tensor_parallel_size: int, decode_context_parallel_size, dcp_kv_cache_interleave_size,
                           block_size: int, num_heads: int, num_kv_heads: int) -> None:
    """vLLM's rules, as ValueErrors naming the argument: D divides T, D uses only the KV-head replication
    (T / K ranks hold each KV head; a DCP group must lie inside one such run), and I divides block_size.
    Also the ranks sharing a KV head must hold equally many query heads (the group gathers them side by side)."""
    check_dcp_sizes(decode_context_parallel_size, dcp_kv_cache_interleave_size, block_size)
    d = decode_context_parallel_size
    t, k = tensor_parallel_size, num_kv_heads
    if t % d:
        raise ValueError(f"decode_context_parallel_size={d} must divide tensor_parallel_size={t}")
    replication = kv_head_replication(t, k)
    if d > replication:
        raise ValueError(f"decode_context_parallel_size={d} exceeds the KV-head replication tensor_parallel_size /"
                         f" num_kv_heads = {t} / {k} (at most {replication}): DCP only splits KV heads that tensor"
                         f" parallelism replicates")
    if d > 1 and (t % k or replication % d):
        raise ValueError(f"decode_context_parallel_size={d} must divide the KV-head replication tensor_parallel_size /"
                         f" num_kv_heads = {t} / {k}: each DCP group lies within the ranks that hold one KV head")
    if d > 1 and (num_heads // k) % replication:
        raise ValueError(f"decode_context_parallel_size={d}: the {num_heads // k} query heads of each KV head do not"
                         f" split evenly over the {replication} ranks that hold it at tensor_parallel_size={t}")
