// dyspec::row_stats: each row of logits [n, V] read twice, for its argmax (its first largest entry, a
// NaN counting as largest, as torch.argmax) and its logsumexp. See row_stats.py.
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(dyspec, m) { m.def("row_stats(Tensor logits) -> (Tensor argmax, Tensor logsumexp)", &row_stats); }
