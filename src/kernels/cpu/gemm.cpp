#include "kernels/gemm.h"

#include <cblas.h>

#include <algorithm>

namespace mt::cpu {

namespace {

struct Dims {
  int64_t m, n, k;
};

Dims check_gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool ta, bool tb) {
  MT_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2)
      << "gemm wants 2-D tensors, got a " << a.str() << ", b " << b.str() << ", c " << c.str();
  MT_CHECK(a.dtype == DType::f32 && b.dtype == DType::f32 && c.dtype == DType::f32)
      << "cpu gemm is f32: a " << a.str() << ", b " << b.str() << ", c " << c.str();
  Dims d{ta ? a.dim(1) : a.dim(0), tb ? b.dim(0) : b.dim(1), ta ? a.dim(0) : a.dim(1)};
  int64_t kb = tb ? b.dim(1) : b.dim(0);
  MT_CHECK(kb == d.k && c.dim(0) == d.m && c.dim(1) == d.n)
      << "gemm shapes disagree: op(a) " << d.m << "x" << d.k << " (a " << a.str() << (ta ? "^T" : "") << "), op(b) "
      << kb << "x" << d.n << " (b " << b.str() << (tb ? "^T" : "") << "), c " << c.str();
  return d;
}

}  // namespace

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // OpenBLAS's own thread pool and our OpenMP loops spin against each other (a 1000x
  // slowdown measured on 2 cores): BLAS runs on one thread, OpenMP parallelises around it.
  [[maybe_unused]] static const bool single_threaded = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  if (k == 0) {
    // BLAS leaves c untouched only for beta == 1; make the empty sum explicit.
    for (int64_t i = 0; i < m * n; ++i) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(std::max<int64_t>(lda, 1)), b,
              static_cast<int>(std::max<int64_t>(ldb, 1)), beta, c, static_cast<int>(std::max<int64_t>(ldc, 1)));
}

void gemm(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b, float alpha, float beta) {
  Dims d = check_gemm(a, b, c, trans_a, trans_b);
  sgemm(trans_a, trans_b, d.m, d.n, d.k, alpha, a.f32(), a.dim(1), b.f32(), b.dim(1), beta, c.f32(), d.n);
}

}  // namespace mt::cpu
