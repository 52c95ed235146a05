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
