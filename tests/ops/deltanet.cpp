#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <sstream>
#include <string>

#include "kernels/deltanet.h"
#include "ops/cases.h"

namespace mt::test {

namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace

OpCase causal_conv1d_silu_case(int64_t batch, int64_t tokens, int64_t channels, int64_t kernel) {
  const Shape shape{batch, tokens, channels};
  std::ostringstream name;
  name << "causal_conv1d_silu B=" << batch << " T=" << tokens << " C=" << channels << " K=" << kernel;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", shape, -2.0, 2.0}, {"w", {channels, kernel}, -1.0, 1.0}};
  c.outputs = {{"y"}};
  // Written as torch's conv1d: the output at t sees inputs t - (K-1) .. t of its own
  // sequence, tap j on input t - (K-1) + j; earlier inputs are the zero padding.
  c.reference = [=](const Vecs& in) {
    Vec y(shape.numel());
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t ch = 0; ch < channels; ++ch) {
          double pre = 0;
          for (int64_t j = 0; j < kernel; ++j) {
            const int64_t src = t - (kernel - 1) + j;
            if (src >= 0) pre += in[1][ch * kernel + j] * in[0][(b * tokens + src) * channels + ch];
          }
          y[(b * tokens + t) * channels + ch] = pre * sigmoid(pre);
        }
    return Vecs{y};
  };
  c.forward = [=](const Vecs& in) {
    auto x = HostTensor::f32(shape, in[0]), w = HostTensor::f32({channels, kernel}, in[1]);
    auto y = HostTensor::zeros(shape);
    cpu::causal_conv1d_silu_forward(x.t, w.t, y.t);
    return Vecs{y.vec()};
  };
  // dx in place of dy (the header allows it); dw starts from w's values, which the
  // kernel must add to and which are subtracted again here, in float64.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto x = HostTensor::f32(shape, in[0]), w = HostTensor::f32({channels, kernel}, in[1]);
    auto d = HostTensor::f32(shape, dout[0]), dw = HostTensor::f32({channels, kernel}, in[1]);
    cpu::causal_conv1d_silu_backward(x.t, w.t, d.t, d.t, dw.t);
    Vecs grads{d.vec(), dw.vec()};
    for (size_t j = 0; j < grads[1].size(); ++j) grads[1][j] -= in[1][j];
    return grads;
  };
  return c;
}

