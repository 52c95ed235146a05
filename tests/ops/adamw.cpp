#include <cmath>
#include <sstream>

#include "kernels/adamw.h"
#include "ops/cases.h"

namespace mt::test {

OpCase adamw_case(int64_t step, float weight_decay) {
  constexpr int64_t kN = 103;
  cpu::AdamWStep s;
  s.lr = 3e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = weight_decay;
  s.step = step;
  std::ostringstream name;
  name << "adamw step=" << step << " wd=" << weight_decay;
  OpCase c;
  c.name = name.str();
  // v must be non-negative: it is a running mean of squares.
  c.inputs = {{"param", {kN}, -1, 1, false},
              {"grad", {kN}, -1, 1, false},
              {"m", {kN}, -0.1, 0.1, false},
              {"v", {kN}, 1e-4, 1e-2, false}};
  c.outputs = {{"param", false}, {"m", false}, {"v", false}};
  c.reference = [=](const Vecs& in) {
    Vec p = in[0], m = in[2], v = in[3];
    double t = static_cast<double>(step);
    for (int64_t i = 0; i < kN; ++i) {
      double g = in[1][i];
      m[i] = s.beta1 * m[i] + (1 - s.beta1) * g;
      v[i] = s.beta2 * v[i] + (1 - s.beta2) * g * g;
      double mhat = m[i] / (1 - std::pow(s.beta1, t));
      double vhat = v[i] / (1 - std::pow(s.beta2, t));
      p[i] = p[i] - s.lr * s.weight_decay * p[i] - s.lr * mhat / (std::sqrt(vhat) + s.eps);
    }
    return Vecs{p, m, v};
  };
  c.forward = [=](const Vecs& in) {
    auto p = HostTensor::f32({kN}, in[0]), g = HostTensor::f32({kN}, in[1]);
    auto m = HostTensor::f32({kN}, in[2]), v = HostTensor::f32({kN}, in[3]);
    cpu::adamw_step(p.t, g.t, m.t, v.t, s);
    return Vecs{p.vec(), m.vec(), v.vec()};
  };
  c.backward = [](const Vecs&, const Vecs&) { return Vecs{}; };
  return c;
}

}  // namespace mt::test
