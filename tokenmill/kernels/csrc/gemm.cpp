// tokenmill CPU kernels: GEMM on panel-packed weights.
//
// tm_pack_weight stores an (N, K) weight as ceil(N / NR) panels of NR = 2 x kLanes output rows:
// for each k, the panel's NR weights side by side, so the micro-kernel reads two vectors per k
// and broadcasts one input value per row; an MR x NR output tile lives in 2 x MR registers (the
// outer-product form of BLIS). bf16 panels pair rows i and kLanes + i in each 32-bit lane (a
// shift and a mask widen them, see vload_panel). With AVX512-BF16, bf16 panels instead hold k
// in pairs, (k, k + 1) of each row side by side, for the dot-product instruction (gemm_dot.h).
#include <unistd.h>

#include <algorithm>
#include <type_traits>

#include "gemm_store.h"
#include "internal.h"
#include "tm.h"
#include "vec.h"
#ifdef TM_ISA_AVX2
#include "gemm_avx2_asm.h"
#endif

namespace tm {

#if defined(TM_ISA_AVX512) || defined(TM_ISA_AVX512_BF16)
constexpr int kTileRows = 8;  // 16 of the 32 vector registers accumulate
#elif defined(TM_ISA_AVX2) || defined(TM_ISA_NEON)
constexpr int kTileRows = 6;  // 12 of 16 (AVX2) or 24 of 32 q registers (NEON)
#else
constexpr int kTileRows = 4;
#endif

// Software prefetch of a panel stream: `bytes` more from pf per call, up to end.
struct Prefetch {
  const char* pf;
  const char* end;
  void ahead(int64_t bytes) {
    if (pf >= end) return;
    for (int64_t b = 0; b < bytes; b += 64) prefetch_l1(pf + b);
    pf += bytes;
  }
};

// out[i, 0:cols] = x[i, :] . panel (+ bias) for MR float32 input rows (stride ldx), one panel.
template <int MR, typename W, typename O>
void micro(const float* x, int64_t ldx, const W* panel, int64_t K, const float* bias, O* out,
           int64_t ldo, int64_t cols, bool gated, Prefetch pre) {
  // Few rows (decode): a second accumulator set for odd k keeps enough FMA chains in flight.
  constexpr bool kTwoSets = MR <= 3;
  vec c[MR][2], d[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = d[i][0] = d[i][1] = vzero();
  auto step = [&](vec (&acc)[MR][2], int64_t k) __attribute__((always_inline)) {
    vec lo, hi;
    vload_panel(panel + k * kPanel, lo, hi);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      vec b = vset1(x[i * ldx + k]);
      acc[i][0] = vfma(b, lo, acc[i][0]);
      acc[i][1] = vfma(b, hi, acc[i][1]);
    }
  };
  int64_t k = 0;
#ifdef TM_ISA_AVX2
  if constexpr (MR >= 5 && std::is_same_v<W, bf16>) {  // where the asm loop measured faster
    alignas(32) float acc[MR][kPanel];
    tile_bf16_asm<MR>(x, ldx, panel, K / 4, pre.pf, pre.end, acc);
    k = K / 4 * 4;
    for (int i = 0; i < MR; ++i) {
      c[i][0] = vload(acc[i]);
      c[i][1] = vload(acc[i] + kLanes);
    }
  }
#endif
  for (; k + 2 <= K; k += 2) {
    pre.ahead(2 * kPanel * sizeof(W));
    step(c, k);
    step(kTwoSets ? d : c, k + 1);
  }
  if (k < K) step(c, k);
  alignas(64) float tile[MR][kPanel];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    vstore(tile[i], kTwoSets ? vadd(c[i][0], d[i][0]) : c[i][0]);
    vstore(tile[i] + kLanes, kTwoSets ? vadd(c[i][1], d[i][1]) : c[i][1]);
  }
  store_tile<MR>(tile, bias, out, ldo, cols, gated);
}

// Bytes of input rows a row block keeps in L2 while every panel streams past it: half of a
// core's L2 as the C library reports it, at least 256 KiB (all there is where it reports none).
// On a 2 MiB-L2 Xeon (1 MiB) a 512-row prefill's GEMMs ran 1.2x faster than at 256 KiB, whose
// blocks made every panel stream from memory three times. TM_ROW_BLOCK_BYTES fixes it.
inline int64_t row_block_bytes() {
#ifdef TM_ROW_BLOCK_BYTES
  return TM_ROW_BLOCK_BYTES;
#else
  static const int64_t bytes = [] {
    long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return std::max<int64_t>(256 * 1024, l2 / 2);
  }();
  return bytes;
#endif
}

// Row blocks of a GEMM: as few as fit L2 (`xbytes` per input value) and at least `least`, of
// equal size in whole tiles of MR rows, so threads taking equal runs of (block, panel) work
// items share it evenly.
struct RowBlocks {
  int64_t size, count;
  RowBlocks(int64_t M, int64_t K, int64_t MR, int64_t xbytes, int64_t least = 1) {
    int64_t most = std::max<int64_t>(MR, row_block_bytes() / (xbytes * K));
    count = std::max((M + most - 1) / most, least);
    size = ((M + count - 1) / count + MR - 1) / MR * MR;
    count = (M + size - 1) / size;
  }
};

}  // namespace tm

