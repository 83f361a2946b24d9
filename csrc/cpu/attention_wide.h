// Attention for many query rows at once (prefill tiles, wide GQA groups): the rows go across the
// vector lanes, 8 on AVX2, 16 on AVX-512. Queries are transposed once per work item (qT
// [head_size][rp], rp = rows rounded up to the lanes), so a score is FMAs of a broadcast key element
// with a vector of rows' query elements, and the scores land by token (scoreT [token][rp]) without a
// horizontal sum (row-by-row dot products, microkernels.h, ran at about half the FMA peak in L1 on
// AVX2, held back by those sums; at 16 lanes a head of 64 leaves each sum only 4 FMAs). The online
// softmax then runs a vector of rows at a time, its chunk max gathered while the scores are still in
// registers. Values keep the rows across the lanes too: the accumulators are transposed ([head_size]
// [rp]), so p loads as vectors by token and each value element is a broadcast, with no per-row
// rescale pass (alpha rides on the accumulators' loads), and go back to rows once per item. (Rows by
// 4-row blocks, block_values_tiles, left the values at ~60% of the FMA peak on a long prefill.)
// Included by attention_impl.h inside the ISA namespace, after RowScores, the layout it mirrors.
#pragma once

#if defined(KVPAGE_VEC_AVX2)
#define KVPAGE_WIDE_ATTENTION 1

#if defined(__AVX512F__)
using WideLanes = Lanes16;
#else
using WideLanes = Lanes8;
#endif
static_assert(WideLanes::kWidth == kRowLanes, "the row padding is one vector of the wide path's lanes");

// Row sets of a vector's lanes or more take the wide path; prefill tiles of more than one token
// from half of them on (a SmolLM2 prompt's last tile of 4 tokens x 3 heads: its 12 rows at 16 lanes
// ran faster than in 4-row blocks), where decode's GQA groups keep the row kernels (their K/V reads,
// not the math, set their pace).
constexpr int64_t kWideRows = WideLanes::kWidth;
inline bool takes_wide_path(const RowSet& rs) {
  return rs.rows >= kWideRows || (rs.rows >= kWideRows / 2 && rs.rows > rs.group);
}
// Tokens per pass for the last one or two row vectors (wide_scores).
constexpr int kWideOnesTokens = WideLanes::kWidth == 16 ? 8 : 4;

// The wide layout's scores are in base 2: log2 e rides in its transposed queries, the max it keeps goes
// back to base e (ln 2) once the item is done, for the callers' log-sum-exp and sinks.
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
// wide_exp2's floor: e^x's -87 (vec.h) in base 2, whole (no denormal probabilities to slow the values).
constexpr float kWideExp2Floor = -125.0f;

#if defined(__AVX512F__)
// dst[j][i] = src[i][j] * factor for one 16 x 16 block (rows ss and ds floats apart): four rounds of
// shuffles, a quarter of an operation per element where copying element by element takes two (an
// item's two transposes, its queries in and its accumulators out, were ~2% of a long prefill).
inline void transpose16x16(const float* src, int64_t ss, float* dst, int64_t ds, float factor) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved by element
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then by pairs of elements
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // then 128-bit lanes, twice
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
  const __m512 f = _mm512_set1_ps(factor);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ds, _mm512_mul_ps(r[i], f));
}
#endif

// dst[j][i] = src[i][j] * factor for i < rows, j < cols (rows ss and ds floats apart), by 16 x 16
// blocks where both are whole blocks of them.
inline void transpose_scaled(const float* src, int64_t ss, int64_t rows, int64_t cols, float* dst, int64_t ds,
                             float factor) {
#if defined(__AVX512F__)
  if (rows % 16 == 0 && cols % 16 == 0) {
    for (int64_t i = 0; i < rows; i += 16)
      for (int64_t j = 0; j < cols; j += 16) transpose16x16(src + i * ss + j, ss, dst + j * ds + i, ds, factor);
    return;
  }
#endif
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = 0; i < rows; ++i) dst[j * ds + i] = src[i * ss + j] * factor;
}

// qT[i][r] = q[r][i] * factor, padding rows [rows, rp) zero (q has room for rp rows).
inline void transpose_queries(float* q, int64_t rows, int64_t d, float* qT, int64_t rp, float factor) {
  std::memset(q + rows * d, 0, sizeof(float) * (rp - rows) * d);
  transpose_scaled(q, d, rp, d, qT, rp, factor);
}

