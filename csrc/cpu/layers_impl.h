// Row kernels for the model's small per-token layers (RMSNorm, SiLU-and-multiply, rotary) and greedy
// sampling, compiled once per ISA like attention_impl.h. Each replaces a chain of several torch
// ops, each a pass over the activations plus a dispatch and a thread fork, with one pass.
// Included by isa_impl.h inside the ISA's anonymous namespace, after vec.h and microkernels.h.
#pragma once

// out = weight * x / sqrt(mean(x^2) + eps), as HF's LlamaRMSNorm in fp32.
void rms_norm_row(float* out, const float* x, const float* weight, int64_t n, float eps) {
  float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum_sq / float(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

// out = silu(gate) * up, silu(g) = g * sigmoid(g); sigmoid from exp(-|g|) so exp never overflows.
void silu_and_mul_row(float* out, const float* gate, const float* up, int64_t n) {
  int64_t i = 0;
#if defined(KVPAGE_VEC_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 num = _mm256_blendv_ps(one, e, g);             // g < 0: e, else 1
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i], e = exp_nonpositive(-std::fabs(g));
    out[i] = g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * up[i];
  }
}

// Rotary position embedding of one head, HF's rotate-half form: out = x * cos + rotate_half(x) * sin,
// rotate_half(x) = [-x2, x1] for halves x1, x2 of head_size d. Products and sum stay separate (as
// torch computes them: no fused multiply-add), so the result matches HF's to the bit.
__attribute__((optimize("fp-contract=off"))) void rotary_row(float* out, const float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
#pragma omp simd
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// The first index of the row's maximum (torch.argmax's tie rule), and its log-softmax value.
void greedy_row(const float* logits, int64_t n, int64_t* token, float* logprob) {
  const float best = row_max(logits, n);  // vectorised; then the first position holding it
  // The sum is a double, fed by float partial sums of at most kBlock terms: one float running sum
  // over a 150k-entry vocabulary drifts by ~1e-4 in the log-probability, these stay ~1e-7 from
  // torch's logsumexp.
  double sum = 0.0;
  bool has_nan = false;  // the vector max and exp drop NaNs, so they are looked for on the way
  int64_t i = 0;
#if defined(KVPAGE_VEC_AVX2)
  constexpr int64_t kBlock = 2048;
  const __m256 mv = _mm256_set1_ps(best);
  __m256 nan = _mm256_setzero_ps();
  while (i + 8 <= n) {
    __m256 acc = _mm256_setzero_ps();
    for (const int64_t end = std::min(n, i + kBlock); i + 8 <= end; i += 8) {
      const __m256 x = _mm256_loadu_ps(logits + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      acc = _mm256_add_ps(acc, exp_nonpositive8(_mm256_sub_ps(x, mv)));
    }
    sum += hsum(acc);
  }
  has_nan = _mm256_movemask_ps(nan) != 0;
#endif
  for (; i < n; ++i) {
    has_nan |= std::isnan(logits[i]);
    sum += exp_nonpositive(logits[i] - best);
  }
  int64_t best_i = 0;
  while (best_i < n && !(logits[best_i] == best)) ++best_i;
  if (best_i == n || has_nan || std::isnan(best)) {  // a NaN in the row: torch.argmax ranks NaN above everything
    best_i = 0;
    while (best_i < n && !std::isnan(logits[best_i])) ++best_i;
    *token = best_i < n ? best_i : 0;
    *logprob = NAN;
    return;
  }
  *token = best_i;
  *logprob = float(-std::log(sum));  // log-softmax at the max: logits[best_i] - best - log(sum)
}
