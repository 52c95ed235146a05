#include "kernels/cross_entropy.h"

#include <cmath>
#include <limits>

namespace mt::cpu {

namespace {

void check_args(const Tensor& logits, const Tensor& labels, const Tensor& lse, int32_t ignore_index) {
  MT_CHECK(logits.ndim() == 2) << "cross-entropy logits should be [N,V], got " << logits.str();
  int64_t n = logits.dim(0), v = logits.dim(1);
  check_tensor(logits, "logits", DType::f32, {n, v});
  check_tensor(labels, "labels", DType::i32, {n});
  check_tensor(lse, "lse", DType::f32, {n});
  const int32_t* y = labels.i32();
  for (int64_t i = 0; i < n; ++i)
    MT_CHECK(y[i] == ignore_index || (y[i] >= 0 && y[i] < v))
        << "label " << y[i] << " at row " << i << " is neither in [0, " << v << ") nor the ignore index "
        << ignore_index;
}

}  // namespace

CrossEntropySum cross_entropy_forward(const Tensor& logits, const Tensor& labels, int32_t ignore_index,
                                      const Tensor& lse, float scale, const Tensor& dlogits) {
  check_args(logits, labels, lse, ignore_index);
  int64_t n = logits.dim(0), v = logits.dim(1);
  const float* x = logits.f32();
  const int32_t* y = labels.i32();
  float* l = lse.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * v;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < v; ++j) m = row[j] > m ? row[j] : m;
    float s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(row[j] - m);
    l[i] = m + std::log(s);
  }
  // Summed in row order, not by an OpenMP reduction whose combining order varies:
  // a resumed run must report bit-identical losses.
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (y[i] == ignore_index) continue;
    sum += static_cast<double>(l[i]) - x[i * v + y[i]];
    ++count;
  }
  if (dlogits.data != nullptr) cpu::cross_entropy_backward(logits, labels, lse, ignore_index, scale, dlogits);
  return {sum, count};
}

void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, int32_t ignore_index,
                            float scale, const Tensor& dlogits) {
  check_args(logits, labels, lse, ignore_index);
  int64_t n = logits.dim(0), v = logits.dim(1);
  check_tensor(dlogits, "dlogits", DType::f32, {n, v});
  const float* x = logits.f32();
  const int32_t* y = labels.i32();
  const float* l = lse.f32();
  float* dx = dlogits.f32();  // may alias x: each element is read before it is written
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    if (y[i] == ignore_index) {
      for (int64_t j = 0; j < v; ++j) dx[i * v + j] = 0.0f;
      continue;
    }
    for (int64_t j = 0; j < v; ++j) dx[i * v + j] = scale * std::exp(x[i * v + j] - l[i]);
    dx[i * v + y[i]] -= scale;
  }
}

}  // namespace mt::cpu
