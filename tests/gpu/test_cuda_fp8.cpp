// Blockwise FP8 quantization on the GPU against the CPU backend: the codes and scales
// must be the same bytes (both evaluate fp8::tile_scale and fp8::scaled, and the CPU's
// e4m3 conversion matches the hardware's satfinite cvt on every input, test_core).
// Inputs span 25 binades, so tiles differ in scale and some codes are subnormal.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test.h"
#include "kernels/adamw.h"
#include "kernels/cuda/runtime.h"
#include "kernels/fp8_quant.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"

namespace mt::gpu_test {
namespace {

std::vector<float> wide_floats(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> e(-12, 12);
  std::vector<float> v = random_floats(n, -1, 1, seed);
  for (float& x : v) x = std::ldexp(x, e(rng));
  for (int64_t i = 0; i < std::min<int64_t>(n, 64); ++i) v[i] = 0.0f;  // a partly zero first tile
  return v;
}

std::vector<uint8_t> download_codes(const Tensor& t) {
  std::vector<uint8_t> out(static_cast<size_t>(t.numel()));
  cuda::copy(Tensor(out.data(), t.shape, DType::f8e4m3), t);
  return out;
}

// Bitwise: a scale the kernel forgot stays poisoned (NaN) and fails too.
::testing::AssertionResult same_bits(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&got[i], &want[i], 4) != 0)
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_codes(const char* what, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i])
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << int{got[i]} << ", want " << int{want[i]};
  return ::testing::AssertionSuccess();
}

struct Shape2 {
  int64_t m, k;
};
const Shape2 kShapes[] = {{4096, 2048}, {300, 384}, {1, 128}, {130, 200}, {257, 1}};

TEST(CudaFp8Quant, RowsEqualCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 5000;
  for (Shape2 c : kShapes)
    for (DType dtype : {DType::bf16, DType::f32})
      for (bool pow2 : {true, false}) {
        SCOPED_TRACE(testing::Message() << "M=" << c.m << " K=" << c.k << " " << dtype_name(dtype) << " pow2=" << pow2);
        const int64_t m = c.m, k = c.k, tk = fp8::tiles(k);
        auto x = wide_floats(m * k, ++seed);
        if (dtype == DType::bf16) x = round_bf16(x);
        std::vector<uint8_t> q(m * k);
        std::vector<float> s(tk * m);
        // The CPU reads f32; the bf16 values are exactly those the GPU reads.
        cpu::quantize_rows(host(x, {m, k}), Tensor(q.data(), {m, k}, DType::f8e4m3), host(s, {tk, m}), pow2);
        auto d_x = upload(x, dtype, {m, k});
        auto d_q = poisoned(DType::f8e4m3, {m, k});
        auto d_s = poisoned(DType::f32, {tk, m});
        cuda::quantize_rows(d_x.t, d_q.t, d_s.t, pow2);
        EXPECT_TRUE(same_codes("q", download_codes(d_q.t), q));
        EXPECT_TRUE(same_bits("scale", download(d_s.t), s));
      }
}

TEST(CudaFp8Quant, BlocksEqualCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 6000;
  for (Shape2 c : kShapes)
    for (DType dtype : {DType::f32, DType::bf16})
      for (bool pow2 : {true, false}) {
        SCOPED_TRACE(testing::Message() << "N=" << c.m << " K=" << c.k << " " << dtype_name(dtype) << " pow2=" << pow2);
        const int64_t n = c.m, k = c.k, tn = fp8::tiles(n), ld = fp8::block_scale_cols(k);
        auto w = wide_floats(n * k, ++seed);
        if (dtype == DType::bf16) w = round_bf16(w);
        std::vector<uint8_t> q(n * k);
        std::vector<float> s(tn * ld);
        cpu::quantize_blocks(host(w, {n, k}), Tensor(q.data(), {n, k}, DType::f8e4m3), host(s, {tn, ld}), pow2);
        auto d_w = upload(w, dtype, {n, k});
        auto d_q = poisoned(DType::f8e4m3, {n, k});
        auto d_s = poisoned(DType::f32, {tn, ld});
        cuda::quantize_blocks(d_w.t, d_q.t, d_s.t, pow2);
        EXPECT_TRUE(same_codes("q", download_codes(d_q.t), q));
        EXPECT_TRUE(same_bits("scale", download(d_s.t), s));
      }
}

