// Dense matrix products. CPU: OpenBLAS sgemm.
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// c[M,N] = alpha * op(a) @ op(b) + beta * c, where op(x) = x^T when its flag is set.
// a is [M,K] ([K,M] transposed), b is [K,N] ([N,K] transposed); all f32, 2-D.
void gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b, float alpha = 1.0f,
          float beta = 0.0f);

// Gradients of c = op(a) @ op(b) given dc. Either of da, db may be an empty Tensor
// (not computed), which is how the B/W split asks for one half. With accumulate the
// results are added to da/db instead of overwriting them.
void gemm_backward(const Tensor& a, const Tensor& b, const Tensor& dc, bool trans_a, bool trans_b, const Tensor& da,
                   const Tensor& db, bool accumulate);

}  // namespace mt::cpu
