// The small ops of a decoder layer, fused, for CPUs (chapter 02, appendix B): RMSNorm, the residual
// add with the RMSNorm after it, rotary embedding, and SwiGLU's SiLU-and-product, each one pass over its
// rows. After vLLM's CPU ops (csrc/cpu/layernorm.cpp, pos_encoding.cpp, activation.cpp). Every value
// is rounded where torch's op-by-op version rounds it (-ffp-contract=off: no fused multiply-add but the
// ones SiLU's exponential names), so the results equal the plain modules' but for the order in which a
// row's squares are summed, and for SiLU's exponential (a polynomial here, torch's vector library there).
#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// float <-> storage type. bfloat16 is a float32's high 16 bits; rounding to nearest even, as torch does.
template <typename scalar_t>
static inline float to_f(scalar_t x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    uint32_t bits = uint32_t(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return float(x);
  }
}

template <typename scalar_t, typename acc_t>
static inline scalar_t from_f(acc_t f) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    c10::BFloat16 out;
    out.x = std::isnan(f) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return out;
  } else {
    return scalar_t(f);
  }
}

// float32 statistics for float32 and bfloat16 (transformers' order); float64 for float64.
template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
static inline acc_of<scalar_t> widen(scalar_t x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return to_f(x);
  else return x;
}

// float32 and bfloat16 16 values at a time, in the GCC/Clang vector extension (one AVX-512 register, two
// AVX2 ones), widened to float32 and rounded back exactly where the scalar loops round (from_f).
typedef float VecF __attribute__((vector_size(64)));
typedef int32_t VecI __attribute__((vector_size(64)));
typedef uint32_t VecU __attribute__((vector_size(64)));
typedef uint16_t VecH __attribute__((vector_size(32)));

static inline VecF fma16(VecF a, VecF b, VecF c) {  // a * b + c: one rounding with AVX-512, two without
#if defined(__AVX512F__)
  return (VecF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

template <typename scalar_t>
static inline VecF load16(const scalar_t* x) {  // 16 values widened to float32
  VecF f;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
#if defined(__AVX512F__)  // one widening instruction (the generic conversion below compiles to two halves)
    f = (VecF)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16);
#else
    VecH h;
    std::memcpy(&h, x, sizeof(h));
    const VecU u = __builtin_convertvector(h, VecU) << 16;
    std::memcpy(&f, &u, sizeof(f));
#endif
  } else {
    std::memcpy(&f, x, sizeof(f));
  }
  return f;
}

// The bfloat16 bits of 16 float32 values, rounded to nearest even as from_f rounds them (a NaN as its
// 0x7FC0). With AVX512-BF16, by one vcvtneps2bf16, which rounds the same way but takes a subnormal input as
// zero and keeps a NaN's sign and payload: a vector holding either (fpclass: NaN, subnormal) goes the
// integer way. (fpclass does not see subnormals where the thread reads them as zero, MXCSR's DAZ, without
// flushing results to zero, FTZ; torch's set_flush_denormal sets both, and then no subnormal reaches here.)
static inline VecH bf16_bits(VecF f) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)  // vfpclassps is AVX512DQ's
  if (!_mm512_fpclass_ps_mask((__m512)f, 0x01 | 0x20 | 0x80)) return (VecH)_mm512_cvtneps_pbh((__m512)f);
#endif
  VecU u;
  std::memcpy(&u, &f, sizeof(u));
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  u = f != f ? VecU{} + 0x7FC0u : u;
  return __builtin_convertvector(u, VecH);
}

template <typename scalar_t>
static inline VecF round16(VecF f) {  // to the storage type and back: to_f(from_f(f)) lane by lane
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const VecU u = __builtin_convertvector(bf16_bits(f), VecU) << 16;
    std::memcpy(&f, &u, sizeof(f));
  }
  return f;
}

template <typename scalar_t>
static inline void store16(scalar_t* out, VecF f) {  // f rounded to the storage type (from_f), stored
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const VecH h = bf16_bits(f);
    std::memcpy(out, &h, sizeof(h));
  } else {
    std::memcpy(out, &f, sizeof(f));
  }
}

