// tokenmill CPU kernels: paged decode attention (see cpu_ops.h).

#include "cpu_ops.h"

using namespace tokenmill;

namespace {

// softmax in place over n scores
void softmax(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  __m256 m = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; i < n; ++i) { s[i] = std::exp(s[i] - mx); total += s[i]; }
  __m256 inv = _mm256_set1_ps(1.0f / total);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
  for (; i < n; ++i) s[i] /= total;
}

// Prefetch one cache line into L1 (or L2 only). GCC deletes a loop of _mm_prefetch calls and
// nothing else (no side effects), so these are asm statements it must keep.
inline void prefetch_l1(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }
inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

constexpr int64_t kMaxHeadDim = 256;

constexpr int64_t kRows = 16;  // cache rows widened to float32 at a time

// One sequence's K or V history for one KV head: positions [0, L) in cache blocks of BS rows
// (`row` values apart), each read at `offset`, D values wide.
template <typename T>
struct Paged {
  const T* cache;
  const int64_t* table;
  int64_t L, BS, row, offset, D;

  const T* at(int64_t p) const { return cache + (table[p / BS] * BS + p % BS) * row + offset; }
  // rows from p up to the end of its block, at most kRows
  int64_t take(int64_t p) const { return std::min({BS - p % BS, L - p, kRows}); }
  // Fetch the rows of the chunk at p into L1 (near) or L2 ahead of use.
  void prefetch(int64_t p, bool near) const {
    if (p >= L) return;
    const char* r = reinterpret_cast<const char*>(at(p));
    const int64_t rows = take(p), stride = row * sizeof(T), bytes = D * sizeof(T);
    for (int64_t j = 0; j < rows; ++j, r += stride)
      for (int64_t b = 0; b < bytes; b += 64) near ? prefetch_l1(r + b) : prefetch_l2(r + b);
  }
};

// Visit positions [start, L) up to kRows at a time, never crossing a cache block: fn(index of
// the first position from start, rows, its cache row). Blocks lie anywhere in the cache, so the
// hardware prefetcher loses the stream at each one: each chunk prefetches the next into L1 and
// the one after into L2 (30 layers, 16 x 192 positions: 22-25 ms without prefetch, 13-15 with
// the next chunk only, 12 with both; docs/performance.md).
template <typename T, typename Fn>
void walk(const Paged<T>& h, int64_t start, Fn fn) {
  for (int64_t p = start, rows; p < h.L; p += rows) {
    rows = h.take(p);
    h.prefetch(p + rows, true);
    if (p + rows < h.L) h.prefetch(p + rows + h.take(p + rows), false);
    fn(p - start, rows, h.at(p));
  }
}

// rows x D cache entries (stride `row`) -> float32 scratch (rows x D)
template <typename T>
void widen_block(const T* src, int64_t rows, int64_t row, int64_t D, float* dst) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(dst + j * D + i, load8(src + j * row + i));
}

// Eight float32 sums in one vector: lane r = hsum(a[r]) (a transpose by horizontal adds).
inline __m256 hsum8(const __m256* a) {
  __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);  // low lanes: rows 0-3 | 4-7
  __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// sc[j] = qf . k[j] for `rows` key rows (stride `stride`): eight rows at a time, eight
// independent FMA chains reduced together.
template <typename R>
void score_rows(const float* qf, const R* k, int64_t stride, int64_t rows, int64_t D, float* sc) {
  int64_t j = 0;
  for (; j + 8 <= rows; j += 8, k += 8 * stride) {
    __m256 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      __m256 qv = _mm256_loadu_ps(qf + i);
      for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, load8(k + r * stride + i), a[r]);
    }
    _mm256_storeu_ps(sc + j, hsum8(a));
  }
  for (; j < rows; ++j, k += stride) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load8(k + i), a);
    sc[j] = hsum(a);
  }
}

// acc[i : i + 8U] += sum_j sc[j] * v[j][i : i + 8U]: U accumulators stay in registers across
// the rows (independent FMA chains).
template <int U, typename R>
void accumulate_cols(const float* sc, const R* v, int64_t stride, int64_t rows, float* acc) {
  __m256 a[U];
  for (int u = 0; u < U; ++u) a[u] = _mm256_loadu_ps(acc + 8 * u);
  for (int64_t j = 0; j < rows; ++j, v += stride) {
    __m256 s = _mm256_set1_ps(sc[j]);
    for (int u = 0; u < U; ++u) a[u] = _mm256_fmadd_ps(s, load8(v + 8 * u), a[u]);
  }
  for (int u = 0; u < U; ++u) _mm256_storeu_ps(acc + 8 * u, a[u]);
}

// acc += sum_j sc[j] * v[j] for `rows` value rows (stride `stride`)
template <typename R>
void accumulate_rows(const float* sc, const R* v, int64_t stride, int64_t rows, int64_t D,
                     float* acc) {
  int64_t i = 0;
  for (; i + 64 <= D; i += 64) accumulate_cols<8>(sc, v + i, stride, rows, acc + i);
  for (; i + 32 <= D; i += 32) accumulate_cols<4>(sc, v + i, stride, rows, acc + i);
  for (; i < D; i += 8) accumulate_cols<1>(sc, v + i, stride, rows, acc + i);
}

