// tokenmill CPU kernels: GEMM on panel-packed weights (see cpu_ops.h).

#include "cpu_ops.h"

#include <type_traits>

using namespace tokenmill;

namespace {

// ---- GEMM on packed weights -----------------------------------------------------------------
// ops.pack_weight stores a (N, K) weight as (ceil(N / 16), K, 16) panels: for each k the 16
// weights of 16 consecutive output rows side by side, so the micro-kernel reads one 32-byte
// (bf16) or 64-byte (float32) vector per k and broadcasts one input value per row: a 6 x 16
// output tile lives in 12 registers (the outer-product form of BLIS). bf16 panels interleave
// each 32-bit lane as (row i, row 8 + i): a shift and a mask widen them to two float32 vectors.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

inline void load16(const BFloat16* p, __m256& lo, __m256& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

constexpr int64_t kPanel = 16, kTileRows = 6;

// Software prefetch: one or two 64-byte lines per two k steps (as many bytes as two k steps of
// the panel read), from `pf` up to `end`.
struct Prefetch {
  const char* pf;
  const char* end;
};

// Tiles of 4-6 rows on bf16 panels in assembly: GCC 12 keeps only 7 of the 12 accumulators of
// the 6-row intrinsics loop in registers (the bf16 mask takes the 16th) and spills the rest
// inside the k loop: 16-20% slower decode and prefill GEMMs (same results, bit for bit). Here
// ymm0-11 accumulate (row i in ymm 2i and 2i+1), ymm12/13 hold the widened weights, ymm14 the
// broadcast input, ymm15 the mask; four k steps per iteration, two prefetched lines (128 bytes
// = 4 k steps). `.if` assembles only the rows the tile has.
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
// `pre` advances past what it prefetched, so the caller's k tail goes on from there.
template <int MR>
void tile_bf16(const float* x, int64_t ldx, const BFloat16* panel, int64_t steps, Prefetch& pre,
               float (&tile)[MR][kPanel]) {
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
      : [p] "+r"(panel), [x0] "+r"(x), [x3] "+r"(x3), [n] "+r"(steps), [pf] "+r"(pre.pf)
      : [ld] "r"(ld), [end] "r"(pre.end), [t] "r"(&tile[0][0]), [mask] "r"(kHighHalves),
        [rows] "i"(MR)
      : "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10",
        "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "cc", "memory");
}
#undef TM_ROW
#undef TM_STEP

// out[i, 0:cols] = x[i, :] . panel (+ bias) for MR input rows (stride ldx) and one panel.
template <int MR, typename W, typename O>
void micro(const float* x, int64_t ldx, const W* panel, int64_t K, const float* bias, O* out,
           int64_t ldo, int64_t cols, Prefetch pre) {
  // Few rows (decode): a second accumulator set for odd k keeps enough FMA chains in flight.
  constexpr bool kTwoSets = MR <= 3;
  __m256 c[MR][2], d[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = d[i][0] = d[i][1] = _mm256_setzero_ps();
  auto step = [&](__m256 (&acc)[MR][2], int64_t k) __attribute__((always_inline)) {
    __m256 lo, hi;
    load16(panel + k * kPanel, lo, hi);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m256 b = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(b, lo, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(b, hi, acc[i][1]);
    }
  };
  int64_t k = 0;
  if constexpr (MR >= 4 && std::is_same_v<W, BFloat16>) {
    alignas(32) float acc[MR][kPanel];
    tile_bf16<MR>(x, ldx, panel, K / 4, pre, acc);
    k = K / 4 * 4;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      c[i][0] = _mm256_load_ps(acc[i]);
      c[i][1] = _mm256_load_ps(acc[i] + 8);
    }
  }
  for (; k + 2 <= K; k += 2) {
    if (pre.pf < pre.end) {
      _mm_prefetch(pre.pf, _MM_HINT_T0);
      if (sizeof(W) == 4) _mm_prefetch(pre.pf + 64, _MM_HINT_T0);
      pre.pf += 2 * kPanel * sizeof(W);
    }
    step(c, k);
    step(kTwoSets ? d : c, k + 1);
  }
  if (k < K) step(c, k);
  // accumulators -> memory in one unrolled pass (indexing them by a runtime row would keep
  // them in memory through the k loop), then bias and the store of the valid columns
  alignas(32) float tile[MR][kPanel];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    __m256 lo = c[i][0], hi = c[i][1];
    if (kTwoSets) {
      lo = _mm256_add_ps(lo, d[i][0]);
      hi = _mm256_add_ps(hi, d[i][1]);
    }
    _mm256_store_ps(tile[i], lo);
    _mm256_store_ps(tile[i] + 8, hi);
  }
  for (int i = 0; i < MR; ++i) {
    O* o = out + i * ldo;
    if (cols == kPanel) {
      __m256 lo = _mm256_load_ps(tile[i]), hi = _mm256_load_ps(tile[i] + 8);
      if (bias) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
      }
      store8(o, lo);
      store8(o + 8, hi);
    } else {  // the last panel of a matrix whose rows are not a multiple of 16
      for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<O>(tile[i][j] + (bias ? bias[j] : 0.f));
    }
  }
}

