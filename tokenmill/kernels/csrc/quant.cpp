// tokenmill CPU kernels: linear layers on GGUF block-quantized weights, read in their file
// layout (blocks of 32 weights, row after row; no repacking, so they take the file's bytes).
//
//   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
//   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
//   Q8_0  34 bytes: fp16 d, 32 signed bytes              w = d * q
// Nibble j of a block is the low half of byte j (j < 16), weight 16 + j its high half.
//
// A few input rows (decode): each output row reads its blocks once and dequantizes them in
// registers; per block sum_k x[k] * q[k] is one vector FMA chain, scaled by d, and the minimum's
// (or Q4_0's -8 d) share is m * sum_k x[k], from per-block sums of x computed once. Decode is
// then bound by the quantized bytes, not by bf16 weights. Many rows (prefill): the blocks are
// dequantized once into the packed panels of the float GEMM, which then runs as for bf16.
#include "internal.h"
#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kBlock = 32;
constexpr int kQuantRows = kLanes == 16 ? 8 : 4;  // input rows per pass over the weights
constexpr int64_t kGemvMaxRows = 16;  // above this, dequantize to panels and run the GEMM

inline int64_t block_bytes(int quant) {
  return quant == TM_Q4_0 ? 18 : quant == TM_Q4_1 ? 20 : 34;
}

inline uint16_t half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// one block -> 32 floats: the dequantization (the same values as the gguf package's)
inline void dequantize_block(int quant, const uint8_t* b, float* out) {
  constexpr int kVecs = kBlock / kLanes;
  vec d = vset1(vhalf(half_at(b)));
  if (quant == TM_Q8_0) {
    for (int v = 0; v < kVecs; ++v)
      vstore(out + v * kLanes, vmul(d, vload_i8(reinterpret_cast<const int8_t*>(b + 2) + v * kLanes)));
    return;
  }
  const uint8_t* q = b + (quant == TM_Q4_1 ? 4 : 2);
  vec m = vset1(quant == TM_Q4_1 ? vhalf(half_at(b + 2)) : 0.f), eight = vset1(8.f);
  for (int v = 0; v < kVecs / 2; ++v) {
    vec lo = vload_lo4(q + v * kLanes), hi = vload_hi4(q + v * kLanes);
    if (quant == TM_Q4_0) {
      lo = vsub(lo, eight);
      hi = vsub(hi, eight);
    }
    vstore(out + v * kLanes, vadd(vmul(d, lo), m));
    vstore(out + (kVecs / 2 + v) * kLanes, vadd(vmul(d, hi), m));
  }
}

// y[i][r] = x[i] . w[r] (+ bias) for MR input rows (float32, ld K) and output rows [r0, r1);
// xs[i][b] = sum of x[i] over block b.
template <int MR, int Q, typename O>
void gemv_rows(const float* x, const float* xs, const uint8_t* w, int64_t K, int64_t r0,
               int64_t r1, const float* bias, O* out, int64_t N) {
  constexpr int64_t kBytes = Q == TM_Q4_0 ? 18 : Q == TM_Q4_1 ? 20 : 34;
  constexpr int kVecs = kBlock / kLanes;
  const int64_t blocks = K / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * blocks * kBytes;
    vec acc[MR];
    float offs[MR] = {};
    for (int i = 0; i < MR; ++i) acc[i] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kBytes;
      prefetch_l1(blk + 1024);
      vec q[kVecs];
      if constexpr (Q == TM_Q8_0) {
        for (int v = 0; v < kVecs; ++v) q[v] = vload_i8(reinterpret_cast<const int8_t*>(blk + 2) + v * kLanes);
      } else {
        const uint8_t* nib = blk + (Q == TM_Q4_1 ? 4 : 2);
        for (int v = 0; v < kVecs / 2; ++v) {
          q[v] = vload_lo4(nib + v * kLanes);
          q[kVecs / 2 + v] = vload_hi4(nib + v * kLanes);
        }
      }
      float d = vhalf(half_at(blk));
      float off = Q == TM_Q4_1 ? vhalf(half_at(blk + 2)) : Q == TM_Q4_0 ? -8.f * d : 0.f;
      for (int i = 0; i < MR; ++i) {
        const float* xb = x + i * K + b * kBlock;
        vec p = vmul(vload(xb), q[0]);
        for (int v = 1; v < kVecs; ++v) p = vfma(vload(xb + v * kLanes), q[v], p);
        acc[i] = vfma(p, vset1(d), acc[i]);
        if (Q != TM_Q8_0) offs[i] += off * xs[i * blocks + b];
      }
    }
    for (int i = 0; i < MR; ++i)
      out[i * N + r] = from_f<O>(vsum(acc[i]) + offs[i] + (bias ? bias[r] : 0.f));
  }
}

