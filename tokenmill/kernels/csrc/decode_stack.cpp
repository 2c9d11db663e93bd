// tokenmill CPU kernels: every decoder layer of a step in one call: its decode rows, then its
// prefill chunks (an unquantized cache). The same kernels in the same order as the Python
// model (models/llama.py, LlamaDecoderLayer, and models/gemma3.py, Gemma3DecoderLayer),
// reading the named per-layer weights of a tm_decoder (tm.h); running the layer loop here saves
// the Python overhead of ~15 small ops per layer, which dominates small models' decode steps,
// and the allocations and wrappers of a prompt's ~10 ops per layer.
#include "internal.h"
#include "tm.h"
#include "vec.h"

namespace tm {

struct Scratch {  // the step's activations, reused from call to call
  std::vector<char> residual, h, qkv, q, k, v, attn, gate_up, act, f32;
  template <typename T> T* get(std::vector<char>& b, int64_t n) {
    b.resize(n * sizeof(T));
    return reinterpret_cast<T*>(b.data());
  }
};

// One layer on a quantized cache: store the new K/V, attend; q/k/v/attn in the model's dtype.
template <typename T>
void quant_kv_layer(const tm_decoder& m, int64_t l, const T* q, const T* k, const T* v, T* attn,
                    int64_t B, const tm_kv_pool& pool, int64_t BS, int64_t window,
                    std::vector<char>& scratch) {
  const int64_t Hk = m.kv_heads, D = m.head_dim, Hq = m.heads;
  const bool int4 = m.kv_format == TM_KV_INT4;
  const int64_t code_bytes = int4 ? D / 2 : D, rows = pool.num_blocks * BS * Hk;
  char* kc = static_cast<char*>(pool.k) + l * rows * code_bytes;
  char* vc = static_cast<char*>(pool.v) + l * rows * code_bytes;
  const int sd = m.dtype;  // the stage holds the model's dtype
  tm_kv_pages kp{m.kv_format, kc, int4 ? nullptr : m.k_scale + l * rows, nullptr, nullptr, sd};
  if (int4) {
    kp.params = m.k_params + l * pool.num_blocks * Hk * (2 * D + 4);
    kp.stage = static_cast<char*>(m.k_stage) + l * m.stage_slots * BS * Hk * D * (sd == TM_BF16 ? 2 : 4);
  }
  const tm_kv_pages vp{int4 ? TM_KV_INT4V : m.kv_format, vc, m.v_scale + l * rows, nullptr,
                       nullptr, sd};
  scratch.resize(sizeof(float) * B * (2 * Hq + 2 * Hk) * D);
  float* f = reinterpret_cast<float*>(scratch.data());
  float *qf = f, *of = f + B * Hq * D, *kf = of + B * Hq * D, *vf = kf + B * Hk * D;
  for (int64_t i = 0; i < B * Hk * D; ++i) kf[i] = to_f(k[i]), vf[i] = to_f(v[i]);
  tm_kv_store(kp.format, kf, B, Hk, D, nullptr, pool.slots, pool.stage_rows, BS, &kp);
  tm_kv_store(vp.format, vf, B, Hk, D, m.v_rotation, pool.slots, nullptr, BS, &vp);
  for (int64_t i = 0; i < B * Hq * D; ++i) qf[i] = to_f(q[i]);
  tm_decode_attention_quant(qf, &kp, &vp, BS, Hk, pool.tables, pool.max_blocks, pool.lens,
                            pool.stages, B, Hq, D, window, m.scale, of);
  if (m.v_rotation) rotate_rows(of, B * Hq, D, m.v_rotation, true);
  for (int64_t i = 0; i < B * Hq * D; ++i) attn[i] = from_f<T>(of[i]);
}

// cache rows[slots[t]] = x[t], rows of `width` values
template <typename T>
void store_slots(T* cache, const T* x, const int64_t* slots, int64_t tokens, int64_t width) {
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(cache + slots[t] * width, x + t * width, width * sizeof(T));
}

// One layer's attention of an unquantized cache: the rotated q (B, heads, D) of the step's
// decode rows (tables / lens rows 0..decodes - 1) and then its chunks (chunk c the rows
// [starts[c], starts[c + 1]), tables / lens row decodes + c) -> attn; their K/V stored already
template <typename T>
void layer_attention(const tm_decoder& m, const T* q, const T* kc, const T* vc, T* attn,
                     int64_t decodes, const int64_t* starts, int64_t chunks,
                     const tm_kv_pool& pool, int64_t BS, int64_t window) {
  const int64_t Hq = m.heads, D = m.head_dim, dt = m.dtype;
  if (decodes)
    tm_decode_attention(dt, q, kc, vc, BS, m.kv_heads, pool.tables, pool.max_blocks, pool.lens,
                        decodes, Hq, D, window, m.scale, attn);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t row = decodes + c, n = starts[c + 1] - starts[c];
    tm_prefill_attention(dt, q + starts[c] * Hq * D, n, Hq, D, kc, vc, BS, m.kv_heads,
                         pool.tables + row * pool.max_blocks, pool.lens[row] - n, window,
                         m.scale, attn + starts[c] * Hq * D);
  }
}

