// tokenmill CPU kernels: every decoder layer of a decode-only step in one call. The same
// kernels in the same order as the Python model (models/llama.py, LlamaDecoderLayer), reading
// the named per-layer weights of a tm_decoder (tm.h); running the layer loop here saves the
// Python overhead of ~15 small ops per layer, which dominates small models' decode steps.
#include "tm.h"
#include "vec.h"

namespace tm {

struct Scratch {  // the step's activations, reused from call to call
  std::vector<char> residual, h, qkv, q, k, v, attn, gate_up, act;
  template <typename T> T* get(std::vector<char>& b, int64_t n) {
    b.resize(n * sizeof(T));
    return reinterpret_cast<T*>(b.data());
  }
};

// cache rows[slots[t]] = x[t], rows of `width` values
template <typename T>
void store_slots(T* cache, const T* x, const int64_t* slots, int64_t tokens, int64_t width) {
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(cache + slots[t] * width, x + t * width, width * sizeof(T));
}

template <typename T>
void decode_stack(const tm_decoder& m, T* x, int64_t B, const int64_t* positions, T* k_cache,
                  T* v_cache, int64_t layer_elems, int64_t BS, const int64_t* slots,
                  const int64_t* tables, int64_t max_blocks, const int64_t* lens) {
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
    tm_rms_norm(dt, res, w.input_norm, l == 0 ? nullptr : h, x, B, H, m.eps);  // res += h
    tm_linear_fwd(dt, x, B, &w.qkv, dt, qkv);
    for (int64_t b = 0; b < B; ++b) {  // split q | k | v
      std::memcpy(q + b * qs, qkv + b * qkv_w, qs * sizeof(T));
      std::memcpy(k + b * kvs, qkv + b * qkv_w + qs, kvs * sizeof(T));
      std::memcpy(v + b * kvs, qkv + b * qkv_w + qs + kvs, kvs * sizeof(T));
    }
    if (w.q_norm) {
      tm_rms_norm(dt, q, w.q_norm, nullptr, q, B * m.heads, D, m.eps);
      tm_rms_norm(dt, k, w.k_norm, nullptr, k, B * m.kv_heads, D, m.eps);
    }
    tm_rope(dt, q, B, m.heads, D, m.cos_sin, m.max_positions, positions);
    tm_rope(dt, k, B, m.kv_heads, D, m.cos_sin, m.max_positions, positions);
    T* kc = k_cache + l * layer_elems;
    T* vc = v_cache + l * layer_elems;
    store_slots(kc, k, slots, B, kvs);
    store_slots(vc, v, slots, B, kvs);
    tm_decode_attention(dt, q, kc, vc, BS, m.kv_heads, tables, max_blocks, lens, B, m.heads, D,
                        w.window, m.scale, attn);
    tm_linear_fwd(dt, attn, B, &w.o, dt, h);
    tm_rms_norm(dt, res, w.post_norm, h, x, B, H, m.eps);  // res += attention output
    tm_linear_fwd(dt, x, B, &w.gate_up, dt, gu);
    tm_silu_mul(dt, gu, act, B, I);
    tm_linear_fwd(dt, act, B, &w.down, dt, h);
  }
  tm_rms_norm(dt, res, m.final_norm, h, x, B, H, m.eps);
}

}  // namespace tm

using namespace tm;

extern "C" void tm_decode_stack(const tm_decoder* m, void* x, int64_t batch,
                                const int64_t* positions, void* k_cache, void* v_cache,
                                int64_t num_blocks, int64_t block_size, const int64_t* slots,
                                const int64_t* block_tables, int64_t max_blocks,
                                const int64_t* seq_lens) {
  int64_t layer_elems = num_blocks * block_size * m->kv_heads * m->head_dim;
  if (m->dtype == TM_BF16)
    return decode_stack(*m, static_cast<bf16*>(x), batch, positions, static_cast<bf16*>(k_cache),
                        static_cast<bf16*>(v_cache), layer_elems, block_size, slots,
                        block_tables, max_blocks, seq_lens);
  decode_stack(*m, static_cast<float*>(x), batch, positions, static_cast<float*>(k_cache),
               static_cast<float*>(v_cache), layer_elems, block_size, slots, block_tables,
               max_blocks, seq_lens);
}
