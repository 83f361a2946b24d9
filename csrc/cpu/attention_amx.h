// Prefill attention of a bfloat16 query over a bfloat16 cache (a bfloat16 model's) on AMX tiles: both
// products as bf16 tile products with fp32 accumulation (TDPBF16PS), as every bf16 attention computes them;
// the online softmax stays in fp32 and its probabilities are rounded to bf16 for the values' product, as
// FlashAttention rounds them. The widening FMA path (attention_wide.h) runs the same products at ~1/14 of
// the tiles' rate on this ISA's cores.
//   scores: scoreT[16 tokens][16 rows] += K[16 tokens][32 d] . QT[16 d pairs][16 rows][2]: K is the A
//           operand straight from the cache (a block's tokens are its rows), the queries' B tiles are
//           built once per item; the scores land as the wide layout's ([token][rp]), whose mask, max and
//           exp run unchanged, a vector of 16 rows at a time.
//   values: acc[16 rows][16 d] += P[16 rows][32 tokens] . V[16 token pairs][16 d][2]: p's A tiles are
//           two tokens' probabilities per dword, transposed from by-token to by-row; V's B tiles
//           interleave two tokens' rows. The accumulators stay by row ([rp][head_size], what the
//           callers read).
// The query is loaded unscaled (exact in bf16), the scale multiplies the fp32 scores.
// Included by attention_impl.h inside the ISA namespace, after attention_wide.h, in the AMX build
// (isa_avx512_amx.cpp; dispatch.cpp picks that build only where the CPU has AMX-BF16 and the OS grants
// the tile state).
#pragma once

#if defined(KVPAGE_AMX) && defined(KVPAGE_WIDE_ATTENTION) && defined(__AMX_BF16__)
#define KVPAGE_AMX_ATTENTION 1

// Whether an op's arguments suit the tile products: a bf16 query over a bf16 cache, head sizes of whole
// 32-element tiles, blocks of whole 16-token tiles.
inline bool amx_dtypes(const AttentionArgs& a) {
  return a.dtype == DType::kBFloat16 && a.cache_dtype == DType::kBFloat16 && a.head_size % 32 == 0 &&
         a.head_size <= 256 && a.block_size % 16 == 0;
}
// Whether a set of rows takes them: a prefill tile of more than one token with at least one 16-row tile
// (decode's GQA groups stream their K/V once: reading it, not the math, sets their pace).
inline bool takes_amx_path(const AttentionArgs& a, const RowSet& rs) {
  return amx_dtypes(a) && rs.rows >= 16 && rs.rows > rs.group;
}

// Palette 1, all eight tiles 16 rows x 64 bytes (16 x 16 fp32, or 16 x 32 bf16 = 16 x 16 pairs).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

constexpr int64_t kAmxTileDwords = 256;  // a 16 x 64-byte tile

// The tile instructions name their tiles in the instruction (the intrinsics paste the number into the
// assembly): accumulator c (tiles 0-3) goes through a switch.
#define KVPAGE_AMX_ON_TILE(c, OP) \
  switch (c) {                   \
    case 0: OP(0); break;        \
    case 1: OP(1); break;        \
    case 2: OP(2); break;        \
    default: OP(3); break;       \
  }

KVPAGE_KERNEL_INLINE void amx_zero(int c) {
#define KVPAGE_AMX_ZERO(C) _tile_zero(C)
  KVPAGE_AMX_ON_TILE(c, KVPAGE_AMX_ZERO)
#undef KVPAGE_AMX_ZERO
}

KVPAGE_KERNEL_INLINE void amx_load(int c, const void* x, int64_t stride) {
#define KVPAGE_AMX_LOAD(C) _tile_loadd(C, x, stride)
  KVPAGE_AMX_ON_TILE(c, KVPAGE_AMX_LOAD)
#undef KVPAGE_AMX_LOAD
}

