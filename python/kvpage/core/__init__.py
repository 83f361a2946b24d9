"""Pure-Python KV-cache bookkeeping: block pools, block tables, copy-on-write, prefix caching, swap.

No torch and no compiled extension here, so the scheduler's decisions are testable without a model.
"""
from .block_manager import BlockManager, BlockManagerStats, BlockMapping, CacheConfig
from .block_pool import BlockPool
from .block_table import num_blocks_for, slot_mapping
from .hashing import ROOT_HASH, hash_block_tokens
from .invariants import InvariantError, check_block_manager
from .kv_cache_groups import (NULL_BLOCK, KVCacheGroup, KVCacheLayout, first_kept_block, kv_cache_layout,
                              num_blocks_per_group, num_blocks_per_seq)
from .prefix_cache import BlockKey, PrefixCache
from .sequence import Sequence, SequenceGroup

__all__ = [
    "BlockKey", "BlockManager", "BlockManagerStats", "BlockMapping", "CacheConfig", "BlockPool", "InvariantError",
    "PrefixCache", "ROOT_HASH", "Sequence", "SequenceGroup", "check_block_manager", "hash_block_tokens",
    "num_blocks_for", "slot_mapping",
    "NULL_BLOCK", "KVCacheGroup", "KVCacheLayout", "first_kept_block", "kv_cache_layout", "num_blocks_per_group",
    "num_blocks_per_seq",
]

# The scheduler: request state, victim policies, the swap-versus-recompute cost model.
from .preemption_cost import MeasuredCostModel, PreemptionCostModel, cost_model_from_measurements  # noqa: E402
from .policies import LeastProgressLost, MostRecentlyAdmitted, VictimPolicy, get_policy  # noqa: E402
from .request import FinishReason, Request, RequestStatus  # noqa: E402
from .scheduler import Scheduler, SchedulerConfig, SchedulerStats  # noqa: E402
from .scheduler_output import BeamStep, ScheduledSequence, SchedulerOutput  # noqa: E402

__all__ += [
    "BeamStep", "FinishReason", "LeastProgressLost", "MeasuredCostModel", "MostRecentlyAdmitted", "PreemptionCostModel",
    "Request",
    "RequestStatus", "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats",
    "VictimPolicy", "cost_model_from_measurements", "get_policy",
]
