// tokenmill CPU kernels: RMSNorm (optionally fused with the residual add), rotary embedding,
// SiLU-and-multiply and row argmax, on the vector layer (vec.h); scalar loops take the tails.
#include "tm.h"
#include "vec.h"

namespace tm {

template <typename T>
void rms_norm_rows(T* x, const T* w, const T* add, T* out, int64_t rows, int64_t H, float eps) {
  parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(H);
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * H;
      const T* ar = add ? add + r * H : nullptr;
      vec ss8 = vzero();
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) {
        // residual stream update: x = x + add, rounded to T (as the reference)
        vec v = vload(xr + i);
        if (ar) {
          v = vrnd<T>(vadd(vload(ar + i), v));
          vstore(xr + i, v);
        }
        vstore(buf.data() + i, v);
        ss8 = vfma(v, v, ss8);
      }
      float ss = vsum(ss8);
      for (; i < H; ++i) {
        float v = ar ? rnd<T>(to_f(ar[i]) + to_f(xr[i])) : to_f(xr[i]);
        if (ar) xr[i] = from_f<T>(v);
        buf[i] = v;
        ss += v * v;
      }
      float inv = 1.0f / std::sqrt(ss / H + eps);
      vec inv8 = vset1(inv);
      for (i = 0; i + kLanes <= H; i += kLanes) {
        vec n = vrnd<T>(vmul(vload(buf.data() + i), inv8));
        vstore(out + r * H + i, vmul(vload(w + i), n));
      }
      for (; i < H; ++i) out[r * H + i] = from_f<T>(to_f(w[i]) * rnd<T>(buf[i] * inv));
    }
  });
}

// cos and sin of one position for each of the D dims, rounded to T as the reference's
// table.to(dtype); the table holds each frequency's once (D / 2 columns) for both halves
template <typename T>
inline void rope_table(const float* cos_sin, int64_t table_len, int64_t pos, int64_t D, float* c,
                       float* s) {
  const int64_t half = D / 2;
  const float* cr = cos_sin + pos * half;
  const float* sr = cos_sin + (table_len + pos) * half;
  for (int64_t i = 0; i < half; ++i) {
    c[i] = c[i + half] = rnd<T>(cr[i]);
    s[i] = s[i + half] = rnd<T>(sr[i]);
  }
}

// One head: dst = src * cos + rotate_half(src) * sin, rounded like the reference at each step
// (dst may be src)
template <typename T>
inline void rotate_head(const T* src, T* dst, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    vec a = vload(src + i), b = vload(src + i + half);
    vec lo = vrnd<T>(vsub(vrnd<T>(vmul(a, vload(c + i))), vrnd<T>(vmul(b, vload(s + i)))));
    vec hi = vrnd<T>(vadd(vrnd<T>(vmul(b, vload(c + i + half))),
                          vrnd<T>(vmul(a, vload(s + i + half)))));
    vstore(dst + i, lo);
    vstore(dst + i + half, hi);
  }
  for (; i < half; ++i) {
    float a = to_f(src[i]), b = to_f(src[i + half]);
    float lo = rnd<T>(rnd<T>(a * c[i]) + rnd<T>(-b * s[i]));
    float hi = rnd<T>(rnd<T>(b * c[i + half]) + rnd<T>(a * s[i + half]));
    dst[i] = from_f<T>(lo);
    dst[i + half] = from_f<T>(hi);
  }
}

template <typename T>
void rope_rows(T* x, const float* cos_sin, const int64_t* pos, int64_t tokens, int64_t heads,
               int64_t D, int64_t table_len) {
  parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(D), s(D);
    for (int64_t t = t0; t < t1; ++t) {
      rope_table<T>(cos_sin, table_len, pos[t], D, c.data(), s.data());
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + (t * heads + h) * D;
        rotate_head(v, v, c.data(), s.data(), D);
      }
    }
  });
}

// A QKV projection's rows (ld apart: heads q, then kv_heads k, then kv_heads v of D each) ->
// rotated q and k (contiguous), and k and v into their cache slots: the two copies, two
// rotations and two cache writes of a prefill layer in one pass
template <typename T>
void rope_store_rows(const T* qkv, int64_t ld, int64_t tokens, int64_t heads, int64_t kv_heads,
                     int64_t D, const float* cos_sin, int64_t table_len, const int64_t* pos,
                     T* q, T* k, T* k_cache, T* v_cache, const int64_t* slots) {
  const int64_t kv = kv_heads * D;
  parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(D), s(D);
    for (int64_t t = t0; t < t1; ++t) {
      rope_table<T>(cos_sin, table_len, pos[t], D, c.data(), s.data());
      const T* row = qkv + t * ld;
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(row + h * D, q + (t * heads + h) * D, c.data(), s.data(), D);
      T* kt = k + t * kv;
      for (int64_t h = 0; h < kv_heads; ++h)
        rotate_head(row + (heads + h) * D, kt + h * D, c.data(), s.data(), D);
      std::memcpy(k_cache + slots[t] * kv, kt, kv * sizeof(T));
      std::memcpy(v_cache + slots[t] * kv, row + heads * D + kv, kv * sizeof(T));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  // ~8K outputs per task: a 16-row decode batch of a 1,536-wide MLP runs on two threads
  parallel_for(0, rows, std::max<int64_t>(1, 8192 / I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) vstore(o + i, vsilu_mul<T>(vload(g + i), vload(u + i)));
      for (; i < I; ++i) {
        float gv = to_f(g[i]);
        float act = rnd<T>(gv / (1.0f + std::exp(-gv)));
        o[i] = from_f<T>(act * to_f(u[i]));
      }
    }
  });
}

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with
// tanh(u) = 1 - 2 / (exp(2u) + 1) (exp overflowing to inf gives 1, as it should)
template <typename T>
void gelu_tanh_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  parallel_for(0, rows, std::max<int64_t>(1, 8192 / I), [&](int64_t r0, int64_t r1) {
    const vec one = vset1(1.0f), two = vset1(2.0f), half = vset1(0.5f);
    const vec c = vset1(0.7978845608028654f), c3 = vset1(0.044715f);
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {  // gelu(g) rounded to T, times up, rounded
        vec gv = vload(g + i);
        vec inner = vmul(c, vfma(vmul(c3, gv), vmul(gv, gv), gv));
        vec th = vsub(one, vdiv(two, vadd(vexp(vmul(two, inner)), one)));
        vec act = vrnd<T>(vmul(vmul(half, gv), vadd(one, th)));
        vstore(o + i, vmul(act, vload(u + i)));
      }
      for (; i < I; ++i) {
        float gv = to_f(g[i]);
        float act = rnd<T>(0.5f * gv * (1.0f + std::tanh(0.7978845608028654f *
                                                          (gv + 0.044715f * gv * gv * gv))));
        o[i] = from_f<T>(act * to_f(u[i]));
      }
    }
  });
}

