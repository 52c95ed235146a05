// Grouped expert products on Hopper through CUTLASS 3.x's ptr-array grouped GEMM (CUTLASS
// example 57: TMA, wgmma, persistent warp-specialized kernels). No host sync:
// plan_groups_kernel turns the device offsets into each group's shape and operand pointers
// in a workspace kept across calls, and CUTLASS reads them there (host_problem_shapes =
// nullptr; its group tile scheduler finds every CTA's tiles from the device-side shapes).
//
// Four instantiations, the dtypes the models run on the GPU:
//   forward  y[seg]   = x[seg] @ w[e]^T      A row-major, B column-major (w[e] is O x K)
//            y[seg]   = x[seg] @ w[e]^T + bias[e]   the same, the bias added in the epilogue
//   B        dx[seg]  = dy[seg] @ w[e]       A row-major, B row-major
//   W        dw[e] (+)= dy[seg]^T @ x[seg]   A column-major, B row-major, f32 C = D = dw[e]
// y and dx bf16, dw f32 with beta 1 (accumulate) or 0 (C is then never read). The bias
// (f32, one row per expert, found through a per-expert pointer like the operands) is added
// to the f32 accumulators before the one rounding to bf16, as the WMMA kernel does. An empty
// expert gets M = 0, so no tiles (in W, where its rows are the reduction, K = 0 would leave
// accumulators uncleared: CUTLASS clears them through the first wgmma's scale-out); without
// accumulation zero_empty_experts_kernel writes its zeros.
#include "kernels/cuda/grouped_gemm_sm90.cuh"

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cutlass_groups.cuh"
#include "kernels/cuda/runtime.h"

namespace mt::cuda {

namespace {

using bf16 = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per expert
using GroupShape = ProblemShape::UnderlyingProblemShape;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Tile, class Cluster, bool kPingpong,
          bool kBias = false>
struct Config {
  using MainloopSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  // Elements per 16 bytes, TMA's alignment (C, when there is one, has D's type).
  static constexpr int kAlignAB = 16 / sizeof(bf16);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor*, kAlignD, ElementD, RowMajor*,
      kAlignD, EpilogueSchedule,
      std::conditional_t<kBias, BiasAdd<Tile, ElementD>,
                         cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, LayoutA*, kAlignAB, bf16, LayoutB*, kAlignAB, float,
      Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>>;
};

// Forward and B cooperative 128x256x64, W pingpong 128x128x64, all in 2x1 clusters; why
// these: docs/architecture.md (src/kernels, grouped_gemm).
using Tile128x256 = cute::Shape<cute::_128, cute::_256, cute::_64>;
using Tile128x128 = cute::Shape<cute::_128, cute::_128, cute::_64>;
using Cluster2x1 = cute::Shape<cute::_2, cute::_1, cute::_1>;
using ForwardGemm = Config<RowMajor, ColumnMajor, void, bf16, Tile128x256, Cluster2x1, false>::Gemm;
using ForwardBiasGemm = Config<RowMajor, ColumnMajor, void, bf16, Tile128x256, Cluster2x1, false, true>::Gemm;
using InputGemm = Config<RowMajor, RowMajor, void, bf16, Tile128x256, Cluster2x1, false>::Gemm;
using WeightGemm = Config<ColumnMajor, RowMajor, float, float, Tile128x128, Cluster2x1, true>::Gemm;

// The types CUTLASS reads per group. ElementC is void when the epilogue has no source.
template <class Gemm>
struct Types {
  using Kernel = typename Gemm::GemmKernel;
  using A = typename Kernel::ElementA;
  using B = typename Kernel::ElementB;
  using C = typename Kernel::ElementC;
  using D = typename Kernel::ElementD;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  static constexpr bool kHasC = !std::is_void_v<C>;
  static constexpr bool kBias = std::is_same_v<Gemm, ForwardBiasGemm>;  // the epilogue reads a bias row
};

// Where expert e's part of an operand starts: base + begin * per_row + e * per_expert
// elements, begin being the first row of its segment.
template <class T>
struct Walk {
  T* base;
  int64_t per_row, per_expert;
  __device__ T* at(int e, int64_t begin) const { return base + begin * per_row + e * per_expert; }
};

// The per-expert arrays of one launch, carved from the workspace.
template <class Gemm>
struct Groups {
  using T = Types<Gemm>;
  GroupShape* shape;
  const typename T::A** a;
  const typename T::B** b;
  const typename T::C** c;  // unused without a source
  typename T::D** d;
  typename T::StrideA* stride_a;
  typename T::StrideB* stride_b;
  typename T::StrideC* stride_c;
  typename T::StrideD* stride_d;
  const float** bias;  // only with a bias
};

template <class Gemm>
struct Plan {
  using T = Types<Gemm>;
  const int32_t* offsets;  // [experts + 1] on the device
  int experts;
  int64_t rows;            // N: offsets are clamped to [0, N], as the WMMA kernel does
  Walk<const typename T::A> a;
  Walk<const typename T::B> b;
  Walk<typename T::D> d;   // also C, when there is one (W accumulates in place)
  Walk<const float> bias;  // [E, n] f32, with a bias
  // Forward and B: expert e is (rows_e, n, k). W (rows_reduce): (m, n, rows_e), and
  // (0, n, rows_e) without rows.
  int m, n, k;
  bool rows_reduce;
  typename T::StrideA stride_a;
  typename T::StrideB stride_b;
  typename T::StrideD stride_d;  // C's too
  Groups<Gemm> out;
};

template <class Gemm>
__global__ void plan_groups_kernel(Plan<Gemm> p) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.experts) return;
  const auto [begin, end] = segment_rows(p.offsets, e, p.rows);
  const int rows = static_cast<int>(end - begin);
  p.out.shape[e] = p.rows_reduce ? cute::make_shape(rows > 0 ? p.m : 0, p.n, rows) : cute::make_shape(rows, p.n, p.k);
  p.out.a[e] = p.a.at(e, begin);
  p.out.b[e] = p.b.at(e, begin);
  p.out.d[e] = p.d.at(e, begin);
  p.out.stride_a[e] = p.stride_a;
  p.out.stride_b[e] = p.stride_b;
  p.out.stride_d[e] = p.stride_d;
  if constexpr (Types<Gemm>::kHasC) {
    p.out.c[e] = p.out.d[e];
    p.out.stride_c[e] = p.stride_d;
  }
  if constexpr (Types<Gemm>::kBias) p.out.bias[e] = p.bias.at(e, begin);
}

