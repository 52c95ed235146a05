// Gated DeltaNet's convolution and gates on the GPU (kernels/deltanet.h has the math and the
// CPU's version). x, y, dy, dx, a, b, da, db f32 or bf16; the weights, g, beta and their
// gradients f32. The weight gradients are per-block partial sums added in block order,
// so they repeat bit for bit.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/deltanet.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxWidth = 8;   // the convolution's K (Qwen3.5: 4)
constexpr int kRowBlock = 256;  // tokens per partial sum of dw

unsigned grid_for(int64_t n) { return std::min<unsigned>(blocks_for(n, kThreads), 32u * sm_count()); }

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float softplus_grad(float x) { return x > 20.0f ? 1.0f : sigmoid(x); }

// The pre-activation at token t (of T) of row r = b T + t, channel c.
__device__ __forceinline__ float conv_at(In x, const float* w, int64_t r, int64_t t, int64_t c, int64_t C, int K) {
  float pre = 0.0f;
  for (int j = 0; j < K; ++j)
    if (t - (K - 1) + j >= 0) pre += w[c * K + j] * x[(r - (K - 1) + j) * C + c];
  return pre;
}

__global__ void conv_forward_kernel(In x, const float* w, int64_t B, int64_t T, int64_t C, int K, Out y) {
  MT_GRID_STRIDE(i, B * T * C) {
    const int64_t r = i / C, c = i % C;
    const float pre = conv_at(x, w, r, r % T, c, C, K);
    y.set(i, pre * sigmoid(pre));
  }
}

// d pre at (r, c): dy times silu's derivative.
__device__ __forceinline__ float dpre_at(In x, const float* w, In dy, int64_t r, int64_t t, int64_t c, int64_t C,
                                         int K) {
  const float pre = conv_at(x, w, r, t, c, C, K), s = sigmoid(pre);
  return dy[r * C + c] * s * (1.0f + pre * (1.0f - s));
}

// dx[t] = sum_j w[j] dpre[t + K - 1 - j] within the sequence.
__global__ void conv_backward_x_kernel(In x, const float* w, In dy, int64_t B, int64_t T, int64_t C, int K, Out dx) {
  MT_GRID_STRIDE(i, B * T * C) {
    const int64_t r = i / C, c = i % C, t = r % T;
    float s = 0.0f;
    for (int j = 0; j < K; ++j) {
      const int64_t u = t + K - 1 - j;
      if (u < T) s += w[c * K + j] * dpre_at(x, w, dy, r + (K - 1 - j), u, c, C, K);
    }
    dx.set(i, s);
  }
}

// Grid (channel blocks, row blocks): part[rb][c][j] = sum over the block's rows of
// dpre[r, c] x[r - (K - 1) + j, c], rows in order.
__global__ void conv_backward_w_kernel(In x, const float* w, In dy, int64_t B, int64_t T, int64_t C, int K,
                                       float* part) {
  const int64_t c = blockIdx.x * int64_t{kThreads} + threadIdx.x, r0 = blockIdx.y * int64_t{kRowBlock};
  if (c >= C) return;
  float acc[kMaxWidth] = {};
  for (int64_t r = r0; r < min(r0 + kRowBlock, B * T); ++r) {
    const int64_t t = r % T;
    const float d = dpre_at(x, w, dy, r, t, c, C, K);
    for (int j = 0; j < K; ++j)
      if (t - (K - 1) + j >= 0) acc[j] += d * x[(r - (K - 1) + j) * C + c];
  }
  for (int j = 0; j < K; ++j) part[(blockIdx.y * C + c) * K + j] = acc[j];
}

__global__ void sum_parts_kernel(const float* part, int64_t blocks, int64_t n, float* dst) {
  MT_GRID_STRIDE(i, n) {
    float s = 0.0f;
    for (int64_t p = 0; p < blocks; ++p) s += part[p * n + i];
    dst[i] += s;
  }
}

__global__ void gates_forward_kernel(In a, In b, const float* A_log, const float* dt_bias, int64_t n, int64_t h,
                                     float* g, float* beta) {
  MT_GRID_STRIDE(i, n * h) {
    const int64_t j = i % h;
    g[i] = -expf(A_log[j]) * softplus(a[i] + dt_bias[j]);
    beta[i] = sigmoid(b[i]);
  }
}

// A block per head: its rows in a fixed stride order, then block_sum.
__global__ void gates_backward_kernel(In a, In b, const float* A_log, const float* dt_bias, const float* dg,
                                      const float* dbeta, int64_t n, int64_t h, Out da, Out db, float* dA_log,
                                      float* ddt_bias) {
  __shared__ float red[kThreads / 32];
  const int64_t j = blockIdx.x;
  const float scale = -expf(A_log[j]);
  float sum_a = 0.0f, sum_dt = 0.0f;
  for (int64_t r = threadIdx.x; r < n; r += kThreads) {
    const int64_t i = r * h + j;
    const float u = a[i] + dt_bias[j], d = dg[i], s = sigmoid(b[i]), d_u = d * scale * softplus_grad(u);
    sum_a += d * scale * softplus(u);
    sum_dt += d_u;
    db.set(i, dbeta[i] * s * (1.0f - s));
    da.set(i, d_u);
  }
  sum_a = block_sum(sum_a, red);
  sum_dt = block_sum(sum_dt, red);
  if (threadIdx.x == 0) {
    dA_log[j] += sum_a;
    ddt_bias[j] += sum_dt;
  }
}