// A layer's experts [E, N, K] and their transposes [E, K, N] in one pass, 2-D too; N and
// K ragged. The padding of both scale arrays must be written as 0, as the CPU does.
TEST(CudaFp8Quant, StackedBlocksAndTransposeEqualCpu) {
  MT_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t e, n, k;  // e 0: a 2-D [N, K]
  };
  uint64_t seed = 6500;
  for (Case c : {Case{3, 300, 384}, Case{2, 130, 200}, Case{1, 1, 128}, Case{4, 257, 1}, Case{0, 300, 640},
                 Case{2, 768, 256}})
    for (DType dtype : {DType::f32, DType::bf16})
      for (bool pow2 : {true, false}) {
        SCOPED_TRACE(testing::Message() << "E=" << c.e << " N=" << c.n << " K=" << c.k << " " << dtype_name(dtype)
                                        << " pow2=" << pow2);
        const int64_t e = std::max<int64_t>(c.e, 1), n = c.n, k = c.k;
        const int64_t tn = fp8::tiles(n), tk = fp8::tiles(k), ld = fp8::block_scale_cols(k),
                      ldt = fp8::block_scale_cols(n);
        auto stacked = [&](Shape s) { return c.e > 0 ? Shape{c.e, s[0], s[1]} : s; };
        const Shape ws = stacked({n, k}), wts = stacked({k, n}), ss = stacked({tn, ld}), sts = stacked({tk, ldt});
        auto w = wide_floats(e * n * k, ++seed);
        if (dtype == DType::bf16) w = round_bf16(w);
        std::vector<uint8_t> q(e * n * k), qt(e * n * k);
        std::vector<float> s(e * tn * ld), st(e * tk * ldt);
        cpu::quantize_blocks(host(w, ws), Tensor(q.data(), ws, DType::f8e4m3), host(s, ss), pow2,
                             Tensor(qt.data(), wts, DType::f8e4m3), host(st, sts));
        auto d_w = upload(w, dtype, ws);
        auto d_q = poisoned(DType::f8e4m3, ws), d_qt = poisoned(DType::f8e4m3, wts);
        auto d_s = poisoned(DType::f32, ss), d_st = poisoned(DType::f32, sts);
        cuda::quantize_blocks(d_w.t, d_q.t, d_s.t, pow2, d_qt.t, d_st.t);
        EXPECT_TRUE(same_codes("q", download_codes(d_q.t), q));
        EXPECT_TRUE(same_bits("scale", download(d_s.t), s));
        EXPECT_TRUE(same_codes("qt", download_codes(d_qt.t), qt));
        EXPECT_TRUE(same_bits("scale_t", download(d_st.t), st));
        // Without the transpose: the same bytes.
        auto d_q1 = poisoned(DType::f8e4m3, ws);
        auto d_s1 = poisoned(DType::f32, ss);
        cuda::quantize_blocks(d_w.t, d_q1.t, d_s1.t, pow2);
        EXPECT_TRUE(same_codes("q (no transpose)", download_codes(d_q1.t), q));
        EXPECT_TRUE(same_bits("scale (no transpose)", download(d_s1.t), s));
      }
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> offsets{0};
  for (int32_t c : counts) offsets.push_back(offsets.back() + c);
  return offsets;
}

std::string counts_str(const std::vector<int32_t>& counts) {
  std::ostringstream s;
  for (size_t i = 0; i < counts.size() && i < 12; ++i) s << (i ? "," : "") << counts[i];
  if (counts.size() > 12) s << ",... (" << counts.size() << " experts)";
  return s.str();
}

