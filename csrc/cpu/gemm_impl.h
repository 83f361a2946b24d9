// y = x @ W.T + bias for decode's few rows, on weights packed once into column slabs.
//
// At decode's batch (M = 1..~128 rows) a linear layer is bound by streaming its weight from memory,
// not by arithmetic, and the weights of a whole model pass through the caches once per step. So the
// layout and loop order serve the stream: W is packed as [N / 48 slabs][K][48 columns], each slab one
// contiguous run that a thread reads once, front to back, while it computes the slab's M x 48 outputs
// from registers and prefetches the NEXT slab into L2. A slab is shared by every row of x (all of
// which sit in L1/L2), so each weight byte is read once per call whatever M is.
//
// Included inside the ISA namespace, after vec.h: AVX-512 builds get the register-blocked kernel
// (up to 8 rows x 48 columns in 24 zmm accumulators: 8-15% faster than 32 columns from 32 rows up, in
// an A/B over SmolLM2's shapes); the others get plain loops, correct but slower
// (kvpage.model.cpu_layout uses this path only where the AVX-512 kernel runs).
#pragma once

constexpr int64_t kMaxRowsPerPass = 8;

// Issues `lines` prefetches of `base` spread evenly over `steps` calls of next(): a slab's worth of
// prefetches rides along with the arithmetic instead of arriving in one burst.
struct PrefetchStream {
  const char* next_line;
  int64_t lines, steps, credit = 0;
  inline void next() {
    credit += lines;
    while (credit >= steps) {
      __builtin_prefetch(next_line, 0, 2);  // into L2: the whole next slab fits there
      next_line += 64;
      credit -= steps;
    }
  }
};

#if defined(__AVX512F__)

template <int R>
void slab_pass(const float* x, int64_t k_dim, const float* w, float* y, int64_t ldy, int64_t ncols,
               const float* bias, PrefetchStream pf) {
  constexpr int V = kSlabColumns / 16;  // zmm vectors per slab row
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    pf.next();
    __m512 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_ps(w + k * kSlabColumns + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_dim + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  // Masked stores: the last slab of an N that is not a multiple of 48 holds padding columns.
  for (int v = 0; v < V; ++v) {
    const int64_t valid = ncols - 16 * v;
    const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : valid <= 0 ? 0 : __mmask16((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask, _mm512_add_ps(acc[r][v], b));
  }
}

#else  // portable loops, vectorised by the compiler to whatever the ISA offers

template <int R>
void slab_pass(const float* x, int64_t k_dim, const float* w, float* y, int64_t ldy, int64_t ncols,
               const float* bias, PrefetchStream pf) {
  float acc[R][kSlabColumns] = {};
  for (int64_t k = 0; k < k_dim; ++k) {
    pf.next();
    const float* wk = w + k * kSlabColumns;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * k_dim + k];
#pragma omp simd
      for (int64_t c = 0; c < kSlabColumns; ++c) acc[r][c] += xv * wk[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c) y[r * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.f);
}

#endif

using SlabPass = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, const float*,
                          PrefetchStream);

// Slabs [slab_begin, slab_end) of y = x @ W.T + bias. Rows go in even passes of <= 8 (64 rows are
// 8 x 8, not 7 x 9 + 1); each pass also prefetches its share of the next slab.
void linear_slabs(const LinearArgs& a, int64_t slab_begin, int64_t slab_end) {
  static constexpr SlabPass kPass[kMaxRowsPerPass + 1] = {
      nullptr, slab_pass<1>, slab_pass<2>, slab_pass<3>, slab_pass<4>,
      slab_pass<5>, slab_pass<6>, slab_pass<7>, slab_pass<8>};
  const int64_t slab_floats = a.k * kSlabColumns;
  const int64_t passes = (a.m + kMaxRowsPerPass - 1) / kMaxRowsPerPass;
  const int64_t lines_per_pass = slab_floats * 4 / 64 / passes;
  for (int64_t s = slab_begin; s < slab_end; ++s) {
    const float* w = a.packed + s * slab_floats;
    const int64_t col0 = s * kSlabColumns, ncols = imin(kSlabColumns, a.n - col0);
    const bool has_next = s + 1 < slab_end;
    int64_t row = 0;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t rows = (a.m - row) / (passes - p);
      const char* pf_base = reinterpret_cast<const char*>(w + slab_floats) + p * lines_per_pass * 64;
      const PrefetchStream pf{pf_base, has_next ? lines_per_pass : 0, a.k};
      kPass[rows](a.x + row * a.k, a.k, w, a.y + row * a.n + col0, a.n, ncols, a.bias ? a.bias + col0 : nullptr,
                  pf);
      row += rows;
    }
  }
}

// W [n, k] row-major -> [ceil(n / 48)][k][48], zero-padded columns.
void pack_linear_slabs(const float* weight, int64_t n, int64_t k, float* packed, int64_t slab_begin,
                       int64_t slab_end) {
  for (int64_t s = slab_begin; s < slab_end; ++s) {
    float* dst = packed + s * k * kSlabColumns;
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t c = 0; c < kSlabColumns; ++c) {
        const int64_t row = s * kSlabColumns + c;
        dst[kk * kSlabColumns + c] = row < n ? weight[row * k + kk] : 0.f;
      }
  }
}
