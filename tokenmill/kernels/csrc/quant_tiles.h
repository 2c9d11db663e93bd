// tokenmill CPU kernels: the register tiles that multiply one group of 16 outputs of a
// block-quantized weight (quant_layout.h) by up to 8 int8 input rows: AVX-512 VNNI, AVX2, and
// the portable loop that defines them.
#pragma once

#include "quant_layout.h"

namespace tm {

constexpr int64_t kRowTile = 8, kRowChunk = 64;

// The block at `pf` (the next group's, or null) into L2: a thread's groups are consecutive in
// memory, so the tile's arithmetic overlaps the next group's read (without it a 16-row decode
// batch waited on memory and arithmetic in turn: 30 layers' GEMMs 7.6 -> 5.1 ms here). L2, not
// L1 (prefetcht0, as before), as the bf16 GEMM prefetches: on a Zen 4 the 30 layers' Q4 GEMVs
// streamed 1.15x faster (one row; 16 rows 1.09x) and a Q4_1 decode step 1.16x
template <int Q>
inline void prefetch_block(const uint8_t* pf) {
  if (pf)
    for (int64_t l = 0; l < group_bytes(Q); l += 64) prefetch_l2(pf + l);
}

// y[r][0..16) = the 16 outputs of group `w` for input rows r < R (rows ld K in xq)
template <int Q>
void tile_portable(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
                   const uint8_t* w, float (*y)[kGroup]) {
  const int64_t blocks = K / kBlock;
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < kGroup; ++o) y[r][o] = 0.f;
  constexpr int H = sums_per_block(Q), span = kBlock / H;  // scales per block, k under each
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * group_bytes(Q);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + b * kBlock;
      for (int o = 0; o < kGroup; ++o)
        for (int h = 0; h < H; ++h) {
          int32_t s = 0;
          for (int k = h * span; k < (h + 1) * span; ++k)
            s += code_at(blk + scale_bytes(Q), qbits(Q), o, k) * xb[k];
          float d, m;
          scales_at(Q, w, blocks, b, o, d, m, h);
          y[r][o] += d * dx[r * blocks + b] * static_cast<float>(s) + m * sx[(r * blocks + b) * H + h];
        }
    }
  }
}

#if defined(__AVX512VNNI__)
// Chunk j's 16 low-nibble (k = 4 j + t) and high-nibble (k = 16 + 4 j + t) codes of the 4- to
// 6-bit codes at `codes`, one byte each: 16 added where the fifth bit is set; 6 bits: bits
// 2 j, 2 j + 1 of the pair bytes moved to bits 4-5 (one shift and one VPTERNLOG each)
template <int BITS>
inline void unpack_chunk(const uint8_t* codes, int j, __m512i& lo, __m512i& hi) {
  const __m512i nib = _mm512_set1_epi8(0x0F), v = _mm512_loadu_si512(codes + 64 * j);
  lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  if constexpr (BITS == 5) {
    const __m512i add = _mm512_set1_epi8(16);
    __mmask64 planes[2];
    std::memcpy(planes, codes + 256 + 16 * j, 16);
    lo = _mm512_mask_add_epi8(lo, planes[0], lo, add);
    hi = _mm512_mask_add_epi8(hi, planes[1], hi, add);
  } else if constexpr (BITS == 6) {
    const __m512i top = _mm512_set1_epi8(0x30);
    auto at4 = [&](__m512i p) {  // bits 2 j, 2 j + 1 of each byte to bits 4-5 (others masked)
      return j == 3 ? _mm512_srli_epi16(p, 2) : j == 2 ? p : _mm512_slli_epi16(p, 4 - 2 * j);
    };
    // a | (b & c): 0xF0 | (0xCC & 0xAA)
    lo = _mm512_ternarylogic_epi32(lo, at4(_mm512_loadu_si512(codes + 256)), top, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, at4(_mm512_loadu_si512(codes + 320)), top, 0xF8);
  }
}

