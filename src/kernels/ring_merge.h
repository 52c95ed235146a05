// Ring attention's bookkeeping (parallel/context_parallel.cpp). The layout is the ring's:
// a rank holds two zigzag chunks of C positions in each batch row, so its tensors are
// [B,2C,H,Dh] (lse [B,H,2C]) and a block is the [1,C,H,Dh] (lse [1,H,C]) of one batch row
// b and one slot (0: the first chunk, 1: the second). Dh is the tensor's own head dim: the
// merge's is out's (v's, which MLA makes narrower than q's).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mt::cpu {

// Folds a block's result into the running one: acc f32 [B,2C,H,Dh] and lse f32
// [B,H,2C] hold the merge of the blocks so far (lse -inf where a row has seen no key
// yet, acc 0 there), o f32 [1,C,H,Dh] and l f32 [1,H,C] are block (b, slot)'s output and
// lse. Softmax over the union of the keys = the two softmaxes weighted by
// exp(lse_part - lse_union), in double; a row whose block saw no key (l -inf) is left as
// it is, and a row's first block is copied.
void ring_merge(const Tensor& o, const Tensor& l, int64_t b, int slot, const Tensor& acc, const Tensor& lse);

// acc += x elementwise, both f32 of the same element count: the ring's sums of the
// blocks' gradients.
void accumulate(const Tensor& x, const Tensor& acc);

}  // namespace mt::cpu

// The CUDA backend: the merge in f32 with o bf16 or f32, and accumulate's x f32 or bf16
// (acc f32): the fp32 sums of the blocks' bf16 gradients, so no partial sum is rounded
// to bf16.
namespace mt::cuda {

void ring_merge(const Tensor& o, const Tensor& l, int64_t b, int slot, const Tensor& acc, const Tensor& lse);
void accumulate(const Tensor& x, const Tensor& acc);

}  // namespace mt::cuda

namespace mt {

inline void ring_merge(const Tensor& o, const Tensor& l, int64_t b, int slot, const Tensor& acc, const Tensor& lse) {
  return MT_BACKEND(acc.device == Device::cuda, ring_merge(o, l, b, slot, acc, lse));
}

inline void accumulate(const Tensor& x, const Tensor& acc) {
  return MT_BACKEND(acc.device == Device::cuda, accumulate(x, acc));
}

}  // namespace mt
