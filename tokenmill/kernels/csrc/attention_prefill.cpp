// tokenmill CPU kernels: causal attention of a prefill chunk against its paged history (its own
// K/V already stored), flash-attention style: for a tile of query positions and the query heads
// of one KV head, walk the keys a tile at a time, keeping each row's running maximum, sum and
// float32 output; no (queries x keys) matrix and no gathered copy of the cache. Quantized pages
// (kv_pages.h) are dequantized a key tile at a time, so a long quantized prefix never exists
// in float as a whole; int4 K tiles of a block are read from the stage for the queries in that
// block and quantized for the queries after it.
#include <type_traits>

#include "attention_prefill_int.h"
#include "attention_tiles.h"
#include "kv_pages.h"
#include "tm.h"
#include "vec.h"
// The rows-in-lanes path (attention_prefill_lanes.h) for bf16 caches: on AMX tiles, else on
// VDPBF16PS; TM_AMX_EMULATED turns the AMX one on in a build whose tile instructions are
// emulated in C++ (tests/test_amx_emulated.py only)
#if defined(TM_ISA_AVX512_BF16) || defined(TM_AMX_EMULATED)
#define TM_LANES_ATTENTION
#include "prefill_lanes.h"
#endif

namespace tm {

constexpr int64_t kQueryTile = 32;  // query positions per task (x the GQA group's heads)

struct PrefillScratch {
  std::vector<float> q, kt, v, s, m, l, o;
  std::vector<uint32_t> qp, kp, vp, pp, vt;  // bf16 pairs (the dot-product and lanes paths)
  std::vector<uint32_t> on;  // the lanes path: whether a group's output holds anything yet
#ifdef TM_PREFILL_INT
  IntTile it;  // int8 / int4 pages
#endif
};

#ifdef TM_LANES_ATTENTION
template <typename Task>  // lanes_prefill_tile on AMX tiles or VDPBF16PS (below)
void lanes_tile(const Task& t, int64_t h, int64_t i0, int64_t rows, PrefillScratch& sc);
#endif

template <typename T>
struct PrefillTask {
  const T* q;  // (tokens, Hq, D)
  const T *kc, *vc;
  const int64_t* table;
  int64_t Hq, Hk, D, BS, computed, window;
  float scale;
  T* out;
  const QuantPages *kq = nullptr, *vq = nullptr;  // quantized pages instead of kc, vc
  const int64_t* stage_table = nullptr;          // int4 K: each block's stage slot
#ifdef TM_LANES_ATTENTION
  const LaneKeys* lanes = nullptr;  // the lanes path's keys, made once per call
#endif

  static constexpr bool kDot =
#ifdef TM_ISA_AVX512_BF16
      std::is_same_v<T, bf16>;
#else
      false;
#endif

  int64_t Dp() const { return (D + kLanes - 1) / kLanes * kLanes; }
  int64_t at(int64_t h, int64_t pos) const { return ((table[pos / BS] * BS + pos % BS) * Hk + h) * D; }

