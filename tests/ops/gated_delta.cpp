#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>

#include "kernels/gated_delta.h"
#include "ops/cases.h"

namespace mt::test {

namespace {

struct Dims {
  int64_t b, t, h, dk, dv;
};

// The reference: the recurrence one token at a time, in double, written from the
// definition (S_t = a_t S_{t-1} + k_t u_t^T with u_t = beta_t (v_t - a_t S_{t-1}^T k_t))
// and not from the chunked form. s0 empty: S_0 = 0. Returns o [B,T,H,Dv], S_T [B,H,Dk,Dv].
Vecs recurrence_forward(const Dims& n, const Vec& q, const Vec& k, const Vec& v, const Vec& g, const Vec& beta,
                        const Vec& s0) {
  const int64_t dk = n.dk, dv = n.dv;
  Vec o(n.b * n.t * n.h * dv), st(n.b * n.h * dk * dv);
  for (int64_t b = 0; b < n.b; ++b)
    for (int64_t h = 0; h < n.h; ++h) {
      Vec S(dk * dv, 0.0), u(dv);
      if (!s0.empty()) std::copy_n(s0.begin() + (b * n.h + h) * dk * dv, dk * dv, S.begin());
      for (int64_t t = 0; t < n.t; ++t) {
        const int64_t r = (b * n.t + t) * n.h + h;
        const double a = std::exp(g[r]);
        for (int64_t e = 0; e < dv; ++e) {
          double w = 0;
          for (int64_t i = 0; i < dk; ++i) w += S[i * dv + e] * k[r * dk + i];
          u[e] = beta[r] * (v[r * dv + e] - a * w);
        }
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t e = 0; e < dv; ++e) S[i * dv + e] = a * S[i * dv + e] + k[r * dk + i] * u[e];
        for (int64_t e = 0; e < dv; ++e) {
          double s = 0;
          for (int64_t i = 0; i < dk; ++i) s += S[i * dv + e] * q[r * dk + i];
          o[r * dv + e] = s;
        }
      }
      std::copy(S.begin(), S.end(), st.begin() + (b * n.h + h) * dk * dv);
    }
  return {o, st};
}

// Its gradients for L = sum(dout . o) + sum(dst . S_T) (dst empty: 0), token by token from
// the last: {dq, dk, dv, dg, dbeta, ds0}. The states are kept from a forward sweep.
Vecs recurrence_backward(const Dims& n, const Vec& q, const Vec& k, const Vec& v, const Vec& g, const Vec& beta,
                         const Vec& s0, const Vec& dout, const Vec& dst) {
  const int64_t dk = n.dk, dv = n.dv, dkv = dk * dv;
  Vec dq(q.size()), dkk(k.size()), dvv(v.size()), dg(g.size()), dbeta(beta.size()), ds0(n.b * n.h * dkv);
  for (int64_t b = 0; b < n.b; ++b)
    for (int64_t h = 0; h < n.h; ++h) {
      std::vector<Vec> S(n.t + 1, Vec(dkv, 0.0));  // S[t]: the state after t tokens
      if (!s0.empty()) std::copy_n(s0.begin() + (b * n.h + h) * dkv, dkv, S[0].begin());
      for (int64_t t = 0; t < n.t; ++t) {
        const int64_t r = (b * n.t + t) * n.h + h;
        const double a = std::exp(g[r]);
        for (int64_t e = 0; e < dv; ++e) {
          double w = 0;
          for (int64_t i = 0; i < dk; ++i) w += S[t][i * dv + e] * k[r * dk + i];
          const double u = beta[r] * (v[r * dv + e] - a * w);
          for (int64_t i = 0; i < dk; ++i) S[t + 1][i * dv + e] = a * S[t][i * dv + e] + k[r * dk + i] * u;
        }
      }
      Vec dS(dkv, 0.0), w(dv), u(dv), du(dv);
      if (!dst.empty()) std::copy_n(dst.begin() + (b * n.h + h) * dkv, dkv, dS.begin());
      for (int64_t t = n.t - 1; t >= 0; --t) {
        const int64_t r = (b * n.t + t) * n.h + h;
        const Vec& P = S[t];  // the state the token reads
        const double a = std::exp(g[r]);
        // o_t = S_t^T q_t.
        for (int64_t i = 0; i < dk; ++i) {
          double s = 0;
          for (int64_t e = 0; e < dv; ++e) {
            s += S[t + 1][i * dv + e] * dout[r * dv + e];
            dS[i * dv + e] += q[r * dk + i] * dout[r * dv + e];
          }
          dq[r * dk + i] = s;
        }
        // S_t = a P + k u^T, u = beta (v - a w), w = P^T k.
        for (int64_t e = 0; e < dv; ++e) {
          w[e] = 0, du[e] = 0;
          for (int64_t i = 0; i < dk; ++i) {
            w[e] += P[i * dv + e] * k[r * dk + i];
            du[e] += dS[i * dv + e] * k[r * dk + i];
          }
          u[e] = beta[r] * (v[r * dv + e] - a * w[e]);
        }
        double da = 0, db = 0;
        for (int64_t i = 0; i < dkv; ++i) da += dS[i] * P[i];
        for (int64_t e = 0; e < dv; ++e) {
          dvv[r * dv + e] = beta[r] * du[e];
          db += du[e] * (v[r * dv + e] - a * w[e]);
          da -= beta[r] * du[e] * w[e];
        }
        dbeta[r] = db;
        dg[r] = a * da;
        for (int64_t i = 0; i < dk; ++i) {
          double s = 0;
          for (int64_t e = 0; e < dv; ++e) {
            const double dw = -a * beta[r] * du[e];
            s += dS[i * dv + e] * u[e] + P[i * dv + e] * dw;
            dS[i * dv + e] = a * dS[i * dv + e] + k[r * dk + i] * dw;
          }
          dkk[r * dk + i] = s;
        }
      }
      std::copy(dS.begin(), dS.end(), ds0.begin() + (b * n.h + h) * dkv);
    }
  return {dq, dkk, dvv, dg, dbeta, ds0};
}

}  // namespace

