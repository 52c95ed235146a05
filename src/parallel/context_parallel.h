// Context parallelism: ring attention over the cp group on the zigzag layout.
//
// Each sequence of T positions is cut into 2*cp chunks of C = T / (2*cp); cp rank r
// holds chunks r and 2cp-1-r, in that order, as rows [chunk r | chunk 2cp-1-r] of
// every batch row (data::Dataset reads exactly that; its positions() gives them). The
// zigzag gives every rank the same amount of causal work.
//
// Forward: the K/V chunks travel around the ring (rank r sends to r+1, receives from
// r-1) while the current ones are used, cp - 1 passes. Every (query chunk, key chunk)
// block that is not fully masked runs cpu::attention_forward with the chunks' absolute
// positions as offsets (the causal diagonal and the window come from those), and the
// block results are merged with the online-softmax rule on their lse. A sink logit is
// given to the diagonal block of each query chunk only, so it is counted once in each
// row's denominator.
//
// Backward: the blocks are recomputed against the final out and lse (so each block's
// probabilities are the global ones); dQ stays here, and the dK/dV of each K/V chunk
// travel with it, each rank adding its share, until they are back at the owner. A
// rank adds its share to a partial sum received during its own compute, so the dK/dV
// transfers overlap the compute as the K/V ones do.
//
// The merge and the partial sums are kernels/ring_merge.h's over fp32 buffers, so the
// outputs are rounded to their dtype once, at the end. On the GPU the blocks run the CUDA
// attention kernels (bf16 q, k, v, out and gradients) and the K/V and dK/dV passes are
// NCCL batches on the communication stream.
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "kernels/attention.h"

namespace mt::parallel {

// The sequence positions cp rank `rank` holds of a sequence of `seq` positions:
// chunks rank and 2cp-1-rank of 2cp (seq must split into 2cp equal chunks).
std::vector<int64_t> zigzag_positions(int64_t seq, int rank, int cp);

// q [B,2C,Hq,Dqk], k [B,2C,Hkv,Dqk] and v [B,2C,Hkv,Dv]: this rank's zigzag rows, f32 on
// the host and bf16 on the GPU. sinks f32 [Hq] or empty. a.scale and a.window as for
// attention_forward; a.q_offset and a.k_offset must be 0 (the ring sets them per
// block). out [B,2C,Hq,Dv] (q's dtype) and lse f32 [B,Hq,2C] (overwritten) are this
// rank's rows of attention over whole sequences.
// Collective over `cp`. With cp = 1 it is plain attention (call that instead).
void ring_attention_forward(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse);

// dout, dq, dk, dv in q's dtype; dq, dk, dv (overwritten): the gradients of this
// rank's rows, dk and dv including every rank's queries. dsinks [Hq] is accumulated
// with this rank's query rows' share only: sum it over cp (and dp) like any parameter
// gradient.
void ring_attention_backward(comm::Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& sinks, const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& dsinks);

}  // namespace mt::parallel
