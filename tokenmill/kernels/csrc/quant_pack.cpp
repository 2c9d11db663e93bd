// tokenmill CPU kernels: block-quantized weights repacked into the kernels' layout (the
// layout: quant.cpp's header and quant_layout.h), and back to float32.
#include <type_traits>

#include "quant_layout.h"
#include "tm.h"

namespace tm {

// tm_qpack's layout for rows of codes (n, k): per (group, block) scale(blk, o, i) writes output
// o's scales (i: its index in (n, k / 32) arrays), then the codes; a TM_QSUPER weight's per-256
// scales through super(header, o, row, s) after each group's blocks
template <typename Scales, typename Super>
void qpack_rows(int quant, const uint8_t* codes, int64_t n, int64_t k, uint8_t* out,
                const Scales& scale, const Super& super) {
  const int64_t blocks = k / kBlock, groups = (n + kGroup - 1) / kGroup;
  const int64_t gbytes = group_bytes(quant), at = scale_bytes(quant), stride = group_stride(quant, k);
  const int bits = qbits(quant);
  parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* grp = out + g * stride;
      std::memset(grp, 0, stride);  // rows past n stay zero; 5-bit words are OR-ed
      for (int64_t o = 0; o < kGroup && g * kGroup + o < n; ++o) {
        const int64_t row = g * kGroup + o;
        if constexpr (!std::is_same_v<Super, std::nullptr_t>)
          for (int64_t s = 0; s < blocks / kSuper; ++s)
            super(reinterpret_cast<uint16_t*>(grp + blocks * gbytes + super_bytes(quant) * s), o,
                  row, s);
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* blk = grp + b * gbytes;
          scale(blk, o, row * blocks + b);
          const uint8_t* c = codes + row * k + b * kBlock;
          uint8_t* q = blk + at + 4 * o;  // chunk j's 4 bytes of output o: q[64 j + t]
          if (bits == 8) {
            for (int64_t kk = 0; kk < kBlock; ++kk) q[64 * (kk / 4) + kk % 4] = c[kk];
            continue;
          }
          for (int64_t j = 0; j < 16; ++j)  // low nibble code j, high nibble code 16 + j
            q[64 * (j / 4) + j % 4] = static_cast<uint8_t>((c[j] & 0xF) | (c[16 + j] & 0xF) << 4);
          if (bits == 6) {  // bits 4-5 of code kk: byte 4 o + t of 64 at 256 (+ 64: high), bits 2 j
            for (int64_t kk = 0; kk < kBlock; ++kk)
              q[256 + 64 * (kk / 16) + kk % 4] |= static_cast<uint8_t>((c[kk] >> 4 & 3) << 2 * (kk % 16 / 4));
            continue;
          }
          if (bits != 5) continue;
          // fifth bits: word 2 j + h (h: low/high nibble), bits 4 o .. 4 o + 3 = codes t of chunk j
          for (int64_t w = 0; w < 8; ++w) {
            const uint8_t* cw = c + 16 * (w % 2) + 4 * (w / 2);
            unsigned nib = (cw[0] >> 4 & 1) | (cw[1] >> 4 & 1) << 1 | (cw[2] >> 4 & 1) << 2 |
                           (cw[3] >> 4 & 1) << 3;
            blk[at + 256 + 8 * w + o / 2] |= static_cast<uint8_t>(nib << 4 * (o % 2));
          }
        }
      }
    }
  });
}

}  // namespace tm

extern "C" {

int64_t tm_qpacked_bytes(int quant, int64_t n, int64_t k) {
  return (n + tm::kGroup - 1) / tm::kGroup * tm::group_stride(quant, k);
}

void tm_qpack(int quant, const uint8_t* codes, const uint16_t* d, const uint16_t* m, int64_t n,
              int64_t k, uint8_t* out) {
  tm::qpack_rows(quant, codes, n, k, out, [&](uint8_t* blk, int64_t o, int64_t i) {
    auto* h = reinterpret_cast<uint16_t*>(blk);
    h[o] = d[i];
    if (!tm::qsym(quant)) h[tm::kGroup + o] = m[i];
  }, nullptr);
}

void tm_qpack_super(int quant, const uint8_t* codes, const uint8_t* sc, const uint8_t* mn,
                    const uint16_t* D, const uint16_t* M, int64_t n, int64_t k, uint8_t* out) {
  const int64_t supers = k / (tm::kSuper * tm::kBlock);
  const bool halves = tm::qhalves(quant);  // sc per 16 k, D alone
  tm::qpack_rows(quant, codes, n, k, out, [&](uint8_t* blk, int64_t o, int64_t i) {
    blk[o] = halves ? sc[2 * i] : sc[i], blk[tm::kGroup + o] = halves ? sc[2 * i + 1] : mn[i];
  }, [&](uint16_t* hdr, int64_t o, int64_t row, int64_t s) {
    hdr[o] = D[row * supers + s];
    if (!halves) hdr[tm::kGroup + o] = M[row * supers + s];
  });
}

int tm_qdequantize(int quant, const uint8_t* packed, int64_t n, int64_t k, const int64_t* rows,
                   int64_t count, float* out) {
  using namespace tm;
  for (int64_t i = 0; rows && i < count; ++i)
    if (rows[i] < 0 || rows[i] >= n) return -1;
  const int64_t blocks = k / kBlock;
  parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = rows ? rows[i] : i, g = row / kGroup, o = row % kGroup;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* grp = packed + g * group_stride(quant, k);
        const uint8_t* c = grp + b * group_bytes(quant) + scale_bytes(quant);
        float d, mn;
        for (int64_t kk = 0; kk < kBlock; ++kk) {
          if (kk % 16 == 0) scales_at(quant, grp, blocks, b, static_cast<int>(o), d, mn, kk / 16);
          out[i * k + b * kBlock + kk] = d * static_cast<float>(code_at(c, qbits(quant), o, kk)) + mn;
        }
      }
    }
  });
  return 0;
}

}  // extern "C"
