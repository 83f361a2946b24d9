// Paged decode attention kernels on CUDA cores (and the SIMT prefill path), fp32 math: every
// dtype pair; fp16 / bf16 GQA groups take the tensor-core kernel instead (attention_decode_mma.cuh,
// chosen in launch_decode_for_head_and_tile). Included only by the
// attention_decode_<cache>_<query>.cu files, each of which instantiates launch_decode for one
// (query dtype, cache dtype) pair, so the instantiations compile in parallel.
//
// One CTA serves one query row and up to GT query heads of one GQA group, so each K/V tile is
// read from memory once for the whole group. K/V stream through a ring of shared-memory stages
// filled by cp.async (one barrier per stage; attention_decode_common.cuh). Its 128 threads form
// "token groups" of TPT lanes; a token group takes one staged token at a time, each lane reading
// 16-byte (or 8-byte, see DecodeConfig) vectors of that token's K and V row. Every token group
// keeps its own online softmax (running max, sum and accumulator) over the tokens it visits; the
// groups' states are merged once at the end (warp shuffles, then shared memory). Long contexts
// split into fixed partitions (one CTA each) whose partial states a reduce kernel merges with
// max-logit / exp-sum weights, vLLM's v2 scheme. Logits live in the log2 domain (q is pre-scaled
// by scale * log2(e)) so every exponential is one exp2f.
//
// fp8 caches: K/V codes unpack to exact floats (device_utils.cuh); k_scale folds into q's
// pre-scale and v_scale into the final normalisation, so the loop does no extra multiplies.
#pragma once

#include "attention_decode_common.cuh"
#include "attention_decode_mma.cuh"

namespace kvpage {
namespace cuda {
namespace {

template <typename Cache, int HEAD, int GT>
struct DecodeConfig {
  static constexpr int kHeadsPerCta = GT;
  // Bytes per K/V load. 16, except for fp8 with 8 heads per CTA: a 16-byte load holds 16 fp8
  // values, doubling a lane's share of q and of the accumulators (GT x 16 floats each), which
  // for GT = 8 no longer fits in registers; 8-byte loads keep that tile's share at 8.
  static constexpr int kLoadBytes = (sizeof(Cache) == 1 && GT > 4) ? 8 : 16;
  using Load = typename std::conditional<kLoadBytes == 16, uint4, uint2>::type;
  static constexpr int kVec = kLoadBytes / sizeof(Cache);   // elements per load
  static constexpr int kVecsPerRow = HEAD / kVec;           // loads in one K/V row
  static constexpr int kTpt = cmin(kWarpSize, next_pow2(kVecsPerRow));  // lanes per token
  static constexpr int kNv = (kVecsPerRow + kTpt - 1) / kTpt;         // loads per lane
  static constexpr int kGroupsPerWarp = kWarpSize / kTpt;
  static constexpr int kTokenGroups = kDecodeWarps * kGroupsPerWarp;
  // Tokens a token group takes per compute step (one online-softmax rescale each): few enough
  // that q, the accumulators and the step's K/V vectors stay in registers. Half-width loads get
  // twice the tokens, so a step covers the same bytes.
  static constexpr int kUnroll = (GT <= 4 ? 4 : 2) * (16 / kLoadBytes);
  static constexpr int kStepTokens = kTokenGroups * kUnroll;  // tokens of one compute step

