// Blockwise FP8 (e4m3) quantization, DeepSeek-V3's recipe (DESIGN.md decision 10):
// activations and output gradients in 1x128 tiles along the reduction dimension,
// weights in 128x128 blocks, one f32 scale per tile, x ~= f32(q) * scale.
//
// Per tile: amax = max |x| (NaN elements ignored); scale = amax / 448, rounded up to a
// power of two when pow2 (at least 2^-126, so its reciprocal is a normal float and
// amax / scale <= 448 still holds); an all-zero tile gets scale 1, so q = +-0 and
// dequantization is exact. q = e4m3(x / scale), round to nearest even, satfinite
// (e4m3_from_f32 on the CPU, __nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3) on
// the GPU). Both backends evaluate tile_scale() and scaled() below, so the codes and
// scales are the same bytes. A ragged last tile (K or M not a multiple of 128) has the
// amax of its own elements.
//
// Scale layouts are the ones cuBLASLt reads (cuBLAS docs, "Scaling factors layouts",
// as PyTorch's scaled_mm feeds them; cublasLt has no scale leading dimension):
// - CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, for a row-major [M, K] operand in 1x128
//   tiles along K: outer-dimension-major, the scale of (m, k/128) at (k/128) * M + m,
//   i.e. a row-major [ceil(K/128), M] array.
// - CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, for a row-major [N, K] operand: the
//   scale of block (n/128, k/128) at (n/128) * L4 + k/128 with L4 = ceil(K/128) rounded
//   up to a multiple of 4 (16-byte rows), i.e. a row-major [ceil(N/128), L4] array;
//   the padding entries are written as 0.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/tensor.h"

#ifdef __CUDACC__
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif

namespace mt::fp8 {

constexpr int64_t kTile = 128;
constexpr float kE4m3Max = 448.0f;

MT_HOST_DEVICE inline int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }
// The padded row length of a 128x128 block-scale array (see above).
MT_HOST_DEVICE inline int64_t block_scale_cols(int64_t k) { return (tiles(k) + 3) / 4 * 4; }

// The scale of a tile from its amax (>= 0). IEEE division, no fast-math: both backends
// round amax / 448 the same way; frexpf/ldexpf are exact.
MT_HOST_DEVICE inline float tile_scale(float amax, bool pow2) {
  if (!(amax > 0.0f)) return 1.0f;
  float s = amax / kE4m3Max;
  if (!pow2 || !(s <= 3.4028235e38f)) return s;  // an infinite amax stays infinite
  s = fmaxf(s, 1.17549435e-38f);
  int e;
  const float m = frexpf(s, &e);  // s = m 2^e, m in [0.5, 1)
  return m == 0.5f ? s : ldexpf(1.0f, e);
}

// x / scale as both backends compute it: with a power-of-two scale the product with its
// exact reciprocal (which equals the quotient); otherwise the correctly rounded quotient.
MT_HOST_DEVICE inline float scaled(float x, float scale, bool pow2) { return pow2 ? x * (1.0f / scale) : x / scale; }

}  // namespace mt::fp8

namespace mt::cpu {

// x f32 or bf16 [M, K] -> q f8e4m3 [M, K], scale f32 [ceil(K/128), M] (1x128 tiles).
void quantize_rows(const Tensor& x, const Tensor& q, const Tensor& scale, bool pow2);
// w f32 or bf16 [N, K] -> q f8e4m3 [N, K], scale f32 [ceil(N/128), block_scale_cols(K)].
// A 3-D w [E, N, K] (a layer's experts) is E such matrices: q [E, N, K], scale
// [E, ceil(N/128), block_scale_cols(K)]. With qt and scale_t (both or neither) also w's
// transpose, the input gradient's operand, in the same pass: qt [(E,) K, N] in blocks
// of its own, scale_t [(E,) ceil(K/128), block_scale_cols(N)] (the same values: a block's
// transpose has the same amax).
void quantize_blocks(const Tensor& w, const Tensor& q, const Tensor& scale, bool pow2, const Tensor& qt = {},
                     const Tensor& scale_t = {});
// x f32 [M, K] = f32(q) * scale, the inverses of the two above (one rounding each).
void dequantize_rows(const Tensor& q, const Tensor& scale, const Tensor& x);
void dequantize_blocks(const Tensor& q, const Tensor& scale, const Tensor& x);

// The FP8 product: c [M, N] = alpha a b^T + beta c, a f8e4m3 [M, K] with 1x128 scales
// (quantize_rows), b f8e4m3 [N, K] with 128x128 scales (quantize_blocks: a weight) when
// b_blocks, else with 1x128 scales (two token-major operands; a weight gradient's, unused
// since those run in bf16, models/linear.h). The CPU computes it in f32 from the dequantized
// values (c f32), which is what the GPU's products compute up to the order of the sums.
void gemm_fp8(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, bool b_blocks,
              const Tensor& c, float alpha = 1.0f, float beta = 0.0f);

// The grouped FP8 product (kernels/grouped_gemm.h's, for the experts' forward and input
// gradient; their weight gradients run in bf16, models/linear.h says why): for each
// expert e, y[seg] = x[seg] w[e]^T, x f8e4m3 [R, K] with 1x128 scales
// [ceil(K/128), R] (quantize_rows of all R rows), w f8e4m3 [E, O, K] with block scales
// [E, ceil(O/128), block_scale_cols(K)] (quantize_blocks of 3-D; for the input gradient
// the transposed copy qt), offsets i32 [E+1], y [R, O] overwritten (CPU f32). With a
// bias f32 [E, O] (GPT-OSS's layers), y[seg] += bias[e], in f32 before y is written.
void grouped_gemm_fp8(const Tensor& x, const Tensor& x_scale, const Tensor& w, const Tensor& w_scale,
                      const Tensor& offsets, const Tensor& y, const Tensor& bias = {});

}  // namespace mt::cpu

