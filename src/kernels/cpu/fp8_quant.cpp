#include "kernels/fp8_quant.h"

#include <algorithm>
#include <vector>

#include "kernels/gemm.h"

namespace mt::cpu {

namespace {

// Elements of a f32 or bf16 buffer as f32.
struct Src {
  const void* p;
  bool bf16;
  float operator[](int64_t i) const {
    return bf16 ? f32_from_bf16(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
};

// One strided view quantized in th x tw tiles: element (r, c) of [R, C] is x[r*xr + c*xc]
// and goes to q[r*qr + c*qc]; tile (r/th, c/tw) has its scale at s[(r/th)*sr + (c/tw)*sc].
// Rows, columns (the transposed view) and weight blocks are the three uses.
struct View {
  int64_t rows, cols, th, tw, xr, xc, qr, qc, sr, sc;
};

void quantize_view(Src x, const View& v, uint8_t* q, float* s, bool pow2) {
  const int64_t tr = (v.rows + v.th - 1) / v.th, tc = (v.cols + v.tw - 1) / v.tw;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tr * tc; ++t) {
    const int64_t r0 = t / tc * v.th, c0 = t % tc * v.tw;
    const int64_t r1 = std::min(r0 + v.th, v.rows), c1 = std::min(c0 + v.tw, v.cols);
    float amax = 0.0f;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) amax = std::fmax(amax, std::fabs(x[r * v.xr + c * v.xc]));
    const float scale = fp8::tile_scale(amax, pow2);
    s[t / tc * v.sr + t % tc * v.sc] = scale;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c)
        q[r * v.qr + c * v.qc] = e4m3_from_f32(fp8::scaled(x[r * v.xr + c * v.xc], scale, pow2));
  }
}

Src check_input(const Tensor& x, const char* name) {
  MT_CHECK(x.ndim() == 2 && (x.dtype == DType::f32 || x.dtype == DType::bf16))
      << name << " should be f32 or bf16 [rows, cols], got " << x.str();
  check_tensor(x, name, x.dtype, x.shape);
  return Src{x.data, x.dtype == DType::bf16};
}

uint8_t* codes(const Tensor& q, const char* name, Shape shape) {
  check_tensor(q, name, DType::f8e4m3, shape);
  return static_cast<uint8_t*>(q.data);
}

}  // namespace

void quantize_rows(const Tensor& x, const Tensor& q, const Tensor& scale, bool pow2) {
  const Src src = check_input(x, "quantize_rows x");
  const int64_t m = x.dim(0), k = x.dim(1);
  check_tensor(scale, "quantize_rows scale", DType::f32, {fp8::tiles(k), m});
  quantize_view(src, {m, k, 1, fp8::kTile, k, 1, k, 1, 1, m}, codes(q, "quantize_rows q", {m, k}), scale.f32(), pow2);
}

void quantize_blocks(const Tensor& w, const Tensor& q, const Tensor& scale, bool pow2, const Tensor& qt,
                     const Tensor& scale_t) {
  MT_CHECK((w.ndim() == 2 || w.ndim() == 3) && (w.dtype == DType::f32 || w.dtype == DType::bf16))
      << "quantize_blocks w should be f32 or bf16 [N, K] or [E, N, K], got " << w.str();
  MT_CHECK((qt.data == nullptr) == (scale_t.data == nullptr)) << "quantize_blocks: qt and scale_t go together";
  const bool batched = w.ndim() == 3;
  const int64_t e = batched ? w.dim(0) : 1, n = w.dim(w.ndim() - 2), k = w.dim(w.ndim() - 1);
  const int64_t ld = fp8::block_scale_cols(k), ldt = fp8::block_scale_cols(n);
  auto shape = [&](int64_t a, int64_t b) { return batched ? Shape{e, a, b} : Shape{a, b}; };
  check_tensor(w, "quantize_blocks w", w.dtype, shape(n, k));
  check_tensor(scale, "quantize_blocks scale", DType::f32, shape(fp8::tiles(n), ld));
  uint8_t* c = codes(q, "quantize_blocks q", shape(n, k));
  uint8_t* ct = nullptr;
  if (qt.data != nullptr) {
    ct = codes(qt, "quantize_blocks qt", shape(k, n));
    check_tensor(scale_t, "quantize_blocks scale_t", DType::f32, shape(fp8::tiles(k), ldt));
    std::fill_n(scale_t.f32(), scale_t.numel(), 0.0f);
  }
  std::fill_n(scale.f32(), scale.numel(), 0.0f);
  const Src src = check_input(w.view({e * n, k}), "quantize_blocks w");
  for (int64_t b = 0; b < e; ++b) {
    const Src x{static_cast<const char*>(src.p) + b * n * k * dtype_size(w.dtype), src.bf16};
    float* s = scale.f32() + b * fp8::tiles(n) * ld;
    quantize_view(x, {n, k, fp8::kTile, fp8::kTile, k, 1, k, 1, ld, 1}, c + b * n * k, s, pow2);
    // The transpose [K, N]: element (k, n) is x[n*K + k]; block (k/128, n/128) at [k/128][n/128].
    if (ct != nullptr)
      quantize_view(x, {k, n, fp8::kTile, fp8::kTile, 1, k, n, 1, ldt, 1}, ct + b * n * k,
                    scale_t.f32() + b * fp8::tiles(k) * ldt, pow2);
  }
}

