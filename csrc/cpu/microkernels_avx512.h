// block_scores / block_values for the AVX-512 build (included by microkernels.h in place of the
// 8-lane ones). Rows go four at a time through 16-lane kernels: the 32 vector registers hold 4 rows
// x 4 tokens of score accumulators, or 4 rows x 64 lanes of output, so a Llama-3 GQA group of 4
// (and prefill's many rows) reads each K/V vector once per 4 rows. Leftover rows (SmolLM2's group of
// 3) keep the 8-lane kernels, which were as fast there in a paired A/B; 4-row blocks were 1.19x
// (Llama-3-8B decode) and 1.10-1.31x (prefill) faster than the 8-lane 2 + 2 split.
#pragma once

// 16 lanes folded to 8 (lane i + lane i + 8).
inline __m256 fold_x16(__m512 x) { return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1)); }

// Sums of four 16-lane vectors: [sum(a), sum(b), sum(c), sum(d)].
inline __m128 hsum4_x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  return hsum4(fold_x16(a), fold_x16(b), fold_x16(c), fold_x16(d));
}

// R rows x tokens t..t+3 (head_size a multiple of 16).
template <int R>
inline void scores_rx4_x16(const float* q, const float* k, int64_t d, float* s, int64_t s_stride) {
  __m512 a[R][4];
  for (auto& row : a)
    for (auto& x : row) x = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    __m512 x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_ps(q + r * d + i);
    for (int j = 0; j < 4; ++j) {
      const __m512 kv = _mm512_loadu_ps(k + j * d + i);
      for (int r = 0; r < R; ++r) a[r][j] = _mm512_fmadd_ps(x[r], kv, a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm_storeu_ps(s + r * s_stride, hsum4_x16(a[r][0], a[r][1], a[r][2], a[r][3]));
}

inline float score_1x1_x16(const float* q, const float* k, int64_t d) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a);
  return hsum(fold_x16(a));
}

template <int R>
inline void scores_rows_x16(const float* q, const float* k, int64_t n, int64_t d, float* s, int64_t s_stride) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) scores_rx4_x16<R>(q, k + t * d, d, s + t, s_stride);
  for (; t < n; ++t)
    for (int r = 0; r < R; ++r) s[r * s_stride + t] = score_1x1_x16(q + r * d, k + t * d, d);
}

// Rows in blocks of 4, then the 8-lane kernels for the 1-3 left.
inline void block_scores(const float* q, int64_t rows, const float* k, int64_t n, int64_t d, float* s,
                         int64_t s_stride) {
  int64_t r = 0;
  for (; rows - r >= 4; r += 4) scores_rows_x16<4>(q + r * d, k, n, d, s + r * s_stride, s_stride);
  if (rows - r == 3) scores_rows<3>(q + r * d, k, n, d, s + r * s_stride, s_stride), r += 3;
  if (rows - r == 2) scores_rows<2>(q + r * d, k, n, d, s + r * s_stride, s_stride), r += 2;
  if (rows - r == 1) scores_rows<1>(q + r * d, k, n, d, s + r * s_stride, s_stride);
}

// acc[r][i..i+16L) += sum_t p[r][t] v[t][i..i+16L) for R rows.
template <int R, int L>
inline void values_tile_x16(float* acc, int64_t d, const float* p, int64_t p_stride, const float* v, int64_t n,
                            int64_t i) {
  __m512 a[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) a[r][j] = _mm512_loadu_ps(acc + r * d + i + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    __m512 w[R];
    for (int r = 0; r < R; ++r) w[r] = _mm512_set1_ps(p[r * p_stride + t]);
    for (int j = 0; j < L; ++j) {
      const __m512 x = _mm512_loadu_ps(v + t * d + i + 16 * j);
      for (int r = 0; r < R; ++r) a[r][j] = _mm512_fmadd_ps(w[r], x, a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) _mm512_storeu_ps(acc + r * d + i + 16 * j, a[r][j]);
}

template <int R>
inline void values_rows_x16(float* acc, int64_t d, const float* p, int64_t p_stride, const float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= d; i += 64) values_tile_x16<R, 4>(acc, d, p, p_stride, v, n, i);
  for (; i + 32 <= d; i += 32) values_tile_x16<R, 2>(acc, d, p, p_stride, v, n, i);
  for (; i < d; i += 16) values_tile_x16<R, 1>(acc, d, p, p_stride, v, n, i);
}

inline void block_values(float* acc, int64_t rows, int64_t d, const float* p, int64_t p_stride, const float* v,
                         int64_t n) {
  int64_t r = 0;
  for (; rows - r >= 4; r += 4) values_rows_x16<4>(acc + r * d, d, p + r * p_stride, p_stride, v, n);
  if (rows - r == 3) values_rows<3>(acc + r * d, d, p + r * p_stride, p_stride, v, n), r += 3;
  if (rows - r == 2) values_rows<2>(acc + r * d, d, p + r * p_stride, p_stride, v, n), r += 2;
  if (rows - r == 1) values_rows<1>(acc + r * d, d, p + r * p_stride, p_stride, v, n);
}
