// scripts/overlap_probe.py's kernel: does this CPU overlap reading memory with arithmetic on registers?
// Each thread takes an equal share of a buffer's 4 KiB chunks, `reps` times over. For each chunk it reads
// the chunk's 64 cache lines into 8 independent sums (the memory part; skipped where `read` is false), then
// runs `work` rounds of 8 independent multiply-add chains that touch no memory (the arithmetic part). With
// `ahead` > 0 it also asks for the chunk `ahead` chunks further on, into the L2 cache, one line at a time
// spread evenly over the rounds (Bresenham's stepping, no division in the loop), as chapter 02's float32
// GEMM spreads its prefetches; the last `ahead` chunks of a thread's share ask for nothing (with the rounds
// timed alone over a small buffer swept again and again, that is `ahead` chunks per sweep: a few per cent
// fewer prefetches than over one long buffer). Plain vectors of the GCC/Clang extension: AVX-512 or AVX2,
// whichever -march=native gives.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

typedef float Vec __attribute__((vector_size(64)));
constexpr int64_t kChunk = 4096, kLines = kChunk / 64;

// (the sum of every float read and of the chains' final values, the number of lines prefetched): the sum is
// returned so that nothing is optimised away. Each chain starts at 1 + i / 1000 (i = 0..7, every lane) and
// steps x -> 0.999999 x + 1e-7 once per round, `work` rounds per chunk of the thread's share, `reps` times.
std::tuple<double, int64_t> stream(torch::Tensor buffer, int64_t work, int64_t ahead, int64_t reps,
                                   bool read) {
  TORCH_CHECK_VALUE(buffer.device().is_cpu() && buffer.scalar_type() == torch::kFloat && buffer.is_contiguous(),
                    "stream: a contiguous float32 CPU buffer");
  TORCH_CHECK_VALUE(buffer.numel() * 4 % kChunk == 0 && buffer.numel() > 0, "stream: a whole number of 4 KiB chunks");
  TORCH_CHECK_VALUE(work >= 0 && ahead >= 0 && reps >= 1, "stream: work and ahead >= 0, reps >= 1");
  const char* base = static_cast<const char*>(buffer.data_ptr());
  const int64_t chunks = buffer.numel() * 4 / kChunk, threads = at::get_num_threads();
  std::vector<double> part(threads, 0.0);
  std::vector<int64_t> asked(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = chunks * t / threads, last = chunks * (t + 1) / threads;
      Vec sum[8] = {}, chain[8];
      for (int i = 0; i < 8; ++i) chain[i] = Vec{} + (1.0f + 0.001f * i);
      const Vec m = Vec{} + 0.999999f, c = Vec{} + 1e-7f;  // x -> 0.999999 x + 1e-7 tends to 0.1: no subnormals
      int64_t lines = 0;  // prefetched by this thread
      for (int64_t r = 0; r < reps; ++r)
        for (int64_t ch = first; ch < last; ++ch) {
          const char* p = base + ch * kChunk;
          if (read)
            for (int64_t l = 0; l < kLines; l += 8)
              for (int j = 0; j < 8; ++j) {
                Vec v;
                std::memcpy(&v, p + 64 * (l + j), sizeof(v));
                sum[j] += v;
              }
          const char* next = p + ahead * kChunk;
          const bool ask = ahead > 0 && ch + ahead < last;
          int64_t sent = 0, due = 0;  // due: kLines added per round, `work` taken per line asked for
          for (int64_t w = 0; w < work; ++w) {
            for (int i = 0; i < 8; ++i) chain[i] = chain[i] * m + c;
            if (ask)
              for (due += kLines; due >= work; due -= work) __builtin_prefetch(next + 64 * sent++, 0, 2);
          }
          for (; ask && sent < kLines; ++sent) __builtin_prefetch(next + 64 * sent, 0, 2);  // work 0: all at once
          lines += sent;
        }
      Vec total = {};
      for (int i = 0; i < 8; ++i) total += sum[i] + chain[i];
      for (int i = 0; i < 16; ++i) part[t] += total[i];
      asked[t] = lines;
    }
  });
  double total = 0;
  int64_t lines = 0;
  for (int64_t t = 0; t < threads; ++t) total += part[t], lines += asked[t];
  return {total, lines};
}

