// Token embedding lookup.
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// out[n] = table[ids[n]]: table f32 [V,D], ids i32 [N] in [0,V), out f32 [N,D].
// An id out of range is an error naming its position and value.
void embedding_forward(const Tensor& table, const Tensor& ids, const Tensor& out);

// dtable[ids[n]] += dout[n] (dtable accumulates; zero it first for a fresh gradient).
void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable);

}  // namespace mt::cpu
