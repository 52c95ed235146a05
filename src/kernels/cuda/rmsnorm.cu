// RMSNorm on the GPU: one warp per row (statistics in f32, rstd kept in f32), and the
// weight gradient as deterministic column sums in two passes; rmsnorm_rope, the per-head
// norm and rotation in one pass each way.

#include <algorithm>
#include <initializer_list>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"

namespace mt::cuda {

namespace {

constexpr int kRowsPerBlock = 8;  // one warp each
constexpr int kThreads = 32 * kRowsPerBlock;

// Products grouped as in the CPU backend: the two differ only in the order of the row sums.
__global__ void rmsnorm_forward_kernel(In x, const float* w, float wo, float eps, int64_t n, int64_t d, Out y,
                                       float* rstd) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t base = row * d;
  float ss = 0.0f;
  for (int64_t c = lane; c < d; c += 32) {
    float v = x[base + c];
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
  if (lane == 0) rstd[row] = r;
  for (int64_t c = lane; c < d; c += 32) y.set(base + c, x[base + c] * r * (w[c] + wo));
}

// dx = r * (w*dy - xhat * mean(w*dy*xhat)), xhat = x * r.
// With a residual: dx's value rounded to its dtype (where the separate add would read
// it), plus the residual.
__global__ void rmsnorm_dx_kernel(In x, const float* w, float wo, const float* rstd, In dy, int64_t n, int64_t d,
                                  Out dx, In residual) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t base = row * d;
  const float r = rstd[row];
  float dot = 0.0f;
  for (int64_t c = lane; c < d; c += 32) dot += (w[c] + wo) * dy[base + c] * x[base + c] * r;
  dot = warp_sum(dot) / static_cast<float>(d);
  for (int64_t c = lane; c < d; c += 32) {
    float v = r * ((w[c] + wo) * dy[base + c] - x[base + c] * r * dot);
    if (residual.p != nullptr) v = (dx.bf16 ? __bfloat162float(__float2bfloat16_rn(v)) : v) + residual[base + c];
    dx.set(base + c, v);
  }
}

// bf16 rows whose width is a multiple of 8 (every model's hidden size and head_dim): a
// lane moves 16 bytes per load and store instead of 2, which these memory-bound passes
// need to approach the bandwidth. Same arithmetic per element; row sums in another order.
__global__ void rmsnorm_forward_x8_kernel(const __nv_bfloat16* x, const float* w, float wo, float eps, int64_t n,
                                          int64_t d, __nv_bfloat16* y, float* rstd) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t base = row * d;
  float ss = 0.0f, v[8];
  for (int64_t c = 8 * lane; c < d; c += 256) {
    load8(x + base + c, v);
    for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
  if (lane == 0) rstd[row] = r;
  for (int64_t c = 8 * lane; c < d; c += 256) {
    load8(x + base + c, v);
    for (int i = 0; i < 8; ++i) v[i] = v[i] * r * (w[c + i] + wo);
    store8(y + base + c, v);
  }
}

__global__ void rmsnorm_dx_x8_kernel(const __nv_bfloat16* x, const float* w, float wo, const float* rstd,
                                     const __nv_bfloat16* dy, int64_t n, int64_t d, __nv_bfloat16* dx,
                                     const __nv_bfloat16* residual) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t base = row * d;
  const float r = rstd[row];
  float dot = 0.0f, xv[8], gv[8];
  for (int64_t c = 8 * lane; c < d; c += 256) {
    load8(x + base + c, xv);
    load8(dy + base + c, gv);
    for (int i = 0; i < 8; ++i) dot += (w[c + i] + wo) * gv[i] * xv[i] * r;
  }
  dot = warp_sum(dot) / static_cast<float>(d);
  for (int64_t c = 8 * lane; c < d; c += 256) {
    load8(x + base + c, xv);
    load8(dy + base + c, gv);
    for (int i = 0; i < 8; ++i) xv[i] = r * ((w[c + i] + wo) * gv[i] - xv[i] * r * dot);
    if (residual != nullptr) {
      load8(residual + base + c, gv);
      for (int i = 0; i < 8; ++i) xv[i] = __bfloat162float(__float2bfloat16_rn(xv[i])) + gv[i];
    }
    store8(dx + base + c, xv);
  }
}

