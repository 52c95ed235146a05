// AdamW with decoupled weight decay, step for step as torch.optim.AdamW computes it.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mt::cpu {

// Hyperparameters in double, as Python passes them to torch; the per-element work is fp32.
struct AdamWStep {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0;
  int64_t step = 1;  // 1-based, for the bias corrections
};

// On a flat f32 shard: p *= 1 - lr*wd; m, v updated; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
// param, grad, m, v all f32 with the same element count.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWStep& s);

}  // namespace mt::cpu
