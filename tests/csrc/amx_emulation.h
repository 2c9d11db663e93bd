// The AMX tile intrinsics (palette 1) in plain C++, force-included into a build of the kernels
// for a CPU without AMX (tests/test_amx_emulated.py): the tile code's layouts, strides and
// masking then run on any machine. TDPBF16PS is emulated as the manual states it: per output
// element, for each k pair, the two bf16 products added in float32 to the accumulator; TDPBSUD
// as exact int32 sums of signed x unsigned bytes.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbsud

// TDPBF16PS executed (a test checks the tiles ran); defined weak in every source file
extern "C" __attribute__((visibility("default"), weak)) int64_t tm_emulated_tile_ops = 0;

namespace tm_amx_emulation {

struct Tile {
  int rows = 0, colsb = 0;
  uint8_t data[16][64];
};
inline thread_local Tile tiles[8];
inline thread_local bool configured = false;

inline void check(bool ok) {
  if (!ok) __builtin_trap();  // what the CPU would fault on: no configuration, bad shapes
}

inline void loadconfig(const void* cfg) {
  const auto* b = static_cast<const uint8_t*>(cfg);
  check(b[0] == 1);
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, b + 16 + 2 * t, 2);
    tiles[t].colsb = colsb;
    tiles[t].rows = b[48 + t];
    check(colsb <= 64 && tiles[t].rows <= 16);
  }
  configured = true;
}

inline void load(int t, const void* p, int64_t stride) {
  check(configured);
  for (int r = 0; r < tiles[t].rows; ++r)
    std::memcpy(tiles[t].data[r], static_cast<const char*>(p) + r * stride, tiles[t].colsb);
}

inline void store(int t, void* p, int64_t stride) {
  check(configured);
  for (int r = 0; r < tiles[t].rows; ++r)
    std::memcpy(static_cast<char*>(p) + r * stride, tiles[t].data[r], tiles[t].colsb);
}

inline void zero(int t) {
  check(configured);
  std::memset(tiles[t].data, 0, sizeof tiles[t].data);
}

inline float bf16_at(const uint8_t* p) {
  uint32_t u = 0;
  std::memcpy(reinterpret_cast<char*>(&u) + 2, p, 2);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// C[m][n] (an Acc: float or int32) += dot(a row m's 4-byte group k, b row k's 4-byte column n)
// over the groups k, for every element: the shape checks and loop the products share.
template <typename Acc, typename Dot>
inline void product(int c, int a, int b, const Dot& dot) {
  check(configured);
  const Tile &A = tiles[a], &B = tiles[b];
  Tile& C = tiles[c];
  const int M = A.rows, K = A.colsb / 4, N = B.colsb / 4;
  check(B.rows == K && C.rows == M && C.colsb == 4 * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      Acc acc;
      std::memcpy(&acc, C.data[m] + 4 * n, 4);
      for (int k = 0; k < K; ++k) dot(acc, A.data[m] + 4 * k, B.data[k] + 4 * n);
      std::memcpy(C.data[m] + 4 * n, &acc, 4);
    }
  __atomic_add_fetch(&tm_emulated_tile_ops, 1, __ATOMIC_RELAXED);
}

inline void dpbf16ps(int c, int a, int b) {  // the two bf16 products added in turn
  product<float>(c, a, b, [](float& acc, const uint8_t* x, const uint8_t* w) {
    acc += bf16_at(x) * bf16_at(w);
    acc += bf16_at(x + 2) * bf16_at(w + 2);
  });
}

// TDPBSUD: the int32 sum of signed (A) x unsigned (B) byte products.
inline void dpbsud(int c, int a, int b) {
  product<int32_t>(c, a, b, [](int32_t& acc, const uint8_t* x, const uint8_t* w) {
    for (int t = 0; t < 4; ++t) acc += static_cast<int8_t>(x[t]) * static_cast<int32_t>(w[t]);
  });
}

}  // namespace tm_amx_emulation

#define _tile_loadconfig(cfg) tm_amx_emulation::loadconfig(cfg)
#define _tile_release() (tm_amx_emulation::configured = false)
#define _tile_loadd(t, p, stride) tm_amx_emulation::load(t, p, stride)
#define _tile_stored(t, p, stride) tm_amx_emulation::store(t, p, stride)
#define _tile_zero(t) tm_amx_emulation::zero(t)
#define _tile_dpbf16ps(c, a, b) tm_amx_emulation::dpbf16ps(c, a, b)
#define _tile_dpbsud(c, a, b) tm_amx_emulation::dpbsud(c, a, b)
