// Expert parallelism: the dispatch and combine stages across the ep ranks.
//
// E global experts are split evenly: ep rank r owns experts [r*E/ep, (r+1)*E/ep).
// Every rank routes its own tokens (x [N,D], router idx [N,k] and weight [N,k]);
//
//   plan      each token goes once to every rank that owns at least one of its k
//             experts (not once per expert): the (token, rank) rows are numbered by
//             rank, then token; the counts are exchanged, then each row's expert ids;
//   dispatch  the token rows follow (all-to-all-v); the receiver copies each row
//             once per local expert it chose, sorted by local expert (a counting
//             sort), giving xs [R,D] and the grouped GEMM's offsets;
//   experts   the caller's grouped GEMMs on xs: ys [R,Do];
//   combine   each (token, slot)'s expert output goes back to the token's rank
//             (all-to-all-v) into `back` [N*k, Do] (by expert, then token, then slot),
//             where the weighted sum over the k slots runs in fp32, slot by slot,
//             exactly as cpu::combine_forward.
//
// Rows reach the experts ordered by (source rank, token, slot), so with the tokens of
// rank 0, then rank 1, ... an expert sees the rows the single-rank dispatch would give
// it, in the same order. The backward runs the same transfers in reverse: the combine's
// backward sends each slot's output gradient to its expert and gives dweight (the
// router's gradient) on the token's rank; the dispatch's backward adds the gradients
// of a row's copies on the expert's rank and sends one row back per (token, rank),
// where the token's rank adds them in the order of the token's slots.
//
// The plan is built where idx is, by the dispatch family's kernels (stable counting
// sorts and elementwise index steps), one code path for both backends; its index
// arrays stay there. Only counts cross to the host, which sizes the all-to-alls: the
// rows and slots per rank, exchanged over ep and read once (on the GPU through pinned
// memory and an event, waiting for nothing queued after them); with a capacity once
// more (the kept slots per rank). Rows travel in bf16 through NCCL on the GPU; the
// weighted sums stay in fp32 (the dispatch kernels').
//
// Each exchange comes in two halves: *_start packs the rows and starts the
// all-to-all-v, returning the EpExchange that holds the transfer; *_finish waits for it
// and unpacks.
//
// Where the rest of the exchange lives: kernels/dispatch.h (the counting sorts and index
// steps the plan runs, and the one-rank dispatch and combine); parallel/buffer.h (the
// row buffers, sized by the counts the plan brings); models/moe.cpp (the MoE layer's
// dispatch, experts and combine stages, which call these, and its RowPool);
// models/expert_replicas.h (replica slots as the plan's experts); train/schedule.h
// (where each *_start and *_finish runs in a step).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace mt::parallel {

// What moves where for one micro-batch of one MoE layer; kept for its backward.
// "Sent rows" are this rank's (token, destination rank) pairs, "received rows" the
// pairs other ranks sent here; "slots" are (token, j) pairs, j < k. Copies share the
// index arrays, which go with the last copy.
struct EpPlan {
  int64_t tokens = 0, top_k = 0;
  Device device = Device::cpu;  // idx's, where the arrays below live

  // Counts per rank, on the host: the sizes of the all-to-alls.
  std::vector<int64_t> sent_rows_to;    // [ep] rows sent to each rank
  std::vector<int64_t> slots_to;        // [ep] slots each rank's experts kept (all, dropless)
  std::vector<int64_t> recv_rows_from;  // [ep] rows received from each rank
  std::vector<int64_t> slots_from;      // [ep] slots of those rows this rank's experts kept
  int64_t dropped = 0;                  // this rank's slots over an expert's capacity

  // Index arrays, i32 on the plan's device. This rank's tokens:
  Tensor sent_slot;   // [S] the slot t*k+j whose token t each sent row carries, by rank then token
  Tensor token_rows;  // [N*k] the sent row of (t, j) where j is t's first slot to its rank; else -1
  Tensor slot_row;    // [N*k] the row of `back` holding slot (t, j)'s output; -1 when dropped
  Tensor expert_counts;  // [num_experts] this rank's slots each expert kept (the metrics')
  // The rows received for this rank's experts:
  Tensor order;           // [R] received slot u*k+j copied into xs row r
  Tensor local_slot_row;  // [U*k] the xs row of received slot (u, j); -1 when not local or dropped
  Tensor return_row;      // [R] the xs row of each output sent back, by (source rank, expert, row, j)
  Tensor return_pos;      // [R] inverse of return_row
  Tensor offsets;         // [E/ep + 1] xs rows of each local expert: the grouped GEMM's segments
  std::vector<std::shared_ptr<void>> storage;

