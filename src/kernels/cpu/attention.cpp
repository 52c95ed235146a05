#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace mt::cpu {

namespace {

struct Dims {
  int64_t b, tq, tk, hq, hkv, d, d_v;  // d: q and k's head dim, d_v: v and out's
};

bool present(const Tensor& t) { return t.defined() && t.numel() > 0; }

// Checks q, k, v, sinks, the arguments and the forward's out and lse; returns the dimensions.
Dims check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks, const AttentionArgs& a,
                  const Tensor& out, const Tensor& lse) {
  MT_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4)
      << "attention q should be [B,Tq,Hq,Dqk], k [B,Tk,Hkv,Dqk] and v [B,Tk,Hkv,Dv], got q " << q.str() << ", k "
      << k.str() << ", v " << v.str();
  Dims n{q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3), v.dim(3)};
  check_tensor(q, "attention q", DType::f32, {n.b, n.tq, n.hq, n.d});
  check_tensor(k, "attention k", DType::f32, {n.b, n.tk, n.hkv, n.d});
  check_tensor(v, "attention v", DType::f32, {n.b, n.tk, n.hkv, n.d_v});
  MT_CHECK(n.hkv > 0 && n.hq % n.hkv == 0) << "attention query heads " << n.hq << " not a multiple of kv heads "
                                           << n.hkv;
  if (present(sinks)) check_tensor(sinks, "attention sinks", DType::f32, {n.hq});
  MT_CHECK(q.device == Device::cpu && k.device == Device::cpu && v.device == Device::cpu)
      << "cpu attention got q " << q.str() << ", k " << k.str() << ", v " << v.str();
  MT_CHECK(a.window >= 0) << "attention window must be >= 0, got " << a.window;
  check_tensor(out, "attention out", DType::f32, {n.b, n.tq, n.hq, n.d_v});
  check_tensor(lse, "attention lse", DType::f32, {n.b, n.hq, n.tq});
  return n;
}

// Keys [first, end) that query row i sees: causal, and within the window when there is one.
struct KeyRange {
  int64_t first, end;
};
KeyRange visible_keys(const AttentionArgs& a, int64_t i, int64_t tk) {
  const int64_t pos = a.q_offset + i;
  const int64_t end = std::clamp<int64_t>(pos - a.k_offset + 1, 0, tk);
  const int64_t first = a.window > 0 ? std::clamp<int64_t>(pos - a.window + 1 - a.k_offset, 0, end) : 0;
  return {first, end};
}

double dot(const float* x, const float* y, int64_t d) {
  double s = 0;
  for (int64_t e = 0; e < d; ++e) s += static_cast<double>(x[e]) * y[e];
  return s;
}

}  // namespace

// Per (batch, query head): plain softmax over the visible keys plus the sink, with
// the row's sums in double (rows are short; this keeps fp32 rounding out of lse).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                       const AttentionArgs& a, const Tensor& out, const Tensor& lse) {
  const Dims n = check_inputs(q, k, v, sinks, a, out, lse);
  const bool has_sinks = present(sinks);
  const int64_t group = n.hq / n.hkv;
  const float* qp = q.f32();
  const float* kp = k.f32();
  const float* vp = v.f32();
  const float* sp = has_sinks ? sinks.f32() : nullptr;
  float* op = out.f32();
  float* lp = lse.f32();
  const double minus_inf = -std::numeric_limits<double>::infinity();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < n.b; ++b)
    for (int64_t h = 0; h < n.hq; ++h) {
      const int64_t g = h / group;
      std::vector<double> score(static_cast<size_t>(n.tk)), acc(static_cast<size_t>(n.d_v));
      for (int64_t i = 0; i < n.tq; ++i) {
        const float* qi = qp + ((b * n.tq + i) * n.hq + h) * n.d;
        float* oi = op + ((b * n.tq + i) * n.hq + h) * n.d_v;
        float& lse_i = lp[(b * n.hq + h) * n.tq + i];
        const KeyRange r = visible_keys(a, i, n.tk);
        double m = has_sinks ? sp[h] : minus_inf;
        for (int64_t j = r.first; j < r.end; ++j) {
          score[j] = a.scale * dot(qi, kp + ((b * n.tk + j) * n.hkv + g) * n.d, n.d);
          m = std::max(m, score[j]);
        }
        // A row with neither keys nor sink has an empty denominator: lse -inf, output 0.
        if (m == minus_inf) {
          lse_i = static_cast<float>(minus_inf);
          std::fill(oi, oi + n.d_v, 0.0f);
          continue;
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double z = has_sinks ? std::exp(sp[h] - m) : 0.0;
        for (int64_t j = r.first; j < r.end; ++j) {
          const double p = std::exp(score[j] - m);
          const float* vj = vp + ((b * n.tk + j) * n.hkv + g) * n.d_v;
          z += p;
          for (int64_t e = 0; e < n.d_v; ++e) acc[e] += p * vj[e];
        }
        for (int64_t e = 0; e < n.d_v; ++e) oi[e] = static_cast<float>(acc[e] / z);
        lse_i = static_cast<float>(m + std::log(z));
      }
    }
}

