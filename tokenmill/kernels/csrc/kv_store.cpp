// tokenmill CPU kernels: writing new K or V rows into a quantized paged cache, the same
// arithmetic as layers/kv_quant.py's and kv_int4.py's encoders (tests/test_kv_kernels.py
// compares them):
//
//   int8    s = fp16(max(max|x| / 127, 2**-14)); q = round(x / s) in [-127, 127]
//   fp8     s = fp16(max(max|x| / 448, 2**-14)); q = e4m3(x / s), rounded to nearest even
//   int4 V  y = x @ R; per shrink c of kShrink: s = fp16(max(max|y| * c / 7.5, 2**-14)),
//           q = round(y / s + 7.5) in [0, 15]; the first with the least squared error wins
//   int4 K  rows to the stage; a block whose last row is written: per channel, the first clip
//           c of kClip with the least squared error gives [lo, hi] = c [min, max]; the head's
//           units mu = fp16(max(max|lo| / 127, 2**-24)) and su = the fp16 not below
//           max step / 255, where mc = floor(lo / mu) and step = max((hi - mc mu) / 15, 2**-14);
//           sc = ceil(step / su); q = round((k - mc mu) / (sc su)) in [0, 15]
// (errors are summed in float lane by lane, in another order than PyTorch's, and the
// rotation's sums too: the same codes but for rare ties)
#include "internal.h"
#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kMaxKvHeadDim = 256;
constexpr float kMinScale = 1.0f / 16384;  // 2**-14
constexpr float kTiny = 0x1p-24f;          // the least fp16 subnormal
constexpr float kClip[4] = {1.0f, 0.9f, 0.8f, 0.7f};
constexpr float kShrink[9] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f, 0.7f, 0.65f, 0.6f};

inline float clampf(float v, float lo, float hi) { return std::min(hi, std::max(lo, v)); }

void pack_nibbles(const uint8_t* q, int64_t D, uint8_t* codes) {
  for (int64_t j = 0; j < D / 2; ++j) codes[j] = q[j] | (q[j + D / 2] << 4);
}

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

// int4 V: y (already rotated) -> codes and scale. Each shrink's squared error is summed lane
// by lane in float (D a multiple of kLanes), then across lanes in double.
void store_int4v(const float* y, int64_t D, uint8_t* codes, uint16_t* scale) {
  vec mx = vzero();
  for (int64_t i = 0; i < D; i += kLanes) mx = vmax(mx, vmax(vload(y + i), vsub(vzero(), vload(y + i))));
  const float amax = vhmax(mx);
  auto quant = [&](vec x, vec s) {
    return vmin(vmax(vrint(vadd(vdiv(x, s), vset1(7.5f))), vzero()), vset1(15.f));
  };
  double best = INFINITY;
  uint16_t best_s = 0;
  for (float c : kShrink) {
    const uint16_t s16 = f_to_half(std::max(amax * c / 7.5f, kMinScale));
    const vec s = vset1(half_to_f(s16));
    vec err = vzero();
    for (int64_t i = 0; i < D; i += kLanes) {
      const vec x = vload(y + i), e = vsub(vmul(vsub(quant(x, s), vset1(7.5f)), s), x);
      err = vfma(e, e, err);
    }
    float lanes[kLanes];
    vstore(lanes, err);
    double total = 0.0;
    for (float l : lanes) total += l;
    if (total < best) best = total, best_s = s16;
  }
  const vec s = vset1(half_to_f(best_s));
  float qf[kMaxKvHeadDim];
  uint8_t q[kMaxKvHeadDim];
  for (int64_t i = 0; i < D; i += kLanes) vstore(qf + i, quant(vload(y + i), s));
  for (int64_t i = 0; i < D; ++i) q[i] = static_cast<uint8_t>(qf[i]);
  pack_nibbles(q, D, codes);
  *scale = best_s;
}

