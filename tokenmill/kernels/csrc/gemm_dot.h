// AVX512-BF16 only: GEMM on pair-packed bf16 panels (included by gemm.cpp).
// VDPBF16PS adds (x[k] * w[k] + x[k + 1] * w[k + 1]) to each float32 lane: a panel holds, per
// pair of k, the NR = 32 rows' two weights side by side (two zmm vectors), and each input row
// broadcasts its (x[k], x[k + 1]) pair. Products of two bf16 values are exact in float32, so
// this sums the same terms as the FMA kernel, in another order, with half the instructions.
//
// The k loop runs in chunks of a panel that stay in L1 while every row tile of the block uses
// them; the first tile of a chunk prefetches the next chunk into L2 as it goes, so the memory
// stream of a decode batch overlaps the arithmetic of its other tiles.
#pragma once

namespace tm {

constexpr int kDotTileRows = 8;  // 16 of the 32 zmm registers accumulate
constexpr int64_t kDotChunk = 128;  // k pairs: 128 x 128 bytes = 16 KiB of panel
constexpr int64_t kStreamRows = 4;  // calls of up to this many rows may prefetch nta

// acc[i] (+)= x[i] . panel over k pairs [kp0, kp1) for MR input rows (stride ldx); the pair at
// `pairs` (when kp1 passes it) is an odd K's last k, paired with a zero.
template <int MR>
void micro_dot(const bf16* x, int64_t ldx, const bf16* panel, int64_t kp0, int64_t kp1,
               int64_t pairs, bool first, float (*acc)[kPanel], const char* pf, bool nta) {
  constexpr bool kTwoSets = MR <= 3;  // few rows: enough independent chains in flight
  __m512 c[MR][2], d[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    c[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[i]);
    c[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[i] + kLanes);
    d[i][0] = d[i][1] = _mm512_setzero_ps();
  }
  auto step = [&](__m512 (&a)[MR][2], int64_t kp, bool tail) __attribute__((always_inline)) {
    const bf16* p = panel + kp * 2 * kPanel;
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(p), w1 = (__m512bh)_mm512_loadu_si512(p + kPanel);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      int32_t pair = 0;
      std::memcpy(&pair, x + i * ldx + 2 * kp, tail ? 2 : 4);
      __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      a[i][0] = _mm512_dpbf16_ps(a[i][0], b, w0);
      a[i][1] = _mm512_dpbf16_ps(a[i][1], b, w1);
    }
  };
  int64_t end = std::min(kp1, pairs), kp = kp0;
  for (; kp + 2 <= end; kp += 2) {
    if (pf) {  // two k pairs = 256 bytes of panel, prefetched a chunk ahead (into L2, or nta)
      for (int b = 0; b < 256; b += 64)
        nta ? prefetch_nta(pf + (kp - kp0) * 128 + b) : prefetch_l2(pf + (kp - kp0) * 128 + b);
    }
    step(c, kp, false);
    step(kTwoSets ? d : c, kp + 1, false);
  }
  if (kp < end) step(c, kp++, false);
  if (kp1 > pairs) step(c, pairs, true);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(acc[i], kTwoSets ? _mm512_add_ps(c[i][0], d[i][0]) : c[i][0]);
    _mm512_storeu_ps(acc[i] + kLanes, kTwoSets ? _mm512_add_ps(c[i][1], d[i][1]) : c[i][1]);
  }
}

template <int R>
void micro_dot_rows(int64_t rows, const bf16* x, int64_t ldx, const bf16* panel, int64_t kp0,
                    int64_t kp1, int64_t pairs, bool first, float (*acc)[kPanel],
                    const char* pf, bool nta) {
  if (rows >= R) return micro_dot<R>(x, ldx, panel, kp0, kp1, pairs, first, acc, pf, nta);
  if constexpr (R > 1)
    micro_dot_rows<R - 1>(rows, x, ldx, panel, kp0, kp1, pairs, first, acc, pf, nta);
}