KVPAGE_KERNEL_INLINE void amx_store(int c, void* x, int64_t stride) {
#define KVPAGE_AMX_STORE(C) _tile_stored(C, x, stride)
  KVPAGE_AMX_ON_TILE(c, KVPAGE_AMX_STORE)
#undef KVPAGE_AMX_STORE
}

// Accumulator c += tile kA (A, 4 or 7) . B loaded from b (64-byte rows) into tile 5 or 6 by c's parity: tiles
// are not renamed, so a load into the tile the previous product still reads would wait for it.
template <int kA>
KVPAGE_KERNEL_INLINE void amx_dot(int c, const void* b) {
#define KVPAGE_AMX_DOT(C, B)                 \
  {                                          \
    _tile_loadd(B, b, 64);                   \
    if constexpr (kA == 4) {                 \
      _tile_dpbf16ps(C, 4, B);               \
    } else {                                 \
      _tile_dpbf16ps(C, 7, B);               \
    }                                        \
  }
  switch (c) {
    case 0: KVPAGE_AMX_DOT(0, 5) break;
    case 1: KVPAGE_AMX_DOT(1, 6) break;
    case 2: KVPAGE_AMX_DOT(2, 5) break;
    default: KVPAGE_AMX_DOT(3, 6) break;
  }
#undef KVPAGE_AMX_DOT
}

// Loads the A operand into tile 4 (even step) or 7 (odd), then adds its products with nb B tiles: one
// accumulator each, B tile c at b + c * b_stride dwords.
KVPAGE_KERNEL_INLINE void amx_dots(int64_t step, const void* a, int64_t a_stride, int nb, const uint32_t* b,
                                   int64_t b_stride) {
  if (step % 2 == 0) {
    _tile_loadd(4, a, a_stride);
    for (int c = 0; c < nb; ++c) amx_dot<4>(c, b + c * b_stride);
  } else {
    _tile_loadd(7, a, a_stride);
    for (int c = 0; c < nb; ++c) amx_dot<7>(c, b + c * b_stride);
  }
}

