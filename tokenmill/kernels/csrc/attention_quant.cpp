// tokenmill CPU kernels: paged decode attention on a quantized KV cache (kv_pages.h), the
// pages read in place, so a step reads the cache's quantized bytes, never a float copy: rows are
// dequantized a few at a time into an L1 scratch that every query head of the KV head reads.
// Tasks hold all KV heads of a sequence when there are many sequences (one contiguous run per
// cache row), else one KV head, and one piece of its history (attention_pieces.h: absolute
// positions, so a row's sums do not depend on the batch); their sums are combined at the end.
//
// int8 and int4 keys are scored with integer dot products (scores_int.h), int8 and int4 values
// summed with them on x86 (values_int.h); fp8, and head sizes those do not take, widen the rows
// to float. A query's own int4 block comes from the stage, in float.
#include "attention_common.h"
#include "attention_pieces.h"
#include "kv_pages.h"
#include "scores_int.h"
#include "tm.h"
#include "values_int.h"
#include "vec.h"

namespace tm {

struct Part {  // one task's share: KV heads [h0, h0 + nh) of sequence b, positions [p0, p1)
  int64_t b, h0, nh, p0, p1;
  int64_t own, stage;  // int4: the block index of the query's position and its stage slot
};

// Unnormalized attention of the task's query heads (group per KV head, qf pre-scaled) over its
// positions: m[g] the largest score, l[g] the sum of exp(score - m), acc[g] the weighted values.
template <int F>  // K's format (int4's V: TM_KV_INT4V, else as K)
void attend_part(const float* qf, const QuantPages& K, const QuantPages& V, const int64_t* table,
                 const Part& t, int64_t BS,
                 int64_t group, float* scores, float* buf, float* acc, float* m, float* l) {
  constexpr int FV = F == TM_KV_INT4 ? TM_KV_INT4V : F;
  const int64_t D = K.D, n = t.p1 - t.p0, Dp = (D + kLanes - 1) / kLanes * kLanes;
  const int64_t nq = t.nh * group;
  auto slot = [&](int64_t p) { return table[p / BS] * BS + p % BS; };
  auto take = [&](int64_t p) { return std::min({kRows, t.p1 - p, BS - p % BS}); };
  // chunks of rows inside one block, the one after next prefetched into L2 and the next into
  // L1 where the task reads whole rows (one KV head of three: 1.07x without it, int8 and int4,
  // one sequence at 2,048-8,192 positions on a Zen 4; batches of whole rows unchanged)
  auto walk = [&](const QuantPages& c, auto fn) {
    for (int64_t p = t.p0, rows; p < t.p1; p += rows) {
      rows = take(p);
      if (p + rows < t.p1) {
        const int64_t r1 = take(p + rows);
        if (t.nh == c.Hk) c.prefetch(slot(p + rows), r1, t.h0, t.nh, true);
        if (p + rows + r1 < t.p1) c.prefetch(slot(p + rows + r1), take(p + rows + r1), t.h0, t.nh, false);
      }
      fn(p, rows, slot(p));
    }
  };
  float lo[256], st[256], sums[8 * kRows], rs[kRows], bias[8], mu = 0.f, su = 0.f;
  alignas(64) int16_t codes[kRows * 256], mc[256], sc[256];
  const bool ints = integer_keys<F>(D);
  std::vector<int16_t> q16;  // the integer path: each query head's int16 query
  std::vector<float> unit(nq);
  if (ints) {
    q16.resize(nq * D);
    for (int64_t g = 0; g < nq; ++g) unit[g] = quantize_query(qf + g * Dp, D, q16.data() + g * D);
  }
  walk(K, [&](int64_t p, int64_t rows, int64_t s0) {
    const int64_t at = p - t.p0;
    for (int64_t hh = 0; hh < t.nh; ++hh) {
      const int64_t h = t.h0 + hh;
      if constexpr (F == TM_KV_INT4 || F == TM_KV_INT8) {
        if (ints && (F == TM_KV_INT8 || p / BS != t.own)) {
          if constexpr (F == TM_KV_INT4) {
            K.block_codes(s0 / BS, h, mc, sc, &mu, &su);
            widen_k4(K, s0, rows, h, sc, codes);
          }
          if constexpr (F == TM_KV_INT8)  // each row's scale
            for (int64_t j = 0; j < rows; ++j) rs[j] = vhalf(K.scale[(s0 + j) * K.Hk + h]);
          for (int64_t g0 = hh * group; g0 < (hh + 1) * group; g0 += 8) {
            const int nb = static_cast<int>(std::min<int64_t>(8, (hh + 1) * group - g0));
            const int16_t* q8[8];
            float *s8[8], *b8[8];
            for (int i = 0; i < nb; ++i)
              q8[i] = q16.data() + (g0 + i) * D, s8[i] = sums + i * kRows, b8[i] = bias + i;
            if constexpr (F == TM_KV_INT4) {
              score_i16(q8, nb, Int16Rows{codes, D}, rows, D, s8);
              score_i16(q8, nb, Int16Rows{mc, D}, 1, D, b8);
            } else {  // int8: the codes as they are in the cache
              const auto* c = reinterpret_cast<const int8_t*>(K.codes_at(s0 * K.Hk + h));
              score_i16(q8, nb, Int8Rows{c, K.Hk * D}, rows, D, s8);
            }
            for (int i = 0; i < nb; ++i) {
              const int64_t g = g0 + i;
              const float* sg = s8[i];
              vec mul = vset1(unit[g]), add = vzero();
              if constexpr (F == TM_KV_INT4)  // (su q . (code sc) + mu q . mc) / A
                mul = vset1(su * unit[g]), add = vset1(bias[i] * mu * unit[g]);
              float* out = scores + g * n + at;
              int64_t j = 0;
              for (; j + kLanes <= rows; j += kLanes) {
                vec x = vfma(vload(sg + j), mul, add);
                vstore(out + j, F == TM_KV_INT8 ? vmul(x, vload(rs + j)) : x);
              }
              for (; j < rows; ++j) {
                const float x = F == TM_KV_INT4 ? (sg[j] * su + bias[i] * mu) * unit[g] : sg[j] * unit[g];
                out[j] = F == TM_KV_INT8 ? x * rs[j] : x;
              }
            }
          }
          continue;
        }
      }
      if constexpr (F == TM_KV_INT4) {
        if (p / BS == t.own) {
          for (int64_t j = 0; j < rows; ++j) K.stage_row(t.stage, p % BS + j, h, buf + j * Dp);
        } else {
          K.block_params(s0 / BS, h, lo, st);
          for (int64_t j = 0; j < rows; ++j) K.row_k4(s0 + j, h, lo, st, buf + j * Dp);
        }
      } else {
        for (int64_t j = 0; j < rows; ++j) K.row<F>(s0 + j, h, buf + j * Dp);
      }
      score_group(qf, Dp, hh * group, (hh + 1) * group, buf, Dp, rows, D, scores + at, n);
    }
  });
  for (int64_t g = 0; g < nq; ++g) l[g] = exp_shifted(scores + g * n, n, m + g);  // unnormalized
  std::fill(acc, acc + nq * Dp, 0.f);
#ifdef TM_VALUES_INT
  if constexpr (FV == TM_KV_INT4V || FV == TM_KV_INT8) {  // integer dot products (values_int.h)
    if (D % 64 == 0 && D <= 256) {
      std::vector<float> perm(nq * D, 0.f), wsum(nq, 0.f);
      walk(V, [&](int64_t p, int64_t rows, int64_t s0) {
        for (int64_t hh = 0; hh < t.nh; ++hh)
          values_int<FV == TM_KV_INT4V>(V, s0, rows, t.h0 + hh, scores + hh * group * n + (p - t.p0),
                                         n, group, perm.data() + hh * group * D, wsum.data() + hh * group);
      });
      for (int64_t g = 0; g < nq; ++g)
        unpermute_values(FV == TM_KV_INT4V, perm.data() + g * D, D, wsum[g], acc + g * Dp);
      return;
    }
  }
#endif
  walk(V, [&](int64_t p, int64_t rows, int64_t s0) {
    const int64_t at = p - t.p0;
    for (int64_t hh = 0; hh < t.nh; ++hh) {
      for (int64_t j = 0; j < rows; ++j) V.row<FV>(s0 + j, t.h0 + hh, buf + j * Dp);
      accumulate_group(scores + at, n, hh * group, (hh + 1) * group, buf, Dp, rows, D, acc, Dp);
    }
  });
}

}  // namespace tm

