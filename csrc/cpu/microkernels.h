// The two inner loops of paged attention, on fp32 tiles in L1:
//   scores:  S[r][t]  = q[r] . k[t]          (rows x tokens; k rows are contiguous in head_size)
//   values:  acc[r]  += sum_t p[r][t] v[t]   (rows x head_size)
// AVX2 builds get register-blocked kernels (3 rows x 4 tokens, 3 rows x 32 lanes), so each K or V
// vector loaded from L1 feeds several FMAs. AVX-512 builds run blocks of 4 rows through the same
// kernels at 16 lanes: the 32 vector registers hold 4 rows x 4 tokens of score accumulators, or 4
// rows x 64 lanes of output, so a Llama-3 GQA group of 4 (and prefill's many rows) reads each K/V
// vector once per 4 rows, and a 3-row rest (SmolLM2's group of 3) runs at 16 lanes too; 1-2 rows
// left keep 8 lanes (bench/attention_isa.py: 4-row blocks 1.15-1.28x Llama-3-8B decode, 1.17-1.30x
// prefill; 16-lane 3-row blocks 1.03-1.11x SmolLM2 decode on a Zen 5 VM, whose 512-bit FMAs are
// full width, where Zen 4's double-pumped ones measured 8 lanes as fast).
// Other builds get plain loops the compiler vectorises. AVX2 and AVX-512 builds score sets of a
// vector's lanes of rows or more (8 / 16) with attention_wide.h instead (rows across the lanes).
// Included inside the ISA namespace, after vec.h.
#pragma once

// The microkernels are inlined into attend_d, whose head size is often a constant.
#define KVPAGE_KERNEL_INLINE inline __attribute__((always_inline))
#define KVPAGE_KERNEL_LAMBDA __attribute__((always_inline))

#if defined(KVPAGE_VEC_AVX2)

inline float hsum(__m256 v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_shuffle_ps(y, y, 1)));
}

// Four horizontal sums at once: returns [sum(a), sum(b), sum(c), sum(d)].
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// A vector width for the kernels below: its register type and the handful of operations they use.
// fold() narrows a vector to 8 lanes (lane i + lane i + 8) for the horizontal sums.
struct Lanes8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static V widen(const T* p) { return load_widened8(p); }  // a K/V tile's fp32 / bf16 / fp16 elements
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  static V floor(V x) { return _mm256_floor_ps(x); }
  // y 2^n for whole-number n (within the exponent's range).
  static V times_pow2(V y, V n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  }
  static V zero_below(V x, float limit, V v) { return _mm256_and_ps(v, _mm256_cmp_ps(x, set1(limit), _CMP_GE_OQ)); }
  static __m256 fold(V v) { return v; }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static V widen(const T* p) { return load_widened16(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V floor(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V times_pow2(V y, V n) {
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  }
  static V zero_below(V x, float limit, V v) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(limit), _CMP_GE_OQ), v);
  }
  static __m256 fold(V v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
};
#endif

// vec.h's exp_nonpositive, a vector at a time: the same steps, so the same bits lane for lane.
template <typename L>
KVPAGE_KERNEL_INLINE
typename L::V exp_nonpositive_lanes(typename L::V x) {
  using V = typename L::V;
  const V clamped = L::max(x, L::set1(-87.0f));
  const V n = L::floor(L::fma(clamped, L::set1(1.44269504088896341f), L::set1(0.5f)));
  V r = L::fnma(n, L::set1(0.693359375f), clamped);
  r = L::fnma(n, L::set1(-2.12194440e-4f), r);
  V y = L::set1(1.9875691500e-4f);
  y = L::fma(y, r, L::set1(1.3981999507e-3f));
  y = L::fma(y, r, L::set1(8.3334519073e-3f));
  y = L::fma(y, r, L::set1(4.1665795894e-2f));
  y = L::fma(y, r, L::set1(1.6666665459e-1f));
  y = L::fma(y, r, L::set1(5.0000001201e-1f));
  y = L::fma(L::mul(y, r), r, L::add(r, L::set1(1.0f)));
  return L::zero_below(x, -87.0f, L::times_pow2(y, n));
}

inline __m256 exp_nonpositive8(__m256 x) { return exp_nonpositive_lanes<Lanes8>(x); }

