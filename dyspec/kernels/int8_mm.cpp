// dyspec::int8_mm: x [M, K] int8 times packed int8 weights -> int32 [M, N], exact.
// A decoding forward (1 to 16 rows) is bound by reading weights: each path reads a panel of weights
// from memory once for all its rows. Four paths, the fastest the build and the CPU allow:
// - AMX (built with -mamx-int8, lent by Linux): AMX_ROWS rows or more on its tiles, 16 rows a pass;
//   at 8 to 16 rows VNNI's arithmetic, not the weights' reading, would be the bound.
// - AVX-512 VNNI (built with -mavx512vnni): up to 8 rows a pass.
// - AVX-VNNI (built with -mavxvnni; or its twin in AVX-512 VNNI with VL): up to 2 rows a pass.
// - AVX2 (any x86-64 since 2013): bytes multiplied in pairs by the sign trick (vpmaddubsw), two
//   rows a pass over a panel brought into the cache ahead of them, at every row count: on a CPU
//   without VNNI, torch._int_mm (oneDNN) runs int8 at a small fraction of this.
// Every path sums the same products in int32 exactly, so all give torch._int_mm's result. See int8_mm.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>
#include <vector>
#ifdef __AMX_INT8__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int PANEL = 32;  // outputs per panel; weights packed [N / PANEL][K / 4][PANEL][4]

// AVX2: rows R of x over one panel, by the sign trick: vpmaddubsw multiplies unsigned by signed bytes,
// so |w| (once a piece for the R rows) meets x * sign(w) (vpsignb, per row), and each output's four
// products are summed in pairs to int16 (2 * 128 * 127 at most: no saturation while x > -128, see
// `avx2_product`), then to int32 by vpmaddwd with ones. A piece of a k-group is 8 outputs x 4 k, so
// the sums come out in the outputs' order; two rows a pass keep them in registers.
// Prefetches (which never fault) keep the weights streaming: the hardware's prefetching alone leaves a
// pass waiting on memory. A panel's only pass asks for its own weights AVX2_AHEAD bytes on, non-
// temporal as each weight is read once a forward. With more rows, pass `pass` of `passes` brings its
// share of the next panel into L2, a line every few K steps, so that the weights of the next panel
// stream while the arithmetic of this one runs, and its first pass reads them from the cache.
constexpr int64_t AVX2_AHEAD = 1024;
template <int R>
void panel_avx2(const int8_t* x, int64_t K, const int8_t* w, int32_t* out, int64_t N, int64_t pass, int64_t passes) {
  const char* next = reinterpret_cast<const char*>(w + K * PANEL) + pass * K * PANEL / passes / 64 * 64;
  int64_t credit = 0;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][PANEL / 8];
#pragma GCC unroll 2
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
    for (int s = 0; s < PANEL / 8; ++s) acc[m][s] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K / 4; ++k) {
    __m256i a[R];  // each row's 4 values, repeated over the register
#pragma GCC unroll 2
    for (int m = 0; m < R; ++m) {
      int32_t four;
      std::memcpy(&four, x + m * K + 4 * k, 4);
      a[m] = _mm256_set1_epi32(four);
    }
    const int8_t* b = w + k * 4 * PANEL;
    if (passes == 1) {
      _mm_prefetch(reinterpret_cast<const char*>(b + AVX2_AHEAD), _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(b + AVX2_AHEAD + 64), _MM_HINT_NTA);
    } else {
      credit += 4 * PANEL;
      if (credit >= 64 * passes) {
        _mm_prefetch(next, _MM_HINT_T1);
        next += 64, credit -= 64 * passes;
      }
    }
#pragma GCC unroll 4
    for (int s = 0; s < PANEL / 8; ++s) {
      const __m256i piece = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * s));
      const __m256i size = _mm256_abs_epi8(piece);
#pragma GCC unroll 2
      for (int m = 0; m < R; ++m) {
        const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(a[m], piece));
        acc[m][s] = _mm256_add_epi32(acc[m][s], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
#pragma GCC unroll 2
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
    for (int s = 0; s < PANEL / 8; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + 8 * s), acc[m][s]);
}

