// Dense matrix products. CPU: OpenBLAS sgemm. A product's backward is two more of them
// (dA = dC B^T, dB = A^T dC): the models write their B/W halves as gemm calls.
#pragma once

#include "core/tensor.h"

namespace mt::cpu {

// c[M,N] = alpha * op(a) @ op(b) + beta * c, where op(x) = x^T when its flag is set.
// a is [M,K] ([K,M] transposed), b is [K,N] ([N,K] transposed); all f32, 2-D.
void gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b, float alpha = 1.0f,
          float beta = 0.0f);

// The raw row-major product the CPU kernels share: c = alpha op(a) op(b) + beta c
// with leading dimensions lda/ldb/ldc (stored row widths). k = 0 scales c by beta.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace mt::cpu

namespace mt::cuda {

// cuBLASLt. a and b bf16, c bf16 or f32 (accumulation is f32 either way); beta = 0
// never reads c.
void gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b, float alpha = 1.0f,
          float beta = 0.0f);

}  // namespace mt::cuda

namespace mt {

inline void gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b, float alpha = 1.0f,
                 float beta = 0.0f) {
  return MT_BACKEND(c.device == Device::cuda, gemm(a, b, c, trans_a, trans_b, alpha, beta));
}

}  // namespace mt
