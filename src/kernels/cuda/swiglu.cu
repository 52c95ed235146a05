// Gated activations on the GPU: elementwise in f32 over f32-or-bf16 storage, with the
// CPU backend's formulas (and grouping of products) term for term.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/swiglu.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;

// expf, not __expf: the fast intrinsic's error grows with |x| and the gates reach +-10.
__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void swiglu_forward_kernel(In gu, int64_t n, int64_t inter, Out h) {
  MT_GRID_STRIDE(idx, n * inter) {
    const int64_t r = idx / inter, c = idx % inter;
    const float gate = gu[r * 2 * inter + c], up = gu[r * 2 * inter + inter + c];
    h.set(idx, gate * sigmoid(gate) * up);
  }
}

__global__ void swiglu_backward_kernel(In gu, In dh, int64_t n, int64_t inter, Out dgu) {
  MT_GRID_STRIDE(idx, n * inter) {
    const int64_t r = idx / inter, c = idx % inter;
    const float gate = gu[r * 2 * inter + c], up = gu[r * 2 * inter + inter + c];
    const float s = sigmoid(gate), d = dh[idx];
    // silu'(x) = s + x s (1 - s)
    dgu.set(r * 2 * inter + c, d * up * s * (1.0f + gate * (1.0f - s)));
    dgu.set(r * 2 * inter + inter + c, d * gate * s);
  }
}

// bf16 rows whose width I is a multiple of 8 (every model's expert width), 16-byte
// aligned: 8 columns a thread, one 16-byte load or store of each row piece, the formulas
// above term for term (so the bits are the scalar kernels').
__global__ void swiglu_forward_x8_kernel(const __nv_bfloat16* gu, int64_t n, int64_t inter, __nv_bfloat16* h) {
  const int64_t per_row = inter / 8;
  MT_GRID_STRIDE(i8, n * per_row) {
    const int64_t r = i8 / per_row, c = i8 % per_row * 8;
    float gate[8], up[8];
    load8(gu + r * 2 * inter + c, gate);
    load8(gu + r * 2 * inter + inter + c, up);
    for (int j = 0; j < 8; ++j) gate[j] = gate[j] * sigmoid(gate[j]) * up[j];
    store8(h + r * inter + c, gate);
  }
}

__global__ void swiglu_backward_x8_kernel(const __nv_bfloat16* gu, const __nv_bfloat16* dh, int64_t n, int64_t inter,
                                          __nv_bfloat16* dgu) {
  const int64_t per_row = inter / 8;
  MT_GRID_STRIDE(i8, n * per_row) {
    const int64_t r = i8 / per_row, c = i8 % per_row * 8;
    float gate[8], up[8], d[8], d_gate[8];
    load8(gu + r * 2 * inter + c, gate);
    load8(gu + r * 2 * inter + inter + c, up);
    load8(dh + r * inter + c, d);
    for (int j = 0; j < 8; ++j) {
      const float s = sigmoid(gate[j]);
      d_gate[j] = d[j] * up[j] * s * (1.0f + gate[j] * (1.0f - s));
      up[j] = d[j] * gate[j] * s;
    }
    store8(dgu + r * 2 * inter + c, d_gate);
    store8(dgu + r * 2 * inter + inter + c, up);
  }
}

// fminf/fmaxf would turn a NaN input into the limit; the comparisons keep it NaN, as
// torch.clamp and the CPU backend do.
__device__ float clamp_above(float x, float hi) { return x > hi ? hi : x; }
__device__ float clamp_both(float x, float lim) { return x > lim ? lim : (x < -lim ? -lim : x); }

__global__ void clamped_swiglu_forward_kernel(In gu, float limit, float alpha, int64_t n, int64_t inter, Out h) {
  MT_GRID_STRIDE(idx, n * inter) {
    const int64_t r = idx / inter, c = idx % inter;
    const float gate = clamp_above(gu[r * 2 * inter + 2 * c], limit);
    const float up = clamp_both(gu[r * 2 * inter + 2 * c + 1], limit);
    h.set(idx, (up + 1.0f) * gate * sigmoid(alpha * gate));
  }
}