// AVX2's product: every panel on every core, two rows a pass. x = -128 would break the sign trick
// (its sign does not flip in int8, and 2 * 128 * 128 saturates int16): it runs as -127, and the
// missing -1 x w is taken off the sums after (never for dyspec's own rows, quantized to +-127).
void avx2_product(const int8_t* xp, int64_t M, int64_t K, const int8_t* wp, int32_t* op, int64_t N) {
  std::vector<int8_t> clamped;
  if (std::find(xp, xp + M * K, int8_t{-128}) != xp + M * K) {
    clamped.assign(xp, xp + M * K);
    std::replace(clamped.begin(), clamped.end(), int8_t{-128}, int8_t{-127});
  }
  const int8_t* x = clamped.empty() ? xp : clamped.data();
  at::parallel_for(0, N / PANEL, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t m = 0; m < M; m += 2) {
        const int64_t passes = (M + 1) / 2, pass = m / 2;
        const int8_t* pw = wp + p * PANEL * K;
        int32_t* out = op + m * N + p * PANEL;
        if (M - m >= 2)
          panel_avx2<2>(x + m * K, K, pw, out, N, pass, passes);
        else
          panel_avx2<1>(x + m * K, K, pw, out, N, pass, passes);
      }
  });
  for (int64_t i = 0; i < static_cast<int64_t>(clamped.size()); ++i)
    if (xp[i] == -128) {
      const int64_t m = i / K, k = i % K;
      for (int64_t o = 0; o < N; ++o) op[m * N + o] -= wp[(o / PANEL * K + k / 4 * 4) * PANEL + o % PANEL * 4 + k % 4];
    }
}

// vpdpbusd at two widths: AVX-512 VNNI's zmm, and ymm, which AVX-VNNI (Intel's laptops since Alder
// Lake, without AVX-512) has and AVX-512 VNNI with VL has too: the same instruction, another encoding
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DYSPEC_YMM_DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define DYSPEC_YMM_DPBUSD _mm256_dpbusd_avx_epi32
#endif

#if defined(__AVX512VNNI__) || defined(DYSPEC_YMM_DPBUSD)

#ifdef __AVX512VNNI__
struct Zmm {  // 32 registers: up to 8 rows a pass, 2 sums each, 2 weight registers
  using T = __m512i;
  static constexpr int BYTES = 64, ROWS = 8;
  static T load(const void* p) { return _mm512_loadu_si512(p); }
  static void store(void* p, T v) { _mm512_storeu_si512(p, v); }
  static T set1(int32_t v) { return _mm512_set1_epi32(v); }
  static T zero() { return _mm512_setzero_si512(); }
  static T add(T a, T b) { return _mm512_add_epi32(a, b); }
  static T sub(T a, T b) { return _mm512_sub_epi32(a, b); }
  static T dot(T acc, T a, T b) { return _mm512_dpbusd_epi32(acc, a, b); }
};
#endif

