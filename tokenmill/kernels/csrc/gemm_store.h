// A GEMM's float32 results for one panel of outputs stored in the output's dtype (the packed
// GEMMs of gemm.cpp and gemm_dot.h, and the dequantized prompt path of quant_dequant_amx.h).
#pragma once

#include "vec.h"

namespace tm {

// out[i, 0:cols] = tile[i] (+ bias) for MR rows: whole panels as vectors, the last one lane by lane.
// gated (a weight packed with gate and up rows interleaved kLanes at a time, whole panels): the
// panel's columns are kLanes of gate, then the same kLanes of up, and out[i, 0:kLanes] =
// silu(gate) x up, each rounded to O as storing both and running silu_mul would round them.
template <int MR, typename O>
void store_tile(const float (&tile)[MR][kPanel], const float* bias, O* out, int64_t ldo,
                int64_t cols, bool gated) {
  for (int i = 0; i < MR; ++i) {
    O* o = out + i * ldo;
    if (cols == kPanel) {
      vec lo = vload(tile[i]), hi = vload(tile[i] + kLanes);
      if (bias) {
        lo = vadd(lo, vload(bias));
        hi = vadd(hi, vload(bias + kLanes));
      }
      if (gated) {
        vstore(o, vsilu_mul<O>(vrnd<O>(lo), vrnd<O>(hi)));
        continue;
      }
      vstore(o, lo);
      vstore(o + kLanes, hi);
    } else {  // the last panel of a matrix whose rows are not a multiple of NR
      for (int64_t j = 0; j < cols; ++j) o[j] = from_f<O>(tile[i][j] + (bias ? bias[j] : 0.f));
    }
  }
}

}  // namespace tm
