#include <cmath>
#include <sstream>

#include "kernels/rmsnorm.h"
#include "ops/cases.h"

namespace mt::test {

OpCase rmsnorm_case(int64_t rows, int64_t dim, float eps) {
  std::ostringstream name;
  name << "rmsnorm N=" << rows << " D=" << dim << " eps=" << eps;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", {rows, dim}, -2.0, 2.0}, {"w", {dim}, 0.5, 1.5}};
  c.outputs = {{"y"}, {"rstd", false}};
  c.reference = [=](const Vecs& in) {
    Vec y(rows * dim), r(rows);
    for (int64_t i = 0; i < rows; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < dim; ++j) ss += in[0][i * dim + j] * in[0][i * dim + j];
      r[i] = 1.0 / std::sqrt(ss / dim + static_cast<double>(eps));
      for (int64_t j = 0; j < dim; ++j) y[i * dim + j] = in[0][i * dim + j] * r[i] * in[1][j];
    }
    return Vecs{y, r};
  };
  c.forward = [=](const Vecs& in) {
    auto x = HostTensor::f32({rows, dim}, in[0]), w = HostTensor::f32({dim}, in[1]);
    auto y = HostTensor::zeros({rows, dim}), r = HostTensor::zeros({rows});
    cpu::rmsnorm_forward(x.t, w.t, eps, y.t, r.t);
    return Vecs{y.vec(), r.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto x = HostTensor::f32({rows, dim}, in[0]), w = HostTensor::f32({dim}, in[1]);
    auto y = HostTensor::zeros({rows, dim}), r = HostTensor::zeros({rows});
    cpu::rmsnorm_forward(x.t, w.t, eps, y.t, r.t);
    auto dy = HostTensor::f32({rows, dim}, dout[0]);
    auto dx = HostTensor::zeros({rows, dim}), dw = HostTensor::zeros({dim});
    cpu::rmsnorm_backward(x.t, w.t, r.t, dy.t, dx.t, dw.t);
    return Vecs{dx.vec(), dw.vec()};
  };
  return c;
}

}  // namespace mt::test
