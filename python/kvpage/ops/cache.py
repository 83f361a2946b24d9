"""Cache allocation and the cache data-movement ops."""
import torch

from kvpage.ops import _checks, memory
from kvpage.ops._library import ops
from kvpage.ops.huge_pages import huge_page_zeros
from kvpage.ops.config import range_checks_enabled


def allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float32, device="cpu",
                      pin_memory=False):
    """Allocates one layer's (key_cache, value_cache), zero-filled.

    Layout, used by every kernel: [num_blocks, num_kv_heads, block_size, head_size], contiguous.
    The token in slot s = block_id * block_size + offset lives at [block_id, :, offset, :], so a
    (block, kv head) pair is one contiguous [block_size, head_size] tile that attention streams.
    block_size: a power of two up to 256; head_size: a multiple of 16 up to 256;
    dtype: float32, float16, bfloat16 (attention computes in float32), or float8_e4m3fn: K/V stored
    as fp8 codes of x / k_scale and x / v_scale (see reshape_and_cache), a quarter of float32's
    memory and bandwidth, read back by attention with the same scales.
    pin_memory: a CPU cache in page-locked memory (a GPU's swap target: its copies run as asynchronous
    DMA), allocated pinned rather than pinned after, which would hold two copies at once."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        _checks.require_positive_int(value, name)
    if block_size & (block_size - 1) or block_size > 256:
        raise ValueError(f"block_size must be a power of two up to 256, got {block_size}")
    if head_size % 16 or head_size > 256:
        raise ValueError(f"head_size must be a multiple of 16 up to 256, got {head_size}")
    if dtype not in _checks.CACHE_DTYPES:
        raise TypeError(f"dtype must be one of {_checks.CACHE_DTYPES}, got {dtype}")
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    _check_fits(device, 2 * torch.Size(shape).numel() * dtype.itemsize, num_blocks)
    try:
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ValueError(f"pin_memory=True needs device 'cpu' (pinned memory is host memory), got '{device}'")
        if pin_memory:
            return (torch.zeros(shape, dtype=dtype, pin_memory=True),
                    torch.zeros(shape, dtype=dtype, pin_memory=True))
        if device.type == "cpu":
            # Attention reads tiles scattered over the whole pool: huge pages spare a TLB miss per tile.
            return huge_page_zeros(shape, dtype), huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    except (AssertionError, RuntimeError, TypeError) as e:  # torch says "not compiled with CUDA" by assert
        raise RuntimeError(f"allocate_kv_cache: cannot allocate on device '{device}': {e}") from e


def _check_fits(device, nbytes: int, num_blocks: int) -> None:
    """CPU only: a cache beyond the free memory would be OOM-killed while zero-filling (CUDA raises)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return  # the allocation itself names the bad device
    if device.type != "cpu":
        return
    available = memory.available_bytes(device)
    if available is not None and nbytes > available:
        raise RuntimeError(f"allocate_kv_cache: num_blocks={num_blocks} needs {memory.gib(nbytes)} for the key and"
                           f" value caches, but only {memory.gib(available)} of memory is available")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0):
    """Writes key/value [num_tokens, num_kv_heads, head_size] (strided views welcome) into the
    caches; slot_mapping int64 [num_tokens], -1 skips a token.

    An fp8 (float8_e4m3fn) cache takes float32/float16/bfloat16 key/value and stores
    x * (1 / k_scale) (v_scale for values) rounded to nearest even and saturated to +-448, as
    reference.quantize_fp8; other caches take their own dtype and scales of 1.0."""
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        _checks.require_tensor(t, name)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, range_checks_enabled(key_cache),
                          _checks.kv_scale(k_scale, "k_scale"), _checks.kv_scale(v_scale, "v_scale"))


def copy_blocks(key_caches, value_caches, block_mapping):
    """Copies block src -> dst for every (src, dst) row of block_mapping in every layer, in one call."""
    key_caches = _checks.tensor_list(key_caches, "key_caches")
    value_caches = _checks.tensor_list(value_caches, "value_caches")
    mapping = _checks.as_block_mapping(block_mapping)
    ops.copy_blocks(key_caches, value_caches, mapping, range_checks_enabled(mapping))


def swap_blocks(src, dst, block_mapping):
    """Copies block src_id of src into block dst_id of dst, for each (src_id, dst_id) row; src and
    dst may be single tensors or matching lists (all layers, K and V) moved in one batched call."""
    src = _checks.tensor_list(src, "src")
    dst = _checks.tensor_list(dst, "dst")
    mapping = _checks.as_block_mapping(block_mapping)
    ops.swap_blocks(src, dst, mapping, range_checks_enabled(mapping))
