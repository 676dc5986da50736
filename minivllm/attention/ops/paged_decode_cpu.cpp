// minivllm's paged decode attention for CPUs: one query per sequence over its cached K/V, read in
// place through its block table (no gather, no padding). The contract of vLLM's paged_attention
// kernels (Kwon et al., SOSP 2023); the work split follows vLLM's CPU backend (csrc/cpu/attention.cpp).
// Hand-written (not generated); built and loaded by minivllm/attention/backends/cpu_attn.py, explained in the
// appendix of notebooks/05_paged_attention.ipynb. float32, float64 and bfloat16: a bfloat16 cache
// and query are widened to float32 (at::opmath_type) as they are read; scores, softmax and the weighted
// sum of V stay in float32, and the output is rounded to bfloat16 once, at the end. Further down: the
// K/V store (reshape_and_cache), two causal prefill kernels, float32 and bfloat16 on AMX tiles, and a
// bfloat16 decode whose scores come from AMX tiles.
//
// How the work is laid out: the `group` query heads that share a K/V head are done together, in tiles of up
// to kMaxTile heads (as GQA-aware decode kernels such as FlashInfer's pack a group into one tile), so each
// cached row is read once per tile rather than once per query head. A tile's sums stay in SIMD registers:
// across a K row for its scores (reduced once per row), across a block's tokens for its weighted sum of V
// (loaded and stored once per block, not once per token). The softmax's exp is a polynomial computed a
// register at a time. While one block's K is worked on, the next block's K is prefetched into L1 and its V
// with a hint for a farther level (prefetcht2: not L1), so that the V pass finds V nearer than memory (the
// pass over K computes the most; its memory reads then overlap the V reads). Where the CPU has AVX-512 and
// head_dim is 64 or 128, float32 and bfloat16 take 16-lane registers spelled with intrinsics (a tile's sums
// and query fit its 32 registers), and bfloat16 scores take AVX512-BF16's pairwise dot product.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

constexpr int64_t kMaxTile = 4;  // query heads per tile: 4 heads x 2 registers of sums fit AVX2's 16

// A SIMD register's worth of acc_t values, with the GCC/Clang vector extension: the compiler maps it
// onto what -march=native offers (AVX2 or AVX-512 on x86, NEON on Arm), no intrinsics named.
constexpr int64_t kVecBytes = 32;
template <typename T>
struct VecOf;
template <>
struct VecOf<float> { typedef float type __attribute__((vector_size(kVecBytes))); };
template <>
struct VecOf<double> { typedef double type __attribute__((vector_size(kVecBytes))); };
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int64_t kVecLen = kVecBytes / sizeof(T);

// kVecLen<acc_t> values from p, widened to acc_t (bfloat16: its 16 bits are a float32's high half).
template <typename acc_t, typename scalar_t>
static inline Vec<acc_t> load_wide(const scalar_t* p) {
  Vec<acc_t> out;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    using Bits16 = uint16_t __attribute__((vector_size(kVecBytes / 2)));
    using Bits32 = uint32_t __attribute__((vector_size(kVecBytes)));
    Bits16 raw;
    std::memcpy(&raw, p, sizeof(raw));
    const Bits32 bits = __builtin_convertvector(raw, Bits32) << 16;
    std::memcpy(&out, &bits, sizeof(out));
  } else {
    static_assert(std::is_same_v<scalar_t, acc_t>, "float32 and float64 are read as they are");
    std::memcpy(&out, p, sizeof(out));
  }
  return out;
}

#if defined(__AVX512F__)
// The 16-lane path: head_dim 64 or 128 (the sizes with a template instance), float32 or bfloat16 data
// (float64 keeps the generic one).
template <typename scalar_t, int64_t kHeadDim>
constexpr bool kWide = kHeadDim > 0 && kHeadDim % 64 == 0 &&
                       (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {  // 16 bfloat16 widened: each the high half of a float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#else
template <typename scalar_t, int64_t kHeadDim>
constexpr bool kWide = false;
#endif

// The sum of a register's lanes, halving it step by step (a tree: log2(L) dependent adds, not L).
template <typename V>
static inline auto sum_lanes(V v) {
  using acc_t = std::remove_reference_t<decltype(v[0])>;
  constexpr int64_t L = sizeof(V) / sizeof(acc_t);
  acc_t t[L];
  std::memcpy(t, &v, sizeof(v));
  for (int64_t w = L / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

// exp(x) for x <= 0 in float32 (a softmax's scores minus their max), to about 2 float32 ulp, a
// register of lanes at a time: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' polynomial, 2**n
// put into the exponent bits; floor from truncation (a lane whose truncation lies above its value
// steps down by one). Plain arithmetic on SIMD registers, because GCC does not vectorise a loop of
// the scalar steps, even under `omp simd` (nor one of std::exp, without -ffast-math). V: any width of
// float32 register (the decode's Vec<float>, the prefill's 16 lanes).
template <typename V>
struct IntsOf;  // the int32 register of V's lanes
template <>
struct IntsOf<Vec<float>> { typedef int32_t type __attribute__((vector_size(kVecBytes))); };
template <typename V>
static inline V exp_approx(V x) {
  using Ints = typename IntsOf<V>::type;
  const V lowest = V{} - 87.0f;
  x = x < lowest ? lowest : x;  // keeps 2**n a normal float (exp(-87) ~ 1.6e-38); a NaN lane stays NaN
  const V t = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(t, Ints), V);
  n = n > t ? n - 1.0f : n;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts: n * ln2 exact
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}
static inline float exp_approx(float x) { return exp_approx(Vec<float>{} + x)[0]; }  // one score: lane 0
static inline double exp_approx(double x) { return std::exp(x); }  // float64: as exact as the reference

// Softmax numerators in place, exp(s[t] - max s), and their sum: float32 a register at a time
// (the max and the sum kept per lane, combined once), float64 lane by lane (std::exp).
template <typename acc_t>
static acc_t softmax_numerators(acc_t* __restrict s, int64_t len) {
  acc_t mx = -INFINITY, total = 0;
  int64_t t = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    constexpr int64_t L = kVecLen<float>;
    const int64_t len_vec = len / L * L;
    Vec<float> v, m = Vec<float>{} + mx, sum = {};
    for (; t < len_vec; t += L) {
      std::memcpy(&v, s + t, sizeof(v));
      m = v > m ? v : m;
    }
    for (int64_t l = 0; l < L; ++l) mx = std::max(mx, m[l]);
    for (int64_t u = len_vec; u < len; ++u) mx = std::max(mx, s[u]);
    for (t = 0; t < len_vec; t += L) {
      std::memcpy(&v, s + t, sizeof(v));
      v = exp_approx(v - mx);
      std::memcpy(s + t, &v, sizeof(v));
      sum += v;
    }
    total = sum_lanes(sum);
  } else {
    for (int64_t u = 0; u < len; ++u) mx = std::max(mx, s[u]);
  }
  for (; t < len; ++t) {  // the rest (float32) or all (float64)
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  return total;
}

// Scores of a tile of kTile query heads q [kTile, D] (q_raw: the same, not widened) against one cached
// K row k [D]: s[h * s_stride] = scale * q[h] . k. Two registers of partial sums per head (one on the
// 16-lane path), summed once at the end.
template <int64_t kTile, int64_t kHeadDim, typename acc_t, typename scalar_t>
static inline void tile_scores(acc_t* __restrict s, int64_t s_stride, const acc_t* __restrict q,
                               const scalar_t* __restrict q_raw, const scalar_t* __restrict k, int64_t head_dim,
                               acc_t scale) {
#if defined(__AVX512F__)
  if constexpr (kWide<scalar_t, kHeadDim>) {
    __m512 part[kTile];
    for (int64_t h = 0; h < kTile; ++h) part[h] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    // bfloat16: 32 products a step, a pair added per lane: exact products, float32 sums, no widening.
    // vdpbf16ps flushes subnormal inputs and sums (below 2**-126) to zero: far smaller than q and K values.
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for (int64_t d = 0; d < kHeadDim; d += 32) {
        const __m512bh kk = (__m512bh)_mm512_loadu_si512(k + d);
        for (int64_t h = 0; h < kTile; ++h)
          part[h] = _mm512_dpbf16_ps(part[h], (__m512bh)_mm512_loadu_si512(q_raw + h * kHeadDim + d), kk);
      }
    } else
#endif
    {
      for (int64_t d = 0; d < kHeadDim; d += 16) {
        const __m512 kk = load16(k + d);
        for (int64_t h = 0; h < kTile; ++h) part[h] = _mm512_fmadd_ps(load16(q + h * kHeadDim + d), kk, part[h]);
      }
    }
    for (int64_t h = 0; h < kTile; ++h) s[h * s_stride] = _mm512_reduce_add_ps(part[h]) * scale;
    return;
  }
#endif
  constexpr int64_t L = kVecLen<acc_t>;
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t D_vec = D / (2 * L) * (2 * L);
  Vec<acc_t> part[kTile][2] = {};
  for (int64_t d = 0; d < D_vec; d += 2 * L) {
    const Vec<acc_t> k0 = load_wide<acc_t>(k + d), k1 = load_wide<acc_t>(k + d + L);
    for (int64_t h = 0; h < kTile; ++h) {
      part[h][0] += load_wide<acc_t>(q + h * D + d) * k0;
      part[h][1] += load_wide<acc_t>(q + h * D + d + L) * k1;
    }
  }
  for (int64_t h = 0; h < kTile; ++h) {
    acc_t dot = sum_lanes(part[h][0] + part[h][1]);
    for (int64_t d = D_vec; d < D; ++d) dot += q[h * D + d] * acc_t(k[d]);  // an odd head_dim's rest
    s[h * s_stride] = dot * scale;
  }
}

#if defined(__AVX512F__)
// bfloat16 on the 16-lane path reads V 32 values at a time and widens them as two registers: the 16 even
// dimensions (each 32-bit word's low half, shifted up) and the 16 odd ones (its high half, already a
// float32's bits: the low half masked off). Two instructions for 32 values, where widening 16 at a time
// takes two for 16; each sum gets the same products in the same order, so the same bits. The weighted sums
// then hold each run of 32 dimensions as its even ones, then its odd ones.
template <typename scalar_t, int64_t kHeadDim>
constexpr bool kPairs = kWide<scalar_t, kHeadDim> && std::is_same_v<scalar_t, c10::BFloat16>;
#else
template <typename scalar_t, int64_t kHeadDim>
constexpr bool kPairs = false;
#endif

// A tile's weighted sum over n consecutive cached tokens of a block: a[h] += sum over i < n of
// p[h * p_stride + i * p_step] * v[i * v_stride] (rows of D values), two registers of D at a time (on the
// AVX-512 path four of 16 lanes, 64 values), so that the tile's sums stay in registers across the n tokens.
// Where kPairs, a[h] holds the dimensions in kPairs' order (weighted_sum_of_blocks puts them back at its end).
template <int64_t kTile, int64_t kHeadDim, typename acc_t, typename scalar_t>
static inline void tile_weighted_sum(acc_t* __restrict a, const acc_t* __restrict p, int64_t p_stride,
                                     const scalar_t* __restrict v, int64_t v_stride, int64_t n, int64_t head_dim,
                                     int64_t p_step = 1) {
#if defined(__AVX512F__)
  if constexpr (kWide<scalar_t, kHeadDim>) {
    for (int64_t d0 = 0; d0 < kHeadDim; d0 += 64) {  // 64 values of D at a time: kTile x 4 sums in registers
      __m512 sum[kTile][4];
      for (int64_t h = 0; h < kTile; ++h)
        for (int64_t c = 0; c < 4; ++c) sum[h][c] = load16(a + h * kHeadDim + d0 + 16 * c);
      for (int64_t i = 0; i < n; ++i) {
        __m512 vv[4];
        if constexpr (kPairs<scalar_t, kHeadDim>) {
          for (int64_t c = 0; c < 2; ++c) {  // even dimensions, then odd ones
            const __m512i pairs = _mm512_loadu_si512(v + i * v_stride + d0 + 32 * c);
            vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
          }
        } else {
          for (int64_t c = 0; c < 4; ++c) vv[c] = load16(v + i * v_stride + d0 + 16 * c);
        }
        for (int64_t h = 0; h < kTile; ++h) {
          const __m512 w = _mm512_set1_ps(p[h * p_stride + i * p_step]);
          for (int64_t c = 0; c < 4; ++c) sum[h][c] = _mm512_fmadd_ps(w, vv[c], sum[h][c]);
        }
      }
      for (int64_t h = 0; h < kTile; ++h)
        for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(a + h * kHeadDim + d0 + 16 * c, sum[h][c]);
    }
    return;
  }
#endif
  constexpr int64_t L = kVecLen<acc_t>;
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t D_vec = D / (2 * L) * (2 * L);
  for (int64_t d = 0; d < D_vec; d += 2 * L) {
    Vec<acc_t> sum[kTile][2];
    for (int64_t h = 0; h < kTile; ++h) {
      sum[h][0] = load_wide<acc_t>(a + h * D + d);
      sum[h][1] = load_wide<acc_t>(a + h * D + d + L);
    }
    for (int64_t i = 0; i < n; ++i) {
      const Vec<acc_t> v0 = load_wide<acc_t>(v + i * v_stride + d), v1 = load_wide<acc_t>(v + i * v_stride + d + L);
      for (int64_t h = 0; h < kTile; ++h) {
        sum[h][0] += p[h * p_stride + i * p_step] * v0;
        sum[h][1] += p[h * p_stride + i * p_step] * v1;
      }
    }
    for (int64_t h = 0; h < kTile; ++h) {
      std::memcpy(a + h * D + d, &sum[h][0], sizeof(sum[h][0]));
      std::memcpy(a + h * D + d + L, &sum[h][1], sizeof(sum[h][1]));
    }
  }
  for (int64_t d = D_vec; d < D; ++d)  // an odd head_dim's rest
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < kTile; ++h) a[h * D + d] += p[h * p_stride + i * p_step] * acc_t(v[i * v_stride + d]);
}

// The weighted sums of `heads` query heads, a [heads, kHeadDim], back in dimension order where kPairs left each
// run of 32 as its 16 even dimensions, then its 16 odd ones (two two-register shuffles per run); else nothing.
template <typename scalar_t, int64_t kHeadDim, typename acc_t>
static inline void sums_in_order(acc_t* a, int64_t heads) {
#if defined(__AVX512F__)
  if constexpr (kPairs<scalar_t, kHeadDim>) {  // acc_t is float
    // lane j of the first result: for even j even[j / 2] (index j / 2), for odd j odd[j / 2] (index 16 + j / 2);
    // the second result: the same indices plus 8
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t i = 0; i < heads * kHeadDim; i += 32) {
      const __m512 even = _mm512_loadu_ps(a + i), odd = _mm512_loadu_ps(a + i + 16);
      _mm512_storeu_ps(a + i, _mm512_permutex2var_ps(even, first, odd));
      _mm512_storeu_ps(a + i + 16, _mm512_permutex2var_ps(even, second, odd));
    }
  }
#endif
}

