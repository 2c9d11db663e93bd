// tokenmill CPU kernels: paged decode attention, one query token per sequence against its K/V
// history read in place through the block table (no gather copy), on the vector layer; a long
// history in pieces (attention_pieces.h).
#include <type_traits>

#include "attention_common.h"
#include "attention_lanes.h"
#include "attention_paged.h"
#include "attention_pieces.h"
#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kMaxQueries = 64;  // queries gathered for one call of the multi-query kernels

// The query heads of `kv` adjacent KV heads (from KV head h) of `nrows` token rows of one
// sequence at consecutive positions (rows `qstride` values apart in q; the last row attends
// positions [.., L), each row before it one fewer) against the piece [p0, p1) of its paged K/V
// history, into `sums` (attention_pieces.h, queries in order: row, KV head, its query heads);
// `heads` query heads per KV head: its whole GQA group, or one head of it. The walk brings each
// K and V block piece into L1 once for all of them, the `kv` heads side by side (one contiguous
// slice of the cache row), and every query reads the cache rows there, widening as it loads
// (a float32 scratch of the piece that the queries then read was 5-35% slower on AVX2, Zen 3,
// in every shape measured, the same bits). A row's positions past its own (or before its
// window) are scored with the others but weigh exactly 0 after its own exponentials, so its
// sums are bit for bit what it gets attending alone (every score is reduced by the same tree:
// see score()).
template <typename T>
void attend_group(const T* q, int64_t qstride, int64_t nrows, const T* kc, const T* vc,
                  const int64_t* table, int64_t window, int64_t L, int64_t p0, int64_t p1,
                  int64_t BS, int64_t Hk, int64_t h, int64_t kv, int64_t D, int64_t heads,
                  float scale, float* scores, float* qf, const PieceSums& sums) {
  auto first = [&](int64_t len) { return window_start(len, window); };
  const int64_t start = std::max(p0, first(L - nrows + 1)), end = std::min(p1, L);
  const int64_t row = Hk * D, n = end - start, W = kv * D;
  const int64_t nq = kv * heads, total = nrows * nq;
  const int64_t Dp = sums.Dp;  // padded scratch row
  float* acc = sums.acc(0);
  const Paged<T> keys{kc, table, end, BS, row, h * D, W}, values{vc, table, end, BS, row, h * D, W};
  auto query = [&](int64_t g) { return q + g / nq * qstride + g % nq * D; };
  auto kv_col = [&](int64_t g) { return g % nq / heads * D; };  // g's KV head in the slice
#ifdef TM_ISA_AVX512_BF16
  constexpr bool kDot = std::is_same_v<T, bf16>;  // scores (and values) on VDPBF16PS
  // lanes: the transposed keys sit on the stack, kMaxHeadDim channels at most (not MLA's 576)
  const bool lanes = kDot && D % 32 == 0 && D <= kMaxHeadDim && nrows * heads >= kLaneQueries;
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
    for (int64_t c = 0; c < kv; ++c) {  // the queries of KV head c, up to eight at a time
      const float* q8[8];
      float* s8[8];
      int count = 0;
      for (int64_t r = 0; r < nrows; ++r)
        for (int64_t i = c * heads; i < (c + 1) * heads; ++i) {
          q8[count] = qf + (r * nq + i) * Dp, s8[count++] = scores + (r * nq + i) * n + at;
          if (count == 8) score_queries(q8, count, k + c * D, row, rows, D, s8), count = 0;
        }
      if (count) score_queries(q8, count, k + c * D, row, rows, D, s8);
    }
  });
  for (int64_t g = 0; g < total; ++g) {  // each row's own positions in the piece
    const int64_t len = L - (nrows - 1 - g / nq);
    const int64_t lo = std::max(first(len), start) - start, hi = std::min(len, end) - start;
    float* s = scores + g * n;
    sums.l()[g] = hi > lo ? exp_shifted(s + lo, hi - lo, sums.m() + g) : 0.f;
    if (hi <= lo) sums.m()[g] = -INFINITY;
    std::fill(s, s + std::min(lo, n), 0.f);
    std::fill(s + std::max<int64_t>(hi, 0), s + n, 0.f);
  }
  std::fill(acc, acc + total * Dp, 0.f);
#ifdef TM_ISA_AVX512_BF16
  if constexpr (kDot)
    if (D % 32 == 0) return value_sums_dot(values, start, scores, n, nrows, nq, heads, kv, D, acc);
#endif
  walk(values, start, [&](int64_t at, int64_t rows, const T* v) {
    for (int64_t c = 0; c < kv; ++c) {  // the queries of KV head c, up to six at a time
      const float* sc[6];
      float* outs[6];
      int q = 0;
      auto flush = [&] {
        if (q) accumulate_n(sc, q, v + c * D, row, rows, D, outs);
        q = 0;
      };
      for (int64_t r = 0; r < nrows; ++r)
        for (int64_t i = c * heads; i < (c + 1) * heads; ++i) {
          const int64_t g = r * nq + i;
          sc[q] = scores + g * n + at;
          outs[q++] = acc + g * Dp;
          if (q == 6) flush();
        }
      flush();
    }
  });
}

