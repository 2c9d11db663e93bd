// tokenmill CPU kernels: the softmax-weighted sum of int4 V rows (kv_pages.h: (q - 7.5) * s per
// token) with integer dot products, on AVX-512 (attention_quant.cpp; other builds widen the
// codes to float). Two rows' codes are interleaved per channel as int16 pairs and multiplied by
// their weights (softmax weight x the row's scale) rounded to int16 on the chunk's own scale
// (2**15 levels), summed by VPDPWSSD (madd + add without VNNI) into int32; each chunk's sums go
// to float once. The interleave (unpacklo / unpackhi of 16-bit lanes, within 128-bit lanes)
// leaves channels permuted in the accumulators: unpermute() puts them back.
#pragma once

#if defined(TM_ISA_AVX512) || defined(TM_ISA_AVX512_BF16)
#define TM_VALUES_INT4 1
#include "kv_pages.h"

namespace tm {

inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {
#ifdef TM_ISA_AVX512_BF16
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// Accumulator vector v = (k, half, u) of D / 16 (k: 32-byte chunk of a row's codes; half: low
// or high nibbles; u: unpacklo or unpackhi): its lane d holds this channel
inline int64_t channel_of(int64_t v, int64_t d, int64_t D) {
  const int64_t k = v / 4, half = v / 2 % 2, u = v % 2;
  return half * D / 2 + 32 * k + 8 * (d / 4) + 4 * u + d % 4;
}

// acc[g][v] (float, permuted) += sum over rows j of w[g][j] * code_j, for G <= 16 / NV heads,
// rows (<= 16) at cache slots s0 + j of KV head h; w rows `ldw` apart
template <int NV>
void values_int4_heads(const QuantPages& V, int64_t s0, int64_t rows, int64_t h, const float* w,
                       int64_t ldw, int64_t G, float* acc) {
  constexpr int kMaxG = 16 / NV;
  __m512i sum[kMaxG][NV];
  uint32_t pairs[kMaxG][8];  // per head, per row pair: (w16[j], w16[j + 1])
  float unit[kMaxG];
  for (int64_t g = 0; g < G; ++g) {
    float top = 0.f, wr[16] = {};
    for (int64_t j = 0; j < rows; ++j) top = std::max(top, wr[j] = w[g * ldw + j] * vhalf(V.scale[(s0 + j) * V.Hk + h]));
    const float a = top > 0.f ? 32767.f / top : 0.f;
    unit[g] = top / 32767.f;
    for (int64_t j = 0; j < rows; j += 2) {
      const auto lo = static_cast<uint16_t>(static_cast<int16_t>(std::nearbyint(wr[j] * a)));
      const auto hi = static_cast<uint16_t>(static_cast<int16_t>(std::nearbyint(wr[j + 1] * a)));
      pairs[g][j / 2] = lo | uint32_t{hi} << 16;
    }
    for (int v = 0; v < NV; ++v) sum[g][v] = _mm512_setzero_si512();
  }
  const int64_t D = V.D;
  for (int64_t j = 0; j < rows; j += 2) {
    const uint8_t* r0 = V.codes_at((s0 + j) * V.Hk + h);
    const uint8_t* r1 = j + 1 < rows ? V.codes_at((s0 + j + 1) * V.Hk + h) : r0;  // weight 0
    __m512i x[NV];
    for (int k = 0; k < NV / 4; ++k) {
      const __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32 * k)));
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 32 * k)));
      const __m512i nib = _mm512_set1_epi16(0xF);
      const __m512i alo = _mm512_and_si512(a, nib), blo = _mm512_and_si512(b, nib);
      const __m512i ahi = _mm512_srli_epi16(a, 4), bhi = _mm512_srli_epi16(b, 4);
      x[4 * k] = _mm512_unpacklo_epi16(alo, blo);
      x[4 * k + 1] = _mm512_unpackhi_epi16(alo, blo);
      x[4 * k + 2] = _mm512_unpacklo_epi16(ahi, bhi);
      x[4 * k + 3] = _mm512_unpackhi_epi16(ahi, bhi);
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512i wp = _mm512_set1_epi32(static_cast<int>(pairs[g][j / 2]));
      for (int v = 0; v < NV; ++v) sum[g][v] = dot_pairs(sum[g][v], x[v], wp);
    }
  }
  (void)D;
  for (int64_t g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) {
      float* a = acc + (g * NV + v) * 16;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[g][v]), _mm512_set1_ps(unit[g]), _mm512_loadu_ps(a)));
    }
}

// The rows' weighted codes for `group` heads (w: softmax weights, head g's row at w + g * ldw)
// into permuted float accumulators (group x D), and each head's sum of weight x scale into
// wsum (for the codes' offset 7.5)
inline bool values_int4(const QuantPages& V, int64_t s0, int64_t rows, int64_t h, const float* w,
                        int64_t ldw, int64_t group, float* acc, float* wsum) {
  const int64_t D = V.D;
  if (D % 64 || D > 256) return false;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < rows; ++j) wsum[g] += w[g * ldw + j] * vhalf(V.scale[(s0 + j) * V.Hk + h]);
  const int64_t nv = D / 16, per = 16 / nv;
  for (int64_t g0 = 0; g0 < group; g0 += per) {
    const int64_t G = std::min(per, group - g0);
    const float* wg = w + g0 * ldw;
    float* ag = acc + g0 * D;
    if (nv == 4) values_int4_heads<4>(V, s0, rows, h, wg, ldw, G, ag);
    else if (nv == 8) values_int4_heads<8>(V, s0, rows, h, wg, ldw, G, ag);
    else values_int4_heads<16>(V, s0, rows, h, wg, ldw, G, ag);
  }
  return true;
}

// permuted accumulators (D floats) -> natural channel order, minus 7.5 x wsum
inline void unpermute_int4(const float* perm, int64_t D, float wsum, float* out) {
  for (int64_t v = 0; v < D / 16; ++v)
    for (int64_t d = 0; d < 16; ++d) out[channel_of(v, d, D)] = perm[v * 16 + d] - 7.5f * wsum;
}

}  // namespace tm
#endif
