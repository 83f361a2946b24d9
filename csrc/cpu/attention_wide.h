// Attention for many query rows at once (prefill tiles, wide GQA groups), AVX2 builds: the rows
// go across the vector lanes. Queries are transposed once per work item (qT [head_size][rp], rp =
// rows rounded up to 8), so a score is FMAs of a broadcast key element with eight rows' query
// elements, and the scores land by token (scoreT [token][rp]) without a horizontal sum (row-by-row
// dot products, microkernels.h, ran at about half the FMA peak in L1 here, held back by those sums;
// the values loop at three quarters). The online softmax then runs eight rows per vector too.
// Values reuse block_values, reading p by token.
// Included by attention_impl.h inside the ISA namespace, after RowScores, the layout it mirrors.
#pragma once

#if defined(KVPAGE_VEC_AVX2) && !defined(__AVX512F__)
#define KVPAGE_WIDE_ATTENTION 1

// Row sets at least this large take the wide path; smaller ones would leave lanes empty.
constexpr int64_t kWideRows = 8;

// qT[i][r] = q[r][i], rows [rows, rp) zero.
inline void transpose_queries(const float* q, int64_t rows, int64_t d, float* qT, int64_t rp) {
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t r = 0; r < rows; ++r) qT[i * rp + r] = q[r * d + i];
    for (int64_t r = rows; r < rp; ++r) qT[i * rp + r] = 0.f;
  }
}

// scoreT[t][8v..8v+8) = k[t] . q[8v..8v+8) for T tokens and V row vectors: T * V accumulators, each
// query vector feeding T FMAs and each broadcast key element V.
template <int T, int V>
KVPAGE_KERNEL_INLINE
void wide_scores_tile(const float* qT, int64_t rp, const float* k, int64_t d, float* sT) {
  __m256 a[T][V];
  for (auto& row : a)
    for (auto& x : row) x = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m256 q[V];
    for (int v = 0; v < V; ++v) q[v] = _mm256_loadu_ps(qT + i * rp + 8 * v);
    for (int t = 0; t < T; ++t) {
      const __m256 kb = _mm256_broadcast_ss(k + t * d + i);
      for (int v = 0; v < V; ++v) a[t][v] = _mm256_fmadd_ps(kb, q[v], a[t][v]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sT + t * rp + 8 * v, a[t][v]);
}

// T tokens at a time (then ones) against V row vectors.
template <int T, int V>
KVPAGE_KERNEL_INLINE
void wide_scores_rows(const float* qT, int64_t rp, const float* k, int64_t n, int64_t d, float* sT) {
  int64_t t = 0;
  for (; t + T <= n; t += T) wide_scores_tile<T, V>(qT, rp, k + t * d, d, sT + t * rp);
  for (; t < n; ++t) wide_scores_tile<1, V>(qT, rp, k + t * d, d, sT + t * rp);
}

// Row vectors in fours x 3 tokens or threes x 4 tokens (12 accumulators, 7 loads per 12 FMAs), the
// last one or two x 4 tokens.
KVPAGE_KERNEL_INLINE
void wide_scores(const float* qT, int64_t rp, const float* k, int64_t n, int64_t d, float* sT) {
  const int64_t vectors = rp / 8;
  int64_t v = 0;
  for (int64_t left = vectors; left > 0; left = vectors - v) {
    float* out = sT + 8 * v;
    const float* q = qT + 8 * v;
    if (left >= 4 && left != 5 && left != 6) {
      wide_scores_rows<3, 4>(q, rp, k, n, d, out), v += 4;
    } else if (left >= 3) {
      wide_scores_rows<4, 3>(q, rp, k, n, d, out), v += 3;
    } else if (left == 2) {
      wide_scores_rows<4, 2>(q, rp, k, n, d, out), v += 2;
    } else {
      wide_scores_rows<4, 1>(q, rp, k, n, d, out), v += 1;
    }
  }
}

// Causal mask for tokens [pos0, pos0 + n): row r sees positions <= first_pos + r / group, so the
// token at pos hides from rows below (pos - first_pos) * group.
inline void wide_mask(int64_t rows, int64_t group, int64_t first_pos, int64_t pos0, int64_t n, float* sT,
                      int64_t rp) {
  for (int64_t t = imax(0, first_pos + 1 - pos0); t < n; ++t) {
    const int64_t hidden = imin(rows, (pos0 + t - first_pos) * group);
    for (int64_t r = 0; r < hidden; ++r) sT[t * rp + r] = -INFINITY;
  }
}

// One chunk's online-softmax step, eight rows at a time: m and l ([rp]) move to the chunk's max,
// scoreT's n tokens become probabilities, and acc rows are rescaled by alpha = exp(m_old - m_new).
// A row that has seen nothing yet (max -inf) keeps probability 0 and alpha 0 (its acc is zero).
inline void wide_softmax(int64_t rows, int64_t rp, int64_t n, int64_t d, float* sT, float* m, float* l,
                         float* acc) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  for (int64_t r0 = 0; r0 < rp; r0 += 8) {
    __m256 mx = minus_inf;
    for (int64_t t = 0; t < n; ++t) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sT + t * rp + r0));
    const __m256 m_old = _mm256_loadu_ps(m + r0);
    const __m256 m_new = _mm256_max_ps(m_old, mx);
    const __m256 nothing_seen = _mm256_cmp_ps(m_new, minus_inf, _CMP_EQ_OQ);
    const __m256 m_safe = _mm256_blendv_ps(m_new, _mm256_setzero_ps(), nothing_seen);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sT + t * rp + r0), m_safe));
      _mm256_storeu_ps(sT + t * rp + r0, p);
      sum = _mm256_add_ps(sum, p);
    }
    const __m256 alpha = exp_nonpositive8(_mm256_sub_ps(m_old, m_safe));
    _mm256_storeu_ps(l + r0, _mm256_fmadd_ps(_mm256_loadu_ps(l + r0), alpha, sum));
    _mm256_storeu_ps(m + r0, m_new);
    alignas(32) float alphas[8];
    _mm256_store_ps(alphas, alpha);
    for (int64_t r = r0; r < imin(rows, r0 + 8); ++r) {
      if (alphas[r - r0] == 1.f) continue;
      float* ac = acc + r * d;
      const __m256 w = _mm256_set1_ps(alphas[r - r0]);
      for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(ac + i, _mm256_mul_ps(w, _mm256_loadu_ps(ac + i)));
    }
  }
}

// The wide layout for attend_d: score [chunk][rp], m and l [rp].
struct WideScores {
  static void start(const RowSet& rs, int64_t d, Scratch& s) {
    transpose_queries(s.q, rs.rows, d, s.qT, round_up_rows(rs.rows));
  }

  static void scores(const RowSet& rs, int64_t d, int64_t, const float* k, int64_t t0, int64_t nb,
                     int64_t pos0, Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows);
    wide_scores(s.qT, rp, k, nb, d, s.score + t0 * rp);
    wide_mask(rs.rows, rs.group, rs.first_pos, pos0, nb, s.score + t0 * rp, rp);
  }

  static void softmax(const RowSet& rs, int64_t d, int64_t, int64_t n, Scratch& s) {
    wide_softmax(rs.rows, round_up_rows(rs.rows), n, d, s.score, s.m, s.l, s.acc);
  }

  static void values(const RowSet& rs, int64_t d, int64_t, const float* v, int64_t t0, int64_t nb,
                     Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows);
    block_values(s.acc, rs.rows, d, s.score + t0 * rp, 1, rp, v, nb);
  }
};

#endif
