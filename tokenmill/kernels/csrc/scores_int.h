// tokenmill CPU kernels: scores of queries against int8 or int4 key rows with integer dot
// products (attention_quant.cpp). The query is rounded to int16 once per task (2**14 levels: a
// score moves by ~1e-4 of |q| |k|); int8 codes are read from the cache as they are, int4 codes
// widened to int16 times each channel's step code; the sums come back to float times the row's
// scale (int8), or the block's step unit plus its q . minimum (int4). The queries of a KV head
// (its GQA heads, each of the rows a sequence verifies) share each code vector they load.
#pragma once

#include "kv_pages.h"
#include "vec.h"

namespace tm {

// q16 = round(q * A), A = kQueryMax / max |q|; returns 1 / A (0 for a zero query). 2**14
// levels: an int4 product (code x step code < 2**12) times it summed over the head_dim / kLanes
// products of a lane stays in int32 up to head_dim 256.
constexpr float kQueryMax = 16383.f;

inline float quantize_query(const float* q, int64_t D, int16_t* q16) {
  vec mx = vzero();
  for (int64_t i = 0; i < D; i += kLanes) mx = vmax(mx, vmax(vload(q + i), vsub(vzero(), vload(q + i))));
  const float top = vhmax(mx);
  if (!(top > 0.f)) {
    std::fill(q16, q16 + D, int16_t{0});
    return 0.f;
  }
  const vec a = vset1(kQueryMax / top);
  for (int64_t i = 0; i < D; i += kLanes) vstore_i16(q16 + i, vmul(vload(q + i), a));
  return top / kQueryMax;
}

// `rows` rows of int4 K codes of KV head h from `slot` -> int16 (rows x D): times each
// channel's step code sc
inline void widen_k4(const QuantPages& K, int64_t slot, int64_t rows, int64_t h, const int16_t* sc,
                     int16_t* dst) {
  const int64_t D = K.D;
  static_assert(sizeof(i16x) == 2 * kLanes * sizeof(int16_t), "i16x holds 2 x kLanes int16");
  auto put = [](int16_t* at, i16x v) { std::memcpy(at, &v, sizeof(v)); };
  for (int64_t j = 0; j < rows; ++j, dst += D) {
    const uint8_t* c = K.codes_at((slot + j) * K.Hk + h);
    for (int64_t i = 0; i < D / 2; i += 2 * kLanes) {
      i16x lo, hi;
      vcodes_4(c + i, lo, hi);
      put(dst + i, vmul16(lo, vload_i16(sc + i)));
      put(dst + D / 2 + i, vmul16(hi, vload_i16(sc + D / 2 + i)));
    }
  }
}

// Rows of integer key codes as int16 vectors: int16 rows (int4's widened codes), or int8 codes
// read in place from the cache (rows `stride` bytes apart)
struct Int16Rows {
  const int16_t* p;
  int64_t stride;
  i16x at(int64_t r, int64_t i) const { return vload_i16(p + r * stride + i); }
};
struct Int8Rows {
  const int8_t* p;
  int64_t stride;
  i16x at(int64_t r, int64_t i) const { return vcodes_i8(p + r * stride + i); }
};

// sums_g[j] = q16_g . codes[j] for Q queries of the same `rows` rows of D int16: each code
// vector is loaded once for all of them, R rows at a time (R x Q independent sums). The sums
// are integers, converted to float per lane and reduced by vsum8 eight rows at a time (the last
// rows too), so a score does not depend on Q, R or its place in a chunk.
template <int Q, int R, typename S>
void score_i16_of(const int16_t* const* q16, S codes, int64_t rows, int64_t D,
                  float* const* sums) {
  vec f[Q][8];
  auto pass = [&](int64_t j, int64_t r0, int n) {  // rows j + r0 .. j + r0 + n (n <= R)
    ivec a[R][Q];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < Q; ++g) a[r][g] = izero();
    for (int64_t i = 0; i < D; i += 2 * kLanes)
      for (int r = 0; r < R; ++r)
        if (r < n) {
          const i16x x = codes.at(j + r0 + r, i);
          for (int g = 0; g < Q; ++g) a[r][g] = vdot16(a[r][g], x, vload_i16(q16[g] + i));
        }
    for (int r = 0; r < n; ++r)
      for (int g = 0; g < Q; ++g) f[g][r0 + r] = vcvt_i32(a[r][g]);
  };
  for (int64_t j = 0; j < rows; j += 8) {
    const int64_t m = std::min<int64_t>(8, rows - j);
    int64_t r0 = 0;
    for (; r0 + R <= m; r0 += R) pass(j, r0, R);  // n == R: the checks fold away
    if (r0 < m) pass(j, r0, static_cast<int>(m - r0));
    for (int g = 0; g < Q; ++g) {
      for (int64_t r = m; r < 8; ++r) f[g][r] = vzero();
      if (m == 8) {
        vsum8(f[g], sums[g] + j);
      } else {
        float out[8];
        vsum8(f[g], out);
        std::copy(out, out + m, sums[g] + j);
      }
    }
  }
}

// n <= 8 queries (score_i16_of)
template <typename S>
void score_i16(const int16_t* const* q16, int n, S codes, int64_t rows, int64_t D,
               float* const* sums) {
  switch (n) {
    case 1: return score_i16_of<1, 8>(q16, codes, rows, D, sums);
    case 2: return score_i16_of<2, 4>(q16, codes, rows, D, sums);
    case 3: return score_i16_of<3, 4>(q16, codes, rows, D, sums);
    case 4: return score_i16_of<4, 2>(q16, codes, rows, D, sums);
    case 5: return score_i16_of<5, 2>(q16, codes, rows, D, sums);
    case 6: return score_i16_of<6, 2>(q16, codes, rows, D, sums);
    case 7: return score_i16_of<7, 1>(q16, codes, rows, D, sums);
    default: return score_i16_of<8, 1>(q16, codes, rows, D, sums);
  }
}

// Whether a head_dim takes the integer path (whole int16 vectors of codes per row)
template <int F>
bool integer_keys(int64_t D) {
  return (F == TM_KV_INT4 && D % (4 * kLanes) == 0) || (F == TM_KV_INT8 && D % (2 * kLanes) == 0);
}

}  // namespace tm