// The query heads of `kv` adjacent KV heads (from KV head h) of one sequence against its paged
// K/V history (head_dim a multiple of 8); `heads` query heads per KV head: its whole GQA group,
// or one head of it. The group reads each K and V row from the cache once, its `kv` heads side
// by side (one contiguous slice of the cache row), widened into an L1 scratch that all its
// query heads use; a single query head reads the cache rows directly.
template <typename T>
void attend_group(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t start,
                  int64_t L, int64_t BS, int64_t Hk, int64_t h, int64_t kv, int64_t D,
                  int64_t heads, float scale, float* scores, float* buf, float* qf, float* acc,
                  T* out) {
  const int64_t row = Hk * D, n = L - start, W = kv * D, nq = kv * heads;
  const Paged<T> keys{kc, table, L, BS, row, h * D, W}, values{vc, table, L, BS, row, h * D, W};
  for (int64_t i = 0; i < nq * D; i += 8)
    _mm256_storeu_ps(qf + i, _mm256_mul_ps(load8(q + i), _mm256_set1_ps(scale)));
  walk(keys, start, [&](int64_t at, int64_t rows, const T* k) {
    if (nq == 1) return score_rows(qf, k, row, rows, D, scores + at);
    widen_block(k, rows, row, W, buf);
    for (int64_t g = 0; g < nq; ++g)  // query head g reads KV head g / heads
      score_rows(qf + g * D, buf + g / heads * D, W, rows, D, scores + g * n + at);
  });
  for (int64_t g = 0; g < nq; ++g) softmax(scores + g * n, n);
  std::fill(acc, acc + nq * D, 0.f);
  walk(values, start, [&](int64_t at, int64_t rows, const T* v) {
    if (nq == 1) return accumulate_rows(scores + at, v, row, rows, D, acc);
    widen_block(v, rows, row, W, buf);
    for (int64_t g = 0; g < nq; ++g)
      accumulate_rows(scores + g * n + at, buf + g / heads * D, W, rows, D, acc + g * D);
  });
  for (int64_t i = 0; i < nq * D; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* tables,
                           const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hk,
                           int64_t D, int64_t BS, int64_t max_blocks, int64_t window,
                           float scale) {
  int64_t group = Hq / Hk, longest = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) { longest = std::max(longest, lens[b]); total += lens[b]; }
  // Tasks: with many sequences, one per (sequence, KV heads whose cache row slice fits the
  // scratch), which reads each cache row as one contiguous run; with fewer, one per (sequence,
  // KV head), or per (sequence, query head) when even those are too few for the threads. A
  // step with little work stays on the calling thread.
  int64_t threads = at::get_num_threads(), heads = B * Hk >= 4 * threads ? group : 1, kv = 1;
  if (B >= 4 * threads)
    for (int64_t k = Hk; k > 1; --k)
      if (Hk % k == 0 && k * D <= kMaxHeadDim) { kv = k; break; }
  int64_t tasks = B * Hq / (heads * kv), per_task = heads * kv;
  int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, total / B * D * per_task / 8));
  at::parallel_for(0, tasks, grain, [&](int64_t j0, int64_t j1) {
    std::vector<float> scores(longest * per_task), buf(kRows * kv * D), qf(per_task * D),
        acc(per_task * D);
    for (int64_t j = j0; j < j1; ++j) {
      int64_t b = j * per_task / Hq, hq = j * per_task % Hq, L = lens[b];
      int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      attend_group(q + (b * Hq + hq) * D, kc, vc, tables + b * max_blocks, start, L, BS, Hk,
                   hq / group, kv, D, heads, scale, scores.data(), buf.data(), qf.data(),
                   acc.data(), out + (b * Hq + hq) * D);
    }
  });
}

}  // namespace

// One query token per sequence against its paged history. q: (B, Hq, D); k_cache, v_cache:
// (num_blocks, block_size, Hk, D) of one layer; block_tables: (B, max_blocks) int64 (entries
// past a sequence's length are ignored); seq_lens: (B,) int64; window 0 = unlimited.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens,
                               int64_t window, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: contiguous inputs");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "decode_attention: dtype mismatch");
  TORCH_CHECK(q.size(2) % 8 == 0 && q.size(2) <= kMaxHeadDim,
              "decode_attention: head_dim must be a multiple of 8 up to 256");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  int64_t BS = k_cache.size(1), Hk = k_cache.size(2), MB = tables.size(1);
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    decode_attention_impl(reinterpret_cast<const BFloat16*>(q.data_ptr()),
                          reinterpret_cast<const BFloat16*>(k_cache.data_ptr()),
                          reinterpret_cast<const BFloat16*>(v_cache.data_ptr()),
                          tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                          reinterpret_cast<BFloat16*>(out.data_ptr()), B, Hq, Hk, D, BS, MB,
                          window, static_cast<float>(scale));
  } else {
    decode_attention_impl(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                          v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                          lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, Hq, Hk, D, BS,
                          MB, window, static_cast<float>(scale));
  }
  return out;
}
