"""The KV connector seam (modelled on vLLM's KVConnectorBase_V1), scheduler side. Pure Python, no torch.

Scheduler side, called by kvpage.core.scheduler once per admission and step:
  get_num_new_matched_tokens(seq, num_computed_tokens) -> int
      how many more tokens, past the pool's own prefix hit, the connector can supply (whole blocks, then
      possibly part of one: a partial last block, kv_offload.connector);
  update_state_after_alloc(seq, blocks)
      the fresh device blocks the block manager gave those tokens: what to load where;
  request_finished(seq)
      a sequence finished and its blocks are about to be freed (their bytes intact until a step runs);
  on_evict(block_hash, key, block_id)
      the pool's LRU reclaimed a cached block: its bytes (still intact until this step runs) should
      be kept;
  begin_step() / build_connector_meta()
      the step's loads and stores, handed to the worker in SchedulerOutput.kv_connector_meta.
Worker side (kv_offload.worker.KVOffloadWorker): start_load(loads), wait_for_load(), save(stores), run
before the step's block moves and forward pass.

The next connectors (another instance's blocks for disaggregated prefill, an external store) implement
the same methods; the scheduler does not change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.core.prefix_cache import BlockKey
from kvpage.core.sequence import Sequence


class KVLoadError(RuntimeError):
    """A step's tier load failed after allocation (a disk tier's payload gone or failing its checksum when read
    into the cache: kv_offload.disk_tier.DiskTier.load_into). Raised by the worker before the forward pass; the
    engine then recovers the step (its requests requeued, as by recompute preemption): the failed entries have
    left the tier, so their tokens are recomputed (vLLM's recompute of failed KV loads)."""

    def __init__(self, block_ids: list[int]) -> None:
        super().__init__(f"KV offload tier: loading device blocks {block_ids} failed")
        self.block_ids = block_ids


@dataclass
class KVConnectorMeta:
    """One step's work for the worker: stores first (their device blocks may be reused by this very
    step), then loads, then the step's own swaps, copies and forward pass."""

    # (device block, payload): verified bytes, or a disk tier's DiskBlock (header and key verified; its payload is
    # read and checked by the worker's load, which raises KVLoadError where that fails).
    loads: list[tuple[int, object]] = field(default_factory=list)
    stores: list[tuple[bytes, BlockKey, int]] = field(default_factory=list)  # (block hash, key, device block)
    # Each load's (tier hash, key), in loads' order: under tensor parallelism every other rank loads its own
    # shard of the block from its own tier (kv_offload.tp), already verified when the scheduler matched it.
    load_keys: list[tuple[bytes, BlockKey]] = field(default_factory=list)
    touches: list[bytes] = field(default_factory=list)  # tier entries used again (their LRU position)

    def load_block_ids(self) -> list[int]:
        return [block_id for block_id, _ in self.loads]


class KVConnectorBase:
    """The seam; see the module docstring. A connector that never matches and keeps nothing."""

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, seq: Sequence, blocks: list[int], is_recompute: bool = False) -> None:
        pass

    def request_finished(self, seq: Sequence) -> None:
        pass

    def on_evict(self, block_hash: bytes, key: BlockKey, block_id: int) -> None:
        pass

    def on_step_computed(self, block_manager) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def build_connector_meta(self) -> KVConnectorMeta | None:
        return None