// A 16 x 16 block of dwords transposed (src rows src_stride dwords apart, dst rows dst_stride).
KVPAGE_KERNEL_INLINE void amx_transpose16(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], lane L: rows 4i..4i+3 of element 4L + k
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
    _mm512_storeu_si512(dst + k * dst_stride, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(dst + (4 + k) * dst_stride, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(dst + (8 + k) * dst_stride, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(dst + (12 + k) * dst_stride, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// Two vectors of 16 floats a, b -> 16 dwords (bf16(b[i]) << 16 | bf16(a[i])), round to nearest even.
KVPAGE_KERNEL_INLINE __m512i amx_bf16_pairs(__m512 a, __m512 b) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Where the AMX layout's operands live (dwords, 64-byte aligned): the queries' B tiles [row tile][d / 32],
// p's A tiles [32-token step][row tile], V's B tiles [32-token step][d / 16], and one tile of p's pairs
// before their transpose.
struct AmxScratch {
  uint32_t *q, *p, *v, *pairs;
};

inline int64_t amx_steps(int64_t chunk) { return (chunk + 31) / 32; }

inline int64_t amx_scratch_dwords(int64_t rp, int64_t d, int64_t chunk) {
  const int64_t tiles = (rp / 16) * (d / 32) + amx_steps(chunk) * (rp / 16 + d / 16) + 1;
  return tiles * kAmxTileDwords + 16;  // + 16: the alignment
}

inline AmxScratch amx_carve(float* base, int64_t rp, int64_t d, int64_t chunk) {
  AmxScratch x;
  x.q = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t(63));
  x.p = x.q + (rp / 16) * (d / 32) * kAmxTileDwords;
  x.v = x.p + amx_steps(chunk) * (rp / 16) * kAmxTileDwords;
  x.pairs = x.v + amx_steps(chunk) * (d / 16) * kAmxTileDwords;
  return x;
}

struct AmxBf16Scores {
  static constexpr bool kChunkValues = true;

  static AmxScratch operands(const RowSet& rs, int64_t d, const Scratch& s) {
    return amx_carve(s.amx, round_up_rows(rs.rows), d, s.chunk);
  }

  // The queries' B tiles: rows [rows, rp) zero; each [16 rows][16 pairs] block of a 32-element slice of the
  // head transposed to [16 pairs][16 rows] (s.q holds bf16 values, so the rounding is exact).
  static void start(const RowSet& rs, int64_t d, Scratch& s) {
    static const AmxTileConfig config;
    _tile_loadconfig(&config);
    const int64_t rp = round_up_rows(rs.rows);
    const AmxScratch x = operands(rs, d, s);
    for (int64_t v = 0; v < rp / 16; ++v)
      for (int64_t h = 0; h < d / 32; ++h) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t r = 16 * v + i;
          const float* q = s.q + r * d + 32 * h;
          const bool real = r < rs.rows;
          const __m512 lo = real ? _mm512_loadu_ps(q) : _mm512_setzero_ps();
          const __m512 hi = real ? _mm512_loadu_ps(q + 16) : _mm512_setzero_ps();
          // 32 bf16 in order are the row's 16 pairs.
          _mm512_storeu_si512(x.pairs + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        amx_transpose16(x.pairs, 16, x.q + (v * (d / 32) + h) * kAmxTileDwords, 16);
      }
    for (int64_t r = 0; r < rp; ++r) s.cmax[r] = -INFINITY;
  }

  // A block's scores by tile products (its tokens past nb are read from the block's unused slots, and
  // neither masked nor read again), then the scale, soft cap, mask and the chunk's running max over its nb
  // tokens.
  static void scores(const RowSet& rs, int64_t d, int64_t, const Bf16Bits* k, int64_t t0, int64_t nb,
                     int64_t pos0, Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows), tiles = rp / 16;
    const AmxScratch x = operands(rs, d, s);
    float* sT = s.score + t0 * rp;
    for (int64_t t = 0; t < nb; t += 16)
      for (int64_t v0 = 0; v0 < tiles; v0 += 4) {
        const int nv = int(imin(4, tiles - v0));
        for (int c = 0; c < nv; ++c) amx_zero(c);
        for (int64_t h = 0; h < d / 32; ++h) {
          amx_dots(h, k + t * d + 32 * h, 2 * d, nv, x.q + (v0 * (d / 32) + h) * kAmxTileDwords,
                   (d / 32) * kAmxTileDwords);
        }
        for (int c = 0; c < nv; ++c) amx_store(c, sT + t * rp + 16 * (v0 + c), rp * 4);
      }
    const __m512 scale = _mm512_set1_ps(s.score_scale);
    for (int64_t i = 0; i < nb * rp; i += 16) _mm512_storeu_ps(sT + i, _mm512_mul_ps(_mm512_loadu_ps(sT + i), scale));
    if (rs.softcap > 0.f) soft_cap(sT, nb * rp, rs.softcap);
    if (wide_block_masked(rs, pos0, nb)) wide_mask(rs, pos0, nb, sT, rp);
    wide_max<Lanes16>(sT, rp, nb, s.cmax);
  }

  // wide_softmax's step with p going straight into its A tiles: two tokens' probabilities per dword
  // (tokens from n to the next 32 get 0), 16 pairs by 16 rows, transposed to rows by pairs.
  static void softmax(const RowSet& rs, int64_t d, int64_t, int64_t n, Scratch& s) {
    using L = Lanes16;
    const int64_t rp = round_up_rows(rs.rows), tiles = rp / 16;
    const AmxScratch x = operands(rs, d, s);
    const float* sT = s.score;
    for (int64_t v = 0; v < tiles; ++v) {
      const int64_t r0 = 16 * v;
      const L::V m_old = L::load(s.m + r0);
      const L::V m_new = L::max(m_old, L::load(s.cmax + r0));
      const L::V m_safe = L::max(m_new, L::set1(-FLT_MAX));
      L::V sum = L::zero();
      for (int64_t t32 = 0; t32 < n; t32 += 32) {
        for (int64_t pair = 0; pair < 16; ++pair) {
          const int64_t t = t32 + 2 * pair;
          const L::V pa = t < n ? wide_exp<L>(L::sub(L::load(sT + t * rp + r0), m_safe)) : L::zero();
          const L::V pb = t + 1 < n ? wide_exp<L>(L::sub(L::load(sT + (t + 1) * rp + r0), m_safe)) : L::zero();
          sum = L::add(sum, L::add(pa, pb));
          _mm512_storeu_si512(x.pairs + 16 * pair, amx_bf16_pairs(pa, pb));
        }
        amx_transpose16(x.pairs, 16, x.p + ((t32 / 32) * tiles + v) * kAmxTileDwords, 16);
      }
      const L::V a = wide_exp<L>(L::sub(m_old, m_safe));
      L::store(s.l + r0, L::fma(L::load(s.l + r0), a, sum));
      L::store(s.m + r0, m_new);
      L::store(s.alpha + r0, a);
      L::store(s.cmax + r0, L::set1(-INFINITY));
    }
  }

  // V's B tiles for tokens [0, n) of the chunk (to the next 32 with zeros: a block's unused slots may
  // hold anything, and 0 * NaN would reach the sums): token pairs' rows interleaved, 16 head elements a
  // tile.
  static void value_tiles(int64_t d, const Bf16Bits* const* tiles, int64_t bs, int64_t n, const AmxScratch& x) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                           6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    auto row = [&](int64_t t, int64_t h) {
      return t < n ? _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(tiles[t / bs]) + (t % bs) * d + 32 * h)
                   : _mm512_setzero_si512();
    };
    for (int64_t t32 = 0; t32 < n; t32 += 32)
      for (int64_t pair = 0; pair < 16; ++pair) {
        const int64_t t = t32 + 2 * pair;
        for (int64_t h = 0; h < d / 32; ++h) {
          const __m512i a = row(t, h), b = row(t + 1, h);
          uint32_t* out = x.v + ((t32 / 32) * (d / 16) + 2 * h) * kAmxTileDwords + 16 * pair;
          _mm512_store_si512(out, _mm512_permutex2var_epi16(a, first, b));
          _mm512_store_si512(out + kAmxTileDwords, _mm512_permutex2var_epi16(a, second, b));
        }
      }
  }

  // The accumulators move to the chunk's max (times alpha, row by row), then take the chunk's values:
  // per 16-row tile, up to four 16-element accumulators over the chunk's 32-token steps.
  static void chunk_values(const RowSet& rs, int64_t d, const Bf16Bits* const* v, int64_t bs, int64_t n,
                           Scratch& s) {
    const int64_t rp = round_up_rows(rs.rows), tiles = rp / 16, steps = (n + 31) / 32;
    const AmxScratch x = operands(rs, d, s);
    value_tiles(d, v, bs, n, x);
    for (int64_t r = 0; r < rp; ++r) rescale_row(s.acc + r * d, d, s.alpha[r]);
    for (int64_t vv = 0; vv < tiles; ++vv)
      for (int64_t u0 = 0; u0 < d / 16; u0 += 4) {
        const int nu = int(imin(4, d / 16 - u0));
        float* acc = s.acc + 16 * vv * d + 16 * u0;
        for (int c = 0; c < nu; ++c) amx_load(c, acc + 16 * c, d * 4);
        for (int64_t step = 0; step < steps; ++step) {
          amx_dots(step, x.p + (step * tiles + vv) * kAmxTileDwords, 64, nu,
                   x.v + (step * (d / 16) + u0) * kAmxTileDwords, kAmxTileDwords);
        }
        for (int c = 0; c < nu; ++c) amx_store(c, acc + 16 * c, d * 4);
      }
  }

  static void finish(const RowSet&, int64_t, Scratch&) { _tile_release(); }
};

#endif
