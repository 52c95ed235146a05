// Blockwise FP8 quantization on the GPU: a kernel each for 1x128 rows and 128x128 weight
// blocks (of one matrix or a layer's experts, optionally with their transposed copy).
// Scales come from the header's tile_scale()/scaled(), the codes from the hardware's
// satfinite conversion, so the bytes equal the CPU backend's
// (tests/gpu/test_cuda_fp8.cpp).
#include <cuda_fp8.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/fp8_quant.h"

namespace mt::cuda {

namespace {

constexpr int kTile = static_cast<int>(fp8::kTile);
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = kTile / kWarps;

// blocks_kernel's arguments.
struct Job {
  In x;
  int64_t m, k;  // x [m, k]; blockIdx.z picks one of the experts' matrices
  bool pow2;
  uint8_t* q;    // [m, k]
  float* scale;  // [tiles(m), ld]
  int64_t ld;
  uint8_t* qt;     // [k, m], or null
  float* scale_t;  // [tiles(k), ldt]
  int64_t ldt;
  int64_t expert_elements, expert_scales, expert_scales_t;  // one expert's strides
};

__device__ __forceinline__ uint8_t e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

uint8_t* codes(const Tensor& q, const char* name, Shape shape) {
  check_arg(q, name, {DType::f8e4m3}, shape);
  return static_cast<uint8_t*>(q.data);
}


// quantize_rows alone, at the bandwidth it needs: a half-warp a 1x128 tile, a lane 8
// consecutive elements (one 16-byte load of bf16, two of f32; scalar where the row's
// elements are not 16-byte aligned or the tile is ragged), the amax over the half-warp by
// shuffles, 8 codes in one 8-byte store; a block's 16 half-warps take 16 consecutive rows
// of one tile column, so their scales go out as one 64-byte store.
constexpr int kRowTilesPerBlock = 16;

__global__ void __launch_bounds__(kThreads) rows_kernel(In x, int64_t m, int64_t k, bool pow2, bool vector,
                                                        uint8_t* q, float* scale) {
  const int half = threadIdx.x / 16, lane = threadIdx.x % 16;
  const int64_t r = blockIdx.y * int64_t{kRowTilesPerBlock} + half, c = blockIdx.x * int64_t{kTile} + 8 * lane;
  float v[8] = {};
  if (r < m) {
    if (vector && c + 8 <= k) {
      if (x.bf16) {
        load8(static_cast<const __nv_bfloat16*>(x.p) + r * k + c, v);
      } else {
        const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(x.p) + r * k + c);
        const float4 a = f[0], b = f[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = c + i < k ? x[r * k + c + i] : 0.0f;
    }
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (r >= m) return;
  const float s = fp8::tile_scale(amax, pow2);
  if (lane == 0) scale[blockIdx.x * m + r] = s;
  uint8_t codes[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) codes[i] = e4m3(fp8::scaled(v[i], s, pow2));
  if (vector && c + 8 <= k) {
    uint2 u;
    memcpy(&u, codes, 8);
    *reinterpret_cast<uint2*>(q + r * k + c) = u;
  } else {
    for (int i = 0; i < 8 && c + i < k; ++i) q[r * k + c + i] = codes[i];
  }
}

// quantize_blocks on its own (the weights after every update): block (bx, by, e) owns one
// 128x128 block, warp w its rows 16w..16w+15, lane l the 4 consecutive columns 4l..4l+3
// of each, held in registers (one 16-byte load of f32, 8 bytes of bf16, a row a warp
// instruction), so x is read once; the codes go out 4 at a time, and the transposed ones
// through shared memory 16 at a time. `vector`: k % 4 == 0 and aligned rows (else
// element by element); `qt_vector`: n % 16 == 0 and qt aligned.
__global__ void __launch_bounds__(kThreads) blocks_kernel(Job p, bool vector, bool qt_vector) {
  __shared__ float smax[kWarps];
  __shared__ __align__(16) uint8_t sq[kTile][kTile + 16];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t e = blockIdx.z, r0 = blockIdx.y * int64_t{kTile}, c0 = blockIdx.x * int64_t{kTile};
  const In x = p.x.from(e * p.expert_elements);
  float v[kRowsPerWarp][4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp * kRowsPerWarp + i, c = c0 + 4 * lane;
    if (vector && r < p.m && c + 4 <= p.k) {
      if (x.bf16) {
        const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(x.p) + r * p.k + c);
        v[i][0] = __uint_as_float(u.x << 16), v[i][1] = __uint_as_float(u.x & 0xffff0000u);
        v[i][2] = __uint_as_float(u.y << 16), v[i][3] = __uint_as_float(u.y & 0xffff0000u);
      } else {
        const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(x.p) + r * p.k + c);
        v[i][0] = f.x, v[i][1] = f.y, v[i][2] = f.z, v[i][3] = f.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[i][j] = r < p.m && c + j < p.k ? x[r * p.k + c + j] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[i][j]));
  }
  amax = warp_max(amax);
  if (lane == 0) smax[warp] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, smax[w]);
  const float s = fp8::tile_scale(amax, p.pow2);
  float* scale = p.scale + e * p.expert_scales;
  // The last block of a row of blocks zeroes the padding up to ld (and of a column,
  // scale_t's up to ldt: a block's transpose has the same amax).
  if (threadIdx.x == 0) scale[blockIdx.y * p.ld + blockIdx.x] = s;
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < p.ld - gridDim.x) scale[blockIdx.y * p.ld + gridDim.x + threadIdx.x] = 0.0f;
  uint8_t* q = p.q + e * p.expert_elements;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int rl = warp * kRowsPerWarp + i;
    const int64_t r = r0 + rl, c = c0 + 4 * lane;
    uint8_t code[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) code[j] = e4m3(fp8::scaled(v[i][j], s, p.pow2));
    if (p.qt != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) sq[4 * lane + j][rl] = code[j];
    }
    if (r >= p.m) continue;
    if (vector && c + 4 <= p.k) {
      uint32_t word;
      memcpy(&word, code, 4);
      *reinterpret_cast<uint32_t*>(q + r * p.k + c) = word;
    } else {
      for (int j = 0; j < 4 && c + j < p.k; ++j) q[r * p.k + c + j] = code[j];
    }
  }
  if (p.qt == nullptr) return;
  float* scale_t = p.scale_t + e * p.expert_scales_t;
  if (threadIdx.x == 0) scale_t[blockIdx.x * p.ldt + blockIdx.y] = s;
  if (blockIdx.y == gridDim.y - 1 && threadIdx.x < p.ldt - gridDim.y)
    scale_t[blockIdx.x * p.ldt + gridDim.y + threadIdx.x] = 0.0f;
  __syncthreads();
  // qt [k, n]: row c0 + cl holds the block's column cl, 128 bytes from column r0.
  uint8_t* qt = p.qt + e * p.expert_elements;
  const int64_t rows = min(p.m - r0, int64_t{kTile}), cols = min(p.k - c0, int64_t{kTile});
  for (int idx = threadIdx.x; idx < kTile * kTile / 16; idx += kThreads) {
    const int cl = idx / (kTile / 16), rl = idx % (kTile / 16) * 16;
    if (cl >= cols || rl >= rows) continue;
    uint8_t* dst = qt + (c0 + cl) * p.m + r0 + rl;
    if (qt_vector && rl + 16 <= rows)
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sq[cl][rl]);
    else
      for (int b = 0; b < 16 && rl + b < rows; ++b) dst[b] = sq[cl][rl + b];
  }
}


}  // namespace

