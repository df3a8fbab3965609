// dyspec::int8_mm: x [M, K] int8 times packed int8 weights -> int32 [M, N], exact.
// One pass over the weights serves up to ROWS rows: a decoding forward (1 to 16 rows) is bound by
// reading weights, so a tree of 8 costs about what one row costs. Where the CPU has AMX (built with
// -mamx-int8 and lent by Linux) a forward of AMX_ROWS rows or more runs on its tiles, 16 rows a
// pass: VNNI's arithmetic, not the weights' reading, bounds a tree of 8 to 16. See int8_mm.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <utility>
#ifdef __AMX_INT8__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int PANEL = 32;  // outputs per panel: two 16-lane int32 accumulators per row
constexpr int ROWS = 8;    // rows per pass: 2 * ROWS accumulators + 2 weight registers of 32
constexpr int AHEAD = 4;   // prefetch distance in K steps

// rows r of x over one panel. Weights: [K / 4][PANEL][4] int8 (VNNI: four k for each output);
// vpdpbusd multiplies unsigned by signed bytes, so x ^ 0x80 = x + 128 goes in and `comp` (128 *
// sum_k w, per output) comes off: every sum is exact in int32.
template <int R>
void panel(const int8_t* x, int64_t K, const int8_t* w, const int32_t* comp, int32_t* out, int64_t N) {
  __m512i acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t k = 0; k < K / 4; ++k) {
    const int8_t* b = w + k * 4 * PANEL;
    _mm_prefetch(reinterpret_cast<const char*>(b + AHEAD * 4 * PANEL), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + AHEAD * 4 * PANEL + 64), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 64);
    for (int m = 0; m < R; ++m) {
      int32_t four;
      std::memcpy(&four, x + m * K + 4 * k, 4);
      const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(four), flip);
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], a, w0);
      acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], a, w1);
    }
  }
  const __m512i c0 = _mm512_loadu_si512(comp), c1 = _mm512_loadu_si512(comp + 16);
  for (int m = 0; m < R; ++m) {
    _mm512_storeu_si512(out + m * N, _mm512_sub_epi32(acc[m][0], c0));
    _mm512_storeu_si512(out + m * N + 16, _mm512_sub_epi32(acc[m][1], c1));
  }
}

template <int... R>
void rows(int r, const int8_t* x, int64_t K, const int8_t* w, const int32_t* comp, int32_t* out, int64_t N,
          std::integer_sequence<int, R...>) {
  ((r == R + 1 ? panel<R + 1>(x, K, w, comp, out, N) : void()), ...);
}

#ifdef __AMX_INT8__
constexpr int AMX_ROWS = 2;  // fewer rows stream the weights on VNNI as fast
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

std::atomic<bool> amx_allowed{true};  // tests and benchmarks turn AMX off to run the VNNI path

bool amx_in_use() {
#ifdef __AMX_INT8__
  return amx_allowed && amx_granted();
#else
  return false;
#endif
}

// whether products of AMX_ROWS rows or more run on AMX, after allowing it or not
bool int8_mm_amx(bool allow) {
  amx_allowed = allow;
  return amx_in_use();
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
  const int32_t* cp = comp.data_ptr<int32_t>();
  int32_t* op = out.data_ptr<int32_t>();
#ifdef __AMX_INT8__
  if (M >= AMX_ROWS && K % AMX_K == 0 && amx_in_use()) {
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
  at::parallel_for(0, N / PANEL, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t m = 0; m < M; m += ROWS) {
        const int r = static_cast<int>(std::min<int64_t>(ROWS, M - m));
        rows(r, xp + m * K, K, wp + p * PANEL * K, cp + p * PANEL, op + m * N + p * PANEL, N,
             std::make_integer_sequence<int, ROWS>{});
      }
  });
  return out;
}

}  // namespace

// the op is declared in int8_mm.py, with its shape function for torch.compile
TORCH_LIBRARY_IMPL(dyspec, CPU, m) { m.impl("int8_mm", &int8_mm); }
TORCH_LIBRARY_FRAGMENT(dyspec, m) { m.def("int8_mm_amx(bool allow) -> bool", &int8_mm_amx); }
