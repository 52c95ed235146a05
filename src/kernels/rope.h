// Rotary position embeddings: frequency tables (default and YaRN) and the rotation.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mt::cpu {

struct RopeConfig {
  double theta = 10000.0;
  int64_t rotary_dim = 0;  // dims rotated (head_dim, or less with a partial rotary factor)
  // YaRN, as transformers' "yarn" rope type computes it (GPT-OSS, DeepSeek).
  bool yarn = false;
  double factor = 1.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double original_max_position = 4096.0;
  double attention_factor = 0.0;  // 0: derived from factor (and mscale / mscale_all_dim)
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  bool truncate = true;  // GPT-OSS sets false: keep the fractional correction range
};

struct RopeFreqs {
  std::vector<float> inv_freq;  // [rotary_dim / 2]
  float attention_scaling = 1.0f;  // multiplies cos and sin (YaRN's mscale)
};

RopeFreqs rope_freqs(const RopeConfig& cfg);

// cos/sin f32 [T, rotary_dim/2] for positions i32 [T]: angle = float(pos) * inv_freq,
// computed in fp32 as transformers does, times attention_scaling.
void rope_tables(const RopeFreqs& f, const Tensor& positions, const Tensor& cos, const Tensor& sin);

// x f32 [B,T,H,Dh] rotated into y (y may be x). The first rotary_dim = 2 * cos.dim(1)
// dims of each head rotate; the rest pass through. Pairs are (i, i + rotary_dim/2)
// (transformers' rotate_half) or, when interleaved, (2i, 2i+1) as DeepSeek's weights
// are laid out.
void rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& y);

// The inverse rotation of dy (dx may be dy).
void rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& dx);

}  // namespace mt::cpu

namespace mt::cuda {

// The tables are computed on the host by cpu::rope_tables (the same fp32 angles on both
// backends) and copied into cos/sin f32 on the GPU; positions may be on either device.
// Meant for once per sequence layout, not per step: it waits for the copies.
void rope_tables(const cpu::RopeFreqs& f, const Tensor& positions, const Tensor& cos, const Tensor& sin);

// x, y, dy, dx f32 or bf16 (rotated in f32); cos/sin f32 on the GPU; in place allowed.
void rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& y);
void rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& dx);

}  // namespace mt::cuda

namespace mt {

// RopeFreqs lives in mt::cpu, so an unqualified call from namespace mt also finds
// cpu::rope_tables by argument-dependent lookup: call this one as mt::rope_tables.
inline void rope_tables(const cpu::RopeFreqs& f, const Tensor& positions, const Tensor& cos, const Tensor& sin) {
  return MT_BACKEND(cos.device == Device::cuda, rope_tables(f, positions, cos, sin));
}

inline void rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& y) {
  return MT_BACKEND(y.device == Device::cuda, rope_forward(x, cos, sin, interleaved, y));
}

inline void rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& dx) {
  return MT_BACKEND(dx.device == Device::cuda, rope_backward(dy, cos, sin, interleaved, dx));
}

}  // namespace mt
