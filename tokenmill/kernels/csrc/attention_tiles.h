// Micro-kernels of the prefill attention tile (included by attention_prefill.cpp): the scores
// of a few query rows against a key tile held transposed, and the probability-weighted sum of
// the tile's value rows into their float32 outputs; float32 FMA everywhere, VDPBF16PS on bf16
// pairs where the CPU has AVX512-BF16.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kKeys = 16;       // keys per step (fewer at a cache block's end)
constexpr int kKeyVecs = kKeys / kLanes;
constexpr int kTileRows = kKeyVecs == 1 ? 8 : 4;  // rows scored (and summed) together
static_assert(kKeys % kLanes == 0, "a key tile is whole vectors");

// A row's scores sr[0:kKeys] against keys [p, p + n) masked (causal at query position qpos,
// window) and turned into exp(s - running max m); updates m and the row's lane sums l[0:kLanes];
// returns the factor that rescales its output so far (0 probabilities and factor 1 when the
// tile is masked for this row).
inline float online_softmax(float* sr, int64_t qpos, int64_t p, int64_t n, int64_t window,
                            float& m, float* l) {
  // the tile's keys this row sees, [lo, hi): causal, inside the window, inside the tile
  const int64_t hi = std::min<int64_t>(n, qpos - p + 1);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, qpos - window + 1 - p) : 0;
  if (hi <= lo) {
    std::fill(sr, sr + kKeys, 0.f);
    return 1.f;
  }
  std::fill(sr, sr + lo, -INFINITY);  // only tiles on the diagonal or the window's edge
  std::fill(sr + hi, sr + kKeys, -INFINITY);
  vec mv = vload(sr);
  for (int u = 1; u < kKeyVecs; ++u) mv = vmax(mv, vload(sr + u * kLanes));
  const float m_old = m;
  // the running max settles early: most tiles raise no lane above it, rescale nothing and need
  // no horizontal max
  const vec mo = vset1(m_old);
  const bool raised = vmask_eq(vmax(mv, mo), mo) != (1 << kLanes) - 1;
  const float m_new = raised ? std::max(m_old, vhmax(mv)) : m_old;
  const float corr = raised ? std::exp(m_old - m_new) : 1.f;
  vec sum = vmul(vload(l), vset1(corr));
  for (int u = 0; u < kKeyVecs; ++u) {
    vec e = vexp(vsub(vload(sr + u * kLanes), vset1(m_new)));
    vstore(sr + u * kLanes, e);
    sum = vadd(sum, e);
  }
  vstore(l, sum);
  m = m_new;
  return corr;
}

// s[i][0:kKeys] = scale * q_i . k_j for R rows (q rows `ld` apart) against the transposed key
// tile kt[d][j]: per d, one key vector load shared by the R rows' broadcasts.
template <int R>
void scores_fma(const float* q, int64_t ld, const float* kt, int64_t D, float scale, float* s) {
  vec a[R][kKeyVecs];
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < kKeyVecs; ++u) a[i][u] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vec k[kKeyVecs];
    for (int u = 0; u < kKeyVecs; ++u) k[u] = vload(kt + d * kKeys + u * kLanes);
    for (int i = 0; i < R; ++i) {
      vec qd = vset1(q[i * ld + d]);
      for (int u = 0; u < kKeyVecs; ++u) a[i][u] = vfma(qd, k[u], a[i][u]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < kKeyVecs; ++u) vstore(s + i * kKeys + u * kLanes, vmul(a[i][u], vset1(scale)));
}

#ifdef TM_ISA_AVX512_BF16
// The same with VDPBF16PS on bf16 pairs: qp[i][d/2] = (q[2d'], q[2d'+1]), kp[d/2][j] the key
// pairs; half the instructions, scaled afterwards (q is not pre-scaled on this path).
template <int R>
void scores_dot(const uint32_t* qp, int64_t ld, const uint32_t* kp, int64_t pairs, float scale,
                float* s) {
  __m512 a[R];
  for (int i = 0; i < R; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < pairs; ++d) {
    __m512bh k = (__m512bh)_mm512_loadu_si512(kp + d * kKeys);
    for (int i = 0; i < R; ++i)
      a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(qp[i * ld + d]), k);
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(s + i * kKeys, _mm512_mul_ps(a[i], _mm512_set1_ps(scale)));
}
#endif

