// The vector layer on ARM NEON (AArch64 Advanced SIMD): 8 float32 lanes in two q registers, so
// kernels tile as on AVX2 (see vec.h for the API).
#pragma once

#include <arm_neon.h>

#include "common.h"

namespace tm {

constexpr int kLanes = 8;
constexpr const char* kIsa = "neon";
struct vec {
  float32x4_t a, b;
};

inline vec vzero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
inline vec vset1(float v) { return {vdupq_n_f32(v), vdupq_n_f32(v)}; }
inline vec vload(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline float32x4_t widen4(uint16x4_t v) { return vreinterpretq_f32_u32(vshll_n_u16(v, 16)); }
inline vec vload(const bf16* p) {
  uint16x8_t v = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  return {widen4(vget_low_u16(v)), widen4(vget_high_u16(v))};
}
inline float32x4_t round4(float32x4_t v) {
  uint32x4_t b = vreinterpretq_u32_f32(v);
  uint32x4_t lsb = vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1));
  b = vaddq_u32(b, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
  return vreinterpretq_f32_u32(vandq_u32(b, vdupq_n_u32(0xFFFF0000u)));
}
inline vec vround_bf16(vec v) { return {round4(v.a), round4(v.b)}; }
inline void vstore(float* p, vec v) {
  vst1q_f32(p, v.a);
  vst1q_f32(p + 4, v.b);
}
inline void vstore(bf16* p, vec v) {
  uint16x4_t lo = vshrn_n_u32(vreinterpretq_u32_f32(round4(v.a)), 16);
  uint16x4_t hi = vshrn_n_u32(vreinterpretq_u32_f32(round4(v.b)), 16);
  vst1q_u16(reinterpret_cast<uint16_t*>(p), vcombine_u16(lo, hi));
}

inline vec vadd(vec x, vec y) { return {vaddq_f32(x.a, y.a), vaddq_f32(x.b, y.b)}; }
inline vec vsub(vec x, vec y) { return {vsubq_f32(x.a, y.a), vsubq_f32(x.b, y.b)}; }
inline vec vmul(vec x, vec y) { return {vmulq_f32(x.a, y.a), vmulq_f32(x.b, y.b)}; }
inline vec vdiv(vec x, vec y) { return {vdivq_f32(x.a, y.a), vdivq_f32(x.b, y.b)}; }
inline vec vmax(vec x, vec y) { return {vmaxnmq_f32(x.a, y.a), vmaxnmq_f32(x.b, y.b)}; }
inline vec vmin(vec x, vec y) { return {vminnmq_f32(x.a, y.a), vminnmq_f32(x.b, y.b)}; }
inline vec vfma(vec x, vec y, vec c) { return {vfmaq_f32(c.a, x.a, y.a), vfmaq_f32(c.b, x.b, y.b)}; }
inline vec vfnma(vec x, vec y, vec c) { return {vfmsq_f32(c.a, x.a, y.a), vfmsq_f32(c.b, x.b, y.b)}; }
inline vec vfloor(vec v) { return {vrndmq_f32(v.a), vrndmq_f32(v.b)}; }
inline vec vrint(vec v) { return {vrndnq_f32(v.a), vrndnq_f32(v.b)}; }
inline float32x4_t exp2i4(float32x4_t n) {
  int32x4_t e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
  return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
inline vec vexp2i(vec n) { return {exp2i4(n.a), exp2i4(n.b)}; }

inline float vsum(vec v) { return vaddvq_f32(vaddq_f32(v.a, v.b)); }
inline float vhmax(vec v) { return vmaxvq_f32(vmaxq_f32(v.a, v.b)); }
inline void vsum8(const vec* a, float* out) { for (int r = 0; r < 8; ++r) out[r] = vsum(a[r]); }
inline int vmask_eq(vec x, vec y) {
  alignas(16) uint32_t m[8];
  vst1q_u32(m, vceqq_f32(x.a, y.a));
  vst1q_u32(m + 4, vceqq_f32(x.b, y.b));
  int bits = 0;
  for (int i = 0; i < 8; ++i) bits |= (m[i] != 0) << i;
  return bits;
}
inline vec vnan_mask(vec v) {  // NaN != NaN: lanes that fail x == x
  return {vreinterpretq_f32_u32(vmvnq_u32(vceqq_f32(v.a, v.a))),
          vreinterpretq_f32_u32(vmvnq_u32(vceqq_f32(v.b, v.b)))};
}
inline vec vor(vec x, vec y) {
  return {vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(x.a), vreinterpretq_u32_f32(y.a))),
          vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(x.b), vreinterpretq_u32_f32(y.b)))};
}
inline bool vany(vec mask) {
  uint32x4_t m = vorrq_u32(vreinterpretq_u32_f32(mask.a), vreinterpretq_u32_f32(mask.b));
  return vmaxvq_u32(m) != 0;
}

