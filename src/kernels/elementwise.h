// Elementwise helpers a model and its trainer need between the ops: dtype casts,
// residual adds, scaling, filling, column slices (splits and concatenations), and the sum
// of squares behind the gradient norm.
#pragma once

#include <cstdint>
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

// Column slices: splits and concatenations along the last dim. Each tensor is seen as a
// matrix [rows, cols], cols its last dim and rows the product of the others:
//   dst[r, dst_col + c] (+)= src[r', src_col + c]   for c < width
// The row counts are equal (r' = r), or dst has g times src's (broadcast: r' = r / g), or
// src has g times dst's (reduce: the sum over r' = r g .. r g + g - 1, added in that order
// in f32). So a copy's backward is the copy with dst and src swapped, a broadcast's is a
// reduce and the reverse. dst and src are each f32 or bf16; the value (plus dst's own when
// accumulating) is rounded once to dst's dtype; dst's other columns are left as they are.
// dst and src must not overlap. DeepSeek's MLA, D = Dn + Dr, as (dst, dst_col, src, src_col, width):
//   q [N,H,D] into q_nope [N,H,Dn], q_pe [N,H,Dr]:     (q_nope, 0, q, 0, Dn), (q_pe, 0, q, Dn, Dr)
//   (kv_a [N, r + Dr] and kv_b [N, H, Dn + Dv] alike); the backward, a concatenation:
//                                                     (dq, 0, dq_nope, 0, Dn), (dq, Dn, dq_pe, 0, Dr)
//   k [N,H,D] from k_nope [N,H,Dn], k_pe [N,1,Dr]:     (k, 0, k_nope, 0, Dn), (k, Dn, k_pe, 0, Dr)
//   dk_pe [N,1,Dr], the sum over the H heads:          (dk_pe, 0, dk, Dn, Dr)
void copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                  bool accumulate);

// copy_columns' arguments checked (names, shapes and columns in the error), as the CUDA
// backend's kernel takes them: dst row r reads src rows r / bcast * sum + i, i < sum.
struct ColumnCopy {
  int64_t rows, dst_cols, src_cols, bcast, sum;
};
ColumnCopy column_copy_shape(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width);

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
// Bit for bit the CPU's (the same f32 additions in the same order).
void copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                  bool accumulate);

}  // namespace mt::cuda

namespace mt {

// Between any two devices (host <-> GPU copies wait until done, so a host buffer can be
// reused at once); host to host is cpu::copy.
inline void copy(const Tensor& dst, const Tensor& src) {
  return MT_BACKEND(dst.device == Device::cuda || src.device == Device::cuda, copy(dst, src));
}

inline void cast(const Tensor& src, const Tensor& dst) {
  return MT_BACKEND(dst.device == Device::cuda, cast(src, dst));
}

// A tensor's values in host memory as f32, from f32 or bf16 on either device.
inline std::vector<float> to_host(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  Tensor out(v.data(), t.shape, DType::f32);
  if (t.dtype == DType::f32) {
    copy(out, t);
  } else {
    std::vector<uint8_t> raw(t.nbytes());
    Tensor staged(raw.data(), t.shape, t.dtype);
    copy(staged, t);
    cast(staged, out);
  }
  return v;
}

inline void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  return MT_BACKEND(out.device == Device::cuda, add(a, b, out));
}

inline void scale(const Tensor& x, float s) { return MT_BACKEND(x.device == Device::cuda, scale(x, s)); }

inline void fill(const Tensor& x, float value) {
  return MT_BACKEND(x.device == Device::cuda, fill(x, value));
}

inline void copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                         bool accumulate) {
  return MT_BACKEND(dst.device == Device::cuda, copy_columns(dst, dst_col, src, src_col, width, accumulate));
}

// The device of the first tensor decides; all must share it.
inline double sum_squares(const std::vector<Tensor>& xs) {
  return MT_BACKEND(!xs.empty() && xs.front().device == Device::cuda, sum_squares(xs));
}

}  // namespace mt
