// One 64-byte line copied with non-temporal stores (x86-64; SSE2): the rows a tier load writes are not read again
// before they leave the caches, so a plain store's read-for-ownership of each line would be wasted memory traffic.
// Shared by the block copies (kv_blocks.cpp) and the checksumming copy (checksum.cpp).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>

#include <cstdint>

namespace kvpage {
namespace cpu {

inline void stream_line(uint8_t* dst, const uint8_t* src) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
  const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
}

}  // namespace cpu
}  // namespace kvpage
#endif
