// Gated DeltaNet, a linear-attention token mixer (Qwen3.5's `linear_attn` layers, as
// transformers 5.17's Qwen3_5MoeGatedDeltaNet computes them), for the decoder's per-layer
// mixer seam (models/decoder.h, Mixers):
//
//   [qkv | z | b | a] = xn W (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
//   qkv = silu(causal depthwise conv1d(qkv))               kernels/deltanet.h
//   q, k = L2-normed per head (q also times 1 / sqrt(Dk)), key heads repeated to the
//   value heads; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
//   o = the gated delta rule over (q, k, v, g, beta)        kernels/gated_delta.h
//   out = out_proj(rmsnorm(o per head, norm) * silu(z))     (the gated RMSNorm)
//
// The L2 norms are rmsnorm with eps / Dk and a constant weight (1 / sqrt(Dk) for k,
// 1 / Dk for q, folding its scale): rmsnorm's rstd is sqrt(Dk) / sqrt(sum + eps). The
// gated RMSNorm is rmsnorm, then swiglu over each head's [z | normed]. The conv's and
// the gates' weight gradients are taken in B, with their input gradients, as the
// decoder's norms are. Both backends; one rank's whole sequences (parallelism.cp > 1 is
// refused), no state between micro-batches.
#pragma once

#include <memory>

#include "models/decoder.h"

namespace mt {

struct GatedDeltaNetSpec {
  int64_t hidden_size = 0;
  int64_t key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0, conv_kernel = 4;
  double rms_norm_eps = 1e-6;
};

// Refuses, by name and before any data is read, what it does not run yet: context
// parallelism (options.cp over more than one rank).
std::shared_ptr<Attention> make_gated_deltanet(const GatedDeltaNetSpec& spec, int64_t num_layers,
                                               const ModelOptions& options);

}  // namespace mt