// scoreT[t][W v..W v + W) = k[t] . q[W v..W v + W) for T tokens and V row vectors of W lanes: T * V
// accumulators, each query vector feeding T FMAs and each broadcast key element V. kMax: also fold
// the tile's scores into cmax (the chunk's running max per row), while they are still in registers.
template <typename L, int T, int V, bool kMax>
KVPAGE_KERNEL_INLINE
void wide_scores_tile(const float* qT, int64_t rp, const float* k, int64_t d, float* sT, float* cmax) {
  constexpr int W = L::kWidth;
  typename L::V a[T][V];
  for (auto& row : a)
    for (auto& x : row) x = L::zero();
  for (int64_t i = 0; i < d; ++i) {
    typename L::V q[V];
    for (int v = 0; v < V; ++v) q[v] = L::load(qT + i * rp + W * v);
    for (int t = 0; t < T; ++t) {
      const typename L::V kb = L::set1(k[t * d + i]);
      for (int v = 0; v < V; ++v) a[t][v] = L::fma(kb, q[v], a[t][v]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) L::store(sT + t * rp + W * v, a[t][v]);
  if constexpr (kMax) {
    for (int v = 0; v < V; ++v) {
      typename L::V mx = L::load(cmax + W * v);
      for (int t = 0; t < T; ++t) mx = L::max(mx, a[t][v]);
      L::store(cmax + W * v, mx);
    }
  }
}

// T tokens at a time (then ones) against V row vectors.
template <typename L, int T, int V, bool kMax>
KVPAGE_KERNEL_INLINE
void wide_scores_rows(const float* qT, int64_t rp, const float* k, int64_t n, int64_t d, float* sT, float* cmax) {
  int64_t t = 0;
  for (; t + T <= n; t += T) wide_scores_tile<L, T, V, kMax>(qT, rp, k + t * d, d, sT + t * rp, cmax);
  if constexpr (T > 4) {
    if (t + 4 <= n) wide_scores_tile<L, 4, V, kMax>(qT, rp, k + t * d, d, sT + t * rp, cmax), t += 4;
  }
  for (; t < n; ++t) wide_scores_tile<L, 1, V, kMax>(qT, rp, k + t * d, d, sT + t * rp, cmax);
}

// Row vectors per pass, by the vectors left, and tokens per pass: AVX-512's 32 registers take fours
// x 6 tokens (24 accumulators, 10 loads per 24 FMAs; the broadcasts ride in the FMAs' memory operands;
// a block of 16 goes 6 + 6 + 4), threes x 4, twos and ones x 8 (token counts that divide the usual
// block sizes); AVX2's 16 take fours x 3 or threes x 4 (12 accumulators, 7 loads per 12 FMAs), the
// last one or two x 4.
template <bool kMax>
KVPAGE_KERNEL_INLINE
void wide_scores(const float* qT, int64_t rp, const float* k, int64_t n, int64_t d, float* sT, float* cmax) {
  using L = WideLanes;
  const int64_t vectors = rp / L::kWidth;
  for (int64_t v = 0; v < vectors;) {
    const int64_t left = vectors - v;
    float* out = sT + L::kWidth * v;
    float* mx = cmax + L::kWidth * v;
    const float* q = qT + L::kWidth * v;
#if defined(__AVX512F__)
    if (left >= 4) {
      wide_scores_rows<L, 6, 4, kMax>(q, rp, k, n, d, out, mx), v += 4;
    } else if (left == 3) {
      wide_scores_rows<L, 4, 3, kMax>(q, rp, k, n, d, out, mx), v += 3;
#else
    if (left >= 4 && left != 5 && left != 6) {
      wide_scores_rows<L, 3, 4, kMax>(q, rp, k, n, d, out, mx), v += 4;
    } else if (left >= 3) {
      wide_scores_rows<L, 4, 3, kMax>(q, rp, k, n, d, out, mx), v += 3;
#endif
    } else if (left == 2) {
      wide_scores_rows<L, kWideOnesTokens, 2, kMax>(q, rp, k, n, d, out, mx), v += 2;
    } else {
      wide_scores_rows<L, kWideOnesTokens, 1, kMax>(q, rp, k, n, d, out, mx), v += 1;
    }
  }
}

// Whether any row hides any of tokens [pos0, pos0 + n): the causal limit of the first row (the
// lowest) falls before the last token, or a window's lower edge (the last row's, the highest) after
// the first.
inline bool wide_block_masked(const RowSet& rs, int64_t pos0, int64_t n) {
  return pos0 + n - 1 > rs.first_pos || (rs.window > 0 && pos0 < rs.lowest(rs.rows - 1));
}

// Causal and window mask for tokens [pos0, pos0 + n): row r sees positions in (limit(r) - window,
// limit(r)] with limit(r) = first_pos + r / group, so the token at pos hides from the rows below
// (pos - first_pos) * group (their queries come before it) and, with a window, from those from
// (pos + window - first_pos) * group on (it has left their window).
inline void wide_mask(const RowSet& rs, int64_t pos0, int64_t n, float* sT, int64_t rp) {
  auto rows_before = [&](int64_t offset) { return imin(rs.rows, imax(0, offset * rs.group)); };
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = pos0 + t, before = rows_before(pos - rs.first_pos);
    const int64_t past = rs.window > 0 ? imax(before, rows_before(pos + rs.window - rs.first_pos)) : rs.rows;
    for (int64_t r = 0; r < before; ++r) sT[t * rp + r] = -INFINITY;
    for (int64_t r = past; r < rs.rows; ++r) sT[t * rp + r] = -INFINITY;
  }
}

// cmax = max(cmax, scoreT's n tokens), a vector of rows at a time.
template <typename L>
void wide_max(const float* sT, int64_t rp, int64_t n, float* cmax) {
  constexpr int W = L::kWidth;
  for (int64_t r0 = 0; r0 < rp; r0 += W) {
    typename L::V mx = L::load(cmax + r0);
    for (int64_t t = 0; t < n; ++t) mx = L::max(mx, L::load(sT + t * rp + r0));
    L::store(cmax + r0, mx);
  }
}

// exp(x) for x <= 0 (-inf included: 0) on the wide softmax's scores. AVX-512 takes vec.h's steps with
// VSCALEFPS for the 2^n (no integer round trip, and no clamp: lanes below -87 come out 0 by a mask,
// as vec.h's do) and the polynomial as Horner's: 13 vector operations instead of 19 (the softmax
// shares the FMA ports with the two matrix products), within an ulp or so of vec.h's result.
template <typename L>
KVPAGE_KERNEL_INLINE
typename L::V wide_exp(typename L::V x) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<L, Lanes16>) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_scalef_ps(keep, y, n);
  }
