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
// backward and for the load-balance loss). With a bias f32 [E] (DeepSeek-V3's
// auxiliary-loss-free balancing) experts and groups are chosen by score + bias, the
// score being the probability (softmax_topk) or the logit (topk_softmax); the weights
// stay those of the unbiased scores.
void router_forward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs, const Tensor& bias = {});

// dlogits f32 [N,E] (overwritten) from dweight f32 [N,k] and, when not empty,
// dprobs f32 [G,E] (the load-balance loss's gradient with respect to probs): the N
// tokens are G groups of N / G in a row, each group's tokens getting its row. G = 1: one
// row for every token (the micro-batch balance term's gradient is the same for all);
// G = the sequences: the sequence-level term's; G = N: a row a token.
void router_backward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits);

// sums f32 [E] = sum over the N tokens of probs f32 [N,E], accumulated in double in
// token order (the load-balance statistics), rounded once to f32.
void router_prob_sum(const Tensor& probs, const Tensor& sums);

// counts i32 [G,E] = the slots of idx i32 [N,k] that chose each expert, in each of G
// groups of N / G tokens in a row (the sequence-level balance term's counts).
void router_counts(const Tensor& idx, const Tensor& counts);

// The router z-loss (ST-MoE): z[t] = lse[t]^2, lse[t] = logsumexp(logits[t]).
// router_z_forward: lse f32 [N] and sum f32 [1] = sum over the N tokens of z[t], in double
// in token order, rounded once to f32. router_z_backward: dlogits[t] += scale * 2 * lse[t]
// * probs[t] (probs = softmax(logits), router_forward's), the gradient of scale * sum_t
// z[t] (dlogits f32 [N,E], added to). It reads what the backward keeps (lse and probs),
// not the logits, whose memory the decoder's layers share.
void router_z_forward(const Tensor& logits, const Tensor& lse, const Tensor& sum);
void router_z_backward(const Tensor& lse, const Tensor& probs, float scale, const Tensor& dlogits);

}  // namespace mt::cpu

// The CUDA backend: the same f32 tensors, the same experts chosen from the same logits;
// at most 64 expert groups.
namespace mt::cuda {

void router_forward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs, const Tensor& bias = {});
void router_backward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits);
// In double, by chunks of 256 tokens then over the chunks (a fixed order, so repeatable;
// it may differ from the CPU's token-order sum in the last bit of the f32 result).
void router_prob_sum(const Tensor& probs, const Tensor& sums);
// A block a group, counting in shared memory.
void router_counts(const Tensor& idx, const Tensor& counts);
// A warp a token; the sum in double by chunks of 256 tokens, then over the chunks.
void router_z_forward(const Tensor& logits, const Tensor& lse, const Tensor& sum);
void router_z_backward(const Tensor& lse, const Tensor& probs, float scale, const Tensor& dlogits);

}  // namespace mt::cuda

namespace mt {

inline void router_forward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx,
                           const Tensor& weight, const Tensor& probs, const Tensor& bias = {}) {
#ifdef MOETRAIN_WITH_CUDA
  if (probs.device == Device::cuda) return cuda::router_forward(cfg, logits, idx, weight, probs, bias);
#endif
  return cpu::router_forward(cfg, logits, idx, weight, probs, bias);
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

inline void router_prob_sum(const Tensor& probs, const Tensor& sums) {
#ifdef MOETRAIN_WITH_CUDA
  if (sums.device == Device::cuda) return cuda::router_prob_sum(probs, sums);
#endif
  return cpu::router_prob_sum(probs, sums);
}

inline void router_counts(const Tensor& idx, const Tensor& counts) {
#ifdef MOETRAIN_WITH_CUDA
  if (counts.device == Device::cuda) return cuda::router_counts(idx, counts);
#endif
  return cpu::router_counts(idx, counts);
}

inline void router_z_forward(const Tensor& logits, const Tensor& lse, const Tensor& sum) {
#ifdef MOETRAIN_WITH_CUDA
  if (sum.device == Device::cuda) return cuda::router_z_forward(logits, lse, sum);
#endif
  return cpu::router_z_forward(logits, lse, sum);
}

inline void router_z_backward(const Tensor& lse, const Tensor& probs, float scale, const Tensor& dlogits) {
#ifdef MOETRAIN_WITH_CUDA
  if (dlogits.device == Device::cuda) return cuda::router_z_backward(lse, probs, scale, dlogits);
#endif
  return cpu::router_z_backward(lse, probs, scale, dlogits);
}

}  // namespace mt
