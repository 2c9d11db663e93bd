// tokenmill CPU kernels: one layer's quantized paged K or V (tm_kv_pages, layers/kv_quant.py)
// as the attention kernels read it: a row of head_dim values dequantized into float32 scratch,
// and software prefetch of the rows to come (attention_quant.cpp, attention_prefill.cpp).
//
//   int8  codes int8 (head_dim per token and head), one fp16 scale:   x = q * s
//   fp8   codes e4m3, one fp16 scale:                                 x = e4m3(q) * s
//   int4  codes: byte j = value j (low nibble) | value j + head_dim / 2 (high); an fp16 scale
//         and minimum per 16 values:                                  x = q * s + m
// (int4 stores a rotation of K and V: the callers rotate q and un-rotate the output.)
#pragma once

#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kGroup4 = 16;  // int4 values per scale

struct QuantPages {
  int fmt;
  const void* codes;
  const uint16_t* scale;
  const uint16_t* zero;
  int64_t Hk, D;

  int64_t code_bytes() const { return fmt == TM_KV_INT4 ? D / 2 : D; }
  int64_t groups() const { return fmt == TM_KV_INT4 ? D / kGroup4 : 1; }
  const uint8_t* codes_at(int64_t at) const {
    return static_cast<const uint8_t*>(codes) + at * code_bytes();
  }

  // head h's D values at cache slot `slot` -> dst (float32)
  template <int F>
  void row(int64_t slot, int64_t h, float* dst) const {
    const int64_t at = slot * Hk + h;
    if constexpr (F != TM_KV_INT4) {
      const uint8_t* q = codes_at(at);
      vec s = vset1(vhalf(scale[at]));
      for (int64_t i = 0; i < D; i += kLanes)  // D is a multiple of 32 (the caller checks)
        vstore(dst + i, vmul(F == TM_KV_INT8 ? vload_i8(reinterpret_cast<const int8_t*>(q + i))
                                               : vload_fp8(q + i), s));
      return;
    }
    const uint8_t* q = codes_at(at);
    const int64_t groups = D / kGroup4;
    for (int64_t g = 0; g < groups; ++g) {
      vec s = vset1(vhalf(scale[at * groups + g])), m = vset1(vhalf(zero[at * groups + g]));
      const int64_t k0 = g * kGroup4;
      const bool low = k0 < D / 2;
      const uint8_t* bytes = q + (low ? k0 : k0 - D / 2);
      for (int64_t v = 0; v < kGroup4; v += kLanes) {
        vec x = low ? vload_lo4(bytes + v) : vload_hi4(bytes + v);
        vstore(dst + k0 + v, vfma(x, s, m));
      }
    }
  }

  // the codes and scales of `rows` consecutive slots from `slot`, KV heads [h0, h0 + nh)
  void prefetch(int64_t slot, int64_t rows, int64_t h0, int64_t nh, bool near) const {
    auto line = [&](const char* p) { near ? prefetch_l1(p) : prefetch_l2(p); };
    const char* c = static_cast<const char*>(codes);
    for (int64_t j = 0; j < rows; ++j)  // each row's KV heads [h0, h0 + nh)
      for (int64_t b = 0; b < nh * code_bytes(); b += 64) line(c + ((slot + j) * Hk + h0) * code_bytes() + b);
    const int64_t unit = 2 * groups(), from = slot * Hk * unit;  // scales: one short run
    for (int64_t b = 0; b < rows * Hk * unit; b += 64) {
      line(reinterpret_cast<const char*>(scale) + from + b);
      if (zero) line(reinterpret_cast<const char*>(zero) + from + b);
    }
  }
};

// row<F> for a format known only at run time
inline void dequant_row(const QuantPages& c, int64_t slot, int64_t h, float* dst) {
  if (c.fmt == TM_KV_INT8) return c.row<TM_KV_INT8>(slot, h, dst);
  if (c.fmt == TM_KV_FP8) return c.row<TM_KV_FP8>(slot, h, dst);
  c.row<TM_KV_INT4>(slot, h, dst);
}

}  // namespace tm