// Asks for size values of the cache to be brought into the caches while the current block is worked
// on: blocks lie anywhere in memory, so the hardware's stream prefetcher cannot guess the next one.
// kLocality (GCC's __builtin_prefetch hint): 3 into L1 and all levels (prefetcht0); 1, prefetcht2: not into
// L1, into a farther level ("level 3 and higher, or an implementation-specific choice", Intel's manual).
template <int kLocality = 3, typename scalar_t>
static inline void prefetch(const scalar_t* start, int64_t size) {
  const char* p = reinterpret_cast<const char*>(start);
  for (int64_t off = 0; off < size * int64_t(sizeof(scalar_t)); off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// Calls f(std::integral_constant<int64_t, tile>) for tile in 1..kMaxTile: the tile size as a
// compile-time constant, so that the arrays sized by it are kept in registers.
template <typename F>
static inline void with_tile(int64_t tile, F&& f) {
  static_assert(kMaxTile == 4, "with_tile names each tile size");
  if (tile == 4) f(std::integral_constant<int64_t, 4>{});
  else if (tile == 3) f(std::integral_constant<int64_t, 3>{});
  else if (tile == 2) f(std::integral_constant<int64_t, 2>{});
  else f(std::integral_constant<int64_t, 1>{});
}

// Step 3 of a decode, for the query heads of K/V heads kv0 .. kv0 + kvn - 1: a[h] += sum over the sequence's
// len tokens t of p(h, t) * v[t, kv0 + h / group] (h counted from kv0's first query head; p(h, t) =
// p[h * p_head + t * p_token]), block by block through the block table, kMaxTile query heads at a time; a
// holds the sums in dimension order at the end (a must start at zero where kPairs: it is read in pair order).
template <int64_t kHeadDim, typename acc_t, typename scalar_t>
static void weighted_sum_of_blocks(acc_t* __restrict a, const acc_t* __restrict p, int64_t p_head, int64_t p_token,
                                   const scalar_t* v_cache, const int64_t* __restrict block_table, int64_t len,
                                   int64_t block_size, int64_t num_kv_heads, int64_t kv0, int64_t kvn, int64_t group,
                                   int64_t D) {
  const int64_t token_stride = num_kv_heads * D, block_stride = block_size * token_stride;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* v_block = v_cache + block_table[b] * block_stride;
    const scalar_t* v_next = v_cache + block_table[std::min(b + 1, num_blocks - 1)] * block_stride;
    const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
    for (int64_t j = 0; j < kvn; ++j) {
      const int64_t kv = kv0 + j;
      // a 1/num_kv_heads slice of the next block per K/V head (rows interleave the heads): the whole
      // block over the heads, into L1
      prefetch(v_next + kv * block_stride / num_kv_heads, block_stride / num_kv_heads);
      for (int64_t g0 = 0; g0 < group; g0 += kMaxTile)
        with_tile(std::min(kMaxTile, group - g0), [&](auto tile) {
          const int64_t h = j * group + g0;
          tile_weighted_sum<decltype(tile)::value, kHeadDim>(a + h * D, p + h * p_head + t0 * p_token, p_head,
                                                             v_block + kv * D, token_stride, n, D, p_token);
        });
    }
  }
  sums_in_order<scalar_t, kHeadDim>(a, kvn * group);
}

// One sequence's decode attention: its query heads q [num_heads, D] over its context_len cached
// tokens, read in place through its block table, block by block. D is a compile-time constant when
// kHeadDim > 0.
template <typename scalar_t, int64_t kHeadDim>
static void decode_one_sequence(scalar_t* __restrict out, const scalar_t* __restrict q,
                                const scalar_t* __restrict k_cache, const scalar_t* __restrict v_cache,
                                const int64_t* __restrict block_table, int64_t len, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double scale,
                                std::vector<at::opmath_type<scalar_t>>& q_wide,
                                std::vector<at::opmath_type<scalar_t>>& scores,
                                std::vector<at::opmath_type<scalar_t>>& acc) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t group = num_heads / num_kv_heads;     // query heads per K/V head
  const int64_t token_stride = num_kv_heads * D;      // one token's row in a block
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  q_wide.resize(num_heads * D);
  scores.resize(num_heads * len);
  acc.assign(num_heads * D, acc_t(0));
  acc_t* __restrict qw = q_wide.data();  // the query widened once, not once per cached token
  for (int64_t i = 0; i < num_heads * D; ++i) qw[i] = acc_t(q[i]);
  acc_t* __restrict s = scores.data();  // s[h * len + t]
  acc_t* __restrict a = acc.data();     // a[h * D + d]
  // each tile: kMaxTile (or fewer) query heads h0.. of one K/V head's group
  auto for_each_tile = [&](auto&& f) {
    for (int64_t kv = 0; kv < num_kv_heads; ++kv)
      for (int64_t h0 = kv * group; h0 < (kv + 1) * group; h0 += kMaxTile)
        with_tile(std::min(kMaxTile, (kv + 1) * group - h0), [&](auto tile) { f(tile, kv, h0); });
  };

  // 1. scores: s[h, t] = scale * q[h] . k[t, h / group]
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* k_block = k_cache + block_table[b] * block_stride;
    const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
    const int64_t next = block_table[std::min(b + 1, num_blocks - 1)] * block_stride;
    for (int64_t i = 0; i < n; ++i) {
      prefetch(k_cache + next + i * token_stride, token_stride);     // the next block's K row, into L1
      prefetch<1>(v_cache + next + i * token_stride, token_stride);  // and its V row, farther out, for step 3
      for_each_tile([&](auto tile, int64_t kv, int64_t h0) {
        tile_scores<decltype(tile)::value, kHeadDim>(s + h0 * len + t0 + i, len, qw + h0 * D, q + h0 * D,
                                                     k_block + i * token_stride + kv * D, D, acc_t(scale));
      });
    }
  }
  // 2. softmax numerators in place
  std::vector<acc_t> denom(num_heads);
  for (int64_t h = 0; h < num_heads; ++h) denom[h] = softmax_numerators(s + h * len, len);
  // 3. a[h] = sum over t of s[h, t] * v[t, h / group]
  weighted_sum_of_blocks<kHeadDim>(a, s, len, 1, v_cache, block_table, len, block_size, num_kv_heads, 0, num_kv_heads,
                                   group, D);
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
  const int64_t q_stride = q.stride(0);  // a sequence's first query head (its heads follow one another)
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<at::opmath_type<scalar_t>> q_wide, scores, acc;  // this thread's scratch
    for (int64_t b = begin; b < end; ++b)
      for (int64_t seq : bins[b])
        decode_one_sequence<scalar_t, kHeadDim>(o + seq * num_heads * D, qp + seq * q_stride, kc, vc,
                                                tables + seq * max_blocks, lens[seq], num_heads, num_kv_heads,
                                                D, block_size, scale, q_wide, scores, acc);
  });
}

// The AMX decode of bfloat16 (further down, with the AMX prefill): false, having done nothing, where the
// build, the CPU or the shapes do not fit it.
static bool decode_batch_amx(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_tables, const int64_t* lens,
                             const std::vector<std::vector<int64_t>>& bins, double scale);

// paged_decode_attention's checks and work split, then the kernel: the AMX one where `amx` and it fits.
static torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor context_lens, double scale, bool amx) {
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
  // each sequence's heads must lie as one row (D numbers a head); its rows may lie further apart, as the
  // q of a fused q/k/v projection's split does: read in place, not copied
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
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
  auto out = torch::empty({n, num_heads, q.size(2)}, q.options());
  if (amx && decode_batch_amx(out, q, k_cache, v_cache, block_tables, lens, bins, scale)) return out;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    const int64_t D = q.size(2);
    if (D == 64) decode_batch<scalar_t, 64>(out, q, k_cache, v_cache, block_tables, lens, bins, scale);
    else if (D == 128) decode_batch<scalar_t, 128>(out, q, k_cache, v_cache, block_tables, lens, bins, scale);
    else decode_batch<scalar_t, 0>(out, q, k_cache, v_cache, block_tables, lens, bins, scale);
  });
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, false);
}

// The same contract; bfloat16 on AMX tiles where decode_batch_amx takes the shapes.
torch::Tensor paged_decode_attention_amx(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                         torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, true);
}

#if defined(__AVX512F__)
// Copies `bytes` (whole 64-byte lines) to a 64-byte aligned dst with streaming stores: the lines go to memory
// without being read into the CPU's caches first (a plain store reads each line it will overwrite: a read for
// ownership), and without pushing other data out of those caches. Callers fence (_mm_sfence) before the data
// is read elsewhere.
static inline void copy_streaming(char* dst, const char* src, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + o), _mm512_loadu_si512(src + o));
}
#endif