// R rows x tokens t..t+3: R * 4 accumulators, each K vector feeds R FMAs (head_size a multiple of
// the width).
template <typename L, int R, typename KT>
KVPAGE_KERNEL_INLINE
void scores_rx4(const float* q, const KT* k, int64_t d, float* s, int64_t s_stride) {
  typename L::V a[R][4];
  for (auto& row : a)
    for (auto& x : row) x = L::zero();
  for (int64_t i = 0; i < d; i += L::kWidth) {
    typename L::V x[R];
    for (int r = 0; r < R; ++r) x[r] = L::load(q + r * d + i);
    for (int j = 0; j < 4; ++j) {
      const typename L::V kv = L::widen(k + j * d + i);
      for (int r = 0; r < R; ++r) a[r][j] = L::fma(x[r], kv, a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm_storeu_ps(s + r * s_stride, hsum4(L::fold(a[r][0]), L::fold(a[r][1]), L::fold(a[r][2]), L::fold(a[r][3])));
}

template <typename L, typename KT>
KVPAGE_KERNEL_INLINE
float score_1x1(const float* q, const KT* k, int64_t d) {
  typename L::V a = L::zero();
  for (int64_t i = 0; i < d; i += L::kWidth) a = L::fma(L::load(q + i), L::widen(k + i), a);
  return hsum(L::fold(a));
}

template <typename L, int R, typename KT>
KVPAGE_KERNEL_INLINE
void scores_rows(const float* q, const KT* k, int64_t n, int64_t d, float* s, int64_t s_stride) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) scores_rx4<L, R>(q, k + t * d, d, s + t, s_stride);
  for (; t < n; ++t)
    for (int r = 0; r < R; ++r) s[r * s_stride + t] = score_1x1<L>(q + r * d, k + t * d, d);
}

// Scores of rows [0, rows) (q stride d, s stride s_stride) against tokens [0, n) of k. With 8 lanes,
// three-row blocks fit GQA groups of 3 and keep 12 accumulators + 3 queries + 1 key in the 16
// registers; four rows go as 2 + 2 rather than 3 + 1, so no row runs alone. AVX-512 takes 4-row
// blocks, then a 3-row rest, at 16 lanes (32 registers).
// KT: the K tile's element type (float, or a 16-bit cache's Bf16Bits / HalfBits read in place).
template <typename KT>
KVPAGE_KERNEL_INLINE
void block_scores(const float* q, int64_t rows, const KT* k, int64_t n, int64_t d, float* s,
                  int64_t s_stride) {
  int64_t r = 0;
#if defined(__AVX512F__)
  for (; rows - r >= 4; r += 4) scores_rows<Lanes16, 4>(q + r * d, k, n, d, s + r * s_stride, s_stride);
  if (rows - r == 3) return scores_rows<Lanes16, 3>(q + r * d, k, n, d, s + r * s_stride, s_stride);
#endif
  for (; rows - r >= 3 && rows - r != 4; r += 3)
    scores_rows<Lanes8, 3>(q + r * d, k, n, d, s + r * s_stride, s_stride);
  for (; rows - r >= 2; r += 2) scores_rows<Lanes8, 2>(q + r * d, k, n, d, s + r * s_stride, s_stride);
  if (r < rows) scores_rows<Lanes8, 1>(q + r * d, k, n, d, s + r * s_stride, s_stride);
}

// Walks tokens [0, n) of a run of K/V tiles (tile_tokens rows of d elements each, the last may be
// short): body(row, t) gets token t's row from element `offset` on.
template <typename VT, typename Body>
KVPAGE_KERNEL_INLINE
void for_each_tile_token(const VT* const* tiles, int64_t tile_tokens, int64_t n, int64_t d, int64_t offset,
                         const Body& body) {
  for (int64_t t0 = 0, tile = 0; t0 < n; t0 += tile_tokens, ++tile) {
    const VT* x = tiles[tile] + offset;
    const int64_t nb = imin(tile_tokens, n - t0);
    for (int64_t t = 0; t < nb; ++t) body(x + t * d, t0 + t);
  }
}

// acc[r][i..i+N*W) += sum_t p[r][t] v[t][i..i+N*W) for R rows, N vectors of W lanes in registers;
// p[r][t] sits at p[r * p_stride + t * t_stride] (scores by row, or attention_wide.h's by token).
// Tokens [0, n) lie in tiles of tile_tokens rows each (the last may be short): the accumulators
// stay in registers across them all.
template <typename L, int R, int N, typename VT>
KVPAGE_KERNEL_INLINE
void values_tile(float* acc, int64_t d, const float* p, int64_t p_stride, int64_t t_stride,
                 const VT* const* tiles, int64_t tile_tokens, int64_t n, int64_t i) {
  constexpr int W = L::kWidth;
  typename L::V a[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) a[r][j] = L::load(acc + r * d + i + W * j);
  for_each_tile_token(tiles, tile_tokens, n, d, i, [&](const VT* v, int64_t t) KVPAGE_KERNEL_LAMBDA {
    typename L::V w[R];
    for (int r = 0; r < R; ++r) w[r] = L::set1(p[r * p_stride + t * t_stride]);
    for (int j = 0; j < N; ++j) {
      const typename L::V x = L::widen(v + W * j);
      for (int r = 0; r < R; ++r) a[r][j] = L::fma(w[r], x, a[r][j]);
    }
  });
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) L::store(acc + r * d + i + W * j, a[r][j]);
}

