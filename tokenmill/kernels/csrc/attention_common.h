// tokenmill CPU kernels: what the decode attention kernels share (attention.cpp on float
// caches, attention_quant.cpp on quantized ones): softmax, scores of a query against rows of
// float keys, and the softmax-weighted sum of value rows, on the vector layer.
#pragma once

#include "vec.h"

namespace tm {

constexpr int64_t kRows = 16;  // cache rows handled (and prefetched) at a time

// s[i] = exp(s[i] - max) in place over n scores; *mx_out = the max, returns the sum
inline float exp_shifted(float* s, int64_t n, float* mx_out) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  vec m = vset1(mx), sum = vzero();
  int64_t i = 0;
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

// softmax in place over n scores
inline void softmax(float* s, int64_t n) {
  float mx;
  const float total = exp_shifted(s, n, &mx);
  vec inv = vset1(1.0f / total);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(s + i, vmul(vload(s + i), inv));
  for (; i < n; ++i) s[i] /= total;
}

// sc[j] = qf . k[j] for `rows` key rows (stride `stride`): eight rows at a time, eight
// independent FMA chains reduced together. qf is zero-padded to whole vectors. DV > 0: head_dim
// is DV whole vectors (the common sizes), so the loops unroll and the sums stay in registers.
template <int DV, typename R>
void score_rows(const float* qf, const R* k, int64_t stride, int64_t rows, int64_t D, float* sc) {
  const int64_t full = DV ? DV * kLanes : D / kLanes * kLanes, tail = DV ? 0 : D - full;
  int64_t j = 0;
  for (; j + 8 <= rows; j += 8, k += 8 * stride) {
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
#pragma GCC unroll 16
    for (int64_t i = 0; i < full; i += kLanes) {
      vec qv = vload(qf + i);
      for (int r = 0; r < 8; ++r) a[r] = vfma(qv, vload(k + r * stride + i), a[r]);
    }
    if (!DV && tail)
      for (int r = 0; r < 8; ++r) a[r] = vfma(vload(qf + full), vload_part(k + r * stride + full, tail), a[r]);
    vsum8(a, sc + j);
  }
  for (; j < rows; ++j, k += stride) {
    vec a = vzero();
#pragma GCC unroll 16
    for (int64_t i = 0; i < full; i += kLanes) a = vfma(vload(qf + i), vload(k + i), a);
    if (!DV && tail) a = vfma(vload(qf + full), vload_part(k + full, tail), a);
    sc[j] = vsum(a);
  }
}

template <typename R>
void score(const float* qf, const R* k, int64_t stride, int64_t rows, int64_t D, float* sc) {
  switch (D == kLanes * (D / kLanes) ? D / kLanes : 0) {
    case 2: return score_rows<2>(qf, k, stride, rows, D, sc);
    case 4: return score_rows<4>(qf, k, stride, rows, D, sc);
    case 8: return score_rows<8>(qf, k, stride, rows, D, sc);
    case 16: return score_rows<16>(qf, k, stride, rows, D, sc);
    default: return score_rows<0>(qf, k, stride, rows, D, sc);
  }
}

// acc[0 : U vectors] += sum_j sc[j] * v[j][same columns]: U accumulators stay in registers
// across the rows (independent FMA chains); kPart loads only `part` < kLanes columns.
template <int U, bool kPart = false, typename R>
void accumulate_cols(const float* sc, const R* v, int64_t stride, int64_t rows, float* acc,
                     int64_t part = kLanes) {
  vec a[U];
  for (int u = 0; u < U; ++u) a[u] = vload(acc + u * kLanes);
  for (int64_t j = 0; j < rows; ++j, v += stride) {
    vec s = vset1(sc[j]);
    for (int u = 0; u < U; ++u)
      a[u] = vfma(s, kPart ? vload_part(v + u * kLanes, part) : vload(v + u * kLanes), a[u]);
  }
  for (int u = 0; u < U; ++u) vstore(acc + u * kLanes, a[u]);
}

// acc += sum_j sc[j] * v[j] for `rows` value rows (stride `stride`); acc padded to whole vectors
template <typename R>
void accumulate_rows(const float* sc, const R* v, int64_t stride, int64_t rows, int64_t D,
                     float* acc) {
  int64_t i = 0;
  for (; i + 8 * kLanes <= D; i += 8 * kLanes)
    accumulate_cols<8>(sc, v + i, stride, rows, acc + i);
  for (; i + 4 * kLanes <= D; i += 4 * kLanes) accumulate_cols<4>(sc, v + i, stride, rows, acc + i);
  for (; i + kLanes <= D; i += kLanes) accumulate_cols<1>(sc, v + i, stride, rows, acc + i);
  if (i < D) accumulate_cols<1, true>(sc, v + i, stride, rows, acc + i, D - i);
}

}  // namespace tm
