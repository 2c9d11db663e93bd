// tokenmill CPU kernels: paged decode attention, one query token per sequence against its K/V
// history read in place through the block table (no gather copy), on the vector layer.
#include <type_traits>

#include "attention_common.h"
#include "attention_lanes.h"
#include "attention_pairs.h"
#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxQueries = 64;  // queries gathered for one call of the multi-query kernels

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
// hardware prefetcher loses the stream at each one: each chunk prefetches the next into L1 and
// the one after into L2. The cursor steps from block to block without dividing (two integer
// divisions per chunk, as before, cost more than the prefetches).
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
      h.prefetch(c1.b, c1.off, c1.rows, true);
      const Cursor c2 = next(c1);
      if (c2.p < h.L) h.prefetch(c2.b, c2.off, c2.rows, false);
    }
    fn(c.p - start, c.rows, h.at(c.b, c.off));
    if (c1.p >= h.L) return;
    c = c1;
    c1 = next(c);
  }
}

// rows x W cache values (stride `row`) -> float32 scratch (rows x W)
template <typename T>
void widen_block(const T* src, int64_t rows, int64_t row, int64_t W, float* dst) {
  for (int64_t j = 0; j < rows; ++j) {
    int64_t i = 0;
    for (; i + kLanes <= W; i += kLanes) vstore(dst + j * W + i, vload(src + j * row + i));
    for (; i < W; ++i) dst[j * W + i] = to_f(src[j * row + i]);
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
  vec a[8];  // the last < 8 rows by the same reduction (see score_rows)
  for (int r = 0; r < 8; ++r) a[r] = vzero();
  for (int r = 0; r < rows - j; ++r, k += stride)
    for (int64_t i = 0; i < D; i += 32) a[r] = _mm512_dpbf16_ps(a[r], kload(q, i), kload(k, i));
  float sums[8];
  vsum8(a, sums);
  for (int r = 0; r < rows - j; ++r) sc[j + r] = sums[r] * scale;
}

// The value sum of attend_group on bf16 pairs (attention_pairs.h), each KV head's queries four
// at a time; acc zeroed, columns in pair order until written to out
inline void value_sums_dot(const Paged<bf16>& values, int64_t start, const float* scores,
                           int64_t n, int64_t nrows, int64_t nq, int64_t heads, int64_t kv,
                           int64_t D, float* acc, bf16* out, int64_t qstride) {
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
  float o[kMaxHeadDim];
  for (int64_t g = 0; g < total; ++g) {
    unpermute(acc + g * Dp, D, o);
    bf16* dst = out + g / nq * qstride + g % nq * D;
    for (int64_t i = 0; i < D; ++i) dst[i] = from_f<bf16>(o[i]);
  }
}
#endif

// The query heads of `kv` adjacent KV heads (from KV head h) of `nrows` token rows of one
// sequence at consecutive positions (rows `qstride` values apart in q and out; the last row
// attends positions [.., L), each row before it one fewer) against its paged K/V history;
// `heads` query heads per KV head: its whole GQA group, or one head of it. Each K and V row is
// read from the cache once for all of them, the `kv` heads side by side (one contiguous slice
// of the cache row), widened into an L1 scratch that every query uses; a single query reads
// the cache rows directly. A row's positions past its own (or before its window) are scored
// with the others but weigh exactly 0 after its own softmax, so its output is bit for bit what
// it gets attending alone (every score is reduced by the same tree: see score()).
template <typename T>
void attend_group(const T* q, int64_t qstride, int64_t nrows, const T* kc, const T* vc,
                  const int64_t* table, int64_t window, int64_t L, int64_t BS, int64_t Hk,
                  int64_t h, int64_t kv, int64_t D, int64_t heads, float scale, float* scores,
                  float* buf, float* qf, float* acc, T* out) {
  auto first = [&](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; };
  const int64_t start = first(L - nrows + 1), row = Hk * D, n = L - start, W = kv * D;
  const int64_t nq = kv * heads, total = nrows * nq;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;  // padded scratch row
  const Paged<T> keys{kc, table, L, BS, row, h * D, W}, values{vc, table, L, BS, row, h * D, W};
  auto query = [&](int64_t g) { return q + g / nq * qstride + g % nq * D; };
  auto kv_col = [&](int64_t g) { return g % nq / heads * D; };  // g's KV head in the slice
#ifdef TM_ISA_AVX512_BF16
  constexpr bool kDot = std::is_same_v<T, bf16>;  // scores (and values) on VDPBF16PS
  const bool lanes = kDot && D % 32 == 0 && nrows * heads >= kLaneQueries;
#else
  constexpr bool kDot = false;
#endif
  for (int64_t g = 0; g < total && !kDot; ++g) {
    std::fill(qf + g * Dp, qf + (g + 1) * Dp, 0.f);
    for (int64_t i = 0; i < D; ++i) qf[g * Dp + i] = to_f(query(g)[i]) * scale;
  }
  walk(keys, start, [&](int64_t at, int64_t rows, const T* k) {
#ifdef TM_ISA_AVX512_BF16
    if constexpr (kDot) {
      if (lanes) {  // each KV head's keys transposed once for all its queries
        alignas(64) uint32_t kt[kMaxHeadDim / 2 * 16];
        const bf16* qs[kMaxQueries];
        float* ss[kMaxQueries];
        for (int64_t c = 0; c < kv; ++c) {
          transpose_keys(k + c * D, row, rows, D, kt);
          int64_t count = 0;
          for (int64_t r = 0; r < nrows; ++r)
            for (int64_t i = c * heads; i < (c + 1) * heads; ++i) {
              qs[count] = query(r * nq + i), ss[count++] = scores + (r * nq + i) * n + at;
              if (count == kMaxQueries) score_lanes_all(qs, kt, rows, D, scale, ss, count), count = 0;
            }
          score_lanes_all(qs, kt, rows, D, scale, ss, count);
        }
        return;
      }
      for (int64_t g = 0; g < total; ++g)  // every query reads the cache rows directly
        score_dot(query(g), k + kv_col(g), row, rows, D, scale, scores + g * n + at);
      return;
    }
#endif
    if (total == 1) return score(qf, k, row, rows, D, scores + at);
    widen_block(k, rows, row, W, buf);
    for (int64_t g = 0; g < total; ++g)
      score(qf + g * Dp, buf + kv_col(g), W, rows, D, scores + g * n + at);
  });
  for (int64_t g = 0; g < total; ++g) {  // each row's own positions
    const int64_t len = L - (nrows - 1 - g / nq), off = first(len) - start;
    float* s = scores + g * n;
    softmax(s + off, len - start - off);
    std::fill(s, s + off, 0.f);
    std::fill(s + (len - start), s + n, 0.f);
  }
  std::fill(acc, acc + total * Dp, 0.f);
#ifdef TM_ISA_AVX512_BF16
  if constexpr (kDot)
    if (D % 32 == 0) return value_sums_dot(values, start, scores, n, nrows, nq, heads, kv, D, acc, out, qstride);
#endif
  walk(values, start, [&](int64_t at, int64_t rows, const T* v) {
    if (total == 1) return accumulate_rows(scores + at, v, row, rows, D, acc);
    widen_block(v, rows, row, W, buf);
    for (int64_t c = 0; c < kv; ++c) {  // the queries of KV head c, up to four at a time
      const float* sc[4];
      float* out4[4];
      int q = 0;
      auto flush = [&] {
        if (q == 4) accumulate_queries<4>(sc, buf + c * D, W, rows, D, out4);
        else if (q == 3) accumulate_queries<3>(sc, buf + c * D, W, rows, D, out4);
        else if (q == 2) accumulate_queries<2>(sc, buf + c * D, W, rows, D, out4);
        else if (q == 1) accumulate_queries<1>(sc, buf + c * D, W, rows, D, out4);
        q = 0;
      };
      for (int64_t r = 0; r < nrows; ++r)
        for (int64_t i = c * heads; i < (c + 1) * heads; ++i) {
          const int64_t g = r * nq + i;
          sc[q] = scores + g * n + at;
          out4[q++] = acc + g * Dp;
          if (q == 4) flush();
        }
      flush();
    }
  });
  for (int64_t g = 0; g < total; ++g) {
    T* o = out + g / nq * qstride + g % nq * D;
    for (int64_t i = 0; i < D; ++i) o[i] = from_f<T>(acc[g * Dp + i]);
  }
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

template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* tables,
                           const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hk,
                           int64_t D, int64_t BS, int64_t max_blocks, int64_t window,
                           float scale) {
  int64_t group = Hq / Hk, longest = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) { longest = std::max(longest, lens[b]); total += lens[b]; }
  // Units: runs of rows of one sequence (row_runs), each read once per task for all its rows;
  // a run's whole GQA groups share a task, at most 32 queries
  int64_t threads = g_threads;
  const auto units = row_runs(tables, lens, B, BS, max_blocks, std::max<int64_t>(1, 32 / group),
                              (2 * threads + Hk - 1) / Hk);
  const int64_t U = static_cast<int64_t>(units.size());
  int64_t unit_rows = 1;
  for (auto [b, n] : units) unit_rows = std::max(unit_rows, n);
  // Tasks: with many units, one per (unit, KV heads whose cache row slice fits the scratch),
  // which reads each cache row as one contiguous run; with fewer, one per (unit, KV head), or
  // per (unit, query head) when even those are too few for the threads (single rows only).
  // A unit of several rows (a sequence verifying drafts) always takes one KV head a task: its
  // rows x GQA heads already fill the task, and the single-row units beside it keep their
  // wider tasks (one verifying sequence moved every sequence of the step to one KV head a
  // task before: +0.9 ms a 16-sequence step of 30 layers for one drafted token).
  // Whole GQA groups as soon as there is a (unit, KV head) task per thread: a query-head task
  // reads and widens the same cache rows as its group's others, so splitting a group only pays
  // where threads would idle (one sequence, 3 KV heads, 2 threads, AVX2: 30 layers at 2,048
  // positions 261 -> 225 us a layer, bit for bit the same; 1 thread 435 -> 323). On VDPBF16PS
  // a lone bf16 query scores the cache rows in place (score_dot: nothing widened to share):
  // groups stay split below 4 tasks a thread there, as measured before (not re-measured).
  // One KV head shared by many query heads (MLA's latent rows) keeps whole groups from a unit
  // per thread. A step with little work stays on the calling thread.
#ifdef TM_ISA_AVX512_BF16
  constexpr int64_t per_thread = std::is_same_v<T, bf16> ? 4 : 1;
#else
  constexpr int64_t per_thread = 1;
#endif
  int64_t wide = 1;  // KV heads a task of a single-row unit
  int64_t heads = U * Hk >= per_thread * threads || unit_rows > 1 ||
                          (Hk == 1 && group >= 8 && U >= threads) ? group : 1;
  if (U >= 4 * threads)
    for (int64_t k = Hk; k > 1; --k)
      if (Hk % k == 0 && k * D <= kMaxHeadDim) { wide = k; break; }
  struct Task {
    int64_t unit, hq, kv;
  };
  std::vector<Task> tasks;
  int64_t most = 1;  // queries of the largest task
  for (int64_t u = 0; u < U; ++u) {
    const int64_t kv = units[u].second == 1 ? wide : 1;
    most = std::max(most, heads * kv * units[u].second);
    for (int64_t hq = 0; hq < Hq; hq += heads * kv) tasks.push_back({u, hq, kv});
  }
  int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  int64_t work = std::max<int64_t>(1, total / B * D * most / 8);
  // tasks differ in work (sequences of different lengths): handed out as threads come free
  parallel_dynamic(static_cast<int64_t>(tasks.size()), [&](int64_t j) {
    const auto [u, hq, kv] = tasks[j];
    const auto [b, n] = units[u];
    const int64_t queries = heads * kv * n, last = b + n - 1;
    thread_local std::vector<float> scores, buf, qf, acc;
    scores.resize(longest * queries), buf.resize(kRows * kv * D + kLanes);
    qf.resize(queries * Dp), acc.resize(queries * Dp);
    attend_group(q + (b * Hq + hq) * D, Hq * D, n, kc, vc, tables + last * max_blocks, window,
                 lens[last], BS, Hk, hq / group, kv, D, heads, scale, scores.data(), buf.data(),
                 qf.data(), acc.data(), out + (b * Hq + hq) * D);
  }, std::max<int64_t>(1, (1 << 14) / work));
}

}  // namespace tm

using namespace tm;

extern "C" void tm_decode_attention(int dtype, const void* q, const void* k_cache,
                                    const void* v_cache, int64_t block_size, int64_t kv_heads,
                                    const int64_t* block_tables, int64_t max_blocks,
                                    const int64_t* seq_lens, int64_t batch, int64_t heads,
                                    int64_t head_dim, int64_t window, float scale, void* out) {
  if (dtype == TM_BF16)
    return decode_attention_impl(static_cast<const bf16*>(q), static_cast<const bf16*>(k_cache),
                                 static_cast<const bf16*>(v_cache), block_tables, seq_lens,
                                 static_cast<bf16*>(out), batch, heads, kv_heads, head_dim,
                                 block_size, max_blocks, window, scale);
  decode_attention_impl(static_cast<const float*>(q), static_cast<const float*>(k_cache),
                        static_cast<const float*>(v_cache), block_tables, seq_lens,
                        static_cast<float*>(out), batch, heads, kv_heads, head_dim, block_size,
                        max_blocks, window, scale);
}
