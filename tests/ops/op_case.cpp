#include "ops/op_case.h"

namespace mt::test {

HostTensor HostTensor::f32(Shape s, const Vec& values) {
  HostTensor h;
  h.f.assign(static_cast<size_t>(s.numel()), 0.0f);
  MT_CHECK(values.empty() || static_cast<int64_t>(values.size()) == s.numel())
      << values.size() << " values for shape " << s.str();
  for (size_t j = 0; j < values.size(); ++j) h.f[j] = static_cast<float>(values[j]);
  h.t = Tensor(h.f.data(), s, DType::f32);
  return h;
}

HostTensor HostTensor::i32(Shape s, const std::vector<int32_t>& values) {
  HostTensor h;
  h.i.assign(static_cast<size_t>(s.numel()), 0);
  MT_CHECK(values.empty() || static_cast<int64_t>(values.size()) == s.numel())
      << values.size() << " values for shape " << s.str();
  for (size_t j = 0; j < values.size(); ++j) h.i[j] = values[j];
  h.t = Tensor(h.i.data(), s, DType::i32);
  return h;
}

Vec HostTensor::vec() const {
  if (!i.empty()) return Vec(i.begin(), i.end());
  return Vec(f.begin(), f.end());
}

std::vector<int32_t> random_ints(uint64_t seed, int64_t n, int32_t lo, int32_t hi) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(g);
  return v;
}

}  // namespace mt::test