// The last layer's attention for the output rows alone, out_rows[i] into attn row i: the
// decode rows (out_rows begins with them) as one batch, each chunk row as a one-row chunk at
// its position (a query row's numbers do not depend on the rows beside it in the prefill
// kernel: a prompt gives the same bits however it is chunked).
template <typename T>
void output_attention(const tm_decoder& m, const T* q, const T* kc, const T* vc, T* attn,
                      int64_t decodes, const int64_t* starts, const tm_kv_pool& pool,
                      int64_t BS, int64_t window, const int64_t* out_rows, int64_t outs) {
  const int64_t Hq = m.heads, D = m.head_dim;
  layer_attention(m, q, kc, vc, attn, decodes, starts, 0, pool, BS, window);
  for (int64_t i = decodes, c = 0; i < outs; ++i) {
    const int64_t r = out_rows[i];
    while (starts[c + 1] <= r) ++c;
    const int64_t row = decodes + c;  // its chunk's tables / lens row
    tm_prefill_attention(m.dtype, q + r * Hq * D, 1, Hq, D, kc, vc, BS, m.kv_heads,
                         pool.tables + row * pool.max_blocks, pool.lens[row] - (starts[c + 1] - r),
                         window, m.scale, attn + i * Hq * D);
  }
}

// Rows out_rows[i] of x (rows of `width`) moved to row i (out_rows ascending); the prompt row
// ranges of the rows kept, renumbered, into kept (begin, end pairs); returns their count.
template <typename T>
int64_t compact_rows(T* x, int64_t width, const int64_t* out_rows, int64_t outs,
                     const int64_t* prompt, int64_t ranges, std::vector<int64_t>& kept) {
  kept.clear();
  for (int64_t i = 0, j = 0; i < outs; ++i) {
    const int64_t r = out_rows[i];
    if (r != i) std::memmove(x + i * width, x + r * width, width * sizeof(T));
    while (j < ranges && prompt[2 * j + 1] <= r) ++j;
    if (j == ranges || prompt[2 * j] > r) continue;
    if (!kept.empty() && kept.back() == i) kept.back() = i + 1;  // extends the last range
    else kept.insert(kept.end(), {i, i + 1});
  }
  return static_cast<int64_t>(kept.size() / 2);
}

