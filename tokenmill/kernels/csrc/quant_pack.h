// tokenmill CPU kernels: one group of 16 output rows written in the kernels' layout for
// block-quantized weights (quant.cpp's header and quant_layout.h): from rows of codes
// (quant_pack.cpp) or from GGUF's blocks decoded a group at a time (quant_gguf.cpp).
#pragma once

#include <cstring>

#include "quant_layout.h"

namespace tm {

// The `rows` (<= 16) outputs of a group at grp (group_stride(quant, k) bytes, zeroed here):
// codes(o) gives output o's k codes; per block b, scale(blk, o, b) writes its scales into the
// block's header; a TM_QSUPER weight's per-256 scales through super(header, o, s) after the
// group's blocks
template <typename Codes, typename Scales, typename Super>
void qpack_group(int quant, int64_t rows, int64_t k, uint8_t* grp, const Codes& codes,
                 const Scales& scale, const Super& super) {
  const int64_t blocks = k / kBlock, gbytes = group_bytes(quant), at = scale_bytes(quant);
  const int bits = qbits(quant);
  std::memset(grp, 0, group_stride(quant, k));  // rows past n stay zero; 5-bit words are OR-ed
  for (int64_t o = 0; o < rows; ++o) {
    if (qsuper(quant))
      for (int64_t s = 0; s < blocks / kSuper; ++s)
        super(reinterpret_cast<uint16_t*>(grp + blocks * gbytes + super_bytes(quant) * s), o, s);
    const uint8_t* row = codes(o);
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* blk = grp + b * gbytes;
      scale(blk, o, b);
      const uint8_t* c = row + b * kBlock;
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

}  // namespace tm
