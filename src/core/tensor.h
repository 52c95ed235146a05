// A non-owning view of a contiguous, row-major block of elements.
//
// Tensor carries what a kernel needs to check its arguments (shape, dtype, device)
// and nothing it does not (no strides, no ownership, no autograd). Storage comes
// from an Arena or any other buffer; views of the leading dimension and reshapes
// are free.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/check.h"
#include "core/dtype.h"

namespace mt {

enum class Device : uint8_t { cpu, cuda };

// An op's call on the backend it runs on (the dispatchers in kernels/*.h): cuda::call when
// on_gpu holds and CUDA support is built in, else cpu::call (on_gpu is then not evaluated).
#ifdef MOETRAIN_WITH_CUDA
#define MT_BACKEND(on_gpu, call) ((on_gpu) ? cuda::call : cpu::call)
#else
#define MT_BACKEND(on_gpu, call) cpu::call
#endif

template <typename T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }

constexpr int kMaxDims = 5;

struct Shape {
  std::array<int64_t, kMaxDims> d{};
  int n = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int64_t operator[](int i) const { return d[i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[2,3,4]"
};

struct Tensor {
  void* data = nullptr;
  Shape shape;
  DType dtype = DType::f32;
  Device device = Device::cpu;

  Tensor() = default;
  Tensor(void* p, Shape s, DType t, Device dev = Device::cpu)
      : data(p), shape(s), dtype(t), device(dev) {}

  int ndim() const { return shape.n; }
  int64_t dim(int i) const;  // negative i counts from the end
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool defined() const { return data != nullptr || numel() == 0; }
  std::string str() const;  // "f32[2,3]@cpu"

  // Typed pointer; checks the dtype so a mix-up fails loudly instead of silently.
  template <typename T>
  T* ptr() const {
    MT_CHECK(dtype == dtype_of<T>()) << "tensor " << str() << " read as " << dtype_name(dtype_of<T>());
    return static_cast<T*>(data);
  }
  float* f32() const { return ptr<float>(); }
  int32_t* i32() const { return ptr<int32_t>(); }

  // Same storage, new shape with the same element count.
  Tensor view(Shape s) const;
  // Rows [begin, end) of the leading dimension.
  Tensor rows(int64_t begin, int64_t end) const;
};

// Argument checks shared by every kernel: dtype, device and exact shape.
void check_tensor(const Tensor& t, const char* name, DType dtype, Shape shape);

}  // namespace mt
