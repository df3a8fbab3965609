// Rows over a vocabulary, read in vector arithmetic. dyspec::row_stats: each row of logits read twice,
// for its argmax (its first largest entry, a NaN counting as largest, as torch.argmax) and its
// logsumexp. dyspec::inverse_cdf: draws from rows of probabilities by their cumulative sums in double.
// See row_stats.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

using namespace dyspec_vec;

// one pass for the largest entry and where it first occurs (each lane keeps the block of its own first
// largest entry: `>` never moves it to a tie), one for the sum of exponentials
void row(const float* x, int64_t V, int64_t* argmax, float* lse) {
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  const int64_t blocks = V / LANES;
  vec tops = vec{} + lowest;
  ivec where = {}, nans = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const vec v = load(x + b * LANES);
    const ivec up = v > tops;
    tops = up ? v : tops;
    where = up ? ivec{} + static_cast<int32_t>(b) : where;
    nans |= v != v;
  }
  float top = lowest;
  int64_t first = V;
  bool nan = false;
  for (int i = 0; i < LANES; ++i) {
    nan |= nans[i] != 0;
    const int64_t at = static_cast<int64_t>(where[i]) * LANES + i;
    if (blocks > 0 && (tops[i] > top || (tops[i] == top && at < first))) top = tops[i], first = at;
  }
  for (int64_t j = blocks * LANES; j < V; ++j) {
    nan |= std::isnan(x[j]);
    if (x[j] > top || first == V) top = x[j], first = j;
  }
  if (nan) {  // torch.argmax's: the first NaN
    first = 0;
    while (!std::isnan(x[first])) ++first;
    top = NAN;
  }
  *argmax = first;
  if (nan || std::isinf(top)) {  // an infinite largest entry is the logsumexp
    *lse = top;
    return;
  }
  vec total = {};
  for (int64_t b = 0; b < blocks; ++b) total += exp_nonpositive(load(x + b * LANES) - top);
  float sum = lanes_sum(total);
  for (int64_t j = blocks * LANES; j < V; ++j) sum += std::exp(x[j] - top);
  *lse = top + std::log(sum);
}

std::tuple<at::Tensor, at::Tensor> row_stats(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() >= 1 && logits.scalar_type() == at::kFloat, "row_stats: float32 logits [..., V]");
  const at::Tensor x = logits.contiguous();
  const int64_t V = x.size(-1);
  TORCH_CHECK(V >= 1, "row_stats: rows of at least one entry");
  const std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor argmax = at::empty(shape, x.options().dtype(at::kLong));
  at::Tensor lse = at::empty(shape, x.options());
  const float* X = x.data_ptr<float>();
  int64_t* A = argmax.data_ptr<int64_t>();
  float* L = lse.data_ptr<float>();
  // rows on every core from four on: below, waking the other threads costs more than a row
  at::parallel_for(0, argmax.numel(), 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) row(X + r * V, V, A + r, L + r);
  });
  return {argmax, lse};
}

// a block's sum in double: its two halves widened and added, then halved down to one lane
inline double block_sum(vec v) {
  typedef double dvec4 __attribute__((vector_size(4 * sizeof(double))));
  typedef double dvec2 __attribute__((vector_size(2 * sizeof(double))));
#if DYSPEC_LANES == 16
  typedef double dvec8 __attribute__((vector_size(8 * sizeof(double))));
  const dvec8 s = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), dvec8) +
                  __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), dvec8);
  const dvec4 h = __builtin_shufflevector(s, s, 0, 1, 2, 3) + __builtin_shufflevector(s, s, 4, 5, 6, 7);
#else
  const dvec4 h = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), dvec4) +
                  __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), dvec4);
#endif
  const dvec2 q = __builtin_shufflevector(h, h, 0, 1) + __builtin_shufflevector(h, h, 2, 3);
  return q[0] + q[1];
}

// the first column whose cumulative sum passes u * the row's total: the sums in double, a block of LANES
// at a time, then column by column from the block that passes; a column of probability 0 never passes
// first. Where rounding keeps every sum below, the last column of positive probability.
void inverse_cdf_row(const float* p, int64_t V, const double* u, int64_t n, int64_t* out) {
  const int64_t blocks = V / LANES;
  std::vector<double> sums(blocks + 1);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = total;
    total += block_sum(load(p + b * LANES));
  }
  sums[blocks] = total;
  for (int64_t j = blocks * LANES; j < V; ++j) total += p[j];
  int64_t last = V - 1;
  while (last > 0 && !(p[last] > 0.f)) --last;
  for (int64_t k = 0; k < n; ++k) {
    const double target = u[k] * total;
    // the block whose start is at or below target and whose end passes it
    const int64_t b = std::upper_bound(sums.begin(), sums.end(), target) - sums.begin() - 1;
    double running = sums[b];
    int64_t pick = last;
    for (int64_t j = b * LANES; j < V; ++j) {
      running += p[j];
      if (running > target && p[j] > 0.f) {
        pick = j;
        break;
      }
    }
    out[k] = pick;
  }
}

at::Tensor inverse_cdf(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat, "inverse_cdf: float32 probabilities [rows, V]");
  TORCH_CHECK(u.dim() == 2 && u.size(0) == probs.size(0) && u.scalar_type() == at::kDouble,
              "inverse_cdf: float64 uniforms [rows, n]");
  const at::Tensor p = probs.contiguous(), v = u.contiguous();
  const int64_t rows = p.size(0), V = p.size(1), n = v.size(1);
  TORCH_CHECK(V >= 1, "inverse_cdf: rows of at least one entry");
  at::Tensor out = at::empty({rows, n}, p.options().dtype(at::kLong));
  const float* P = p.data_ptr<float>();
  const double* U = v.data_ptr<double>();
  int64_t* O = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) inverse_cdf_row(P + r * V, V, U + r * n, n, O + r * n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dyspec, m) {
  m.def("row_stats(Tensor logits) -> (Tensor argmax, Tensor logsumexp)", &row_stats);
  m.def("inverse_cdf(Tensor probs, Tensor u) -> Tensor", &inverse_cdf);
}
