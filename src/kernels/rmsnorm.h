// RMSNorm over the last dimension, as Llama/Qwen/DeepSeek/GPT-OSS define it.
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row.
// x f32 [N,D], w f32 [D], y f32 [N,D], rstd f32 [N] (kept for the backward).
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd);

// dx (overwritten) and dw (accumulated); either may be empty to skip it.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw);

}  // namespace mt::cpu

namespace mt::cuda {

// x, y, dy, dx f32 or bf16; w, rstd, dw f32 (statistics and weights stay f32). dw
// accumulates, summed in a fixed order (repeatable bit for bit).
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw);

}  // namespace mt::cuda

namespace mt {

inline void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd) {
#ifdef MOETRAIN_WITH_CUDA
  if (y.device == Device::cuda) return cuda::rmsnorm_forward(x, w, eps, y, rstd);
#endif
  return cpu::rmsnorm_forward(x, w, eps, y, rstd);
}

inline void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                             const Tensor& dw) {
#ifdef MOETRAIN_WITH_CUDA
  if (dy.device == Device::cuda) return cuda::rmsnorm_backward(x, w, rstd, dy, dx, dw);
#endif
  return cpu::rmsnorm_backward(x, w, rstd, dy, dx, dw);
}

}  // namespace mt
