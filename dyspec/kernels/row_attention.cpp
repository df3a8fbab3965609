// dyspec::row_attention: each query row of a decoding forward over the cached keys it sees, read in
// place at `slots`, in position order. A row's result depends on its query, its keys and values and
// nothing else: no padding, no batch, the same loops whatever rows share the call. So a token tree's
// row computes bit for bit what the one-token forward of its path computes. See row_attention.py.
// Beside it, the cache's other per-step work: the slots each row sees (visible_slots) and a commit's
// moves (keep_slots).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using namespace dyspec_vec;

// the lanes of s0..s3, each in the halving tree of lanes_sum, four at once for a quarter of the shuffles
inline vec4 lanes_sums(vec s0, vec s1, vec s2, vec s3) {
#if DYSPEC_LANES == 16
  const vec a = __builtin_shufflevector(s0, s1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(s0, s1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec b = __builtin_shufflevector(s2, s3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(s2, s3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec c = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vec8 e = __builtin_shufflevector(c, c, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(c, c, 2, 3, 6, 7, 10, 11, 14, 15);
#else
  const vec8 a = __builtin_shufflevector(s0, s1, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(s0, s1, 4, 5, 6, 7, 12, 13, 14, 15);
  const vec8 b = __builtin_shufflevector(s2, s3, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(s2, s3, 4, 5, 6, 7, 12, 13, 14, 15);
  const vec8 e = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
#endif
  return __builtin_shufflevector(e, e, 0, 2, 4, 6) + __builtin_shufflevector(e, e, 1, 3, 5, 7);
}

// a . b over d floats in position order
inline float dot_any(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// softmax weights of a row's scores p [m], in place and not normalized; returns 1 / their total. The
// largest score is the same in any order; the total sums LANES-wide slices, then their lanes: an order
// set by m alone
inline float softmax_weights(float* p, int64_t m) {
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  vec tops = vec{} + lowest;
  int64_t j = 0;
  for (; j + LANES <= m; j += LANES) {
    const vec x = load(p + j);
    tops = x > tops ? x : tops;
  }
  float top = lowest;
  for (int i = 0; i < LANES; ++i) top = std::max(top, tops[i]);
  for (; j < m; ++j) top = std::max(top, p[j]);
  vec total = {};
  for (j = 0; j + LANES <= m; j += LANES) {
    const vec w = exp_nonpositive(load(p + j) - top);
    std::memcpy(p + j, &w, sizeof w);
    total += w;
  }
  vec tail = vec{} + top;  // e^0 in the lanes past m, left out of the total
  std::memcpy(&tail, p + j, (m - j) * sizeof(float));
  tail = exp_nonpositive(tail - top);
  std::memcpy(p + j, &tail, (m - j) * sizeof(float));
  for (int64_t i = m - j; i < LANES; ++i) tail[i] = 0.f;
  return 1.f / lanes_sum(total + tail);
}

// G query heads [G, D] of a row that read one key head, over the m keys it sees: each key, then each
// value, is loaded once for all G, and the G heads' independent sums keep the FMA units busy. Every
// head's arithmetic is the one a head alone would run. p: the scores' room, [G, P]
template <int D, int G>
void attend_heads(const float* queries, const float* K, int64_t k_slot, const float* V, int64_t v_slot,
                  const int64_t* seen, int64_t m, float factor, float* p, int64_t P, float* o) {
  constexpr int C = D / LANES;
  vec q[G][C], sum[G][C] = {};
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) q[h][c] = load(queries + h * D + c * LANES);
  for (int64_t j = 0; j < m; j += 4) {  // four keys at a time, the last repeated past m
    const float* k[4];
    for (int t = 0; t < 4; ++t) k[t] = K + seen[std::min(j + t, m - 1)] * k_slot;
    for (int h = 0; h < G; ++h) {
      vec s[4];
      for (int t = 0; t < 4; ++t) s[t] = q[h][0] * load(k[t]);
      for (int c = 1; c < C; ++c)
        for (int t = 0; t < 4; ++t) s[t] += q[h][c] * load(k[t] + c * LANES);
      const vec4 scores = lanes_sums(s[0], s[1], s[2], s[3]) * factor;
      std::memcpy(p + h * P + j, &scores, std::min<int64_t>(4, m - j) * sizeof(float));
    }
  }
  float inverse[G];
  for (int h = 0; h < G; ++h) inverse[h] = softmax_weights(p + h * P, m);
  for (int64_t j = 0; j < m; ++j) {
    const float* value = V + seen[j] * v_slot;
    vec v[C];
    for (int c = 0; c < C; ++c) v[c] = load(value + c * LANES);
    for (int h = 0; h < G; ++h) {
      const vec w = vec{} + p[h * P + j];
      for (int c = 0; c < C; ++c) sum[h][c] += w * v[c];
    }
  }
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) {
      const vec out = sum[h][c] * inverse[h];
      std::memcpy(o + h * D + c * LANES, &out, sizeof out);
    }
}

// heads taken together: their queries (or their sums) fill at most half the vector registers
template <int D>
constexpr int HEADS_TOGETHER = std::max(1, REGISTERS / 2 * LANES / D);

// the g query heads of a row that read one key head, HEADS_TOGETHER<D> at a time
template <int D, int... G>
void attend(const float* queries, int64_t g, const float* K, int64_t k_slot, const float* V, int64_t v_slot,
            const int64_t* seen, int64_t m, float factor, float* p, int64_t P, float* o,
            std::integer_sequence<int, G...>) {
  for (int64_t h = 0; h < g; h += HEADS_TOGETHER<D>) {
    const int64_t together = std::min<int64_t>(HEADS_TOGETHER<D>, g - h);
    ((together == G + 1 ? attend_heads<D, G + 1>(queries + h * D, K, k_slot, V, v_slot, seen, m, factor, p, P,
                                                 o + h * D)
                        : void()),
     ...);
  }
}

// a head size the compiler does not know: each head in position order, scalar
void attend_any(const float* queries, int64_t g, const float* K, int64_t k_slot, const float* V, int64_t v_slot,
                const int64_t* seen, int64_t m, int64_t d, float factor, float* p, float* o) {
  for (int64_t h = 0; h < g; ++h, queries += d, o += d) {
    for (int64_t j = 0; j < m; ++j) p[j] = dot_any(queries, K + seen[j] * k_slot, d) * factor;
    const float inverse = softmax_weights(p, m);
    for (int64_t i = 0; i < d; ++i) o[i] = 0.f;
    for (int64_t j = 0; j < m; ++j) {
      const float* value = V + seen[j] * v_slot;
      for (int64_t i = 0; i < d; ++i) o[i] += p[j] * value[i];
    }
    for (int64_t i = 0; i < d; ++i) o[i] *= inverse;
  }
}

}  // namespace

// q [n, H, d]; keys, values [Hkv, capacity, d]; slots [n, C] int64, of which row r reads the first
// counts[r]; scale: the scores' factor. Returns [n, H, d]; query head h reads key head h / (H / Hkv).
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& slots, const at::Tensor& counts, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "row_attention: q [n, H, d], keys and values [Hkv, capacity, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat, "row_attention: float32 q, keys and values");
  TORCH_CHECK(slots.scalar_type() == at::kLong && counts.scalar_type() == at::kLong, "row_attention: int64 slots and counts");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && q.size(2) == keys.size(2), "row_attention: keys and values of q's head size, contiguous in it");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), Hkv = keys.size(0), capacity = keys.size(1);
  TORCH_CHECK(H % Hkv == 0 && slots.dim() == 2 && slots.size(0) == n && counts.numel() == n, "row_attention: slots [n, C], counts [n]");
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), cc = counts.contiguous();
  const int64_t C = slots.size(1), g = H / Hkv;
  const float* Q = qc.data_ptr<float>();
  const float* K = keys.data_ptr<float>();
  const float* V = values.data_ptr<float>();
  const int64_t* S = sc.data_ptr<int64_t>();
  const int64_t* counts_ = cc.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(counts_[r] >= 1 && counts_[r] <= C, "row_attention: each row sees 1 to C slots");
    for (int64_t j = 0; j < counts_[r]; ++j)
      TORCH_CHECK(S[r * C + j] >= 0 && S[r * C + j] < capacity, "row_attention: a slot past the cache");
  }
  at::Tensor out = at::empty({n, H, d}, q.options());
  float* O = out.data_ptr<float>();
  const float factor = static_cast<float>(scale);
  const int64_t k_head = keys.stride(0), k_slot = keys.stride(1), v_head = values.stride(0), v_slot = values.stride(1);
  // a unit of work: the query heads of a row that read one key head and go together (HEADS_TOGETHER),
  // so that a one-row forward has several units for the threads to share
  const int64_t together = d == 64 ? HEADS_TOGETHER<64> : d == 128 ? HEADS_TOGETHER<128> : g;
  const int64_t groups = (g + together - 1) / together;
  at::parallel_for(0, Hkv * n * groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> p(g * C);
    for (int64_t unit = first; unit < last; ++unit) {
      // a key head's rows in turn: a thread reads each key head's keys once for all its rows
      const int64_t kv = unit / (n * groups), r = unit / groups % n, h = unit % groups * together;
      const int64_t m = counts_[r], at = ((r * Hkv + kv) * g + h) * d, heads = std::min(together, g - h);
      const float *k = K + kv * k_head, *v = V + kv * v_head, *q_heads = Q + at;
      const int64_t* seen = S + r * C;
      float* o = O + at;
      if (d == 64)
        attend<64>(q_heads, heads, k, k_slot, v, v_slot, seen, m, factor, p.data(), C, o,
                   std::make_integer_sequence<int, HEADS_TOGETHER<64>>{});
      else if (d == 128)
        attend<128>(q_heads, heads, k, k_slot, v, v_slot, seen, m, factor, p.data(), C, o,
                    std::make_integer_sequence<int, HEADS_TOGETHER<128>>{});
      else
        attend_any(q_heads, heads, k, k_slot, v, v_slot, seen, m, d, factor, p.data(), o);
    }
  });
  return out;
}

