#include <gtest/gtest.h>

#include <sstream>

#include "kernels/grouped_gemm.h"
#include "ops/cases.h"

namespace mt::test {

OpCase grouped_gemm_case(const std::vector<int32_t>& counts, int64_t k, int64_t o, bool bias, bool accumulate) {
  int64_t e = static_cast<int64_t>(counts.size());
  std::vector<int32_t> offsets{0};
  // The expert of every row, for the reference: it walks rows, not segments.
  std::vector<int64_t> expert_of;
  for (int64_t x = 0; x < e; ++x) {
    offsets.push_back(offsets.back() + counts[x]);
    expert_of.insert(expert_of.end(), counts[x], x);
  }
  int64_t n = offsets.back();
  std::ostringstream name;
  name << "grouped_gemm counts=";
  for (int64_t x = 0; x < e; ++x) name << (x ? "," : "") << counts[x];
  name << " K=" << k << " O=" << o << " bias=" << bias << " acc=" << accumulate;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", {n, k}}, {"w", {e, o, k}}};
  if (bias) c.inputs.push_back({"bias", {e, o}});
  c.outputs = {{"y"}};
  c.reference = [=](const Vecs& in) {
    Vec y(n * o);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < o; ++j) {
        double s = bias ? in[2][expert_of[r] * o + j] : 0.0;
        for (int64_t p = 0; p < k; ++p) s += in[0][r * k + p] * in[1][(expert_of[r] * o + j) * k + p];
        y[r * o + j] = s;
      }
    return Vecs{y};
  };
  c.forward = [=](const Vecs& in) {
    auto x = HostTensor::f32({n, k}, in[0]), w = HostTensor::f32({e, o, k}, in[1]);
    auto b = bias ? HostTensor::f32({e, o}, in[2]) : HostTensor{};
    auto off = HostTensor::i32({e + 1}, offsets), y = HostTensor::f32({n, o});
    cpu::grouped_gemm(x.t, w.t, b.t, off.t, y.t);
    return Vecs{y.vec()};
  };
  // Gradient buffers start from the input values: without accumulate a stale value
  // would show, with it the start is subtracted again here, in float64.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto x = HostTensor::f32({n, k}, in[0]), w = HostTensor::f32({e, o, k}, in[1]);
    auto dy = HostTensor::f32({n, o}, dout[0]), off = HostTensor::i32({e + 1}, offsets);
    auto dx = HostTensor::f32({n, k}, in[0]), dw = HostTensor::f32({e, o, k}, in[1]);
    auto db = bias ? HostTensor::f32({e, o}, in[2]) : HostTensor{};
    cpu::grouped_gemm_backward_input(dy.t, w.t, off.t, dx.t);
    cpu::grouped_gemm_backward_weight(x.t, dy.t, off.t, dw.t, db.t, accumulate);
    Vecs grads{dx.vec(), dw.vec()};
    if (bias) grads.push_back(db.vec());
    if (accumulate)
      for (size_t i = 1; i < grads.size(); ++i)
        for (size_t j = 0; j < grads[i].size(); ++j) grads[i][j] -= in[i][j];
    return grads;
  };
  return c;
}

namespace {

TEST(GroupedGemm, RejectsBadOffsets) {
  auto x = HostTensor::f32({4, 3}), w = HostTensor::f32({2, 5, 3}), y = HostTensor::f32({4, 5});
  auto expect_error = [&](const std::vector<int32_t>& offsets, const std::string& part) {
    auto off = HostTensor::i32({3}, offsets);
    try {
      cpu::grouped_gemm(x.t, w.t, Tensor(), off.t, y.t);
      ADD_FAILURE() << "offsets accepted, expected an error mentioning '" << part << "'";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(part), std::string::npos) << err.what();
    }
  };
  // A window of experts may start past row 0 and end before the last (the header).
  expect_error({-1, 2, 4}, "offsets[0] should be a row index >= 0, got -1");
  expect_error({0, 3, 2}, "expert 1 spans rows [3, 2)");
  expect_error({0, 2, 5}, "offsets[2] should be at most the row count 4, got 5");
}

}  // namespace

}  // namespace mt::test
