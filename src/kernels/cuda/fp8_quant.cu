// Blockwise FP8 quantization on the GPU: one kernel for 1x128 rows, rows plus the
// transposed 1x128 columns, and 128x128 weight blocks. Scales come from the header's
// tile_scale()/scaled(), the codes from the hardware's satfinite conversion, so the
// bytes equal the CPU backend's (tests/gpu/test_cuda_fp8.cpp).
#include <cuda_fp8.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/fp8_quant.h"

namespace mt::cuda {

namespace {

constexpr int kTile = static_cast<int>(fp8::kTile);
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = kTile / kWarps, kColsPerLane = kTile / 32;

enum class Mode { rows, rows_and_columns, block };

__device__ __forceinline__ uint8_t e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// fmaxf ignores NaN, as std::fmax does on the CPU.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block (bx, by) owns rows [128 by, +128) and columns [128 bx, +128) of x [M, K]: warp w
// its rows 16w..16w+15, lane l the columns l + 32j (coalesced loads), all held in
// registers; elements outside x read as 0, which leaves every amax unchanged.
template <Mode mode>
__global__ void __launch_bounds__(kThreads) quantize_kernel(In x, int64_t m, int64_t k, bool pow2, uint8_t* q,
                                                            float* scale, int64_t ld, uint8_t* qt, float* scale_t) {
  __shared__ float smax[kWarps][kTile];
  __shared__ float sscale[kTile];
  __shared__ uint8_t sq[mode == Mode::rows_and_columns ? kTile : 1][kTile + 4];  // +4: no bank conflicts
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = blockIdx.y * int64_t{kTile} + warp * kRowsPerWarp, c0 = blockIdx.x * int64_t{kTile} + lane;
  float v[kRowsPerWarp][kColsPerLane], cmax[kColsPerLane] = {}, wmax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + i;
    float rmax = 0.0f;
#pragma unroll
    for (int j = 0; j < kColsPerLane; ++j) {
      const int64_t c = c0 + 32 * j;
      v[i][j] = r < m && c < k ? x[r * k + c] : 0.0f;
      rmax = fmaxf(rmax, fabsf(v[i][j]));
      cmax[j] = fmaxf(cmax[j], fabsf(v[i][j]));
    }
    rmax = warp_max(rmax);
    if constexpr (mode == Mode::block) {
      wmax = fmaxf(wmax, rmax);
    } else if (r < m) {
      const float s = fp8::tile_scale(rmax, pow2);
      if (lane == 0) scale[blockIdx.x * m + r] = s;
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j)
        if (c0 + 32 * j < k) q[r * k + c0 + 32 * j] = e4m3(fp8::scaled(v[i][j], s, pow2));
    }
  }
  if constexpr (mode == Mode::block) {
    if (lane == 0) smax[0][warp] = wmax;
    __syncthreads();
    float amax = 0.0f;
    for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, smax[0][w]);
    const float s = fp8::tile_scale(amax, pow2);
    if (threadIdx.x == 0) scale[blockIdx.y * ld + blockIdx.x] = s;
    // The last block of a row of blocks zeroes the padding up to ld.
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x < ld - gridDim.x) scale[blockIdx.y * ld + gridDim.x + threadIdx.x] = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j)
        if (r0 + i < m && c0 + 32 * j < k) q[(r0 + i) * k + c0 + 32 * j] = e4m3(fp8::scaled(v[i][j], s, pow2));
  }
  if constexpr (mode == Mode::rows_and_columns) {
    // Column amax over the 8 warps, then the codes of x^T staged as [column][row] so that
    // each row of qt [K, M] goes out as 128 consecutive bytes.
#pragma unroll
    for (int j = 0; j < kColsPerLane; ++j) smax[warp][lane + 32 * j] = cmax[j];
    __syncthreads();
    if (threadIdx.x < kTile) {
      float amax = 0.0f;
      for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, smax[w][threadIdx.x]);
      sscale[threadIdx.x] = fp8::tile_scale(amax, pow2);
      const int64_t c = blockIdx.x * int64_t{kTile} + threadIdx.x;
      if (c < k) scale_t[blockIdx.y * k + c] = sscale[threadIdx.x];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j)
        sq[lane + 32 * j][warp * kRowsPerWarp + i] = e4m3(fp8::scaled(v[i][j], sscale[lane + 32 * j], pow2));
    __syncthreads();
    for (int idx = threadIdx.x; idx < kTile * kTile; idx += kThreads) {
      const int64_t c = blockIdx.x * int64_t{kTile} + idx / kTile, r = blockIdx.y * int64_t{kTile} + idx % kTile;
      if (c < k && r < m) qt[c * m + r] = sq[idx / kTile][idx % kTile];
    }
  }
}

In check_input(const Tensor& x, const char* name) {
  MT_CHECK(x.ndim() == 2) << name << " should be [rows, cols], got " << x.str();
  check_arg(x, name, {DType::bf16, DType::f32}, x.shape);
  return as_in(x);
}

uint8_t* codes(const Tensor& q, const char* name, Shape shape) {
  check_arg(q, name, {DType::f8e4m3}, shape);
  return static_cast<uint8_t*>(q.data);
}

template <Mode mode>
void launch(In x, int64_t m, int64_t k, bool pow2, uint8_t* q, float* scale, int64_t ld, uint8_t* qt = nullptr,
            float* scale_t = nullptr) {
  if (m * k == 0) return;
  const dim3 grid(static_cast<unsigned>(fp8::tiles(k)), static_cast<unsigned>(fp8::tiles(m)));
  quantize_kernel<mode><<<grid, kThreads, 0, stream()>>>(x, m, k, pow2, q, scale, ld, qt, scale_t);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_rows(const Tensor& x, const Tensor& q, const Tensor& scale, bool pow2) {
  const In in = check_input(x, "quantize_rows x");
  const int64_t m = x.dim(0), k = x.dim(1);
  check_arg(scale, "quantize_rows scale", {DType::f32}, {fp8::tiles(k), m});
  launch<Mode::rows>(in, m, k, pow2, codes(q, "quantize_rows q", {m, k}), scale.f32(), 0);
}

void quantize_rows_and_columns(const Tensor& x, const Tensor& q, const Tensor& scale, const Tensor& qt,
                               const Tensor& scale_t, bool pow2) {
  const In in = check_input(x, "quantize_rows_and_columns x");
  const int64_t m = x.dim(0), k = x.dim(1);
  check_arg(scale, "quantize_rows_and_columns scale", {DType::f32}, {fp8::tiles(k), m});
  check_arg(scale_t, "quantize_rows_and_columns scale_t", {DType::f32}, {fp8::tiles(m), k});
  launch<Mode::rows_and_columns>(in, m, k, pow2, codes(q, "quantize_rows_and_columns q", {m, k}), scale.f32(), 0,
                                 codes(qt, "quantize_rows_and_columns qt", {k, m}), scale_t.f32());
}

void quantize_blocks(const Tensor& w, const Tensor& q, const Tensor& scale, bool pow2) {
  const In in = check_input(w, "quantize_blocks w");
  const int64_t n = w.dim(0), k = w.dim(1), ld = fp8::block_scale_cols(k);
  check_arg(scale, "quantize_blocks scale", {DType::f32}, {fp8::tiles(n), ld});
  launch<Mode::block>(in, n, k, pow2, codes(q, "quantize_blocks q", {n, k}), scale.f32(), ld);
}

}  // namespace mt::cuda