#endif
  return exp_nonpositive_lanes<L>(x);
}

// 2^x for x <= 0 (-inf included: 0; exactly 0 below -125, near e^x's -87 = -125.5 log2 e) on the wide
// layout's scores, which carry log2 e from their queries (WideScores::start): the exponent takes no
// multiply, the reduction r = x - round(x) is exact (no two-constant step), and 2^r on [-1/2, 1/2] is a
// degree-6 minimax polynomial (within ~1.3 ulp in fp32, as wide_exp is of vec.h's exp). 10 vector
// operations on AVX-512 where wide_exp takes 13: the softmax shares the FMA ports with the products.
constexpr float kWideExp2Poly[] = {1.5345684369e-4f, 1.3399882009e-3f, 9.6184890717e-3f, 5.5503290147e-2f,
                                   2.4022646248e-1f, 6.9314718246e-1f, 1.0f};  // r^6 .. r^0

template <typename L>
KVPAGE_KERNEL_INLINE
typename L::V wide_exp2(typename L::V x) {
  using V = typename L::V;
  auto poly = [](V r) KVPAGE_KERNEL_LAMBDA {  // Horner's rule
    V y = L::set1(kWideExp2Poly[0]);
    for (size_t i = 1; i < sizeof(kWideExp2Poly) / sizeof(float); ++i) y = L::fma(y, r, L::set1(kWideExp2Poly[i]));
    return y;
  };
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<L, Lanes16>) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kWideExp2Floor), _CMP_GE_OQ);
    return _mm512_maskz_scalef_ps(keep, poly(_mm512_sub_ps(x, n)), n);
  }
#endif
  const V clamped = L::max(x, L::set1(kWideExp2Floor));
  const V n = L::floor(L::add(clamped, L::set1(0.5f)));
  return L::zero_below(x, kWideExp2Floor, L::times_pow2(poly(L::sub(clamped, n)), n));
}

