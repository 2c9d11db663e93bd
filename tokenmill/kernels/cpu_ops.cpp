// tokenmill CPU kernels (AVX2 + FMA): the decode hot path without per-op Python overhead.
//
// Each function has a plain PyTorch reference in tokenmill/layers/ops.py and a test that the
// two agree. Arithmetic mirrors the reference: accumulate in float32, round to the tensor's
// dtype (float32 or bfloat16) at the same points where the reference rounds.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using at::BFloat16;

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift left by 16.
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Prefetch one cache line into L1 (or L2 only). GCC deletes a loop of _mm_prefetch calls and
// nothing else (no side effects), so these are asm statements it must keep.
inline void prefetch_l1(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }
inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Round 8 floats to bfloat16 precision (round to nearest even), kept as floats: what storing
// into a bf16 tensor and reading back does (NaN aside).
inline __m256 round_bf16(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xFFFF0000)));
}

template <typename T> inline __m256 rnd8(__m256 v) { return v; }
template <> inline __m256 rnd8<BFloat16>(__m256 v) { return round_bf16(v); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(BFloat16* p, __m256 v) {  // v already bf16-exact: keep the high halves
  __m256i b = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// exp(x) for 8 floats: Cephes' polynomial after range reduction (max rel. error ~2e-7);
// std::exp per score was the slowest part of decode attention.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                              _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float to_f(float v) { return v; }
inline float to_f(BFloat16 v) { return static_cast<float>(v); }

// Round a float32 to the storage type T and back (the rounding a bf16 tensor op performs).
template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

}  // namespace

namespace {

// ---- GEMM on packed weights -----------------------------------------------------------------
// ops.pack_weight stores a (N, K) weight as (ceil(N / 16), K, 16) panels: for each k the 16
// weights of 16 consecutive output rows side by side, so the micro-kernel reads one 32-byte
// (bf16) or 64-byte (float32) vector per k and broadcasts one input value per row: a 6 x 16
// output tile lives in 12 registers (the outer-product form of BLIS). bf16 panels interleave
// each 32-bit lane as (row i, row 8 + i): a shift and a mask widen them to two float32 vectors.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

inline void load16(const BFloat16* p, __m256& lo, __m256& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

constexpr int64_t kPanel = 16, kTileRows = 6;

// Software prefetch: one or two 64-byte lines per two k steps (as many bytes as two k steps of
// the panel read), from `pf` up to `end`.
struct Prefetch {
  const char* pf;
  const char* end;
};

// out[i, 0:cols] = x[i, :] . panel (+ bias) for MR input rows (stride ldx) and one panel.
template <int MR, typename W, typename O>
void micro(const float* x, int64_t ldx, const W* panel, int64_t K, const float* bias, O* out,
           int64_t ldo, int64_t cols, Prefetch pre) {
  // Few rows (decode): a second accumulator set for odd k keeps enough FMA chains in flight.
  constexpr bool kTwoSets = MR <= 3;
  __m256 c[MR][2], d[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = d[i][0] = d[i][1] = _mm256_setzero_ps();
  auto step = [&](__m256 (&acc)[MR][2], int64_t k) __attribute__((always_inline)) {
    __m256 lo, hi;
    load16(panel + k * kPanel, lo, hi);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m256 b = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(b, lo, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(b, hi, acc[i][1]);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    if (pre.pf < pre.end) {
      _mm_prefetch(pre.pf, _MM_HINT_T0);
      if (sizeof(W) == 4) _mm_prefetch(pre.pf + 64, _MM_HINT_T0);
      pre.pf += 2 * kPanel * sizeof(W);
    }
    step(c, k);
    step(kTwoSets ? d : c, k + 1);
  }
  if (k < K) step(c, k);
  // accumulators -> memory in one unrolled pass (indexing them by a runtime row would keep
  // them in memory through the k loop), then bias and the store of the valid columns
  alignas(32) float tile[MR][kPanel];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    __m256 lo = c[i][0], hi = c[i][1];
    if (kTwoSets) {
      lo = _mm256_add_ps(lo, d[i][0]);
      hi = _mm256_add_ps(hi, d[i][1]);
    }
    _mm256_store_ps(tile[i], lo);
    _mm256_store_ps(tile[i] + 8, hi);
  }
  for (int i = 0; i < MR; ++i) {
    O* o = out + i * ldo;
    if (cols == kPanel) {
      __m256 lo = _mm256_load_ps(tile[i]), hi = _mm256_load_ps(tile[i] + 8);
      if (bias) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
      }
      store8(o, lo);
      store8(o + 8, hi);
    } else {  // the last panel of a matrix whose rows are not a multiple of 16
      for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<O>(tile[i][j] + (bias ? bias[j] : 0.f));
    }
  }
}

template <typename W, typename O>
void micro_rows(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t K,
                const float* bias, O* out, int64_t ldo, int64_t cols, Prefetch pre) {
  switch (rows) {
    case 1: return micro<1>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 2: return micro<2>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 3: return micro<3>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 4: return micro<4>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 5: return micro<5>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    default: return micro<6>(x, ldx, panel, K, bias, out, ldo, cols, pre);
  }
}

// Blocks of input rows sized to stay in a core's L2 while every panel streams past them;
// work items are (row block, panel) pairs, so a decode batch splits by panels and a prefill
// chunk by row blocks. The first row tile of a panel streams it from memory with a prefetch
// 4 KiB ahead; later tiles find it cached and prefetch the next panel meanwhile, in equal
// shares, so memory traffic overlaps arithmetic.
template <typename W, typename O>
void gemm_packed(const float* x, const W* w, const float* bias, O* out, int64_t M, int64_t N,
                 int64_t K) {
  int64_t panels = (N + kPanel - 1) / kPanel, bytes = K * kPanel * sizeof(W);
  int64_t block = std::max<int64_t>(kTileRows, (256 * 1024 / (4 * K)) / kTileRows * kTileRows);
  block = std::min(block, M);
  int64_t blocks = (M + block - 1) / block;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t m0 = t / panels * block, m1 = std::min(M, m0 + block), p = t % panels;
      int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      const W* panel = w + p * K * kPanel;
      const char* start = reinterpret_cast<const char*>(panel);
      int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
      int64_t share = tiles > 1 ? (bytes / (tiles - 1) + 63) / 64 * 64 : 0;
      // the next panel follows this one; prefetch it only when this thread reads it next
      const char* next = start + bytes;
      int64_t ahead = t + 1 < t1 && p + 1 < panels ? bytes : 0;
      for (int64_t j = 0; j < tiles; ++j) {
        Prefetch pre = j == 0 ? Prefetch{start + 4096, start + 4096 + bytes}
                              : Prefetch{next + (j - 1) * share, next + std::min(ahead, j * share)};
        int64_t m = m0 + j * kTileRows;
        micro_rows(std::min(kTileRows, m1 - m), x + m * K, K, panel, K,
                   bias ? bias + n0 : nullptr, out + m * N + n0, N, cols, pre);
      }
    }
  });
}

}  // namespace