#ifdef TM_ISA_AMX
#include "gemm_amx.h"
#endif
#ifdef TM_ISA_AVX512_BF16
#include "gemm_dot.h"
#endif

namespace tm {

// One tile of `rows` (1 to R) rows: the micro-kernel instantiated for that row count.
template <int R, typename X, typename W, typename O, template <int, typename, typename> class M>
struct Tiles {
  static void run(int64_t rows, const X* x, int64_t ldx, const W* panel, int64_t K,
                  const float* bias, O* out, int64_t ldo, int64_t cols, bool gated, Prefetch pre) {
    if (rows >= R) return M<R, W, O>::run(x, ldx, panel, K, bias, out, ldo, cols, gated, pre);
    if constexpr (R > 1)
      Tiles<R - 1, X, W, O, M>::run(rows, x, ldx, panel, K, bias, out, ldo, cols, gated, pre);
  }
};
template <int MR, typename W, typename O> struct Fma {
  static void run(const float* x, int64_t ldx, const W* panel, int64_t K, const float* bias,
                  O* out, int64_t ldo, int64_t cols, bool gated, Prefetch pre) {
    micro<MR, W, O>(x, ldx, panel, K, bias, out, ldo, cols, gated, pre);
  }
};

// Blocks of input rows sized to stay in a core's L2 while every panel streams past them; work
// items are (row block, panel) pairs, so a decode batch splits by panels and a prefill chunk by
// row blocks, handed out by parallel_steal (a thread done early takes another's last items).
// The first row tile of a panel streams it from memory with a prefetch 4 KiB ahead; later
// tiles find it cached and prefetch the next panel meanwhile, in equal shares. gated: out has
// N / 2 columns (store_tile).
template <int MR, template <int, typename, typename> class M, typename X, typename W, typename O>
void gemm_packed(const X* x, const W* w, int64_t panel_elems, const float* bias, O* out,
                 int64_t Mrows, int64_t N, int64_t K, bool row_invariant, bool gated) {
  const int64_t ldo = gated ? N / 2 : N;
  const int64_t tile_rows = row_invariant ? 1 : MR;
  int64_t panels = (N + kPanel - 1) / kPanel, bytes = panel_elems * sizeof(W);
  const RowBlocks rb(Mrows, K, MR, sizeof(X));
  const int64_t block = rb.size, blocks = rb.count;
  parallel_steal(0, blocks * panels, [&](const auto& take) {
    for (int64_t t, t1; take(t, t1);) {  // t1: the end of the run this thread is taking
      int64_t m0 = t / panels * block, m1 = std::min(Mrows, m0 + block), p = t % panels;
      int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      const W* panel = w + p * panel_elems;
      const char* start = reinterpret_cast<const char*>(panel);
      int64_t tiles = (m1 - m0 + tile_rows - 1) / tile_rows;
      int64_t share = tiles > 1 ? (bytes / (tiles - 1) + 63) / 64 * 64 : 0;
      // the next panel follows this one; prefetch it only when this thread reads it next
      const char* next = start + bytes;
      int64_t ahead = t + 1 < t1 && p + 1 < panels ? bytes : 0;
      for (int64_t j = 0; j < tiles; ++j) {
        Prefetch pre = j == 0 ? Prefetch{start + 4096, start + 4096 + bytes}
                              : Prefetch{next + (j - 1) * share, next + std::min(ahead, j * share)};
        int64_t m = m0 + j * tile_rows;
        Tiles<MR, X, W, O, M>::run(std::min<int64_t>(tile_rows, m1 - m), x + m * K, K, panel, K,
                                   bias ? bias + n0 : nullptr, out + m * ldo + (gated ? n0 / 2 : n0),
                                   ldo, cols, gated, pre);
      }
    }
  });
}

inline bool dot_layout(int dtype) {
#ifdef TM_ISA_AVX512_BF16
  return dtype == TM_BF16;
#else
  (void)dtype;
  return false;
#endif
}

// k positions per panel (an odd k is padded to an even one in the pair layout)
inline int64_t panel_depth(int dtype, int64_t k) { return dot_layout(dtype) ? (k + 1) / 2 * 2 : k; }

// Panels from rows: row(r, buf) writes row r's k values (as float32) into buf; rows past n and
// k past the weight's are zero. Float rows hold bf16 values exactly, so a bf16 weight packs
// bit for bit.
// The slot of (row j, k kk) in a panel: see the layouts at the top of this file.
template <typename W>
inline int64_t panel_slot(bool pairs, int64_t j, int64_t kk) {
  return pairs ? (kk / 2) * 2 * kPanel + j * 2 + kk % 2
         : std::is_same_v<W, bf16> ? kk * kPanel + (j % kLanes) * 2 + j / kLanes
                                   : kk * kPanel + j;
}

template <typename W>
void pack_from(int64_t n, int64_t k, bool pairs, W* out, const RowFn& row) {
  int64_t depth = pairs ? (k + 1) / 2 * 2 : k, panels = (n + kPanel - 1) / kPanel;
  parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> rows(kPanel * depth);  // the panel's rows, zero past n and past k
    for (int64_t p = p0; p < p1; ++p) {
      std::fill(rows.begin(), rows.end(), 0.f);
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) row(p * kPanel + j, &rows[j * depth]);
      W* dst = out + p * depth * kPanel;
      for (int64_t kk = 0; kk < depth; ++kk)
        for (int64_t j = 0; j < kPanel; ++j) dst[panel_slot<W>(pairs, j, kk)] = from_f<W>(rows[j * depth + kk]);
    }
  });
}

