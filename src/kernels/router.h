// Expert selection from router logits.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mt::cpu {

enum class RouterScoring : uint8_t {
  softmax_topk,  // softmax over all experts, then top-k of the probabilities (Qwen3, DeepSeek)
  topk_softmax,  // top-k of the logits, then softmax over those k (GPT-OSS)
};

struct RouterConfig {
  int64_t top_k = 1;
  RouterScoring scoring = RouterScoring::softmax_topk;
  bool normalize = false;     // renormalise the k weights to sum to 1 (norm_topk_prob)
  float scale = 1.0f;         // multiplies the final weights (routed_scaling_factor)
  int64_t n_group = 1;        // DeepSeek group-limited top-k: experts split into n_group
  int64_t topk_group = 1;     // groups, ranked by their best probability; only the best
                              // topk_group groups are eligible. n_group = 1 disables it.
};

// logits f32 [N,E] -> idx i32 [N,k] (best first; ties to the lower expert id),
// weight f32 [N,k], probs f32 [N,E] = softmax over all E experts (kept for the
// backward and for the load-balance loss).
void router_forward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs);

// dlogits f32 [N,E] (overwritten) from dweight f32 [N,k] and, when not empty,
// dprobs f32 [N,E] (the load-balance loss's gradient with respect to probs).
void router_backward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits);

}  // namespace mt::cpu

// The CUDA backend: the same f32 tensors, the same experts chosen from the same logits;
// at most 64 expert groups.
namespace mt::cuda {

void router_forward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs);
void router_backward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits);

}  // namespace mt::cuda

namespace mt {

inline void router_forward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx,
                           const Tensor& weight, const Tensor& probs) {
#ifdef MOETRAIN_WITH_CUDA
  if (probs.device == Device::cuda) return cuda::router_forward(cfg, logits, idx, weight, probs);
#endif
  return cpu::router_forward(cfg, logits, idx, weight, probs);
}

inline void router_backward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx,
                            const Tensor& weight, const Tensor& probs, const Tensor& dweight, const Tensor& dprobs,
                            const Tensor& dlogits) {
#ifdef MOETRAIN_WITH_CUDA
  if (dlogits.device == Device::cuda)
    return cuda::router_backward(cfg, logits, idx, weight, probs, dweight, dprobs, dlogits);
#endif
  return cpu::router_backward(cfg, logits, idx, weight, probs, dweight, dprobs, dlogits);
}

}  // namespace mt
