// minivllm's paged decode attention for CPUs: one query per sequence over its cached K/V, read in
// place through its block table (no gather, no padding). The contract of vLLM's paged_attention
// kernels (Kwon et al., SOSP 2023); the work split follows vLLM's CPU backend (csrc/cpu/attention.cpp).
// Hand-written (not generated); built and loaded by minivllm/kernels/cpu_decode.py, explained in the
// appendix of notebooks/05_paged_attention.ipynb. float32, float64 and bfloat16: a bfloat16 cache
// and query are widened to float32 (at::opmath_type) as they are read; scores, softmax and the weighted
// sum of V stay in float32, and the output is rounded to bfloat16 once, at the end.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

// One sequence's decode attention: its query heads q [num_heads, D] over its context_len cached
// tokens, read in place through its block table. D is a compile-time constant when kHeadDim > 0.
template <typename scalar_t, int64_t kHeadDim>
static void decode_one_sequence(scalar_t* __restrict out, const scalar_t* __restrict q,
                                const scalar_t* __restrict k_cache, const scalar_t* __restrict v_cache,
                                const int64_t* __restrict block_table, int64_t len, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double scale,
                                std::vector<at::opmath_type<scalar_t>>& q_wide,
                                std::vector<at::opmath_type<scalar_t>>& scores,
                                std::vector<at::opmath_type<scalar_t>>& acc,
                                std::vector<at::opmath_type<scalar_t>>& denom) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t group = num_heads / num_kv_heads;     // query heads per K/V head
  const int64_t token_stride = num_kv_heads * D;      // one token's row in a block
  const int64_t block_stride = block_size * token_stride;
  q_wide.resize(num_heads * D);
  scores.resize(num_heads * len);
  acc.assign(num_heads * D, acc_t(0));
  denom.resize(num_heads);
  acc_t* __restrict qw = q_wide.data();  // the query widened once, not once per cached token
  for (int64_t i = 0; i < num_heads * D; ++i) qw[i] = acc_t(q[i]);
  acc_t* __restrict s = scores.data();  // s[h * len + t]
  acc_t* __restrict a = acc.data();     // a[h * D + d]

  // 1. scores: s[h, t] = scale * q[h] . k[t, h / group]
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* k_t = k_cache + block_table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = 0; h < num_heads; ++h) {
      const acc_t* qh = qw + h * D;
      const scalar_t* kh = k_t + (h / group) * D;
      acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * acc_t(kh[d]);
      s[h * len + t] = dot * acc_t(scale);
    }
  }
  // 2. softmax numerators in place, and their sums
  for (int64_t h = 0; h < num_heads; ++h) {
    acc_t* sh = s + h * len;
    acc_t mx = -INFINITY, total = 0;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sh[t]);
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = std::exp(sh[t] - mx);
      total += sh[t];
    }
    denom[h] = total;
  }
  // 3. a[h] = sum over t of s[h, t] * v[t, h / group]
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* v_t = v_cache + block_table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = 0; h < num_heads; ++h) {
      const scalar_t* vh = v_t + (h / group) * D;
      const acc_t p = s[h * len + t];
      acc_t* ah = a + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ah[d] += p * acc_t(vh[d]);
    }
  }
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = scalar_t(a[h * D + d] / denom[h]);
}

template <typename scalar_t, int64_t kHeadDim>
static void decode_batch(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const torch::Tensor& block_tables, const int64_t* lens,
                         const std::vector<std::vector<int64_t>>& bins, double scale) {
  const int64_t num_heads = q.size(1), D = q.size(2), max_blocks = block_tables.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  scalar_t* o = out.data_ptr<scalar_t>();
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<at::opmath_type<scalar_t>> q_wide, scores, acc, denom;  // this thread's scratch
    for (int64_t b = begin; b < end; ++b)
      for (int64_t seq : bins[b])
        decode_one_sequence<scalar_t, kHeadDim>(o + seq * num_heads * D, qp + seq * num_heads * D, kc, vc,
                                                tables + seq * max_blocks, lens[seq], num_heads, num_kv_heads,
                                                D, block_size, scale, q_wide, scores, acc, denom);
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                        block_tables.device().is_cpu() && context_lens.device().is_cpu(),
                    "the CPU decode kernel takes CPU tensors");
  TORCH_CHECK_VALUE(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kDouble ||
                        q.scalar_type() == torch::kBFloat16,
                    "the CPU decode kernel takes float32, float64 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                    "q, k_cache and v_cache must have one dtype");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt64 &&
                        context_lens.dim() == 1 && context_lens.scalar_type() == torch::kInt64,
                    "block_tables must be 2-D int64 and context_lens 1-D int64");
  const int64_t n = q.size(0), num_heads = q.size(1), num_blocks = k_cache.size(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK_VALUE(block_tables.size(0) == n && context_lens.size(0) == n,
                    "block_tables and context_lens need one row per sequence of q");
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && block_size > 0 && q.size(2) > 0,
                    "num_heads, num_kv_heads, block_size and head_dim must be positive");
  TORCH_CHECK_VALUE(q.size(2) == k_cache.size(3) && num_heads % num_kv_heads == 0,
                    "head_dim must match and num_heads must be a multiple of num_kv_heads");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t i = 0; i < n; ++i) {  // checked before the threads start: no thread reads outside the cache
    TORCH_CHECK_VALUE(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "context_lens[", i, "] = ", lens[i],
                      " is not in [1, ", max_blocks * block_size, "]");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[i * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", i, ", ", b, "] = ", id,
                        " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
  // one bin of sequences per thread: longest first, each into the bin with the fewest tokens so far
  // (Graham's LPT rule), so that the threads finish at about the same time
  std::vector<int64_t> by_len(n);
  std::iota(by_len.begin(), by_len.end(), 0);
  std::stable_sort(by_len.begin(), by_len.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  const int64_t num_bins = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<std::vector<int64_t>> bins(num_bins);
  std::vector<int64_t> load(num_bins, 0);
  for (int64_t seq : by_len) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(seq);
    load[b] += lens[seq];
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    const int64_t D = q.size(2);
    if (D == 64) decode_batch<scalar_t, 64>(out, q, k_cache, v_cache, block_tables, lens, bins, scale);
    else if (D == 128) decode_batch<scalar_t, 128>(out, q, k_cache, v_cache, block_tables, lens, bins, scale);
    else decode_batch<scalar_t, 0>(out, q, k_cache, v_cache, block_tables, lens, bins, scale);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (q, k_cache, v_cache, block_tables, context_lens, scale)");
}