// (AVX2 widens 6-bit groups for many rows, quant_tiles_avx2.h; here, with two groups per
// broadcast, unpacking the codes in every tile measured faster than widening them once: 0.80-0.93
// against 0.75-0.81 of the 8-bit conversion's speed at 32-512 rows)
inline void widen_q6(const uint8_t*, int64_t, uint8_t*) {}
constexpr bool kWidenQ6 = false;

// y[g * R + r][0..16) for G consecutive groups (gstride bytes apart) and input rows r < R:
// each row's 4-byte broadcast of x serves the G groups' codes
template <int R, int G, int Q>
void tile_vnni(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               int64_t gstride, float (*y)[kGroup], const uint8_t* pf) {
  constexpr int BITS = qbits(Q);
  constexpr bool HALVES = qhalves(Q);  // the high nibbles' sums apart (s2), with their own d
  const int64_t blocks = K / kBlock;
  __m512 acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  __m512 sd[G], sm[G];  // TM_QSUPER: the current 8 blocks' D, M
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk[G];
    __m512 d[G], m[G];
    for (int g = 0; g < G; ++g) {
      blk[g] = w + g * gstride + b * group_bytes(Q);
      prefetch_block<Q>(pf ? pf + g * gstride + b * group_bytes(Q) : nullptr);
      if constexpr (HALVES) {  // after the sums (the registers hold twice the sums)
      } else if constexpr (qsuper(Q)) {  // 16 sc, 16 mn times the 8 blocks' D, M
        if (b % kSuper == 0) {
          const auto* s = reinterpret_cast<const __m256i*>(super_scales(Q, w + g * gstride, blocks, b));
          sd[g] = _mm512_cvtph_ps(_mm256_loadu_si256(s));
          sm[g] = _mm512_cvtph_ps(_mm256_loadu_si256(s + 1));
        }
        auto ints = [&](int at) {
          return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[g] + at))));
        };
        d[g] = _mm512_mul_ps(ints(0), sd[g]);
        m[g] = _mm512_fnmadd_ps(ints(16), sm[g], _mm512_setzero_ps());
      } else {
        d[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g])));
        m[g] = qsym(Q) ? _mm512_mul_ps(d[g], _mm512_set1_ps(sym_offset(Q)))
                       : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + 32)));
      }
    }
    __m512i s[G][R], s2[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) s[g][r] = s2[g][r] = _mm512_setzero_si512();
    const int8_t* xb = xq + b * kBlock;
    auto x4 = [&](int r, int k) {  // 4 int8 of row r at k, in every lane
      int32_t v;
      std::memcpy(&v, xb + r * K + k, 4);
      return _mm512_set1_epi32(v);
    };
    if constexpr (BITS != 8) {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[G], hi[G];
        for (int g = 0; g < G; ++g) unpack_chunk<BITS>(blk[g] + scale_bytes(Q), j, lo[g], hi[g]);
        for (int r = 0; r < R; ++r) {
          const __m512i xl = x4(r, 4 * j), xh = x4(r, 16 + 4 * j);
          for (int g = 0; g < G; ++g) {
            s[g][r] = _mm512_dpbusd_epi32(s[g][r], lo[g], xl);
            if constexpr (HALVES) s2[g][r] = _mm512_dpbusd_epi32(s2[g][r], hi[g], xh);
            else s[g][r] = _mm512_dpbusd_epi32(s[g][r], hi[g], xh);
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i v[G];
        for (int g = 0; g < G; ++g) v[g] = _mm512_loadu_si512(blk[g] + scale_bytes(Q) + 64 * j);
        for (int r = 0; r < R; ++r) {
          const __m512i x = x4(r, 4 * j);
          for (int g = 0; g < G; ++g) s[g][r] = _mm512_dpbusd_epi32(s[g][r], v[g], x);
        }
      }
    }
    __m512 d2[G];  // HALVES: d = sc D of each half
    for (int g = 0; HALVES && g < G; ++g) {
      auto ints = [&](int at) {
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[g] + at))));
      };
      const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(super_scales(Q, w + g * gstride, blocks, b))));
      d[g] = _mm512_mul_ps(ints(0), D), d2[g] = _mm512_mul_ps(ints(kGroup), D);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xd = _mm512_set1_ps(dx[r * blocks + b]);
      if constexpr (HALVES) {  // per half d (cvt(s) dx - 32 sx): m = -32 d
        const float* sh = sx + 2 * (r * blocks + b);
        const __m512 xs = _mm512_set1_ps(sym_offset(Q) * sh[0]);
        const __m512 xs2 = _mm512_set1_ps(sym_offset(Q) * sh[1]);
        for (int g = 0; g < G; ++g) {
          acc[g][r] = _mm512_fmadd_ps(d[g], _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[g][r]), xd, xs), acc[g][r]);
          acc[g][r] = _mm512_fmadd_ps(d2[g], _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2[g][r]), xd, xs2), acc[g][r]);
        }
      } else {
        const __m512 xs = _mm512_set1_ps(sx[r * blocks + b]);
        for (int g = 0; g < G; ++g) {
          __m512 scale = _mm512_mul_ps(d[g], xd);
          acc[g][r] = _mm512_fmadd_ps(m[g], xs, acc[g][r]);
          acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[g][r]), scale, acc[g][r]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[g * R + r], acc[g][r]);
}

