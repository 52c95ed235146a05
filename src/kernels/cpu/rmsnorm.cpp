#include "kernels/rmsnorm.h"

#include <cmath>
#include <vector>

#include "kernels/rope.h"

namespace mt::cpu {

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd, float wo) {
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
    for (int64_t j = 0; j < d; ++j) yp[i * d + j] = xi[j] * r * (wp[j] + wo);
  }
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw, const Tensor& residual, float wo) {
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
    if (residual.data != nullptr) check_tensor(residual, "rmsnorm residual", DType::f32, {n, d});
    float* out = dx.f32();
    const float* res = residual.data != nullptr ? residual.f32() : nullptr;
    // With xhat = x * r: dx = r * (w*dy - xhat * mean(w*dy * xhat)).
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      float r = rp[i], dot = 0;
      for (int64_t j = 0; j < d; ++j) dot += (wp[j] + wo) * g[i * d + j] * xp[i * d + j] * r;
      dot /= static_cast<float>(d);
      for (int64_t j = 0; j < d; ++j) {
        float xhat = xp[i * d + j] * r;
        out[i * d + j] = r * ((wp[j] + wo) * g[i * d + j] - xhat * dot);
        if (res != nullptr) out[i * d + j] += res[i * d + j];
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

// The two ops in turn: on the CPU the normed heads cost no more in memory than in registers.
void rmsnorm_rope_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& cos, const Tensor& sin,
                          const Tensor& y, const Tensor& rstd, float wo) {
  MT_CHECK(x.ndim() == 4 && y.ndim() == 4) << "rmsnorm_rope x and y should be [B,T,H,Dh], got " << x.str() << " and "
                                           << y.str();
  MT_CHECK(x.data != y.data) << "rmsnorm_rope needs y apart from x (the backward reads x)";
  const int64_t rows = x.dim(0) * x.dim(1) * x.dim(2), d = x.dim(3);
  cpu::rmsnorm_forward(x.view({rows, d}), w, eps, y.view({rows, d}), rstd, wo);
  cpu::rope_forward(y, cos, sin, false, y);
}

void rmsnorm_rope_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& cos,
                           const Tensor& sin, const Tensor& dy, const Tensor& dx, const Tensor& dw, float wo) {
  MT_CHECK(x.ndim() == 4 && dy.ndim() == 4) << "rmsnorm_rope x and dy should be [B,T,H,Dh], got " << x.str()
                                            << " and " << dy.str();
  const int64_t rows = x.dim(0) * x.dim(1) * x.dim(2), d = x.dim(3);
  check_tensor(dy, "rmsnorm_rope dy", DType::f32, x.shape);
  std::vector<float> normed(static_cast<size_t>(rows * d));  // the gradient of the normed heads
  const Tensor dn(normed.data(), x.shape, DType::f32);
  cpu::rope_backward(dy, cos, sin, false, dn);
  cpu::rmsnorm_backward(x.view({rows, d}), w, rstd, dn.view({rows, d}), dx.data ? dx.view({rows, d}) : Tensor(), dw,
                        Tensor(), wo);
}

}  // namespace mt::cpu
