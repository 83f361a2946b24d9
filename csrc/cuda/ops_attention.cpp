// CUDA paged attention ops: validate (checks.h, shared with the CPU backend), choose the work
// split from shapes alone, launch on the current stream.
//
// Synchronisation policy: the kernels never trust index data (see kernel_params.h), so the only
// checks that must read index tensors are the optional range checks. With check_ranges=True
// (the debug switch, KVPAGE_RANGE_CHECKS=1) they run exactly as on the CPU (seq_lens bounds, block
// ids, query_start_loc), which copies those tensors to the host: one device sync per call. With
// check_ranges=False (the default) nothing syncs: planning uses shapes only and bad indices are
// masked inside the kernels.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "../checks.h"
#include "../ops.h"
#include "glue.h"

namespace kvpage {
namespace cuda {
namespace {

// The split is planned in waves: a wave is the CTAs the GPU runs at once (SMs x the decode
// kernel's CTAs per SM). Fitted to H200 sweeps of every fixed partition size
// (bench/kernels_cuda.py --sweep-partitions, docs/gpu/kernels_cuda_run7.json), batch 1-256 x
// 512-8192 tokens, Llama-3-8B and SmolLM2 heads:
//   - a grid just over a wave runs its remainder as a nearly empty second wave (batch 16 x 8k
//     Llama-3, tensor-core kernel at 3 CTAs per SM: 512 CTAs took 173 us, 256 took 149 and 1024
//     took 155), so a split grid is either within one wave or at least two;
//   - under one wave, more CTAs help until the wave is full: the shortest partitions that keep
//     the grid within it;
//   - from one wave, longer partitions (fewer CTAs, fewer partials to reduce) help, as long as
//     there are two waves; from two waves single pass is fastest.
// Partitions are powers of two of at least kMinPartitionTokens, or kBusyMinPartitionTokens once
// the single pass alone gives every other SM a CTA: there a short partition's fixed costs (q,
// the merge, its partials, the reduce) outweigh a fuller wave (batch 16 x 512 Llama-3: single
// pass 22.9 us, 256-token partitions 24.6).
constexpr int64_t kMinPartitionTokens = 128;
constexpr int64_t kBusyMinPartitionTokens = 512;

// The decode work split: partition_size 0 is the single pass.
struct DecodeSplit {
  int64_t partition_size = 0;
  int64_t max_partitions = 1;
};

// From shapes alone (no sync): the table width bounds the longest sequence. wave: CTAs the GPU's
// sms run at once; forced: the caller's partition_size (0: choose). Partitions past a sequence's
// end exit at once, and the reduce reads only the ones that exist.
DecodeSplit plan_decode_split(int64_t ctas_per_partition, int64_t capacity, int64_t block_size, int64_t sms,
                              int64_t wave, int64_t forced) {
  DecodeSplit split;
  int64_t part = forced;
  if (forced == 0) {
    const int64_t ctas = ctas_per_partition;
    if (ctas >= 2 * wave) return split;
    auto grid = [&](int64_t p) { return ctas * ((capacity + p - 1) / p); };
    part = std::max(2 * ctas < sms ? kMinPartitionTokens : kBusyMinPartitionTokens, block_size);
    if (ctas >= wave) {
      if (grid(part) < 2 * wave) return split;  // no split reaches two waves
      while (part < capacity && grid(2 * part) >= 2 * wave) part *= 2;
    } else {
      while (part < capacity && grid(part) > wave) part *= 2;
    }
  }
  const int64_t parts = (capacity + part - 1) / part;
  if (parts > 1) split.partition_size = part, split.max_partitions = parts;
  return split;
}

// The shared metadata checks and the CUDA kernels' own limits (alignment, int32 sizes); no index data
// read (the range checks run after the options', whose window they need).
CacheShape check_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double k_scale, double v_scale) {
  const CacheShape cache = check_attention_inputs(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                  k_scale, v_scale);
  TORCH_CHECK_VALUE(aligned16(key_cache.data_ptr()) && aligned16(value_cache.data_ptr()),
                    "key_cache and value_cache must be 16-byte aligned (use allocate_kv_cache)");
  as_int(cache.num_blocks, "key_cache.size(0)");
  as_int(block_tables.size(1) * cache.block_size, "block_tables.size(1) * block_size");
  as_int(query.size(0), "query.size(0)");
  return cache;
}

AttentionParams make_params(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const CacheShape& cache, double scale,
                            double k_scale, double v_scale) {
  AttentionParams p{};
  p.dtype = to_dtype(query.scalar_type());
  p.cache_dtype = to_dtype(key_cache.scalar_type());
  // Rounded to float once, like the reference: an fp8 code reads as code * float(scale).
  p.k_scale = static_cast<float>(k_scale), p.v_scale = static_cast<float>(v_scale);
  p.out = out.data_ptr();
  p.out_row_stride = out.stride(0), p.out_head_stride = out.stride(1);
  p.query = query.data_ptr();
  p.q_row_stride = query.stride(0), p.q_head_stride = query.stride(1);
  p.key_cache = key_cache.data_ptr(), p.value_cache = value_cache.data_ptr();
  p.num_heads = static_cast<int>(query.size(1)), p.num_kv_heads = static_cast<int>(cache.num_kv_heads);
  p.block_size = static_cast<int>(cache.block_size), p.head_size = static_cast<int>(cache.head_size);
  p.num_blocks = static_cast<int>(cache.num_blocks);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.num_seqs = static_cast<int>(seq_lens.size(0));
  p.num_rows = static_cast<int>(query.size(0));
  p.scale = static_cast<float>(scale);
  return p;
}

// The options as the kernels take them: softcap in the log2 domain their logits live in.
void set_options(AttentionParams& p, const AttentionOptions& o) {
  p.window = static_cast<int>(o.window);
  p.softcap = o.softcap * 1.4426950408889634f;  // log2(e)
  p.sinks = o.sinks;
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale, int64_t partition_size,
                     bool check_ranges, double k_scale, double v_scale, const std::optional<at::Tensor>& lse,
                     std::optional<int64_t> sliding_window, std::optional<double> softcap,
                     const std::optional<at::Tensor>& sinks) {
  const CacheShape cache =
      check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale);
  check_decode(query, seq_lens, partition_size, cache);
  const AttentionOptions options = check_attention_options(sliding_window, softcap, sinks, query, out);
  // Host copies of the index tensors: the documented sync.
  if (check_ranges) check_attention_ranges(block_tables, seq_lens, cache, 1, options.window, nullptr, query.size(0));
  float* lse_data = check_lse(lse, out, query, key_cache, value_cache, block_tables, seq_lens);
  if (query.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  AttentionParams p = make_params(out, query, key_cache, value_cache, block_tables, seq_lens, cache, scale,
                                  k_scale, v_scale);
  p.lse = lse_data;
  set_options(p, options);

  const int64_t sms = num_sms();
  const DecodeOccupancy occupancy = decode_occupancy(p, shared_memory_per_sm());
  // A row reads at most its window's keys: the split plans for that many, not the table's width.
  int64_t capacity = block_tables.size(1) * cache.block_size;
  if (options.window > 0) capacity = std::min(capacity, options.window);
  const DecodeSplit split = plan_decode_split(query.size(0) * occupancy.ctas_per_row, capacity, cache.block_size,
                                              sms, sms * occupancy.ctas_per_sm, partition_size);
  DecodeWork w{};
  at::Tensor tmp;
  if (split.partition_size > 0) {
    w.partition_size = static_cast<int>(split.partition_size);
    w.max_partitions = as_int(split.max_partitions, "partitions per sequence");
    const int64_t slots = query.size(0) * query.size(1) * split.max_partitions;
    tmp = at::empty({slots * (cache.head_size + 2)}, query.options().dtype(at::kFloat));
    w.tmp_out = tmp.data_ptr<float>();
    w.tmp_max = w.tmp_out + slots * cache.head_size;
    w.tmp_sum = w.tmp_max + slots;
    w.overlap_reduce = compute_capability_major() >= 9;
  }
  C10_CUDA_CHECK(launch_paged_decode(p, w, current_stream()));
}

void paged_prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             double scale, bool check_ranges, double k_scale, double v_scale,
                             const std::optional<at::Tensor>& lse, std::optional<int64_t> sliding_window,
                             std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const CacheShape cache =
      check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale);
  check_query_start_loc_tensor(query_start_loc, seq_lens, out, key_cache);
  const AttentionOptions options = check_attention_options(sliding_window, softcap, sinks, query, out);
  if (check_ranges) {  // host copies: the documented sync
    check_attention_ranges(block_tables, seq_lens, cache, 0, options.window, &query_start_loc, query.size(0));
  }
  float* lse_data =
      check_lse(lse, out, query, key_cache, value_cache, block_tables, seq_lens, &query_start_loc);
  if (query.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  if (seq_lens.size(0) == 0) {  // only reachable unchecked: tokens that belong to no sequence
    out.zero_();
    if (lse.has_value()) lse->fill_(-INFINITY);  // and see no key
    return;
  }
  AttentionParams p = make_params(out, query, key_cache, value_cache, block_tables, seq_lens, cache, scale,
                                  k_scale, v_scale);
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.lse = lse_data;
  set_options(p, options);
  if (prefill_uses_tensor_cores(p)) {
    // The tensor-core kernel stages Q with 16-byte copies; a misaligned view gets an aligned copy.
    at::Tensor q = query;
    const int64_t vec = 16 / query.element_size();
    if (!aligned16(query.data_ptr()) || query.stride(0) % vec || query.stride(1) % vec) {
      q = query.clone(at::MemoryFormat::Contiguous);
      p.query = q.data_ptr();
      p.q_row_stride = q.stride(0), p.q_head_stride = q.stride(1);
    }
    at::Tensor offsets = at::empty({seq_lens.size(0) + 1}, seq_lens.options());
    C10_CUDA_CHECK(launch_paged_prefill(p, PrefillWork{offsets.data_ptr<int32_t>(), num_sms()}, current_stream()));
  } else {
    // fp32 queries: every query token is a row of the SIMT decode kernel, single pass, causal
    // limit from its position (see attention_prefill.cu for why not on tensor cores). That
    // kernel reads q element by element, so any view works.
    C10_CUDA_CHECK(launch_paged_decode(p, DecodeWork{}, current_stream()));
  }
}

}  // namespace cuda
}  // namespace kvpage
