"""Python faces of the kvpage kernels (torch.ops.kvpage.*), with argument checks.

`reference` holds a plain-torch version of every op for tests and benchmarks."""
from kvpage.ops import layers, reference
from kvpage.ops._library import available_cpu_isas, built_with_cuda, cpu_isa, set_cpu_isa
from kvpage.ops.attention import paged_attention, paged_prefill_attention
from kvpage.ops.cache import allocate_kv_cache, copy_blocks, reshape_and_cache, swap_blocks
from kvpage.ops.config import range_checks, range_checks_enabled, set_range_checks
from kvpage.ops.merge import merge_attention_states

__all__ = [
    "allocate_kv_cache", "reshape_and_cache", "paged_attention", "paged_prefill_attention", "merge_attention_states",
    "copy_blocks", "swap_blocks", "reference", "set_range_checks", "range_checks",
    "range_checks_enabled", "cpu_isa", "set_cpu_isa", "available_cpu_isas", "built_with_cuda", "layers",
]
