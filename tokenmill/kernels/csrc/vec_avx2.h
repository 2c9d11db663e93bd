// The vector layer on AVX2 + FMA: 8 float32 lanes in a ymm register (see vec.h for the API).
#pragma once

#include <immintrin.h>

#include "common.h"

namespace tm {

constexpr int kLanes = 8;
constexpr const char* kIsa = "avx2";
using vec = __m256;

inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float v) { return _mm256_set1_ps(v); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const bf16* p) {  // widen: the bf16 bits become a float32's top half
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline vec vround_bf16(vec v) {  // to the nearest bf16 (even on ties), kept as float32
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xFFFF0000)));
}
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline void vstore(bf16* p, vec v) {
  __m256i b = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(v)), 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline vec vfloor(vec v) { return _mm256_floor_ps(v); }
inline vec vrint(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }  // to nearest, even on ties
inline vec vexp2i(vec n) {  // 2^n for integral n in the normal range: build the exponent bits
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vec v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + 8);
}
// out[r] = vsum(a[r]) for r < 8: a transpose by horizontal adds
inline void vsum8(const vec* a, float* out) {
  __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}
inline int vmask_eq(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
inline vec vnan_mask(vec v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
inline vec vor(vec a, vec b) { return _mm256_or_ps(a, b); }
inline bool vany(vec mask) { return _mm256_movemask_ps(mask) != 0; }

// A GEMM panel vector pair: 2 x kLanes weights of consecutive output rows. bf16 panels pair
// rows i and kLanes + i in each 32-bit lane, so a shift and a mask widen them.
inline void vload_panel(const float* p, vec& lo, vec& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void vload_panel(const bf16* p, vec& lo, vec& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline float vhalf(uint16_t h) { return _cvtsh_ss(h); }  // IEEE half -> float32

// Quantized codes: kLanes bytes -> kLanes floats (unsigned low / high nibbles, signed bytes).
inline vec vload_lo4(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
}
inline vec vload_hi4(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline vec vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// fp8 e4m3 codes -> floats, exact. A code sign-extended to 16 bits and shifted left by 7 is,
// with bit 14 cleared, the IEEE half of the same sign, exponent and mantissa bits: the value
// times 2**-8 (e4m3's exponent bias is 7, the half's 15), subnormals included; F16C widens it
// and the multiply restores it. Four instructions where vec_avx512.h's way takes seven, and no
// denormal float32 operand.
inline vec vload_fp8(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}

// Integer dot products (see vec_avx512.h): 16 int16, 8 int32 sums.
using i16x = __m256i;
using ivec = __m256i;
inline ivec izero() { return _mm256_setzero_si256(); }
inline i16x vload_i16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void vcodes_4(const uint8_t* p, i16x& lo, i16x& hi) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_and_si256(b, _mm256_set1_epi16(0xF));
  hi = _mm256_srli_epi16(b, 4);
}
inline i16x vcodes_i8(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline i16x vcodes_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline i16x vmul16(i16x a, i16x b) { return _mm256_mullo_epi16(a, b); }  // low 16 bits
inline i16x vodd16(i16x a) { return _mm256_sub_epi16(_mm256_add_epi16(a, a), _mm256_set1_epi16(15)); }  // 2a - 15
inline ivec vdot16(ivec acc, i16x a, i16x b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline vec vcvt_i32(ivec a) { return _mm256_cvtepi32_ps(a); }
inline ivec vload_i32(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vec vload_f16(const uint16_t* p) {  // kLanes IEEE halves -> float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vpairs(i16x a, i16x b, i16x& lo, i16x& hi) {  // (a, b) pairs, within 128-bit lanes
  lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
}
inline i16x vbcast_pair(const int16_t* p) {  // (p[0], p[1]) in every pair
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline void vstore_i16(int16_t* p, vec v) {  // rounded to nearest, saturated
  __m256i i = _mm256_cvtps_epi32(v);
  __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Prefetches as asm statements: GCC deletes a loop of _mm_prefetch calls and nothing else.
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*(const char*)p)); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*(const char*)p)); }
inline void prefetch_nta(const void* p) { asm volatile("prefetchnta %0" : : "m"(*(const char*)p)); }

}  // namespace tm
