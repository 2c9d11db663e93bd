// tests/test_team.py: a step's team (tokenmill/kernels/csrc/team.h) runs each part of each
// job exactly once, whichever member claims it, finishes a job only when its parts are done,
// runs loops inside a part inline, and keeps going through members that sleep between jobs.
// Prints "bad ..." lines for failures and "ok ..." for each check passed.
// (no <chrono> or <thread>: their <ctime> declares a struct tm, which the namespace tm hides)
#include <unistd.h>

#include <cstdio>

#include "../../tokenmill/kernels/csrc/common.h"

namespace tm {
int g_threads = 4;
}

using tm::Team;

static int bad = 0;
#define CHECK(cond, ...) \
  if (!(cond)) ++bad, std::printf("bad " __VA_ARGS__), std::printf("\n")

int main() {
  // outside a team: the loops make their own OpenMP regions, as before
  CHECK(Team::driving() == nullptr, "driving outside a team");
  Team::run(4, [] {
    Team* team = Team::driving();
    CHECK(team != nullptr && omp_get_thread_num() == 0, "the step runs on the team's first thread");
    // parallel_for: one slice per member, each once; a loop inside a part runs inline
    std::vector<int> seen(1000, 0), inner_ok(4, 1);
    tm::parallel_for(0, 1000, 1, [&](int64_t b, int64_t e) {
      const int me = omp_get_thread_num();
      CHECK(Team::driving() == nullptr, "driving() inside a part");
      tm::parallel_for(b, e, 1, [&](int64_t b2, int64_t e2) {
        if (omp_get_thread_num() != me || b2 != b || e2 != e) inner_ok[b / 250] = 0;
        for (int64_t i = b2; i < e2; ++i) __atomic_add_fetch(&seen[i], 1, __ATOMIC_RELAXED);
      });
    });
    for (int i = 0; i < 1000; ++i) CHECK(seen[i] == 1, "parallel_for item %d ran %d times", i, seen[i]);
    for (int s = 0; s < 4; ++s) CHECK(inner_ok[s], "a loop inside slice %d did not run inline", s);
    CHECK(Team::driving() == team, "driving() after a job");
    std::printf("ok parallel_for\n");

    // parallel_dynamic: a slow member (thread 3, 20x slower a part) runs few of the parts
    std::vector<int> owner(400, -1), runs(400, 0);
    tm::parallel_dynamic(400, [&](int64_t i) {
      const int me = omp_get_thread_num();
      owner[i] = me;
      __atomic_add_fetch(&runs[i], 1, __ATOMIC_RELAXED);
      usleep(me == 3 ? 2000 : 100);
    });
    int slow = 0;
    for (int i = 0; i < 400; ++i) {
      CHECK(runs[i] == 1, "parallel_dynamic part %d ran %d times", i, runs[i]);
      slow += owner[i] == 3;
    }
    CHECK(slow < 400 / 8, "the slow member ran %d of 400 parts", slow);
    std::printf("ok parallel_dynamic %d\n", slow);

    // parallel_steal in a team: every item once
    std::vector<int> taken(203, 0);
    tm::parallel_steal(0, 203, [&](const auto& take) {
      for (int64_t i, hint; take(i, hint);) __atomic_add_fetch(&taken[i], 1, __ATOMIC_RELAXED);
    });
    for (int i = 0; i < 203; ++i) CHECK(taken[i] == 1, "parallel_steal item %d ran %d times", i, taken[i]);
    std::printf("ok parallel_steal\n");

    // a job ends only when its parts have: a member's slow part is finished before it returns
    int finished = 0;
    tm::parallel_for(0, 4, 1, [&](int64_t b, int64_t) {
      if (b == 3) usleep(20000), __atomic_store_n(&finished, 1, __ATOMIC_RELAXED);
    });
    CHECK(finished == 1, "a job returned before its slow part ended");
    std::printf("ok waits\n");

    // many small jobs, with pauses longer than the members' spin (they sleep, then are woken)
    std::vector<int> count(4, 0);
    for (int j = 0; j < 20000; ++j) {
      tm::parallel_for(0, 4, 1, [&](int64_t b, int64_t) {
        __atomic_add_fetch(&count[b], 1, __ATOMIC_RELAXED);
      });
      if (j % 1000 == 0) usleep(2000);
    }
    for (int s = 0; s < 4; ++s) CHECK(count[s] == 20000, "slice %d ran %d of 20000 times", s, count[s]);
    std::printf("ok many jobs\n");
  });
  CHECK(Team::driving() == nullptr, "driving after the team");
  // a team of one: the body runs inline, its loops too
  Team::run(1, [] { CHECK(Team::driving() == nullptr, "a team of one drives"); });
  std::printf("ok done\n");
  return bad != 0;
}
