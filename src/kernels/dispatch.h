// Token <-> expert permutations: a stable counting sort of the (token, slot) pairs
// by expert (O(N*k), no argsort), the gather into expert order, and the weighted
// combine back. Backwards are gathers too, so no step needs atomics.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"

namespace mt::cpu {

// idx i32 [N,k] with experts in [0,E) -> counts i32 [E], offsets i32 [E+1],
// order i32 [R] and slot_row i32 [N*k], where R = offsets[E] rows are kept.
// order[r] = t*k + j, the flat slot placed in row r (by expert, then token, then j);
// slot_row[t*k + j] = the row that slot went to, or -1 when dropped. capacity > 0
// keeps at most that many rows per expert (earliest tokens first); 0 drops nothing.
// order must have room for N*k entries. Returns the number of dropped slots.
int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                      const Tensor& offsets, const Tensor& order, const Tensor& slot_row);

// xs[r] = x[order[r] / k] for r < R. x f32 [N,D], xs f32 [R,D].
void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs);
// dx[t] = sum over kept slots j of dxs[slot_row[t*k+j]] (overwritten). dxs [R,D].
void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx);

// y[t] = sum over kept slots j of weight[t,j] * ys[slot_row[t*k+j]], summed in fp32.
// ys f32 [R,D], weight f32 [N,k], y f32 [N,D] (overwritten).
void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y);
// dys[slot_row[s]] = weight[s] * dy[t]; dweight[t,j] = dy[t] . ys[slot_row[t*k+j]] (0 if dropped).
void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                      const Tensor& dys, const Tensor& dweight);

// dispatch_plan's counting sort as the expert-parallel plan uses it: buckets i32 [N,k]
// in [-1, B), where -1 sends a slot nowhere (slot_row -1, neither counted nor placed).
// order must have room for the offsets[B] placed slots, at most N*k. Nothing comes back
// to the host (the dropped slots are those of a bucket with slot_row -1), so on the GPU
// it never synchronises.
void dispatch_sort(const Tensor& buckets, int64_t num_buckets, int64_t capacity, const Tensor& counts,
                   const Tensor& offsets, const Tensor& order, const Tensor& slot_row);

// The expert-parallel plan's elementwise steps (parallel/expert_parallel.cpp), for E
// experts over ranks of `per` experts each (rank r owns [r*per, (r+1)*per)). "Rows" are a
// token's copies, one per destination rank; "slots" are (token t, j) pairs, j < k.
//
// idx i32 [N,k] in [0, E) -> buckets [N,k]: the rank owning expert idx[t,j] when j is
// token t's first slot going to that rank, else -1 (the row is already counted). A
// counting sort by them numbers the rows by (rank, token).
void ep_row_buckets(const Tensor& idx, int64_t per, int64_t num_experts, const Tensor& buckets);
// What each sent row tells its rank r: for row i, carrying slot sent_slot[i] of token t
// = sent_slot[i] / k, buckets[i,j] = idx[t,j] - r*per (a local expert of r) or -1 when
// r does not own that expert. buckets i32 [S,k] for sent_slot [S].
void ep_send_buckets(const Tensor& idx, const Tensor& sent_slot, int64_t per, const Tensor& buckets);
// out [ranks,2]: per rank, rows row_counts[r] and slots expert_offsets[(r+1)*per] -
// expert_offsets[r*per] (the offsets of the slots' counting sort by expert, [E+1]).
void ep_pack_counts(const Tensor& row_counts, const Tensor& expert_offsets, int64_t per, const Tensor& out);
// buckets [M] over the rows of `order`: the source rank of received row order[r] / k for
// r < R = local_offsets[last] (the rows placed), -1 for r >= R. Rows arrive in source
// rank order, recv_counts[p, 0] of them from rank p ([ranks,2]).
void ep_return_buckets(const Tensor& order, const Tensor& local_offsets, const Tensor& recv_counts, int64_t k,
                       const Tensor& buckets);
// With a capacity: buckets [N,k] = idx[t,j] when the receiver kept slot (t,j), else -1.
// token_rows [N*k] numbers the sent rows (ep_row_buckets' sort); kept_rows [S*k] holds,
// for each slot of each sent row, the row the receiver gave it (-1: dropped or not its).
void ep_kept_buckets(const Tensor& idx, const Tensor& token_rows, const Tensor& kept_rows, int64_t per,
                     const Tensor& buckets);
// Expert replicas (parallel/placement.h, RouteTable): idx i32 [N,k] -> slots i32 [N,k],
// the slot of the ranks' numbering each (t, j) goes to: mine[e] when >= 0, else the
// first copy i in [first[e], first[e+1]) with u(t) < bound[i], u(t) = t x 2654435769 mod
// 2^32 (the last bound is 2^32). mine [E], first [E+1], slot i32 and bound i64 [C].
void ep_route_slots(const Tensor& idx, const Tensor& mine, const Tensor& first, const Tensor& slot,
                    const Tensor& bound, const Tensor& slots);
