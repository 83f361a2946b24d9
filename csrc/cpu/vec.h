// Element conversions and a vectorisable exp for the CPU kernels. Included only by the ISA
// translation units, inside their ISA namespace: everything here is compiled per instruction
// set, and the compiler vectorises the plain loops (-fopenmp-simd) to that set's width.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define KVPAGE_VEC_AVX2 1
#endif

// __builtin_bit_cast rather than memcpy: it keeps loops that use it vectorisable.
inline float bits_to_float(uint32_t u) { return __builtin_bit_cast(float, u); }
inline uint32_t float_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

inline float bf16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                     // round to nearest even
  return uint16_t(u >> 16);
}

// 16-bit elements (packed weights, KV-cache tiles), distinct types so the loads below overload on them.
struct Bf16Bits {
  uint16_t bits;
};
struct HalfBits {
  uint16_t bits;
};

#if defined(KVPAGE_VEC_AVX2)
// 8 elements widened to fp32 (exactly: bf16 is fp32's top half, every fp16 value is an fp32 value).
inline __m256 load_widened8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_widened8(const Bf16Bits* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load_widened8(const HalfBits* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

#if defined(__AVX512F__)
inline __m512 load_widened16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_widened16(const Bf16Bits* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_widened16(const HalfBits* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 31) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  exponent = 113;  // subnormal: shift the leading one into the implicit bit
  while (!(mantissa & 0x400u)) {
    mantissa <<= 1;
    --exponent;
  }
  return bits_to_float(sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t x = float_to_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00;    // NaN
  if (x >= 0x477ff000u) return sign | 0x7c00;   // rounds past 65504: infinity
  if (x < 0x38800000u) {                         // half subnormal: let the FPU round
    const float rounded = bits_to_float(x) + 0.5f;  // ulp(0.5) is the half subnormal step
    return sign | uint16_t(float_to_bits(rounded) - 0x3f000000u);
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias exponent 127 -> 15, round to nearest even
  return sign | uint16_t(x >> 13);
}

// e^x for x <= 0 (scores minus a running max); exactly 0 below -87.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float fx = clamped * 1.44269504088896341f + 0.5f;
  float n = float(int32_t(fx));
  n -= (n > fx) ? 1.0f : 0.0f;  // floor without a libm call, so the loop vectorises
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const float scaled = y * bits_to_float(uint32_t(int32_t(n) + 127) << 23);
  return x < -87.0f ? 0.0f : scaled;
}

// Loads n (a multiple of 16) elements of dtype into fp32.
inline void load_as_float(kvpage::cpu::DType dtype, const void* src, float* dst, int64_t n) {
  using kvpage::cpu::DType;
  if (dtype == DType::kFloat) {
    std::memcpy(dst, src, size_t(n) * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
#if defined(__AVX512F__)
  // 16 lanes a step: a 16-bit cache's tiles convert at half the instructions of the 8-lane loops.
  if (dtype == DType::kHalf) {
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
  } else {
    for (int64_t i = 0; i < n; i += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(s + i)));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
  }
#elif defined(KVPAGE_VEC_AVX2)
  if (dtype == DType::kHalf) {
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
  } else {
    for (int64_t i = 0; i < n; i += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
  }
#else
  if (dtype == DType::kHalf) {
    for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(uint32_t(s[i]) << 16);
  }
#endif
}

// float8_e4m3fn codes read as fp16: the code's sign, exponent and mantissa bits moved into fp16's
// fields make an fp16 worth exactly 2^-8 of the fp8 value (subnormals included), so the hardware's
// fp16 conversion does the work. Callers fold kFp8HalfFactor (and the cache's scale) into a factor
// they apply anyway: q's softmax scale for K, the output normalisation for V. NaN codes (0x7f,
// 0xff) read as +-480 / 256; reshape_and_cache never writes them (it saturates to +-448).
constexpr float kFp8HalfFactor = 256.f;

inline uint16_t fp8e4m3_as_half_bits(uint8_t code) {
  return uint16_t((code & 0x80u) << 8 | (code & 0x7fu) << 7);
}

// n (a multiple of 16) fp8 codes -> fp32, each worth 1 / kFp8HalfFactor of the code's value.
inline void load_fp8_as_scaled_float(const void* src, float* dst, int64_t n) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
#if defined(KVPAGE_VEC_AVX2)
  // code << 8 (interleaved under a zero byte), arithmetic shift right by one and clear bit 14:
  // sign at bit 15, exponent and mantissa at bits 7-13. Three integer ops per 8 codes.
  const __m128i zero = _mm_setzero_si128(), clear_bit14 = _mm_set1_epi16(int16_t(0xbfff));
  for (int64_t i = 0; i < n; i += 16) {
    const __m128i codes = _mm_loadu_si128((const __m128i*)(s + i));
    const __m128i lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, codes), 1), clear_bit14);
    const __m128i hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, codes), 1), clear_bit14);
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(lo));
    _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(hi));
  }
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(fp8e4m3_as_half_bits(s[i]));
#endif
}

inline void store_from_float(kvpage::cpu::DType dtype, const float* src, void* dst, int64_t n) {
  using kvpage::cpu::DType;
  if (dtype == DType::kFloat) {
    std::memcpy(dst, src, size_t(n) * sizeof(float));
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i)
    d[i] = dtype == DType::kHalf ? float_to_half(src[i]) : float_to_bf16(src[i]);
}
