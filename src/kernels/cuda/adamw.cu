// Multi-tensor AdamW on the GPU: the list of parameter blocks travels in the kernel's
// parameters, each thread block updates one chunk of one tensor, so a model's whole
// optimizer step is one launch (one per kTableSize blocks).
#include <cuda_bf16.h>

#include <algorithm>
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
// for bit (sqrt and division are IEEE-rounded on both).
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
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float gi = __fmul_rn(g[i], t.grad_scale);
    const float pi = __fmul_rn(p[i], decay);
    const float mi = __fadd_rn(m[i], __fmul_rn(t.w1, __fsub_rn(gi, m[i])));
    const float vi = __fadd_rn(__fmul_rn(v[i], t.b2), __fmul_rn(__fmul_rn(t.w2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), t.bias2_sqrt), t.eps);
    const float pn = __fsub_rn(pi, __fdiv_rn(__fmul_rn(t.step_size, mi), denom));
    p[i] = pn;
    if (c != nullptr) c[i] = __float2bfloat16_rn(pn);
    m[i] = mi;
    v[i] = vi;
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