template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* tables,
                           const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hk,
                           int64_t D, int64_t BS, int64_t max_blocks, int64_t window,
                           float scale) {
  int64_t group = Hq / Hk, longest = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) { longest = std::max(longest, lens[b]); total += lens[b]; }
  // Units: runs of rows of one sequence (row_runs), each read once per task for all its rows;
  // a run's whole GQA groups share a task, at most 32 queries. Few runs are cut for the
  // threads only where the history is one piece: longer ones give the threads their pieces
  // and are read once for all their rows (a verify run of 4-8 rows at 1,031-8,004 positions,
  // 1.17-1.23x; cutting still paid at 128-900 positions, 1.05-1.10x)
  int64_t threads = g_threads;
  const auto units = row_runs(tables, lens, B, BS, max_blocks, std::max<int64_t>(1, 32 / group),
                              longest > kPiece ? 1 : (2 * threads + Hk - 1) / Hk);
  const int64_t U = static_cast<int64_t>(units.size());
  int64_t unit_rows = 1;
  for (auto [b, n] : units) unit_rows = std::max(unit_rows, n);
  // Tasks: with many units, one per (unit, up to kMaxHeadDim values of KV heads),
  // which reads each cache row as one contiguous run; with fewer, one per (unit, KV head), or
  // per (unit, query head) when even those are too few for the threads (single rows only).
  // A unit of several rows (a sequence verifying drafts) always takes one KV head a task: its
  // rows x GQA heads already fill the task, and the single-row units beside it keep their
  // wider tasks (one verifying sequence moved every sequence of the step to one KV head a
  // task before: +0.9 ms a 16-sequence step of 30 layers for one drafted token).
  // Pieces (attention_pieces.h): while the (unit, KV head) tasks are fewer than 4 a thread, a
  // unit's pieces go to tasks of their own (their sums combined by whichever task finishes its
  // group's last piece); else a task attends its unit's pieces in turn.
  // Whole GQA groups as soon as there is a (unit or piece, KV head) task per thread: a
  // query-head task reads the same cache rows as its group's others, so splitting a group only
  // pays where threads would idle. One bf16 sequence (9 / 3 heads, d 64, 30 layers, 2 threads,
  // Zen 4): whole groups from 128 to 8,192 positions took 1.24-1.96x less time than groups split
  // into query-head tasks (as bf16 kept them below 4 tasks a thread before the pieces).
  // A step with little work stays on the calling thread.
  auto first = [&](int64_t len) { return window_start(len, window); };
  std::vector<std::pair<int64_t, int64_t>> span(U);  // (first piece, pieces) of each unit
  int64_t pieces = 0;
  for (int64_t u = 0; u < U; ++u) {
    const auto [b, n] = units[u];
    const int64_t p = first(lens[b]) / kPiece;
    span[u] = {p, std::max<int64_t>(1, (lens[b + n - 1] - 1) / kPiece - p + 1)};
    pieces += span[u].second;
  }
  const bool split = U * Hk < 4 * threads && pieces > U;
  const int64_t kv_tasks = split ? pieces * Hk : U * Hk;
  const int64_t heads = kv_tasks >= threads || unit_rows > 1 ? group : 1;
  int64_t wide = 1;  // KV heads a task of a single-row unit
  if (U >= 4 * threads)
    for (int64_t k = Hk; k > 1; --k)
      if (Hk % k == 0 && k * D <= kMaxHeadDim) { wide = k; break; }
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  struct Task {
    int64_t unit, hq, kv, piece, group;  // group -1: all the unit's pieces, else its split group
  };
  std::vector<Task> tasks;
  std::vector<int64_t> at;  // each split group's sums in `shared`
  int64_t most = 1, size = 0;  // queries of the largest task; floats of the split sums
  for (int64_t u = 0; u < U; ++u) {
    const int64_t kv = units[u].second == 1 ? wide : 1, queries = heads * kv * units[u].second;
    most = std::max(most, queries);
    for (int64_t hq = 0; hq < Hq; hq += heads * kv) {
      if (!split || span[u].second == 1) { tasks.push_back({u, hq, kv, 0, -1}); continue; }
      for (int64_t p = 0; p < span[u].second; ++p)
        tasks.push_back({u, hq, kv, p, static_cast<int64_t>(at.size())});
      at.push_back(size);
      size += span[u].second * PieceSums::size(queries, Dp);
    }
  }
  std::vector<float> shared(size);
  std::vector<std::atomic<int64_t>> left(at.size());  // pieces still to attend
  for (const Task& t : tasks)
    if (t.group >= 0 && t.piece == 0) left[t.group].store(span[t.unit].second);
  const int64_t work = std::max<int64_t>(1, std::min(total / B, kPiece) * D * most / 8);
  // tasks differ in work (sequences of different lengths): handed out as threads come free
  parallel_dynamic(static_cast<int64_t>(tasks.size()), [&](int64_t j) {
    const Task t = tasks[j];
    const auto [b, n] = units[t.unit];
    const auto [p0, count] = span[t.unit];
    const int64_t queries = heads * t.kv * n, last = b + n - 1, nq = heads * t.kv;
    const int64_t block = PieceSums::size(queries, Dp);
    thread_local std::vector<float> scores, qf, own;
    scores.resize(std::min(longest, kPiece) * queries), qf.resize(queries * Dp);
    if (t.group < 0) own.resize(count * block);
    float* sums = t.group < 0 ? own.data() : shared.data() + at[t.group];
    for (int64_t p = t.group < 0 ? 0 : t.piece; p < (t.group < 0 ? count : t.piece + 1); ++p)
      attend_group(q + (b * Hq + t.hq) * D, Hq * D, n, kc, vc, tables + last * max_blocks,
                   window, lens[last], (p0 + p) * kPiece, (p0 + p + 1) * kPiece, BS, Hk,
                   t.hq / group, t.kv, D, heads, scale, scores.data(), qf.data(),
                   PieceSums{sums + p * block, queries, Dp});
    if (t.group >= 0 && left[t.group].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    for (int64_t g = 0; g < queries; ++g)
      combine(sums, block, count, queries, Dp, g, D,
              out + (b * Hq + t.hq) * D + g / nq * Hq * D + g % nq * D);
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