// cuBLASLt's block-scaled product against the CPU's on the same codes and scales, for a
// weight (128x128 blocks) and the weight gradient's form (1x128 both). The CPU sums in
// f32; Hopper's FP8 tensor cores keep fewer bits within each 128-wide block of K before
// cuBLASLt scales and adds it in f32 (DeepSeek-V3 measured about 14 on H800), so the two
// differ by up to ~2^-12 of the output's magnitude: 2.0e-4 to 2.3e-4 measured on an H200
// at f32 output; the bound is 1e-3, and 8e-3 with the bf16 output's rounding.
TEST(CudaFp8Gemm, MatchesTheCpuOnTheSameCodes) {
  MT_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t m, n, k;
  };
  for (Case sh : {Case{256, 384, 512}, Case{300, 200, 384}, Case{8192, 2048, 768}})
    for (bool blocks : {true, false})
      for (DType out : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(testing::Message() << "M=" << sh.m << " N=" << sh.n << " K=" << sh.k << " blocks=" << blocks
                                        << " " << dtype_name(out));
        const int64_t m = sh.m, n = sh.n, k = sh.k;
        auto a = random_floats(m * k, -2, 2, 11), b = random_floats(n * k, -0.1f, 0.1f, 12);
        auto c0 = round_bf16(random_floats(m * n, -1, 1, 13));
        std::vector<uint8_t> qa(m * k), qb(n * k);
        std::vector<float> sa(fp8::tiles(k) * m);
        const int64_t sr = blocks ? fp8::tiles(n) : fp8::tiles(k), sc = blocks ? fp8::block_scale_cols(k) : n;
        std::vector<float> sb(sr * sc);
        const Tensor ta(qa.data(), {m, k}, DType::f8e4m3), tb(qb.data(), {n, k}, DType::f8e4m3);
        cpu::quantize_rows(host(a, {m, k}), ta, host(sa, {fp8::tiles(k), m}), true);
        if (blocks)
          cpu::quantize_blocks(host(b, {n, k}), tb, host(sb, {sr, sc}), true);
        else
          cpu::quantize_rows(host(b, {n, k}), tb, host(sb, {sr, sc}), true);
        std::vector<float> want = c0;
        cpu::gemm_fp8(ta, host(sa, {fp8::tiles(k), m}), tb, host(sb, {sr, sc}), blocks, host(want, {m, n}), 1.0f, 1.0f);
        auto d_qa = poisoned(DType::f8e4m3, {m, k}), d_qb = poisoned(DType::f8e4m3, {n, k});
        cuda::copy(d_qa.t, ta);
        cuda::copy(d_qb.t, tb);
        auto d_sa = upload(sa, DType::f32, {fp8::tiles(k), m}), d_sb = upload(sb, DType::f32, {sr, sc});
        auto d_c = upload(c0, out, {m, n});
        cuda::gemm_fp8(d_qa.t, d_sa.t, d_qb.t, d_sb.t, blocks, d_c.t, 1.0f, 1.0f);
        std::vector<float> got = download(d_c.t);
        double worst = 0, norm = max_abs(want);
        for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(got[i] - double{want[i]}));
        EXPECT_LT(worst, (out == DType::bf16 ? 8e-3 : 1e-3) * norm) << "worst " << worst << " of " << norm;
      }
}

// Codes and scales made on the CPU, uploaded as they are: the GPU products read exactly
// the CPU's inputs.
DeviceTensor upload_codes(std::vector<uint8_t>& codes, Shape shape) {
  auto d = poisoned(DType::f8e4m3, shape);
  cuda::copy(d.t, Tensor(codes.data(), shape, DType::f8e4m3));
  return d;
}

// |got - want| < bound * max |want|, the bound MatchesTheCpuOnTheSameCodes derives.
::testing::AssertionResult within(const char* what, const std::vector<float>& got, const std::vector<float>& want,
                                  double bound, double norm) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(got[i] - double{want[i]});
    if (std::isnan(d))
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << got[i] << ", want " << want[i];
    if (d > worst) worst = d, at = i;
  }
  if (worst < bound * norm) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << "[" << at << "]: " << got[at] << ", want " << want[at] << " (worst "
                                       << worst << ", bound " << bound * norm << ")";
}

struct GroupedFp8Case {
  std::vector<int32_t> counts;
  int64_t k, o;
};

