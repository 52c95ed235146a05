// The two small ops around the gated delta rule (kernels/gated_delta.h) in Qwen3.5's
// gated DeltaNet layer, as transformers computes them:
//
//   qkv = silu(causal depthwise conv1d(in_proj_qkv(x)))   (then split into q, k, v)
//   g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias),   beta = sigmoid(in_proj_b(x))
//
// The convolution mixes each channel with its own last K tokens only (K = 4 in Qwen3.5),
// so q, k and v see a little local context before the recurrence. g is the rule's
// log-decay, <= 0 by construction: A_log and dt_bias are per-head parameters that learn
// the decay's scale and offset.
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// transformers' causal_conv1d_fn with activation "silu" and no bias. x, y f32 [B,T,C]
// (channels last: the in_proj_qkv output [B*T, C] viewed per sequence), w f32 [C,K]
// (Hugging Face's conv1d.weight [C,1,K] without its middle dim):
//
//   pre[b,t,c] = sum_j w[c,j] x[b, t-(K-1)+j, c],   y = pre * sigmoid(pre),
//
// with x = 0 before each sequence's first token (torch pads K-1 zeros on the left and
// keeps the first T outputs). So a context-parallel rank's chunk would need the K-1 rows
// before it; this op knows only whole sequences.
void causal_conv1d_silu_forward(const Tensor& x, const Tensor& w, const Tensor& y);
// Recomputes pre from x (nothing stashed). dx [B,T,C] is overwritten (dx may be dy, not
// x); dw [C,K] is accumulated, summed over b then t in order for each channel (the same
// bits on every run and thread count).
void causal_conv1d_silu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                                 const Tensor& dw);

// a, b, g, beta f32 [N,H]; A_log, dt_bias f32 [H]:
//
//   g = -exp(A_log[h]) * softplus(a + dt_bias[h]),   beta = sigmoid(b),
//
// softplus as torch's default (beta 1, threshold 20): x above 20, else log1p(exp(x)).
void deltanet_gates_forward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                            const Tensor& g, const Tensor& beta);
// da, db [N,H] overwritten; dA_log, ddt_bias [H] accumulated, summed over n in order.
// softplus'(x) = sigmoid(x), and 1 above the threshold (as torch's backward).
void deltanet_gates_backward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                             const Tensor& dg, const Tensor& dbeta, const Tensor& da, const Tensor& db,
                             const Tensor& dA_log, const Tensor& ddt_bias);

}  // namespace mt::cpu

namespace mt::cuda {

// kernels/cuda/deltanet.cu: x, y, dy, dx, a, b, da, db f32 or bf16, the rest f32; the
// convolution's K <= 8, and its dx apart from dy (other threads read the dy rows dx
// would overwrite).
void causal_conv1d_silu_forward(const Tensor& x, const Tensor& w, const Tensor& y);
void causal_conv1d_silu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                                 const Tensor& dw);
void deltanet_gates_forward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                            const Tensor& g, const Tensor& beta);
void deltanet_gates_backward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                             const Tensor& dg, const Tensor& dbeta, const Tensor& da, const Tensor& db,
                             const Tensor& dA_log, const Tensor& ddt_bias);

}  // namespace mt::cuda

namespace mt {

inline void causal_conv1d_silu_forward(const Tensor& x, const Tensor& w, const Tensor& y) {
  return MT_BACKEND(y.device == Device::cuda, causal_conv1d_silu_forward(x, w, y));
}

inline void causal_conv1d_silu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                                        const Tensor& dw) {
  return MT_BACKEND(dx.device == Device::cuda, causal_conv1d_silu_backward(x, w, dy, dx, dw));
}

inline void deltanet_gates_forward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                                   const Tensor& g, const Tensor& beta) {
  return MT_BACKEND(g.device == Device::cuda, deltanet_gates_forward(a, b, A_log, dt_bias, g, beta));
}

inline void deltanet_gates_backward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                                    const Tensor& dg, const Tensor& dbeta, const Tensor& da, const Tensor& db,
                                    const Tensor& dA_log, const Tensor& ddt_bias) {
  return MT_BACKEND(da.device == Device::cuda,
                    deltanet_gates_backward(a, b, A_log, dt_bias, dg, dbeta, da, db, dA_log, ddt_bias));
}

}  // namespace mt