// vLLM's reshape_and_cache for one layer: this step's k, v [N, num_kv_heads, head_dim] copied into their
// slots (slot = block id * block_size + offset in the block) of k_cache, v_cache [num_blocks, block_size,
// num_kv_heads, head_dim]; slot -1 marks a padded row, skipped. One row copy per token and cache, in one
// call (a pair of index_copy_ calls costs several times as much at decode sizes: chapter 05 times both).
// `stream`: where the build has AVX-512, the rows are whole 64-byte lines and both caches start on a line, write
// with streaming stores (copy_streaming), for rows that nothing reads again in this step: the CPU then moves
// half the bytes on the KV cache's side and keeps its own caches for other data. The same values either way.
void reshape_and_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slot_mapping, bool stream) {
  TORCH_CHECK_VALUE(k.dim() == 3 && v.sizes() == k.sizes(),
                    "k and v must both be [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) &&
                        k_cache.size(3) == k.size(2),
                    "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] of k's heads ",
                    "and head_dim, got ", k_cache.sizes(), " for k ", k.sizes());
  TORCH_CHECK_VALUE(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() &&
                        v_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
                    "reshape_and_cache takes CPU tensors");
  TORCH_CHECK_VALUE(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                        v_cache.scalar_type() == k_cache.scalar_type(),
                    "k, v, k_cache and v_cache must have one dtype");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == torch::kInt64 &&
                        slot_mapping.size(0) == k.size(0),
                    "slot_mapping must be 1-D int64 with one slot per token of k");
  const int64_t n = k.size(0), row = k.size(1) * k.size(2), num_slots = k_cache.size(0) * k_cache.size(1);
  slot_mapping = slot_mapping.contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)  // checked before anything is written
    TORCH_CHECK_VALUE(slots[i] >= -1 && slots[i] < num_slots, "slot_mapping[", i, "] = ", slots[i],
                      " is not -1 or a slot of the cache (", num_slots, " slots)");
  // each token's heads must lie as one row; a q/k/v split's views do (their token stride is wider)
  if (k.stride(2) != 1 || k.stride(1) != k.size(2)) k = k.contiguous();
  if (v.stride(2) != 1 || v.stride(1) != v.size(2)) v = v.contiguous();
  const int64_t bytes = row * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
#if defined(__AVX512F__)
  const auto line_aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; };
  stream = stream && bytes % 64 == 0 && line_aligned(kc) && line_aligned(vc);
#else
  stream = false;
#endif
  // split among the threads in runs of at least 256 tokens (a prefill's; a decode step's few rows stay on one)
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
#if defined(__AVX512F__)
      if (stream) {
        copy_streaming(kc + slots[i] * bytes, kp + i * k_step, bytes);
        copy_streaming(vc + slots[i] * bytes, vp + i * v_step, bytes);
        continue;
      }
#endif
      std::memcpy(kc + slots[i] * bytes, kp + i * k_step, bytes);
      std::memcpy(vc + slots[i] * bytes, vp + i * v_step, bytes);
    }
#if defined(__AVX512F__)
    if (stream) _mm_sfence();  // this thread's streaming stores in order before the join
#endif
  });
}

// ---------------------------------------------------------------------------------------------------
// Causal prefill attention in float32: FlashAttention-2's tiling (Dao, 2023) on a CPU. A tile of kRows
// query rows (a K/V head's group of query heads at consecutive tokens: they share K, V and nearly their
// causal limit) walks the keys in blocks of kKeys: scores S = Q K^T from K transposed once per call (block
// by block, each block's K^T contiguous), so that a register holds 16 keys' scores of one row and each step
// is a broadcast q value times a K^T row; then the online softmax in base 2 (the block's max, 2**x by a
// polynomial, a rescale of the running sum and output); then O += P V, the tile's outputs held in
// registers across the block's V rows. The scores never leave the first-level cache. The registers are
// vectors of the GCC/Clang extension: 64 bytes, one AVX-512 register each; where the CPU has AVX2 instead,
// 32 bytes, and S and P V each done in passes of two vectors (four over a block's keys, four over a row of O
// for head_dim 64), so that a pass's sums fit AVX2's 16 registers. Blocks of 64 keys on either: with AVX2, 64
// ran 2-5% faster than 32 from 128 tokens a sequence on an AMD EPYC (Zen 3), 3% slower at 32, the rescale of
// O and the other per-block work spread over twice the keys (cpu_attn.py's cpu_prefill_kernel takes either
// build). AVX-512 intrinsics, with plain fallbacks, where the vector extension has no word for an instruction.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;             // float32 values per vector: one 64-byte AVX-512 register
constexpr int64_t kScoreVecs = 4;          // vectors of keys per pass of S = Q K^T: 6 x 4 sums in registers
constexpr int64_t kOutVecs = 4;            // vectors of a row of O per pass of P V: 6 x 4 sums in registers
#else
constexpr int64_t kLanes = 8;              // AVX2: one 32-byte register, 16 of them
constexpr int64_t kScoreVecs = 2;          // 6 x 2 sums, a K^T row's 2 vectors and a broadcast: 15 registers
constexpr int64_t kOutVecs = 2;            // likewise for P V
#endif
constexpr int64_t kRows = 6;               // query rows per tile
constexpr int64_t kKeys = 64;              // keys per block (16 KiB of K^T for head_dim 64)
constexpr int64_t kKeyVecs = kKeys / kLanes;  // 4 AVX-512 vectors, 8 AVX2 ones
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));
#if defined(__AVX512F__)
template <>
struct IntsOf<VecF> { typedef VecI type; };  // (with 8 lanes VecF is the decode's Vec<float>, already there)
#endif

static inline VecF load_vecf(const float* p) { VecF v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline void store_vecf(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }
static inline float max_lanes(VecF v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);  // shuffles within the register, not through memory
#else
  float t[kLanes];
  std::memcpy(t, &v, sizeof(v));
  for (int64_t w = kLanes / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) t[l] = std::max(t[l], t[l + w]);
  return t[0];
#endif
}
static inline float add_lanes(VecF v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  return sum_lanes(v);
#endif
}

#if defined(__AVX512F__)
// A 16 x 16 matrix of 32-bit words, one row a register, transposed in the registers: row i of the result
// holds word i of every input row. Four rounds of shuffles (words, pairs of words, then 128-bit quarters
// twice), 64 in all; it packs K for the prefill tiles. (A gather per row of the result, 16 loads each, did
// the same a little more slowly, and its int32 offsets limited the token stride.)
static inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// 16 rows of 64 bytes, row i from p + i * stride (elements of T), the rows from `present` on zero (keys past
// the sequence's last): a matrix for transpose16x16.
template <typename T>
static inline void load_rows16(__m512i (&r)[16], const T* p, int64_t stride, int64_t present) {
  for (int64_t i = 0; i < 16; ++i) r[i] = i < present ? _mm512_loadu_si512(p + i * stride) : _mm512_setzero_si512();
}
#elif defined(__AVX2__)
// The AVX2 counterpart, 8 x 8 floats: pairs of rows interleaved, then pairs of pairs, then 128-bit halves.
static inline void transpose8x8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + j]: word j of rows i..i + 3, then word j + 4 (one per 128-bit half)
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}
#endif

template <size_t N>
static inline VecF horner(VecF f, const float (&c)[N]) {  // c[0] + c[1] f + ... + c[N - 1] f**(N - 1)
  VecF p = VecF{} + c[N - 1];
  for (size_t i = N - 1; i-- > 0;) p = p * f + c[i];
  return p;
}
// exp2_poly: 2**x in float32 for x <= 0 (a softmax's scores minus their max, in base 2), a register at a
// time: x = n + f with n whole and |f| <= 1/2, 2**f by a polynomial in f (the coefficients c, lowest degree
// first: least squares of the relative error on Chebyshev points of [-1/2, 1/2]), times 2**n (AVX-512's
// vscalefps, or the exponent bits). x below -127 is taken as -127, so that -inf gives 2**-127 (a subnormal float32; 0
// through the exponent bits), not the NaN of -inf - (-inf): callers that need exactly 0 there select it.
template <size_t N>
static inline VecF exp2_poly(VecF x, const float (&c)[N]) {
#if defined(__AVX512F__)
  x = (VecF)_mm512_max_ps(_mm512_set1_ps(-127.0f), (__m512)x);  // a NaN lane stays NaN (max's second operand)
  const VecF n = (VecF)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (VecF)_mm512_scalef_ps((__m512)horner(x - n, c), (__m512)n);
#else
  x = x < VecF{} - 127.0f ? VecF{} - 127.0f : x;  // a NaN lane stays NaN
  const VecF n = (x + 12582912.0f) - 12582912.0f;  // 1.5 * 2**23: the sum's last bit is a unit, rounded to nearest
  const VecI bits = (__builtin_convertvector(n, VecI) + 127) << 23;
  VecF two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return horner(x - n, c) * two_n;
#endif
}
// degree 5, the constant held at 1 (so that a row's max score weighs exactly 1): within 1.9e-7 relative
// (about 3 float32 ulp), for the float32 kernel's probabilities
constexpr float kExp2Float32[] = {1.0f, 0.6931468844f, 0.2402223796f, 0.0555089302f, 0.0096716983f, 0.0013218672f};

// The rescale factors of all rows in one register, from their old and new maxima: 2**(m - m_new) by the
// polynomial c (where the max stayed, c's constant: 1 for float32's), 0 where m was -inf (nothing seen yet,
// so the sums it scales are 0).
template <size_t N>
static inline VecF rescale_factors(VecF m, VecF m_new, const float (&c)[N]) {
  const VecF minus_inf = VecF{} - INFINITY;
  return m == minus_inf ? VecF{} : exp2_poly(m - m_new, c);
}

// S = Q K^T for one tile and kVecs vectors of keys from vector c0: s[r][kLanes c + i] = q[r] . kt[:, kLanes c + i]
// for c = c0..c0 + kVecs - 1, the tile's 6 x kVecs sums in registers across the D steps (a broadcast q value
// times a K^T row at each step).
template <int64_t D, int64_t kVecs>
static inline void tile_block_scores(const float* __restrict q, const float* __restrict kt, float (*s)[kKeys],
                                     int64_t c0) {
  VecF acc[kRows][kVecs] = {};
  for (int64_t d = 0; d < D; ++d) {
    VecF k[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) k[c] = load_vecf(kt + d * kKeys + (c0 + c) * kLanes);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < kVecs; ++c) acc[r][c] += q[r * D + d] * k[c];
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kVecs; ++c) store_vecf(s[r] + (c0 + c) * kLanes, acc[r][c]);
}

// The scores of a block's first `vecs` vectors of keys, kScoreVecs vectors a pass (one pass with AVX-512, whose
// 32 registers hold 6 x 4 sums; two with AVX2's 16), each pass's width a compile-time constant.
template <int64_t D>
static inline void block_scores(const float* __restrict q, const float* __restrict kt, float (*s)[kKeys], int64_t vecs) {
  for (int64_t c0 = 0; c0 < vecs; c0 += kScoreVecs) {
    const int64_t w = std::min(kScoreVecs, vecs - c0);
    if (w == 1) tile_block_scores<D, 1>(q, kt, s, c0);
    else if (w == 2) tile_block_scores<D, 2>(q, kt, s, c0);
    else if (w == 3) tile_block_scores<D, 3>(q, kt, s, c0);
    else tile_block_scores<D, kScoreVecs>(q, kt, s, c0);
  }
}

