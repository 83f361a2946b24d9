// CRC-32C (Castagnoli, the iSCSI / ext4 / RocksDB checksum) of a byte buffer: the disk KV tier's payload
// checksum (kv_offload/tiers.py). On x86 CPUs with SSE4.2 (every AVX2 or AVX-512 machine) it runs on the
// crc32 instruction, three independent streams at once (the instruction's latency is three cycles, its
// throughput one per cycle), combined by a multiply in GF(2); elsewhere, and under KVPAGE_CPU_ISA=generic,
// a portable slicing-by-8 table loop. Both give the same value for any length and alignment. crc32c_copy also
// copies the bytes it checksums, in the same pass (a disk tier load's payload into the cache rows).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "dispatch.h"
#include "stream_store.h"
#include "../ops.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define KVPAGE_CRC32C_X86 1
#endif

namespace kvpage {
namespace cpu {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // x^32 + x^28 + ... reflected (the Castagnoli polynomial)

struct Tables {
  uint32_t slice[8][256];  // slicing-by-8: slice[k][b] = the CRC of byte b followed by k zero bytes
  uint32_t x2n[32];        // x^(2^n) mod P, for shifting a CRC over a run of zero bytes
};

// a * b mod P in the reflected representation (bit 31 is x^0).
uint32_t mult_mod_p(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

const Tables& tables() {
  static const Tables t = [] {
    Tables t{};
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t.slice[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t.slice[k][b] = (t.slice[k - 1][b] >> 8) ^ t.slice[0][t.slice[k - 1][b] & 0xFF];
    }
    uint32_t p = 1u << 30;  // x^1
    t.x2n[0] = p;
    for (int n = 1; n < 32; ++n) t.x2n[n] = p = mult_mod_p(p, p);
    return t;
  }();
  return t;
}

// crc (raw: no pre/post inversion) followed by num_bytes zero bytes: crc * x^(8 * num_bytes) mod P.
uint32_t shift_zeros(uint32_t crc, size_t num_bytes) {
  const Tables& t = tables();
  uint32_t x = 1u << 31;  // x^0
  for (unsigned k = 3; num_bytes; num_bytes >>= 1, ++k) {
    if (num_bytes & 1) x = mult_mod_p(t.x2n[k & 31], x);
  }
  return mult_mod_p(x, crc);
}

uint32_t raw_portable(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& t = tables();
  for (; n >= 8; p += 8, n -= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);  // little-endian loads: the table layout assumes them
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t.slice[7][lo & 0xFF] ^ t.slice[6][(lo >> 8) & 0xFF] ^ t.slice[5][(lo >> 16) & 0xFF] ^
          t.slice[4][lo >> 24] ^ t.slice[3][hi & 0xFF] ^ t.slice[2][(hi >> 8) & 0xFF] ^
          t.slice[1][(hi >> 16) & 0xFF] ^ t.slice[0][hi >> 24];
  }
  for (; n; ++p, --n) crc = (crc >> 8) ^ t.slice[0][(crc ^ *p) & 0xFF];
  return crc;
}

#if defined(KVPAGE_CRC32C_X86)
// Three streams of `len` bytes each, combined: crc(A B C) = shift(shift(crc(A), |B|) ^ crc0(B), |C|) ^ crc0(C).
// Below a few KiB the combine's ~100 ns is not repaid.
constexpr size_t kMinStream = 2048;

__attribute__((target("sse4.2"))) uint32_t raw_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7); ++p, --n) crc = _mm_crc32_u8(crc, *p);
  if (n >= 3 * kMinStream) {
    const size_t len = (n / 3) & ~size_t{7};
    const uint8_t* a = p;
    const uint8_t* b = p + len;
    const uint8_t* c = p + 2 * len;
    uint64_t ca = crc, cb = 0, cc = 0;
    for (size_t i = 0; i < len; i += 8) {
      uint64_t wa, wb, wc;
      std::memcpy(&wa, a + i, 8);
      std::memcpy(&wb, b + i, 8);
      std::memcpy(&wc, c + i, 8);
      ca = _mm_crc32_u64(ca, wa);
      cb = _mm_crc32_u64(cb, wb);
      cc = _mm_crc32_u64(cc, wc);
    }
    crc = shift_zeros(static_cast<uint32_t>(ca), len) ^ static_cast<uint32_t>(cb);
    crc = shift_zeros(crc, len) ^ static_cast<uint32_t>(cc);
    p += 3 * len;
    n -= 3 * len;
  }
  uint64_t c64 = crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
  }
  crc = static_cast<uint32_t>(c64);
  for (; n; ++p, --n) crc = _mm_crc32_u8(crc, *p);
  return crc;
}