// The rows of x: [rows, D] or [N, H, D] (last dim contiguous); row r starts at row_offset(r).
struct Rows {
  int64_t n, h, d, s0, s1;
  explicit Rows(const torch::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "expected [rows, D] or [N, H, D], got ", x.sizes());
    TORCH_CHECK(x.device().is_cpu(), "CPU tensors only");
    TORCH_CHECK(x.stride(-1) == 1, "the last dimension must be contiguous");
    n = x.size(0);
    h = x.dim() == 3 ? x.size(1) : 1;
    d = x.size(-1);
    s0 = x.stride(0);
    s1 = x.dim() == 3 ? x.stride(1) : 0;
  }
  int64_t count() const { return n * h; }
  int64_t offset(int64_t r) const { return (r / h) * s0 + (r % h) * s1; }
};

// One row: out = weight * (x * rsqrt(mean(x^2) + eps)), the normalised row rounded to the storage
// type before the weight multiplies it (Llama's order). x may alias out.
template <typename scalar_t>
static inline void norm_row(scalar_t* out, const scalar_t* x, const scalar_t* w, int64_t d, double eps) {
  using acc_t = acc_of<scalar_t>;
  constexpr int L = 64 / sizeof(acc_t);
  acc_t part[L] = {};  // lane l: the squares of x[l], x[L + l], ...
  int64_t i = 0;
  if constexpr (std::is_same_v<acc_t, float>) {  // float32, bfloat16: a register of lanes
    VecF sums = {};
    for (; i + L <= d; i += L) {
      const VecF v = load16(x + i);
      sums += v * v;
    }
    std::memcpy(part, &sums, sizeof(part));
  } else {
    for (; i + L <= d; i += L)
      for (int l = 0; l < L; ++l) {
        const acc_t v = widen(x[i + l]);
        part[l] += v * v;
      }
  }
  acc_t ss = 0;
  for (; i < d; ++i) ss += widen(x[i]) * widen(x[i]);
  for (int l = 0; l < L; ++l) ss += part[l];
  const acc_t r = acc_t(1) / std::sqrt(ss / acc_t(d) + acc_t(eps));
  int64_t j = 0;
  if constexpr (std::is_same_v<acc_t, float>)
    for (; j + 16 <= d; j += 16) store16(out + j, load16(w + j) * round16<scalar_t>(load16(x + j) * r));
  for (; j < d; ++j) {
    const scalar_t h = from_f<scalar_t>(widen(x[j]) * r);
    out[j] = from_f<scalar_t>(widen(w[j]) * widen(h));
  }
}

template <typename F>
static void for_rows(int64_t rows, int64_t d, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

void rms_norm(torch::Tensor out, torch::Tensor input, torch::Tensor weight, double eps) {
  const Rows rows(input), orows(out);
  TORCH_CHECK(out.sizes() == input.sizes() && out.scalar_type() == input.scalar_type(), "out must match input");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == rows.d && weight.is_contiguous() &&
              weight.scalar_type() == input.scalar_type(), "weight must be [D], contiguous, input's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, input.scalar_type(), "rms_norm", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* x = input.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    for_rows(rows.count(), rows.d, [&](int64_t r) { norm_row(o + orows.offset(r), x + rows.offset(r), w, rows.d, eps); });
  });
}

void fused_add_rms_norm(torch::Tensor input, torch::Tensor residual, torch::Tensor weight, double eps) {
  const Rows rows(input), rrows(residual);
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.scalar_type() == input.scalar_type(),
              "residual must match input");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == rows.d && weight.is_contiguous() &&
              weight.scalar_type() == input.scalar_type(), "weight must be [D], contiguous, input's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, input.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    for_rows(rows.count(), rows.d, [&](int64_t r) {
      scalar_t* xr = x + rows.offset(r);
      scalar_t* rr = res + rrows.offset(r);
      int64_t j = 0;
      if constexpr (!std::is_same_v<scalar_t, double>)
        for (; j + 16 <= rows.d; j += 16) store16(rr + j, load16(xr + j) + load16(rr + j));
      for (; j < rows.d; ++j) rr[j] = from_f<scalar_t>(widen(xr[j]) + widen(rr[j]));
      norm_row(xr, rr, w, rows.d, eps);
    });
  });
}

