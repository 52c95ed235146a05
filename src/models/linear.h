// Every linear layer of a model runs through Linear, so that training.fp8 is one switch
// in one place. What stays out: the router, the embedding, the LM head, the norms and
// the attention core (DeepSeek-V3 keeps them in bf16; so do we), and a shared expert's
// one-column gate (Qwen3.5), which goes through Linear without an FP8 copy: a weight
// without one runs in bf16 in either mode (the decoder decides which have one).
//
// none: the products read Param::compute (bf16 on the GPU, f32 on the CPU).
// blockwise: DeepSeek-V3's recipe, kernels/fp8_quant.h: e4m3 codes with one f32 scale
// per tile. The forward quantizes its input x in 1x128 tiles along the reduction once
// per call, shared by every weight that reads it (q, k and v); the input gradient
// quantizes dy the same way. The weight gradients stay in bf16, measured on the 8-layer
// benchmark (bench/NOTES.md v11, v12): reducing over an expert's few hundred tokens,
// CUTLASS's blockwise FP8 grouped product ran no faster than the bf16 one (H200: 441
// against 468 TFLOPS), so quantizing x^T and dy^T per segment only added time (+15.5 ms
// a step); the dense products gained less than quantizing x^T and dy^T cost (3.7 ms a
// step in bf16 against 7.0 in FP8; fp8 rows +2.6%). Both are in git (0a2094f, 0bc24e0).
// Weights come quantized from their Param::fp8 cache in both layouts (128x128 blocks),
// written by the optimizer's AdamW pass from the f32 master after every update (such a
// weight has no bf16 copy). Products accumulate in f32. The quantized activations are
// temporaries of the call (the stream-ordered pool on the GPU).
#pragma once

#include <initializer_list>

#include "core/param.h"
#include "core/tensor.h"

namespace mt {

enum class Fp8 : uint8_t { none, blockwise };

class Linear {
 public:
  Linear(Fp8 mode, bool pow2) : mode_(mode), pow2_(pow2) {}
  bool fp8() const { return mode_ == Fp8::blockwise; }
  bool pow2() const { return pow2_; }

  // y = x w^T + beta y for each output: x [N, K], w [O, K], y [N, O].
  struct Out {
    const Param& w;
    const Tensor& y;
    float beta = 0.0f;
  };
  void forward(const Tensor& x, std::initializer_list<Out> outs) const;
  // dx = dy w + beta dx: dy [N, O], dx [N, K].
  void backward_input(const Tensor& dy, const Param& w, const Tensor& dx, float beta = 0.0f) const;
  // w.grad (+)= dy^T x for each (dy, w) of one input x; the first write of a step
  // replaces (grad_beta).
  struct Grad {
    const Tensor& dy;
    Param& w;
  };
  void backward_weight(const Tensor& x, std::initializer_list<Grad> grads) const;

  // The experts' grouped products (kernels/grouped_gemm.h): rows offsets[e] ..
  // offsets[e+1] of x against w [E, O, K] (or [O, K], one group) and a bias [E, O] (or
  // [O]), as there; with fp8 the bias is added after the product (kernels/fp8_quant.h).
  void grouped_forward(const Tensor& x, const Param& w, const Tensor& bias, const Tensor& offsets,
                       const Tensor& y) const;
  void grouped_backward_input(const Tensor& dy, const Param& w, const Tensor& offsets, const Tensor& dx) const;
  void grouped_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, Param& w,
                               const Tensor& dbias, bool accumulate) const;

 private:
  Fp8 mode_ = Fp8::none;
  bool pow2_ = true;
};

// The FP8 cache of a weight [O, K] or [E, O, K] (Param::fp8): its shapes.
Shape fp8_block_scale_shape(const Shape& w, bool transposed);

}  // namespace mt
