#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "kernels/attention.h"
#include "ops/cases.h"

namespace mt::test {

OpCase attention_case(const AttentionSpec& s) {
  const int64_t d_v = s.dim_v > 0 ? s.dim_v : s.dim;
  const Shape qs{s.batch, s.tq, s.hq, s.dim}, ks{s.batch, s.tk, s.hkv, s.dim}, ls{s.batch, s.hq, s.tq};
  const Shape vs{s.batch, s.tk, s.hkv, d_v}, os{s.batch, s.tq, s.hq, d_v};
  cpu::AttentionArgs args;
  args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dim)));
  args.window = s.window;
  args.q_offset = s.q_offset;
  args.k_offset = s.k_offset;
  std::ostringstream name;
  name << "attention B=" << s.batch << " Tq=" << s.tq << " Tk=" << s.tk << " Hq=" << s.hq << " Hkv=" << s.hkv
       << " D=" << s.dim << (d_v != s.dim ? " Dv=" + std::to_string(d_v) : "") << " window=" << s.window
       << (s.sinks ? " sinks" : "") << " q_offset=" << s.q_offset << " k_offset=" << s.k_offset;
  OpCase c;
  c.name = name.str();
  // q spans [-2, 2] so that some rows' softmax is peaked, not nearly uniform.
  c.inputs = {{"q", qs, -2.0, 2.0}, {"k", ks}, {"v", vs}};
  if (s.sinks) c.inputs.push_back({"sinks", {s.hq}, -1.0, 2.0});
  // lse is compared as exp(lse), the softmax denominator: a row that sees no key and
  // has no sink then compares 0 with 0 rather than -inf with -inf.
  c.outputs = {{"out"}, {"exp_lse", false}};

  c.reference = [=](const Vecs& in) {
    const int64_t b_n = s.batch, tq = s.tq, tk = s.tk, hq = s.hq, hkv = s.hkv, d = s.dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    Vec out(static_cast<size_t>(os.numel()), 0.0), z(static_cast<size_t>(ls.numel()), 0.0);
    for (int64_t b = 0; b < b_n; ++b)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t g = h * hkv / hq;
        for (int64_t i = 0; i < tq; ++i) {
          const int64_t qpos = s.q_offset + i;
          double denom = s.sinks ? std::exp(in[3][h]) : 0.0;
          Vec o(static_cast<size_t>(d_v), 0.0);
          for (int64_t j = 0; j < tk; ++j) {
            const int64_t kpos = s.k_offset + j;
            if (kpos > qpos || (s.window > 0 && qpos - kpos >= s.window)) continue;
            double logit = 0;
            for (int64_t e = 0; e < d; ++e)
              logit += in[0][((b * tq + i) * hq + h) * d + e] * in[1][((b * tk + j) * hkv + g) * d + e];
            const double w = std::exp(scale * logit);
            denom += w;
            for (int64_t e = 0; e < d_v; ++e) o[e] += w * in[2][((b * tk + j) * hkv + g) * d_v + e];
          }
          z[(b * hq + h) * tq + i] = denom;
          if (denom > 0)
            for (int64_t e = 0; e < d_v; ++e) out[((b * tq + i) * hq + h) * d_v + e] = o[e] / denom;
        }
      }
    return Vecs{out, z};
  };

  c.forward = [=](const Vecs& in) {
    auto q = HostTensor::f32(qs, in[0]), k = HostTensor::f32(ks, in[1]), v = HostTensor::f32(vs, in[2]);
    auto sinks = s.sinks ? HostTensor::f32({s.hq}, in[3]) : HostTensor{};
    auto out = HostTensor::zeros(os), lse = HostTensor::zeros(ls);
    cpu::attention_forward(q.t, k.t, v.t, sinks.t, args, out.t, lse.t);
    Vec z = lse.vec();
    for (double& x : z) x = std::exp(x);
    return Vecs{out.vec(), z};
  };

  // dq, dk, dv start from non-zero values so that a gradient left unwritten shows;
  // dsinks starts at 1 and the 1 is taken off again, which checks that it accumulates.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto q = HostTensor::f32(qs, in[0]), k = HostTensor::f32(ks, in[1]), v = HostTensor::f32(vs, in[2]);
    auto sinks = s.sinks ? HostTensor::f32({s.hq}, in[3]) : HostTensor{};
    auto out = HostTensor::zeros(os), lse = HostTensor::zeros(ls);
    cpu::attention_forward(q.t, k.t, v.t, sinks.t, args, out.t, lse.t);
    auto dy = HostTensor::f32(os, dout[0]);
    auto dq = HostTensor::f32(qs, in[0]), dk = HostTensor::f32(ks, in[1]), dv = HostTensor::f32(vs, in[2]);
    auto dsinks = s.sinks ? HostTensor::f32({s.hq}, Vec(static_cast<size_t>(s.hq), 1.0)) : HostTensor{};
    cpu::attention_backward(q.t, k.t, v.t, sinks.t, args, out.t, lse.t, dy.t, dq.t, dk.t, dv.t, dsinks.t);
    Vecs grads{dq.vec(), dk.vec(), dv.vec()};
    if (s.sinks) {
      Vec ds = dsinks.vec();
      for (double& x : ds) x -= 1.0;
      grads.push_back(ds);
    }
    return grads;
  };
  return c;
}