// x[i], x[i + D/2] -> x[i] cos - x[i + D/2] sin, x[i + D/2] cos + x[i] sin, each product and the
// sum rounded to the storage type (as `x * cos + rotate_half(x) * sin` computes it op by op); cos and sin
// [half] already rounded to it (once per token, for all its heads).
template <typename scalar_t, typename acc_t = acc_of<scalar_t>>
static inline void rotate_row(scalar_t* x, const acc_t* cos, const acc_t* sin, int64_t half) {
  int64_t i = 0;
  if constexpr (std::is_same_v<acc_t, float>)
    for (; i + 16 <= half; i += 16) {
      const VecF c = load16(cos + i), s = load16(sin + i), x1 = load16(x + i), x2 = load16(x + i + half);
      const VecF a1 = round16<scalar_t>(x1 * c), b1 = round16<scalar_t>(-x2 * s);
      const VecF a2 = round16<scalar_t>(x2 * c), b2 = round16<scalar_t>(x1 * s);
      store16(x + i, a1 + b1);
      store16(x + i + half, a2 + b2);
    }
  for (; i < half; ++i) {
    const acc_t c = cos[i], s = sin[i], x1 = widen(x[i]), x2 = widen(x[i + half]);
    const acc_t a1 = widen(from_f<scalar_t>(x1 * c)), b1 = widen(from_f<scalar_t>(-x2 * s));
    const acc_t a2 = widen(from_f<scalar_t>(x2 * c)), b2 = widen(from_f<scalar_t>(x1 * s));
    x[i] = from_f<scalar_t>(a1 + b1);
    x[i + half] = from_f<scalar_t>(a2 + b2);
  }
}

// A token's cos and sin (the table's first half) rounded to the storage type, as rotate_row takes them:
// float32's are the table's own; another type's are rounded into buf [2 half].
template <typename scalar_t, typename acc_t = acc_of<scalar_t>>
static inline std::pair<const acc_t*, const acc_t*> token_angles(const float* cos, const float* sin, int64_t half,
                                                                 acc_t* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return {cos, sin};
  } else {
    for (int64_t i = 0; i < half; ++i)
      buf[i] = widen(from_f<scalar_t>(cos[i])), buf[half + i] = widen(from_f<scalar_t>(sin[i]));
    return {buf, buf + half};
  }
}

void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                      torch::Tensor sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "query [N, H, D] and key [N, Hkv, D] expected");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == query.size(0) && positions.scalar_type() == at::kLong &&
              positions.is_contiguous(), "positions must be [N] int64, contiguous");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must have one dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == query.size(2), "cos, sin must be [max_position, D] float32");
  const Rows q(query), k(key);
  TORCH_CHECK(q.d % 2 == 0, "head_dim must be even");
  const int64_t n = q.n, d = q.d, half = d / 2, max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the table of ", max_pos);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = query.data_ptr<scalar_t>();
    scalar_t* kp = key.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d * (q.h + k.h), 1));
    using acc_t = acc_of<scalar_t>;
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(2 * half);  // token_angles' room (float32's angles are the table's own)
      for (int64_t t = begin; t < end; ++t) {
        const auto [c, s] = token_angles<scalar_t>(cp + pos[t] * d, sp + pos[t] * d, half, buf.data());
        for (int64_t h = 0; h < q.h; ++h) rotate_row(qp + t * q.s0 + h * q.s1, c, s, half);
        for (int64_t h = 0; h < k.h; ++h) rotate_row(kp + t * k.s0 + h * k.s1, c, s, half);
      }
    });
  });
}

