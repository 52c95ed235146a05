// Device-side helpers the kernel files share: float views of f32-or-bf16 buffers, 16-byte
// bf16 loads and stores, warp and block sums, grid-stride loops, expert row segments.
// Kernels compute in f32 and choose the storage type per launch with a uniform branch,
// which keeps one kernel per op instead of one per dtype pair.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"

namespace mt::cuda {

// Element i of a f32 or bf16 buffer, as f32.
struct In {
  const void* p;
  bool bf16;
  __device__ float operator[](int64_t i) const {
    return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  // The view from element i on (a row of the buffer).
  __device__ In from(int64_t i) const { return {static_cast<const char*>(p) + i * (bf16 ? 2 : 4), bf16}; }
};

// Writes f32 values into a f32 or bf16 buffer (round to nearest even for bf16).
struct Out {
  void* p;
  bool bf16;
  __device__ void set(int64_t i, float v) const {
    if (bf16)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(p)[i] = v;
  }
  __device__ float get(int64_t i) const { return In{p, bf16}[i]; }
  __device__ Out from(int64_t i) const { return {static_cast<char*>(p) + i * (bf16 ? 2 : 4), bf16}; }
};

// A bf16 tensor's elements (the caller has checked its dtype).
inline __nv_bfloat16* bf16_data(const Tensor& t) { return static_cast<__nv_bfloat16*>(t.data); }

inline In as_in(const Tensor& t) { return In{t.data, t.dtype == DType::bf16}; }
inline Out as_out(const Tensor& t) { return Out{t.data, t.dtype == DType::bf16}; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool all_aligned16(std::initializer_list<const Tensor*> ts) {
  return std::all_of(ts.begin(), ts.end(), [](const Tensor* t) { return aligned16(t->data); });
}

// Whether a kernel's 8-wide bf16 path applies: bf16 everywhere, rows of 8k elements,
// 16-byte starts.
inline bool x8(int64_t d, std::initializer_list<const Tensor*> ts) {
  if (d % 8 != 0) return false;
  for (const Tensor* t : ts)
    if (t->dtype != DType::bf16 || !aligned16(t->data)) return false;
  return true;
}

inline unsigned blocks_for(int64_t work, int threads) {
  int64_t b = (work + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// 8 consecutive bf16 (16-byte aligned) as f32 in one load, and back (round to nearest even).
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint4 u;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Two f32 as one packed bf16 pair (round to nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Sum over the warp (a butterfly: every lane gets the same total).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Maximum over the warp, every lane getting it; fmaxf ignores NaN, as std::fmax does on the CPU.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block of a per-thread value; every thread gets the total. The order of
// the additions depends only on blockDim, so results repeat bit for bit. `shared` holds
// one T per warp; blockDim.x is a multiple of 32.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

// A grid-stride loop: i over [0, n) from this thread's index, in steps of the grid's size.
#define MT_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); i += int64_t{gridDim.x} * blockDim.x)

// Multi-tensor launches: block b works on the last tensor whose first chunk is <= b
// (first_chunk is non-decreasing over `count` tensors).
__device__ inline int tensor_of_chunk(const int64_t* first_chunk, int count, int64_t b) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (first_chunk[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Rows [begin, end) of expert e's segment, the offsets clamped to [0, rows] so that
// malformed offsets cannot send a block outside the buffers.
struct RowRange {
  int64_t begin, end;
};
__device__ __forceinline__ RowRange segment_rows(const int32_t* offsets, int e, int64_t rows) {
  const int64_t begin = min(max(int64_t{offsets[e]}, int64_t{0}), rows);
  return {begin, min(max(int64_t{offsets[e + 1]}, begin), rows)};
}

}  // namespace mt::cuda
