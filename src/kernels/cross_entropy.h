// Softmax cross-entropy over a vocabulary, fused: the backward overwrites the logits
// buffer with the gradient, so only one full-vocabulary fp32 copy ever exists.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mt::cpu {

struct CrossEntropySum {
  double loss_sum = 0;  // sum over counted rows of lse - logit[label]
  int64_t count = 0;    // rows whose label is not ignore_index
};

// logits f32 [N,V], labels i32 [N] (ignore_index rows skipped, others in [0,V)),
// lse f32 [N] (log-sum-exp per row, kept for the backward). The mean loss is
// loss_sum / count; with micro-batches the caller divides by the global count. Given
// dlogits (which may be the logits), the backward's gradient with `scale` is written
// there too, as cross_entropy_backward would (on the GPU in the same pass over the rows).
CrossEntropySum cross_entropy_forward(const Tensor& logits, const Tensor& labels, int32_t ignore_index,
                                      const Tensor& lse, float scale = 0.0f, const Tensor& dlogits = Tensor());

// dlogits = scale * (softmax(logits) - onehot(label)), zero on ignored rows. scale is
// dloss / count for a mean. dlogits may be the logits tensor itself.
void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, int32_t ignore_index,
                            float scale, const Tensor& dlogits);

}  // namespace mt::cpu

namespace mt::cuda {

// logits f32 or bf16, labels i32, lse f32, all on the GPU. The forward sums the row
// losses in double on the device in a fixed order and waits for the two numbers it
// returns; a label outside [0, V) (not the ignore index) makes the sum NaN, not an error.
// dlogits f32 or bf16 (the logits' dtype when it is the logits buffer, as in the model).
cpu::CrossEntropySum cross_entropy_forward(const Tensor& logits, const Tensor& labels, int32_t ignore_index,
                                           const Tensor& lse, float scale = 0.0f, const Tensor& dlogits = Tensor());
void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, int32_t ignore_index,
                            float scale, const Tensor& dlogits);

}  // namespace mt::cuda

namespace mt {

inline cpu::CrossEntropySum cross_entropy_forward(const Tensor& logits, const Tensor& labels, int32_t ignore_index,
                                                  const Tensor& lse, float scale = 0.0f,
                                                  const Tensor& dlogits = Tensor()) {
  return MT_BACKEND(lse.device == Device::cuda,
                    cross_entropy_forward(logits, labels, ignore_index, lse, scale, dlogits));
}

inline void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, int32_t ignore_index,
                                   float scale, const Tensor& dlogits) {
  return MT_BACKEND(dlogits.device == Device::cuda,
                    cross_entropy_backward(logits, labels, lse, ignore_index, scale, dlogits));
}

}  // namespace mt
