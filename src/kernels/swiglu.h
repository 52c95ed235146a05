// Gated activations of the expert and dense MLPs, and sigmoid gates (Qwen3.5's attention
// output gate and its shared expert's gate).
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

// out = v * sigmoid(s), v and out f32 [N, C]: s [N, C] gates each element, or [N, 1]
// each row. The backward: dv = sigmoid(s) * dout (dv may be dout) and ds = dout * v *
// sigmoid(s) (1 - sigmoid(s)), summed over the row's columns in order for a row gate.
void sigmoid_gate_forward(const Tensor& v, const Tensor& s, const Tensor& out);
void sigmoid_gate_backward(const Tensor& v, const Tensor& s, const Tensor& dout, const Tensor& dv, const Tensor& ds);

}  // namespace mt::cpu

namespace mt::cuda {

// gu, h, dh, dgu f32 or bf16, computed in f32 with the CPU's formulas; dgu may be gu.
void swiglu_forward(const Tensor& gu, const Tensor& h);
void swiglu_backward(const Tensor& gu, const Tensor& dh, const Tensor& dgu);
void clamped_swiglu_forward(const Tensor& gu, float limit, float alpha, const Tensor& h);
void clamped_swiglu_backward(const Tensor& gu, float limit, float alpha, const Tensor& dh, const Tensor& dgu);
// Any of them f32 or bf16; a row gate's sum over a warp's lanes (in another order than
// the CPU's).
void sigmoid_gate_forward(const Tensor& v, const Tensor& s, const Tensor& out);
void sigmoid_gate_backward(const Tensor& v, const Tensor& s, const Tensor& dout, const Tensor& dv, const Tensor& ds);

}  // namespace mt::cuda

namespace mt {

inline void swiglu_forward(const Tensor& gu, const Tensor& h) {
  return MT_BACKEND(h.device == Device::cuda, swiglu_forward(gu, h));
}

inline void swiglu_backward(const Tensor& gu, const Tensor& dh, const Tensor& dgu) {
  return MT_BACKEND(dgu.device == Device::cuda, swiglu_backward(gu, dh, dgu));
}

inline void clamped_swiglu_forward(const Tensor& gu, float limit, float alpha, const Tensor& h) {
  return MT_BACKEND(h.device == Device::cuda, clamped_swiglu_forward(gu, limit, alpha, h));
}

inline void clamped_swiglu_backward(const Tensor& gu, float limit, float alpha, const Tensor& dh, const Tensor& dgu) {
  return MT_BACKEND(dgu.device == Device::cuda, clamped_swiglu_backward(gu, limit, alpha, dh, dgu));
}

inline void sigmoid_gate_forward(const Tensor& v, const Tensor& s, const Tensor& out) {
  return MT_BACKEND(out.device == Device::cuda, sigmoid_gate_forward(v, s, out));
}

inline void sigmoid_gate_backward(const Tensor& v, const Tensor& s, const Tensor& dout, const Tensor& dv,
                                  const Tensor& ds) {
  return MT_BACKEND(dv.device == Device::cuda, sigmoid_gate_backward(v, s, dout, dv, ds));
}

}  // namespace mt
