// AMX only: PrefillTask::run's work (one KV head, one tile of query positions) on bf16 tiles,
// for an unquantized bf16 cache and a head size that is a multiple of 32 (included by
// attention_prefill.cpp). Everything runs transposed, query rows (position x GQA head) in the
// lanes, 16 rows to a group, so the online softmax is plain vector work with no horizontal
// reductions. Groups go in pairs and keys kAmxBlock at a time (a pair's scores for all of them,
// then each group's softmax step, then their outputs: fewer, longer phases measured faster than
// 128 keys at a time), in tiles of 16 (scores) and 32 (values), read from the call's K rows and
// V^T pairs (AmxKeys). Each K or V^T tile multiplies both groups' operands: one group per tile
// load had left both tile phases bound by reading the keys from L2 (with every load from L1
// they took 45-70% less time), and the pair halves that traffic.
// - scores S^T (keys x rows): tiles 0-1 (group g) and 2-3 (group g + 1), 16 keys x 16 rows
//   each, float32, accumulate TDPBF16PS of 32 keys' rows (tiles 4 and 5) and each group's q
//   as pairs (tiles 6 and 7, transposed once per task);
// - the online softmax: per key a vector of the rows' scores, scaled, masked (causal, window),
//   the rows' maxima, sums and corrections as vectors;
// - the probabilities, rounded to bf16 (as values_dot rounds them) and paired by key (tiles 6
//   and 7), multiply V^T (tiles 4 and 5: 32 channels x 32 keys) into each group's float32
//   output O^T (channels x rows) in tiles 0-1 and 2-3, zeroed for its first block, else loaded
//   from and stored back to the task's scratch.
// Products of bf16 are exact in float32, as on the VDPBF16PS path; only the order of the sums
// differs (and not with the pairing: each tile sums as it did alone).
#pragma once

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "attention_amx_keys.h"

