// tokenmill CPU kernels: what the decode attention kernels share (attention.cpp on float
// caches, attention_quant.cpp on quantized ones): softmax, scores of a query against rows of
// float keys, and the softmax-weighted sum of value rows, on the vector layer.
#pragma once

#include "vec.h"

namespace tm {

constexpr int64_t kRows = 16;  // cache rows handled (and prefetched) at a time

// s[i] = exp(s[i] - max) in place over n scores; *mx_out = the max, returns the sum
inline float exp_shifted(float* s, int64_t n, float* mx_out) {
  vec vm = vset1(-INFINITY);  // the max in vectors (one scalar chain was most of the time)
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vm = vmax(vm, vload(s + i));
  float mx = vhmax(vm);
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  vec m = vset1(mx), sum = vzero();
  i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vec e = vexp(vsub(vload(s + i), m));
    vstore(s + i, e);
    sum = vadd(sum, e);
  }
  float total = vsum(sum);
  for (; i < n; ++i) { s[i] = std::exp(s[i] - mx); total += s[i]; }
  *mx_out = mx;
  return total;
}

// sc_g[j] = qf_g . k[j] for Q queries g of the same `rows` key rows (stride `stride`): each key
// vector is loaded (widened) once for all of them, R rows at a time (R x Q independent FMA
// chains; loading it once per query was two thirds of the work for bf16 keys on AVX2). Every
// score is one FMA chain per lane over d, reduced eight rows at a time by vsum8 (the last rows
// too), so it does not depend on Q, R or its place in a chunk. qf is zero-padded to whole
// vectors; DV > 0: head_dim is DV whole vectors (the common sizes), so the loops unroll.
template <int Q, int R, int DV, typename K>
void score_queries_of(const float* const* qf, const K* k, int64_t stride, int64_t rows,
                      int64_t D, float* const* sc) {
  const int64_t full = DV ? DV * kLanes : D / kLanes * kLanes, tail = DV ? 0 : D - full;
  vec a[Q][8];
  // rows r0 .. r0 + n (n <= R) of the eight at j into a[.][r0 ..]
  auto pass = [&](const K* kj, int64_t r0, int n) {
    vec c[R][Q];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < Q; ++g) c[r][g] = vzero();
#pragma GCC unroll 16
    for (int64_t i = 0; i < full; i += kLanes)
      for (int r = 0; r < R; ++r)
        if (r < n) {
          const vec kv = vload(kj + (r0 + r) * stride + i);
          for (int g = 0; g < Q; ++g) c[r][g] = vfma(vload(qf[g] + i), kv, c[r][g]);
        }
    if (!DV && tail)
      for (int r = 0; r < n; ++r) {
        const vec kv = vload_part(kj + (r0 + r) * stride + full, tail);
        for (int g = 0; g < Q; ++g) c[r][g] = vfma(vload(qf[g] + full), kv, c[r][g]);
      }
    for (int r = 0; r < n; ++r)
      for (int g = 0; g < Q; ++g) a[g][r0 + r] = c[r][g];
  };
  for (int64_t j = 0; j < rows; j += 8) {
    const int64_t m = std::min<int64_t>(8, rows - j);
    const K* kj = k + j * stride;
    int64_t r0 = 0;
    for (; r0 + R <= m; r0 += R) pass(kj, r0, R);  // n == R: the checks fold away
    if (r0 < m) pass(kj, r0, static_cast<int>(m - r0));
    for (int g = 0; g < Q; ++g) {
      for (int64_t r = m; r < 8; ++r) a[g][r] = vzero();
      if (m == 8) {
        vsum8(a[g], sc[g] + j);
      } else {
        float sums[8];
        vsum8(a[g], sums);
        std::copy(sums, sums + m, sc[g] + j);
      }
    }
  }
}

template <int Q, int R, typename K>
void score_queries_d(const float* const* qf, const K* k, int64_t stride, int64_t rows,
                     int64_t D, float* const* sc) {
  switch (D == kLanes * (D / kLanes) ? D / kLanes : 0) {
    case 2: return score_queries_of<Q, R, 2>(qf, k, stride, rows, D, sc);
    case 4: return score_queries_of<Q, R, 4>(qf, k, stride, rows, D, sc);
    case 8: return score_queries_of<Q, R, 8>(qf, k, stride, rows, D, sc);
    case 16: return score_queries_of<Q, R, 16>(qf, k, stride, rows, D, sc);
    default: return score_queries_of<Q, R, 0>(qf, k, stride, rows, D, sc);
  }
}

// one query: eight rows at a time
template <typename K>
void score(const float* qf, const K* k, int64_t stride, int64_t rows, int64_t D, float* sc) {
  score_queries_d<1, 8>(&qf, k, stride, rows, D, &sc);
}

// n <= 8 queries of the same key rows (score_queries_of)
template <typename K>
void score_queries(const float* const* qf, int n, const K* k, int64_t stride, int64_t rows,
                   int64_t D, float* const* sc) {
  switch (n) {
    case 1: return score(qf[0], k, stride, rows, D, sc[0]);
    case 2: return score_queries_d<2, 4>(qf, k, stride, rows, D, sc);
    case 3: return score_queries_d<3, 4>(qf, k, stride, rows, D, sc);
    case 4: return score_queries_d<4, 2>(qf, k, stride, rows, D, sc);
    case 5: return score_queries_d<5, 2>(qf, k, stride, rows, D, sc);
    case 6: return score_queries_d<6, 2>(qf, k, stride, rows, D, sc);
    case 7: return score_queries_d<7, 1>(qf, k, stride, rows, D, sc);
    default: return score_queries_d<8, 1>(qf, k, stride, rows, D, sc);
  }
}

