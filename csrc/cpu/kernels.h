// The interface between the CPU op glue (torch-aware, ISA-neutral) and the math kernels, which
// are compiled once per instruction set (isa_avx512.cpp, isa_avx2.cpp, isa_generic.cpp) and picked at run time.
// Kernel TUs see only this header: raw pointers, no torch or c10 headers, so no inline function
// compiled with AVX2 can leak into the portable build through the linker.
#pragma once

#include <cstdint>

#include "../attention_window.h"

namespace kvpage {
namespace cpu {

// kFloat8E4M3 is a cache dtype only (float8_e4m3fn codes; value = code * scale).
enum class DType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };

struct AttentionArgs {
  DType dtype;        // query and out
  DType cache_dtype;  // key_cache and value_cache: dtype, or kFloat8E4M3
  float k_scale, v_scale;  // fp8 caches: what a code is worth (1.0 otherwise)
  void* out;
  int64_t out_token_stride, out_head_stride;
  const void* query;
  int64_t q_token_stride, q_head_stride;
  const void* key_cache;
  const void* value_cache;
  int64_t num_heads, num_kv_heads, block_size, head_size;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1], prefill only
  int64_t num_seqs;
  float scale;
  float* lse;  // [rows, num_heads] contiguous: each row's log-sum-exp of scale * q.k, or null
  int64_t window;      // sliding window: a query at p sees keys in (p - window, p]; 0: none
  float softcap;       // scores -> softcap * tanh(score / softcap); 0: none
  const float* sinks;  // [num_heads]: an extra logit per head in the softmax denominator, or null
};

// The first token an item whose earliest query sits at first_pos reads: the start of the block
// holding the first key its window reaches (attention_window.h).
inline int64_t window_begin(const AttentionArgs& a, int64_t first_pos) {
  return first_window_block(first_pos, a.window, a.block_size) * a.block_size;
}

// Where decode sequence seq's reading starts (its query sits at seq_len - 1); its partitions
// (DecodePlan) tile [decode_begin, seq_len).
inline int64_t decode_begin(const AttentionArgs& a, int64_t seq) { return window_begin(a, a.seq_lens[seq] - 1); }

// Decode work is (partition, kv head); a sequence owns ceil((seq_len - decode_begin) / P)
// consecutive partitions starting at part_offset[seq]. Multi-partition sequences leave
// unnormalised partial outputs in tmp_* for decode_reduce.
struct DecodePlan {
  int64_t partition_size;     // tokens per partition (a multiple of block_size)
  const int64_t* part_offset;  // [num_seqs + 1]
  const int32_t* part_seq;     // [num_parts]: owning sequence
  float* tmp_out;              // [num_parts, num_heads, head_size]
  float* tmp_max;              // [num_parts, num_heads]
  float* tmp_sum;              // [num_parts, num_heads]
};

// Prefill work is (query tile, kv head); sequence s owns tiles [tile_offset[s], tile_offset[s+1]).
struct PrefillPlan {
  int64_t tile_tokens;         // query tokens per tile
  const int64_t* tile_offset;  // [num_seqs + 1]
  const int32_t* tile_seq;     // [num_tiles]
};

// Columns per slab of a packed linear weight: the glue sizes and checks packed tensors with it, the
// kernels (gemm_impl.h) tile by it. 48 = three 16-lane vectors.
constexpr int64_t kSlabColumns = 48;

// y [m, n] = x [m, k] @ W.T + bias, W packed by pack_linear_slabs into 48-column slabs (gemm_impl.h).
// The slabs hold fp32, or bf16 / fp16 (weights stored in 16 bits, widened exactly to fp32 as they are
// loaded: half the bytes a memory-bound decode step streams, the same fp32 arithmetic).
struct LinearArgs {
  const float* x;       // [m, k], contiguous
  const void* packed;   // [ceil(n / 48), k, 48] of weight_dtype
  const float* bias;    // [n] or null
  float* y;             // [m, n], contiguous
  int64_t m, n, k;
  DType weight_dtype = DType::kFloat;  // kFloat, kBFloat16 or kHalf
  // bf16 dot products: x rounded to bf16, [m][ceil(k / 2)] pairs; packed is then pair-interleaved bf16
  // [ceil(n / 48)][ceil(k / 2)][48][2] (linear_slabs_bf16_pairs).
  const uint32_t* x_pairs = nullptr;
  // [m, n] contiguous, added to each output after its bias (a decoder layer's residual), or null.
  const float* residual = nullptr;
};

// An item's place in the run of consecutive items one thread takes (dispatch.h's parallel_items).
struct RunPosition {
  bool after_previous;  // this thread ran item - 1 just before
  bool before_next;     // this thread runs item + 1 next
};

struct KernelTable {
  const char* isa;
  // Floats of per-thread scratch the attention kernels need.
  int64_t (*scratch_floats)(const AttentionArgs& a, int64_t rows);
  // run: where the item sits in the calling thread's run of items (dispatch.h), which says whose
  // tiles are already being prefetched and whether the next item's are worth prefetching.
  void (*decode_item)(const AttentionArgs& a, const DecodePlan& p, int64_t part, int64_t kv_head, RunPosition run,
                      float* scratch);
  void (*decode_reduce)(const AttentionArgs& a, const DecodePlan& p, int64_t seq, int64_t head);
  void (*prefill_item)(const AttentionArgs& a, const PrefillPlan& p, int64_t tile, int64_t kv_head,
                       float* scratch);
  // One row of the model's small layers (layers_impl.h), fp32.
  void (*rms_norm_row)(float* out, const float* x, const float* weight, int64_t n, float eps);
  void (*silu_and_mul_row)(float* out, const float* gate, const float* up, int64_t n);
  void (*greedy_row)(const float* logits, int64_t n, int64_t* token, float* logprob);
  void (*rotary_row)(float* out, const float* x, const float* cos, const float* sin, int64_t d);
  // Slabs [begin, end) of a packed linear layer, and the packing itself.
  void (*linear_slabs)(const LinearArgs& a, int64_t slab_begin, int64_t slab_end);
  void (*pack_linear_slabs)(const float* weight, int64_t n, int64_t k, float* packed, int64_t slab_begin,
                            int64_t slab_end);
  // bf16 dot products (AVX-512 builds; null elsewhere, and usable only where the CPU has AVX512-BF16).
  void (*linear_slabs_bf16_pairs)(const LinearArgs& a, int64_t slab_begin, int64_t slab_end);
  void (*round_rows_to_bf16)(const float* x, int64_t rows, int64_t k, uint16_t* out);
};

const KernelTable& generic_kernels();
#if defined(KVPAGE_HAVE_AVX2)
const KernelTable& avx2_kernels();
#endif
#if defined(KVPAGE_HAVE_AVX512)
const KernelTable& avx512_kernels();
#endif
#if defined(KVPAGE_HAVE_AMX)
const KernelTable& avx512_amx_kernels();  // avx512's, with AMX prefill attention (isa_avx512_amx.cpp)
#endif

}  // namespace cpu
}  // namespace kvpage
