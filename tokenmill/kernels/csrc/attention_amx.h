// AMX only: the rows-in-lanes prefill attention's products (attention_prefill_lanes.h) on bf16
// tiles. Keys go 512 at a time (fewer, longer phases measured faster than 128 keys at a time), in
// tiles of 16 (scores) and 32 (values). Each K or V^T tile multiplies both groups' operands: one
// group per tile load had left both tile phases bound by reading the keys from L2 (with every
// load from L1 they took 45-70% less time), and the pair halves that traffic.
// - scores S^T (keys x rows): tiles 0-1 (group g) and 2-3 (group g + 1), 16 keys x 16 rows
//   each, float32, accumulate TDPBF16PS of 32 keys' rows (tiles 4 and 5) and each group's q
//   as pairs (tiles 6 and 7, transposed once per task);
// - the probabilities, rounded to bf16 (as values_dot rounds them) and paired by key (tiles 6
//   and 7), multiply V^T (tiles 4 and 5: 32 channels x 32 keys) into each group's float32
//   output O^T (channels x rows) in tiles 0-1 and 2-3, zeroed for its first block, else loaded
//   from and stored back to the task's scratch.
// Products of bf16 are exact in float32, as on the VDPBF16PS path; only the order of the sums
// differs (and not with the pairing: each tile sums as it did alone).
#pragma once

#include "amx_tiles.h"
#include "prefill_lanes.h"

namespace tm {

struct AmxAttention {
  static constexpr int64_t kBlock = 512;  // keys per softmax step
  AmxTiles tiles{true};

  void scores(const bf16* kr, int64_t D, int64_t keys, const uint32_t* q0, const uint32_t* q1,
              bool two, float* s, float* s1) {
    constexpr int64_t G = kLaneGroup;
    const int64_t ld = D * sizeof(bf16), ldq = G * sizeof(uint32_t);
    for (int64_t k = 0; k < keys; k += 32) {
      const bf16* kk = kr + k * D;
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(4, kk + c * 32, ld);
        _tile_loadd(5, kk + 16 * D + c * 32, ld);
        _tile_loadd(6, q0 + c * 16 * G, ldq);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, q1 + c * 16 * G, ldq);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      tile_store(0, s + k * G, G * sizeof(float));
      tile_store(1, s + (k + 16) * G, G * sizeof(float));
      if (two) {
        tile_store(2, s1 + k * G, G * sizeof(float));
        tile_store(3, s1 + (k + 16) * G, G * sizeof(float));
      }
    }
  }

  // 32 channels at a time: each V^T tile (tiles 4, 5) multiplies both groups' probabilities
  // (tiles 6, 7)
  void values(const uint32_t* vt0, int64_t D, int64_t n0, int64_t n1, const uint32_t* pp,
              const uint32_t* pp1, float* o0, float* o1, bool on0, bool on1, bool two) {
    constexpr int64_t G = kLaneGroup;
    const int64_t ld = 16 * sizeof(uint32_t), ldp = G * sizeof(uint32_t), ldo = G * sizeof(float);
    for (int64_t c = 0; c < D / 16; c += 2) {
      for (int u = 0; u < 2; ++u) {
        if (on0) tile_load(u, o0 + (c + u) * 16 * G, ldo);
        else tile_clear(u);
        if (!two) continue;
        if (on1) tile_load(2 + u, o1 + (c + u) * 16 * G, ldo);
        else tile_clear(2 + u);
      }
      for (int64_t k = 0; k < std::max(n0, n1); ++k) {
        const uint32_t* vt = vt0 + (k * D + c * 16) * 16;
        _tile_loadd(4, vt, ld);
        _tile_loadd(5, vt + 256, ld);
        if (k < n0) {
          _tile_loadd(6, pp + k * 16 * G, ldp);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (k < n1) {
          _tile_loadd(7, pp1 + k * 16 * G, ldp);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      for (int u = 0; u < 2; ++u) {
        tile_store(u, o0 + (c + u) * 16 * G, ldo);
        if (two) tile_store(2 + u, o1 + (c + u) * 16 * G, ldo);
      }
    }
  }
};

}  // namespace tm