template <typename W, typename O>
void micro_rows(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t K,
                const float* bias, O* out, int64_t ldo, int64_t cols, Prefetch pre) {
  switch (rows) {
    case 1: return micro<1>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 2: return micro<2>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 3: return micro<3>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 4: return micro<4>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    case 5: return micro<5>(x, ldx, panel, K, bias, out, ldo, cols, pre);
    default: return micro<6>(x, ldx, panel, K, bias, out, ldo, cols, pre);
  }
}

// Blocks of input rows sized to stay in a core's L2 while every panel streams past them;
// work items are (row block, panel) pairs, so a decode batch splits by panels and a prefill
// chunk by row blocks. The first row tile of a panel streams it from memory with a prefetch
// 4 KiB ahead; later tiles find it cached and prefetch the next panel meanwhile, in equal
// shares, so memory traffic overlaps arithmetic.
template <typename W, typename O>
void gemm_packed(const float* x, const W* w, const float* bias, O* out, int64_t M, int64_t N,
                 int64_t K) {
  int64_t panels = (N + kPanel - 1) / kPanel, bytes = K * kPanel * sizeof(W);
  int64_t block = std::max<int64_t>(kTileRows, (256 * 1024 / (4 * K)) / kTileRows * kTileRows);
  block = std::min(block, M);
  int64_t blocks = (M + block - 1) / block;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t m0 = t / panels * block, m1 = std::min(M, m0 + block), p = t % panels;
      int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      const W* panel = w + p * K * kPanel;
      const char* start = reinterpret_cast<const char*>(panel);
      int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
      int64_t share = tiles > 1 ? (bytes / (tiles - 1) + 63) / 64 * 64 : 0;
      // the next panel follows this one; prefetch it only when this thread reads it next
      const char* next = start + bytes;
      int64_t ahead = t + 1 < t1 && p + 1 < panels ? bytes : 0;
      for (int64_t j = 0; j < tiles; ++j) {
        Prefetch pre = j == 0 ? Prefetch{start + 4096, start + 4096 + bytes}
                              : Prefetch{next + (j - 1) * share, next + std::min(ahead, j * share)};
        int64_t m = m0 + j * kTileRows;
        micro_rows(std::min(kTileRows, m1 - m), x + m * K, K, panel, K,
                   bias ? bias + n0 : nullptr, out + m * N + n0, N, cols, pre);
      }
    }
  });
}

}  // namespace

// x: (M, K) float32 or bfloat16; w: packed (ceil(N / 16), K, 16) float32 or bfloat16 (see
// ops.pack_weight) -> (M, N) in x's dtype, or float32 when out_fp32 (logits: no bf16
// rounding of the accumulated sums).
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                     int64_t N, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == kPanel && x.size(1) == w.size(1) &&
              w.size(0) == (N + kPanel - 1) / kPanel && w.is_contiguous(),
              "linear: bad shapes");
  auto xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor bf;
  if (bias.has_value()) bf = bias->to(torch::kFloat32).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, out_fp32 ? x.options().dtype(torch::kFloat32) : x.options());
  const float* xp = xf.data_ptr<float>();
  bool wbf = w.scalar_type() == torch::kBFloat16;
  auto* wb = reinterpret_cast<const BFloat16*>(w.data_ptr());
  if (out.scalar_type() == torch::kBFloat16) {
    auto* o = reinterpret_cast<BFloat16*>(out.data_ptr());
    if (wbf) gemm_packed(xp, wb, bp, o, M, N, K);
    else gemm_packed(xp, w.data_ptr<float>(), bp, o, M, N, K);
  } else {
    auto* o = out.data_ptr<float>();
    if (wbf) gemm_packed(xp, wb, bp, o, M, N, K);
    else gemm_packed(xp, w.data_ptr<float>(), bp, o, M, N, K);
  }
  return out;
}
