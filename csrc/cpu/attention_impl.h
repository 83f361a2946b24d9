// Paged attention math, compiled once per ISA: isa_<name>.cpp defines KVPAGE_ISA_NS and includes
// this file. Decode and prefill share one core: a set of query rows that attend to one KV head's
// tokens [begin, end), streamed a chunk at a time with an online softmax. Decode rows are the
// query heads of one GQA group (so each K/V tile is read once per group); prefill rows are a tile
// of query tokens times that group, each with its own causal limit. The kernel table at the end
// also carries the row kernels of layers_impl.h (RMSNorm, SiLU-and-multiply, greedy sampling) and
// the packed linear layer of gemm_impl.h.
#include "kernels.h"

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>  // gemm_impl.h: std::index_sequence
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>  // vec.h is included inside a namespace: system headers come first
#endif

#ifndef KVPAGE_ISA_NS
#error "define KVPAGE_ISA_NS before including attention_impl.h"
#endif

namespace kvpage {
namespace cpu {
namespace KVPAGE_ISA_NS {
namespace {

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

#include "vec.h"
#include "microkernels.h"
#include "layers_impl.h"

#include "gemm_impl.h"

int64_t element_size(DType t) { return t == DType::kFloat ? 4 : t == DType::kFloat8E4M3 ? 1 : 2; }

// Online-softmax step: a chunk's scores stay in L1/L2 between its K and V passes.
int64_t chunk_tokens(const AttentionArgs& a) { return imax(a.block_size, 128); }
constexpr int64_t kMaxChunkTiles = 128;  // a chunk's tiles at most (block size 1)

struct Scratch {
  float* q;      // [rows, head_size], pre-scaled
  float* qT;     // [head_size, rp]: q transposed for the wide path (attention_wide.h)
  float* acc;    // [rows, head_size]; the wide path accumulates [head_size, rp] (attention_wide.h)
  float* m;      // [rp] running max
  float* cmax;   // [rp] the wide path's max over the chunk's scores so far
  float* alpha;  // [rp] the wide path's rescale of the accumulators at the chunk's values
  float* l;      // [rp] running sum of exp
  float* score;  // [rows, chunk], or [chunk, rp] on the wide path
  float* kbuf;   // [chunk, head_size] fp32 copy of K for 16-bit and fp8 caches
  float* vbuf;   // [chunk, head_size]
  float* amx;    // the AMX layout's bf16 operand tiles (attention_amx.h; none outside its build)
  int64_t chunk;      // chunk_tokens
  float score_scale;  // what the AMX layout's scores take (its query is loaded unscaled)
};

// Rows rounded up to whole vectors of the wide path's lanes (attention_wide.h): its row padding.
#if defined(__AVX512F__)
constexpr int64_t kRowLanes = 16;
#else
constexpr int64_t kRowLanes = 8;
#endif
int64_t round_up_rows(int64_t rows) { return (rows + kRowLanes - 1) / kRowLanes * kRowLanes; }

int64_t amx_scratch_floats(const AttentionArgs& a, int64_t rp, int64_t d, int64_t chunk);

int64_t scratch_floats(const AttentionArgs& a, int64_t rows) {
  const int64_t d = a.head_size, c = chunk_tokens(a), rp = round_up_rows(rows);
  return 3 * rp * d + 4 * rp + rp * c + 2 * c * d + 16 + amx_scratch_floats(a, rp, d, c);
}

Scratch carve(const AttentionArgs& a, int64_t rows, float* base) {
  const int64_t d = a.head_size, c = chunk_tokens(a), rp = round_up_rows(rows);
  Scratch s;
  s.q = base;
  s.qT = s.q + rp * d;
  s.acc = s.qT + rp * d;
  s.m = s.acc + rp * d;
  s.l = s.m + rp;
  s.cmax = s.l + rp;
  s.alpha = s.cmax + rp;
  s.score = s.alpha + rp;
  s.kbuf = s.score + rp * c;
  s.vbuf = s.kbuf + c * d;
  s.amx = s.vbuf + c * d;
  s.chunk = c;
  s.score_scale = 1.f;
  return s;
}

// What one unit of a converted K or V tile is worth: 1 for float caches; for fp8 caches the
// cache's scale times kFp8HalfFactor, applied to q (keys) and to the normalised output (values).
float cache_unit(const AttentionArgs& a, float scale) {
  return a.cache_dtype == DType::kFloat8E4M3 ? scale * kFp8HalfFactor : 1.f;
}

// Where one KV head's tiles sit in the pool ([num_blocks, num_kv_heads, block_size, head_size]).
struct TileStrides {
  int64_t tile_bytes = 0;   // one (block, KV head) tile
  int64_t block_bytes = 0;  // one pool block, all KV heads
  int64_t head_offset = 0;  // this KV head's tile within a block

