#include "kernels/dispatch.h"

#include <algorithm>
#include <vector>

namespace mt::cpu {

namespace {

// 1-D i32 with at least `need` entries.
void check_index_tensor(const Tensor& t, const char* name, int64_t need) {
  MT_CHECK(t.dtype == DType::i32 && t.ndim() == 1 && t.dim(0) >= need)
      << name << " should be i32 with at least " << need << " entries, got " << t.str();
  MT_CHECK(t.data != nullptr || need == 0) << name << " " << t.str() << " has no storage";
}

// slot_row [N*k] for x/y [N,D]: every entry a row of the [R,D] expert-ordered tensor or
// -1. Checked once up front so the parallel loops can trust it. Returns k.
int64_t check_slot_row(const Tensor& slot_row, int64_t tokens, int64_t rows) {
  MT_CHECK(slot_row.dtype == DType::i32 && slot_row.ndim() == 1 &&
           (tokens == 0 ? slot_row.dim(0) == 0 : slot_row.dim(0) % tokens == 0))
      << "slot_row should be i32 [N*k] with N=" << tokens << ", got " << slot_row.str();
  const int32_t* sr = slot_row.i32();
  int64_t slots = slot_row.dim(0);
  int64_t k = tokens == 0 ? 0 : slots / tokens;
  for (int64_t s = 0; s < slots; ++s)
    MT_CHECK(sr[s] >= -1 && sr[s] < rows) << "slot_row[" << s << "] (token " << s / k << ", slot " << s % k << ") is "
                                          << sr[s] << ", expected -1 or a row in [0, " << rows << ")";
  return k;
}

}  // namespace

int64_t dispatch_plan(const Tensor& idx, int64_t num_experts, int64_t capacity, const Tensor& counts,
                      const Tensor& offsets, const Tensor& order, const Tensor& slot_row) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2) << "dispatch idx should be i32 [N,k], got " << idx.str();
  MT_CHECK(num_experts > 0 && capacity >= 0) << "dispatch wants at least one expert and capacity >= 0, got "
                                             << num_experts << " experts, capacity " << capacity;
  int64_t n = idx.dim(0), k = idx.dim(1), slots = n * k;
  check_tensor(counts, "dispatch counts", DType::i32, {num_experts});
  check_tensor(offsets, "dispatch offsets", DType::i32, {num_experts + 1});
  check_index_tensor(order, "dispatch order", slots);
  check_tensor(slot_row, "dispatch slot_row", DType::i32, {slots});
  const int32_t* ip = idx.i32();
  int32_t* cnt = counts.i32();
  int32_t* off = offsets.i32();
  int32_t* ord = order.i32();
  int32_t* sr = slot_row.i32();

  // Counting sort: histogram, capped histogram, exclusive prefix sum, then one stable
  // pass in slot order so rows within an expert follow (token, j).
  std::vector<int64_t> wanted(static_cast<size_t>(num_experts), 0);
  for (int64_t s = 0; s < slots; ++s) {
    MT_CHECK(ip[s] >= 0 && ip[s] < num_experts) << "dispatch idx of token " << s / k << " slot " << s % k << " is "
                                                << ip[s] << ", outside [0, " << num_experts << ")";
    ++wanted[ip[s]];
  }
  off[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    cnt[e] = static_cast<int32_t>(capacity > 0 ? std::min(wanted[e], capacity) : wanted[e]);
    off[e + 1] = off[e] + cnt[e];
  }
  std::vector<int32_t> next(off, off + num_experts);
  int64_t dropped = 0;
  for (int64_t s = 0; s < slots; ++s) {
    int32_t e = ip[s];
    if (next[e] == off[e + 1]) {
      sr[s] = -1;
      ++dropped;
      continue;
    }
    ord[next[e]] = static_cast<int32_t>(s);
    sr[s] = next[e]++;
  }
  return dropped;
}

void dispatch_forward(const Tensor& x, const Tensor& order, int64_t k, const Tensor& xs) {
  MT_CHECK(x.ndim() == 2 && xs.ndim() == 2 && k >= 1)
      << "dispatch wants x [N,D], xs [R,D] and k >= 1, got x " << x.str() << ", xs " << xs.str() << ", k " << k;
  int64_t n = x.dim(0), d = x.dim(1), rows = xs.dim(0);
  check_tensor(x, "dispatch x", DType::f32, {n, d});
  check_tensor(xs, "dispatch xs", DType::f32, {rows, d});
  check_index_tensor(order, "dispatch order", rows);
  const int32_t* ord = order.i32();
  for (int64_t r = 0; r < rows; ++r)
    MT_CHECK(ord[r] >= 0 && ord[r] < n * k)
        << "dispatch order[" << r << "] is " << ord[r] << ", expected a slot in [0, " << n * k << ")";
  const float* xp = x.f32();
  float* out = xs.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) std::copy_n(xp + ord[r] / k * d, d, out + r * d);
}

