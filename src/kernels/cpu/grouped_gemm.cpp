#include "kernels/grouped_gemm.h"

#include <algorithm>

#include "kernels/gemm.h"

namespace mt::cpu {

namespace {

// Segments must lie in [0, N) in expert order; a bad offsets tensor would otherwise
// read or write out of bounds inside BLAS, far from the caller's mistake.
const int32_t* check_offsets(const Tensor& offsets, int64_t experts, int64_t rows) {
  check_tensor(offsets, "grouped_gemm offsets", DType::i32, {experts + 1});
  const int32_t* o = offsets.i32();
  MT_CHECK(o[0] >= 0) << "grouped_gemm offsets[0] should be a row index >= 0, got " << o[0];
  for (int64_t e = 0; e < experts; ++e)
    MT_CHECK(o[e] <= o[e + 1]) << "grouped_gemm offsets must be non-decreasing: expert " << e << " spans rows [" << o[e]
                               << ", " << o[e + 1] << ")";
  MT_CHECK(o[experts] <= rows) << "grouped_gemm offsets[" << experts << "] should be at most the row count " << rows
                               << ", got " << o[experts];
  return o;
}

}  // namespace

void grouped_gemm(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y) {
  MT_CHECK(x.ndim() == 2 && w.ndim() == 3)
      << "grouped_gemm wants x [N,K] and w [E,O,K], got x " << x.str() << ", w " << w.str();
  int64_t n = x.dim(0), k = x.dim(1), experts = w.dim(0), o = w.dim(1);
  check_tensor(x, "grouped_gemm x", DType::f32, {n, k});
  check_tensor(w, "grouped_gemm w", DType::f32, {experts, o, k});
  check_tensor(y, "grouped_gemm y", DType::f32, {n, o});
  if (bias.data != nullptr) check_tensor(bias, "grouped_gemm bias", DType::f32, {experts, o});
  const int32_t* off = check_offsets(offsets, experts, n);
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* bp = bias.data != nullptr ? bias.f32() : nullptr;
  float* yp = y.f32();
  for (int64_t e = 0; e < experts; ++e) {
    int64_t r0 = off[e], rows = off[e + 1] - off[e];
    if (rows == 0 || o == 0) continue;
    float* ye = yp + r0 * o;
    // The bias goes in first so the product can accumulate onto it (beta = 1).
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < o; ++j) ye[r * o + j] = bp != nullptr ? bp[e * o + j] : 0.0f;
    if (k > 0) sgemm(false, true, rows, o, k, 1.0f, xp + r0 * k, k, wp + e * o * k, k, 1.0f, ye, o);
  }
}

void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx) {
  MT_CHECK(dy.ndim() == 2 && w.ndim() == 3 && dx.ndim() == 2)
      << "grouped_gemm backward wants dy [N,O], w [E,O,K], dx [N,K], got dy " << dy.str() << ", w " << w.str()
      << ", dx " << dx.str();
  int64_t n = dy.dim(0), experts = w.dim(0), o = w.dim(1), k = w.dim(2);
  check_tensor(dy, "grouped_gemm dy", DType::f32, {n, o});
  check_tensor(w, "grouped_gemm w", DType::f32, {experts, o, k});
  check_tensor(dx, "grouped_gemm dx", DType::f32, {n, k});
  const int32_t* off = check_offsets(offsets, experts, n);
  const float* g = dy.f32();
  const float* wp = w.f32();
  float* out = dx.f32();
  for (int64_t e = 0; e < experts; ++e) {
    int64_t r0 = off[e], rows = off[e + 1] - off[e];
    if (rows == 0 || k == 0) continue;
    if (o == 0)
      std::fill(out + r0 * k, out + (r0 + rows) * k, 0.0f);
    else
      sgemm(false, false, rows, k, o, 1.0f, g + r0 * o, o, wp + e * o * k, k, 0.0f, out + r0 * k, k);
  }
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                  const Tensor& dbias, bool accumulate) {
  MT_CHECK(x.ndim() == 2 && dy.ndim() == 2 && dw.ndim() == 3)
      << "grouped_gemm backward wants x [N,K], dy [N,O], dw [E,O,K], got x " << x.str() << ", dy " << dy.str()
      << ", dw " << dw.str();
  int64_t n = x.dim(0), k = x.dim(1), experts = dw.dim(0), o = dw.dim(1);
  check_tensor(x, "grouped_gemm x", DType::f32, {n, k});
  check_tensor(dy, "grouped_gemm dy", DType::f32, {n, o});
  check_tensor(dw, "grouped_gemm dw", DType::f32, {experts, o, k});
  if (dbias.data != nullptr) check_tensor(dbias, "grouped_gemm dbias", DType::f32, {experts, o});
  const int32_t* off = check_offsets(offsets, experts, n);
  const float* xp = x.f32();
  const float* g = dy.f32();
  float* dwp = dw.f32();
  float* dbp = dbias.data != nullptr ? dbias.f32() : nullptr;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t r0 = off[e], rows = off[e + 1] - off[e];
    float* dwe = dwp + e * o * k;
    if (rows > 0 && o > 0 && k > 0)
      sgemm(true, false, o, k, rows, 1.0f, g + r0 * o, o, xp + r0 * k, k, accumulate ? 1.0f : 0.0f, dwe, k);
    else if (!accumulate)
      std::fill(dwe, dwe + o * k, 0.0f);
    if (dbp == nullptr) continue;
    // Rows in order per column: the same sum whatever the thread count.
    for (int64_t j = 0; j < o; ++j) {
      float s = 0.0f;
      for (int64_t r = r0; r < r0 + rows; ++r) s += g[r * o + j];
      dbp[e * o + j] = accumulate ? dbp[e * o + j] + s : s;
    }
  }
}

}  // namespace mt::cpu
