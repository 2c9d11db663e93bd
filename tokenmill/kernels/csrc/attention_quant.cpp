// tokenmill CPU kernels: paged decode attention on a quantized KV cache (layers/kv_quant.py),
// the pages read in place and dequantized in registers a few rows at a time into an L1
// scratch, so a step reads the cache's quantized bytes, never a float copy of the history.
//
//   int8  codes int8 (head_dim per token and head), one fp16 scale:   x = q * s
//   int4  codes: byte j = value j (low nibble) | value j + head_dim / 2 (high); an fp16 scale
//         and minimum per 16 values:                                  x = q * s + m
// (int4 stores a rotation of K and V: the caller rotates q and un-rotates the output.)
#include "attention_common.h"
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

  // head h's D values at cache slot `slot` -> dst (float32)
  void row(int64_t slot, int64_t h, float* dst) const {
    const int64_t at = slot * Hk + h;
    if (fmt == TM_KV_INT8) {
      const int8_t* q = static_cast<const int8_t*>(codes) + at * D;
      vec s = vset1(vhalf(scale[at]));
      int64_t i = 0;
      for (; i + kLanes <= D; i += kLanes) vstore(dst + i, vmul(vload_i8(q + i), s));
      for (; i < D; ++i) dst[i] = q[i] * vhalf(scale[at]);
      return;
    }
    const uint8_t* q = static_cast<const uint8_t*>(codes) + at * (D / 2);
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
};

// The query heads of KV head h of one sequence (`group` of them, q pre-scaled) against its
// quantized history [start, L).
void attend_quant(const float* qf, const QuantPages& K, const QuantPages& V,
                  const int64_t* table, int64_t start, int64_t L, int64_t BS, int64_t h,
                  int64_t group, float* scores, float* buf, float* acc, float* out) {
  const int64_t D = K.D, n = L - start, Dp = (D + kLanes - 1) / kLanes * kLanes;
  auto rows_of = [&](const QuantPages& c, int64_t p, int64_t rows) {  // rows -> buf (ld Dp)
    for (int64_t j = 0; j < rows; ++j)
      c.row(table[(p + j) / BS] * BS + (p + j) % BS, h, buf + j * Dp);
  };
  for (int64_t p = start; p < L;) {
    const int64_t rows = std::min({kRows, L - p, BS - p % BS});
    rows_of(K, p, rows);
    for (int64_t g = 0; g < group; ++g) score(qf + g * Dp, buf, Dp, rows, D, scores + g * n + p - start);
    p += rows;
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * n, n);
  std::fill(acc, acc + group * Dp, 0.f);
  for (int64_t p = start; p < L;) {
    const int64_t rows = std::min({kRows, L - p, BS - p % BS});
    rows_of(V, p, rows);
    for (int64_t g = 0; g < group; ++g)
      accumulate_rows(scores + g * n + p - start, buf, Dp, rows, D, acc + g * Dp);
    p += rows;
  }
  for (int64_t g = 0; g < group; ++g) std::copy(acc + g * Dp, acc + g * Dp + D, out + g * D);
}

}  // namespace tm

using namespace tm;

extern "C" void tm_decode_attention_quant(const float* q, const tm_kv_pages* k,
                                          const tm_kv_pages* v, int64_t block_size,
                                          int64_t kv_heads, const int64_t* block_tables,
                                          int64_t max_blocks, const int64_t* seq_lens,
                                          int64_t batch, int64_t heads, int64_t head_dim,
                                          int64_t window, float scale, float* out) {
  const int64_t group = heads / kv_heads, D = head_dim, Dp = (D + kLanes - 1) / kLanes * kLanes;
  const QuantPages K{k->format, k->codes, k->scale, k->zero, kv_heads, D};
  const QuantPages V{v->format, v->codes, v->scale, v->zero, kv_heads, D};
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < batch; ++b) { longest = std::max(longest, seq_lens[b]); total += seq_lens[b]; }
  const int64_t work = std::max<int64_t>(1, total / batch * D * group / 8);
  parallel_for(0, batch * kv_heads, std::max<int64_t>(1, (1 << 14) / work), [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(longest * group), buf(kRows * Dp), qf(group * Dp, 0.f),
        acc(group * Dp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / kv_heads, h = t % kv_heads, L = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const float* qb = q + (b * heads + h * group) * D;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < D; ++i) qf[g * Dp + i] = qb[g * D + i] * scale;
      attend_quant(qf.data(), K, V, block_tables + b * max_blocks, start, L, block_size, h,
                   group, scores.data(), buf.data(), acc.data(), out + (b * heads + h * group) * D);
    }
  });
}