  const char* at(const void* cache, int32_t block) const {
    return static_cast<const char*>(cache) + int64_t(block) * block_bytes + head_offset;
  }
};

TileStrides tile_strides(const AttentionArgs& a, int64_t kv_head) {
  TileStrides t;
  t.tile_bytes = a.block_size * a.head_size * element_size(a.cache_dtype);
  t.block_bytes = a.num_kv_heads * t.tile_bytes;
  t.head_offset = kv_head * t.tile_bytes;
  return t;
}

// The K/V tiles of one sequence and KV head.
struct KVSource {
  const AttentionArgs& a;
  const int32_t* table;  // this sequence's block_tables row
  TileStrides strides;

  KVSource(const AttentionArgs& args, int64_t seq, int64_t kv_head)
      : a(args), table(args.block_tables + seq * args.max_blocks_per_seq), strides(tile_strides(args, kv_head)) {}

  const char* tile_address(const void* cache, int64_t b) const { return strides.at(cache, table[b]); }

  // Pointer to a [n, head_size] fp32 view of K or V for logical block b; 16-bit and fp8 caches
  // convert into buf (fp8: in units of cache_unit(), see load_fp8_as_scaled_float).
  const float* tile(const void* cache, int64_t b, int64_t n, float* buf) const {
    const char* base = tile_address(cache, b);
    if (a.cache_dtype == DType::kFloat) return reinterpret_cast<const float*>(base);
    if (a.cache_dtype == DType::kFloat8E4M3) {
      load_fp8_as_scaled_float(base, buf, n * a.head_size);
    } else {
      load_as_float(a.cache_dtype, base, buf, n * a.head_size);
    }
    return buf;
  }
};

#include "attention_prefetch.h"

// An accumulator row moves to a new running max: acc *= alpha = exp(m_old - m_new) (a no-op at 1).
KVPAGE_KERNEL_INLINE
void rescale_row(float* acc, int64_t d, float alpha) {
  if (alpha == 1.f) return;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] *= alpha;
}

// Rows r see tokens at positions in (limit(r) - window, limit(r)], limit(r) = first_pos + r / group
// (causal; decode passes group = rows); window 0: no lower bound. softcap: the scores' cap, 0: none.
struct RowSet {
  int64_t rows, group, first_pos, window;
  float softcap;
  int64_t limit(int64_t r) const { return first_pos + r / group; }
  int64_t lowest(int64_t r) const { return window > 0 ? limit(r) - window + 1 : 0; }
};

// Gemma 2's logit softcapping, s -> cap * tanh(s / cap), on scores already scaled. It runs before
// the mask: tanh would turn a masked -inf into -cap.
inline void soft_cap(float* s, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// Scores by row (score [rows][chunk]): microkernels.h's dot products. The chunk loop (attend_d)
// calls a layout's start once, then per chunk scores and mask per block, softmax, values per block.
struct RowScores {
  static constexpr bool kChunkValues = false;  // values tile by tile (decode's prefetch stream follows them)

  static void start(const RowSet&, int64_t, Scratch&) {}
  static void finish(const RowSet&, int64_t, Scratch&) {}

  template <typename KT>
  static void scores(const RowSet& rs, int64_t d, int64_t chunk, const KT* k, int64_t t0, int64_t nb,
                     int64_t pos0, Scratch& s) {
    block_scores(s.q, rs.rows, k, nb, d, s.score + t0, chunk);
    for (int64_t r = 0; r < rs.rows; ++r) {
      float* sc = s.score + r * chunk + t0;
      if (rs.softcap > 0.f) soft_cap(sc, nb, rs.softcap);
      // The window's lower edge (only a window's first block has any), then the causal mask (only
      // prefill's diagonal has any).
      for (int64_t t = 0, n = imin(nb, rs.lowest(r) - pos0); t < n; ++t) sc[t] = -INFINITY;
      for (int64_t t = imax(0, rs.limit(r) - pos0 + 1); t < nb; ++t) sc[t] = -INFINITY;
    }
  }

  // Rescales the running state to the chunk's max and turns scores into probabilities.
  static void softmax(const RowSet& rs, int64_t d, int64_t chunk, int64_t n, Scratch& s) {
    for (int64_t r = 0; r < rs.rows; ++r) {
      float* sc = s.score + r * chunk;
      const float mx = row_max(sc, n);
      const float m_new = mx > s.m[r] ? mx : s.m[r];
      if (m_new == -INFINITY) {  // nothing visible yet for this row
        for (int64_t t = 0; t < n; ++t) sc[t] = 0.f;
        continue;
      }
      const float alpha = exp_nonpositive(s.m[r] - m_new);
      rescale_row(s.acc + r * d, d, alpha);
      s.l[r] = s.l[r] * alpha + exp_and_sum(sc, n, m_new);
      s.m[r] = m_new;
    }
  }

  template <typename VT>
  static void values(const RowSet& rs, int64_t d, int64_t chunk, const VT* v, int64_t t0, int64_t nb,
                     Scratch& s) {
    block_values(s.acc, rs.rows, d, s.score + t0, chunk, 1, v, nb);
  }
};

#include "attention_wide.h"
#include "attention_amx.h"

// Floats of scratch the AMX layout takes: none outside its build, nor for dtypes it does not run (every
// op call's workers allocate and zero their scratch).
int64_t amx_scratch_floats(const AttentionArgs& a, int64_t rp, int64_t d, int64_t chunk) {
#if defined(KVPAGE_AMX_ATTENTION)
  return amx_dtypes(a) ? amx_scratch_dwords(rp, d, chunk) : 0;
#else
  (void)a, (void)rp, (void)d, (void)chunk;
  return 0;
#endif
}

// Whether rows take the AMX layout (a bf16 prefill tile in the AMX build).
bool takes_amx(const AttentionArgs& a, const RowSet& rs) {
#if defined(KVPAGE_AMX_ATTENTION)
  return takes_amx_path(a, rs);
#else
  (void)a, (void)rs;
  return false;
#endif
}

// Attends every row to tokens [begin, end) of one KV head, a chunk at a time, with scores laid out
// by Layout. begin is block aligned. kD is the head size when it is one of the common ones (0:
// a.head_size), so the inlined microkernels unroll fully and keep their accumulators in registers.
// A tile for the microkernels: float (an fp32 cache's tile, or any other converted into buf), or
// a 16-bit cache's tile read in place (Bf16Bits / HalfBits: the kernels widen as they load).
template <typename CT>
const CT* tile_for_kernels(const KVSource& kv, const void* cache, int64_t b, int64_t n, float* buf) {
  if constexpr (std::is_same_v<CT, float>) {
    return kv.tile(cache, b, n, buf);
  } else {
    return reinterpret_cast<const CT*>(kv.tile_address(cache, b));
  }
}

// The item's tiles stream through pf (attention_prefetch.h), which prefetches ahead of each read.
template <int kD, typename Layout, typename CT = float>
void attend_d(const KVSource& kv, const RowSet& rs, int64_t begin, int64_t end, Scratch& s, TilePrefetcher& pf) {
  const AttentionArgs& a = kv.a;
  const int64_t d = kD ? kD : a.head_size, bs = a.block_size, chunk = chunk_tokens(a);
  const int64_t rp = round_up_rows(rs.rows);  // the wide layout's softmax runs over padded rows too
  for (int64_t r = 0; r < rp; ++r) s.m[r] = -INFINITY, s.l[r] = 0.f;
  std::memset(s.acc, 0, sizeof(float) * rp * d);
  Layout::start(rs, d, s);
  // Prefill tiles on the wide layout issue no prefetches past pf's first lines: with the K/V in L2 / L3
  // (a long prefill's tiles reread by each of its query tiles), a tile's 64 lines issued at once
  // stalled on the line fill buffers, ~10% of the time, and spreading them over the kernels' steps
  // measured 0.85-0.9x of none; the hardware prefetcher follows the kernels' runs through each tile.
  // Decode's wide GQA groups (one token: rows == group) read their K/V once, from DRAM: they stream.
  const bool prefetch = !Layout::kChunkValues || rs.rows == rs.group;
  for (int64_t c0 = begin; c0 < end; c0 += chunk) {
    const int64_t n = imin(chunk, end - c0);
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
      const int64_t nb = imin(bs, n - t0), pos0 = c0 + t0;
      const CT* k = tile_for_kernels<CT>(kv, a.key_cache, pos0 / bs, nb, s.kbuf + t0 * d);
      if (prefetch) pf.consumed();
      Layout::scores(rs, d, chunk, k, t0, nb, pos0, s);
    }
    Layout::softmax(rs, d, chunk, n, s);
    const CT* v[kMaxChunkTiles];
    for (int64_t t0 = 0, j = 0; t0 < n; t0 += bs, ++j) {
      const int64_t nb = imin(bs, n - t0);
      v[j] = tile_for_kernels<CT>(kv, a.value_cache, (c0 + t0) / bs, nb, s.vbuf + t0 * d);
      if (prefetch) pf.consumed();
      if constexpr (!Layout::kChunkValues) Layout::values(rs, d, chunk, v[j], t0, nb, s);
    }
    if constexpr (Layout::kChunkValues) Layout::chunk_values(rs, d, v, bs, n, s);
  }
  Layout::finish(rs, d, s);
}

constexpr int64_t kInPlaceRows = 4;

template <int kD>
void attend_rows(const KVSource& kv, const RowSet& rs, int64_t begin, int64_t end, Scratch& s,
                 TilePrefetcher& pf) {
#if defined(KVPAGE_AMX_ATTENTION)
  if (takes_amx_path(kv.a, rs)) return attend_d<kD, AmxBf16Scores, Bf16Bits>(kv, rs, begin, end, s, pf);
#endif
#if defined(KVPAGE_WIDE_ATTENTION)
  if (takes_wide_path(rs)) return attend_d<kD, WideScores>(kv, rs, begin, end, s, pf);
#endif
#if defined(KVPAGE_VEC_AVX2)
  // A few rows (decode's GQA groups) read a 16-bit tile in place, widening each element once as they
  // load it, instead of a conversion pass into kbuf / vbuf and a second read; many rows (prefill)
  // would widen each element once per row block, so they convert first.
  if (rs.rows <= kInPlaceRows) {
    if (kv.a.cache_dtype == DType::kBFloat16) return attend_d<kD, RowScores, Bf16Bits>(kv, rs, begin, end, s, pf);
    if (kv.a.cache_dtype == DType::kHalf) return attend_d<kD, RowScores, HalfBits>(kv, rs, begin, end, s, pf);
  }
#endif
  attend_d<kD, RowScores>(kv, rs, begin, end, s, pf);
}

void attend(const KVSource& kv, const RowSet& rs, int64_t begin, int64_t end, Scratch& s, TilePrefetcher& pf) {
  switch (kv.a.head_size) {
    case 64: return attend_rows<64>(kv, rs, begin, end, s, pf);
    case 128: return attend_rows<128>(kv, rs, begin, end, s, pf);
    default: return attend_rows<0>(kv, rs, begin, end, s, pf);
  }
}

// What a query row is multiplied by before its dot products: the scale, and an fp8 key's unit.
float query_factor(const AttentionArgs& a) { return a.scale * cache_unit(a, a.k_scale); }

// Loads query heads [head0, head0 + group) of token `token` into rows [row0, row0 + group), times factor.
void load_query(const AttentionArgs& a, int64_t token, int64_t head0, int64_t group, int64_t row0,
                Scratch& s, float factor) {
  const int64_t d = a.head_size;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t elem = token * a.q_token_stride + (head0 + g) * a.q_head_stride;
    float* q = s.q + (row0 + g) * d;
    load_as_float(a.dtype, static_cast<const char*>(a.query) + elem * element_size(a.dtype), q, d);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) q[i] *= factor;
  }
}

// out = acc * factor / l (and the fp8 value unit); 0 for a row that saw nothing.
void store_normalised(const AttentionArgs& a, int64_t token, int64_t head, const float* acc,
                      float l, float factor, float* tmp) {
  const int64_t d = a.head_size;
  const float inv = l > 0.f ? cache_unit(a, a.v_scale) * factor / l : 0.f;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) tmp[i] = acc[i] * inv;
  const int64_t elem = token * a.out_token_stride + head * a.out_head_stride;
  store_from_float(a.dtype, tmp, static_cast<char*>(a.out) + elem * element_size(a.dtype), d);
}

