"""Pure-Python KV-cache bookkeeping: block pools, block tables, copy-on-write, prefix caching, swap.

No torch and no compiled extension here, so the scheduler's decisions are testable without a model.
"""
from .block_manager import BlockManager, BlockManagerStats, BlockMapping
from .block_pool import BlockPool
from .block_table import num_blocks_for, slot_mapping
from .hashing import ROOT_HASH, hash_block_tokens
from .invariants import InvariantError, check_block_manager
from .prefix_cache import BlockKey, PrefixCache
from .sequence import Sequence, SequenceGroup

__all__ = [
    "BlockKey", "BlockManager", "BlockManagerStats", "BlockMapping", "BlockPool", "InvariantError",
    "PrefixCache", "ROOT_HASH", "Sequence", "SequenceGroup", "check_block_manager", "hash_block_tokens",
    "num_blocks_for", "slot_mapping",
]
