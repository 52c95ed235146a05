#include "kernels/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace mt::cpu {

namespace {

bool present(const Tensor& t) { return t.data != nullptr && t.numel() > 0; }

// One (batch, head)'s rows: token t of q is q + t * qs, and so on.
template <typename T>
struct HeadRows {
  const T *q, *k, *v, *g, *beta;
  int64_t qs, vs, gs;
};

template <typename T>
HeadRows<T> head_rows(const GatedDeltaDims& n, int64_t b, int64_t h, const T* q, const T* k, const T* v, const T* g,
                      const T* beta) {
  const int64_t row = b * n.tokens * n.heads + h;
  return {q + row * n.dk, k + row * n.dk, v + row * n.dv, g + row, beta + row, n.heads * n.dk, n.heads * n.dv,
          n.heads};
}

// One chunk's working set. Everything a chunk computes is in double whatever T is: it is
// C x C and C x D, small beside the tensors, and it keeps fp32 rounding to the inputs
// and outputs. s is the state entering the chunk until advance_state moves it on.
struct Chunk {
  int64_t dk, dv, len = 0;
  std::vector<double> q, k, v, beta;  // the chunk's rows
  std::vector<double> G, gamma;       // cumulative log-decay and its exp, [L]
  std::vector<double> D;              // exp(G_i - G_j), j <= i, [C,C]
  std::vector<double> kk, qk;         // k_i.k_j (j < i), q_i.k_j (j <= i), [C,C]
  std::vector<double> A;              // beta_i D_ij k_i.k_j (j < i), [C,C]
  std::vector<double> w, u;           // S0^T k_j and the delta values, [C,Dv]
  std::vector<double> s;              // [Dk,Dv]

  Chunk(int64_t c, int64_t dk_, int64_t dv_)
      : dk(dk_), dv(dv_), q(c * dk_), k(c * dk_), v(c * dv_), beta(c), G(c), gamma(c), D(c * c), kk(c * c),
        qk(c * c), A(c * c), w(c * dv_), u(c * dv_), s(dk_ * dv_) {}
  int64_t C() const { return static_cast<int64_t>(G.size()); }
};

double dot(const double* x, const double* y, int64_t n) {
  double s = 0;
  for (int64_t e = 0; e < n; ++e) s += x[e] * y[e];
  return s;
}

// Reads tokens [t0, t0 + len) and builds the chunk's decays, products and delta values U
// from the entering state s (already in place).
template <typename T>
void solve_chunk(const HeadRows<T>& r, int64_t t0, int64_t len, Chunk& c) {
  const int64_t dk = c.dk, dv = c.dv, C = c.C();
  c.len = len;
  double G = 0;
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    for (int64_t a = 0; a < dk; ++a) c.q[i * dk + a] = r.q[t * r.qs + a], c.k[i * dk + a] = r.k[t * r.qs + a];
    for (int64_t e = 0; e < dv; ++e) c.v[i * dv + e] = r.v[t * r.vs + e];
    c.beta[i] = r.beta[t * r.gs];
    G += r.g[t * r.gs];
    c.G[i] = G;
    c.gamma[i] = std::exp(G);
  }
  for (int64_t i = 0; i < len; ++i) {
    const double* qi = &c.q[i * dk];
    const double* ki = &c.k[i * dk];
    for (int64_t j = 0; j <= i; ++j) {
      const double* kj = &c.k[j * dk];
      c.D[i * C + j] = std::exp(c.G[i] - c.G[j]);
      c.qk[i * C + j] = dot(qi, kj, dk);
      if (j < i) {
        c.kk[i * C + j] = dot(ki, kj, dk);
        c.A[i * C + j] = c.beta[i] * c.D[i * C + j] * c.kk[i * C + j];
      }
    }
  }
  // w_j = S0^T k_j, then forward substitution: u_j = R_j - sum_{m<j} A_jm u_m.
  for (int64_t j = 0; j < len; ++j) {
    double* wj = &c.w[j * dv];
    double* uj = &c.u[j * dv];
    std::fill(wj, wj + dv, 0.0);
    for (int64_t a = 0; a < dk; ++a) {
      const double ka = c.k[j * dk + a];
      for (int64_t e = 0; e < dv; ++e) wj[e] += ka * c.s[a * dv + e];
    }
    for (int64_t e = 0; e < dv; ++e) uj[e] = c.beta[j] * (c.v[j * dv + e] - c.gamma[j] * wj[e]);
    for (int64_t m = 0; m < j; ++m) {
      const double am = c.A[j * C + m];
      for (int64_t e = 0; e < dv; ++e) uj[e] -= am * c.u[m * dv + e];
    }
  }
}

