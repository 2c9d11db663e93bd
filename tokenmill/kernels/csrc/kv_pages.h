// tokenmill CPU kernels: one layer's quantized paged K or V (tm_kv_pages, layers/kv_quant.py
// and kv_int4.py) as the attention kernels read it: a row of head_dim values dequantized into
// float32 scratch, and software prefetch of the rows to come (attention_quant.cpp,
// attention_prefill.cpp).
//
//   int8     codes int8 (head_dim per token and head), one fp16 scale:   x = q * s
//   fp8      codes e4m3, one fp16 scale:                                 x = e4m3(q) * s
//   int4 V   codes: byte j = value j (low nibble) | value j + D / 2 (high); one fp16 scale:
//            x = (q - 7.5) * s, in the rotated basis (the callers rotate the output back)
//   int4 K   codes as int4 V; per (block, head) params: D int8 minimum codes, D uint8 step
//            codes, the fp16 minimum unit and step unit: x = q * (sc * su) + mc * mu. A block
//            not yet full is read from the stage (its rows in the stage dtype) instead.
#pragma once

#include "tm.h"
#include "vec.h"

namespace tm {

struct QuantPages {
  int fmt;
  const void* codes;
  const uint16_t* scale;
  const uint8_t* params;
  const void* stage;
  int stage_dtype;
  int64_t Hk, D, BS;

  QuantPages(const tm_kv_pages& p, int64_t kv_heads, int64_t head_dim, int64_t block_size)
      : fmt(p.format), codes(p.codes), scale(p.scale), params(p.params), stage(p.stage),
        stage_dtype(p.stage_dtype), Hk(kv_heads), D(head_dim), BS(block_size) {}

  bool int4() const { return fmt == TM_KV_INT4 || fmt == TM_KV_INT4V; }
  int64_t code_bytes() const { return int4() ? D / 2 : D; }
  int64_t param_bytes() const { return 2 * D + 4; }
  const uint8_t* codes_at(int64_t at) const {
    return static_cast<const uint8_t*>(codes) + at * code_bytes();
  }

  // per-token formats (int8, fp8, int4 V): head h's D values at cache slot `slot` -> dst
  template <int F>
  void row(int64_t slot, int64_t h, float* dst) const {
    const int64_t at = slot * Hk + h;
    const uint8_t* q = codes_at(at);
    const float s = vhalf(scale[at]);
    if constexpr (F == TM_KV_INT4V) {
      const vec vs = vset1(s), off = vset1(-7.5f * s);
      for (int64_t i = 0; i < D / 2; i += kLanes) {  // D is a multiple of 32 (the caller checks)
        vstore(dst + i, vfma(vload_lo4(q + i), vs, off));
        vstore(dst + D / 2 + i, vfma(vload_hi4(q + i), vs, off));
      }
    } else {
      for (int64_t i = 0; i < D; i += kLanes)
        vstore(dst + i, vmul(F == TM_KV_INT8 ? vload_i8(reinterpret_cast<const int8_t*>(q + i))
                                             : vload_fp8(q + i), vset1(s)));
    }
  }

  // int4 K: a quantized block's channel minimums lo[0:D] and steps st[0:D] for head h
  void block_params(int64_t block, int64_t h, float* lo, float* st) const {
    const uint8_t* p = params + (block * Hk + h) * param_bytes();
    uint16_t units[2];
    std::memcpy(units, p + 2 * D, 4);
    const float mu = half_to_f(units[0]), su = half_to_f(units[1]);
    for (int64_t i = 0; i < D; ++i) {
      lo[i] = static_cast<float>(static_cast<int8_t>(p[i])) * mu;
      st[i] = static_cast<float>(p[D + i]) * su;
    }
  }

  // int4 K: a quantized block's params for head h as int16 (minimum codes mc, step codes sc)
  // and their fp16 units (mu, su)
  void block_codes(int64_t block, int64_t h, int16_t* mc, int16_t* sc, float* mu, float* su) const {
    const uint8_t* p = params + (block * Hk + h) * param_bytes();
    for (int64_t i = 0; i < D; i += 2 * kLanes) {
      const i16x m = vcodes_i8(reinterpret_cast<const int8_t*>(p + i)), c = vcodes_u8(p + D + i);
      std::memcpy(mc + i, &m, sizeof(m));
      std::memcpy(sc + i, &c, sizeof(c));
    }
    uint16_t units[2];
    std::memcpy(units, p + 2 * D, 4);
    *mu = half_to_f(units[0]), *su = half_to_f(units[1]);
  }

  // int4 K: a quantized row, with its block's params
  void row_k4(int64_t slot, int64_t h, const float* lo, const float* st, float* dst) const {
    const uint8_t* q = codes_at(slot * Hk + h);
    for (int64_t i = 0; i < D / 2; i += kLanes) {
      vstore(dst + i, vfma(vload_lo4(q + i), vload(st + i), vload(lo + i)));
      vstore(dst + D / 2 + i, vfma(vload_hi4(q + i), vload(st + D / 2 + i), vload(lo + D / 2 + i)));
    }
  }

  // int4 K: row j of stage slot s, head h (the stage dtype) -> dst
  void stage_row(int64_t s, int64_t j, int64_t h, float* dst) const {
    const int64_t at = ((s * BS + j) * Hk + h) * D;
    if (stage_dtype == TM_BF16) {
      const bf16* x = static_cast<const bf16*>(stage) + at;
      for (int64_t i = 0; i < D; i += kLanes) vstore(dst + i, vload(x + i));
    } else {
      std::memcpy(dst, static_cast<const float*>(stage) + at, D * sizeof(float));
    }
  }

  // the codes and scales (or params) of `rows` consecutive slots from `slot`, KV heads
  // [h0, h0 + nh)
  void prefetch(int64_t slot, int64_t rows, int64_t h0, int64_t nh, bool near) const {
    auto line = [&](const void* p) { near ? prefetch_l1(p) : prefetch_l2(p); };
    const char* c = static_cast<const char*>(codes);
    for (int64_t j = 0; j < rows; ++j)  // each row's KV heads [h0, h0 + nh)
      for (int64_t b = 0; b < nh * code_bytes(); b += 64) line(c + ((slot + j) * Hk + h0) * code_bytes() + b);
    if (scale)  // one short run
      for (int64_t b = 0; b < rows * Hk * 2; b += 64) line(reinterpret_cast<const char*>(scale + slot * Hk) + b);
  }
};

// row<F> of a per-token format known only at run time
inline void dequant_row(const QuantPages& c, int64_t slot, int64_t h, float* dst) {
  if (c.fmt == TM_KV_INT8) return c.row<TM_KV_INT8>(slot, h, dst);
  if (c.fmt == TM_KV_FP8) return c.row<TM_KV_FP8>(slot, h, dst);
  c.row<TM_KV_INT4V>(slot, h, dst);
}

}  // namespace tm
