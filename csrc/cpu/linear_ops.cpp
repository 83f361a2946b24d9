// CPU glue for the packed linear layer (kernel in gemm_impl.h): weights packed once into 48-column
// slabs (fp32, or bf16 / fp16 storage), then y = x @ W.T + bias with the slabs split over torch's
// threads in contiguous runs, so each thread streams its share of the weight front to back (once per
// block of rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "../ops.h"
#include "dispatch.h"

namespace kvpage {
namespace cpu {
namespace {

// A prefill's rows go in even blocks of at most this many: each thread sweeps its slabs once per block,
// so the block's input stays in L2 however long the prompt. Row blocks of 32..128 and none at all measured
// alike up to 2048 rows on a 2-core EPYC VM (L3 holds a 2048-row input there): this bounds the worst case.
constexpr int64_t kRowBlock = 128;

int64_t num_slabs(int64_t n) { return (n + kSlabColumns - 1) / kSlabColumns; }

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

// A packed weight's element type: fp32, or bf16 / fp16 storage that the kernels widen to fp32.
DType check_packed(const at::Tensor& packed) {
  const at::ScalarType t = packed.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
                   "packed must be float32, bfloat16 or float16, got ", t);
  TORCH_CHECK_VALUE(packed.device().is_cpu(), "packed must be a CPU tensor, got ", packed.device());
  TORCH_CHECK_VALUE(packed.is_contiguous(), "packed must be contiguous, got strides ", packed.strides());
  return t == at::kFloat ? DType::kFloat : t == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
}

// Pair-interleaved bf16 slabs [slabs, ceil(k / 2), 48, 2] for bf16 dot products (gemm_impl.h).
bool is_pair_layout(const at::Tensor& packed) { return packed.dim() == 4; }

void pack_bf16_pairs(at::Tensor& packed, const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1), slabs = num_slabs(n), pairs = (k + 1) / 2;
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kBFloat16 && packed.size(0) == slabs && packed.size(1) == pairs &&
                        packed.size(2) == kSlabColumns && packed.size(3) == 2,
                    "packed must be a bfloat16 [", slabs, ", ", pairs, ", ", kSlabColumns, ", 2] tensor for bf16 dot"
                    " products, got ", packed.scalar_type(), " ", packed.sizes());
  at::Tensor padded = at::zeros({slabs * kSlabColumns, 2 * pairs}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  packed.copy_(padded.view({slabs, kSlabColumns, pairs, 2}).permute({0, 2, 1, 3}));  // rounds to nearest even
}

}  // namespace

bool bf16_dot_available() {
  return active_kernels().linear_slabs_bf16_pairs != nullptr && __builtin_cpu_supports("avx512bf16");
}

void pack_linear_weight(at::Tensor& packed, const at::Tensor& weight) {
  check_float_cpu(weight, "weight");
  const DType weight_dtype = check_packed(packed);
  if (is_pair_layout(packed)) {
    TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0,
                      "weight must be a non-empty [out_features, in_features] matrix, got shape ", weight.sizes());
    return pack_bf16_pairs(packed, weight);
  }
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0,
                    "weight must be a non-empty [out_features, in_features] matrix, got shape ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(0) == num_slabs(n) && packed.size(1) == k &&
                        packed.size(2) == kSlabColumns,
                    "packed must have shape [", num_slabs(n), ", ", k, ", ", kSlabColumns, "], got ", packed.sizes());
  const auto pack = active_kernels().pack_linear_slabs;
  // 16-bit slabs: packed in fp32, then rounded to nearest even by torch's own conversion, so a
  // slab element is exactly weight.to(packed.dtype) of its weight.
  at::Tensor staging = weight_dtype == DType::kFloat ? packed : at::empty(packed.sizes(), weight.options());
  const float* w = weight.data_ptr<float>();
  float* p = staging.data_ptr<float>();
  at::parallel_for(0, num_slabs(n), 1, [&](int64_t begin, int64_t end) { pack(w, n, k, p, begin, end); });
  if (weight_dtype != DType::kFloat) packed.copy_(staging);
}

