// The grouped FP8 expert products (kernels/fp8_quant.h) on Hopper: CUTLASS 4.2's ptr-array
// grouped GEMM with blockwise scaling (CUTLASS example 68: TMA, wgmma in FP8, and each
// 128-wide slice of K promoted into f32 accumulators times its two scales), planned on the
// device as grouped_gemm_sm90.cu plans the bf16 ones: plan kernels turn the device offsets
// into each expert's problem shape, operand and scale pointers, strides and scale layouts
// in the stream's grouped GEMM buffer, and CUTLASS reads them there (host_problem_shapes =
// nullptr). No host sync.
//
//   grouped_gemm_fp8         y[seg] = x[seg] w[e]^T (+ bias[e]): A = x rows (K-major) with
//                            one scale a row per 128 of K, B = w[e] (K-major) with one a
//                            128x128 block; y bf16, the bias (GPT-OSS's) added to the f32
//                            accumulators in the epilogue before the one rounding, as the
//                            bf16 kernel does. An empty expert gets M = 0 (no tiles). (A
//                            weight-gradient variant measured no faster than bf16's and
//                            went: models/linear.h.)
//
// CUTLASS's collective takes a layout of each group's scales but reads them through the
// compact one it rebuilds from the group's shape (its load_init); ours are not compact (x's
// scales are [K/128, R] with R between k-tiles, a weight's block rows are padded to a
// multiple of 4), so GivenScaleLayouts makes it read the layouts the plan wrote.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <climits>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cutlass_groups.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/fp8_quant.h"

namespace mt::cuda {

namespace {

using f8 = cutlass::float_e4m3_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per expert
using GroupShape = ProblemShape::UnderlyingProblemShape;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
constexpr int kTile = static_cast<int>(fp8::kTile);

// The blockwise collective, reading each group's scales through the layout at
// layout_SFA[g] / layout_SFB[g] (both producer warps update their tensors this way
// whenever the group changes, before any load).
template <class Base>
struct GivenScaleLayouts : Base {
  template <class Inputs, class ProblemShapeMNKL>
  CUTLASS_DEVICE Inputs tensors_perform_update(Inputs const& inputs, typename Base::Params const& params,
                                               ProblemShapeMNKL shape, int32_t group) {
    Inputs compact = Base::tensors_perform_update(inputs, params, shape, group);
    return cute::make_tuple(
        cute::get<0>(compact), cute::get<1>(compact),
        cute::make_tensor(cute::make_gmem_ptr(params.ptr_SFA[group]), params.layout_SFA[group]),
        cute::make_tensor(cute::make_gmem_ptr(params.ptr_SFB[group]), params.layout_SFB[group]));
  }
};

// A scale per row of A and per 128 of K; B's per 128x128 block (the block arrays' rows
// run along K: K-major). y bf16, no source (C void), with or without a bias row.
template <class Tile, class Cluster, bool kBias>
struct Config {
  using Scales = cutlass::detail::Sm90BlockwiseScaleConfig<1, kTile, kTile, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(Scales::deduce_layoutSFA());
  using LayoutSFB = decltype(Scales::deduce_layoutSFB());
  using ElementD = cutlass::bfloat16_t;
  using ElementC = void;
  static constexpr int kAlignAB = 16 / sizeof(f8);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor*, kAlignD, ElementD,
      RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      std::conditional_t<kBias, BiasAdd<Tile, ElementD>,
                         cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, f8, cute::tuple<RowMajor*, LayoutSFA*>, kAlignAB, f8,
      cute::tuple<ColumnMajor*, LayoutSFB*>, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>::CollectiveOp;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, GivenScaleLayouts<Mainloop>, Epilogue>>;
};

// Cooperative 128x128x128 tiles (K 128: one scale promotion a k-tile) in
// 2x1 clusters, a pair of M tiles sharing B's tile through TMA multicast. Why these:
// docs/architecture.md (src/kernels, grouped_gemm_fp8).
using Tile128 = cute::Shape<cute::_128, cute::_128, cute::_128>;
using Cluster2x1 = cute::Shape<cute::_2, cute::_1, cute::_1>;
using Gemm = Config<Tile128, Cluster2x1, false>::Gemm;
using BiasGemm = Config<Tile128, Cluster2x1, true>::Gemm;
using Kernel = Gemm::GemmKernel;  // BiasGemm's has the same operand types
using StrideA = Kernel::InternalStrideA;
using StrideB = Kernel::InternalStrideB;
using StrideD = Kernel::InternalStrideD;
using LayoutSFA = Kernel::CollectiveMainloop::InternalLayoutSFA;
using LayoutSFB = Kernel::CollectiveMainloop::InternalLayoutSFB;

// The per-expert arrays of one launch, carved from the workspace.
struct Groups {
  GroupShape* shape;
  const f8** a;
  const f8** b;
  Kernel::ElementD** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  const float** sfa;
  const float** sfb;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  const float** bias;
};

Groups carve_groups(Carve& c, int experts) {
  Groups g{};
  g.shape = c.take<GroupShape>(experts);
  g.a = c.take<const f8*>(experts);
  g.b = c.take<const f8*>(experts);
  g.d = c.take<Kernel::ElementD*>(experts);
  g.stride_a = c.take<StrideA>(experts);
  g.stride_b = c.take<StrideB>(experts);
  g.stride_d = c.take<StrideD>(experts);
  g.sfa = c.take<const float*>(experts);
  g.sfb = c.take<const float*>(experts);
  g.layout_sfa = c.take<LayoutSFA>(experts);
  g.layout_sfb = c.take<LayoutSFB>(experts);
  g.bias = c.take<const float*>(experts);
  return g;
}

__device__ int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }

// A per-row scale layout ((1, rows), (128, k_tiles)): rows contiguous, k_stride between
// k-tiles.
template <class Layout>
__device__ Layout row_scales(int rows, int k_tiles, int k_stride) {
  using namespace cute;
  return make_layout(make_shape(make_shape(_1{}, rows), make_shape(Int<kTile>{}, k_tiles), 1),
                     make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, k_stride), 0));
}

