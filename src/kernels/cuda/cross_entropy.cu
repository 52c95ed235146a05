// Fused softmax cross-entropy on the GPU over f32 or bf16 logits: a block per row, one
// online max/sum read, lse f32, the loss summed in double on the device; the backward
// overwrites the logits (or writes a separate buffer), within the forward's pass over
// each row when the forward is given the gradient's buffer.
#include <cmath>

#include "kernels/cross_entropy.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 512;

// Rows are read in 16-byte chunks (8 bf16 or 4 f32) when length and base allow, else singly.

__device__ void load_chunk(const void* row, bool bf16, int64_t q, float* v) {
  const uint4 u = static_cast<const uint4*>(row)[q];
  if (bf16) {
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __bfloat162float(e[k]);
  } else {
    const float* e = reinterpret_cast<const float*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = e[k];
  }
}

__device__ void store_chunk(void* row, bool bf16, int64_t q, const float* v) {
  uint4 u;
  if (bf16) {
    __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = __float2bfloat16_rn(v[k]);
  } else {
    float* e = reinterpret_cast<float*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) e[k] = v[k];
  }
  static_cast<uint4*>(row)[q] = u;
}

// Running softmax statistics: the maximum m and sum(exp(x - m)).
struct MaxSum {
  float m = -INFINITY, s = 0.0f;
  __device__ void add(float x) {
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  // An empty side (s == 0) contributes nothing, even when its m is -inf.
  __device__ void merge(const MaxSum& o) {
    const float top = fmaxf(m, o.m);
    s = (s == 0.0f ? 0.0f : s * expf(m - top)) + (o.s == 0.0f ? 0.0f : o.s * expf(o.m - top));
    m = top;
  }
};

__device__ MaxSum block_max_sum(MaxSum v) {
  __shared__ float ms[32], ss[32];
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other;
    other.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, v.s, o);
    v.merge(other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    ms[warp] = v.m;
    ss[warp] = v.s;
  }
  __syncthreads();
  MaxSum total;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total.merge(MaxSum{ms[w], ss[w]});
  return total;
}

// dlogits = scale * (exp(x - lse) - onehot(label)) over one row, zero on an ignored row.
// Each element is read and written by the same thread, so out may be the logits row.
// `reverse` walks the row from its end: right after the forward's pass over it, whose
// last chunks are the likeliest to be in L2 still.
__device__ void grad_row(In in, Out out, int64_t v, bool vec, int32_t y, bool skip, float l, float scale,
                         bool reverse) {
  auto grad = [&](int64_t j, float x) {
    if (skip) return 0.0f;
    const float g = scale * expf(x - l);
    return j == y ? g - scale : g;
  };
  if (vec) {
    const int w = in.bf16 ? 8 : 4;
    const int64_t chunks = v / w;
    float buf[8];
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
      const int64_t q = reverse ? chunks - 1 - i : i;
      load_chunk(in.p, in.bf16, q, buf);
#pragma unroll
      for (int k = 0; k < 8; ++k)  // all 8 unrolled, so buf stays in registers
        if (k < w) buf[k] = grad(q * w + k, buf[k]);
      store_chunk(out.p, out.bf16, q, buf);
    }
  } else {
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
      const int64_t j = reverse ? v - 1 - i : i;
      out.set(j, grad(j, in[j]));
    }
  }
}

// lse[row], and the row's loss in double (0 when ignored, NaN for a label outside the
// vocabulary: the sum shows it, where the CPU backend would name the row); with
// dlogits.p, the row's gradient as ce_backward_kernel writes it, from the same lse.
__global__ void ce_forward_kernel(In logits, const int32_t* labels, int32_t ignore, int64_t v, bool vec, float* lse,
                                  double* row_loss, float scale, Out dlogits) {
  const int64_t row = blockIdx.x;
  const In x = logits.from(row * v);
  MaxSum st;
  if (vec) {
    const int w = logits.bf16 ? 8 : 4;
    float buf[8];
    for (int64_t q = threadIdx.x; q < v / w; q += blockDim.x) {
      load_chunk(x.p, x.bf16, q, buf);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (k < w) st.add(buf[k]);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) st.add(x[j]);
  }
  st = block_max_sum(st);
  const float l = st.m + logf(st.s);
  const int32_t y = labels[row];
  if (threadIdx.x == 0) {
    lse[row] = l;
    if (y == ignore)
      row_loss[row] = 0.0;
    else if (y < 0 || y >= v)
      row_loss[row] = NAN;
    else
      row_loss[row] = static_cast<double>(l) - x[y];
  }
  if (dlogits.p == nullptr) return;
  __syncthreads();  // the label's logit is read before the pass below may overwrite it
  grad_row(x, dlogits.from(row * v), v, vec, y, y == ignore, l, scale, true);
}

