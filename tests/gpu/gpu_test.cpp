#include "gpu/gpu_test.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <utility>

#include "core/arena.h"
#include "core/dtype.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/runtime.h"

namespace mt::gpu_test {

bool have_gpu(std::string* why) {
  static const cuda::DeviceInfo info = cuda::query_device();
  if (info.count > 0 && info.kernels_run) return true;
  *why = info.count == 0 ? "no device found" : "device 0 (" + info.name + ") did not run an sm_90a kernel";
  if (!info.error.empty()) *why += " (" + info.error + ")";
  return false;
}

DeviceTensor::DeviceTensor(DType dtype, Shape shape)
    : t(device_alloc(Device::cuda, static_cast<size_t>(shape.numel()) * dtype_size(dtype)), shape, dtype,
        Device::cuda) {}

DeviceTensor::~DeviceTensor() { device_free(Device::cuda, t.data); }

DeviceTensor::DeviceTensor(DeviceTensor&& o) noexcept : t(std::exchange(o.t, Tensor())) {}

void DeviceTensor::poison() {
  if (t.nbytes() > 0) CUDA_CHECK(cudaMemsetAsync(t.data, 0xff, t.nbytes(), cuda::stream()));
}

DeviceTensor upload(const std::vector<float>& values, DType dtype, Shape shape) {
  MT_CHECK(static_cast<int64_t>(values.size()) == shape.numel()) << values.size() << " values for " << shape.str();
  DeviceTensor d(dtype, shape);
  if (dtype == DType::bf16) {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = bf16_from_f32(values[i]);
    cuda::copy(d.t, Tensor(bits.data(), shape, DType::bf16));
  } else {
    MT_CHECK(dtype == DType::f32) << "upload of floats as " << dtype_name(dtype);
    cuda::copy(d.t, Tensor(const_cast<float*>(values.data()), shape, DType::f32));
  }
  return d;
}

DeviceTensor upload(const std::vector<int32_t>& values, Shape shape) {
  MT_CHECK(static_cast<int64_t>(values.size()) == shape.numel()) << values.size() << " values for " << shape.str();
  DeviceTensor d(DType::i32, shape);
  cuda::copy(d.t, Tensor(const_cast<int32_t*>(values.data()), shape, DType::i32));
  return d;
}

DeviceTensor poisoned(DType dtype, Shape shape) {
  DeviceTensor d(dtype, shape);
  d.poison();
  return d;
}

std::vector<float> download(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::bf16) {
    std::vector<uint16_t> bits(out.size());
    cuda::copy(Tensor(bits.data(), t.shape, DType::bf16), t);
    for (size_t i = 0; i < out.size(); ++i) out[i] = f32_from_bf16(bits[i]);
  } else {
    cuda::copy(Tensor(out.data(), t.shape, DType::f32), t);
  }
  return out;
}

std::vector<int32_t> download_ints(const Tensor& t) {
  std::vector<int32_t> out(static_cast<size_t>(t.numel()));
  cuda::copy(Tensor(out.data(), t.shape, DType::i32), t);
  return out;
}

DeviceTensor random_device(DType dtype, Shape shape, uint64_t seed) {
  DeviceTensor d(dtype, shape);
  const int64_t n = shape.numel(), tile = std::min<int64_t>(n, int64_t{1} << 22);
  if (n == 0) return d;
  DeviceTensor src = upload(random_floats(tile, -1, 1, seed), dtype, {tile});
  const Tensor flat = d.t.view({n});
  for (int64_t at = 0; at < n; at += tile) {
    const int64_t len = std::min(tile, n - at);
    cuda::copy(flat.rows(at, at + len), src.t.rows(0, len));
  }
  return d;
}

double median_ms(int reps, const std::function<void()>& f) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 2; ++i) f();
  std::vector<float> ms(static_cast<size_t>(reps));
  for (float& t : ms) {
    CUDA_CHECK(cudaEventRecord(start, cuda::stream()));
    f();
    CUDA_CHECK(cudaEventRecord(stop, cuda::stream()));
    CUDA_CHECK(cudaEventSynchronize(stop));
    CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::vector<float> random_floats(int64_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    do x = d(g);
    while (x == 0.0f);
  }
  return v;
}

std::vector<int32_t> random_ints(int64_t n, int32_t lo, int32_t hi, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& x : v) x = d(g);
  return v;
}

std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = f32_from_bf16(bf16_from_f32(x));
  return v;
}

std::vector<float> abs_of(std::vector<float> v) {
  for (float& x : v) x = std::fabs(x);
  return v;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

Tensor host(std::vector<float>& v, Shape s) {
  MT_CHECK(static_cast<int64_t>(v.size()) == s.numel()) << v.size() << " values for " << s.str();
  return Tensor(v.data(), s, DType::f32);
}

Tensor host(std::vector<int32_t>& v, Shape s) {
  MT_CHECK(static_cast<int64_t>(v.size()) == s.numel()) << v.size() << " values for " << s.str();
  return Tensor(v.data(), s, DType::i32);
}

::testing::AssertionResult near(const std::string& what, const std::vector<float>& got,
                                const std::vector<float>& want, const Tol& tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << want.size();
  size_t bad = 0, nans = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double allowed = tol.rel * std::fabs(want[i]) + tol.abs + (tol.abs_each.empty() ? 0.0 : tol.abs_each[i]);
    double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(got[i])) ++nans;
    if (!(err <= allowed)) {
      ++bad;
      double ratio = std::isnan(err) ? INFINITY : err / std::max(allowed, 1e-300);
      if (bad == 1 || ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  double allowed = tol.rel * std::fabs(want[worst]) + tol.abs + (tol.abs_each.empty() ? 0.0 : tol.abs_each[worst]);
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " elements out of tolerance ("
                                       << nans << " NaN, i.e. unwritten or poisoned); worst [" << worst
                                       << "] = " << got[worst] << ", expected " << want[worst] << " (allowed error "
                                       << allowed << ")";
}

}  // namespace mt::gpu_test