// The raw CRC of 64-byte lines [0, len) at src, each line streamed to dst right after it is checksummed.
__attribute__((target("sse4.2"))) uint64_t raw_copy_lines(uint64_t crc, uint8_t* dst, const uint8_t* src,
                                                           size_t len) {
  for (size_t i = 0; i < len; i += 64) {
    for (size_t k = 0; k < 64; k += 8) {
      uint64_t w;
      std::memcpy(&w, src + i + k, 8);
      crc = _mm_crc32_u64(crc, w);
    }
    stream_line(dst + i, src + i);
  }
  return crc;
}

// raw_sse42 over src while copying it to dst, one pass: the three streams in lockstep, a line of each at a time.
__attribute__((target("sse4.2"))) uint32_t raw_copy_sse42(uint32_t crc, uint8_t* dst, const uint8_t* src, size_t n) {
  // Up to a 64-byte aligned dst: streamed stores that fill whole cache lines (a line written in part by them is
  // merged in memory, several times slower).
  const size_t head = std::min(n, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  crc = raw_sse42(crc, src, head);
  dst += head, src += head, n -= head;
  if (n >= 3 * kMinStream) {
    const size_t len = (n / 3) & ~size_t{63};
    uint64_t ca = crc, cb = 0, cc = 0;
    for (size_t i = 0; i < len; i += 64) {
      ca = raw_copy_lines(ca, dst + i, src + i, 64);
      cb = raw_copy_lines(cb, dst + len + i, src + len + i, 64);
      cc = raw_copy_lines(cc, dst + 2 * len + i, src + 2 * len + i, 64);
    }
    crc = shift_zeros(static_cast<uint32_t>(ca), len) ^ static_cast<uint32_t>(cb);
    crc = shift_zeros(crc, len) ^ static_cast<uint32_t>(cc);
    dst += 3 * len, src += 3 * len, n -= 3 * len;
  }
  const size_t lines = n & ~size_t{63};
  crc = static_cast<uint32_t>(raw_copy_lines(crc, dst, src, lines));
  std::memcpy(dst + lines, src + lines, n - lines);
  return raw_sse42(crc, src + lines, n - lines);
}

bool cpu_has_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#endif

}  // namespace

bool crc32c_uses_hardware() {
#if defined(KVPAGE_CRC32C_X86)
  // Follows the kernels' ISA choice, so KVPAGE_CPU_ISA=generic (and set_isa) test the portable loop here too.
  static const bool has = cpu_has_sse42();
  return has && std::string(active_kernels().isa) != "generic";
#else
  return false;
#endif
}

uint32_t crc32c(const void* data, size_t num_bytes, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t raw = ~crc;
#if defined(KVPAGE_CRC32C_X86)
  if (crc32c_uses_hardware()) return ~raw_sse42(raw, p, num_bytes);
#endif
  return ~raw_portable(raw, p, num_bytes);
}

uint32_t crc32c_copy(void* dst, const void* src, size_t num_bytes, uint32_t crc) {
#if defined(KVPAGE_CRC32C_X86)
  if (crc32c_uses_hardware()) {
    return ~raw_copy_sse42(~crc, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), num_bytes);
  }
#endif
  std::memcpy(dst, src, num_bytes);
  return crc32c(src, num_bytes, crc);
}

}  // namespace cpu
}  // namespace kvpage