OpCase gated_delta_case(const GatedDeltaSpec& s) {
  const Dims n{s.batch, s.tokens, s.heads, s.dk, s.dv};
  const Shape qs{n.b, n.t, n.h, n.dk}, vs{n.b, n.t, n.h, n.dv}, gs{n.b, n.t, n.h}, ss{n.b, n.h, n.dk, n.dv};
  std::ostringstream name;
  name << "gated_delta B=" << n.b << " T=" << n.t << " H=" << n.h << " Dk=" << n.dk << " Dv=" << n.dv
       << " chunk=" << s.chunk << (s.initial_state ? " state_in" : "") << (s.final_state ? " state_out" : "");
  OpCase c;
  c.name = name.str();
  const double kmax = 1.0 / std::sqrt(static_cast<double>(n.dk));
  c.inputs = {{"q", qs}, {"k", qs, -kmax, kmax}, {"v", vs}, {"g", gs, -2.0, -0.01}, {"beta", gs, 0.05, 0.95}};
  if (s.initial_state) c.inputs.push_back({"state_in", ss});
  c.outputs = {{"out"}};
  if (s.final_state) c.outputs.push_back({"state_out"});
  auto state_in = [=](const Vecs& in) { return s.initial_state ? in[5] : Vec(); };
  c.reference = [=](const Vecs& in) {
    Vecs r = recurrence_forward(n, in[0], in[1], in[2], in[3], in[4], state_in(in));
    if (!s.final_state) r.pop_back();
    return r;
  };
  c.forward = [=](const Vecs& in) {
    auto q = HostTensor::f32(qs, in[0]), k = HostTensor::f32(qs, in[1]), v = HostTensor::f32(vs, in[2]);
    auto g = HostTensor::f32(gs, in[3]), beta = HostTensor::f32(gs, in[4]);
    auto s0 = HostTensor::f32(ss, state_in(in)), out = HostTensor::zeros(vs), st = HostTensor::zeros(ss);
    cpu::gated_delta_forward(q.t, k.t, v.t, g.t, beta.t, s.initial_state ? s0.t : Tensor(), out.t,
                             s.final_state ? st.t : Tensor(), s.chunk);
    return s.final_state ? Vecs{out.vec(), st.vec()} : Vecs{out.vec()};
  };
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto q = HostTensor::f32(qs, in[0]), k = HostTensor::f32(qs, in[1]), v = HostTensor::f32(vs, in[2]);
    auto g = HostTensor::f32(gs, in[3]), beta = HostTensor::f32(gs, in[4]);
    auto s0 = HostTensor::f32(ss, state_in(in)), d_out = HostTensor::f32(vs, dout[0]);
    auto dst = HostTensor::f32(ss, s.final_state ? dout[1] : Vec());
    auto dq = HostTensor::zeros(qs), dk = HostTensor::zeros(qs), dv = HostTensor::zeros(vs);
    auto dg = HostTensor::zeros(gs), dbeta = HostTensor::zeros(gs), ds0 = HostTensor::zeros(ss);
    cpu::gated_delta_backward(q.t, k.t, v.t, g.t, beta.t, s.initial_state ? s0.t : Tensor(), d_out.t,
                              s.final_state ? dst.t : Tensor(), dq.t, dk.t, dv.t, dg.t, dbeta.t,
                              s.initial_state ? ds0.t : Tensor(), s.chunk);
    Vecs r{dq.vec(), dk.vec(), dv.vec(), dg.vec(), dbeta.vec()};
    if (s.initial_state) r.push_back(ds0.vec());
    return r;
  };
  return c;
}