// int4 K: one head of a full block, rows y[j * ld + i] (BS rows, D channels) -> each row's
// codes (`code_stride` bytes apart) and the block's params
void seal_int4k(const float* y, int64_t ld, int64_t BS, int64_t D, uint8_t* codes,
                int64_t code_stride, uint8_t* params) {
  // each clip's squared error per channel, kLanes channels at a time (summed in float)
  float lo[kMaxKvHeadDim], hi[kMaxKvHeadDim], mn[kMaxKvHeadDim], mx[kMaxKvHeadDim];
  float err[4][kMaxKvHeadDim];
  static_assert(sizeof(kClip) / sizeof(kClip[0]) == 4, "four clips");
  const vec zero = vzero(), fifteen = vset1(15.f);
  for (int64_t i = 0; i < D; i += kLanes) {
    vec lo_v = vload(y + i), hi_v = lo_v;
    for (int64_t j = 1; j < BS; ++j) lo_v = vmin(lo_v, vload(y + j * ld + i)), hi_v = vmax(hi_v, vload(y + j * ld + i));
    vstore(mn + i, lo_v), vstore(mx + i, hi_v);
    for (int c = 0; c < 4; ++c) {
      const vec l = vmul(lo_v, vset1(kClip[c])), h = vmul(hi_v, vset1(kClip[c]));
      const vec s = vmax(vdiv(vsub(h, l), fifteen), vset1(kMinScale));
      vec e2 = zero;
      for (int64_t j = 0; j < BS; ++j) {
        const vec v = vload(y + j * ld + i);
        const vec z = vadd(vmul(vmin(vmax(vrint(vdiv(vsub(v, l), s)), zero), fifteen), s), l);
        e2 = vfma(vsub(z, v), vsub(z, v), e2);
      }
      vstore(err[c] + i, e2);
    }
  }
  for (int64_t i = 0; i < D; ++i) {  // the first clip with the least error
    float best = INFINITY;
    for (int c = 0; c < 4; ++c)
      if (err[c][i] < best) best = err[c][i], lo[i] = mn[i] * kClip[c], hi[i] = mx[i] * kClip[c];
  }
  float lmax = 0.f;
  for (int64_t i = 0; i < D; ++i) lmax = std::max(lmax, std::fabs(lo[i]));
  const uint16_t mu16 = f_to_half(std::max(lmax / 127.f, kTiny));
  const float mu = half_to_f(mu16);
  float step[kMaxKvHeadDim], smax = 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float mc = clampf(std::floor(lo[i] / mu), -128.f, 127.f);
    params[i] = static_cast<uint8_t>(static_cast<int8_t>(mc));
    lo[i] = mc * mu;
    step[i] = std::max((hi[i] - lo[i]) / 15.f, kMinScale);
    smax = std::max(smax, step[i]);
  }
  const float want = smax / 255.f;
  uint16_t su16 = f_to_half(want);
  if (half_to_f(su16) < want) ++su16;  // the next fp16 up (want > 0)
  const float su = half_to_f(su16);
  for (int64_t i = 0; i < D; ++i) {
    const float sc = clampf(std::ceil(step[i] / su), 1.f, 255.f);
    params[D + i] = static_cast<uint8_t>(sc);
    step[i] = sc * su;
  }
  std::memcpy(params + 2 * D, &mu16, 2);
  std::memcpy(params + 2 * D + 2, &su16, 2);
  uint8_t q[kMaxKvHeadDim];
  float qf[kMaxKvHeadDim];
  for (int64_t j = 0; j < BS; ++j) {
    for (int64_t i = 0; i < D; i += kLanes)
      vstore(qf + i, vmin(vmax(vrint(vdiv(vsub(vload(y + j * ld + i), vload(lo + i)), vload(step + i))), zero), fifteen));
    for (int64_t i = 0; i < D; ++i) q[i] = static_cast<uint8_t>(qf[i]);
    pack_nibbles(q, D, codes + j * code_stride);
  }
}

