"""Decode attention's bf16 score paths (AVX512-BF16 build) give bit-identical scores: per key
with a horizontal reduction (score_dot, attention.cpp) and keys in lanes after a transpose, one
query at a time (score_lanes) or several sharing each loaded plane (score_lanes_all,
attention_lanes.h). A task takes one or the other by its number of queries, so a
verifying row's scores must equal what the row gets alone to the last bit; the attention output
(probabilities rounded to bf16, a bf16 result) hides most last-bit differences, so the scores
are compared directly, by a small program built from the kernel sources."""

import subprocess

import pytest

from tokenmill.kernels.build import BASE_FLAGS, CSRC, ISA_FLAGS, compiler
from tokenmill.kernels.isa import supported_isas

PROGRAM = r"""
#include "attention.cpp"
#include <cstdio>
#include <cstring>
namespace tm { int g_threads = 1; }
int main() {
  uint32_t state = 1;  // xorshift32 (<random> would declare struct tm: the namespace's name)
  auto u = [&] {
    state ^= state << 13, state ^= state >> 17, state ^= state << 5;
    return (state >> 8) * (8.f / 16777216.f) - 4.f;
  };
  long differ = 0, total = 0;
  for (int D : {32, 64, 128, 256})
    for (int rows = 1; rows <= 16; ++rows)
      for (int trial = 0; trial < 40; ++trial) {
        const int stride = 3 * D + 14;  // a KV head's slice of a wider cache row
        const int count = trial % 9 + 1;  // queries scored together by score_lanes_all
        std::vector<tm::bf16> q(count * D), k(16 * stride);
        for (auto& x : q) x = tm::from_f<tm::bf16>(u() * (trial % 7 + 1));
        for (auto& x : k) x = tm::from_f<tm::bf16>(u());
        float a[9][16], b[16], c[9][16];
        const tm::bf16* qs[9];
        float* cs[9];
        alignas(64) uint32_t kt[tm::kMaxHeadDim / 2 * 16];
        tm::transpose_keys(k.data(), stride, rows, D, kt);
        for (int g = 0; g < count; ++g) {
          tm::score_dot(q.data() + g * D, k.data(), stride, rows, D, 0.125f, a[g]);
          qs[g] = q.data() + g * D, cs[g] = c[g];
        }
        tm::score_lanes(q.data(), kt, rows, D, 0.125f, b);
        tm::score_lanes_all(qs, kt, rows, D, 0.125f, cs, count);
        for (int j = 0; j < rows; ++j, ++total) differ += std::memcmp(&a[0][j], &b[j], 4) != 0;
        for (int g = 0; g < count; ++g)
          for (int j = 0; j < rows; ++j, ++total) differ += std::memcmp(&a[g][j], &c[g][j], 4) != 0;
      }
  std::printf("%ld %ld\n", differ, total);
}
"""


@pytest.mark.skipif("avx512_bf16" not in supported_isas() or compiler() is None,
                    reason="needs a CPU with AVX512-BF16 and a C++ compiler")
def test_lanes_scores_equal_per_key_scores(tmp_path):
    src, exe = tmp_path / "lanes.cpp", tmp_path / "lanes"
    src.write_text(PROGRAM)
    flags = [f for f in BASE_FLAGS if f not in ("-shared", "-fPIC", "-fvisibility=hidden")]
    subprocess.run([compiler(), *flags, "-DTM_ISA_AVX512_BF16", *ISA_FLAGS["avx512_bf16"],
                    "-fopenmp", f"-I{CSRC}", str(src), str(CSRC / "team.cpp"), "-o", str(exe)],
                   check=True)
    differ, total = map(int, subprocess.run([str(exe)], capture_output=True, text=True,
                                            check=True).stdout.split())
    # every head_dim, 1-16 keys, 40 draws: score_lanes, then 1-9 queries together
    assert total == 4 * 136 * (40 + sum(t % 9 + 1 for t in range(40)))
    assert differ == 0