// Rows back from panels (pack_from's inverse, values as stored): out[i] = row rows[i] (row i
// when rows is null), for i < count.
template <typename W>
void unpack_to(int64_t k, bool pairs, const W* in, const int64_t* rows, int64_t count, W* out) {
  const int64_t depth = pairs ? (k + 1) / 2 * 2 : k;
  parallel_for(0, count, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = rows ? rows[i] : i;
      const W* src = in + r / kPanel * depth * kPanel;
      for (int64_t kk = 0; kk < k; ++kk) out[i * k + kk] = src[panel_slot<W>(pairs, r % kPanel, kk)];
    }
  });
}

template <typename O>
void linear_typed(int dtype, const void* x, int64_t m, const tm_linear* w, O* out) {
  int64_t N = w->n, K = w->k, panel_elems = panel_depth(dtype, K) * kPanel;
  if (dtype == TM_F32) {
    return gemm_packed<kTileRows, Fma>(static_cast<const float*>(x),
                                       static_cast<const float*>(w->packed), panel_elems, w->bias,
                                       out, m, N, K, w->row_invariant, w->gated);
  }
  const bf16* xb = static_cast<const bf16*>(x);
  const bf16* wb = static_cast<const bf16*>(w->packed);
#ifdef TM_ISA_AVX512_BF16
  return gemm_dot(xb, wb, panel_elems, w->bias, out, m, N, K, w->row_invariant, w->gated);
#else
  thread_local std::vector<float> xf;  // the FMA tiles broadcast float32 inputs
  xf.resize(m * K);
  float* xp = xf.data();
  parallel_for(0, m, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * K; i < r1 * K; ++i) xp[i] = to_f(xb[i]);
  });
  gemm_packed<kTileRows, Fma>(static_cast<const float*>(xp), wb, panel_elems, w->bias, out, m, N,
                              K, w->row_invariant, w->gated);
#endif
}

void pack_rows(int dtype, int64_t n, int64_t k, void* out, const RowFn& row) {
  if (dtype == TM_F32) return pack_from(n, k, false, static_cast<float*>(out), row);
  pack_from(n, k, dot_layout(dtype), static_cast<bf16*>(out), row);
}

void packed_linear(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
                   void* out) {
  if (out_dtype == TM_F32) return linear_typed(dtype, x, m, w, static_cast<float*>(out));
  linear_typed(dtype, x, m, w, static_cast<bf16*>(out));
}

}  // namespace tm

using namespace tm;

extern "C" {

int64_t tm_panel_rows(void) { return kPanel; }

int64_t tm_packed_numel(int dtype, int64_t n, int64_t k) {
  return (n + kPanel - 1) / kPanel * panel_depth(dtype, k) * kPanel;
}

void tm_pack_weight(int dtype, const void* w, int64_t n, int64_t k, void* out) {
  pack_rows(dtype, n, k, out, [&](int64_t r, float* buf) {
    for (int64_t i = 0; i < k; ++i)
      buf[i] = dtype == TM_F32 ? static_cast<const float*>(w)[r * k + i]
                               : to_f(static_cast<const bf16*>(w)[r * k + i]);
  });
}

int tm_unpack_weight(int dtype, const void* packed, int64_t n, int64_t k, const int64_t* rows,
                     int64_t count, void* out) {
  for (int64_t i = 0; rows && i < count; ++i)
    if (rows[i] < 0 || rows[i] >= n) return -1;
  if (!rows) count = n;
  if (dtype == TM_F32)
    unpack_to(k, false, static_cast<const float*>(packed), rows, count, static_cast<float*>(out));
  else
    unpack_to(k, dot_layout(dtype), static_cast<const bf16*>(packed), rows, count,
              static_cast<bf16*>(out));
  return 0;
}

void tm_linear_fwd(int dtype, const void* x, int64_t m, const tm_linear* w, int out_dtype,
                   void* out, const int64_t* prompt_rows, int64_t ranges) {
  if (m <= 0) return;  // no rows (a step's last layer keeping none)
  if (w->quant) return quant_linear(dtype, x, m, w, out_dtype, out, prompt_rows, ranges);
  packed_linear(dtype, x, m, w, out_dtype, out);
}

}  // extern "C"
