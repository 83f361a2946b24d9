"""The seed's arithmetic as code: KV memory, paging vs reservation, swap vs recompute, prefix-cache
time to first token, copy-on-write savings, per-rank KV under tensor x decode context parallelism, for a
model shape on a device. `kvpage plan` prints it; bench/mathlab/ measures each number on the real engine;
docs/mathlab.md sets them side by side.

Pure Python; only `measure_this_machine()` (the "this" device) imports torch, when called.
"""
from . import cow, dcp, memory
from .dcp import DcpTraffic, ParallelConfig, RankCapacity, dcp_traffic, rank_capacity, tp_all_reduce_bytes
from .device import (DEVICE_NAMES, PRESETS as DEVICE_PRESETS, Device, LinearFit, fit_bandwidth, fit_linear,
                     get_device, measure_this_machine)
from .memory import (Capacity, block_table_bytes, blocks_per_sequence, capacity, kv_budget_bytes,
                     kv_bytes_per_block, kv_bytes_per_token, paged_slots, reserved_slots)
from .model import PRESETS as MODEL_PRESETS, ModelShape, from_hf_config, get_model
from .plan import Workload, plan_text
from .prefix import PrefixCachePlan, prefix_cache_ttft, resident_blocks
from .preemption import SwapRecompute
from .step import Chunk, chunked_prefill_steps, step_seconds

__all__ = [
    "Capacity", "Chunk", "DEVICE_NAMES", "DEVICE_PRESETS", "DcpTraffic", "Device", "LinearFit", "MODEL_PRESETS",
    "ModelShape", "ParallelConfig", "PrefixCachePlan", "RankCapacity", "SwapRecompute", "Workload",
    "block_table_bytes", "blocks_per_sequence", "capacity", "chunked_prefill_steps", "cow", "dcp", "dcp_traffic",
    "fit_bandwidth", "fit_linear", "from_hf_config", "get_device", "get_model",
    "kv_budget_bytes", "kv_bytes_per_block", "kv_bytes_per_token", "measure_this_machine", "memory", "paged_slots", "plan_text",
    "prefix_cache_ttft", "rank_capacity", "reserved_slots", "resident_blocks", "step_seconds",
    "tp_all_reduce_bytes",
]
