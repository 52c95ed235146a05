#include "kernels/rmsnorm.h"

#include <cmath>

namespace mt::cpu {

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd) {
  MT_CHECK(x.ndim() == 2) << "rmsnorm input should be [N,D], got " << x.str();
  int64_t n = x.dim(0), d = x.dim(1);
  check_tensor(x, "rmsnorm x", DType::f32, {n, d});
  check_tensor(w, "rmsnorm weight", DType::f32, {d});
  check_tensor(y, "rmsnorm y", DType::f32, {n, d});
  check_tensor(rstd, "rmsnorm rstd", DType::f32, {n});
  const float* xp = x.f32();
  const float* wp = w.f32();
  float* yp = y.f32();
  float* rp = rstd.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = xp + i * d;
    float ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += xi[j] * xi[j];
    float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    rp[i] = r;
    for (int64_t j = 0; j < d; ++j) yp[i * d + j] = xi[j] * r * wp[j];
  }
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw) {
  MT_CHECK(x.ndim() == 2) << "rmsnorm input should be [N,D], got " << x.str();
  int64_t n = x.dim(0), d = x.dim(1);
  check_tensor(w, "rmsnorm weight", DType::f32, {d});
  check_tensor(rstd, "rmsnorm rstd", DType::f32, {n});
  check_tensor(dy, "rmsnorm dy", DType::f32, {n, d});
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* rp = rstd.f32();
  const float* g = dy.f32();
  if (dx.data != nullptr) {
    check_tensor(dx, "rmsnorm dx", DType::f32, {n, d});
    float* out = dx.f32();
    // With xhat = x * r: dx = r * (w*dy - xhat * mean(w*dy * xhat)).
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      float r = rp[i], dot = 0;
      for (int64_t j = 0; j < d; ++j) dot += wp[j] * g[i * d + j] * xp[i * d + j] * r;
      dot /= static_cast<float>(d);
      for (int64_t j = 0; j < d; ++j) {
        float xhat = xp[i * d + j] * r;
        out[i * d + j] = r * (wp[j] * g[i * d + j] - xhat * dot);
      }
    }
  }
  if (dw.data != nullptr) {
    check_tensor(dw, "rmsnorm dw", DType::f32, {d});
    float* out = dw.f32();
    // Columns in parallel, rows in order: deterministic sums.
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < d; ++j) {
      float s = 0;
      for (int64_t i = 0; i < n; ++i) s += g[i * d + j] * xp[i * d + j] * rp[i];
      out[j] += s;
    }
  }
}

}  // namespace mt::cpu
