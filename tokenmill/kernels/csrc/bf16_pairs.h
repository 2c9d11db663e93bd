// bf16 pairs for the dot-product instructions' right operands (TDPBF16PS, VDPBF16PS), and the
// flushing of denormals their softmax probabilities need (prefill_lanes.h, quant_dequant_amx.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tm {

// Denormal float32 results flushed to zero and denormal inputs read as zero while it lives (on
// this thread): the softmax's 2^t underflows for probabilities far below a row's maximum, and
// each denormal result would cost a microcode assist.
class FlushDenormals {
 public:
  FlushDenormals() : csr_(_mm_getcsr()) { _mm_setcsr(csr_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(csr_); }

 private:
  unsigned csr_;
};

#ifdef TM_ISA_AVX512_BF16
// 16 floats of a and 16 of b as bf16 pairs (a_i, b_i), rounded to nearest even: a right
// operand's row of TDPBF16PS / VDPBF16PS (the attention's probabilities, dequantized weights)
inline void store_bf16_pairs(__m512 a, __m512 b, uint32_t* out) {
  static const __m512i kInterleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(kInterleave, both));
}
#endif

constexpr int64_t kLaneGroup = 16;  // query rows per group (the lanes of a tile row)
constexpr float kLaneNoMax = -1e30f;  // a row's maximum before any key (finite: no inf - inf)

}  // namespace tm
