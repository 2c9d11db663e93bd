// tokenmill CPU kernels: paged decode attention, one query token per sequence against its K/V
// history read in place through the block table (no gather copy), on the vector layer.
#include <type_traits>

#include "attention_common.h"
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

  const T* at(int64_t p) const { return cache + (table[p / BS] * BS + p % BS) * row + offset; }
  // rows from p up to the end of its block, at most kRows
  int64_t take(int64_t p) const { return std::min({BS - p % BS, L - p, kRows}); }
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
// the one after into L2.
template <typename T, typename Fn>
void walk(const Paged<T>& h, int64_t start, Fn fn) {
  for (int64_t p = start, rows; p < h.L; p += rows) {
    rows = h.take(p);
    h.prefetch(p + rows, true);
    if (p + rows < h.L) h.prefetch(p + rows + h.take(p + rows), false);
    fn(p - start, rows, h.at(p));
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
  for (; j < rows; ++j, k += stride) {
    vec a = vzero();
    for (int64_t i = 0; i < D; i += 32) a = _mm512_dpbf16_ps(a, kload(q, i), kload(k, i));
    sc[j] = vsum(a) * scale;
  }
}
#endif

// The query heads of `kv` adjacent KV heads (from KV head h) of one sequence against its paged
// K/V history; `heads` query heads per KV head: its whole GQA group, or one head of it. A group
// reads each K and V row from the cache once, its `kv` heads side by side (one contiguous slice
// of the cache row), widened into an L1 scratch that all its query heads use; a single query
// head reads the cache rows directly.
template <typename T>
void attend_group(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t start,
                  int64_t L, int64_t BS, int64_t Hk, int64_t h, int64_t kv, int64_t D,
                  int64_t heads, float scale, float* scores, float* buf, float* qf, float* acc,
                  T* out) {
  const int64_t row = Hk * D, n = L - start, W = kv * D, nq = kv * heads;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;  // padded scratch row
  const Paged<T> keys{kc, table, L, BS, row, h * D, W}, values{vc, table, L, BS, row, h * D, W};
  for (int64_t g = 0; g < nq; ++g) {
    std::fill(qf + g * Dp, qf + (g + 1) * Dp, 0.f);
    for (int64_t i = 0; i < D; ++i) qf[g * Dp + i] = to_f(q[g * D + i]) * scale;
  }
  walk(keys, start, [&](int64_t at, int64_t rows, const T* k) {
#ifdef TM_ISA_AVX512_BF16
    if constexpr (std::is_same_v<T, bf16>) {  // every query head reads the cache rows directly
      for (int64_t g = 0; g < nq; ++g)
        score_dot(q + g * D, k + g / heads * D, row, rows, D, scale, scores + g * n + at);
      return;
    }
#endif
    if (nq == 1) return score(qf, k, row, rows, D, scores + at);
    widen_block(k, rows, row, W, buf);
    for (int64_t g = 0; g < nq; ++g)  // query head g reads KV head g / heads
      score(qf + g * Dp, buf + g / heads * D, W, rows, D, scores + g * n + at);
  });
  for (int64_t g = 0; g < nq; ++g) softmax(scores + g * n, n);
  std::fill(acc, acc + nq * Dp, 0.f);
  walk(values, start, [&](int64_t at, int64_t rows, const T* v) {
    if (nq == 1) return accumulate_rows(scores + at, v, row, rows, D, acc);
    widen_block(v, rows, row, W, buf);
    for (int64_t g = 0; g < nq; ++g)
      accumulate_rows(scores + g * n + at, buf + g / heads * D, W, rows, D, acc + g * Dp);
  });
  for (int64_t g = 0; g < nq; ++g)
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = from_f<T>(acc[g * Dp + i]);
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
  // KV head), or per (sequence, query head) when even those are too few for the threads. One
  // KV head shared by many query heads (MLA's latent rows) keeps whole groups as soon as there
  // is a sequence per thread: each cache row is then read once for all its heads. A step with
  // little work stays on the calling thread.
  int64_t threads = g_threads, kv = 1;
  int64_t heads = B * Hk >= 4 * threads || (Hk == 1 && group >= 8 && B >= threads) ? group : 1;
  if (B >= 4 * threads)
    for (int64_t k = Hk; k > 1; --k)
      if (Hk % k == 0 && k * D <= kMaxHeadDim) { kv = k; break; }
  int64_t tasks = B * Hq / (heads * kv), per_task = heads * kv;
  int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  int64_t work = std::max<int64_t>(1, total / B * D * per_task / 8);
  parallel_for(0, tasks, std::max<int64_t>(1, (1 << 14) / work), [&](int64_t j0, int64_t j1) {
    std::vector<float> scores(longest * per_task), buf(kRows * kv * D + kLanes),
        qf(per_task * Dp), acc(per_task * Dp);
    for (int64_t j = j0; j < j1; ++j) {
      int64_t b = j * per_task / Hq, hq = j * per_task % Hq, L = lens[b];
      int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      attend_group(q + (b * Hq + hq) * D, kc, vc, tables + b * max_blocks, start, L, BS, Hk,
                   hq / group, kv, D, heads, scale, scores.data(), buf.data(), qf.data(),
                   acc.data(), out + (b * Hq + hq) * D);
    }
  });
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
