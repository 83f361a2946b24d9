// Warp collectives of the emulator: each is served by the last lane to arrive, from every lane's
// request (see emu_api.h): shuffles, ballot, mma.sync.m16n8k16, ldmatrix.x4 (plain and .trans) and movmatrix.trans.
#include <cuda_fp16.h>

#include <cstring>
#include <string>

#include "emu_internal.h"

namespace emu {
namespace detail {

void serve_shuffle(Block& b, int warp, unsigned mask) {
  Fiber* lanes = &b.fibers[warp * 32];
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1)) continue;
    auto* r = static_cast<ShuffleRequest*>(lanes[l].request);
    const int w = r->width, base = l / w * w;
    int src = l;
    switch (r->mode) {
      case 0: src = base + (r->arg % w + w) % w; break;
      case 1: src = l - r->arg >= base ? l - r->arg : l; break;
      case 2: src = l + r->arg < base + w ? l + r->arg : l; break;
      case 3: src = (l ^ r->arg) / w == l / w ? (l ^ r->arg) : l; break;
    }
    if (!(mask >> src & 1)) {
      fail(b, thread_name(lanes[l]) + " shuffles from lane " + std::to_string(src) + ", outside the mask");
    }
    r->result = static_cast<ShuffleRequest*>(lanes[src].request)->value;
  }
}

void serve_ballot(Block& b, int warp, unsigned mask) {
  Fiber* lanes = &b.fibers[warp * 32];
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) {
    if ((mask >> l & 1) && *lanes[l].int_result) bits |= 1u << l;
  }
  for (int l = 0; l < 32; ++l) {
    if (mask >> l & 1) *lanes[l].int_result = static_cast<int>(bits);
  }
}

float half_bits_to_float(uint16_t h, bool bf16) {
  if (bf16) {
    const uint32_t w = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

// mma.sync.m16n8k16.row.col.f32: fragments as in the PTX ISA. With g = lane / 4, t = lane % 4:
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..] (low half first);
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1].
void serve_mma(Block& b, int warp, bool bf16) {
  ++W().stats.mmas;
  Fiber* lanes = &b.fibers[warp * 32];
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const auto* r = static_cast<MmaRequest*>(lanes[l].request);
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i & 1) * 8, col = 2 * t + (i >> 1) * 8;
      A[row][col] = half_bits_to_float(r->a[i] & 0xffff, bf16);
      A[row][col + 1] = half_bits_to_float(r->a[i] >> 16, bf16);
    }
    for (int i = 0; i < 2; ++i) {
      B[2 * t + 8 * i][g] = half_bits_to_float(r->b[i] & 0xffff, bf16);
      B[2 * t + 8 * i + 1][g] = half_bits_to_float(r->b[i] >> 16, bf16);
    }
    C[g][2 * t] = r->d[0], C[g][2 * t + 1] = r->d[1], C[g + 8][2 * t] = r->d[2], C[g + 8][2 * t + 1] = r->d[3];
  }
  for (int l = 0; l < 32; ++l) {
    auto* r = static_cast<MmaRequest*>(lanes[l].request);
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >> 1) * 8, col = 2 * t + (i & 1);
      float acc = C[row][col];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      r->d[i] = acc;
    }
  }
}

// ldmatrix.sync.m8n8.x4[.trans].b16: lanes 8j..8j+7 give the row addresses of matrix j (8 rows of
// 8 16-bit elements M_j[row][col]). With g = l / 4, t = l % 4, lane l receives
//   plain:  r[j] = {M_j[g][2t], M_j[g][2t+1]}      (row g, from lane 8j + g's address)
//   .trans: r[j] = {M_j[2t][g], M_j[2t+1][g]}      (column g, from lanes 8j + 2t and 8j + 2t + 1)
// (low half first).
void serve_ldmatrix(Block& b, int warp, bool trans) {
  Fiber* lanes = &b.fibers[warp * 32];
  auto row = [&](int lane) {
    return static_cast<const uint16_t*>(static_cast<LdmatrixRequest*>(lanes[lane].request)->row);
  };
  for (int l = 0; l < 32; ++l) {
    if (reinterpret_cast<uintptr_t>(row(l)) % 16 != 0) {
      fail(b, thread_name(lanes[l]) + ": ldmatrix row address not 16-byte aligned");
    }
  }
  for (int l = 0; l < 32; ++l) {
    auto* r = static_cast<LdmatrixRequest*>(lanes[l].request);
    const int t = l % 4, g = l / 4;
    for (int j = 0; j < 4; ++j) {
      uint16_t lo, hi;
      if (trans) {
        std::memcpy(&lo, row(8 * j + 2 * t) + g, 2);
        std::memcpy(&hi, row(8 * j + 2 * t + 1) + g, 2);
      } else {
        std::memcpy(&lo, row(8 * j + g) + 2 * t, 2);
        std::memcpy(&hi, row(8 * j + g) + 2 * t + 1, 2);
      }
      r->r[j] = uint32_t(lo) | uint32_t(hi) << 16;
    }
  }
}

// movmatrix.sync.m8n8.trans.b16: lane l holds M[l / 4][2 (l % 4)], M[l / 4][2 (l % 4) + 1] (low
// half first) and receives M[2 (l % 4)][l / 4], M[2 (l % 4) + 1][l / 4].
void serve_movmatrix(Block& b, int warp) {
  Fiber* lanes = &b.fibers[warp * 32];
  uint16_t m[8][8];
  for (int l = 0; l < 32; ++l) {
    const auto word = static_cast<uint32_t>(static_cast<ShuffleRequest*>(lanes[l].request)->value);
    m[l / 4][2 * (l % 4)] = static_cast<uint16_t>(word & 0xffff);
    m[l / 4][2 * (l % 4) + 1] = static_cast<uint16_t>(word >> 16);
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    static_cast<ShuffleRequest*>(lanes[l].request)->result = uint32_t(m[2 * t][g]) | uint32_t(m[2 * t + 1][g]) << 16;
  }
}

void serve_warp(Block& b, int warp) {
  WarpState& w = b.warps[warp];
  switch (w.op) {
    case Op::kShuffle: serve_shuffle(b, warp, w.mask); break;
    case Op::kBallot: serve_ballot(b, warp, w.mask); break;
    case Op::kSyncWarp: break;
    case Op::kMmaF16: serve_mma(b, warp, false); break;
    case Op::kMmaBF16: serve_mma(b, warp, true); break;
    case Op::kLdmatrixX4: serve_ldmatrix(b, warp, false); break;
    case Op::kLdmatrixX4Trans: serve_ldmatrix(b, warp, true); break;
    case Op::kMovmatrixTrans: serve_movmatrix(b, warp); break;
  }
  for (int l = 0; l < 32; ++l) {
    if (w.mask >> l & 1) make_runnable(b, b.fibers[warp * 32 + l]);
  }
  w.arrived = 0;
}


}  // namespace detail
}  // namespace emu
