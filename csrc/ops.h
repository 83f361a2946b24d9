// kvpage op declarations: the one header every backend implements.
//
// KV-cache layout (the library's choice, used by every kernel):
//   key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_size], contiguous.
//   Token at slot s lives in block s / block_size at offset s % block_size.
// One (block, kv head) is a contiguous [block_size, head_size] tile, so attention streams
// whole tiles and a GQA group reads each KV head's tile once.
//
// Cache dtypes: the query's (float32, float16, bfloat16), or float8_e4m3fn with any of them: an
// fp8 cache holds round_to_nearest_even(clamp(x * (1 / scale), -448, 448)) with one per-tensor
// k_scale / v_scale (vLLM's kv_cache_dtype="fp8"), and attention reads code * scale. The scales
// must be 1.0 for the other cache dtypes.
//
// Attention options (decode and prefill, every backend): sliding_window W, a query at position p
// sees keys in (p - W, p] (block-table entries before the first block the earliest query's window
// reaches are never read: they may hold any id); softcap c, scores become c * tanh(s / c) after the
// scale (Gemma 2); sinks, float32 [num_heads], one extra logit per query head in the softmax
// denominator that brings no value (gpt-oss's s_aux), counted in lse too.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ATen_fwd.h>
#include <ATen/core/List.h>

#include <optional>

// Each backend (kvpage::cpu, kvpage::cuda) implements this same set; torch_bindings.cpp registers
// them under the CPU and CUDA dispatch keys of torch.ops.kvpage.
#define KVPAGE_DECLARE_OPS                                                                          \
  /* key/value [num_tokens, num_kv_heads, head_size] into the caches at slot_mapping            \
     (int64 [num_tokens]; -1 skips the token). An fp8 cache stores x / scale, saturated. */     \
  void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,   \
                         at::Tensor& value_cache, const at::Tensor& slot_mapping,                 \
                         bool check_ranges, double k_scale, double v_scale);                      \
  /* Decode, one query token per sequence; partition_size 0 picks single-pass vs partitioned.     \
     lse, when given (float32 [num_tokens, num_heads], contiguous), receives each row's natural   \
     log of its softmax denominator, sum_j exp(scale * q.k_j), for merging partial results.   */  \
  void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,     \
                       const at::Tensor& value_cache, const at::Tensor& block_tables,            \
                       const at::Tensor& seq_lens, double scale, int64_t partition_size,         \
                       bool check_ranges, double k_scale, double v_scale,                         \
                       const std::optional<at::Tensor>& lse, std::optional<int64_t> sliding_window, \
                       std::optional<double> softcap, const std::optional<at::Tensor>& sinks);      \
  /* Varlen causal prefill over the paged cache (chunked prefill, prefix hits); lse as above,   \
     over each query token's causal context. */                                                   \
  void paged_prefill_attention(at::Tensor& out, const at::Tensor& query,                         \
                               const at::Tensor& key_cache, const at::Tensor& value_cache,       \
                               const at::Tensor& block_tables, const at::Tensor& query_start_loc, \
                               const at::Tensor& seq_lens, double scale, bool check_ranges,      \
                               double k_scale, double v_scale, const std::optional<at::Tensor>& lse, \
                               std::optional<int64_t> sliding_window, std::optional<double> softcap, \
                               const std::optional<at::Tensor>& sinks);                           \
  /* block_mapping int64 [n, 2] of (src, dst); every layer in one call. */                       \
  void copy_blocks(at::TensorList key_caches,                                                    \
                   at::TensorList value_caches, const at::Tensor& block_mapping,                 \
                   bool check_ranges);                                                            \
  /* src[i] -> dst[i] for every tensor pair (all layers, K and V) in one batched operation. */   \
  void swap_blocks(at::TensorList src, at::TensorList dst,                                         \
                   const at::Tensor& block_mapping, bool check_ranges);

