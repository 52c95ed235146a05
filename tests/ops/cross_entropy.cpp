#include <cmath>
#include <sstream>

#include <gtest/gtest.h>

#include "kernels/cross_entropy.h"
#include "ops/cases.h"

namespace mt::test {

OpCase cross_entropy_case(int64_t rows, int64_t vocab, int64_t ignored) {
  constexpr int32_t kIgnore = -100;
  std::ostringstream name;
  name << "cross_entropy N=" << rows << " V=" << vocab << " ignored=" << ignored;
  std::vector<int32_t> labels = random_ints(rows * 7 + vocab, rows, 0, static_cast<int32_t>(vocab - 1));
  for (int64_t i = 0; i < ignored && i < rows; ++i) labels[(i * 5) % rows] = kIgnore;
  int64_t kept = 0;
  for (int32_t y : labels) kept += y != kIgnore;
  OpCase c;
  c.name = name.str();
  // Logits spread wide enough that the softmax is far from uniform.
  c.inputs = {{"logits", {rows, vocab}, -6.0, 6.0}};
  c.outputs = {{"loss"}, {"lse", false}};
  c.reference = [=](const Vecs& in) {
    Vec lse(rows);
    double sum = 0;
    for (int64_t i = 0; i < rows; ++i) {
      double s = 0;
      for (int64_t j = 0; j < vocab; ++j) s += std::exp(in[0][i * vocab + j]);
      lse[i] = std::log(s);
      if (labels[i] != kIgnore) sum += lse[i] - in[0][i * vocab + labels[i]];
    }
    return Vecs{{kept ? sum / kept : 0.0}, lse};
  };
  c.forward = [=](const Vecs& in) {
    auto x = HostTensor::f32({rows, vocab}, in[0]);
    auto y = HostTensor::i32({rows}, labels);
    auto lse = HostTensor::zeros({rows});
    cpu::CrossEntropySum s = cpu::cross_entropy_forward(x.t, y.t, kIgnore, lse.t);
    EXPECT_EQ(s.count, kept);
    return Vecs{{s.count ? s.loss_sum / s.count : 0.0}, lse.vec()};
  };
  // In place, as the trainer uses it: the gradient overwrites the logits.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto x = HostTensor::f32({rows, vocab}, in[0]);
    auto y = HostTensor::i32({rows}, labels);
    auto lse = HostTensor::zeros({rows});
    cpu::cross_entropy_forward(x.t, y.t, kIgnore, lse.t);
    float scale = kept ? static_cast<float>(dout[0][0] / kept) : 0.0f;
    cpu::cross_entropy_backward(x.t, y.t, lse.t, kIgnore, scale, x.t);
    return Vecs{x.vec()};
  };
  return c;
}

}  // namespace mt::test
