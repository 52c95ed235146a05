#include "models/linear.h"

#include "core/check.h"
#include "kernels/fp8_quant.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "models/decoder.h"
#include "parallel/buffer.h"

namespace mt {

namespace {

using parallel::Buffer;
using parallel::make_buffer;

// A [M, K] operand quantized in 1x128 tiles along K: codes and scales [ceil(K/128), M].
struct Rows {
  Buffer q, scale;
};

Rows quantized_rows(const Tensor& x, bool pow2) {
  const int64_t m = x.dim(0), k = x.dim(1);
  Rows r{make_buffer(x.device, DType::f8e4m3, {m, k}), make_buffer(x.device, DType::f32, {fp8::tiles(k), m})};
  quantize_rows(x, r.q.t, r.scale.t, pow2);
  return r;
}

// A 2-D weight and its 1-D bias (a linear layer with a bias) are one group of every row.
Tensor group(const Tensor& t, int64_t dims) {
  if (t.ndim() == dims || t.data == nullptr) return t;
  Shape s = t.shape;
  s.n += 1;
  for (int i = s.n - 1; i > 0; --i) s.d[i] = s.d[i - 1];
  s.d[0] = 1;
  return t.view(s);
}

// The decoder keeps one-column products (a shared expert's gate) out of FP8: such a
// weight has no copy and runs in bf16 (models/decoder.cpp, quantized).
bool has_fp8(const Param& w) { return w.fp8.q.data != nullptr; }

const Fp8Copy& cache(const Param& w) {
  MT_CHECK(w.fp8.q.data != nullptr) << w.name << " has no FP8 copy: training.fp8 = blockwise quantizes only the "
                                    << "weights of linear layers";
  return w.fp8;
}

}  // namespace

Shape fp8_block_scale_shape(const Shape& w, bool transposed) {
  const int64_t o = w.d[w.n - 2], k = w.d[w.n - 1];
  const int64_t rows = fp8::tiles(transposed ? k : o), cols = fp8::block_scale_cols(transposed ? o : k);
  return w.n == 3 ? Shape{w.d[0], rows, cols} : Shape{rows, cols};
}

void Linear::forward(const Tensor& x, std::initializer_list<Out> outs) const {
  bool any = false;
  for (const Out& o : outs) {
    if (fp8() && has_fp8(o.w)) any = true;
    else gemm(x, o.w.compute, o.y, false, true, 1.0f, o.beta);
  }
  if (!any) return;
  const Rows xq = quantized_rows(x, pow2_);
  for (const Out& o : outs)
    if (has_fp8(o.w)) gemm_fp8(xq.q.t, xq.scale.t, cache(o.w).q, o.w.fp8.scale, true, o.y, 1.0f, o.beta);
}

void Linear::backward_input(const Tensor& dy, const Param& w, const Tensor& dx, float beta) const {
  if (!fp8() || !has_fp8(w)) return gemm(dy, w.compute, dx, false, false, 1.0f, beta);
  const Rows dq = quantized_rows(dy, pow2_);
  gemm_fp8(dq.q.t, dq.scale.t, cache(w).qt, w.fp8.scale_t, true, dx, 1.0f, beta);
}

void Linear::backward_weight(const Tensor& x, std::initializer_list<Grad> grads) const {
  for (const Grad& g : grads) gemm(g.dy, x, g.w.grad, true, false, 1.0f, grad_beta(g.w));  // bf16 in either mode
}

void Linear::grouped_forward(const Tensor& x, const Param& w, const Tensor& bias, const Tensor& offsets,
                             const Tensor& y) const {
  if (!fp8()) return grouped_gemm(x, group(w.compute, 3), group(bias, 2), offsets, y);
  const Rows xq = quantized_rows(x, pow2_);
  grouped_gemm_fp8(xq.q.t, xq.scale.t, group(cache(w).q, 3), group(w.fp8.scale, 3), offsets, y, group(bias, 2));
}

void Linear::grouped_backward_input(const Tensor& dy, const Param& w, const Tensor& offsets,
                                    const Tensor& dx) const {
  if (!fp8()) return grouped_gemm_backward_input(dy, w.compute, offsets, dx);
  const Rows dq = quantized_rows(dy, pow2_);
  grouped_gemm_fp8(dq.q.t, dq.scale.t, cache(w).qt, w.fp8.scale_t, offsets, dx);
}

void Linear::grouped_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, Param& w,
                                     const Tensor& dbias, bool accumulate) const {
  // bf16 in either mode (header)
  grouped_gemm_backward_weight(x, dy, offsets, group(w.grad, 3), group(dbias, 2), accumulate);
}

}  // namespace mt