// The natural log of a row's softmax denominator, sum exp(score), from its running max m and
// sum l of exp(score - m): what merging partial results over disjoint keys needs (-inf: no keys).
void store_lse(const AttentionArgs& a, int64_t token, int64_t head, float m, float l) {
  if (a.lse != nullptr) a.lse[token * a.num_heads + head] = l > 0.f ? m + std::log(l) : -INFINITY;
}

// A row's softmax state once its keys are done: max m, sum l of exp(score - m), and the factor its
// accumulator (sum of exp(score - m) * v) still takes.
struct RowTotal {
  float m, l, acc_factor;
};

// Folds the head's sink into a row's total: one more logit in the denominator that brings no value
// (gpt-oss's s_aux). The max moves to cover it, as HF's eager attention subtracts the max over the
// scores and the sink. Once per row, after every key (partitions merged first), so it counts once.
RowTotal row_total(const AttentionArgs& a, int64_t head, float m, float l) {
  if (a.sinks == nullptr) return {m, l, 1.f};
  const float sink = a.sinks[head], m_new = m > sink ? m : sink;
  if (m_new == -INFINITY) return {m, l, 1.f};  // no key and a sink of -inf: nothing to fold
  const float alpha = std::exp(m - m_new);    // 0 where the row saw no key (m = -inf)
  return {m_new, l * alpha + std::exp(sink - m_new), alpha};
}

