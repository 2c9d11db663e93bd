// Decode attention's reading of the paged history (included by attention.cpp): a sequence's
// K or V rows through its block table, walked a cache block at a time with prefetches, and on
// AVX512-BF16 the scores and value sums on bf16 pairs straight from the cache rows.
#pragma once

#include <vector>

#include "attention_common.h"
#include "attention_pairs.h"
#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kMaxHeadDim = 256;

// One sequence's K or V history for some KV heads: positions [0, L) in cache blocks of BS rows
// (`row` values apart), each read at `offset`, D values wide.
template <typename T>
struct Paged {
  const T* cache;
  const int64_t* table;
  int64_t L, BS, row, offset, D;

  // row `off` of the sequence's block `b`
  const T* at(int64_t b, int64_t off) const { return cache + (table[b] * BS + off) * row + offset; }
  void prefetch(int64_t b, int64_t off, int64_t rows, bool near) const {
    const char* r = reinterpret_cast<const char*>(at(b, off));
    const int64_t stride = row * sizeof(T), bytes = D * sizeof(T);
    for (int64_t j = 0; j < rows; ++j, r += stride)
      for (int64_t i = 0; i < bytes; i += 64) near ? prefetch_l1(r + i) : prefetch_l2(r + i);
  }
};

// Visit positions [start, L) up to kRows at a time, never crossing a cache block: fn(index of
// the first position from start, rows, its cache row). Blocks lie anywhere in the cache, so the
// hardware prefetcher loses the stream at each one: each chunk prefetches the one after next
// into L2, and the next into L1 where the walk reads whole cache rows (a task of every KV head).
// Where it reads a slice of each row (one KV head of several), the L1 prefetch cost time: one
// bf16 sequence (3 KV heads) at 512-8,192 positions ran 1.08-1.34x faster without it on a
// Zen 4 (the AVX2 build there 1.10-1.14x), while batches of whole-row tasks lost 2-9% (16-64
// sequences). The cursor steps from block to block without dividing (two integer divisions
// per chunk, as before, cost more than the prefetches).
template <typename T, typename Fn>
void walk(const Paged<T>& h, int64_t start, Fn fn) {
  struct Cursor {
    int64_t p, b, off, rows;  // position, its block in the table, row in the block; chunk rows
  };
  auto chunk = [&](int64_t p, int64_t b, int64_t off) {
    return Cursor{p, b, off, std::min({h.BS - off, h.L - p, kRows})};
  };
  auto next = [&](const Cursor& c) {
    return c.off + c.rows == h.BS ? chunk(c.p + c.rows, c.b + 1, 0)
                                  : chunk(c.p + c.rows, c.b, c.off + c.rows);
  };
  if (start >= h.L) return;
  Cursor c = chunk(start, start / h.BS, start % h.BS), c1 = next(c);
  while (true) {
    if (c1.p < h.L) {
      if (h.D == h.row) h.prefetch(c1.b, c1.off, c1.rows, true);
      const Cursor c2 = next(c1);
      if (c2.p < h.L) h.prefetch(c2.b, c2.off, c2.rows, false);
    }
    fn(c.p - start, c.rows, h.at(c.b, c.off));
    if (c1.p >= h.L) return;
    c = c1;
    c1 = next(c);
  }
}

#ifdef TM_ISA_AVX512_BF16
// bf16 scores without widening the keys: VDPBF16PS sums q[d] * k[d] over pairs of d straight
// from the bf16 cache rows (products exact in float32), eight rows at a time; the scale is
// applied to the sums. A head_dim that is not a multiple of 32 ends with a masked load.
inline void score_dot(const bf16* q, const bf16* k, int64_t stride, int64_t rows, int64_t D,
                      float scale, float* sc) {
  const int64_t full = D / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (D - full)) - 1);
  auto kload = [&](const bf16* p, int64_t i) {
    return (__m512bh)(i < full ? _mm512_loadu_si512(p + i) : _mm512_maskz_loadu_epi16(tail, p + i));
  };
  int64_t j = 0;
  for (; j + 8 <= rows; j += 8, k += 8 * stride) {
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
    for (int64_t i = 0; i < D; i += 32) {
      __m512bh qv = kload(q, i);
      for (int r = 0; r < 8; ++r) a[r] = _mm512_dpbf16_ps(a[r], qv, kload(k + r * stride, i));
    }
    float sums[8];
    vsum8(a, sums);
    for (int r = 0; r < 8; ++r) sc[j + r] = sums[r] * scale;
  }
  if (j == rows) return;
  vec a[8];  // the last < 8 rows by the same reduction (see score_queries_of)
  for (int r = 0; r < 8; ++r) a[r] = vzero();
  for (int r = 0; r < rows - j; ++r, k += stride)
    for (int64_t i = 0; i < D; i += 32) a[r] = _mm512_dpbf16_ps(a[r], kload(q, i), kload(k, i));
  float sums[8];
  vsum8(a, sums);
  for (int r = 0; r < rows - j; ++r) sc[j + r] = sums[r] * scale;
}

// The value sum of attend_group on bf16 pairs (attention_pairs.h), each KV head's queries four
// at a time; acc zeroed, columns in pair order until put back in order at the end
inline void value_sums_dot(const Paged<bf16>& values, int64_t start, const float* scores,
                           int64_t n, int64_t nrows, int64_t nq, int64_t heads, int64_t kv,
                           int64_t D, float* acc) {
  constexpr int64_t P = kRows;  // pairs per chunk and query: kRows + 1 positions at most
  const int64_t total = nrows * nq, Dp = (D + kLanes - 1) / kLanes * kLanes;
  thread_local std::vector<uint32_t> pp;
  pp.resize(total * P);
  walk(values, start, [&](int64_t at, int64_t rows, const bf16* v) {
    const int64_t odd = (start + at) % 2;
    for (int64_t g = 0; g < total; ++g) probability_pairs(scores + g * n + at, rows, odd, pp.data() + g * P);
    for (int64_t c = 0; c < kv; ++c) {
      const bf16* vc = v + c * D;
      const uint32_t* p4[4];
      float* o4[4];
      int q = 0;
      auto flush = [&] {
        if (q == 4) pair_sums_all<4>(p4, vc, values.row, rows, odd, D, o4);
        else if (q == 3) pair_sums_all<3>(p4, vc, values.row, rows, odd, D, o4);
        else if (q == 2) pair_sums_all<2>(p4, vc, values.row, rows, odd, D, o4);
        else if (q == 1) pair_sums_all<1>(p4, vc, values.row, rows, odd, D, o4);
        q = 0;
      };
      for (int64_t r = 0; r < nrows; ++r)
        for (int64_t i = c * heads; i < (c + 1) * heads; ++i) {
          p4[q] = pp.data() + (r * nq + i) * P;
          o4[q++] = acc + (r * nq + i) * Dp;
          if (q == 4) flush();
        }
      flush();
    }
  });
  thread_local std::vector<float> o;  // a row in column order (MLA's latent: 576 columns)
  o.resize(D);
  for (int64_t g = 0; g < total; ++g) {
    unpermute(acc + g * Dp, D, o.data());
    std::copy(o.begin(), o.end(), acc + g * Dp);
  }
}
#endif

}  // namespace tm
