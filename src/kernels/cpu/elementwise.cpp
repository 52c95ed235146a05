#include "kernels/elementwise.h"

#include <cstring>

namespace mt::cpu {

namespace {

void check_float(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(t.dtype == DType::f32 || t.dtype == DType::bf16)
      << op << " " << name << " should be f32 or bf16, got " << t.str();
  MT_CHECK(t.device == Device::cpu) << "cpu " << op << " got " << name << " " << t.str();
  MT_CHECK(t.data != nullptr || t.numel() == 0) << op << " " << name << " " << t.str() << " has no storage";
}

uint16_t* bf16_ptr(const Tensor& t) { return static_cast<uint16_t*>(t.data); }

float get(const Tensor& t, int64_t i) {
  return t.dtype == DType::bf16 ? f32_from_bf16(bf16_ptr(t)[i]) : static_cast<float*>(t.data)[i];
}

void set(const Tensor& t, int64_t i, float v) {
  if (t.dtype == DType::bf16)
    bf16_ptr(t)[i] = bf16_from_f32(v);
  else
    static_cast<float*>(t.data)[i] = v;
}

}  // namespace

void cast(const Tensor& src, const Tensor& dst) {
  check_float(src, "cast", "src");
  check_float(dst, "cast", "dst");
  MT_CHECK(src.numel() == dst.numel()) << "cast from " << src.str() << " to " << dst.str()
                                       << " changes the element count";
  int64_t n = src.numel();
  if (src.dtype == dst.dtype) {
    if (n > 0 && src.data != dst.data) std::memmove(dst.data, src.data, src.nbytes());
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) set(dst, i, get(src, i));
}

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  check_float(a, "add", "a");
  check_float(b, "add", "b");
  check_float(out, "add", "out");
  MT_CHECK(a.dtype == out.dtype && b.dtype == out.dtype && a.shape == out.shape && b.shape == out.shape)
      << "add wants a, b and out of one dtype and shape, got a " << a.str() << ", b " << b.str() << ", out "
      << out.str();
  int64_t n = out.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) set(out, i, get(a, i) + get(b, i));
}

void scale(const Tensor& x, float s) {
  check_float(x, "scale", "x");
  int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) set(x, i, get(x, i) * s);
}

void fill(const Tensor& x, float value) {
  check_float(x, "fill", "x");
  int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) set(x, i, value);
}

double sum_squares(const std::vector<Tensor>& xs) {
  double s = 0;
  for (const Tensor& x : xs) {
    check_float(x, "sum_squares", "input");
    MT_CHECK(x.dtype == DType::f32) << "sum_squares takes f32 tensors, got " << x.str();
    const float* p = x.f32();
    for (int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  }
  return s;
}

ColumnCopy column_copy_shape(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width) {
  MT_CHECK(dst.ndim() >= 1 && src.ndim() >= 1) << "copy_columns wants tensors of at least one dim, got dst "
                                               << dst.str() << ", src " << src.str();
  const int64_t dst_cols = dst.dim(dst.ndim() - 1), src_cols = src.dim(src.ndim() - 1);
  const int64_t dst_rows = dst_cols > 0 ? dst.numel() / dst_cols : 0;
  const int64_t src_rows = src_cols > 0 ? src.numel() / src_cols : 0;
  MT_CHECK(width >= 0 && dst_col >= 0 && src_col >= 0 && dst_col + width <= dst_cols && src_col + width <= src_cols)
      << "copy_columns of width " << width << " from column " << src_col << " of src " << src.str() << " to column "
      << dst_col << " of dst " << dst.str() << " falls outside a row";
  ColumnCopy c{dst_rows, dst_cols, src_cols, 1, 1};
  if (width == 0 || dst_rows == src_rows) return c;
  if (src_rows > 0 && dst_rows % src_rows == 0)
    c.bcast = dst_rows / src_rows;
  else if (dst_rows > 0 && src_rows > 0 && src_rows % dst_rows == 0)
    c.sum = src_rows / dst_rows;
  else
    MT_CHECK(false) << "copy_columns wants row counts that are equal or multiples of each other, got dst " << dst.str()
                    << " (" << dst_rows << " rows), src " << src.str() << " (" << src_rows << " rows)";
  return c;
}

void copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                  bool accumulate) {
  check_float(dst, "copy_columns", "dst");
  check_float(src, "copy_columns", "src");
  const ColumnCopy c = column_copy_shape(dst, dst_col, src, src_col, width);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t s0 = r / c.bcast * c.sum;
    for (int64_t j = 0; j < width; ++j) {
      float v = get(src, s0 * c.src_cols + src_col + j);
      for (int64_t i = 1; i < c.sum; ++i) v += get(src, (s0 + i) * c.src_cols + src_col + j);
      const int64_t d = r * c.dst_cols + dst_col + j;
      set(dst, d, accumulate ? get(dst, d) + v : v);
    }
  }
}

void copy(const Tensor& dst, const Tensor& src) {
  MT_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel())
      << "copy wants the same dtype and element count, got " << dst.str() << " <- " << src.str();
  if (dst.nbytes() > 0) std::memcpy(dst.data, src.data, dst.nbytes());
}

}  // namespace mt::cpu