// dw[c] = sum over rows of dy * x * r: each block sums its chunk of rows per column in
// row order into partial[chunk][c]; then the chunks are added in order. No atomics, so
// the gradient repeats bit for bit.
__global__ void rmsnorm_dw_partial_kernel(In x, const float* rstd, In dy, int64_t n, int64_t d, int64_t rows_per_chunk,
                                          float* partial) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= d) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = min(n, r0 + rows_per_chunk);
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s += dy[r * d + c] * x[r * d + c] * rstd[r];
  partial[blockIdx.y * d + c] = s;
}

// A block's column sums of its row groups' 8-wide accumulators (group g's columns c..c+7
// in acc), added in group order into the block's partial row: the dw partials.
__device__ void group_sums_to_partial(const float (&acc)[8], float* sums, int g, int groups, int64_t c, int64_t d,
                                      float* partial) {
  for (int i = 0; i < 8; ++i) sums[g * d + c + i] = acc[i];
  __syncthreads();
  for (int64_t col = threadIdx.x; col < d; col += kThreads) {
    float s = 0.0f;
    for (int k = 0; k < groups; ++k) s += sums[k * d + col];
    partial[blockIdx.x * d + col] = s;
  }
}

// The same partial sums with 16-byte loads, for bf16 rows of d = 8 .. 2048 with d / 8
// dividing the block: d / 8 threads cover a row, the block's 256 / (d / 8) row groups walk
// the chunk's rows in an interleaved fixed order, their sums added in group order through
// shared memory. Narrow rows (q/k norms: head_dim over millions of rows) keep every lane busy.
__global__ void rmsnorm_dw_partial_x8_kernel(const __nv_bfloat16* x, const float* rstd, const __nv_bfloat16* dy,
                                             int64_t n, int64_t d, int64_t rows_per_chunk, float* partial) {
  __shared__ float sums[kThreads * 8];  // [groups][d]
  const int per_row = static_cast<int>(d / 8), groups = kThreads / per_row;
  const int g = threadIdx.x / per_row, c = (threadIdx.x % per_row) * 8;
  const int64_t r0 = blockIdx.x * rows_per_chunk, r1 = min(n, r0 + rows_per_chunk);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, xv[8], gv[8];
  for (int64_t r = r0 + g; r < r1; r += groups) {
    load8(x + r * d + c, xv);
    load8(dy + r * d + c, gv);
    const float rs = rstd[r];
    for (int i = 0; i < 8; ++i) acc[i] += gv[i] * xv[i] * rs;
  }
  group_sums_to_partial(acc, sums, g, groups, c, d, partial);
}

