// tokenmill CPU kernels: block-quantized weights repacked into the kernels' layout (the
// layout: quant.cpp's header and quant_layout.h), and back to float32.
#include <algorithm>

#include "quant_pack.h"
#include "tm.h"

namespace tm {

// tm_qpack's layout for rows of codes (n, k), a group per task: scale(blk, o, i) writes output
// o's scales (i: its index in (n, k / 32) arrays); a TM_QSUPER weight's per-256 scales through
// super(header, o, row, s)
template <typename Scales, typename Super>
void qpack_rows(int quant, const uint8_t* codes, int64_t n, int64_t k, uint8_t* out,
                const Scales& scale, const Super& super) {
  const int64_t blocks = k / kBlock, groups = (n + kGroup - 1) / kGroup;
  const int64_t stride = group_stride(quant, k);
  parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * kGroup;
      qpack_group(quant, std::min(kGroup, n - first), k, out + g * stride,
                  [&](int64_t o) { return codes + (first + o) * k; },
                  [&](uint8_t* blk, int64_t o, int64_t b) { scale(blk, o, (first + o) * blocks + b); },
                  [&](uint16_t* hdr, int64_t o, int64_t s) { super(hdr, o, first + o, s); });
    }
  });
}

}  // namespace tm

extern "C" {

int64_t tm_qpacked_bytes(int quant, int64_t n, int64_t k) {
  return (n + tm::kGroup - 1) / tm::kGroup * tm::group_stride(quant, k);
}

void tm_qpack(int quant, const uint8_t* codes, const uint16_t* d, const uint16_t* m, int64_t n,
              int64_t k, uint8_t* out) {
  tm::qpack_rows(quant, codes, n, k, out, [&](uint8_t* blk, int64_t o, int64_t i) {
    auto* h = reinterpret_cast<uint16_t*>(blk);
    h[o] = d[i];
    if (!tm::qsym(quant)) h[tm::kGroup + o] = m[i];
  }, [](uint16_t*, int64_t, int64_t, int64_t) {});
}

void tm_qpack_super(int quant, const uint8_t* codes, const uint8_t* sc, const uint8_t* mn,
                    const uint16_t* D, const uint16_t* M, int64_t n, int64_t k, uint8_t* out) {
  const int64_t supers = k / (tm::kSuper * tm::kBlock);
  const bool halves = tm::qhalves(quant);  // sc per 16 k, D alone
  tm::qpack_rows(quant, codes, n, k, out, [&](uint8_t* blk, int64_t o, int64_t i) {
    blk[o] = halves ? sc[2 * i] : sc[i], blk[tm::kGroup + o] = halves ? sc[2 * i + 1] : mn[i];
  }, [&](uint16_t* hdr, int64_t o, int64_t row, int64_t s) {
    hdr[o] = D[row * supers + s];
    if (!halves) hdr[tm::kGroup + o] = M[row * supers + s];
  });
}

int tm_qdequantize(int quant, const uint8_t* packed, int64_t n, int64_t k, const int64_t* rows,
                   int64_t count, float* out) {
  using namespace tm;
  for (int64_t i = 0; rows && i < count; ++i)
    if (rows[i] < 0 || rows[i] >= n) return -1;
  const int64_t blocks = k / kBlock;
  parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = rows ? rows[i] : i, g = row / kGroup, o = row % kGroup;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* grp = packed + g * group_stride(quant, k);
        const uint8_t* c = grp + b * group_bytes(quant) + scale_bytes(quant);
        float d, mn;
        for (int64_t kk = 0; kk < kBlock; ++kk) {
          if (kk % 16 == 0) scales_at(quant, grp, blocks, b, static_cast<int>(o), d, mn, kk / 16);
          out[i * k + b * kBlock + kk] = d * static_cast<float>(code_at(c, qbits(quant), o, kk)) + mn;
        }
      }
    }
  });
  return 0;
}

}  // extern "C"
