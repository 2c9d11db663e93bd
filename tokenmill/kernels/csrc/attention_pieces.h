// How decode attention (attention.cpp) cuts its work: rows of one sequence into runs read
// together, and a history into pieces of fixed absolute positions, each attended on its own
// (its own softmax max and sum) and combined afterwards.
//
// A piece is kPiece positions from a multiple of kPiece, whatever the batch, the thread count or
// the task that attends it, and a row's pieces are always combined by combine() in position
// order: a row's output is therefore bit for bit the same alone, in a verify run of its sequence
// or as one piece a task, which speculative decoding's and the batch-invariant mode's exactness
// rest on. Pieces are what lets one long sequence keep whole GQA groups (each cache row read
// once) and still give every thread tasks.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "common.h"
#include "vec.h"

namespace tm {

constexpr int64_t kPiece = 1024;

// The first position a decode row of `len` positions attends (window 0: no window)
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// Rows of one sequence at consecutive positions: row b extends the run of row b - 1 when its
// length is one more and its block table the same over its positions (a sequence verifying
// drafted tokens, a batch-invariant prefill chunk). Runs are cut to at most `cap` rows and
// into `pieces` parts where there are few, so that the threads have tasks.
inline std::vector<std::pair<int64_t, int64_t>> row_runs(const int64_t* tables,
                                                          const int64_t* lens, int64_t B,
                                                          int64_t BS, int64_t max_blocks,
                                                          int64_t cap, int64_t want) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = std::min(max_blocks, (lens[b] + BS - 1) / BS);
    if (b > 0 && lens[b] == lens[b - 1] + 1 &&
        std::equal(tables + b * max_blocks, tables + b * max_blocks + used,
                   tables + (b - 1) * max_blocks))
      ++runs.back().second;
    else
      runs.emplace_back(b, 1);
  }
  const int64_t pieces = std::max<int64_t>(1, (want + static_cast<int64_t>(runs.size()) - 1) /
                                                  static_cast<int64_t>(runs.size()));
  std::vector<std::pair<int64_t, int64_t>> units;
  for (auto [b, n] : runs) {
    const int64_t per = std::min(cap, (n + std::min(n, pieces) - 1) / std::min(n, pieces));
    for (int64_t i = 0; i < n; i += per) units.emplace_back(b + i, std::min(per, n - i));
  }
  return units;
}

// What attending one piece leaves for Q queries: per query its largest score m, the sum l of
// exp(score - m) over its positions in the piece (0: none there), and acc, the values weighed
// by those exponentials (Dp floats a query, in column order). One block of Q (Dp + 2) floats.
struct PieceSums {
  float* base;
  int64_t Q, Dp;
  float* m() const { return base; }
  float* l() const { return base + Q; }
  float* acc(int64_t g) const { return base + 2 * Q + g * Dp; }
  static int64_t size(int64_t Q, int64_t Dp) { return Q * (Dp + 2); }
};

// Query g's output from its `count` pieces (blocks `stride` floats apart, in position order):
// sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p, M the largest m_p, pieces it has no
// position in skipped. One piece: acc / l.
template <typename T>
void combine(const float* first, int64_t stride, int64_t count, int64_t Q, int64_t Dp,
             int64_t g, int64_t D, T* out) {
  float M = -INFINITY, denom = 0.f;
  auto m = [&](int64_t p) { return first[p * stride + g]; };  // PieceSums' layout
  auto l = [&](int64_t p) { return first[p * stride + Q + g]; };
  for (int64_t p = 0; p < count; ++p)
    if (l(p) > 0.f) M = std::max(M, m(p));
  alignas(64) float o[1024];  // Dp <= MAX_LATENT_DIM (lib.py)
  std::fill(o, o + Dp, 0.f);
  for (int64_t p = 0; p < count; ++p) {
    if (!(l(p) > 0.f)) continue;
    const float w = std::exp(m(p) - M);
    denom += w * l(p);
    const vec wv = vset1(w);
    const float* a = first + p * stride + 2 * Q + g * Dp;
    for (int64_t i = 0; i < Dp; i += kLanes) vstore(o + i, vfma(wv, vload(a + i), vload(o + i)));
  }
  const float inv = 1.0f / denom;
  for (int64_t i = 0; i < D; ++i) out[i] = from_f<T>(o[i] * inv);
}

}  // namespace tm
