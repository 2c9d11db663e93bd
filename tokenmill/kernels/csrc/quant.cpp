// tokenmill CPU kernels: linear layers on block-quantized weights (GGUF Q4_0 / Q4_1 / Q8_0 and
// whatever else reduces to the same form), run on their quantized bits.
//
// The form: weight w[o][k] = d * c + m with an unsigned code c of 4, 5 or 8 bits and one float16
// (d, m) per output row and block of 32 k (Q4_0: m = -8 d; Q8_0: c = q + 128, m = -128 d).
// Repacked at load (tm_qpack) into groups of 16 output rows, so that one 64-byte vector holds
// 4 consecutive k of 16 outputs (quant_pack.cpp); per (group, block): 16 d, 16 m (float16; a
// symmetric weight, TM_QSYM, m = -2^(bits - 1) d for every block: the 16 d alone; TM_QSUPER,
// Q4_K / Q5_K: 16 sc and 16 mn bytes, with 16 D and 16 M per 8 blocks after the group's
// blocks, d = sc D, m = -mn M; Q6_K, TM_QI6 | TM_QSUPER: 16 int8 sc for k < 16 and 16 for
// k >= 16, with 16 D per 8 blocks, d = sc D and m = -32 d per half), then the codes:
//   4 bits  4 chunks of 64 bytes; byte 4 o + t of chunk j: code k = 4 j + t (low nibble) and
//           k = 16 + 4 j + t (high nibble) of output o
//   5 bits  the 4-bit chunks, then 8 words of 64 bits: bit p of word 2 j (2 j + 1) is the
//           fifth bit of the low (high) nibble in byte p of chunk j
//   6 bits  the 4-bit chunks, then 2 x 64 bytes (low, high nibbles' k): bits 2 j, 2 j + 1 of
//           byte 4 o + t are bits 4-5 of code k = 4 j + t (+ 16)
//   8 bits  8 chunks of 64 bytes; byte 4 o + t of chunk j: code k = 4 j + t
//
// The product uses integer dot products, as llama.cpp's CPU kernels do: each input row is
// quantized per block of 32 to int8 (scale dx = max |x| / 127, rounded to nearest), then per
// block and output sum_k c * q is exact in int32 (VPDPBUSD: unsigned codes x signed int8,
// 4 products per lane) and y += d dx sum(c q) + m dx sum(q) (6 bits: per half block, two sums).
// 16 outputs per vector, so no horizontal sums; the codes of a group are read once for up to 8
// input rows.
#include <type_traits>

#include "internal.h"
#include "quant_tiles.h"
#include "tm.h"
#include "vec.h"

// Many input rows on AMX-INT8 tiles (quant_amx.h); TM_AMX_EMULATED: a build whose tile
// instructions are emulated in C++ (tests/test_amx_emulated.py only)
#if defined(TM_ISA_AMX) || defined(TM_AMX_EMULATED)
#define TM_AMX_QUANT
#include "quant_amx.h"
#endif
#ifdef TM_ISA_AMX  // prompt rows of bf16 on bf16 tiles, the weights dequantized a panel at a time
#include "quant_dequant_amx.h"
#endif

namespace tm {

// 32 values -> int8 codes q = round(x / dx), dx = max |x| / 127 (round to nearest even; the
// activations llama.cpp's CPU kernels use too); sums sum(q) of its halves (k < 16, k >= 16) in
// half[2]. (Two int8 digits per value, tried for precision, made batches of 16 rows 2x slower:
// docs/performance.md.)
template <typename T>
inline void quantize_block(const T* x, int8_t* q, float* d, int* half) {
#if defined(__AVX512F__)
  vec lo = vload(x), hi = vload(x + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  *d = amax / 127.f;
  half[0] = _mm512_reduce_add_epi32(qlo), half[1] = _mm512_reduce_add_epi32(qhi);
#else
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(to_f(x[j])));
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  half[0] = half[1] = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(to_f(x[j]) * inv));
    half[j / 16] += q[j];
  }
  *d = amax / 127.f;
#endif
}

// x (m, K) -> int8 codes, per-block scales dx and dx * sum(codes) (sx; sh, unless null: per
// half block, the 6-bit weights' sums). The codes row by row, or `tiled` (the AMX tiles' left operand,
// quant_amx.h): per 16 rows and block, 16 x 32 bytes.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t K, int8_t* xq, float* dx, float* sx,
                   float* sh, bool tiled) {
  const int64_t blocks = K / kBlock;
  parallel_for(0, m * blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / blocks;
      const int64_t at = tiled ? ((r / 16 * blocks + b % blocks) * 16 + r % 16) * kBlock : b * kBlock;
      int half[2];
      quantize_block(x + b * kBlock, xq + at, dx + b, half);
      sx[b] = dx[b] * static_cast<float>(half[0] + half[1]);
      if (sh) sh[2 * b] = dx[b] * static_cast<float>(half[0]), sh[2 * b + 1] = dx[b] * static_cast<float>(half[1]);
    }
  });
}


