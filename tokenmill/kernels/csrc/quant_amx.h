// AMX only (and the emulated tiles of tests/test_amx_emulated.py): the block-quantized GEMM of
// quant.cpp on AMX-INT8 tiles, for calls of many input rows (prompts, batches: amx_quant_runs).
//
// Per quantization block (32 k), 16 input rows and one group of 16 outputs, TDPBSUD gives the
// 256 exact int32 sums sum_k c * q the vector tiles make with VPDPBUSD. The left tile is the
// rows' int8 codes, written by quantize_rows in tile order (16 rows x 32 bytes per block); the
// right one the group's unsigned codes as 8 rows of 64 bytes, row j holding codes k = 4 j ..
// 4 j + 3 of the 16 outputs (byte 4 o + t): the packed layout's chunks as they are (8 bits), or
// with their nibbles split into rows 0-3 (low: k 0-15) and 4-7 (high: k 16-31) and the fifth
// bits added. The sums leave the tile through memory and are scaled into float32 accumulators
// exactly as the vector tiles scale theirs (y += m sx, then y += float(s) d dx), so both paths
// give the same bits and a row's output does not depend on the rows beside it.
//
// On the Xeon measured (docs/performance.md, "Stop 50") tile and vector work add up instead of
// overlapping, and a block's scaling (4 vector operations per row and 16 outputs; VNNI: 12 with
// its 8 dot products) bounds the gain at ~1.2x; below 64 rows unpacking the nibbles and storing
// the outputs cost more than the tiles save, and the vector tiles run.
#pragma once

#include <vector>

#include "amx_tiles.h"
#include "quant_tiles.h"
#include "vec.h"

namespace tm {

// From how many input rows the tiles run: 4/5-bit codes are unpacked for them, which pays from
// 64 rows; 8-bit codes load as packed (the default model's Q8_0 LM head at 16 rows 1.14 ->
// 0.79 ms, 32 rows 1.97 -> 1.47; at 8 rows level)
constexpr int64_t kAmxQuantRows = 64, kAmxQuantRows8 = 16;
constexpr int64_t kAmxQuantChunk = 256;    // input rows whose codes stay in L2 across groups
constexpr int64_t kRightBytes = 8 * 64;    // one block's right tile
constexpr int64_t kTileCodes = 16 * kBlock;  // one block's left tile (quantize_rows, tiled)

inline bool amx_quant_runs(int64_t m, bool row_invariant, int quant) {
  return !row_invariant && !qhalves(quant) &&  // 6 bits: a scale per half block, not here
         m >= (qbits(quant) == 8 ? kAmxQuantRows8 : kAmxQuantRows);
}

// Group `grp`'s blocks as right tiles, kRightBytes apart, into `out` (4 and 5 bits).
template <int Q>
void unpack_group(const uint8_t* grp, int64_t blocks, uint8_t* out) {
  constexpr int BITS = qbits(Q);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* codes = grp + b * group_bytes(Q) + scale_bytes(Q);
    uint8_t* dst = out + b * kRightBytes;
    for (int j = 0; j < 4; ++j) {
      uint64_t planes[2] = {0, 0};
      if constexpr (BITS == 5) std::memcpy(planes, codes + 256 + 16 * j, 16);
      for (int p = 0; p < 64; ++p) {
        const uint8_t v = codes[64 * j + p];
        dst[64 * j + p] = static_cast<uint8_t>((v & 0xF) | ((planes[0] >> p & 1) << 4));
        dst[64 * (4 + j) + p] = static_cast<uint8_t>((v >> 4) | ((planes[1] >> p & 1) << 4));
      }
    }
  }
}

