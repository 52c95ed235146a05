#include <cmath>
#include <cstdint>
#include <sstream>

#include "kernels/elementwise.h"
#include "ops/cases.h"

namespace mt::test {

namespace {

// x rounded to bf16's 8 significant bits, ties to even, computed from frexp/ldexp in
// double: independent of the bit manipulation in core/dtype.h that the kernels use.
double bf16_round(double x) {
  int e = 0;
  double m = std::frexp(x, &e);  // x = m 2^e, 0.5 <= |m| < 1
  return std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8);
}

// A host tensor of either float dtype, filled from doubles through cpu::cast (f32 ->
// bf16 rounding when bf16), read back as doubles through cpu::cast again.
struct FloatTensor {
  std::vector<float> f;
  std::vector<uint16_t> h;
  Tensor t;
  FloatTensor(DType dtype, Shape s, const Vec& values) {
    f.resize(static_cast<size_t>(s.numel()));
    for (size_t i = 0; i < values.size(); ++i) f[i] = static_cast<float>(values[i]);
    if (dtype == DType::f32) {
      t = Tensor(f.data(), s, DType::f32);
      return;
    }
    h.resize(f.size());
    t = Tensor(h.data(), s, DType::bf16);
    cpu::cast(Tensor(f.data(), s, DType::f32), t);
  }
  FloatTensor(const FloatTensor&) = delete;
  Vec vec() {
    if (t.dtype == DType::bf16) cpu::cast(t, Tensor(f.data(), t.shape, DType::f32));
    return Vec(f.begin(), f.end());
  }
};

const char* name_of(DType d) { return d == DType::bf16 ? "bf16" : "f32"; }

// What the kernels compute for a bf16 output: the f32 result, rounded once.
double stored(DType d, double f32_value) {
  double f = static_cast<float>(f32_value);
  return d == DType::bf16 ? bf16_round(f) : f;
}

}  // namespace

// f32 -> bf16 -> f32: every value rounded to nearest even, exactly.
OpCase cast_case(int64_t n) {
  std::ostringstream name;
  name << "cast f32-bf16-f32 N=" << n;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", {n}, -3.0, 3.0, false}};
  c.outputs = {{"y", false}};
  c.fwd_tol = 0.0;
  c.reference = [=](const Vecs& in) {
    Vec y(in[0]);
    for (double& v : y) v = bf16_round(v);
    return Vecs{y};
  };
  c.forward = [=](const Vecs& in) {
    FloatTensor x(DType::f32, {n}, in[0]), b(DType::bf16, {n}, Vec{}), y(DType::f32, {n}, Vec{});
    cpu::cast(x.t, b.t);
    cpu::cast(b.t, y.t);
    return Vecs{y.vec()};
  };
  c.backward = [](const Vecs&, const Vecs&) { return Vecs{}; };
  return c;
}

// out = a + b, written over a (in place, as a residual add is used). Inputs are rounded
// to the dtype first, then the sum is rounded once from f32: exact for either dtype.
OpCase add_case(int64_t n, DType dtype) {
  std::ostringstream name;
  name << "add " << name_of(dtype) << " N=" << n;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"a", {n}, -1.0, 1.0, false}, {"b", {n}, -1.0, 1.0, false}};
  c.outputs = {{"out", false}};
  c.fwd_tol = 0.0;
  c.reference = [=](const Vecs& in) {
    Vec out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[i] = stored(dtype, stored(dtype, in[0][i]) + stored(dtype, in[1][i]));
    return Vecs{out};
  };
  c.forward = [=](const Vecs& in) {
    FloatTensor a(dtype, {n}, in[0]), b(dtype, {n}, in[1]);
    cpu::add(a.t, b.t, a.t);
    return Vecs{a.vec()};
  };
  c.backward = [](const Vecs&, const Vecs&) { return Vecs{}; };
  return c;
}

OpCase scale_case(int64_t n, float s, DType dtype) {
  std::ostringstream name;
  name << "scale " << name_of(dtype) << " N=" << n << " s=" << s;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", {n}, -1.0, 1.0, false}};
  c.outputs = {{"y", false}};
  c.fwd_tol = 0.0;
  c.reference = [=](const Vecs& in) {
    Vec y(in[0]);
    for (double& v : y) v = stored(dtype, stored(dtype, v) * static_cast<double>(s));
    return Vecs{y};
  };
  c.forward = [=](const Vecs& in) {
    FloatTensor x(dtype, {n}, in[0]);
    cpu::scale(x.t, s);
    return Vecs{x.vec()};
  };
  c.backward = [](const Vecs&, const Vecs&) { return Vecs{}; };
  return c;
}

