#include <cmath>
#include <sstream>

#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "ops/cases.h"

namespace mt::test {

OpCase rmsnorm_case(int64_t rows, int64_t dim, float eps, bool with_residual, float wo) {
  std::ostringstream name;
  name << "rmsnorm N=" << rows << " D=" << dim << " eps=" << eps << (with_residual ? " residual" : "");
  if (wo != 0.0f) name << " offset=" << wo;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", {rows, dim}, -2.0, 2.0}, {"w", {dim}, 0.5 - wo, 1.5 - wo}};
  c.outputs = {{"y"}, {"rstd", false}};
  // A decoder layer's skip path: x also goes on unchanged, so its gradient is the norm's
  // plus the skip output's, which the kernel's residual argument adds in the same pass.
  if (with_residual) c.outputs.push_back({"skip"});
  c.reference = [=](const Vecs& in) {
    Vec y(rows * dim), r(rows);
    for (int64_t i = 0; i < rows; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < dim; ++j) ss += in[0][i * dim + j] * in[0][i * dim + j];
      r[i] = 1.0 / std::sqrt(ss / dim + static_cast<double>(eps));
      for (int64_t j = 0; j < dim; ++j) y[i * dim + j] = in[0][i * dim + j] * r[i] * (in[1][j] + wo);
    }
    return with_residual ? Vecs{y, r, in[0]} : Vecs{y, r};
  };
  c.forward = [=](const Vecs& in) {
    auto x = HostTensor::f32({rows, dim}, in[0]), w = HostTensor::f32({dim}, in[1]);
    auto y = HostTensor::zeros({rows, dim}), r = HostTensor::zeros({rows});
    cpu::rmsnorm_forward(x.t, w.t, eps, y.t, r.t, wo);
    return with_residual ? Vecs{y.vec(), r.vec(), x.vec()} : Vecs{y.vec(), r.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto x = HostTensor::f32({rows, dim}, in[0]), w = HostTensor::f32({dim}, in[1]);
    auto y = HostTensor::zeros({rows, dim}), r = HostTensor::zeros({rows});
    cpu::rmsnorm_forward(x.t, w.t, eps, y.t, r.t, wo);
    auto dy = HostTensor::f32({rows, dim}, dout[0]);
    auto skip = HostTensor::f32({rows, dim}, with_residual ? dout[2] : Vec());
    auto dx = HostTensor::zeros({rows, dim}), dw = HostTensor::zeros({dim});
    cpu::rmsnorm_backward(x.t, w.t, r.t, dy.t, dx.t, dw.t, with_residual ? skip.t : Tensor(), wo);
    return Vecs{dx.vec(), dw.vec()};
  };
  return c;
}

OpCase rmsnorm_rope_case(int64_t batch, int64_t heads, int64_t dim, int64_t rotary_dim,
                         const std::vector<int32_t>& positions, float wo) {
  const int64_t t = static_cast<int64_t>(positions.size()), rows = batch * t * heads, half = rotary_dim / 2;
  const Shape shape{batch, t, heads, dim};
  const float eps = 1e-6f;
  const double theta = 1e6;
  std::ostringstream name;
  name << "rmsnorm_rope B=" << batch << " T=" << t << " H=" << heads << " Dh=" << dim << " R=" << rotary_dim;
  if (wo != 0.0f) name << " offset=" << wo;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", shape, -2.0, 2.0}, {"w", {dim}, 0.5 - wo, 1.5 - wo}};
  c.outputs = {{"y"}, {"rstd", false}};
  c.reference = [=](const Vecs& in) {
    Vec y(rows * dim), r(rows);
    for (int64_t i = 0; i < rows; ++i) {
      const double* x = in[0].data() + i * dim;
      double ss = 0;
      for (int64_t j = 0; j < dim; ++j) ss += x[j] * x[j];
      r[i] = 1.0 / std::sqrt(ss / dim + static_cast<double>(eps));
      Vec n(dim);
      for (int64_t j = 0; j < dim; ++j) n[j] = x[j] * r[i] * (in[1][j] + wo);
      double* out = y.data() + i * dim;
      for (int64_t j = 0; j < dim; ++j) out[j] = n[j];
      const double pos = positions[(i / heads) % t];
      for (int64_t j = 0; j < half; ++j) {
        const double angle = pos * std::pow(theta, -2.0 * static_cast<double>(j) / rotary_dim);
        out[j] = n[j] * std::cos(angle) - n[j + half] * std::sin(angle);
        out[j + half] = n[j] * std::sin(angle) + n[j + half] * std::cos(angle);
      }
    }
    return Vecs{y, r};
  };
  struct Tables {
    HostTensor pos, cos, sin;
  };
  auto tables = [=] {
    cpu::RopeConfig cfg;
    cfg.theta = theta;
    cfg.rotary_dim = rotary_dim;
    Tables tb{HostTensor::i32({t}, positions), HostTensor::zeros({t, half}), HostTensor::zeros({t, half})};
    cpu::rope_tables(cpu::rope_freqs(cfg), tb.pos.t, tb.cos.t, tb.sin.t);
    return tb;
  };
  c.forward = [=](const Vecs& in) {
    const Tables tb = tables();
    auto x = HostTensor::f32(shape, in[0]), w = HostTensor::f32({dim}, in[1]);
    auto y = HostTensor::zeros(shape), r = HostTensor::zeros({rows});
    cpu::rmsnorm_rope_forward(x.t, w.t, eps, tb.cos.t, tb.sin.t, y.t, r.t, wo);
    return Vecs{y.vec(), r.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    const Tables tb = tables();
    auto x = HostTensor::f32(shape, in[0]), w = HostTensor::f32({dim}, in[1]);
    auto y = HostTensor::zeros(shape), r = HostTensor::zeros({rows});
    cpu::rmsnorm_rope_forward(x.t, w.t, eps, tb.cos.t, tb.sin.t, y.t, r.t, wo);
    auto dy = HostTensor::f32(shape, dout[0]), dx = HostTensor::zeros(shape), dw = HostTensor::zeros({dim});
    cpu::rmsnorm_rope_backward(x.t, w.t, r.t, tb.cos.t, tb.sin.t, dy.t, dx.t, dw.t, wo);
    return Vecs{dx.vec(), dw.vec()};
  };
  // fp32 angles, as in rope's rows.
  c.fwd_tol = 5e-5;
  return c;
}

}  // namespace mt::test
