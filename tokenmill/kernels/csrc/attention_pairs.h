// Decode attention's weighted value sum on VDPBF16PS (AVX512-BF16, bf16 caches, head_dim a
// multiple of 32; included by attention.cpp). Positions go in pairs (even, odd): each query's
// probabilities are rounded to bf16 pairs, as PyTorch's bf16 attention rounds them before its
// second matmul, and the value rows are interleaved into the same pairs, 32 columns at a time,
// by one unpack each (columns permuted within 128-bit blocks; unpermute() puts them back).
// Pairs are taken at even absolute positions, so a query sums exactly the same pairs in the
// same order whether it attends alone or in a run of rows that starts earlier (the extra
// pairs weigh 0 for it).
#pragma once

#ifdef TM_ISA_AVX512_BF16
#include "tm.h"
#include "vec.h"

namespace tm {

// pairs covering `rows` positions from an odd (odd = 1) or even position
inline int64_t pair_count(int64_t rows, int64_t odd) { return (rows + odd + 1) / 2; }

// pp[0:pairs]: the probabilities p[0:rows] of a chunk's positions as bf16 pairs of positions
// (2m - odd, 2m + 1 - odd), a missing position zero
inline void probability_pairs(const float* p, int64_t rows, int64_t odd, uint32_t* pp) {
  const int64_t count = rows + odd;
  for (int64_t i = 0; i < count; i += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, count - i);
    __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    if (i == 0 && odd) mask &= static_cast<__mmask16>(~1u);  // masked lanes are not read
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, p - odd + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + i / 2), (__m256i)b);
  }
}

// acc[g][col : col + 16U] += sum_m pp[g][m] * (value rows 2m - odd, 2m + 1 - odd)[same
// columns] for Q queries, over the chunk's `rows` value rows (stride `stride`; a missing row of
// a pair is zero): each pair of rows is loaded and interleaved once for all the queries, Q x U
// accumulators in registers
template <int Q, int U>
void pair_sums(const uint32_t* const* pp, const bf16* v, int64_t stride, int64_t rows,
               int64_t odd, int64_t col, float* const* acc) {
  static_assert(U % 2 == 0, "whole 32-column groups");
  __m512 a[Q][U];
  for (int g = 0; g < Q; ++g)
    for (int u = 0; u < U; ++u) a[g][u] = _mm512_loadu_ps(acc[g] + col + u * kLanes);
  const int64_t pairs = pair_count(rows, odd);
  auto load = [&](int64_t r, int64_t i) {
    return r >= 0 && r < rows ? _mm512_loadu_si512(v + r * stride + col + i) : _mm512_setzero_si512();
  };
  for (int64_t m = 0; m < pairs; ++m) {
    __m512bh x[U];
    for (int u = 0; u < U; u += 2) {
      const __m512i lo = load(2 * m - odd, u * kLanes), hi = load(2 * m + 1 - odd, u * kLanes);
      x[u] = (__m512bh)_mm512_unpacklo_epi16(lo, hi);
      x[u + 1] = (__m512bh)_mm512_unpackhi_epi16(lo, hi);
    }
    for (int g = 0; g < Q; ++g) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g][m]));
      for (int u = 0; u < U; ++u) a[g][u] = _mm512_dpbf16_ps(a[g][u], s, x[u]);
    }
  }
  for (int g = 0; g < Q; ++g)
    for (int u = 0; u < U; ++u) _mm512_storeu_ps(acc[g] + col + u * kLanes, a[g][u]);
}

// pair_sums over all D columns for Q <= 4 queries
template <int Q>
void pair_sums_all(const uint32_t* const* pp, const bf16* v, int64_t stride, int64_t rows,
                   int64_t odd, int64_t D, float* const* acc) {
  int64_t col = 0;
  for (; col + 4 * kLanes <= D; col += 4 * kLanes) pair_sums<Q, 4>(pp, v, stride, rows, odd, col, acc);
  for (; col < D; col += 2 * kLanes) pair_sums<Q, 2>(pp, v, stride, rows, odd, col, acc);
}

// The columns of a pair sum back in order: of each 32, unpacklo held 0-3, 8-11, 16-19, 24-27
// and unpackhi 4-7, 12-15, 20-23, 28-31
inline void unpermute(const float* acc, int64_t D, float* out) {
  for (int64_t i = 0; i < D; i += 32)
    for (int l = 0; l < 16; ++l) {
      out[i + l / 4 * 8 + l % 4] = acc[i + l];
      out[i + l / 4 * 8 + 4 + l % 4] = acc[i + 16 + l];
    }
}

}  // namespace tm
#endif