// One chunk's online-softmax step in base 2 (the scores and m carry log2 e), a vector of rows at a time:
// m and l ([rp]) move to the chunk's max (cmax, which starts over), scoreT's n tokens become
// probabilities, and alpha = 2^(m_old - m_new) is what the accumulators take before the chunk's values
// (wide_values). A row that has seen
// nothing yet (max -inf) keeps probability 0 and alpha 0 (its accumulators are zero): its max is
// taken as -FLT_MAX, so both exponents are -inf.
template <typename L>
void wide_softmax(int64_t rp, int64_t n, float* sT, float* m, float* l, float* cmax, float* alpha) {
  constexpr int W = L::kWidth;
  for (int64_t r0 = 0; r0 < rp; r0 += W) {
    const typename L::V m_old = L::load(m + r0);
    const typename L::V m_new = L::max(m_old, L::load(cmax + r0));
    const typename L::V m_safe = L::max(m_new, L::set1(-FLT_MAX));
    typename L::V sum = L::zero();
    for (int64_t t = 0; t < n; ++t) {
      const typename L::V p = wide_exp2<L>(L::sub(L::load(sT + t * rp + r0), m_safe));
      L::store(sT + t * rp + r0, p);
      sum = L::add(sum, p);
    }
    const typename L::V a = wide_exp2<L>(L::sub(m_old, m_safe));
    L::store(l + r0, L::fma(L::load(l + r0), a, sum));
    L::store(m + r0, m_new);
    L::store(alpha + r0, a);
    L::store(cmax + r0, L::set1(-INFINITY));
  }
}

// accT[i][W v..] (times alpha[W v..] when rescale) += sum_t v[t][i] p[t][W v..] over tokens [0, n) of a
// run of V tiles (tile_tokens each, the last may be short), for head elements [i0, i0 + I) and V row
// vectors: the rows across the lanes again, so p (scoreT, by token) loads as vectors and each value
// element is a broadcast (a memory operand of its FMAs on AVX-512); the I * V accumulators stay in
// registers over the run.
template <typename L, int I, int V>
KVPAGE_KERNEL_INLINE
void wide_values_tile(float* accT, int64_t rp, const float* alpha, bool rescale, const float* p,
                      const float* const* tiles, int64_t tile_tokens, int64_t n, int64_t d, int64_t i0) {
  constexpr int W = L::kWidth;
  typename L::V a[I][V];
  for (int j = 0; j < I; ++j)
    for (int v = 0; v < V; ++v) a[j][v] = L::load(accT + (i0 + j) * rp + W * v);
  if (rescale) {
    for (int v = 0; v < V; ++v) {
      const typename L::V al = L::load(alpha + W * v);
      for (int j = 0; j < I; ++j) a[j][v] = L::mul(a[j][v], al);
    }
  }
  for_each_tile_token(tiles, tile_tokens, n, d, i0, [&](const float* x, int64_t t) KVPAGE_KERNEL_LAMBDA {
    typename L::V pv[V];
    for (int v = 0; v < V; ++v) pv[v] = L::load(p + t * rp + W * v);
    for (int j = 0; j < I; ++j) {
      const typename L::V xb = L::set1(x[j]);
      for (int v = 0; v < V; ++v) a[j][v] = L::fma(xb, pv[v], a[j][v]);
    }
  });
  for (int j = 0; j < I; ++j)
    for (int v = 0; v < V; ++v) L::store(accT + (i0 + j) * rp + W * v, a[j][v]);
}

// Head elements per pass by row vectors, V: AVX-512 6 x 4 (24 accumulators, 4 p vectors; 10 loads per
// 24 FMAs), 8 x 3, 12 x 2, 16 x 1 (fewer vectors: more elements, so each p load still feeds enough
// FMAs); AVX2 4 x 3 (12 accumulators, 3 p vectors, a broadcast: the 16 registers), 6 x 2, 8 x 1.
#if defined(__AVX512F__)
constexpr int kWideValueVectors = 4;
constexpr int wide_value_elems(int v) { return v >= 4 ? 6 : v == 3 ? 8 : v == 2 ? 12 : 16; }
#else
constexpr int kWideValueVectors = 3;
constexpr int wide_value_elems(int v) { return v >= 3 ? 4 : v == 2 ? 6 : 8; }
#endif

// Runs of tiles of up to kWideValueTokens tokens, all head elements per run: a run's p rows and V
// lines stay in L1 while every element block reads them (a whole chunk's p and V, 32 KB each, did
// not: each block reread them from L2), and the accumulators load and store once per run rather than
// per tile. The first run also applies the chunk's rescale.
constexpr int64_t kWideValueTokens = 64;