// One tile: rows r < n of q [kRows, D] (scaled by the softmax scale times log2(e): scores in base 2),
// row r seeing keys 0..last[r]; K^T kt [key blocks][D][kKeys] (each block's K^T contiguous, 16 KiB for D 64,
// so that its rows do not crowd a few sets of the first-level cache; zero past the last key in its vector,
// vectors wholly past it not written, as no tile reads them), V rows
// v + j * ldv; row r's output written to out[r]. The last block computes scores only for the vectors of
// keys some row sees; the causal mask is applied only in blocks that hold a row's limit.
template <int64_t D>
static void prefill_tile(const float* __restrict q, const int64_t* last, int64_t n, const float* __restrict kt,
                         const float* __restrict v, int64_t ldv, float* const* out) {
  static_assert(D % (kOutVecs * kLanes) == 0, "head_dim: a multiple of 64");
  alignas(64) float o[kRows][D] = {};
  alignas(64) float s[kRows][kKeys];
  alignas(64) float p[kRows][kKeys];  // rows < n written before they are read; rows >= n zero
  for (int64_t r = n; r < kRows; ++r) std::memset(p[r], 0, sizeof(p[r]));
  alignas(64) float m[kLanes], m_new[kLanes], alpha[kLanes];  // per row (a register's worth: one exp2 for all)
  VecF lsum[kRows] = {}, l[kRows];  // the running and a block's sums of probabilities, lane by lane
  int64_t num_keys = 0, min_last = INT64_MAX;
  for (int64_t r = 0; r < kLanes; ++r) m[r] = m_new[r] = -INFINITY;
  for (int64_t r = 0; r < n; ++r) num_keys = std::max(num_keys, last[r] + 1), min_last = std::min(min_last, last[r]);
  VecI lane;
  for (int64_t i = 0; i < kLanes; ++i) lane[i] = int32_t(i);
  const VecF minus_inf = VecF{} - INFINITY;
  for (int64_t j0 = 0; j0 < num_keys; j0 += kKeys) {
    const int64_t keys = std::min(kKeys, num_keys - j0), vecs = (keys + kLanes - 1) / kLanes;
    block_scores<D>(q, kt + j0 * D, s, vecs);  // 1. scores of the block's keys, as few vectors as the rows see
    const bool all_seen = j0 + kKeys <= min_last + 1;  // no row's causal limit inside the block
    for (int64_t r = 0; r < n; ++r) {  // 2. online softmax in base 2: probabilities; the rescale follows
      VecF x[kKeyVecs], mx = minus_inf;
      for (int64_t c = 0; c < vecs; ++c) {
        x[c] = load_vecf(s[r] + c * kLanes);
        if (!all_seen) x[c] = lane + int32_t(j0 + c * kLanes) > int32_t(last[r]) ? minus_inf : x[c];
        mx = mx > x[c] ? mx : x[c];
      }
      m_new[r] = std::max(m[r], max_lanes(mx));
      // -inf where every score seen so far is -inf (hidden, or a product that overflowed float32, finite
      // inputs): the exponent from 0 then; -inf scores weigh exactly 0
      const float m_ref = m_new[r] == -INFINITY ? 0.0f : m_new[r];
      VecF sum = {};
      for (int64_t c = 0; c < vecs; ++c) {
        const VecF e = x[c] == minus_inf ? VecF{} : exp2_poly(x[c] - m_ref, kExp2Float32);
        sum += e;
        store_vecf(p[r] + c * kLanes, e);
      }
      l[r] = sum;
    }
    {  // the rescale factors of all rows in one register (rescale_factors)
      const VecF mo = load_vecf(m), mn = load_vecf(m_new);
      store_vecf(alpha, rescale_factors(mo, mn, kExp2Float32));
      store_vecf(m, mn);
    }
    for (int64_t r = 0; r < n; ++r) lsum[r] = lsum[r] * alpha[r] + l[r];
    for (int64_t d0 = 0; d0 < D; d0 += kOutVecs * kLanes) {  // 3. o = alpha o + P V, a register block of D at a time
      VecF a[kRows][kOutVecs];
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t c = 0; c < kOutVecs; ++c) a[r][c] = alpha[r] * load_vecf(o[r] + d0 + c * kLanes);
      for (int64_t j = 0; j < keys; ++j) {
        VecF vj[kOutVecs];
        for (int64_t c = 0; c < kOutVecs; ++c) vj[c] = load_vecf(v + (j0 + j) * ldv + d0 + c * kLanes);
        for (int64_t r = 0; r < kRows; ++r)
          for (int64_t c = 0; c < kOutVecs; ++c) a[r][c] += p[r][j] * vj[c];
      }
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t c = 0; c < kOutVecs; ++c) store_vecf(o[r] + d0 + c * kLanes, a[r][c]);
    }
  }
  for (int64_t r = 0; r < n; ++r) {  // one division a row, not one a value (vdivps is slow), as the AMX kernel
    const float sum = add_lanes(lsum[r]), inv = sum == 0.0f ? 1.0f : 1.0f / sum;  // no finite score seen: 0
    for (int64_t d = 0; d < D; ++d) out[r][d] = o[r][d] * inv;
  }
}

// A prefill batch laid end to end, as FlashAttention's varlen kernels take one: sequence s's new tokens are
// q's rows cu_q[s] .. cu_q[s + 1] - 1 and its keys k's and v's rows cu_k[s] .. cu_k[s + 1] - 1 (cached ones
// first, then the new ones: its query i sees its keys 0 .. tk - tq + i). One call serves the whole batch:
// no call per sequence, and the threads share out the tiles of all sequences. With block_tables, the keys
// lie in a paged cache instead (FlashAttention's varlen call with a block table, as vLLM makes it for a
// prefix the cache holds): key t of sequence s is row block_tables[s][t / block_size] * block_size +
// t % block_size of k and v, and cu_k holds the prefix sums of the sequences' lengths only.
struct VarlenBatch {
  const int64_t* cu_q;
  const int64_t* cu_k;
  int64_t num_seqs;
  const int64_t* block_tables = nullptr;  // [num_seqs, max_blocks], or none: k's rows cu_k[s] + t
  int64_t max_blocks = 0, block_size = 0;
  int64_t tq(int64_t s) const { return cu_q[s + 1] - cu_q[s]; }
  int64_t tk(int64_t s) const { return cu_k[s + 1] - cu_k[s]; }
  int64_t key_row(int64_t s, int64_t t) const {  // k's and v's row of sequence s's key t (t < tk(s))
    if (block_tables == nullptr) return cu_k[s] + t;
    return block_tables[s * max_blocks + t / block_size] * block_size + t % block_size;
  }
};

// Calls f(s, i) for every i < count[s] of every sequence s, the items of all sequences split among the
// threads in runs of at least grain (at::parallel_for over them laid end to end).
template <typename F>
static void for_each_item(const std::vector<int64_t>& count, int64_t grain, F&& f) {
  std::vector<int64_t> start(count.size() + 1, 0);
  std::partial_sum(count.begin(), count.end(), start.begin() + 1);
  at::parallel_for(0, start.back(), grain, [&](int64_t begin, int64_t end) {
    int64_t s = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= start[s + 1]) ++s;
      f(s, item - start[s]);
    }
  });
}

// The tiles of a batch, count[s] of sequence s, in the order the threads take them: the sequences with the
// most keys first, so that the short ones come last and even out the threads' shares (longest processing
// time first, Graham 1969), each thread taking every threads-th tile (round-robin, so that neighbouring
// tiles, of nearly equal cost, go to different threads). Each tile is computed whole by one thread, so the
// results do not depend on the number of threads.
class TileOrder {
 public:
  TileOrder(const std::vector<int64_t>& count, const VarlenBatch& batch)
      : order_(count.size()), start_(count.size() + 1, 0) {
    std::iota(order_.begin(), order_.end(), int64_t(0));
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return batch.tk(a) > batch.tk(b); });
    for (size_t o = 0; o < order_.size(); ++o) start_[o + 1] = start_[o] + count[order_[o]];
  }
  int64_t size() const { return start_.back(); }
  // Calls f(s, i) for thread th of threads: tile i of sequence s for every th-th tile of the order.
  template <typename F>
  void for_thread(int64_t th, int64_t threads, F&& f) const {
    size_t o = 0;
    for (int64_t n = th; n < size(); n += threads) {
      while (n >= start_[o + 1]) ++o;
      f(order_[o], n - start_[o]);
    }
  }

 private:
  std::vector<int64_t> order_, start_;
};

// Per sequence of a batch: its blocks of `keys` keys, its packing items (one per K/V head and block), its
// tiles of `rows` query rows (a K/V head's group of query heads at consecutive tokens), and where its packed
// keys start (keys * D values an item, sequences one after the other).
struct BatchLayout {
  std::vector<int64_t> blocks, items, tiles, start;
  BatchLayout(const VarlenBatch& batch, int64_t num_kv_heads, int64_t group, int64_t D, int64_t keys, int64_t rows)
      : blocks(batch.num_seqs), items(batch.num_seqs), tiles(batch.num_seqs), start(batch.num_seqs + 1, 0) {
    for (int64_t s = 0; s < batch.num_seqs; ++s) {
      blocks[s] = (batch.tk(s) + keys - 1) / keys;
      items[s] = num_kv_heads * blocks[s];
      start[s + 1] = start[s] + items[s] * keys * D;
      tiles[s] = num_kv_heads * ((batch.tq(s) * group + rows - 1) / rows);
    }
  }
};

// Who does what in a batch. The work comes in units: a sequence, packing its keys and computing its tiles,
// or, where sequences are too few or too unequal to share out, a sequence's K/V head. Where the units, dealt
// out whole by Graham's rule (the costliest first, each to the thread with the least work so far; a tile
// costs the blocks of keys its last row sees, plus one, and packing a block one), leave no thread more than
// kSlack above an equal share, each thread packs its own units' keys, then computes their tiles, in one
// parallel region: its tiles' keys were packed on its own core, no join parts packing from tiles, and a core's
// rows of q and of the output lie together (K/V heads dealt apart interleave them). Tile by tile, short prompts
// ran slower on an Intel Xeon, and so did K/V heads dealt apart in bfloat16 (which difference counts, that A/B
// does not say). Otherwise (a few long sequences) the keys are packed in a parallel pass of their own and
// TileOrder deals the tiles, so that the threads share each sequence.
class WorkPlan {
 public:
  static constexpr double kSlack = 0.05;
  WorkPlan(const VarlenBatch& batch, const BatchLayout& layout, int64_t num_kv_heads, int64_t group, int64_t keys,
           int64_t rows)
      : layout_(layout), order_(layout.tiles, batch), num_kv_heads_(num_kv_heads) {
    std::vector<double> head_cost(batch.num_seqs);  // one K/V head's: packing, then its tiles
    for (int64_t s = 0; s < batch.num_seqs; ++s) {
      double c = double(layout.blocks[s]);
      const int64_t tiles_per_head = layout.tiles[s] / num_kv_heads, head_rows = batch.tq(s) * group;
      for (int64_t i = 0; i < tiles_per_head; ++i) {
        const int64_t t = (std::min(head_rows, (i + 1) * rows) - 1) / group;  // the tile's last row's token
        c += double((batch.tk(s) - batch.tq(s) + t + keys) / keys) + 1.0;
      }
      head_cost[s] = c;
    }
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    for (int64_t heads = num_kv_heads; heads > 0; heads = heads > 1 ? 1 : 0) {  // K/V heads a unit: all, then one
      const int64_t per_seq = num_kv_heads / heads, units = batch.num_seqs * per_seq;
      std::vector<int64_t> by_cost(units);
      std::iota(by_cost.begin(), by_cost.end(), int64_t(0));
      const auto cost = [&](int64_t u) { return head_cost[u / per_seq] * double(heads); };
      std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
      std::vector<double> load(threads, 0.0);
      units_.assign(threads, {});
      for (int64_t u : by_cost) {
        const int64_t th = std::min_element(load.begin(), load.end()) - load.begin();
        load[th] += cost(u);
        units_[th].push_back(u);
      }
      const double total = std::accumulate(load.begin(), load.end(), 0.0);
      if (total > 0 && *std::max_element(load.begin(), load.end()) <= (1.0 + kSlack) * total / double(threads)) {
        heads_ = heads, threads_ = threads;
        return;
      }
    }
    units_.clear();
    threads_ = std::max<int64_t>(1, std::min<int64_t>(threads, order_.size()));
  }
  bool owned() const { return heads_ > 0; }  // each thread packs its own units (else: a packing pass first)
  int64_t threads() const { return threads_; }
  // Thread th's work: where owned, pack(s, item) for each packing item of its units (BatchLayout's items: K/V
  // head h's block b is item h * blocks[s] + b), then tile(s, i) for each of their tiles; else its tiles.
  template <typename Pack, typename Tile>
  void for_thread(int64_t th, Pack&& pack, Tile&& tile) const {
    if (!owned()) return order_.for_thread(th, threads_, tile);
    const int64_t per_seq = num_kv_heads_ / heads_;
    for (int64_t u : units_[th]) {
      const int64_t s = u / per_seq, h0 = u % per_seq * heads_;
      for (int64_t item = h0 * layout_.blocks[s]; item < (h0 + heads_) * layout_.blocks[s]; ++item) pack(s, item);
    }
    for (int64_t u : units_[th]) {
      const int64_t s = u / per_seq, h0 = u % per_seq * heads_, tiles_per_head = layout_.tiles[s] / num_kv_heads_;
      for (int64_t i = h0 * tiles_per_head; i < (h0 + heads_) * tiles_per_head; ++i) tile(s, i);
    }
  }

 private:
  const BatchLayout& layout_;
  TileOrder order_;
  int64_t num_kv_heads_, heads_ = 0, threads_ = 1;  // heads_: K/V heads a unit, 0 where not owned
  std::vector<std::vector<int64_t>> units_;  // per thread, its units, as for_thread reads them
};

