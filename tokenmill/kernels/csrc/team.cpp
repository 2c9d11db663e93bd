// tokenmill CPU kernels: a step's team (team.h): claiming parts, spinning, then sleeping.
// (No <chrono>, <thread> or <ctime> here: their struct tm would clash with namespace tm.)
#include "team.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#ifndef TM_TEAM_SPIN_US
#define TM_TEAM_SPIN_US 50  // how long a member with nothing to do spins before it sleeps
#endif

namespace tm {
namespace {

thread_local Team* t_driving = nullptr;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A clock for the spin: the time-stamp counter (~3 GHz; the budget need not be exact) or the
// AArch64 virtual counter; elsewhere a count of spins.
inline uint64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#elif defined(__aarch64__)
  uint64_t t;
  asm volatile("mrs %0, cntvct_el0" : "=r"(t));
  return t;
#else
  static thread_local uint64_t n = 0;
  return n += 64;
#endif
}

inline uint64_t spin_ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return TM_TEAM_SPIN_US * 3000ull;
#elif defined(__aarch64__)
  uint64_t f;
  asm volatile("mrs %0, cntfrq_el0" : "=r"(f));
  return TM_TEAM_SPIN_US * f / 1000000;
#else
  return TM_TEAM_SPIN_US * 100ull;
#endif
}

// Sleep while *word == value (or return at once if it differs); wake the sleepers on word.
void sleep_on(std::atomic<uint32_t>& word, uint32_t value) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, value, nullptr,
          nullptr, 0);
#else
  if (word.load() == value) sched_yield();
#endif
}

void wake(std::atomic<uint32_t>& word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, 1 << 30, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

// Spin until done() or TM_TEAM_SPIN_US have passed; returns done().
template <typename F>
bool spin(const F& done) {
  const uint64_t until = ticks() + spin_ticks();
  for (int i = 1;; ++i) {
    if (done()) return true;
    relax();
    if (i % 64 == 0 && ticks() > until) return done();
  }
}

}  // namespace

Team* Team::driving() { return t_driving; }

void Team::start(int64_t threads, Body body, const void* ctx) {
#ifdef _OPENMP
  if (threads > 1 && !t_driving && !omp_in_parallel()) {
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      if (omp_get_thread_num() == 0) {
        t_driving = this;
        body(ctx);
        t_driving = nullptr;
        publish(kExit);
      } else {
        help();
      }
    }
    return;
  }
#endif
  (void)threads;
  body(ctx);
}

void Team::publish(uint64_t state) {
  state_.store(state, std::memory_order_release);
  seq_.fetch_add(1);
  if (sleepers_.load()) wake(seq_);
}

void Team::job(int64_t n, Part f, const void* ctx) {
  part_ = f, ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  publish(static_cast<uint64_t>(n) << 32);
  t_driving = nullptr;  // parallel loops inside a part run inline
  while (claim()) {
  }
  t_driving = this;
  const auto n32 = static_cast<uint32_t>(n);
  if (spin([&] { return done_.load(std::memory_order_acquire) == n32; })) return;
  for (uint32_t d; (d = done_.load()) != n32;) {  // a member holds a part: sleep till it ends
    waiting_.store(1);
    if ((d = done_.load()) != n32) sleep_on(done_, d);
    waiting_.store(0);
  }
}

bool Team::claim() {
  uint64_t v = state_.load(std::memory_order_acquire);
  for (;;) {
    const auto next = static_cast<uint32_t>(v), n = static_cast<uint32_t>(v >> 32);
    if ((v & kExit) || next >= n) return false;
    if (state_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
      part_(ctx_, next);
      if (done_.fetch_add(1) + 1 == n && waiting_.load()) wake(done_);
      return true;
    }
  }
}

void Team::help() {
  for (;;) {
    const uint32_t s = seq_.load();
    if (state_.load(std::memory_order_acquire) & kExit) return;
    if (claim()) continue;
    if (spin([&] { return seq_.load(std::memory_order_relaxed) != s; })) continue;
    sleepers_.fetch_add(1);
    if (seq_.load() == s) sleep_on(seq_, s);
    sleepers_.fetch_sub(1);
  }
}

}  // namespace tm