using namespace tm;

extern "C" void tm_decode_attention_quant(const float* q, const tm_kv_pages* k,
                                          const tm_kv_pages* v, int64_t block_size,
                                          int64_t kv_heads, const int64_t* block_tables,
                                          int64_t max_blocks, const int64_t* seq_lens,
                                          const int64_t* stages, int64_t batch, int64_t heads,
                                          int64_t head_dim, int64_t window, float scale,
                                          float* out) {
  const int64_t group = heads / kv_heads, D = head_dim, Dp = (D + kLanes - 1) / kLanes * kLanes;
  const QuantPages K(*k, kv_heads, D, block_size), V(*v, kv_heads, D, block_size);
  const int64_t threads = g_threads, P = kPiece;
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, seq_lens[b]), total += seq_lens[b];
  const int64_t nh = batch >= 4 * threads ? kv_heads : 1;
  std::vector<Part> parts;
  std::vector<std::pair<int64_t, int64_t>> groups;  // (first part, parts) of a task's KV heads
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t L = seq_lens[b], start = window_start(L, window);
    for (int64_t h0 = 0; h0 < kv_heads; h0 += nh) {
      groups.emplace_back(static_cast<int64_t>(parts.size()), 0);
      for (int64_t p = start / P; p == start / P || p * P < L; ++p, ++groups.back().second)
        parts.push_back({b, h0, nh, std::max(start, p * P), std::min(L, (p + 1) * P),
                         (L - 1) / block_size, stages ? stages[b] : -1});
    }
  }
  auto attend = K.fmt == TM_KV_INT8  ? attend_part<TM_KV_INT8>
                : K.fmt == TM_KV_FP8 ? attend_part<TM_KV_FP8>
                                     : attend_part<TM_KV_INT4>;
  const int64_t per = nh * group, tasks = static_cast<int64_t>(parts.size());
  const int64_t block = PieceSums::size(per, Dp);
  std::vector<float> sums(tasks * block);
  const int64_t work = std::max<int64_t>(1, std::min(total / batch, P) * D * per / 8);
  // parts differ in work (sequences of different lengths): handed out as threads come free
  parallel_dynamic(tasks, [&](int64_t t) {
    thread_local std::vector<float> scores, buf, qf;
    scores.resize((std::min(longest, P) + 1) * per), buf.resize(kRows * Dp);
    qf.assign(per * Dp, 0.f);
    const Part& p = parts[t];
    const float* qb = q + (p.b * heads + p.h0 * group) * D;
    for (int64_t g = 0; g < per; ++g)
      for (int64_t i = 0; i < D; ++i) qf[g * Dp + i] = qb[g * D + i] * scale;
    const PieceSums s{sums.data() + t * block, per, Dp};
    attend(qf.data(), K, V, block_tables + p.b * max_blocks, p, block_size, group,
           scores.data(), buf.data(), s.acc(0), s.m(), s.l());
  }, std::max<int64_t>(1, (1 << 14) / work));
  for (auto [first, count] : groups) {  // each query head's pieces, in position order
    const Part& p = parts[first];
    for (int64_t g = 0; g < per; ++g)
      combine(sums.data() + first * block, block, count, per, Dp, g, D,
              out + (p.b * heads + p.h0 * group + g) * D);
  }
}