namespace {

// Inputs as a model gives them: q and k L2-normalised per head (q then scaled by
// 1/sqrt(Dk)), g in [g_lo, g_hi], beta in (0.05, 0.95); dout and dst are the upstream
// gradients of the loss.
struct Draw {
  Vec q, k, v, g, beta, s0, dout, dst;
};
Draw draw(const Dims& n, uint64_t seed, double g_lo, double g_hi, bool initial_state, bool final_state) {
  std::mt19937_64 gen(seed);
  auto uniform = [&](int64_t count, double lo, double hi) {
    std::uniform_real_distribution<double> d(lo, hi);
    Vec x(count);
    for (double& e : x) e = d(gen);
    return x;
  };
  auto normalised = [&](double scale) {
    Vec x = uniform(n.b * n.t * n.h * n.dk, -1.0, 1.0);
    for (int64_t r = 0; r < n.b * n.t * n.h; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < n.dk; ++i) ss += x[r * n.dk + i] * x[r * n.dk + i];
      for (int64_t i = 0; i < n.dk; ++i) x[r * n.dk + i] *= scale / std::sqrt(ss);
    }
    return x;
  };
  const int64_t rows = n.b * n.t * n.h, states = n.b * n.h * n.dk * n.dv;
  Draw d;
  d.q = normalised(1.0 / std::sqrt(static_cast<double>(n.dk)));
  d.k = normalised(1.0);
  d.v = uniform(rows * n.dv, -1.0, 1.0);
  d.g = uniform(rows, g_lo, g_hi);
  d.beta = uniform(rows, 0.05, 0.95);
  if (initial_state) d.s0 = uniform(states, -1.0, 1.0);
  d.dout = uniform(rows * n.dv, -1.0, 1.0);
  if (final_state) d.dst = uniform(states, -1.0, 1.0);
  return d;
}

// max |got - want| over max |want|.
double relative_error(const Vec& got, const Vec& want) {
  double err = 0, scale = 1e-300;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return err / scale;
}

