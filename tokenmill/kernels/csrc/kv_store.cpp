// tokenmill CPU kernels: writing new K or V rows into a quantized paged cache, the same
// arithmetic as layers/kv_quant.py's encoders (tests/test_kernels.py compares the two):
//
//   int8  s = fp16(max(max|x| / 127, 2**-14)); q = round(x / s) in [-127, 127]
//   fp8   s = fp16(max(max|x| / 448, 2**-14)); q = e4m3(x / s), rounded to nearest even
//   int4  x rotated (x @ R); per group of 16: for every clip (a, b) of (1, .95, .9, .85, .8)^2,
//         lo = fp16(min * a), s = fp16(max((max * b - lo) / 15, 2**-14)),
//         q = round((x - lo) / s) in [0, 15]; the first pair with the least squared error wins
//         (in vectors here, rounding halves up where the encoder rounds them to even, and the
//         error summed in another order: the same codes but for rare ties)
#include "internal.h"
#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kMaxKvHeadDim = 256;
constexpr float kMinScale = 1.0f / 16384;  // 2**-14
constexpr int kG = 16;
constexpr float kClip[5] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f};

inline float rhalf(float v) { return half_to_f(f_to_half(v)); }  // through an fp16 store

void store_int8(const float* x, int64_t D, int8_t* q, uint16_t* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint16_t s16 = f_to_half(std::max(amax / 127.f, kMinScale));
  const float s = half_to_f(s16);
  for (int64_t i = 0; i < D; ++i)
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / s))));
  *scale = s16;
}

// float in [-448, 448] -> fp8 e4m3 bits, rounded to nearest even (as PyTorch converts)
uint8_t to_e4m3(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint8_t sign = (b >> 24) & 0x80;
  const float a = std::fabs(x);
  if (a < 0x1p-6f)  // zero and subnormals: multiples of 2**-9 (8 of them is the least normal)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 0x1p9f));
  uint32_t m = b & 0x7FFFFFFFu;
  m = (m + 0x7FFFFu + ((m >> 20) & 1)) >> 20;  // 8 exponent + 3 mantissa bits, rounded
  return sign | static_cast<uint8_t>((((m >> 3) - 120) << 3) | (m & 7));
}

void store_fp8(const float* x, int64_t D, uint8_t* q, uint16_t* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint16_t s16 = f_to_half(std::max(amax / 448.f, kMinScale));
  const float s = half_to_f(s16);
  for (int64_t i = 0; i < D; ++i) q[i] = to_e4m3(std::min(448.f, std::max(-448.f, x[i] / s)));
  *scale = s16;
}

void store_int4(const float* x, int64_t D, uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  uint8_t q[kMaxKvHeadDim];
  for (int64_t g = 0; g < D / kG; ++g) {
    const float* v = x + g * kG;
    float lo0 = v[0], hi0 = v[0];
    for (int j = 1; j < kG; ++j) lo0 = std::min(lo0, v[j]), hi0 = std::max(hi0, v[j]);
    float best = INFINITY, best_lo = 0.f, best_s = 1.f;
    for (float a : kClip)
      for (float b : kClip) {
        const float lo = rhalf(lo0 * a), s = rhalf(std::max((hi0 * b - lo) / 15.f, kMinScale));
        const vec vlo = vset1(lo), vs = vset1(s), top = vset1(15.f), half = vset1(0.5f);
        vec err = vzero();
        for (int j = 0; j < kG; j += kLanes) {  // the group's values in whole vectors
          vec x = vload(v + j);
          vec c = vmin(top, vmax(vzero(), vfloor(vadd(vdiv(vsub(x, vlo), vs), half))));
          vec e = vsub(vfma(c, vs, vlo), x);
          err = vfma(e, e, err);
        }
        const float total = vsum(err);
        if (total < best) best = total, best_lo = lo, best_s = s;
      }
    for (int j = 0; j < kG; ++j)
      q[g * kG + j] = static_cast<uint8_t>(
          std::min(15.f, std::max(0.f, std::floor((v[j] - best_lo) / best_s + 0.5f))));
    scale[g] = f_to_half(best_s);
    zero[g] = f_to_half(best_lo);
  }
  for (int64_t j = 0; j < D / 2; ++j) codes[j] = q[j] | (q[j + D / 2] << 4);
}

// rows (n, D) float32 <- rows @ R (or @ R^T), in place; D <= 256
void rotate_rows(float* x, int64_t n, int64_t D, const float* R, bool transpose) {
  std::vector<float> rt;
  if (transpose) {  // x @ R^T as x @ (R^T): rows of R^T are R's columns
    rt.resize(D * D);
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) rt[j * D + i] = R[i * D + j];
    R = rt.data();
  }
  parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
    float r[256];
    for (int64_t t = t0; t < t1; ++t) {
      float* row = x + t * D;
      std::fill(r, r + D, 0.f);
      for (int64_t i = 0; i < D; ++i) {  // r += row[i] * R[i, :]
        vec xi = vset1(row[i]);
        int64_t j = 0;
        for (; j + kLanes <= D; j += kLanes) vstore(r + j, vfma(xi, vload(R + i * D + j), vload(r + j)));
        for (; j < D; ++j) r[j] += row[i] * R[i * D + j];
      }
      std::copy(r, r + D, row);
    }
  });
}

}  // namespace tm

using namespace tm;

extern "C" void tm_kv_store(int format, const float* x, int64_t tokens, int64_t kv_heads,
                            int64_t head_dim, const float* rotation, const int64_t* slots,
                            const tm_kv_pages* pages) {
  const int64_t D = head_dim, groups = D / kG;
  parallel_for(0, tokens * kv_heads, 8, [&](int64_t r0, int64_t r1) {
    float rot[kMaxKvHeadDim];
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = x + r * D;
      const int64_t at = slots[r / kv_heads] * kv_heads + r % kv_heads;
      if (format == TM_KV_INT8) {
        store_int8(src, D, static_cast<int8_t*>(const_cast<void*>(pages->codes)) + at * D,
                   const_cast<uint16_t*>(pages->scale) + at);
        continue;
      }
      if (format == TM_KV_FP8) {
        store_fp8(src, D, static_cast<uint8_t*>(const_cast<void*>(pages->codes)) + at * D,
                  const_cast<uint16_t*>(pages->scale) + at);
        continue;
      }
      if (rotation) {
        std::copy(src, src + D, rot);
        rotate_rows(rot, 1, D, rotation, false);
        src = rot;
      }
      store_int4(src, D, static_cast<uint8_t*>(const_cast<void*>(pages->codes)) + at * (D / 2),
                 const_cast<uint16_t*>(pages->scale) + at * groups,
                 const_cast<uint16_t*>(pages->zero) + at * groups);
    }
  });
}