// Work items are (row block, panel) pairs as in gemm_packed (parallel_steal); within one, chunk
// by chunk of k, every row tile accumulates into a float32 scratch, stored to out after the
// last chunk.
template <typename O>
void gemm_dot(const bf16* x, const bf16* w, int64_t panel_elems, const float* bias, O* out,
              int64_t M, int64_t N, int64_t K, bool row_invariant, bool gated) {
  const int64_t ldo = gated ? N / 2 : N;  // gated: see store_tile
  constexpr int MR = kDotTileRows;
  const int64_t tile_rows = row_invariant ? 1 : MR;
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = K / 2, total = (K + 1) / 2;
#ifdef TM_ISA_AMX  // whole tile steps of k on AMX, the rest (if any) below
  const bool amx = amx_runs(M, K, row_invariant);
  const int64_t tile_pairs = amx ? pairs / kAmxPairs * kAmxPairs : 0;
#else
  const bool amx = false;
  const int64_t tile_pairs = 0;
#endif
  // AMX, a prompt's rows and a weight no larger than a core's L2: one row block per thread,
  // so each core multiplies the rows it wrote in the op before (the norms and RoPE split rows
  // the same way) and writes the rows it reads in the op after, reading the whole weight from
  // L3 instead of half of it and the other core's rows (a 512-token prompt 1.02-1.03x)
  const bool own_rows = amx && M >= 128 * g_threads && N * K * 2 <= 2 * row_block_bytes();
  const RowBlocks rb(M, K, amx ? 32 : MR, sizeof(bf16), own_rows ? g_threads : 1);
  const int64_t block = rb.size, blocks = rb.count;
  // up to 4 rows a call is a memory stream with little arithmetic between loads: there the
  // L2 prefetch slowed a 1-row GEMM 1.2-1.4x on a Zen 4 against none or prefetchnta (which
  // kernels/stream_prefetch.py chooses by measurement); from ~5 rows it overlaps the stream
  // with the tiles' arithmetic (8 rows: 1.2x faster than nta)
  const bool nta = g_stream_nta && M <= kStreamRows;
  parallel_steal(0, blocks * panels, [&](const auto& take) {
    thread_local std::vector<float> scratch;
    scratch.resize(block * kPanel);
    auto* acc = reinterpret_cast<float(*)[kPanel]>(scratch.data());
#ifdef TM_ISA_AMX
    const int tile_m = amx_tile_rows(M);  // the tiles' rows: M under 16
    AmxTiles tiles(amx, 64, tile_m);
    thread_local std::vector<bf16> pad;
    pad.resize(amx ? 32 * 2 * tile_pairs : 0);
#endif
    for (int64_t t, t1; take(t, t1);) {  // t1: the end of the run this thread is taking
      int64_t m0 = t / panels * block, rows = std::min(M, m0 + block) - m0, p = t % panels;
      const bf16* panel = w + p * panel_elems;
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      const float* b = bias ? bias + n0 : nullptr;
      auto store_rows = [&](const float (*res)[kPanel], int64_t r0, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {  // out[m0 + r0 + i, n0:n0 + cols] (+ bias)
          const float (&row)[1][kPanel] = *reinterpret_cast<const float(*)[1][kPanel]>(res + i);
          store_tile<1>(row, b, out + (m0 + r0 + i) * ldo + (gated ? n0 / 2 : n0), ldo, cols, gated);
        }
      };
#ifdef TM_ISA_AMX
      if (amx && tile_pairs == total) {  // the whole k on tiles: results straight to out
        const bool next = t + 1 < t1 && p + 1 < panels;  // this thread's next panel
        amx_panel(rows, x + m0 * K, K, panel, tile_pairs, pad.data(), store_rows, tile_m,
                  next ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr,
                  panel_elems * sizeof(bf16));
        continue;
      }
      if (amx) {  // a k tail follows on VDPBF16PS, accumulating into acc
        amx_panel(rows, x + m0 * K, K, panel, tile_pairs, pad.data(),
                  [&](const float (*res)[kPanel], int64_t r0, int64_t n) {
                    std::memcpy(acc[r0], res[0], n * sizeof(float[kPanel]));
                  }, tile_m);
      }
#endif
      // the next chunk (of this panel, or the next one when this thread reads it next)
      const char* stop = reinterpret_cast<const char*>(panel + panel_elems) +
                         (t + 1 < t1 && p + 1 < panels ? panel_elems * 2 : 0);
      for (int64_t kp = tile_pairs; kp < total; kp += kDotChunk) {
        const char* pf = reinterpret_cast<const char*>(panel + (kp + kDotChunk) * 2 * kPanel);
        for (int64_t i = 0; i < rows; i += tile_rows)
          micro_dot_rows<MR>(std::min<int64_t>(tile_rows, rows - i), x + (m0 + i) * K, K, panel, kp,
                             std::min(total, kp + kDotChunk), pairs, kp == 0, acc + i,
                             i == 0 && pf < stop ? pf : nullptr, nta);
      }
      store_rows(acc, 0, rows);
    }
  });
}

}  // namespace tm
