// Grouped matrix products over expert row segments, one launch per product, the offsets
// read on the device (cuBLAS's grouped GEMM takes the group sizes in host arrays and
// cuBLASLt 13.0 has no grouped mode: a host sync per MoE layer). What the models run goes
// to CUTLASS's Hopper grouped GEMM (grouped_gemm_sm90.cu says what it takes); the rest
// (f32 outputs, odd shapes and alignments) to the one tensor-core kernel here:
// WMMA bf16 16x16x16, f32 accumulators, block tile 128x128x32, 8 warps of 64x32, operands
// staged through registers into shared memory one k-step ahead.
//   forward       y[seg]  = x[seg] @ w[e]^T      rows of the segment tile M
//   B (input)     dx[seg] = dy[seg] @ w[e]       rows of the segment tile M
//   W (weight)    dw[e]  (+)= dy[seg]^T @ x[seg]  the segment's rows are the reduction
#include <mma.h>

#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/grouped_gemm.h"

namespace mt::cuda {

namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int BM = 128, BN = 128, BK = 32, kPad = 8, kThreads = 256;
constexpr int WM = 64, WN = 32;  // warp tile: 2 x 4 warps cover BM x BN

// Element (m, k) of A and (k, n) of B live at base[row * ld + col]; "k-major" means k
// is the contiguous (col) index. The smem copy keeps the global layout, and the WMMA
// fragment layout is chosen to match, so tiles are copied without transposing.
struct Operand {
  const bf16* base;
  int64_t ld;
  int64_t rows, cols;  // valid extent of the stored (row, col) index; beyond reads 0
  bool vec;            // ld % 8 == 0 and base 16-byte aligned: 16-byte loads
};

// A stored tile of R x C (C contiguous) in smem with row stride C + kPad: the padding
// spreads the rows of a fragment load over the banks.
template <int R, int C>
struct Tile {
  static constexpr int kChunks = R * C / 8 / kThreads;  // 8-element chunks per thread
  uint4 regs[kChunks];

  __device__ void fetch(const Operand& op, int64_t r0, int64_t c0) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int chunk = threadIdx.x + i * kThreads;
      const int r = chunk / (C / 8), c = (chunk % (C / 8)) * 8;
      const int64_t gr = r0 + r, gc = c0 + c;
      if (op.vec && gr < op.rows && gc + 8 <= op.cols) {
        regs[i] = *reinterpret_cast<const uint4*>(op.base + gr * op.ld + gc);
      } else {
        alignas(16) bf16 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          v[j] = (gr < op.rows && gc + j < op.cols) ? op.base[gr * op.ld + gc + j] : __float2bfloat16_rn(0.0f);
        regs[i] = *reinterpret_cast<const uint4*>(v);
      }
    }
  }

  __device__ void store(bf16* smem) const {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int chunk = threadIdx.x + i * kThreads;
      const int r = chunk / (C / 8), c = (chunk % (C / 8)) * 8;
      *reinterpret_cast<uint4*>(smem + r * (C + kPad) + c) = regs[i];
    }
  }
};

struct Epilogue {
  void* c;             // C(m, n) at c[m * ldc + n], f32 or bf16
  bool c_bf16;
  int64_t ldc, rows, cols;
  const float* bias;   // bias[n] added, or null
  bool accumulate;     // C += result (never reads C otherwise: it may hold NaN)
};

// A k-major: A [BM][BK] tiles of rows m; m-major: A [BK][BM] tiles of rows k.
// B k-major: B [BN][BK] tiles of rows n; n-major: B [BK][BN] tiles of rows k.
template <bool kAKMajor, bool kBKMajor>
struct Gemm {
  using LayoutA = std::conditional_t<kAKMajor, wmma::row_major, wmma::col_major>;
  using LayoutB = std::conditional_t<kBKMajor, wmma::col_major, wmma::row_major>;
  using TileA = std::conditional_t<kAKMajor, Tile<BM, BK>, Tile<BK, BM>>;
  using TileB = std::conditional_t<kBKMajor, Tile<BN, BK>, Tile<BK, BN>>;
  static constexpr int kLdA = kAKMajor ? BK + kPad : BM + kPad;
  static constexpr int kLdB = kBKMajor ? BK + kPad : BN + kPad;
  static constexpr int kSmemA = kAKMajor ? BM * (BK + kPad) : BK * (BM + kPad);
  static constexpr int kSmemB = kBKMajor ? BN * (BK + kPad) : BK * (BN + kPad);
  static constexpr int kSmemBytes = (kSmemA + kSmemB) * 2;

