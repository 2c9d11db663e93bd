// The vector layer on AVX-512 (F, BW, VL, DQ): 16 float32 lanes in a zmm register (see vec.h).
#pragma once

#include <immintrin.h>

#include "common.h"

namespace tm {

constexpr int kLanes = 16;
#if defined(TM_ISA_AMX)  // built with TM_ISA_AVX512_BF16 too: that build plus AMX tiles
constexpr const char* kIsa = "amx";
#elif defined(TM_ISA_AVX512_BF16)
constexpr const char* kIsa = "avx512_bf16";
#else
constexpr const char* kIsa = "avx512";
#endif
using vec = __m512;

inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float v) { return _mm512_set1_ps(v); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const bf16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#ifdef __AVX512BF16__  // one VCVTNEPS2BF16: round to nearest even (NaN stays NaN)
inline vec vround_bf16(vec v) {
  __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}
inline void vstore(bf16* p, vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
#else
inline vec vround_bf16(vec v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore(bf16* p, vec v) {
  __m512i b = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}
#endif
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }

inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline vec vfloor(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vrint(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// t - floor(t) (one VREDUCEPS) and y x 2^floor(t) (one VSCALEFPS): vec.h's vexp2
#define TM_VEC_LDEXP
inline vec vfrac(vec t) { return _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vldexp(vec y, vec t) { return _mm512_scalef_ps(y, t); }
// 1 / d: VRCP14PS and one Newton step (within an ulp or two of the division, ~10x its throughput)
inline vec vrecip(vec d) {
  const vec r = _mm512_rcp14_ps(d);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r);
}
inline vec vexp2i(vec n) {
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}

inline float vsum(vec v) {  // the two halves added, then the AVX2 reduction
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vec v) { return _mm512_reduce_max_ps(v); }
inline __m256 fold(vec v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline void vsum8(const vec* a, float* out) {
  __m256 s01 = _mm256_hadd_ps(fold(a[0]), fold(a[1])), s23 = _mm256_hadd_ps(fold(a[2]), fold(a[3]));
  __m256 s45 = _mm256_hadd_ps(fold(a[4]), fold(a[5])), s67 = _mm256_hadd_ps(fold(a[6]), fold(a[7]));
  __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}
inline int vmask_eq(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline vec vnan_mask(vec v) {  // all-ones lanes where v is NaN
  return _mm512_castsi512_ps(_mm512_movm_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)));
}
inline vec vor(vec a, vec b) { return _mm512_or_ps(a, b); }
inline bool vany(vec mask) { return _mm512_movepi32_mask(_mm512_castps_si512(mask)) != 0; }

inline void vload_panel(const float* p, vec& lo, vec& hi) {
  lo = _mm512_loadu_ps(p);
  hi = _mm512_loadu_ps(p + 16);
}
inline void vload_panel(const bf16* p, vec& lo, vec& hi) {
  __m512i v = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline float vhalf(uint16_t h) { return _cvtsh_ss(h); }  // IEEE half -> float32

// Quantized codes: kLanes bytes -> kLanes floats (unsigned low / high nibbles, signed bytes).
inline vec vload_lo4(const uint8_t* p) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
}
inline vec vload_hi4(const uint8_t* p) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline vec vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// fp8 e4m3 codes: kLanes bytes -> floats. The 7 magnitude bits land on float32's exponent and
// mantissa, a multiply by 2**120 moves the bias from 127 to 7 (subnormals included), the sign
// bit goes back on top.
inline vec vload_fp8(const uint8_t* p) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
  __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  vec f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

// Integer dot products (attention on quantized pages): i16x holds 2 x kLanes int16, ivec kLanes
// int32 sums; vdot16 adds the products a[i] * b[i] into acc (VPDPWSSD where there is VNNI).
using i16x = __m512i;
using ivec = __m512i;
inline ivec izero() { return _mm512_setzero_si512(); }
inline i16x vload_i16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline void vcodes_4(const uint8_t* p, i16x& lo, i16x& hi) {  // 2 x kLanes bytes -> nibbles
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo = _mm512_and_si512(b, _mm512_set1_epi16(0xF));
  hi = _mm512_srli_epi16(b, 4);
}
inline i16x vcodes_i8(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline i16x vcodes_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline i16x vmul16(i16x a, i16x b) { return _mm512_mullo_epi16(a, b); }  // low 16 bits
inline i16x vodd16(i16x a) { return _mm512_sub_epi16(_mm512_add_epi16(a, a), _mm512_set1_epi16(15)); }  // 2a - 15
inline ivec vdot16(ivec acc, i16x a, i16x b) {
#ifdef TM_ISA_AVX512_BF16  // that build has AVX512-VNNI too
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
inline vec vcvt_i32(ivec a) { return _mm512_cvtepi32_ps(a); }
inline ivec vload_i32(const int32_t* p) { return _mm512_loadu_si512(p); }
inline vec vload_f16(const uint16_t* p) {  // kLanes IEEE halves -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vpairs(i16x a, i16x b, i16x& lo, i16x& hi) {  // (a, b) pairs, within 128-bit lanes
  lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
}
inline i16x vbcast_pair(const int16_t* p) {  // (p[0], p[1]) in every pair
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline void vstore_i16(int16_t* p, vec v) {  // rounded to nearest, saturated
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
}

inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*(const char*)p)); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*(const char*)p)); }
inline void prefetch_nta(const void* p) { asm volatile("prefetchnta %0" : : "m"(*(const char*)p)); }

}  // namespace tm