struct ForwardPlan {
  const int32_t* offsets;
  int experts;
  int64_t rows, k, o;  // x [rows, k], w [E, o, k], y [rows, o]
  const f8* x;
  const float* x_scale;  // [k/128, rows]
  const f8* w;
  const float* w_scale;  // [E, tiles(o), ld]
  int64_t ld;
  const float* bias;  // [E, o], or nullptr
  cutlass::bfloat16_t* y;
  StrideA stride_a;
  StrideB stride_b;
  StrideD stride_d;
};

__global__ void plan_forward_kernel(ForwardPlan p, Groups out) {
  using namespace cute;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.experts) return;
  const auto [begin, end] = segment_rows(p.offsets, e, p.rows);
  const int n = static_cast<int>(end - begin), k_tiles = static_cast<int>(tiles_of(p.k));
  const int o_tiles = static_cast<int>(tiles_of(p.o));
  out.shape[e] = make_shape(n, static_cast<int>(p.o), static_cast<int>(p.k));
  out.a[e] = p.x + begin * p.k;
  out.b[e] = p.w + e * p.o * p.k;
  out.d[e] = p.y + begin * p.o;
  out.bias[e] = p.bias == nullptr ? nullptr : p.bias + e * p.o;
  out.stride_a[e] = p.stride_a;
  out.stride_b[e] = p.stride_b;
  out.stride_d[e] = p.stride_d;
  // x's scales: the segment's columns of [k/128, rows]. w[e]'s: rows of ld block scales.
  out.sfa[e] = p.x_scale + begin;
  out.layout_sfa[e] = row_scales<LayoutSFA>(n, k_tiles, static_cast<int>(p.rows));
  out.sfb[e] = p.w_scale + e * o_tiles * p.ld;
  out.layout_sfb[e] = make_layout(make_shape(make_shape(Int<kTile>{}, o_tiles), make_shape(Int<kTile>{}, k_tiles), 1),
                                  make_stride(make_stride(_0{}, static_cast<int>(p.ld)), make_stride(_0{}, _1{}), 0));
}