// One block adds the rows' losses in a fixed order and counts the labelled rows.
__global__ void ce_sum_kernel(const double* row_loss, const int32_t* labels, int32_t ignore, int64_t n,
                              double* result) {
  __shared__ double warp_sums[32];
  double s = 0, c = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    s += row_loss[i];
    c += labels[i] != ignore ? 1.0 : 0.0;
  }
  s = block_sum(s, warp_sums);
  c = block_sum(c, warp_sums);
  if (threadIdx.x == 0) {
    result[0] = s;
    result[1] = c;
  }
}

// grad_row over every row, from the forward's lse (dlogits may be the logits buffer).
__global__ void ce_backward_kernel(In logits, const int32_t* labels, const float* lse, int32_t ignore, float scale,
                                   int64_t v, bool vec, Out dlogits) {
  const int64_t row = blockIdx.x;
  const int32_t y = labels[row];
  grad_row(logits.from(row * v), dlogits.from(row * v), v, vec, y, y == ignore, lse[row], scale, false);
}

void check_args(const Tensor& logits, const Tensor& labels, const Tensor& lse) {
  MT_CHECK(logits.ndim() == 2) << "cross-entropy logits should be [N,V], got " << logits.str();
  const int64_t n = logits.dim(0), v = logits.dim(1);
  check_arg(logits, "logits", {DType::bf16, DType::f32}, {n, v});
  check_arg(labels, "labels", {DType::i32}, {n});
  check_arg(lse, "lse", {DType::f32}, {n});
}

}  // namespace

cpu::CrossEntropySum cross_entropy_forward(const Tensor& logits, const Tensor& labels, int32_t ignore_index,
                                           const Tensor& lse, float scale, const Tensor& dlogits) {
  check_args(logits, labels, lse);
  const int64_t n = logits.dim(0), v = logits.dim(1);
  const bool grad = dlogits.data != nullptr;
  if (grad) check_arg(dlogits, "dlogits", {logits.dtype}, {n, v});
  if (n == 0) return {};
  MT_CHECK(v > 0) << "cross-entropy over an empty vocabulary: logits " << logits.str();
  const bool bf16 = logits.dtype == DType::bf16;
  const bool vec = v % (bf16 ? 8 : 4) == 0 && aligned16(logits.data) && (!grad || aligned16(dlogits.data));
  double* row_loss = static_cast<double*>(scratch(sizeof(double) * (n + 2)));
  double* result = row_loss + n;
  ce_forward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream()>>>(
      as_in(logits), labels.i32(), ignore_index, v, vec, lse.f32(), row_loss, scale, Out{dlogits.data, bf16});
  CUDA_CHECK_LAUNCH();
  ce_sum_kernel<<<1, 1024, 0, stream()>>>(row_loss, labels.i32(), ignore_index, n, result);
  CUDA_CHECK_LAUNCH();
  double host[2];
  CUDA_CHECK(cudaMemcpyAsync(host, result, sizeof(host), cudaMemcpyDeviceToHost, stream()));
  synchronize();
  return {host[0], static_cast<int64_t>(host[1])};
}

void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, int32_t ignore_index,
                            float scale, const Tensor& dlogits) {
  check_args(logits, labels, lse);
  const int64_t n = logits.dim(0), v = logits.dim(1);
  check_arg(dlogits, "dlogits", {DType::bf16, DType::f32}, {n, v});
  MT_CHECK(dlogits.data != logits.data || dlogits.dtype == logits.dtype)
      << "cross-entropy backward in place needs one dtype, got logits " << logits.str() << ", dlogits "
      << dlogits.str();
  if (n == 0 || v == 0) return;
  const bool bf16 = logits.dtype == DType::bf16;
  const bool vec = dlogits.dtype == logits.dtype && v % (bf16 ? 8 : 4) == 0 && aligned16(logits.data) &&
                   aligned16(dlogits.data);
  ce_backward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream()>>>(
      as_in(logits), labels.i32(), lse.f32(), ignore_index, scale, v, vec, as_out(dlogits));
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
