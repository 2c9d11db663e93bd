// tokenmill CPU kernels: linear layers on block-quantized weights (GGUF Q4_0 / Q4_1 / Q8_0 and
// whatever else reduces to the same form), run on their quantized bits.
//
// The form: weight w[o][k] = d * c + m with an unsigned code c of 4, 5 or 8 bits and one float16
// (d, m) per output row and block of 32 k (Q4_0: m = -8 d; Q8_0: c = q + 128, m = -128 d).
// Repacked at load (tm_qpack) into groups of 16 output rows, so that one 64-byte vector holds
// 4 consecutive k of 16 outputs; per (group, block): 16 d, 16 m (float16), then the codes:
//   4 bits  4 chunks of 64 bytes; byte 4 o + t of chunk j: code k = 4 j + t (low nibble) and
//           k = 16 + 4 j + t (high nibble) of output o
//   5 bits  the 4-bit chunks, then 8 words of 64 bits: bit p of word 2 j (2 j + 1) is the
//           fifth bit of the low (high) nibble in byte p of chunk j
//   8 bits  8 chunks of 64 bytes; byte 4 o + t of chunk j: code k = 4 j + t
//
// The product uses integer dot products, as llama.cpp's CPU kernels do: each input row is
// quantized per block of 32 to int8 (scale dx = max |x| / 127, rounded to nearest), then per
// block and output sum_k c * q is exact in int32 (VPDPBUSD: unsigned codes x signed int8,
// 4 products per lane) and y += d dx sum(c q) + m dx sum(q). 16 outputs per vector, so no
// horizontal sums; the codes of a group are read once for up to 8 input rows.
#include "internal.h"
#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kBlock = 32, kGroup = 16, kRowTile = 8, kRowChunk = 64;

// bytes per (group, block): 64 of scales, then the codes
inline int64_t group_bytes(int bits) { return 64 + (bits == 4 ? 256 : bits == 5 ? 320 : 512); }

inline int code_at(const uint8_t* codes, int bits, int64_t o, int64_t k) {
  if (bits == 8) return codes[64 * (k / 4) + 4 * o + k % 4];
  int64_t kk = k % 16, p = 4 * o + kk % 4;  // byte p of chunk kk / 4
  uint8_t b = codes[64 * (kk / 4) + p];
  int c = k < 16 ? b & 0xF : b >> 4;
  if (bits == 5) {  // fifth bits: 64-bit word 2 j (low nibbles) / 2 j + 1 (high), bit p
    uint64_t word;
    std::memcpy(&word, codes + 256 + 8 * (2 * (kk / 4) + (k >= 16)), 8);
    c |= static_cast<int>((word >> p) & 1) << 4;
  }
  return c;
}

// 32 values -> int8 codes q = round(x / dx), dx = max |x| / 127 (round to nearest even; the
// activations llama.cpp's CPU kernels use too); returns sum(q). (Two int8 digits per value,
// tried for precision, made batches of 16 rows 2x slower: docs/performance.md.)
template <typename T>
inline int quantize_block(const T* x, int8_t* q, float* d) {
#if defined(__AVX512F__)
  vec lo = vload(x), hi = vload(x + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  *d = amax / 127.f;
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(to_f(x[j])));
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(to_f(x[j]) * inv));
    sum += q[j];
  }
  *d = amax / 127.f;
  return sum;
#endif
}

// x (m, K) -> int8 codes, per-block scales dx and dx * sum(codes)
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t K, int8_t* xq, float* dx, float* sx) {
  parallel_for(0, m * (K / kBlock), 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int sum = quantize_block(x + b * kBlock, xq + b * kBlock, dx + b);
      sx[b] = dx[b] * static_cast<float>(sum);
    }
  });
}

// y[r][0..16) = the 16 outputs of group `w` for input rows r < R (rows ld K in xq)
template <int BITS>
void tile_portable(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
                   const uint8_t* w, float (*y)[kGroup]) {
  const int64_t blocks = K / kBlock;
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < kGroup; ++o) y[r][o] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * group_bytes(BITS);
    const auto* h = reinterpret_cast<const uint16_t*>(blk);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + b * kBlock;
      for (int o = 0; o < kGroup; ++o) {
        int32_t s = 0;
        for (int k = 0; k < kBlock; ++k) s += code_at(blk + 64, BITS, o, k) * xb[k];
        y[r][o] += half_to_f(h[o]) * dx[r * blocks + b] * static_cast<float>(s) +
                   half_to_f(h[kGroup + o]) * sx[r * blocks + b];
      }
    }
  }
}