  // Fetches the k-step starting at k0 of the tile at (m0, n0), at (row, col) of the stored operands.
  static __device__ void fetch(TileA& ta, TileB& tb, const Operand& a, const Operand& b, int64_t m0, int64_t n0,
                               int64_t k0) {
    ta.fetch(a, kAKMajor ? m0 : k0, kAKMajor ? k0 : m0);
    tb.fetch(b, kBKMajor ? n0 : k0, kBKMajor ? k0 : n0);
  }

  // C tile at (m0, n0) over the reduction [0, k_len): the whole of one block's work.
  static __device__ void run(const Operand& a, const Operand& b, int64_t m0, int64_t n0, int64_t k_len,
                             const Epilogue& e, unsigned char* smem) {
    bf16* sa = reinterpret_cast<bf16*>(smem);
    bf16* sb = sa + kSmemA;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / (BN / WN), wn = warp % (BN / WN);

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[WM / 16][WN / 16];
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
      for (int j = 0; j < WN / 16; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    TileA ta;
    TileB tb;
    if (k_len > 0) fetch(ta, tb, a, b, m0, n0, 0);
    for (int64_t k0 = 0; k0 < k_len; k0 += BK) {
      ta.store(sa);
      tb.store(sb);
      __syncthreads();
      // The next k-step's global loads are in flight while this one multiplies.
      if (k0 + BK < k_len) fetch(ta, tb, a, b, m0, n0, k0 + BK);
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LayoutA> fa[WM / 16];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LayoutB> fb[WN / 16];
#pragma unroll
        for (int i = 0; i < WM / 16; ++i) {
          const int m = wm * WM + i * 16;
          wmma::load_matrix_sync(fa[i], kAKMajor ? sa + m * kLdA + kk : sa + kk * kLdA + m, kLdA);
        }
#pragma unroll
        for (int j = 0; j < WN / 16; ++j) {
          const int n = wn * WN + j * 16;
          wmma::load_matrix_sync(fb[j], kBKMajor ? sb + n * kLdB + kk : sb + kk * kLdB + n, kLdB);
        }
#pragma unroll
        for (int i = 0; i < WM / 16; ++i)
#pragma unroll
          for (int j = 0; j < WN / 16; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
      __syncthreads();  // everyone is done reading the tiles before they are overwritten
    }

    // Each warp stages one 16x16 accumulator at a time in its own 1 KiB of the (now
    // free) operand memory and writes it out with bounds, bias and accumulation.
    float* stage = reinterpret_cast<float*>(smem) + warp * 256;
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
      for (int j = 0; j < WN / 16; ++j) {
        wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
        __syncwarp();
        const int64_t row0 = m0 + wm * WM + i * 16, col0 = n0 + wn * WN + j * 16;
        const Out o{e.c, e.c_bf16};
        // All of a lane's loads of C (when accumulating) are issued before its stores,
        // so they are in flight together instead of one round trip per element.
        float add[8];
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const int idx = lane + 32 * t;
          const int64_t row = row0 + idx / 16, col = col0 + idx % 16;
          const bool inside = row < e.rows && col < e.cols;
          add[t] = inside && e.bias != nullptr ? e.bias[col] : 0.0f;
          if (inside && e.accumulate) add[t] += o.get(row * e.ldc + col);
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const int idx = lane + 32 * t;
          const int64_t row = row0 + idx / 16, col = col0 + idx % 16;
          if (row < e.rows && col < e.cols) o.set(row * e.ldc + col, stage[idx] + add[t]);
        }
        __syncwarp();
      }
  }
};

struct Segments {
  const int32_t* offsets;  // [experts + 1] on the device
  int experts;
  int64_t total_rows;
};

// Which (expert, tile row) block `tile` of a row-segmented product is: warp 0 scans the
// per-expert tile counts 32 experts at a time. Returns false past the last tile (the
// grid is sized for the worst case, ceil(N / BM) + E tiles).
__device__ bool find_row_tile(const Segments& s, int64_t tile, int& expert, int64_t& row0, int64_t& row_end) {
  __shared__ int64_t found[3];
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int64_t before = 0;  // tiles of the experts already scanned
    if (lane == 0) found[0] = -1;
    __syncwarp();  // the reset lands before any lane can record a match
    for (int e0 = 0; e0 < s.experts; e0 += 32) {
      const int e = e0 + lane;
      const auto [begin, end] = e < s.experts ? segment_rows(s.offsets, e, s.total_rows) : RowRange{0, 0};
      const int64_t tiles = (end - begin + BM - 1) / BM;
      int64_t incl = tiles;  // inclusive prefix sum over the lanes
      for (int o = 1; o < 32; o <<= 1) {
        int64_t v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int64_t first = before + incl - tiles;
      if (tiles > 0 && tile >= first && tile < first + tiles) {
        found[0] = e;
        found[1] = begin + (tile - first) * BM;
        found[2] = end;
      }
      before += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  expert = static_cast<int>(found[0]);
  row0 = found[1];
  row_end = found[2];
  return expert >= 0;
}

struct RowArgs {
  Segments seg;
  const bf16* a;       // [N, K] rows of all segments (x or dy)
  const bf16* w;       // [E, ...] expert weights
  int64_t k;           // reduction length (K of x, or O of dy)
  int64_t w_rows, w_cols;  // stored shape of one expert's weight
  const float* bias;   // [E, n_out] or null
  void* c;             // [N, n_out]
  bool c_bf16;
  int64_t n_out;
};

// forward (B = w[e]^T, k-major) and backward-input (B = w[e], n-major).
template <bool kBKMajor>
__global__ void __launch_bounds__(kThreads) row_segment_kernel(RowArgs p) {
  __shared__ __align__(128) unsigned char smem[Gemm<true, kBKMajor>::kSmemBytes];
  int expert;
  int64_t row0, row_end;
  if (!find_row_tile(p.seg, blockIdx.x, expert, row0, row_end)) return;
  const int64_t rows = row_end - row0;
  Operand a{p.a + row0 * p.k, p.k, rows, p.k, p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.a) % 16 == 0};
  const bf16* we = p.w + expert * p.w_rows * p.w_cols;
  Operand b{we, p.w_cols, p.w_rows, p.w_cols, p.w_cols % 8 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0};
  Epilogue e{static_cast<char*>(p.c) + row0 * p.n_out * (p.c_bf16 ? 2 : 4), p.c_bf16, p.n_out, rows, p.n_out,
             p.bias != nullptr ? p.bias + expert * p.n_out : nullptr, false};
  Gemm<true, kBKMajor>::run(a, b, 0, int64_t{blockIdx.y} * BN, p.k, e, smem);
}

struct WeightArgs {
  Segments seg;
  const bf16* dy;  // [N, O]
  const bf16* x;   // [N, K]
  float* dw;       // [E, O, K]
  int64_t o, k;
  bool accumulate;
};

// dw[e] tile (blockIdx.x over O, blockIdx.y over K, blockIdx.z = e), reducing over the
// segment's rows. An empty segment still writes its tile: zeros, or dw unchanged.
__global__ void __launch_bounds__(kThreads) weight_kernel(WeightArgs p) {
  __shared__ __align__(128) unsigned char smem[Gemm<false, false>::kSmemBytes];
  const int expert = blockIdx.z;
  const auto [begin, end] = segment_rows(p.seg.offsets, expert, p.seg.total_rows);
  const int64_t rows = end - begin;
  // A(m=o, k=row) = dy[row][o] and B(k=row, n) = x[row][n].
  Operand a{p.dy + begin * p.o, p.o, rows, p.o, p.o % 8 == 0 && reinterpret_cast<uintptr_t>(p.dy) % 16 == 0};
  Operand b{p.x + begin * p.k, p.k, rows, p.k, p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0};
  Epilogue e{p.dw + expert * p.o * p.k, false, p.k, p.o, p.k, nullptr, p.accumulate};
  Gemm<false, false>::run(a, b, int64_t{blockIdx.x} * BM, int64_t{blockIdx.y} * BN, rows, e, smem);
}

// dbias[e][j] (+)= sum of dy[seg][j] in two passes whose order depends on the offsets
// alone (no atomics, so runs repeat bit for bit): the column sums of each BM-row tile of a
// segment (find_row_tile's tiles, rows in order), then per expert its tiles' sums.
__global__ void bias_grad_partial_kernel(Segments seg, const bf16* dy, int64_t o, float* partial) {
  int expert;
  int64_t row0, row_end;
  if (!find_row_tile(seg, blockIdx.x, expert, row0, row_end)) return;
  const int64_t j = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (j >= o) return;
  const int64_t rows = min(row_end - row0, int64_t{BM});
  const bf16* col = dy + row0 * o + j;
  float s = 0.0f;
#pragma unroll 8
  for (int64_t r = 0; r < rows; ++r) s += __bfloat162float(col[r * o]);
  partial[blockIdx.x * o + j] = s;
}

__device__ int64_t tiles_of(const Segments& s, int e) {
  const auto [begin, end] = segment_rows(s.offsets, e, s.total_rows);
  return (end - begin + BM - 1) / BM;
}

// 32 columns of one expert a block: warp w adds the expert's tiles w, w + 8, ... in order,
// then the 8 warps' sums are added in warp order. An expert without rows gets 0 (or keeps
// its value when accumulating).
__global__ void bias_grad_sum_kernel(Segments seg, const float* partial, int64_t o, float* dbias, bool accumulate) {
  __shared__ float sums[8][32];
  __shared__ int64_t first;  // the expert's first tile: the tiles of the experts before it
  const int expert = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) {
    int64_t before = 0;
    for (int e = lane; e < expert; e += 32) before += tiles_of(seg, e);
    before = warp_sum(before);
    if (lane == 0) first = before;
  }
  __syncthreads();
  const int64_t tiles = tiles_of(seg, expert), j = blockIdx.x * int64_t{32} + lane;
  float s = 0.0f;
  if (j < o)
    for (int64_t t = warp; t < tiles; t += 8) s += partial[(first + t) * o + j];
  sums[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || j >= o) return;
  for (int w = 1; w < 8; ++w) s += sums[w][lane];
  float* out = dbias + expert * o + j;
  *out = accumulate ? *out + s : s;
}

Segments segments_of(const Tensor& offsets, int64_t experts, int64_t rows) {
  check_arg(offsets, "grouped_gemm offsets", {DType::i32}, {experts + 1});
  return Segments{offsets.i32(), static_cast<int>(experts), rows};
}

unsigned row_tiles(int64_t rows, int64_t experts) { return static_cast<unsigned>((rows + BM - 1) / BM + experts); }

}  // namespace

