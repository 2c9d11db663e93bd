// AVX512-BF16 only: the GEMM micro-kernel on pair-packed bf16 panels (included by gemm.cpp).
// VDPBF16PS adds (x[k] * w[k] + x[k + 1] * w[k + 1]) to each float32 lane: a panel holds, per
// pair of k, the NR = 32 rows' two weights side by side (two zmm vectors), and each input row
// broadcasts its (x[k], x[k + 1]) pair. Products of two bf16 values are exact in float32, so
// this sums the same terms as the FMA kernel, in another order, with half the instructions.
#pragma once

namespace tm {

#ifndef TM_DOT_ROWS
#define TM_DOT_ROWS 8
#endif
constexpr int kDotTileRows = TM_DOT_ROWS;

template <int MR, typename O>
void micro_dot(const bf16* x, int64_t ldx, const bf16* panel, int64_t K, const float* bias,
               O* out, int64_t ldo, int64_t cols, Prefetch pre) {
  constexpr bool kTwoSets = MR <= 3;
  __m512 c[MR][2], d[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = d[i][0] = d[i][1] = _mm512_setzero_ps();
  auto step = [&](__m512 (&acc)[MR][2], int64_t kp, bool tail) __attribute__((always_inline)) {
    const bf16* p = panel + kp * 2 * kPanel;
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(p), w1 = (__m512bh)_mm512_loadu_si512(p + kPanel);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      int32_t pair = 0;  // (x[2kp], x[2kp + 1]); an odd K's last pair is (x[K - 1], 0)
      std::memcpy(&pair, x + i * ldx + 2 * kp, tail ? 2 : 4);
      __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], b, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], b, w1);
    }
  };
  int64_t pairs = K / 2, kp = 0;
  for (; kp + 2 <= pairs; kp += 2) {
    pre.ahead(4 * kPanel * sizeof(bf16));
    step(c, kp, false);
    step(kTwoSets ? d : c, kp + 1, false);
  }
  if (kp < pairs) step(c, kp++, false);
  if (K % 2) step(c, kp, true);
  alignas(64) float tile[MR][kPanel];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm512_store_ps(tile[i], kTwoSets ? _mm512_add_ps(c[i][0], d[i][0]) : c[i][0]);
    _mm512_store_ps(tile[i] + kLanes, kTwoSets ? _mm512_add_ps(c[i][1], d[i][1]) : c[i][1]);
  }
  store_tile<MR>(tile, bias, out, ldo, cols);
}

template <int MR, typename W, typename O> struct Dot {
  static void run(const bf16* x, int64_t ldx, const W* panel, int64_t K, const float* bias,
                  O* out, int64_t ldo, int64_t cols, Prefetch pre) {
    micro_dot<MR, O>(x, ldx, panel, K, bias, out, ldo, cols, pre);
  }
};

}  // namespace tm
