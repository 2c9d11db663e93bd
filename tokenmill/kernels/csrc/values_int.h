// tokenmill CPU kernels: the softmax-weighted sum of int8 or int4 V rows (kv_pages.h: q * s, or
// (q - 7.5) * s, per token) with integer dot products, on x86 (attention_quant.cpp; other
// builds widen the codes to float). Two rows' codes are interleaved per channel as int16 pairs
// (vpairs) and multiplied by their weights (softmax weight x the row's scale) rounded to int16
// on the chunk's own scale (2**15 levels), summed by vdot16 (VPDPWSSD with VNNI, else VPMADDWD
// + add) into int32; each chunk's sums go to float once. The interleave (16-bit lanes, within
// 128-bit lanes) leaves channels permuted in the accumulators: unpermute_values() puts them
// back. One AVX2 VPMADDWD sums two rows of 8 channels, where the float path converts both rows
// and needs two FMAs: on AVX2 (Zen 3, GQA 3, rows in L2) the passes took 3.7 ns a row and KV
// head against 9.5 for widening to float and summing.
#pragma once

#if defined(TM_ISA_AVX512) || defined(TM_ISA_AVX512_BF16) || defined(TM_ISA_AVX2)
#define TM_VALUES_INT 1
#include "attention_common.h"
#include "kv_pages.h"

namespace tm {

// Accumulator vector v of D / kLanes: int4 (k, half, u) (k: 2 x kLanes-byte chunk of a row's
// codes; half: low or high nibbles; u: vpairs' low or high), int8 (k, u): its lane d holds
// this channel
inline int64_t channel_of(bool int4, int64_t v, int64_t d, int64_t D) {
  const int64_t k = int4 ? v / 4 : v / 2, half = int4 ? v / 2 % 2 : 0, u = v % 2;
  return half * D / 2 + 2 * kLanes * k + 8 * (d / 4) + 4 * u + d % 4;
}

// w16[g][j] = the rows' weights (w: head g's at w + g * ldw) times their scales rs, rounded to
// int16 on each head's own scale: unit[g] = the largest / 32767 (weights are >= 0); zeros
// from `rows` on. wsum (int4's offset): += the weights times the scales, unrounded.
template <int G>
void weights_i16(const float* w, int64_t ldw, int64_t rows, const float* rs,
                 int16_t (*w16)[kRows], float* unit, float* wsum) {
  constexpr int kVecs = kRows / kLanes;
  for (int g = 0; g < G; ++g) {
    vec x[kVecs], mx = vzero();
    for (int i = 0; i < kVecs; ++i) {
      const int64_t n = rows - i * kLanes;
      const float* wi = w + g * ldw + i * kLanes;
      const vec wv = n >= kLanes ? vload(wi) : n > 0 ? vload_part(wi, n) : vzero();
      x[i] = vmul(wv, vload(rs + i * kLanes)), mx = vmax(mx, x[i]);
    }
    if (wsum) {
      vec t = x[0];
      for (int i = 1; i < kVecs; ++i) t = vadd(t, x[i]);
      wsum[g] += vsum(t);
    }
    const float top = vhmax(mx);
    unit[g] = top / 32767.f;
    const vec a = vset1(top > 0.f ? 32767.f / top : 0.f);
    for (int i = 0; i < kVecs; ++i) vstore_i16(w16[g] + i * kLanes, vmul(x[i], a));
  }
}

// acc[g][v0 .. v0 + P) (float, permuted; NV accumulators a head) += sum over rows j of
// w16[g][j] code_j, for G heads, rows (<= kRows) at cache slots s0 + j of KV head h. P = 4:
// int8 two chunks of codes, int4 one chunk (its low and high nibbles); P = 2: one chunk, int4
// half of one
template <int P, int G, bool kInt4, bool kHigh = false>  // kHigh: P = 2, int4's high nibbles
void values_pass(const QuantPages& V, int64_t s0, int64_t rows, int64_t h,
                 const int16_t (*w16)[kRows], const float* unit, int64_t v0, int64_t NV,
                 float* acc) {
  static_assert(P == 2 || P == 4, "a pass takes two or four accumulators a head");
  ivec sum[G][P];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < P; ++v) sum[g][v] = izero();
  const int64_t stride = V.Hk * V.code_bytes();  // from one cache row to the next
  const uint8_t* first = V.codes_at(s0 * V.Hk + h) + (kInt4 ? v0 / 4 : v0 / 2) * 2 * kLanes;
  auto pair = [&](int64_t j, const uint8_t* r0, const uint8_t* r1) {  // rows j, j + 1
    i16x x[P];
    if constexpr (kInt4) {
      i16x alo, ahi, blo, bhi;
      vcodes_4(r0, alo, ahi);
      vcodes_4(r1, blo, bhi);
      if constexpr (P == 2) {
        if constexpr (kHigh) vpairs(ahi, bhi, x[0], x[1]);
        else vpairs(alo, blo, x[0], x[1]);
      } else {
        vpairs(alo, blo, x[0], x[1]);
        vpairs(ahi, bhi, x[2], x[3]);
      }
    } else {
      for (int c = 0; c < P / 2; ++c)
        vpairs(vcodes_i8(reinterpret_cast<const int8_t*>(r0 + 2 * kLanes * c)),
               vcodes_i8(reinterpret_cast<const int8_t*>(r1 + 2 * kLanes * c)), x[2 * c], x[2 * c + 1]);
    }
    for (int g = 0; g < G; ++g) {
      const i16x wp = vbcast_pair(w16[g] + j);  // (w16[j], w16[j + 1]): row j in the low half
      for (int v = 0; v < P; ++v) sum[g][v] = vdot16(sum[g][v], x[v], wp);
    }
  };
  if (rows == kRows) {  // a whole chunk: the loop's bounds are known
    for (int64_t j = 0; j < kRows; j += 2) pair(j, first + j * stride, first + (j + 1) * stride);
  } else {
    int64_t j = 0;
    for (; j + 1 < rows; j += 2) pair(j, first + j * stride, first + (j + 1) * stride);
    if (j < rows) pair(j, first + j * stride, first + j * stride);  // the second's weight is 0
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < P; ++v) {
      float* a = acc + (g * NV + v0 + v) * kLanes;
      vstore(a, vfma(vcvt_i32(sum[g][v]), vset1(unit[g]), vload(a)));
    }
}