// Flash-attention style: probabilities are recomputed from lse, P = exp(s - lse), and
// with D_i = dout_i . out_i the score gradient is dS = P * (dout_i . v_j - D_i). The
// sink's probability is exp(sink - lse_i) and its gradient -sum_i P_sink,i * D_i.
// Threads own (batch, kv head) pairs, so each writes its own dk and dv rows and the
// dq rows of its query heads; dsinks is summed over the batch afterwards, in order.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                        const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                        const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks) {
  const Dims n = check_inputs(q, k, v, sinks, a, out, lse);
  check_tensor(dout, "attention dout", DType::f32, out.shape);
  check_tensor(dq, "attention dq", DType::f32, q.shape);
  check_tensor(dk, "attention dk", DType::f32, k.shape);
  check_tensor(dv, "attention dv", DType::f32, v.shape);
  const bool has_sinks = present(sinks);
  if (has_sinks) check_tensor(dsinks, "attention dsinks", DType::f32, {n.hq});
  const int64_t group = n.hq / n.hkv;
  const float* qp = q.f32();
  const float* kp = k.f32();
  const float* vp = v.f32();
  const float* sp = has_sinks ? sinks.f32() : nullptr;
  const float* op = out.f32();
  const float* lp = lse.f32();
  const float* gp = dout.f32();
  float* dqp = dq.f32();
  float* dkp = dk.f32();
  float* dvp = dv.f32();
  std::vector<double> dsink_bh(static_cast<size_t>(n.b * n.hq), 0.0);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < n.b; ++b)
    for (int64_t g = 0; g < n.hkv; ++g) {
      // dk and dv of this (b, g) are sums over queries of every head in the group.
      std::vector<double> dk_acc(static_cast<size_t>(n.tk * n.d), 0.0), dv_acc(static_cast<size_t>(n.tk * n.d_v), 0.0);
      std::vector<double> dq_acc(static_cast<size_t>(n.d));
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        for (int64_t i = 0; i < n.tq; ++i) {
          const int64_t row = ((b * n.tq + i) * n.hq + h) * n.d, orow = ((b * n.tq + i) * n.hq + h) * n.d_v;
          const float* qi = qp + row;
          const float* gi = gp + orow;
          const KeyRange r = visible_keys(a, i, n.tk);
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          // A row that sees no key has output 0, so it passes no gradient anywhere.
          if (r.first < r.end) {
            const double lse_i = lp[(b * n.hq + h) * n.tq + i];
            const double d_i = dot(gi, op + orow, n.d_v);
            for (int64_t j = r.first; j < r.end; ++j) {
              const int64_t kr = ((b * n.tk + j) * n.hkv + g) * n.d, vr = ((b * n.tk + j) * n.hkv + g) * n.d_v;
              const double p = std::exp(a.scale * dot(qi, kp + kr, n.d) - lse_i);
              const double ds = p * (dot(gi, vp + vr, n.d_v) - d_i);
              double* dkj = dk_acc.data() + j * n.d;
              double* dvj = dv_acc.data() + j * n.d_v;
              for (int64_t e = 0; e < n.d; ++e) {
                dq_acc[e] += ds * kp[kr + e];
                dkj[e] += ds * qi[e];
              }
              for (int64_t e = 0; e < n.d_v; ++e) dvj[e] += p * gi[e];
            }
            if (has_sinks) dsink_bh[b * n.hq + h] -= std::exp(sp[h] - lse_i) * d_i;
          }
          for (int64_t e = 0; e < n.d; ++e) dqp[row + e] = static_cast<float>(a.scale * dq_acc[e]);
        }
      for (int64_t j = 0; j < n.tk; ++j) {
        for (int64_t e = 0; e < n.d; ++e)
          dkp[((b * n.tk + j) * n.hkv + g) * n.d + e] = static_cast<float>(a.scale * dk_acc[j * n.d + e]);
        for (int64_t e = 0; e < n.d_v; ++e)
          dvp[((b * n.tk + j) * n.hkv + g) * n.d_v + e] = static_cast<float>(dv_acc[j * n.d_v + e]);
      }
    }
  if (has_sinks) {
    float* dsp = dsinks.f32();
    for (int64_t h = 0; h < n.hq; ++h) {
      double s = 0;
      for (int64_t b = 0; b < n.b; ++b) s += dsink_bh[b * n.hq + h];
      dsp[h] += static_cast<float>(s);
    }
  }
}

}  // namespace mt::cpu