// The grouped products through CUTLASS against the CPU's on the same codes, for the shapes
// the GPU takes (K and O multiples of 16, ragged against 128 too), with empty experts and
// 1-row segments: the forward y = x w^T and the input gradient (the same function on w's
// transposed blocks, y bf16). The bound is MatchesTheCpuOnTheSameCodes': Hopper's FP8
// accumulation within each 128-wide slice of the reduction, which CUTLASS promotes to f32
// per k-tile as cuBLASLt does; 8e-3 with bf16's rounding. Experts without rows write
// nothing in y.
TEST(CudaFp8GroupedGemm, MatchesTheCpuOnTheSameCodes) {
  MT_SKIP_WITHOUT_GPU();
  const GroupedFp8Case cases[] = {{{0, 1, 300, 130, 0, 129}, 256, 384},
                                  {{64, 0, 200}, 208, 336},
                                  {{17}, 128, 128},
                                  {std::vector<int32_t>(8, 512), 2048, 768}};
  uint64_t seed = 8000;
  for (const GroupedFp8Case& g : cases) {
    SCOPED_TRACE(testing::Message() << "counts " << counts_str(g.counts) << " K=" << g.k << " O=" << g.o);
    std::vector<int32_t> offsets = offsets_of(g.counts);
    const int64_t e = static_cast<int64_t>(g.counts.size()), r = offsets.back(), k = g.k, o = g.o;
    const int64_t tk = fp8::tiles(k), to = fp8::tiles(o);
    auto x = random_floats(r * k, -2, 2, ++seed), dy = random_floats(r * o, -2, 2, ++seed);
    auto w = random_floats(e * o * k, -0.1f, 0.1f, ++seed);
    auto off = host(offsets, {e + 1});
    auto d_off = upload(offsets, {e + 1});

    // Forward and input gradient: x and dy in rows, w and its transpose in blocks.
    std::vector<uint8_t> qx(r * k), qdy(r * o), qw(e * o * k), qwt(e * o * k);
    std::vector<float> sx(tk * r), sdy(to * r), sw(e * to * fp8::block_scale_cols(k)),
        swt(e * tk * fp8::block_scale_cols(o));
    const Shape sxs{tk, r}, sdys{to, r}, sws{e, to, fp8::block_scale_cols(k)}, swts{e, tk, fp8::block_scale_cols(o)};
    cpu::quantize_rows(host(x, {r, k}), Tensor(qx.data(), {r, k}, DType::f8e4m3), host(sx, sxs), true);
    cpu::quantize_rows(host(dy, {r, o}), Tensor(qdy.data(), {r, o}, DType::f8e4m3), host(sdy, sdys), true);
    cpu::quantize_blocks(host(w, {e, o, k}), Tensor(qw.data(), {e, o, k}, DType::f8e4m3), host(sw, sws), true,
                         Tensor(qwt.data(), {e, k, o}, DType::f8e4m3), host(swt, swts));
    std::vector<float> want_y(r * o), want_dx(r * k);
    cpu::grouped_gemm_fp8(Tensor(qx.data(), {r, k}, DType::f8e4m3), host(sx, sxs),
                          Tensor(qw.data(), {e, o, k}, DType::f8e4m3), host(sw, sws), off, host(want_y, {r, o}));
    cpu::grouped_gemm_fp8(Tensor(qdy.data(), {r, o}, DType::f8e4m3), host(sdy, sdys),
                          Tensor(qwt.data(), {e, k, o}, DType::f8e4m3), host(swt, swts), off, host(want_dx, {r, k}));
    auto d_qx = upload_codes(qx, {r, k}), d_qdy = upload_codes(qdy, {r, o});
    auto d_qw = upload_codes(qw, {e, o, k}), d_qwt = upload_codes(qwt, {e, k, o});
    auto d_sx = upload(sx, DType::f32, sxs), d_sdy = upload(sdy, DType::f32, sdys);
    auto d_sw = upload(sw, DType::f32, sws), d_swt = upload(swt, DType::f32, swts);
    auto d_y = poisoned(DType::bf16, {r, o}), d_dx = poisoned(DType::bf16, {r, k});
    cuda::grouped_gemm_fp8(d_qx.t, d_sx.t, d_qw.t, d_sw.t, d_off.t, d_y.t);
    cuda::grouped_gemm_fp8(d_qdy.t, d_sdy.t, d_qwt.t, d_swt.t, d_off.t, d_dx.t);
    EXPECT_TRUE(within("y", download(d_y.t), want_y, 8e-3, max_abs(want_y)));
    EXPECT_TRUE(within("dx", download(d_dx.t), want_dx, 8e-3, max_abs(want_dx)));
    // With a bias [E, O] (GPT-OSS's), added in the epilogue before y's one rounding.
    auto bias = random_floats(e * o, -1, 1, ++seed);
    std::vector<float> want_yb(r * o);
    cpu::grouped_gemm_fp8(Tensor(qx.data(), {r, k}, DType::f8e4m3), host(sx, sxs),
                          Tensor(qw.data(), {e, o, k}, DType::f8e4m3), host(sw, sws), off, host(want_yb, {r, o}),
                          host(bias, {e, o}));
    auto d_bias = upload(bias, DType::f32, {e, o});
    auto d_yb = poisoned(DType::bf16, {r, o});
    mt::grouped_gemm_fp8(d_qx.t, d_sx.t, d_qw.t, d_sw.t, d_off.t, d_yb.t, d_bias.t);
    EXPECT_TRUE(within("y with a bias", download(d_yb.t), want_yb, 8e-3, max_abs(want_yb)));

  }
}