// The slots each of the last n of `end` tokens sees, in position order, [n, C] (C at least 2), and
// their counts [n]: from a boolean mask [..., n, >= end] (True where visible), or causally (none).
// One op where building them from tensor ops costs a decoding forward dozens of calls.
std::tuple<at::Tensor, at::Tensor> visible_slots(const std::optional<at::Tensor>& mask, int64_t n, int64_t end) {
  at::Tensor counts = at::empty({n}, at::kLong);
  int64_t* c = counts.data_ptr<int64_t>();
  if (!mask.has_value()) {  // row r sees slots 0 .. end - n + r
    const int64_t C = std::max<int64_t>(2, end);
    at::Tensor slots = at::zeros({n, C}, at::kLong);
    int64_t* s = slots.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      c[r] = end - n + 1 + r;
      for (int64_t j = 0; j < end; ++j) s[r * C + j] = j;
    }
    return {slots, counts};
  }
  const at::Tensor m = mask->cpu();
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() >= 2 && m.size(-2) == n && m.size(-1) >= end,
              "visible_slots: a boolean mask [..., n, >= end]");
  const bool* b = m.data_ptr<bool>();
  const int64_t row = m.stride(-2), col = m.stride(-1);
  int64_t C = 2;
  for (int64_t r = 0; r < n; ++r) {
    int64_t k = 0;
    for (int64_t j = 0; j < end; ++j) k += b[r * row + j * col];
    c[r] = k;
    C = std::max(C, k);
  }
  at::Tensor slots = at::zeros({n, C}, at::kLong);
  int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0, k = 0; j < end; ++j)
      if (b[r * row + j * col]) s[r * C + k++] = j;
  return {slots, counts};
}