  // keys [p, p + n) (one block's) of KV head h: K transposed (kt[d][j], or bf16 pairs
  // kp[d/2][j]), V widened to v[j][0:Dp]; keys past n are zero. staged: int4 K from the stage
  void load_keys(int64_t h, int64_t p, int64_t n, PrefillScratch& sc, bool staged = false) const {
    if (kDot && !kq) std::fill(sc.vp.begin(), sc.vp.end(), 0u);
    else std::fill(sc.v.begin(), sc.v.end(), 0.f);
    if (kDot) std::fill(sc.kp.begin(), sc.kp.end(), 0u);
    else std::fill(sc.kt.begin(), sc.kt.end(), 0.f);
    float lo[256], st[256];
    if (kq && kq->fmt == TM_KV_INT4 && !staged) kq->block_params(table[p / BS], h, lo, st);
    for (int64_t j = 0; j < n; ++j) {
      if (kq) {  // the key row dequantized (through v's scratch row), then the value row
        const int64_t slot = table[(p + j) / BS] * BS + (p + j) % BS;
        float* row = sc.v.data() + j * Dp();
        if (kq->fmt != TM_KV_INT4) dequant_row(*kq, slot, h, row);
        else if (staged) kq->stage_row(stage_table[p / BS], (p + j) % BS, h, row);
        else kq->row_k4(slot, h, lo, st, row);
        if constexpr (kDot)  // rounded to bf16 pairs, as a bf16 model's cache would hold them
          for (int64_t d = 0; d < D / 2; ++d)
            sc.kp[d * kKeys + j] = to_bf16(row[2 * d]).bits | uint32_t{to_bf16(row[2 * d + 1]).bits} << 16;
        else
          for (int64_t d = 0; d < D; ++d) sc.kt[d * kKeys + j] = row[d];
        dequant_row(*vq, slot, h, row);
        continue;
      }
      const T* k = kc + at(h, p + j);
      if constexpr (kDot) {
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(k);
        for (int64_t d = 0; d < D / 2; ++d) sc.kp[d * kKeys + j] = pairs[d];
      } else {
        for (int64_t d = 0; d < D; ++d) sc.kt[d * kKeys + j] = to_f(k[d]);
      }
      const T* v = vc + at(h, p + j);
      if constexpr (kDot) {
        if (j % 2 == 0) value_pair(v, j + 1 < n ? vc + at(h, p + j + 1) : nullptr, sc.vp.data() + j / 2 * Dp());
        continue;
      }
      float* dst = sc.v.data() + j * Dp();
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) vstore(dst + d, vload(v + d));
      for (; d < D; ++d) dst[d] = to_f(v[d]);
    }
  }