// The random input is what gets overwritten, so a skipped element shows.
OpCase fill_case(int64_t n, float value, DType dtype) {
  std::ostringstream name;
  name << "fill " << name_of(dtype) << " N=" << n << " value=" << value;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"x", {n}, -1.0, 1.0, false}};
  c.outputs = {{"x", false}};
  c.fwd_tol = 0.0;
  c.reference = [=](const Vecs&) { return Vecs{Vec(static_cast<size_t>(n), stored(dtype, value))}; };
  c.forward = [=](const Vecs& in) {
    FloatTensor x(dtype, {n}, in[0]);
    cpu::fill(x.t, value);
    return Vecs{x.vec()};
  };
  c.backward = [](const Vecs&, const Vecs&) { return Vecs{}; };
  return c;
}

// The products of two floats are exact in double; n additions in double round at
// most n times by 2^-53 relative to the running sum.
OpCase sum_squares_case(const std::vector<int64_t>& sizes) {
  std::ostringstream name;
  name << "sum_squares sizes=";
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    name << (i ? "," : "") << sizes[i];
    total += sizes[i];
  }
  OpCase c;
  c.name = name.str();
  // append, not "x" + std::to_string(i): GCC 12 misreads that one (-Wrestrict).
  for (size_t i = 0; i < sizes.size(); ++i)
    c.inputs.push_back({std::string("x").append(std::to_string(i)), {sizes[i]}, -2.0, 2.0, false});
  c.outputs = {{"sum", false}};
  c.fwd_tol = 4.0 * static_cast<double>(total + 1) * std::ldexp(1.0, -53);
  c.reference = [](const Vecs& in) {
    double s = 0;
    for (const Vec& x : in)
      for (double v : x) s += v * v;
    return Vecs{{s}};
  };
  c.forward = [=](const Vecs& in) {
    std::vector<HostTensor> held;
    std::vector<Tensor> xs;
    for (size_t i = 0; i < sizes.size(); ++i) {
      held.push_back(HostTensor::f32({sizes[i]}, in[i]));
      xs.push_back(held.back().t);
    }
    return Vecs{{cpu::sum_squares(xs)}};
  };
  c.backward = [](const Vecs&, const Vecs&) { return Vecs{}; };
  return c;
}

// dst [.., Cd] columns dst_col.. from src [.., Cs] columns src_col.., rows paired one to
// one, broadcast (dst has g times src's rows) or summed (src has g times dst's). The
// reference walks dst's rows in float64; the backward is copy_columns with the two swapped,
// into zeros (accumulating onto them when the forward accumulates). dst0, what dst holds
// before, shows through where it is not written.
OpCase copy_columns_case(Shape dst, int64_t dst_col, Shape src, int64_t src_col, int64_t width, bool accumulate) {
  const int64_t dst_cols = dst[dst.n - 1], src_cols = src[src.n - 1];
  const int64_t dst_rows = dst.numel() / dst_cols, src_rows = src.numel() / src_cols;
  std::ostringstream name;
  name << "copy_columns dst=" << dst.str() << " col=" << dst_col << " src=" << src.str() << " col=" << src_col
       << " width=" << width << " acc=" << accumulate;
  OpCase c;
  c.name = name.str();
  c.inputs = {{"dst0", dst, -1.0, 1.0, false}, {"src", src}};
  c.outputs = {{"dst"}};
  const bool exact = !accumulate && src_rows <= dst_rows;  // copies only
  c.fwd_tol = exact ? 0.0 : 1e-6;
  c.reference = [=](const Vecs& in) {
    Vec out = in[0];
    for (int64_t r = 0; r < dst_rows; ++r)
      for (int64_t j = 0; j < width; ++j) {
        double v = 0;
        if (src_rows <= dst_rows) {
          v = in[1][(r / (dst_rows / src_rows)) * src_cols + src_col + j];
        } else {
          const int64_t g = src_rows / dst_rows;
          for (int64_t i = 0; i < g; ++i) v += in[1][(r * g + i) * src_cols + src_col + j];
        }
        double& o = out[r * dst_cols + dst_col + j];
        o = accumulate ? o + v : v;
      }
    return Vecs{out};
  };
  c.forward = [=](const Vecs& in) {
    auto d = HostTensor::f32(dst, in[0]), s = HostTensor::f32(src, in[1]);
    cpu::copy_columns(d.t, dst_col, s.t, src_col, width, accumulate);
    return Vecs{d.vec()};
  };
  c.backward = [=](const Vecs&, const Vecs& dout) {
    auto dd = HostTensor::f32(dst, dout[0]), ds = HostTensor::zeros(src);
    cpu::copy_columns(ds.t, src_col, dd.t, dst_col, width, accumulate);
    return Vecs{Vec{}, ds.vec()};
  };
  return c;
}

}  // namespace mt::test