// Writes a finished row's output and log-sum-exp, its sink folded in.
void finish_row(const AttentionArgs& a, int64_t token, int64_t head, const float* acc, float m, float l,
                float* tmp) {
  const RowTotal t = row_total(a, head, m, l);
  store_normalised(a, token, head, acc, t.l, t.acc_factor, tmp);
  store_lse(a, token, head, t.m, t.l);
}

// Tokens [begin, end) of sequence seq: partition `part`'s share.
struct PartRange {
  int64_t seq, begin, end;
};

PartRange part_range(const AttentionArgs& a, const DecodePlan& p, int64_t part) {
  const int64_t seq = p.part_seq[part];
  const int64_t begin = decode_begin(a, seq) + (part - p.part_offset[seq]) * p.partition_size;
  return {seq, begin, imin(a.seq_lens[seq], begin + p.partition_size)};
}

// The tiles a work item (tokens r of one sequence, one KV head) reads.
ItemTiles item_tiles(const AttentionArgs& a, const PartRange& r, int64_t kv_head) {
  ItemTiles t;
  const int64_t bs = a.block_size;
  t.key_cache = static_cast<const char*>(a.key_cache);
  t.value_cache = static_cast<const char*>(a.value_cache);
  t.table = a.block_tables + r.seq * a.max_blocks_per_seq;
  t.strides = tile_strides(a, kv_head);
  t.first_block = r.begin / bs;
  t.num_blocks = (r.end - r.begin + bs - 1) / bs;
  t.blocks_per_chunk = chunk_tokens(a) / bs;
  return t;
}