void quantize_rows(const Tensor& x, const Tensor& q, const Tensor& scale, bool pow2) {
  MT_CHECK(x.ndim() == 2) << "quantize_rows x should be [rows, cols], got " << x.str();
  check_arg(x, "quantize_rows x", {DType::bf16, DType::f32}, x.shape);
  const int64_t m = x.dim(0), k = x.dim(1);
  check_arg(scale, "quantize_rows scale", {DType::f32}, {fp8::tiles(k), m});
  uint8_t* codes_q = codes(q, "quantize_rows q", {m, k});
  if (m * k == 0) return;
  // 16-byte loads of a row's 8 elements and 8-byte stores of their codes need k % 8 == 0.
  const bool vector = k % 8 == 0 && aligned16(x.data) && reinterpret_cast<uintptr_t>(q.data) % 8 == 0;
  const int64_t blocks = (m + kRowTilesPerBlock - 1) / kRowTilesPerBlock;
  MT_CHECK(blocks <= 65535 && fp8::tiles(k) <= INT_MAX)
      << "quantize_rows of [" << m << ", " << k << "]: more row groups (" << blocks << ") than one launch takes";
  const dim3 grid(static_cast<unsigned>(fp8::tiles(k)), static_cast<unsigned>(blocks));
  rows_kernel<<<grid, kThreads, 0, stream()>>>(as_in(x), m, k, pow2, vector, codes_q, scale.f32());
  CUDA_CHECK_LAUNCH();
}

