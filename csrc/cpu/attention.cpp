// CPU paged attention ops: validate, plan the work items, run them on every core.
#include <ATen/ATen.h>

#include "../checks.h"
#include "../ops.h"
#include "dispatch.h"

namespace kvpage {
namespace cpu {
namespace {

constexpr int64_t kDefaultPartitionTokens = 512;
constexpr int64_t kPrefillTileRows = 64;  // query rows per prefill work item (see paged_prefill_attention)

DType to_dtype(at::ScalarType t) {
  if (t == at::kHalf) return DType::kHalf;
  if (t == at::kBFloat16) return DType::kBFloat16;
  if (t == at::kFloat8_e4m3fn) return DType::kFloat8E4M3;
  return DType::kFloat;
}

AttentionArgs make_args(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const CacheShape& cache, double scale,
                        double k_scale, double v_scale) {
  AttentionArgs a{};
  a.dtype = to_dtype(query.scalar_type());
  a.cache_dtype = to_dtype(key_cache.scalar_type());
  a.k_scale = static_cast<float>(k_scale), a.v_scale = static_cast<float>(v_scale);
  a.out = out.data_ptr();
  a.out_token_stride = out.stride(0), a.out_head_stride = out.stride(1);
  a.query = query.data_ptr();
  a.q_token_stride = query.stride(0), a.q_head_stride = query.stride(1);
  a.key_cache = key_cache.data_ptr(), a.value_cache = value_cache.data_ptr();
  a.num_heads = query.size(1), a.num_kv_heads = cache.num_kv_heads;
  a.block_size = cache.block_size, a.head_size = cache.head_size;
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.max_blocks_per_seq = block_tables.size(1);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.num_seqs = seq_lens.size(0);
  a.scale = static_cast<float>(scale);
  return a;
}

void set_options(AttentionArgs& a, const AttentionOptions& o) {
  a.window = o.window, a.softcap = o.softcap, a.sinks = o.sinks;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Splits long contexts only when one sequence's work would leave cores idle: a sequence longer
// than a quarter of an even per-thread share is cut into fixed partitions (vLLM's v2 idea).
// Lengths are what each sequence reads: from decode_begin (its window's first block) to seq_len.
int64_t choose_partition_size(const AttentionArgs& a, int64_t requested) {
  int64_t max_len = 1, total = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t len = a.seq_lens[s] - decode_begin(a, s);
    max_len = std::max<int64_t>(max_len, len);
    total += len;
  }
  const int64_t single_pass = round_up(max_len, a.block_size);
  if (requested > 0) return std::min(requested, single_pass);
  const int64_t partition = round_up(kDefaultPartitionTokens, a.block_size);
  const int64_t fair_share = total / (4 * at::get_num_threads());
  return (max_len <= partition || max_len <= fair_share) ? single_pass : partition;
}

// Sequence s owns items [offset[s], offset[s + 1]); owner maps an item back to its sequence.
struct WorkSplit {
  std::vector<int64_t> offset;
  std::vector<int32_t> owner;
  int64_t size() const { return offset.back(); }
};

template <typename ItemsOf>
WorkSplit split_work(int64_t num_seqs, const ItemsOf& items_of) {
  WorkSplit w;
  w.offset.assign(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) w.offset[s + 1] = w.offset[s] + items_of(s);
  w.owner.resize(w.size());
  for (int64_t s = 0; s < num_seqs; ++s)
    std::fill(w.owner.begin() + w.offset[s], w.owner.begin() + w.offset[s + 1], int32_t(s));
  return w;
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale, int64_t partition_size,
                     bool check_ranges, double k_scale, double v_scale, const std::optional<at::Tensor>& lse,
                     std::optional<int64_t> sliding_window, std::optional<double> softcap,
                     const std::optional<at::Tensor>& sinks) {
  const CacheShape cache = check_attention_inputs(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                  k_scale, v_scale, /*float32_over_16bit=*/true);
  check_decode(query, seq_lens, partition_size, cache);
  const AttentionOptions options = check_attention_options(sliding_window, softcap, sinks, query, out);
  if (check_ranges) check_attention_ranges(block_tables, seq_lens, cache, 1, options.window, nullptr, query.size(0));
  float* lse_data = check_lse(lse, out, query, key_cache, value_cache, block_tables, seq_lens);
  if (query.size(0) == 0) return;
  AttentionArgs a = make_args(out, query, key_cache, value_cache, block_tables, seq_lens, cache, scale,
                              k_scale, v_scale);
  a.lse = lse_data;
  set_options(a, options);

  DecodePlan plan{};
  plan.partition_size = choose_partition_size(a, partition_size);
  const WorkSplit parts = split_work(a.num_seqs, [&](int64_t s) {
    return (a.seq_lens[s] - decode_begin(a, s) + plan.partition_size - 1) / plan.partition_size;
  });
  const int64_t num_parts = parts.size();
  plan.part_offset = parts.offset.data(), plan.part_seq = parts.owner.data();

  const bool partitioned = num_parts > a.num_seqs;
  at::Tensor tmp;
  if (partitioned) {
    tmp = at::empty({num_parts * a.num_heads * (a.head_size + 2)}, query.options().dtype(at::kFloat));
    plan.tmp_out = tmp.data_ptr<float>();
    plan.tmp_max = plan.tmp_out + num_parts * a.num_heads * a.head_size;
    plan.tmp_sum = plan.tmp_max + num_parts * a.num_heads;
  }
  const KernelTable& k = active_kernels();
  const int64_t group = a.num_heads / a.num_kv_heads;
  parallel_items(num_parts * a.num_kv_heads, k.scratch_floats(a, group), [&](int64_t i, float* scratch,
                                                                             RunPosition run) {
    k.decode_item(a, plan, i / a.num_kv_heads, i % a.num_kv_heads, run, scratch);
  });
  if (!partitioned) return;
  at::parallel_for(0, a.num_seqs * a.num_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) k.decode_reduce(a, plan, i / a.num_heads, i % a.num_heads);
  });
}

void paged_prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             double scale, bool check_ranges, double k_scale, double v_scale,
                             const std::optional<at::Tensor>& lse, std::optional<int64_t> sliding_window,
                             std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const CacheShape cache = check_attention_inputs(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                  k_scale, v_scale, /*float32_over_16bit=*/true);
  check_query_start_loc_tensor(query_start_loc, seq_lens, out, key_cache);
  const AttentionOptions options = check_attention_options(sliding_window, softcap, sinks, query, out);
  if (check_ranges) {
    check_attention_ranges(block_tables, seq_lens, cache, 0, options.window, &query_start_loc, query.size(0));
  }
  float* lse_data =
      check_lse(lse, out, query, key_cache, value_cache, block_tables, seq_lens, &query_start_loc);
  if (query.size(0) == 0) return;
  AttentionArgs a = make_args(out, query, key_cache, value_cache, block_tables, seq_lens, cache, scale,
                              k_scale, v_scale);
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.lse = lse_data;
  set_options(a, options);