// x: (M, K) float32 or bfloat16; w: packed (ceil(N / 16), K, 16) float32 or bfloat16 (see
// ops.pack_weight) -> (M, N) in x's dtype, or float32 when out_fp32 (logits: no bf16
// rounding of the accumulated sums).
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                     int64_t N, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == kPanel && x.size(1) == w.size(1) &&
              w.size(0) == (N + kPanel - 1) / kPanel && w.is_contiguous(),
              "linear: bad shapes");
  auto xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor bf;
  if (bias.has_value()) bf = bias->to(torch::kFloat32).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, out_fp32 ? x.options().dtype(torch::kFloat32) : x.options());
  const float* xp = xf.data_ptr<float>();
  bool wbf = w.scalar_type() == torch::kBFloat16;
  auto* wb = reinterpret_cast<const BFloat16*>(w.data_ptr());
  if (out.scalar_type() == torch::kBFloat16) {
    auto* o = reinterpret_cast<BFloat16*>(out.data_ptr());
    if (wbf) gemm_packed(xp, wb, bp, o, M, N, K);
    else gemm_packed(xp, w.data_ptr<float>(), bp, o, M, N, K);
  } else {
    auto* o = out.data_ptr<float>();
    if (wbf) gemm_packed(xp, wb, bp, o, M, N, K);
    else gemm_packed(xp, w.data_ptr<float>(), bp, o, M, N, K);
  }
  return out;
}

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, T* residual, const T* add, int64_t rows,
                   int64_t H, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(H);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      const T* ar = add ? add + r * H : nullptr;
      __m256 ss8 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) {
        // residual stream update: residual = residual + add, rounded to T (as the reference)
        __m256 v = load8(xr + i);
        if (ar) {
          v = rnd8<T>(_mm256_add_ps(load8(ar + i), v));
          store8(residual + r * H + i, v);
        }
        _mm256_storeu_ps(buf.data() + i, v);
        ss8 = _mm256_fmadd_ps(v, v, ss8);
      }
      float ss = hsum(ss8);
      for (; i < H; ++i) {
        float v = ar ? rnd<T>(to_f(ar[i]) + to_f(xr[i])) : to_f(xr[i]);
        if (ar) residual[r * H + i] = static_cast<T>(v);
        buf[i] = v;
        ss += v * v;
      }
      float inv = 1.0f / std::sqrt(ss / H + eps);
      __m256 inv8 = _mm256_set1_ps(inv);
      for (i = 0; i + 8 <= H; i += 8) {
        __m256 n = rnd8<T>(_mm256_mul_ps(_mm256_loadu_ps(buf.data() + i), inv8));
        store8(out + r * H + i, _mm256_mul_ps(load8(w + i), n));
      }
      for (; i < H; ++i) out[r * H + i] = static_cast<T>(to_f(w[i]) * rnd<T>(buf[i] * inv));
    }
  });
}

}  // namespace