template <class Gemm>
Groups<Gemm> carve_groups(Carve& c, int experts) {
  using T = Types<Gemm>;
  Groups<Gemm> g{};
  g.shape = c.take<GroupShape>(experts);
  g.a = c.take<const typename T::A*>(experts);
  g.b = c.take<const typename T::B*>(experts);
  if constexpr (T::kHasC) g.c = c.take<const typename T::C*>(experts);
  g.d = c.take<typename T::D*>(experts);
  g.stride_a = c.take<typename T::StrideA>(experts);
  g.stride_b = c.take<typename T::StrideB>(experts);
  if constexpr (T::kHasC) g.stride_c = c.take<typename T::StrideC>(experts);
  g.stride_d = c.take<typename T::StrideD>(experts);
  if constexpr (T::kBias) g.bias = c.take<const float*>(experts);
  return g;
}

// Runs the plan over the `experts` segments that offsets makes of `rows` rows.
template <class Gemm>
void launch(Plan<Gemm> p, const Tensor& offsets, int64_t experts, int64_t rows, float beta) {
  using T = Types<Gemm>;
  p.offsets = offsets.i32();
  p.experts = static_cast<int>(experts);
  p.rows = rows;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.hw_info = hardware<Gemm>();
  const size_t cutlass_bytes = Gemm::get_workspace_size(args);
  Carve measure{nullptr, cutlass_bytes};
  carve_groups<Gemm>(measure, p.experts);
  // Kept across calls, one per stream (runtime.h): CUTLASS's workspace (a TMA descriptor
  // per SM and operand), then the per-expert arrays. Launches on one stream queue in order,
  // so each one's arrays are written after the previous one has read its own.
  char* ws = static_cast<char*>(stream_buffer(StreamBuffer::grouped_gemm, measure.used));
  Carve carve{ws, cutlass_bytes};
  p.out = carve_groups<Gemm>(carve, p.experts);

  plan_groups_kernel<Gemm><<<blocks_for(p.experts, 128), 128, 0, stream()>>>(p);
  CUDA_CHECK_LAUNCH();

  const Groups<Gemm>& g = p.out;
  args.problem_shape = {p.experts, g.shape, nullptr};
  args.mainloop = {g.a, g.stride_a, g.b, g.stride_b};
  args.epilogue.ptr_C = g.c;
  args.epilogue.dC = g.stride_c;
  args.epilogue.ptr_D = g.d;
  args.epilogue.dD = g.stride_d;
  if constexpr (T::kBias) {
    args.epilogue.thread = {{}, {g.bias, 0.0f, {}}, {}};  // BiasAdd's (cutlass_groups.cuh)
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = T::kHasC ? beta : 0.0f;
  }
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status == cutlass::Status::kSuccess) status = gemm.initialize(args, ws, stream());
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream());
  MT_CHECK(status == cutlass::Status::kSuccess)
      << "CUTLASS grouped GEMM (" << p.experts << " experts, rows " << p.rows << ", n " << p.n << ", k " << p.k
      << ") failed: " << cutlass::cutlassGetStatusString(status);
}

// TMA moves 16-byte aligned rows: a bf16 (or f32) row length a positive multiple of 8 (4)
// elements, and every tensor's start 16-byte aligned. Sizes must fit CUTLASS's ints.
bool tma_length(int64_t elements) { return elements > 0 && elements % 8 == 0 && elements <= INT_MAX; }
bool tma_fits(int64_t n, int64_t experts, int64_t k, int64_t o, std::initializer_list<const Tensor*> tensors) {
  return tma_length(k) && tma_length(o) && n <= INT_MAX && experts <= INT_MAX && all_aligned16(tensors);
}