// torch.clamp passes the gradient where min <= x <= max, boundaries included.
__global__ void clamped_swiglu_backward_kernel(In gu, float limit, float alpha, In dh, int64_t n, int64_t inter,
                                               Out dgu) {
  MT_GRID_STRIDE(idx, n * inter) {
    const int64_t r = idx / inter, c = idx % inter;
    const int64_t g_at = r * 2 * inter + 2 * c;
    const float graw = gu[g_at], uraw = gu[g_at + 1];
    const float gate = clamp_above(graw, limit), up = clamp_both(uraw, limit);
    const float s = sigmoid(alpha * gate), d = dh[idx];
    dgu.set(g_at, graw <= limit ? d * (up + 1.0f) * s * (1.0f + alpha * gate * (1.0f - s)) : 0.0f);
    dgu.set(g_at + 1, (uraw >= -limit && uraw <= limit) ? d * gate * s : 0.0f);
  }
}

// gu [N, 2I] and the [N, I] tensor that goes with it; returns I.
int64_t check_gated(const char* op, const Tensor& gu, const Tensor& half, const char* half_name) {
  MT_CHECK(gu.ndim() == 2 && gu.dim(1) % 2 == 0) << op << " input should be [N,2I], got " << gu.str();
  const int64_t n = gu.dim(0), i = gu.dim(1) / 2;
  check_arg(gu, op, {DType::bf16, DType::f32}, {n, 2 * i});
  check_arg(half, half_name, {DType::bf16, DType::f32}, {n, i});
  return i;
}

unsigned grid_for(int64_t n) { return std::min<unsigned>(blocks_for(n, kThreads), 32u * sm_count()); }

// Elementwise gates: one thread an element. Row gates: a warp a row, its lanes' sums
// reduced by warp_sum.
__global__ void sigmoid_gate_forward_kernel(In v, In s, int64_t n, int64_t c, bool row_gate, Out out) {
  MT_GRID_STRIDE(idx, n * c) out.set(idx, v[idx] * sigmoid(s[row_gate ? idx / c : idx]));
}

__global__ void sigmoid_gate_backward_kernel(In v, In s, In dout, int64_t n, int64_t c, Out dv, Out ds) {
  MT_GRID_STRIDE(idx, n * c) {
    const float sg = sigmoid(s[idx]), d = dout[idx];
    ds.set(idx, d * v[idx] * sg * (1.0f - sg));
    dv.set(idx, sg * d);
  }
}

__global__ void sigmoid_gate_backward_rows_kernel(In v, In s, In dout, int64_t n, int64_t c, Out dv, Out ds) {
  const int64_t row = (blockIdx.x * int64_t{kThreads} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float sg = sigmoid(s[row]);
  float sum = 0.0f;
  for (int64_t j = lane; j < c; j += 32) {
    const float d = dout[row * c + j];
    sum += d * v[row * c + j] * sg * (1.0f - sg);
    dv.set(row * c + j, sg * d);
  }
  sum = warp_sum(sum);
  if (lane == 0) ds.set(row, sum);
}

int64_t check_sigmoid_gate(const Tensor& v, const Tensor& s) {
  MT_CHECK(v.ndim() == 2) << "sigmoid_gate v should be [N,C], got " << v.str();
  check_arg(v, "sigmoid_gate v", {DType::bf16, DType::f32}, v.shape);
  MT_CHECK(s.ndim() == 2 && s.dim(0) == v.dim(0) && (s.dim(1) == v.dim(1) || s.dim(1) == 1))
      << "sigmoid_gate s should be [N,C] or [N,1] for v " << v.str() << ", got " << s.str();
  check_arg(s, "sigmoid_gate s", {DType::bf16, DType::f32}, s.shape);
  return s.dim(1);
}

}  // namespace

