// Muon on the GPU: the momentum and the update, elementwise and bit for bit the CPU's, and
// the Newton-Schulz orthogonalisation as cuBLASLt products in bf16 with f32 sums.

#include <algorithm>
#include <memory>
#include <utility>

#include "kernels/adamw.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/gemm.h"
#include "kernels/muon.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kTile = 32;

// Enough blocks to fill the GPU several times over; the loops stride over the rest.
unsigned grid_for(int64_t n) { return std::min<unsigned>(blocks_for(n, kThreads), 32u * sm_count()); }

struct MomentumArgs {
  const float* g;
  void* m;  // f32, or bf16 when bf16
  float* out;
  int64_t n;
  float mu, grad_scale;
  bool nesterov, bf16;
  uint64_t key, step;
};

// The CPU's expression operation for operation; the _rn intrinsics keep nvcc from fusing
// a multiply and an add into one rounding. out may be g: each element is read before it
// is written, by the same thread.
__global__ void momentum_kernel(MomentumArgs a) {
  MT_GRID_STRIDE(i, a.n) {
    const float gs = __fmul_rn(a.g[i], a.grad_scale);
    float mi = a.bf16 ? __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(a.m)[i]) << 16)
                      : static_cast<const float*>(a.m)[i];
    mi = __fadd_rn(__fmul_rn(a.mu, mi), gs);
    a.out[i] = a.nesterov ? __fadd_rn(gs, __fmul_rn(a.mu, mi)) : mi;
    if (a.bf16)
      static_cast<uint16_t*>(a.m)[i] =
          bf16_stochastic(__float_as_uint(mi), adamw_noise(a.key + static_cast<uint64_t>(i), a.step));
    else
      static_cast<float*>(a.m)[i] = mi;
  }
}

__global__ void apply_kernel(float* p, const float* o, float decay, float step, int64_t n) {
  MT_GRID_STRIDE(i, n) p[i] = __fsub_rn(__fmul_rn(p[i], decay), __fmul_rn(step, o[i]));
}