#if defined(__AVX512VNNI__)
template <int R, int BITS>
void tile_vnni(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               float (*y)[kGroup]) {
  const int64_t blocks = K / kBlock;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * group_bytes(BITS);
    const uint8_t* codes = blk + 64;
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    const int8_t* xb = xq + b * kBlock;
    auto x4 = [&](int r, int k) {  // 4 int8 of row r at k, in every lane
      int32_t v;
      std::memcpy(&v, xb + r * K + k, 4);
      return _mm512_set1_epi32(v);
    };
    if constexpr (BITS != 8) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int j = 0; j < 4; ++j) {
        __m512i v = _mm512_loadu_si512(codes + 64 * j);
        __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        if constexpr (BITS == 5) {  // add 16 where the fifth bit is set
          __mmask64 planes[2];
          std::memcpy(planes, codes + 256 + 16 * j, 16);
          lo = _mm512_mask_add_epi8(lo, planes[0], lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, planes[1], hi, sixteen);
        }
        for (int r = 0; r < R; ++r) {
          s[r] = _mm512_dpbusd_epi32(s[r], lo, x4(r, 4 * j));
          s[r] = _mm512_dpbusd_epi32(s[r], hi, x4(r, 16 + 4 * j));
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i v = _mm512_loadu_si512(codes + 64 * j);
        for (int r = 0; r < R; ++r) s[r] = _mm512_dpbusd_epi32(s[r], v, x4(r, 4 * j));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * blocks + b]), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[r], acc[r]);
}

template <int BITS>
void tile(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
          const uint8_t* w, float (*y)[kGroup]) {
  switch (R) {
    case 1: return tile_vnni<1, BITS>(xq, dx, sx, K, w, y);
    case 2: return tile_vnni<2, BITS>(xq, dx, sx, K, w, y);
    case 3: return tile_vnni<3, BITS>(xq, dx, sx, K, w, y);
    case 4: return tile_vnni<4, BITS>(xq, dx, sx, K, w, y);
    case 5: return tile_vnni<5, BITS>(xq, dx, sx, K, w, y);
    case 6: return tile_vnni<6, BITS>(xq, dx, sx, K, w, y);
    case 7: return tile_vnni<7, BITS>(xq, dx, sx, K, w, y);
    default: return tile_vnni<8, BITS>(xq, dx, sx, K, w, y);
  }
}
constexpr bool kFastQuant = true;
#elif defined(__AVX2__)
// AVX2 without VNNI: VPMADDUBSW (unsigned codes x signed int8, adjacent pairs summed to int16)
// then VPMADDWD by ones. 4-bit codes: a pair is at most 2 * 15 * 127, no saturation. 8-bit
// codes go signed, c - 128, with their sign moved onto x (|c - 128| <= 128: a pair stays below
// 2**15); the 128 * sum(q) share joins m: w = d (c - 128) + (m + 128 d). Half a group (8
// outputs) per pass, up to 4 rows (16 ymm registers).
// 32 bits -> 32 bytes: 16 where the bit is set, else 0
inline __m256i fifth_bits(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), select);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, select), _mm256_set1_epi8(16));
}

template <int R, int BITS>
void tile_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               int half, float (*y)[kGroup]) {
  const int64_t blocks = K / kBlock;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * group_bytes(BITS);
    const uint8_t* codes = blk + 64 + 32 * half;
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * half)));
    __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * half)));
    if constexpr (BITS == 8) m = _mm256_fmadd_ps(d, _mm256_set1_ps(128.f), m);
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    const int8_t* xb = xq + b * kBlock;
    auto x4 = [&](int r, int k) {
      int32_t v;
      std::memcpy(&v, xb + r * K + k, 4);
      return _mm256_set1_epi32(v);
    };
    auto dot = [&](int r, __m256i a, __m256i x) {
      s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), ones));
    };
    if constexpr (BITS != 8) {
      for (int j = 0; j < 4; ++j) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j));
        __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        if constexpr (BITS == 5) {
          const uint8_t* planes = codes - 32 * half + 256 + 16 * j + 4 * half;  // this half's bits
          lo = _mm256_or_si256(lo, fifth_bits(planes));
          hi = _mm256_or_si256(hi, fifth_bits(planes + 8));
        }
        for (int r = 0; r < R; ++r) {
          dot(r, lo, x4(r, 4 * j));
          dot(r, hi, x4(r, 16 + 4 * j));
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m256i v = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j)), flip);
        __m256i a = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) dot(r, a, _mm256_sign_epi8(x4(r, 4 * j), v));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * blocks + b]));
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * blocks + b]), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y[r] + 8 * half, acc[r]);
}

template <int BITS>
void tile(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
          const uint8_t* w, float (*y)[kGroup]) {
  const int64_t blocks = K / kBlock;
  for (int r0 = 0; r0 < R; r0 += 4) {
    const int8_t* x = xq + r0 * K;
    const float *d = dx + r0 * blocks, *s = sx + r0 * blocks;
    for (int half = 0; half < 2; ++half) {
      switch (std::min(4, R - r0)) {
        case 1: tile_avx2<1, BITS>(x, d, s, K, w, half, y + r0); break;
        case 2: tile_avx2<2, BITS>(x, d, s, K, w, half, y + r0); break;
        case 3: tile_avx2<3, BITS>(x, d, s, K, w, half, y + r0); break;
        default: tile_avx2<4, BITS>(x, d, s, K, w, half, y + r0);
      }
    }
  }
}
constexpr bool kFastQuant = true;
#else
template <int BITS>
void tile(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
          const uint8_t* w, float (*y)[kGroup]) {
  tile_portable<BITS>(R, xq, dx, sx, K, w, y);
}
constexpr bool kFastQuant = false;
#endif

