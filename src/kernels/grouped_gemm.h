// One matrix product per expert over contiguous row segments (tokens sorted by expert).
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// For each expert e, rows offsets[e]..offsets[e+1] of x:
//   y[seg] = x[seg] @ w[e]^T (+ bias[e])
// x f32 [N,K]; w f32 [E,O,K] (Hugging Face Linear layout, out x in); bias f32 [E,O] or
// empty; offsets i32 [E+1] non-decreasing within [0, N] (empty segments allowed); y [N,O].
// A dense Linear (with or without bias) is the one-expert case: w [1,O,K], offsets {0, N}.
// Rows outside the segments are not touched, so a window of experts [e0, e1) runs alone
// as w.rows(e0, e1) with offsets.rows(e0, e1 + 1) over the whole x and y (the weights
// tier's expert cache, models/expert_cache.h, runs a cached line of experts so).
void grouped_gemm(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y);

// B: dx[seg] = dy[seg] @ w[e]  (dx [N,K], overwritten).
void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx);

// W: dw[e] (+)= dy[seg]^T @ x[seg], dbias[e] (+)= column sums of dy[seg]. dbias may be
// empty. An expert with no rows gets zero (or keeps its value when accumulating).
void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                  const Tensor& dbias, bool accumulate);

}  // namespace mt::cpu

namespace mt::cuda {

// x, w, dy bf16; y and dx bf16 or f32; bias, dw and dbias f32; accumulation in f32. No
// host sync: offsets stay on the device and are trusted (the dispatch kernels make them;
// the CPU backend is where bad offsets are reported). Which products run on CUTLASS's
// Hopper grouped GEMM and which on our own kernel: kernels/cuda/grouped_gemm_sm90.cuh; a
// bias rides in CUTLASS's epilogue. dbias is summed in 128-row tiles, then tile by tile:
// repeatable bit for bit, but not the CPU's row-by-row order.
void grouped_gemm(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y);
void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx);
void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                  const Tensor& dbias, bool accumulate);

}  // namespace mt::cuda

namespace mt {

inline void grouped_gemm(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets,
                         const Tensor& y) {
  return MT_BACKEND(y.device == Device::cuda, grouped_gemm(x, w, bias, offsets, y));
}

inline void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx) {
  return MT_BACKEND(dx.device == Device::cuda, grouped_gemm_backward_input(dy, w, offsets, dx));
}

inline void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                         const Tensor& dbias, bool accumulate) {
  return MT_BACKEND(dw.device == Device::cuda, grouped_gemm_backward_weight(x, dy, offsets, dw, dbias, accumulate));
}

}  // namespace mt