// o_i = gamma_i S0^T q_i + sum_{j<=i} D_ij (q_i.k_j) u_j, written to out's rows.
template <typename T>
void chunk_outputs(const Chunk& c, T* out, int64_t os, int64_t t0) {
  const int64_t dk = c.dk, dv = c.dv, C = c.C();
  std::vector<double> o(dv);
  for (int64_t i = 0; i < c.len; ++i) {
    std::fill(o.begin(), o.end(), 0.0);
    for (int64_t a = 0; a < dk; ++a) {
      const double qa = c.gamma[i] * c.q[i * dk + a];
      for (int64_t e = 0; e < dv; ++e) o[e] += qa * c.s[a * dv + e];
    }
    for (int64_t j = 0; j <= i; ++j) {
      const double p = c.D[i * C + j] * c.qk[i * C + j];
      for (int64_t e = 0; e < dv; ++e) o[e] += p * c.u[j * dv + e];
    }
    T* oi = out + (t0 + i) * os;
    for (int64_t e = 0; e < dv; ++e) oi[e] = static_cast<T>(o[e]);
  }
}

// c.s becomes the state leaving the chunk: gamma_L S0 + sum_j D_Lj k_j u_j^T.
void advance_state(Chunk& c) {
  const int64_t dk = c.dk, dv = c.dv, C = c.C(), last = c.len - 1;
  for (double& x : c.s) x *= c.gamma[last];
  for (int64_t j = 0; j < c.len; ++j) {
    const double e = c.D[last * C + j];
    for (int64_t a = 0; a < dk; ++a) {
      const double ka = e * c.k[j * dk + a];
      for (int64_t x = 0; x < dv; ++x) c.s[a * dv + x] += ka * c.u[j * dv + x];
    }
  }
}

// Gradients of one chunk, following the forward's steps backward (see the header). dS is
// the gradient of the state leaving the chunk on entry and of the one entering it on exit.
struct ChunkGrad {
  std::vector<double> dq, dk, dv, dbeta, dG, du, dR, dS0;
  std::vector<double> row;  // one Dv row of scratch
  ChunkGrad(int64_t c, int64_t dk_, int64_t dv_)
      : dq(c * dk_), dk(c * dk_), dv(c * dv_), dbeta(c), dG(c), du(c * dv_), dR(c * dv_), dS0(dk_ * dv_), row(dv_) {}
};