// The norm's partial sums of squares, in double: a fixed grid of at most kThreads blocks
// (set by n alone), so the sum repeats bit for bit and scaled_copy_kernel's blocks can
// each add the partials themselves.
__global__ void sum_squares_kernel(const float* x, int64_t n, double* partials) {
  __shared__ double warp_sums[kThreads / 32];
  double s = 0;
  MT_GRID_STRIDE(i, n) {
    const double v = x[i];
    s += v * v;
  }
  s = block_sum(s, warp_sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// dst = src * inv, src [rows, cols] and dst the same or, with transpose, [cols, rows],
// through a 32x32 tile in shared memory so reads and writes are both coalesced; a block
// a tile. inv = 1 / (|src|_F + eps) as the CPU computes it, from the `parts` partials
// (<= kThreads), or 1 without them.
__global__ void __launch_bounds__(kThreads) scaled_copy_kernel(In src, Out dst, int64_t rows, int64_t cols,
                                                                bool transpose, const double* partials, int parts) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ double warp_sums[kThreads / 32];
  float inv = 1.0f;
  if (partials != nullptr) {
    const double ss = block_sum(static_cast<int>(threadIdx.x) < parts ? partials[threadIdx.x] : 0.0, warp_sums);
    inv = 1.0f / (static_cast<float>(sqrt(ss)) + kMuonNormEps);
  }
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  const int64_t r0 = blockIdx.x / col_tiles * kTile, c0 = blockIdx.x % col_tiles * kTile;
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  for (int y = ty; y < kTile; y += kThreads / kTile) {
    const int64_t r = r0 + y, c = c0 + tx;
    if (r < rows && c < cols) tile[y][tx] = __fmul_rn(src[r * cols + c], inv);
  }
  __syncthreads();
  for (int y = ty; y < kTile; y += kThreads / kTile) {
    if (transpose) {  // dst row c0 + y, column r0 + tx
      const int64_t r = r0 + tx, c = c0 + y;
      if (r < rows && c < cols) dst.set(c * rows + r, tile[tx][y]);
    } else {
      const int64_t r = r0 + y, c = c0 + tx;
      if (r < rows && c < cols) dst.set(r * cols + c, tile[y][tx]);
    }
  }
}

void scaled_copy(In src, Out dst, int64_t rows, int64_t cols, bool transpose, const double* partials, int parts) {
  const int64_t tiles = (rows + kTile - 1) / kTile * ((cols + kTile - 1) / kTile);
  scaled_copy_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream()>>>(src, dst, rows, cols, transpose,
                                                                             partials, parts);
  CUDA_CHECK_LAUNCH();
}

// Bytes rounded up to cuBLASLt's preferred 256-byte operand alignment.
size_t aligned_bytes(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

void muon_momentum(const Tensor& grad, const Tensor& m, const Tensor& out, const cpu::MuonMomentum& s, uint64_t key) {
  const int64_t n = grad.numel();
  check_arg(grad, "muon_momentum grad", {DType::f32}, grad.shape);
  check_arg(m, "muon_momentum m", {DType::f32, DType::bf16}, m.shape);
  check_arg(out, "muon_momentum out", {DType::f32}, out.shape);
  MT_CHECK(m.numel() == n && out.numel() == n)
      << "muon_momentum wants momentum and output of the gradient's " << n << " elements (grad " << grad.str()
      << "), got m " << m.str() << " and out " << out.str();
  MT_CHECK(s.step >= 1) << "muon_momentum step is 1-based, got " << s.step;
  if (n == 0) return;
  const MomentumArgs a{.g = grad.f32(),
                       .m = m.data,
                       .out = out.f32(),
                       .n = n,
                       .mu = s.mu,
                       .grad_scale = s.grad_scale,
                       .nesterov = s.nesterov,
                       .bf16 = m.dtype == DType::bf16,
                       .key = key,
                       .step = static_cast<uint64_t>(s.step)};
  momentum_kernel<<<grid_for(n), kThreads, 0, stream()>>>(a);
  CUDA_CHECK_LAUNCH();
}

void muon_apply(const Tensor& param, const Tensor& o, float decay, float step) {
  const int64_t n = param.numel();
  check_arg(param, "muon_apply param", {DType::f32}, param.shape);
  check_arg(o, "muon_apply o", {DType::f32}, o.shape);
  MT_CHECK(o.numel() == n) << "muon_apply wants an update of the parameter's " << n << " elements (param "
                           << param.str() << "), got " << o.str();
  if (n == 0) return;
  apply_kernel<<<grid_for(n), kThreads, 0, stream()>>>(param.f32(), o.f32(), decay, step, n);
  CUDA_CHECK_LAUNCH();
}

void newton_schulz(const std::vector<Tensor>& xs, int steps) {
  if (xs.empty()) return;
  MT_CHECK(steps >= 0) << "newton_schulz: steps must be >= 0, got " << steps;
  const Tensor& first = xs.front();
  MT_CHECK(first.ndim() == 2) << "newton_schulz wants 2-D matrices, got " << first.str();
  for (const Tensor& x : xs) check_arg(x, "newton_schulz matrix (all of the first's shape)", {DType::f32}, first.shape);
  const int64_t r = first.dim(0), c = first.dim(1), n = r * c;
  if (n == 0) return;
  // The wide orientation: p rows <= q columns.
  const bool tall = r > c;
  const int64_t p = tall ? c : r, q = tall ? r : c;
  // One workspace for one matrix: the iterate X and the next one Y [p, q], A = X X^T and
  // B = b A + c A A [p, p] in bf16, and the norm's partial sums.
  const size_t x_bytes = aligned_bytes(static_cast<size_t>(p * q) * 2);
  const size_t a_bytes = aligned_bytes(static_cast<size_t>(p * p) * 2);
  const int parts = static_cast<int>(std::min<unsigned>(blocks_for(n, kThreads), kThreads));
  std::unique_ptr<void, void (*)(void*)> ws(stream_alloc(2 * x_bytes + 2 * a_bytes + sizeof(double) * kThreads),
                                            stream_free);
  char* base = static_cast<char*>(ws.get());
  Tensor X(base, {p, q}, DType::bf16, Device::cuda), Y(base + x_bytes, {p, q}, DType::bf16, Device::cuda);
  const Tensor A(base + 2 * x_bytes, {p, p}, DType::bf16, Device::cuda),
      B(base + 2 * x_bytes + a_bytes, {p, p}, DType::bf16, Device::cuda);
  auto* partials = reinterpret_cast<double*>(base + 2 * x_bytes + 2 * a_bytes);
  // One matrix at a time (batching them is a later optimisation). The norm stays on the
  // device: each copy block adds the partials itself, so no matrix waits on the host.
  for (const Tensor& x : xs) {
    sum_squares_kernel<<<static_cast<unsigned>(parts), kThreads, 0, stream()>>>(x.f32(), n, partials);
    CUDA_CHECK_LAUNCH();
    scaled_copy(as_in(x), as_out(X), r, c, tall, partials, parts);
    for (int it = 0; it < steps; ++it) {
      cuda::gemm(X, X, A, false, true);  // A = X X^T
      cuda::copy(B, A);
      cuda::gemm(A, A, B, false, false, kNewtonSchulzC, kNewtonSchulzB);  // B = c A A + b A
      cuda::copy(Y, X);
      cuda::gemm(B, X, Y, false, false, 1.0f, kNewtonSchulzA);  // Y = B X + a X
      std::swap(X, Y);
    }
    // Back to f32 in x's orientation (transposed again when x is tall).
    scaled_copy(as_in(X), as_out(x), p, q, tall, nullptr, 0);
  }
}

}  // namespace mt::cuda
