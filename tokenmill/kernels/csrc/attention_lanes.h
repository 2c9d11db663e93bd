// Decode attention scores with the keys in lanes (AVX512-BF16, bf16 caches, head_dim a multiple
// of 32; included by attention.cpp), for a KV head with many queries in one task (a sequence
// verifying drafts: rows x GQA heads). A chunk of up to 16 keys is transposed once into pair
// planes (plane p: dword pair p of each key, one key per lane); every query then takes 16
// scores from 2 x D/2 instructions per plane (VDPBF16PS with its pair broadcast) and one
// vertical add tree, with no horizontal reduction per key.
// The sums are exactly score_dot's: plane l of each 32-column group accumulates into
// accumulator l (l < 16) in group order, as lane l of score_dot's per-key accumulator does, and
// the tree adds the accumulators in vsum8's order (l + 8 first, then neighbours). A query
// therefore scores bit for bit alike in either path, whichever its task takes.
#pragma once

#ifdef TM_ISA_AVX512_BF16
#include "tm.h"
#include "vec.h"

namespace tm {

// Queries of one KV head in a task from which keys in lanes are used. One layer (9 q / 3 KV
// heads, d 64, 500 positions, Zen 5), against score_dot for every query: 16 sequences x 1 row
// level, x 2 rows 6-10% faster, x 3 10%, x 4 14-15%; 1 sequence x 8 rows 11-13%; a task of one
// query (few sequences: a task per query head) keeps score_dot, where the transpose would not
// pay.
constexpr int64_t kLaneQueries = 3;

// r[j] (16 dwords of key j) -> r[l] (dword l of keys 0..15, in that order)
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit blocks: keys 4b..4b+3 of every dword in block b
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// kt[p * 16 + j] = dword pair p of key j (rows keys, `stride` values apart; keys past rows 0)
inline void transpose_keys(const bf16* k, int64_t stride, int64_t rows, int64_t D, uint32_t* kt) {
  for (int64_t c = 0; c < D; c += 32) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < rows ? _mm512_loadu_si512(k + j * stride + c) : _mm512_setzero_si512();
    transpose16(r);
    for (int l = 0; l < 16; ++l) _mm512_storeu_si512(kt + (c / 2 + l) * 16, r[l]);
  }
}

// sc[j] = scale x q . key j for the rows keys in kt (transpose_keys), as score_dot sums it
inline void score_lanes(const bf16* q, const uint32_t* kt, int64_t rows, int64_t D, float scale,
                        float* sc) {
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(q);
  vec a[16];
  for (int l = 0; l < 16; ++l)
    a[l] = _mm512_dpbf16_ps(vzero(), (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[l])),
                            (__m512bh)_mm512_loadu_si512(kt + l * 16));
  for (int64_t c = 16; c < D / 2; c += 16)
    for (int l = 0; l < 16; ++l)
      a[l] = _mm512_dpbf16_ps(a[l], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[c + l])),
                              (__m512bh)_mm512_loadu_si512(kt + (c + l) * 16));
  vec f[8];
  for (int i = 0; i < 8; ++i) f[i] = vadd(a[i], a[i + 8]);
  const vec s = vadd(vadd(vadd(f[0], f[1]), vadd(f[2], f[3])),
                     vadd(vadd(f[4], f[5]), vadd(f[6], f[7])));
  _mm512_mask_storeu_ps(sc, static_cast<__mmask16>((1u << rows) - 1), vmul(s, vset1(scale)));
}

// score_lanes for Q queries at once (Q <= 4), each plane of kt loaded once for all of them:
// accumulators l and l + 8 of every query (sums over planes l, l + 16, ... in that order, as
// score_lanes takes them) are made together and added at once, then folded into the same add
// tree, so each query's scores are bit for bit score_lanes'. (One query at a time loaded every
// plane once per query: with the broadcasts, two loads per VDPBF16PS.)
template <int Q>
inline void score_lanes_q(const bf16* const* q, const uint32_t* kt, int64_t rows, int64_t D,
                          float scale, float* const* sc) {
  const uint32_t* qp[Q];
  for (int g = 0; g < Q; ++g) qp[g] = reinterpret_cast<const uint32_t*>(q[g]);
  auto bc = [&](int g, int64_t p) {
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g][p]));
  };
  auto plane = [&](int64_t p) { return (__m512bh)_mm512_loadu_si512(kt + p * 16); };
  auto pair = [&](int i, vec* f) {  // f[g] = a[g][i] + a[g][i + 8]
    vec lo[Q], hi[Q];
    __m512bh k0 = plane(i), k1 = plane(i + 8);
    for (int g = 0; g < Q; ++g) {
      lo[g] = _mm512_dpbf16_ps(vzero(), bc(g, i), k0);
      hi[g] = _mm512_dpbf16_ps(vzero(), bc(g, i + 8), k1);
    }
    for (int64_t c = 16; c < D / 2; c += 16) {
      k0 = plane(c + i), k1 = plane(c + i + 8);
      for (int g = 0; g < Q; ++g) {
        lo[g] = _mm512_dpbf16_ps(lo[g], bc(g, c + i), k0);
        hi[g] = _mm512_dpbf16_ps(hi[g], bc(g, c + i + 8), k1);
      }
    }
    for (int g = 0; g < Q; ++g) f[g] = vadd(lo[g], hi[g]);
  };
  vec a[Q], b[Q], left[Q], right[Q];  // ((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7))
  pair(0, a), pair(1, b);
  for (int g = 0; g < Q; ++g) left[g] = vadd(a[g], b[g]);
  pair(2, a), pair(3, b);
  for (int g = 0; g < Q; ++g) left[g] = vadd(left[g], vadd(a[g], b[g]));
  pair(4, a), pair(5, b);
  for (int g = 0; g < Q; ++g) right[g] = vadd(a[g], b[g]);
  pair(6, a), pair(7, b);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (int g = 0; g < Q; ++g) {
    right[g] = vadd(right[g], vadd(a[g], b[g]));
    _mm512_mask_storeu_ps(sc[g], mask, vmul(vadd(left[g], right[g]), vset1(scale)));
  }
}

// score_lanes_q over any number of queries, four at a time (fewer: one by one, which measured
// faster than score_lanes_q<3> for a whole GQA group of three)
inline void score_lanes_all(const bf16* const* q, const uint32_t* kt, int64_t rows, int64_t D,
                            float scale, float* const* sc, int64_t count) {
  int64_t g = 0;
  for (; g + 4 <= count; g += 4) score_lanes_q<4>(q + g, kt, rows, D, scale, sc + g);
  for (; g < count; ++g) score_lanes(q[g], kt, rows, D, scale, sc[g]);
}

}  // namespace tm
#endif