// The chunked kernel in float64 equals the recurrence to rounding: forward, final state and
// every gradient, over chunk sizes that do and do not divide T (1 and T < chunk included),
// with and without an initial state and a final state's gradient, and g near 0.
TEST(GatedDelta, ChunkedMatchesRecurrenceInFloat64) {
  struct Row {
    int64_t t, chunk;
    double g_lo, g_hi;
  };
  std::vector<Row> rows;
  for (int64_t t : {1, 5, 16, 37})
    for (int64_t chunk : {4, 16, 64}) rows.push_back({t, chunk, -2.0, -0.01});
  rows.push_back({37, 16, -1e-4, -1e-8});
  rows.push_back({37, 1, -2.0, -0.01});
  double worst = 0;
  int64_t seed = 0;
  for (const Row& row : rows)
    for (bool initial_state : {false, true})
      for (bool final_state : {false, true}) {
        ++seed;
        const Dims n{2, row.t, 2, 4 + seed % 5, 3 + seed % 4};
        const Draw d = draw(n, static_cast<uint64_t>(seed), row.g_lo, row.g_hi, initial_state, final_state);
        const Vecs want = recurrence_forward(n, d.q, d.k, d.v, d.g, d.beta, d.s0);
        const Vecs want_grad = recurrence_backward(n, d.q, d.k, d.v, d.g, d.beta, d.s0, d.dout, d.dst);
        const cpu::GatedDeltaDims cn{n.b, n.t, n.h, n.dk, n.dv, row.chunk};
        Vec o(want[0].size()), st(want[1].size());
        cpu::gated_delta_chunked_forward<double>(cn, d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(),
                                                 initial_state ? d.s0.data() : nullptr, o.data(), st.data());
        Vecs grad;
        for (const Vec& x : want_grad) grad.emplace_back(x.size());
        cpu::gated_delta_chunked_backward<double>(cn, d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(),
                                                  initial_state ? d.s0.data() : nullptr, d.dout.data(),
                                                  final_state ? d.dst.data() : nullptr, grad[0].data(),
                                                  grad[1].data(), grad[2].data(), grad[3].data(), grad[4].data(),
                                                  grad[5].data());
        std::ostringstream where;
        where << "T=" << n.t << " chunk=" << row.chunk << " Dk=" << n.dk << " Dv=" << n.dv << " g in [" << row.g_lo
              << ", " << row.g_hi << "]" << (initial_state ? " state_in" : "") << (final_state ? " d_state_out" : "");
        const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "d_state_in"};
        std::vector<std::pair<std::string, double>> errors = {{"out", relative_error(o, want[0])},
                                                               {"state_out", relative_error(st, want[1])}};
        for (size_t i = 0; i < grad.size(); ++i) errors.emplace_back(names[i], relative_error(grad[i], want_grad[i]));
        for (const auto& [what, err] : errors) {
          EXPECT_LE(err, 1e-10) << what << ", " << where.str();
          worst = std::max(worst, err);
        }
      }
  std::printf("gated delta, float64 chunked vs recurrence: worst relative error %.3g\n", worst);
}

