// The vector layer in plain C++: 8 float32 lanes in an array, every operation a loop. The
// portable build: no intrinsics, no instruction-set flags; it runs wherever C++ compiles.
#pragma once

#include "common.h"

namespace tm {

constexpr int kLanes = 8;
constexpr const char* kIsa = "scalar";
struct vec {
  float x[kLanes];
};

#define TM_LANES(expr)                          \
  vec r;                                        \
  for (int i = 0; i < kLanes; ++i) r.x[i] = expr; \
  return r

inline vec vzero() { TM_LANES(0.f); }
inline vec vset1(float v) { TM_LANES(v); }
inline vec vload(const float* p) { TM_LANES(p[i]); }
inline vec vload(const bf16* p) { TM_LANES(to_f(p[i])); }
inline vec vround_bf16(vec v) { TM_LANES(rnd<bf16>(v.x[i])); }
inline void vstore(float* p, vec v) { for (int i = 0; i < kLanes; ++i) p[i] = v.x[i]; }
inline void vstore(bf16* p, vec v) { for (int i = 0; i < kLanes; ++i) p[i] = to_bf16(v.x[i]); }

inline vec vadd(vec a, vec b) { TM_LANES(a.x[i] + b.x[i]); }
inline vec vsub(vec a, vec b) { TM_LANES(a.x[i] - b.x[i]); }
inline vec vmul(vec a, vec b) { TM_LANES(a.x[i] * b.x[i]); }
inline vec vdiv(vec a, vec b) { TM_LANES(a.x[i] / b.x[i]); }
inline vec vmax(vec a, vec b) { TM_LANES(a.x[i] > b.x[i] ? a.x[i] : b.x[i]); }
inline vec vmin(vec a, vec b) { TM_LANES(a.x[i] < b.x[i] ? a.x[i] : b.x[i]); }
#ifdef __FP_FAST_FMAF  // one instruction here (AArch64, an x86 target with FMA)
inline vec vfma(vec a, vec b, vec c) { TM_LANES(std::fma(a.x[i], b.x[i], c.x[i])); }
inline vec vfnma(vec a, vec b, vec c) { TM_LANES(std::fma(-a.x[i], b.x[i], c.x[i])); }
#else  // baseline x86-64 has no FMA: std::fma would be a libm call per lane, never vectorized
inline vec vfma(vec a, vec b, vec c) { TM_LANES(a.x[i] * b.x[i] + c.x[i]); }
inline vec vfnma(vec a, vec b, vec c) { TM_LANES(c.x[i] - a.x[i] * b.x[i]); }
#endif
inline vec vfloor(vec v) { TM_LANES(std::floor(v.x[i])); }
inline vec vrint(vec v) { TM_LANES(std::nearbyint(v.x[i])); }
inline vec vexp2i(vec n) { TM_LANES(std::ldexp(1.0f, static_cast<int>(n.x[i]))); }
#undef TM_LANES

inline float vsum(vec v) {  // pairwise, in the order of the 8-lane x86 reductions
  float s[4];
  for (int i = 0; i < 4; ++i) s[i] = v.x[i] + v.x[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
inline float vhmax(vec v) { return *std::max_element(v.x, v.x + kLanes); }
inline void vsum8(const vec* a, float* out) { for (int r = 0; r < 8; ++r) out[r] = vsum(a[r]); }
inline int vmask_eq(vec a, vec b) {
  int m = 0;
  for (int i = 0; i < kLanes; ++i) m |= (a.x[i] == b.x[i]) << i;
  return m;
}
inline vec vnan_mask(vec v) {
  vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = std::isnan(v.x[i]) ? 1.f : 0.f;
  return r;
}
inline vec vor(vec a, vec b) { return vmax(a, b); }  // on vnan_mask's 0/1 lanes
inline bool vany(vec mask) { return vhmax(mask) > 0.f; }

// A GEMM panel vector pair (see vec.h): bf16 element 2i is row i, element 2i + 1 row kLanes + i.
inline void vload_panel(const float* p, vec& lo, vec& hi) {
  lo = vload(p);
  hi = vload(p + kLanes);
}
inline void vload_panel(const bf16* p, vec& lo, vec& hi) {
  for (int i = 0; i < kLanes; ++i) {
    lo.x[i] = to_f(p[2 * i]);
    hi.x[i] = to_f(p[2 * i + 1]);
  }
}

inline float vhalf(uint16_t h) { return half_to_f(h); }  // IEEE half -> float32

// Quantized codes: kLanes bytes -> kLanes floats (unsigned low / high nibbles, signed bytes).
inline vec vload_lo4(const uint8_t* p) {
  vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = static_cast<float>(p[i] & 0xF);
  return r;
}
inline vec vload_hi4(const uint8_t* p) {
  vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = static_cast<float>(p[i] >> 4);
  return r;
}
inline vec vload_i8(const int8_t* p) {
  vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = static_cast<float>(p[i]);
  return r;
}

// fp8 e4m3 codes -> floats, bit by bit as the vector builds do it (see vec_avx512.h)
inline vec vload_fp8(const uint8_t* p) {
  vec r;
  for (int i = 0; i < kLanes; ++i) {
    uint32_t mag = static_cast<uint32_t>(p[i] & 0x7F) << 20;
    float f;
    std::memcpy(&f, &mag, 4);
    r.x[i] = (p[i] & 0x80 ? -f : f) * 0x1p120f;
  }
  return r;
}

// Integer dot products (see vec_avx512.h): 2 x kLanes int16, kLanes int32 sums.
struct i16x {
  int16_t x[2 * kLanes];
};
struct ivec {
  int32_t x[kLanes];
};
inline ivec izero() { return {}; }
inline i16x vload_i16(const int16_t* p) {
  i16x r;
  std::memcpy(r.x, p, sizeof(r.x));
  return r;
}
inline void vcodes_4(const uint8_t* p, i16x& lo, i16x& hi) {
  for (int i = 0; i < 2 * kLanes; ++i) lo.x[i] = static_cast<int16_t>(p[i] & 0xF), hi.x[i] = static_cast<int16_t>(p[i] >> 4);
}
inline i16x vcodes_i8(const int8_t* p) {
  i16x r;
  for (int i = 0; i < 2 * kLanes; ++i) r.x[i] = p[i];
  return r;
}
inline i16x vcodes_u8(const uint8_t* p) {
  i16x r;
  for (int i = 0; i < 2 * kLanes; ++i) r.x[i] = p[i];
  return r;
}
inline i16x vmul16(i16x a, i16x b) {  // products that fit int16
  for (int i = 0; i < 2 * kLanes; ++i) a.x[i] = static_cast<int16_t>(a.x[i] * b.x[i]);
  return a;
}
inline ivec vdot16(ivec acc, i16x a, i16x b) {
  for (int i = 0; i < kLanes; ++i)
    acc.x[i] += int32_t{a.x[2 * i]} * b.x[2 * i] + int32_t{a.x[2 * i + 1]} * b.x[2 * i + 1];
  return acc;
}
inline vec vcvt_i32(ivec a) {
  vec r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = static_cast<float>(a.x[i]);
  return r;
}
inline void vstore_i16(int16_t* p, vec v) {  // rounded to nearest (even), saturated
  for (int i = 0; i < kLanes; ++i)
    p[i] = static_cast<int16_t>(std::min(32767.f, std::max(-32768.f, std::nearbyint(v.x[i]))));
}

inline void prefetch_l1(const void*) {}
inline void prefetch_l2(const void*) {}
inline void prefetch_nta(const void*) {}

}  // namespace tm