void grouped_gemm(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y) {
  MT_CHECK(x.ndim() == 2 && w.ndim() == 3 && y.ndim() == 2)
      << "grouped_gemm wants x [N,K], w [E,O,K], y [N,O], got x " << x.str() << ", w " << w.str() << ", y "
      << y.str();
  const int64_t n = x.dim(0), k = x.dim(1), experts = w.dim(0), o = w.dim(1);
  check_arg(x, "grouped_gemm x", {DType::bf16}, {n, k});
  check_arg(w, "grouped_gemm w", {DType::bf16}, {experts, o, k});
  check_arg(y, "grouped_gemm y", {DType::bf16, DType::f32}, {n, o});
  if (bias.data != nullptr) check_arg(bias, "grouped_gemm bias", {DType::f32}, {experts, o});
  check_arg(offsets, "grouped_gemm offsets", {DType::i32}, {experts + 1});
  if (n == 0 || o == 0 || experts == 0) return;
  if (grouped_gemm_sm90(x, w, bias, offsets, y)) return;
  grouped_gemm_wmma(x, w, bias, offsets, y);
}

void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx) {
  MT_CHECK(dy.ndim() == 2 && w.ndim() == 3 && dx.ndim() == 2)
      << "grouped_gemm backward wants dy [N,O], w [E,O,K], dx [N,K], got dy " << dy.str() << ", w " << w.str()
      << ", dx " << dx.str();
  const int64_t n = dy.dim(0), experts = w.dim(0), o = w.dim(1), k = w.dim(2);
  check_arg(dy, "grouped_gemm dy", {DType::bf16}, {n, o});
  check_arg(w, "grouped_gemm w", {DType::bf16}, {experts, o, k});
  check_arg(dx, "grouped_gemm dx", {DType::bf16, DType::f32}, {n, k});
  check_arg(offsets, "grouped_gemm offsets", {DType::i32}, {experts + 1});
  if (n == 0 || k == 0 || experts == 0) return;
  if (grouped_gemm_backward_input_sm90(dy, w, offsets, dx)) return;
  grouped_gemm_backward_input_wmma(dy, w, offsets, dx);
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                  const Tensor& dbias, bool accumulate) {
  MT_CHECK(x.ndim() == 2 && dy.ndim() == 2 && dw.ndim() == 3)
      << "grouped_gemm backward wants x [N,K], dy [N,O], dw [E,O,K], got x " << x.str() << ", dy " << dy.str()
      << ", dw " << dw.str();
  const int64_t n = x.dim(0), k = x.dim(1), experts = dw.dim(0), o = dw.dim(1);
  check_arg(x, "grouped_gemm x", {DType::bf16}, {n, k});
  check_arg(dy, "grouped_gemm dy", {DType::bf16}, {n, o});
  check_arg(dw, "grouped_gemm dw", {DType::f32}, {experts, o, k});
  if (dbias.data != nullptr) check_arg(dbias, "grouped_gemm dbias", {DType::f32}, {experts, o});
  Segments seg = segments_of(offsets, experts, n);
  if (experts == 0 || o == 0) return;
  if (k > 0 && !grouped_gemm_backward_weight_sm90(x, dy, offsets, dw, accumulate))
    grouped_gemm_backward_weight_wmma(x, dy, offsets, dw, accumulate);
  if (dbias.data != nullptr) {
    const unsigned tiles = row_tiles(n, experts);
    float* partial = static_cast<float*>(scratch(sizeof(float) * tiles * o));
    bias_grad_partial_kernel<<<dim3(tiles, blocks_for(o, 256)), 256, 0, stream()>>>(seg, bf16_data(dy), o, partial);
    CUDA_CHECK_LAUNCH();
    dim3 grid(blocks_for(o, 32), static_cast<unsigned>(experts));
    bias_grad_sum_kernel<<<grid, 256, 0, stream()>>>(seg, partial, o, dbias.f32(), accumulate);
    CUDA_CHECK_LAUNCH();
  }
}