namespace tm {

constexpr int64_t kAmxBlock = 512;  // keys per softmax step
constexpr int64_t kAmxGroup = 16;  // query rows per group (the lanes of a tile row)
constexpr float kAmxNoMax = -1e30f;  // a row's maximum before any key (finite: no inf - inf)

// kLanes probabilities of rows for keys 2j and 2j + 1 (a, b) as bf16 pairs (a_r, b_r), rounded
// to nearest even as values_dot rounds them
inline void amx_prob_pairs(vec a, vec b, uint32_t* out) {
#ifdef TM_ISA_AMX
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
bool amx_softmax(float* s, int64_t n, float scale, float* m, float* l, float* corr, uint32_t* pp,
                 int64_t mask_lo, const Visible& visible) {
  for (int64_t j = std::max<int64_t>(0, mask_lo); j < n; ++j) {
    int64_t lo, hi;  // masked scores first: rows that do not see the key
    visible(j, lo, hi);
    lo = std::clamp<int64_t>(lo, 0, kAmxGroup);
    hi = std::clamp<int64_t>(hi, lo, kAmxGroup);
    float* sj = s + j * kAmxGroup;
    std::fill(sj, sj + lo, -INFINITY);
    std::fill(sj + hi, sj + kAmxGroup, -INFINITY);
  }
  // in base 2: m holds the rows' maxima of score x scale x log2(e) (the scale is positive, so the
  // largest score gives the largest product), a probability is 2^(score x c - m)
  const vec c = vset1(scale * 1.44269504088896341f);
  bool raised = false;
  for (int64_t u = 0; u < kAmxGroup; u += kLanes) {
    const vec mo = vload(m + u);
    vec top = vset1(-INFINITY);
    for (int64_t j = 0; j < n; ++j) top = vmax(top, vload(s + j * kAmxGroup + u));
    const vec mx = vmax(mo, vmul(top, c));
    raised |= vmask_eq(mx, mo) != (1 << kLanes) - 1;
    vstore(m + u, mx);
    vstore(corr + u, vexp2_prob(vsub(mo, mx)));
  }
  const int64_t padded = (n + kAmxKeys - 1) / kAmxKeys * kAmxKeys;
  for (int64_t u = 0; u < kAmxGroup; u += kLanes) {  // probabilities straight to their pairs
    const vec neg_mx = vsub(vzero(), vload(m + u));
    auto prob = [&](int64_t j) { return vexp2_prob(vfma(vload(s + j * kAmxGroup + u), c, neg_mx)); };
    vec sum = vmul(vload(l + u), vload(corr + u));
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const vec a = prob(j), b = prob(j + 1);
      sum = vadd(sum, vadd(a, b));
      amx_prob_pairs(a, b, pp + j / 2 * kAmxGroup + u);
    }
    if (j < n) {  // an odd key count: the last key with a zero partner
      const vec a = prob(j);
      sum = vadd(sum, a);
      amx_prob_pairs(a, vzero(), pp + j / 2 * kAmxGroup + u);
      j += 2;
    }
    for (; j < padded; j += 2) amx_prob_pairs(vzero(), vzero(), pp + j / 2 * kAmxGroup + u);
    vstore(l + u, sum);
  }
  return raised;
}

template <typename Task>
void amx_prefill_tile(const Task& t, int64_t h, int64_t i0, int64_t rows, PrefillScratch& sc) {
  const int64_t D = t.D, group = t.Hq / t.Hk, R = rows * group;
  const int64_t groups = (R + kAmxGroup - 1) / kAmxGroup, G = kAmxGroup;
  sc.qp.resize(groups * D / 2 * G);  // per group: q^T pairs [D/2][16]; rows past R zero
  sc.s.resize(2 * kAmxBlock * G), sc.pp.resize(kAmxBlock * G), sc.vp.resize(G * D / 2);
  sc.m.assign(groups * G, kAmxNoMax), sc.l.assign(groups * G, 0.f), sc.o.resize(groups * D * G);
  sc.on.assign(groups, 0u);  // whether a group's O^T holds anything yet (else: zero tiles)
  for (int64_t g = 0; g < groups; ++g) {  // row r: position i0 + r / group, head h * group + r % group
    uint32_t* rows_in = sc.vp.data();  // the group's 16 rows of q, then transposed
    for (int64_t i = 0; i < G; ++i) {
      const int64_t r = g * G + i;
      if (r < R) std::memcpy(rows_in + i * D / 2, t.q + ((i0 + r / group) * t.Hq + h * group + r % group) * D, D * sizeof(bf16));
      else std::fill(rows_in + i * D / 2, rows_in + (i + 1) * D / 2, 0u);
    }
    for (int64_t d0 = 0; d0 < D / 2; d0 += 16)
      transpose16(rows_in + d0, D / 2, sc.qp.data() + g * D / 2 * G + d0 * G, G);
  }
  AmxTiles tiles(true);
  FlushDenormals ftz;  // far-below-the-maximum probabilities: 0, not microcode assists
  const int64_t first = t.computed + i0, last = first + rows - 1;  // query positions
  float corr[kAmxGroup];
  const AmxKeys& keys = *t.amx;
  const int64_t start = t.window > 0 ? std::max<int64_t>(0, first - t.window + 1) : 0;
  for (int64_t p = start - (start - keys.p0) % kAmxKeys, n; p <= last; p += n) {  // a chunk's start
    n = std::min(kAmxBlock, last + 1 - p);
    const bf16* kr = keys.k_at(h, p);
    const uint32_t* vt0 = keys.vt_at(h, p);
    // groups whose rows all come before the keys see none of them; with a window, groups
    // whose rows all come past it neither
    const int64_t g_first = std::max<int64_t>(0, p - first) * group / G;
    int64_t g_end = groups;
    if (t.window > 0) g_end = std::min(groups, ((p + n - 1 + t.window - first) * group + G - 1) / G);
    // the keys the group's last row can see (causal): the rest of the block is skipped
    auto seen_by = [&](int64_t g) {
      return std::min(n, first + std::min(R - 1, g * G + G - 1) / group - p + 1);
    };
    // S^T of group g into s[k][16], and of group g + 1 (two) into s1: 32 keys at a time, each
    // 16 keys' tile of K rows (tiles 4, 5) multiplying both groups' q (tiles 6, 7), so a pair
    // of groups reads the keys once (their tile loads from L2 had bound this phase)
    auto scores = [&](int64_t g, bool two, float* s, float* s1) {
      const uint32_t* q0 = sc.qp.data() + g * D / 2 * G;
      const uint32_t* q1 = q0 + D / 2 * G;
      const int64_t ld = D * sizeof(bf16), ldq = G * sizeof(uint32_t);
      for (int64_t k = 0; k < seen_by(two ? g + 1 : g); k += 32) {
        const bf16* kk = kr + k * D;
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t c = 0; c < D / 32; ++c) {
          _tile_loadd(4, kk + c * 32, ld);
          _tile_loadd(5, kk + 16 * D + c * 32, ld);
          _tile_loadd(6, q0 + c * 16 * G, ldq);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          if (two) {
            _tile_loadd(7, q1 + c * 16 * G, ldq);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        tile_store(0, s + k * G, G * sizeof(float));
        tile_store(1, s + (k + 16) * G, G * sizeof(float));
        if (two) {
          tile_store(2, s1 + k * G, G * sizeof(float));
          tile_store(3, s1 + (k + 16) * G, G * sizeof(float));
        }
      }
    };
    // group g's softmax step: probabilities to pp, its output rows rescaled
    auto softmax = [&](int64_t g, float* s, uint32_t* pp) {
      const int64_t r0 = g * G, seen = seen_by(g);
      auto visible = [&](int64_t j, int64_t& lo, int64_t& hi) {  // rows [lo, hi) see key p + j
        lo = (p + j - first) * group - r0;
        hi = t.window > 0 ? (p + j + t.window - first) * group - r0 : G;
      };
      // keys from the group's first row's position on are masked for some rows (causal); with
      // a window, any key may be
      const int64_t mask_lo = t.window > 0 ? 0 : first + r0 / group - p + 1;
      float* o = sc.o.data() + g * D * G;  // O^T [D][16]
      if (amx_softmax(s, seen, t.scale, sc.m.data() + r0, sc.l.data() + r0, corr, pp, mask_lo,
                      visible) && sc.on[g])
        for (int64_t d = 0; d < D; ++d)
          for (int64_t u = 0; u < G; u += kLanes)
            vstore(o + d * G + u, vmul(vload(o + d * G + u), vload(corr + u)));
    };
    // group g's output O^T += V^T . P^T (and group g + 1's from pp1 when two), 32 channels at
    // a time: each V^T tile (tiles 4, 5) multiplies both groups' probabilities (tiles 6, 7)
    auto values = [&](int64_t g, bool two, const uint32_t* pp, const uint32_t* pp1) {
      const int64_t n0 = (seen_by(g) + kAmxKeys - 1) / kAmxKeys;  // chunks of 32 keys
      const int64_t n1 = two ? (seen_by(g + 1) + kAmxKeys - 1) / kAmxKeys : 0;
      float* o0 = sc.o.data() + g * D * G;
      float* o1 = o0 + D * G;
      const int64_t ld = 16 * sizeof(uint32_t), ldp = G * sizeof(uint32_t), ldo = G * sizeof(float);
      for (int64_t c = 0; c < D / 16; c += 2) {
        for (int u = 0; u < 2; ++u) {
          if (sc.on[g]) tile_load(u, o0 + (c + u) * 16 * G, ldo);
          else tile_clear(u);
          if (!two) continue;
          if (sc.on[g + 1]) tile_load(2 + u, o1 + (c + u) * 16 * G, ldo);
          else tile_clear(2 + u);
        }
        for (int64_t k = 0; k < std::max(n0, n1); ++k) {
          const uint32_t* vt = vt0 + (k * D + c * 16) * 16;
          _tile_loadd(4, vt, ld);
          _tile_loadd(5, vt + 256, ld);
          if (k < n0) {
            _tile_loadd(6, pp + k * 16 * G, ldp);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
          }
          if (k < n1) {
            _tile_loadd(7, pp1 + k * 16 * G, ldp);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        for (int u = 0; u < 2; ++u) {
          tile_store(u, o0 + (c + u) * 16 * G, ldo);
          if (two) tile_store(2 + u, o1 + (c + u) * 16 * G, ldo);
        }
      }
      sc.on[g] = 1u;
      if (two) sc.on[g + 1] = 1u;
    };
    float* s1 = sc.s.data() + kAmxBlock * G;
    uint32_t* pp1 = sc.pp.data() + kAmxBlock / 2 * G;
    for (int64_t g = g_first; g < g_end; g += 2) {  // groups in pairs
      const bool two = g + 1 < g_end;
      scores(g, two, sc.s.data(), s1);
      softmax(g, sc.s.data(), sc.pp.data());
      if (two) softmax(g + 1, s1, pp1);
      values(g, two, sc.pp.data(), pp1);
    }
  }
  // O^T / l to the rows of out: per group, scaled by its rows' 1 / l in place, then 16 channels
  // at a time transposed to the rows and rounded
  alignas(64) uint32_t rows_out[16 * 16];
  for (int64_t g = 0; g < groups; ++g) {
    float* o = sc.o.data() + g * D * G;
    for (int64_t u = 0; u < G; u += kLanes) {
      const vec inv = vdiv(vset1(1.f), vload(sc.l.data() + g * G + u));
      for (int64_t d = 0; d < D; ++d) vstore(o + d * G + u, vmul(vload(o + d * G + u), inv));
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      transpose16(reinterpret_cast<const uint32_t*>(o + d0 * G), G, rows_out, 16);
      for (int64_t i = 0; i < G && g * G + i < R; ++i) {
        const int64_t r = g * G + i;
        bf16* dst = t.out + ((i0 + r / group) * t.Hq + h * group + r % group) * D + d0;
        for (int64_t u = 0; u < 16; u += kLanes)
          vstore(dst + u, vload(reinterpret_cast<const float*>(rows_out) + i * 16 + u));
      }
    }
  }
}

}  // namespace tm
