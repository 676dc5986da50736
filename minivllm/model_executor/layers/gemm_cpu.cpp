// A float32 matrix multiply for linear layers on CPUs with AVX-512 or AVX2 (chapter 02, appendix C):
// out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), written for the few rows of a decode step.
//
// The weight is packed once into panels of 64 output columns, [ceil(N / 64), K, 64], so a panel
// is one contiguous stream of memory. A micro-kernel keeps a 6 x 64 block of the output in 24
// AVX-512 registers and, for each k, loads 64 weights and multiplies them with 6 broadcast inputs
// (the register blocking of Goto and van de Geijn's GEMM, as in BLIS). The K axis is cut into equal
// blocks of at most 128 so the block of a panel being read stays in the L1 cache
// while every 6-row chunk of x passes over it; meanwhile each chunk prefetches a share of a block two
// ahead into the L2 cache, spread evenly over its k loop (with one or two rows, only one line in 16),
// so the next weights come from memory while these are multiplied. Up to 96 rows the weight is read
// once, and each thread takes an equal share of the (panel, row) pairs, panel by panel, so from two rows
// on a panel may be split by rows between threads; more rows are cut into equal row blocks of at most 96,
// each reading the weight again, and the threads split the work items, one panel of one row block each.
// Where the CPU has AVX2 and FMA but no AVX-512 (AMD's Zen 3, Intel's cores before Skylake-SP), the same
// panels and loops with a 6 x 16 micro-kernel in AVX2's 16 registers, a quarter of a panel at a time, and
// K blocks of at most 64.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <string>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static constexpr int64_t PANEL = 64;    // output columns per panel: 4 AVX-512 vectors of 16 floats
static constexpr int64_t MR = 6;        // rows per micro-kernel call: 6 x 4 = 24 accumulators
#if defined(__AVX512F__)
static constexpr int64_t KC = 128;      // most k per block: 128 x 64 floats, 32 KiB (L1)
#else
static constexpr int64_t KC = 64;       // AVX2: 16 KiB blocks, faster than 128 from 64 rows up on an AMD EPYC (Zen 3)
#endif
static constexpr int64_t MC_MAX = 96;   // rows per row block, for many rows (prefill)
static constexpr int64_t LINE = 64;     // bytes per cache line
static constexpr int64_t AHEAD = 2;     // prefetch the block this many blocks ahead in the stream
static constexpr int64_t FEW_ROWS = 2;  // up to this many rows, prefetch one line in SPARSE: the loop is then little
static constexpr int64_t SPARSE = 16;   // but a stream of reads, which the L2 cache's own stream prefetcher follows
                                        // once started on each stretch (a request per line measured slower, and so
                                        // did none, on an Intel Xeon)

// [N, K] -> [ceil(N / 64), K, 64], zero columns past N.
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(), "pack_weight: a 2-D float32 CPU weight");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + PANEL - 1) / PANEL;
  auto padded = torch::zeros({panels * PANEL, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, PANEL, k}).transpose(1, 2).contiguous();
}

// The micro-kernel this build has: "avx512", "avx2" (AVX2 with FMA), or "" (none: `linear` refuses to run).
std::string kernel_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "";
#endif
}

