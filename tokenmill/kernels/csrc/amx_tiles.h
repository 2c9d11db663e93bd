// AMX only: a thread's tile configuration and the tile operations the GEMMs (gemm_amx.h,
// quant_amx.h) and the prefill attention (attention_amx.h) share. Tiles 0-3 accumulate (float32
// or int32, 16 rows x 64 bytes), 4-5 hold the left operands and 6-7 the right ones: 16 x 64
// bytes each, except where a kernel asks for narrower left operands (quant_amx.h: 32 bytes, one
// quantization block of int8) and right operands of fewer rows to match.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16_pairs.h"

namespace tm {

// The thread's tile configuration for one kernel call, released at the end (other code on this
// thread, oneDNN's, loads its own). left_bytes: the width of tiles 4-5; tiles 6-7 then have
// left_bytes / 4 rows (the k groups of 4 bytes a left row holds). rows: the rows of tiles 0-5
// (a call of fewer than 16 input rows: its rows read in place, no padding).
class AmxTiles {
 public:
  explicit AmxTiles(bool on, int left_bytes = 64, int rows = 16) : on_(on) {
    if (!on_) return;
    struct alignas(64) {
      uint8_t palette, start_row, reserved[14];
      uint16_t colsb[16];
      uint8_t rows[16];
    } cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = t == 4 || t == 5 ? left_bytes : 64;
      cfg.rows[t] = t >= 6 ? left_bytes / 4 : rows;
    }
    _tile_loadconfig(&cfg);
  }
  ~AmxTiles() {
    if (on_) _tile_release();
  }

 private:
  bool on_;
};

// Accumulator tile t (0-3) to memory (the intrinsic takes the tile number as a literal).
inline void tile_store(int t, void* p, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    case 2: _tile_stored(2, p, stride); break;
    default: _tile_stored(3, p, stride); break;
  }
}

// Accumulator tile t (0-3) from memory.
inline void tile_load(int t, const void* p, int64_t stride) {
  switch (t) {
    case 0: _tile_loadd(0, p, stride); break;
    case 1: _tile_loadd(1, p, stride); break;
    case 2: _tile_loadd(2, p, stride); break;
    default: _tile_loadd(3, p, stride); break;
  }
}

// Accumulator tile t (0-3) zeroed.
inline void tile_clear(int t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}

}  // namespace tm
