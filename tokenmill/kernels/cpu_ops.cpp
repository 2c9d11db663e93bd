// tokenmill CPU kernels (AVX2 + FMA): the decode hot path without per-op Python overhead.
//
// Each function has a plain PyTorch reference in tokenmill/layers/ops.py and a test that the
// two agree. Arithmetic mirrors the reference: accumulate in float32, round to the tensor's
// dtype (float32 or bfloat16) at the same points where the reference rounds.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

using at::BFloat16;

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift left by 16.
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float to_f(float v) { return v; }
inline float to_f(BFloat16 v) { return static_cast<float>(v); }

// Round a float32 to the storage type T and back (the rounding a bf16 tensor op performs).
template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
float dot(const float* x, const T* w, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    a0 = _mm256_fmadd_ps(load8(x + i), load8(w + i), a0);
    a1 = _mm256_fmadd_ps(load8(x + i + 8), load8(w + i + 8), a1);
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; i < k; ++i) s += x[i] * to_f(w[i]);
  return s;
}

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). Weight rows are streamed from memory once
// per call and reused for all m rows while they sit in L1: bandwidth-bound small-batch GEMM.
template <typename W, typename O>
void linear_small(const float* x, const W* w, const float* bias, O* out, int64_t M, int64_t N,
                  int64_t K) {
  constexpr int64_t kRows = 4;
  at::parallel_for(0, (N + kRows - 1) / kRows, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      int64_t n0 = blk * kRows, n1 = std::min(N, n0 + kRows);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        for (int64_t n = n0; n < n1; ++n) {
          float s = dot(xm, w + n * K, K) + (bias ? bias[n] : 0.f);
          out[m * N + n] = static_cast<O>(s);
        }
      }
    }
  });
}

}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  // x: (M, K) float32 or bfloat16; w: (N, K) float32 or bfloat16 -> (M, N) in x's dtype.
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: bad shapes");
  auto xf = x.to(torch::kFloat32).contiguous();
  auto wc = w.contiguous();
  torch::Tensor bf;
  if (bias.has_value()) bf = bias->to(torch::kFloat32).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  bool wbf = w.scalar_type() == torch::kBFloat16;
  if (out.scalar_type() == torch::kBFloat16) {
    auto* o = reinterpret_cast<BFloat16*>(out.data_ptr());
    if (wbf) linear_small(xf.data_ptr<float>(), reinterpret_cast<BFloat16*>(wc.data_ptr()), bp, o, M, N, K);
    else linear_small(xf.data_ptr<float>(), wc.data_ptr<float>(), bp, o, M, N, K);
  } else {
    auto* o = out.data_ptr<float>();
    if (wbf) linear_small(xf.data_ptr<float>(), reinterpret_cast<BFloat16*>(wc.data_ptr()), bp, o, M, N, K);
    else linear_small(xf.data_ptr<float>(), wc.data_ptr<float>(), bp, o, M, N, K);
  }
  return out;
}

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, T* residual, const T* add, int64_t rows,
                   int64_t H, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(H);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      double ss = 0;
      for (int64_t i = 0; i < H; ++i) {
        // residual stream update: residual = residual + add, rounded to T (as the reference)
        float v = add ? rnd<T>(to_f(add[r * H + i]) + to_f(xr[i])) : to_f(xr[i]);
        if (add) residual[r * H + i] = static_cast<T>(v);
        buf[i] = v;
        ss += static_cast<double>(v) * v;
      }
      float inv = 1.0f / std::sqrt(static_cast<float>(ss / H) + eps);
      for (int64_t i = 0; i < H; ++i) {
        out[r * H + i] = static_cast<T>(to_f(w[i]) * rnd<T>(buf[i] * inv));
      }
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
        for (int64_t i = 0; i < half; ++i) {
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
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      for (int64_t i = 0; i < I; ++i) {
        float gv = to_f(g[i]);
        float act = rnd<T>(gv / (1.0f + std::exp(-gv)));
        out[r * I + i] = static_cast<T>(act * to_f(u[i]));
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

template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* tables,
                           const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hk,
                           int64_t D, int64_t BS, int64_t max_blocks, int64_t window,
                           float scale) {
  int64_t group = Hq / Hk;
  at::parallel_for(0, B * Hk, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> qf(group * D), acc(group * D), scores;
    for (int64_t j = j0; j < j1; ++j) {
      int64_t b = j / Hk, h = j % Hk, L = lens[b];
      int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      int64_t n = L - start;
      scores.assign(group * n, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(q[(b * Hq + h * group + g) * D + d]);
      const int64_t* table = tables + b * max_blocks;
      for (int64_t p = start; p < L; ++p) {
        const T* kp = kc + ((table[p / BS] * BS + p % BS) * Hk + h) * D;
        for (int64_t g = 0; g < group; ++g) scores[g * n + p - start] = dot(&qf[g * D], kp, D) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * n];
        float mx = -INFINITY, sum = 0.f;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
        for (int64_t i = 0; i < n; ++i) { s[i] = std::exp(s[i] - mx); sum += s[i]; }
        for (int64_t i = 0; i < n; ++i) s[i] /= sum;
      }
      for (int64_t p = start; p < L; ++p) {
        const T* vp = vc + ((table[p / BS] * BS + p % BS) * Hk + h) * D;
        for (int64_t g = 0; g < group; ++g) {
          float w = scores[g * n + p - start];
          float* a = &acc[g * D];
          int64_t d = 0;
          __m256 wv = _mm256_set1_ps(w);
          for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(wv, load8(vp + d), _mm256_loadu_ps(a + d)));
          for (; d < D; ++d) a[d] += w * to_f(vp[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + h * group + g) * D + d] = static_cast<T>(acc[g * D + d]);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ w.T (+ bias), float32/bfloat16 weights, small batches");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add");
  m.def("rope", &rope, "rotary embedding in place (rotate-half layout)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from a fused [gate | up] tensor");
  m.def("decode_attention", &decode_attention, "paged attention for one query per sequence");
}
