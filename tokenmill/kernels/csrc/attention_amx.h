// AMX only: PrefillTask::run's work (one KV head, one tile of query positions) on bf16 tiles,
// for an unquantized bf16 cache and a head size that is a multiple of 32 (included by
// attention_prefill.cpp). Keys go 32 at a time, query rows (position x GQA head) 16 at a time:
// - scores: tiles 0 and 1 (16 rows x 16 keys each, float32) accumulate TDPBF16PS of the rows'
//   q (tile 4) and the keys' pairs (tile 6), scaled afterwards as scores_dot does;
// - the online softmax is softmax_step's, as two steps of 16 keys;
// - the probabilities, rounded to bf16 as values_dot rounds them (tile 4), times the value pairs
//   (tile 6, 16 output columns each) add into the rows' float32 outputs in tiles 0-3, loaded
//   from and stored back to the task's output rows.
// Products of bf16 are exact in float32, as on the VDPBF16PS path; only the order of the sums
// differs.
#pragma once

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"

namespace tm {

constexpr int64_t kAmxKeys = 32;  // keys per step: two 16-key score tiles

// keys [p, p + n) of KV head h: K as two 16-key tiles of pairs kp[half][d/2][16], V as pairs
// vp[j/2][d] of two keys; zero past n
template <typename Task>
void amx_load_keys(const Task& t, int64_t h, int64_t p, int64_t n, PrefillScratch& sc) {
  const int64_t D = t.D, half = D / 2 * 16;
  if (n < kAmxKeys) {
    std::fill(sc.kp.begin(), sc.kp.end(), 0u);
    std::fill(sc.vp.begin(), sc.vp.end(), 0u);
  }
  for (int64_t j = 0; j < n; ++j) {
    const auto* pairs = reinterpret_cast<const uint32_t*>(t.kc + t.at(h, p + j));
    uint32_t* dst = sc.kp.data() + j / 16 * half + j % 16;
    for (int64_t d = 0; d < D / 2; ++d) dst[d * 16] = pairs[d];
  }
  for (int64_t j = 0; j < n; j += 2)
    t.value_pair(t.vc + t.at(h, p + j), j + 1 < n ? t.vc + t.at(h, p + j + 1) : nullptr,
                 sc.vp.data() + j / 2 * D);
}

// rows [r0, r0 + 16) of q (bf16 pairs, rows D / 2 apart) against the loaded keys: s[16][32]
inline void amx_scores(const uint32_t* qp, const uint32_t* kp, int64_t D, float scale, float* s) {
  const int64_t half = D / 2 * 16;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < D / 2; k += 16) {
    _tile_loadd(4, qp + k, D * 2);
    _tile_loadd(6, kp + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(6, kp + half + k * 16, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  _tile_stored(0, s, kAmxKeys * sizeof(float));
  _tile_stored(1, s + 16, kAmxKeys * sizeof(float));
  for (int64_t i = 0; i < 16 * kAmxKeys; i += kLanes) vstore(s + i, vmul(vload(s + i), vset1(scale)));
}

// 32 probabilities of a row as bf16 (round to nearest even, as values_dot's conversion)
inline void amx_probs(const float* s, bf16* pp) {
#ifdef TM_ISA_AMX
  _mm512_storeu_si512(pp, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s)));
#else
  for (int64_t j = 0; j < kAmxKeys; ++j) pp[j] = to_bf16(s[j]);
#endif
}

template <typename Task>
void amx_prefill_tile(const Task& t, int64_t h, int64_t i0, int64_t rows, PrefillScratch& sc) {
  const int64_t D = t.D, group = t.Hq / t.Hk, R = rows * group, padded = (R + 15) / 16 * 16;
  sc.qp.assign(padded * D / 2, 0u);  // rows past R stay zero: their scores and outputs are 0
  sc.kp.resize(kAmxKeys * D / 2), sc.vp.resize(kAmxKeys / 2 * D);
  sc.s.resize(16 * kAmxKeys), sc.pp.resize(16 * kAmxKeys / 2);
  sc.m.assign(R, -INFINITY), sc.l.assign(R * kLanes, 0.f), sc.o.assign(padded * D, 0.f);
  for (int64_t r = 0; r < R; ++r)  // row r: position i0 + r / group, head h * group + r % group
    std::memcpy(sc.qp.data() + r * D / 2, t.q + ((i0 + r / group) * t.Hq + h * group + r % group) * D,
                D * sizeof(bf16));
  AmxTiles tiles(true);
  const int64_t first = t.computed + i0, last = first + rows - 1;  // query positions
  float* s = sc.s.data();
  auto* pp = reinterpret_cast<bf16*>(sc.pp.data());
  for (int64_t p = t.window > 0 ? std::max<int64_t>(0, first - t.window + 1) : 0, n; p <= last;
       p += n) {
    n = std::min(kAmxKeys, last + 1 - p);
    amx_load_keys(t, h, p, n, sc);
    // row groups whose positions all come before the keys see none of them
    for (int64_t r0 = std::max<int64_t>(0, p - first) * group / 16 * 16; r0 < R; r0 += 16) {
      amx_scores(sc.qp.data() + r0 * D / 2, sc.kp.data(), D, t.scale, s);
      float corr[16];
      bool rescale = false;
      for (int64_t i = 0; i < std::min<int64_t>(16, R - r0); ++i) {
        const int64_t r = r0 + i, qpos = first + r / group;
        float* sr = s + i * kAmxKeys;
        corr[i] = t.softmax_step(sr, r, qpos, p, std::min<int64_t>(n, 16), sc);
        const float c = t.softmax_step(sr + 16, r, qpos, p + 16, std::max<int64_t>(0, n - 16), sc);
        if (c != 1.f)  // the second step's new maximum applies to the first's probabilities too
          for (int64_t j = 0; j < 16; ++j) sr[j] *= c;
        corr[i] *= c;
        rescale |= corr[i] != 1.f;
      }
      for (int64_t i = 0; i < 16; ++i) amx_probs(s + i * kAmxKeys, pp + i * kAmxKeys);
      float* o = sc.o.data() + r0 * D;
      if (rescale)
        for (int64_t i = 0; i < std::min<int64_t>(16, R - r0); ++i)
          for (int64_t d = 0; d < D; d += kLanes)
            vstore(o + i * D + d, vmul(vload(o + i * D + d), vset1(corr[i])));
      _tile_loadd(4, pp, kAmxKeys * sizeof(bf16));
      for (int64_t c = 0; c < D / 16; c += 4) {  // 4 tiles of 16 output columns at a time
        const int nt = static_cast<int>(std::min<int64_t>(4, D / 16 - c));
        for (int u = 0; u < nt; ++u) tile_load(u, o + (c + u) * 16, D * sizeof(float));
        for (int u = 0; u < nt; ++u) {
          _tile_loadd(6, sc.vp.data() + (c + u) * 16, D * sizeof(uint32_t));
          tile_dot_4_6(u);
        }
        for (int u = 0; u < nt; ++u) tile_store(u, o + (c + u) * 16, D * sizeof(float));
      }
    }
  }
  t.write_rows(h, i0, R, D, sc);
}

}  // namespace tm
