// RMSNorm over the last dimension, as Llama/Qwen/DeepSeek/GPT-OSS define it; and
// rmsnorm_rope, Qwen3's per-head q/k norm and the rotation after it (kernels/rope.h's
// halves) as one op, so that on the GPU the normed heads never make a trip to memory.
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// y = x * rstd * (w + w_offset) with rstd = 1 / sqrt(mean(x^2) + eps) per row; w_offset 1
// for zero-centred weights (Qwen3.5's, stored as w - 1: the offset is added in f32, as
// transformers adds it, so the stored weight and its gradient stay the checkpoint's).
// x f32 [N,D], w f32 [D], y f32 [N,D], rstd f32 [N] (kept for the backward).
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd,
                     float w_offset = 0.0f);

// dx (overwritten) and dw (accumulated); either may be empty to skip it. With a
// residual [N,D] (a decoder layer's gradient from the skip path), dx = the norm's input
// gradient, in dx's dtype, + residual: the add that would follow, in the same pass.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw, const Tensor& residual = Tensor(), float w_offset = 0.0f);

// y = rope(rmsnorm(x)) per head: x, y [B,T,H,Dh] (y may not be x), w [Dh], rstd
// [B*T*H], cos/sin [T, rotary_dim/2] as rope_forward takes them (pairs i, i + half).
void rmsnorm_rope_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& cos, const Tensor& sin,
                          const Tensor& y, const Tensor& rstd, float w_offset = 0.0f);
// dy is the gradient of the rotated y: dx (overwritten) and dw (accumulated).
void rmsnorm_rope_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& cos,
                           const Tensor& sin, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                           float w_offset = 0.0f);

}  // namespace mt::cpu

namespace mt::cuda {

// x, y, dy, dx, residual f32 or bf16 (residual as dx); w, rstd, dw f32 (statistics and
// weights stay f32). dw accumulates, summed in a fixed order (repeatable bit for bit).
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd,
                     float w_offset = 0.0f);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw, const Tensor& residual = Tensor(), float w_offset = 0.0f);
// One pass each way for bf16 heads whose whole width rotates (Dh a multiple of 16, at
// most 256): the forward reads x once and writes y; the backward reads x and dy once,
// writes dx and sums dw's partials as rmsnorm_backward does. The normed (forward) and
// unrotated (backward) heads are rounded to bf16 in registers, where the two separate
// ops would store them, so the result is theirs. Other shapes run the two ops.
void rmsnorm_rope_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& cos, const Tensor& sin,
                          const Tensor& y, const Tensor& rstd, float w_offset = 0.0f);
void rmsnorm_rope_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& cos,
                           const Tensor& sin, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                           float w_offset = 0.0f);

}  // namespace mt::cuda

namespace mt {

inline void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd,
                            float w_offset = 0.0f) {
  return MT_BACKEND(y.device == Device::cuda, rmsnorm_forward(x, w, eps, y, rstd, w_offset));
}

inline void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                             const Tensor& dw, const Tensor& residual = Tensor(), float w_offset = 0.0f) {
  return MT_BACKEND(dy.device == Device::cuda, rmsnorm_backward(x, w, rstd, dy, dx, dw, residual, w_offset));
}

inline void rmsnorm_rope_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& cos, const Tensor& sin,
                                 const Tensor& y, const Tensor& rstd, float w_offset = 0.0f) {
  return MT_BACKEND(y.device == Device::cuda, rmsnorm_rope_forward(x, w, eps, cos, sin, y, rstd, w_offset));
}

inline void rmsnorm_rope_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& cos,
                                  const Tensor& sin, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                                  float w_offset = 0.0f) {
  return MT_BACKEND(dy.device == Device::cuda, rmsnorm_rope_backward(x, w, rstd, cos, sin, dy, dx, dw, w_offset));
}

}  // namespace mt