// dw[c] += the chunks' partials: 32 columns a block, 8 warps each adding every 8th
// chunk, then the 8 sums in warp order (fixed, so bit-repeatable).
__global__ void rmsnorm_dw_sum_kernel(const float* partial, int64_t chunks, int64_t d, float* dw) {
  __shared__ float s[kThreads / 32][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col = blockIdx.x * int64_t{32} + lane;
  float acc = 0.0f;
  if (col < d)
    for (int64_t g = warp; g < chunks; g += kThreads / 32) acc += partial[g * d + col];
  s[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || col >= d) return;
  float t = 0.0f;
  for (int k = 0; k < kThreads / 32; ++k) t += s[k][lane];
  dw[col] += t;
}


// rmsnorm_rope: lanes of a head row. Dh / 8 consecutive lanes hold a head, 8 columns
// each as rmsnorm's x8 kernels and dw partials lay them out, so each row sum is the one
// those kernels form (their lanes past Dh / 8 add zeros) and dw's partials are theirs.
// A rotated pair (c, c + Dh/2) sits in lanes Dh / 16 apart: one shuffle brings the other
// half. Every lane runs every step (rows past the end compute on zeros and store
// nothing), so the shuffles see whole warps.
__device__ __forceinline__ float lanes_sum(float v, int lanes) {
  for (int o = lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Rotates this lane's 8 values against the other half's: y_lo = a c - e s, y_hi = e c +
// a s with a the low half, as rope_kernel computes it (sin_sign -1: the backward).
__device__ __forceinline__ void rotate8(float (&v)[8], int c, int half, int lanes, const float* cos,
                                        const float* sin, int64_t pos, float sin_sign) {
  const bool low = c < half;
  const int j = low ? c : c - half;
  float other[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) other[i] = __shfl_xor_sync(0xffffffffu, v[i], lanes / 2);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float co = cos[pos * half + j + i], si = sin_sign * sin[pos * half + j + i];
    v[i] = low ? v[i] * co - other[i] * si : v[i] * co + other[i] * si;
  }
}

__device__ __forceinline__ void round_bf16(float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
}

__global__ void rmsnorm_rope_forward_kernel(const __nv_bfloat16* x, const float* w, float wo, float eps, const float* cos,
                                            const float* sin, int64_t n, int d, int64_t t, int64_t heads,
                                            __nv_bfloat16* y, float* rstd) {
  const int lanes = d / 8;
  const int64_t row = (blockIdx.x * int64_t{kThreads} + threadIdx.x) / lanes;
  const int c = (threadIdx.x % lanes) * 8;
  const bool valid = row < n;
  float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (valid) load8(x + row * d + c, v);
  float ss = 0.0f;
  for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
  const float r = 1.0f / sqrtf(lanes_sum(ss, lanes) / static_cast<float>(d) + eps);
  if (valid && c == 0) rstd[row] = r;
  for (int i = 0; i < 8; ++i) v[i] = v[i] * r * (w[c + i] + wo);
  round_bf16(v);
  rotate8(v, c, d / 2, lanes, cos, sin, valid ? (row / heads) % t : 0, 1.0f);
  if (valid) store8(y + row * d + c, v);
}

// A block is a chunk of rows, as rmsnorm_dw_partial_x8_kernel splits them: row group g
// walks rows r0 + g, r0 + g + groups, ...; per row, dx as rmsnorm_dx_x8_kernel computes it
// from the unrotated gradient, and dw's partial sums as the partial kernel adds them.
__global__ void rmsnorm_rope_backward_kernel(const __nv_bfloat16* x, const float* w, float wo, const float* rstd,
                                             const float* cos, const float* sin, const __nv_bfloat16* dy, int64_t n,
                                             int d, int64_t t, int64_t heads, int64_t rows_per_chunk,
                                             __nv_bfloat16* dx, float* partial) {
  __shared__ float sums[kThreads * 8];  // [groups][d]
  const int lanes = d / 8, groups = kThreads / lanes;
  const int g = threadIdx.x / lanes, c = (threadIdx.x % lanes) * 8;
  const int64_t r0 = blockIdx.x * rows_per_chunk, r1 = min(n, r0 + rows_per_chunk);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t base = r0; base < r1; base += groups) {
    const int64_t row = base + g;
    const bool valid = row < r1;
    float xv[8] = {0, 0, 0, 0, 0, 0, 0, 0}, gv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (valid) {
      load8(x + row * d + c, xv);
      load8(dy + row * d + c, gv);
    }
    rotate8(gv, c, d / 2, lanes, cos, sin, valid ? (row / heads) % t : 0, -1.0f);
    round_bf16(gv);
    const float r = valid ? rstd[row] : 0.0f;
    float dot = 0.0f;
    for (int i = 0; i < 8; ++i) dot += (w[c + i] + wo) * gv[i] * xv[i] * r;
    dot = lanes_sum(dot, lanes) / static_cast<float>(d);
    if (!valid) continue;
    for (int i = 0; i < 8; ++i) acc[i] += gv[i] * xv[i] * r;
    for (int i = 0; i < 8; ++i) xv[i] = r * ((w[c + i] + wo) * gv[i] - xv[i] * r * dot);
    store8(dx + row * d + c, xv);
  }
  group_sums_to_partial(acc, sums, g, groups, c, d, partial);
}

// The chunking of dw's partial sums for bf16 rows of width d (rmsnorm_backward's, wide).
int64_t dw_rows_per_chunk(int64_t n, int64_t d) { return std::max<int64_t>(4 * (kThreads / (d / 8)), (n + 527) / 528); }

// Whether the fused kernels take these heads: bf16, 16-byte rows, the whole width rotating,
// a head's lanes a power of two within a warp.
bool fused_heads(const Tensor& x, const Tensor& cos, std::initializer_list<const Tensor*> ts) {
  const int64_t d = x.dim(3), lanes = d / 8;
  return d % 16 == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0 && 2 * cos.dim(1) == d && x8(d, ts);
}

void check_heads(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  MT_CHECK(x.ndim() == 4) << "rmsnorm_rope x should be [B,T,H,Dh], got " << x.str();
  MT_CHECK(cos.ndim() == 2) << "rmsnorm_rope cos should be [T, rotary_dim/2], got " << cos.str();
  check_arg(cos, "rmsnorm_rope cos", {DType::f32}, {x.dim(1), cos.dim(1)});
  check_arg(sin, "rmsnorm_rope sin", {DType::f32}, {x.dim(1), cos.dim(1)});
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd, float wo) {
  MT_CHECK(x.ndim() == 2) << "rmsnorm input should be [N,D], got " << x.str();
  const int64_t n = x.dim(0), d = x.dim(1);
  check_arg(x, "rmsnorm x", {DType::bf16, DType::f32}, {n, d});
  check_arg(w, "rmsnorm weight", {DType::f32}, {d});
  check_arg(y, "rmsnorm y", {DType::bf16, DType::f32}, {n, d});
  check_arg(rstd, "rmsnorm rstd", {DType::f32}, {n});
  if (n == 0) return;
  if (x8(d, {&x, &y}))
    rmsnorm_forward_x8_kernel<<<blocks_for(n, kRowsPerBlock), kThreads, 0, stream()>>>(bf16_data(x), w.f32(), wo, eps, n,
                                                                                       d, bf16_data(y), rstd.f32());
  else
    rmsnorm_forward_kernel<<<blocks_for(n, kRowsPerBlock), kThreads, 0, stream()>>>(as_in(x), w.f32(), wo, eps, n,
                                                                                     d, as_out(y), rstd.f32());
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                      const Tensor& dw, const Tensor& residual, float wo) {
  MT_CHECK(x.ndim() == 2) << "rmsnorm input should be [N,D], got " << x.str();
  const int64_t n = x.dim(0), d = x.dim(1);
  check_arg(x, "rmsnorm x", {DType::bf16, DType::f32}, {n, d});
  check_arg(w, "rmsnorm weight", {DType::f32}, {d});
  check_arg(rstd, "rmsnorm rstd", {DType::f32}, {n});
  check_arg(dy, "rmsnorm dy", {DType::bf16, DType::f32}, {n, d});
  if (dx.data != nullptr) {
    check_arg(dx, "rmsnorm dx", {DType::bf16, DType::f32}, {n, d});
    const bool res = residual.data != nullptr;
    if (res) check_arg(residual, "rmsnorm residual", {dx.dtype}, {n, d});
    if (n > 0) {
      if (x8(d, {&x, &dy, &dx}) && (!res || aligned16(residual.data)))
        rmsnorm_dx_x8_kernel<<<blocks_for(n, kRowsPerBlock), kThreads, 0, stream()>>>(
            bf16_data(x), w.f32(), wo, rstd.f32(), bf16_data(dy), n, d, bf16_data(dx),
            res ? bf16_data(residual) : nullptr);
      else
        rmsnorm_dx_kernel<<<blocks_for(n, kRowsPerBlock), kThreads, 0, stream()>>>(
            as_in(x), w.f32(), wo, rstd.f32(), as_in(dy), n, d, as_out(dx),
            In{residual.data, res && residual.dtype == DType::bf16});
      CUDA_CHECK_LAUNCH();
    }
  }
  if (dw.data != nullptr) {
    check_arg(dw, "rmsnorm dw", {DType::f32}, {d});
    if (n == 0 || d == 0) return;
    const bool wide = x8(d, {&x, &dy}) && d <= kThreads * 8 && kThreads % (d / 8) == 0;
    // Wide (the x8 kernel): about four chunks an SM (132 on an H100/H200), each a whole
    // number of row groups. Else enough row chunks to fill the GPU when D is small (q/k
    // norms: D = head_dim over many rows), and no more partials than needed when it is large.
    const int64_t rows_per_chunk = wide ? dw_rows_per_chunk(n, d) : std::max<int64_t>(32, (n + 511) / 512);
    const int64_t chunks = (n + rows_per_chunk - 1) / rows_per_chunk;
    float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * d));
    if (wide)
      rmsnorm_dw_partial_x8_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(
          bf16_data(x), rstd.f32(), bf16_data(dy), n, d, rows_per_chunk, partial);
    else
      rmsnorm_dw_partial_kernel<<<dim3(blocks_for(d, 256), static_cast<unsigned>(chunks)), 256, 0, stream()>>>(
          as_in(x), rstd.f32(), as_in(dy), n, d, rows_per_chunk, partial);
    CUDA_CHECK_LAUNCH();
    rmsnorm_dw_sum_kernel<<<blocks_for(d, 32), kThreads, 0, stream()>>>(partial, chunks, d, dw.f32());
    CUDA_CHECK_LAUNCH();
  }
}