void grouped_gemm_wmma(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y) {
  const int64_t n = x.dim(0), k = x.dim(1), experts = w.dim(0), o = w.dim(1);
  Segments seg = segments_of(offsets, experts, n);
  if (n == 0 || o == 0 || experts == 0) return;
  RowArgs p{seg, bf16_data(x), bf16_data(w), k, o, k, bias.data != nullptr ? bias.f32() : nullptr, y.data,
            y.dtype == DType::bf16, o};
  dim3 grid(row_tiles(n, experts), blocks_for(o, BN));
  row_segment_kernel<true><<<grid, kThreads, 0, stream()>>>(p);
  CUDA_CHECK_LAUNCH();
}

void grouped_gemm_backward_input_wmma(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx) {
  const int64_t n = dy.dim(0), experts = w.dim(0), o = w.dim(1), k = w.dim(2);
  Segments seg = segments_of(offsets, experts, n);
  if (n == 0 || k == 0 || experts == 0) return;
  RowArgs p{seg, bf16_data(dy), bf16_data(w), o, o, k, nullptr, dx.data, dx.dtype == DType::bf16, k};
  dim3 grid(row_tiles(n, experts), blocks_for(k, BN));
  row_segment_kernel<false><<<grid, kThreads, 0, stream()>>>(p);
  CUDA_CHECK_LAUNCH();
}

void grouped_gemm_backward_weight_wmma(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                       bool accumulate) {
  const int64_t n = x.dim(0), k = x.dim(1), experts = dw.dim(0), o = dw.dim(1);
  Segments seg = segments_of(offsets, experts, n);
  if (experts == 0 || o == 0 || k == 0) return;
  WeightArgs p{seg, bf16_data(dy), bf16_data(x), dw.f32(), o, k, accumulate};
  dim3 grid(blocks_for(o, BM), blocks_for(k, BN), static_cast<unsigned>(experts));
  weight_kernel<<<grid, kThreads, 0, stream()>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
