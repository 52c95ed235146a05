// AdamW with decoupled weight decay, step for step as torch.optim.AdamW computes it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/param.h"
#include "core/tensor.h"

namespace mt {

// One parameter block of a multi-tensor step: f32 param and grad, and the moments m, v,
// f32 or both bf16, of one element count; decay says whether the step's weight decay
// applies to it (matrices) or not.
struct AdamWBlock {
  Tensor param, grad, m, v;
  bool decay = true;
  // Optional bf16 tensor of param's size: gets the updated param rounded to nearest
  // even, as cast() rounds, in the same pass (the GPU's compute copy, no second read).
  Tensor compute;
  // bf16 moments: element i's rounding noise is keyed by key + i (adamw_noise), so a
  // block names where it starts, e.g. its parameter's index << 40 plus its offset.
  uint64_t key = 0;
  // Optional (q set): the updated param, a [N, K] or [E, N, K] matrix, quantized into
  // these blockwise FP8 codes, as quantize_blocks writes them (kernels/fp8_quant.h), in
  // the same pass on the GPU (the update's tiles are the 128x128 blocks).
  Fp8Copy fp8 = {};
};

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif

// bf16 moments are rounded stochastically: 16 random bits are added below the kept
// half of the f32 before truncation, so a value rounds up with probability equal to
// the fraction it lies above the lower bf16 neighbour, and the moment is unbiased.
// (Rounded to nearest, v's increment (1 - beta2) g^2 is below half a bf16 step once
// beta2 > 0.996, and v would stop moving.) The bits are a hash of the element's key
// and the step, so a run repeats bit for bit, on either backend, and resumes exactly.
MT_HOST_DEVICE inline uint64_t adamw_noise(uint64_t key, uint64_t step) {
  uint64_t z = key + step * 0x9e3779b97f4a7c15ull;  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// `bits` an f32's bits; the low 16 of `noise` are used. NaN stays the canonical NaN.
MT_HOST_DEVICE inline uint16_t bf16_stochastic(uint32_t bits, uint64_t noise) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<uint16_t>((bits + static_cast<uint32_t>(noise & 0xffffu)) >> 16);
}

}  // namespace mt

namespace mt::cpu {

// Hyperparameters in double, as Python passes them to torch; the per-element work is fp32.
struct AdamWStep {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0;
  int64_t step = 1;  // 1-based, for the bias corrections
  // Multiplies each gradient as it is read: the clipping factor, applied here instead
  // of in a pass of its own over every gradient.
  float grad_scale = 1.0f;
};

// On a flat f32 shard: p *= 1 - lr*wd; m, v updated; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
// param, grad f32, m and v f32 or both bf16 (stored stochastically rounded, noise keyed
// by key + i), all with the same element count.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWStep& s,
                uint64_t key = 0);

// adamw_step on every block, with s.weight_decay where the block's decay is set and 0
// elsewhere.
void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const AdamWStep& s);

}  // namespace mt::cpu

namespace mt::cuda {

// The same update on the GPU, bit for bit: the per-element arithmetic is the CPU's,
// in the same order, with no fused multiply-adds.
void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& s);

}  // namespace mt::cuda

// The optimizer steps lists of blocks, so only adamw_step_multi has a dispatcher: by the
// first block's device (all must share it). Call it as mt::adamw_step_multi: AdamWStep
// lives in mt::cpu, so unqualified lookup by argument type also finds cpu::'s.
namespace mt {

inline void adamw_step_multi(const std::vector<AdamWBlock>& blocks, const cpu::AdamWStep& s) {
  return MT_BACKEND(!blocks.empty() && blocks.front().param.device == Device::cuda, adamw_step_multi(blocks, s));
}

}  // namespace mt