inline void vload_panel(const float* p, vec& lo, vec& hi) {
  lo = vload(p);
  hi = vload(p + 8);
}
inline void vload_panel(const bf16* p, vec& lo, vec& hi) {  // 32-bit lane i: (row i, row 8 + i)
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
  uint32x4_t w0 = vld1q_u32(w), w1 = vld1q_u32(w + 4), mask = vdupq_n_u32(0xFFFF0000u);
  lo = {vreinterpretq_f32_u32(vshlq_n_u32(w0, 16)), vreinterpretq_f32_u32(vshlq_n_u32(w1, 16))};
  hi = {vreinterpretq_f32_u32(vandq_u32(w0, mask)), vreinterpretq_f32_u32(vandq_u32(w1, mask))};
}

inline float vhalf(uint16_t h) {
  __fp16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}  // IEEE half -> float32

// Quantized codes: kLanes bytes -> kLanes floats (unsigned low / high nibbles, signed bytes).
inline vec u8x8_to_vec(uint8x8_t b) {
  uint16x8_t w = vmovl_u8(b);
  return {vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(w)))};
}
inline vec vload_lo4(const uint8_t* p) { return u8x8_to_vec(vand_u8(vld1_u8(p), vdup_n_u8(0xF))); }
inline vec vload_hi4(const uint8_t* p) { return u8x8_to_vec(vshr_n_u8(vld1_u8(p), 4)); }
inline vec vload_i8(const int8_t* p) {
  int16x8_t w = vmovl_s8(vld1_s8(p));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)))};
}

// fp8 e4m3 codes -> floats (see vec_avx512.h)
inline float32x4_t fp8x4(uint32x4_t b) {
  uint32x4_t mag = vshlq_n_u32(vandq_u32(b, vdupq_n_u32(0x7F)), 20);
  uint32x4_t sign = vshlq_n_u32(vandq_u32(b, vdupq_n_u32(0x80)), 24);
  float32x4_t f = vmulq_f32(vreinterpretq_f32_u32(mag), vdupq_n_f32(0x1p120f));
  return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(f), sign));
}
inline vec vload_fp8(const uint8_t* p) {
  uint16x8_t w = vmovl_u8(vld1_u8(p));
  return {fp8x4(vmovl_u16(vget_low_u16(w))), fp8x4(vmovl_u16(vget_high_u16(w)))};
}

// Integer dot products (see vec_avx512.h): 16 int16 in two q registers, 8 int32 sums.
struct i16x {
  int16x8_t a, b;
};
struct ivec {
  int32x4_t a, b;
};
inline ivec izero() { return {vdupq_n_s32(0), vdupq_n_s32(0)}; }
inline i16x vload_i16(const int16_t* p) { return {vld1q_s16(p), vld1q_s16(p + 8)}; }
inline i16x u8x16_to_i16(uint8x16_t b) {
  return {vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(b))),
          vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(b)))};
}
inline void vcodes_4(const uint8_t* p, i16x& lo, i16x& hi) {
  const uint8x16_t b = vld1q_u8(p);
  lo = u8x16_to_i16(vandq_u8(b, vdupq_n_u8(0xF)));
  hi = u8x16_to_i16(vshrq_n_u8(b, 4));
}
inline i16x vcodes_i8(const int8_t* p) {
  int8x16_t b = vld1q_s8(p);
  return {vmovl_s8(vget_low_s8(b)), vmovl_s8(vget_high_s8(b))};
}
inline i16x vcodes_u8(const uint8_t* p) { return u8x16_to_i16(vld1q_u8(p)); }
inline i16x vmul16(i16x x, i16x y) { return {vmulq_s16(x.a, y.a), vmulq_s16(x.b, y.b)}; }
inline ivec vdot16(ivec acc, i16x x, i16x y) {
  acc.a = vmlal_s16(acc.a, vget_low_s16(x.a), vget_low_s16(y.a));
  acc.b = vmlal_s16(acc.b, vget_high_s16(x.a), vget_high_s16(y.a));
  acc.a = vmlal_s16(acc.a, vget_low_s16(x.b), vget_low_s16(y.b));
  acc.b = vmlal_s16(acc.b, vget_high_s16(x.b), vget_high_s16(y.b));
  return acc;
}
inline vec vcvt_i32(ivec x) { return {vcvtq_f32_s32(x.a), vcvtq_f32_s32(x.b)}; }
inline void vstore_i16(int16_t* p, vec v) {  // rounded to nearest, saturated
  vst1_s16(p, vqmovn_s32(vcvtnq_s32_f32(v.a)));
  vst1_s16(p + 4, vqmovn_s32(vcvtnq_s32_f32(v.b)));
}

inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline void prefetch_nta(const void* p) { __builtin_prefetch(p, 0, 0); }

}  // namespace tm
