#include <algorithm>
#include <cmath>
#include <sstream>

#include "kernels/gemm.h"
#include "ops/cases.h"
#include "test_util.h"

namespace mt::test {

OpCase gemm_case(int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, float beta) {
  Shape sa = trans_a ? Shape{k, m} : Shape{m, k};
  Shape sb = trans_b ? Shape{n, k} : Shape{k, n};
  std::ostringstream name;
  name << "gemm M=" << m << " N=" << n << " K=" << k << " ta=" << trans_a << " tb=" << trans_b << " beta=" << beta;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"a", sa}, {"b", sb}, {"c0", {m, n}}};
  c.outputs = {{"c"}};
  // Rounding in fp32 dot products of K terms grows like sqrt(K).
  c.fwd_tol = 1e-5 * std::max<double>(1.0, std::sqrt(static_cast<double>(k)));
  // Element (i, p) of op(x) for a row-major x stored [rows, cols].
  auto at = [](const Vec& x, bool t, int64_t cols_stored, int64_t i, int64_t p) {
    return t ? x[p * cols_stored + i] : x[i * cols_stored + p];
  };
  c.reference = [=](const Vecs& in) {
    Vec out(m * n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) s += at(in[0], trans_a, sa[1], i, p) * at(in[1], trans_b, sb[1], p, j);
        out[i * n + j] = s + beta * in[2][i * n + j];
      }
    return Vecs{out};
  };
  c.forward = [=](const Vecs& in) {
    auto a = HostTensor::f32(sa, in[0]), b = HostTensor::f32(sb, in[1]), out = HostTensor::f32({m, n}, in[2]);
    cpu::gemm(a.t, b.t, out.t, trans_a, trans_b, 1.0f, beta);
    return Vecs{out.vec()};
  };
  // The backward of the accumulate form: dA and dB from gemm_backward (written into
  // non-zero buffers with accumulate=false, so stale values would show), dC0 = beta*dC.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto a = HostTensor::f32(sa, in[0]), b = HostTensor::f32(sb, in[1]), dc = HostTensor::f32({m, n}, dout[0]);
    auto da = HostTensor::f32(sa, in[0]), db = HostTensor::f32(sb, in[1]);
    gemm_backward(a.t, b.t, dc.t, trans_a, trans_b, da.t, db.t, false);
    Vec dc0 = dout[0];
    for (double& x : dc0) x *= beta;
    return Vecs{da.vec(), db.vec(), dc0};
  };
  return c;
}

}  // namespace mt::test