// A commit: cache slots `slots` of each tensor [..., capacity, d] moved in place to start, start + 1,
// ... (ascending, none before its place, so a copy never overwrites a slot still to be read). One
// call for every layer, where tensor ops cost two calls a layer.
void keep_slots(at::TensorList caches, at::IntArrayRef slots, int64_t start) {
  const int64_t n = static_cast<int64_t>(slots.size());
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(slots[j] >= start + j && (j == 0 || slots[j] > slots[j - 1]),
                "keep_slots: ascending slots, each at or after its place");
  for (const at::Tensor& t : caches) {
    TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.dim() >= 2 && (n == 0 || slots[n - 1] < t.size(-2)),
                "keep_slots: contiguous CPU tensors [..., capacity, d] that hold the slots");
    const int64_t capacity = t.size(-2), row = t.size(-1) * t.element_size();
    const int64_t heads = t.numel() / std::max<int64_t>(1, capacity * t.size(-1));
    char* base = static_cast<char*>(t.data_ptr());
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < n; ++j)
        std::memmove(base + (h * capacity + start + j) * row, base + (h * capacity + slots[j]) * row, row);
  }
}

TORCH_LIBRARY_IMPL(dyspec, CPU, m) { m.impl("row_attention", &row_attention); }
TORCH_LIBRARY_FRAGMENT(dyspec, m) {
  m.def("visible_slots(Tensor? mask, int n, int end) -> (Tensor, Tensor)", &visible_slots);
  m.def("keep_slots(Tensor(a!)[] caches, int[] slots, int start) -> ()", &keep_slots);
}
