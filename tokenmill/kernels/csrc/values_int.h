// tokenmill CPU kernels: the softmax-weighted sum of int8 or int4 V rows (kv_pages.h: q * s, or
// (q - 7.5) * s, per token) with integer dot products, on AVX-512 (attention_quant.cpp; other
// builds widen the codes to float). Two rows' codes are interleaved per channel as int16 pairs
// and multiplied by their weights (softmax weight x the row's scale) rounded to int16 on the
// chunk's own scale (2**15 levels), summed by VPDPWSSD (madd + add without VNNI) into int32;
// each chunk's sums go to float once. The interleave (unpacklo / unpackhi of 16-bit lanes,
// within 128-bit lanes) leaves channels permuted in the accumulators: unpermute_values() puts
// them back.
#pragma once

#if defined(TM_ISA_AVX512) || defined(TM_ISA_AVX512_BF16)
#define TM_VALUES_INT 1
#include "kv_pages.h"

namespace tm {

inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {
#ifdef TM_ISA_AVX512_BF16
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// Accumulator vector v of D / 16: int4 (k, half, u) (k: 32-byte chunk of a row's codes; half:
// low or high nibbles; u: unpacklo or unpackhi), int8 (k, u): its lane d holds this channel
inline int64_t channel_of(bool int4, int64_t v, int64_t d, int64_t D) {
  const int64_t k = int4 ? v / 4 : v / 2, half = int4 ? v / 2 % 2 : 0, u = v % 2;
  return half * D / 2 + 32 * k + 8 * (d / 4) + 4 * u + d % 4;
}

// acc[g][v] (float, permuted) += sum over rows j of w[g][j] rs[j] code_j, for G <= 16 / NV
// heads, rows (<= 16) at cache slots s0 + j of KV head h (rs: their scales, 16 floats, 0 past
// `rows`); w rows `ldw` apart
template <int NV, bool kInt4>
void values_heads(const QuantPages& V, int64_t s0, int64_t rows, int64_t h, const float* w,
                  int64_t ldw, const float* rs, int64_t G, float* acc) {
  constexpr int kMaxG = 16 / NV;
  __m512i sum[kMaxG][NV];
  alignas(64) int16_t w16[kMaxG][16];  // per head, per row; row pairs read as one uint32
  float unit[kMaxG];
  const __m512 r = _mm512_loadu_ps(rs);
  for (int64_t g = 0; g < G; ++g) {
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << rows) - 1), w + g * ldw), r);
    const float top = _mm512_reduce_max_ps(x);  // weights are >= 0
    unit[g] = top / 32767.f;
    const __m512 a = _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w16[g]), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, a))));
    for (int v = 0; v < NV; ++v) sum[g][v] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < rows; j += 2) {
    const uint8_t* r0 = V.codes_at((s0 + j) * V.Hk + h);
    const uint8_t* r1 = j + 1 < rows ? V.codes_at((s0 + j + 1) * V.Hk + h) : r0;  // weight 0
    __m512i x[NV];
    auto load = [](const uint8_t* p) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return kInt4 ? _mm512_cvtepu8_epi16(b) : _mm512_cvtepi8_epi16(b);
    };
    for (int k = 0; k < (kInt4 ? NV / 4 : NV / 2); ++k) {
      const __m512i a = load(r0 + 32 * k), b = load(r1 + 32 * k);
      if constexpr (kInt4) {
        const __m512i nib = _mm512_set1_epi16(0xF);
        const __m512i alo = _mm512_and_si512(a, nib), blo = _mm512_and_si512(b, nib);
        const __m512i ahi = _mm512_srli_epi16(a, 4), bhi = _mm512_srli_epi16(b, 4);
        x[4 * k] = _mm512_unpacklo_epi16(alo, blo);
        x[4 * k + 1] = _mm512_unpackhi_epi16(alo, blo);
        x[4 * k + 2] = _mm512_unpacklo_epi16(ahi, bhi);
        x[4 * k + 3] = _mm512_unpackhi_epi16(ahi, bhi);
      } else {
        x[2 * k] = _mm512_unpacklo_epi16(a, b);
        x[2 * k + 1] = _mm512_unpackhi_epi16(a, b);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      int32_t pair;
      std::memcpy(&pair, w16[g] + j, 4);  // (w16[j], w16[j + 1]): row j in the low half
      const __m512i wp = _mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) sum[g][v] = dot_pairs(sum[g][v], x[v], wp);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) {
      float* a = acc + (g * NV + v) * 16;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[g][v]), _mm512_set1_ps(unit[g]), _mm512_loadu_ps(a)));
    }
}

// The rows' weighted codes for `group` heads (w: softmax weights, head g's row at w + g * ldw)
// into permuted float accumulators (group x D), and each head's sum of weight x scale into
// wsum (for int4's offset 7.5); int8 or int4 V (D a multiple of 64, at most 256)
template <bool kInt4>
void values_int(const QuantPages& V, int64_t s0, int64_t rows, int64_t h, const float* w,
                int64_t ldw, int64_t group, float* acc, float* wsum) {
  const int64_t D = V.D;
  alignas(64) float rs[16] = {};  // the rows' scales
  for (int64_t j = 0; j < rows; ++j) rs[j] = vhalf(V.scale[(s0 + j) * V.Hk + h]);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < rows; ++j) wsum[g] += w[g * ldw + j] * rs[j];
  const int64_t nv = D / 16, per = 16 / nv;
  for (int64_t g0 = 0; g0 < group; g0 += per) {
    const int64_t G = std::min(per, group - g0);
    const float* wg = w + g0 * ldw;
    float* ag = acc + g0 * D;
    if (nv == 4) values_heads<4, kInt4>(V, s0, rows, h, wg, ldw, rs, G, ag);
    else if (nv == 8) values_heads<8, kInt4>(V, s0, rows, h, wg, ldw, rs, G, ag);
    else values_heads<16, kInt4>(V, s0, rows, h, wg, ldw, rs, G, ag);
  }
}

// permuted accumulators (D floats) -> natural channel order (int4: minus 7.5 x wsum)
inline void unpermute_values(bool int4, const float* perm, int64_t D, float wsum, float* out) {
  const float off = int4 ? 7.5f * wsum : 0.f;
  for (int64_t v = 0; v < D / 16; ++v)
    for (int64_t d = 0; d < 16; ++d) out[channel_of(int4, v, d, D)] = perm[v * 16 + d] - off;
}

}  // namespace tm
#endif