// The fp32 entry points (Tensors, the default chunk of 64 with T = 100 and a chunk of 16
// with T = 37) against the float64 recurrence: every output and gradient within 1e-5 of
// its largest magnitude.
TEST(GatedDelta, Fp32EntryPointsMatchFloat64Recurrence) {
  double worst = 0;
  for (auto [t, chunk] : {std::pair<int64_t, int64_t>{100, 64}, {37, 16}}) {
    const Dims n{2, t, 2, 8, 6};
    Draw d = draw(n, static_cast<uint64_t>(t), -2.0, -0.01, true, true);
    // Rounded to fp32 first, so the reference and the kernel see the same numbers.
    for (Vec* x : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.s0, &d.dout, &d.dst})
      for (double& e : *x) e = static_cast<float>(e);
    const Vecs want = recurrence_forward(n, d.q, d.k, d.v, d.g, d.beta, d.s0);
    const Vecs want_grad = recurrence_backward(n, d.q, d.k, d.v, d.g, d.beta, d.s0, d.dout, d.dst);
    const Shape qs{n.b, n.t, n.h, n.dk}, vs{n.b, n.t, n.h, n.dv}, gs{n.b, n.t, n.h}, ss{n.b, n.h, n.dk, n.dv};
    auto q = HostTensor::f32(qs, d.q), k = HostTensor::f32(qs, d.k), v = HostTensor::f32(vs, d.v);
    auto g = HostTensor::f32(gs, d.g), beta = HostTensor::f32(gs, d.beta), s0 = HostTensor::f32(ss, d.s0);
    auto out = HostTensor::zeros(vs), st = HostTensor::zeros(ss);
    cpu::gated_delta_forward(q.t, k.t, v.t, g.t, beta.t, s0.t, out.t, st.t, chunk);
    auto dout = HostTensor::f32(vs, d.dout), dst = HostTensor::f32(ss, d.dst);
    auto dq = HostTensor::zeros(qs), dk = HostTensor::zeros(qs), dv = HostTensor::zeros(vs);
    auto dg = HostTensor::zeros(gs), dbeta = HostTensor::zeros(gs), ds0 = HostTensor::zeros(ss);
    cpu::gated_delta_backward(q.t, k.t, v.t, g.t, beta.t, s0.t, dout.t, dst.t, dq.t, dk.t, dv.t, dg.t, dbeta.t, ds0.t,
                              chunk);
    const std::pair<const char*, double> errors[] = {
        {"out", relative_error(out.vec(), want[0])},    {"state_out", relative_error(st.vec(), want[1])},
        {"dq", relative_error(dq.vec(), want_grad[0])}, {"dk", relative_error(dk.vec(), want_grad[1])},
        {"dv", relative_error(dv.vec(), want_grad[2])}, {"dg", relative_error(dg.vec(), want_grad[3])},
        {"dbeta", relative_error(dbeta.vec(), want_grad[4])}, {"d_state_in", relative_error(ds0.vec(), want_grad[5])}};
    for (const auto& [what, err] : errors) {
      EXPECT_LE(err, 1e-5) << what << ", T=" << t << " chunk=" << chunk;
      worst = std::max(worst, err);
    }
  }
  std::printf("gated delta, fp32 entry points vs float64 recurrence: worst relative error %.3g\n", worst);
}

// The reference's own backward against central differences of its forward, for
// L = sum(dout . o) + sum(dst . S_T), every input including S_0.
TEST(GatedDelta, RecurrenceBackwardMatchesFiniteDifferences) {
  const Dims n{1, 6, 2, 3, 2};
  Draw d = draw(n, 99, -2.0, -0.01, true, true);
  const Vecs grad = recurrence_backward(n, d.q, d.k, d.v, d.g, d.beta, d.s0, d.dout, d.dst);
  Vecs in{d.q, d.k, d.v, d.g, d.beta, d.s0};
  auto loss = [&](const Vecs& x) {
    const Vecs y = recurrence_forward(n, x[0], x[1], x[2], x[3], x[4], x[5]);
    double l = 0;
    for (size_t j = 0; j < y[0].size(); ++j) l += d.dout[j] * y[0][j];
    for (size_t j = 0; j < y[1].size(); ++j) l += d.dst[j] * y[1][j];
    return l;
  };
  const char* names[] = {"q", "k", "v", "g", "beta", "state_in"};
  double worst = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    Vec fd(in[i].size());
    for (size_t j = 0; j < in[i].size(); ++j) {
      const double h = 1e-5;
      Vecs x = in;
      x[i][j] = in[i][j] + h;
      const double up = loss(x);
      x[i][j] = in[i][j] - h;
      fd[j] = (up - loss(x)) / (2 * h);
    }
    const double err = relative_error(grad[i], fd);
    EXPECT_LE(err, 1e-8) << "d" << names[i];
    worst = std::max(worst, err);
  }
  std::printf("gated delta, float64 recurrence backward vs finite differences: worst relative error %.3g\n", worst);
}

}  // namespace

}  // namespace mt::test
