// Shared helpers of the GPU op tests (tests/gpu/test_cuda_*.cpp, one file per op
// family group, all in the test_cuda_ops binary): device tensors filled from host values
// or poisoned, downloads, fresh random inputs, bf16 rounding, and a comparison that
// names the worst element and counts the unwritten (NaN) ones.
//
// The pattern of a test: draw inputs on the host, round those that the GPU reads as
// bf16 (so the CPU reference reads exactly the same numbers), run the CPU backend on
// them in f32, poison the GPU outputs, run the CUDA op, compare with a tolerance
// derived from the roundings the GPU adds.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mt::gpu_test {

// bf16 keeps 8 significant bits (7 stored): a rounding to nearest is off by at most half
// a unit in the last place, 2^-8 of the value at the bottom of a binade.
constexpr double kBf16Round = 1.0 / 256;
// The same for f32 (24 significant bits).
constexpr double kF32Round = 1.0 / 16777216;

// Whether a CUDA device can run our kernels; `why` says what is missing when not.
bool have_gpu(std::string* why);

#define MT_SKIP_WITHOUT_GPU()                                                               \
  do {                                                                                      \
    std::string mt_gpu_why_;                                                                \
    if (!::mt::gpu_test::have_gpu(&mt_gpu_why_)) GTEST_SKIP() << "no usable CUDA GPU: " << mt_gpu_why_; \
  } while (0)

// A GPU tensor owning its memory.
class DeviceTensor {
 public:
  DeviceTensor(DType dtype, Shape shape);
  ~DeviceTensor();
  DeviceTensor(DeviceTensor&& o) noexcept;
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  // Every byte 0xff: NaN as f32 and as bf16, -1 as i32, so an element the kernel
  // forgets to write fails any comparison.
  void poison();
  Tensor t;
};

// values converted to dtype (f32, bf16 rounded to nearest even, or i32) on the GPU.
DeviceTensor upload(const std::vector<float>& values, DType dtype, Shape shape);
DeviceTensor upload(const std::vector<int32_t>& values, Shape shape);
DeviceTensor poisoned(DType dtype, Shape shape);
// A f32 or bf16 GPU tensor as floats; an i32 one as ints.
std::vector<float> download(const Tensor& t);
std::vector<int32_t> download_ints(const Tensor& t);

// A large GPU tensor of random values (uniform in [-1, 1], no zeros) for timing:
// 2^22 host values tiled over it, so filling gigabytes stays quick.
DeviceTensor random_device(DType dtype, Shape shape, uint64_t seed);
// Median milliseconds of `reps` runs of f on cuda::stream(), after two warm-up runs,
// timed with CUDA events.
double median_ms(int reps, const std::function<void()>& f);

// Uniform in [lo, hi] without zeros, from `seed`.
std::vector<float> random_floats(int64_t n, float lo, float hi, uint64_t seed);
std::vector<int32_t> random_ints(int64_t n, int32_t lo, int32_t hi, uint64_t seed);
// The values a bf16 tensor made from v holds, as floats.
std::vector<float> round_bf16(std::vector<float> v);
std::vector<float> abs_of(std::vector<float> v);
double max_abs(const std::vector<float>& v);

// A f32 host tensor over a vector (which must outlive it).
Tensor host(std::vector<float>& v, Shape s);
Tensor host(std::vector<int32_t>& v, Shape s);

// |got - want| <= rel * |want| + abs (+ abs_each[i] when given) for every element; a
// NaN never passes. On failure: the worst element, and how many are NaN.
struct Tol {
  Tol(double rel_ = 0, double abs_ = 0, std::vector<float> abs_each_ = {})
      : rel(rel_), abs(abs_), abs_each(std::move(abs_each_)) {}
  double rel, abs;
  std::vector<float> abs_each;
};
::testing::AssertionResult near(const std::string& what, const std::vector<float>& got,
                                const std::vector<float>& want, const Tol& tol);

}  // namespace mt::gpu_test