  int64_t sent_rows() const;      // S
  int64_t received_rows() const;  // U
  int64_t local_rows() const;     // R, rows of xs and ys
  int64_t returned_rows() const;  // rows of `back`: this rank's kept slots (N*k when dropless)
};

// Collective over `ep`. idx i32 [N,k] on the host or the GPU, experts in [0,
// num_experts); num_experts must be a multiple of ep.size(). N may differ between ranks
// (even 0). The plan lives on idx's device, and so must every tensor given with it.
// capacity > 0: each expert keeps at most that many of the rows it receives, in
// (source rank, token, slot) order, so the earliest tokens of the lowest ranks first:
// the single-rank choice for the ranks' batches laid end to end. Receivers tell the
// senders which slots they kept (one more exchange); a dropped slot adds nothing to its
// token's output (slot_row -1) and is counted in `dropped`.
//
// On the GPU the plan is built on a stream of its own (high priority: the host waits
// for its counts), after `routed` when given, else after what the current stream has
// queued; the current stream then waits for the plan. With the mark taken right after
// the router, the count read waits for the router and nothing a schedule queued on the
// compute stream since (another micro-batch's stages).
struct RoutedMark {
  std::shared_ptr<void> event;  // GPU: the cuda::Event after the router; null: none
};
// Marks the current stream where idx is complete (GPU; on the host it marks nothing).
RoutedMark mark_routed(const Tensor& idx);
EpPlan ep_plan(comm::Communicator& ep, const Tensor& idx, int64_t num_experts, int64_t capacity = 0,
               const RoutedMark& routed = {});

// A started exchange: the transfer's request and the buffers that belong to it until
// the finish of the same kind, which waits, unpacks and empties it. Destroying one that
// was never finished, or assigning over it, waits for its transfer before the buffers go
// (the request, declared last, is destroyed first and assigned first).
struct EpExchange {
  enum class Kind : uint8_t { none, dispatch_forward, dispatch_backward, combine_forward, combine_backward };
  Kind kind = Kind::none;
  Tensor received;  // where the rows arrive
  std::shared_ptr<void> send_storage, recv_storage;  // recv: none when they arrive in the caller's tensor
  comm::Request request;

  EpExchange() = default;
  EpExchange(EpExchange&& o) noexcept { *this = std::move(o); }
  EpExchange& operator=(EpExchange&& o) noexcept {
    if (this != &o) {
      request = std::move(o.request);
      kind = std::exchange(o.kind, Kind::none);
      received = o.received;
      send_storage = std::move(o.send_storage);
      recv_storage = std::move(o.recv_storage);
    }
    return *this;
  }
  bool in_flight() const { return kind != Kind::none; }
};

// The row tensors below (x, xs, dxs, dx, ys, back, y, dy, dys) are f32 on the host and
// bf16 on the GPU, as the dispatch kernels take them; weight and dweight are f32.

// x [N,D] -> xs [R,D] (R = plan.local_rows()), rows of local expert e at
// plan.offsets[e] .. offsets[e+1].
EpExchange ep_dispatch_forward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& x);
void ep_dispatch_forward_finish(EpExchange& exchange, const EpPlan& plan, const Tensor& xs);

// dxs [R,D] -> dx [N,D] (overwritten). On the GPU a row's local copies are added in
// fp32 and rounded to bf16 before they travel, then the ranks' rows added in fp32.
EpExchange ep_dispatch_backward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& dxs);
void ep_dispatch_backward_finish(EpExchange& exchange, const EpPlan& plan, const Tensor& dx);

// ys [R,Do], weight f32 [N,k] -> back [returned_rows, Do] (the outputs of this rank's
// kept slots, which the backward needs: keep it; it belongs to the transfer until the
// finish) and y [N,Do] (overwritten).
EpExchange ep_combine_forward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& ys,
                                    const Tensor& back);
void ep_combine_forward_finish(EpExchange& exchange, const EpPlan& plan, const Tensor& weight, const Tensor& y);

// dy [N,Do] -> dweight f32 [N,k] (written by the start) and dys [R,Do] (by the finish).
EpExchange ep_combine_backward_start(comm::Communicator& ep, const EpPlan& plan, const Tensor& back,
                                     const Tensor& weight, const Tensor& dy, const Tensor& dweight);
void ep_combine_backward_finish(EpExchange& exchange, const EpPlan& plan, const Tensor& dys);

}  // namespace mt::parallel