void dequantize_rows(const Tensor& q, const Tensor& scale, const Tensor& x) {
  MT_CHECK(x.ndim() == 2) << "dequantize_rows x should be [M, K], got " << x.str();
  const int64_t m = x.dim(0), k = x.dim(1);
  const uint8_t* c = codes(q, "dequantize_rows q", {m, k});
  check_tensor(scale, "dequantize_rows scale", DType::f32, {fp8::tiles(k), m});
  check_tensor(x, "dequantize_rows x", DType::f32, {m, k});
  const float* s = scale.f32();
  float* out = x.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < k; ++j) out[r * k + j] = f32_from_e4m3(c[r * k + j]) * s[j / fp8::kTile * m + r];
}

void dequantize_blocks(const Tensor& q, const Tensor& scale, const Tensor& x) {
  MT_CHECK(x.ndim() == 2) << "dequantize_blocks x should be [N, K], got " << x.str();
  const int64_t n = x.dim(0), k = x.dim(1), ld = fp8::block_scale_cols(k);
  const uint8_t* c = codes(q, "dequantize_blocks q", {n, k});
  check_tensor(scale, "dequantize_blocks scale", DType::f32, {fp8::tiles(n), ld});
  check_tensor(x, "dequantize_blocks x", DType::f32, {n, k});
  const float* s = scale.f32();
  float* out = x.f32();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k; ++j)
      out[r * k + j] = f32_from_e4m3(c[r * k + j]) * s[r / fp8::kTile * ld + j / fp8::kTile];
}

void gemm_fp8(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, bool b_blocks,
              const Tensor& c, float alpha, float beta) {
  MT_CHECK(a.ndim() == 2 && b.ndim() == 2 && a.dim(1) == b.dim(1))
      << "gemm_fp8 wants a [M, K] and b [N, K], got " << a.str() << " and " << b.str();
  const int64_t m = a.dim(0), n = b.dim(0), k = a.dim(1);
  check_tensor(c, "gemm_fp8 c", DType::f32, {m, n});
  std::vector<float> af(static_cast<size_t>(m * k)), bf(static_cast<size_t>(n * k));
  dequantize_rows(a, a_scale, Tensor(af.data(), {m, k}, DType::f32));
  (b_blocks ? dequantize_blocks : dequantize_rows)(b, b_scale, Tensor(bf.data(), {n, k}, DType::f32));
  sgemm(false, true, m, n, k, alpha, af.data(), k, bf.data(), k, beta, c.f32(), n);
}

void grouped_gemm_fp8(const Tensor& x, const Tensor& x_scale, const Tensor& w, const Tensor& w_scale,
                      const Tensor& offsets, const Tensor& y, const Tensor& bias) {
  MT_CHECK(x.ndim() == 2 && w.ndim() == 3 && x.dim(1) == w.dim(2) && offsets.ndim() == 1 &&
           offsets.dim(0) == w.dim(0) + 1)
      << "grouped_gemm_fp8 wants x [R, K], w [E, O, K], offsets [E+1], got " << x.str() << ", " << w.str() << ", "
      << offsets.str();
  const int64_t r = x.dim(0), k = x.dim(1), e = w.dim(0), o = w.dim(1);
  check_tensor(offsets, "grouped_gemm_fp8 offsets", DType::i32, {e + 1});
  check_tensor(y, "grouped_gemm_fp8 y", DType::f32, {r, o});
  std::vector<float> xf(static_cast<size_t>(r * k)), wf(static_cast<size_t>(o * k));
  dequantize_rows(x, x_scale, Tensor(xf.data(), {r, k}, DType::f32));
  check_tensor(w_scale, "grouped_gemm_fp8 w_scale", DType::f32, {e, fp8::tiles(o), fp8::block_scale_cols(k)});
  if (bias.data != nullptr) check_tensor(bias, "grouped_gemm_fp8 bias", DType::f32, {e, o});
  const int32_t* off = offsets.i32();
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r0 = off[g], r1 = off[g + 1];
    MT_CHECK(r0 >= 0 && r0 <= r1 && r1 <= r)
        << "grouped_gemm_fp8: offsets " << r0 << " .. " << r1 << " of expert " << g << " outside 0 .. " << r;
    if (r1 == r0) continue;
    dequantize_blocks(w.rows(g, g + 1).view({o, k}), w_scale.rows(g, g + 1).view({fp8::tiles(o), fp8::block_scale_cols(k)}),
                      Tensor(wf.data(), {o, k}, DType::f32));
    sgemm(false, true, r1 - r0, o, k, 1.0f, xf.data() + r0 * k, k, wf.data(), k, 0.0f, y.f32() + r0 * o, o);
    if (bias.data == nullptr) continue;
    const float* b = bias.f32() + g * o;
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t c = 0; c < o; ++c) y.f32()[i * o + c] += b[c];
  }
}

}  // namespace mt::cpu
