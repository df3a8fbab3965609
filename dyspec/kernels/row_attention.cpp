// dyspec::row_attention: each query row of a decoding forward over the cached keys it sees, read in
// place at `slots`, in position order. A row's result depends on its query, its keys and values and
// nothing else: no padding, no batch, the same loops whatever rows share the call. So a token tree's
// row computes bit for bit what the one-token forward of its path computes. See row_attention.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// GCC's and Clang's vector extensions: the compiler lowers them to the machine's SIMD, and the order of
// every sum is the one written here (no reassociation), so every row of every call sums alike
constexpr int LANES = 16;
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_vec __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(LANES / 4 * sizeof(float))));
typedef float eighth_vec __attribute__((vector_size(LANES / 8 * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// the lanes of s in a halving tree
inline float lanes_sum(vec s) {
  const half_vec h = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
  const quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const eighth_vec e = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return e[0] + e[1];
}

// a . b over D floats (a multiple of LANES): lane sums in position order, then lanes_sum
template <int D>
inline float dot(const float* a, const float* b) {
  vec s = load(a) * load(b);
  for (int c = LANES; c < D; c += LANES) s += load(a + c) * load(b + c);
  return lanes_sum(s);
}

// the same for a head size the compiler does not know: in position order
inline float dot_any(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// e^x for x <= 0 (Cephes' expf: within 2 ulp), in plain arithmetic that `omp simd` vectorizes where
// std::exp would run a call per element
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below, e^x < 2e-38: nothing next to the row's largest weight, 1
  const int32_t k = static_cast<int32_t>(x * 1.44269504088896341f - 0.5f);  // round(x / ln 2), x <= 0
  const float n = static_cast<float>(k);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (k + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// the scores of a query row over the m keys it sees, into p [m]. D: the head size where it is a multiple
// of LANES known to the compiler (vector sums), else 0 (scalar, head size d)
template <int D>
void scores(const float* query, const float* K, int64_t k_slot, const int64_t* seen, int64_t m, int64_t d, float factor,
            float* p) {
  for (int64_t j = 0; j < m; ++j) {
    const float* key = K + seen[j] * k_slot;
    if constexpr (D > 0) p[j] = dot<D>(query, key) * factor;
    else p[j] = dot_any(query, key, d) * factor;
  }
}

// the softmax of a row's scores p [m] (in place) times the values it sees, into o: for D > 0 the sum
// stays in registers
template <int D>
void weigh(float* p, int64_t m, const float* V, int64_t v_slot, const int64_t* seen, int64_t d, float* o) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < m; ++j) top = std::max(top, p[j]);
#pragma omp simd
  for (int64_t j = 0; j < m; ++j) p[j] = exp_nonpositive(p[j] - top);
  float total = 0.f;
  for (int64_t j = 0; j < m; ++j) total += p[j];
  const float inverse = 1.f / total;
  if constexpr (D > 0) {
    vec sum[D / LANES] = {};
    for (int64_t j = 0; j < m; ++j) {
      const float* value = V + seen[j] * v_slot;
      const vec w = vec{} + p[j];
      for (int c = 0; c < D / LANES; ++c) sum[c] += w * load(value + c * LANES);
    }
    for (int c = 0; c < D / LANES; ++c) {
      const vec out = sum[c] * inverse;
      std::memcpy(o + c * LANES, &out, sizeof out);
    }
  } else {
    for (int64_t i = 0; i < d; ++i) o[i] = 0.f;
    for (int64_t j = 0; j < m; ++j) {
      const float* value = V + seen[j] * v_slot;
      for (int64_t i = 0; i < d; ++i) o[i] += p[j] * value[i];
    }
    for (int64_t i = 0; i < d; ++i) o[i] *= inverse;
  }
}

// the g query heads [g, d] of a row that read one key head: every head's scores first, then every
// head's weighted sum, so the row's keys, then its values, are read from the nearest cache g times
template <int D>
void attend(const float* queries, int64_t g, const float* K, int64_t k_slot, const float* V, int64_t v_slot,
            const int64_t* seen, int64_t m, int64_t d, int64_t C, float factor, float* p, float* o) {
  for (int64_t h = 0; h < g; ++h) scores<D>(queries + h * d, K, k_slot, seen, m, d, factor, p + h * C);
  for (int64_t h = 0; h < g; ++h) weigh<D>(p + h * C, m, V, v_slot, seen, d, o + h * d);
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
  at::parallel_for(0, n * Hkv, 1, [&](int64_t first, int64_t last) {
    std::vector<float> p(g * C);
    for (int64_t unit = first; unit < last; ++unit) {  // a row's query heads that read one key head
      const int64_t r = unit / Hkv, kv = unit % Hkv, m = counts_[r];
      const float *k = K + kv * k_head, *v = V + kv * v_head, *q_heads = Q + unit * g * d;
      const int64_t* seen = S + r * C;
      float* o = O + unit * g * d;
      if (d == 64) attend<64>(q_heads, g, k, k_slot, v, v_slot, seen, m, d, C, factor, p.data(), o);
      else if (d == 128) attend<128>(q_heads, g, k, k_slot, v, v_slot, seen, m, d, C, factor, p.data(), o);
      else attend<0>(q_heads, g, k, k_slot, v, v_slot, seen, m, d, C, factor, p.data(), o);
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(dyspec, CPU, m) { m.impl("row_attention", &row_attention); }