OpCase deltanet_gates_case(int64_t rows, int64_t heads, bool above_threshold) {
  std::ostringstream name;
  name << "deltanet_gates N=" << rows << " H=" << heads << (above_threshold ? " above_threshold" : "");
  OpCase c;
  c.name = name.str();
  // a + dt_bias in [-4, 4], or in [20.5, 24.5] (softplus is the identity there): either
  // way the finite-difference step never crosses the threshold at 20.
  const double a_lo = above_threshold ? 21.0 : -2.0, a_hi = above_threshold ? 24.0 : 2.0;
  const double dt_lo = above_threshold ? -0.5 : -2.0, dt_hi = above_threshold ? 0.5 : 2.0;
  c.inputs = {{"a", {rows, heads}, a_lo, a_hi},
              {"b", {rows, heads}, -4.0, 4.0},
              {"A_log", {heads}, -1.0, 1.0},
              {"dt_bias", {heads}, dt_lo, dt_hi}};
  c.outputs = {{"g"}, {"beta"}};
  c.reference = [=](const Vecs& in) {
    Vec g(rows * heads), beta(rows * heads);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const double u = in[0][r * heads + h] + in[3][h];
        const double softplus = u > 20.0 ? u : std::log1p(std::exp(u));
        g[r * heads + h] = -std::exp(in[2][h]) * softplus;
        beta[r * heads + h] = sigmoid(in[1][r * heads + h]);
      }
    return Vecs{g, beta};
  };
  c.forward = [=](const Vecs& in) {
    auto a = HostTensor::f32({rows, heads}, in[0]), b = HostTensor::f32({rows, heads}, in[1]);
    auto A_log = HostTensor::f32({heads}, in[2]), dt_bias = HostTensor::f32({heads}, in[3]);
    auto g = HostTensor::zeros({rows, heads}), beta = HostTensor::zeros({rows, heads});
    cpu::deltanet_gates_forward(a.t, b.t, A_log.t, dt_bias.t, g.t, beta.t);
    return Vecs{g.vec(), beta.vec()};
  };
  // da and db start stale (a's and b's values) and must be overwritten; dA_log and
  // ddt_bias start from A_log's and dt_bias's values, added to and subtracted again here.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto a = HostTensor::f32({rows, heads}, in[0]), b = HostTensor::f32({rows, heads}, in[1]);
    auto A_log = HostTensor::f32({heads}, in[2]), dt_bias = HostTensor::f32({heads}, in[3]);
    auto dg = HostTensor::f32({rows, heads}, dout[0]), dbeta = HostTensor::f32({rows, heads}, dout[1]);
    auto da = HostTensor::f32({rows, heads}, in[0]), db = HostTensor::f32({rows, heads}, in[1]);
    auto dA_log = HostTensor::f32({heads}, in[2]), ddt_bias = HostTensor::f32({heads}, in[3]);
    cpu::deltanet_gates_backward(a.t, b.t, A_log.t, dt_bias.t, dg.t, dbeta.t, da.t, db.t, dA_log.t, ddt_bias.t);
    Vecs grads{da.vec(), db.vec(), dA_log.vec(), ddt_bias.vec()};
    for (size_t i = 2; i < grads.size(); ++i)
      for (size_t j = 0; j < grads[i].size(); ++j) grads[i][j] -= in[i][j];
    return grads;
  };
  return c;
}

namespace {

void expect_error(const std::function<void()>& call, const std::string& part) {
  try {
    call();
    ADD_FAILURE() << "accepted, expected an error mentioning '" << part << "'";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find(part), std::string::npos) << err.what();
  }
}

TEST(CausalConv1dSilu, RejectsMismatchedShapes) {
  auto x = HostTensor::f32({2, 3, 5}), y = HostTensor::f32({2, 3, 5}), w = HostTensor::f32({4, 4});
  expect_error([&] { cpu::causal_conv1d_silu_forward(x.t, w.t, y.t); },
               "causal_conv1d_silu w should be [C,K] = [5,K] with K >= 1 for x f32[2,3,5]@cpu, got f32[4,4]@cpu");
  auto flat = HostTensor::f32({6, 5}), w5 = HostTensor::f32({5, 4});
  expect_error([&] { cpu::causal_conv1d_silu_forward(flat.t, w5.t, y.t); },
               "causal_conv1d_silu x should be [B,T,C], got f32[6,5]@cpu");
  auto dw = HostTensor::f32({5, 3});
  expect_error([&] { cpu::causal_conv1d_silu_backward(x.t, w5.t, y.t, y.t, dw.t); },
               "causal_conv1d_silu dw should be f32[5,4], got f32[5,3]@cpu");
}

TEST(DeltanetGates, RejectsMismatchedShapes) {
  auto a = HostTensor::f32({4, 3}), b = HostTensor::f32({4, 3}), g = HostTensor::f32({4, 3});
  auto beta = HostTensor::f32({4, 3}), h3 = HostTensor::f32({3}), h2 = HostTensor::f32({2});
  expect_error([&] { cpu::deltanet_gates_forward(a.t, b.t, h2.t, h3.t, g.t, beta.t); },
               "deltanet_gates A_log should be f32[3], got f32[2]@cpu");
  auto b_wide = HostTensor::f32({4, 4});
  expect_error([&] { cpu::deltanet_gates_forward(a.t, b_wide.t, h3.t, h3.t, g.t, beta.t); },
               "deltanet_gates b should be f32[4,3], got f32[4,4]@cpu");
}

}  // namespace

}  // namespace mt::test