// o[i] = o[i] * corr[i] + sum_j p[i][j] v[j] for R rows (p rows kKeys apart, o rows Dp apart):
// per key, U vectors of its value row serve all R rows (R x U accumulators in registers).
constexpr int kValueRows = kLanes == 16 ? 4 : 2, kValueVecs = 4;

template <int R, int U>
void values_block(const float* p, const float* corr, const float* v, int64_t n, int64_t Dp,
                  int64_t d, float* o) {
  vec a[R][U];
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u) a[i][u] = vmul(vload(o + i * Dp + d + u * kLanes), vset1(corr[i]));
  for (int64_t j = 0; j < n; ++j) {
    vec vj[U];
    for (int u = 0; u < U; ++u) vj[u] = vload(v + j * Dp + d + u * kLanes);
    for (int i = 0; i < R; ++i) {
      vec pj = vset1(p[i * kKeys + j]);
      for (int u = 0; u < U; ++u) a[i][u] = vfma(pj, vj[u], a[i][u]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u) vstore(o + i * Dp + d + u * kLanes, a[i][u]);
}

template <int R>
void values_fma(const float* p, const float* corr, const float* v, int64_t n, int64_t Dp,
                float* o) {
  int64_t d = 0;
  for (; d + kValueVecs * kLanes <= Dp; d += kValueVecs * kLanes)
    values_block<R, kValueVecs>(p, corr, v, n, Dp, d, o);
  for (; d < Dp; d += kLanes) values_block<R, 1>(p, corr, v, n, Dp, d, o);
}

#ifdef TM_ISA_AVX512_BF16
// The same sum by VDPBF16PS: the probabilities rounded to bf16 pairs pp[i][j/2] = (p[j],
// p[j + 1]), as PyTorch's bf16 attention rounds them before its second matmul, against the
// value pairs vp[j/2][d] = (v[j][d], v[j + 1][d]) (rows Dp apart, zero past D and past the
// tile's keys): half the instructions of the float32 sum.
template <int R, int U>
void values_dot_block(const uint32_t* pp, const float* corr, const uint32_t* vp, int64_t pairs,
                      int64_t Dp, int64_t d, float* o) {
  __m512 a[R][U];
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u)
      a[i][u] = _mm512_mul_ps(_mm512_loadu_ps(o + i * Dp + d + u * kLanes), _mm512_set1_ps(corr[i]));
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh vj[U];
    for (int u = 0; u < U; ++u) vj[u] = (__m512bh)_mm512_loadu_si512(vp + j * Dp + d + u * kLanes);
    for (int i = 0; i < R; ++i) {
      __m512bh pj = (__m512bh)_mm512_set1_epi32(pp[i * kKeys / 2 + j]);
      for (int u = 0; u < U; ++u) a[i][u] = _mm512_dpbf16_ps(a[i][u], pj, vj[u]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u) _mm512_storeu_ps(o + i * Dp + d + u * kLanes, a[i][u]);
}

template <int R>
void values_dot(const float* p, const float* corr, const uint32_t* vp, int64_t n, int64_t Dp,
                uint32_t* pp, float* o) {
  static_assert(kKeys == kLanes, "one vector of probabilities per row");
  for (int i = 0; i < R; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + i * kKeys / 2),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + i * kKeys)));
  const int64_t pairs = (n + 1) / 2;
  int64_t d = 0;
  for (; d + kValueVecs * kLanes <= Dp; d += kValueVecs * kLanes)
    values_dot_block<R, kValueVecs>(pp, corr, vp, pairs, Dp, d, o);
  for (; d < Dp; d += kLanes) values_dot_block<R, 1>(pp, corr, vp, pairs, Dp, d, o);
}
#endif

template <int R, typename F>
void for_rows(int64_t rows, const F& f) {  // f.template operator()<r>() for r = rows <= R
  if (rows >= R) return f(std::integral_constant<int, R>());
  if constexpr (R > 1) for_rows<R - 1>(rows, f);
}

}  // namespace tm
