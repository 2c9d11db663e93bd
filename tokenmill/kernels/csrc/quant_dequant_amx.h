// AMX only: quant.cpp's prompt rows on bf16 tiles (quant_linear's prompt ranges, dequant_runs):
// bf16 input rows against 4-, 5- or 8-bit block-quantized weights. Each thread turns two groups
// of 16 outputs (one 32-column panel) at a time back into bf16 weights, w = d c + m rounded to
// bf16, in the pair layout of the bf16 GEMM's tiles (gemm_amx.h), and
// multiplies every input row by them there: the dequantizing is paid once per panel for all
// the rows, and the product is TDPBF16PS alone, without the int8 tiles' vector rescaling of
// every block's sums. The results are those of a bf16 model holding the dequantized weights
// (the activations are not quantized): not the int8 paths' bits, so the engine sends a row here
// by what it is (a prompt token), never by the call's row count. Against the int8 tiles at 512
// rows 2.1-2.4x faster with a third of the error; from 32 rows faster, and at 16 rows ~1.4x
// slower (the dequantizing paid whatever the rows).
#pragma once

#include <vector>

#include "gemm_amx.h"
#include "gemm_store.h"
#include "quant_tiles.h"

namespace tm {

// Whether prompt rows of x in `dtype` against w run here (bf16 rows; batch-invariant mode keeps
// every row on the int8 path)
inline bool dequant_runs(int dtype, const tm_linear* w) {
  return dtype == TM_BF16 && !w->row_invariant;
}

// The group of 16 outputs at grp (K / 32 blocks) as bf16 columns [col0, col0 + 16) of a panel:
// weight (k, col) at panel[k / 2 * 2 kPanel + 2 col + k % 2]. One lane per output: a chunk's
// 64 bytes are 16 lanes of 4 codes (byte 4 o + t); 5 bits: the fifth bits of chunk j's low (high)
// nibbles are bits 4 o + t of the 64-bit word 2 j (2 j + 1) after the chunks; 6 bits: bits 4-5
// of chunk j's low (high) nibbles are bits 8 t + 2 j, 8 t + 2 j + 1 of lane o of the 64 bytes
// (the next 64) after the chunks. The high nibbles (k >= 16) take d, m of their half.
template <int Q>
void dequant_group(const uint8_t* grp, int64_t K, bf16* panel, int64_t col0) {
  static_assert(kLanes == kGroup, "one lane per output of a group");
  constexpr int BITS = qbits(Q);
  constexpr int64_t C = scale_bytes(Q);  // where the codes start
  const __m512i mask = _mm512_set1_epi32(BITS == 8 ? 0xFF : 0x0F), one = _mm512_set1_epi32(1);
  // a fifth-bit word as lanes: lane o holds bits 4 o .. 4 o + 3 at its bottom
  const __m512i dword = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i shift4 = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = grp + b * group_bytes(Q);
    vec d[2], mn[2];
    vscales<Q>(grp, K / kBlock, b, 0, d[0], mn[0]);
    if constexpr (qhalves(Q)) vscales<Q>(grp, K / kBlock, b, 0, d[1], mn[1], 1);
    else d[1] = d[0], mn[1] = mn[0];
    for (int64_t j = 0; j < (BITS == 8 ? 8 : 4); ++j) {
      const __m512i c = _mm512_loadu_si512(blk + C + 64 * j);
      __m512i fifth[2] = {};
      for (int hi = 0; BITS == 5 && hi < 2; ++hi) {
        uint64_t word;
        std::memcpy(&word, blk + C + 256 + 8 * (2 * j + hi), 8);
        const __m512i lanes = _mm512_permutexvar_epi32(dword, _mm512_set1_epi64(word));
        fifth[hi] = _mm512_srlv_epi32(lanes, shift4);
      }
      auto weight = [&](int t, int hi) {  // code t of each lane (8 t bits in; high nibble: + 4)
        __m512i code = _mm512_and_si512(_mm512_srli_epi32(c, 8 * t + 4 * hi), mask);
        if (BITS == 5) {
          const __m512i bit = _mm512_and_si512(_mm512_srli_epi32(fifth[hi], t), one);
          code = _mm512_or_si512(code, _mm512_slli_epi32(bit, 4));
        }
        if (BITS == 6) {  // bits 8 t + 2 j, + 1 of the lane to bits 4-5
          const __m512i pairs = _mm512_loadu_si512(blk + C + 256 + 64 * hi);
          const __m512i two = _mm512_srlv_epi32(pairs, _mm512_set1_epi32(static_cast<int>(8 * t + 2 * j)));
          code = _mm512_or_si512(code, _mm512_slli_epi32(_mm512_and_si512(two, _mm512_set1_epi32(3)), 4));
        }
        return vfma(_mm512_cvtepi32_ps(code), d[hi], mn[hi]);
      };
      auto put = [&](int64_t k, int t, int hi) {  // k = 4 j + t (+ 16 high) and k + 1
        bf16* dst = panel + (b * kBlock + k) / 2 * 2 * kPanel + 2 * col0;
        store_bf16_pairs(weight(t, hi), weight(t + 1, hi), reinterpret_cast<uint32_t*>(dst));
      };
      put(4 * j, 0, 0);
      put(4 * j + 2, 2, 0);
      if (BITS != 8) {
        put(16 + 4 * j, 0, 1);
        put(16 + 4 * j + 2, 2, 1);
      }
    }
  }
}

// out (m, N; rows ldo apart) = x (m, K) bf16 . w^T (+ bias), panel by panel (parallel_steal):
// each dequantized once, then every block of input rows through amx_panel
template <int Q, typename O>
void qgemm_dequant(const bf16* x, int64_t m, const tm_linear* w, O* out, int64_t ldo) {
  const int64_t N = w->n, K = w->k, groups = (N + kGroup - 1) / kGroup, panels = (groups + 1) / 2;
  const int64_t gstride = group_stride(Q, K), pairs = K / 2;
  const int64_t block = std::max<int64_t>(32, (512 << 10) / (K * 2) / 32 * 32);  // rows
  const auto* wq = static_cast<const uint8_t*>(w->packed);
  parallel_steal(0, panels, [&](const auto& take) {
    thread_local std::vector<bf16> panel, pad;
    panel.resize(pairs * 2 * kPanel), pad.resize(32 * 2 * pairs);
    AmxTiles tiles(true);
    for (int64_t p, hint; take(p, hint);) {
      dequant_group<Q>(wq + 2 * p * gstride, K, panel.data(), 0);
      if (2 * p + 1 < groups) {
        dequant_group<Q>(wq + (2 * p + 1) * gstride, K, panel.data(), kGroup);
      } else {  // no second group: its columns zero
        for (int64_t kp = 0; kp < pairs; ++kp)
          std::fill(panel.begin() + kp * 2 * kPanel + 2 * kGroup,
                    panel.begin() + (kp + 1) * 2 * kPanel, bf16{});
      }
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      for (int64_t r0 = 0; r0 < m; r0 += block) {
        auto emit = [&](const float (*res)[kPanel], int64_t row, int64_t n) {
          for (int64_t i = 0; i < n; ++i)
            store_tile<1>(*reinterpret_cast<const float(*)[1][kPanel]>(res + i),
                          w->bias ? w->bias + n0 : nullptr, out + (r0 + row + i) * ldo + n0, ldo,
                          cols, false);
        };
        amx_panel(std::min(block, m - r0), x + r0 * K, K, panel.data(), pairs, pad.data(), emit);
      }
    }
  });
}

}  // namespace tm