void decode_item(const AttentionArgs& a, const DecodePlan& p, int64_t part, int64_t kv_head, RunPosition run,
                 float* scratch) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_size;
  const PartRange r = part_range(a, p, part);
  const int64_t seq = r.seq, begin = r.begin, end = r.end, seq_len = a.seq_lens[seq];
  const int64_t num_parts = p.part_offset[seq + 1] - p.part_offset[seq];
  Scratch s = carve(a, group, scratch);
  load_query(a, seq, kv_head * group, group, 0, s, query_factor(a));
  const KVSource kv(a, seq, kv_head);
  // The next item, when this thread runs it: prefetching another core's tiles only costs this one.
  // (before_next implies a next item exists.)
  const bool last_head = kv_head + 1 == a.num_kv_heads;
  const ItemTiles next = run.before_next ? item_tiles(a, part_range(a, p, last_head ? part + 1 : part),
                                                      last_head ? 0 : kv_head + 1)
                                         : ItemTiles{};
  TilePrefetcher pf(item_tiles(a, r, kv_head), next, run.after_previous);
  attend(kv, RowSet{group, group, seq_len - 1, a.window, a.softcap}, begin, end, s, pf);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = kv_head * group + g;
    if (num_parts == 1) {
      finish_row(a, seq, head, s.acc + g * d, s.m[g], s.l[g], s.kbuf);
      continue;
    }
    std::memcpy(p.tmp_out + (part * a.num_heads + head) * d, s.acc + g * d, sizeof(float) * d);
    p.tmp_max[part * a.num_heads + head] = s.m[g];
    p.tmp_sum[part * a.num_heads + head] = s.l[g];
  }
}