#if defined(__AVX512F__)
// out[0:R, 0:64] (= or +=) x[0:R, 0:kc] @ panel block [kc, 64]; columns of out and bias past `cols`
// are neither read nor written (the panel's own columns past them are zeros). `first`: start from the bias (or 0) instead of out. The `pf_lines` cache lines
// from `pf` on are prefetched one in `every` (lines 0, every, 2 every, ..., below pf_lines: floor(pf_lines / every)
// of them), spread evenly over the k loop: each step adds pf_lines to a count, and a line goes out each time
// the count passes another kc * every (Bresenham's stepping), so memory is asked for something all through
// the loop, never in one burst.
template <int R>
static inline void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t kc, float* out, int64_t ldo,
                                int64_t cols, const float* bias, bool first, const char* pf, int64_t pf_lines,
                                int64_t every) {
  __mmask16 mask[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t c = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    mask[j] = __mmask16((1u << c) - 1u);
  }
  int64_t due = 0, next = 0;  // due: pf_lines added per step, kc * every taken per line prefetched
  const int64_t per_prefetch = kc * every;
  __m512 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    const __m512 start = (first && bias) ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      acc[r][j] = first ? start : _mm512_maskz_loadu_ps(mask[j], out + r * ldo + 16 * j);
  }
  for (int64_t k = 0; k < kc; ++k) {
    for (due += pf_lines; due >= per_prefetch; due -= per_prefetch, next += every)
      _mm_prefetch(pf + LINE * next, _MM_HINT_T1);  // into L2: L1 holds the block being read
    const float* wk = w + k * PANEL;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(out + r * ldo + 16 * j, mask[j], acc[r][j]);
}

#elif defined(__AVX2__) && defined(__FMA__)
// The same contract with AVX2's 16 registers of 8 floats: a 6 x 64 block no longer fits (48 registers), so
// the panel's 64 columns are done a quarter at a time, a 6 x 16 block in 12 registers (with two weight
// vectors and a broadcast: 15 of 16), the classic AVX2 SGEMM tile. Each quarter reads its 16 columns of
// every k of the block (one cache line per k), so the block is still read once per call; the prefetches
// are spread over all four quarters' k loops.
template <int R>
static inline void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t kc, float* out, int64_t ldo,
                                int64_t cols, const float* bias, bool first, const char* pf, int64_t pf_lines,
                                int64_t every) {
  int64_t due = 0, next = 0;
  const int64_t per_prefetch = 4 * kc * every;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int q = 0; q < 4; ++q) {
    __m256i mask[2];  // the columns below `cols` of each 8-column vector
    for (int j = 0; j < 2; ++j) {
      const int64_t c = std::clamp<int64_t>(cols - 16 * q - 8 * j, 0, 8);
      mask[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(c)), lane);
    }
    if (_mm256_testz_si256(mask[0], mask[0])) break;  // no column of this quarter (or of the next ones) is kept
    // masked loads and stores only for a partial quarter: AMD's Zen cores take many cycles for each
    const bool whole = cols >= 16 * q + 16;
    const auto load = [&](const float* p, int j) { return whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask[j]); };
    __m256 acc[R][2];
    for (int j = 0; j < 2; ++j) {
      const int64_t col = 16 * q + 8 * j;
      const __m256 start = (first && bias) ? load(bias + col, j) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) acc[r][j] = first ? start : load(out + r * ldo + col, j);
    }
    for (int64_t k = 0; k < kc; ++k) {
      for (due += pf_lines; due >= per_prefetch; due -= per_prefetch, next += every)
        _mm_prefetch(pf + LINE * next, _MM_HINT_T1);
      const float* wk = w + k * PANEL + 16 * q;
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
        acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j) {
        float* o = out + r * ldo + 16 * q + 8 * j;
        if (whole) _mm256_storeu_ps(o, acc[r][j]);
        else _mm256_maskstore_ps(o, mask[j], acc[r][j]);
      }
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define MINIVLLM_GEMM 1
using MicroKernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                             bool, const char*, int64_t, int64_t);
static constexpr MicroKernel MICRO_KERNELS[MR + 1] = {nullptr,         micro_kernel<1>, micro_kernel<2>,
                                                      micro_kernel<3>, micro_kernel<4>, micro_kernel<5>,
                                                      micro_kernel<6>};
#endif

