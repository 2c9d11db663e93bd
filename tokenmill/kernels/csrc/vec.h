// The vector layer: one small set of float32 vector operations per instruction set, chosen at
// compile time by the TM_ISA_* macro the build passes (kernels/build.py compiles the same
// kernel sources once per instruction set). Every kernel is written once on top of it.
//
//   kLanes                      float32 lanes per vector (8 on AVX2 / NEON / scalar, 16 on AVX-512)
//   vzero vset1 vload vstore    vload widens bf16; vstore rounds to bf16 to nearest even
//   vadd vsub vmul vdiv vmax vmin vfma(a, b, c) = a * b + c, vfnma = c - a * b, vfloor, vexp2i
//   vexp vexp2 vrecip           e^x; 2^t; 1 / d (vfrac, vldexp: vexp2's parts)
//   vsum vhmax vsum8            horizontal sum / max; eight sums of eight vectors at once
//   vmask_eq vnan_mask vor vany comparisons for argmax
//   vload_panel                 2 x kLanes weights of a GEMM panel (see gemm.cpp)
//   vload_lo4 vload_hi4 vload_i8  kLanes quantized codes (nibbles, int8) as floats; vhalf
//   vload_fp8                   kLanes fp8 e4m3 codes as floats (exact)
//   i16x ivec izero vload_i16   integer dot products: 2 x kLanes int16 / kLanes int32 sums;
//   vcodes_4 vcodes_i8          2 x kLanes code bytes as int16 (low and high nibbles, int8,
//   vcodes_u8 vmul16            uint8); lane products (that fit int16);
//   vmul16 vdot16 vcvt_i32      acc += a . b (lanes hold partial sums); to float32;
//   vstore_i16                  kLanes floats rounded and saturated to int16
//   vpairs vbcast_pair          x86 only: two vectors' int16 interleaved in pairs (within
//                               128-bit lanes); one int16 pair in every pair (values_int.h)
//   vload_i32 vload_f16         x86 only: kLanes int32 as an ivec; kLanes IEEE halves as
//                               float32 (quant_amx.h)
//   prefetch_l1 prefetch_l2     software prefetch (none in the portable build); prefetch_nta:
//   prefetch_nta                a line read once (kept out of the outer caches where the CPU can)
#pragma once

#if defined(TM_ISA_AVX512) || defined(TM_ISA_AVX512_BF16)
#include "vec_avx512.h"
#elif defined(TM_ISA_AVX2)
#include "vec_avx2.h"
#elif defined(TM_ISA_NEON)
#include "vec_neon.h"
#elif defined(TM_ISA_SCALAR)
#include "vec_scalar.h"
#else
#error "build with one of TM_ISA_AMX, TM_ISA_AVX512_BF16, TM_ISA_AVX512, TM_ISA_AVX2, TM_ISA_NEON, TM_ISA_SCALAR"
#endif

namespace tm {

constexpr int64_t kPanel = 2 * kLanes;  // output columns of a packed GEMM panel (gemm.cpp)

// Round to T's precision, kept as float32 (what storing into a T tensor and reading back does).
template <typename T> inline vec vrnd(vec v) { return v; }
template <> inline vec vrnd<bf16>(vec v) { return vround_bf16(v); }

// The first n < kLanes values (zeros after), and their store.
template <typename T> inline vec vload_part(const T* p, int64_t n) {
  T tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return vload(tmp);
}
template <typename T> inline void vstore_part(T* p, vec v, int64_t n) {
  T tmp[kLanes];
  vstore(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

#ifndef TM_VEC_LDEXP  // t - floor(t) and y x 2^floor(t) (floor(t) in the normal range); 1 / d
inline vec vfrac(vec t) { return vsub(t, vfloor(t)); }
inline vec vldexp(vec y, vec t) { return vmul(y, vexp2i(vfloor(t))); }
inline vec vrecip(vec d) { return vdiv(vset1(1.f), d); }
#endif

// 2^t for t clamped to [lo, 126]: 2^floor(t) times a degree-5 fit of 2^f on [0, 1) whose
// constant term is 1, so 2^0 is exactly 1 (max. relative error 1.7e-7 in float32, as vexp's).
// lo = -127 gives 0 there (exponent bits 0; on AVX-512 a denormal, 0 under flushed denormals).
inline vec vexp2(vec t, float lo = -126.f) {
  t = vmin(vmax(t, vset1(lo)), vset1(126.f));
  const vec f = vfrac(t);
  vec y = vset1(1.8670517020e-3f);
  y = vfma(y, f, vset1(9.0171955526e-3f));
  y = vfma(y, f, vset1(5.5799797177e-2f));
  y = vfma(y, f, vset1(2.4016447365e-1f));
  y = vfma(y, f, vset1(6.9315129519e-1f));
  y = vfma(y, f, vset1(1.f));
  return vldexp(y, t);
}

// silu(g) x u as a T tensor would hold it: silu(g) = g / (1 + 2^(-g log2 e)) rounded to T, times
// u (the caller rounds the product as it stores it)
template <typename T> inline vec vsilu_mul(vec g, vec u) {
  const vec e = vexp2(vmul(g, vset1(-1.44269504088896341f)));
  return vmul(vrnd<T>(vmul(g, vrecip(vadd(vset1(1.f), e)))), u);
}

// exp(x): Cephes' polynomial after range reduction (max rel. error ~2e-7).
inline vec vexp(vec x) {
  x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
  vec fx = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfnma(fx, vset1(0.693359375f), x);
  x = vfnma(fx, vset1(-2.12194440e-4f), x);
  vec y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
  return vmul(y, vexp2i(fx));
}

}  // namespace tm
