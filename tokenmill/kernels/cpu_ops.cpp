// tokenmill CPU kernels: the decoder stack of a decode step and the Python module (see cpu_ops.h).

#include "cpu_ops.h"

using namespace tokenmill;

// ---- the whole decoder stack for a decode-only step ------------------------------------------
// Same kernels, same order as the Python model (models/llama.py); running the layer loop here
// saves ~200 us of Python per layer. Per layer, `weights` holds kLayerTensors entries:
// input_norm, qkv_w, qkv_b, o_w, post_norm, gate_up_w, down_w, q_norm, k_norm (an empty tensor
// where a model has none); the projection weights packed by ops.pack_weight.
constexpr int64_t kLayerTensors = 9;

// cache.view(-1, heads, head_dim)[slots[t]] = x[t]: plain row copies.
void store_slots(torch::Tensor cache, const torch::Tensor& x, const torch::Tensor& slots) {
  int64_t row_bytes = x[0].numel() * x.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) std::memcpy(dst + s[t] * row_bytes, src + t * row_bytes, row_bytes);
}

torch::Tensor decode_stack(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin,
                           std::vector<torch::Tensor> weights, std::vector<int64_t> windows,
                           torch::Tensor final_norm, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor slots,
                           torch::Tensor block_tables, torch::Tensor seq_lens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                           double scale) {
  int64_t B = x.size(0), hidden = x.size(1), layers = static_cast<int64_t>(windows.size());
  int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto opt = [](const torch::Tensor& t) {
    return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
  };
  torch::Tensor residual = x.clone(), h;
  auto slot_ids = slots.to(torch::kInt64).contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = &weights[l * kLayerTensors];
    h = l == 0 ? ::rms_norm(residual, w[0], eps, c10::nullopt)
               : ::rms_norm(residual, w[0], eps, h);  // residual += h, then normalize
    auto qkv = ::linear(h, w[1], opt(w[2]), q_size + 2 * kv_size, false);
    auto q = qkv.narrow(1, 0, q_size).reshape({B, num_heads, head_dim}).contiguous();
    auto k = qkv.narrow(1, q_size, kv_size).reshape({B, num_kv_heads, head_dim}).contiguous();
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({B, num_kv_heads, head_dim});
    if (w[7].numel()) {
      q = ::rms_norm(q, w[7], eps, c10::nullopt);
      k = ::rms_norm(k, w[8], eps, c10::nullopt);
    }
    ::rope(q, cos_sin, positions);
    ::rope(k, cos_sin, positions);
    auto kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    store_slots(kc, k, slot_ids);
    store_slots(vc, v.contiguous(), slot_ids);
    auto attn = ::decode_attention(q, kc, vc, block_tables, seq_lens, windows[l], scale);
    h = ::linear(attn.view({B, q_size}), w[3], c10::nullopt, hidden, false);
    auto normed = ::rms_norm(residual, w[4], eps, h);
    auto gate_up = ::linear(normed, w[5], c10::nullopt, 2 * intermediate, false);
    h = ::linear(::silu_mul(gate_up), w[6], c10::nullopt, hidden, false);
  }
  return ::rms_norm(residual, final_norm, eps, h);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel releases the GIL (none touches Python objects): while a step runs, the
  // server's event loop keeps streaming the previous step's tokens.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("decode_stack", &decode_stack, "all decoder layers of a decode-only step", release());
  m.def("linear", &::linear, "x @ w.T (+ bias) on panel-packed float32/bfloat16 weights",
        release());
  m.def("rms_norm", &::rms_norm, "RMSNorm, optionally fused with the residual add", release());
  m.def("rope", &::rope, "rotary embedding in place (rotate-half layout)", release());
  m.def("silu_mul", &::silu_mul, "silu(gate) * up from a fused [gate | up] tensor", release());
  m.def("argmax_rows", &::argmax_rows, "first index of each row's maximum (float32)",
        release());
  m.def("decode_attention", &::decode_attention, "paged attention for one query per sequence",
        release());
}