// out = weight * normalize(x); with `add`: residual = add + x first (written to `x`'s slot in
// residual), then normalize that. Returns out.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps,
                       c10::optional<torch::Tensor> add) {
  TORCH_CHECK(x.is_contiguous() && w.scalar_type() == x.scalar_type(), "rms_norm: bad inputs");
  int64_t H = x.size(-1), rows = x.numel() / H;
  auto out = torch::empty_like(x);
  torch::Tensor res = x;  // residual stream, updated in place when add is given
  if (x.scalar_type() == torch::kBFloat16) {
    auto* p = reinterpret_cast<BFloat16*>(x.data_ptr());
    rms_norm_rows(p, reinterpret_cast<BFloat16*>(w.data_ptr()),
                  reinterpret_cast<BFloat16*>(out.data_ptr()), p,
                  add ? reinterpret_cast<BFloat16*>(add->data_ptr()) : nullptr, rows, H,
                  static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rms_norm: float32 or bfloat16 only");
    auto* p = x.data_ptr<float>();
    rms_norm_rows(p, w.data_ptr<float>(), out.data_ptr<float>(), p,
                  add ? add->data_ptr<float>() : nullptr, rows, H, static_cast<float>(eps));
  }
  return out;
}

namespace {

template <typename T>
void rope_rows(T* x, const float* cos_sin, const int64_t* pos, int64_t T_, int64_t heads,
               int64_t D, int64_t table_len) {
  int64_t half = D / 2;
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(D), s(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* cr = cos_sin + pos[t] * D;
      const float* sr = cos_sin + (table_len + pos[t]) * D;
      for (int64_t i = 0; i < D; ++i) { c[i] = rnd<T>(cr[i]); s[i] = rnd<T>(sr[i]); }
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + (t * heads + h) * D;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {  // the same roundings, eight lanes at a time
          __m256 a = load8(v + i), b = load8(v + i + half);
          __m256 cl = _mm256_loadu_ps(&c[i]), ch = _mm256_loadu_ps(&c[i + half]);
          __m256 sl = _mm256_loadu_ps(&s[i]), sh = _mm256_loadu_ps(&s[i + half]);
          __m256 lo = rnd8<T>(_mm256_sub_ps(rnd8<T>(_mm256_mul_ps(a, cl)),
                                            rnd8<T>(_mm256_mul_ps(b, sl))));
          __m256 hi = rnd8<T>(_mm256_add_ps(rnd8<T>(_mm256_mul_ps(b, ch)),
                                            rnd8<T>(_mm256_mul_ps(a, sh))));
          store8(v + i, lo);
          store8(v + i + half, hi);
        }
        for (; i < half; ++i) {
          float a = to_f(v[i]), b = to_f(v[i + half]);
          // q * cos + rotate_half(q) * sin, each product rounded like the reference
          float lo = rnd<T>(rnd<T>(a * c[i]) + rnd<T>(-b * s[i]));
          float hi = rnd<T>(rnd<T>(b * c[i + half]) + rnd<T>(a * s[i + half]));
          v[i] = static_cast<T>(lo);
          v[i + half] = static_cast<T>(hi);
        }
      }
    }
  });
}

}  // namespace