template <int BITS, typename O>
void qgemm(const int8_t* xq, const float* dx, const float* sx, int64_t m, const tm_linear* w,
           O* out) {
  const int64_t N = w->n, K = w->k, groups = (N + kGroup - 1) / kGroup;
  const int64_t gstride = K / kBlock * group_bytes(BITS);
  const auto* wq = static_cast<const uint8_t*>(w->packed);
  parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    float y[kRowTile][kGroup];
    for (int64_t i0 = 0; i0 < m; i0 += kRowChunk) {  // input rows stay in cache across groups
      const int64_t i1 = std::min(m, i0 + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n = std::min(kGroup, N - g * kGroup);
        for (int64_t i = i0; i < i1; i += kRowTile) {
          const int R = static_cast<int>(std::min(kRowTile, i1 - i));
          const int64_t bi = i * (K / kBlock);
          tile<BITS>(R, xq + i * K, dx + bi, sx + bi, K, wq + g * gstride, y);
          for (int r = 0; r < R; ++r) {
            O* dst = out + (i + r) * N + g * kGroup;
            for (int64_t o = 0; o < n; o += kLanes) {
              vec v = vload(y[r] + o);
              if (w->bias) v = vadd(v, vload_part(w->bias + g * kGroup + o, std::min<int64_t>(kLanes, n - o)));
              if (n - o >= kLanes) vstore(dst + o, v);
              else vstore_part(dst + o, v, n - o);
            }
          }
        }
      }
    }
  });
}

void quant_linear(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
                  void* out) {
  const int64_t K = w->k, blocks = m * (K / kBlock);
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx, sx;
  xq.resize(m * K), dx.resize(blocks), sx.resize(blocks);
  if (dtype == TM_F32)
    quantize_rows(static_cast<const float*>(x), m, K, xq.data(), dx.data(), sx.data());
  else
    quantize_rows(static_cast<const bf16*>(x), m, K, xq.data(), dx.data(), sx.data());
  auto run = [&](auto* o) {
    if (w->quant == TM_QI4) qgemm<4>(xq.data(), dx.data(), sx.data(), m, w, o);
    else if (w->quant == TM_QI5) qgemm<5>(xq.data(), dx.data(), sx.data(), m, w, o);
    else qgemm<8>(xq.data(), dx.data(), sx.data(), m, w, o);
  };
  if (out_dtype == TM_F32) run(static_cast<float*>(out));
  else run(static_cast<bf16*>(out));
}

}  // namespace tm

extern "C" {

int tm_quant_fast(void) { return tm::kFastQuant; }

int64_t tm_qpacked_bytes(int bits, int64_t n, int64_t k) {
  return (n + tm::kGroup - 1) / tm::kGroup * (k / tm::kBlock) * tm::group_bytes(bits);
}

void tm_qpack(int bits, const uint8_t* codes, const uint16_t* d, const uint16_t* m, int64_t n,
              int64_t k, uint8_t* out) {
  using namespace tm;
  const int64_t blocks = k / kBlock, groups = (n + kGroup - 1) / kGroup;
  parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = out + (g * blocks + b) * group_bytes(bits);
        std::memset(blk, 0, group_bytes(bits));
        auto* h = reinterpret_cast<uint16_t*>(blk);
        for (int64_t o = 0; o < kGroup && g * kGroup + o < n; ++o) {
          const int64_t row = g * kGroup + o;
          h[o] = d[row * blocks + b];
          h[kGroup + o] = m[row * blocks + b];
          const uint8_t* c = codes + row * k + b * kBlock;
          for (int64_t kk = 0; kk < kBlock; ++kk) {
            if (bits == 8) {
              blk[64 + 64 * (kk / 4) + 4 * o + kk % 4] = c[kk];
              continue;
            }
            int64_t j = kk % 16, p = 4 * o + j % 4;
            blk[64 + 64 * (j / 4) + p] |= (c[kk] & 0xF) << (kk < 16 ? 0 : 4);
            if (bits == 5 && (c[kk] & 0x10)) {
              uint8_t* word = blk + 64 + 256 + 8 * (2 * (j / 4) + (kk >= 16));
              word[p / 8] |= static_cast<uint8_t>(1u << (p % 8));
            }
          }
        }
      }
  });
}

void tm_qdequantize(int bits, const uint8_t* packed, int64_t n, int64_t k, const int64_t* rows,
                    int64_t count, float* out) {
  using namespace tm;
  const int64_t blocks = k / kBlock;
  parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = rows ? rows[i] : i, g = row / kGroup, o = row % kGroup;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = packed + (g * blocks + b) * group_bytes(bits);
        const auto* h = reinterpret_cast<const uint16_t*>(blk);
        float d = half_to_f(h[o]), mn = half_to_f(h[kGroup + o]);
        for (int64_t kk = 0; kk < kBlock; ++kk)
          out[i * k + b * kBlock + kk] = d * static_cast<float>(code_at(blk + 64, bits, o, kk)) + mn;
      }
    }
  });
  (void)n;
}

}  // extern "C"
