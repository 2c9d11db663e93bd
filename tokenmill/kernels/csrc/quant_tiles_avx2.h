// tokenmill CPU kernels: the AVX2 register tiles of quant_tiles.h (included there, inside
// namespace tm, when the library is built for AVX2 without AVX-512 VNNI).
#pragma once

// AVX2 without VNNI: VPMADDUBSW (unsigned codes x signed int8, adjacent pairs summed to int16)
// then VPMADDWD by ones. 4-bit codes: a pair is at most 2 * 15 * 127, no saturation. 8-bit
// codes go signed, c - 128, with their sign moved onto x (|c - 128| <= 128: a pair stays below
// 2**15); the 128 * sum(q) share joins m: w = d (c - 128) + (m + 128 d). 1-2 rows take the
// whole group (16 outputs) in one pass; 3-4 rows half a group (8 outputs) per pass (16 ymm
// registers).
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

// An empty asm the value passes through: the sums stay in the order written. Without it GCC
// reassociated a block's 32 pair sums into a tree, spilling them and the accumulators to the
// stack (half the speed at 4 rows)
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// H halves of the group (from `half` on) in one pass: with 1-2 rows the registers hold both,
// and the rows' x broadcasts serve both halves
template <int R, int H, int Q>
void tile_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* w,
               int half, float (*y)[kGroup], const uint8_t* pf) {
  constexpr int BITS = qbits(Q);
  constexpr bool HALVES = qhalves(Q);  // the high nibbles' sums apart (s2), with their own d
  const int64_t blocks = K / kBlock;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  __m256 sd[H], sm[H];  // TM_QSUPER: the current 8 blocks' D, M
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * group_bytes(Q);
    prefetch_block<Q>(pf ? pf + b * group_bytes(Q) : nullptr);
    const uint8_t* codes[H];
    __m256 d[H], m[H], d2[H];
    for (int h = 0; h < H; ++h) {
      const int64_t hh = half + h;
      codes[h] = blk + scale_bytes(Q) + 32 * hh;
      if constexpr (qsuper(Q)) {  // 8 sc, 8 mn of this half (6 bits: 8 sc per k half) times D, M
        if (b % kSuper == 0) {
          const uint16_t* sup = super_scales(Q, w, blocks, b) + 8 * hh;
          auto halves = [&](const uint16_t* p) {
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          };
          sd[h] = halves(sup);
          if constexpr (!HALVES) sm[h] = halves(sup + kGroup);
        }
        auto ints = [&](int at) {
          const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + at + 8 * hh));
          return _mm256_cvtepi32_ps(HALVES ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
        };
        d[h] = _mm256_mul_ps(ints(0), sd[h]);
        if constexpr (HALVES) d2[h] = _mm256_mul_ps(ints(16), sd[h]);
        else m[h] = _mm256_fnmadd_ps(ints(16), sm[h], _mm256_setzero_ps());
      } else {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * hh)));
        m[h] = qsym(Q) ? _mm256_mul_ps(d[h], _mm256_set1_ps(sym_offset(Q)))
                       : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * hh)));
      }
      if constexpr (BITS == 8 && !HALVES) m[h] = _mm256_fmadd_ps(d[h], _mm256_set1_ps(128.f), m[h]);
    }
    __m256i s[H][R], s2[H][R];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) s[h][r] = s2[h][r] = _mm256_setzero_si256();
    const int8_t* xb = xq + b * kBlock;
    auto x4 = [&](int r, int k) {
      int32_t v;
      std::memcpy(&v, xb + r * K + k, 4);
      return _mm256_set1_epi32(v);
    };
    if constexpr (HALVES && BITS == 8) {  // widened 6-bit codes (widen_q6): below 64, unsigned,
      // so VPMADDUBSW takes them as they are; two chunks' pairs (<= 2 * 2 * 63 * 127) add in int16
      for (int j = 0; j < 8; j += 2) {
        __m256i v[H][2];
        for (int h = 0; h < H; ++h)
          for (int c = 0; c < 2; ++c)
            v[h][c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[h] + 64 * (j + c)));
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = x4(r, 4 * j), x1 = x4(r, 4 * j + 4);
          for (int h = 0; h < H; ++h) {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v[h][0], x0),
                                               _mm256_maddubs_epi16(v[h][1], x1));
            __m256i& t = j < 4 ? s[h][r] : s2[h][r];  // k < 16, k >= 16
            t = _mm256_add_epi32(t, _mm256_madd_epi16(p, ones));
          }
        }
      }
    } else if constexpr (HALVES) {
      // 6-bit codes: the low nibbles' k (k < 16), scaled into acc, then the high ones' in the
      // same registers (16 ymm do not hold both halves' sums); per half two chunks' pairs
      // (<= 2 * 2 * 63 * 127) add in int16 before VPMADDWD widens them
      const __m256i top = _mm256_set1_epi8(0x30);
      for (int kh = 0; kh < 2; ++kh) {
        for (int j = 0; j < 4; j += 2) {
          __m256i p[H][R];
          for (int jj = j; jj < j + 2; ++jj) {
            __m256i c[H];
            for (int h = 0; h < H; ++h) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[h] + 64 * jj));
              // bits 4-5: bits 2 jj, 2 jj + 1 of the pair bytes (this half's 32 of each 64)
              const __m256i pr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[h] + 256 + 64 * kh));
              const __m256i at4 = _mm256_and_si256(
                  jj == 3 ? _mm256_srli_epi16(pr, 2) : jj == 2 ? pr : _mm256_slli_epi16(pr, 4 - 2 * jj), top);
              c[h] = _mm256_or_si256(_mm256_and_si256(kh ? _mm256_srli_epi16(v, 4) : v, nib), at4);
            }
            for (int r = 0; r < R; ++r) {
              const __m256i x = x4(r, 16 * kh + 4 * jj);
              for (int h = 0; h < H; ++h) {
                const __m256i m2 = _mm256_maddubs_epi16(c[h], x);
                p[h][r] = jj == j ? m2 : _mm256_add_epi16(p[h][r], m2);
              }
            }
          }
          for (int h = 0; h < H; ++h)
            for (int r = 0; r < R; ++r) s[h][r] = _mm256_add_epi32(s[h][r], _mm256_madd_epi16(p[h][r], ones));
        }
        for (int r = 0; r < R; ++r) {  // acc += d (cvt(s) dx - 32 sx) of this half
          const __m256 xd = _mm256_set1_ps(dx[r * blocks + b]);
          const __m256 xs = _mm256_set1_ps(sym_offset(Q) * sx[2 * (r * blocks + b) + kh]);
          for (int h = 0; h < H; ++h) {
            acc[h][r] = _mm256_fmadd_ps(kh ? d2[h] : d[h],
                                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h][r]), xd, xs), acc[h][r]);
            s[h][r] = _mm256_setzero_si256();
          }
        }
      }
      continue;  // scaled above
    } else if constexpr (BITS != 8) {
      // The pair sums add up in int16 before one VPMADDWD widens them: a pair is at most
      // 2 * 15 * 127 = 3,810 (5-bit codes: 7,874), so all 8 of a block (5-bit: 4) fit in 16
      // bits; half the multiplies of widening every pair, the same integers
      __m256i p[H][R];
      for (int h = 0; h < H; ++h)
        for (int r = 0; r < R; ++r) p[h][r] = _mm256_setzero_si256();
      auto widen = [&] {
        for (int h = 0; h < H; ++h)
          for (int r = 0; r < R; ++r) {
            s[h][r] = _mm256_add_epi32(s[h][r], _mm256_madd_epi16(p[h][r], ones));
            p[h][r] = _mm256_setzero_si256();
          }
      };
      for (int j = 0; j < 4; ++j) {
        __m256i lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[h] + 64 * j));
          lo[h] = _mm256_and_si256(v, nib), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          if constexpr (BITS == 5) {  // this half's fifth bits
            const uint8_t* planes = blk + scale_bytes(Q) + 256 + 16 * j + 4 * (half + h);
            lo[h] = _mm256_or_si256(lo[h], fifth_bits(planes));
            hi[h] = _mm256_or_si256(hi[h], fifth_bits(planes + 8));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xl = x4(r, 4 * j), xh = x4(r, 16 + 4 * j);
          for (int h = 0; h < H; ++h) {
            p[h][r] = _mm256_add_epi16(p[h][r], _mm256_maddubs_epi16(lo[h], xl));
            p[h][r] = _mm256_add_epi16(p[h][r], _mm256_maddubs_epi16(hi[h], xh));
            if constexpr (H == 1 && BITS == 4) in_register(p[h][r]);
          }
        }
        if (BITS == 5 && j == 1) widen();
      }
      widen();
    } else {
      for (int j = 0; j < 8; ++j) {
        __m256i v[H], a[H];
        for (int h = 0; h < H; ++h) {
          v[h] = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[h] + 64 * j)), flip);
          a[h] = _mm256_abs_epi8(v[h]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i x = x4(r, 4 * j);
          for (int h = 0; h < H; ++h) {
            s[h][r] = _mm256_add_epi32(
                s[h][r], _mm256_madd_epi16(_mm256_maddubs_epi16(a[h], _mm256_sign_epi8(x, v[h])),
                                           ones));
            if constexpr (H == 1) in_register(s[h][r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xd = _mm256_set1_ps(dx[r * blocks + b]);
      if constexpr (HALVES) {  // per k half d (cvt(s) dx - 32 sx): m = -32 d
        const float* sh = sx + 2 * (r * blocks + b);
        const __m256 xs = _mm256_set1_ps(sym_offset(Q) * sh[0]);
        const __m256 xs2 = _mm256_set1_ps(sym_offset(Q) * sh[1]);
        for (int h = 0; h < H; ++h) {
          acc[h][r] = _mm256_fmadd_ps(d[h], _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h][r]), xd, xs), acc[h][r]);
          acc[h][r] = _mm256_fmadd_ps(d2[h], _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2[h][r]), xd, xs2), acc[h][r]);
        }
        continue;
      }
      const __m256 xs = _mm256_set1_ps(sx[r * blocks + b]);
      for (int h = 0; h < H; ++h) {
        __m256 scale = _mm256_mul_ps(d[h], xd);
        acc[h][r] = _mm256_fmadd_ps(m[h], xs, acc[h][r]);
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h][r]), scale, acc[h][r]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y[r] + 8 * (half + h), acc[h][r]);
}

