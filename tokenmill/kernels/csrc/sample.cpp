// tokenmill CPU kernels: one token drawn per row of float32 logits, as the reference draws it
// (layers/sampler.py: Sampler.probs, then inverse_cdf): the temperature, min-p, top-k and
// top-p, then the first token in vocabulary order whose cumulative weight exceeds u x the
// total. The reference spends ~20 tensor ops on the whole vocabulary (16 rows of 49K: ~5 ms;
// with top-p, which sorts candidates, ~18 ms); here a row is two vector passes (its maximum;
// the weights and their sum), for top-k / top-p the few best tokens found and ordered, and a
// scan that stops at the token. Draws equal the reference's but where u falls within a
// rounding of a boundary of its cumulative distribution.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "common.h"
#include "internal.h"
#include "tm.h"
#include "vec.h"

namespace tm {

namespace {

constexpr float kSmallest = -87.f;  // weights under e^-87 (~1.6e-38) count as 0
constexpr int64_t kBlock = 16 * kLanes;  // values per partial sum (row_weights and scan agree)

// The sum of w[i, i + len) (len a multiple of kLanes) as scan and row_weights add it
inline double block_sum(const float* w, int64_t len) {
  vec acc = vzero();
  for (int64_t j = 0; j < len; j += kLanes) acc = vadd(acc, vload(w + j));
  return vsum(acc);
}

// w_i = exp(x_i) for x_i = (logit_i - m) / t (the temperature as a product by 1 / t: within
// a rounding of the reference's division) where x_i >= lo (min-p's log, at least kSmallest),
// else 0; returns their sum, added block by block as scan adds it (a target under it is
// reached)
double row_weights(const float* l, int64_t n, float m, float t, float lo, float* w) {
  const vec mv = vset1(m), inv = vset1(1.f / t), lov = vset1(lo), big = vset1(1e30f);
  const vec one = vset1(1.f);
  const int64_t whole = n / kLanes * kLanes;
  double sum = 0;
  for (int64_t b = 0; b < whole; b += kBlock) {
    const int64_t len = std::min(kBlock, whole - b);
    for (int64_t i = b; i < b + len; i += kLanes) {
      const vec d = vmul(vsub(vload(l + i), mv), inv);
      // 1 where d >= lo, 0 below it (and at -inf): (d - lo) x 1e30 + 1 clamped to [0, 1]
      const vec keep = vmin(vmax(vfma(vsub(d, lov), big, one), vzero()), one);
      vstore(w + i, vmul(vexp(d), keep));
    }
    sum += block_sum(w + b, len);
  }
  for (int64_t i = whole; i < n; ++i) {
    const float d = (l[i] - m) * (1.f / t);
    w[i] = d >= lo ? std::exp(d) : 0.f;
    sum += w[i];
  }
  return sum;
}

// The first index whose cumulative weight (in index order) exceeds target (under the total);
// the last positive weight if rounding leaves none
int64_t scan(const float* w, int64_t n, double target) {
  const int64_t whole = n / kLanes * kLanes;
  double cum = 0;
  int64_t i = 0;
  for (; i < whole; i += kBlock) {  // whole blocks while the target is past them
    const double s = block_sum(w + i, std::min(kBlock, whole - i));
    if (cum + s > target) break;
    cum += s;
  }
  for (i = std::min(i, whole); i < n; ++i) {
    cum += w[i];
    if (w[i] > 0 && cum > target) return i;
  }
  for (i = n - 1; i >= 0 && w[i] <= 0; --i) {}
  return i;
}

// Below the total: u x total, at most the float just under it (as inverse_cdf keeps it)
double draw_target(double total, float u) {
  const float t = static_cast<float>(total);
  return std::min(static_cast<double>(u) * total, static_cast<double>(std::nextafter(t, 0.f)));
}

// A candidate: its logit and index, the better first (the larger logit, then the lower index)
struct Cand {
  float logit;
  int32_t i;
  bool operator<(const Cand& o) const { return logit > o.logit || (logit == o.logit && i < o.i); }
};

// The tokens whose weight is >= floor as candidates (a vector compare, then its set lanes)
void at_least(const float* l, const float* w, int64_t n, float floor, std::vector<Cand>& c) {
  const vec f = vset1(floor);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec v = vload(w + i);
    for (int hit = vmask_eq(vmax(v, f), v); hit; hit &= hit - 1) {
      const int32_t j = static_cast<int32_t>(i + __builtin_ctz(hit));
      c.push_back({l[j], j});
    }
  }
  for (; i < n; ++i)
    if (w[i] >= floor) c.push_back({l[i], static_cast<int32_t>(i)});
}

// A weight the k-th largest is at least: the k-th largest of the vectors' maxima (k vectors
// hold one weight at least that large each)
float top_k_floor(const float* w, int64_t n, int64_t k, std::vector<float>& maxima) {
  maxima.clear();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) maxima.push_back(vhmax(vload(w + i)));
  for (; i < n; ++i) maxima.push_back(w[i]);
  if (static_cast<int64_t>(maxima.size()) <= k) return 0.f;
  std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<>());
  return maxima[k - 1];
}

