// The two implementations behind mt::cuda::grouped_gemm* (kernels/grouped_gemm.h), for
// grouped_gemm.cu and the tests and benchmark that compare them; host declarations only.
// Arguments are trusted (the public functions check them first).
//   *_sm90  CUTLASS's Hopper grouped GEMM (grouped_gemm_sm90.cu) for what the model runs:
//           bf16 out for forward and B, f32 dw for W, no bias, K and O multiples of 8,
//           16-byte aligned tensors. Returns false, having queued nothing, otherwise.
//   *_wmma  the portable kernel (grouped_gemm.cu): any shape and dtype, bias included.
#pragma once

#include "core/tensor.h"

namespace mt::cuda {

bool grouped_gemm_sm90(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& y);
bool grouped_gemm_backward_input_sm90(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx);
bool grouped_gemm_backward_weight_sm90(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                       bool accumulate);

void grouped_gemm_wmma(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y);
void grouped_gemm_backward_input_wmma(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx);
// dw only; the bias gradient is its own kernel, shared by both paths.
void grouped_gemm_backward_weight_wmma(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                       bool accumulate);

}  // namespace mt::cuda