template <typename T>
void decode_stack(const tm_decoder& m, T* x, int64_t B, const int64_t* positions,
                  const tm_kv_pool* pools, int64_t BS, const int64_t* starts, int64_t chunks,
                  const int64_t* prompt, int64_t ranges, const int64_t* out_rows,
                  int64_t outs) {
  const int64_t decodes = chunks ? starts[0] : B;
  int64_t rows = B;  // the rows a layer computes: all, but out_rows from the last attention on
  std::vector<int64_t> kept;  // then the prompt ranges of out_rows
  auto linear = [&](const T* in, const tm_linear& w, T* out) {
    tm_linear_fwd(m.dtype, in, rows, &w, m.dtype, out, prompt, ranges);
  };
  thread_local Scratch s;
  const int dt = m.dtype;
  const int64_t H = m.hidden, D = m.head_dim, qs = m.heads * D, kvs = m.kv_heads * D;
  const int64_t qkv_w = qs + 2 * kvs, I = m.intermediate;
  T* res = s.get<T>(s.residual, B * H);
  T* h = s.get<T>(s.h, B * H);
  T* qkv = s.get<T>(s.qkv, B * qkv_w);
  T* q = s.get<T>(s.q, B * qs);
  T* k = s.get<T>(s.k, B * kvs);
  T* v = s.get<T>(s.v, B * kvs);
  T* attn = s.get<T>(s.attn, B * qs);
  T* gu = s.get<T>(s.gate_up, B * 2 * I);
  T* act = s.get<T>(s.act, B * I);
  std::memcpy(res, x, B * H * sizeof(T));
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const tm_layer& w = m.layers[l];
    const tm_kv_pool& pool = pools[w.pool];
    const float* cos_sin = w.cos_sin ? w.cos_sin : m.cos_sin;
    tm_rms_norm(dt, res, w.input_norm, l == 0 ? nullptr : h, x, B, H, m.eps);  // res += h
    linear(x, w.qkv, qkv);
    const int64_t layer_elems = m.kv_format ? 0 : pool.num_blocks * BS * kvs;  // else codes
    T* kc = static_cast<T*>(pool.k) + w.pool_layer * layer_elems;
    T* vc = static_cast<T*>(pool.v) + w.pool_layer * layer_elems;
    if (!w.q_norm && !m.kv_format) {  // RoPE, the split and the cache writes in one pass
      tm_rope_store(dt, qkv, qkv_w, B, m.heads, m.kv_heads, D, cos_sin, m.max_positions,
                    positions, q, k, kc, vc, pool.slots);
    } else {
      for (int64_t b = 0; b < B; ++b) {  // split q | k | v
        std::memcpy(q + b * qs, qkv + b * qkv_w, qs * sizeof(T));
        std::memcpy(k + b * kvs, qkv + b * qkv_w + qs, kvs * sizeof(T));
        std::memcpy(v + b * kvs, qkv + b * qkv_w + qs + kvs, kvs * sizeof(T));
      }
      if (w.q_norm) {
        tm_rms_norm(dt, q, w.q_norm, nullptr, q, B * m.heads, D, m.eps);
        tm_rms_norm(dt, k, w.k_norm, nullptr, k, B * m.kv_heads, D, m.eps);
      }
      tm_rope(dt, q, B, m.heads, D, cos_sin, m.max_positions, positions);
      tm_rope(dt, k, B, m.kv_heads, D, cos_sin, m.max_positions, positions);
      if (!m.kv_format) {
        store_slots(kc, k, pool.slots, B, kvs);
        store_slots(vc, v, pool.slots, B, kvs);
      }
    }
    if (m.kv_format) {  // decode rows only, one pool (FusedDecoder.accepts)
      quant_kv_layer(m, w.pool_layer, q, k, v, attn, B, pool, BS, w.window, s.f32);
    } else if (out_rows && l == m.num_layers - 1) {
      // the last layer's outputs matter only for the rows whose logits the step takes: every
      // row's K/V is stored; from attention on, those rows alone, compacted to the front
      output_attention(m, q, kc, vc, attn, decodes, starts, pool, BS, w.window, out_rows, outs);
      ranges = compact_rows(res, H, out_rows, outs, prompt, ranges, kept);
      prompt = kept.data();
      rows = outs;
      if (!rows) return;  // no row's output is used (chunks before their prompts' ends)
    } else {
      layer_attention(m, q, kc, vc, attn, decodes, starts, chunks, pool, BS, w.window);
    }
    linear(attn, w.o, h);
    if (w.pre_ffn_norm) {  // Gemma: norm the attention output, add, norm again
      tm_rms_norm(dt, h, w.post_norm, nullptr, x, rows, H, m.eps);
      tm_rms_norm(dt, res, w.pre_ffn_norm, x, x, rows, H, m.eps);  // res += x, x = norm(res)
    } else {
      tm_rms_norm(dt, res, w.post_norm, h, x, rows, H, m.eps);  // res += attention output
    }
    if (w.gate_up.gated) {  // silu(gate) x up straight from the GEMM
      linear(x, w.gate_up, act);
    } else {
      linear(x, w.gate_up, gu);
      if (m.act == TM_ACT_GELU_TANH)
        tm_gelu_tanh_mul(dt, gu, act, rows, I);
      else
        tm_silu_mul(dt, gu, act, rows, I);
    }
    linear(act, w.down, h);
    if (w.post_ffn_norm) {
      tm_rms_norm(dt, h, w.post_ffn_norm, nullptr, x, rows, H, m.eps);
      std::memcpy(h, x, rows * H * sizeof(T));
    }
  }
  tm_rms_norm(dt, res, m.final_norm, h, x, rows, H, m.eps);
}

}  // namespace tm

using namespace tm;

extern "C" void tm_decode_stack(const tm_decoder* m, void* x, int64_t batch,
                                const int64_t* positions, const tm_kv_pool* pools,
                                int64_t block_size, const int64_t* chunk_starts,
                                int64_t chunks, const int64_t* prompt_rows, int64_t ranges,
                                const int64_t* out_rows, int64_t outs) {
  Team::run(g_threads, [&] {  // the step's parallel loops as one team's jobs (team.h)
    if (m->dtype == TM_BF16)
      return decode_stack(*m, static_cast<bf16*>(x), batch, positions, pools, block_size,
                          chunk_starts, chunks, prompt_rows, ranges, out_rows, outs);
    decode_stack(*m, static_cast<float*>(x), batch, positions, pools, block_size, chunk_starts,
                 chunks, prompt_rows, ranges, out_rows, outs);
  });
}