template <int64_t D>
static void prefill_heads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& out,
                          const VarlenBatch& batch, double scale) {
  const int64_t num_heads = q.size(1), num_kv_heads = k.size(1), group = num_heads / num_kv_heads;
  // K^T per sequence, K/V head and block of keys, kt[h][b][d][i] = K[kKeys b + i][h][d]: [num_kv_heads,
  // blocks, D, kKeys] for each sequence, one after the other (from kt_start[s]), packed as WorkPlan deals the
  // work; the padding keys of a last block: zero scores, masked anyway
  const BatchLayout layout(batch, num_kv_heads, group, D, kKeys, kRows);
  const WorkPlan plan(batch, layout, num_kv_heads, group, kKeys, kRows);
  const auto& blocks = layout.blocks;
  const auto& tiles = layout.tiles;
  const auto& kt_start = layout.start;
  auto kt_blocks = torch::empty({kt_start.back()}, k.options());
  float* kt_w = kt_blocks.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t k_stride = k.stride(0);
  const int64_t v_stride = v.stride(0);
  torch::Tensor v_copy;  // a paged batch's V, [keys of all sequences, num_kv_heads, D]
  if (batch.block_tables != nullptr) v_copy = torch::empty({batch.cu_k[batch.num_seqs], num_kv_heads, D}, v.options());
  float* v_rows = v_copy.defined() ? v_copy.data_ptr<float>() : nullptr;
  const auto pack_item = [&](int64_t s, int64_t item) {
    const int64_t h = item / blocks[s], t0 = item % blocks[s] * kKeys, tk = batch.tk(s);
    float* dst = kt_w + kt_start[s] + item * D * kKeys;
#if defined(__AVX512F__)
    for (int64_t c = 0; c < kKeyVecs; ++c) {  // 16 keys' values d0..d0 + 15: 16 row loads, one transposition
      const int64_t t = t0 + c * kLanes, present = std::clamp<int64_t>(tk - t, 0, kLanes);
      if (present == 0) break;  // past the last key: no tile scores these vectors
      // 16 keys from a multiple of 16 are 16 rows in a row, in a paged cache too (block_size a multiple of 16)
      const float* rows = kp + batch.key_row(s, t) * k_stride + h * D;
      for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
        __m512i r[16];
        load_rows16(r, rows + d0, k_stride, present);
        transpose16x16(r);
        for (int64_t j = 0; j < kLanes; ++j) _mm512_storeu_si512(dst + (d0 + j) * kKeys + c * kLanes, r[j]);
      }
    }
#elif defined(__AVX2__)
    for (int64_t c = 0; c < kKeys / 8; ++c) {  // 8 keys' values d0..d0 + 7: 8 row loads, one transposition
      const int64_t t = t0 + c * 8, present = std::clamp<int64_t>(tk - t, 0, 8);
      if (present == 0) break;  // past the last key: no tile scores these vectors
      const float* rows = kp + batch.key_row(s, t) * k_stride + h * D;  // 8 rows in a row
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8];
        for (int64_t i = 0; i < 8; ++i) r[i] = i < present ? _mm256_loadu_ps(rows + i * k_stride + d0) : _mm256_setzero_ps();
        transpose8x8(r);
        for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (d0 + j) * kKeys + c * 8, r[j]);
      }
    }
#else
    for (int64_t i = 0; i < kKeys; ++i)
      for (int64_t d = 0; d < D; ++d)
        dst[d * kKeys + i] = t0 + i < tk ? kp[batch.key_row(s, t0 + i) * k_stride + h * D + d] : 0.0f;
#endif
    if (v_rows != nullptr)  // a paged V: this item's rows copied end to end, where the tiles read V in place
      for (int64_t t = t0; t < std::min(t0 + kKeys, tk); ++t)
        std::memcpy(v_rows + ((batch.cu_k[s] + t) * num_kv_heads + h) * D, vp + batch.key_row(s, t) * v_stride + h * D,
                    D * sizeof(float));
  };
  if (!plan.owned()) for_each_item(layout.items, 4, pack_item);  // a pass of its own, at least 4 blocks a thread
  const float* kt = kt_blocks.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  // where the tiles read V: sequence s's rows from row cu_k[s], ldv apart
  const float* vt = v_rows != nullptr ? v_rows : vp;
  const int64_t ldv = v_rows != nullptr ? num_kv_heads * D : v_stride;
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0);
  const float q_scale = float(scale * 1.4426950408889634);  // scores in base 2: scale * log2(e)
  at::parallel_for(0, plan.threads(), 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qt[kRows * D];
    for (int64_t th = begin; th < end; ++th) plan.for_thread(th, pack_item, [&](int64_t s, int64_t i) {
      // a K/V head's rows are (token, query head of its group), token-major: tile i covers rows kRows * i..
      const int64_t rows = batch.tq(s) * group, tiles_per_head = tiles[s] / num_kv_heads;
      const int64_t kv = i / tiles_per_head, r0 = i % tiles_per_head * kRows, n = std::min(kRows, rows - r0);
      const float* qs = qp + batch.cu_q[s] * q_stride;
      // Asks for the next tile's q rows and its tokens' V rows, the keys it sees that this tile mostly has not
      // (the others are in the core's caches by then), so that it does not start by waiting for them: a fresh
      // projection's q, k and v are several MiB, more than a core's own caches hold. Where each thread computes
      // whole units (WorkPlan), the next tile is this thread's next; where tiles are dealt round-robin, another
      // core's, and the lines come into this core's caches for nothing.
      if (r0 + kRows < rows) {
        const int64_t t_first = (r0 + kRows) / group, t_end = (std::min(rows, r0 + 2 * kRows) - 1) / group;
        for (int64_t t = t_first; t <= t_end; ++t) {
          prefetch(qs + t * q_stride + kv * group * D, group * D);
          prefetch(vt + (batch.cu_k[s] + batch.tk(s) - batch.tq(s) + t) * ldv + kv * D, D);
        }
      }
      int64_t last[kRows];
      float* out_rows[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t t = (r0 + r) / group, h = kv * group + (r0 + r) % group;
        last[r] = batch.tk(s) - batch.tq(s) + t;
        out_rows[r] = r < n ? op + ((batch.cu_q[s] + t) * num_heads + h) * D : nullptr;
        if (r >= n) {  // a short last tile: zero rows (a condition inside the copy would make it a gather)
          std::memset(qt + r * D, 0, D * sizeof(float));
          continue;
        }
        const float* q_row = qs + t * q_stride + h * D;
        for (int64_t d = 0; d < D; ++d) qt[r * D + d] = q_row[d] * q_scale;
      }
      prefill_tile<D>(qt, last, n, kt + kt_start[s] + kv * blocks[s] * D * kKeys,
                      vt + batch.cu_k[s] * ldv + kv * D, ldv, out_rows);
    });
  });
}

// The checks and layout fixes both prefill kernels make (kernel: its name in the errors; dtype: the one it
// takes): each token's heads must be rows of D values, whatever the token stride (a q/k/v split's views keep
// theirs).
static void check_prefill_inputs(torch::Tensor& q, torch::Tensor& k, torch::Tensor& v, const char* kernel,
                                 c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
                    "q must be [Tq, num_heads, head_dim] and k, v both [Tk, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), kernel, " takes CPU tensors");
  TORCH_CHECK_VALUE(q.layout() == torch::kStrided && k.layout() == torch::kStrided && v.layout() == torch::kStrided,
                    kernel, " takes dense (strided) tensors, not sparse or mkldnn ones");
  TORCH_CHECK_VALUE(q.scalar_type() == dtype && k.scalar_type() == dtype && v.scalar_type() == dtype, kernel,
                    " takes ", dtype == torch::kFloat ? "float32" : "bfloat16");
  TORCH_CHECK_VALUE(q.size(2) == k.size(2) && (q.size(2) == 64 || q.size(2) == 128), kernel,
                    " takes head_dim 64 or 128, the same for q, k and v");
  TORCH_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  // a fresh dense copy where the strides do not fit (contiguous() keeps a size-1 dimension's stride as it is)
  const auto dense = [](const torch::Tensor& t) { return torch::empty(t.sizes(), t.options()).copy_(t); };
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = dense(q);
  if (k.stride(2) != 1 || k.stride(1) != k.size(2)) k = dense(k);
  if (v.stride(2) != 1 || v.stride(1) != v.size(2)) v = dense(v);
}

// cu_seqlens_q and cu_seqlens_k as a VarlenBatch, checked against q's and k's rows: int64 prefix sums from 0,
// one more than the sequences, each sequence with at least as many keys as queries. cu_q, cu_k: the
// contiguous CPU copies the batch points into (kept alive by the caller).
static VarlenBatch varlen_batch(const torch::Tensor& q, const torch::Tensor& k, torch::Tensor& cu_q,
                                torch::Tensor& cu_k) {
  TORCH_CHECK_VALUE(cu_q.dim() == 1 && cu_k.dim() == 1 && cu_q.size(0) == cu_k.size(0) && cu_q.size(0) >= 1,
                    "cu_seqlens_q and cu_seqlens_k must both be [num_seqs + 1]");
  TORCH_CHECK_VALUE(cu_q.scalar_type() == torch::kLong && cu_k.scalar_type() == torch::kLong &&
                        cu_q.device().is_cpu() && cu_k.device().is_cpu(),
                    "cu_seqlens_q and cu_seqlens_k must be int64 CPU tensors");
  cu_q = cu_q.contiguous(), cu_k = cu_k.contiguous();
  const VarlenBatch batch{cu_q.data_ptr<int64_t>(), cu_k.data_ptr<int64_t>(), cu_q.size(0) - 1};
  TORCH_CHECK_VALUE(batch.cu_q[0] == 0 && batch.cu_k[0] == 0, "cu_seqlens_q and cu_seqlens_k must start at 0");
  for (int64_t s = 0; s < batch.num_seqs; ++s) {  // the values compared, not subtracted: no int64 wrap-around
    TORCH_CHECK_VALUE(batch.cu_q[s + 1] >= batch.cu_q[s] && batch.cu_k[s + 1] >= batch.cu_k[s],
                      "cu_seqlens_q and cu_seqlens_k must not decrease");
  }
  TORCH_CHECK_VALUE(batch.cu_q[batch.num_seqs] == q.size(0) && batch.cu_k[batch.num_seqs] == k.size(0),
                    "cu_seqlens_q must end at q's rows (", q.size(0), ") and cu_seqlens_k at k's (", k.size(0), ")");
  for (int64_t s = 0; s < batch.num_seqs; ++s) {  // every entry now within [0, rows]: the lengths cannot wrap
    TORCH_CHECK_VALUE(batch.tk(s) >= batch.tq(s), "sequence ", s, " has ", batch.tq(s), " queries but ", batch.tk(s),
                      " keys: Tk must be at least Tq (the new tokens are the last keys)");
  }
  return batch;
}

// Causal prefill attention in bfloat16 on AMX tiles (Intel Sapphire Rapids and later; chapter 02's
// appendix C introduces the tiles and tdpbf16ps). The same FlashAttention-2 walk as prefill_tile, but a
// tile of 16 query rows meets a block of 32 keys in tile instructions: S = Q K^T as two 16 x 16 float32
// tiles (D / 32 products each), the online softmax on those scores in AVX-512 registers (float32, its
// reference max moved only when a score rises well above it), the probabilities rounded to bfloat16 into a
// 16 x 32 tile P, and P V as D / 16 products of 16 x 16 added to the float32 output: in tiles 0-3 for
// head_dim 64, in memory for 128. The matrices are put in the tiles' order once per call: K as B tiles of
// Q K^T (16 pairs of head dimensions x 16 keys), V as B tiles of P V (16 pairs of keys x 16 head
// dimensions). Ideas: FlashAttention-2 (Dao, 2023), FlashAttention-4's conditional rescaling, and the AMX
// paths of CPU attention kernels (SGLang's and vLLM's CPU backends, which also round P to bfloat16 before P V).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define MINIVLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// Linux grants AMX's tile state only to a process that asks (ARCH_REQ_XCOMP_PERM for XTILEDATA).
static bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