// out rows i .. i + R (ldo apart), group g's outputs: t's rows plus the bias
template <typename O>
void store_group(const tm_linear* w, O* out, int64_t ldo, int64_t i, int R, int64_t g,
                 const float (*t)[kGroup]) {
  const int64_t n = std::min(kGroup, w->n - g * kGroup);
  for (int r = 0; r < R; ++r) {
    O* dst = out + (i + r) * ldo + g * kGroup;
    for (int64_t o = 0; o < n; o += kLanes) {
      vec v = vload(t[r] + o);
      if (w->bias) v = vadd(v, vload_part(w->bias + g * kGroup + o, std::min<int64_t>(kLanes, n - o)));
      if (n - o >= kLanes) vstore(dst + o, v);
      else vstore_part(dst + o, v, n - o);
    }
  }
}

// out (m, w->n; rows ldo apart) = the int8 rows times w (one run of its rows: for_each_run)
template <int Q, typename O>
void qgemm(const int8_t* xq, const float* dx, const float* sx, int64_t m, const tm_linear* w,
           O* out, int64_t ldo) {
  const int64_t N = w->n, K = w->k, groups = (N + kGroup - 1) / kGroup;
  const int64_t gstride = group_stride(Q, K), sums = sums_per_block(Q);
  const auto* wq = static_cast<const uint8_t*>(w->packed);
#ifdef TM_AMX_QUANT
  if (amx_quant_runs(m, w->row_invariant, w->quant))
    return qgemm_amx<Q>(xq, dx, sx, m, N, K, wq,
                           [&](int64_t i, int R, int64_t g, const float (*y)[kGroup]) {
                             store_group(w, out, ldo, i, R, g, y);
                           });
#endif
  parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    float y[2 * kRowTile][kGroup];
    thread_local std::vector<uint8_t> wide;  // a 6-bit group widened (widen_q6: AVX2)
    if (kWidenQ6 && qbits(Q) == 6 && m >= g_q6_widen_rows) wide.resize(group_stride(kQ6Wide, K));
    for (int64_t i0 = 0; i0 < m; i0 += kRowChunk) {  // input rows stay in cache across groups
      const int64_t i1 = std::min(m, i0 + kRowChunk);
      for (int64_t g = g0; g < g1;) {
        // two groups at once where a row's broadcast feeds both (VNNI), in tiles of fewer rows
        const bool pair = kGroupPairs && g + 1 < g1;
        const bool widen = kWidenQ6 && qbits(Q) == 6 && i1 - i0 >= g_q6_widen_rows;
        if (widen) widen_q6(wq + g * gstride, K, wide.data());  // once for the row chunk
        const int64_t tile_rows = w->row_invariant ? 1 : pair ? kPairRows : kRowTile;
        for (int64_t i = i0; i < i1; i += tile_rows) {
          const int R = static_cast<int>(std::min(tile_rows, i1 - i));
          const int64_t bi = i * (K / kBlock), next = g + (pair ? 2 : 1);
          const uint8_t* pf = i == i0 && next < g1 ? wq + next * gstride : nullptr;
          if constexpr (kWidenQ6 && qbits(Q) == 6) {  // (no pairs where groups are widened)
            if (widen) {  // (widen_q6 reads the codes: nothing to prefetch)
              tile<kQ6Wide>(R, xq + i * K, dx + bi, sx + bi * sums, K, wide.data(), y, nullptr);
              store_group(w, out, ldo, i, R, g, y);
              continue;
            }
          }
          if (pair) {
            tile_pair<Q>(R, xq + i * K, dx + bi, sx + bi * sums, K, wq + g * gstride, gstride, y, pf);
          } else {
            tile<Q>(R, xq + i * K, dx + bi, sx + bi * sums, K, wq + g * gstride, y, pf);
          }
          store_group(w, out, ldo, i, R, g, y);
          if (pair) store_group(w, out, ldo, i, R, g + 1, y + R);
        }
        g += pair ? 2 : 1;
      }
    }
  });
}

// f(std::integral_constant<int, quant>) for a weight's quant code (tm.h)
template <typename F>
void with_quant(int quant, const F& f) {
  switch (quant) {
    case TM_QI4: return f(std::integral_constant<int, TM_QI4>());
    case TM_QI5: return f(std::integral_constant<int, TM_QI5>());
    case TM_QI8: return f(std::integral_constant<int, TM_QI8>());
    case TM_QI4 | TM_QSYM: return f(std::integral_constant<int, TM_QI4 | TM_QSYM>());
    case TM_QI5 | TM_QSYM: return f(std::integral_constant<int, TM_QI5 | TM_QSYM>());
    case TM_QI4 | TM_QSUPER: return f(std::integral_constant<int, TM_QI4 | TM_QSUPER>());
    case TM_QI5 | TM_QSUPER: return f(std::integral_constant<int, TM_QI5 | TM_QSUPER>());
    case TM_QI6 | TM_QSUPER: return f(std::integral_constant<int, TM_QI6 | TM_QSUPER>());
    default: return f(std::integral_constant<int, TM_QI8 | TM_QSYM>());
  }
}

