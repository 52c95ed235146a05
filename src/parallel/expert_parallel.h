// Expert parallelism: the dispatch and combine stages across the ep ranks.
//
// E global experts are split evenly: ep rank r owns experts [r*E/ep, (r+1)*E/ep).
// Every rank routes its own tokens (x [N,D], router idx [N,k] and weight [N,k]);
//
//   plan      each token goes once to every rank that owns at least one of its k
//             experts (not once per expert): the (token, rank) pairs are counted,
//             the counts exchanged, then the tokens' expert ids (all-to-all-v);
//   dispatch  the token rows follow (all-to-all-v); the receiver copies each row
//             once per local expert it chose, sorted by local expert (a counting
//             sort), giving xs [R,D] and the grouped GEMM's offsets;
//   experts   the caller's grouped GEMMs on xs: ys [R,Do];
//   combine   each (token, slot)'s expert output goes back to the token's rank
//             (all-to-all-v) into `back` [N*k, Do], where the weighted sum over the
//             k slots runs in fp32, slot by slot, exactly as cpu::combine_forward.
//
// Rows reach the experts ordered by (source rank, token, slot), so with the tokens of
// rank 0, then rank 1, ... an expert sees the rows the single-rank dispatch would give
// it, in the same order. The backward runs the same transfers in reverse: the combine's
// backward sends each slot's output gradient to its expert and gives dweight (the
// router's gradient) on the token's rank; the dispatch's backward adds the gradients
// of a row's copies on the expert's rank and sends one row back per (token, rank).
//
// The plan is built on the host (its counts must be there for the all-to-all-v
// anyway); the data movement goes through the dispatch kernels and the communicator.
// On the GPU the router's idx comes to the host once (N*k ints: the one synchronisation
// of a layer's exchange), the plan's index arrays go back to the device in one upload,
// and the rows travel in bf16 through NCCL; the weighted sums stay in fp32 (the dispatch
// kernels'). Dropless: every slot is kept.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace mt::parallel {

// What moves where for one micro-batch of one MoE layer; kept for its backward.
// "Sent rows" are this rank's (token, destination rank) pairs, "received rows" the
// pairs other ranks sent here; "slots" are (token, j) pairs, j < k.
struct EpPlan {
  int64_t tokens = 0, top_k = 0, num_experts = 0, ep_size = 1;
  int64_t first_expert = 0, local_experts = 0;  // this rank owns [first, first + local)

  // This rank's tokens.
  std::vector<int64_t> sent_rows_to;    // [ep] rows sent to each rank
  std::vector<int64_t> slots_to;        // [ep] slots routed to each rank's experts
  std::vector<int32_t> sent_token;      // [S] the token of each sent row (by rank, then token)
  std::vector<int32_t> token_rows;      // [N*k] the sent rows of token t, by rank; -1 after the last
  std::vector<int32_t> slot_row;        // [N*k] the row of `back` holding slot (t, j)'s output

  // The rows received for this rank's experts.
  std::vector<int64_t> recv_rows_from;  // [ep] rows received from each rank
  std::vector<int64_t> slots_from;      // [ep] local-expert slots among them
  std::vector<int32_t> order;           // [R] received slot u*k+j copied into xs row r
  std::vector<int32_t> local_slot_row;  // [U*k] the xs row of received slot (u, j); -1 when not local
  std::vector<int32_t> return_row;      // [R] the xs row of each output sent back, by (rank, token, j)
  std::vector<int32_t> return_pos;      // [R] inverse of return_row
  std::vector<int32_t> offsets;         // [local_experts + 1] xs rows of each local expert
  std::vector<int64_t> expert_counts;   // [num_experts] this rank's slots each expert kept
  int64_t dropped = 0;                  // this rank's slots over an expert's capacity

  // Where the kernels read the index arrays above: the host vectors, or (when idx was
  // on the GPU) their copies in one device block uploaded by ep_plan, which copies of
  // the plan share and the last one frees.
  Device device = Device::cpu;
  struct OnDevice {
    Tensor sent_token, token_rows, slot_row, order, local_slot_row, return_row, return_pos, offsets;
    std::shared_ptr<void> block;
  } gpu;

  int64_t sent_rows() const { return static_cast<int64_t>(sent_token.size()); }
  int64_t received_rows() const;                                          // U
  int64_t local_rows() const { return static_cast<int64_t>(order.size()); }  // R, rows of xs and ys
  int64_t returned_rows() const;  // rows of `back`: this rank's kept slots (N*k when dropless)
  // The grouped GEMM's segments, i32 [local_experts + 1] on the plan's device: a view
  // of `offsets` or of its GPU copy.
  Tensor offsets_tensor() const;
  // Rows each local expert received (from all ranks), for the metrics.
  std::vector<int64_t> local_counts() const;
};

// Collective over `ep`. idx i32 [N,k] on the host or the GPU, experts in [0,
// num_experts); num_experts must be a multiple of ep.size(). N may differ between ranks
// (even 0). The plan lives on idx's device, and so must every tensor given with it.
// capacity > 0: each expert keeps at most that many of the rows it receives, in
// (source rank, token, slot) order, so the earliest tokens of the lowest ranks first:
// the single-rank choice for the ranks' batches laid end to end. Receivers tell the
// senders which slots they dropped (one more exchange); a dropped slot adds nothing to
// its token's output (slot_row -1) and is counted in `dropped`.
EpPlan ep_plan(comm::Communicator& ep, const Tensor& idx, int64_t num_experts, int64_t capacity = 0);

// The row tensors below (x, xs, dxs, dx, ys, back, y, dy, dys) are f32 on the host and
// bf16 on the GPU, as the dispatch kernels take them; weight and dweight are f32.

// x [N,D] -> xs [R,D] (R = plan.local_rows()), rows of local expert e at
// plan.offsets[e] .. offsets[e+1].
void ep_dispatch_forward(comm::Communicator& ep, const EpPlan& plan, const Tensor& x, const Tensor& xs);
// dxs [R,D] -> dx [N,D] (overwritten). On the GPU a row's local copies are added in
// fp32 and rounded to bf16 before they travel, then the ranks' rows added in fp32.
void ep_dispatch_backward(comm::Communicator& ep, const EpPlan& plan, const Tensor& dxs, const Tensor& dx);

// ys [R,Do], weight f32 [N,k] -> back [N*k,Do] (the outputs of this rank's slots,
// which the backward needs: keep it) and y [N,Do] (overwritten).
void ep_combine_forward(comm::Communicator& ep, const EpPlan& plan, const Tensor& ys, const Tensor& weight,
                        const Tensor& back, const Tensor& y);
// dy [N,Do] -> dys [R,Do] and dweight f32 [N,k] (both overwritten).
void ep_combine_backward(comm::Communicator& ep, const EpPlan& plan, const Tensor& back, const Tensor& weight,
                         const Tensor& dy, const Tensor& dys, const Tensor& dweight);

}  // namespace mt::parallel