  // vp[d] = (a[d], b[d]): the value rows of two keys (b null: a zero key) as bf16 pairs
  void value_pair(const T* a, const T* b, uint32_t* vp) const {
    if constexpr (std::is_same_v<T, bf16>) {
      int64_t d = 0;
#ifdef TM_ISA_AVX512_BF16
      for (; d + kLanes <= D; d += kLanes) {
        __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
        __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)))
                       : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
#endif
      for (; d < D; ++d) vp[d] = a[d].bits | (b ? uint32_t{b[d].bits} << 16 : 0u);
    }
  }

  // int8 / int4 pages whose tiles take integer dot products (attention_prefill_int.h)
  bool int_pages() const {
#ifdef TM_PREFILL_INT
    return kq && (kq->fmt == TM_KV_INT8 || kq->fmt == TM_KV_INT4) && D % 64 == 0 && D <= 256;
#else
    return false;
#endif
  }

  // query tile [i0, i0 + rows) x the `group` query heads of KV head h
  void run(int64_t h, int64_t i0, int64_t rows, PrefillScratch& sc) const {
#ifdef TM_LANES_ATTENTION
    if constexpr (std::is_same_v<T, bf16>)
      if (lanes) return lanes_tile(*this, h, i0, rows, sc);
#endif
    const int64_t group = Hq / Hk, R = rows * group, Dp = this->Dp();
    const bool ints = int_pages();
    sc.kt.resize(D * kKeys), sc.kp.resize(D / 2 * kKeys), sc.v.resize(kKeys * Dp);
    sc.vp.resize(kKeys / 2 * Dp), sc.pp.resize(kTileRows * kKeys / 2);
    sc.s.resize(R * kKeys), sc.m.assign(R, -INFINITY), sc.l.assign(R * kLanes, 0.f);
    sc.o.assign(R * Dp, 0.f), sc.q.resize(R * D), sc.qp.resize(R * D / 2);
    for (int64_t r = 0; r < R; ++r) {  // row r: position i0 + r / group, head h * group + r % group
      const T* src = q + ((i0 + r / group) * Hq + h * group + r % group) * D;
      if constexpr (kDot) std::memcpy(sc.qp.data() + r * D / 2, src, D * sizeof(T));
      if (!kDot || ints)
        for (int64_t d = 0; d < D; ++d) sc.q[r * D + d] = to_f(src[d]);
    }
#ifdef TM_PREFILL_INT
    if (ints) sc.it.set_queries(sc.q.data(), R, D, kq->fmt == TM_KV_INT4);
#endif
    std::vector<float> corr(kTileRows);
    int64_t first = computed + i0, last = computed + i0 + rows - 1;  // query positions
    int64_t p = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
    // rows [r0, r1) against the loaded key tile [p, p + n); int_keys: its integer keys
    auto attend_rows = [&](int64_t p, int64_t n, int64_t r0, int64_t r1, bool int_keys) {
      for (; r0 < r1; r0 += kTileRows) {
        int64_t rb = std::min<int64_t>(kTileRows, r1 - r0);
        float* s = sc.s.data() + r0 * kKeys;
        for_rows<kTileRows>(rb, [&](auto c) {
#ifdef TM_PREFILL_INT
          if (int_keys) return sc.it.template scores<c>(r0, scale, s);
#endif
          if constexpr (kDot) {
#ifdef TM_ISA_AVX512_BF16
            scores_dot<c>(sc.qp.data() + r0 * D / 2, D / 2, sc.kp.data(), D / 2, scale, s);
#endif
          } else {
            scores_fma<c>(sc.q.data() + r0 * D, D, sc.kt.data(), D, scale, s);
          }
        });
        for (int64_t i = 0; i < rb; ++i)
          corr[i] = softmax_step(s + i * kKeys, r0 + i, computed + i0 + (r0 + i) / group, p, n, sc);
        for (int64_t i = 0; i < rb; i += kValueRows)
          for_rows<kValueRows>(std::min<int64_t>(kValueRows, rb - i), [&](auto c) {
            float* o = sc.o.data() + (r0 + i) * Dp;
#ifdef TM_PREFILL_INT
            if (ints) return sc.it.template values<c>(s + i * kKeys, corr.data() + i, n, o, Dp);
#endif
            if constexpr (kDot) {
#ifdef TM_ISA_AVX512_BF16
              if (!kq) return values_dot<c>(s + i * kKeys, corr.data() + i, sc.vp.data(), n, Dp,
                                            sc.pp.data(), o);
#endif
            }
            values_fma<c>(s + i * kKeys, corr.data() + i, sc.v.data(), n, Dp, o);
          });
      }
    };
    const bool staged = kq && kq->fmt == TM_KV_INT4;
    for (int64_t n; p <= last; p += n) {
      n = std::min({kKeys, BS - p % BS, last + 1 - p});
      // rows whose position comes before the tile see none of it: start past them
      const int64_t r0 = std::max<int64_t>(0, p - first) * group;
      // int4: rows in the tile's block read it from the stage, later rows quantized
      const int64_t split = staged ? std::clamp<int64_t>(((p / BS + 1) * BS - first) * group, r0, R) : r0;
#ifdef TM_PREFILL_INT
      if (ints) sc.it.load(*kq, *vq, table[p / BS] * BS + p % BS, n, h, split, R);
#endif
      if (split > r0) {
        load_keys(h, p, n, sc, true);
        attend_rows(p, n, r0, split, false);
      }
      if (R > split) {
        if (!ints) load_keys(h, p, n, sc);
        attend_rows(p, n, split, R, ints);
      }
    }
    write_rows(h, i0, R, Dp, sc, ints);
  }

  // rows [0, R) of the tile's outputs (sc.o, rows ld apart; permuted: the integer path's
  // channel order) divided by their sums, to out
  void write_rows(int64_t h, int64_t i0, int64_t R, int64_t ld, const PrefillScratch& sc,
                  bool permuted = false) const {
    const int64_t group = Hq / Hk;
    for (int64_t r = 0; r < R; ++r) {
      T* dst = out + ((i0 + r / group) * Hq + h * group + r % group) * D;
      float inv = 1.f / vsum(vload(sc.l.data() + r * kLanes));
      for (int64_t d = 0; d < D; ++d) {
#ifdef TM_PREFILL_INT
        if (permuted) {
          dst[channel_of(kq->fmt == TM_KV_INT4, d / kLanes, d % kLanes, D)] = from_f<T>(sc.o[r * ld + d] * inv);
          continue;
        }
#endif
        dst[d] = from_f<T>(sc.o[r * ld + d] * inv);
      }
    }
  }

  // row r's online softmax step (online_softmax, attention_tiles.h)
  float softmax_step(float* sr, int64_t r, int64_t qpos, int64_t p, int64_t n,
                     PrefillScratch& sc) const {
    return online_softmax(sr, qpos, p, n, window, sc.m[r], sc.l.data() + r * kLanes);
  }
};

}  // namespace tm