// Small i32 arrays (a plan's counts) one after another into host memory `out`, which has
// room for all of them: on the CPU a copy.
void read_counts(std::initializer_list<Tensor> arrays, int32_t* out);

}  // namespace mt::cpu

// The CUDA backend: the same plan (identical, deterministic), bf16 activations with the
// combine's weighted sums in f32. dispatch_plan synchronises only with a capacity (to
// return the dropped count; the single-rank dispatch stage accepts that), without one
// it returns 0 at once; dispatch_sort and the ep_ steps never synchronise.
namespace mt::cuda {

int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                      const Tensor& offsets, const Tensor& order, const Tensor& slot_row);
void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs);
void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx);
void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y);
void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                      const Tensor& dys, const Tensor& dweight);
void dispatch_sort(const Tensor& buckets, int64_t num_buckets, int64_t capacity, const Tensor& counts,
                   const Tensor& offsets, const Tensor& order, const Tensor& slot_row);
void ep_row_buckets(const Tensor& idx, int64_t per, int64_t num_experts, const Tensor& buckets);
void ep_send_buckets(const Tensor& idx, const Tensor& sent_slot, int64_t per, const Tensor& buckets);
void ep_pack_counts(const Tensor& row_counts, const Tensor& expert_offsets, int64_t per, const Tensor& out);
void ep_return_buckets(const Tensor& order, const Tensor& local_offsets, const Tensor& recv_counts, int64_t k,
                       const Tensor& buckets);
void ep_kept_buckets(const Tensor& idx, const Tensor& token_rows, const Tensor& kept_rows, int64_t per,
                     const Tensor& buckets);
void ep_route_slots(const Tensor& idx, const Tensor& mine, const Tensor& first, const Tensor& slot,
                    const Tensor& bound, const Tensor& slots);
// Through a pinned buffer; waits for the work queued before the copies (an event), never
// for the whole device.
void read_counts(std::initializer_list<Tensor> arrays, int32_t* out);

}  // namespace mt::cuda

namespace mt {

inline int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                             const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  return MT_BACKEND(slot_row.device == Device::cuda,
                    dispatch_plan(idx, num_experts, capacity, counts, offsets, order, slot_row));
}

inline void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs) {
  return MT_BACKEND(xs.device == Device::cuda, dispatch_forward(x, order, k, xs));
}

inline void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx) {
  return MT_BACKEND(dx.device == Device::cuda, dispatch_backward(dxs, slot_row, dx));
}

inline void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y) {
  return MT_BACKEND(y.device == Device::cuda, combine_forward(ys, weight, slot_row, y));
}

inline void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                             const Tensor& dys, const Tensor& dweight) {
  return MT_BACKEND(dys.device == Device::cuda, combine_backward(ys, weight, slot_row, dy, dys, dweight));
}

inline void dispatch_sort(const Tensor& buckets, int64_t num_buckets, int64_t capacity, const Tensor& counts,
                          const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  return MT_BACKEND(slot_row.device == Device::cuda,
                    dispatch_sort(buckets, num_buckets, capacity, counts, offsets, order, slot_row));
}

inline void ep_row_buckets(const Tensor& idx, int64_t per, int64_t num_experts, const Tensor& buckets) {
  return MT_BACKEND(buckets.device == Device::cuda, ep_row_buckets(idx, per, num_experts, buckets));
}

inline void ep_send_buckets(const Tensor& idx, const Tensor& sent_slot, int64_t per, const Tensor& buckets) {
  return MT_BACKEND(buckets.device == Device::cuda, ep_send_buckets(idx, sent_slot, per, buckets));
}

inline void ep_pack_counts(const Tensor& row_counts, const Tensor& expert_offsets, int64_t per, const Tensor& out) {
  return MT_BACKEND(out.device == Device::cuda, ep_pack_counts(row_counts, expert_offsets, per, out));
}

inline void ep_return_buckets(const Tensor& order, const Tensor& local_offsets, const Tensor& recv_counts, int64_t k,
                              const Tensor& buckets) {
  return MT_BACKEND(buckets.device == Device::cuda, ep_return_buckets(order, local_offsets, recv_counts, k, buckets));
}

inline void ep_kept_buckets(const Tensor& idx, const Tensor& token_rows, const Tensor& kept_rows, int64_t per,
                            const Tensor& buckets) {
  return MT_BACKEND(buckets.device == Device::cuda, ep_kept_buckets(idx, token_rows, kept_rows, per, buckets));
}

inline void ep_route_slots(const Tensor& idx, const Tensor& mine, const Tensor& first, const Tensor& slot,
                           const Tensor& bound, const Tensor& slots) {
  return MT_BACKEND(slots.device == Device::cuda, ep_route_slots(idx, mine, first, slot, bound, slots));
}

inline void read_counts(std::initializer_list<Tensor> arrays, int32_t* out) {
  return MT_BACKEND(arrays.size() > 0 && arrays.begin()->device == Device::cuda, read_counts(arrays, out));
}

}  // namespace mt
