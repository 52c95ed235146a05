// What the GPU micro-benchmarks (bench/*_bench.cpp) share: device tensors that own
// their memory, random fills, downloads and CUDA-event timing on the backend's stream.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "core/arena.h"
#include "core/dtype.h"
#include "kernels/cuda/runtime.h"

namespace mt::bench {

// A GPU tensor owning its memory.
struct Buffer {
  Buffer(DType dtype, Shape shape)
      : t(device_alloc(Device::cuda, static_cast<size_t>(shape.numel()) * dtype_size(dtype)), shape, dtype,
          Device::cuda) {}
  ~Buffer() { device_free(Device::cuda, t.data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Tensor t;
};

// Uniform in [lo, hi], never zero (zeros run faster than real data), f32 or bf16: up
// to 2^22 values drawn on the host and tiled over the tensor, so big fills stay quick.
inline void fill_random(const Tensor& t, float lo, float hi, uint64_t seed) {
  const int64_t n = t.numel(), tile = std::min<int64_t>(n, int64_t{1} << 22);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> f(static_cast<size_t>(tile));
  for (float& v : f)
    do v = d(g);
    while (v == 0.0f);
  std::vector<uint16_t> b;
  void* src = f.data();
  if (t.dtype == DType::bf16) {
    b.resize(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = bf16_from_f32(f[i]);
    src = b.data();
  }
  const Tensor flat = t.view({n});
  for (int64_t at = 0; at < n; at += tile) {
    const int64_t len = std::min(tile, n - at);
    cuda::copy(flat.rows(at, at + len), Tensor(src, {len}, t.dtype));
  }
}

// A f32 or bf16 GPU tensor as floats.
inline std::vector<float> download(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::f32) {
    cuda::copy(Tensor(out.data(), t.shape, DType::f32), t);
  } else {
    std::vector<uint16_t> b(out.size());
    cuda::copy(Tensor(b.data(), t.shape, DType::bf16), t);
    for (size_t i = 0; i < b.size(); ++i) out[i] = f32_from_bf16(b[i]);
  }
  return out;
}

// Median milliseconds of `reps` runs of f(i) (i counts runs, warm-ups included) after
// 3 warm-up runs, timed with CUDA events on the backend's stream.
inline double median_ms(int reps, const std::function<void(int)>& f) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  int run = 0;
  for (int i = 0; i < 3; ++i) f(run++);
  std::vector<float> ms(static_cast<size_t>(reps));
  for (float& t : ms) {
    CUDA_CHECK(cudaEventRecord(start, cuda::stream()));
    f(run++);
    CUDA_CHECK(cudaEventRecord(stop, cuda::stream()));
    CUDA_CHECK(cudaEventSynchronize(stop));
    CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace mt::bench