// one row (D float32) <- row @ R, in place; D <= 256
void rotate_row(float* row, int64_t D, const float* R) {
  float r[256] = {};
  for (int64_t i = 0; i < D; ++i) {  // r += row[i] * R[i, :]
    vec xi = vset1(row[i]);
    int64_t j = 0;
    for (; j + kLanes <= D; j += kLanes) vstore(r + j, vfma(xi, vload(R + i * D + j), vload(r + j)));
    for (; j < D; ++j) r[j] += row[i] * R[i * D + j];
  }
  std::copy(r, r + D, row);
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
    for (int64_t t = t0; t < t1; ++t) rotate_row(x + t * D, D, R);
  });
}

// int4 K: the step's rows into the stage, then every block whose last row came is quantized
void store_int4k(const float* x, int64_t tokens, int64_t Hk, int64_t D, const int64_t* slots,
                 const int64_t* stage_rows, int64_t BS, const tm_kv_pages& p) {
  parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* src = x + t * Hk * D;
      const int64_t at = stage_rows[t] * Hk * D;
      if (p.stage_dtype == TM_BF16) {
        bf16* dst = static_cast<bf16*>(p.stage) + at;
        for (int64_t i = 0; i < Hk * D; ++i) dst[i] = to_bf16(src[i]);
      } else {
        std::memcpy(static_cast<float*>(p.stage) + at, src, Hk * D * sizeof(float));
      }
    }
  });
  std::vector<int64_t> full;  // tokens that end a block
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] % BS == BS - 1) full.push_back(t);
  const int64_t n = static_cast<int64_t>(full.size());
  parallel_for(0, n * Hk, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> rows(BS * D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = full[r / Hk], h = r % Hk;
      const int64_t block = slots[t] / BS, slot = stage_rows[t] / BS;
      for (int64_t j = 0; j < BS; ++j) {
        const int64_t at = ((slot * BS + j) * Hk + h) * D;
        for (int64_t i = 0; i < D; ++i)
          rows[j * D + i] = p.stage_dtype == TM_BF16 ? to_f(static_cast<const bf16*>(p.stage)[at + i])
                                                     : static_cast<const float*>(p.stage)[at + i];
      }
      uint8_t* codes = static_cast<uint8_t*>(const_cast<void*>(p.codes)) + (block * BS * Hk + h) * (D / 2);
      seal_int4k(rows.data(), D, BS, D, codes, Hk * (D / 2),
                 const_cast<uint8_t*>(p.params) + (block * Hk + h) * (2 * D + 4));
    }
  });
}

}  // namespace tm

using namespace tm;

extern "C" void tm_kv_store(int format, const float* x, int64_t tokens, int64_t kv_heads,
                            int64_t head_dim, const float* rotation, const int64_t* slots,
                            const int64_t* stage_rows, int64_t block_size,
                            const tm_kv_pages* pages) {
  const int64_t D = head_dim;
  if (format == TM_KV_INT4)
    return store_int4k(x, tokens, kv_heads, D, slots, stage_rows, block_size, *pages);
  uint8_t* codes = static_cast<uint8_t*>(const_cast<void*>(pages->codes));
  uint16_t* scale = const_cast<uint16_t*>(pages->scale);
  parallel_for(0, tokens * kv_heads, 8, [&](int64_t r0, int64_t r1) {
    float rot[kMaxKvHeadDim];
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = x + r * D;
      const int64_t at = slots[r / kv_heads] * kv_heads + r % kv_heads;
      if (format == TM_KV_INT8) {
        store_int8(src, D, reinterpret_cast<int8_t*>(codes) + at * D, scale + at);
      } else if (format == TM_KV_FP8) {
        store_fp8(src, D, codes + at * D, scale + at);
      } else {  // TM_KV_INT4V
        std::copy(src, src + D, rot);
        if (rotation) rotate_row(rot, D, rotation);
        store_int4v(rot, D, codes + at * (D / 2), scale + at);
      }
    }
  });
}
