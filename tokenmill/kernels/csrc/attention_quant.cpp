// tokenmill CPU kernels: paged decode attention on a quantized KV cache (kv_pages.h), the
// pages read in place, so a step reads the cache's quantized bytes, never a float copy: rows are
// dequantized a few at a time into an L1 scratch that every query head of the KV head reads.
// Tasks hold all KV heads of a sequence when there are many sequences (one contiguous run per
// cache row), else one KV head; when even those are fewer than 4 per thread, each sequence's
// positions are split between tasks (partial softmax sums, combined at the end).
//
// int8 and int4 keys are scored with integer dot products: the query is rounded to int16 once
// per task (2**14 levels: a score moves by ~1e-4 of |q| |k|), the codes are widened to int16
// (int4: times each channel's step code), and the sums come back to float times the row's scale
// (int8), or the block's step unit plus its q . minimum (int4). A query's own int4 block comes
// from the stage, in float.
#include "attention_common.h"
#include "kv_pages.h"
#include "tm.h"
#include "values_int.h"
#include "vec.h"

namespace tm {

struct Part {  // one task's share: KV heads [h0, h0 + nh) of sequence b, positions [p0, p1)
  int64_t b, h0, nh, p0, p1;
  int64_t own, stage;  // int4: the block index of the query's position and its stage slot
};

// q16 = round(q * A), A = kQueryMax / max |q|; returns 1 / A (0 for a zero query). 2**14
// levels: an int4 product (code x step code < 2**12) times it summed over the head_dim / kLanes
// products of a lane stays in int32 up to head_dim 256.
constexpr float kQueryMax = 16383.f;

inline float quantize_query(const float* q, int64_t D, int16_t* q16) {
  vec mx = vzero();
  for (int64_t i = 0; i < D; i += kLanes) mx = vmax(mx, vmax(vload(q + i), vsub(vzero(), vload(q + i))));
  const float top = vhmax(mx);
  if (!(top > 0.f)) {
    std::fill(q16, q16 + D, int16_t{0});
    return 0.f;
  }
  const vec a = vset1(kQueryMax / top);
  for (int64_t i = 0; i < D; i += kLanes) vstore_i16(q16 + i, vmul(vload(q + i), a));
  return top / kQueryMax;
}

// `rows` rows of K codes of KV head h from `slot` -> int16 (rows x D): int8 as they are, int4
// times each channel's step code sc
template <int F>
void widen_codes(const QuantPages& K, int64_t slot, int64_t rows, int64_t h, const int16_t* sc,
                 int16_t* dst) {
  const int64_t D = K.D;
  static_assert(sizeof(i16x) == 2 * kLanes * sizeof(int16_t), "i16x holds 2 x kLanes int16");
  auto put = [](int16_t* at, i16x v) { std::memcpy(at, &v, sizeof(v)); };
  for (int64_t j = 0; j < rows; ++j, dst += D) {
    const uint8_t* c = K.codes_at((slot + j) * K.Hk + h);
    if constexpr (F == TM_KV_INT4) {
      for (int64_t i = 0; i < D / 2; i += 2 * kLanes) {
        i16x lo, hi;
        vcodes_4(c + i, lo, hi);
        put(dst + i, vmul16(lo, vload_i16(sc + i)));
        put(dst + D / 2 + i, vmul16(hi, vload_i16(sc + D / 2 + i)));
      }
    } else {
      for (int64_t i = 0; i < D; i += 2 * kLanes) put(dst + i, vcodes_i8(reinterpret_cast<const int8_t*>(c + i)));
    }
  }
}

// sums[j] = q16 . codes[j] for `rows` rows of D int16, eight at a time
inline void score_i16(const int16_t* q16, const int16_t* codes, int64_t rows, int64_t D,
                      float* sums) {
  int64_t j = 0;
  for (; j + 8 <= rows; j += 8) {
    ivec a[8];
    for (int r = 0; r < 8; ++r) a[r] = izero();
    for (int64_t i = 0; i < D; i += 2 * kLanes) {
      const i16x qv = vload_i16(q16 + i);
      for (int r = 0; r < 8; ++r) a[r] = vdot16(a[r], vload_i16(codes + (j + r) * D + i), qv);
    }
    vec f[8];
    for (int r = 0; r < 8; ++r) f[r] = vcvt_i32(a[r]);
    vsum8(f, sums + j);
  }
  for (; j < rows; ++j) {
    ivec a = izero();
    for (int64_t i = 0; i < D; i += 2 * kLanes) a = vdot16(a, vload_i16(codes + j * D + i), vload_i16(q16 + i));
    sums[j] = vsum(vcvt_i32(a));
  }
}

// Whether a head_dim takes the integer path (whole int16 vectors of codes per row)
template <int F>
bool integer_keys(int64_t D) {
  return (F == TM_KV_INT4 && D % (4 * kLanes) == 0) || (F == TM_KV_INT8 && D % (2 * kLanes) == 0);
}

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
  // chunks of rows inside one block, the next prefetched into L1 and the one after into L2
  auto walk = [&](const QuantPages& c, auto fn) {
    for (int64_t p = t.p0, rows; p < t.p1; p += rows) {
      rows = take(p);
      if (p + rows < t.p1) {
        const int64_t r1 = take(p + rows);
        c.prefetch(slot(p + rows), r1, t.h0, t.nh, true);
        if (p + rows + r1 < t.p1) c.prefetch(slot(p + rows + r1), take(p + rows + r1), t.h0, t.nh, false);
      }
      fn(p, rows, slot(p));
    }
  };
  float lo[256], st[256], sums[kRows], rs[kRows], bias[1], mu = 0.f, su = 0.f;
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
          if constexpr (F == TM_KV_INT4) K.block_codes(s0 / BS, h, mc, sc, &mu, &su);
          widen_codes<F>(K, s0, rows, h, sc, codes);
          if constexpr (F == TM_KV_INT8)  // each row's scale
            for (int64_t j = 0; j < rows; ++j) rs[j] = vhalf(K.scale[(s0 + j) * K.Hk + h]);
          for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
            const int16_t* qg = q16.data() + g * D;
            score_i16(qg, codes, rows, D, sums);
            vec mul = vset1(unit[g]), add = vzero();
            if constexpr (F == TM_KV_INT4) {  // (su q . (code sc) + mu q . mc) / A
              score_i16(qg, mc, 1, D, bias);
              mul = vset1(su * unit[g]), add = vset1(bias[0] * mu * unit[g]);
            }
            float* out = scores + g * n + at;
            int64_t j = 0;
            for (; j + kLanes <= rows; j += kLanes) {
              vec x = vfma(vload(sums + j), mul, add);
              vstore(out + j, F == TM_KV_INT8 ? vmul(x, vload(rs + j)) : x);
            }
            for (; j < rows; ++j) {
              const float x = F == TM_KV_INT4 ? (sums[j] * su + bias[0] * mu) * unit[g] : sums[j] * unit[g];
              out[j] = F == TM_KV_INT8 ? x * rs[j] : x;
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
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g)
        score(qf + g * Dp, buf, Dp, rows, D, scores + g * n + at);
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
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g)
        accumulate_rows(scores + g * n + at, buf, Dp, rows, D, acc + g * Dp);
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
                                          int invariant, float* out) {
  const int64_t group = heads / kv_heads, D = head_dim, Dp = (D + kLanes - 1) / kLanes * kLanes;
  const QuantPages K(*k, kv_heads, D, block_size), V(*v, kv_heads, D, block_size);
  const int64_t threads = g_threads;
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, seq_lens[b]), total += seq_lens[b];
  const int64_t nh = batch >= 4 * threads ? kv_heads : 1, units = batch * (kv_heads / nh);
  int64_t splits = 1;  // positions split until there are 4 tasks per thread (>= 256 each)
  while (!invariant && units * splits < 4 * threads && longest / (2 * splits) >= 256) splits *= 2;
  std::vector<Part> parts;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t L = seq_lens[b], start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    for (int64_t h0 = 0; h0 < kv_heads; h0 += nh)
      for (int64_t s = 0; s < splits; ++s)
        parts.push_back({b, h0, nh, start + (L - start) * s / splits,
                         start + (L - start) * (s + 1) / splits, (L - 1) / block_size,
                         stages ? stages[b] : -1});
  }
  auto attend = K.fmt == TM_KV_INT8  ? attend_part<TM_KV_INT8>
                : K.fmt == TM_KV_FP8 ? attend_part<TM_KV_FP8>
                                     : attend_part<TM_KV_INT4>;
  const int64_t per = nh * group, tasks = static_cast<int64_t>(parts.size());
  std::vector<float> m(tasks * per), l(tasks * per), acc(tasks * per * Dp);
  const int64_t work = std::max<int64_t>(1, total / batch / splits * D * per / 8);
  // parts differ in work (sequences of different lengths): handed out as threads come free
  parallel_dynamic(tasks, [&](int64_t t) {
    thread_local std::vector<float> scores, buf, qf;
    scores.resize(((longest + splits - 1) / splits + 1) * per), buf.resize(kRows * Dp);
    qf.assign(per * Dp, 0.f);
    const Part& p = parts[t];
    const float* qb = q + (p.b * heads + p.h0 * group) * D;
    for (int64_t g = 0; g < per; ++g)
      for (int64_t i = 0; i < D; ++i) qf[g * Dp + i] = qb[g * D + i] * scale;
    attend(qf.data(), K, V, block_tables + p.b * max_blocks, p, block_size, group,
           scores.data(), buf.data(), acc.data() + t * per * Dp, m.data() + t * per,
           l.data() + t * per);
  }, std::max<int64_t>(1, (1 << 14) / work));
  // combine each query head's splits: out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
  for (int64_t t = 0; t < tasks; t += splits) {
    const Part& p = parts[t];
    for (int64_t g = 0; g < per; ++g) {
      float M = -INFINITY, denom = 0.f;
      for (int64_t s = 0; s < splits; ++s)
        if (parts[t + s].p1 > parts[t + s].p0) M = std::max(M, m[(t + s) * per + g]);
      float* o = out + (p.b * heads + p.h0 * group + g) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        if (parts[t + s].p1 <= parts[t + s].p0) continue;
        const float w = std::exp(m[(t + s) * per + g] - M);
        denom += w * l[(t + s) * per + g];
        const float* a = acc.data() + ((t + s) * per + g) * Dp;
        for (int64_t i = 0; i < D; ++i) o[i] += w * a[i];
      }
      for (int64_t i = 0; i < D; ++i) o[i] /= denom;
    }
  }
}