template <int Q, typename O>
void gemv(const float* x, const float* xs, int64_t m, const tm_linear* w, O* out) {
  const auto* wq = static_cast<const uint8_t*>(w->packed);
  const int64_t N = w->n, K = w->k;
  parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = 0; i < m; i += kQuantRows) {
      const float* xi = x + i * K;
      const float* si = xs + i * (K / kBlock);
      O* oi = out + i * N;
      switch (std::min<int64_t>(kQuantRows, m - i)) {
        case 1: gemv_rows<1, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N); break;
        case 2: gemv_rows<2, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N); break;
        case 3: gemv_rows<3, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N); break;
        case 4: gemv_rows<4, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N); break;
        case 5: gemv_rows<5, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N); break;
        case 6: gemv_rows<6, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N); break;
        case 7: gemv_rows<7, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N); break;
        default: gemv_rows<kQuantRows, Q>(xi, si, wq, K, r0, r1, w->bias, oi, N);
      }
    }
  });
}

template <typename O>
void gemv_typed(int dtype, const void* x, int64_t m, const tm_linear* w, O* out) {
  const int64_t K = w->k, blocks = K / kBlock;
  thread_local std::vector<float> xf, xs;  // x in float32, and its per-block sums
  xf.resize(m * K), xs.resize(m * blocks);
  for (int64_t i = 0; i < m * K; ++i)
    xf[i] = dtype == TM_F32 ? static_cast<const float*>(x)[i] : to_f(static_cast<const bf16*>(x)[i]);
  for (int64_t i = 0; i < m * blocks; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += xf[i * kBlock + j];
    xs[i] = s;
  }
  if (w->quant == TM_Q4_0) return gemv<TM_Q4_0>(xf.data(), xs.data(), m, w, out);
  if (w->quant == TM_Q4_1) return gemv<TM_Q4_1>(xf.data(), xs.data(), m, w, out);
  gemv<TM_Q8_0>(xf.data(), xs.data(), m, w, out);
}

void quant_linear(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
                  void* out) {
  if (m <= kGemvMaxRows) {
    if (out_dtype == TM_F32) return gemv_typed(dtype, x, m, w, static_cast<float*>(out));
    return gemv_typed(dtype, x, m, w, static_cast<bf16*>(out));
  }
  // prefill: dequantize every block once into the float GEMM's panels
  const int64_t K = w->k, blocks = K / kBlock, bytes = block_bytes(w->quant);
  const auto* wq = static_cast<const uint8_t*>(w->packed);
  thread_local std::vector<char> panels;
  panels.resize(tm_packed_numel(dtype, w->n, K) * (dtype == TM_F32 ? 4 : 2));
  pack_rows(dtype, w->n, K, panels.data(), [&](int64_t r, float* buf) {
    for (int64_t b = 0; b < blocks; ++b)
      dequantize_block(w->quant, wq + (r * blocks + b) * bytes, buf + b * kBlock);
  });
  tm_linear packed{panels.data(), w->bias, w->n, K, 0};
  packed_linear(dtype, x, m, &packed, out_dtype, out);
}

}  // namespace tm

extern "C" void tm_dequantize(int quant, const void* blocks, int64_t n, int64_t k, float* out) {
  const auto* wq = static_cast<const uint8_t*>(blocks);
  const int64_t per_row = k / tm::kBlock, bytes = tm::block_bytes(quant);
  tm::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < per_row; ++b)
        tm::dequantize_block(quant, wq + (r * per_row + b) * bytes, out + r * k + b * tm::kBlock);
  });
}
