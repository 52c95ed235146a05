// Gated activations of the expert and dense MLPs.
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// gu f32 [N, 2I] holds gate in columns [0,I) and up in [I,2I) (the fused gate_up
// projection); h f32 [N,I] = silu(gate) * up.
void swiglu_forward(const Tensor& gu, const Tensor& h);
void swiglu_backward(const Tensor& gu, const Tensor& dh, const Tensor& dgu);

// GPT-OSS: gate = gu[:, 0::2], up = gu[:, 1::2] (interleaved); gate clamped above at
// limit, up clamped to [-limit, limit]; h = (up + 1) * gate * sigmoid(alpha * gate).
// The clamps pass no gradient where they bind, as torch.clamp does.
void clamped_swiglu_forward(const Tensor& gu, float limit, float alpha, const Tensor& h);
void clamped_swiglu_backward(const Tensor& gu, float limit, float alpha, const Tensor& dh, const Tensor& dgu);

}  // namespace mt::cpu
