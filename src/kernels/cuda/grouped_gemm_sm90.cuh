// The two implementations behind mt::cuda::grouped_gemm* (kernels/grouped_gemm.h), for
// grouped_gemm.cu and the tests and benchmark that compare them; host declarations only.
// Arguments are trusted (the public functions check them first).
//   *_sm90  CUTLASS's Hopper grouped GEMM (grouped_gemm_sm90.cu) for what the models run:
//           bf16 out for forward (with or without bias) and B, f32 dw for W, K and O
//           multiples of 8, 16-byte aligned x, w, y, dy, dx and dw. Returns false, having
//           queued nothing, otherwise.
//   *_wmma  the portable kernel (grouped_gemm.cu): any shape and dtype, bias included.
// Neither computes dbias: grouped_gemm_backward_weight adds it with its own kernels.
// zero_empty_experts: dw f32 [E, ...] (f32 elements a multiple of 4 an expert, 16-byte
// aligned) = 0 for each expert whose segment of offsets, clamped to [0, rows], is empty,
// the weight gradients CUTLASS gives no tiles.
#pragma once

#include "core/tensor.h"

namespace mt::cuda {

bool grouped_gemm_sm90(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y);
bool grouped_gemm_backward_input_sm90(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx);
bool grouped_gemm_backward_weight_sm90(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                       bool accumulate);

void zero_empty_experts(const Tensor& offsets, int64_t rows, const Tensor& dw);

void grouped_gemm_wmma(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y);
void grouped_gemm_backward_input_wmma(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx);
void grouped_gemm_backward_weight_wmma(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                       bool accumulate);

}  // namespace mt::cuda