template <typename T>
void chunk_backward(const Chunk& c, const T* dout, int64_t os, int64_t t0, std::vector<double>& dS, ChunkGrad& d) {
  const int64_t dk = c.dk, dv = c.dv, C = c.C(), L = c.len, last = L - 1;
  std::fill(d.dq.begin(), d.dq.end(), 0.0);
  std::fill(d.dk.begin(), d.dk.end(), 0.0);
  std::fill(d.dbeta.begin(), d.dbeta.end(), 0.0);
  std::fill(d.dG.begin(), d.dG.end(), 0.0);
  std::fill(d.du.begin(), d.du.end(), 0.0);

  // The state leaving the chunk: S_L = gamma_L S0 + sum_j e_j k_j u_j^T with e_j = D_Lj.
  d.dG[last] += c.gamma[last] * dot(dS.data(), c.s.data(), dk * dv);
  for (int64_t x = 0; x < dk * dv; ++x) d.dS0[x] = c.gamma[last] * dS[x];
  for (int64_t j = 0; j < L; ++j) {
    const double e = c.D[last * C + j];
    double* dSk = d.row.data();  // dS^T k_j
    std::fill(dSk, dSk + dv, 0.0);
    for (int64_t a = 0; a < dk; ++a) {
      const double ka = c.k[j * dk + a];
      double s = 0;
      for (int64_t x = 0; x < dv; ++x) dSk[x] += ka * dS[a * dv + x], s += dS[a * dv + x] * c.u[j * dv + x];
      d.dk[j * dk + a] += e * s;
    }
    for (int64_t x = 0; x < dv; ++x) d.du[j * dv + x] += e * dSk[x];
    const double de = e * dot(dSk, &c.u[j * dv], dv);
    d.dG[last] += de;
    d.dG[j] -= de;
  }

  // The outputs: o_i = gamma_i S0^T q_i + sum_{j<=i} P_ij u_j with P_ij = D_ij q_i.k_j.
  double* dO = d.row.data();
  for (int64_t i = 0; i < L; ++i) {
    const T* doi = dout + (t0 + i) * os;
    for (int64_t x = 0; x < dv; ++x) dO[x] = doi[x];
    const double gi = c.gamma[i];
    const double* qi = &c.q[i * dk];
    double dgamma = 0;
    for (int64_t a = 0; a < dk; ++a) {
      const double sdo = dot(&c.s[a * dv], dO, dv);  // (S0 do_i)_a
      dgamma += qi[a] * sdo;
      d.dq[i * dk + a] += gi * sdo;
      for (int64_t x = 0; x < dv; ++x) d.dS0[a * dv + x] += gi * qi[a] * dO[x];
    }
    d.dG[i] += gi * dgamma;
    for (int64_t j = 0; j <= i; ++j) {
      const double Dij = c.D[i * C + j], P = Dij * c.qk[i * C + j];
      const double dP = dot(dO, &c.u[j * dv], dv);
      for (int64_t x = 0; x < dv; ++x) d.du[j * dv + x] += P * dO[x];
      for (int64_t a = 0; a < dk; ++a) {
        d.dq[i * dk + a] += dP * Dij * c.k[j * dk + a];
        d.dk[j * dk + a] += dP * Dij * qi[a];
      }
      d.dG[i] += dP * P;
      d.dG[j] -= dP * P;
    }
  }

  // U = (I + A)^-1 R, so dR = (I + A)^-T dU: back substitution.
  for (int64_t j = L - 1; j >= 0; --j) {
    double* rj = &d.dR[j * dv];
    for (int64_t x = 0; x < dv; ++x) rj[x] = d.du[j * dv + x];
    for (int64_t i = j + 1; i < L; ++i) {
      const double aij = c.A[i * C + j];
      for (int64_t x = 0; x < dv; ++x) rj[x] -= aij * d.dR[i * dv + x];
    }
  }

  // dA = -dR U^T below the diagonal; A_ij = beta_i D_ij k_i.k_j.
  for (int64_t i = 1; i < L; ++i)
    for (int64_t j = 0; j < i; ++j) {
      const double dA = -dot(&d.dR[i * dv], &c.u[j * dv], dv);
      const double f = dA * c.beta[i] * c.D[i * C + j];
      d.dbeta[i] += dA * c.D[i * C + j] * c.kk[i * C + j];
      for (int64_t a = 0; a < dk; ++a) {
        d.dk[i * dk + a] += f * c.k[j * dk + a];
        d.dk[j * dk + a] += f * c.k[i * dk + a];
      }
      d.dG[i] += dA * c.A[i * C + j];
      d.dG[j] -= dA * c.A[i * C + j];
    }

  // R_j = beta_j (v_j - gamma_j S0^T k_j).
  for (int64_t j = 0; j < L; ++j) {
    const double* rj = &d.dR[j * dv];
    const double bj = c.beta[j], gj = c.gamma[j];
    double dbeta = 0, rw = 0;
    for (int64_t x = 0; x < dv; ++x) {
      d.dv[j * dv + x] = bj * rj[x];
      dbeta += rj[x] * (c.v[j * dv + x] - gj * c.w[j * dv + x]);
      rw += rj[x] * c.w[j * dv + x];
    }
    d.dbeta[j] += dbeta;
    d.dG[j] -= bj * gj * rw;
    for (int64_t a = 0; a < dk; ++a) {
      d.dk[j * dk + a] -= bj * gj * dot(&c.s[a * dv], rj, dv);
      const double ka = bj * gj * c.k[j * dk + a];
      for (int64_t x = 0; x < dv; ++x) d.dS0[a * dv + x] -= ka * rj[x];
    }
  }
  dS.swap(d.dS0);
}

}  // namespace

