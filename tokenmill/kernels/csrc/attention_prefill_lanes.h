// PrefillTask::run's work (one KV head, one tile of query positions) with the query rows
// (position x GQA head) in the lanes, 16 rows to a group, for an unquantized bf16 cache and a
// head size that is a multiple of 32 (included by attention_prefill.cpp). Everything runs
// transposed, so the online softmax is plain vector work with no horizontal reductions. Groups
// go in pairs and keys Engine::kBlock at a time: a pair's scores S^T (keys x rows) for all of
// them, then each group's softmax step (prefill_lanes.h), then their outputs O^T (channels x
// rows) += V^T . P^T, read from the call's K rows and V^T pairs (LaneKeys). The engine computes
// the two products: AMX tiles (attention_amx.h) or VDPBF16PS (attention_prefill_dot.h):
// - engine.scores(kr, D, keys, q0, q1, two, s, s1): S^T of the group whose q^T pairs [D/2][16]
//   are q0 into s[k][16] for keys k < `keys` (written up to a multiple of 32), and of the next
//   group (q1) into s1 when two; kr: the keys' rows, D apart, zero past the call's keys;
// - engine.values(vt, D, n0, n1, pp, pp1, o0, o1, on0, on1, two): O^T [D][16] of the group (o0;
//   zero first unless on0) += its probabilities' key pairs pp [chunk][16][16] times the V^T
//   pairs vt [chunk][D][16], over n0 chunks of 32 keys, and the next group's when two.
// Products of bf16 are exact in float32; the engines differ only in the order of the sums.
#pragma once

#include <algorithm>
#include <cstring>

#include "prefill_lanes.h"
#if defined(TM_ISA_AMX) || defined(TM_AMX_EMULATED)
#include "attention_amx.h"
#else
#include "attention_prefill_dot.h"
#endif

namespace tm {

template <typename Engine, typename Task>
void lanes_prefill_tile(const Task& t, int64_t h, int64_t i0, int64_t rows, PrefillScratch& sc) {
  constexpr int64_t G = kLaneGroup, kBlock = Engine::kBlock;
  const int64_t D = t.D, group = t.Hq / t.Hk, R = rows * group;
  const int64_t groups = (R + G - 1) / G;
  sc.qp.resize(groups * D / 2 * G);  // per group: q^T pairs [D/2][16]; rows past R zero
  sc.s.resize(2 * kBlock * G), sc.pp.resize(kBlock * G), sc.vp.resize(G * D / 2);
  sc.m.assign(groups * G, kLaneNoMax), sc.l.assign(groups * G, 0.f), sc.o.resize(groups * D * G);
  sc.on.assign(groups, 0u);  // whether a group's O^T holds anything yet (else: zero)
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
  Engine engine;
  FlushDenormals ftz;  // far-below-the-maximum probabilities: 0, not microcode assists
  const int64_t first = t.computed + i0, last = first + rows - 1;  // query positions
  float corr[G];
  const LaneKeys& keys = *t.lanes;
  const int64_t start = t.window > 0 ? std::max<int64_t>(0, first - t.window + 1) : 0;
  // blocks end at multiples of kBlock, so a row's keys fall into the same softmax steps in any
  // call (a window's first block starts where the call's first row sees keys): its bits do not
  // depend on the rows beside it
  for (int64_t p = start - (start - keys.p0) % kLaneKeys, n; p <= last; p += n) {  // a block's start
    n = std::min(kBlock - p % kBlock, last + 1 - p);
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
      if (lanes_softmax(s, seen, t.scale, sc.m.data() + r0, sc.l.data() + r0, corr, pp, mask_lo,
                        visible) && sc.on[g])
        for (int64_t d = 0; d < D; ++d)
          for (int64_t u = 0; u < G; u += kLanes)
            vstore(o + d * G + u, vmul(vload(o + d * G + u), vload(corr + u)));
    };
    float* s1 = sc.s.data() + kBlock * G;
    uint32_t* pp1 = sc.pp.data() + kBlock / 2 * G;
    for (int64_t g = g_first; g < g_end; g += 2) {  // groups in pairs
      const bool two = g + 1 < g_end;
      const uint32_t* q0 = sc.qp.data() + g * D / 2 * G;
      engine.scores(kr, D, seen_by(two ? g + 1 : g), q0, q0 + D / 2 * G, two, sc.s.data(), s1);
      softmax(g, sc.s.data(), sc.pp.data());
      if (two) softmax(g + 1, s1, pp1);
      float* o0 = sc.o.data() + g * D * G;
      const int64_t n0 = (seen_by(g) + kLaneKeys - 1) / kLaneKeys;  // chunks of 32 keys
      const int64_t n1 = two ? (seen_by(g + 1) + kLaneKeys - 1) / kLaneKeys : 0;
      engine.values(vt0, D, n0, n1, sc.pp.data(), pp1, o0, o0 + D * G, sc.on[g] != 0,
                    two && sc.on[g + 1], two);
      sc.on[g] = 1u;
      if (two) sc.on[g + 1] = 1u;
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

// PrefillTask::run's lanes path: the build's engine
template <typename Task>
void lanes_tile(const Task& t, int64_t h, int64_t i0, int64_t rows, PrefillScratch& sc) {
#if defined(TM_ISA_AMX) || defined(TM_AMX_EMULATED)
  lanes_prefill_tile<AmxAttention>(t, h, i0, rows, sc);
#else
  lanes_prefill_tile<DotAttention>(t, h, i0, rows, sc);
#endif
}

}  // namespace tm
