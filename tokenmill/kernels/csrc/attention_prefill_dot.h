// AVX512-BF16: the rows-in-lanes prefill attention's products (attention_prefill_lanes.h) by
// VDPBF16PS, on CPUs without AMX tiles. Each product keeps a block of accumulators in registers,
// a vector of 16 query rows each, and broadcasts the other operand's bf16 pair:
// - scores: per key, the pair (k[2c], k[2c + 1]) of its row against the rows' q^T pairs; 8 keys
//   x both groups (16 keys x one group) at a time;
// - values: per channel, the V^T pair (v[2j][d], v[2j + 1][d]) against the rows' probability
//   pairs; 8 channels x both groups (16 channels x one group) over all the block's keys, so
//   O^T is loaded and stored once a block.
// Against the per-row kernel (PrefillTask::run's scores_dot / values_dot with keys transposed
// per 16-key tile and a horizontal softmax per row), this needs no per-tile transposition, no
// horizontal reductions and no per-row rescaling of 16 keys at a time.
#pragma once

#ifdef TM_ISA_AVX512_BF16
#include "prefill_lanes.h"

namespace tm {

// S^T rows k0 .. k0 + K of GN groups: acc[k][g] += (k row's pair c) x (group g's q^T pair c)
template <int K, int GN>
inline void dot_scores_block(const uint32_t* kr, int64_t pairs, const uint32_t* const* q,
                             float* const* s, int64_t k0) {
  __m512 acc[K][GN];
  for (int k = 0; k < K; ++k)
    for (int g = 0; g < GN; ++g) acc[k][g] = _mm512_setzero_ps();
  const uint32_t* row = kr + k0 * pairs;
  for (int64_t c = 0; c < pairs; ++c) {
    __m512bh qv[GN];
    for (int g = 0; g < GN; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(q[g] + c * kLaneGroup);
    for (int k = 0; k < K; ++k) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(row[k * pairs + c]));
      for (int g = 0; g < GN; ++g) acc[k][g] = _mm512_dpbf16_ps(acc[k][g], kb, qv[g]);
    }
  }
  for (int k = 0; k < K; ++k)
    for (int g = 0; g < GN; ++g) _mm512_storeu_ps(s[g] + (k0 + k) * kLaneGroup, acc[k][g]);
}

// O^T channels d0 .. d0 + C of GN groups over chunks [0, n[g]) of 32 keys
template <int C, int GN>
inline void dot_values_block(const uint32_t* vt0, int64_t D, const int64_t* n,
                             const uint32_t* const* pp, float* const* o, const bool* on,
                             int64_t d0) {
  constexpr int64_t G = kLaneGroup;
  __m512 acc[C][GN];
  for (int d = 0; d < C; ++d)
    for (int g = 0; g < GN; ++g)
      acc[d][g] = on[g] ? _mm512_loadu_ps(o[g] + (d0 + d) * G) : _mm512_setzero_ps();
  const int64_t chunks = GN == 1 ? n[0] : std::max(n[0], n[GN - 1]);
  for (int64_t k = 0; k < chunks; ++k) {
    const uint32_t* vt = vt0 + (k * D + d0) * 16;  // [C][16 key pairs]
    if (GN > 1 && k >= n[0]) {  // the first group saw its last key: the second alone
      for (int64_t j = 0; j < 16; ++j) {
        const __m512bh pv = (__m512bh)_mm512_loadu_si512(pp[GN - 1] + (k * 16 + j) * G);
        for (int d = 0; d < C; ++d)
          acc[d][GN - 1] = _mm512_dpbf16_ps(
              acc[d][GN - 1], (__m512bh)_mm512_set1_epi32(static_cast<int>(vt[d * 16 + j])), pv);
      }
      continue;
    }
    for (int64_t j = 0; j < 16; ++j) {
      __m512bh pv[GN];
      for (int g = 0; g < GN; ++g) pv[g] = (__m512bh)_mm512_loadu_si512(pp[g] + (k * 16 + j) * G);
      for (int d = 0; d < C; ++d) {
        const __m512bh vb = (__m512bh)_mm512_set1_epi32(static_cast<int>(vt[d * 16 + j]));
        for (int g = 0; g < GN; ++g) acc[d][g] = _mm512_dpbf16_ps(acc[d][g], vb, pv[g]);
      }
    }
  }
  for (int d = 0; d < C; ++d)
    for (int g = 0; g < GN; ++g) _mm512_storeu_ps(o[g] + (d0 + d) * G, acc[d][g]);
}

struct DotAttention {
  static constexpr int64_t kBlock = 256;  // keys per softmax step (128-512 within 3%)

  void scores(const bf16* kr, int64_t D, int64_t keys, const uint32_t* q0, const uint32_t* q1,
              bool two, float* s, float* s1) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(kr);
    const uint32_t* q[2] = {q0, q1};
    float* out[2] = {s, s1};
    const int64_t padded = (keys + kLaneKeys - 1) / kLaneKeys * kLaneKeys;
    for (int64_t k0 = 0; k0 < padded; k0 += 16) {
      if (two) {
        dot_scores_block<8, 2>(k, D / 2, q, out, k0);
        dot_scores_block<8, 2>(k, D / 2, q, out, k0 + 8);
      } else {
        dot_scores_block<16, 1>(k, D / 2, q, out, k0);
      }
    }
  }

  void values(const uint32_t* vt0, int64_t D, int64_t n0, int64_t n1, const uint32_t* pp,
              const uint32_t* pp1, float* o0, float* o1, bool on0, bool on1, bool two) {
    const int64_t n[2] = {n0, n1};
    const uint32_t* p[2] = {pp, pp1};
    float* o[2] = {o0, o1};
    const bool on[2] = {on0, on1};
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      if (two) {
        dot_values_block<8, 2>(vt0, D, n, p, o, on, d0);
        dot_values_block<8, 2>(vt0, D, n, p, o, on, d0 + 8);
      } else {
        dot_values_block<16, 1>(vt0, D, n, p, o, on, d0);
      }
    }
  }
};

}  // namespace tm
#endif