#ifdef DYSPEC_YMM_DPBUSD
struct Ymm {  // 16 registers (AVX-VNNI): up to 2 rows a pass, 4 sums each
  using T = __m256i;
  static constexpr int BYTES = 32, ROWS = 2;
  static T load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(void* p, T v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static T set1(int32_t v) { return _mm256_set1_epi32(v); }
  static T zero() { return _mm256_setzero_si256(); }
  static T add(T a, T b) { return _mm256_add_epi32(a, b); }
  static T sub(T a, T b) { return _mm256_sub_epi32(a, b); }
  static T dot(T acc, T a, T b) { return DYSPEC_YMM_DPBUSD(acc, a, b); }
};
#endif

// VNNI: rows R of x over one panel, S registers of weights a K step. vpdpbusd multiplies unsigned by
// signed bytes, so x ^ 0x80 = x + 128 (`ux`, flipped once per product) goes in and `comp` (128 *
// sum_k w, per output) comes off. Few rows take U K steps a pass into U sets of sums: each vpdpbusd
// waits for the previous one into its sum, and fewer than 8 sums would leave the unit idle. With
// PREFETCH each K step brings the next panel's into L2 (prefetches never fault): a pass over many
// rows is bound by its arithmetic, and the next panel's weights then stream during it; one row also
// streams its weights faster so, but a single pass of 2 to V::ROWS rows streams them faster without
// (the hardware's own prefetching keeps up, the extra requests only compete with it). The
// loops are unrolled so that the sums stay in registers: GCC keeps an array indexed in a loop on
// the stack, and each vpdpbusd then also waits for a store.
template <class V, int R, bool PREFETCH>
void panel(const uint8_t* ux, int64_t K, const int8_t* w, const int32_t* comp, int32_t* out, int64_t N) {
  constexpr int S = 4 * PANEL / V::BYTES, U = R * S >= 8 ? 1 : 8 / (R * S);
  typename V::T acc[U][R][S];
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) acc[u][m][s] = V::zero();
  const int64_t steps = K / 4 / U * U;  // then one step at a time
  for (int64_t k = 0; k < K / 4; k += k < steps ? U : 1) {
    const int n = k < steps ? U : 1;
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      if (u >= n) break;
      const int8_t* b = w + (k + u) * 4 * PANEL;
      if (PREFETCH) {
        _mm_prefetch(reinterpret_cast<const char*>(b + K * PANEL), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(b + K * PANEL + 64), _MM_HINT_T1);
      }
      typename V::T a[R];
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        int32_t four;
        std::memcpy(&four, ux + m * K + 4 * (k + u), 4);
        a[m] = V::set1(four);
      }
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const typename V::T piece = V::load(b + s * V::BYTES);
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) acc[u][m][s] = V::dot(acc[u][m][s], a[m], piece);
      }
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    const typename V::T c = V::load(comp + s * V::BYTES / 4);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
#pragma GCC unroll 16
      for (int u = 1; u < U; ++u) acc[0][m][s] = V::add(acc[0][m][s], acc[u][m][s]);
      V::store(out + m * N + s * V::BYTES / 4, V::sub(acc[0][m][s], c));
    }
  }
}

template <class V, bool PREFETCH, int... R>
void rows(int r, const uint8_t* ux, int64_t K, const int8_t* w, const int32_t* comp, int32_t* out, int64_t N,
          std::integer_sequence<int, R...>) {
  ((r == R + 1 ? panel<V, R + 1, PREFETCH>(ux, K, w, comp, out, N) : void()), ...);
}

// every panel on every core, V::ROWS rows of x a pass over it (later passes read it from the cache)
template <class V>
void vnni_product(const int8_t* xp, int64_t M, int64_t K, const int8_t* wp, const int32_t* cp, int32_t* op, int64_t N) {
  std::vector<uint8_t> flipped(M * K);
  for (int64_t i = 0; i < M * K; ++i) flipped[i] = static_cast<uint8_t>(xp[i]) ^ 0x80;
  const bool prefetch = M == 1 || M > V::ROWS;  // see `panel`
  at::parallel_for(0, N / PANEL, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t m = 0; m < M; m += V::ROWS) {
        const int r = static_cast<int>(std::min<int64_t>(V::ROWS, M - m));
        const uint8_t* ux = flipped.data() + m * K;
        const int8_t* w = wp + p * PANEL * K;
        int32_t* out = op + m * N + p * PANEL;
        const auto sizes = std::make_integer_sequence<int, V::ROWS>{};
        if (prefetch)
          rows<V, true>(r, ux, K, w, cp + p * PANEL, out, N, sizes);
        else
          rows<V, false>(r, ux, K, w, cp + p * PANEL, out, N, sizes);
      }
  });
}
#endif

#ifdef __AMX_INT8__
constexpr int AMX_ROWS = 2;    // fewer rows stream the weights on VNNI as fast
constexpr int64_t AMX_K = 64;  // k per tile row: K must be a multiple

// Linux lends a process AMX's tile registers when it asks (ARCH_REQ_XCOMP_PERM for XTILEDATA); a
// kernel or VM that refuses leaves every product on VNNI
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0, 1: the sums of a panel's two halves of 16 outputs for r rows; 2: the rows' next AMX_K
// values of x; 3, 4: each half's weights for them, 16 rows of four k (the panel read with the stride
// of its k rows). tdpbssd multiplies signed by signed bytes: no offset to take off
void configure_tiles(int r) {
  TileConfig c;
  for (int t : {0, 1, 2}) c.rows[t] = r, c.bytes[t] = 64;
  for (int t : {3, 4}) c.rows[t] = 16, c.bytes[t] = 64;
  _tile_loadconfig(&c);
}

