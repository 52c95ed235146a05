// Multi-tensor AdamW on the GPU: the list of parameter blocks travels in the kernel's
// parameters, each thread block updates one chunk of one tensor, so a model's whole
// optimizer step is one launch (one per kTableSize blocks).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cmath>

#include "kernels/adamw.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"

namespace mt::cuda {

namespace {

constexpr int kTableSize = 128;
constexpr int64_t kChunk = 16384;
constexpr int kThreads = 256;

struct AdamWTable {
  float* p[kTableSize];
  const float* g[kTableSize];
  float* m[kTableSize];
  float* v[kTableSize];
  __nv_bfloat16* c[kTableSize];          // the bf16 copy to write, or null
  int64_t n[kTableSize];
  float decay[kTableSize];               // 1 - lr * wd for this block
  int64_t first_chunk[kTableSize + 1];   // chunk index of each tensor's first chunk
  int count;
  float step_size, bias2_sqrt, w1, b2, w2, eps, grad_scale;
};

// The CPU backend's expression, operation for operation; the _rn intrinsics keep nvcc
// from fusing a multiply and an add into one rounding, so the two backends agree bit
// for bit (sqrt and division are IEEE-rounded on both). p, m, v are updated in place.
__device__ __forceinline__ void adamw_element(const AdamWTable& t, float decay, float g, float& p, float& m,
                                              float& v) {
  const float gi = __fmul_rn(g, t.grad_scale);
  const float pi = __fmul_rn(p, decay);
  m = __fadd_rn(m, __fmul_rn(t.w1, __fsub_rn(gi, m)));
  v = __fadd_rn(__fmul_rn(v, t.b2), __fmul_rn(__fmul_rn(t.w2, gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), t.bias2_sqrt), t.eps);
  p = __fsub_rn(pi, __fdiv_rn(__fmul_rn(t.step_size, m), denom));
}

// The step is bound by memory traffic (7 or 8 streams of 4 bytes a parameter), so
// aligned chunks move four elements per load and store; the tail and unaligned pieces
// (shards of a sharded optimizer start anywhere) go one by one.
__global__ void __launch_bounds__(kThreads) adamw_kernel(AdamWTable t) {
  const int64_t b = blockIdx.x;
  const int lo = tensor_of_chunk(t.first_chunk, t.count, b);
  float* p = t.p[lo];
  const float* g = t.g[lo];
  float* m = t.m[lo];
  float* v = t.v[lo];
  __nv_bfloat16* c = t.c[lo];
  const float decay = t.decay[lo];
  const int64_t begin = (b - t.first_chunk[lo]) * kChunk, end = min(t.n[lo], begin + kChunk);
  const auto addr = [](const void* x) { return reinterpret_cast<uintptr_t>(x); };
  const bool aligned = ((addr(p) | addr(g) | addr(m) | addr(v)) % 16 == 0) && addr(c) % 8 == 0;
  int64_t i = begin;
  if (aligned) {
    const int64_t vec_end = begin + (end - begin) / 4 * 4;
    for (int64_t j = begin + 4 * threadIdx.x; j < vec_end; j += 4 * blockDim.x) {
      const float4 gj = *reinterpret_cast<const float4*>(g + j);
      float4 pj = *reinterpret_cast<float4*>(p + j), mj = *reinterpret_cast<float4*>(m + j),
             vj = *reinterpret_cast<float4*>(v + j);
      adamw_element(t, decay, gj.x, pj.x, mj.x, vj.x);
      adamw_element(t, decay, gj.y, pj.y, mj.y, vj.y);
      adamw_element(t, decay, gj.z, pj.z, mj.z, vj.z);
      adamw_element(t, decay, gj.w, pj.w, mj.w, vj.w);
      *reinterpret_cast<float4*>(p + j) = pj;
      *reinterpret_cast<float4*>(m + j) = mj;
      *reinterpret_cast<float4*>(v + j) = vj;
      if (c != nullptr) {
        __nv_bfloat162 lo2 = __floats2bfloat162_rn(pj.x, pj.y), hi2 = __floats2bfloat162_rn(pj.z, pj.w);
        uint2 packed;
        packed.x = *reinterpret_cast<uint32_t*>(&lo2);
        packed.y = *reinterpret_cast<uint32_t*>(&hi2);
        *reinterpret_cast<uint2*>(c + j) = packed;
      }
    }
    i = vec_end;
  }
  for (int64_t j = i + threadIdx.x; j < end; j += blockDim.x) {
    float pj = p[j], mj = m[j], vj = v[j];
    adamw_element(t, decay, g[j], pj, mj, vj);
    p[j] = pj;
    m[j] = mj;
    v[j] = vj;
    if (c != nullptr) c[j] = __float2bfloat16_rn(pj);
  }
}

}  // namespace

void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& s) {
  MT_CHECK(s.step >= 1) << "adamw step is 1-based, got " << s.step;
  for (const AdamWBlock& b : blocks) {
    const Shape shape = b.param.shape;
    check_arg(b.param, "adamw param", {DType::f32}, shape);
    const Tensor* others[] = {&b.grad, &b.m, &b.v};
    for (const Tensor* t : others)
      MT_CHECK(t->dtype == DType::f32 && t->device == Device::cuda && t->numel() == b.param.numel())
          << "adamw wants f32 GPU tensors of " << b.param.numel() << " elements (param " << b.param.str()
          << "), got " << t->str();
    if (b.compute.data != nullptr)
      MT_CHECK(b.compute.dtype == DType::bf16 && b.compute.device == Device::cuda &&
               b.compute.numel() == b.param.numel())
          << "adamw's compute copy should be a bf16 GPU tensor of " << b.param.numel() << " elements, got "
          << b.compute.str();
  }
  // Scalars as the CPU backend derives them: in double, then rounded to float.
  const double step = static_cast<double>(s.step);
  AdamWTable t{};
  t.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(s.beta2, step)));
  t.step_size = static_cast<float>(s.lr / (1.0 - std::pow(s.beta1, step)));
  t.w1 = static_cast<float>(1.0 - s.beta1);
  t.b2 = static_cast<float>(s.beta2);
  t.w2 = static_cast<float>(1.0 - s.beta2);
  t.eps = static_cast<float>(s.eps);
  t.grad_scale = s.grad_scale;
  // Without decay the factor is exactly 1, as the CPU's 1 - lr * 0 rounds.
  const float with_decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  for (size_t first = 0; first < blocks.size(); first += kTableSize) {
    t.count = static_cast<int>(std::min<size_t>(kTableSize, blocks.size() - first));
    int64_t chunks = 0;
    for (int j = 0; j < t.count; ++j) {
      const AdamWBlock& b = blocks[first + j];
      t.p[j] = b.param.f32();
      t.g[j] = b.grad.f32();
      t.m[j] = b.m.f32();
      t.v[j] = b.v.f32();
      t.c[j] = b.compute.data != nullptr ? static_cast<__nv_bfloat16*>(b.compute.data) : nullptr;
      t.n[j] = b.param.numel();
      t.decay[j] = b.decay ? with_decay : 1.0f;
      t.first_chunk[j] = chunks;
      chunks += (t.n[j] + kChunk - 1) / kChunk;
    }
    t.first_chunk[t.count] = chunks;
    if (chunks == 0) continue;
    adamw_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(t);
    CUDA_CHECK_LAUNCH();
  }
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const cpu::AdamWStep& s) {
  cuda::adamw_step_multi({AdamWBlock{param, grad, m, v, true, Tensor()}}, s);
}

}  // namespace mt::cuda
