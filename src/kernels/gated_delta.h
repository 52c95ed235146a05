// The gated delta rule, the token mixer of Gated DeltaNet: per batch row and head a state
// S [Dk,Dv] is decayed, corrected toward v along k, and read by q,
//
//   S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   a_t = exp(g_t),
//   o_t = S_t^T q_t,
//
// with q and k as given (the caller L2-normalises them and scales q), g_t <= 0 a log-decay
// and beta_t in (0,1), one each per head and token, S_0 given or zero.
//
// Chunked, as the GPU will run it. In a chunk of L <= C tokens entering with state S0, with
// G_i = g_1 + ... + g_i (the chunk's cumulative log-decay), gamma_i = exp(G_i) and
// D_ij = exp(G_i - G_j) for j <= i (never above 1, so nothing overflows), the state is
// S_i = gamma_i S0 + sum_{j<=i} D_ij k_j u_j^T, where the chunk's "delta" values
// u_j = beta_j (v_j - a_j S_{j-1}^T k_j) solve the unit lower-triangular system
//
//   (I + A) U = R,   A_jm = beta_j D_jm k_j.k_m (m < j),   R_j = beta_j (v_j - gamma_j S0^T k_j)
//
// (the UT transform, by forward substitution); then
//
//   O = diag(gamma) Q S0 + (D o Q K^T)_causal U,   S_L = gamma_L S0 + sum_j D_Lj k_j u_j^T.
//
// The backward walks the chunks from last to first carrying dS (the gradient of the state
// leaving the chunk), and in each: the state and output terms give dU, dS0 and parts of
// dq, dk; dR = (I + A)^-T dU (back substitution) and dA = -dR U^T (strictly lower); those
// give dv = beta dR, dbeta, the rest of dk and dS0. Every term's gradient with respect to a
// G_i or G_j (each D_ij, gamma_i, A_jm is an exponential of G differences) is collected in
// dG, and dg_i = sum_{m >= i} dG_m (G is a cumulative sum). Nothing is stashed: the
// backward recomputes the states entering each chunk (one forward sweep without outputs),
// then each chunk's G, A, U and D o QK^T, so the forward keeps only its inputs (the
// backward holds T/C states of Dk x Dv doubles per thread while it runs).
//
// Layouts (row-major): q, k [B,T,H,Dk]; v, o [B,T,H,Dv]; g, beta [B,T,H]; states
// [B,H,Dk,Dv]. Threads own (batch, head) pairs; inside, a chunk computes in double.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "core/tensor.h"

namespace mt::cpu {

// All f32. state_in may be empty (S_0 = 0) and state_out may be empty (not wanted): a
// context-parallel rank hands its final state to the next rank as that one's state_in.
void gated_delta_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                         const Tensor& state_in, const Tensor& out, const Tensor& state_out, int64_t chunk = 64);

// dout like out; d_state_out (the final state's gradient) may be empty (zero). dq, dk,
// dv, dg, dbeta (shaped like their inputs) are overwritten; d_state_in may be empty (not
// wanted), and is computed as S_0's gradient even when state_in is empty (zeros).
void gated_delta_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& state_in, const Tensor& dout, const Tensor& d_state_out, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                          const Tensor& d_state_in, int64_t chunk = 64);

// The chunked core on raw pointers, for T = float (the entry points above) and double (the
// tests' exactness check against the step-by-step recurrence): T is the type of what is
// read and written. Null state pointers mean what the empty Tensors above mean.
struct GatedDeltaDims {
  int64_t batch, tokens, heads, dk, dv, chunk;
};
template <typename T>
void gated_delta_chunked_forward(const GatedDeltaDims& n, const T* q, const T* k, const T* v, const T* g,
                                 const T* beta, const T* state_in, T* out, T* state_out);
template <typename T>
void gated_delta_chunked_backward(const GatedDeltaDims& n, const T* q, const T* k, const T* v, const T* g,
                                  const T* beta, const T* state_in, const T* dout, const T* d_state_out, T* dq,
                                  T* dk, T* dv, T* dg, T* dbeta, T* d_state_in);
extern template void gated_delta_chunked_forward<float>(const GatedDeltaDims&, const float*, const float*,
                                                        const float*, const float*, const float*, const float*,
                                                        float*, float*);
extern template void gated_delta_chunked_forward<double>(const GatedDeltaDims&, const double*, const double*,
                                                         const double*, const double*, const double*,
                                                         const double*, double*, double*);
extern template void gated_delta_chunked_backward<float>(const GatedDeltaDims&, const float*, const float*,
                                                         const float*, const float*, const float*, const float*,
                                                         const float*, const float*, float*, float*, float*, float*,
                                                         float*, float*);
extern template void gated_delta_chunked_backward<double>(const GatedDeltaDims&, const double*, const double*,
                                                          const double*, const double*, const double*,
                                                          const double*, const double*, const double*, double*,
                                                          double*, double*, double*, double*, double*);

}  // namespace mt::cpu

namespace mt::cuda {

// kernels/cuda/gated_delta.cu: chunks of 64, states in f32. q, k, v, out, dout, dq, dk, dv
// f32 or bf16; g, beta, dg, dbeta and the states f32; Dk, Dv <= 128. The backward
// allocates a workspace of every batch row's states and stashes (that file's header).
void gated_delta_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                         const Tensor& state_in, const Tensor& out, const Tensor& state_out);
void gated_delta_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& state_in, const Tensor& dout, const Tensor& d_state_out, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                          const Tensor& d_state_in);
// The products on the tensor cores in tf32 (the default) or on the SIMT cores in f32;
// for the tests and attention_bench, which compare the two.
void set_gated_delta_tensor_cores(bool enabled);
bool gated_delta_tensor_cores();

}  // namespace mt::cuda

namespace mt {

inline void gated_delta_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                const Tensor& state_in, const Tensor& out, const Tensor& state_out) {
  return MT_BACKEND(out.device == Device::cuda, gated_delta_forward(q, k, v, g, beta, state_in, out, state_out));
}

inline void gated_delta_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, const Tensor& state_in, const Tensor& dout,
                                 const Tensor& d_state_out, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                 const Tensor& dg, const Tensor& dbeta, const Tensor& d_state_in) {
  return MT_BACKEND(dq.device == Device::cuda, gated_delta_backward(q, k, v, g, beta, state_in, dout, d_state_out, dq,
                                                                    dk, dv, dg, dbeta, d_state_in));
}

}  // namespace mt