template <typename T>
void gated_delta_chunked_forward(const GatedDeltaDims& n, const T* q, const T* k, const T* v, const T* g,
                                 const T* beta, const T* state_in, T* out, T* state_out) {
  const int64_t dkv = n.dk * n.dv, C = std::min(n.chunk, std::max<int64_t>(n.tokens, 1));
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < n.batch * n.heads; ++bh) {
    const int64_t b = bh / n.heads, h = bh % n.heads;
    const HeadRows<T> r = head_rows(n, b, h, q, k, v, g, beta);
    Chunk c(C, n.dk, n.dv);
    if (state_in != nullptr)
      for (int64_t x = 0; x < dkv; ++x) c.s[x] = state_in[bh * dkv + x];
    T* o = out + (b * n.tokens * n.heads + h) * n.dv;
    for (int64_t t0 = 0; t0 < n.tokens; t0 += C) {
      solve_chunk(r, t0, std::min(C, n.tokens - t0), c);
      chunk_outputs(c, o, n.heads * n.dv, t0);
      advance_state(c);
    }
    if (state_out != nullptr)
      for (int64_t x = 0; x < dkv; ++x) state_out[bh * dkv + x] = static_cast<T>(c.s[x]);
  }
}

template <typename T>
void gated_delta_chunked_backward(const GatedDeltaDims& n, const T* q, const T* k, const T* v, const T* g,
                                  const T* beta, const T* state_in, const T* dout, const T* d_state_out, T* dq,
                                  T* dk, T* dv, T* dg, T* dbeta, T* d_state_in) {
  const int64_t dkv = n.dk * n.dv, C = std::min(n.chunk, std::max<int64_t>(n.tokens, 1));
  const int64_t chunks = (n.tokens + C - 1) / C;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < n.batch * n.heads; ++bh) {
    const int64_t b = bh / n.heads, h = bh % n.heads;
    const HeadRows<T> r = head_rows(n, b, h, q, k, v, g, beta);
    Chunk c(C, n.dk, n.dv);
    ChunkGrad d(C, n.dk, n.dv);
    // The states entering each chunk, recomputed: the forward keeps none.
    std::vector<double> entering(chunks * dkv);
    if (state_in != nullptr)
      for (int64_t x = 0; x < dkv; ++x) c.s[x] = state_in[bh * dkv + x];
    for (int64_t ci = 0; ci < chunks; ++ci) {
      std::copy(c.s.begin(), c.s.end(), entering.begin() + ci * dkv);
      solve_chunk(r, ci * C, std::min(C, n.tokens - ci * C), c);
      advance_state(c);
    }
    std::vector<double> dS(dkv, 0.0);
    if (d_state_out != nullptr)
      for (int64_t x = 0; x < dkv; ++x) dS[x] = d_state_out[bh * dkv + x];
    const int64_t row = b * n.tokens * n.heads + h, qs = n.heads * n.dk, vs = n.heads * n.dv;
    for (int64_t ci = chunks - 1; ci >= 0; --ci) {
      const int64_t t0 = ci * C, len = std::min(C, n.tokens - t0);
      std::copy(entering.begin() + ci * dkv, entering.begin() + (ci + 1) * dkv, c.s.begin());
      solve_chunk(r, t0, len, c);
      chunk_backward(c, dout + row * n.dv, vs, t0, dS, d);
      // G_i = g_1 + ... + g_i within the chunk: dg_i = sum_{m >= i} dG_m.
      double acc = 0;
      for (int64_t i = len - 1; i >= 0; --i) {
        const int64_t t = t0 + i;
        acc += d.dG[i];
        dg[row + t * n.heads] = static_cast<T>(acc);
        dbeta[row + t * n.heads] = static_cast<T>(d.dbeta[i]);
        for (int64_t a = 0; a < n.dk; ++a) {
          dq[row * n.dk + t * qs + a] = static_cast<T>(d.dq[i * n.dk + a]);
          dk[row * n.dk + t * qs + a] = static_cast<T>(d.dk[i * n.dk + a]);
        }
        for (int64_t x = 0; x < n.dv; ++x) dv[row * n.dv + t * vs + x] = static_cast<T>(d.dv[i * n.dv + x]);
      }
    }
    if (d_state_in != nullptr)
      for (int64_t x = 0; x < dkv; ++x) d_state_in[bh * dkv + x] = static_cast<T>(dS[x]);
  }
}

template void gated_delta_chunked_forward<float>(const GatedDeltaDims&, const float*, const float*, const float*,
                                                 const float*, const float*, const float*, float*, float*);
template void gated_delta_chunked_forward<double>(const GatedDeltaDims&, const double*, const double*,
                                                  const double*, const double*, const double*, const double*,
                                                  double*, double*);
