// AVX2 only: the pair loops of the integer prefill tile (attention_prefill_int.h) in assembly.
// GCC 12 at -O3 accumulates VPMADDWD products with a VPADDD into a fresh register and copies
// it back (8 VMOVDQA a step for 8 accumulators); those copies sit on the sums' dependency
// chains and made the intrinsics loops slower than the float FMA tile on a Zen 3. These loops
// add in place. The sums are integers, so they are the intrinsics' bits (a test builds both).
// ymm0-3 are scratch; the accumulators are the operands a00 .. a13.
#pragma once

#if defined(TM_ISA_AVX2) && !defined(TM_NO_INT_ASM)
#define TM_INT_ASM 1
#include "vec.h"

namespace tm {

#define TM_MADD(src, w, acc) \
  "vpmaddwd " src ", " w ", %%ymm3\n\t" \
  "vpaddd %%ymm3, %[" acc "], %[" acc "]\n\t"

// a[i][u] += sum over `pairs` steps d of (q_i[2d], q_i[2d+1]) . kp[d][u * 8 .. + 8]: 4 query
// rows (ld int16 apart), two vectors of 8 keys (64 bytes of pairs a step)
inline void scores_pairs_4x2(const int16_t* q, int64_t ld, const int16_t* kp, int64_t pairs,
                             __m256i (&a)[4][2]) {
  if (pairs <= 0) return;
  const int16_t* q3 = q + 3 * ld;
  const int64_t bytes = 2 * ld;
  asm volatile(
      "1:\n\t"
      "vmovdqu (%[k]), %%ymm0\n\t"
      "vmovdqu 32(%[k]), %%ymm1\n\t"
      "vpbroadcastd (%[q]), %%ymm2\n\t" TM_MADD("%%ymm0", "%%ymm2", "a00") TM_MADD("%%ymm1", "%%ymm2", "a01")
      "vpbroadcastd (%[q],%[ld]), %%ymm2\n\t" TM_MADD("%%ymm0", "%%ymm2", "a10") TM_MADD("%%ymm1", "%%ymm2", "a11")
      "vpbroadcastd (%[q],%[ld],2), %%ymm2\n\t" TM_MADD("%%ymm0", "%%ymm2", "a20") TM_MADD("%%ymm1", "%%ymm2", "a21")
      "vpbroadcastd (%[q3]), %%ymm2\n\t" TM_MADD("%%ymm0", "%%ymm2", "a30") TM_MADD("%%ymm1", "%%ymm2", "a31")
      "add $4, %[q]\n\t"
      "add $4, %[q3]\n\t"
      "add $64, %[k]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]),
        [a20] "+x"(a[2][0]), [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1]),
        [q] "+r"(q), [q3] "+r"(q3), [k] "+r"(kp), [n] "+r"(pairs)
      : [ld] "r"(bytes)
      : "xmm0", "xmm1", "xmm2", "xmm3", "cc", "memory");
}

// a[i][u] += sum over `pairs` steps j of (w_i[2j], w_i[2j+1]) . vp[j][u * 8 .. + 8]: 2 rows of
// weights (32 bytes apart, kRows int16), four vectors of value pairs (steps `stride` int16 apart)
inline void values_pairs_2x4(const int16_t* w, const int16_t* vp, int64_t stride, int64_t pairs,
                             __m256i (&a)[2][4]) {
  if (pairs <= 0) return;
  const int64_t bytes = 2 * stride;
  asm volatile(
      "1:\n\t"
      "vpbroadcastd (%[w]), %%ymm1\n\t"
      "vpbroadcastd 32(%[w]), %%ymm2\n\t"
      "vmovdqu (%[v]), %%ymm0\n\t" TM_MADD("%%ymm0", "%%ymm1", "a00") TM_MADD("%%ymm0", "%%ymm2", "a10")
      "vmovdqu 32(%[v]), %%ymm0\n\t" TM_MADD("%%ymm0", "%%ymm1", "a01") TM_MADD("%%ymm0", "%%ymm2", "a11")
      "vmovdqu 64(%[v]), %%ymm0\n\t" TM_MADD("%%ymm0", "%%ymm1", "a02") TM_MADD("%%ymm0", "%%ymm2", "a12")
      "vmovdqu 96(%[v]), %%ymm0\n\t" TM_MADD("%%ymm0", "%%ymm1", "a03") TM_MADD("%%ymm0", "%%ymm2", "a13")
      "add $4, %[w]\n\t"
      "add %[s], %[v]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a02] "+x"(a[0][2]), [a03] "+x"(a[0][3]),
        [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), [a12] "+x"(a[1][2]), [a13] "+x"(a[1][3]),
        [w] "+r"(w), [v] "+r"(vp), [n] "+r"(pairs)
      : [s] "r"(bytes)
      : "xmm0", "xmm1", "xmm2", "xmm3", "cc", "memory");
}

#undef TM_MADD

}  // namespace tm
#endif
