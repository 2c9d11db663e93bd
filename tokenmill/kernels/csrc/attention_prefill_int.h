// tokenmill CPU kernels: the prefill tile (attention_prefill.cpp) on int8 / int4 pages with
// integer dot products: each query row rounded to int16 once per task, as decode does
// (scores_int.h); each tile's softmax weights times the value rows' scales rounded to int16 on
// one unit per tile. One VPMADDWD multiplies 16 pairs of int16 where a float FMA takes 8, and
// the tile's codes stay int16 instead of becoming floats. AVX2 (Zen 3, 512 new tokens over a
// 4K history, one layer's kernel): int8 0.77x, int4 0.88x the float tile's time.
//
//   keys    kp[d/2][j] = (k_j[d], k_j[d + 1]) as int16 pairs (int8 codes; int4 codes times the
//           channel's step code), scored against a row's broadcast (q16[d], q16[d + 1]);
//   values  vp[j/2][.] = (v_j[c], v_(j+1)[c]) interleaved as values_int.h does (channels
//           permuted in the outputs until they are written), summed against a row's broadcast
//           (w16[j], w16[j + 1]).
#pragma once

#include "attention_int_asm.h"
#include "attention_tiles.h"
#include "kv_pages.h"
#include "scores_int.h"
#include "values_int.h"

// AVX2 only for now: the AVX-512 build compiles the same templates but has not been timed
#if defined(TM_VALUES_INT) && defined(TM_ISA_AVX2)
#define TM_PREFILL_INT 1
namespace tm {

// s[i][0:kKeys] = (q16_i . kp[.][j]) * mul[i] * kmul[j] + add[i] for R rows (q16 rows D
// apart). The int32 sums go to float every `flush` pairs: an int4 product (< 2 x 2**14 x 3825 a
// pair) would overflow a lane over more than 17 of them.
template <int R>
void scores_i16(const int16_t* q16, int64_t D, const int16_t* kp, int64_t flush, const float* mul,
                const float* add, const float* kmul, float* s) {
  for (int64_t d0 = 0; d0 < D / 2; d0 += flush) {
    ivec a[R][kKeyVecs];
    for (int i = 0; i < R; ++i)
      for (int u = 0; u < kKeyVecs; ++u) a[i][u] = izero();
    const int64_t d1 = std::min(D / 2, d0 + flush);
#ifdef TM_INT_ASM
    if constexpr (R == 4 && kKeyVecs == 2) {
      scores_pairs_4x2(q16 + 2 * d0, D, kp + 2 * d0 * kKeys, d1 - d0, a);
      goto store;
    }
#endif
    for (int64_t d = d0; d < d1; ++d) {
      i16x k[kKeyVecs];
      for (int u = 0; u < kKeyVecs; ++u) k[u] = vload_i16(kp + 2 * (d * kKeys + u * kLanes));
      for (int i = 0; i < R; ++i) {
        const i16x qd = vbcast_pair(q16 + i * D + 2 * d);
        for (int u = 0; u < kKeyVecs; ++u) a[i][u] = vdot16(a[i][u], qd, k[u]);
      }
    }
  store:
    for (int i = 0; i < R; ++i)
      for (int u = 0; u < kKeyVecs; ++u) {
        float* at = s + i * kKeys + u * kLanes;
        vec x = vcvt_i32(a[i][u]);
        if (d0) x = vadd(x, vload(at));
        if (d1 == D / 2) x = vfma(x, vmul(vset1(mul[i]), vload(kmul + u * kLanes)), vset1(add[i]));
        vstore(at, x);
      }
  }
}

// o[i][v0 .. v0 + U) (permuted channels, rows ldo apart) = o * corr[i] + unit * sum_j w16[i][j]
// v_j over `pairs` pairs of value rows
template <int R, int U>
void values_i16(const int16_t (*w16)[kKeys], float unit, const float* corr, const int16_t* vp,
                int64_t pairs, int64_t D, int64_t v0, float* o, int64_t ldo) {
  ivec a[R][U];
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u) a[i][u] = izero();
#ifdef TM_INT_ASM
  if constexpr (R == 2 && U == 4) values_pairs_2x4(w16[0], vp + 2 * v0 * kLanes, 2 * D, pairs, a);
  else
#endif
  for (int64_t jp = 0; jp < pairs; ++jp) {
    i16x x[U];
    for (int u = 0; u < U; ++u) x[u] = vload_i16(vp + 2 * (jp * D + (v0 + u) * kLanes));
    for (int i = 0; i < R; ++i) {
      const i16x wp = vbcast_pair(w16[i] + 2 * jp);
      for (int u = 0; u < U; ++u) a[i][u] = vdot16(a[i][u], x[u], wp);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u) {
      float* at = o + i * ldo + (v0 + u) * kLanes;
      vstore(at, vfma(vcvt_i32(a[i][u]), vset1(unit), vmul(vload(at), vset1(corr[i]))));
    }
}

// kp[d][j] = pair d of row j (rows: kKeys rows of D int16, pairs as uint32): AVX2 moves 8 x 8
// blocks through registers, other builds one pair at a time
inline void transpose_pairs(const int16_t* rows, int64_t D, int16_t* kp) {
#ifdef TM_ISA_AVX2
  for (int64_t j0 = 0; j0 < kKeys; j0 += 8)
    for (int64_t d0 = 0; d0 < D / 2; d0 += 8) {
      __m256i r[8], t[8];
      for (int k = 0; k < 8; ++k) r[k] = vload_i16(rows + (j0 + k) * D + 2 * d0);
      for (int k = 0; k < 8; k += 2)
        t[k] = _mm256_unpacklo_epi32(r[k], r[k + 1]), t[k + 1] = _mm256_unpackhi_epi32(r[k], r[k + 1]);
      for (int k = 0; k < 8; k += 4) {  // r[k + i]: pairs i and i + 4 of rows k .. k + 3
        r[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]), r[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
        r[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]), r[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
      }
      for (int i = 0; i < 4; ++i) {
        auto at = [&](int64_t d) { return reinterpret_cast<__m256i*>(kp + 2 * ((d0 + d) * kKeys + j0)); };
        _mm256_storeu_si256(at(i), _mm256_permute2x128_si256(r[i], r[i + 4], 0x20));
        _mm256_storeu_si256(at(i + 4), _mm256_permute2x128_si256(r[i], r[i + 4], 0x31));
      }
    }
#else
  for (int64_t j = 0; j < kKeys; ++j)
    for (int64_t d = 0; d < D / 2; ++d) std::memcpy(kp + 2 * (d * kKeys + j), rows + j * D + 2 * d, 4);
#endif
}

// One task's integer state: its query rows, and the key / value tile as pairs
struct IntTile {
  int64_t D = 0, flush = 0;
  bool int4 = false;
  std::vector<int16_t> q16, kp, vp, rows16;
  std::vector<float> unit, bias;  // per query row: 1 / its int16 scale; int4: q16 . mc
  alignas(64) float kmul[kKeys], vw[kKeys];  // per key: K's scale (int4: 1), V's (see load)
  alignas(64) int16_t mc[256], sc[256];
  float mu = 0.f, su = 1.f, vunit = 0.f;