// A pass: kPassVecs accumulators of each of up to kPassHeads heads. AVX2's 16 registers
// hold two of four heads (four accumulators of three spilled: 1.2x slower on a Zen 3); AVX-512's
// 32 four of four. A build may set both (tests build AVX2 with AVX-512's, which must give the
// same bits: the sums are integers).
#ifndef TM_VALUES_PASS
#ifdef TM_ISA_AVX2
#define TM_VALUES_PASS 2
#else
#define TM_VALUES_PASS 4
#endif
#endif
constexpr int kPassVecs = TM_VALUES_PASS;
constexpr int64_t kPassHeads = 4;

// G heads (G <= kPassHeads), every accumulator of each
template <int G, bool kInt4>
void values_heads(const QuantPages& V, int64_t s0, int64_t rows, int64_t h, const float* w,
                  int64_t ldw, const float* rs, float* acc, float* wsum) {
  alignas(64) int16_t w16[G][kRows];
  float unit[G];
  weights_i16<G>(w, ldw, rows, rs, w16, unit, kInt4 ? wsum : nullptr);
  const int64_t NV = V.D / kLanes;
  for (int64_t v0 = 0; v0 < NV; v0 += 4) {  // a chunk of int4 codes: low, then high nibbles
    values_pass<kPassVecs, G, kInt4>(V, s0, rows, h, w16, unit, v0, NV, acc);
    if constexpr (kPassVecs == 2)
      values_pass<2, G, kInt4, kInt4>(V, s0, rows, h, w16, unit, v0 + 2, NV, acc);
  }
}

// The rows' weighted codes for `group` heads (w: softmax weights, head g's row at w + g * ldw)
// into permuted float accumulators (group x D), and (int4) each head's sum of weight x scale
// into wsum (for the offset 7.5); int8 or int4 V (D a multiple of 64, at most 256)
template <bool kInt4>
void values_int(const QuantPages& V, int64_t s0, int64_t rows, int64_t h, const float* w,
                int64_t ldw, int64_t group, float* acc, float* wsum) {
  const int64_t D = V.D;
  alignas(64) float rs[kRows] = {};  // the rows' scales
  for (int64_t j = 0; j < rows; ++j) rs[j] = vhalf(V.scale[(s0 + j) * V.Hk + h]);
  const int64_t per = kPassHeads;
  for (int64_t g0 = 0; g0 < group; g0 += per) {
    const float* wg = w + g0 * ldw;
    float *ag = acc + g0 * D, *sg = wsum + g0;
    switch (std::min(per, group - g0)) {
      case 1: values_heads<1, kInt4>(V, s0, rows, h, wg, ldw, rs, ag, sg); break;
      case 2: values_heads<2, kInt4>(V, s0, rows, h, wg, ldw, rs, ag, sg); break;
      case 3: values_heads<3, kInt4>(V, s0, rows, h, wg, ldw, rs, ag, sg); break;
      default: values_heads<4, kInt4>(V, s0, rows, h, wg, ldw, rs, ag, sg);
    }
  }
}

// permuted accumulators (D floats) -> natural channel order (int4: minus 7.5 x wsum)
inline void unpermute_values(bool int4, const float* perm, int64_t D, float wsum, float* out) {
  const float off = int4 ? 7.5f * wsum : 0.f;
  for (int64_t v = 0; v < D / kLanes; ++v)
    for (int64_t d = 0; d < kLanes; ++d) out[channel_of(int4, v, d, D)] = perm[v * kLanes + d] - off;
}

}  // namespace tm
#endif