// How many of the best candidates top-p keeps: a token is kept while the mass of the better
// ones is under top_p (w / mass its probability). Halves the range with nth_element (the better
// half first) instead of sorting every candidate; sorts the last few.
size_t nucleus(Cand* c, size_t n, const float* w, double mass, double top_p) {
  size_t lo = 0, hi = n;  // c[0, lo) kept, c[hi, n) not; `before` the mass of c[0, lo)
  double before = 0;
  while (hi - lo > 64) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(c + lo, c + mid, c + hi);
    double s = 0;
    for (size_t j = lo; j < mid; ++j) s += w[c[j].i] / mass;
    if (before + s < top_p) before += s, lo = mid;  // c[mid] too: the mass before it is under
    else hi = mid;
  }
  std::sort(c + lo, c + hi);
  while (lo < hi && before < top_p) before += w[c[lo++].i] / mass;
  return lo;
}

struct SampleScratch {
  std::vector<float> w, maxima;
  std::vector<int32_t> idx;
  std::vector<Cand> cand;
};

int64_t sample_row(const float* l, int64_t n, float t, int64_t top_k, float top_p, float min_p,
                   float u, SampleScratch& sc) {
  sc.w.resize(n);
  float* w = sc.w.data();
  if (t <= 0) return -1;  // a greedy row: the caller's argmax
  bool nan;
  const float m = row_max(l, n, nan);
  if (nan || m == -INFINITY) return -1;  // a NaN, or no finite logit: the reference draws
  const float lo = min_p > 0 ? std::max(kSmallest, std::log(min_p)) : kSmallest;
  const double total = row_weights(l, n, m, t, lo, w);
  const bool use_k = top_k > 0 && top_k < n, use_p = top_p < 1;
  if (!use_k && !use_p) return scan(w, n, draw_target(total, u));
  // the candidates: every weight the k best (top-k) or the nucleus (top-p) can hold. Top-p's
  // tokens are the best ones while the mass before them is under top_p, so all have a weight
  // of at least (1 - top_p) total / n: the weights below that add up to less than 1 - top_p.
  const float floor = use_k ? top_k_floor(w, n, top_k, sc.maxima)
                            : static_cast<float>((1.0 - top_p) * total / static_cast<double>(n));
  std::vector<Cand>& c = sc.cand;
  c.clear();
  at_least(l, w, n, std::max(floor, std::numeric_limits<float>::min()), c);
  size_t keep = c.size();
  double mass = total;  // top-p's probabilities are among the tokens top-k kept
  if (use_k) {
    if (static_cast<int64_t>(keep) > top_k) {  // the k best and any equal to the k-th
      std::nth_element(c.begin(), c.begin() + (top_k - 1), c.end());
      const float kth = c[top_k - 1].logit;
      keep = std::partition(c.begin() + top_k, c.end(),
                            [&](const Cand& x) { return x.logit == kth; }) - c.begin();
    }
    mass = 0;
    for (size_t j = 0; j < keep; ++j) mass += w[c[j].i];
  }
  if (use_p) keep = nucleus(c.data(), keep, w, mass, top_p);
  std::vector<int32_t>& idx = sc.idx;  // drawn in vocabulary order, as the reference draws
  idx.clear();
  for (size_t j = 0; j < keep; ++j) idx.push_back(c[j].i);
  std::sort(idx.begin(), idx.end());
  double kept_total = 0;
  for (int32_t i : idx) kept_total += w[i];
  const double target = draw_target(kept_total, u);
  double cum = 0;
  for (int32_t i : idx) {
    cum += w[i];
    if (cum > target) return i;
  }
  return idx.empty() ? -1 : idx.back();
}

}  // namespace

}  // namespace tm

using namespace tm;

extern "C" void tm_sample_rows(const float* logits, int64_t rows, int64_t vocab,
                               const float* temperatures, const int64_t* top_k,
                               const float* top_p, const float* min_p, const float* u,
                               int64_t* out) {
  parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    thread_local SampleScratch sc;
    for (int64_t r = r0; r < r1; ++r)
      out[r] = sample_row(logits + r * vocab, vocab, temperatures[r], top_k[r], top_p[r],
                          min_p[r], u[r], sc);
  });
}
