// What the CUTLASS grouped GEMMs (grouped_gemm_sm90.cu, grouped_gemm_fp8.cu) share: the
// packed strides they fill per group, the carving of their per-group arrays out of the
// grouped GEMM's stream buffer, the persistent grid's size, and the bias epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/runtime.h"

namespace mt::cuda {

// A CUTLASS stride of a packed matrix has one dynamic mode, the leading dimension; the
// others are static 1 (the contiguous mode) and 0 (the batch mode, unused when grouped).
template <class Stride>
Stride leading(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<std::remove_cvref_t<decltype(cute::get<0>(s))>>::value)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  return s;
}

// Hands out 256-byte aligned pieces from `base`; with base = nullptr it only measures.
struct Carve {
  char* base;
  size_t used = 0;
  template <class T>
  T* take(int64_t count) {
    T* p = reinterpret_cast<T*>(base == nullptr ? nullptr : base + used);
    used += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
};

// The SM count and how many clusters fit at once (clusters need whole GPCs' worth of
// free SMs, so fewer may fit than SMs / cluster size): the persistent grid's size.
template <class Gemm>
cutlass::KernelHardwareInfo hardware() {
  static const cutlass::KernelHardwareInfo info = [] {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    return cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Gemm::GemmKernel>(device, sm_count());
  }();
  return info;
}

// D = acc + bias[e][n] in f32, rounded once to ElementD: a row broadcast of the expert's
// bias (Sm90RowBroadcast over an array of per-group pointers). Its arguments are
// {{}, {bias pointers, 0, {}}, {}}: (acc, bias row, plus).
template <class Tile, class ElementD>
using BiasAdd = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, float*, float>>;

}  // namespace mt::cuda
