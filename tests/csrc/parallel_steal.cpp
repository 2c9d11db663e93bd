// tests/test_parallel_steal.py: parallel_steal (tokenmill/kernels/csrc/common.h) hands out every
// item exactly once while the last thread runs 20x slower per item; prints, per item, the
// thread that took it, then each thread's first item and how many hints pointed past it.
// (no <chrono> or <thread>: their <ctime> declares a struct tm, which the namespace tm hides)
#include <unistd.h>

#include <cstdio>

#include "../../tokenmill/kernels/csrc/common.h"

namespace tm {
int g_threads = 4;
}

int main() {
  const int64_t n = 203;
  std::vector<int> owner(n, -1), taken(n, 0);
  tm::parallel_steal(0, n, [&](const auto& take) {
    const int me = omp_get_thread_num();
    for (int64_t i, hint; take(i, hint);) {
      __atomic_add_fetch(&taken[i], 1, __ATOMIC_RELAXED);
      owner[i] = me;
      if (hint <= i) std::printf("bad hint %lld for %lld\n", (long long)hint, (long long)i);
      usleep(me == tm::g_threads - 1 ? 2000 : 100);
    }
  });
  for (int64_t i = 0; i < n; ++i) std::printf("%d %d\n", owner[i], taken[i]);
}