namespace {

void packed_linear_impl(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed,
                        const std::optional<at::Tensor>& bias, const float* residual) {
  check_float_cpu(input, "input");
  const DType weight_dtype = check_packed(packed);
  check_float_cpu(out, "out");
  const bool pairs = is_pair_layout(packed);
  if (pairs) {
    TORCH_CHECK_VALUE(packed.scalar_type() == at::kBFloat16 && packed.size(2) == kSlabColumns && packed.size(3) == 2,
                      "packed must be a bfloat16 [slabs, in_features / 2, ", kSlabColumns, ", 2] tensor for bf16 dot"
                      " products, got ", packed.scalar_type(), " ", packed.sizes());
    TORCH_CHECK_VALUE(input.dim() == 2 && (input.size(1) + 1) / 2 == packed.size(1), "input must be [rows, ",
                      2 * packed.size(1) - 1, " or ", 2 * packed.size(1), "] (in_features of packed), got shape ",
                      input.sizes());
    TORCH_CHECK_VALUE(bf16_dot_available(), "packed: bf16 dot-product slabs need a CPU with AVX512-BF16 (and the"
                      " avx512 kernels active)");
  } else {
    TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == kSlabColumns,
                      "packed must be [slabs, in_features, ", kSlabColumns, "] from pack_linear_weight, got shape ",
                      packed.sizes());
    TORCH_CHECK_VALUE(input.dim() == 2 && input.size(1) == packed.size(1), "input must be [rows, ", packed.size(1),
                      "] (in_features of packed), got shape ", input.sizes());
  }
  const int64_t k = input.size(1);
  const int64_t m = input.size(0);
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == m && num_slabs(out.size(1)) == packed.size(0),
                    "out must be [", m, ", out_features] with ", packed.size(0), " slabs of ", kSlabColumns,
                    " columns, got shape ", out.sizes());
  const int64_t n = out.size(1);
  if (bias.has_value()) {
    check_float_cpu(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "bias must have shape [", n, "], got ",
                      bias->sizes());
  }
  if (m == 0) return;
  LinearArgs a{input.data_ptr<float>(), packed.data_ptr(),
               bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), m, n, k, weight_dtype};
  a.residual = residual;
  const KernelTable& kernels = active_kernels();
  auto slabs = kernels.linear_slabs;
  at::Tensor x_bf16;  // bf16 dot products: the input rounded once per call, not once per slab
  const int64_t pair_count = (k + 1) / 2;
  if (pairs) {
    x_bf16 = at::empty({m, 2 * pair_count}, input.options().dtype(at::kBFloat16));
    uint16_t* rounded = reinterpret_cast<uint16_t*>(x_bf16.data_ptr());
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      kernels.round_rows_to_bf16(a.x + begin * k, end - begin, k, rounded + begin * 2 * pair_count);
    });
    a.x_pairs = reinterpret_cast<const uint32_t*>(rounded);
    slabs = kernels.linear_slabs_bf16_pairs;
  }
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  // One contiguous range of slabs per thread, not runs from a shared counter (dispatch.h parallel_runs):
  // a thread then prefetches its next slab all the way (linear_slabs_of), which runs of one or two slabs
  // cut short; the counter measured 3-40% slower at M = 1 and 13-25% at M = 64 (bench/linear.py shapes,
  // 3 alternating rounds, loaded 2-vCPU Xeon, OMP_WAIT_POLICY=passive).
  at::parallel_for(0, num_slabs(n), 1, [&](int64_t begin, int64_t end) {
    int64_t row = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t rows = (m - row) / (blocks - b);
      LinearArgs block = a;
      block.x += row * k;
      if (pairs) block.x_pairs += row * pair_count;
      block.y += row * n;
      if (block.residual) block.residual += row * n;
      block.m = rows;
      slabs(block, begin, end);
      row += rows;
    }
  });
}

}  // namespace

void packed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed,
                   const std::optional<at::Tensor>& bias) {
  packed_linear_impl(out, input, packed, bias, nullptr);
}

void packed_linear_add(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, const at::Tensor& residual) {
  check_float_cpu(residual, "residual");
  TORCH_CHECK_VALUE(residual.sizes() == out.sizes(), "residual must have out's shape ", out.sizes(), ", got ",
                    residual.sizes());
  packed_linear_impl(out, input, packed, bias, residual.data_ptr<float>());
}

}  // namespace cpu
}  // namespace kvpage
