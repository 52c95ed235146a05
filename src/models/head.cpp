#include "models/head.h"

#include <algorithm>

#include "core/check.h"
#include "kernels/cross_entropy.h"
#include "kernels/gemm.h"
#include "kernels/rmsnorm.h"
#include "models/decoder.h"

namespace mt {

void Head::allocate(Acts& x, Arena& a, DType act, int64_t tokens, int64_t width) const {
  x.hf = a.alloc(act, {tokens, width});
  x.rstd_f = a.alloc(DType::f32, {tokens});
  x.logits = a.alloc(act, {rows(tokens), vocab_});
  x.lse = a.alloc(DType::f32, {tokens});
  x.d_hf = a.alloc(act, {tokens, width});
}

void Head::hf_tensors(std::vector<HfTensor>& out, const std::string& norm_key) const {
  out.push_back(hf_tensor(norm_key, p(norm_), 0.0f, 1.0f - norm_offset_));
  if (own_out_) out.push_back(hf_tensor("lm_head.weight", p(out_)));
}

LossSum Head::forward(const Tensor& h, const Tensor& labels, Acts& x, float grad_scale) {
  const int64_t N = h.dim(0);
  rmsnorm_forward(h, p(norm_).value, static_cast<float>(eps_), x.hf, x.rstd_f, norm_offset_);
  LossSum loss;
  // One chunk: its logits become their gradient in the cross-entropy's pass (the
  // backward starts from them); chunks are made again by the backward.
  x.logits_grad_scale = N <= rows(N) ? grad_scale : 0.0f;
  for (int64_t r0 = 0, c = rows(N); r0 < N; r0 += c) {
    const int64_t r1 = std::min(N, r0 + c);
    const Tensor logits = x.logits.rows(0, r1 - r0);
    gemm(x.hf.rows(r0, r1), p(out_).compute, logits, false, true);
    cpu::CrossEntropySum ce =
        cross_entropy_forward(logits, labels.rows(r0, r1), kIgnoreIndex, x.lse.rows(r0, r1), x.logits_grad_scale,
                              x.logits_grad_scale > 0 ? logits : Tensor());
    loss.sum += ce.loss_sum;
    loss.count += ce.count;
  }
  return loss;
}

void Head::backward_input(const Tensor& h, const Tensor& labels, Acts& x, float scale, const Tensor& dh) {
  const int64_t N = h.dim(0), c = rows(N);
  const bool chunked = N > c;
  MT_CHECK(x.logits_grad_scale == 0 || x.logits_grad_scale == scale)
      << "head backward at scale " << scale << ", but its forward made the gradient at " << x.logits_grad_scale;
  Param& out = p(out_);
  for (int64_t r0 = 0; r0 < N; r0 += c) {
    const int64_t r1 = std::min(N, r0 + c);
    const Tensor logits = x.logits.rows(0, r1 - r0), hf = x.hf.rows(r0, r1);
    if (chunked) gemm(hf, out.compute, logits, false, true);  // one chunk's are still there
    // In place: the chunk's logits become d(loss)/d(logits), which the weight's gradient
    // reads (here, or in W when there is one chunk).
    if (x.logits_grad_scale == 0)
      cross_entropy_backward(logits, labels.rows(r0, r1), x.lse.rows(r0, r1), kIgnoreIndex, scale, logits);
    gemm(logits, out.compute, x.d_hf.rows(r0, r1), false, false);
    if (chunked) gemm(logits, hf, out.grad, true, false, 1.0f, grad_beta(out));
  }
  rmsnorm_backward(h, p(norm_).value, x.rstd_f, x.d_hf, dh, grad_zeroed(p(norm_)), Tensor(), norm_offset_);
}

void Head::backward_weight(Acts& x, int64_t tokens) {
  Param& out = p(out_);
  if (tokens <= rows(tokens)) gemm(x.logits, x.hf, out.grad, true, false, 1.0f, grad_beta(out));
}

Tensor Head::logits(const Acts& x, int64_t tokens) const {
  const int64_t c = rows(tokens), last = tokens - (tokens - 1) / c * c;
  return x.logits.rows(0, last);
}

}  // namespace mt