constexpr int64_t kAmxRows = 16, kAmxKeys = 32;  // query rows per tile, keys per block

// 2**x for the AMX tile's probabilities: a cubic, within 7.8e-5 relative (P is rounded to bfloat16 right
// after, up to 2**-8 = 3.9e-3; Taylor's cubic would be off by 8e-4).
constexpr float kExp2Cubic[] = {0.99992895126f, 0.69327622652f, 0.24260404706f, 0.05508868396f};

// Every tile 16 rows x 64 bytes. Prefill: 0-3 O (head_dim 64; 0 a P V scratch for 128), 4-5 S, 6 Q or P, 7 K
// or V; decode: 0 S, 1 K, 2 Q. A constant in memory: GCC may drop the stores of a local configuration, since it
// does not see ldtilecfg read them.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};
static void configure_tiles() {
  static const TileConfig cfg = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
  _tile_loadconfig(&cfg);
}

// 32 bfloat16 values (two to a 32-bit word) as 16 float32 lanes whose sum is theirs: a word's high half is
// already a float32's bits, its low half becomes one shifted up.
static inline VecF pair_sums(__m512i pr) {
  return (VecF)_mm512_slli_epi32(pr, 16) + (VecF)_mm512_and_si512(pr, _mm512_set1_epi32(int32_t(0xFFFF0000u)));
}

// exp2_poly_where: exp2_poly in the lanes of `keep`, 0 in the others (the scaling masked: no extra instruction),
// for the AMX tile's probabilities, in one instruction fewer: f = x - n from AVX-512DQ's vreduceps, then n = x - f,
// where exp2_poly clamps, rounds and subtracts; vreduceps gives f = 0 at x = -inf, so 2**n is 0 there with no clamp
// at -127. Below -127 the two differ only in subnormals, which P's rounding to bfloat16 flushes to 0: the same P.
template <size_t N>
static inline VecF exp2_poly_where(VecF x, __mmask16 keep, const float (&c)[N]) {
  const VecF f = (VecF)_mm512_reduce_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // NaN stays NaN
  return (VecF)_mm512_maskz_scalef_ps(keep, (__m512)horner(f, c), (__m512)(x - f));
}

// How far (in base 2) a block's score may rise above a row's reference max before the reference moves: the
// probabilities stay at most 2**8, and most blocks rescale nothing (FlashAttention-4's conditional rescaling).
constexpr float kRescaleHeadroom = 8.0f;

// One tile: rows r < n of q [16, D] (bfloat16, unscaled, rows >= n zero), row r seeing keys 0..last[r];
// kb: this K/V head's K tiles, [key blocks of 16][D / 32][16 pairs of dimensions][16 keys][2]; vb: its
// V tiles, [key blocks of 32][D / 16][16 pairs of keys][16 dimensions][2]; row r's output (bfloat16)
// written to out[r]. A row's probabilities are 2**(x - m) for a reference m that moves only when a score
// rises more than kRescaleHeadroom above it (then to the row's max, and the row's sums are rescaled), so
// a block that raises no row's reference computes no horizontal max and rescales nothing. For head_dim
// 64 the output stays in tiles 0-3 across the blocks, P V added by tdpbf16ps itself; for 128 (eight tiles'
// worth) it is kept in memory and each block's P V added there.
template <int64_t D>
static void prefill_tile_amx(const uint16_t* q, const int64_t* last, int64_t n, const uint16_t* kb,
                             const uint16_t* vb, float scale, uint16_t* const* out) {
  constexpr int64_t C = D / 32, J = D / 16, T = 16 * 32;  // T: bfloat16 values per tile
  constexpr bool kOutputInTiles = D == 64;
  alignas(64) float o[kAmxRows][D];  // head_dim 128: the output; 64: where its tiles are rescaled and read out
  if constexpr (!kOutputInTiles) std::memset(o, 0, sizeof(o));
  alignas(64) float s_buf[2][kAmxRows][kAmxKeys];  // block b's scores in s_buf[b % 2]
  alignas(64) uint16_t p[kAmxRows][kAmxKeys] = {};  // its probabilities (rows >= n stay zero)
  alignas(64) float pv[kAmxRows][16];
  alignas(64) VecF l[kAmxRows], lsum[kAmxRows] = {};  // a block's and the running sums, lane by lane
  alignas(64) float m[kAmxRows], m_new[kAmxRows], alpha[kAmxRows];
  int64_t num_keys = 0, min_last = INT64_MAX;
  for (int64_t r = 0; r < kAmxRows; ++r) m[r] = -INFINITY;
  for (int64_t r = 0; r < n; ++r)
    num_keys = std::max(num_keys, last[r] + 1), min_last = std::min(min_last, last[r]);
  VecI lane;
  for (int64_t i = 0; i < kLanes; ++i) lane[i] = int32_t(i);
  const VecF minus_inf = VecF{} - INFINITY, ones = VecF{} + 1.0f;
  const float scale2 = scale * 1.4426950408889634f;  // scores in base 2: scale * log2(e)
  const __m512 scale2_v = _mm512_set1_ps(scale2), headroom = _mm512_set1_ps(kRescaleHeadroom);
  const uint32_t all_rows = (1u << n) - 1;
  if constexpr (kOutputInTiles) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const auto block_scores = [&](int64_t b) {  // 1. S = Q K^T for block b's 32 keys, two 16 x 16 tiles
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t c = 0; c < C; ++c) {
      _tile_loadd(6, q + c * 32, D * 2);
      _tile_loadd(7, kb + ((2 * b) * C + c) * T, 64);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(7, kb + ((2 * b + 1) * C + c) * T, 64);
      _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(4, &s_buf[b % 2][0][0], kAmxKeys * 4);
    _tile_stored(5, &s_buf[b % 2][0][16], kAmxKeys * 4);
  };
  if (num_keys > 0) block_scores(0);
  for (int64_t j0 = 0, b = 0; j0 < num_keys; j0 += kAmxKeys, ++b) {
    // the next block's scores are asked for first, into the other buffer: they are stored well before the
    // softmax reads them back (a load right after a tile store waits for it)
    if (j0 + kAmxKeys < num_keys) block_scores(b + 1);
    const float(*s)[kAmxKeys] = s_buf[b % 2];
    const bool all_seen = j0 + kAmxKeys <= min_last + 1;  // no row's causal limit inside the block
    // P rounded to bfloat16 into p[r], and this block's part of the row's sum (the running sum's rescale
    // follows), of P as rounded: the divisor then holds the same rounding as the weighted sum, which cancels
    // where one key carries most of the weight (a row's largest probability need not be 1 here)
    const auto emit = [&](int64_t r, const VecF (&e)[2]) {
      const __m512i pr = (__m512i)_mm512_cvtne2ps_pbh((__m512)e[1], (__m512)e[0]);  // e[0] first
      _mm512_store_si512(p[r], pr);
      l[r] = pair_sums(pr);
    };
    const auto seen = [&](int64_t r, int64_t h) -> __mmask16 {  // the keys of half h that row r sees
      return all_seen ? 0xFFFF
                      : _mm512_cmp_epi32_mask((__m512i)(lane + int32_t(j0 + h * kLanes)),
                                              _mm512_set1_epi32(int32_t(last[r])), _MM_CMPINT_LE);
    };
    // 2. the online softmax in float32, in two passes. The first, every row: 2**(x - m) against the row's
    // reference m as it stands (a multiply-add a register: no max across lanes, no branch), marking the row
    // where a score it sees lies more than kRescaleHeadroom above m, or where m is -inf (nothing finite
    // seen yet; every row in the first block, which this pass then skips). The second redoes the marked rows
    // with m moved to the row's max.
    uint32_t redo = _mm512_cmp_ps_mask(_mm512_load_ps(m), (__m512)minus_inf, _CMP_EQ_OQ) & all_rows;
    for (int64_t r = 0; r < n && redo != all_rows; ++r) {
      const __m512 minus_m = _mm512_set1_ps(-m[r]);
      VecF e[2];
      __mmask16 over = 0;
      for (int64_t h = 0; h < 2; ++h) {
        const __mmask16 k = seen(r, h);
        const VecF x = (VecF)_mm512_fmadd_ps(_mm512_load_ps(s[r] + h * kLanes), scale2_v, minus_m);
        over |= _mm512_mask_cmp_ps_mask(k, (__m512)x, headroom, _CMP_GT_OQ);
        e[h] = exp2_poly_where(x, k, kExp2Cubic);
      }
      redo |= uint32_t(over != 0) << r;
      emit(r, e);
    }
    std::memcpy(m_new, m, sizeof(m));
    for (uint32_t rows = redo; rows != 0; rows &= rows - 1) {
      const int64_t r = __builtin_ctz(rows);
      VecF x[2], e[2];
      __mmask16 k[2];
      for (int64_t h = 0; h < 2; ++h) {
        k[h] = seen(r, h);
        x[h] = (VecF)_mm512_mask_blend_ps(k[h], (__m512)minus_inf, (__m512)(load_vecf(s[r] + h * kLanes) * scale2));
      }
      m_new[r] = std::max(m[r], max_lanes(x[0] > x[1] ? x[0] : x[1]));
      // -inf where every score seen so far is -inf (a float32 product that overflowed, finite inputs): 2**x
      // from 0 then (2**-inf = 0), not 2**(-inf + inf) = NaN; the next block's alpha is 0
      const float m_ref = m_new[r] == -INFINITY ? 0.0f : m_new[r];
      for (int64_t h = 0; h < 2; ++h) e[h] = exp2_poly_where(x[h] - m_ref, k[h], kExp2Cubic);
      emit(r, e);
    }
    const bool rescale = redo != 0;
    if (rescale) {  // all 16 rows' rescale factors in one register (rescale_factors, base 2; 1 where m stayed)
      const VecF mo = load_vecf(m), mn = load_vecf(m_new);
      store_vecf(alpha, mo == mn ? ones : rescale_factors(mo, mn, kExp2Cubic));
      store_vecf(m, mn);
      for (int64_t r = 0; r < n; ++r) lsum[r] = lsum[r] * alpha[r] + l[r];
    } else {
      store_vecf(alpha, ones);
      for (int64_t r = 0; r < n; ++r) lsum[r] += l[r];
    }
    _tile_loadd(6, &p[0][0], kAmxKeys * 2);
    if constexpr (kOutputInTiles) {  // 3. O += P V in the tiles, after O's rows are rescaled where a reference moved
      if (rescale && b > 0) {  // (in the first block O is still 0)
        _tile_stored(0, &o[0][0], D * 4);
        _tile_stored(1, &o[0][16], D * 4);
        _tile_stored(2, &o[0][32], D * 4);
        _tile_stored(3, &o[0][48], D * 4);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t d = 0; d < D; d += kLanes) store_vecf(o[r] + d, alpha[r] * load_vecf(o[r] + d));
        _tile_loadd(0, &o[0][0], D * 4);
        _tile_loadd(1, &o[0][16], D * 4);
        _tile_loadd(2, &o[0][32], D * 4);
        _tile_loadd(3, &o[0][48], D * 4);
      }
      _tile_loadd(7, vb + (b * J + 0) * T, 64);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(7, vb + (b * J + 1) * T, 64);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(7, vb + (b * J + 2) * T, 64);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(7, vb + (b * J + 3) * T, 64);
      _tile_dpbf16ps(3, 6, 7);
    } else {
      for (int64_t j = 0; j < J; ++j) {  // 3. o = alpha o + P V, 16 head dimensions at a time (tile 0 a scratch)
        _tile_zero(0);
        _tile_loadd(7, vb + (b * J + j) * T, 64);
        _tile_dpbf16ps(0, 6, 7);
        _tile_stored(0, &pv[0][0], 64);
        for (int64_t r = 0; r < n; ++r)
          store_vecf(o[r] + j * 16, alpha[r] * load_vecf(o[r] + j * 16) + load_vecf(pv[r]));
      }
    }
  }
  if constexpr (kOutputInTiles) {
    _tile_stored(0, &o[0][0], D * 4);
    _tile_stored(1, &o[0][16], D * 4);
    _tile_stored(2, &o[0][32], D * 4);
    _tile_stored(3, &o[0][48], D * 4);
  }
  float inv[kAmxRows];  // 1 / the row's sum: one division a row, not one a value (vdivps is slow)
  // a sum of 0: every score the row saw was -inf (or a subnormal flushed to 0), its P all 0 and o 0: output 0, as
  // torch's fused path, whichever rows share the tile (a block hidden from this row sets alpha 0 and the sum 0)
  for (int64_t r = 0; r < n; ++r) inv[r] = add_lanes(lsum[r]), inv[r] = inv[r] == 0.0f ? 1.0f : 1.0f / inv[r];
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; d += kLanes)
      _mm256_storeu_si256((__m256i*)(out[r] + d), (__m256i)_mm512_cvtneps_pbh((__m512)(load_vecf(o[r] + d) * inv[r])));
}

