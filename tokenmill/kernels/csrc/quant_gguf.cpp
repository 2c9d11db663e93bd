// tokenmill CPU kernels: GGUF's block formats (llama.cpp's ggml-quants; byte layouts in
// tokenmill/quantization/gguf_blocks.py) packed straight from a file's bytes into the kernels'
// layout, a group of 16 rows at a time: each row's blocks decoded into codes and scales in a
// buffer that stays in cache, then written as quant_pack.cpp writes rows of codes. The packed
// bytes equal those of the file converted to BlockQuant and packed by tm_qpack /
// tm_qpack_super (tests/test_gguf_blocks.py checks every format); what the load skips is the
// conversion's copies: a byte per weight written and read back.
#include <algorithm>
#include <atomic>
#include <vector>

#include "quant_pack.h"
#include "tm.h"

namespace tm {
namespace {

// ggml type ids (gguf's GGMLQuantizationType)
enum { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Format {
  int quant;            // the packed form (tm.h quant code)
  int64_t k, bytes;     // weights and bytes per file block
};

Format format_of(int type) {
  switch (type) {
    case kQ4_0: return {TM_QI4 | TM_QSYM, 32, 18};
    case kQ4_1: return {TM_QI4, 32, 20};
    case kQ5_0: return {TM_QI5 | TM_QSYM, 32, 22};
    case kQ5_1: return {TM_QI5, 32, 24};
    case kQ8_0: return {TM_QI8 | TM_QSYM, 32, 34};
    case kQ4_K: return {TM_QI4 | TM_QSUPER, 256, 144};
    case kQ5_K: return {TM_QI5 | TM_QSUPER, 256, 176};
    case kQ6_K: return {TM_QI6 | TM_QSUPER, 256, 210};
    default: return {-1, 0, 0};
  }
}

uint16_t u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
uint32_t u32(const uint8_t* p) { return u16(p) | static_cast<uint32_t>(u16(p + 2)) << 16; }
bool finite(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

// One row's scales as tm_qpack / tm_qpack_super take them: d, m per 32 (float16 bits); or sc,
// mn per 32 (Q6_K: sc per 16, int8) and D, M per 256
struct RowScales {
  uint16_t *d, *m, *D, *M;
  uint8_t *sc, *mn;
};

// 16 nibbles: low halves codes 0-15, high halves 16-31, plus a fifth bit per code from qh
void nibbles32(const uint8_t* qs, uint32_t qh, uint8_t* c) {
  for (int j = 0; j < 16; ++j) {
    c[j] = static_cast<uint8_t>((qs[j] & 0xF) | (qh >> j & 1) << 4);
    c[16 + j] = static_cast<uint8_t>((qs[j] >> 4) | (qh >> (16 + j) & 1) << 4);
  }
}

// Q4_K / Q5_K: 6-bit sc, mn of sub-block j from 12 bytes (llama.cpp's get_scale_min_k4)
void k_scale(const uint8_t* q, int j, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = q[j] & 63, mn = q[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((q[j + 4] & 0xF) | (q[j - 4] >> 6) << 4);
    mn = static_cast<uint8_t>((q[j + 4] >> 4) | (q[j] >> 6) << 4);
  }
}

// A row's file blocks -> its k codes and scales; false where a float16 scale is inf or NaN
bool decode_row(int type, const Format& f, const uint8_t* src, int64_t k, uint8_t* codes,
                const RowScales& s) {
  bool ok = true;
  for (int64_t b = 0; b < k / f.k; ++b, src += f.bytes) {
    uint8_t* c = codes + b * f.k;
    const uint16_t d = type == kQ6_K ? u16(src + 208) : u16(src);  // m, M: the next 2 bytes
    ok &= finite(d) && (qsym(f.quant) || qhalves(f.quant) || finite(u16(src + 2)));
    switch (type) {
      case kQ4_0: nibbles32(src + 2, 0, c); s.d[b] = d; break;
      case kQ4_1: nibbles32(src + 4, 0, c); s.d[b] = d, s.m[b] = u16(src + 2); break;
      case kQ5_0: nibbles32(src + 6, u32(src + 2), c); s.d[b] = d; break;
      case kQ5_1: nibbles32(src + 8, u32(src + 4), c); s.d[b] = d, s.m[b] = u16(src + 2); break;
      case kQ8_0:
        for (int j = 0; j < 32; ++j) c[j] = src[2 + j] ^ 0x80;  // int8 q -> q + 128
        s.d[b] = d;
        break;
      case kQ4_K:
      case kQ5_K: {  // sub-block 2 i / 2 i + 1: low / high nibbles of 32 bytes; Q5_K: bit s of qh[j]
        const uint8_t* qs = src + (type == kQ5_K ? 48 : 16);
        for (int sub = 0; sub < 8; ++sub) {
          for (int j = 0; j < 32; ++j) {
            const uint8_t nib = sub % 2 ? qs[32 * (sub / 2) + j] >> 4 : qs[32 * (sub / 2) + j] & 0xF;
            const uint8_t fifth = type == kQ5_K ? (src[16 + j] >> sub & 1) << 4 : 0;
            c[32 * sub + j] = nib | fifth;
          }
          k_scale(src + 4, sub, s.sc[8 * b + sub], s.mn[8 * b + sub]);
        }
        s.D[b] = d, s.M[b] = u16(src + 2);
        break;
      }
      case kQ6_K: {  // weight 128 h + 32 j + l: nibble of ql[64 h + 32 (j % 2) + l] (high for
        // j >= 2), bits 4-5 from bits 2 j, 2 j + 1 of qh[32 h + l]; sc per 16, d after them
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 4; ++j)
            for (int l = 0; l < 32; ++l) {
              const uint8_t q = src[64 * h + 32 * (j % 2) + l];
              c[128 * h + 32 * j + l] = static_cast<uint8_t>(
                  (j < 2 ? q & 0xF : q >> 4) | (src[128 + 32 * h + l] >> 2 * j & 3) << 4);
            }
        std::memcpy(s.sc + 16 * b, src + 192, 16);
        s.D[b] = d;
        break;
      }
    }
  }
  return ok;
}

}  // namespace
}  // namespace tm

extern "C" {

int tm_gguf_quant(int type) { return tm::format_of(type).quant; }

int tm_qpack_gguf(int type, const uint8_t* data, int64_t row_bytes, int64_t n, int64_t k,
                  uint8_t* out) {
  using namespace tm;
  const Format f = format_of(type);
  if (f.quant < 0 || k <= 0 || k % f.k || row_bytes != k / f.k * f.bytes) return -1;
  const int q = f.quant;
  const int64_t blocks = k / kBlock, supers = k / (kSuper * kBlock);
  const int64_t stride = group_stride(q, k), groups = (n + kGroup - 1) / kGroup;
  std::atomic<bool> finite_scales{true};
  parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    // a group's codes and scales (Q6_K: two sc per block)
    std::vector<uint8_t> codes(kGroup * k), sc(kGroup * 2 * blocks), mn(kGroup * blocks);
    std::vector<uint16_t> d(kGroup * blocks), m(kGroup * blocks), D(kGroup * supers), M(kGroup * supers);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t rows = std::min(kGroup, n - g * kGroup);
      for (int64_t o = 0; o < rows; ++o) {
        const RowScales s{d.data() + o * blocks, m.data() + o * blocks, D.data() + o * supers,
                          M.data() + o * supers, sc.data() + o * 2 * blocks, mn.data() + o * blocks};
        if (!decode_row(type, f, data + (g * kGroup + o) * row_bytes, k, codes.data() + o * k, s))
          finite_scales = false;
      }
      const bool halves = qhalves(q);
      qpack_group(q, rows, k, out + g * stride, [&](int64_t o) { return codes.data() + o * k; },
                  [&](uint8_t* blk, int64_t o, int64_t b) {
                    if (qsuper(q)) {  // sc, mn; Q6_K: the two sc of the block's halves
                      const uint8_t* row_sc = sc.data() + o * 2 * blocks;
                      blk[o] = halves ? row_sc[2 * b] : row_sc[b];
                      blk[kGroup + o] = halves ? row_sc[2 * b + 1] : mn[o * blocks + b];
                      return;
                    }
                    auto* h = reinterpret_cast<uint16_t*>(blk);
                    h[o] = d[o * blocks + b];
                    if (!qsym(q)) h[kGroup + o] = m[o * blocks + b];
                  },
                  [&](uint16_t* hdr, int64_t o, int64_t s) {
                    hdr[o] = D[o * supers + s];
                    if (!halves) hdr[kGroup + o] = M[o * supers + s];
                  });
    }
  });
  return finite_scales ? 0 : -2;
}

}  // extern "C"