  // A tile of query tokens times the GQA group: ~64 query rows, whose K/V reads (every item reads
  // its KV head's context once) then cost a 64th of a byte per multiply-add. A Llama-3-8B head of 128
  // had 32 rows before: 1.33-1.37x faster on a 4k prompt whose K/V outgrows the L3, level with the
  // context in cache; SmolLM2's 64-dim heads kept their 63 (twice as many ran no faster).
  const int64_t group = a.num_heads / a.num_kv_heads;
  PrefillPlan plan{};
  plan.tile_tokens = std::max<int64_t>(1, std::max<int64_t>(group, kPrefillTileRows) / group);
  const WorkSplit tiles = split_work(a.num_seqs, [&](int64_t s) {
    const int64_t q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    return (q_len + plan.tile_tokens - 1) / plan.tile_tokens;
  });
  const int64_t num_tiles = tiles.size();
  plan.tile_offset = tiles.offset.data(), plan.tile_seq = tiles.owner.data();

  const KernelTable& k = active_kernels();
  // KV head by KV head, so a core's tiles of one head reread that head's K/V from its L2 (SmolLM2's
  // 1.4k-token context is ~0.7 MB per head, its three heads together outgrow a 2 MB L2); within a
  // head later tiles attend to more context: hand them out first so the last items are short.
  parallel_items(num_tiles * a.num_kv_heads, k.scratch_floats(a, plan.tile_tokens * group),
                 [&](int64_t i, float* scratch) {
                   k.prefill_item(a, plan, num_tiles - 1 - i % num_tiles, i / num_tiles, scratch);
                 });
}

}  // namespace cpu
}  // namespace kvpage
