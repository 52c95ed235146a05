#include "kernels/adamw.h"

#include <cmath>

#include "kernels/elementwise.h"
#include "kernels/fp8_quant.h"

namespace mt::cpu {

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWStep& s,
                uint64_t key) {
  int64_t n = param.numel();
  for (const Tensor* t : {&param, &grad})
    MT_CHECK(t->dtype == DType::f32 && t->numel() == n)
        << "adamw wants f32 param and grad of " << n << " elements (param " << param.str() << "), got " << t->str();
  for (const Tensor* t : {&m, &v})
    MT_CHECK((t->dtype == DType::f32 || t->dtype == DType::bf16) && t->dtype == m.dtype && t->numel() == n)
        << "adamw wants both moments f32 or both bf16, of " << n << " elements (param " << param.str() << "), got "
        << t->str();
  MT_CHECK(s.step >= 1) << "adamw step is 1-based, got " << s.step;
  float* p = param.f32();
  const float* g = grad.f32();
  // The same order of operations as torch.optim.AdamW (foreach=False), so a run can
  // be compared with transformers step for step.
  double t = static_cast<double>(s.step);
  float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(s.beta2, t)));
  float step_size = static_cast<float>(s.lr / (1.0 - std::pow(s.beta1, t)));
  float decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  float w1 = static_cast<float>(1.0 - s.beta1), b2 = static_cast<float>(s.beta2), w2 = static_cast<float>(1.0 - s.beta2);
  float eps = static_cast<float>(s.eps), scale = s.grad_scale;
  auto update = [&](int64_t i, float& mi, float& vi) {
    const float gi = g[i] * scale;
    p[i] *= decay;
    mi += w1 * (gi - mi);
    vi = vi * b2 + w2 * gi * gi;
    float denom = std::sqrt(vi) / bias2_sqrt + eps;
    p[i] -= step_size * mi / denom;
  };
  if (m.dtype != DType::bf16) {
    float* mp = m.f32();
    float* vp = v.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) update(i, mp[i], vp[i]);
    return;
  }
  // bf16 moments: updated in f32 (the step reads the unrounded values), stored rounded
  // stochastically, m with the noise's low 16 bits and v with the next 16.
  uint16_t* mp = static_cast<uint16_t*>(m.data);
  uint16_t* vp = static_cast<uint16_t*>(v.data);
  const uint64_t step = static_cast<uint64_t>(s.step);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float mi = f32_from_bf16(mp[i]), vi = f32_from_bf16(vp[i]);
    update(i, mi, vi);
    const uint64_t noise = adamw_noise(key + static_cast<uint64_t>(i), step);
    mp[i] = bf16_stochastic(f32_bits(mi), noise);
    vp[i] = bf16_stochastic(f32_bits(vi), noise >> 16);
  }
}

void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const AdamWStep& s) {
  AdamWStep block_step = s;
  for (const AdamWBlock& b : blocks) {
    block_step.weight_decay = b.decay ? s.weight_decay : 0.0;
    // Qualified: unqualified, lookup by argument type also finds the mt:: dispatcher.
    cpu::adamw_step(b.param, b.grad, b.m, b.v, block_step, b.key);
    if (b.compute.data != nullptr) cpu::cast(b.param, b.compute);
    if (b.fp8.q.data != nullptr) cpu::quantize_blocks(b.param, b.fp8.q, b.fp8.scale, b.fp8.pow2, b.fp8.qt, b.fp8.scale_t);
  }
}

}  // namespace mt::cpu
