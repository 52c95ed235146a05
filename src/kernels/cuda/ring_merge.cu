// Ring attention's merge and accumulations on the GPU (contract in kernels/ring_merge.h).
// The merge gives a warp to each (head, query row) of the block: the running lse and the
// block's decide two weights, the lanes rescale the row's Dh values. All f32, elementwise per
// row, so results repeat bit for bit.

#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/ring_merge.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Merge {
  In o;            // block output [C,H,Dh]
  const float* l;  // block lse [H,C]
  float* acc;      // running output [B,2C,H,Dh]
  float* lse;      // running lse [B,H,2C]
  int64_t b;
  int slot, c, h, d;
};

__global__ void ring_merge_kernel(Merge m) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // h * C + i
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(m.h) * m.c) return;
  const int64_t hh = row / m.c, i = row % m.c;
  const float l_new = m.l[row];
  if (l_new == -INFINITY) return;  // this block's keys are all masked for the row
  float* running = m.lse + (m.b * m.h + hh) * 2 * m.c + m.slot * m.c + i;
  float* out = m.acc + ((m.b * 2 * m.c + m.slot * m.c + i) * m.h + hh) * m.d;
  const int64_t x0 = (i * m.h + hh) * m.d;
  const float l_old = *running;
  // A row's first block is copied; later ones are weighted by exp(lse - lse_union).
  float w_old = 0.0f, w_new = 1.0f, l_out = l_new;
  if (l_old != -INFINITY) {
    const float mx = fmaxf(l_old, l_new), a = expf(l_old - mx), c = expf(l_new - mx), z = a + c;
    w_old = a / z;
    w_new = c / z;
    l_out = mx + logf(z);
  }
  for (int e = lane; e < m.d; e += 32) out[e] = l_old == -INFINITY ? m.o[x0 + e] : w_old * out[e] + w_new * m.o[x0 + e];
  __syncwarp();  // every lane has read l_old before lane 0 replaces it
  if (lane == 0) *running = l_out;
}

__global__ void accumulate_kernel(In x, float* acc, int64_t n) {
  MT_GRID_STRIDE(i, n) acc[i] += x[i];
}

// Grid-stride launches stop at a grid the GPU can hold at once.
unsigned grid_for(int64_t n) { return std::min<unsigned>(blocks_for(n, kThreads), 8u * sm_count()); }

}  // namespace

void ring_merge(const Tensor& o, const Tensor& l, int64_t b, int slot, const Tensor& acc, const Tensor& lse) {
  // The block's rows: b in [0, B) and slot 0 or 1 of acc [B,2C,H,Dh].
  MT_CHECK(acc.ndim() == 4 && acc.dim(1) % 2 == 0 && b >= 0 && b < acc.dim(0) && (slot == 0 || slot == 1))
      << "ring_merge: block (batch row " << b << ", slot " << slot << ") of " << acc.str()
      << " is not one of a [B,2C,H,Dh] tensor's";
  const int64_t c = acc.dim(1) / 2, h = acc.dim(2), d = acc.dim(3);
  check_arg(acc, "ring merge acc", {DType::f32}, acc.shape);
  check_arg(lse, "ring merge lse", {DType::f32}, {acc.dim(0), h, 2 * c});
  check_arg(o, "ring merge block out", {DType::bf16, DType::f32}, {1, c, h, d});
  check_arg(l, "ring merge block lse", {DType::f32}, {1, h, c});
  const int64_t rows = h * c;
  if (rows == 0 || d == 0) return;
  Merge m{as_in(o), l.f32(), acc.f32(), lse.f32(), b, slot, static_cast<int>(c), static_cast<int>(h),
          static_cast<int>(d)};
  ring_merge_kernel<<<blocks_for(rows, kWarps), kThreads, 0, stream()>>>(m);
  CUDA_CHECK_LAUNCH();
}

void accumulate(const Tensor& x, const Tensor& acc) {
  check_arg(x, "accumulate x", {DType::f32, DType::bf16}, x.shape);
  check_arg(acc, "accumulate acc", {DType::f32}, acc.shape);
  MT_CHECK(x.numel() == acc.numel()) << "accumulate " << x.str() << " into " << acc.str()
                                     << ": the element counts differ";
  const int64_t n = acc.numel();
  if (n == 0) return;
  accumulate_kernel<<<grid_for(n), kThreads, 0, stream()>>>(as_in(x), acc.f32(), n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
