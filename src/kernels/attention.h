// Causal scaled-dot-product attention with grouped-query heads, an optional sliding
// window, optional learnable per-head sink logits (GPT-OSS), and a value head dim that may
// differ from the query/key one (DeepSeek's MLA: Dqk 192, Dv 128).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mt::cpu {

struct AttentionArgs {
  float scale = 1.0f;       // usually 1/sqrt(Dqk)
  int64_t window = 0;       // 0: full causal; else key j is visible to query i when i - j < window
  int64_t q_offset = 0;     // absolute position of query row 0 (ring attention passes chunks)
  int64_t k_offset = 0;     // absolute position of key row 0
};

// q f32 [B,Tq,Hq,Dqk], k f32 [B,Tk,Hkv,Dqk], v f32 [B,Tk,Hkv,Dv] (Dv is read from v)
// with Hq % Hkv == 0 (query head h reads kv head h / (Hq/Hkv)); sinks f32 [Hq] or empty:
// an extra logit per head in the softmax denominator with no value. Query i (position q_offset+i) sees key j
// (position k_offset+j) when pos_j <= pos_i and, with a window, pos_i - pos_j < window.
// out f32 [B,Tq,Hq,Dv]; lse f32 [B,Hq,Tq] = log of the softmax denominator (sink
// included), -inf for a row that sees nothing (its output is 0).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                       const AttentionArgs& a, const Tensor& out, const Tensor& lse);

// dout like out; dq, dk, dv (shaped like q, k, v) overwritten; dsinks [Hq] accumulated (may
// be empty when sinks is).
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                        const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks);

}  // namespace mt::cpu

// The CUDA backend: q, k, v, out, dout, dq, dk, dv bf16 (f32 accumulation inside), lse,
// sinks and dsinks f32; Dqk up to 192 and Dv up to 128. What runs where:
//   cuDNN's fused SDPA (cuda/attention_cudnn.h) with a plain causal mask (optionally
//     windowed) or none, sinks or not, (Dqk, Dv) = (64, 64), (128, 128) or (192, 128) and
//     16-byte aligned pointers; not deterministic (its dQ adds with atomics);
//   our flash kernel (cuda/attention.cu) for everything else, shifted diagonals and offsets
//     with any Dqk/Dv, heads padded to (64, 64), (128, 128) or (192, 128) in shared memory;
//     deterministic: no atomics.
namespace mt::cuda {

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                       const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                        const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks);

}  // namespace mt::cuda

namespace mt {

inline void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                              const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse) {
  return MT_BACKEND(out.device == Device::cuda, attention_forward(q, k, v, sinks, a, out, lse));
}

inline void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                               const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse,
                               const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                               const Tensor& dsinks) {
  return MT_BACKEND(dq.device == Device::cuda,
                    attention_backward(q, k, v, sinks, a, out, lse, dout, dq, dk, dv, dsinks));
}

}  // namespace mt
