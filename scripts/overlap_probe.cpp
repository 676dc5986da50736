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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream", &stream,
        "read a buffer chunk by chunk (if `read`) with `work` rounds of register arithmetic per chunk");
}
