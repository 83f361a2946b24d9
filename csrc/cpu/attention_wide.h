// Attention for many query rows at once (prefill tiles, wide GQA groups): the rows go across the
// vector lanes, 8 on AVX2, 16 on AVX-512. Queries are transposed once per work item (qT
// [head_size][rp], rp = rows rounded up to the lanes), so a score is FMAs of a broadcast key element
// with a vector of rows' query elements, and the scores land by token (scoreT [token][rp]) without a
// horizontal sum (row-by-row dot products, microkernels.h, ran at about half the FMA peak in L1 on
// AVX2, held back by those sums; at 16 lanes a head of 64 leaves each sum only 4 FMAs). The online
// softmax then runs a vector of rows at a time. Values reuse block_values_tiles, reading p by token,
// a whole chunk per pass.
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

// Row sets at least this large take the wide path; smaller ones would leave lanes empty.
constexpr int64_t kWideRows = WideLanes::kWidth;
// Tokens per pass for the last one or two row vectors (wide_scores).
constexpr int kWideOnesTokens = WideLanes::kWidth == 16 ? 8 : 4;

// qT[i][r] = q[r][i], rows [rows, rp) zero.
inline void transpose_queries(const float* q, int64_t rows, int64_t d, float* qT, int64_t rp) {
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t r = 0; r < rows; ++r) qT[i * rp + r] = q[r * d + i];
    for (int64_t r = rows; r < rp; ++r) qT[i * rp + r] = 0.f;
  }
}

// scoreT[t][W v..W v + W) = k[t] . q[W v..W v + W) for T tokens and V row vectors of W lanes: T * V
// accumulators, each query vector feeding T FMAs and each broadcast key element V.
template <typename L, int T, int V>
KVPAGE_KERNEL_INLINE
void wide_scores_tile(const float* qT, int64_t rp, const float* k, int64_t d, float* sT) {
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
}

// T tokens at a time (then ones) against V row vectors.
template <typename L, int T, int V>
KVPAGE_KERNEL_INLINE
void wide_scores_rows(const float* qT, int64_t rp, const float* k, int64_t n, int64_t d, float* sT) {
  int64_t t = 0;
  for (; t + T <= n; t += T) wide_scores_tile<L, T, V>(qT, rp, k + t * d, d, sT + t * rp);
  for (; t < n; ++t) wide_scores_tile<L, 1, V>(qT, rp, k + t * d, d, sT + t * rp);
}

// Row vectors per pass, by the vectors left, and tokens per pass: AVX-512's 32 registers take fours
// x 4 tokens (16 accumulators; the broadcasts ride in the FMAs' memory operands), threes x 4, twos
// and ones x 8 (token counts that divide the usual block sizes); AVX2's 16 take fours x 3 or threes
// x 4 (12 accumulators, 7 loads per 12 FMAs), the last one or two x 4.
KVPAGE_KERNEL_INLINE
void wide_scores(const float* qT, int64_t rp, const float* k, int64_t n, int64_t d, float* sT) {
  using L = WideLanes;
  const int64_t vectors = rp / L::kWidth;
  for (int64_t v = 0; v < vectors;) {
    const int64_t left = vectors - v;
    float* out = sT + L::kWidth * v;
    const float* q = qT + L::kWidth * v;
#if defined(__AVX512F__)
    if (left >= 4) {
      wide_scores_rows<L, 4, 4>(q, rp, k, n, d, out), v += 4;
    } else if (left == 3) {
      wide_scores_rows<L, 4, 3>(q, rp, k, n, d, out), v += 3;
#else
    if (left >= 4 && left != 5 && left != 6) {
      wide_scores_rows<L, 3, 4>(q, rp, k, n, d, out), v += 4;
    } else if (left >= 3) {
      wide_scores_rows<L, 4, 3>(q, rp, k, n, d, out), v += 3;
#endif
    } else if (left == 2) {
      wide_scores_rows<L, kWideOnesTokens, 2>(q, rp, k, n, d, out), v += 2;
    } else {
      wide_scores_rows<L, kWideOnesTokens, 1>(q, rp, k, n, d, out), v += 1;
    }
  }
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

// One chunk's online-softmax step, a vector of rows at a time: m and l ([rp]) move to the chunk's
// max, scoreT's n tokens become probabilities, and acc rows are rescaled by alpha = exp(m_old -
// m_new). A row that has seen nothing yet (max -inf) keeps probability 0 and alpha 0 (its acc is
// zero): its max is taken as -FLT_MAX, so both exponents are -inf.
template <typename L>
void wide_softmax(int64_t rows, int64_t rp, int64_t n, int64_t d, float* sT, float* m, float* l, float* acc) {
  constexpr int W = L::kWidth;
  for (int64_t r0 = 0; r0 < rp; r0 += W) {
    typename L::V mx = L::set1(-INFINITY);
    for (int64_t t = 0; t < n; ++t) mx = L::max(mx, L::load(sT + t * rp + r0));
    const typename L::V m_old = L::load(m + r0);
    const typename L::V m_new = L::max(m_old, mx);
    const typename L::V m_safe = L::max(m_new, L::set1(-FLT_MAX));
    typename L::V sum = L::zero();
    for (int64_t t = 0; t < n; ++t) {
      const typename L::V p = exp_nonpositive_lanes<L>(L::sub(L::load(sT + t * rp + r0), m_safe));
      L::store(sT + t * rp + r0, p);
      sum = L::add(sum, p);
    }
    const typename L::V alpha = exp_nonpositive_lanes<L>(L::sub(m_old, m_safe));
    L::store(l + r0, L::fma(L::load(l + r0), alpha, sum));
    L::store(m + r0, m_new);
    alignas(64) float alphas[W];
    L::store(alphas, alpha);
    for (int64_t r = r0; r < imin(rows, r0 + W); ++r) rescale_row(acc + r * d, d, alphas[r - r0]);
  }
}

// The wide layout for attend_d: score [chunk][rp], m and l [rp].
struct WideScores {
  static constexpr bool kChunkValues = true;

  static void start(const RowSet& rs, int64_t d, Scratch& s) {
    transpose_queries(s.q, rs.rows, d, s.qT, round_up_rows(rs.rows));
  }

  static void scores(const RowSet& rs, int64_t d, int64_t, const float* k, int64_t t0, int64_t nb,
                     int64_t pos0, Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows);
    wide_scores(s.qT, rp, k, nb, d, s.score + t0 * rp);
    if (rs.softcap > 0.f) soft_cap(s.score + t0 * rp, nb * rp, rs.softcap);
    wide_mask(rs, pos0, nb, s.score + t0 * rp, rp);
  }

  static void softmax(const RowSet& rs, int64_t d, int64_t, int64_t n, Scratch& s) {
    wide_softmax<WideLanes>(rs.rows, round_up_rows(rs.rows), n, d, s.score, s.m, s.l, s.acc);
  }

  // A chunk's values in one pass, the accumulators held in registers across its V tiles.
  static void chunk_values(const RowSet& rs, int64_t d, const float* const* v, int64_t bs, int64_t n, Scratch& s) {
    block_values_tiles(s.acc, rs.rows, d, s.score, 1, round_up_rows(rs.rows), v, bs, n);
  }
};

#endif