// SwiGLU's activation (vLLM's silu_and_mul): out[r, i] = silu(gate[r, i]) * up[r, i], silu(g) = g / (1 +
// e**-g), rounded to the storage type before the product, as torch's `silu(gate) * up` rounds it. vLLM's
// op takes the two halves of one [N, 2d] tensor; this one takes them as two [N, d] tensors, which may be
// those halves (views) or two projections' outputs; out may be gate or up itself, but may not overlap
// them otherwise (each value is read before it is written, in the same place only). e**-g: n = round(-g log2
// e), r = -g - n ln 2 in two parts (Cody and Waite's reduction: n ln2_hi is exact), e**r by its Taylor
// polynomial of degree 7 (|r| <= 0.35: within float32's rounding), times 2**n from the exponent bits; its
// steps are fused multiply-adds where the CPU has AVX-512 (the exponential need not round as torch's
// does, only be as close; the division and the product are rounded as torch's are). 16 values at a time
// in the GCC/Clang vector extension (one AVX-512 register, two AVX2 ones).
static inline VecF exp_neg(VecF g) {
  VecF y = -g;
  y = y > 89.0f ? VecF{} + 89.0f : y;    // above about 88.72, e**y overflows to inf, as it should
  y = y < -87.5f ? VecF{} - 87.5f : y;   // below, 1 + e**y is 1 (a NaN fails both tests and stays NaN)
  const VecF n = fma16(y, VecF{} + 1.44269504f, VecF{} + 12582912.0f) - 12582912.0f;  // 1.5 * 2**23: rounds
  const VecF r = fma16(n, VecF{} + 2.12194440e-4f, fma16(n, VecF{} - 0.693359375f, y));  // ln 2 in two parts
  VecF p = VecF{} + 1.98412698e-4f;  // 1/7!, then Horner's rule down to 1
  for (const float c : {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f})
    p = fma16(p, r, VecF{} + c);
  // 2**n as 2 * 2**(n - 1), so that n = 128 still has an exponent field (n - 1 + 127 is in [0, 254]); at
  // n = -126 the field is 0 and the result 0, for y near -87, where 1 + e**y is 1 anyway
  const VecI bits = (__builtin_convertvector(n, VecI) + 126) << 23;
  VecF half_two_n;
  std::memcpy(&half_two_n, &bits, sizeof(half_two_n));
  return (p + p) * half_two_n;
}

template <typename scalar_t>
static inline void silu_mul_row(scalar_t* out, const scalar_t* gate, const scalar_t* up, int64_t d) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<scalar_t, double>) {  // float64: the plain loop, std::exp
    for (; i + 16 <= d; i += 16) {
      const VecF g = load16(gate + i), s = round16<scalar_t>(g / (1.0f + exp_neg(g)));
      store16(out + i, s * load16(up + i));
    }
  }
  for (; i < d; ++i) {
    const auto g = widen(gate[i]);
    const scalar_t s = from_f<scalar_t>(g / (decltype(g)(1) + std::exp(-g)));
    out[i] = from_f<scalar_t>(widen(s) * widen(up[i]));
  }
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && out.sizes() == gate.sizes(),
              "gate, up and out must be [N, d] each, got ", gate.sizes(), ", ", up.sizes(), " and ", out.sizes());
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu() && out.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1 && out.stride(1) == 1, "the last dimension must be contiguous");
  TORCH_CHECK(up.scalar_type() == gate.scalar_type() && out.scalar_type() == gate.scalar_type(),
              "gate, up and out must have one dtype");
  at::assert_no_internal_overlap(out);  // as torch's out= ops: out's values in places of their own,
  at::assert_no_partial_overlap(out, gate);  // and out either gate, up or apart from them
  at::assert_no_partial_overlap(out, up);
  const int64_t n = gate.size(0), d = gate.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate.scalar_type(), "silu_and_mul", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    const int64_t so = out.stride(0), sg = gate.stride(0), su = up.stride(0);
    for_rows(n, d, [&](int64_t r) { silu_mul_row(o + r * so, g + r * sg, u + r * su, d); });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = RMSNorm(input) * weight (out, input, weight, eps)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += input; input = RMSNorm(residual) * weight");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up (out, gate, up); out may be gate or up");
  m.def("rotary_embedding", &rotary_embedding, "rotate query and key in place (positions, query, key, cos, sin)");
}
