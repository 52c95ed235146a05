#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "kernels/swiglu.h"
#include "ops/cases.h"

namespace mt::test {

OpCase swiglu_case(int64_t rows, int64_t inter) {
  std::ostringstream name;
  name << "swiglu N=" << rows << " I=" << inter;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"gu", {rows, 2 * inter}, -4.0, 4.0}};
  c.outputs = {{"h"}};
  c.reference = [=](const Vecs& in) {
    Vec h(rows * inter);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < inter; ++i) {
        double gate = in[0][r * 2 * inter + i], up = in[0][r * 2 * inter + inter + i];
        h[r * inter + i] = gate / (1.0 + std::exp(-gate)) * up;
      }
    return Vecs{h};
  };
  c.forward = [=](const Vecs& in) {
    auto gu = HostTensor::f32({rows, 2 * inter}, in[0]), h = HostTensor::f32({rows, inter});
    cpu::swiglu_forward(gu.t, h.t);
    return Vecs{h.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto gu = HostTensor::f32({rows, 2 * inter}, in[0]), dh = HostTensor::f32({rows, inter}, dout[0]);
    auto dgu = HostTensor::f32({rows, 2 * inter}, in[0]);
    cpu::swiglu_backward(gu.t, dh.t, dgu.t);
    return Vecs{dgu.vec()};
  };
  return c;
}

// Inputs in [-10, 10]: with GPT-OSS's limit of 7 both clamps bind in some elements.
OpCase clamped_swiglu_case(int64_t rows, int64_t inter, float limit, float alpha) {
  std::ostringstream name;
  name << "clamped_swiglu N=" << rows << " I=" << inter << " limit=" << limit << " alpha=" << alpha;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"gu", {rows, 2 * inter}, -10.0, 10.0}};
  c.outputs = {{"h"}};
  c.reference = [=](const Vecs& in) {
    double lim = limit, a = alpha;
    Vec h(rows * inter);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < inter; ++i) {
        double gate = std::min(in[0][r * 2 * inter + 2 * i], lim);
        double up = std::clamp(in[0][r * 2 * inter + 2 * i + 1], -lim, lim);
        h[r * inter + i] = (up + 1.0) * gate / (1.0 + std::exp(-a * gate));
      }
    return Vecs{h};
  };
  c.forward = [=](const Vecs& in) {
    auto gu = HostTensor::f32({rows, 2 * inter}, in[0]), h = HostTensor::f32({rows, inter});
    cpu::clamped_swiglu_forward(gu.t, limit, alpha, h.t);
    return Vecs{h.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto gu = HostTensor::f32({rows, 2 * inter}, in[0]), dh = HostTensor::f32({rows, inter}, dout[0]);
    auto dgu = HostTensor::f32({rows, 2 * inter}, in[0]);
    cpu::clamped_swiglu_backward(gu.t, limit, alpha, dh.t, dgu.t);
    return Vecs{dgu.vec()};
  };
  return c;
}

namespace {

// torch.clamp passes the gradient at the boundary itself and stops it just beyond;
// random inputs never land exactly on a limit, so this is checked by hand.
TEST(ClampedSwiglu, GradientAtClampBoundaries) {
  float limit = 7.0f, beyond = std::nextafter(limit, 100.0f);
  // Pairs (gate, up): on the boundaries, then just beyond them.
  auto gu = HostTensor::f32({1, 6}, {limit, limit, 0.5, -limit, beyond, -beyond});
  auto dh = HostTensor::f32({1, 3}, {1.0, 1.0, 1.0}), dgu = HostTensor::f32({1, 6});
  cpu::clamped_swiglu_backward(gu.t, limit, 1.702f, dh.t, dgu.t);
  Vec g = dgu.vec();
  EXPECT_NE(g[0], 0.0) << "gate == limit";
  EXPECT_NE(g[1], 0.0) << "up == limit";
  EXPECT_NE(g[3], 0.0) << "up == -limit";
  EXPECT_EQ(g[4], 0.0) << "gate above limit";
  EXPECT_EQ(g[5], 0.0) << "up below -limit";
}

}  // namespace

OpCase sigmoid_gate_case(int64_t rows, int64_t cols, bool row_gate) {
  std::ostringstream name;
  name << "sigmoid_gate N=" << rows << " C=" << cols << (row_gate ? " row" : "");
  const int64_t gc = row_gate ? 1 : cols;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"v", {rows, cols}, -2.0, 2.0}, {"s", {rows, gc}, -4.0, 4.0}};
  c.outputs = {{"out"}};
  c.reference = [=](const Vecs& in) {
    Vec out(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j)
        out[r * cols + j] = in[0][r * cols + j] / (1.0 + std::exp(-in[1][r * gc + (row_gate ? 0 : j)]));
    return Vecs{out};
  };
  c.forward = [=](const Vecs& in) {
    auto v = HostTensor::f32({rows, cols}, in[0]), s = HostTensor::f32({rows, gc}, in[1]);
    auto out = HostTensor::zeros({rows, cols});
    cpu::sigmoid_gate_forward(v.t, s.t, out.t);
    return Vecs{out.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto v = HostTensor::f32({rows, cols}, in[0]), s = HostTensor::f32({rows, gc}, in[1]);
    auto d = HostTensor::f32({rows, cols}, dout[0]), ds = HostTensor::zeros({rows, gc});
    cpu::sigmoid_gate_backward(v.t, s.t, d.t, d.t, ds.t);  // dv in place of dout
    return Vecs{d.vec(), ds.vec()};
  };
  return c;
}

}  // namespace mt::test
