#include "train/optimizer.h"

#include "core/check.h"
#include "kernels/adamw.h"
#include "kernels/elementwise.h"

namespace mt {

AdamW::AdamW(std::vector<Param>& params) : params_(params) {
  const Device device = params_.empty() ? Device::cpu : params_.front().value.device;
  Arena count = Arena::counting("optimizer", device);
  for (const Param& p : params_)
    for (int j = 0; j < 2; ++j) count.alloc(DType::f32, p.value.shape);
  arena_ = Arena("optimizer", device, count.peak());
  for (const Param& p : params_) {
    m_.push_back(arena_.alloc(DType::f32, p.value.shape));
    v_.push_back(arena_.alloc(DType::f32, p.value.shape));
    fill(m_.back(), 0.0f);
    fill(v_.back(), 0.0f);
  }
}

void AdamW::step(const OptimizerConfig& cfg, double lr, int64_t step, float grad_scale) {
  cpu::AdamWStep a;
  a.lr = lr;
  a.beta1 = cfg.beta1;
  a.beta2 = cfg.beta2;
  a.eps = cfg.eps;
  a.step = step;
  a.grad_scale = grad_scale;
  a.weight_decay = cfg.weight_decay;
  std::vector<AdamWBlock> blocks;
  for (size_t i = 0; i < params_.size(); ++i)
    blocks.push_back({params_[i].value, params_[i].grad, m_[i], v_[i], params_[i].matrix || cfg.decay == "all"});
  mt::adamw_step_multi(blocks, a);
}

Tensor AdamW::moment(const Tensor& value, const std::vector<Tensor>& which) const {
  const char* p = static_cast<const char*>(value.data);
  for (size_t i = 0; i < params_.size(); ++i) {
    const char* base = static_cast<const char*>(params_[i].value.data);
    if (p >= base && p + value.nbytes() <= base + params_[i].value.nbytes())
      return Tensor(static_cast<char*>(which[i].data) + (p - base), value.shape, value.dtype, value.device);
  }
  MT_FAIL() << "tensor " << value.str() << " is not part of any parameter block";
  return Tensor();
}

}  // namespace mt