template <int64_t D>
static void prefill_heads_amx(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              torch::Tensor& out, const VarlenBatch& batch, double scale) {
  const int64_t num_heads = q.size(1), num_kv_heads = k.size(1), group = num_heads / num_kv_heads;
  // the tiles' order, once per call, for each sequence and K/V head h (keys padded to a multiple of 32):
  // kb[h][n][c][p][col] = the 32-bit word (two bfloat16) 16c + p of key 16n + col's row in head h (16 keys'
  // rows of 16 words transposed), vb[h][b][j][p][col][e] = V[32b + 2p + e][h][16j + col] (two keys' rows interleaved);
  // zeros past the last key. Sequence s's start in both: pack_start[s].
  const BatchLayout layout(batch, num_kv_heads, group, D, kAmxKeys, kAmxRows);
  const WorkPlan plan(batch, layout, num_kv_heads, group, kAmxKeys, kAmxRows);
  const auto& blocks = layout.blocks;
  const auto& tiles = layout.tiles;
  const auto& pack_start = layout.start;
  auto packed = torch::empty({2, pack_start.back()}, k.options());
  auto* kb_w = reinterpret_cast<int32_t*>(packed[0].data_ptr());
  auto* vb = reinterpret_cast<uint16_t*>(packed[1].data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  __m512i interleave;  // element 2i from the first row, 2i + 1 from the second
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) idx[2 * i] = int16_t(i), idx[2 * i + 1] = int16_t(32 + i);
  interleave = _mm512_load_si512(idx);
  // an item: a sequence's K/V head's block of 32 keys (two K tiles of 16 keys, one V tile of 32)
  const auto pack_item = [&](int64_t s, int64_t item) {
    const int64_t h = item / blocks[s], b = item % blocks[s], tk = batch.tk(s), n16 = 2 * blocks[s];
    int32_t* kb_s = kb_w + pack_start[s] / 2;
    uint16_t* vb_s = vb + pack_start[s];
    for (int64_t n = 2 * b; n < 2 * b + 2; ++n) {
      // 16 keys from a multiple of 16 are 16 rows in a row, in a paged cache too (block_size a multiple of 16)
      const int64_t present = std::clamp<int64_t>(tk - 16 * n, 0, 16);
      const uint16_t* rows = present > 0 ? kp + batch.key_row(s, 16 * n) * k_stride + h * D : kp;
      for (int64_t c = 0; c < D / 32; ++c) {  // words 16c..16c + 15 of the 16 keys: tile (n, c), row p = word 16c + p
        __m512i r[16];
        load_rows16(r, rows + 32 * c, k_stride, present);
        transpose16x16(r);
        int32_t* tile = kb_s + ((h * n16 + n) * (D / 32) + c) * 256;
        for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * 16, r[p]);
      }
    }
    for (int64_t pr = 0; pr < 16; ++pr) {
      const int64_t t = 32 * b + 2 * pr;
      const uint16_t* v0 = t < tk ? vp + batch.key_row(s, t) * v_stride + h * D : nullptr;
      const uint16_t* v1 = t + 1 < tk ? vp + batch.key_row(s, t + 1) * v_stride + h * D : nullptr;
      for (int64_t j = 0; j < D / 16; ++j) {
        const __m256i a = v0 ? _mm256_loadu_si256((const __m256i*)(v0 + 16 * j)) : _mm256_setzero_si256();
        const __m256i c = v1 ? _mm256_loadu_si256((const __m256i*)(v1 + 16 * j)) : _mm256_setzero_si256();
        _mm512_storeu_si512(vb_s + ((h * blocks[s] + b) * (D / 16) + j) * 512 + pr * 32,
                            _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), interleave, _mm512_castsi256_si512(c)));
      }
    }
  };
  if (!plan.owned()) for_each_item(layout.items, 4, pack_item);  // a pass of its own, at least 4 blocks a thread
  const auto* kb = reinterpret_cast<const uint16_t*>(kb_w);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t q_stride = q.stride(0);
  at::parallel_for(0, plan.threads(), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) uint16_t qt[kAmxRows * D];
    // each thread its share of the work, as in prefill_heads
    for (int64_t th = begin; th < end; ++th) plan.for_thread(th, pack_item, [&](int64_t s, int64_t i) {
      const int64_t rows = batch.tq(s) * group, tiles_per_head = tiles[s] / num_kv_heads;
      const int64_t kv = i / tiles_per_head, r0 = i % tiles_per_head * kAmxRows, n = std::min(kAmxRows, rows - r0);
      const int64_t head_elems = blocks[s] * kAmxKeys * D;
      if (r0 + kAmxRows < rows) {  // the next tile's q rows, as prefill_heads asks for them (a fresh projection's
        // q is several MiB: without this, copying a tile's rows in waited on memory for a tenth of the kernel's time)
        const int64_t t_first = (r0 + kAmxRows) / group, t_end = (std::min(rows, r0 + 2 * kAmxRows) - 1) / group;
        for (int64_t t = t_first; t <= t_end; ++t)
          prefetch(qp + (batch.cu_q[s] + t) * q_stride + kv * group * D, group * D);
      }
      int64_t last[kAmxRows];
      uint16_t* out_rows[kAmxRows];
      for (int64_t r = 0; r < kAmxRows; ++r) {
        if (r >= n) {
          std::memset(qt + r * D, 0, D * sizeof(uint16_t));
          continue;
        }
        const int64_t t = (r0 + r) / group, h = kv * group + (r0 + r) % group;
        last[r] = batch.tk(s) - batch.tq(s) + t;
        out_rows[r] = op + ((batch.cu_q[s] + t) * num_heads + h) * D;
        std::memcpy(qt + r * D, qp + (batch.cu_q[s] + t) * q_stride + h * D, D * sizeof(uint16_t));
      }
      prefill_tile_amx<D>(qt, last, n, kb + pack_start[s] + kv * head_elems, vb + pack_start[s] + kv * head_elems,
                          float(scale), out_rows);
    });
    _tile_release();
  });
}

// Decode attention in bfloat16 on AMX tiles (paged_decode_attention_amx). The scores of 16 cached tokens
// against every query head of up to 16 / group K/V heads (a pass) come from tile products, S^T = K Q^T: the A
// tiles are the cached K rows themselves, read in place (16 tokens of one K/V head, 32 head dimensions, a
// token stride apart); the B tiles hold the query heads in pairs of dimensions, packed once per pass (per
// sequence where one pass covers its heads), each K/V head's with zeros in the other heads' columns. Each K/V
// head's 16 x 16 product gives its group's columns of one row per token: row t, column c =
// K[t, kv0 + c / group] . q[h0 + c], kv0 and h0 the pass's first K/V and query head. No sums across a
// register's lanes (one per score on the AVX-512 path). The softmax then runs down the columns, one token's
// 16 scores a register (float32, 2**x by the float32 polynomial); the weighted sum of V is the AVX-512 path's
// (tile_weighted_sum, float32 probabilities).
template <int64_t D>
static void decode_one_sequence_amx(c10::BFloat16* __restrict out, const c10::BFloat16* __restrict q,
                                    const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                                    const int64_t* __restrict block_table, int64_t len, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t block_size, float scale, std::vector<float>& scores,
                                    std::vector<float>& acc, std::vector<uint32_t>& q_tiles) {
  constexpr int64_t C = D / 32;  // A and B tiles per K/V head: 32 head dimensions each
  const int64_t group = num_heads / num_kv_heads, per_pass = 16 / group;
  const int64_t token_stride = num_kv_heads * D, block_stride = block_size * token_stride;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  scores.resize(num_blocks * block_size * 16);
  acc.resize(16 * D);
  float* __restrict s = scores.data();  // s[t * 16 + c]: token t, column c
  const float scale2 = scale * 1.4426950408889634f;     // base 2: scale * log2(e)
  for (int64_t kv0 = 0; kv0 < num_kv_heads; kv0 += per_pass) {  // one pass where group * num_kv_heads <= 16
    const int64_t kvn = std::min(per_pass, num_kv_heads - kv0), cols = kvn * group, h0 = kv0 * group;
    // B tile (j, c): word [p][col] = q[h0 + col]'s dimensions 32c + 2p, 32c + 2p + 1 if col / group == j, else 0
    q_tiles.assign(kvn * C * 256, 0);
    for (int64_t col = 0; col < cols; ++col)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t pr = 0; pr < 16; ++pr)
          std::memcpy(&q_tiles[((col / group) * C + c) * 256 + pr * 16 + col], q + (h0 + col) * D + 32 * c + 2 * pr, 4);
    // 1. scores, 16 tokens at a time. All K/V heads of the pass add into tile 0 (the zeros in the other
    // heads' columns add nothing), unless `apart`: then each head's product is stored alone and only its
    // group's columns kept. That is the second try, where a NaN or inf came out: 0 * NaN is NaN, so a NaN
    // or inf in one head's K would reach the other heads' columns of the shared sum.
    alignas(64) float heads[16][16][16];  // apart: [K/V head of the pass][token][column]
    auto scores_of_blocks = [&](bool apart) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        const c10::BFloat16* k_block = k_cache + block_table[b] * block_stride + kv0 * D;
        const int64_t next = block_table[std::min(b + 1, num_blocks - 1)] * block_stride + kv0 * D;
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        // the next block's K rows into L1 and its V rows farther out for step 3, a share of the n rows after each
        // tile product: the k-th product (counted from 1) asks for rows n (k - 1) / products up to, not
        // including, n k / products. Asked for all at once before the products, they made the products wait
        // (presumably the burst fills the core's queue of misses, and the products queue behind it) rather
        // than run while the reads come in
        const int64_t products = (n + 15) / 16 * kvn * C;
        int64_t asked = 0, k = 0;
        for (int64_t i0 = 0; i0 < n; i0 += 16) {  // rows past n: within the block (block_size a multiple of 16)
          for (int64_t j = 0; j < kvn; ++j) {
            if (apart || j == 0) _tile_zero(0);
            for (int64_t c = 0; c < C; ++c) {
              _tile_loadd(1, k_block + i0 * token_stride + j * D + 32 * c, token_stride * 2);
              _tile_loadd(2, q_tiles.data() + (j * C + c) * 256, 64);
              _tile_dpbf16ps(0, 1, 2);
              for (const int64_t until = n * ++k / products; asked < until; ++asked) {
                prefetch(k_cache + next + asked * token_stride, kvn * D);
                prefetch<1>(v_cache + next + asked * token_stride, kvn * D);
              }
            }
            if (apart) _tile_stored(0, &heads[j][0][0], 64);
          }
          if (!apart) {
            _tile_stored(0, s + (t0 + i0) * 16, 64);
            continue;
          }
          for (int64_t r = 0; r < 16; ++r) {  // row r: each K/V head's own columns
            __m512 row = _mm512_setzero_ps();
            for (int64_t j = 0; j < kvn; ++j)
              row = _mm512_mask_loadu_ps(row, __mmask16(((1u << group) - 1) << (j * group)), heads[j][r]);
            _mm512_storeu_ps(s + (t0 + i0 + r) * 16, row);
          }
        }
      }
    };
    // 2. softmax down the columns: the max (and whether a score is NaN or infinite), then 2**(x - max) in
    // place and the sums (columns >= cols: 0s)
    VecF m, sum = {};
    auto max_of_scores = [&] {
      m = VecF{} - INFINITY;
      __mmask16 bad = 0;
      for (int64_t t = 0; t < len; ++t) {
        const VecF x = load_vecf(s + t * 16) * scale2;
        m = x > m ? x : m;
        bad |= _mm512_fpclass_ps_mask((__m512)x, 0x99);  // quiet or signalling NaN, +inf, -inf
      }
      return bad != 0;
    };
    scores_of_blocks(false);
    if (max_of_scores()) {
      scores_of_blocks(true);
      max_of_scores();
    }
    for (int64_t t = 0; t < len; ++t) {
      const VecF e = exp2_poly(load_vecf(s + t * 16) * scale2 - m, kExp2Float32);
      store_vecf(s + t * 16, e);
      sum += e;
    }
    // 3. a[col] = sum over t of p[t, col] * v[t, kv0 + col / group]
    float* __restrict a = acc.data();
    std::fill(a, a + cols * D, 0.0f);
    weighted_sum_of_blocks<D>(a, s, 1, 16, v_cache, block_table, len, block_size, num_kv_heads, kv0, kvn, group, D);
    for (int64_t col = 0; col < cols; ++col)
      for (int64_t d = 0; d < D; ++d) out[(h0 + col) * D + d] = c10::BFloat16(a[col * D + d] / sum[col]);
  }
}

