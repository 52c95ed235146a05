// Param: a block of parameters as the optimizer, the sharding and the checkpoints see
// it. It lives here, below models/ and parallel/, because all of them name it and a
// lower layer may not include an upper one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

// A weight's blockwise FP8 copy (training.fp8 = blockwise, models/linear.h): the codes of
// `compute` (for such a weight the f32 master itself: nothing reads a bf16 copy of it) in
// 128x128 blocks and those of its transpose (the input gradient's operand), with their
// block scales (kernels/fp8_quant.h has the layouts). Written whenever the weights change
// (refresh_compute_weights, the optimizer).
struct Fp8Copy {
  Tensor q, scale, qt, scale_t;
  bool pow2 = true;
  size_t bytes() const { return q.nbytes() + scale.nbytes() + qt.nbytes() + scale_t.nbytes(); }
};

// Expert weights are fused (all experts of a layer in one block) and are sharded
// differently from the rest, hence `expert`.
struct Param {
  std::string name;  // an internal name, e.g. "layers.3.experts.gate_up"
  Tensor value;      // f32 master weights
  Tensor grad;       // f32, accumulated over micro-batches
  Tensor compute;    // what the matrix products read: a bf16 copy on the GPU, `value` on the CPU
  Fp8Copy fp8;       // empty unless the products read this weight in FP8
  bool matrix = false;  // 2-D and up: decayed when optimizer.decay = "matrices"
  bool expert = false;
  // offload.experts: `value` lives in host memory (pinned on a GPU run) and `compute` on
  // the device; AdamW streams its update through device staging (train/offload.h).
  bool offloaded = false;
  // offload.experts = weights: `compute` and `grad` live in host memory too (pinned, and
  // mapped on a GPU run: a kernel reads and writes them there over PCIe), and the
  // decoder's expert cache brings them through device frames (models/expert_cache.h).
  bool cached = false;
  // The part of the model it belongs to: -1 the embedding, 0 .. L-1 a decoder layer, L
  // the head. Sharding cuts units by (layer, expert); pipeline stages will cut by it.
  int64_t layer = -1;
  // Whether this step has written `grad` yet. A gradient's first write of a step
  // replaces what is there and later ones add, in whatever order a schedule runs the
  // micro-batches, so no pass zeroes the gradients. Cleared by clear_gradient_marks at
  // a step's start (and by ZeRO-3 when a layer's gradients start afresh in its slot).
  bool grad_started = false;
};

inline void clear_gradient_marks(std::vector<Param>& params) {
  for (Param& p : params) p.grad_started = false;
}

}  // namespace mt
