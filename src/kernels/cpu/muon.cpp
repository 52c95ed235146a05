#include "kernels/muon.h"

#include <cmath>

#include "core/check.h"
#include "kernels/adamw.h"
#include "kernels/gemm.h"

namespace mt::cpu {

void muon_momentum(const Tensor& grad, const Tensor& m, const Tensor& out, const MuonMomentum& s, uint64_t key) {
  const int64_t n = grad.numel();
  for (const Tensor* t : {&grad, &out})
    MT_CHECK(t->dtype == DType::f32 && t->numel() == n)
        << "muon_momentum wants f32 gradient and output of " << n << " elements (gradient " << grad.str() << "), got "
        << t->str();
  MT_CHECK((m.dtype == DType::f32 || m.dtype == DType::bf16) && m.numel() == n)
      << "muon_momentum wants an f32 or bf16 momentum of " << n << " elements, got " << m.str();
  MT_CHECK(s.step >= 1) << "muon_momentum: step is 1-based, got " << s.step;
  const float* g = grad.f32();
  float* o = out.f32();
  const float mu = s.mu, scale = s.grad_scale;
  const bool nesterov = s.nesterov;
  auto update = [&](int64_t i, float& mi) {
    const float gs = g[i] * scale;
    const float next = mu * mi;
    mi = next + gs;
    const float u = mu * mi;
    o[i] = nesterov ? gs + u : mi;
  };
  if (m.dtype == DType::f32) {
    float* mp = m.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) update(i, mp[i]);
    return;
  }
  uint16_t* mp = static_cast<uint16_t*>(m.data);
  const uint64_t step = static_cast<uint64_t>(s.step);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float mi = f32_from_bf16(mp[i]);
    update(i, mi);
    mp[i] = bf16_stochastic(f32_bits(mi), adamw_noise(key + static_cast<uint64_t>(i), step));
  }
}

void newton_schulz(const std::vector<Tensor>& xs, int steps) {
  if (xs.empty()) return;
  MT_CHECK(steps >= 0) << "newton_schulz: steps must be >= 0, got " << steps;
  const Tensor& first = xs.front();
  MT_CHECK(first.ndim() == 2) << "newton_schulz wants 2-D matrices, got " << first.str();
  const int64_t r = first.dim(0), c = first.dim(1);
  for (const Tensor& x : xs)
    MT_CHECK(x.dtype == DType::f32 && x.ndim() == 2 && x.dim(0) == r && x.dim(1) == c)
        << "newton_schulz wants f32 matrices all of shape [" << r << ", " << c << "], got " << x.str();
  // The wide orientation: p rows <= q columns.
  const bool tall = r > c;
  const int64_t p = tall ? c : r, q = tall ? r : c;
  std::vector<float> X(static_cast<size_t>(p * q)), Y(X.size()), A(static_cast<size_t>(p * p)), B(A.size());
  for (const Tensor& x : xs) {
    const float* src = x.f32();
    double ss = 0;
    for (int64_t i = 0; i < r * c; ++i) ss += static_cast<double>(src[i]) * src[i];
    const float inv = 1.0f / (static_cast<float>(std::sqrt(ss)) + kMuonNormEps);
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j)
        X[static_cast<size_t>(tall ? j * q + i : i * q + j)] = src[i * c + j] * inv;
    for (int it = 0; it < steps; ++it) {
      sgemm(false, true, p, p, q, 1.0f, X.data(), q, X.data(), q, 0.0f, A.data(), p);  // A = X X^T
      B = A;
      sgemm(false, false, p, p, p, kNewtonSchulzC, A.data(), p, A.data(), p, kNewtonSchulzB, B.data(), p);
      Y = X;
      sgemm(false, false, p, q, p, 1.0f, B.data(), p, X.data(), q, kNewtonSchulzA, Y.data(), q);  // a X + B X
      X.swap(Y);
    }
    float* dst = x.f32();
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) dst[i * c + j] = X[static_cast<size_t>(tall ? j * q + i : i * q + j)];
  }
}

void muon_apply(const Tensor& param, const Tensor& o, float decay, float step) {
  const int64_t n = param.numel();
  MT_CHECK(param.dtype == DType::f32 && o.dtype == DType::f32 && o.numel() == n)
      << "muon_apply wants f32 parameter and update of one element count, got " << param.str() << " and " << o.str();
  float* p = param.f32();
  const float* u = o.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float kept = p[i] * decay;
    const float moved = step * u[i];
    p[i] = kept - moved;
  }
}

}  // namespace mt::cpu