void dispatch_backward(const Tensor& dxs, const Tensor& slot_row, const Tensor& dx) {
  MT_CHECK(dxs.ndim() == 2 && dx.ndim() == 2)
      << "dispatch backward wants dxs [R,D] and dx [N,D], got dxs " << dxs.str() << ", dx " << dx.str();
  int64_t rows = dxs.dim(0), d = dxs.dim(1), n = dx.dim(0);
  check_tensor(dxs, "dispatch dxs", DType::f32, {rows, d});
  check_tensor(dx, "dispatch dx", DType::f32, {n, d});
  int64_t k = check_slot_row(slot_row, n, rows);
  const int32_t* sr = slot_row.i32();
  const float* g = dxs.f32();
  float* out = dx.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float* o = out + t * d;
    std::fill_n(o, d, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      int32_t r = sr[t * k + j];
      if (r < 0) continue;
      for (int64_t c = 0; c < d; ++c) o[c] += g[r * d + c];
    }
  }
}

void combine_forward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& y) {
  MT_CHECK(ys.ndim() == 2 && weight.ndim() == 2 && y.ndim() == 2)
      << "combine wants ys [R,D], weight [N,k], y [N,D], got ys " << ys.str() << ", weight " << weight.str() << ", y "
      << y.str();
  int64_t rows = ys.dim(0), d = ys.dim(1), n = weight.dim(0), k = weight.dim(1);
  check_tensor(ys, "combine ys", DType::f32, {rows, d});
  check_tensor(weight, "combine weight", DType::f32, {n, k});
  check_tensor(y, "combine y", DType::f32, {n, d});
  check_tensor(slot_row, "combine slot_row", DType::i32, {n * k});
  check_slot_row(slot_row, n, rows);
  const int32_t* sr = slot_row.i32();
  const float* yp = ys.f32();
  const float* wp = weight.f32();
  float* out = y.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float* o = out + t * d;
    std::fill_n(o, d, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      int32_t r = sr[t * k + j];
      if (r < 0) continue;
      float w = wp[t * k + j];
      for (int64_t c = 0; c < d; ++c) o[c] += w * yp[r * d + c];
    }
  }
}

void combine_backward(const Tensor& ys, const Tensor& weight, const Tensor& slot_row, const Tensor& dy,
                      const Tensor& dys, const Tensor& dweight) {
  MT_CHECK(ys.ndim() == 2 && weight.ndim() == 2 && dy.ndim() == 2)
      << "combine backward wants ys [R,D], weight [N,k], dy [N,D], got ys " << ys.str() << ", weight " << weight.str()
      << ", dy " << dy.str();
  int64_t rows = ys.dim(0), d = ys.dim(1), n = weight.dim(0), k = weight.dim(1);
  check_tensor(ys, "combine ys", DType::f32, {rows, d});
  check_tensor(dy, "combine dy", DType::f32, {n, d});
  check_tensor(dys, "combine dys", DType::f32, {rows, d});
  check_tensor(dweight, "combine dweight", DType::f32, {n, k});
  check_tensor(slot_row, "combine slot_row", DType::i32, {n * k});
  check_slot_row(slot_row, n, rows);
  const int32_t* sr = slot_row.i32();
  const float* yp = ys.f32();
  const float* wp = weight.f32();
  const float* g = dy.f32();
  float* dyp = dys.f32();
  float* dwp = dweight.f32();
  // Each kept slot owns one row of dys, so tokens write disjoint rows.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const float* gt = g + t * d;
    for (int64_t j = 0; j < k; ++j) {
      int32_t r = sr[t * k + j];
      if (r < 0) {
        dwp[t * k + j] = 0.0f;
        continue;
      }
      float w = wp[t * k + j], dot = 0.0f;
      for (int64_t c = 0; c < d; ++c) {
        dot += gt[c] * yp[r * d + c];
        dyp[r * d + c] = w * gt[c];
      }
      dwp[t * k + j] = dot;
    }
  }
}

}  // namespace mt::cpu
