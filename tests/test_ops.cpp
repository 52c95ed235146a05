// The op table: every CPU kernel at every shape worth checking, forward against a
// float64 reference and backward against central finite differences. See
// tests/ops/op_case.h for what a row checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "ops/cases.h"

namespace mt::test {
namespace {

std::vector<OpCase> table() {
  std::vector<OpCase> t;
  auto add = [&](OpCase c) { t.push_back(std::move(c)); };

  // gemm: every transpose combination, accumulate, one row, odd sizes.
  for (bool ta : {false, true})
    for (bool tb : {false, true}) add(gemm_case(7, 5, 3, ta, tb, 0.0f));
  add(gemm_case(1, 9, 13, false, true, 0.0f));
  add(gemm_case(33, 1, 17, true, false, 0.5f));
  add(gemm_case(130, 24, 129, false, true, 1.0f));

  // embedding: repeated ids, one token.
  add(embedding_case(11, 6, 20));
  add(embedding_case(3, 1, 1));

  // rmsnorm: one row, dims not multiples of 8.
  add(rmsnorm_case(1, 5, 1e-6f));
  add(rmsnorm_case(9, 131, 1e-5f));

  // cross-entropy: ignored labels, one row, a vocabulary that is not a multiple of 8.
  add(cross_entropy_case(12, 37, 3));
  add(cross_entropy_case(1, 5, 0));
  add(cross_entropy_case(40, 1001, 7));

  // adamw: with and without decay, first and a later step.
  add(adamw_case(1, 0.0f));
  add(adamw_case(7, 0.1f));
  add(adamw_case(1000, 0.01f));

  // grouped gemm: ROWS-GROUPED-GEMM
  // swiglu and clamped swiglu: ROWS-SWIGLU
  // router: ROWS-ROUTER
  // dispatch and combine: ROWS-DISPATCH
  // rope: ROWS-ROPE
  // attention: ROWS-ATTENTION
  return t;
}

// |a - b| within tol of max(|b|, a floor at 1% of the output's largest magnitude):
// relative where values are large, absolute near zero where cancellation makes a
// purely relative test meaningless.
::testing::AssertionResult close_enough(const std::string& what, const Vec& got, const Vec& want, double tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << want.size();
  double scale = 1e-12;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    double allowed = tol * std::max(std::fabs(want[i]), 1e-2 * scale);
    if (!(std::fabs(got[i] - want[i]) <= allowed))
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", expected " << want[i]
                                           << " (allowed error " << allowed << ")";
  }
  return ::testing::AssertionSuccess();
}

Vecs draw_inputs(const OpCase& c) {
  std::mt19937_64 g(c.seed);
  Vecs in;
  for (const Input& x : c.inputs) {
    std::uniform_real_distribution<double> d(x.lo, x.hi);
    Vec v(static_cast<size_t>(x.shape.numel()));
    for (double& e : v) {
      do e = d(g);
      while (e == 0.0);
      // Round to fp32 so the reference and the kernel see the same numbers.
      e = static_cast<double>(static_cast<float>(e));
    }
    in.push_back(std::move(v));
  }
  return in;
}

class OpTable : public ::testing::TestWithParam<OpCase> {};

TEST_P(OpTable, ForwardMatchesFloat64Reference) {
  const OpCase& c = GetParam();
  Vecs in = draw_inputs(c);
  Vecs want = c.reference(in);
  Vecs got = c.forward(in);
  ASSERT_EQ(got.size(), c.outputs.size());
  ASSERT_EQ(want.size(), c.outputs.size());
  for (size_t o = 0; o < c.outputs.size(); ++o) EXPECT_TRUE(close_enough(c.outputs[o].name, got[o], want[o], c.fwd_tol));
}

TEST_P(OpTable, BackwardMatchesFiniteDifferences) {
  const OpCase& c = GetParam();
  Vecs in = draw_inputs(c);
  Vecs out = c.reference(in);
  std::mt19937_64 g(c.seed + 1000);
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  Vecs dout;
  bool any = false;
  for (size_t o = 0; o < c.outputs.size(); ++o) {
    Vec v(out[o].size(), 0.0);
    if (c.outputs[o].differentiable)
      for (double& e : v) e = static_cast<double>(static_cast<float>(d(g)));
    any = any || c.outputs[o].differentiable;
    dout.push_back(std::move(v));
  }
  if (!any) GTEST_SKIP() << "no differentiable output";
  auto loss = [&](const Vecs& x) {
    Vecs y = c.reference(x);
    double l = 0;
    for (size_t o = 0; o < y.size(); ++o)
      for (size_t j = 0; j < y[o].size(); ++j) l += dout[o][j] * y[o][j];
    return l;
  };
  Vecs grads = c.backward(in, dout);
  ASSERT_EQ(grads.size(), c.inputs.size());
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    if (!c.inputs[i].differentiable) continue;
    ASSERT_EQ(grads[i].size(), in[i].size()) << c.inputs[i].name;
    // Every element when small; otherwise a fixed random sample of 400 plus the ends.
    std::vector<size_t> pick;
    size_t n = in[i].size();
    if (n <= 600) {
      for (size_t j = 0; j < n; ++j) pick.push_back(j);
    } else {
      std::mt19937_64 s(c.seed + 7 * i);
      pick = {0, n - 1};
      for (int j = 0; j < 400; ++j) pick.push_back(s() % n);
    }
    Vec fd, an;
    for (size_t j : pick) {
      Vecs x = in;
      double h = c.fd_step * std::max(1.0, std::fabs(in[i][j]));
      x[i][j] = in[i][j] + h;
      double up = loss(x);
      x[i][j] = in[i][j] - h;
      double down = loss(x);
      fd.push_back((up - down) / (2 * h));
      an.push_back(grads[i][j]);
    }
    EXPECT_TRUE(close_enough("d" + c.inputs[i].name, an, fd, c.bwd_tol));
  }
}

std::string case_name(const ::testing::TestParamInfo<OpCase>& info) {
  std::string s;
  for (char ch : info.param.name) s += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Cpu, OpTable, ::testing::ValuesIn(table()), case_name);

}  // namespace
}  // namespace mt::test
