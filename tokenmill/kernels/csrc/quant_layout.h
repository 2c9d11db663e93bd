// tokenmill CPU kernels: the repacked layout of block-quantized weights (quant.cpp's header;
// packed by quant_pack.cpp): quant codes, byte offsets, scales and codes of one output.
#pragma once

#include <cstring>

#include "tm.h"
#include "vec.h"

namespace tm {

constexpr int64_t kBlock = 32, kGroup = 16;  // k per block, output rows per group

// A weight's quant code (tm.h): its code bits; whether m is implied (TM_QSYM: m = -2^(bits - 1) d)
// or d, m come from integers and per-256 scales (TM_QSUPER); the bytes of scales per (group,
// block): 16 float16 d then 16 m, the d alone, or 16 sc then 16 mn (uint8); with the codes after
// them. A TM_QSUPER group holds its blocks, then per 8 blocks 16 D and 16 M (float16, 64 bytes).
// 6 bits (Q6_K, qhalves): a scale per half block (16 k), 16 int8 sc for k < 16 then 16 for
// k >= 16, d = sc D and m = -32 d per half; per 8 blocks 16 D alone (32 bytes). Its codes: the
// 4-bit chunks, then bits 4-5 in 2 x 64 bytes (low nibbles' k, high nibbles' k): byte 4 o + t
// holds those of code k = 4 j + t (+ 16) at bits 2 j, 2 j + 1.
constexpr int qbits(int q) { return q & 15; }
constexpr bool qsym(int q) { return (q & TM_QSYM) != 0; }
constexpr bool qsuper(int q) { return (q & TM_QSUPER) != 0; }
// kQ6Wide (8 bits with TM_QSUPER: no weight packs to it): 6-bit groups widened to a byte a
// code for calls of many rows (widen_q6, AVX2), the scales as they were
constexpr int kQ6Wide = TM_QI8 | TM_QSUPER;
constexpr bool qhalves(int q) { return qbits(q) == 6 || q == kQ6Wide; }
constexpr int64_t scale_bytes(int q) { return qsym(q) || qsuper(q) ? 32 : 64; }
constexpr int64_t code_bytes(int q) { return qbits(q) == 8 ? 512 : 256 + 64 * (qbits(q) - 4); }
constexpr int64_t group_bytes(int q) { return scale_bytes(q) + code_bytes(q); }
constexpr int64_t kSuper = 8;  // blocks per TM_QSUPER scale pair (256 k)
constexpr int64_t super_bytes(int q) { return qhalves(q) ? 32 : 64; }
constexpr int64_t group_stride(int q, int64_t K) {
  return K / kBlock * group_bytes(q) + (qsuper(q) ? K / (kSuper * kBlock) * super_bytes(q) : 0);
}
// the activation sums a tile reads per input row and block (sx: one, or one per half)
constexpr int64_t sums_per_block(int q) { return qhalves(q) ? 2 : 1; }
// a TM_QSUPER group's D (16 float16) for block b, M after them
inline const uint16_t* super_scales(int q, const uint8_t* grp, int64_t blocks, int64_t b) {
  return reinterpret_cast<const uint16_t*>(grp + blocks * group_bytes(q) + b / kSuper * super_bytes(q));
}
constexpr float sym_offset(int q) { return qhalves(q) ? -32.f : -static_cast<float>(1 << (qbits(q) - 1)); }

// d and m of output o in block b (its half h: k >= 16) of the group at grp (K / 32 blocks), in
// float32
inline void scales_at(int q, const uint8_t* grp, int64_t blocks, int64_t b, int o, float& d,
                      float& m, int h = 0) {
  const uint8_t* blk = grp + b * group_bytes(q);
  const auto* h16 = reinterpret_cast<const uint16_t*>(blk);
  if (qhalves(q)) {
    const auto sc = static_cast<int8_t>(blk[kGroup * h + o]);
    d = static_cast<float>(sc) * half_to_f(super_scales(q, grp, blocks, b)[o]);
    m = d * sym_offset(q);
  } else if (qsuper(q)) {
    const uint16_t* s = super_scales(q, grp, blocks, b);
    d = static_cast<float>(blk[o]) * half_to_f(s[o]);
    m = -(static_cast<float>(blk[kGroup + o]) * half_to_f(s[kGroup + o]));
  } else {
    d = half_to_f(h16[o]);
    m = qsym(q) ? d * sym_offset(q) : half_to_f(h16[kGroup + o]);
  }
}

#if defined(__AVX2__)  // vload_f16 is x86's
// scales_at for outputs lane0 .. lane0 + kLanes as vectors (the AMX paths; the register tiles
// below keep a TM_QSUPER group's D, M across its 8 blocks instead)
template <int Q>
inline void vscales(const uint8_t* grp, int64_t blocks, int64_t b, int lane0, vec& d, vec& m,
                    int h = 0) {
  const uint8_t* blk = grp + b * group_bytes(Q);
  if constexpr (qhalves(Q)) {
    const auto* ints = reinterpret_cast<const int8_t*>(blk) + kGroup * h + lane0;
    d = vmul(vload_i8(ints), vload_f16(super_scales(Q, grp, blocks, b) + lane0));
    m = vmul(d, vset1(sym_offset(Q)));
  } else if constexpr (qsuper(Q)) {
    const uint16_t* s = super_scales(Q, grp, blocks, b) + lane0;
    const auto* ints = reinterpret_cast<const int8_t*>(blk) + lane0;  // sc, mn < 64
    d = vmul(vload_i8(ints), vload_f16(s));
    m = vsub(vzero(), vmul(vload_i8(ints + kGroup), vload_f16(s + kGroup)));
  } else {
    const auto* h = reinterpret_cast<const uint16_t*>(blk) + lane0;
    d = vload_f16(h);
    m = qsym(Q) ? vmul(d, vset1(sym_offset(Q))) : vload_f16(h + kGroup);
  }
}
#endif

inline int code_at(const uint8_t* codes, int bits, int64_t o, int64_t k) {
  if (bits == 8) return codes[64 * (k / 4) + 4 * o + k % 4];
  int64_t kk = k % 16, p = 4 * o + kk % 4;  // byte p of chunk kk / 4
  uint8_t b = codes[64 * (kk / 4) + p];
  int c = k < 16 ? b & 0xF : b >> 4;
  if (bits == 5) {  // fifth bits: 64-bit word 2 j (low nibbles) / 2 j + 1 (high), bit p
    uint64_t word;
    std::memcpy(&word, codes + 256 + 8 * (2 * (kk / 4) + (k >= 16)), 8);
    c |= static_cast<int>((word >> p) & 1) << 4;
  }
  if (bits == 6)  // bits 4-5: bits 2 j, 2 j + 1 of byte p of the 64 at 256 (low) / 320 (high)
    c |= (codes[256 + 64 * (k >= 16) + p] >> (2 * (kk / 4)) & 3) << 4;
  return c;
}

}  // namespace tm
