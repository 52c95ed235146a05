// Token <-> expert permutations: a stable counting sort of the (token, slot) pairs
// by expert (O(N*k), no argsort), the gather into expert order, and the weighted
// combine back. Backwards are gathers too, so no step needs atomics.
#pragma once

#include <cstdint>

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

}  // namespace mt::cpu

// The CUDA backend: the same plan (identical, deterministic), bf16 activations with the
// combine's weighted sums in f32. dispatch_plan synchronises only with a capacity (to
// return the dropped count); without one it returns 0 at once.
namespace mt::cuda {

int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                      const Tensor& offsets, const Tensor& order, const Tensor& slot_row);
void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs);
void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx);
void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y);
void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                      const Tensor& dys, const Tensor& dweight);

}  // namespace mt::cuda

namespace mt {

inline int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                             const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
#ifdef MOETRAIN_WITH_CUDA
  if (slot_row.device == Device::cuda)
    return cuda::dispatch_plan(idx, num_experts, capacity, counts, offsets, order, slot_row);
#endif
  return cpu::dispatch_plan(idx, num_experts, capacity, counts, offsets, order, slot_row);
}

inline void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs) {
#ifdef MOETRAIN_WITH_CUDA
  if (xs.device == Device::cuda) return cuda::dispatch_forward(x, order, k, xs);
#endif
  return cpu::dispatch_forward(x, order, k, xs);
}

inline void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx) {
#ifdef MOETRAIN_WITH_CUDA
  if (dx.device == Device::cuda) return cuda::dispatch_backward(dxs, slot_row, dx);
#endif
  return cpu::dispatch_backward(dxs, slot_row, dx);
}

inline void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y) {
#ifdef MOETRAIN_WITH_CUDA
  if (y.device == Device::cuda) return cuda::combine_forward(ys, weight, slot_row, y);
#endif
  return cpu::combine_forward(ys, weight, slot_row, y);
}

inline void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                             const Tensor& dys, const Tensor& dweight) {
#ifdef MOETRAIN_WITH_CUDA
  if (dys.device == Device::cuda) return cuda::combine_backward(ys, weight, slot_row, dy, dys, dweight);
#endif
  return cpu::combine_backward(ys, weight, slot_row, dy, dys, dweight);
}

}  // namespace mt
