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
// an A/B over SmolLM2's shapes); AVX2 builds one of up to 4 rows x 24 columns (12 of the 16 ymm
// registers, 3 for the weights, 1 for the broadcast input), run over the slab's two halves; the
// generic build gets plain loops, correct but slower (kvpage.model.cpu_layout uses this path only
// where a register-blocked kernel runs). Every kernel sums each output over k in order with one
// fused multiply-add per term, then adds the bias: the same bits on AVX-512 and AVX2. Slabs of bf16 or
// fp16 weights (half the bytes to stream) are widened to fp32 as they are loaded, which is exact, so
// they give the same bits as fp32 slabs of the same (16-bit representable) weights.
#pragma once

#if defined(KVPAGE_VEC_AVX2) && !defined(__AVX512F__)
constexpr int64_t kMaxRowsPerPass = 4;  // 16 ymm registers
#else
constexpr int64_t kMaxRowsPerPass = 8;
#endif

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

// Each pass over a slab prefetches, spread over its k steps, its share of the NEXT slab, so that all the
// passes of a slab together bring the next one into L2 before its first pass reads it. A thread's first
// slab has no previous one to do that for it: its first kLeadLines go out at once (prefetch_run_start)
// and its first pass streams the rest of it, kLeadLines ahead of its loads, on top of its share of the
// next. Left to the hardware prefetchers, that first slab per thread streamed slowly for 16-bit slabs
// (with no software prefetch at all bf16 slabs ran 0.63-0.80x, fp32 level), and decode's small
// matrices are only 6-10 slabs per thread at 2 threads. bench/linear.py's shapes in a C++ harness
// alternating both builds on one loaded core of the 2-vCPU Xeon, each call split in two runs as 2
// threads run it: M = 1 bf16 1.01-1.05x (medians of 4-5 rounds), fp32 0.96-1.01x; M = 8, 64 level.
constexpr int64_t kLeadLines = 256;  // 16 KiB

inline void prefetch_run_start(const void* run, int64_t slab_bytes) {
  const char* line = static_cast<const char*>(run);
  const int64_t lines = slab_bytes / 64 < kLeadLines ? slab_bytes / 64 : kLeadLines;
  for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(line + 64 * l, 0, 2);
}

// Pass p of `passes` over the slab at `slab` (slab_bytes long; the next slab follows it), `steps` k steps.
inline PrefetchStream slab_stream(const void* slab, int64_t slab_bytes, bool first, bool has_next, int64_t passes,
                                  int64_t p, int64_t steps) {
  const char* base = static_cast<const char*>(slab);
  const int64_t slab_lines = slab_bytes / 64, per_pass = slab_lines / passes, next = has_next ? per_pass : 0;
  if (first && p == 0) {
    const int64_t lead = slab_lines < kLeadLines ? slab_lines : kLeadLines;
    return PrefetchStream{base + 64 * lead, slab_lines - lead + next, steps};  // through its share of the next
  }
  return PrefetchStream{base + slab_bytes + 64 * p * per_pass, next, steps};
}

// Bf16Bits / HalfBits and their widening loads (load_widened16 / load_widened8): vec.h.
inline float weight_to_float(float w) { return w; }
inline float weight_to_float(Bf16Bits w) { return bf16_to_float(w.bits); }
inline float weight_to_float(HalfBits w) { return half_to_float(w.bits); }

#if defined(__AVX512F__)

// y[r][0..ncols) = (acc[r] + bias) + residual[r] for a pass's R rows (residual rows share y's stride;
// no residual: acc + bias). Masked stores: the last slab of an N that is not a multiple of 48 holds
// padding columns.
template <int R>
inline void store_slab_rows(const __m512 (&acc)[R][kSlabColumns / 16], float* y, int64_t ldy, int64_t ncols,
                            const float* bias, const float* residual) {
  for (int v = 0; v < kSlabColumns / 16; ++v) {
    const int64_t valid = ncols - 16 * v;
    const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : valid <= 0 ? 0 : __mmask16((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 out = _mm512_add_ps(acc[r][v], b);
      if (residual) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, residual + r * ldy + 16 * v));
      _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask, out);
    }
  }
}

// Prefetches, for writing, the lines of the R x ncols outputs a pass stores at its end: a long prefill's
// outputs are not in cache, and 24 stores missing at once stall the pass (read-for-ownership).
// `python bench/linear.py --rows 64 256 1024`, builds with and without alternating (2 rounds, Zen 5 VM):
// 1024 rows fp32 slabs 1.11-1.13x, bf16 dot 1.07-1.27x; 256 rows 1.02-1.05x; 64 rows level. The AVX2
// kernel (4 rows per half-slab pass) measured no gain in a per-matrix A/B, so it has none.
template <int R>
inline void prefetch_outputs(float* y, int64_t ldy, int64_t ncols) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; c += 16) __builtin_prefetch(y + r * ldy + c, 1, 3);
}

