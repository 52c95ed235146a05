// Expert selection from router logits.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mt::cpu {

enum class RouterScoring : uint8_t {
  softmax_topk,  // softmax over all experts, then top-k of the probabilities (Qwen3, DeepSeek-V2)
  topk_softmax,  // top-k of the logits, then softmax over those k (GPT-OSS)
  sigmoid,       // a sigmoid of each logit, then top-k of those scores (DeepSeek-V3, Moonlight, Kimi K2)
};

struct RouterConfig {
  int64_t top_k = 1;
  RouterScoring scoring = RouterScoring::softmax_topk;
  bool normalize = false;     // renormalise the k weights to sum to 1 (norm_topk_prob)
  float scale = 1.0f;         // multiplies the final weights (routed_scaling_factor)
  int64_t n_group = 1;        // group-limited top-k: experts split into n_group contiguous
  int64_t topk_group = 1;     // groups, only the best topk_group of them eligible; groups
                              // ranked by their best score (softmax_topk: DeepSeek-V2) or
                              // by the sum of their two best (sigmoid: DeepSeek-V3's
                              // noaux_tc). n_group = 1 disables it.
};

// logits f32 [N,E] -> idx i32 [N,k] (best first; ties to the lower expert id, and
// groups to the lower group id), weight f32 [N,k], probs f32 [N,E] (kept for the
// backward and for the load-balance terms). With a bias f32 [E] (DeepSeek-V3's
// auxiliary-loss-free balancing, e_score_correction_bias) experts and groups are chosen
// by score + bias; the weights stay those of the unbiased scores.
//
// softmax_topk: probs = softmax(logits) over all E; the score is the probability;
//   weight_j = scale * probs[idx_j] (/ the sum of the k chosen with normalize).
// topk_softmax: the score is the logit; weight = softmax of the k chosen logits.
// sigmoid (DeepSeek-V3): s = sigmoid(logits) [N,E], the score; with n_group > 1 a group's
//   rank is the sum of its two highest s + bias (so a group needs 2 experts at least),
//   and only experts of the best topk_group groups are eligible (ineligible ones are
//   out of the choice, not scored 0: a negative bias cannot let them in); then the top-k
//   of s + bias among the eligible. weight_j = scale * s[idx_j], or with normalize
//   scale * s[idx_j] / (sum of the k chosen s + 1e-20), transformers' epsilon.
//   probs = s / (sum of the token's E scores): the per-token normalised scores that
//   DeepSeek-V3's sequence-wise balance loss averages, so router_prob_sum and the
//   balance terms read them as they read softmax probabilities. score_sum f32 [N] gets
//   that sum (the backward needs s = probs * score_sum and does not read the logits,
//   whose memory the decoder's layers share); it is required with sigmoid scoring and
//   must be empty with the others.
void router_forward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs, const Tensor& bias = {}, const Tensor& score_sum = {});

// dlogits f32 [N,E] (overwritten) from dweight f32 [N,k] and, when not empty,
// dprobs f32 [G,E] (the load-balance loss's gradient with respect to probs): the N
// tokens are G groups of N / G in a row, each group's tokens getting its row. G = 1: one
// row for every token (the micro-batch balance term's gradient is the same for all);
// G = the sequences: the sequence-level term's; G = N: a row a token. It reads idx,
// weight, probs (and score_sum) as router_forward wrote them, never the logits (their
// shape only). The bias gets no gradient, and the choice none (it is piecewise constant).
//
// sigmoid: with S = score_sum and s = probs * S, the gradient with respect to s is
//   ds_e = (dprobs_e - sum_f dprobs_f probs_f) / S                 (probs = s / S)
//        + for a chosen e = idx_j: scale * dweight_j, or with normalize
//          scale / D * (dweight_j - sum_i dweight_i s[idx_i] / D), D = the sum of the k
//          chosen s + 1e-20;
//   then dlogits_e = ds_e * s_e * (1 - s_e). Only the chosen experts' scores get a
//   weight gradient; every expert's gets the balance gradient through S.
void router_backward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits,
                     const Tensor& score_sum = {});

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
// With sigmoid scoring the z-loss is refused: probs is then the normalised sigmoid
// scores, not softmax(logits), so router_z_backward would compute a wrong gradient, and
// DeepSeek-V3 has no z-loss. A model with sigmoid scoring must reject a z-loss
// coefficient other than 0 at its configuration and never call these two.
void router_z_forward(const Tensor& logits, const Tensor& lse, const Tensor& sum);
void router_z_backward(const Tensor& lse, const Tensor& probs, float scale, const Tensor& dlogits);

}  // namespace mt::cpu

// The CUDA backend: the same f32 tensors, the same experts chosen from the same logits;
// at most 64 expert groups.
namespace mt::cuda {

void router_forward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs, const Tensor& bias = {}, const Tensor& score_sum = {});
void router_backward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits,
                     const Tensor& score_sum = {});
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
                           const Tensor& weight, const Tensor& probs, const Tensor& bias = {},
                           const Tensor& score_sum = {}) {
  return MT_BACKEND(probs.device == Device::cuda, router_forward(cfg, logits, idx, weight, probs, bias, score_sum));
}

inline void router_backward(const cpu::RouterConfig& cfg, const Tensor& logits, const Tensor& idx,
                            const Tensor& weight, const Tensor& probs, const Tensor& dweight, const Tensor& dprobs,
                            const Tensor& dlogits, const Tensor& score_sum = {}) {
  return MT_BACKEND(dlogits.device == Device::cuda,
                    router_backward(cfg, logits, idx, weight, probs, dweight, dprobs, dlogits, score_sum));
}

inline void router_prob_sum(const Tensor& probs, const Tensor& sums) {
  return MT_BACKEND(sums.device == Device::cuda, router_prob_sum(probs, sums));
}

inline void router_counts(const Tensor& idx, const Tensor& counts) {
  return MT_BACKEND(counts.device == Device::cuda, router_counts(idx, counts));
}

inline void router_z_forward(const Tensor& logits, const Tensor& lse, const Tensor& sum) {
  return MT_BACKEND(sum.device == Device::cuda, router_z_forward(logits, lse, sum));
}

inline void router_z_backward(const Tensor& lse, const Tensor& probs, float scale, const Tensor& dlogits) {
  return MT_BACKEND(dlogits.device == Device::cuda, router_z_backward(lse, probs, scale, dlogits));
}

}  // namespace mt
