// Rotary embeddings on the GPU. The cos/sin tables are computed on the host by the CPU
// code (so both backends rotate by the same fp32 angles) and uploaded once per layout.
#include <algorithm>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/rope.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;

// One thread per rotated pair or passed-through element of a head: items 0..half-1
// rotate pair p, the rest copy the dims beyond rotary_dim. Both values of a pair are
// read before either is written, so y may alias x.
__global__ void rope_kernel(In x, const float* cos, const float* sin, int64_t rows, int64_t t, int64_t heads,
                            int64_t dh, int64_t half, bool interleaved, float sin_sign, Out y, bool aliased) {
  const int64_t items = dh - half;  // half pairs + (dh - 2 half) copies
  const int64_t total = rows * heads * items;
  MT_GRID_STRIDE(idx, total) {
    const int64_t head_row = idx / items, item = idx % items;
    const int64_t base = head_row * dh, pos = (head_row / heads) % t;
    if (item < half) {
      const int64_t i0 = interleaved ? 2 * item : item, i1 = interleaved ? i0 + 1 : item + half;
      const float a = x[base + i0], e = x[base + i1];
      const float c = cos[pos * half + item], s = sin_sign * sin[pos * half + item];
      y.set(base + i0, a * c - e * s);
      y.set(base + i1, e * c + a * s);
    } else if (!aliased) {
      const int64_t j = half + item;  // 2 * half + (item - half)
      y.set(base + j, x[base + j]);
    }
  }
}

void rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, float sin_sign, const Tensor& y,
            const char* what) {
  MT_CHECK(x.ndim() == 4) << "rope " << what << " should be [B,T,H,Dh], got " << x.str();
  const int64_t b = x.dim(0), t = x.dim(1), h = x.dim(2), dh = x.dim(3);
  MT_CHECK(cos.ndim() == 2) << "rope cos should be [T, rotary_dim/2], got " << cos.str();
  const int64_t half = cos.dim(1);
  check_arg(x, what, {DType::bf16, DType::f32}, {b, t, h, dh});
  check_arg(cos, "rope cos", {DType::f32}, {t, half});
  check_arg(sin, "rope sin", {DType::f32}, {t, half});
  check_arg(y, "rope output", {DType::bf16, DType::f32}, {b, t, h, dh});
  MT_CHECK(2 * half <= dh) << "rotary_dim " << 2 * half << " exceeds head_dim " << dh;
  const bool aliased = x.data == y.data;
  MT_CHECK(!aliased || x.dtype == y.dtype) << "rope in place needs one dtype, got " << x.str() << " -> " << y.str();
  const int64_t total = b * t * h * (dh - half);
  if (total == 0) return;
  const unsigned grid = std::min<unsigned>(blocks_for(total, kThreads), 32u * sm_count());
  rope_kernel<<<grid, kThreads, 0, stream()>>>(as_in(x), cos.f32(), sin.f32(), b * t, t, h, dh, half, interleaved,
                                               sin_sign, as_out(y), aliased);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_tables(const cpu::RopeFreqs& f, const Tensor& positions, const Tensor& cos, const Tensor& sin) {
  MT_CHECK(positions.ndim() == 1 && positions.dtype == DType::i32)
      << "rope positions should be i32[T], got " << positions.str();
  const int64_t t = positions.dim(0), half = static_cast<int64_t>(f.inv_freq.size());
  check_arg(cos, "rope cos", {DType::f32}, {t, half});
  check_arg(sin, "rope sin", {DType::f32}, {t, half});
  std::vector<int32_t> pos(static_cast<size_t>(t));
  std::vector<float> c(static_cast<size_t>(t * half)), s(c.size());
  Tensor pos_host(pos.data(), {t}, DType::i32), cos_host(c.data(), {t, half}, DType::f32),
      sin_host(s.data(), {t, half}, DType::f32);
  copy(pos_host, positions);
  cpu::rope_tables(f, pos_host, cos_host, sin_host);
  copy(cos, cos_host);
  copy(sin, sin_host);
}

void rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& y) {
  rotate(x, cos, sin, interleaved, 1.0f, y, "rope x");
}

void rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin, bool interleaved, const Tensor& dx) {
  rotate(dy, cos, sin, interleaved, -1.0f, dx, "rope dy");
}

}  // namespace mt::cuda