template <int R, typename W>
void slab_pass(const float* x, int64_t k_dim, const W* w, float* y, int64_t ldy, int64_t ncols,
               const float* bias, const float* residual, PrefetchStream pf) {
  constexpr int V = kSlabColumns / 16;  // zmm vectors per slab row
  prefetch_outputs<R>(y, ldy, ncols);
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    pf.next();
    __m512 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load_widened16(w + k * kSlabColumns + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_dim + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  store_slab_rows<R>(acc, y, ldy, ncols, bias, residual);
}

#elif defined(KVPAGE_VEC_AVX2)

// (out + the bias of its columns) + residual into y's first `valid` columns (a slab's last vector may
// hold padding; bias and residual may be null).
inline void store_columns(float* y, __m256 out, const float* bias, const float* residual, int64_t valid) {
  if (valid >= 8) {
    if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y, residual ? _mm256_add_ps(out, _mm256_loadu_ps(residual)) : out);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, out);
  for (int64_t c = 0; c < valid; ++c) {
    const float with_bias = tmp[c] + (bias ? bias[c] : 0.f);
    y[c] = residual ? with_bias + residual[c] : with_bias;
  }
}

template <int R, typename W>
void slab_pass(const float* x, int64_t k_dim, const W* w, float* y, int64_t ldy, int64_t ncols,
               const float* bias, const float* residual, PrefetchStream pf) {
  constexpr int kHalf = kSlabColumns / 2, V = kHalf / 8;  // 24 columns: 3 ymm vectors
  for (int h = 0; h < 2; ++h) {
    const W* wh = w + h * kHalf;
    __m256 acc[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_dim; ++k) {
      if (h == 0) pf.next();  // the pass's share of the next slab, during the first half
      __m256 wv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) wv[v] = load_widened8(wh + k * kSlabColumns + 8 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * k_dim + k);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const int64_t col = h * kHalf + 8 * v;
      if (col >= ncols) continue;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        store_columns(y + r * ldy + col, acc[r][v], bias ? bias + col : nullptr,
                      residual ? residual + r * ldy + col : nullptr, ncols - col);
    }
  }
}

#else  // portable loops, vectorised by the compiler to whatever the ISA offers

template <int R, typename W>
void slab_pass(const float* x, int64_t k_dim, const W* w, float* y, int64_t ldy, int64_t ncols,
               const float* bias, const float* residual, PrefetchStream pf) {
  float acc[R][kSlabColumns] = {};
  float wk[kSlabColumns];
  for (int64_t k = 0; k < k_dim; ++k) {
    pf.next();
    for (int64_t c = 0; c < kSlabColumns; ++c) wk[c] = weight_to_float(w[k * kSlabColumns + c]);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * k_dim + k];
#pragma omp simd
      for (int64_t c = 0; c < kSlabColumns; ++c) acc[r][c] += xv * wk[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c) {
      const float with_bias = acc[r][c] + (bias ? bias[c] : 0.f);
      y[r * ldy + c] = residual ? with_bias + residual[r * ldy + c] : with_bias;
    }
}

#endif

template <typename W>
using SlabPass = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t, const float*, const float*,
                          PrefetchStream);

// slab_pass<1, W> .. slab_pass<kMaxRowsPerPass, W>, indexed by rows - 1.
template <typename W, size_t... R>
constexpr std::array<SlabPass<W>, sizeof...(R)> pass_table(std::index_sequence<R...>) {
  return {{slab_pass<int(R) + 1, W>...}};
}

// Slabs [slab_begin, slab_end) of y = x @ W.T + bias. Rows go in even passes of <= kMaxRowsPerPass
// (64 rows are 8 x 8, not 7 x 9 + 1); each pass also prefetches its share of the next slab (slab_stream).
template <typename W>
void linear_slabs_of(const LinearArgs& a, const W* packed, int64_t slab_begin, int64_t slab_end) {
  static constexpr auto kPass = pass_table<W>(std::make_index_sequence<kMaxRowsPerPass>{});
  const int64_t slab_elements = a.k * kSlabColumns, slab_bytes = slab_elements * int64_t(sizeof(W));
  const int64_t passes = (a.m + kMaxRowsPerPass - 1) / kMaxRowsPerPass;
  prefetch_run_start(packed + slab_begin * slab_elements, slab_bytes);
  for (int64_t s = slab_begin; s < slab_end; ++s) {
    const W* w = packed + s * slab_elements;
    const int64_t col0 = s * kSlabColumns, ncols = imin(kSlabColumns, a.n - col0);
    int64_t row = 0;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t rows = (a.m - row) / (passes - p);
      const PrefetchStream pf = slab_stream(w, slab_bytes, s == slab_begin, s + 1 < slab_end, passes, p, a.k);
      kPass[rows - 1](a.x + row * a.k, a.k, w, a.y + row * a.n + col0, a.n, ncols, a.bias ? a.bias + col0 : nullptr,
                      a.residual ? a.residual + row * a.n + col0 : nullptr, pf);
      row += rows;
    }
  }
}