  // R rows of float queries (rows D apart), int4 or int8 pages of head size D
  void set_queries(const float* q, int64_t R, int64_t head_dim, bool is_int4) {
    D = head_dim, int4 = is_int4, flush = is_int4 ? 16 : D / 2;
    q16.resize(R * D), unit.resize(R), bias.resize(R);
    for (int64_t r = 0; r < R; ++r) unit[r] = quantize_query(q + r * D, D, q16.data() + r * D);
    kp.assign(D / 2 * kKeys * 2, 0), vp.assign(kKeys / 2 * D * 2, 0), rows16.resize(kKeys * D);
  }

  // keys and values [p, p + n) of KV head h (one block's: slots s0 + j), rows [r0, R) of
  // queries (int4: their q . mc for this block). Softmax weights are at most 1, so a weight
  // times its row's V scale is at most the tile's largest scale: weights are rounded to int16 on
  // that one unit for every row (vw[j] = scale_j / unit), no per-row maximum. int4 V codes
  // are kept as 2 q - 15 on half the unit: (q - 7.5) s exactly, no offset sum.
  void load(const QuantPages& K, const QuantPages& V, int64_t s0, int64_t n, int64_t h,
            int64_t r0, int64_t R) {
    if (int4) {
      K.block_codes(s0 / K.BS, h, mc, sc, &mu, &su);
      widen_k4(K, s0, n, h, sc, rows16.data());
      for (int64_t r = r0; r < R; r += 8) {
        const int nb = static_cast<int>(std::min<int64_t>(8, R - r));
        const int16_t* q8[8];
        float* b8[8];
        for (int i = 0; i < nb; ++i) q8[i] = q16.data() + (r + i) * D, b8[i] = bias.data() + r + i;
        score_i16(q8, nb, Int16Rows{mc, D}, 1, D, b8);
      }
    } else {
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < D; i += 2 * kLanes) {
          const i16x c = vcodes_i8(reinterpret_cast<const int8_t*>(K.codes_at((s0 + j) * K.Hk + h)) + i);
          std::memcpy(rows16.data() + j * D + i, &c, sizeof(c));
        }
    }
    std::fill(rows16.begin() + n * D, rows16.end(), int16_t{0});  // zero keys past n
    transpose_pairs(rows16.data(), D, kp.data());
    float top = 0.f;
    for (int64_t j = 0; j < kKeys; ++j) {
      kmul[j] = j < n && !int4 ? vhalf(K.scale[(s0 + j) * K.Hk + h]) : 1.f;
      vw[j] = j < n ? vhalf(V.scale[(s0 + j) * V.Hk + h]) : 0.f;
      top = std::max(top, vw[j]);
    }
    vunit = top / 32767.f / (int4 ? 2.f : 1.f);
    for (int64_t j = 0; j < kKeys; ++j) vw[j] = top > 0.f ? vw[j] * (32767.f / top) : 0.f;
    const int64_t stride = V.Hk * V.code_bytes(), step = 2 * kLanes;
    for (int64_t j = 0; j < n; j += 2) {  // a missing second row repeats the first: weight 0
      const uint8_t *a = V.codes_at((s0 + j) * V.Hk + h), *b = j + 1 < n ? a + stride : a;
      int16_t* dst = vp.data() + j * D;
      auto put = [&](int64_t v, i16x x) { std::memcpy(dst + 2 * v * kLanes, &x, sizeof(x)); };
      for (int64_t k = 0; k < (int4 ? D / 2 : D) / step; ++k) {
        i16x x0, x1, x2, x3;
        if (int4) {
          i16x alo, ahi, blo, bhi;
          vcodes_4(a + k * step, alo, ahi), vcodes_4(b + k * step, blo, bhi);
          vpairs(vodd16(alo), vodd16(blo), x0, x1), vpairs(vodd16(ahi), vodd16(bhi), x2, x3);
          put(4 * k, x0), put(4 * k + 1, x1), put(4 * k + 2, x2), put(4 * k + 3, x3);
        } else {
          vpairs(vcodes_i8(reinterpret_cast<const int8_t*>(a) + k * step),
                 vcodes_i8(reinterpret_cast<const int8_t*>(b) + k * step), x0, x1);
          put(2 * k, x0), put(2 * k + 1, x1);
        }
      }
    }
  }

