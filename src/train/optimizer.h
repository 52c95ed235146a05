// AdamW over the model's parameter blocks, with its moments laid out like them.
#pragma once

#include <vector>

#include "core/arena.h"
#include "models/interface.h"
#include "train/config.h"

namespace mt {

class AdamW {
 public:
  explicit AdamW(std::vector<Param>& params);
  // One update of every block at 1-based `step` with learning rate `lr`; weight decay
  // applies to matrices, or to everything when optimizer.decay = "all".
  // grad_scale multiplies every gradient as it is read (the clipping factor).
  void step(const OptimizerConfig& cfg, double lr, int64_t step, float grad_scale = 1.0f);
  // The moments of `value`, a Param's tensor or a view into one (an HfTensor).
  Tensor exp_avg(const Tensor& value) const { return moment(value, m_); }
  Tensor exp_avg_sq(const Tensor& value) const { return moment(value, v_); }
  size_t bytes() const { return arena_.capacity(); }

 private:
  Tensor moment(const Tensor& value, const std::vector<Tensor>& which) const;
  std::vector<Param>& params_;
  Arena arena_;
  std::vector<Tensor> m_, v_;
};

}  // namespace mt