// Shapes the CUTLASS path does not take are refused, naming them, before anything runs.
TEST(CudaFp8GroupedGemm, RefusesWhatTmaCannotMove) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t e = 2, r = 64;
  auto off = upload(std::vector<int32_t>{0, 32, 64}, {e + 1});
  {
    const int64_t k = 200, o = 128;  // K not a multiple of 16
    auto x = poisoned(DType::f8e4m3, {r, k}), sx = poisoned(DType::f32, {fp8::tiles(k), r});
    auto w = poisoned(DType::f8e4m3, {e, o, k}), sw = poisoned(DType::f32, {e, 1, fp8::block_scale_cols(k)});
    auto y = poisoned(DType::bf16, {r, o});
    EXPECT_THROW(cuda::grouped_gemm_fp8(x.t, sx.t, w.t, sw.t, off.t, y.t), Error);
  }
}

// Speed, not correctness (run with --gtest_also_run_disabled_tests): the FP8 product
// against the bf16 one, and the quantization passes, on the Qwen3-30B-A3B attention and
// dense shapes of the benchmark (8192 tokens). Prints TFLOPS and GB/s.
TEST(CudaFp8Gemm, DISABLED_TimeBenchmarkShapes) {
  MT_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t m, n, k;
  };
  for (Case sh : {Case{8192, 4096, 2048}, Case{8192, 2048, 4096}, Case{8192, 2048, 6144}, Case{4096, 2048, 8192}}) {
    const int64_t m = sh.m, n = sh.n, k = sh.k;
    auto a = random_device(DType::bf16, {m, k}, 1), b = random_device(DType::bf16, {n, k}, 2);
    auto c = random_device(DType::bf16, {m, n}, 3);
    auto qa = poisoned(DType::f8e4m3, {m, k}), qb = poisoned(DType::f8e4m3, {n, k});
    auto sa = poisoned(DType::f32, {fp8::tiles(k), m});
    auto sb = poisoned(DType::f32, {fp8::tiles(n), fp8::block_scale_cols(k)});
    cuda::quantize_blocks(b.t, qb.t, sb.t, true);
    const double flops = 2.0 * m * n * k;
    const double bf16 = median_ms(20, [&] { cuda::gemm(a.t, b.t, c.t, false, true); });
    const double f8 = median_ms(20, [&] { cuda::gemm_fp8(qa.t, sa.t, qb.t, sb.t, true, c.t); });
    const double q1 = median_ms(20, [&] { cuda::quantize_rows(a.t, qa.t, sa.t, true); });
    std::printf("M %lld N %lld K %lld: bf16 %.0f TFLOPS, fp8 %.0f TFLOPS; quantize rows %.0f GB/s\n",
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), flops / bf16 / 1e9,
                flops / f8 / 1e9, 3.0 * m * k / q1 / 1e6);
  }
}