float row_max(const float* p, int64_t n, bool& has_nan) {
  vec mx = vset1(-INFINITY), nan = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vec v = vload(p + i);
    nan = vor(nan, vnan_mask(v));
    mx = vmax(mx, v);
  }
  float m = vhmax(mx);
  has_nan = vany(nan);
  for (int64_t j = i; j < n; ++j) { has_nan |= std::isnan(p[j]); m = std::max(m, p[j]); }
  return m;
}

// The index of a row's largest value, the first on ties, a NaN counting as the largest
// (torch.argmax's rules): one vectorized pass for the maximum, one for its first index.
int64_t argmax_row(const float* p, int64_t n) {
  bool has_nan;
  const float m = row_max(p, n, has_nan);
  int64_t at = 0;
  if (has_nan) {
    while (!std::isnan(p[at])) ++at;
    return at;
  }
  vec target = vset1(m);
  for (int64_t j = 0; j + kLanes <= n; j += kLanes) {
    int hit = vmask_eq(vload(p + j), target);
    if (hit) return j + __builtin_ctz(hit);
  }
  for (at = n / kLanes * kLanes; p[at] != m; ++at) {}  // not in the vector part: the tail
  return at;
}

}  // namespace tm

using namespace tm;

extern "C" {

void tm_rms_norm(int dtype, void* x, const void* w, const void* add, void* out, int64_t rows,
                 int64_t hidden, float eps) {
  if (dtype == TM_BF16)
    return rms_norm_rows(static_cast<bf16*>(x), static_cast<const bf16*>(w),
                         static_cast<const bf16*>(add), static_cast<bf16*>(out), rows, hidden, eps);
  rms_norm_rows(static_cast<float*>(x), static_cast<const float*>(w),
                static_cast<const float*>(add), static_cast<float*>(out), rows, hidden, eps);
}

void tm_rope(int dtype, void* x, int64_t tokens, int64_t heads, int64_t head_dim,
             const float* cos_sin, int64_t max_positions, const int64_t* positions) {
  if (dtype == TM_BF16)
    return rope_rows(static_cast<bf16*>(x), cos_sin, positions, tokens, heads, head_dim,
                     max_positions);
  rope_rows(static_cast<float*>(x), cos_sin, positions, tokens, heads, head_dim, max_positions);
}

void tm_rope_store(int dtype, const void* qkv, int64_t ld, int64_t tokens, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, const float* cos_sin, int64_t max_positions,
                   const int64_t* positions, void* q, void* k, void* k_cache, void* v_cache,
                   const int64_t* slots) {
  if (dtype == TM_BF16)
    return rope_store_rows(static_cast<const bf16*>(qkv), ld, tokens, heads, kv_heads, head_dim,
                           cos_sin, max_positions, positions, static_cast<bf16*>(q),
                           static_cast<bf16*>(k), static_cast<bf16*>(k_cache),
                           static_cast<bf16*>(v_cache), slots);
  rope_store_rows(static_cast<const float*>(qkv), ld, tokens, heads, kv_heads, head_dim, cos_sin,
                  max_positions, positions, static_cast<float*>(q), static_cast<float*>(k),
                  static_cast<float*>(k_cache), static_cast<float*>(v_cache), slots);
}

void tm_silu_mul(int dtype, const void* x, void* out, int64_t rows, int64_t inter) {
  if (dtype == TM_BF16)
    return silu_mul_rows(static_cast<const bf16*>(x), static_cast<bf16*>(out), rows, inter);
  silu_mul_rows(static_cast<const float*>(x), static_cast<float*>(out), rows, inter);
}

void tm_gelu_tanh_mul(int dtype, const void* x, void* out, int64_t rows, int64_t inter) {
  if (dtype == TM_BF16)
    return gelu_tanh_mul_rows(static_cast<const bf16*>(x), static_cast<bf16*>(out), rows, inter);
  gelu_tanh_mul_rows(static_cast<const float*>(x), static_cast<float*>(out), rows, inter);
}

void tm_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out) {
  parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x + r * n, n);
  });
}

}  // extern "C"