// Plans and runs the product: the plan kernel writes the groups, then CUTLASS reads them.
template <class Gemm>
void launch(const ForwardPlan& p) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.hw_info = hardware<Gemm>();
  const size_t cutlass_bytes = Gemm::get_workspace_size(args);
  Carve measure{nullptr, cutlass_bytes};
  carve_groups(measure, p.experts);
  // CUTLASS's workspace (a TMA descriptor per SM and operand), then the per-expert arrays,
  // in the stream's grouped GEMM buffer (grouped_gemm_sm90.cu's too: launches on one
  // stream queue in order, so each one's arrays are written after the last has read its own).
  char* ws = static_cast<char*>(stream_buffer(StreamBuffer::grouped_gemm, measure.used));
  Carve carve{ws, cutlass_bytes};
  const Groups g = carve_groups(carve, p.experts);
  plan_forward_kernel<<<blocks_for(p.experts, 128), 128, 0, stream()>>>(p, g);
  CUDA_CHECK_LAUNCH();

  args.problem_shape = {p.experts, g.shape, nullptr};
  args.mainloop = {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.ptr_D = g.d;
  args.epilogue.dD = g.stride_d;
  if constexpr (std::is_same_v<Gemm, BiasGemm>) {
    args.epilogue.thread = {{}, {g.bias, 0.0f, {}}, {}};  // BiasAdd's (cutlass_groups.cuh)
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
  }
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status == cutlass::Status::kSuccess) status = gemm.initialize(args, ws, stream());
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream());
  MT_CHECK(status == cutlass::Status::kSuccess)
      << "CUTLASS grouped FP8 GEMM (" << p.experts << " experts) failed: "
      << cutlass::cutlassGetStatusString(status);
}

}  // namespace

void grouped_gemm_fp8(const Tensor& x, const Tensor& x_scale, const Tensor& w, const Tensor& w_scale,
                      const Tensor& offsets, const Tensor& y, const Tensor& bias) {
  MT_CHECK(x.ndim() == 2 && w.ndim() == 3 && y.ndim() == 2 && x.dim(1) == w.dim(2))
      << "grouped_gemm_fp8 wants x [R, K], w [E, O, K] and y [R, O], got x " << x.str() << ", w " << w.str()
      << ", y " << y.str();
  const int64_t rows = x.dim(0), k = x.dim(1), experts = w.dim(0), o = w.dim(1), ld = fp8::block_scale_cols(k);
  check_arg(x, "grouped_gemm_fp8 x", {DType::f8e4m3}, {rows, k});
  check_arg(x_scale, "grouped_gemm_fp8 x_scale", {DType::f32}, {fp8::tiles(k), rows});
  check_arg(w, "grouped_gemm_fp8 w", {DType::f8e4m3}, {experts, o, k});
  check_arg(w_scale, "grouped_gemm_fp8 w_scale", {DType::f32}, {experts, fp8::tiles(o), ld});
  check_arg(offsets, "grouped_gemm_fp8 offsets", {DType::i32}, {experts + 1});
  check_arg(y, "grouped_gemm_fp8 y", {DType::bf16}, {rows, o});
  if (bias.data != nullptr) check_arg(bias, "grouped_gemm_fp8 bias", {DType::f32}, {experts, o});
  // TMA moves 16-byte rows (x's and w's K a multiple of 16 codes, y's O of 8 bf16); O a
  // multiple of 16 too, what the tests reach (a ragged last N tile included).
  MT_CHECK(k > 0 && k % 16 == 0 && o > 0 && o % 16 == 0 && rows <= INT_MAX && k <= INT_MAX && o <= INT_MAX &&
           experts <= INT_MAX && all_aligned16({&x, &w, &y}))
      << "grouped_gemm_fp8 on the GPU takes K and O positive multiples of 16 and 16-byte aligned x, w, y; got x "
      << x.str() << ", w " << w.str() << ", y " << y.str();
  if (rows == 0 || experts == 0) return;
  ForwardPlan p{offsets.i32(), static_cast<int>(experts), rows, k, o, static_cast<const f8*>(x.data), x_scale.f32(),
                static_cast<const f8*>(w.data), w_scale.f32(), ld, bias.data == nullptr ? nullptr : bias.f32(),
                static_cast<cutlass::bfloat16_t*>(y.data), leading<StrideA>(k), leading<StrideB>(k), leading<StrideD>(o)};
  if (bias.data != nullptr)
    launch<BiasGemm>(p);
  else
    launch<Gemm>(p);
}

}  // namespace mt::cuda