// Rows before the first key: without a sink lse is -inf and the output 0; with one
// the sink is the whole denominator (lse = sink) and the output still 0. Either way
// the backward must give such rows zero gradients, not NaN.
TEST(AttentionCpu, RowsThatSeeNoKey) {
  const int64_t tq = 5, tk = 3, h = 2, d = 4;
  cpu::AttentionArgs a;
  a.scale = 0.5f;
  a.k_offset = 3;  // query rows 0..2 precede every key
  Vec qv(static_cast<size_t>(tq * h * d)), kv(static_cast<size_t>(tk * h * d));
  for (size_t i = 0; i < qv.size(); ++i) qv[i] = std::sin(1.0 + static_cast<double>(i));
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = std::cos(2.0 + static_cast<double>(i));
  auto q = HostTensor::f32({1, tq, h, d}, qv), k = HostTensor::f32({1, tk, h, d}, kv);
  auto v = HostTensor::f32({1, tk, h, d}, kv), dout = HostTensor::f32({1, tq, h, d}, qv);
  for (bool with_sinks : {false, true}) {
    auto sinks = with_sinks ? HostTensor::f32({h}, {0.25, -1.5}) : HostTensor{};
    auto dsinks = with_sinks ? HostTensor::zeros({h}) : HostTensor{};
    auto out = HostTensor::zeros({1, tq, h, d}), lse = HostTensor::zeros({1, h, tq});
    cpu::attention_forward(q.t, k.t, v.t, sinks.t, a, out.t, lse.t);
    auto dq = HostTensor::zeros({1, tq, h, d}), dk = HostTensor::zeros({1, tk, h, d});
    auto dv = HostTensor::zeros({1, tk, h, d});
    cpu::attention_backward(q.t, k.t, v.t, sinks.t, a, out.t, lse.t, dout.t, dq.t, dk.t, dv.t, dsinks.t);
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t i = 0; i < tq; ++i) {
        const float l = lse.f[hh * tq + i];
        if (i < 3 && with_sinks) {
          EXPECT_EQ(l, sinks.f[hh]) << "head " << hh << " row " << i;
        } else if (i < 3) {
          EXPECT_EQ(l, -std::numeric_limits<float>::infinity()) << "head " << hh << " row " << i;
        } else {
          EXPECT_TRUE(std::isfinite(l)) << "head " << hh << " row " << i;
        }
        for (int64_t e = 0; e < d; ++e) {
          const size_t at = static_cast<size_t>((i * h + hh) * d + e);
          if (i < 3) {
            EXPECT_EQ(out.f[at], 0.0f) << "head " << hh << " row " << i;
            EXPECT_EQ(dq.f[at], 0.0f) << "head " << hh << " row " << i;
          }
          EXPECT_TRUE(std::isfinite(dq.f[at])) << "head " << hh << " row " << i;
        }
      }
    for (float x : dk.f) EXPECT_TRUE(std::isfinite(x));
    for (float x : dv.f) EXPECT_TRUE(std::isfinite(x));
    for (float x : dsinks.f) EXPECT_TRUE(std::isfinite(x));
  }
}

// v's head dim is out's: an out shaped like q, or a v of another length, is named.
TEST(AttentionCpu, ValueHeadDimShapesOut) {
  auto q = HostTensor::zeros({1, 3, 2, 8}), k = HostTensor::zeros({1, 3, 2, 8}), v = HostTensor::zeros({1, 3, 2, 4});
  auto lse = HostTensor::zeros({1, 2, 3}), out_q = HostTensor::zeros({1, 3, 2, 8});
  auto short_v = HostTensor::zeros({1, 2, 2, 4}), out = HostTensor::zeros({1, 3, 2, 4});
  auto message = [&](const Tensor& vt, const Tensor& ot) {
    try {
      cpu::attention_forward(q.t, k.t, vt, Tensor(), cpu::AttentionArgs{}, ot, lse.t);
    } catch (const Error& err) {
      return std::string(err.what());
    }
    return std::string("accepted");
  };
  std::string e = message(v.t, out_q.t);
  EXPECT_NE(e.find("attention out should be f32[1,3,2,4], got f32[1,3,2,8]"), std::string::npos) << e;
  e = message(short_v.t, out.t);
  EXPECT_NE(e.find("attention v should be f32[1,3,2,4], got f32[1,2,2,4]"), std::string::npos) << e;
}

}  // namespace mt::test