template <typename L, int R, typename VT>
KVPAGE_KERNEL_INLINE
void values_rows(float* acc, int64_t d, const float* p, int64_t p_stride, int64_t t_stride,
                 const VT* const* tiles, int64_t tile_tokens, int64_t n) {
  constexpr int W = L::kWidth;
  int64_t i = 0;
  for (; i + 4 * W <= d; i += 4 * W) values_tile<L, R, 4>(acc, d, p, p_stride, t_stride, tiles, tile_tokens, n, i);
  for (; i + 2 * W <= d; i += 2 * W) values_tile<L, R, 2>(acc, d, p, p_stride, t_stride, tiles, tile_tokens, n, i);
  for (; i < d; i += W) values_tile<L, R, 1>(acc, d, p, p_stride, t_stride, tiles, tile_tokens, n, i);
}

// block_values over tokens [0, n) spread over tiles of tile_tokens rows (see values_tile).
template <typename VT>
KVPAGE_KERNEL_INLINE
void block_values_tiles(float* acc, int64_t rows, int64_t d, const float* p, int64_t p_stride, int64_t t_stride,
                        const VT* const* tiles, int64_t tile_tokens, int64_t n) {
  int64_t r = 0;
#if defined(__AVX512F__)
  for (; rows - r >= 4; r += 4)
    values_rows<Lanes16, 4>(acc + r * d, d, p + r * p_stride, p_stride, t_stride, tiles, tile_tokens, n);
  if (rows - r == 3)
    return values_rows<Lanes16, 3>(acc + r * d, d, p + r * p_stride, p_stride, t_stride, tiles, tile_tokens, n);
#endif
  for (; rows - r >= 3 && rows - r != 4; r += 3)
    values_rows<Lanes8, 3>(acc + r * d, d, p + r * p_stride, p_stride, t_stride, tiles, tile_tokens, n);
  for (; rows - r >= 2; r += 2)
    values_rows<Lanes8, 2>(acc + r * d, d, p + r * p_stride, p_stride, t_stride, tiles, tile_tokens, n);
  if (r < rows) values_rows<Lanes8, 1>(acc + r * d, d, p + r * p_stride, p_stride, t_stride, tiles, tile_tokens, n);
}

// acc[r] += sum_t p[r][t] v[t] over one tile v of n tokens.
template <typename VT>
KVPAGE_KERNEL_INLINE
void block_values(float* acc, int64_t rows, int64_t d, const float* p, int64_t p_stride, int64_t t_stride,
                  const VT* v, int64_t n) {
  block_values_tiles(acc, rows, d, p, p_stride, t_stride, &v, n, n);
}

inline float row_max(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  float mx = _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
  for (; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
  return mx;
}

// s[t] = exp(s[t] - m); returns the sum.
inline float exp_and_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, p);
    acc = _mm256_add_ps(acc, p);
  }
  float sum = hsum(acc);
  for (; t < n; ++t) sum += (s[t] = exp_nonpositive(s[t] - m));
  return sum;
}

#else  // portable loops

inline float row_max(const float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
  return mx;
}

inline float exp_and_sum(float* s, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += (s[t] = exp_nonpositive(s[t] - m));
  return sum;
}

KVPAGE_KERNEL_INLINE
void block_scores(const float* q, int64_t rows, const float* k, int64_t n, int64_t d, float* s,
                  int64_t s_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < n; ++t) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += q[r * d + i] * k[t * d + i];
      s[r * s_stride + t] = sum;
    }
  }
}

KVPAGE_KERNEL_INLINE
void block_values(float* acc, int64_t rows, int64_t d, const float* p, int64_t p_stride, int64_t t_stride,
                  const float* v, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < n; ++t) {
      const float w = p[r * p_stride + t * t_stride];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[r * d + i] += w * v[t * d + i];
    }
  }
}

#endif