// Speed at the benchmark's expert shapes (Qwen3-30B-A3B: 8192 tokens, top-8 of 128
// experts, balanced: 512 rows each; hidden 2048, expert FFN 768): each grouped FP8
// product against the bf16 grouped GEMM at the same shape, and the quantization passes
// that feed them. Run with --gtest_also_run_disabled_tests.
// AdamW on weights with FP8 codes updates and quantizes each 128x128 tile in one pass:
// the weights and moments bit for bit the CPU's update, the codes and scales (both
// layouts) bit for bit the CPU's quantize_blocks of them; a ragged matrix, a layer's
// experts, K not a multiple of 4 (the element-by-element path), f32 and bf16 moments.
TEST(CudaFp8AdamW, UpdateAndCodesEqualCpu) {
  MT_SKIP_WITHOUT_GPU();
  const std::vector<Shape> shapes{{130, 200}, {3, 136, 256}, {2, 128, 130}};
  for (DType moments : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(moments));
    cpu::AdamWStep s;
    s.lr = 3e-3;
    s.weight_decay = 0.1;
    s.step = 7;
    std::vector<std::vector<float>> p, g, m, v;
    std::vector<std::vector<uint8_t>> q, qt;
    std::vector<std::vector<float>> sc, sct;
    std::vector<DeviceTensor> dev;
    std::vector<AdamWBlock> cpu_blocks, gpu_blocks;
    uint64_t seed = 900;
    for (const Shape& sh : shapes) {
      const int64_t n = sh.numel(), e = sh.n == 3 ? sh.d[0] : 1, r = sh.d[sh.n - 2], k = sh.d[sh.n - 1];
      const Shape qs = sh.n == 3 ? Shape{e, fp8::tiles(r), fp8::block_scale_cols(k)} : Shape{fp8::tiles(r), fp8::block_scale_cols(k)};
      const Shape ts = sh.n == 3 ? Shape{e, k, r} : Shape{k, r};
      const Shape tss = sh.n == 3 ? Shape{e, fp8::tiles(k), fp8::block_scale_cols(r)} : Shape{fp8::tiles(k), fp8::block_scale_cols(r)};
      p.push_back(random_floats(n, -1, 1, ++seed));
      g.push_back(random_floats(n, -1, 1, ++seed));
      m.push_back(random_floats(n, -0.1f, 0.1f, ++seed));
      v.push_back(random_floats(n, 1e-4f, 1e-2f, ++seed));
      if (moments == DType::bf16) {
        m.back() = round_bf16(m.back());
        v.back() = round_bf16(v.back());
      }
      const size_t b = p.size() - 1;
      q.emplace_back(n);
      qt.emplace_back(n);
      sc.emplace_back(qs.numel());
      sct.emplace_back(tss.numel());
      for (auto* x : {&p[b], &g[b]}) dev.push_back(upload(*x, DType::f32, sh));
      for (auto* x : {&m[b], &v[b]}) dev.push_back(upload(*x, moments, sh));
      dev.push_back(poisoned(DType::f8e4m3, sh));
      dev.push_back(poisoned(DType::f32, qs));
      dev.push_back(poisoned(DType::f8e4m3, ts));
      dev.push_back(poisoned(DType::f32, tss));
      const size_t d = dev.size() - 8;
      gpu_blocks.push_back({dev[d].t, dev[d + 1].t, dev[d + 2].t, dev[d + 3].t, true, Tensor(), 1000 * b,
                            Fp8Copy{dev[d + 4].t, dev[d + 5].t, dev[d + 6].t, dev[d + 7].t, true}});
    }
    // The CPU's moments in the same dtype: bf16 ones as their bits.
    std::vector<std::vector<uint16_t>> mb(shapes.size()), vb(shapes.size());
    for (size_t b = 0; b < shapes.size(); ++b) {
      const Shape& sh = shapes[b];
      const int64_t e = sh.n == 3 ? sh.d[0] : 1, r = sh.d[sh.n - 2], k = sh.d[sh.n - 1];
      Tensor tm = host(m[b], sh), tv = host(v[b], sh);
      if (moments == DType::bf16) {
        for (float x : m[b]) mb[b].push_back(bf16_from_f32(x));
        for (float x : v[b]) vb[b].push_back(bf16_from_f32(x));
        tm = Tensor(mb[b].data(), sh, DType::bf16);
        tv = Tensor(vb[b].data(), sh, DType::bf16);
      }
      const Shape qs = sh.n == 3 ? Shape{e, fp8::tiles(r), fp8::block_scale_cols(k)} : Shape{fp8::tiles(r), fp8::block_scale_cols(k)};
      const Shape ts = sh.n == 3 ? Shape{e, k, r} : Shape{k, r};
      const Shape tss = sh.n == 3 ? Shape{e, fp8::tiles(k), fp8::block_scale_cols(r)} : Shape{fp8::tiles(k), fp8::block_scale_cols(r)};
      cpu_blocks.push_back({host(p[b], sh), host(g[b], sh), tm, tv, true, Tensor(), 1000 * b,
                            Fp8Copy{Tensor(q[b].data(), sh, DType::f8e4m3), host(sc[b], qs),
                                    Tensor(qt[b].data(), ts, DType::f8e4m3), host(sct[b], tss), true}});
    }
    cpu::adamw_step_multi(cpu_blocks, s);
    cuda::adamw_step_multi(gpu_blocks, s);
    for (size_t b = 0; b < shapes.size(); ++b) {
      SCOPED_TRACE("block " + std::to_string(b));
      EXPECT_TRUE(same_bits("param", download(gpu_blocks[b].param), p[b]));
      std::vector<float> want_m = m[b], want_v = v[b];
      if (moments == DType::bf16)
        for (size_t i = 0; i < want_m.size(); ++i) want_m[i] = f32_from_bf16(mb[b][i]), want_v[i] = f32_from_bf16(vb[b][i]);
      EXPECT_TRUE(same_bits("m", download(gpu_blocks[b].m), want_m));
      EXPECT_TRUE(same_bits("v", download(gpu_blocks[b].v), want_v));
      EXPECT_TRUE(same_codes("q", download_codes(gpu_blocks[b].fp8.q), q[b]));
      EXPECT_TRUE(same_bits("scale", download(gpu_blocks[b].fp8.scale), sc[b]));
      EXPECT_TRUE(same_codes("qt", download_codes(gpu_blocks[b].fp8.qt), qt[b]));
      EXPECT_TRUE(same_bits("scale_t", download(gpu_blocks[b].fp8.scale_t), sct[b]));
    }
  }
}

