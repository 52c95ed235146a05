// cuDNN's fused scaled-dot-product attention (cuDNN frontend graphs) where it computes
// exactly what our kernel does; cuda::attention_forward/backward (attention.cu) try it
// first. It applies with head dims (q/k, v) of (64, 64), (128, 128), (256, 256) or MLA's (192, 128)
// (cuDNN 9 has d_qk = 192, d_v = 128 on Hopper), every pointer 16-byte aligned, and a mask
// cuDNN has:
//   causal   q_offset == k_offset and Tq == Tk: query i sees keys 0..i (top-left diagonal),
//            with a window only keys i-window+1..i (the band's left bound);
//   none     every key is visible to every query (k_offset + Tk - 1 <= q_offset), as in
//            the off-diagonal blocks of ring attention, and no window cuts the block.
// GPT-OSS's sinks are cuDNN's sink token (cuDNN 9.13 or later): a logit per head in the
// softmax's denominator. cuDNN returns dq, dk and dv; the sinks' gradient is attention.cu's.
// Its softmax statistics (Stats, f32 [B,Hq,Tq,1], natural log, the sink included) are our
// lse [B,Hq,Tq] in the same layout, so either route's backward reads either route's lse.
// A graph is built per (shape, mask, scale, direction) on first use and cached (cuDNN
// compiles it with NVRTC then: libnvrtc must load); one cuDNN cannot build or execute is
// reported once on stderr and runs our kernel from then on. Graphs run on the current
// stream with its scratch() as workspace; the one handle and the cache are used under a
// lock. cuDNN's backward adds dQ with f32 atomics, so unlike our kernel it may differ in
// the last bits from run to run (its deterministic mode needs a [B,Hq,Tq,Tk] workspace).
#pragma once

#include "kernels/attention.h"

namespace mt::cuda {

// The switch for the cuDNN route: on unless MOETRAIN_ATTENTION_CUDNN=0 when the process
// first asks. Tests and the benchmark turn it off to run our kernel on the same cases.
void set_attention_cudnn(bool enabled);
bool attention_cudnn_enabled();

// How many attention calls cuDNN has run in this process (tests check the route taken).
int64_t attention_cudnn_calls();

// Runs the op on cuDNN (true) when the switch is on, the case applies and cuDNN has a plan;
// otherwise returns false having queued nothing. The arguments have passed attention.cu's checks.
bool cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                             const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse);
bool cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                              const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv);

}  // namespace mt::cuda
