// AdamW with decoupled weight decay, step for step as torch.optim.AdamW computes it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mt {

// One parameter block of a multi-tensor step: f32 param, grad, m, v of one element
// count; decay says whether the step's weight decay applies to it (matrices) or not.
struct AdamWBlock {
  Tensor param, grad, m, v;
  bool decay = true;
  // Optional bf16 tensor of param's size: gets the updated param rounded to nearest
  // even, as cast() rounds, in the same pass (the GPU's compute copy, no second read).
  Tensor compute;
};

}  // namespace mt

namespace mt::cpu {

// Hyperparameters in double, as Python passes them to torch; the per-element work is fp32.
struct AdamWStep {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0;
  int64_t step = 1;  // 1-based, for the bias corrections
  // Multiplies each gradient as it is read: the clipping factor, applied here instead
  // of in a pass of its own over every gradient.
  float grad_scale = 1.0f;
};

// On a flat f32 shard: p *= 1 - lr*wd; m, v updated; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
// param, grad, m, v all f32 with the same element count.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWStep& s);

// adamw_step on every block, with s.weight_decay where the block's decay is set and 0
// elsewhere.
void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const AdamWStep& s);

}  // namespace mt::cpu

namespace mt::cuda {

// The same update on the GPU, bit for bit: the per-element arithmetic is the CPU's,
// in the same order, with no fused multiply-adds. adamw_step_multi updates a whole
// list in one launch (one per 128 blocks), each thread block on one chunk of a tensor.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const cpu::AdamWStep& s);
void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& s);

}  // namespace mt::cuda

// Dispatch on the parameters' device. AdamWStep lives in mt::cpu, so an unqualified
// call from namespace mt also finds the cpu:: function by argument-dependent lookup
// and is ambiguous: call these as mt::adamw_step / mt::adamw_step_multi.
namespace mt {

inline void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const cpu::AdamWStep& s) {
#ifdef MOETRAIN_WITH_CUDA
  if (param.device == Device::cuda) return cuda::adamw_step(param, grad, m, v, s);
#endif
  return cpu::adamw_step(param, grad, m, v, s);
}

// The device of the first block decides; all must share it.
inline void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& s) {
#ifdef MOETRAIN_WITH_CUDA
  if (!blocks.empty() && blocks.front().param.device == Device::cuda) return cuda::adamw_step_multi(blocks, s);
#endif
  return cpu::adamw_step_multi(blocks, s);
}

}  // namespace mt