void linear_slabs(const LinearArgs& a, int64_t slab_begin, int64_t slab_end) {
  switch (a.weight_dtype) {
    case DType::kBFloat16:
      return linear_slabs_of(a, static_cast<const Bf16Bits*>(a.packed), slab_begin, slab_end);
    case DType::kHalf:
      return linear_slabs_of(a, static_cast<const HalfBits*>(a.packed), slab_begin, slab_end);
    default:
      return linear_slabs_of(a, static_cast<const float*>(a.packed), slab_begin, slab_end);
  }
}

#if defined(__AVX512F__)
#define KVPAGE_BF16_DOT 1

// bf16 dot products (LLM(matmul_precision="medium")): pair-interleaved bf16 slabs [slabs][k / 2][48][2]
// and x rounded to bf16, whose consecutive pairs (x[2p], x[2p + 1]) one 32-bit broadcast carries; each
// vdpbf16ps adds two products per lane, twice an fp32 FMA's work (C++ microbenchmark on the Zen 5 VM:
// ~505 vs ~253 GFLOP/s on one core). Products of bf16 values are exact in fp32; the sums are rounded
// as the instruction does (denormals flushed), so the result is close to, not equal to, an fp32 sum
// over the rounded operands. Built for CPUs with AVX512-BF16 only (the glue checks at run time).
template <int R>
__attribute__((target("avx512bf16"))) void slab_pass_bf16_pairs(const uint32_t* x, int64_t pairs,
                                                                   const uint16_t* w, float* y, int64_t ldy,
                                                                   int64_t ncols, const float* bias,
                                                                   const float* residual, PrefetchStream pf) {
  constexpr int V = kSlabColumns / 16;
  prefetch_outputs<R>(y, ldy, ncols);
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    pf.next();
    __m512i wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_si512(w + 2 * (p * kSlabColumns + 16 * v));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(x[r * pairs + p]));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, (__m512bh)wv[v]);
    }
  }
  store_slab_rows<R>(acc, y, ldy, ncols, bias, residual);
}

using PairPass = void (*)(const uint32_t*, int64_t, const uint16_t*, float*, int64_t, int64_t, const float*,
                          const float*, PrefetchStream);

template <size_t... R>
constexpr std::array<PairPass, sizeof...(R)> pair_pass_table(std::index_sequence<R...>) {
  return {{slab_pass_bf16_pairs<int(R) + 1>...}};
}

// linear_slabs for pair-interleaved bf16 slabs: a.x_pairs holds x rounded to bf16, [m][k / 2] pairs.
void linear_slabs_bf16_pairs(const LinearArgs& a, int64_t slab_begin, int64_t slab_end) {
  static constexpr auto kPass = pair_pass_table(std::make_index_sequence<kMaxRowsPerPass>{});
  const int64_t pairs = (a.k + 1) / 2, slab_elements = pairs * 2 * kSlabColumns;
  const int64_t passes = (a.m + kMaxRowsPerPass - 1) / kMaxRowsPerPass;
  const uint16_t* packed = static_cast<const uint16_t*>(a.packed);
  prefetch_run_start(packed + slab_begin * slab_elements, slab_elements * 2);
  for (int64_t s = slab_begin; s < slab_end; ++s) {
    const uint16_t* w = packed + s * slab_elements;
    const int64_t col0 = s * kSlabColumns, ncols = imin(kSlabColumns, a.n - col0);
    int64_t row = 0;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t rows = (a.m - row) / (passes - p);
      const PrefetchStream pf = slab_stream(w, slab_elements * 2, s == slab_begin, s + 1 < slab_end, passes, p, pairs);
      kPass[rows - 1](a.x_pairs + row * pairs, pairs, w, a.y + row * a.n + col0, a.n, ncols,
                      a.bias ? a.bias + col0 : nullptr, a.residual ? a.residual + row * a.n + col0 : nullptr, pf);
      row += rows;
    }
  }
}

// out [rows][2 * ceil(k / 2)] = x [rows][k] rounded to bf16 (nearest even), an odd k padded with 0.
__attribute__((target("avx512bf16"))) void round_rows_to_bf16(const float* x, int64_t rows, int64_t k,
                                                                 uint16_t* out) {
  const int64_t width = 2 * ((k + 1) / 2);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    uint16_t* o = out + r * width;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i));
      _mm512_storeu_si512(o + i, (__m512i)h);
    }
    for (; i < k; ++i) o[i] = float_to_bf16(xr[i]);
    if (width > k) o[k] = 0;
  }
}

#endif

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
