// CPU glue for the model's small layers and greedy sampling (row kernels in layers_impl.h):
// fp32 rows, any row stride, contiguous within a row; rows split over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "../ops.h"
#include "dispatch.h"

namespace kvpage {
namespace cpu {
namespace {

// [rows, n] view of a tensor whose last dimension is contiguous.
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.stride(-1) == 1, name,
                    " must have a contiguous last dimension, got strides ", t.strides());
  TORCH_CHECK_VALUE(t.dim() == 1 || t.dim() == 2 || t.is_contiguous(), name,
                    " must be 1-D, 2-D or contiguous, got shape ", t.sizes(), " strides ", t.strides());
}

int64_t num_rows(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.numel() / t.size(-1); }
int64_t row_stride(const at::Tensor& t) { return t.dim() == 2 ? t.stride(0) : t.size(-1); }

// Enough elements per task that a thread fork pays off (~16k floats).
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

void check_same_shape(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK_VALUE(a.sizes() == b.sizes(), a_name, " and ", b_name, " must have the same shape, got ",
                    a.sizes(), " and ", b.sizes());
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_rows(out, "out");
  check_rows(input, "input");
  check_rows(weight, "weight");
  check_same_shape(out, "out", input, "input");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == input.size(-1), "weight must be 1-D of size ",
                    input.size(-1), " (input's last dimension), got shape ", weight.sizes());
  TORCH_CHECK_VALUE(epsilon >= 0, "epsilon must be >= 0, got ", epsilon);
  const int64_t n = input.size(-1), in_stride = row_stride(input), out_stride = row_stride(out);
  const float* x = input.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const auto row = active_kernels().rms_norm_row;
  at::parallel_for(0, num_rows(input), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(y + r * out_stride, x + r * in_stride, w, n, float(epsilon));
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  check_rows(out, "out");
  check_rows(gate, "gate");
  check_rows(up, "up");
  check_same_shape(gate, "gate", up, "up");
  check_same_shape(out, "out", gate, "gate");
  const int64_t n = gate.size(-1);
  const int64_t g_stride = row_stride(gate), u_stride = row_stride(up), o_stride = row_stride(out);
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const auto row = active_kernels().silu_and_mul_row;
  at::parallel_for(0, num_rows(gate), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(y + r * o_stride, g + r * g_stride, u + r * u_stride, n);
  });
}

namespace {

// [tokens, heads, d] with a contiguous last dimension (any token and head strides).
void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t d) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == tokens && t.size(2) == d && t.stride(2) == 1, name,
                    " must be [", tokens, ", heads, ", d, "] with a contiguous last dimension, got shape ",
                    t.sizes(), " strides ", t.strides());
}

}  // namespace

void rotary_embedding(at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(1) % 2 == 0, "cos must be [tokens, head_size] with an even head_size,"
                    " got shape ", cos.sizes());
  check_same_shape(sin, "sin", cos, "cos");
  const int64_t tokens = cos.size(0), d = cos.size(1);
  check_heads(query, "query", tokens, d);
  check_heads(key, "key", tokens, d);
  check_heads(query_out, "query_out", tokens, d);
  check_heads(key_out, "key_out", tokens, d);
  check_same_shape(query_out, "query_out", query, "query");
  check_same_shape(key_out, "key_out", key, "key");
  struct Heads {  // one of query/key: where its rows are read and written
    const float* in;
    float* out;
    int64_t heads, in_token, in_head, out_token, out_head;
  };
  const Heads sets[2] = {
      {query.data_ptr<float>(), query_out.data_ptr<float>(), query.size(1), query.stride(0), query.stride(1),
       query_out.stride(0), query_out.stride(1)},
      {key.data_ptr<float>(), key_out.data_ptr<float>(), key.size(1), key.stride(0), key.stride(1),
       key_out.stride(0), key_out.stride(1)}};
  const auto row = active_kernels().rotary_row;
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t c_stride = cos.stride(0), s_stride = sin.stride(0);
  at::parallel_for(0, tokens, row_grain((query.size(1) + key.size(1)) * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (const Heads& x : sets)
        for (int64_t h = 0; h < x.heads; ++h)
          row(x.out + t * x.out_token + h * x.out_head, x.in + t * x.in_token + h * x.in_head, c + t * c_stride,
              s + t * s_stride, d);
  });
}

void greedy_sample(at::Tensor& tokens, at::Tensor& logprobs, const at::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) > 0, "logits must be [num_rows, vocab_size > 0], got ",
                    logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kLong, "tokens must be int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.device().is_cpu() && tokens.dim() == 1 && tokens.size(0) == rows && tokens.is_contiguous(),
                    "tokens must be a contiguous CPU tensor of shape [", rows, "], got ", tokens.sizes());
  check_rows(logprobs, "logprobs");
  TORCH_CHECK_VALUE(logprobs.dim() == 1 && logprobs.size(0) == rows, "logprobs must have shape [", rows,
                    "], got ", logprobs.sizes());
  const float* x = logits.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  const auto row = active_kernels().greedy_row;
  at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(x + r * logits.stride(0), vocab, tok + r, lp + r);
  });
}

}  // namespace cpu
}  // namespace kvpage