  // K/V stream through shared memory in a ring of kStages stages filled by cp.async, so about
  // (kStages - 1) stages of every resident CTA are in flight while it computes: enough bytes
  // outstanding per SM to cover DRAM latency, with no registers held for them. A stage is a
  // whole number of steps, about 16 KiB of K + V; the ring about 48 KiB, so 4 CTAs fit an SM
  // (a 64 KiB ring, 3 per SM, ran grids of ~4 CTAs per SM in two waves on an H200).
  static constexpr int kRowBytes = HEAD * int(sizeof(Cache));  // a K or V row's shared-memory slot
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kStageSteps = cmax(1, 16384 / (2 * kRowBytes * kStepTokens));
  static constexpr int kStageTokens = kStepTokens * kStageSteps;
  static constexpr int kStages = cmin(3, cmax(2, 49152 / (2 * kStageTokens * kRowBytes)));
  using Ring = KvRing<Cache, HEAD, kStageTokens, kRowBytes, kStages>;
  // After the loop the ring holds the warps' states for the final merge.
  static_assert(WarpStates<GT, HEAD>::kBytes <= Ring::kValidOffset, "the merge reuses the K/V ring");
  // Resident CTAs per SM the register budget aims at: 4 (at most 128 registers) where q and
  // the accumulators take at most 64 floats per lane and a row takes one load per lane; GQA
  // tiles of 8, fp8's wide loads and fp32 rows of two loads a lane hold more (they spilled at
  // 128) and settle for 2.
  static constexpr int kMinBlocksPerSm = GT <= 4 && kNv == 1 && GT * kVec <= 32 ? 4 : 2;
};

// Online-softmax state of one query head: merge (m_o, l_o, acc_o) into (m, l, acc).
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m_o, float l_o,
                                            const float* acc_o) {
  const float m_new = fmaxf(m, m_o);
  if (m_new == -INFINITY) return;  // neither side has seen a token
  const float a = exp2f(m - m_new), b = exp2f(m_o - m_new);
  l = l * a + l_o * b;
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = acc[i] * a + acc_o[i] * b;
  m = m_new;
}

// One compute step of a token group: kUnroll tokens (K rows kv, V rows vv, this lane's share)
// folded into the online-softmax state (m, l, acc) of each of the GT query heads.
template <typename Cache, int HEAD, int GT, typename C = DecodeConfig<Cache, HEAD, GT>,
          int kAcc = C::kNv * C::kVec>
__device__ __forceinline__ void attend_step(const float (&q)[GT][kAcc],
                                            const typename C::Load (&kv)[C::kUnroll][C::kNv],
                                            const typename C::Load (&vv)[C::kUnroll][C::kNv],
                                            const bool (&valid)[C::kUnroll], float softcap, float (&m)[GT],
                                            float (&l)[GT], float (&acc)[GT][kAcc]) {
  constexpr int kUnroll = C::kUnroll, kNv = C::kNv, kVec = C::kVec, kTpt = C::kTpt;
  float s[kUnroll][GT];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float k[kAcc];
#pragma unroll
    for (int i = 0; i < kNv; ++i) unpack<Cache>(kv[u][i], k + i * kVec);
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) dot = fmaf(q[g][i], k[i], dot);
#pragma unroll
      for (int off = kTpt / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      s[u][g] = valid[u] ? dot : -INFINITY;
    }
  }
  // Softcapping in a pass of its own behind a uniform branch: inside the dot products it kept
  // registers live across the shuffles, and the kernels at their 128-register bound spilled.
  if (softcap > 0.f) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int g = 0; g < GT; ++g) s[u][g] = valid[u] ? soft_cap(s[u][g], softcap) : -INFINITY;
    }
  }

  // One rescale per kUnroll tokens: the running max moves to the max over the step, and s
  // becomes the step's probabilities (all 0 while nothing is visible yet).
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    float m_new = m[g];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, s[u][g]);
    if (m_new == -INFINITY) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) s[u][g] = 0.f;
      continue;
    }
    if (m_new > m[g]) {  // once the running max settles, most steps skip the (exact: x1) rescale
      const float alpha = exp2f(m[g] - m_new);
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[g][i] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      s[u][g] = exp2f(s[u][g] - m_new);
      l[g] += s[u][g];
    }
    m[g] = m_new;
  }
  // acc += p V, each V row unpacked once for all GT heads (unpacking is a large share of the
  // loop's instructions for fp8 and 16-bit caches).
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float v[kAcc];
#pragma unroll
    for (int i = 0; i < kNv; ++i) unpack<Cache>(vv[u][i], v + i * kVec);
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[g][i] = fmaf(s[u][g], v[i], acc[g][i]);
    }
  }
}

// T: query / out element; Cache: K/V cache element (T itself, or Fp8E4M3).
template <typename T, typename Cache, int HEAD, int GT>
__global__ void __launch_bounds__(kDecodeThreads, (DecodeConfig<Cache, HEAD, GT>::kMinBlocksPerSm))
    paged_decode_kernel(const AttentionParams p, const DecodeWork w) {
  using C = DecodeConfig<Cache, HEAD, GT>;
  using Load = typename C::Load;
  constexpr int kVec = C::kVec, kNv = C::kNv, kTpt = C::kTpt, kUnroll = C::kUnroll;
  constexpr int kAcc = kNv * kVec;  // accumulator floats per lane per head

  DecodeCta cta;
  if (!decode_cta<GT>(p, w, cta)) return;  // this row has fewer partitions; the reduce skips it
  const int row = cta.row, head0 = cta.head0, num_heads_here = cta.num_heads;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int sub = lane % kTpt;  // lane within the token group
  const int token_group = warp * C::kGroupsPerWarp + lane / kTpt;
  const int vecs = p.head_size / kVec;  // runtime head size may be below HEAD (masked lanes)

  // q for every head of the tile, only the dims this lane owns, pre-scaled to the log2 domain
  // and by k_scale (a key's value is its unpacked element times k_scale).
  float q[GT][kAcc];
  const float qscale = p.scale * kLog2e * p.k_scale;
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const T* qh = static_cast<const T*>(p.query) + row * p.q_row_stride + (head0 + g) * p.q_head_stride;
#pragma unroll
    for (int i = 0; i < kNv; ++i) {
      const int v = sub + i * kTpt;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        q[g][i * kVec + e] = (g < num_heads_here && v < vecs) ? to_float(qh[v * kVec + e]) * qscale : 0.f;
      }
    }
  }

  float m[GT], l[GT], acc[GT][kAcc];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[g][i] = 0.f;
  }

  extern __shared__ __align__(16) unsigned char smem[];
  typename C::Ring ring(p, cta, smem);
  stream_kv(ring, cta.begin, [&](int stage) {
    const unsigned char* k_src = ring.keys(stage);
    const unsigned char* v_src = ring.values(stage);
    const bool* valid_src = ring.valid(stage);
#pragma unroll
    for (int step = 0; step < C::kStageSteps; ++step) {
      Load kv[kUnroll][kNv], vv[kUnroll][kNv];
      bool valid[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        // At step u the token groups of a warp take consecutive tokens: contiguous rows.
        const int r = step * C::kStepTokens + u * C::kTokenGroups + token_group;
        valid[u] = valid_src[r];
#pragma unroll
        for (int i = 0; i < kNv; ++i) {
          const int v = sub + i * kTpt;
          const bool on = v < vecs;
          kv[u][i] = on ? *reinterpret_cast<const Load*>(k_src + r * C::kRowBytes + v * C::kLoadBytes) : Load{};
          vv[u][i] = on ? *reinterpret_cast<const Load*>(v_src + r * C::kRowBytes + v * C::kLoadBytes) : Load{};
        }
      }
      attend_step<Cache, HEAD, GT>(q, kv, vv, valid, p.softcap, m, l, acc);
    }
  });

  // Merge the token groups of each warp (lanes that own the same dims differ in bits >= kTpt).
