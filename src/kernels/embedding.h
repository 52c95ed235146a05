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

namespace mt::cuda {

// table f32 or bf16 (a f32 master table is read directly, no bf16 copy), out f32 or
// bf16, ids i32 on the GPU. An id out of range gives a NaN row instead of an error
// (reporting it would need a host sync). The backward adds dout (f32 or bf16) into
// the f32 dtable with f32 atomics: repeated ids add in an unspecified order.
void embedding_forward(const Tensor& table, const Tensor& ids, const Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable);

}  // namespace mt::cuda

namespace mt {

inline void embedding_forward(const Tensor& table, const Tensor& ids, const Tensor& out) {
  return MT_BACKEND(out.device == Device::cuda, embedding_forward(table, ids, out));
}

inline void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  return MT_BACKEND(dtable.device == Device::cuda, embedding_backward(ids, dout, dtable));
}

}  // namespace mt
