#include "kernels/deltanet.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace mt::cpu {

namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus with beta 1 and threshold 20.
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
float softplus_grad(float x) { return x > 20.0f ? 1.0f : sigmoid(x); }

// x [B,T,C] and w [C,K]; returns K.
int64_t check_conv(const Tensor& x, const Tensor& w) {
  MT_CHECK(x.ndim() == 3) << "causal_conv1d_silu x should be [B,T,C], got " << x.str();
  const int64_t c = x.dim(2);
  check_tensor(x, "causal_conv1d_silu x", DType::f32, x.shape);
  MT_CHECK(w.ndim() == 2 && w.dim(0) == c && w.dim(1) >= 1)
      << "causal_conv1d_silu w should be [C,K] = [" << c << ",K] with K >= 1 for x " << x.str() << ", got "
      << w.str();
  check_tensor(w, "causal_conv1d_silu w", DType::f32, w.shape);
  return w.dim(1);
}

// The pre-activation at one row of x (row r of sequence position t) and channel c.
float conv_at(const float* x, const float* w, int64_t r, int64_t t, int64_t c, int64_t C, int64_t K) {
  float pre = 0.0f;
  for (int64_t j = std::max<int64_t>(0, K - 1 - t); j < K; ++j) pre += w[c * K + j] * x[(r - (K - 1) + j) * C + c];
  return pre;
}

// Channels a task owns in the backward's per-channel passes: enough for contiguous rows.
constexpr int64_t kChannelBlock = 64;

}  // namespace

void causal_conv1d_silu_forward(const Tensor& x, const Tensor& w, const Tensor& y) {
  const int64_t K = check_conv(x, w), B = x.dim(0), T = x.dim(1), C = x.dim(2);
  check_tensor(y, "causal_conv1d_silu y", DType::f32, x.shape);
  MT_CHECK(x.numel() == 0 || y.data != x.data) << "causal_conv1d_silu needs y apart from x (later rows read x)";
  const float *xp = x.f32(), *wp = w.f32();
  float* yp = y.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const float pre = conv_at(xp, wp, r, r % T, c, C, K);
      yp[r * C + c] = pre * sigmoid(pre);
    }
}

void causal_conv1d_silu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                                 const Tensor& dw) {
  const int64_t K = check_conv(x, w), B = x.dim(0), T = x.dim(1), C = x.dim(2);
  check_tensor(dy, "causal_conv1d_silu dy", DType::f32, x.shape);
  check_tensor(dx, "causal_conv1d_silu dx", DType::f32, x.shape);
  check_tensor(dw, "causal_conv1d_silu dw", DType::f32, {C, K});
  MT_CHECK(x.numel() == 0 || dx.data != x.data) << "causal_conv1d_silu needs dx apart from x";
  const float *xp = x.f32(), *wp = w.f32(), *g = dy.f32();
  float *dxp = dx.f32(), *dwp = dw.f32();
  // dx first holds dpre = dy * silu'(pre), silu'(p) = s (1 + p (1 - s)).
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const float pre = conv_at(xp, wp, r, r % T, c, C, K), s = sigmoid(pre);
      dxp[r * C + c] = g[r * C + c] * s * (1.0f + pre * (1.0f - s));
    }
  // Then per block of channels: dw[c,j] += sum over b, t of dpre[b,t,c] x[b,t-(K-1)+j,c]
  // (in that order), and dx[b,s,c] = sum_j w[c,j] dpre[b,s+(K-1)-j,c] in place: row s
  // reads dpre at rows s..s+K-1 only, so walking s upward overwrites nothing still needed.
  const int64_t blocks = (C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kChannelBlock, c1 = std::min(C, c0 + kChannelBlock);
    std::vector<float> acc((c1 - c0) * K, 0.0f);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t r = b * T + t;
        for (int64_t j = std::max<int64_t>(0, K - 1 - t); j < K; ++j)
          for (int64_t c = c0; c < c1; ++c) acc[(c - c0) * K + j] += dxp[r * C + c] * xp[(r - (K - 1) + j) * C + c];
      }
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t j = 0; j < K; ++j) dwp[c * K + j] += acc[(c - c0) * K + j];
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < T; ++s) {
        const int64_t r = b * T + s;
        for (int64_t c = c0; c < c1; ++c) {
          float d = 0.0f;
          for (int64_t j = std::max<int64_t>(0, s + K - T); j < K; ++j)
            d += wp[c * K + j] * dxp[(r + (K - 1) - j) * C + c];
          dxp[r * C + c] = d;
        }
      }
  }
}

