// tokenmill CPU kernels: what one source file of the library calls in another (not exported).
#pragma once

#include <functional>

#include "tm.h"

namespace tm {

// row(r, buf): the k values of weight row r, as float32
using RowFn = std::function<void(int64_t, float*)>;

// gemm.cpp: pack an (n, k) weight given row by row into this build's panels for `dtype`; the
// GEMM on packed panels (tm_linear_fwd without quantization)
void pack_rows(int dtype, int64_t n, int64_t k, void* out, const RowFn& row);
void packed_linear(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
                   void* out);

// quant.cpp: the GEMM on block-quantized weights (tm_linear_fwd with quantization); the
// prompt row ranges as tm_linear_fwd takes them
void quant_linear(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
                  void* out, const int64_t* prompt, int64_t ranges);

// elementwise.cpp: a row's largest value (NaNs aside, -inf for none) and whether it has a NaN
float row_max(const float* p, int64_t n, bool& has_nan);

// kv_store.cpp: rows (n, D <= 256) float32 <- rows @ R, or @ R^T (the int4 KV rotation)
void rotate_rows(float* x, int64_t n, int64_t D, const float* R, bool transpose);

}  // namespace tm