// 16 rows (their codes `x`, 16 x 32 bytes a block) times one group (`right`: its right tiles,
// `step` bytes apart; `grp`: its packed blocks, for the scales), all blocks, into y. Two blocks
// in flight (tiles 4 / 6 / 0 and 5 / 7 / 1): block b + 1's products are issued before block b's
// sums are stored and scaled, so the tile loads never wait behind a store of sums and the
// products run while the vector units scale the previous block.
template <int Q>
void amx_rows_group(const int8_t* x, const float* dx, const float* sx, int64_t blocks,
                    const uint8_t* grp, const uint8_t* right, int64_t step, float (*y)[kGroup]) {
  constexpr int H = kGroup / kLanes;
  alignas(64) int32_t sums[16][kGroup];
  vec acc[16][H];
  for (auto& row : acc)
    for (auto& a : row) a = vzero();
  auto products = [&](int64_t b) {
    if (b % 2 == 0) {
      _tile_loadd(4, x + b * kTileCodes, kBlock);
      _tile_loadd(6, right + b * step, 64);
      _tile_zero(0);
      _tile_dpbsud(0, 4, 6);
    } else {
      _tile_loadd(5, x + b * kTileCodes, kBlock);
      _tile_loadd(7, right + b * step, 64);
      _tile_zero(1);
      _tile_dpbsud(1, 5, 7);
    }
  };
  products(0);
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) products(b + 1);
    if (b % 2 == 0) _tile_stored(0, sums, kGroup * sizeof(int32_t));
    else _tile_stored(1, sums, kGroup * sizeof(int32_t));
    // y += m sx, then y += float(s) d dx, as the vector tiles do
    vec d[H], mn[H];
    for (int l = 0; l < H; ++l) vscales<Q>(grp, blocks, b, l * kLanes, d[l], mn[l]);
    for (int r = 0; r < 16; ++r) {
      const vec xd = vset1(dx[r * blocks + b]), xs = vset1(sx[r * blocks + b]);
      for (int l = 0; l < H; ++l) {
        acc[r][l] = vfma(mn[l], xs, acc[r][l]);
        acc[r][l] = vfma(vcvt_i32(vload_i32(sums[r] + l * kLanes)), vmul(d[l], xd), acc[r][l]);
      }
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int l = 0; l < H; ++l) vstore(y[r] + l * kLanes, acc[r][l]);
}

// out rows [0, m) = x . w where amx_quant_runs; xq, dx, sx hold whole 16-row tiles (rows past
// m zero). store_rows(i, R, g, y) writes R rows of group g from y.
template <int Q, typename StoreRows>
void qgemm_amx(const int8_t* xq, const float* dx, const float* sx, int64_t m, int64_t N,
               int64_t K, const uint8_t* wq, const StoreRows& store_rows) {
  const int64_t groups = (N + kGroup - 1) / kGroup, blocks = K / kBlock;
  constexpr int BITS = qbits(Q);
  const int64_t gstride = group_stride(Q, K), tiles_end = (m + 15) / 16 * 16;
  parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {  // pairs of groups
    AmxTiles tiles(true, kBlock);
    thread_local std::vector<uint8_t> right;
    right.resize(BITS == 8 ? 0 : 2 * blocks * kRightBytes);
    for (int64_t i0 = 0; i0 < tiles_end; i0 += kAmxQuantChunk) {
      const int64_t i1 = std::min(tiles_end, i0 + kAmxQuantChunk);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t g = 2 * p;
        const int ng = g + 1 < groups ? 2 : 1;
        const uint8_t* grp = wq + g * gstride;
        const uint8_t* r = grp + scale_bytes(Q);  // 8 bits: the packed chunks are the right tiles
        int64_t step = group_bytes(Q), gstep = gstride;
        if constexpr (BITS != 8) {
          for (int q = 0; q < ng; ++q)
            unpack_group<Q>(grp + q * gstride, blocks, right.data() + q * blocks * kRightBytes);
          r = right.data(), step = kRightBytes, gstep = blocks * kRightBytes;
        }
        for (int64_t i = i0; i < i1; i += 16)
          for (int q = 0; q < ng; ++q) {
            alignas(64) float y[16][kGroup];
            amx_rows_group<Q>(xq + i * K, dx + i * blocks, sx + i * blocks, blocks,
                                 grp + q * gstride, r + q * gstep, step, y);
            store_rows(i, static_cast<int>(std::min<int64_t>(16, m - i)), g + q, y);
          }
      }
    }
  });
}

}  // namespace tm