namespace mt::cuda {

// The same arguments. One kernel: a block of 256 threads owns a 128x128 tile of x and
// writes its row codes and scales, and with qt its transposed codes and column scales
// (staged through shared memory), or for weights the one block scale (and with qt the
// block's transposed codes; a 3-D w is one launch over every expert's blocks).
void quantize_rows(const Tensor& x, const Tensor& q, const Tensor& scale, bool pow2);
void quantize_blocks(const Tensor& w, const Tensor& q, const Tensor& scale, bool pow2, const Tensor& qt = {},
                     const Tensor& scale_t = {});
// cuBLASLt's block-scaled FP8 product (VEC128_32F for a, BLK128x128_32F or VEC128_32F
// for b; kernels/cuda/gemm.cu), c bf16 or f32, accumulation in f32.
void gemm_fp8(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, bool b_blocks,
              const Tensor& c, float alpha = 1.0f, float beta = 0.0f);
// CUTLASS 4.2's Hopper grouped GEMM with blockwise scaling (kernels/cuda/grouped_gemm_fp8.cu:
// cooperative 128x128x128 tiles in 2x1 clusters), planned on the device: offsets stay
// there (no host sync), clamped rather than checked. TMA moves 16-byte rows, which sets
// what is taken; anything else is refused (MT_CHECK, naming the shapes):
// - grouped_gemm_fp8: y bf16; K and O positive multiples of 16, not necessarily of 128
//   (a ragged last tile is read as zeros and stored masked); x, w, y 16-byte aligned. The
//   bias is added in the epilogue, to the f32 accumulators before y's one rounding.
void grouped_gemm_fp8(const Tensor& x, const Tensor& x_scale, const Tensor& w, const Tensor& w_scale,
                      const Tensor& offsets, const Tensor& y, const Tensor& bias = {});

}  // namespace mt::cuda

namespace mt {

inline void quantize_rows(const Tensor& x, const Tensor& q, const Tensor& scale, bool pow2) {
  return MT_BACKEND(q.device == Device::cuda, quantize_rows(x, q, scale, pow2));
}

inline void quantize_blocks(const Tensor& w, const Tensor& q, const Tensor& scale, bool pow2, const Tensor& qt = {},
                            const Tensor& scale_t = {}) {
  return MT_BACKEND(q.device == Device::cuda, quantize_blocks(w, q, scale, pow2, qt, scale_t));
}

inline void gemm_fp8(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, bool b_blocks,
                     const Tensor& c, float alpha = 1.0f, float beta = 0.0f) {
  return MT_BACKEND(c.device == Device::cuda, gemm_fp8(a, a_scale, b, b_scale, b_blocks, c, alpha, beta));
}

inline void grouped_gemm_fp8(const Tensor& x, const Tensor& x_scale, const Tensor& w, const Tensor& w_scale,
                             const Tensor& offsets, const Tensor& y, const Tensor& bias = {}) {
  return MT_BACKEND(y.device == Device::cuda, grouped_gemm_fp8(x, x_scale, w, w_scale, offsets, y, bias));
}

}  // namespace mt
