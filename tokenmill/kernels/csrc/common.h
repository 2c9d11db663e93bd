// tokenmill CPU kernels: what every kernel shares, whatever the instruction set: the bfloat16
// storage type and its roundings, and the parallel loops (over OpenMP, or a step's team).
//
// Arithmetic mirrors the PyTorch references in tokenmill/layers/ops.py: accumulate in float32,
// round to the tensor's dtype (float32 or bfloat16) at the points where the reference rounds.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "team.h"

namespace tm {

struct bf16 {  // storage only: the top 16 bits of a float32
  uint16_t bits;
};

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 -> bfloat16, round to nearest even (PyTorch's conversion; NaN stays a NaN)
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return bf16{0x7FC0};
  u += 0x7FFF + ((u >> 16) & 1);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// IEEE half (GGUF block scales) -> float32, exactly (normals, subnormals, inf, NaN).
inline float half_to_f(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) {  // subnormal: normalize
    int e = 113;
    while (!(man & 0x400)) { man <<= 1; --e; }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3FF) << 13);
  } else {
    bits = sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> IEEE half, round to nearest even (what PyTorch's .to(torch.float16) does);
// overflow to inf, NaN stays a NaN.
inline uint16_t f_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000;
  u &= 0x7FFFFFFF;
  if (u >= 0x7F800000) return static_cast<uint16_t>(sign | (u > 0x7F800000 ? 0x7E00 : 0x7C00));
  if (u >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds past 65504
  if (u < 0x38800000) {  // subnormal half (or zero): round 2**-24 units
    float a;
    std::memcpy(&a, &u, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
  }
  u += 0xFFF + ((u >> 13) & 1);  // round the 13 dropped bits to nearest even
  return static_cast<uint16_t>(sign | ((u - 0x38000000) >> 13));
}

template <typename T> inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline bf16 from_f<bf16>(float v) { return to_bf16(v); }

// Round a float32 to the storage type T and back: what a bf16 tensor op's output rounding does.
template <typename T> inline float rnd(float v) { return to_f(from_f<T>(v)); }

// Threads the kernels use (set from Python to torch.get_num_threads()).
extern int g_threads;
// 1: the bf16 dot-product GEMM prefetches the weights of a call with few rows (each panel read
// once) non-temporally instead of into L2; set from Python where that measured faster
// (kernels/stream_prefetch.py)
extern int g_stream_nta;
// Q6_K calls on the AVX2 tiles widen each group once per row chunk of at least this many rows
// (tm_set_q6_widen_rows; kernels/q6_widen.py chooses by measurement)
extern int64_t g_q6_widen_rows;

// f(begin, end) on contiguous slices of [begin, end), one per thread, at least `grain` items
// each (at::parallel_for's split); inline when the range is small or already inside a
// parallel region. In a step's team (team.h) each slice is a part of a job.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  int64_t n = end - begin;
  if (n <= 0) return;
  int64_t threads = std::min<int64_t>(g_threads, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (Team* team = threads > 1 ? Team::driving() : nullptr) {
    const int64_t chunk = (n + threads - 1) / threads;
    team->parts(threads, [&](int64_t t) {
      const int64_t b = begin + t * chunk;
      if (b < end) f(b, std::min(end, b + chunk));
    });
    return;
  }
#ifdef _OPENMP
  if (threads > 1 && !omp_in_parallel()) {
    int64_t chunk = (n + threads - 1) / threads;
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      int64_t b = begin + omp_get_thread_num() * chunk;
      if (b < end) f(b, std::min(end, b + chunk));
    }
    return;
  }
#endif
  (void)threads;
  f(begin, end);
}

// f(i) for i in [0, n), handed out one at a time to the threads as they come free (tasks of
// unequal work: causal tiles, sequences of different lengths); inline when n <= serial or
// already inside a parallel region.
template <typename F>
void parallel_dynamic(int64_t n, const F& f, int64_t serial = 1) {
  if (Team* team = g_threads > 1 && n > serial ? Team::driving() : nullptr) {
    team->parts(n, f);
    return;
  }
#ifdef _OPENMP
  if (g_threads > 1 && n > serial && !omp_in_parallel()) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast<int>(std::min<int64_t>(g_threads, n)))
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) f(i);
}

// Items [begin, end) split into one run per thread as parallel_for splits them; each thread
// takes its own run's items from the front, and when it is done, the others' from their backs.
// A core slowed by a neighbour (on a shared host the two vCPUs' tile units ran 400 and 1,100
// GFLOP/s at once) hands its last items to the faster one, as ggml's chunks do; on an even
// machine little moves. f(take) runs once per thread: take(i, hint) gives the thread's next
// item i, and in hint the end of the run it is taking from the front (items in [i + 1, hint)
// are likely its next; i + 1 for a taken item), or returns false when none is left. Which
// thread runs an item must not change its results.
template <typename F>
void parallel_steal(int64_t begin, int64_t end, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(g_threads, n);
  const int64_t chunk = (n + threads - 1) / threads;
  struct alignas(64) Run {  // (front, back) offsets from the run's first item, packed
    std::atomic<uint64_t> fb;
  };
  std::vector<Run> runs(threads);
  for (int64_t t = 0; t < threads; ++t)
    runs[t].fb.store(static_cast<uint64_t>(std::min(chunk, n - t * chunk)) << 32);
  auto go = [&](int64_t me) {
    auto take = [&](int64_t& item, int64_t& hint) {
      uint64_t v = runs[me].fb.load();
      while (static_cast<uint32_t>(v) < (v >> 32)) {  // the front of its own run
        if (runs[me].fb.compare_exchange_weak(v, v + 1)) {
          const int64_t base = begin + me * chunk;
          item = base + static_cast<uint32_t>(v), hint = base + static_cast<int64_t>(v >> 32);
          return true;
        }
      }
      for (int64_t k = 1; k < threads; ++k) {  // the backs of the others'
        const int64_t u = (me + k) % threads;
        uint64_t w = runs[u].fb.load();
        while (static_cast<uint32_t>(w) < (w >> 32)) {
          if (runs[u].fb.compare_exchange_weak(w, w - (uint64_t{1} << 32))) {
            item = begin + u * chunk + (w >> 32) - 1, hint = item + 1;
            return true;
          }
        }
      }
      return false;
    };
    f(take);
  };
  if (Team* team = threads > 1 ? Team::driving() : nullptr) {
    team->parts(threads, go);
    return;
  }
#ifdef _OPENMP
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(static_cast<int>(threads))
    go(omp_get_thread_num());
    return;
  }
#endif
  go(0);  // one thread: its own run, then the others' from their backs
}

}  // namespace tm
