"""Every CUDA op once, for compute-sanitizer (bench/gpu_check.sh's SANITIZE=1 phase):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/cuda/sanitize_ops.py

or, without a GPU, in the CPU emulator built with AddressSanitizer (tests/cuda_emu/test_emu_asan.py
runs this):

    LD_PRELOAD=$(g++ -print-file-name=libasan.so) python tests/cuda/sanitize_ops.py --emu-asan

Range checks are off, and each op also gets bad indices (block ids outside the cache or negative,
slots of -1 and beyond the cache, seq_lens past a table row or negative, a broken
query_start_loc, block mappings out of range): the kernels must mask them, so memcheck must stay
silent. Without the caching allocator every tensor is its own allocation, so an access just past
a tensor is caught rather than landing in the allocator's pool. Tiny shapes: memcheck is slow.
Not a pytest module (no test_ prefix); exits non-zero if an op raises."""
import sys

import torch

from cuda_backends import get_backend
from kvpage import ops

FP8 = torch.float8_e4m3fn
B = None  # the backend (cuda_backends.Backend) main() picked
BLOCK_SIZE, NUM_BLOCKS = 16, 6


def ints(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=B.device)


def caches(dtype, num_kv_heads, head_size):
    key_cache, value_cache = B.ops.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype,
                                                     device=B.device)
    for cache in (key_cache, value_cache):
        cache.copy_(torch.randn(cache.shape, device=B.device).to(dtype))
    return key_cache, value_cache


def exercise(cache_dtype, query_dtype, heads, head_size):
    num_heads, num_kv_heads = heads
    key_cache, value_cache = caches(cache_dtype, num_kv_heads, head_size)
    scales = dict(k_scale=0.5, v_scale=2.0) if cache_dtype == FP8 else {}
    qkv = torch.randn(3, num_heads + 2 * num_kv_heads, head_size, device=B.device).to(query_dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    num_slots = NUM_BLOCKS * BLOCK_SIZE

    # reshape_and_cache: a good slot, padding, one past the end, far past, negative.
    B.ops.reshape_and_cache(key, value, key_cache, value_cache, ints([5, -1, num_slots], torch.int64), **scales)
    B.ops.reshape_and_cache(key, value, key_cache, value_cache, ints([1 << 40, -7, num_slots - 1], torch.int64),
                            **scales)
    # Misaligned (scalar-kernel) sources: a view one element into a padded row.
    padded = torch.randn(3, num_kv_heads * head_size + 1, device=B.device).to(query_dtype)
    odd = padded[:, 1:].view(3, num_kv_heads, head_size)
    B.ops.reshape_and_cache(odd, odd, key_cache, value_cache, ints([0, 17, num_slots], torch.int64), **scales)

    # Decode: good rows, then block ids outside [0, NUM_BLOCKS), lengths past the row / negative;
    # single pass and partitioned (partition 16 over a 4-block row).
    good_tables, good_lens = ints([[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5]]), ints([64, 17, 1])
    bad_tables = ints([[0, NUM_BLOCKS, 1 << 30, -5], [-1, 3, 2, 1], [5, 5, 5, 5]])
    bad_lens = ints([1 << 20, -3, 64])
    for tables, lens in ((good_tables, good_lens), (bad_tables, bad_lens)):
        for partition_size in (None, 16, 4096):
            B.ops.paged_attention(query, key_cache, value_cache, tables, lens, partition_size=partition_size,
                                  **scales)

    # Prefill: good, then a broken query_start_loc and lengths.
    B.ops.paged_prefill_attention(query, key_cache, value_cache, good_tables, ints([0, 1, 2, 3]), ints([64, 17, 5]),
                                  **scales)
    B.ops.paged_prefill_attention(query, key_cache, value_cache, bad_tables, ints([0, 5, -100, 1 << 30]),
                                  ints([1 << 25, 2, -4]), **scales)

    # Block moves: in range, then sources / destinations outside the cache.
    B.ops.copy_blocks([key_cache], [value_cache], [[0, 1], [2, 3]])
    B.ops.copy_blocks([key_cache], [value_cache], [[0, 1 << 40], [-3, 2], [NUM_BLOCKS, 4]])
    host = [B.pin(torch.zeros(key_cache.shape, dtype=cache_dtype)) for _ in range(2)]
    B.ops.swap_blocks([key_cache, value_cache], host, [[0, 1], [5, 0]])
    B.ops.swap_blocks(host, [key_cache, value_cache], [[1, 2], [NUM_BLOCKS, 0], [0, -1]])
    B.synchronize()


def main():
    global B
    emulated = "--emu-asan" in sys.argv
    if not emulated and not (torch.cuda.is_available() and ops.built_with_cuda):
        raise SystemExit("sanitize_ops: needs a CUDA device and kvpage built with CUDA (or --emu-asan)")
    B = get_backend("emu" if emulated else "cuda", asan=emulated)
    ops.set_range_checks(False)
    torch.manual_seed(0)
    # Every cache dtype with its query dtypes, MHA / GQA / group-8 tiles, a masked head size.
    runs = [(torch.float16, torch.float16, (4, 2), 64), (torch.bfloat16, torch.bfloat16, (8, 1), 48),
            (torch.float32, torch.float32, (2, 2), 128), (FP8, torch.float16, (8, 2), 128),
            (FP8, torch.float32, (8, 1), 64), (FP8, torch.bfloat16, (2, 2), 80)]
    for cache_dtype, query_dtype, heads, head_size in runs:
        exercise(cache_dtype, query_dtype, heads, head_size)
        print(f"sanitize_ops: {cache_dtype} cache, {query_dtype} query, heads {heads}, head_size {head_size}: ok",
              flush=True)
    print("sanitize_ops: every op ran")


if __name__ == "__main__":
    sys.exit(main())