namespace {

// a, b [N,H], A_log and dt_bias [H]; returns N.
int64_t check_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias) {
  MT_CHECK(a.ndim() == 2) << "deltanet_gates a should be [N,H], got " << a.str();
  const int64_t n = a.dim(0), h = a.dim(1);
  check_tensor(a, "deltanet_gates a", DType::f32, {n, h});
  check_tensor(b, "deltanet_gates b", DType::f32, {n, h});
  check_tensor(A_log, "deltanet_gates A_log", DType::f32, {h});
  check_tensor(dt_bias, "deltanet_gates dt_bias", DType::f32, {h});
  return n;
}

}  // namespace

void deltanet_gates_forward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                            const Tensor& g, const Tensor& beta) {
  const int64_t n = check_gates(a, b, A_log, dt_bias), h = a.dim(1);
  check_tensor(g, "deltanet_gates g", DType::f32, {n, h});
  check_tensor(beta, "deltanet_gates beta", DType::f32, {n, h});
  const float *ap = a.f32(), *bp = b.f32(), *al = A_log.f32(), *dt = dt_bias.f32();
  float *gp = g.f32(), *betap = beta.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j) {
      gp[r * h + j] = -std::exp(al[j]) * softplus(ap[r * h + j] + dt[j]);
      betap[r * h + j] = sigmoid(bp[r * h + j]);
    }
}

void deltanet_gates_backward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                             const Tensor& dg, const Tensor& dbeta, const Tensor& da, const Tensor& db,
                             const Tensor& dA_log, const Tensor& ddt_bias) {
  const int64_t n = check_gates(a, b, A_log, dt_bias), h = a.dim(1);
  check_tensor(dg, "deltanet_gates dg", DType::f32, {n, h});
  check_tensor(dbeta, "deltanet_gates dbeta", DType::f32, {n, h});
  check_tensor(da, "deltanet_gates da", DType::f32, {n, h});
  check_tensor(db, "deltanet_gates db", DType::f32, {n, h});
  check_tensor(dA_log, "deltanet_gates dA_log", DType::f32, {h});
  check_tensor(ddt_bias, "deltanet_gates ddt_bias", DType::f32, {h});
  const float *ap = a.f32(), *bp = b.f32(), *al = A_log.f32(), *dt = dt_bias.f32();
  const float *gg = dg.f32(), *gb = dbeta.f32();
  float *dap = da.f32(), *dbp = db.f32(), *dal = dA_log.f32(), *ddt = ddt_bias.f32();
  // Heads in parallel, rows in order: the per-head sums come out the same on every run.
  // d g / d A_log = g itself; d g / d a = d g / d dt_bias = -exp(A_log) softplus'(a + dt_bias).
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < h; ++j) {
    const float scale = -std::exp(al[j]);
    float sum_a = 0.0f, sum_dt = 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = r * h + j;
      const float u = ap[i] + dt[j], d = gg[i], s = sigmoid(bp[i]);
      const float d_u = d * scale * softplus_grad(u);
      sum_a += d * scale * softplus(u);
      sum_dt += d_u;
      dbp[i] = gb[i] * s * (1.0f - s);
      dap[i] = d_u;
    }
    dal[j] += sum_a;
    ddt[j] += sum_dt;
  }
}

}  // namespace mt::cpu