// In place on x: (tokens, heads, head_dim) contiguous; cos_sin: (2, positions, head_dim) f32.
void rope(torch::Tensor x, torch::Tensor cos_sin, torch::Tensor positions) {
  TORCH_CHECK(x.is_contiguous() && cos_sin.is_contiguous(), "rope: contiguous inputs");
  auto pos = positions.to(torch::kInt64).contiguous();
  int64_t T_ = x.size(0), heads = x.size(1), D = x.size(2), L = cos_sin.size(1);
  if (x.scalar_type() == torch::kBFloat16) {
    rope_rows(reinterpret_cast<BFloat16*>(x.data_ptr()), cos_sin.data_ptr<float>(),
              pos.data_ptr<int64_t>(), T_, heads, D, L);
  } else {
    rope_rows(x.data_ptr<float>(), cos_sin.data_ptr<float>(), pos.data_ptr<int64_t>(), T_,
              heads, D, L);
  }
}

namespace {

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {  // silu(g) rounded to T, times up, rounded
        __m256 gv = load8(g + i);
        __m256 act = rnd8<T>(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(
            _mm256_setzero_ps(), gv)))));
        store8(o + i, _mm256_mul_ps(act, load8(u + i)));
      }
      for (; i < I; ++i) {
        float gv = to_f(g[i]);
        float act = rnd<T>(gv / (1.0f + std::exp(-gv)));
        o[i] = static_cast<T>(act * to_f(u[i]));
      }
    }
  });
}

}  // namespace