template <int Q>
void tile(int R, const int8_t* xq, const float* dx, const float* sx, int64_t K,
          const uint8_t* w, float (*y)[kGroup], const uint8_t* pf = nullptr) {
  const int64_t blocks = K / kBlock;
  for (int r0 = 0; r0 < R; r0 += 4) {
    const int8_t* x = xq + r0 * K;
    const float *d = dx + r0 * blocks, *s = sx + r0 * blocks * sums_per_block(Q);
    const uint8_t* p = r0 == 0 ? pf : nullptr;  // the first pass prefetches
    switch (std::min(4, R - r0)) {
      case 1: tile_avx2<1, 2, Q>(x, d, s, K, w, 0, y + r0, p); break;
      case 2: tile_avx2<2, 2, Q>(x, d, s, K, w, 0, y + r0, p); break;
      case 3:
        tile_avx2<3, 1, Q>(x, d, s, K, w, 0, y + r0, p);
        tile_avx2<3, 1, Q>(x, d, s, K, w, 1, y + r0, nullptr);
        break;
      default:
        tile_avx2<4, 1, Q>(x, d, s, K, w, 0, y + r0, p);
        tile_avx2<4, 1, Q>(x, d, s, K, w, 1, y + r0, nullptr);
    }
  }
}
constexpr bool kFastQuant = true;

