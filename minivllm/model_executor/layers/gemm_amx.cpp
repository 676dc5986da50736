// A bfloat16 matrix multiply for linear layers on CPUs with AMX (chapter 02, appendix C):
// out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), bfloat16 in and out, float32 sums.
//
// AMX (Advanced Matrix Extensions, Intel Sapphire Rapids and later) adds eight tile registers of up to
// 16 rows x 64 bytes and one instruction, tdpbf16ps, that multiplies a 16 x 32 bfloat16 tile of x by a
// 32 x 16 bfloat16 tile of the weight and adds the 16 x 16 float32 products into a third tile. The
// weight tile must be in "VNNI" order: 16 rows, each holding 16 columns x 2 consecutive k (pairs along
// K), so the weight is packed once into panels of 16 output columns, [ceil(N/16), ceil(K/32), 16, 16, 2]:
// a panel is its 1 KiB tiles for each block of 32 k, one after another, one contiguous stream of memory.
// The kernel takes up to four panels side by side (64 columns; fewer at the end of a thread's share): for
// each block of up to 16 rows of x, one float32 tile per panel holds 16 x 16 sums over the whole of K, the
// panels read as separate streams; then the tiles are stored, the bias added, and the sums rounded to
// bfloat16 once. Rows beyond 16 walk the panels again, from the L2 cache. Each thread takes an equal share
// of the panels, a run of whole panels walked four at a time. Ideas: Intel's AMX
// programming reference (tile configuration, VNNI layout) and the weight packing of oneDNN's and SGLang's
// CPU kernels.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define MINIVLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static constexpr int64_t PANEL = 16;  // output columns per panel: one tile of 16 float32 columns
static constexpr int64_t GROUP = 4;   // panels side by side in one pass: four tiles of sums, 64 columns
static constexpr int64_t KT = 32;     // k per tile: 16 rows of pairs
static constexpr int64_t TILE = 16 * KT;  // bfloat16 values in one weight tile (1 KiB)
static constexpr int64_t ROWS = 16;   // most rows of x per tile
static constexpr int64_t MC = 128;    // rows per row block: 128 rows of x stay in the L2 cache beside four panels

