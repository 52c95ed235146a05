#include "core/tensor.h"

#include <algorithm>
#include <sstream>

namespace mt {

Shape::Shape(std::initializer_list<int64_t> dims) {
  MT_CHECK(static_cast<int>(dims.size()) <= kMaxDims) << "a shape has at most " << kMaxDims << " dims, got " << dims.size();
  for (int64_t v : dims) {
    MT_CHECK(v >= 0) << "negative dimension " << v;
    d[n++] = v;
  }
}

int64_t Shape::numel() const {
  int64_t p = 1;
  for (int i = 0; i < n; ++i)
    MT_CHECK(!__builtin_mul_overflow(p, d[i], &p)) << "shape " << str() << " has more elements than fit in 64 bits";
  return p;
}

bool Shape::operator==(const Shape& o) const {
  return n == o.n && std::equal(d.begin(), d.begin() + n, o.d.begin());
}

std::string Shape::str() const {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < n; ++i) s << (i ? "," : "") << d[i];
  s << "]";
  return s.str();
}

int64_t Tensor::dim(int i) const {
  int j = i < 0 ? i + shape.n : i;
  MT_CHECK(j >= 0 && j < shape.n) << "dim " << i << " of " << str();
  return shape.d[j];
}

std::string Tensor::str() const {
  return std::string(dtype_name(dtype)) + shape.str() + (device == Device::cpu ? "@cpu" : "@cuda");
}

Tensor Tensor::view(Shape s) const {
  MT_CHECK(s.numel() == numel()) << "cannot view " << str() << " as " << s.str();
  return Tensor(data, s, dtype, device);
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  MT_CHECK(shape.n >= 1 && 0 <= begin && begin <= end && end <= shape.d[0])
      << "rows [" << begin << "," << end << ") of " << str();
  Shape s = shape;
  s.d[0] = end - begin;
  size_t row_bytes = static_cast<size_t>(shape.d[0] ? numel() / shape.d[0] : 0) * dtype_size(dtype);
  // No storage (an arena's sizing pass) stays none: an offset from null is undefined.
  return Tensor(data ? static_cast<char*>(data) + begin * row_bytes : nullptr, s, dtype, device);
}

void check_tensor(const Tensor& t, const char* name, DType dtype, Shape shape) {
  MT_CHECK(t.dtype == dtype && t.shape == shape)
      << name << " should be " << dtype_name(dtype) << shape.str() << ", got " << t.str();
  MT_CHECK(t.data != nullptr || shape.numel() == 0) << name << " " << t.str() << " has no storage";
}

}  // namespace mt
