// AVX2 only: the k loop of a 4-6 row GEMM tile on bf16 panels, in assembly. GCC 12 keeps only
// 7 of the 6-row intrinsics tile's 12 accumulators in registers (the bf16 mask takes the 16th)
// and spills the rest inside the k loop; this loop keeps all twelve (same sums, bit for bit).
// gemm.cpp uses it for 5-6 row tiles, where it measured faster than the intrinsics on both
// the Zen 3 and the Zen 4; 4-row tiles were slower with it (docs/performance.md). ymm0-11 accumulate (row i in ymm 2i and 2i+1),
// ymm12/13 hold the widened weights, ymm14 the broadcast input, ymm15 the mask; four k steps per
// iteration, two prefetched lines (128 bytes = 4 k steps). `.if` assembles only the tile's rows.
#pragma once

#include "vec.h"

namespace tm {

#define TM_ROW(i, u, addr, lo, hi)                                                           \
  ".if " #i " < %c[rows]\n\t"                                                                \
  "vbroadcastss " #u "*4" addr ", %%ymm14\n\t"                                               \
  "vfmadd231ps %%ymm12, %%ymm14, %%ymm" #lo "\n\t"                                           \
  "vfmadd231ps %%ymm13, %%ymm14, %%ymm" #hi "\n\t"                                           \
  ".endif\n\t"
#define TM_STEP(u)                                                                           \
  "vmovdqu " #u "*32(%[p]), %%ymm13\n\t"                                                     \
  "vpslld $16, %%ymm13, %%ymm12\n\t"                                                         \
  "vpand %%ymm15, %%ymm13, %%ymm13\n\t"                                                      \
  TM_ROW(0, u, "(%[x0])", 0, 1) TM_ROW(1, u, "(%[x0],%[ld])", 2, 3)                          \
  TM_ROW(2, u, "(%[x0],%[ld],2)", 4, 5) TM_ROW(3, u, "(%[x3])", 6, 7)                        \
  TM_ROW(4, u, "(%[x3],%[ld])", 8, 9) TM_ROW(5, u, "(%[x3],%[ld],2)", 10, 11)

alignas(32) constexpr uint32_t kHighHalves[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                                 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                                 0xFFFF0000u, 0xFFFF0000u};

// tile[i][0:16] = sum over k < 4 * steps of x[i * ldx + k] * panel[k][0:16], i < MR (4 to 6);
// pf advances past what it prefetched (up to end), so the caller's k tail goes on from there.
template <int MR>
void tile_bf16_asm(const float* x, int64_t ldx, const bf16* panel, int64_t steps,
                   const char*& pf, const char* end, float (&tile)[MR][16]) {
  static_assert(MR >= 4 && MR <= 6, "rows 0-2 are addressed from x0, rows 3-5 from x3");
  const float* x3 = x + 3 * ldx;
  int64_t ld = ldx * static_cast<int64_t>(sizeof(float));
  asm volatile(
      "vmovdqa (%[mask]), %%ymm15\n\t"
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t" "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n\t" "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t" "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t" "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t" "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t" "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "test %[n], %[n]\n\t"
      "jz 3f\n\t"
      "1:\n\t"
      "cmp %[end], %[pf]\n\t"
      "jae 2f\n\t"
      "prefetcht0 (%[pf])\n\t"
      "prefetcht0 64(%[pf])\n\t"
      "add $128, %[pf]\n\t"
      "2:\n\t"
      TM_STEP(0) TM_STEP(1) TM_STEP(2) TM_STEP(3)
      "add $128, %[p]\n\t"
      "add $16, %[x0]\n\t"
      "add $16, %[x3]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      "3:\n\t"
      "vmovaps %%ymm0, 0(%[t])\n\t" "vmovaps %%ymm1, 32(%[t])\n\t"
      "vmovaps %%ymm2, 64(%[t])\n\t" "vmovaps %%ymm3, 96(%[t])\n\t"
      "vmovaps %%ymm4, 128(%[t])\n\t" "vmovaps %%ymm5, 160(%[t])\n\t"
      "vmovaps %%ymm6, 192(%[t])\n\t" "vmovaps %%ymm7, 224(%[t])\n\t"
      ".if 4 < %c[rows]\n\t"
      "vmovaps %%ymm8, 256(%[t])\n\t" "vmovaps %%ymm9, 288(%[t])\n\t"
      ".endif\n\t"
      ".if 5 < %c[rows]\n\t"
      "vmovaps %%ymm10, 320(%[t])\n\t" "vmovaps %%ymm11, 352(%[t])\n\t"
      ".endif\n\t"
      : [p] "+r"(panel), [x0] "+r"(x), [x3] "+r"(x3), [n] "+r"(steps), [pf] "+r"(pf)
      : [ld] "r"(ld), [end] "r"(end), [t] "r"(&tile[0][0]), [mask] "r"(kHighHalves),
        [rows] "i"(MR)
      : "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10",
        "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "cc", "memory");
}
#undef TM_ROW
#undef TM_STEP

}  // namespace tm
