// AMX only: the k loop of gemm_dot on tiles (included by gemm.cpp after gemm_dot.h).
// TDPBF16PS multiplies a 16-row x 32-k tile of bf16 inputs by a 16-pair x 16-column tile of
// weights held in the pair layout VDPBF16PS reads, so the packed panels load as they are: for
// k pairs kp..kp+15, a panel's columns 0-15 are 16 rows of 64 bytes at a stride of 128, and
// columns 16-31 the other 64 bytes of each. Tiles 0-3 accumulate 32 rows x 32 columns (float32),
// 4-5 hold inputs, 6-7 weights. The k pairs past the last whole tile step (K not a multiple of
// 32) are added by micro_dot. Inputs and weights are bf16 and products exact in float32, as in
// the VDPBF16PS kernel; only the order of the sums differs.
#pragma once

#include <cstring>

#include "amx_tiles.h"

namespace tm {

constexpr int64_t kAmxPairs = 16;   // k pairs per tile step (32 k)
constexpr int64_t kAmxMinRows = 4;  // fewer rows run on VDPBF16PS (a tile would be mostly padding)
#ifndef TM_AMX_AHEAD
#define TM_AMX_AHEAD 8192
#endif
constexpr int64_t kAmxAhead = TM_AMX_AHEAD;  // bytes of panel prefetched ahead of the tiles' loads

inline bool amx_runs(int64_t M, int64_t K, bool row_invariant) {
  return !row_invariant && M >= kAmxMinRows && K >= 2 * kAmxPairs;
}

// 16 rows of `width` bf16 inputs from src (stride ld) as a tile operand: src itself when all
// 16 rows exist, else the n rows copied into pad with zero rows after them (stride width).
inline const bf16* tile_rows(const bf16* src, int64_t ld, int64_t n, int64_t width, bf16* pad,
                             int64_t& tile_ld) {
  tile_ld = ld;
  if (n >= 16) return src;
  for (int64_t r = 0; r < n; ++r) std::memcpy(pad + r * width, src + r * ld, width * sizeof(bf16));
  std::memset(static_cast<void*>(pad + n * width), 0, (16 - n) * width * sizeof(bf16));
  tile_ld = width;
  return pad;
}

// x[0:rows] . panel over the k pairs [0, pairs) (a multiple of 16), 32 rows at a time, each
// 16 rows' results to emit(res, row0, n) from an L1-resident buffer; pad holds 32 rows of
// 2 x pairs inputs for a last tile with fewer rows. A row tile's results are emitted after the
// next row tile's tile products are issued, so the vector work overlaps them.
template <typename Emit>
void amx_panel(int64_t rows, const bf16* x, int64_t ldx, const bf16* panel, int64_t pairs,
               bf16* pad, const Emit& emit) {
  const int64_t width = 2 * pairs, wstride = 2 * kPanel * sizeof(bf16);
  alignas(64) float done[32][kPanel];  // the previous row tile's results
  int64_t done_row = 0, done_n = 0;
  auto flush = [&] {
    emit(done, done_row, std::min<int64_t>(16, done_n));
    if (done_n > 16) emit(done + 16, done_row + 16, done_n - 16);
  };
  for (int64_t i = 0; i < rows; i += 32) {
    const int64_t n = std::min<int64_t>(32, rows - i);
    const bool two = n > 16;
    int64_t lda0 = 0, lda1 = 0;
    const bf16* a0 = tile_rows(x + i * ldx, ldx, n, width, pad, lda0);
    const bf16* a1 = two ? tile_rows(x + (i + 16) * ldx, ldx, n - 16, width, pad + 16 * width, lda1)
                         : nullptr;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kp = 0; kp < pairs; kp += kAmxPairs) {
      const bf16* w = panel + kp * 2 * kPanel;
      if (kAmxAhead && i == 0) {  // the first row tiles stream the panel from memory: ask for it ahead
        const char* ahead = reinterpret_cast<const char*>(w) + kAmxAhead;
        for (int b = 0; b < kAmxPairs * 2 * kPanel * 2; b += 64) prefetch_l2(ahead + b);
      }
      _tile_loadd(6, w, wstride);
      _tile_loadd(7, w + kLanes * 2, wstride);
      _tile_loadd(4, a0 + 2 * kp, lda0 * sizeof(bf16));
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a1 + 2 * kp, lda1 * sizeof(bf16));
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    if (done_n) flush();
    tile_store(0, done[0], kPanel * sizeof(float));
    tile_store(1, done[0] + kLanes, kPanel * sizeof(float));
    if (two) {
      tile_store(2, done[16], kPanel * sizeof(float));
      tile_store(3, done[16] + kLanes, kPanel * sizeof(float));
    }
    done_row = i, done_n = n;
  }
  if (done_n) flush();
}

}  // namespace tm
