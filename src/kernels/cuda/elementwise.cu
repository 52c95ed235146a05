// Elementwise helpers on the GPU (f32 over f32-or-bf16 storage), column slices and a
// multi-tensor sum of squares in double.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/elementwise.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;

// Enough blocks to fill the GPU several times over; the loops stride over the rest.
unsigned grid_for(int64_t n) { return std::min<unsigned>(blocks_for(n, kThreads), 32u * sm_count()); }

__global__ void cast_kernel(In src, Out dst, int64_t n) {
  MT_GRID_STRIDE(i, n) dst.set(i, src[i]);
}

__global__ void add_kernel(In a, In b, Out o, int64_t n) {
  MT_GRID_STRIDE(i, n) o.set(i, a[i] + b[i]);
}

__global__ void scale_kernel(Out x, float s, int64_t n) {
  MT_GRID_STRIDE(i, n) x.set(i, x.get(i) * s);
}

__global__ void fill_kernel(Out x, float v, int64_t n) {
  MT_GRID_STRIDE(i, n) x.set(i, v);
}

// A warp per dst row (grid-stride), its lanes over the row's columns: coalesced, and one
// division a row rather than one an element.
struct ColumnArgs {
  Out dst;
  In src;
  cpu::ColumnCopy c;
  int64_t dst_col, src_col, width;
  bool accumulate;
};

__global__ void copy_columns_kernel(ColumnArgs p) {
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; r < p.c.rows; r += warps) {
    const int64_t s0 = r / p.c.bcast * p.c.sum;
    for (int64_t j = threadIdx.x % 32; j < p.width; j += 32) {
      float v = p.src[s0 * p.c.src_cols + p.src_col + j];
      for (int64_t i = 1; i < p.c.sum; ++i) v += p.src[(s0 + i) * p.c.src_cols + p.src_col + j];
      const int64_t d = r * p.c.dst_cols + p.dst_col + j;
      p.dst.set(d, p.accumulate ? p.dst.get(d) + v : v);
    }
  }
}

// Multi-tensor sum of squares: the tensor list travels in the kernel's parameters, a block
// per chunk of one tensor (one launch per kTableSize tensors); each chunk's partial lands in
// its own slot and one block adds the slots in order: no atomics, the same bits every run.
constexpr int kTableSize = 256;
constexpr int64_t kChunk = 16384;

struct SumSqTable {
  const float* p[kTableSize];
  int64_t n[kTableSize];
  int64_t first_chunk[kTableSize + 1];  // chunk index of each tensor's first chunk in this launch
  int count;
};

__global__ void sum_squares_kernel(SumSqTable t, double* partials) {
  __shared__ double warp_sums[32];
  const int64_t b = blockIdx.x;
  const int lo = tensor_of_chunk(t.first_chunk, t.count, b);
  const int64_t begin = (b - t.first_chunk[lo]) * kChunk;
  const int64_t end = min(t.n[lo], begin + kChunk);
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    double v = t.p[lo][i];
    s += v * v;
  }
  s = block_sum(s, warp_sums);
  if (threadIdx.x == 0) partials[b] = s;
}

__global__ void sum_partials_kernel(const double* partials, int64_t n, double* result) {
  __shared__ double warp_sums[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_sum(s, warp_sums);
  if (threadIdx.x == 0) *result = s;
}

void check_float(const Tensor& t, const char* name) { check_arg(t, name, {DType::f32, DType::bf16}, t.shape); }

}  // namespace

void cast(const Tensor& src, const Tensor& dst) {
  check_float(src, "cast src");
  check_float(dst, "cast dst");
  MT_CHECK(src.numel() == dst.numel()) << "cast from " << src.str() << " to " << dst.str()
                                       << " changes the element count";
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype == dst.dtype) {
    if (src.data != dst.data)
      CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  cast_kernel<<<grid_for(n), kThreads, 0, stream()>>>(as_in(src), as_out(dst), n);
  CUDA_CHECK_LAUNCH();
}

void add(const Tensor& a, const Tensor& b, const Tensor& o) {
  check_float(o, "add out");
  check_arg(a, "add a", {o.dtype}, o.shape);
  check_arg(b, "add b", {o.dtype}, o.shape);
  const int64_t n = o.numel();
  if (n == 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream()>>>(as_in(a), as_in(b), as_out(o), n);
  CUDA_CHECK_LAUNCH();
}

void scale(const Tensor& x, float s) {
  check_float(x, "scale x");
  const int64_t n = x.numel();
  if (n == 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, stream()>>>(as_out(x), s, n);
  CUDA_CHECK_LAUNCH();
}

void fill(const Tensor& x, float value) {
  check_float(x, "fill x");
  const int64_t n = x.numel();
  if (n == 0) return;
  fill_kernel<<<grid_for(n), kThreads, 0, stream()>>>(as_out(x), value, n);
  CUDA_CHECK_LAUNCH();
}

void copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                  bool accumulate) {
  check_float(dst, "copy_columns dst");
  check_float(src, "copy_columns src");
  const cpu::ColumnCopy c = cpu::column_copy_shape(dst, dst_col, src, src_col, width);
  if (c.rows == 0 || width == 0) return;
  const unsigned blocks = std::min<unsigned>(blocks_for(c.rows, kThreads / 32), 32u * sm_count());
  copy_columns_kernel<<<blocks, kThreads, 0, stream()>>>(
      ColumnArgs{as_out(dst), as_in(src), c, dst_col, src_col, width, accumulate});
  CUDA_CHECK_LAUNCH();
}

double sum_squares(const std::vector<Tensor>& xs) {
  int64_t total_chunks = 0;
  for (const Tensor& x : xs) {
    check_arg(x, "sum_squares input", {DType::f32}, x.shape);
    total_chunks += (x.numel() + kChunk - 1) / kChunk;
  }
  if (total_chunks == 0) return 0.0;
  double* partials = static_cast<double*>(scratch(sizeof(double) * (total_chunks + 1)));
  double* result = partials + total_chunks;
  int64_t done = 0;  // chunks launched so far = where this launch's partials start
  for (size_t first = 0; first < xs.size(); first += kTableSize) {
    SumSqTable t{};
    t.count = static_cast<int>(std::min<size_t>(kTableSize, xs.size() - first));
    int64_t chunks = 0;
    for (int j = 0; j < t.count; ++j) {
      const Tensor& x = xs[first + j];
      t.p[j] = x.f32();
      t.n[j] = x.numel();
      t.first_chunk[j] = chunks;
      chunks += (x.numel() + kChunk - 1) / kChunk;
    }
    t.first_chunk[t.count] = chunks;
    if (chunks == 0) continue;
    sum_squares_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(t, partials + done);
    CUDA_CHECK_LAUNCH();
    done += chunks;
  }
  sum_partials_kernel<<<1, 1024, 0, stream()>>>(partials, total_chunks, result);
  CUDA_CHECK_LAUNCH();
  double host = 0;
  CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof(double), cudaMemcpyDeviceToHost, stream()));
  synchronize();
  return host;
}

}  // namespace mt::cuda