// x [M, K] float32 contiguous, packed [P, K, 64] from pack_weight, bias [N] or None -> [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t n) {
#if defined(MINIVLLM_GEMM)
  // the kernel reads raw pointers: a tensor on another device must not get that far
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear: x and the packed weight must be on the CPU; got ",
              x.device(), " and ", packed.device());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "linear: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.size(1) == x.size(1) && packed.is_contiguous() &&
              packed.scalar_type() == torch::kFloat32,
              "linear: packed weight of shape ", packed.sizes(), " (", packed.scalar_type(), ") does not fit float32 x of shape ", x.sizes());
  TORCH_CHECK(n > (packed.size(0) - 1) * PANEL && n <= packed.size(0) * PANEL, "linear: ", n, " columns do not fit ", packed.size(0), " panels");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->device().is_cpu(),
                "linear: bias must be a float32 CPU tensor [", n, "]");
    b = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  if (k == 0) return b ? out.copy_(bias->reshape({1, n}).expand({m, n})) : out.zero_();  // no K blocks: the bias
  const float* X = x.data_ptr<float>();
  const float* W = packed.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t w_size = panels * k * PANEL;  // floats in the packed weight
  const int64_t row_blocks = (m + MC_MAX - 1) / MC_MAX;
  const int64_t k_blocks = (k + KC - 1) / KC;
  const int64_t every = m <= FEW_ROWS ? SPARSE : 1;  // prefetch every line, or one in SPARSE for a row or two
  const int64_t kc_block = (k + k_blocks - 1) / k_blocks;  // equal blocks of at most KC
  // rows [r0, r1) of panel p, block by block of K
  const auto panel_rows = [&](int64_t p, int64_t r0, int64_t r1) {
    const int64_t chunks = (r1 - r0 + MR - 1) / MR, cols = std::min(PANEL, n - p * PANEL);
    for (int64_t k0 = 0; k0 < k; k0 += kc_block) {
      const int64_t kc = std::min(kc_block, k - k0);
      const float* w = W + (p * k + k0) * PANEL;
      // a block further on in the stream (into the next panel, near the end), shared among the chunks;
      // offsets, not pointers, until it is known to lie inside the weight
      const int64_t pf_at = std::min(w_size, (p * k + k0 + AHEAD * kc) * PANEL);
      const int64_t lines = std::min(kc * PANEL, w_size - pf_at) * int64_t(sizeof(float)) / LINE;
      const char* pf = reinterpret_cast<const char*>(W + pf_at);
      const int64_t per_chunk = (lines + chunks - 1) / chunks;
      for (int64_t r = r0, c = 0; r < r1; r += MR, ++c) {
        const int64_t pf_lines = std::clamp<int64_t>(lines - per_chunk * c, 0, per_chunk);
        MICRO_KERNELS[std::min(MR, r1 - r)](X + r * k + k0, k, w, kc, O + r * n + p * PANEL, n, cols,
                                            b ? b + p * PANEL : nullptr, k0 == 0,
                                            pf + LINE * std::min(per_chunk * c, lines), pf_lines, every);
      }
    }
  };
  if (row_blocks == 1) {
    // thread t takes the pairs [t U / T, (t + 1) U / T) of the U = panels x m (panel, row) pairs laid panel
    // by panel (T <= U: no range is empty), the same work per thread to within one pair, whereas whole
    // panels leave one thread a panel more when T does not divide them (9 panels for 576 columns)
    const int64_t pairs = panels * m, threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs));
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t u0 = pairs * t / threads, u1 = pairs * (t + 1) / threads;
        for (int64_t p = u0 / m; p * m < u1; ++p)
          panel_rows(p, std::max(u0, p * m) - p * m, std::min(u1, (p + 1) * m) - p * m);
      }
    });
  } else {
    const int64_t mc = ((m + row_blocks - 1) / row_blocks + MR - 1) / MR * MR;  // equal blocks of whole chunks
    at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t p = item % panels, m0 = item / panels * mc;
        panel_rows(p, m0, std::min(m, m0 + mc));
      }
    });
  }
  return out;
#else
  TORCH_CHECK(false, "linear: this library was built without AVX-512 or AVX2 with FMA");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "[N, K] float32 -> [ceil(N/64), K, 64] panels");
  m.def("linear", &linear, "x [M, K] @ weight^T (+ bias) -> [M, N], from pack_weight's panels");
  m.def("kernel_isa", &kernel_isa, "the micro-kernel this build has: 'avx512', 'avx2' or '' (none)");
}
