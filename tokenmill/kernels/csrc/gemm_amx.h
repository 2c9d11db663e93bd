// AMX only: the k loop of gemm_dot on tiles (included by gemm.cpp after gemm_dot.h).
// TDPBF16PS multiplies a 16-row x 32-k tile of bf16 inputs by a 16-pair x 16-column tile of
// weights held in the pair layout VDPBF16PS reads, so the packed panels load as they are: for
// k pairs kp..kp+15, a panel's columns 0-15 are 16 rows of 64 bytes at a stride of 128, and
// columns 16-31 the other 64 bytes of each. Tiles 0-3 accumulate 32 rows x 32 columns (float32),
// 4-5 hold inputs, 6-7 weights. The k pairs past the last whole tile step (K not a multiple of
// 32) are added by micro_dot. Inputs and weights are bf16 and products exact in float32, as in
// the VDPBF16PS kernel; only the order of the sums differs.
// Every row count runs here (a call of fewer than 16 rows on tiles of that many rows), so a
// row's result never depends on the rows beside it or on how many there are (K a multiple of
// 32): decode, verify and batched rows of a bf16 model give the same bits, and speculation on
// bf16 weights is exact. Against VDPBF16PS (30 layers of SmolLM2's GEMMs, weights from L3):
// 1-3 rows level (1 row ~3% slower), 4-8 rows 13-16% faster.
#pragma once

#include <cstring>

#include "amx_tiles.h"

namespace tm {

constexpr int64_t kAmxPairs = 16;  // k pairs per tile step (32 k)
#ifndef TM_AMX_AHEAD
#define TM_AMX_AHEAD 8192
#endif
constexpr int64_t kAmxAhead = TM_AMX_AHEAD;  // bytes of panel prefetched ahead of the tiles' loads

inline bool amx_runs(int64_t M, int64_t K, bool row_invariant) {
  return !row_invariant && M >= 1 && K >= 2 * kAmxPairs;
}

// The rows of the tiles for a call of M input rows: M itself under 16 (AmxTiles' rows)
inline int amx_tile_rows(int64_t M) { return M < 16 ? static_cast<int>(M) : 16; }

// A tile's rows of `width` bf16 inputs from src (stride ld) as a tile operand: src itself when
// the tile's rows (tile_m) all exist, else the n rows copied into pad with zero rows after them
// (stride width).
inline const bf16* tile_rows(const bf16* src, int64_t ld, int64_t n, int64_t width, bf16* pad,
                             int64_t& tile_ld, int64_t tile_m = 16) {
  tile_ld = ld;
  if (n >= tile_m) return src;
  for (int64_t r = 0; r < n; ++r) std::memcpy(pad + r * width, src + r * ld, width * sizeof(bf16));
  std::memset(static_cast<void*>(pad + n * width), 0, (16 - n) * width * sizeof(bf16));
  tile_ld = width;
  return pad;
}

// x[0:rows] . panel over the k pairs [0, pairs) (a multiple of 16), 32 rows at a time, each
// 16 rows' results to emit(res, row0, n) from an L1-resident buffer; pad holds 32 rows of
// 2 x pairs inputs for a last tile with fewer rows. A row tile's results are emitted after the
// next row tile's tile products are issued, so the vector work overlaps them. tile_m: the
// tiles' rows as configured (amx_tile_rows of the call's rows). next: the panel this thread
// multiplies next (next_bytes of it), prefetched into L2 in equal shares over the row tiles
// after the first, so its first row tile does not wait on L3 (a 512-token prompt 1.03x).
template <typename Emit>
void amx_panel(int64_t rows, const bf16* x, int64_t ldx, const bf16* panel, int64_t pairs,
               bf16* pad, const Emit& emit, int64_t tile_m = 16, const char* next = nullptr,
               int64_t next_bytes = 0) {
  const int64_t width = 2 * pairs, wstride = 2 * kPanel * sizeof(bf16);
  const int64_t row_tiles = (rows + 31) / 32, steps = pairs / kAmxPairs;
  const int64_t share = row_tiles > 1 ? (next_bytes / (row_tiles - 1) + 63) / 64 * 64 : 0;
  const int64_t per_step = (share / 64 + steps - 1) / steps * 64;  // bytes a k step asks for
  alignas(64) float done[32][kPanel];  // the previous row tile's results
  int64_t done_row = 0, done_n = 0;
  auto flush = [&] {
    emit(done, done_row, std::min<int64_t>(16, done_n));
    if (done_n > 16) emit(done + 16, done_row + 16, done_n - 16);
  };
  for (int64_t i = 0; i < rows; i += 32) {
    const int64_t n = std::min<int64_t>(32, rows - i);
    const char* pf = next && i ? next + (i / 32 - 1) * share : nullptr;  // this tile's share
    const char* pf_end = pf ? std::min(next + next_bytes, pf + share) : nullptr;
    const bool two = n > 16;
    int64_t lda0 = 0, lda1 = 0;
    const bf16* a0 = tile_rows(x + i * ldx, ldx, n, width, pad, lda0, tile_m);
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
      for (int64_t b = 0; pf && b < per_step && pf < pf_end; b += 64, pf += 64) prefetch_l2(pf);
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
