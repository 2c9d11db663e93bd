// A command-line front for the kernel library's C interface (tokenmill/kernels/csrc/tm.h), so
// that builds this machine cannot load (NEON, cross-compiled and run under qemu) are checked
// against the PyTorch references: tests/test_kernels_arm.py writes each call's inputs as raw
// files, runs `harness KERNEL DIR`, and compares DIR/out.bin with the reference.
//
// DIR/params.txt holds the call's sizes; inputs are DIR/in0.bin, in1.bin, ... in the order
// below. Element sizes follow the dtype codes (0 = float32, 1 = bfloat16).
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "../tokenmill/kernels/csrc/tm.h"

using Bytes = std::vector<char>;

static Bytes load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

static void save(const std::string& path, const void* data, size_t n) {
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(data), n);
}

static size_t elem(int dtype) { return dtype == TM_F32 ? 4 : 2; }

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::string kernel = argv[1], dir = std::string(argv[2]) + "/";
  std::ifstream pf(dir + "params.txt");
  std::vector<double> p{std::istream_iterator<double>(pf), {}};
  auto in = [&](int i) { return load(dir + "in" + std::to_string(i) + ".bin"); };
  auto I = [&](int i) { return static_cast<int64_t>(p[i]); };
  if (kernel == "linear") {  // dtype m n k has_bias out_dtype: x, w, bias(f32)
    int dt = I(0), odt = I(5);
    int64_t m = I(1), n = I(2), k = I(3);
    Bytes x = in(0), w = in(1), b = I(4) ? in(2) : Bytes();
    Bytes packed(tm_packed_numel(dt, n, k) * elem(dt)), out(m * n * elem(odt));
    tm_pack_weight(dt, w.data(), n, k, packed.data());
    tm_linear lin{packed.data(), I(4) ? reinterpret_cast<const float*>(b.data()) : nullptr, n, k};
    tm_linear_fwd(dt, x.data(), m, &lin, odt, out.data(), nullptr, 0);
    save(dir + "out.bin", out.data(), out.size());
  } else if (kernel == "qlinear") {  // bits n k m dtype out_dtype: codes(u8), d, m(f16), x
    int bits = I(0), dt = I(4), odt = I(5);
    int64_t n = I(1), k = I(2), m = I(3);
    Bytes codes = in(0), d = in(1), mn = in(2), x = in(3), out(m * n * elem(odt));
    Bytes packed(tm_qpacked_bytes(bits, n, k));
    tm_qpack(bits, reinterpret_cast<const uint8_t*>(codes.data()),
             reinterpret_cast<const uint16_t*>(d.data()),
             reinterpret_cast<const uint16_t*>(mn.data()), n, k,
             reinterpret_cast<uint8_t*>(packed.data()));
    tm_linear lin{packed.data(), nullptr, n, k, bits};
    tm_linear_fwd(dt, x.data(), m, &lin, odt, out.data(), nullptr, 0);
    save(dir + "out.bin", out.data(), out.size());
  } else if (kernel == "rms_norm") {  // dtype rows hidden eps has_add: x, w, add
    int dt = I(0);
    Bytes x = in(0), w = in(1), add = I(4) ? in(2) : Bytes(), out(x.size());
    tm_rms_norm(dt, x.data(), w.data(), I(4) ? add.data() : nullptr, out.data(), I(1), I(2),
                static_cast<float>(p[3]));
    save(dir + "out.bin", out.data(), out.size());
    save(dir + "residual.bin", x.data(), x.size());
  } else if (kernel == "rope") {  // dtype tokens heads head_dim max_positions: x, cos_sin, pos
    Bytes x = in(0), cs = in(1), pos = in(2);
    tm_rope(I(0), x.data(), I(1), I(2), I(3), reinterpret_cast<const float*>(cs.data()), I(4),
            reinterpret_cast<const int64_t*>(pos.data()));
    save(dir + "out.bin", x.data(), x.size());
  } else if (kernel == "silu_mul") {  // dtype rows inter: x
    Bytes x = in(0), out(x.size() / 2);
    tm_silu_mul(I(0), x.data(), out.data(), I(1), I(2));
    save(dir + "out.bin", out.data(), out.size());
  } else if (kernel == "gelu_tanh_mul") {  // dtype rows inter: x
    Bytes x = in(0), out(x.size() / 2);
    tm_gelu_tanh_mul(I(0), x.data(), out.data(), I(1), I(2));
    save(dir + "out.bin", out.data(), out.size());
  } else if (kernel == "argmax") {  // rows n: x(f32)
    Bytes x = in(0);
    std::vector<int64_t> out(I(0));
    tm_argmax_rows(reinterpret_cast<const float*>(x.data()), I(0), I(1), out.data());
    save(dir + "out.bin", out.data(), out.size() * 8);
  } else if (kernel == "sample") {  // rows vocab: logits, temperatures, top_k(i64), top_p, min_p, u
    Bytes x = in(0), t = in(1), k = in(2), tp = in(3), mp = in(4), u = in(5);
    std::vector<int64_t> out(I(0));
    auto f = [](const Bytes& b) { return reinterpret_cast<const float*>(b.data()); };
    tm_sample_rows(f(x), I(0), I(1), f(t), reinterpret_cast<const int64_t*>(k.data()), f(tp),
                   f(mp), f(u), out.data());
    save(dir + "out.bin", out.data(), out.size() * 8);
  } else if (kernel == "attention") {
    // dtype batch heads kv_heads head_dim block_size max_blocks window scale:
    // q, k_cache, v_cache, tables(i64), lens(i64)
    int dt = I(0);
    Bytes q = in(0), kc = in(1), vc = in(2), tables = in(3), lens = in(4), out(q.size());
    tm_decode_attention(dt, q.data(), kc.data(), vc.data(), I(5), I(3),
                        reinterpret_cast<const int64_t*>(tables.data()), I(6),
                        reinterpret_cast<const int64_t*>(lens.data()), I(1), I(2), I(4), I(7),
                        static_cast<float>(p[8]), out.data());
    save(dir + "out.bin", out.data(), out.size());
  } else if (kernel == "prefill") {
    // dtype new heads kv_heads head_dim block_size computed window scale:
    // q, k_cache, v_cache, table(i64)
    Bytes q = in(0), kc = in(1), vc = in(2), table = in(3), out(q.size());
    tm_prefill_attention(I(0), q.data(), I(1), I(2), I(4), kc.data(), vc.data(), I(5), I(3),
                         reinterpret_cast<const int64_t*>(table.data()), I(6), I(7),
                         static_cast<float>(p[8]), out.data());
    save(dir + "out.bin", out.data(), out.size());
  } else if (kernel == "kv_attention") {
    // format batch heads kv_heads head_dim block_size blocks max_blocks window scale:
    // k, v (blocks x block_size rows, f32), rotation (f32, int4), tables, lens, stages (i64), q
    // -> the pages written by tm_kv_store (every slot, stage slot = block), then decode
    // attention (int4: the output in V's rotated basis)
    const int fmt = I(0);
    const int64_t B = I(1), Hq = I(2), Hk = I(3), D = I(4), BS = I(5), nb = I(6), rows = nb * BS;
    const bool int4 = fmt == TM_KV_INT4;
    const int64_t cb = int4 ? D / 2 : D;
    Bytes k = in(0), v = in(1), rot = in(2), tables = in(3), lens = in(4), stages = in(5), q = in(6);
    std::vector<int64_t> slots(rows);
    for (int64_t i = 0; i < rows; ++i) slots[i] = i;
    std::vector<uint8_t> kc(rows * Hk * cb), vc(rows * Hk * cb), params(nb * Hk * (2 * D + 4));
    std::vector<uint16_t> ks(rows * Hk), vs(rows * Hk);
    std::vector<float> stage(rows * Hk * D), out(B * Hq * D);
    tm_kv_pages kp{fmt, kc.data(), int4 ? nullptr : ks.data(), int4 ? params.data() : nullptr,
                   int4 ? stage.data() : nullptr, TM_F32};
    tm_kv_pages vp{int4 ? TM_KV_INT4V : fmt, vc.data(), vs.data(), nullptr, nullptr, TM_F32};
    tm_kv_store(kp.format, reinterpret_cast<const float*>(k.data()), rows, Hk, D, nullptr,
                slots.data(), slots.data(), BS, &kp);
    tm_kv_store(vp.format, reinterpret_cast<const float*>(v.data()), rows, Hk, D,
                int4 ? reinterpret_cast<const float*>(rot.data()) : nullptr, slots.data(),
                nullptr, BS, &vp);
    tm_decode_attention_quant(reinterpret_cast<const float*>(q.data()), &kp, &vp, BS, Hk,
                              reinterpret_cast<const int64_t*>(tables.data()), I(7),
                              reinterpret_cast<const int64_t*>(lens.data()),
                              int4 ? reinterpret_cast<const int64_t*>(stages.data()) : nullptr,
                              B, Hq, D, I(8), static_cast<float>(p[9]), out.data());
    save(dir + "out.bin", out.data(), out.size() * 4);
  } else {
    std::fprintf(stderr, "unknown kernel %s\n", kernel.c_str());
    return 2;
  }
  std::printf("%s %s\n", tm_isa(), kernel.c_str());
  return 0;
}
