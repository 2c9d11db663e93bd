// tokenmill CPU kernels (AVX2 + FMA): shared helpers and the kernels' declarations.
//
// Each kernel has a plain PyTorch reference in tokenmill/layers/ops.py and a test that the
// two agree. Arithmetic mirrors the reference: accumulate in float32, round to the tensor's
// dtype (float32 or bfloat16) at the same points where the reference rounds.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace tokenmill {

using at::BFloat16;

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

}  // namespace tokenmill

// gemm.cpp
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                     int64_t N, bool out_fp32);
// elementwise.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps,
                       c10::optional<torch::Tensor> add);
void rope(torch::Tensor x, torch::Tensor cos_sin, torch::Tensor positions);
torch::Tensor silu_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor x);
// attention.cpp
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens,
                               int64_t window, double scale);