static bool decode_batch_amx(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_tables, const int64_t* lens,
                             const std::vector<std::vector<int64_t>>& bins, double scale) {
  const int64_t num_heads = q.size(1), D = q.size(2), max_blocks = block_tables.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  // with fewer than 3 query heads per K/V head most of a tile's columns are zeros: in decode-step A/Bs
  // (10 layers' caches, 64 sequences) this decode took 0.875x the AVX-512 decode's speed at groups of 1 and
  // 0.98-1.02x at 2, against 1.10-1.16x at groups of 3 and 4 with head_dim 64 (1.01-1.03x with 128)
  const int64_t group = num_heads / num_kv_heads;
  if (q.scalar_type() != torch::kBFloat16 || (D != 64 && D != 128) || block_size % 16 != 0 || group < 3 ||
      group > 16 || !request_amx())
    return false;
  auto* o = out.data_ptr<c10::BFloat16>();
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const int64_t q_stride = q.stride(0);
  const auto* kc = k_cache.data_ptr<c10::BFloat16>();
  const auto* vc = v_cache.data_ptr<c10::BFloat16>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<float> scores, acc;  // this thread's scratch
    std::vector<uint32_t> q_tiles;
    for (int64_t b = begin; b < end; ++b)
      for (int64_t seq : bins[b]) {
        auto run = [&](auto head_dim) {
          constexpr int64_t kD = decltype(head_dim)::value;
          decode_one_sequence_amx<kD>(o + seq * num_heads * kD, qp + seq * q_stride, kc, vc,
                                      tables + seq * max_blocks, lens[seq], num_heads, num_kv_heads, block_size,
                                      float(scale), scores, acc, q_tiles);
        };
        if (D == 64) run(std::integral_constant<int64_t, 64>{});
        else run(std::integral_constant<int64_t, 128>{});
      }
    _tile_release();
  });
  return true;
}
#else
static bool decode_batch_amx(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                             const torch::Tensor&, const int64_t*, const std::vector<std::vector<int64_t>>&, double) {
  return false;
}
#endif

bool amx_available() {
#if defined(MINIVLLM_AMX)
  return request_amx();
#else
  return false;
#endif
}

// check_prefill_inputs for the float32 kernel or the AMX one, and whether the AMX one may run.
static void check_prefill_inputs(torch::Tensor& q, torch::Tensor& k, torch::Tensor& v, bool amx) {
  if (amx) check_prefill_inputs(q, k, v, "the AMX prefill kernel", torch::kBFloat16);
  else check_prefill_inputs(q, k, v, "the CPU prefill kernel", torch::kFloat);
  TORCH_CHECK(!amx || amx_available(), "the AMX prefill kernel needs a build for AMX and Linux's permission to use it");
}

// The output of a checked batch: the float32 tiles or the AMX ones, for head_dim 64 or 128.
static torch::Tensor run_prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const VarlenBatch& batch, double scale, bool amx) {
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  if (!amx) {
    if (q.size(2) == 64) prefill_heads<64>(q, k, v, out, batch, scale);
    else prefill_heads<128>(q, k, v, out, batch, scale);
  }
#if defined(MINIVLLM_AMX)
  else if (q.size(2) == 64) prefill_heads_amx<64>(q, k, v, out, batch, scale);
  else prefill_heads_amx<128>(q, k, v, out, batch, scale);
#endif
  return out;
}

// The prefill entry points' common path: the inputs checked (and laid out) for the float32 kernel or the AMX
// one, the batch read from cu_seqlens_q and cu_seqlens_k (a batch of one where they are undefined), the
// kernel run. Returns [sum Tq, num_heads, D] in the inputs' dtype.
static torch::Tensor prefill_entry(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cu_seqlens_q,
                                   torch::Tensor cu_seqlens_k, double scale, bool amx) {
  check_prefill_inputs(q, k, v, amx);
  const int64_t one_q[] = {0, q.size(0)}, one_k[] = {0, k.size(0)};
  VarlenBatch batch{one_q, one_k, 1};
  if (cu_seqlens_q.defined()) batch = varlen_batch(q, k, cu_seqlens_q, cu_seqlens_k);
  else TORCH_CHECK_VALUE(k.size(0) >= q.size(0), "Tk must be at least Tq (the new tokens are the last keys)");
  return run_prefill(q, k, v, batch, scale, amx);
}

// One sequence's causal attention: q [Tq, num_heads, D] over k, v [Tk, num_kv_heads, D], Tk >= Tq, query
// i seeing keys 0..Tk - Tq + i; float32, D 64 or 128. Returns [Tq, num_heads, D].
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  return prefill_entry(q, k, v, {}, {}, scale, false);
}

// A batch of causal attentions in float32, the sequences laid end to end (VarlenBatch): q [sum Tq,
// num_heads, D] over k, v [sum Tk, num_kv_heads, D], cu_seqlens_q and cu_seqlens_k their int64 prefix
// sums; D 64 or 128. Returns [sum Tq, num_heads, D].
torch::Tensor prefill_attention_varlen(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cu_seqlens_q,
                                       torch::Tensor cu_seqlens_k, double scale) {
  return prefill_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, false);
}

// prefill_attention's and prefill_attention_varlen's contracts in bfloat16 (float32 scores, softmax and sums;
// P and the output rounded to bfloat16), on AMX tiles: for a build and a CPU where amx_available().
torch::Tensor prefill_attention_amx(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  return prefill_entry(q, k, v, {}, {}, scale, true);
}
torch::Tensor prefill_attention_amx_varlen(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                           torch::Tensor cu_seqlens_q, torch::Tensor cu_seqlens_k, double scale) {
  return prefill_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, true);
}

// The batch forms over a paged cache (VarlenBatch's block_tables): sequence s's new tokens are q's rows
// cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1, its keys (cached ones first, then the new ones, all stored by
// then) the first context_lens[s] slots of its blocks block_tables[s] in k_cache, v_cache [num_blocks,
// block_size, num_kv_heads, head_dim] (contiguous; block_size a multiple of 16). Nothing is gathered first.
static torch::Tensor prefill_entry_paged(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                         torch::Tensor cu_seqlens_q, torch::Tensor context_lens,
                                         torch::Tensor block_tables, double scale, bool amx) {
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                        v_cache.is_contiguous(),
                    "k_cache and v_cache must both be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  TORCH_CHECK_VALUE(block_size % 16 == 0, "the paged prefill takes a block_size that is a multiple of 16, got ",
                    block_size);
  torch::Tensor k = k_cache.view({num_blocks * block_size, k_cache.size(2), k_cache.size(3)});
  torch::Tensor v = v_cache.view({num_blocks * block_size, v_cache.size(2), v_cache.size(3)});
  check_prefill_inputs(q, k, v, amx);
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && block_tables.dim() == 2 && cu_seqlens_q.dim() == 1 &&
                        cu_seqlens_q.size(0) == context_lens.size(0) + 1 &&
                        block_tables.size(0) == context_lens.size(0),
                    "cu_seqlens_q must be [num_seqs + 1], context_lens [num_seqs], ",
                    "block_tables [num_seqs, max_blocks]");
  for (const torch::Tensor* t : {&cu_seqlens_q, &context_lens, &block_tables})
    TORCH_CHECK_VALUE(t->scalar_type() == torch::kLong && t->device().is_cpu(),
                      "cu_seqlens_q, context_lens and block_tables must be int64 CPU tensors");
  cu_seqlens_q = cu_seqlens_q.contiguous(), context_lens = context_lens.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t num_seqs = context_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  std::vector<int64_t> cu_k(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {  // every block a sequence reads: one of the cache's
    // compared, not rounded up: a length near 2**63 would wrap around in lens + block_size - 1
    TORCH_CHECK_VALUE(lens[s] >= 0 && lens[s] <= max_blocks * block_size, "context_lens[", s, "] = ", lens[s],
                      " does not fit its ", max_blocks, " blocks of ", block_size);
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK_VALUE(table[s * max_blocks + b] >= 0 && table[s * max_blocks + b] < num_blocks, "block_tables[", s,
                        "][", b, "] = ", table[s * max_blocks + b], " is not a block of the cache (", num_blocks, ")");
    cu_k[s + 1] = cu_k[s] + lens[s];
  }
  // cu_seqlens_q checked as varlen_batch checks it, against prefix sums of the lengths standing in for k's rows
  torch::Tensor cu_k_t = torch::from_blob(cu_k.data(), {num_seqs + 1}, torch::kLong);
  const torch::Tensor k_rows = torch::empty({cu_k.back(), 0}, q.options());
  VarlenBatch batch = varlen_batch(q, k_rows, cu_seqlens_q, cu_k_t);
  batch.block_tables = table, batch.max_blocks = max_blocks, batch.block_size = block_size;
  return run_prefill(q, k, v, batch, scale, amx);
}
torch::Tensor prefill_attention_paged(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor cu_seqlens_q, torch::Tensor context_lens,
                                      torch::Tensor block_tables, double scale) {
  return prefill_entry_paged(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, false);
}
torch::Tensor prefill_attention_amx_paged(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor cu_seqlens_q, torch::Tensor context_lens,
                                          torch::Tensor block_tables, double scale) {
  return prefill_entry_paged(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, true);
}

// The vector width this build's kernels are written for (what -march=native gave the compiler): "avx512"
// (16-lane registers in the float32 prefill), "avx2" (AVX2 with FMA: 8 lanes), or "" (neither: the generic
// vector code, which cpu_attn.py's cpu_prefill_kernel does not use). The same answer as chapter 02's GEMM
// library gives, asked of the build rather than of torch's dispatch level.
std::string kernel_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (q, k_cache, v_cache, block_tables, context_lens, scale)");
  m.def("paged_decode_attention_amx", &paged_decode_attention_amx,
        "paged_decode_attention; bfloat16 on AMX tiles where the build, the CPU and the shapes allow");
  m.def("reshape_and_cache", &reshape_and_cache,
        "this step's k, v into their cache slots (k, v, k_cache, v_cache, slot_mapping, stream=False); slot -1 is "
        "skipped; stream: streaming stores, for rows this step does not read again",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("stream") = false);
  m.def("prefill_attention", &prefill_attention, "one sequence's causal attention in float32 (q, k, v, scale)");
  m.def("prefill_attention_varlen", &prefill_attention_varlen,
        "a batch of causal attentions in float32, laid end to end (q, k, v, cu_seqlens_q, cu_seqlens_k, scale)");
  m.def("prefill_attention_amx", &prefill_attention_amx,
        "one sequence's causal attention in bfloat16 on AMX tiles (q, k, v, scale)");
  m.def("prefill_attention_amx_varlen", &prefill_attention_amx_varlen,
        "a batch of causal attentions in bfloat16 on AMX tiles (q, k, v, cu_seqlens_q, cu_seqlens_k, scale)");
  m.def("prefill_attention_paged", &prefill_attention_paged,
        "the float32 batch form, keys read through block tables "
        "(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)");
  m.def("prefill_attention_amx_paged", &prefill_attention_amx_paged,
        "the bfloat16 AMX batch form, keys read through block tables "
        "(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)");
  m.def("amx_available", &amx_available, "whether this build and CPU run the AMX kernels");
  m.def("kernel_isa", &kernel_isa, "the vector width this build is written for: 'avx512', 'avx2' or '' (neither)");
}
