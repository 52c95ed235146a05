// One matrix product per expert over contiguous row segments (tokens sorted by expert).
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// For each expert e, rows offsets[e]..offsets[e+1] of x:
//   y[seg] = x[seg] @ w[e]^T (+ bias[e])
// x f32 [N,K]; w f32 [E,O,K] (Hugging Face Linear layout, out x in); bias f32 [E,O] or
// empty; offsets i32 [E+1] non-decreasing from 0 to N (empty segments allowed); y [N,O].
void grouped_gemm(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y);

// B: dx[seg] = dy[seg] @ w[e]  (dx [N,K], overwritten).
void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx);

// W: dw[e] (+)= dy[seg]^T @ x[seg], dbias[e] (+)= column sums of dy[seg]. dbias may be
// empty. An expert with no rows gets zero (or keeps its value when accumulating).
void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                  const Tensor& dbias, bool accumulate);

}  // namespace mt::cpu