// The probe of `python scripts/overlap_probe.py --tiles`: do AMX's tile products and AVX-512 arithmetic run side by
// side? Each thread repeats `groups` times: (if `tiles`) four tdpbf16ps, each adding a 16 x 32 bfloat16 tile of ones
// times a 32 x 16 one of 1/32 to its own float32 accumulator tile (1 more in each of its 16 x 16 sums), then `rounds`
// rounds of 12 independent 16-lane multiply-add chains, x -> 0.999999 x + 1e-7 from 1 + i / 1000 (i = 0..11). The two
// kinds of work share nothing, so a core that runs them side by side takes the longer of the two, one that takes them
// in turn their sum. Returns (each accumulator's sum over the threads: threads x 256 x groups where `tiles`, else 0,
// exact up to 2**24 groups, the most it takes; the sum of the chains' lanes over the threads). Built where the
// compiler and CPU have AMX (see tiles_available).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

bool tiles_available() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }  // Linux: ARCH_REQ_XCOMP_PERM

std::tuple<std::vector<double>, double> tiles_and_vectors(int64_t groups, bool tiles, int64_t rounds) {
  TORCH_CHECK_VALUE(groups >= 0 && groups <= (1 << 24) && rounds >= 0,
                    "tiles_and_vectors: groups in [0, 2**24] (float32 sums count exactly that far) and rounds >= 0");
  TORCH_CHECK(tiles_available(), "tiles_and_vectors: Linux does not grant this process AMX's tile state");
  const int64_t threads = at::get_num_threads();
  std::vector<double> tile_sum(threads * 4, 0.0), chain_sum(threads, 0.0);  // tile_sum[4 t + j]: accumulator j
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    static const TileConfig cfg = {1, 0, {}, {64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16}};
    alignas(64) uint16_t a[16 * 32], b[16 * 32];
    alignas(64) float c[16 * 16];
    std::fill(a, a + 16 * 32, uint16_t(0x3F80));  // bfloat16 1
    std::fill(b, b + 16 * 32, uint16_t(0x3D00));  // bfloat16 1/32: each product adds 32 / 32 = 1
    for (int64_t t = begin; t < end; ++t) {
      _tile_loadconfig(&cfg);
      _tile_loadd(4, a, 64);
      _tile_loadd(5, b, 64);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      __m512 chain[12];
      for (int i = 0; i < 12; ++i) chain[i] = _mm512_set1_ps(1.0f + 0.001f * i);
      const __m512 m = _mm512_set1_ps(0.999999f), k = _mm512_set1_ps(1e-7f);
      for (int64_t g = 0; g < groups; ++g) {
        if (tiles) {
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 5);
          _tile_dpbf16ps(2, 4, 5);
          _tile_dpbf16ps(3, 4, 5);
        }
        for (int64_t r = 0; r < rounds; ++r)
#pragma GCC unroll 12
          for (int i = 0; i < 12; ++i) chain[i] = _mm512_fmadd_ps(chain[i], m, k);
      }
      const auto add = [&](int j) { for (float x : c) tile_sum[4 * t + j] += x; };  // accumulator j, stored into c
      _tile_stored(0, c, 64);
      add(0);
      _tile_stored(1, c, 64);
      add(1);
      _tile_stored(2, c, 64);
      add(2);
      _tile_stored(3, c, 64);
      add(3);
      _tile_release();
      for (int i = 0; i < 12; ++i) chain_sum[t] += _mm512_reduce_add_ps(chain[i]);
    }
  });
  std::vector<double> tile_total(4, 0.0);
  double chain_total = 0;
  for (int64_t t = 0; t < threads; ++t) {
    for (int j = 0; j < 4; ++j) tile_total[j] += tile_sum[4 * t + j];
    chain_total += chain_sum[t];
  }
  return {tile_total, chain_total};
}
#else
bool tiles_available() { return false; }
std::tuple<std::vector<double>, double> tiles_and_vectors(int64_t, bool, int64_t) {
  TORCH_CHECK(false, "tiles_and_vectors: this build has no AMX (the compiler's -march=native on this CPU)");
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream", &stream,
        "read a buffer chunk by chunk (if `read`) with `work` rounds of register arithmetic per chunk");
  m.def("tiles_available", &tiles_available, "whether this build and CPU run tiles_and_vectors");
  m.def("tiles_and_vectors", &tiles_and_vectors,
        "`groups` times: four AMX tile products (if `tiles`), then `rounds` rounds of 12 AVX-512 multiply-add chains");
}