// Merges a sequence's partitions with a log-sum-exp reduction.
void decode_reduce(const AttentionArgs& a, const DecodePlan& p, int64_t seq, int64_t head) {
  const int64_t first = p.part_offset[seq], num_parts = p.part_offset[seq + 1] - first;
  if (num_parts <= 1) return;
  const int64_t d = a.head_size, h = a.num_heads;
  float global_max = -INFINITY;
  for (int64_t i = 0; i < num_parts; ++i) {
    const float m = p.tmp_max[(first + i) * h + head];
    global_max = m > global_max ? m : global_max;
  }
  float acc[256] = {0.f}, out[256];
  float total = 0.f;
  for (int64_t i = 0; i < num_parts; ++i) {
    const int64_t row = (first + i) * h + head;
    const float w = exp_nonpositive(p.tmp_max[row] - global_max);
    total += w * p.tmp_sum[row];
    const float* part_out = p.tmp_out + row * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) acc[j] += w * part_out[j];
  }
  finish_row(a, seq, head, acc, global_max, total, out);
}

void prefill_item(const AttentionArgs& a, const PrefillPlan& p, int64_t tile, int64_t kv_head,
                  float* scratch) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_size;
  const int64_t seq = p.tile_seq[tile];
  const int64_t q_start = a.query_start_loc[seq], q_len = a.query_start_loc[seq + 1] - q_start;
  const int64_t context = int64_t(a.seq_lens[seq]) - q_len;
  const int64_t tok0 = q_start + (tile - p.tile_offset[seq]) * p.tile_tokens;
  const int64_t ntok = imin(p.tile_tokens, q_start + q_len - tok0);
  Scratch s = carve(a, ntok * group, scratch);
  const RowSet rows{ntok * group, group, context + (tok0 - q_start), a.window, a.softcap};
  // The AMX layout takes the bf16 query as it is (exact) and scales its fp32 scores instead.
  const bool unscaled = takes_amx(a, rows);
  if (unscaled) s.score_scale = query_factor(a);
  for (int64_t i = 0; i < ntok; ++i) {
    load_query(a, tok0 + i, kv_head * group, group, i * group, s, unscaled ? 1.f : query_factor(a));
  }
  const KVSource kv(a, seq, kv_head);
  // From the block of the first key the tile's first query's window reaches, to its last query.
  const int64_t begin = window_begin(a, rows.first_pos), end = rows.limit(rows.rows - 1) + 1;
  TilePrefetcher pf(item_tiles(a, PartRange{seq, begin, end}, kv_head), ItemTiles{}, false);
  attend(kv, rows, begin, end, s, pf);
  for (int64_t r = 0; r < rows.rows; ++r) {
    const int64_t token = tok0 + r / group, head = kv_head * group + r % group;
    finish_row(a, token, head, s.acc + r * d, s.m[r], s.l[r], s.kbuf);
  }
}

}  // namespace
}  // namespace KVPAGE_ISA_NS
}  // namespace cpu
}  // namespace kvpage

namespace kvpage {
namespace cpu {
namespace KVPAGE_ISA_NS {

const KernelTable& kernels() {
#if defined(KVPAGE_BF16_DOT)
  static const KernelTable table{KVPAGE_ISA_NAME, scratch_floats, decode_item, decode_reduce,
                                 prefill_item, rms_norm_row, silu_and_mul_row, greedy_row, rotary_row,
                                 linear_slabs, pack_linear_slabs, linear_slabs_bf16_pairs, round_rows_to_bf16};
#else
  static const KernelTable table{KVPAGE_ISA_NAME, scratch_floats, decode_item, decode_reduce,
                                 prefill_item, rms_norm_row, silu_and_mul_row, greedy_row, rotary_row,
                                 linear_slabs, pack_linear_slabs, nullptr, nullptr};
#endif
  return table;
}

}  // namespace KVPAGE_ISA_NS
}  // namespace cpu
}  // namespace kvpage
