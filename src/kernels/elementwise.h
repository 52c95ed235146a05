// Elementwise helpers a model and its trainer need between the ops: dtype casts,
// residual adds, scaling, filling, and the sum of squares behind the gradient norm.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace mt::cpu {

// dst = src converted: f32 -> bf16 (round to nearest even), bf16 -> f32 (exact), or a
// plain copy when the dtypes agree. Same element count; shapes may differ (a view).
void cast(const Tensor& src, const Tensor& dst);

// out = a + b elementwise; all three f32, or all three bf16 (added in f32, rounded
// once). out may be a or b.
void add(const Tensor& a, const Tensor& b, const Tensor& out);

// x *= s in place; f32 or bf16.
void scale(const Tensor& x, float s);

// Every element of x = value (rounded to bf16 for a bf16 x); f32 or bf16.
void fill(const Tensor& x, float value);

// Sum over all tensors of sum(x^2), accumulated in double; f32 tensors.
double sum_squares(const std::vector<Tensor>& xs);

// dst = src byte for byte: same dtype (any) and element count, host memory.
void copy(const Tensor& dst, const Tensor& src);

}  // namespace mt::cpu

namespace mt::cuda {

// The same contracts on the GPU. sum_squares reduces in double on the device, in an
// order fixed by the tensor sizes (repeatable bit for bit), and waits for the result.
void cast(const Tensor& src, const Tensor& dst);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
void scale(const Tensor& x, float s);
void fill(const Tensor& x, float value);
double sum_squares(const std::vector<Tensor>& xs);
void copy(const Tensor& dst, const Tensor& src);  // defined with the runtime (runtime.cu)

}  // namespace mt::cuda

namespace mt {

// Between any two devices (host <-> GPU copies wait until done, so a host buffer can be
// reused at once); host to host is cpu::copy.
inline void copy(const Tensor& dst, const Tensor& src) {
#ifdef MOETRAIN_WITH_CUDA
  if (dst.device == Device::cuda || src.device == Device::cuda) return cuda::copy(dst, src);
#endif
  return cpu::copy(dst, src);
}

inline void cast(const Tensor& src, const Tensor& dst) {
#ifdef MOETRAIN_WITH_CUDA
  if (dst.device == Device::cuda) return cuda::cast(src, dst);
#endif
  return cpu::cast(src, dst);
}

inline void add(const Tensor& a, const Tensor& b, const Tensor& out) {
#ifdef MOETRAIN_WITH_CUDA
  if (out.device == Device::cuda) return cuda::add(a, b, out);
#endif
  return cpu::add(a, b, out);
}

inline void scale(const Tensor& x, float s) {
#ifdef MOETRAIN_WITH_CUDA
  if (x.device == Device::cuda) return cuda::scale(x, s);
#endif
  return cpu::scale(x, s);
}

inline void fill(const Tensor& x, float value) {
#ifdef MOETRAIN_WITH_CUDA
  if (x.device == Device::cuda) return cuda::fill(x, value);
#endif
  return cpu::fill(x, value);
}

// The device of the first tensor decides; all must share it.
inline double sum_squares(const std::vector<Tensor>& xs) {
#ifdef MOETRAIN_WITH_CUDA
  if (!xs.empty() && xs.front().device == Device::cuda) return cuda::sum_squares(xs);
#endif
  return cpu::sum_squares(xs);
}

}  // namespace mt
