// The rows-in-lanes prefill attention's shared pieces (attention_prefill_lanes.h runs them with
// an engine for its products: AMX tiles, attention_amx.h, or VDPBF16PS,
// attention_prefill_dot.h): the keys of a call in the layouts the engines read, made once per
// call for every KV head and shared by its tasks (each task used to copy the keys it needed for
// itself: at 512 tokens every key ~8 times), and the online softmax on query rows held in the
// lanes.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16_pairs.h"
#include "common.h"
#include "vec.h"

namespace tm {

constexpr int64_t kLaneKeys = 32;  // keys per value step (an AMX tile: two 16-key score tiles)

// dst[c][r] = src[r][c] for a 16 x 16 block of 32-bit values (rows ld_src / ld_dst apart)
inline void transpose16(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
#if defined(TM_ISA_AVX512) || defined(TM_ISA_AVX512_BF16)
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
struct LaneKeys {
  int64_t p0 = 0, rows = 0, D = 0;
  std::vector<bf16> k;
  std::vector<uint32_t> vt;

  const bf16* k_at(int64_t h, int64_t p) const { return k.data() + (h * rows + p - p0) * D; }
  const uint32_t* vt_at(int64_t h, int64_t p) const {
    return vt.data() + (h * rows + p - p0) / kLaneKeys * D * 16;
  }

  // After a call: buffers past `keep` bytes are freed rather than kept for the next call, so a
  // long history's copy does not stay resident (8 KV heads x 128 after 30,000 tokens: 118 MiB
  // of RSS); smaller ones are reused
  void release_above(size_t keep) {
    if (k.capacity() * sizeof(bf16) + vt.capacity() * sizeof(uint32_t) <= keep) return;
    std::vector<bf16>().swap(k);
    std::vector<uint32_t>().swap(vt);
  }

  // keys [first, end) from the task's bf16 cache, 32 keys of one head a piece in parallel; p0 is
  // first rounded down to 32, and the keys before first stay zero (with a window their blocks
  // may be released: the tasks mask them)
  template <typename Task>
  void make(const Task& t, int64_t first, int64_t end) {
    p0 = first - first % kLaneKeys, D = t.D;
    const int64_t n = end - p0, chunks = (n + kLaneKeys - 1) / kLaneKeys + 1, skip = first - p0;
    rows = chunks * kLaneKeys;
    k.resize(t.Hk * rows * D), vt.resize(t.Hk * rows / 2 * D);
    parallel_for(0, t.Hk * chunks, 1, [&](int64_t c0, int64_t c1) {
      thread_local std::vector<uint32_t> vp;  // [16][D] pairs of one chunk, then transposed
      vp.resize(kLaneKeys / 2 * D);
      for (int64_t i = c0; i < c1; ++i) {
        const int64_t h = i / chunks, c = i % chunks * kLaneKeys;  // keys [p0 + c, p0 + c + 32)
        bf16* kr = k.data() + (h * rows + c) * D;
        for (int64_t j = c; j < c + kLaneKeys; ++j) {
          if (j >= skip && j < n) std::memcpy(kr + (j - c) * D, t.kc + t.at(h, p0 + j), D * sizeof(bf16));
          else std::memset(static_cast<void*>(kr + (j - c) * D), 0, D * sizeof(bf16));
        }
        for (int64_t j = c; j < c + kLaneKeys; j += 2) {
          uint32_t* dst = vp.data() + (j - c) / 2 * D;
          if (j + 1 == skip) {  // the pair's first key comes before first: zero
            const bf16* b = t.vc + t.at(h, p0 + j + 1);
            for (int64_t d = 0; d < D; ++d) dst[d] = uint32_t{b[d].bits} << 16;
          } else if (j >= skip && j < n) {
            t.value_pair(t.vc + t.at(h, p0 + j), j + 1 < n ? t.vc + t.at(h, p0 + j + 1) : nullptr, dst);
          } else std::fill(dst, dst + D, 0u);
        }
        uint32_t* out = vt.data() + (h * rows + c) / kLaneKeys * D * 16;
        for (int64_t d0 = 0; d0 < D; d0 += 16) transpose16(vp.data() + d0, D, out + d0 * 16, 16);
      }
    });
  }
};

// kLanes probabilities of rows for keys 2j and 2j + 1 (a, b) as bf16 pairs (a_r, b_r), rounded
// to nearest even as values_dot rounds them
inline void prob_pairs(vec a, vec b, uint32_t* out) {
#ifdef TM_ISA_AVX512_BF16
  store_bf16_pairs(a, b, out);
#else
  alignas(64) float fa[kLanes], fb[kLanes];
  vstore(fa, a);
  vstore(fb, b);
  for (int r = 0; r < kLanes; ++r) out[r] = to_bf16(fa[r]).bits | uint32_t{to_bf16(fb[r]).bits} << 16;
#endif
}

// A probability 2^t (t <= 0 up to rounding; -inf gives 0): 2^floor(t) times a degree-3 fit of
// 2^f on [0, 1) whose constant term is 1 (max. relative error 8.6e-5, far below the bf16
// rounding the probabilities then get, 2^-9), so 2^0 is exactly 1 and a row whose maximum did
// not move keeps its sum and output bit for bit however its group's rows fall (chunked prefill
// gives the same bits). Against vexp2: two fewer FMAs and no upper clamp; the scale is folded
// into the caller's FMA.
inline vec vexp2_prob(vec t) {
  t = vmax(t, vset1(-127.f));  // exponent bits 0 there: 0 under flushed denormals
  const vec f = vfrac(t);
  const vec y = vfma(vfma(vfma(vset1(7.706263e-2f), f, vset1(2.2764981e-1f)), f,
                          vset1(6.9511571e-1f)), f, vset1(1.f));
  return vldexp(y, t);
}

// One group's online softmax over the keys [p, p + n): s[n][16] scores in, probabilities as
// key pairs pp[n rounded up to 32, halved][16] out; m, l: the group's maxima and sums; corr:
// their corrections (returns whether any is not 1). visible(j, lo, hi): the rows [lo, hi) that
// see key p + j (rows in position order); every row sees the keys before mask_lo.
template <typename Visible>
bool lanes_softmax(float* s, int64_t n, float scale, float* m, float* l, float* corr, uint32_t* pp,
                 int64_t mask_lo, const Visible& visible) {
  for (int64_t j = std::max<int64_t>(0, mask_lo); j < n; ++j) {
    int64_t lo, hi;  // masked scores first: rows that do not see the key
    visible(j, lo, hi);
    lo = std::clamp<int64_t>(lo, 0, kLaneGroup);
    hi = std::clamp<int64_t>(hi, lo, kLaneGroup);
    float* sj = s + j * kLaneGroup;
    std::fill(sj, sj + lo, -INFINITY);
    std::fill(sj + hi, sj + kLaneGroup, -INFINITY);
  }
  // in base 2: m holds the rows' maxima of score x scale x log2(e) (the scale is positive, so the
  // largest score gives the largest product), a probability is 2^(score x c - m)
  const vec c = vset1(scale * 1.44269504088896341f);
  bool raised = false;
  for (int64_t u = 0; u < kLaneGroup; u += kLanes) {
    const vec mo = vload(m + u);
    vec top = vset1(-INFINITY);
    for (int64_t j = 0; j < n; ++j) top = vmax(top, vload(s + j * kLaneGroup + u));
    const vec mx = vmax(mo, vmul(top, c));
    raised |= vmask_eq(mx, mo) != (1 << kLanes) - 1;
    vstore(m + u, mx);
    vstore(corr + u, vexp2_prob(vsub(mo, mx)));
  }
  const int64_t padded = (n + kLaneKeys - 1) / kLaneKeys * kLaneKeys;
  for (int64_t u = 0; u < kLaneGroup; u += kLanes) {  // probabilities straight to their pairs
    const vec neg_mx = vsub(vzero(), vload(m + u));
    auto prob = [&](int64_t j) { return vexp2_prob(vfma(vload(s + j * kLaneGroup + u), c, neg_mx)); };
    vec sum = vmul(vload(l + u), vload(corr + u));
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const vec a = prob(j), b = prob(j + 1);
      sum = vadd(sum, vadd(a, b));
      prob_pairs(a, b, pp + j / 2 * kLaneGroup + u);
    }
    if (j < n) {  // an odd key count: the last key with a zero partner
      const vec a = prob(j);
      sum = vadd(sum, a);
      prob_pairs(a, vzero(), pp + j / 2 * kLaneGroup + u);
      j += 2;
    }
    for (; j < padded; j += 2) prob_pairs(vzero(), vzero(), pp + j / 2 * kLaneGroup + u);
    vstore(l + u, sum);
  }
  return raised;
}

}  // namespace tm
