// Vector arithmetic shared by dyspec's float kernels (row_attention.cpp, row_stats.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace dyspec_vec {

// GCC's and Clang's vector extensions: the compiler lowers them to the machine's SIMD, and the order of
// every sum is the one written here (no reassociation), so every row of every call sums alike. A vector
// is one register wide: wider than the machine's, GCC passes it through memory, many times slower.
#ifdef __AVX512F__
#define DYSPEC_LANES 16
constexpr int REGISTERS = 32;
#else
#define DYSPEC_LANES 8
constexpr int REGISTERS = 16;
#endif
constexpr int LANES = DYSPEC_LANES;
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));
typedef float vec2 __attribute__((vector_size(2 * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 lanes added in halves to 8 (one register of 8 as it is)
inline vec8 to_eight(vec s) {
#if DYSPEC_LANES == 16
  return __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return s;
#endif
}

// the lanes of s in a halving tree
inline float lanes_sum(vec s) {
  const vec8 h = to_eight(s);
  const vec4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const vec2 e = __builtin_shufflevector(q, q, 0, 1) + __builtin_shufflevector(q, q, 2, 3);
  return e[0] + e[1];
}

// e^x for x <= 0, lane by lane (Cephes' expf: within 2 ulp), in vector arithmetic: GCC leaves a loop
// over std::exp, or over a scalar version of this, a call or an instruction per element
inline vec exp_nonpositive(vec x) {
  x = x < -87.0f ? vec{} - 87.0f : x;  // below, e^x < 2e-38: nothing next to the row's largest weight, 1
  const ivec k = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec);  // round(x / ln 2), x <= 0
  const vec n = __builtin_convertvector(k, vec);
  const vec r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln 2 in two parts
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (k + 127) << 23;  // 2^n
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace dyspec_vec
