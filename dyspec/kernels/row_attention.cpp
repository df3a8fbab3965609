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

// `omp simd` vectorizes the sum in one order, fixed for the binary
inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
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
  at::parallel_for(0, n * H, 1, [&](int64_t first, int64_t last) {
    std::vector<float> p(C);
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t r = unit / H, head = unit % H, kv = head / g, m = counts_[r];
      const float* query = Q + unit * d;
      const int64_t* seen = S + r * C;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < m; ++j) {
        p[j] = dot(query, K + kv * k_head + seen[j] * k_slot, d) * factor;
        top = std::max(top, p[j]);
      }
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) p[j] = exp_nonpositive(p[j] - top);
      float total = 0.f;
      for (int64_t j = 0; j < m; ++j) total += p[j];
      float* o = O + unit * d;
      for (int64_t i = 0; i < d; ++i) o[i] = 0.f;
      for (int64_t j = 0; j < m; ++j) {
        const float* v = V + kv * v_head + seen[j] * v_slot;
        const float w = p[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
      }
      const float inverse = 1.f / total;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] *= inverse;
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(dyspec, CPU, m) { m.impl("row_attention", &row_attention); }
