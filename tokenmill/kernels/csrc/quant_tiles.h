// tokenmill CPU kernels: the repacked layout of block-quantized weights (see quant.cpp) and
// the register tiles that multiply one group of 16 outputs by up to 8 int8 input rows: AVX-512
// VNNI, AVX2, and the portable loop that defines them.
#pragma once

#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kBlock = 32, kGroup = 16, kRowTile = 8, kRowChunk = 64;

// A weight's quant code (tm.h): its code bits; whether m is implied (TM_QSYM: m = -2^(bits - 1) d)
// or d, m come from integers and per-256 scales (TM_QSUPER); the bytes of scales per (group,
// block): 16 float16 d then 16 m, the d alone, or 16 sc then 16 mn (uint8); with the codes after
// them. A TM_QSUPER group holds its blocks, then per 8 blocks 16 D and 16 M (float16, 64 bytes).
constexpr int qbits(int q) { return q & 15; }
constexpr bool qsym(int q) { return (q & TM_QSYM) != 0; }
constexpr bool qsuper(int q) { return (q & TM_QSUPER) != 0; }
constexpr int64_t scale_bytes(int q) { return qsym(q) || qsuper(q) ? 32 : 64; }
constexpr int64_t group_bytes(int q) {
  return scale_bytes(q) + (qbits(q) == 4 ? 256 : qbits(q) == 5 ? 320 : 512);
}
constexpr int64_t kSuper = 8;  // blocks per TM_QSUPER scale pair (256 k)
constexpr int64_t group_stride(int q, int64_t K) {
  return K / kBlock * group_bytes(q) + (qsuper(q) ? K / (kSuper * kBlock) * 64 : 0);
}
// a TM_QSUPER group's D (16 float16) for block b, M after them
inline const uint16_t* super_scales(int q, const uint8_t* grp, int64_t blocks, int64_t b) {
  return reinterpret_cast<const uint16_t*>(grp + blocks * group_bytes(q) + b / kSuper * 64);
}
constexpr float sym_offset(int q) { return -static_cast<float>(1 << (qbits(q) - 1)); }

// d and m of output o in block b of the group at grp (K / 32 blocks), in float32
inline void scales_at(int q, const uint8_t* grp, int64_t blocks, int64_t b, int o, float& d,
                      float& m) {
  const uint8_t* blk = grp + b * group_bytes(q);
  const auto* h = reinterpret_cast<const uint16_t*>(blk);
  if (qsuper(q)) {
    const uint16_t* s = super_scales(q, grp, blocks, b);
    d = static_cast<float>(blk[o]) * half_to_f(s[o]);
    m = -(static_cast<float>(blk[kGroup + o]) * half_to_f(s[kGroup + o]));
  } else {
    d = half_to_f(h[o]);
    m = qsym(q) ? d * sym_offset(q) : half_to_f(h[kGroup + o]);
  }
}

#if defined(__AVX2__)  // vload_f16 is x86's
// scales_at for outputs lane0 .. lane0 + kLanes as vectors (the AMX paths; the register tiles
// below keep a TM_QSUPER group's D, M across its 8 blocks instead)
template <int Q>
inline void vscales(const uint8_t* grp, int64_t blocks, int64_t b, int lane0, vec& d, vec& m) {
  const uint8_t* blk = grp + b * group_bytes(Q);
  if constexpr (qsuper(Q)) {
    const uint16_t* s = super_scales(Q, grp, blocks, b) + lane0;
    const auto* ints = reinterpret_cast<const int8_t*>(blk) + lane0;  // sc, mn < 64
    d = vmul(vload_i8(ints), vload_f16(s));
    m = vsub(vzero(), vmul(vload_i8(ints + kGroup), vload_f16(s + kGroup)));
  } else {
    const auto* h = reinterpret_cast<const uint16_t*>(blk) + lane0;
    d = vload_f16(h);
    m = qsym(Q) ? vmul(d, vset1(sym_offset(Q))) : vload_f16(h + kGroup);
  }
}
#endif

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
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * group_bytes(Q);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * K + b * kBlock;
      for (int o = 0; o < kGroup; ++o) {
        int32_t s = 0;
        for (int k = 0; k < kBlock; ++k) s += code_at(blk + scale_bytes(Q), qbits(Q), o, k) * xb[k];
        float d, m;
        scales_at(Q, w, blocks, b, o, d, m);
        y[r][o] += d * dx[r * blocks + b] * static_cast<float>(s) + m * sx[r * blocks + b];
      }
    }
  }
}

#if defined(__AVX512VNNI__)
// y[g * R + r][0..16) for G consecutive groups (gstride bytes apart) and input rows r < R:
// each row's 4-byte broadcast of x serves the G groups' codes
template <int R, int G, int Q>
void tile_vnni(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               int64_t gstride, float (*y)[kGroup], const uint8_t* pf) {
  constexpr int BITS = qbits(Q);
  const int64_t blocks = K / kBlock;
  const __m512i nib = _mm512_set1_epi8(0x0F);
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
      if constexpr (qsuper(Q)) {  // 16 sc, 16 mn times the 8 blocks' D, M
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
    __m512i s[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) s[g][r] = _mm512_setzero_si512();
    const int8_t* xb = xq + b * kBlock;
    auto x4 = [&](int r, int k) {  // 4 int8 of row r at k, in every lane
      int32_t v;
      std::memcpy(&v, xb + r * K + k, 4);
      return _mm512_set1_epi32(v);
    };
    if constexpr (BITS != 8) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int j = 0; j < 4; ++j) {
        __m512i lo[G], hi[G];
        for (int g = 0; g < G; ++g) {
          const uint8_t* codes = blk[g] + scale_bytes(Q);
          __m512i v = _mm512_loadu_si512(codes + 64 * j);
          lo[g] = _mm512_and_si512(v, nib), hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          if constexpr (BITS == 5) {  // add 16 where the fifth bit is set
            __mmask64 planes[2];
            std::memcpy(planes, codes + 256 + 16 * j, 16);
            lo[g] = _mm512_mask_add_epi8(lo[g], planes[0], lo[g], sixteen);
            hi[g] = _mm512_mask_add_epi8(hi[g], planes[1], hi[g], sixteen);
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xl = x4(r, 4 * j), xh = x4(r, 16 + 4 * j);
          for (int g = 0; g < G; ++g) {
            s[g][r] = _mm512_dpbusd_epi32(s[g][r], lo[g], xl);
            s[g][r] = _mm512_dpbusd_epi32(s[g][r], hi[g], xh);
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
    for (int r = 0; r < R; ++r) {
      const __m512 xd = _mm512_set1_ps(dx[r * blocks + b]), xs = _mm512_set1_ps(sx[r * blocks + b]);
      for (int g = 0; g < G; ++g) {
        __m512 scale = _mm512_mul_ps(d[g], xd);
        acc[g][r] = _mm512_fmadd_ps(m[g], xs, acc[g][r]);
        acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[g][r]), scale, acc[g][r]);
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