// f(run, its first row) for each run of w's rows (tm_linear.runs; a weight of one code width is
// its own one run)
template <typename F>
void for_each_run(const tm_linear* w, const F& f) {
  if (w->runs == 0) return f(*w, int64_t{0});
  const auto* p = static_cast<const uint8_t*>(w->packed);
  int64_t row = 0;
  for (int s = 0; s < w->runs; ++s) {
    tm_linear run = *w;
    run.packed = p, run.n = w->run_end[s] - row, run.quant = w->run_quant[s], run.runs = 0;
    run.bias = w->bias ? w->bias + row : nullptr;
    f(run, row);
    p += tm_qpacked_bytes(run.quant, run.n, w->k);
    row = w->run_end[s];
  }
}

// Rows [0, m) of x on the int8 path: quantized per block of 32, then the integer GEMM.
void int8_rows(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
               void* out) {
  const int64_t K = w->k, blocks = m * (K / kBlock);
  thread_local std::vector<int8_t> xq[2];  // [tiled]
  thread_local std::vector<float> dx[2], sx[2], sh[2];  // sh: per half block
  bool ready[2] = {false, false}, halves = false;  // halves: a 6-bit run reads sh
  for_each_run(w, [&](const tm_linear& run, int64_t) { halves |= qhalves(run.quant); });
  // row by row, or `tiled` for the AMX tiles: whole 16-row tiles, rows past m zero
  auto quantize = [&](bool tiled) {
    const int64_t rows = tiled ? (m + 15) / 16 * 16 : m;
    std::vector<int8_t>& q = xq[tiled];
    q.resize(rows * K);
    dx[tiled].resize(rows * (K / kBlock)), sx[tiled].resize(rows * (K / kBlock));
    if (halves) sh[tiled].resize(2 * rows * (K / kBlock));
    if (tiled) std::fill(q.begin() + m / 16 * 16 * K, q.end(), int8_t{0});
    std::fill(dx[tiled].begin() + blocks, dx[tiled].end(), 0.f);
    std::fill(sx[tiled].begin() + blocks, sx[tiled].end(), 0.f);
    if (halves) std::fill(sh[tiled].begin() + 2 * blocks, sh[tiled].end(), 0.f);
    float* h = halves ? sh[tiled].data() : nullptr;
    if (dtype == TM_F32)
      quantize_rows(static_cast<const float*>(x), m, K, q.data(), dx[tiled].data(),
                    sx[tiled].data(), h, tiled);
    else
      quantize_rows(static_cast<const bf16*>(x), m, K, q.data(), dx[tiled].data(),
                    sx[tiled].data(), h, tiled);
    ready[tiled] = true;
  };
  for_each_run(w, [&](const tm_linear& run, int64_t row) {
#ifdef TM_AMX_QUANT
    const bool tiled = amx_quant_runs(m, run.row_invariant, run.quant);
#else
    const bool tiled = false;
#endif
    if (!ready[tiled]) quantize(tiled);
    const int8_t* q = xq[tiled].data();
    const float* d = dx[tiled].data();
    auto go = [&](auto* o) {
      with_quant(run.quant, [&](auto Q) {
        const float* s = (qhalves(Q()) ? sh : sx)[tiled].data();
        qgemm<Q()>(q, d, s, m, &run, o + row, w->n);
      });
    };
    if (out_dtype == TM_F32) go(static_cast<float*>(out));
    else go(static_cast<bf16*>(out));
  });
}

void quant_linear(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
                  void* out, const int64_t* prompt, int64_t ranges) {
#ifdef TM_ISA_AMX
  if (ranges && dequant_runs(dtype, w)) {  // int8 rows and prompt rows, run apart
    const int64_t xs = dtype == TM_F32 ? 4 : 2, os = out_dtype == TM_F32 ? 4 : 2;
    auto part = [&](int64_t a, int64_t b, bool dense) {
      if (b <= a) return;
      const void* xa = static_cast<const char*>(x) + a * w->k * xs;
      void* oa = static_cast<char*>(out) + a * w->n * os;
      if (!dense) return int8_rows(dtype, xa, b - a, w, out_dtype, oa);
      const auto* xb = static_cast<const bf16*>(xa);
      auto run = [&](auto* o) {
        for_each_run(w, [&](const tm_linear& r, int64_t row) {
          with_quant(r.quant, [&](auto Q) { qgemm_dequant<Q()>(xb, b - a, &r, o + row, w->n); });
        });
      };
      out_dtype == TM_F32 ? run(static_cast<float*>(oa)) : run(static_cast<bf16*>(oa));
    };
    int64_t done = 0;
    for (int64_t r = 0; r < ranges; ++r) {
      part(done, prompt[2 * r], false);
      part(prompt[2 * r], prompt[2 * r + 1], true);
      done = prompt[2 * r + 1];
    }
    return part(done, m, false);
  }
#endif
  (void)prompt, (void)ranges;  // elsewhere a prompt row's int8 path is its only one
  int8_rows(dtype, x, m, w, out_dtype, out);
}

}  // namespace tm

extern "C" {

int tm_quant_fast(void) { return tm::kFastQuant; }
int tm_q6_widens(void) { return tm::kWidenQ6; }

}  // extern "C"