template <class Gemm>
void forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y) {
  const int64_t n = x.dim(0), k = x.dim(1), experts = w.dim(0), o = w.dim(1);
  using T = Types<Gemm>;
  Plan<Gemm> p{};
  p.a = {static_cast<const typename T::A*>(x.data), k, 0};
  p.b = {static_cast<const typename T::B*>(w.data), 0, o * k};
  p.d = {static_cast<typename T::D*>(y.data), o, 0};
  if (bias.data != nullptr) p.bias = {bias.f32(), 0, o};
  p.n = static_cast<int>(o);
  p.k = static_cast<int>(k);
  p.stride_a = leading<typename T::StrideA>(k);
  p.stride_b = leading<typename T::StrideB>(k);
  p.stride_d = leading<typename T::StrideD>(o);
  launch(p, offsets, experts, n, 0.0f);
}

// dw[e] = 0 for every expert without rows (W without accumulation: CUTLASS skips them).
__global__ void zero_empty_experts_kernel(const int32_t* offsets, int64_t rows, float4* dw, int64_t per_expert) {
  const int e = blockIdx.y;
  const auto [begin, end] = segment_rows(offsets, e, rows);
  if (end > begin) return;
  float4* out = dw + e * per_expert;
  MT_GRID_STRIDE(i, per_expert) out[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

}  // namespace

void zero_empty_experts(const Tensor& offsets, int64_t rows, const Tensor& dw) {
  const int64_t experts = dw.dim(0);
  if (experts == 0) return;
  const int64_t per_expert = dw.numel() / experts / 4;
  // Few blocks an expert: almost every expert has rows, and its blocks only look and
  // leave, so the launch costs what scheduling them does (64 an expert took 70 us).
  dim3 grid(std::min(blocks_for(per_expert, 256), 8u), static_cast<unsigned>(experts));
  zero_empty_experts_kernel<<<grid, 256, 0, stream()>>>(offsets.i32(), rows, reinterpret_cast<float4*>(dw.data),
                                                         per_expert);
  CUDA_CHECK_LAUNCH();
}

bool grouped_gemm_sm90(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& offsets, const Tensor& y) {
  const int64_t n = x.dim(0), k = x.dim(1), experts = w.dim(0), o = w.dim(1);
  if (y.dtype != DType::bf16 || !tma_fits(n, experts, k, o, {&x, &w, &y})) return false;
  if (bias.data != nullptr)
    forward<ForwardBiasGemm>(x, w, bias, offsets, y);
  else
    forward<ForwardGemm>(x, w, bias, offsets, y);
  return true;
}

bool grouped_gemm_backward_input_sm90(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx) {
  const int64_t n = dy.dim(0), experts = w.dim(0), o = w.dim(1), k = w.dim(2);
  if (dx.dtype != DType::bf16 || !tma_fits(n, experts, k, o, {&dy, &w, &dx})) return false;
  using T = Types<InputGemm>;
  Plan<InputGemm> p{};
  p.a = {static_cast<const T::A*>(dy.data), o, 0};
  p.b = {static_cast<const T::B*>(w.data), 0, o * k};
  p.d = {static_cast<T::D*>(dx.data), k, 0};
  p.n = static_cast<int>(k);
  p.k = static_cast<int>(o);
  // B(n, r) = w[e][r][n]: n contiguous, leading dimension K.
  p.stride_a = leading<T::StrideA>(o);
  p.stride_b = leading<T::StrideB>(k);
  p.stride_d = leading<T::StrideD>(k);
  launch(p, offsets, experts, n, 0.0f);
  return true;
}

bool grouped_gemm_backward_weight_sm90(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw,
                                       bool accumulate) {
  const int64_t n = x.dim(0), k = x.dim(1), experts = dw.dim(0), o = dw.dim(1);
  if (!tma_fits(n, experts, k, o, {&x, &dy, &dw})) return false;
  using T = Types<WeightGemm>;
  Plan<WeightGemm> p{};
  // A(m, r) = dy[r][m] (m contiguous, leading dimension O); B(n, r) = x[r][n] (leading
  // dimension K); D = dw[e], O x K row-major.
  p.a = {static_cast<const T::A*>(dy.data), o, 0};
  p.b = {static_cast<const T::B*>(x.data), k, 0};
  p.d = {dw.f32(), 0, o * k};
  p.m = static_cast<int>(o);
  p.n = static_cast<int>(k);
  p.rows_reduce = true;
  p.stride_a = leading<T::StrideA>(o);
  p.stride_b = leading<T::StrideB>(k);
  p.stride_d = leading<T::StrideD>(k);
  if (!accumulate) zero_empty_experts(offsets, n, dw);
  launch(p, offsets, experts, n, accumulate ? 1.0f : 0.0f);
  return true;
}

}  // namespace mt::cuda
