// AMX only: the keys of a prefill call in the layouts the AMX attention's tiles read
// (attention_amx.h), made once per call for every KV head and shared by its tasks (each task
// used to copy the keys it needed for itself: at 512 tokens every key ~8 times).
#pragma once

#include <cstring>
#include <vector>

namespace tm {

constexpr int64_t kAmxKeys = 32;  // keys per value tile step: two 16-key score tiles

// dst[c][r] = src[r][c] for a 16 x 16 block of 32-bit values (rows ld_src / ld_dst apart)
inline void transpose16(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
#ifdef TM_ISA_AMX
  __m512i r[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {  // 32-bit pairs
    u[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    u[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit pairs
    r[i] = _mm512_unpacklo_epi64(u[i], u[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(u[i], u[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(u[i + 1], u[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(u[i + 1], u[i + 3]);
  }
  // r[4a + b] holds, in each 128-bit lane L, column 4L + b of rows 4a..4a+3: gather the
  // lanes across the four row quads
  for (int b = 0; b < 4; ++b) {
    __m512i x0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88), x1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xdd);
    __m512i x2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88), x3 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xdd);
    u[b] = _mm512_shuffle_i32x4(x0, x2, 0x88);       // lane 0 of each quad: column b
    u[8 + b] = _mm512_shuffle_i32x4(x0, x2, 0xdd);   // lane 2
    u[4 + b] = _mm512_shuffle_i32x4(x1, x3, 0x88);   // lane 1
    u[12 + b] = _mm512_shuffle_i32x4(x1, x3, 0xdd);  // lane 3
  }
  for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + c * ld_dst, u[c]);
#else
  for (int i = 0; i < 16; ++i)
    for (int c = 0; c < 16; ++c) dst[c * ld_dst + i] = src[i * ld_src + c];
#endif
}

// Keys [p0, p0 + n) of every KV head (p0 a multiple of 32): K rows k[Hk][rows][D] and V^T as
// pairs of keys vt[Hk][rows / 32][D][16] (per 32 keys, channel d: (v[2j][d], v[2j + 1][d]) for
// j < 16); zero past n. rows: n rounded up to 32, plus 32, so a 64-key score step starting at
// a multiple of 32 before n stays inside its head.
struct AmxKeys {
  int64_t p0 = 0, rows = 0, D = 0;
  std::vector<bf16> k;
  std::vector<uint32_t> vt;

  const bf16* k_at(int64_t h, int64_t p) const { return k.data() + (h * rows + p - p0) * D; }
  const uint32_t* vt_at(int64_t h, int64_t p) const {
    return vt.data() + (h * rows + p - p0) / kAmxKeys * D * 16;
  }

  // keys [first, end) from the task's bf16 cache, 32 keys of one head a piece in parallel; p0 is
  // first rounded down to 32, and the keys before first stay zero (with a window their blocks
  // may be released: the tasks mask them)
  template <typename Task>
  void make(const Task& t, int64_t first, int64_t end) {
    p0 = first - first % kAmxKeys, D = t.D;
    const int64_t n = end - p0, chunks = (n + kAmxKeys - 1) / kAmxKeys + 1, skip = first - p0;
    rows = chunks * kAmxKeys;
    k.resize(t.Hk * rows * D), vt.resize(t.Hk * rows / 2 * D);
    parallel_for(0, t.Hk * chunks, 1, [&](int64_t c0, int64_t c1) {
      thread_local std::vector<uint32_t> vp;  // [16][D] pairs of one chunk, then transposed
      vp.resize(kAmxKeys / 2 * D);
      for (int64_t i = c0; i < c1; ++i) {
        const int64_t h = i / chunks, c = i % chunks * kAmxKeys;  // keys [p0 + c, p0 + c + 32)
        bf16* kr = k.data() + (h * rows + c) * D;
        for (int64_t j = c; j < c + kAmxKeys; ++j) {
          if (j >= skip && j < n) std::memcpy(kr + (j - c) * D, t.kc + t.at(h, p0 + j), D * sizeof(bf16));
          else std::memset(static_cast<void*>(kr + (j - c) * D), 0, D * sizeof(bf16));
        }
        for (int64_t j = c; j < c + kAmxKeys; j += 2) {
          uint32_t* dst = vp.data() + (j - c) / 2 * D;
          if (j + 1 == skip) {  // the pair's first key comes before first: zero
            const bf16* b = t.vc + t.at(h, p0 + j + 1);
            for (int64_t d = 0; d < D; ++d) dst[d] = uint32_t{b[d].bits} << 16;
          } else if (j >= skip && j < n) {
            t.value_pair(t.vc + t.at(h, p0 + j), j + 1 < n ? t.vc + t.at(h, p0 + j + 1) : nullptr, dst);
          } else std::fill(dst, dst + D, 0u);
        }
        uint32_t* out = vt.data() + (h * rows + c) / kAmxKeys * D * 16;
        for (int64_t d0 = 0; d0 < D; d0 += 16) transpose16(vp.data() + d0, D, out + d0 * 16, 16);
      }
    });
  }
};

}  // namespace tm