// A 6-bit group widened to a byte a code (quant_layout.h kQ6Wide), the scales copied: calls of
// many rows unpack its codes once instead of in every row tile
inline void widen_q6(const uint8_t* grp, int64_t K, uint8_t* out) {
  constexpr int Q = TM_QI6 | TM_QSUPER;
  const int64_t blocks = K / kBlock;
  const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* src = grp + b * group_bytes(Q);
    uint8_t* dst = out + b * group_bytes(kQ6Wide) + scale_bytes(Q);
    std::memcpy(dst - scale_bytes(Q), src, scale_bytes(Q));
    const uint8_t* codes = src + scale_bytes(Q);
    for (int half = 0; half < 2; ++half)  // 32 of each chunk's 64 bytes at a time
      for (int j = 0; j < 4; ++j) {
        auto load = [&](int at) {
          return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + at + 32 * half));
        };
        auto at4 = [&](__m256i p) {  // bits 2 j, 2 j + 1 to bits 4-5
          return _mm256_and_si256(j == 3 ? _mm256_srli_epi16(p, 2) : j == 2 ? p
                                  : _mm256_slli_epi16(p, 4 - 2 * j), top);
        };
        const __m256i v = load(64 * j);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, nib), at4(load(256)));
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), at4(load(320)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * j + 32 * half), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * (4 + j) + 32 * half), hi);
      }
  }
  std::memcpy(out + blocks * group_bytes(kQ6Wide), grp + blocks * group_bytes(Q),
              blocks / kSuper * super_bytes(Q));
}
constexpr bool kWidenQ6 = true;