int check_conv(const Tensor& x, const Tensor& w) {
  MT_CHECK(x.ndim() == 3) << "causal_conv1d_silu x should be [B,T,C], got " << x.str();
  check_arg(x, "causal_conv1d_silu x", {DType::bf16, DType::f32}, x.shape);
  MT_CHECK(w.ndim() == 2 && w.dim(0) == x.dim(2) && w.dim(1) >= 1 && w.dim(1) <= kMaxWidth)
      << "causal_conv1d_silu w should be [C,K] = [" << x.dim(2) << ",K] with 1 <= K <= " << kMaxWidth
      << " on the GPU for x " << x.str() << ", got " << w.str();
  check_arg(w, "causal_conv1d_silu w", {DType::f32}, w.shape);
  return static_cast<int>(w.dim(1));
}

int64_t check_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias) {
  MT_CHECK(a.ndim() == 2) << "deltanet_gates a should be [N,H], got " << a.str();
  const int64_t h = a.dim(1);
  check_arg(a, "deltanet_gates a", {DType::bf16, DType::f32}, a.shape);
  check_arg(b, "deltanet_gates b", {DType::bf16, DType::f32}, a.shape);
  check_arg(A_log, "deltanet_gates A_log", {DType::f32}, {h});
  check_arg(dt_bias, "deltanet_gates dt_bias", {DType::f32}, {h});
  return a.dim(0);
}

}  // namespace

void causal_conv1d_silu_forward(const Tensor& x, const Tensor& w, const Tensor& y) {
  const int K = check_conv(x, w);
  check_arg(y, "causal_conv1d_silu y", {DType::bf16, DType::f32}, x.shape);
  MT_CHECK(x.numel() == 0 || y.data != x.data) << "causal_conv1d_silu needs y apart from x (later rows read x)";
  const int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2);
  if (x.numel() == 0) return;
  conv_forward_kernel<<<grid_for(x.numel()), kThreads, 0, stream()>>>(as_in(x), w.f32(), B, T, C, K, as_out(y));
  CUDA_CHECK_LAUNCH();
}

void causal_conv1d_silu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                                 const Tensor& dw) {
  const int K = check_conv(x, w);
  const int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2);
  check_arg(dy, "causal_conv1d_silu dy", {DType::bf16, DType::f32}, x.shape);
  check_arg(dx, "causal_conv1d_silu dx", {DType::bf16, DType::f32}, x.shape);
  check_arg(dw, "causal_conv1d_silu dw", {DType::f32}, {C, K});
  // The CPU's dx may be dy; here other threads read dy rows that dx would overwrite.
  MT_CHECK(x.numel() == 0 || (dx.data != dy.data && dx.data != x.data))
      << "causal_conv1d_silu_backward on the GPU needs dx apart from dy and x";
  if (x.numel() == 0) return;
  const int64_t blocks = (B * T + kRowBlock - 1) / kRowBlock;
  MT_CHECK(blocks <= 65535) << "causal_conv1d_silu_backward takes up to " << 65535 * int64_t{kRowBlock}
                            << " tokens on the GPU, got " << B * T;
  auto* part = static_cast<float*>(scratch(sizeof(float) * static_cast<size_t>(blocks * C * K)));
  conv_backward_w_kernel<<<dim3(blocks_for(C, kThreads), static_cast<unsigned>(blocks)), kThreads, 0, stream()>>>(
      as_in(x), w.f32(), as_in(dy), B, T, C, K, part);
  CUDA_CHECK_LAUNCH();
  sum_parts_kernel<<<grid_for(C * K), kThreads, 0, stream()>>>(part, blocks, C * K, dw.f32());
  CUDA_CHECK_LAUNCH();
  conv_backward_x_kernel<<<grid_for(x.numel()), kThreads, 0, stream()>>>(as_in(x), w.f32(), as_in(dy), B, T, C, K,
                                                                          as_out(dx));
  CUDA_CHECK_LAUNCH();
}

void deltanet_gates_forward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                            const Tensor& g, const Tensor& beta) {
  const int64_t n = check_gates(a, b, A_log, dt_bias), h = a.dim(1);
  check_arg(g, "deltanet_gates g", {DType::f32}, a.shape);
  check_arg(beta, "deltanet_gates beta", {DType::f32}, a.shape);
  if (n * h == 0) return;
  gates_forward_kernel<<<grid_for(n * h), kThreads, 0, stream()>>>(as_in(a), as_in(b), A_log.f32(), dt_bias.f32(),
                                                                   n, h, g.f32(), beta.f32());
  CUDA_CHECK_LAUNCH();
}

void deltanet_gates_backward(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                             const Tensor& dg, const Tensor& dbeta, const Tensor& da, const Tensor& db,
                             const Tensor& dA_log, const Tensor& ddt_bias) {
  const int64_t n = check_gates(a, b, A_log, dt_bias), h = a.dim(1);
  check_arg(dg, "deltanet_gates dg", {DType::f32}, a.shape);
  check_arg(dbeta, "deltanet_gates dbeta", {DType::f32}, a.shape);
  check_arg(da, "deltanet_gates da", {DType::bf16, DType::f32}, a.shape);
  check_arg(db, "deltanet_gates db", {DType::bf16, DType::f32}, a.shape);
  check_arg(dA_log, "deltanet_gates dA_log", {DType::f32}, {h});
  check_arg(ddt_bias, "deltanet_gates ddt_bias", {DType::f32}, {h});
  if (h == 0) return;
  gates_backward_kernel<<<static_cast<unsigned>(h), kThreads, 0, stream()>>>(
      as_in(a), as_in(b), A_log.f32(), dt_bias.f32(), dg.f32(), dbeta.f32(), n, h, as_out(da), as_out(db),
      dA_log.f32(), ddt_bias.f32());
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
