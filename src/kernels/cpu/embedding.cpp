#include "kernels/embedding.h"

#include <cstring>

namespace mt::cpu {

namespace {

void check_ids(const Tensor& ids, int64_t vocab) {
  MT_CHECK(ids.dtype == DType::i32 && ids.ndim() == 1) << "embedding ids should be i32[N], got " << ids.str();
  const int32_t* id = ids.i32();
  for (int64_t n = 0; n < ids.numel(); ++n)
    MT_CHECK(id[n] >= 0 && id[n] < vocab) << "token id " << id[n] << " at position " << n
                                          << " is outside the vocabulary [0, " << vocab << ")";
}

}  // namespace

void embedding_forward(const Tensor& table, const Tensor& ids, const Tensor& out) {
  MT_CHECK(table.ndim() == 2) << "embedding table should be [V,D], got " << table.str();
  int64_t vocab = table.dim(0), dim = table.dim(1), n = ids.numel();
  check_ids(ids, vocab);
  check_tensor(table, "embedding table", DType::f32, {vocab, dim});
  check_tensor(out, "embedding out", DType::f32, {n, dim});
  const int32_t* id = ids.i32();
  const float* w = table.f32();
  float* y = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) std::memcpy(y + t * dim, w + static_cast<int64_t>(id[t]) * dim, dim * sizeof(float));
}

void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  MT_CHECK(dtable.ndim() == 2) << "embedding gradient should be [V,D], got " << dtable.str();
  int64_t vocab = dtable.dim(0), dim = dtable.dim(1), n = ids.numel();
  check_ids(ids, vocab);
  check_tensor(dtable, "embedding dtable", DType::f32, {vocab, dim});
  check_tensor(dout, "embedding dout", DType::f32, {n, dim});
  const int32_t* id = ids.i32();
  const float* dy = dout.f32();
  float* dw = dtable.f32();
  // Parallel over columns: each thread owns a column range, so repeated ids never
  // race and the summation order (token order) is deterministic.
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < dim; c0 += 64) {
    int64_t c1 = c0 + 64 < dim ? c0 + 64 : dim;
    for (int64_t t = 0; t < n; ++t) {
      float* row = dw + static_cast<int64_t>(id[t]) * dim;
      for (int64_t c = c0; c < c1; ++c) row[c] += dy[t * dim + c];
    }
  }
}

}  // namespace mt::cpu