  // scores of query rows [r0, r0 + R) against the tile, times `scale`, into s (kKeys a row)
  template <int R>
  void scores(int64_t r0, float scale, float* s) const {
    float mul[R], add[R];
    for (int i = 0; i < R; ++i) {
      const float u = unit[r0 + i] * scale;
      mul[i] = int4 ? u * su : u, add[i] = int4 ? bias[r0 + i] * mu * u : 0.f;
    }
    scores_i16<R>(q16.data() + r0 * D, D, kp.data(), flush, mul, add, kmul, s);
  }

  // rows' outputs o (R rows, ldo apart, permuted) rescaled by corr and added the tile's n
  // values weighted by p (R rows of kKeys; zero past n)
  template <int R>
  void values(const float* p, const float* corr, int64_t n, float* o, int64_t ldo) const {
    alignas(64) int16_t w16[R][kKeys];
    for (int i = 0; i < R; ++i)
      for (int u = 0; u < kKeyVecs; ++u)
        vstore_i16(w16[i] + u * kLanes, vmul(vload(p + i * kKeys + u * kLanes), vload(vw + u * kLanes)));
    const int64_t pairs = (n + 1) / 2, NV = D / kLanes;
    int64_t v = 0;
    for (; v + kValueVecs <= NV; v += kValueVecs)
      values_i16<R, kValueVecs>(w16, vunit, corr, vp.data(), pairs, D, v, o, ldo);
    for (; v < NV; ++v) values_i16<R, 1>(w16, vunit, corr, vp.data(), pairs, D, v, o, ldo);
  }
};

}  // namespace tm
#endif
