// tokenmill CPU kernels: RMSNorm, rotary embedding, SiLU-and-multiply (see cpu_ops.h).

#include "cpu_ops.h"

using namespace tokenmill;

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
  // ~8K outputs per task: a 16-row decode batch of a 1,536-wide MLP runs on both threads
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / I), [&](int64_t r0, int64_t r1) {
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

// x: (rows, n) float32 -> (rows,) int64: the index of each row's largest value, the first one
// on ties, a NaN counting as the largest (torch.argmax's rules); torch.argmax took ~1 ms for 16
// rows of 49K logits, one vectorized pass for the maximum and one for its first index ~0.1 ms.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "argmax_rows: contiguous (rows, n) float32");
  int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: empty rows");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* base = x.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = base + r * n;
      __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(p + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      float m = *std::max_element(lanes, lanes + 8);
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (int64_t j = i; j < n; ++j) { has_nan |= std::isnan(p[j]); m = std::max(m, p[j]); }
      int64_t at = -1;
      if (has_nan) {
        for (at = 0; !std::isnan(p[at]); ++at) {}
      } else {
        __m256 target = _mm256_set1_ps(m);
        for (int64_t j = 0; j + 8 <= n && at < 0; j += 8) {
          int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), target, _CMP_EQ_OQ));
          if (hit) at = j + __builtin_ctz(hit);
        }
        if (at < 0)  // not in the vector part: in the tail
          for (at = n / 8 * 8; p[at] != m; ++at) {}
      }
      idx[r] = at;
    }
  });
  return out;
}