void rmsnorm_rope_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& cos, const Tensor& sin,
                          const Tensor& y, const Tensor& rstd, float wo) {
  check_heads(x, cos, sin);
  MT_CHECK(x.data != y.data) << "rmsnorm_rope needs y apart from x (the backward reads x)";
  const int64_t t = x.dim(1), h = x.dim(2), d = x.dim(3), n = x.dim(0) * t * h;
  if (!fused_heads(x, cos, {&x, &y})) {
    cuda::rmsnorm_forward(x.view({n, d}), w, eps, y.view({n, d}), rstd, wo);
    return cuda::rope_forward(y, cos, sin, false, y);
  }
  check_arg(w, "rmsnorm_rope weight", {DType::f32}, {d});
  check_arg(y, "rmsnorm_rope y", {DType::bf16}, x.shape);
  check_arg(rstd, "rmsnorm_rope rstd", {DType::f32}, {n});
  if (n == 0) return;
  rmsnorm_rope_forward_kernel<<<blocks_for(n * (d / 8), kThreads), kThreads, 0, stream()>>>(
      bf16_data(x), w.f32(), wo, eps, cos.f32(), sin.f32(), n, static_cast<int>(d), t, h, bf16_data(y), rstd.f32());
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_rope_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& cos,
                           const Tensor& sin, const Tensor& dy, const Tensor& dx, const Tensor& dw, float wo) {
  check_heads(x, cos, sin);
  const int64_t t = x.dim(1), h = x.dim(2), d = x.dim(3), n = x.dim(0) * t * h;
  check_arg(dy, "rmsnorm_rope dy", {DType::bf16, DType::f32}, x.shape);
  if (dx.data == nullptr || dw.data == nullptr || !fused_heads(x, cos, {&x, &dy, &dx})) {
    // The two ops through a temporary of the unrotated gradient.
    void* p = stream_alloc(static_cast<size_t>(n * d) * dtype_size(dy.dtype));
    const Tensor dn(p, x.shape, dy.dtype, Device::cuda);
    cuda::rope_backward(dy, cos, sin, false, dn);
    cuda::rmsnorm_backward(x.view({n, d}), w, rstd, dn.view({n, d}), dx.data ? dx.view({n, d}) : Tensor(), dw,
                           Tensor(), wo);
    return stream_free(p);
  }
  check_arg(w, "rmsnorm_rope weight", {DType::f32}, {d});
  check_arg(rstd, "rmsnorm_rope rstd", {DType::f32}, {n});
  check_arg(dx, "rmsnorm_rope dx", {DType::bf16}, x.shape);
  check_arg(dw, "rmsnorm_rope dw", {DType::f32}, {d});
  if (n == 0) return;
  const int64_t rows_per_chunk = dw_rows_per_chunk(n, d), chunks = (n + rows_per_chunk - 1) / rows_per_chunk;
  float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * d));
  rmsnorm_rope_backward_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(
      bf16_data(x), w.f32(), wo, rstd.f32(), cos.f32(), sin.f32(), bf16_data(dy), n, static_cast<int>(d), t, h,
      rows_per_chunk, bf16_data(dx), partial);
  CUDA_CHECK_LAUNCH();
  rmsnorm_dw_sum_kernel<<<blocks_for(d, 32), kThreads, 0, stream()>>>(partial, chunks, d, dw.f32());
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