#pragma unroll
  for (int off = kTpt; off < kWarpSize; off *= 2) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float acc_o[kAcc];
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc_o[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], off);
      const float m_o = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[g], off);
      merge_state<kAcc>(m[g], l[g], acc[g], m_o, l_o, acc_o);
    }
  }

  // Then the warps, through shared memory.
  const WarpStates<GT, HEAD> states(smem);
  if (lane < kTpt) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      if (lane == 0) states.max[warp][g] = m[g], states.sum[warp][g] = l[g];
#pragma unroll
      for (int i = 0; i < kNv; ++i) {
        const int v = sub + i * kTpt;
        if (v < C::kVecsPerRow) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) states.acc[warp][g][v * kVec + e] = acc[g][i * kVec + e];
        }
      }
    }
  }
  __syncthreads();
  store_merged<T>(p, w, cta, states);
}

// The decode kernels as types, for the one place that chooses between them (visit_decode_kernel):
// Config (kHeadsPerCta, Ring and kMinBlocksPerSm: what the split planner needs) and launch. Only
// launch's body names the kernel, so reading a Config (attention_decode.cu) instantiates none.
template <typename T, typename Cache, int HEAD, int GT>
struct SimtDecode {
  using Config = DecodeConfig<Cache, HEAD, GT>;
  static cudaError_t launch(const AttentionParams& p, const DecodeWork& w, cudaStream_t stream) {
    return launch_decode_grid<T, GT, paged_decode_kernel<T, Cache, HEAD, GT>>(Config::Ring::kSmemBytes, p, w,
                                                                              stream);
  }
};
template <typename T, int HEAD>
struct MmaDecode {
  using Config = MmaDecodeConfig<T, HEAD>;
  static cudaError_t launch(const AttentionParams& p, const DecodeWork& w, cudaStream_t stream) {
    return launch_decode_grid<T, Config::kHeadsPerCta, paged_decode_mma_kernel<T, HEAD>>(Config::Ring::kSmemBytes,
                                                                                          p, w, stream);
  }
};

// Calls f(Kernel{}) with the decode kernel that serves p: MmaDecode for 16-bit GQA groups
// (decode_uses_tensor_cores), else SimtDecode at the head size's and group's tile. false when
// no kernel does (a head size past 256).
template <typename T, typename Cache, typename F>
bool visit_decode_kernel(const AttentionParams& p, F&& f) {
  return dispatch_head_size(p.head_size, [&](auto head) {
    constexpr int kHead = decltype(head)::value;
    if constexpr (std::is_same<T, Cache>::value && sizeof(T) == 2 && kHead <= 128) {
      if (decode_uses_tensor_cores(p)) return f(MmaDecode<T, kHead>{});
    }
    dispatch_group_tile(p.num_heads / p.num_kv_heads,
                        [&](auto gt) { f(SimtDecode<T, Cache, kHead, decltype(gt)::value>{}); });
  });
}

// What one attention_decode_*.cu file instantiates: every decode kernel of its (query, cache)
// dtype pair.
template <typename T, typename Cache>
cudaError_t launch_decode_for_head_and_tile(const AttentionParams& p, const DecodeWork& w,
                                            cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  visit_decode_kernel<T, Cache>(p, [&](auto kernel) { err = decltype(kernel)::launch(p, w, stream); });
  return err;
}

}  // namespace
}  // namespace cuda
}  // namespace kvpage