template <typename L, int V>
KVPAGE_KERNEL_INLINE
void wide_values_rows(float* accT, int64_t rp, const float* alpha, const float* p, const float* const* tiles,
                      int64_t tile_tokens, int64_t n, int64_t d) {
  constexpr int I = wide_value_elems(V);
  const int64_t run_tiles = imax(1, kWideValueTokens / tile_tokens), run = run_tiles * tile_tokens;
  for (int64_t t0 = 0, tile = 0; t0 < n; t0 += run, tile += run_tiles) {
    const float* const* x = tiles + tile;
    const float* pt = p + t0 * rp;
    const int64_t nr = imin(run, n - t0);
    const bool rescale = t0 == 0;
    int64_t i = 0;
    for (; i + I <= d; i += I) wide_values_tile<L, I, V>(accT, rp, alpha, rescale, pt, x, tile_tokens, nr, d, i);
    if constexpr (I > 4) {
      for (; i + 4 <= d; i += 4) wide_values_tile<L, 4, V>(accT, rp, alpha, rescale, pt, x, tile_tokens, nr, d, i);
    }
    for (; i < d; ++i) wide_values_tile<L, 1, V>(accT, rp, alpha, rescale, pt, x, tile_tokens, nr, d, i);
  }
}

// A chunk's values for all rp rows, kWideValueVectors row vectors at a time.
inline void wide_values(float* accT, int64_t rp, const float* alpha, const float* p, const float* const* tiles,
                        int64_t tile_tokens, int64_t n, int64_t d) {
  using L = WideLanes;
  constexpr int W = L::kWidth, NV = kWideValueVectors;
  for (int64_t v = 0, vectors = rp / W; v < vectors;) {
    const int64_t left = vectors - v;
    const int64_t off = W * v;
    if (left >= NV) {
      wide_values_rows<L, NV>(accT + off, rp, alpha + off, p + off, tiles, tile_tokens, n, d), v += NV;
    } else if (left == 3) {
      wide_values_rows<L, 3>(accT + off, rp, alpha + off, p + off, tiles, tile_tokens, n, d), v += 3;
    } else if (left == 2) {
      wide_values_rows<L, 2>(accT + off, rp, alpha + off, p + off, tiles, tile_tokens, n, d), v += 2;
    } else {
      wide_values_rows<L, 1>(accT + off, rp, alpha + off, p + off, tiles, tile_tokens, n, d), v += 1;
    }
  }
}

// The wide layout for attend_d: score [chunk][rp], m, l, cmax and alpha [rp], the accumulators
// transposed ([head_size][rp] in s.acc) until finish.
struct WideScores {
  static constexpr bool kChunkValues = true;

  static void start(const RowSet& rs, int64_t d, Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows);
    transpose_queries(s.q, rs.rows, d, s.qT, rp, kLog2e);
    for (int64_t r = 0; r < rp; ++r) s.cmax[r] = -INFINITY;
  }

  // A block no row masks (all but the diagonal's and a window's edge) takes its max in registers.
  static void scores(const RowSet& rs, int64_t d, int64_t, const float* k, int64_t t0, int64_t nb,
                     int64_t pos0, Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows);
    float* sT = s.score + t0 * rp;
    if (rs.softcap <= 0.f && !wide_block_masked(rs, pos0, nb)) {
      return wide_scores<true>(s.qT, rp, k, nb, d, sT, s.cmax);
    }
    wide_scores<false>(s.qT, rp, k, nb, d, sT, s.cmax);
    if (rs.softcap > 0.f) soft_cap(sT, nb * rp, rs.softcap * kLog2e);  // cap tanh(s / cap), in base 2
    wide_mask(rs, pos0, nb, sT, rp);
    wide_max<WideLanes>(sT, rp, nb, s.cmax);
  }

  static void softmax(const RowSet& rs, int64_t, int64_t, int64_t n, Scratch& s) {
    wide_softmax<WideLanes>(round_up_rows(rs.rows), n, s.score, s.m, s.l, s.cmax, s.alpha);
  }

  // A chunk's values in one pass, the accumulators held in registers across its V tiles.
  static void chunk_values(const RowSet& rs, int64_t d, const float* const* v, int64_t bs, int64_t n, Scratch& s) {
    wide_values(s.acc, round_up_rows(rs.rows), s.alpha, s.score, v, bs, n, d);
  }

  // The accumulators back into rows ([rows][head_size]) for the callers: transposed into qT (done
  // with), which s.acc then points at.
  static void finish(const RowSet& rs, int64_t d, Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows);
    for (int64_t r = 0; r < rs.rows; ++r) s.m[r] *= kLn2;  // -inf stays -inf
    transpose_scaled(s.acc, rp, d, rp, s.qT, d, 1.f);
    s.acc = s.qT;
  }
};

#endif