void panel_amx(const int8_t* x, int64_t K, const int8_t* w, int32_t* out, int64_t N) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < K; k += AMX_K) {
    _tile_loadd(2, x + k, K);
    _tile_loadd(3, w + k * PANEL, 4 * PANEL);
    _tile_loadd(4, w + k * PANEL + 64, 4 * PANEL);
    _tile_dpbssd(0, 2, 3);
    _tile_dpbssd(1, 2, 4);
  }
  _tile_stored(0, out, N * 4);
  _tile_stored(1, out + 16, N * 4);
}
#endif

enum Path { AVX2, AVX_VNNI, VNNI, AMX };
const char* const NAMES[] = {"avx2", "avx-vnni", "vnni", "amx"};
std::atomic<int> allowed{AMX};  // tests and benchmarks force a slower path (all give the same sums)

Path path_in_use() {
  int best = AVX2;
#ifdef DYSPEC_YMM_DPBUSD
  best = AVX_VNNI;
#endif
#ifdef __AVX512VNNI__
  best = VNNI;
#endif
#ifdef __AMX_INT8__
  if (amx_granted()) best = AMX;
#endif
  return static_cast<Path>(std::min(best, allowed.load()));
}

// the path products run on after allowing `path` ("amx", "vnni", "avx-vnni" or "avx2") at most; "" asks only
std::string int8_mm_path(const std::string& path) {
  if (!path.empty()) {
    const auto named = std::find(std::begin(NAMES), std::end(NAMES), path);
    TORCH_CHECK(named != std::end(NAMES), "int8_mm_path: amx, vnni, avx-vnni or avx2, not ", path);
    allowed = static_cast<int>(named - std::begin(NAMES));
  }
  return NAMES[path_in_use()];
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar && x.is_contiguous(), "x: a contiguous int8 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(2) == PANEL &&
                  w.size(3) == 4 && w.size(1) * 4 == x.size(1),
              "w: packed int8 [N / 32, K / 4, 32, 4] (int8_mm.pack)");
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.numel() == w.size(0) * PANEL, "comp: int32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = comp.numel();
  auto out = at::empty({M, N}, x.options().dtype(at::kInt));
  const int8_t *xp = x.data_ptr<int8_t>(), *wp = w.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  const Path path = path_in_use();
#ifdef __AMX_INT8__
  if (path == AMX && M >= AMX_ROWS && K % AMX_K == 0) {
    at::parallel_for(0, N / PANEL, 1, [&](int64_t first, int64_t last) {
      int configured = 0;  // tiles are configured per thread, and again only for a shorter last block
      for (int64_t p = first; p < last; ++p)
        for (int64_t m = 0; m < M; m += 16) {
          const int r = static_cast<int>(std::min<int64_t>(16, M - m));
          if (r != configured) configure_tiles(configured = r);
          panel_amx(xp + m * K, K, wp + p * PANEL * K, op + m * N + p * PANEL, N);
        }
      _tile_release();
    });
    return out;
  }
#endif
#ifdef __AVX512VNNI__
  if (path >= VNNI) {
    vnni_product<Zmm>(xp, M, K, wp, comp.data_ptr<int32_t>(), op, N);
    return out;
  }
#endif
#ifdef DYSPEC_YMM_DPBUSD
  if (path >= AVX_VNNI) {
    vnni_product<Ymm>(xp, M, K, wp, comp.data_ptr<int32_t>(), op, N);
    return out;
  }
#endif
  avx2_product(xp, M, K, wp, op, N);
  return out;
}

}  // namespace

// the op is declared in int8_mm.py, with its shape function for torch.compile
TORCH_LIBRARY_IMPL(dyspec, CPU, m) { m.impl("int8_mm", &int8_mm); }
TORCH_LIBRARY_FRAGMENT(dyspec, m) { m.def("int8_mm_path(str path) -> str", &int8_mm_path); }