void swiglu_forward(const Tensor& gu, const Tensor& h) {
  const int64_t i = check_gated("swiglu gu", gu, h, "swiglu h"), n = gu.dim(0);
  if (n * i == 0) return;
  if (x8(i, {&gu, &h}))
    swiglu_forward_x8_kernel<<<grid_for(n * i / 8), kThreads, 0, stream()>>>(bf16_data(gu), n, i, bf16_data(h));
  else
    swiglu_forward_kernel<<<grid_for(n * i), kThreads, 0, stream()>>>(as_in(gu), n, i, as_out(h));
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const Tensor& gu, const Tensor& dh, const Tensor& dgu) {
  const int64_t i = check_gated("swiglu gu", gu, dh, "swiglu dh"), n = gu.dim(0);
  check_arg(dgu, "swiglu dgu", {DType::bf16, DType::f32}, gu.shape);
  if (n * i == 0) return;
  if (x8(i, {&gu, &dh, &dgu}))
    swiglu_backward_x8_kernel<<<grid_for(n * i / 8), kThreads, 0, stream()>>>(bf16_data(gu), bf16_data(dh), n, i,
                                                                              bf16_data(dgu));
  else
    swiglu_backward_kernel<<<grid_for(n * i), kThreads, 0, stream()>>>(as_in(gu), as_in(dh), n, i, as_out(dgu));
  CUDA_CHECK_LAUNCH();
}

void clamped_swiglu_forward(const Tensor& gu, float limit, float alpha, const Tensor& h) {
  const int64_t i = check_gated("clamped_swiglu gu", gu, h, "clamped_swiglu h"), n = gu.dim(0);
  if (n * i == 0) return;
  clamped_swiglu_forward_kernel<<<grid_for(n * i), kThreads, 0, stream()>>>(as_in(gu), limit, alpha, n, i,
                                                                             as_out(h));
  CUDA_CHECK_LAUNCH();
}

void clamped_swiglu_backward(const Tensor& gu, float limit, float alpha, const Tensor& dh, const Tensor& dgu) {
  const int64_t i = check_gated("clamped_swiglu gu", gu, dh, "clamped_swiglu dh"), n = gu.dim(0);
  check_arg(dgu, "clamped_swiglu dgu", {DType::bf16, DType::f32}, gu.shape);
  if (n * i == 0) return;
  clamped_swiglu_backward_kernel<<<grid_for(n * i), kThreads, 0, stream()>>>(as_in(gu), limit, alpha, as_in(dh), n,
                                                                              i, as_out(dgu));
  CUDA_CHECK_LAUNCH();
}

void sigmoid_gate_forward(const Tensor& v, const Tensor& s, const Tensor& out) {
  const int64_t gc = check_sigmoid_gate(v, s), n = v.dim(0), c = v.dim(1);
  check_arg(out, "sigmoid_gate out", {DType::bf16, DType::f32}, v.shape);
  if (n * c == 0) return;
  sigmoid_gate_forward_kernel<<<grid_for(n * c), kThreads, 0, stream()>>>(as_in(v), as_in(s), n, c, gc == 1 && c > 1,
                                                                          as_out(out));
  CUDA_CHECK_LAUNCH();
}

void sigmoid_gate_backward(const Tensor& v, const Tensor& s, const Tensor& dout, const Tensor& dv, const Tensor& ds) {
  const int64_t gc = check_sigmoid_gate(v, s), n = v.dim(0), c = v.dim(1);
  check_arg(dout, "sigmoid_gate dout", {DType::bf16, DType::f32}, v.shape);
  check_arg(dv, "sigmoid_gate dv", {DType::bf16, DType::f32}, v.shape);
  check_arg(ds, "sigmoid_gate ds", {DType::bf16, DType::f32}, s.shape);
  if (n * c == 0) return;
  if (gc == 1 && c > 1)
    sigmoid_gate_backward_rows_kernel<<<blocks_for(n * 32, kThreads), kThreads, 0, stream()>>>(
        as_in(v), as_in(s), as_in(dout), n, c, as_out(dv), as_out(ds));
  else
    sigmoid_gate_backward_kernel<<<grid_for(n * c), kThreads, 0, stream()>>>(as_in(v), as_in(s), as_in(dout), n, c,
                                                                             as_out(dv), as_out(ds));
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