// two groups at once, up to kPairRows input rows: y[g * R + r]
constexpr int kPairRows = 4;
template <int Q>
void tile_pair(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
               const uint8_t* w, int64_t gstride, float (*y)[kGroup], const uint8_t* pf) {
  switch (R) {
    case 1: return tile_vnni<1, 2, Q>(xq, dx, sx, K, w, gstride, y, pf);
    case 2: return tile_vnni<2, 2, Q>(xq, dx, sx, K, w, gstride, y, pf);
    case 3: return tile_vnni<3, 2, Q>(xq, dx, sx, K, w, gstride, y, pf);
    default: return tile_vnni<4, 2, Q>(xq, dx, sx, K, w, gstride, y, pf);
  }
}
constexpr bool kGroupPairs = true;

template <int Q>
void tile(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
          const uint8_t* w, float (*y)[kGroup], const uint8_t* pf = nullptr) {
  switch (R) {
    case 1: return tile_vnni<1, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
    case 2: return tile_vnni<2, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
    case 3: return tile_vnni<3, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
    case 4: return tile_vnni<4, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
    case 5: return tile_vnni<5, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
    case 6: return tile_vnni<6, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
    case 7: return tile_vnni<7, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
    default: return tile_vnni<8, 1, Q>(xq, dx, sx, K, w, 0, y, pf);
  }
}
constexpr bool kFastQuant = true;
#elif defined(__AVX2__)
#include "quant_tiles_avx2.h"
#else
template <int Q>
void tile(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
          const uint8_t* w, float (*y)[kGroup], const uint8_t* = nullptr) {
  tile_portable<Q>(R, xq, dx, sx, K, w, y);
}
constexpr bool kFastQuant = false;
inline void widen_q6(const uint8_t*, int64_t, uint8_t*) {}  // AVX2 only
constexpr bool kWidenQ6 = false;
#endif

#if !defined(__AVX512VNNI__)
// Two groups as two tiles (the pairing pays only where a broadcast feeds both: VNNI)
constexpr int kPairRows = kRowTile;
constexpr bool kGroupPairs = false;
template <int Q>
void tile_pair(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
               const uint8_t* w, int64_t gstride, float (*y)[kGroup], const uint8_t* pf) {
  tile<Q>(R, xq, dx, sx, K, w, y, pf);
  tile<Q>(R, xq, dx, sx, K, w + gstride, y + R, pf ? pf + gstride : nullptr);
}
#endif

}  // namespace tm
