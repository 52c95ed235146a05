// cuDNN's fused scaled-dot-product attention (flash attention on Hopper's wgmma and TMA,
// through the cuDNN frontend's graph API) for the cases it computes exactly as our
// kernel does. cuda::attention_forward/backward (attention.cu) try it first and run our
// own kernel when it declines.
//
// It applies when there are no sinks, no window, head_dim is 64 or 128, every pointer is
// 16-byte aligned, and the mask is one cuDNN has:
//   causal   q_offset == k_offset and Tq == Tk: query i sees keys 0..i (top-left diagonal);
//   none     every key is visible to every query (k_offset + Tk - 1 <= q_offset), as in
//            the off-diagonal blocks of ring attention.
// Anything else (windows, sinks, other offsets, other head dims) runs our kernel.
//
// cuDNN's softmax statistics ("Stats", f32 [B,Hq,Tq,1]) are max + log(sum exp) of the
// scaled logits in natural log: our lse [B,Hq,Tq], same memory layout. So the forward
// writes our lse directly and the backward reads whatever lse the forward produced, on
// either route.
//
// One graph is built per (shape, mask, scale, direction) on first use and cached (cuDNN
// compiles its attention kernels with NVRTC then, so libnvrtc must be loadable); a shape
// cuDNN cannot build (or execute) is remembered, reported once on stderr, and runs our
// kernel from then on. Graphs run on the current stream (runtime.h) through one
// cudnnHandle, set to that stream at each call, with that stream's scratch() as their
// workspace; the handle and the cache are used under a lock, so two streams (or threads)
// never share a workspace or race on the handle's stream.
//
// Determinism: cuDNN's backward on Hopper accumulates dQ across key blocks with f32
// atomics, so its results may differ in the last bits from run to run. Its deterministic
// mode keeps a [B,Hq,Tq,Tk] bf16 workspace (2 GiB at the benchmark's shape) and is not
// used. Our kernel repeats bit for bit. The tests compare either route with the CPU
// within bf16 tolerances, which does not need exact repeats; they print whether two cuDNN
// backwards gave the same bits.
#pragma once

#include "kernels/attention.h"

namespace mt::cuda {

// The switch for the cuDNN route: on unless the environment says
// MOETRAIN_ATTENTION_CUDNN=0 when the process first asks. Tests and the benchmark turn
// it off to run (and compare) our kernel on the same cases.
void set_attention_cudnn(bool enabled);
bool attention_cudnn_enabled();

// How many attention forward and backward calls cuDNN has run in this process: tests
// check that their cases took the route they expect.
int64_t attention_cudnn_calls();

// Runs the op on cuDNN and returns true when the switch is on, the case applies and cuDNN
// has a plan for it; otherwise returns false having queued nothing. The arguments must
// already have passed attention.cu's checks.
bool cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                             const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse);
bool cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                              const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv);

}  // namespace mt::cuda
