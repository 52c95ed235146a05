// The head after the last layer: the final norm, the output projection (its own
// `lm_head`, or the embedding's when tied) and the cross-entropy, with its three stages:
// forward (the loss, and with one chunk the logits' gradient in place), B (the input
// gradient into the last layer's residual stream, and past one chunk the projection's
// weight gradient) and W (the projection's weight gradient from the kept chunk).
//
// The schedules reach it only through Model::head_forward / head_backward_input /
// head_backward_weight, on the rank that holds the head (ModelOptions::head: the last
// pipeline stage). That is the seam for heads after the last layer: a model that adds
// some runs them behind the same three calls, and no schedule changes: DeepSeek-V3's
// multi-token prediction (models/decoder.cpp, Decoder::mtp_forward), each depth a Head
// of its own norm over the model's projection.
//
// With full recomputation the head runs over chunks of kHeadRows tokens, so a stash
// holds [kHeadRows, vocab] logits, not [tokens, vocab] (Liger-Kernel's fused linear
// cross-entropy does the same): past one chunk, B computes each chunk's logits again and
// its weight gradient with them, and W has nothing left to do. Not by default: on the
// H200 it cost 8% of the 8-layer benchmark's tokens/s (the logits' product again, and a
// host wait a chunk) for 2.2 GB (bench/RESULTS.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "models/interface.h"

namespace mt {

constexpr int64_t kHeadRows = 1024;
constexpr int32_t kIgnoreIndex = -100;  // a label the cross-entropy skips

class Head {
 public:
  // One micro-batch's head activations.
  struct Acts {
    Tensor hf, rstd_f, logits, lse, d_hf;
    float logits_grad_scale = 0;  // > 0: forward left d(loss)/d(logits) in place, at this scale
  };
  Head() = default;
  // `norm` and `out` index `params` (out: lm_head, or the embedding when tied); `chunked`:
  // full recomputation's chunks of kHeadRows tokens.
  // norm_offset: zero-centred norm weights (DecoderSpec::norm_weight_offset).
  Head(std::vector<Param>* params, int norm, int out, bool own_out, double eps, int64_t vocab, bool chunked,
       float norm_offset = 0.0f)
      : params_(params), norm_(norm), out_(out), own_out_(own_out), eps_(eps), vocab_(vocab), chunked_(chunked),
        norm_offset_(norm_offset) {}

  // Allocates a micro-batch's activations of `tokens` tokens of width `width`.
  void allocate(Acts& x, Arena& a, DType act, int64_t tokens, int64_t width) const;
  // The norm under `norm_key`, and the output projection where it is the head's own.
  void hf_tensors(std::vector<HfTensor>& out, const std::string& norm_key = "model.norm.weight") const;
  // h: the last layer's output [N, D]; labels i32 [N].
  LossSum forward(const Tensor& h, const Tensor& labels, Acts& x, float grad_scale);
  // dh: d loss / d h, written.
  void backward_input(const Tensor& h, const Tensor& labels, Acts& x, float scale, const Tensor& dh);
  void backward_weight(Acts& x, int64_t tokens);
  // The last chunk's logits: every token's where the micro-batch fits in one.
  Tensor logits(const Acts& x, int64_t tokens) const;

 private:
  int64_t rows(int64_t tokens) const { return chunked_ ? std::min(tokens, kHeadRows) : tokens; }
  Param& p(int i) const { return (*params_)[static_cast<size_t>(i)]; }

  std::vector<Param>* params_ = nullptr;
  int norm_ = -1, out_ = -1;
  bool own_out_ = false;
  double eps_ = 1e-6;
  int64_t vocab_ = 0;
  bool chunked_ = false;
  float norm_offset_ = 0.0f;
};

}  // namespace mt