void quantize_blocks(const Tensor& w, const Tensor& q, const Tensor& scale, bool pow2, const Tensor& qt,
                     const Tensor& scale_t) {
  MT_CHECK(w.ndim() == 2 || w.ndim() == 3) << "quantize_blocks w should be [N, K] or [E, N, K], got " << w.str();
  check_arg(w, "quantize_blocks w", {DType::bf16, DType::f32}, w.shape);
  MT_CHECK((qt.data == nullptr) == (scale_t.data == nullptr))
      << "quantize_blocks: qt and scale_t come together, got qt " << qt.str() << " and scale_t " << scale_t.str();
  const bool stacked = w.ndim() == 3;
  const int64_t experts = stacked ? w.dim(0) : 1, n = w.dim(-2), k = w.dim(-1);
  const int64_t ld = fp8::block_scale_cols(k), ldt = fp8::block_scale_cols(n);
  auto per_expert = [&](Shape s) { return stacked ? Shape{experts, s[0], s[1]} : s; };
  Job p{};
  p.x = as_in(w);
  p.m = n, p.k = k, p.pow2 = pow2;
  check_arg(scale, "quantize_blocks scale", {DType::f32}, per_expert({fp8::tiles(n), ld}));
  p.q = codes(q, "quantize_blocks q", w.shape);
  p.scale = scale.f32();
  p.ld = ld;
  p.expert_elements = n * k;
  p.expert_scales = fp8::tiles(n) * ld;
  if (qt.data != nullptr) {
    check_arg(scale_t, "quantize_blocks scale_t", {DType::f32}, per_expert({fp8::tiles(k), ldt}));
    p.qt = codes(qt, "quantize_blocks qt", per_expert({k, n}));
    p.scale_t = scale_t.f32();
    p.ldt = ldt;
    p.expert_scales_t = fp8::tiles(k) * ldt;
  }
  if (n * k == 0 || experts == 0) return;
  MT_CHECK(fp8::tiles(n) <= 65535 && experts <= 65535 && fp8::tiles(k) <= INT_MAX)
      << "quantize_blocks of " << w.str() << ": more 128-row blocks or experts than one launch takes (65535)";
  const size_t elem = w.dtype == DType::bf16 ? 2 : 4;
  const bool vector = k % 4 == 0 && reinterpret_cast<uintptr_t>(w.data) % (4 * elem) == 0 &&
                      reinterpret_cast<uintptr_t>(q.data) % 4 == 0;
  const bool qt_vector = p.qt != nullptr && n % 16 == 0 && aligned16(p.qt);
  const dim3 grid(static_cast<unsigned>(fp8::tiles(k)), static_cast<unsigned>(fp8::tiles(n)),
                  static_cast<unsigned>(experts));
  blocks_kernel<<<grid, kThreads, 0, stream()>>>(p, vector, qt_vector);
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
