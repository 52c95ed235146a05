// Muon's per-element and per-matrix steps (train/optimizer.h applies them: which weights
// are matrices, the sharding, the learning-rate scale). For a 2-D weight W with gradient G:
//
//   m <- mu m + G                       momentum (muon_momentum)
//   U  = G + mu m  (Nesterov) or m
//   O  = NS5(U / (|U|_F + 1e-7))        orthogonalised (newton_schulz)
//   W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O      (muon_apply)
//
// NS5 is five steps of the quintic Newton-Schulz iteration X <- a X + (b A + c A A) X,
// A = X X^T, with the public coefficients (a, b, c) = (3.4445, -4.7750, 2.0315), run on
// the wide orientation (X^T when rows exceed columns, the result transposed back). Its
// products are f32 on the CPU and bf16 with f32 sums on the GPU, as Muon runs them.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mt {

constexpr float kNewtonSchulzA = 3.4445f, kNewtonSchulzB = -4.7750f, kNewtonSchulzC = 2.0315f;
constexpr float kMuonNormEps = 1e-7f;

}  // namespace mt

namespace mt::cpu {

struct MuonMomentum {
  float mu = 0.95f;
  bool nesterov = true;
  float grad_scale = 1.0f;  // multiplies each gradient as it is read (the clipping factor)
  int64_t step = 1;         // 1-based: keys a bf16 momentum's rounding noise (kernels/adamw.h)
};

// m <- mu m + g s; out <- g s + mu m (Nesterov) or m, where s = grad_scale. grad, out f32
// (out may be grad); m f32, or bf16 stored rounded stochastically (adamw_noise(key + i,
// step)'s low 16 bits), the update reading its unrounded value. All of one element count.
void muon_momentum(const Tensor& grad, const Tensor& m, const Tensor& out, const MuonMomentum& s, uint64_t key = 0);

// Each of xs (f32 [rows, cols], all of one shape) in place: normalised by its Frobenius
// norm and orthogonalised by `steps` Newton-Schulz iterations (the header).
void newton_schulz(const std::vector<Tensor>& xs, int steps);

// param <- param * decay - step * o, f32, one element count (o may be a view of another
// layout's element order only if it matches param's).
void muon_apply(const Tensor& param, const Tensor& o, float decay, float step);

}  // namespace mt::cpu

namespace mt::cuda {

void muon_momentum(const Tensor& grad, const Tensor& m, const Tensor& out, const cpu::MuonMomentum& s,
                   uint64_t key = 0);
// The products in bf16 (f32 sums), the iterate kept in bf16 between them.
void newton_schulz(const std::vector<Tensor>& xs, int steps);
void muon_apply(const Tensor& param, const Tensor& o, float decay, float step);

}  // namespace mt::cuda

namespace mt {

inline void muon_momentum(const Tensor& grad, const Tensor& m, const Tensor& out, const cpu::MuonMomentum& s,
                          uint64_t key = 0) {
  return MT_BACKEND(grad.device == Device::cuda, muon_momentum(grad, m, out, s, key));
}
inline void newton_schulz(const std::vector<Tensor>& xs, int steps) {
  return MT_BACKEND(!xs.empty() && xs.front().device == Device::cuda, newton_schulz(xs, steps));
}
inline void muon_apply(const Tensor& param, const Tensor& o, float decay, float step) {
  return MT_BACKEND(param.device == Device::cuda, muon_apply(param, o, decay, step));
}

}  // namespace mt
