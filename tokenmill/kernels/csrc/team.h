// tokenmill CPU kernels: a step's team. A fused step (decode_stack.cpp) makes ~300 parallel
// loops; as one OpenMP region each, every loop ends at a barrier where all threads must
// arrive, so a thread the OS has descheduled (a busy neighbour on a 2-vCPU machine) stalls each
// of them while the others spin: decode ran 3.5-4x slower beside one busy process. In a team,
// the step is one OpenMP region: its first thread runs the step and hands each parallel loop
// to the others as a job of parts; any member claims the next unclaimed part, so a job is done
// when its parts are, whoever ran them, and a member that comes late finds nothing left. Idle
// members spin briefly, then sleep (futex), so a descheduled member's CPU time goes to the
// members that have work. Which member runs a part must not change its results (the loops'
// rule already: parallel_steal hands items across threads).
#pragma once

#include <atomic>
#include <cstdint>

namespace tm {

class Team {
 public:
  // body() with `threads` members (this thread and threads - 1 helpers): the parallel loops
  // it calls (common.h) run as the team's jobs; inline when threads <= 1 or already in a
  // parallel region
  template <typename B>
  static void run(int64_t threads, const B& body) {
    Team team;
    team.start(threads, [](const void* b) { (*static_cast<const B*>(b))(); }, &body);
  }

  // The team whose step this thread runs, outside the job parts; nullptr elsewhere.
  static Team* driving();

  // f(i) for each part i in [0, n), once each, by whichever member claims it; returns when
  // all are done. Called by the step's thread (driving() == this).
  template <typename F>
  void parts(int64_t n, const F& f) {
    job(n, [](const void* c, int64_t i) { (*static_cast<const F*>(c))(i); }, &f);
  }

 private:
  using Body = void (*)(const void*);
  using Part = void (*)(const void*, int64_t);
  static constexpr uint64_t kExit = uint64_t{1} << 63;

  void start(int64_t threads, Body body, const void* ctx);
  void job(int64_t n, Part f, const void* ctx);
  void help();
  bool claim();  // runs the next unclaimed part of the current job; false when none is left
  void publish(uint64_t state);

  // (exit bit, parts << 32 | next part to claim): a member claims by compare-and-swap, then
  // reads part_ / ctx_, which stay as they are until every part is done
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<uint32_t> done_{0};  // parts finished (the step thread sleeps on it)
  std::atomic<uint32_t> waiting_{0};           // the step thread sleeps on done_
  alignas(64) std::atomic<uint32_t> seq_{0};   // bumped by each job (idle helpers sleep on it)
  std::atomic<uint32_t> sleepers_{0};
  Part part_ = nullptr;
  const void* ctx_ = nullptr;
};

}  // namespace tm
