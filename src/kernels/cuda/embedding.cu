// Token embedding on the GPU: a gather forward, a scatter-add backward.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/embedding.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;

// One block per token. An id outside [0, V) cannot be reported without a host sync,
// so its row becomes NaN: the loss shows it, and nothing is read out of bounds.
__global__ void embedding_forward_kernel(In table, const int32_t* ids, int64_t vocab, int64_t dim, Out y) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  const bool ok = id >= 0 && id < vocab;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
    y.set(t * dim + c, ok ? table[static_cast<int64_t>(id) * dim + c] : __int_as_float(0x7fffffff));
}

// f32 atomics: tokens that repeat add into one row in whatever order the blocks run, so
// such rows may differ in the last bits from run to run. A deterministic version needs the
// ids sorted first; the embedding gradient is one tensor of many and this keeps it one pass.
__global__ void embedding_backward_kernel(const int32_t* ids, In dy, int64_t vocab, int64_t dim, float* dtable) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  if (id < 0 || id >= vocab) return;
  float* row = dtable + static_cast<int64_t>(id) * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) atomicAdd(row + c, dy[t * dim + c]);
}

}  // namespace

void embedding_forward(const Tensor& table, const Tensor& ids, const Tensor& out) {
  MT_CHECK(table.ndim() == 2 && ids.ndim() == 1) << "embedding wants table [V,D] and ids [N], got table "
                                                  << table.str() << ", ids " << ids.str();
  const int64_t vocab = table.dim(0), dim = table.dim(1), n = ids.dim(0);
  check_arg(table, "embedding table", {DType::f32, DType::bf16}, {vocab, dim});
  check_arg(ids, "embedding ids", {DType::i32}, {n});
  check_arg(out, "embedding out", {DType::f32, DType::bf16}, {n, dim});
  if (n == 0 || dim == 0) return;
  embedding_forward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream()>>>(as_in(table), ids.i32(), vocab, dim,
                                                                                as_out(out));
  CUDA_CHECK_LAUNCH();
}

void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  MT_CHECK(dtable.ndim() == 2 && ids.ndim() == 1) << "embedding backward wants dtable [V,D] and ids [N], got dtable "
                                                   << dtable.str() << ", ids " << ids.str();
  const int64_t vocab = dtable.dim(0), dim = dtable.dim(1), n = ids.dim(0);
  check_arg(ids, "embedding ids", {DType::i32}, {n});
  check_arg(dout, "embedding dout", {DType::f32, DType::bf16}, {n, dim});
  check_arg(dtable, "embedding dtable", {DType::f32}, {vocab, dim});
  if (n == 0 || dim == 0) return;
  embedding_backward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream()>>>(ids.i32(), as_in(dout), vocab, dim,
                                                                                 dtable.f32());
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