// x: (rows, 2 * I) = [gate | up] -> silu(gate) * up: (rows, I)
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "silu_mul: contiguous input");
  int64_t I = x.size(-1) / 2, rows = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    silu_mul_rows(reinterpret_cast<const BFloat16*>(x.data_ptr()),
                  reinterpret_cast<BFloat16*>(out.data_ptr()), rows, I);
  } else {
    silu_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, I);
  }
  return out;
}

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
// the one after into L2 (measured 1.6-2x faster than no prefetch, 1.1-1.3x than the next only).
template <typename T, typename Fn>
void walk(const Paged<T>& h, int64_t start, Fn fn) {
  for (int64_t p = start; p < h.L; p += h.take(p)) {
    int64_t next = p + h.take(p);
    h.prefetch(next, true);
    if (next < h.L) h.prefetch(next + h.take(next), false);
    fn(p - start, h.take(p), h.at(p));
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

// `heads` query heads sharing KV head h (a GQA group, or one head of it) of one sequence
// against its paged K/V history (head_dim a multiple of 8). A group reads each K and V row from
// the cache once, widened into an L1 scratch that all its heads use, instead of once per head;
// a single head reads the cache rows directly.
template <typename T>
void attend_group(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t start,
                  int64_t L, int64_t BS, int64_t Hk, int64_t h, int64_t D, int64_t heads,
                  float scale, float* scores, float* buf, float* qf, float* acc, T* out) {
  const int64_t row = Hk * D, n = L - start;
  const Paged<T> keys{kc, table, L, BS, row, h * D, D}, values{vc, table, L, BS, row, h * D, D};
  for (int64_t i = 0; i < heads * D; i += 8)
    _mm256_storeu_ps(qf + i, _mm256_mul_ps(load8(q + i), _mm256_set1_ps(scale)));
  walk(keys, start, [&](int64_t at, int64_t rows, const T* k) {
    if (heads == 1) return score_rows(qf, k, row, rows, D, scores + at);
    widen_block(k, rows, row, D, buf);
    for (int64_t g = 0; g < heads; ++g)
      score_rows(qf + g * D, buf, D, rows, D, scores + g * n + at);
  });
  for (int64_t g = 0; g < heads; ++g) softmax(scores + g * n, n);
  std::fill(acc, acc + heads * D, 0.f);
  walk(values, start, [&](int64_t at, int64_t rows, const T* v) {
    if (heads == 1) return accumulate_rows(scores + at, v, row, rows, D, acc);
    widen_block(v, rows, row, D, buf);
    for (int64_t g = 0; g < heads; ++g)
      accumulate_rows(scores + g * n + at, buf, D, rows, D, acc + g * D);
  });
  for (int64_t i = 0; i < heads * D; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* tables,
                           const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hk,
                           int64_t D, int64_t BS, int64_t max_blocks, int64_t window,
                           float scale) {
  int64_t group = Hq / Hk, longest = 0, total = 0;
  for (int64_t b = 0; b < B; ++b) { longest = std::max(longest, lens[b]); total += lens[b]; }
  // One task per (sequence, KV head) when there are enough to keep the threads busy, else
  // per (sequence, query head); a step with little work stays on the calling thread.
  int64_t heads = B * Hk >= 4 * at::get_num_threads() ? group : 1, tasks = B * Hq / heads;
  int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, total / B * D * heads / 8));
  at::parallel_for(0, tasks, grain, [&](int64_t j0, int64_t j1) {
    std::vector<float> scores(longest * heads), buf(kRows * D), qf(heads * D), acc(heads * D);
    for (int64_t j = j0; j < j1; ++j) {
      int64_t b = j * heads / Hq, hq = j * heads % Hq, L = lens[b];
      int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      attend_group(q + (b * Hq + hq) * D, kc, vc, tables + b * max_blocks, start, L, BS, Hk,
                   hq / group, D, heads, scale, scores.data(), buf.data(), qf.data(), acc.data(),
                   out + (b * Hq + hq) * D);
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

// ---- the whole decoder stack for a decode-only step ------------------------------------------
// Same kernels, same order as the Python model (models/llama.py); running the layer loop here
// saves ~200 us of Python per layer. Per layer, `weights` holds kLayerTensors entries:
// input_norm, qkv_w, qkv_b, o_w, post_norm, gate_up_w, down_w, q_norm, k_norm (an empty tensor
// where a model has none); the projection weights packed by ops.pack_weight.
constexpr int64_t kLayerTensors = 9;

// cache.view(-1, heads, head_dim)[slots[t]] = x[t]: plain row copies.
void store_slots(torch::Tensor cache, const torch::Tensor& x, const torch::Tensor& slots) {
  int64_t row_bytes = x[0].numel() * x.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) std::memcpy(dst + s[t] * row_bytes, src + t * row_bytes, row_bytes);
}

torch::Tensor decode_stack(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin,
                           std::vector<torch::Tensor> weights, std::vector<int64_t> windows,
                           torch::Tensor final_norm, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor slots,
                           torch::Tensor block_tables, torch::Tensor seq_lens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                           double scale) {
  int64_t B = x.size(0), hidden = x.size(1), layers = static_cast<int64_t>(windows.size());
  int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto opt = [](const torch::Tensor& t) {
    return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
  };
  torch::Tensor residual = x.clone(), h;
  auto slot_ids = slots.to(torch::kInt64).contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = &weights[l * kLayerTensors];
    h = l == 0 ? ::rms_norm(residual, w[0], eps, c10::nullopt)
               : ::rms_norm(residual, w[0], eps, h);  // residual += h, then normalize
    auto qkv = ::linear(h, w[1], opt(w[2]), q_size + 2 * kv_size, false);
    auto q = qkv.narrow(1, 0, q_size).reshape({B, num_heads, head_dim}).contiguous();
    auto k = qkv.narrow(1, q_size, kv_size).reshape({B, num_kv_heads, head_dim}).contiguous();
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({B, num_kv_heads, head_dim});
    if (w[7].numel()) {
      q = ::rms_norm(q, w[7], eps, c10::nullopt);
      k = ::rms_norm(k, w[8], eps, c10::nullopt);
    }
    ::rope(q, cos_sin, positions);
    ::rope(k, cos_sin, positions);
    auto kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    store_slots(kc, k, slot_ids);
    store_slots(vc, v.contiguous(), slot_ids);
    auto attn = ::decode_attention(q, kc, vc, block_tables, seq_lens, windows[l], scale);
    h = ::linear(attn.view({B, q_size}), w[3], c10::nullopt, hidden, false);
    auto normed = ::rms_norm(residual, w[4], eps, h);
    auto gate_up = ::linear(normed, w[5], c10::nullopt, 2 * intermediate, false);
    h = ::linear(::silu_mul(gate_up), w[6], c10::nullopt, hidden, false);
  }
  return ::rms_norm(residual, final_norm, eps, h);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel releases the GIL (none touches Python objects): while a step runs, the
  // server's event loop keeps streaming the previous step's tokens.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("decode_stack", &decode_stack, "all decoder layers of a decode-only step", release());
  m.def("linear", &::linear, "x @ w.T (+ bias) on panel-packed float32/bfloat16 weights",
        release());
  m.def("rms_norm", &::rms_norm, "RMSNorm, optionally fused with the residual add", release());
  m.def("rope", &::rope, "rotary embedding in place (rotate-half layout)", release());
  m.def("silu_mul", &::silu_mul, "silu(gate) * up from a fused [gate | up] tensor", release());
  m.def("decode_attention", &::decode_attention, "paged attention for one query per sequence",
        release());
}