#ifdef TM_LANES_ATTENTION
#include "attention_prefill_lanes.h"  // lanes_tile
#endif

namespace tm {

template <typename T>
void prefill_attention(PrefillTask<T> t, int64_t n_new) {
#ifdef TM_LANES_ATTENTION
  thread_local LaneKeys keys;  // the caller's: the same buffers call after call
  if constexpr (std::is_same_v<T, bf16>)
    if (!t.kq && t.D % 32 == 0) {
      keys.make(t, t.window > 0 ? std::max<int64_t>(0, t.computed - t.window + 1) : 0,
                t.computed + n_new);
      t.lanes = &keys;
    }
#endif
  int64_t tiles = (n_new + kQueryTile - 1) / kQueryTile;
  parallel_dynamic(t.Hk * tiles, [&](int64_t i) {
    thread_local PrefillScratch sc;
    int64_t tile = tiles - 1 - i / t.Hk, h = i % t.Hk;  // the longest tiles first
    t.run(h, tile * kQueryTile, std::min(kQueryTile, n_new - tile * kQueryTile), sc);
  });
#ifdef TM_LANES_ATTENTION
  // up to 64 MiB kept (SmolLM2's keys of 87,000 tokens): a freed copy costs the next call its
  // page faults and zeroing (128 new after 30,000 cached, 23 MB: 15.7 -> 18.6 ms a layer)
  keys.release_above(size_t{64} << 20);
#endif
}

}  // namespace tm

using namespace tm;

extern "C" void tm_prefill_attention(int dtype, const void* q, int64_t n_new, int64_t heads,
                                     int64_t head_dim, const void* k_cache, const void* v_cache,
                                     int64_t block_size, int64_t kv_heads,
                                     const int64_t* block_table, int64_t num_computed,
                                     int64_t window, float scale, void* out) {
  if (dtype == TM_BF16) {
    PrefillTask<bf16> t{static_cast<const bf16*>(q), static_cast<const bf16*>(k_cache),
                        static_cast<const bf16*>(v_cache), block_table, heads, kv_heads,
                        head_dim, block_size, num_computed, window, scale,
                        static_cast<bf16*>(out)};
    return prefill_attention(t, n_new);
  }
  PrefillTask<float> t{static_cast<const float*>(q), static_cast<const float*>(k_cache),
                       static_cast<const float*>(v_cache), block_table, heads, kv_heads,
                       head_dim, block_size, num_computed, window, scale,
                       static_cast<float*>(out)};
  prefill_attention(t, n_new);
}

extern "C" void tm_prefill_attention_quant(int dtype, const void* q, int64_t n_new, int64_t heads,
                                           int64_t head_dim, const tm_kv_pages* k,
                                           const tm_kv_pages* v, int64_t block_size,
                                           int64_t kv_heads, const int64_t* block_table,
                                           const int64_t* stage_table, int64_t num_computed,
                                           int64_t window, float scale, void* out) {
  const QuantPages K(*k, kv_heads, head_dim, block_size), V(*v, kv_heads, head_dim, block_size);
  if (dtype == TM_BF16) {  // keys rounded to bf16: the dot-product scores where the ISA has them
    PrefillTask<bf16> t{static_cast<const bf16*>(q), nullptr, nullptr, block_table, heads,
                        kv_heads, head_dim, block_size, num_computed, window, scale,
                        static_cast<bf16*>(out), &K, &V, stage_table};
    return prefill_attention(t, n_new);
  }
  PrefillTask<float> t{static_cast<const float*>(q), nullptr, nullptr, block_table, heads,
                       kv_heads, head_dim, block_size, num_computed, window, scale,
                       static_cast<float*>(out), &K, &V, stage_table};
  prefill_attention(t, n_new);
}