TEST(CudaFp8GroupedGemm, DISABLED_TimeBenchmarkShapes) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t e = 128, r = 8192 * 8, d = 2048, inter = 768;
  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  std::vector<int32_t> offsets;
  for (int64_t i = 0; i <= e; ++i) offsets.push_back(static_cast<int32_t>(i * r / e));
  auto off = upload(offsets, {e + 1});
  Tensor none;
  // (K, O) of gate_up and of down: y [R, O] = x [R, K] w^T, dx = dy w.
  const std::pair<int64_t, int64_t> shapes[] = {{d, 2 * inter}, {inter, d}};
  for (auto [k, o] : shapes) {
    auto x = random_device(DType::bf16, {r, k}, 1), w = random_device(DType::bf16, {e, o, k}, 2);
    auto dy = random_device(DType::bf16, {r, o}, 3);
    auto y = poisoned(DType::bf16, {r, o}), dx = poisoned(DType::bf16, {r, k});
    auto qx = poisoned(DType::f8e4m3, {r, k}), sx = poisoned(DType::f32, {fp8::tiles(k), r});
    auto qdy = poisoned(DType::f8e4m3, {r, o}), sdy = poisoned(DType::f32, {fp8::tiles(o), r});
    auto qw = poisoned(DType::f8e4m3, {e, o, k}), sw = poisoned(DType::f32, {e, fp8::tiles(o), fp8::block_scale_cols(k)});
    auto qwt = poisoned(DType::f8e4m3, {e, k, o}), swt = poisoned(DType::f32, {e, fp8::tiles(k), fp8::block_scale_cols(o)});
    const double qr = median_ms(10, [&] { cuda::quantize_rows(x.t, qx.t, sx.t, true); });
    const double qbl = median_ms(10, [&] { cuda::quantize_blocks(w.t, qw.t, sw.t, true, qwt.t, swt.t); });
    cuda::quantize_rows(dy.t, qdy.t, sdy.t, true);
    const double flops = 2.0 * r * k * o;
    const double f16 = median_ms(10, [&] { cuda::grouped_gemm(x.t, w.t, none, off.t, y.t); });
    const double f8 = median_ms(10, [&] { cuda::grouped_gemm_fp8(qx.t, sx.t, qw.t, sw.t, off.t, y.t); });
    const double b16 = median_ms(10, [&] { cuda::grouped_gemm_backward_input(dy.t, w.t, off.t, dx.t); });
    const double b8 = median_ms(10, [&] { cuda::grouped_gemm_fp8(qdy.t, sdy.t, qwt.t, swt.t, off.t, dx.t); });
    std::printf("E %ld R %ld K %ld O %ld, TFLOPS fp8 (bf16): forward %.0f (%.0f), input grad %.0f (%.0f)\n",
                static_cast<long>(e), static_cast<long>(r), static_cast<long>(k), static_cast<long>(o),
                tflops(flops, f8), tflops(flops, f16), tflops(flops, b8), tflops(flops, b16));
    // Bytes moved: bf16 in, codes and scales out (the transposed copy doubles the codes).
    std::printf("  quantize GB/s: rows of x %.0f, blocks of w with transpose %.0f\n", 3.0 * r * k / qr / 1e6,
                4.0 * e * o * k / qbl / 1e6);
  }
}

}  // namespace
}  // namespace mt::gpu_test
