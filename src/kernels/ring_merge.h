// Ring attention's bookkeeping on the GPU (parallel/context_parallel.cpp; the CPU's is
// host code there, fp32 throughout, so only mt::cuda declares these). The layout is the
// ring's: a rank holds two zigzag chunks of C positions in each batch row, so its tensors
// are [B,2C,H,Dh] (lse [B,H,2C]) and a block is the [1,C,H,Dh] (lse [1,H,C]) of one batch
// row b and one slot (0: the first chunk, 1: the second). Dh is the tensor's own head dim:
// the merge's is out's (v's, which MLA makes narrower than q's).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mt::cuda {

// Folds a block's result into the running one: acc f32 [B,2C,H,Dh] and lse f32
// [B,H,2C] hold the merge of the blocks so far (lse -inf where a row has seen no key
// yet, acc 0 there), o bf16 or f32 [1,C,H,Dh] and l f32 [1,H,C] are block (b, slot)'s
// output and lse. Softmax over the union of the keys = the two softmaxes weighted by
// exp(lse_part - lse_union), in f32; a row whose block saw no key (l -inf) is left as
// it is, and a row's first block is copied.
void ring_merge(const Tensor& o, const Tensor& l, int64_t b, int slot, const Tensor& acc, const Tensor& lse);

// acc += x elementwise, x f32 or bf16, acc f32, the same element count: the ring's fp32
// sums of the blocks' bf16 gradients, so no partial sum is rounded to bf16.
void accumulate(const Tensor& x, const Tensor& acc);

// out f32 [1,H,C] = block (b, slot)'s rows of lse f32 [B,H,2C], as the backward's
// blocks take their lse.
void lse_block(const Tensor& lse, int64_t b, int slot, const Tensor& out);

}  // namespace mt::cuda