// For each of Q queries q reading the same value rows: acc_q[0 : U vectors] += sum_j sc_q[j] *
// v[j][same columns]. Each row's U vectors are loaded once for all the queries, and the U x Q
// accumulators stay in registers across the rows (independent FMA chains: one query's U
// chains alone wait on the FMA latency); each query's sums run in row order, as alone. kPart
// loads only `part` < kLanes columns.
template <int U, int Q, bool kPart = false, typename R>
void accumulate_cols(const float* const* sc, const R* v, int64_t stride, int64_t rows,
                     float* const* acc, int64_t col, int64_t part = kLanes) {
  vec a[Q][U];
  for (int g = 0; g < Q; ++g)
    for (int u = 0; u < U; ++u) a[g][u] = vload(acc[g] + col + u * kLanes);
  for (int64_t j = 0; j < rows; ++j, v += stride) {
    vec x[U];
    for (int u = 0; u < U; ++u)
      x[u] = kPart ? vload_part(v + col + u * kLanes, part) : vload(v + col + u * kLanes);
    for (int g = 0; g < Q; ++g) {
      vec s = vset1(sc[g][j]);
      for (int u = 0; u < U; ++u) a[g][u] = vfma(s, x[u], a[g][u]);
    }
  }
  for (int g = 0; g < Q; ++g)
    for (int u = 0; u < U; ++u) vstore(acc[g] + col + u * kLanes, a[g][u]);
}

// acc_q += sum_j sc_q[j] * v[j] for Q queries (Q <= 6) of the same `rows` value rows (stride
// `stride`); acc padded to whole vectors. Two column vectors a pass for several queries, at
// most 12 accumulators: four (16 of them, spilling on AVX2's 16 registers) were 3-19% slower
// on AVX2 (Zen 3) in every shape measured.
template <int Q, typename R>
void accumulate_queries(const float* const* sc, const R* v, int64_t stride, int64_t rows,
                        int64_t D, float* const* acc) {
  constexpr int U = Q > 2 ? 2 : 4;
  int64_t i = 0;
  for (; i + U * kLanes <= D; i += U * kLanes) accumulate_cols<U, Q>(sc, v, stride, rows, acc, i);
  for (; i + 4 * kLanes <= D; i += 4 * kLanes) accumulate_cols<4, Q>(sc, v, stride, rows, acc, i);
  for (; i + kLanes <= D; i += kLanes) accumulate_cols<1, Q>(sc, v, stride, rows, acc, i);
  if (i < D) accumulate_cols<1, Q, true>(sc, v, stride, rows, acc, i, D - i);
}

// n <= 6 queries of the same value rows (accumulate_queries)
template <typename R>
void accumulate_n(const float* const* sc, int n, const R* v, int64_t stride, int64_t rows,
                  int64_t D, float* const* acc) {
  switch (n) {
    case 1: return accumulate_queries<1>(sc, v, stride, rows, D, acc);
    case 2: return accumulate_queries<2>(sc, v, stride, rows, D, acc);
    case 3: return accumulate_queries<3>(sc, v, stride, rows, D, acc);
    case 4: return accumulate_queries<4>(sc, v, stride, rows, D, acc);
    case 5: return accumulate_queries<5>(sc, v, stride, rows, D, acc);
    default: return accumulate_queries<6>(sc, v, stride, rows, D, acc);
  }
}

// Queries [g0, g1) of one KV head against the same key rows, eight at a time (score_queries):
// query g's vector at qf + g * ldq, its scores at sc + g * lds
template <typename K>
void score_group(const float* qf, int64_t ldq, int64_t g0, int64_t g1, const K* k,
                 int64_t stride, int64_t rows, int64_t D, float* sc, int64_t lds) {
  const float* q8[8];
  float* s8[8];
  for (int64_t g = g0; g < g1; g += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, g1 - g));
    for (int i = 0; i < n; ++i) q8[i] = qf + (g + i) * ldq, s8[i] = sc + (g + i) * lds;
    score_queries(q8, n, k, stride, rows, D, s8);
  }
}

// Queries [g0, g1) of one KV head over the same value rows, six at a time (accumulate_n):
// query g's weights at sc + g * lds, its accumulator at acc + g * ldq
template <typename R>
void accumulate_group(const float* sc, int64_t lds, int64_t g0, int64_t g1, const R* v,
                      int64_t stride, int64_t rows, int64_t D, float* acc, int64_t ldq) {
  const float* s6[6];
  float* a6[6];
  for (int64_t g = g0; g < g1; g += 6) {
    const int n = static_cast<int>(std::min<int64_t>(6, g1 - g));
    for (int i = 0; i < n; ++i) s6[i] = sc + (g + i) * lds, a6[i] = acc + (g + i) * ldq;
    accumulate_n(s6, n, v, stride, rows, D, a6);
  }
}

}  // namespace tm