template void gated_delta_chunked_backward<float>(const GatedDeltaDims&, const float*, const float*, const float*,
                                                  const float*, const float*, const float*, const float*,
                                                  const float*, float*, float*, float*, float*, float*, float*);
template void gated_delta_chunked_backward<double>(const GatedDeltaDims&, const double*, const double*,
                                                   const double*, const double*, const double*, const double*,
                                                   const double*, const double*, double*, double*, double*,
                                                   double*, double*, double*);

namespace {

// Checks the inputs (and the given states) and returns the dimensions.
GatedDeltaDims check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                            const Tensor& state_in, int64_t chunk) {
  MT_CHECK(q.ndim() == 4 && v.ndim() == 4)
      << "gated_delta q should be [B,T,H,Dk] and v [B,T,H,Dv], got q " << q.str() << ", v " << v.str();
  const GatedDeltaDims n{q.dim(0), q.dim(1), q.dim(2), q.dim(3), v.dim(3), chunk};
  MT_CHECK(chunk >= 1) << "gated_delta chunk size must be >= 1, got " << chunk;
  check_tensor(q, "gated_delta q", DType::f32, {n.batch, n.tokens, n.heads, n.dk});
  check_tensor(k, "gated_delta k", DType::f32, {n.batch, n.tokens, n.heads, n.dk});
  check_tensor(v, "gated_delta v", DType::f32, {n.batch, n.tokens, n.heads, n.dv});
  check_tensor(g, "gated_delta g", DType::f32, {n.batch, n.tokens, n.heads});
  check_tensor(beta, "gated_delta beta", DType::f32, {n.batch, n.tokens, n.heads});
  if (present(state_in)) check_tensor(state_in, "gated_delta state_in", DType::f32, {n.batch, n.heads, n.dk, n.dv});
  MT_CHECK(q.device == Device::cpu && k.device == Device::cpu && v.device == Device::cpu)
      << "cpu gated_delta got q " << q.str() << ", k " << k.str() << ", v " << v.str();
  return n;
}

const float* maybe(const Tensor& t) { return present(t) ? t.f32() : nullptr; }
float* maybe_out(const Tensor& t) { return present(t) ? t.f32() : nullptr; }

}  // namespace

void gated_delta_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                         const Tensor& state_in, const Tensor& out, const Tensor& state_out, int64_t chunk) {
  const GatedDeltaDims n = check_inputs(q, k, v, g, beta, state_in, chunk);
  check_tensor(out, "gated_delta out", DType::f32, {n.batch, n.tokens, n.heads, n.dv});
  if (present(state_out))
    check_tensor(state_out, "gated_delta state_out", DType::f32, {n.batch, n.heads, n.dk, n.dv});
  gated_delta_chunked_forward<float>(n, q.f32(), k.f32(), v.f32(), g.f32(), beta.f32(), maybe(state_in), out.f32(),
                                     maybe_out(state_out));
}

void gated_delta_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& state_in, const Tensor& dout, const Tensor& d_state_out, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                          const Tensor& d_state_in, int64_t chunk) {
  const GatedDeltaDims n = check_inputs(q, k, v, g, beta, state_in, chunk);
  const Shape qk{n.batch, n.tokens, n.heads, n.dk}, vo{n.batch, n.tokens, n.heads, n.dv},
      scalar{n.batch, n.tokens, n.heads}, state{n.batch, n.heads, n.dk, n.dv};
  check_tensor(dout, "gated_delta dout", DType::f32, vo);
  if (present(d_state_out)) check_tensor(d_state_out, "gated_delta d_state_out", DType::f32, state);
  check_tensor(dq, "gated_delta dq", DType::f32, qk);
  check_tensor(dk, "gated_delta dk", DType::f32, qk);
  check_tensor(dv, "gated_delta dv", DType::f32, vo);
  check_tensor(dg, "gated_delta dg", DType::f32, scalar);
  check_tensor(dbeta, "gated_delta dbeta", DType::f32, scalar);
  if (present(d_state_in)) check_tensor(d_state_in, "gated_delta d_state_in", DType::f32, state);
  gated_delta_chunked_backward<float>(n, q.f32(), k.f32(), v.f32(), g.f32(), beta.f32(), maybe(state_in), dout.f32(),
                                      maybe(d_state_out), dq.f32(), dk.f32(), dv.f32(), dg.f32(), dbeta.f32(),
                                      maybe_out(d_state_in));
}

}  // namespace mt::cpu
