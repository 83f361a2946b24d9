// One Llama-style pre-norm decoder layer of a kvpage CPU step, in one op call: the same kernels, in the
// same order, as python/kvpage/model/llama.py's composed DecoderLayer (so the same bits), without
// ~45 Python-level op dispatches per layer (~5 ms of a 64-sequence decode step over SmolLM2's 30 layers).
// Each kernel call is recorded under its op's name, so torch.profiler still shows where the time goes.
//
//   h = rms_norm(x); q|k|v = h @ Wqkv; q, k = rotary(q, k); cache <- k, v (slot_mapping);
//   a = attention(q) over the paged cache (its sliding window, softcap, sinks); x = x + a @ Wo;
//   h = rms_norm(x); g|u = h @ Wgate_up; x = x + (silu(g) * u) @ Wdown
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "../ops.h"
#include "dispatch.h"

namespace kvpage {
namespace cpu {
namespace {

enum Weight { kInputNorm, kQKV, kO, kPostNorm, kGateUp, kDown, kNumWeights };
enum Bias { kQKVBias, kOBias, kGateUpBias, kDownBias, kNumBiases };

std::optional<at::Tensor> bias_at(const c10::List<std::optional<at::Tensor>>& biases, int i) {
  std::optional<at::Tensor> b = biases.get(i);
  return b.has_value() && b->defined() ? b : std::nullopt;
}

// out [rows, out_features] = input @ W.T + bias, W packed in slabs (out_features from the caller: the
// slab count alone rounds it up to 48 columns).
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({input.size(0), out_features}, input.options());
  RECORD_FUNCTION("kvpage::packed_linear", std::vector<c10::IValue>());
  packed_linear(out, input, packed, bias);
  return out;
}

// residual + (input @ W.T + bias) as one pass of the linear's output stores (packed_linear_add): the same
// bits as the separate add, without another sweep over [rows, out_features] and its allocation.
at::Tensor linear_add(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      const at::Tensor& residual) {
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  RECORD_FUNCTION("kvpage::packed_linear", std::vector<c10::IValue>());
  packed_linear_add(out, input, packed, bias, residual);
  return out;
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double epsilon) {
  at::Tensor out = at::empty_like(x);
  RECORD_FUNCTION("kvpage::rms_norm", std::vector<c10::IValue>());
  rms_norm(out, x, weight, epsilon);
  return out;
}

}  // namespace

at::Tensor llama_decoder_layer(const at::Tensor& hidden, at::TensorList weights,
                               const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef widths,
                               at::ArrayRef<double> epsilons, double scale, const at::Tensor& cos,
                               const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               int64_t max_query_len, bool check_ranges, std::optional<int64_t> sliding_window,
                               std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(weights.size() == kNumWeights, "weights must be [input_norm, qkv, o, post_norm, gate_up, down]"
                    " (", int(kNumWeights), " tensors), got ", weights.size());
  TORCH_CHECK_VALUE(biases.size() == kNumBiases, "biases must be [qkv, o, gate_up, down] (", int(kNumBiases),
                    " optional tensors), got ", biases.size());
  TORCH_CHECK_VALUE(widths.size() == 5, "widths must be [q, k, v, head_size, intermediate], got ", widths);
  TORCH_CHECK_VALUE(epsilons.size() == 2, "epsilons must be [input_norm, post_norm], got ", epsilons.size());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
                    "hidden must be a contiguous float32 [tokens, hidden_size] tensor, got ", hidden.sizes(), " ",
                    hidden.scalar_type());
  const int64_t q_width = widths[0], k_width = widths[1], v_width = widths[2], d = widths[3];
  const int64_t intermediate = widths[4], tokens = hidden.size(0);
  TORCH_CHECK_VALUE(q_width > 0 && k_width > 0 && v_width > 0 && d > 0 && intermediate > 0 && q_width % d == 0 &&
                        k_width % d == 0 && v_width % d == 0,
                    "widths must be positive with q, k and v multiples of head_size, got ", widths);

  const at::Tensor h = norm(hidden, weights[kInputNorm], epsilons[0]);
  const at::Tensor qkv = linear(h, weights[kQKV], q_width + k_width + v_width, bias_at(biases, kQKVBias));
  const at::Tensor q = qkv.slice(1, 0, q_width).view({tokens, -1, d});
  const at::Tensor k = qkv.slice(1, q_width, q_width + k_width).view({tokens, -1, d});
  const at::Tensor v = qkv.slice(1, q_width + k_width).view({tokens, -1, d});
  at::Tensor q_rot = at::empty(q.sizes(), q.options()), k_rot = at::empty(k.sizes(), k.options());
  {
    RECORD_FUNCTION("kvpage::rotary_embedding", std::vector<c10::IValue>());
    rotary_embedding(q_rot, k_rot, q, k, cos, sin);
  }
  {
    RECORD_FUNCTION("kvpage::reshape_and_cache", std::vector<c10::IValue>());
    reshape_and_cache(k_rot, v, key_cache, value_cache, slot_mapping, check_ranges, 1.0, 1.0);
  }
  at::Tensor attn = at::empty(q.sizes(), q.options());
  if (max_query_len == 1) {  // one token per sequence: the decode kernel, which splits long contexts
    RECORD_FUNCTION("kvpage::paged_attention", std::vector<c10::IValue>());
    paged_attention(attn, q_rot, key_cache, value_cache, block_tables, seq_lens, scale, 0, check_ranges, 1.0, 1.0,
                    std::nullopt, sliding_window, softcap, sinks);
  } else {
    RECORD_FUNCTION("kvpage::paged_prefill_attention", std::vector<c10::IValue>());
    paged_prefill_attention(attn, q_rot, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                            check_ranges, 1.0, 1.0, std::nullopt, sliding_window, softcap, sinks);
  }
  const at::Tensor x = linear_add(attn.view({tokens, -1}), weights[kO], bias_at(biases, kOBias), hidden);

  const at::Tensor h2 = norm(x, weights[kPostNorm], epsilons[1]);
  const at::Tensor gate_up = linear(h2, weights[kGateUp], 2 * intermediate, bias_at(biases, kGateUpBias));
  at::Tensor act = at::empty({tokens, intermediate}, x.options());
  {
    RECORD_FUNCTION("kvpage::silu_and_mul", std::vector<c10::IValue>());
    silu_and_mul(act, gate_up.slice(1, 0, intermediate), gate_up.slice(1, intermediate));
  }
  return linear_add(act, weights[kDown], bias_at(biases, kDownBias), x);
}

}  // namespace cpu
}  // namespace kvpage