// The model's small per-token layers and greedy sampling, CPU only: each fuses a chain of torch
// ops into one pass (on GPUs the Python side keeps torch's own ops). Rows are the last dimension.
#define KVPAGE_DECLARE_CPU_LAYER_OPS                                                                \
  /* out = weight * input / sqrt(mean(input^2) + epsilon), per row (HF LlamaRMSNorm, fp32). */    \
  void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon); \
  /* out = silu(gate) * up (a Llama MLP's activation). */                                         \
  void silu_and_mul(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up);              \
  /* Per row of logits [rows, vocab]: argmax (first on ties) and its log-softmax. */             \
  void greedy_sample(at::Tensor& tokens, at::Tensor& logprobs, const at::Tensor& logits);         \
  /* query/key [tokens, heads, d] -> *_out, rotated by cos/sin [tokens, d] (HF rotate-half form). */ \
  void rotary_embedding(at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& query,         \
                        const at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin);        \
  /* packed [ceil(n / 48), k, 48] (fp32/bf16/fp16) <- weight [n, k]: packed_linear's layout. */   \
  void pack_linear_weight(at::Tensor& packed, const at::Tensor& weight);                          \
  /* out [m, n] = input [m, k] @ weight.T + bias, from pack_linear_weight's packed weight. */     \
  void packed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed,          \
                     const std::optional<at::Tensor>& bias);                                      \
  /* A Llama pre-norm decoder layer on hidden [tokens, hidden] of one flat step (cpu/decoder_layer.cpp): \
     weights [input_norm, qkv, o, post_norm, gate_up, down] (linears packed), biases [qkv, o,     \
     gate_up, down], widths [q, k, v, head_size, intermediate], epsilons of the two norms;        \
     the attention options as for paged_attention. */                                             \
  at::Tensor llama_decoder_layer(                                                                 \
      const at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, \
      at::IntArrayRef widths, at::ArrayRef<double> epsilons, double scale, const at::Tensor& cos,  \
      const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,                      \
      const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, \
      const at::Tensor& query_start_loc, int64_t max_query_len, bool check_ranges,                  \
      std::optional<int64_t> sliding_window, std::optional<double> softcap,                       \
      const std::optional<at::Tensor>& sinks);

namespace kvpage {
namespace cpu {
KVPAGE_DECLARE_OPS
KVPAGE_DECLARE_CPU_LAYER_OPS
// CRC-32C (Castagnoli) of num_bytes at data, continuing from crc (0 to start; crc32c(B, crc32c(A)) ==
// crc32c(AB)): the disk KV tier's payload checksum (cpu/checksum.cpp). SSE4.2's crc32 instruction where
// the CPU has it and the kernels' ISA is not "generic", a portable table loop otherwise; same values.
uint32_t crc32c(const void* data, size_t num_bytes, uint32_t crc);
// crc32c of src while copying it to dst (which must not overlap it) in the same pass. On the crc32 path dst is written
// with non-temporal stores: fence them (_mm_sfence) before another thread reads dst.
uint32_t crc32c_copy(void* dst, const void* src, size_t num_bytes, uint32_t crc);
bool crc32c_uses_hardware();
// The disk KV tier's reads (cpu/kv_blocks.cpp): file i read whole into dsts[i] where its size fits capacities[i]
// (else only its size is reported), with the CRC-32C of its bytes from crc_starts[i] on (where it reaches that far);
// error: the open/read errno, 0 if none. The files are read in parallel on the op threads.
struct KVFileRead {
  int error;
  int64_t size;
  uint32_t crc;
};
void read_kv_files(const char* const* paths, uint8_t* const* dsts, const int64_t* capacities,
                   const int64_t* crc_starts, int64_t num_files, KVFileRead* out);
// The disk tier's load straight into a CPU cache (cpu/kv_blocks.cpp): file i (of sizes[i] bytes, else nothing is
// read) holds from offsets[i] on block block_ids[i]'s row of every cache in turn (row_bytes[t] bytes of cache t, whose
// block b starts at caches[t] + b * row_bytes[t]); they are read into those rows (files in parallel on the op
// threads) and out[i].crc is the CRC-32C of the bytes read, computed as they are copied into the rows. out[i].size: the file's size, or the
// position its read reached where that fell short; error: the errno, 0 if none. The caller checks the arguments
// (offsets[i] + the rows' bytes == sizes[i]) and the results: a failed file leaves its rows partly written.
void load_kv_files(const char* const* paths, const int64_t* sizes, const int64_t* offsets, const int64_t* block_ids,
                   int64_t num_files, uint8_t* const* caches, const int64_t* row_bytes, int64_t num_caches,
                   KVFileRead* out);
// The KV offload tier's block moves (cpu/kv_blocks.cpp): payloads[i] is block block_ids[i]'s row of every cache in
// turn (row_bytes[t] bytes of cache t, whose block b starts at caches[t] + b * row_bytes[t]); to_cache copies the
// payloads into the caches (non-temporal stores), else the caches' rows into the payloads. The caller checks the
// arguments.
void copy_kv_blocks(uint8_t* const* payloads, const int64_t* block_ids, int64_t num_blocks, uint8_t* const* caches,
                    const int64_t* row_bytes, int64_t num_caches, bool to_cache);
}  // namespace cpu
#ifdef KVPAGE_WITH_CUDA
namespace cuda {
KVPAGE_DECLARE_OPS
}  // namespace cuda
#endif
}  // namespace kvpage