// [N, K] -> [ceil(N/16), ceil(K/32), 16, 16, 2]: packed[p][b][i][c][e] = weight[16p + c][32b + 2i + e], zeros
// past N and K.
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.device().is_cpu(),
              "pack_weight: a 2-D bfloat16 CPU weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + PANEL - 1) / PANEL, blocks = (k + KT - 1) / KT;
  auto padded = torch::zeros({panels * PANEL, blocks * KT}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({panels, PANEL, blocks, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

#if defined(MINIVLLM_AMX)
// Linux hands out AMX's 8 KiB of tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without it the first tile instruction kills the process.
static bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// The tile shapes (the "palette 1" layout): tiles 0-3 the output (rows x 16 float32), 4 the rows of x
// (rows x 32 bfloat16), 5 and 6 the weight (16 pairs x 16 columns).
static void configure_tiles(int rows) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = t < 5 ? rows : 16;
    cfg.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// out[0:rows, 0:cols] = x[0:rows, :] @ G panels side by side (+ bias), rounded to bfloat16 once; the tiles
// are configured for `rows`. x: rows of `k` bfloat16 (k a multiple of 32); w: the first panel's first tile,
// the next panels `stride` values further each.
template <int G>
static void panel_kernel(const uint16_t* x, int64_t k, const uint16_t* w, int64_t stride, int rows, int64_t cols,
                         const uint16_t* bias, uint16_t* out, int64_t ldo) {
  _tile_zero(0);
  if (G > 1) _tile_zero(1);
  if (G > 2) _tile_zero(2);
  if (G > 3) _tile_zero(3);
  for (int64_t k0 = 0; k0 < k; k0 += KT, w += TILE) {
    _tile_loadd(4, x + k0, k * 2);  // rows x 32 of x; the row stride in bytes
    _tile_loadd(5, w, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (G > 1) {
      _tile_loadd(6, w + stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (G > 2) {
      _tile_loadd(5, w + 2 * stride, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (G > 3) {
      _tile_loadd(6, w + 3 * stride, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) float sums[ROWS * GROUP * PANEL];
  constexpr int64_t ld = GROUP * PANEL * 4;  // bytes per row of sums
  _tile_stored(0, sums, ld);
  if (G > 1) _tile_stored(1, sums + 16, ld);
  if (G > 2) _tile_stored(2, sums + 32, ld);
  if (G > 3) _tile_stored(3, sums + 48, ld);
  for (int j = 0; j < G; ++j) {
    const int64_t c = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    if (c == 0) break;
    const __mmask16 mask = __mmask16((1u << c) - 1u);
    // bfloat16 -> float32: the 16 bits are a float32's upper half
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + 16 * j)), 16))
                          : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums + r * GROUP * PANEL + 16 * j), b));
      _mm256_mask_storeu_epi16(out + r * ldo + 16 * j, mask, (__m256i)v);
    }
  }
}

using PanelKernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int, int64_t, const uint16_t*,
                             uint16_t*, int64_t);
static constexpr PanelKernel PANEL_KERNELS[GROUP + 1] = {nullptr, panel_kernel<1>, panel_kernel<2>, panel_kernel<3>,
                                                         panel_kernel<4>};
#endif

bool has_amx() {
#if defined(MINIVLLM_AMX)
  return request_amx();
#else
  return false;
#endif
}

// x [M, K] bfloat16 contiguous, packed from pack_weight, bias [N] bfloat16 or None -> [M, N] bfloat16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t n) {
#if defined(MINIVLLM_AMX)
  TORCH_CHECK(request_amx(), "linear: Linux did not grant this process AMX's tile state");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear: x and the packed weight must be on the CPU; got ",
              x.device(), " and ", packed.device());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16,
              "linear: x must be a contiguous 2-D bfloat16 tensor; got ", x.sizes(), " ", x.scalar_type(),
              x.is_contiguous() ? "" : ", not contiguous");
  const int64_t m = x.size(0), k = x.size(1), blocks = (k + KT - 1) / KT;
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) == blocks && packed.size(2) == 16 && packed.size(3) == PANEL &&
              packed.size(4) == 2 && packed.is_contiguous() &&
              packed.scalar_type() == torch::kBFloat16,
              "linear: packed weight of shape ", packed.sizes(), " (", packed.scalar_type(),
              packed.is_contiguous() ? "" : ", not contiguous", ") does not fit bfloat16 x of shape ", x.sizes(),
              ": pack_weight gives [ceil(N/16), ", blocks, ", 16, 16, 2], contiguous");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(n >= 0 && n > (panels - 1) * PANEL && n <= panels * PANEL, "linear: ", n, " columns do not fit ", panels,
              " panels");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == torch::kBFloat16 &&
                bias->device().is_cpu(), "linear: bias must be a bfloat16 CPU tensor [", n, "]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  if (k == 0) return b ? out.copy_(bias->reshape({1, n}).expand({m, n})) : out.zero_();  // no K blocks: the bias
  // the tiles read whole blocks of 32 k: pad x's rows with zeros (the packed weight has zeros there)
  const torch::Tensor xp = k % KT ? torch::constant_pad_nd(x, {0, blocks * KT - k}) : x;
  const auto* X = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  const auto* W = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t kp = blocks * KT;
  const int64_t row_blocks = (m + MC - 1) / MC, stride = blocks * TILE;  // stride: values per panel
  // each thread an equal share of the panels (a run of whole panels), walked four at a time
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));  // 1 for no panels
  at::parallel_for(0, row_blocks * shares, 1, [&](int64_t begin, int64_t end) {
    int configured = 0;  // tile configurations are per thread
    for (int64_t item = begin; item < end; ++item) {
      const int64_t share = item % shares, r0 = item / shares * MC, r1 = std::min(m, r0 + MC);
      const int64_t p1 = panels * (share + 1) / shares;
      for (int64_t p = panels * share / shares; p < p1; p += GROUP) {
        const int64_t g = std::min(GROUP, p1 - p), cols = std::min(g * PANEL, n - p * PANEL);
        for (int64_t m0 = r0; m0 < r1; m0 += ROWS) {
          const int rows = static_cast<int>(std::min(ROWS, r1 - m0));
          if (rows != configured) configure_tiles(configured = rows);
          PANEL_KERNELS[g](X + m0 * kp, kp, W + p * stride, stride, rows, cols, b ? b + p * PANEL : nullptr,
                           O + m0 * n + p * PANEL, n);
        }
      }
    }
    if (configured) _tile_release();  // leave no tile state behind for the thread's next work
  });
  return out;
#else
  TORCH_CHECK(false, "linear: this library was built without AMX (amx_tile, amx_bf16, avx512_bf16)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "[N, K] bfloat16 -> [ceil(N/16), ceil(K/32), 16, 16, 2] AMX weight tiles");
  m.def("linear", &linear, "x [M, K] @ weight^T (+ bias) -> [M, N] bfloat16, from pack_weight's tiles");
  m.def("has_amx", &has_amx, "whether this build has the AMX kernel and Linux granted the tile state");
}
