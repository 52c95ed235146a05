// cuBLASLt gemm and the grouped expert gemm against the CPU backend.
//
// Tolerance of a K-term product. The operands are bf16 on both sides (the CPU reads the
// same rounded values in f32), and a product of two bf16 values is exact in f32, so the
// backends differ only in how they add the K products in f32: each sum rounds by at
// most 2^-24 of the running total, and tensor cores may truncate rather than round
// (2^-23), so each side is within K 2^-23 S of the exact sum, S = sum_k |a_k b_k| (the
// same product over |a| and |b|, computed here by the CPU op on absolute values).
// Together: |gpu - cpu| <= K 2^-22 S, plus one rounding of the output to bf16 (2^-8
// relative) when the output is bf16. Accumulated outputs add |beta c0| to S.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <utility>

#include "gpu/gpu_test.h"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "test_util.h"

namespace mt::gpu_test {
namespace {

Tol product_tol(int64_t k, std::vector<float> s, DType out) {
  const double factor = static_cast<double>(std::max<int64_t>(k, 1)) * 4.0 * kF32Round;
  for (float& x : s) x = static_cast<float>(x * factor);
  return Tol{out == DType::bf16 ? kBf16Round : 0.0, 0.0, std::move(s)};
}

struct GemmCase {
  int64_t m, n, k;
  bool ta, tb;
  float alpha, beta;
  DType out;
};

std::string describe(const GemmCase& g) {
  std::ostringstream s;
  s << "M=" << g.m << " N=" << g.n << " K=" << g.k << " ta=" << g.ta << " tb=" << g.tb << " alpha=" << g.alpha
    << " beta=" << g.beta << " out=" << dtype_name(g.out);
  return s.str();
}

// The CPU table's shapes (every transpose pair, one row, one column, K not a multiple of
// 8, accumulation), then shapes spanning several tiles and an empty reduction.
std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> cases;
  for (DType out : {DType::bf16, DType::f32}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) cases.push_back({7, 5, 3, ta, tb, 1.0f, 0.0f, out});
    cases.push_back({1, 9, 13, false, true, 1.0f, 0.0f, out});
    cases.push_back({33, 1, 17, true, false, 1.0f, 0.5f, out});
    cases.push_back({130, 24, 129, false, true, 1.0f, 1.0f, out});
    cases.push_back({300, 257, 520, true, false, 0.5f, 1.0f, out});
    cases.push_back({512, 384, 256, false, true, 1.0f, 0.0f, out});
    cases.push_back({6, 5, 0, false, false, 1.0f, 0.5f, out});
  }
  return cases;
}

TEST(CudaGemm, ForwardMatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 1;
  for (const GemmCase& g : gemm_cases()) {
    SCOPED_TRACE(describe(g));
    Shape sa = g.ta ? Shape{g.k, g.m} : Shape{g.m, g.k};
    Shape sb = g.tb ? Shape{g.n, g.k} : Shape{g.k, g.n};
    auto a = round_bf16(random_floats(sa.numel(), -1, 1, ++seed));
    auto b = round_bf16(random_floats(sb.numel(), -1, 1, ++seed));
    auto c0 = random_floats(g.m * g.n, -1, 1, ++seed);
    if (g.out == DType::bf16) c0 = round_bf16(c0);

    auto want = c0;
    cpu::gemm(host(a, sa), host(b, sb), host(want, {g.m, g.n}), g.ta, g.tb, g.alpha, g.beta);
    auto aa = abs_of(a), ab = abs_of(b), bound = abs_of(c0);
    cpu::gemm(host(aa, sa), host(ab, sb), host(bound, {g.m, g.n}), g.ta, g.tb, std::fabs(g.alpha), std::fabs(g.beta));

    auto da = upload(a, DType::bf16, sa), db = upload(b, DType::bf16, sb);
    // beta = 0 must not read c: poison it. Otherwise c holds c0.
    auto dc = g.beta == 0.0f ? poisoned(g.out, {g.m, g.n}) : upload(c0, g.out, {g.m, g.n});
    cuda::gemm(da.t, db.t, dc.t, g.ta, g.tb, g.alpha, g.beta);
    EXPECT_TRUE(near("c", download(dc.t), want, product_tol(g.k, bound, g.out)));
  }
}

// dA and dB of every transpose pair, overwritten (into poison) and accumulated (f32, as
// weight gradients are).
TEST(CudaGemm, BackwardMatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (const GemmCase& g : gemm_cases()) {
    for (bool accumulate : {false, true}) {
      const DType gd = accumulate ? DType::f32 : g.out;
      SCOPED_TRACE(describe(g) + (accumulate ? " accumulate" : ""));
      Shape sa = g.ta ? Shape{g.k, g.m} : Shape{g.m, g.k};
      Shape sb = g.tb ? Shape{g.n, g.k} : Shape{g.k, g.n};
      auto a = round_bf16(random_floats(sa.numel(), -1, 1, ++seed));
      auto b = round_bf16(random_floats(sb.numel(), -1, 1, ++seed));
      auto dc = round_bf16(random_floats(g.m * g.n, -1, 1, ++seed));
      auto da0 = random_floats(sa.numel(), -1, 1, ++seed), db0 = random_floats(sb.numel(), -1, 1, ++seed);

      auto want_da = da0, want_db = db0;
      test::gemm_backward(host(a, sa), host(b, sb), host(dc, {g.m, g.n}), g.ta, g.tb, host(want_da, sa),
                         host(want_db, sb), accumulate);
      auto aa = abs_of(a), ab = abs_of(b), adc = abs_of(dc);
      auto bound_da = accumulate ? abs_of(da0) : std::vector<float>(da0.size(), 0.0f);
      auto bound_db = accumulate ? abs_of(db0) : std::vector<float>(db0.size(), 0.0f);
      test::gemm_backward(host(aa, sa), host(ab, sb), host(adc, {g.m, g.n}), g.ta, g.tb, host(bound_da, sa),
                         host(bound_db, sb), true);

      auto d_a = upload(a, DType::bf16, sa), d_b = upload(b, DType::bf16, sb);
      auto d_dc = upload(dc, DType::bf16, {g.m, g.n});
      auto d_da = accumulate ? upload(da0, gd, sa) : poisoned(gd, sa);
      auto d_db = accumulate ? upload(db0, gd, sb) : poisoned(gd, sb);
      test::gemm_backward(d_a.t, d_b.t, d_dc.t, g.ta, g.tb, d_da.t, d_db.t, accumulate);
      // dA reduces over N, dB over M.
      EXPECT_TRUE(near("da", download(d_da.t), want_da, product_tol(g.n, bound_da, gd)));
      EXPECT_TRUE(near("db", download(d_db.t), want_db, product_tol(g.m, bound_db, gd)));
    }
  }
}

struct GroupedCase {
  std::vector<int32_t> counts;
  int64_t k, o;
  bool bias, accumulate;
  DType out;
};

// Rows per expert drawn uniformly from [0, 2 * mean], with the experts in `empty` forced
// to none: the uneven segments routing produces.
std::vector<int32_t> random_counts(int64_t experts, int32_t mean, std::vector<int64_t> empty, uint64_t seed) {
  std::vector<int32_t> counts = random_ints(experts, 0, 2 * mean, seed);
  for (int64_t e : empty) counts[static_cast<size_t>(e)] = 0;
  return counts;
}

// The CPU table's rows (one row, empty experts first, last, between and all but one, K
// and O not multiples of 8 or 128, one expert), then segments spanning several 128-row
// tiles with the operands 16-byte aligned (vector loads) and not. Then the cases the
// CUTLASS path takes (bf16 out, K and O multiples of 8): empty experts at both ends and
// between, every expert empty, O not a multiple of the 128 or 256 tile, more experts than
// a warp scans at once and than one planning block covers, and Qwen3-30B-A3B's two
// expert products (K=2048, O=1536 and K=768, O=2048) with uneven segments around 512 rows.
// With a bias (the epilogue's, and dbias's two passes): empty experts at both ends, O
// not a multiple of the tile, segments of many 128-row tiles (more than dbias's 8 warps
// take at once), and one expert (a dense Linear with bias: GPT-OSS's attention) short and
// long, with and without accumulation.
std::vector<GroupedCase> grouped_cases() {
  return {
      {{0, 1, 0}, 5, 3, true, false, DType::bf16},
      {{0, 3, 0, 5, 0}, 7, 6, false, false, DType::bf16},
      {{4, 9, 1, 13}, 33, 20, true, true, DType::f32},
      {{11}, 129, 9, false, true, DType::bf16},
      {{6, 0, 3, 9}, 12, 130, true, false, DType::f32},
      {{9}, 6, 5, true, false, DType::bf16},
      {{300, 0, 129, 1, 260, 0, 0, 517}, 200, 260, false, true, DType::bf16},
      {{128, 256, 0, 77, 301}, 256, 384, true, false, DType::bf16},
      {{0, 0, 0}, 16, 8, true, true, DType::bf16},
      {{0, 200, 0, 37, 513, 0}, 64, 136, false, false, DType::bf16},
      {{1, 0, 255, 129, 8}, 256, 512, false, true, DType::bf16},
      {{0, 0, 0, 0}, 32, 16, false, false, DType::bf16},
      {{300, 0, 129, 1, 260}, 200, 264, true, true, DType::f32},
      {random_counts(160, 20, {0, 31, 32, 100, 159}, 71), 64, 96, false, true, DType::bf16},
      {random_counts(16, 512, {3, 11}, 72), 2048, 1536, false, false, DType::bf16},
      {random_counts(8, 512, {0}, 73), 768, 2048, false, true, DType::bf16},
      {random_counts(24, 300, {0, 9, 23}, 74), 256, 520, true, true, DType::bf16},
      {{0, 1500, 3, 0, 700}, 64, 264, true, false, DType::bf16},
      {{2048}, 512, 640, true, false, DType::bf16},
      {{1000}, 64, 24, true, true, DType::bf16},
      {{5}, 16, 8, true, false, DType::bf16},
  };
}

std::string describe(const GroupedCase& g) {
  std::ostringstream s;
  s << "counts=";
  for (size_t i = 0; i < g.counts.size() && i < 24; ++i) s << (i ? "," : "") << g.counts[i];
  if (g.counts.size() > 24) s << ",... (" << g.counts.size() << " experts)";
  s << " K=" << g.k << " O=" << g.o << " bias=" << g.bias << " acc=" << g.accumulate << " out=" << dtype_name(g.out);
  return s.str();
}

// The routes a grouped product can take (kernels/cuda/grouped_gemm_sm90.cuh): the public
// function's choice, CUTLASS called directly, and the WMMA kernel called directly. A case
// with K and O multiples of 8 runs all three, so neither implementation goes untested at
// the shapes CUTLASS takes (and CUTLASS must decline what it was not built for); the
// others only reach the WMMA kernel, through the public functions.
enum class Route { dispatch, sm90, wmma };

const char* route_name(Route r) { return r == Route::dispatch ? "dispatch" : r == Route::sm90 ? "sm90" : "wmma"; }

TEST(CudaGroupedGemm, ForwardAndBackwardMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 500;
  for (const GroupedCase& g : grouped_cases()) {
    SCOPED_TRACE(describe(g));
    const int64_t e = static_cast<int64_t>(g.counts.size());
    std::vector<int32_t> offsets{0};
    int64_t longest = 0;
    for (int32_t c : g.counts) {
      offsets.push_back(offsets.back() + c);
      longest = std::max<int64_t>(longest, c);
    }
    const int64_t n = offsets.back();
    auto x = round_bf16(random_floats(n * g.k, -1, 1, ++seed));
    auto w = round_bf16(random_floats(e * g.o * g.k, -1, 1, ++seed));
    auto bias = random_floats(e * g.o, -1, 1, ++seed);
    auto dy = round_bf16(random_floats(n * g.o, -1, 1, ++seed));
    auto dw0 = random_floats(e * g.o * g.k, -1, 1, ++seed), db0 = random_floats(e * g.o, -1, 1, ++seed);
    auto ax = abs_of(x), aw = abs_of(w), ady = abs_of(dy), abias = abs_of(bias);
    Tensor none;
    auto off = host(offsets, {e + 1});

    // Forward: y = x w^T + bias.
    std::vector<float> want_y(n * g.o), bound_y(n * g.o);
    cpu::grouped_gemm(host(x, {n, g.k}), host(w, {e, g.o, g.k}), g.bias ? host(bias, {e, g.o}) : none, off,
                      host(want_y, {n, g.o}));
    cpu::grouped_gemm(host(ax, {n, g.k}), host(aw, {e, g.o, g.k}), g.bias ? host(abias, {e, g.o}) : none, off,
                      host(bound_y, {n, g.o}));
    // B: dx = dy w, reducing over O.
    std::vector<float> want_dx(n * g.k), bound_dx(n * g.k);
    cpu::grouped_gemm_backward_input(host(dy, {n, g.o}), host(w, {e, g.o, g.k}), off, host(want_dx, {n, g.k}));
    cpu::grouped_gemm_backward_input(host(ady, {n, g.o}), host(aw, {e, g.o, g.k}), off, host(bound_dx, {n, g.k}));
    // W: dw = dy^T x and dbias = column sums of dy over each segment, reducing over its
    // rows (at most `longest`); f32, accumulated onto dw0/db0 or overwriting poison.
    auto want_dw = dw0, want_db = db0;
    cpu::grouped_gemm_backward_weight(host(x, {n, g.k}), host(dy, {n, g.o}), off, host(want_dw, {e, g.o, g.k}),
                                      g.bias ? host(want_db, {e, g.o}) : none, g.accumulate);
    auto bound_dw = g.accumulate ? abs_of(dw0) : std::vector<float>(dw0.size(), 0.0f);
    auto bound_db = g.accumulate ? abs_of(db0) : std::vector<float>(db0.size(), 0.0f);
    cpu::grouped_gemm_backward_weight(host(ax, {n, g.k}), host(ady, {n, g.o}), off, host(bound_dw, {e, g.o, g.k}),
                                      host(bound_db, {e, g.o}), true);

    auto d_x = upload(x, DType::bf16, {n, g.k}), d_w = upload(w, DType::bf16, {e, g.o, g.k});
    auto d_bias = upload(bias, DType::f32, {e, g.o}), d_off = upload(offsets, {e + 1});
    auto d_dy = upload(dy, DType::bf16, {n, g.o});
    // What CUTLASS must take (the device buffers are 256-byte aligned): TMA rows of
    // 16-byte multiples, the model's dtypes, with or without a bias.
    const bool tma = g.k > 0 && g.k % 8 == 0 && g.o > 0 && g.o % 8 == 0;
    const bool sm90 = tma && g.out == DType::bf16;
    for (Route route : {Route::dispatch, Route::sm90, Route::wmma}) {
      if (route != Route::dispatch && !tma) continue;
      SCOPED_TRACE(std::string("route ") + route_name(route));

      auto d_y = poisoned(g.out, {n, g.o});
      if (route == Route::dispatch) {
        cuda::grouped_gemm(d_x.t, d_w.t, g.bias ? d_bias.t : none, d_off.t, d_y.t);
      } else if (route == Route::wmma) {
        cuda::grouped_gemm_wmma(d_x.t, d_w.t, g.bias ? d_bias.t : none, d_off.t, d_y.t);
      } else {
        EXPECT_EQ(cuda::grouped_gemm_sm90(d_x.t, d_w.t, g.bias ? d_bias.t : none, d_off.t, d_y.t), sm90);
      }
      if (route != Route::sm90 || sm90) {
        EXPECT_TRUE(near("y", download(d_y.t), want_y, product_tol(g.k, bound_y, g.out)));
      }

      auto d_dx = poisoned(g.out, {n, g.k});
      if (route == Route::dispatch) {
        cuda::grouped_gemm_backward_input(d_dy.t, d_w.t, d_off.t, d_dx.t);
      } else if (route == Route::wmma) {
        cuda::grouped_gemm_backward_input_wmma(d_dy.t, d_w.t, d_off.t, d_dx.t);
      } else {
        EXPECT_EQ(cuda::grouped_gemm_backward_input_sm90(d_dy.t, d_w.t, d_off.t, d_dx.t), sm90);
      }
      if (route != Route::sm90 || sm90) {
        EXPECT_TRUE(near("dx", download(d_dx.t), want_dx, product_tol(g.o, bound_dx, g.out)));
      }

      auto d_dw = g.accumulate ? upload(dw0, DType::f32, {e, g.o, g.k}) : poisoned(DType::f32, {e, g.o, g.k});
      auto d_db = g.accumulate ? upload(db0, DType::f32, {e, g.o}) : poisoned(DType::f32, {e, g.o});
      if (route == Route::dispatch) {
        cuda::grouped_gemm_backward_weight(d_x.t, d_dy.t, d_off.t, d_dw.t, g.bias ? d_db.t : none, g.accumulate);
      } else if (route == Route::wmma) {
        cuda::grouped_gemm_backward_weight_wmma(d_x.t, d_dy.t, d_off.t, d_dw.t, g.accumulate);
      } else {
        EXPECT_TRUE(cuda::grouped_gemm_backward_weight_sm90(d_x.t, d_dy.t, d_off.t, d_dw.t, g.accumulate));
      }
      EXPECT_TRUE(near("dw", download(d_dw.t), want_dw, product_tol(longest, bound_dw, DType::f32)));
      // The bias gradient adds the same bf16 values in f32, the CPU row by row, the GPU
      // in 128-row tiles and then the tiles: a sum of `longest` terms on each side. Only
      // the public function computes it; it repeats bit for bit.
      if (g.bias && route == Route::dispatch) {
        const std::vector<float> got_db = download(d_db.t);
        EXPECT_TRUE(near("dbias", got_db, want_db, product_tol(longest, bound_db, DType::f32)));
        auto d_db2 = g.accumulate ? upload(db0, DType::f32, {e, g.o}) : poisoned(DType::f32, {e, g.o});
        cuda::grouped_gemm_backward_weight(d_x.t, d_dy.t, d_off.t, d_dw.t, d_db2.t, g.accumulate);
        EXPECT_TRUE(near("dbias again", download(d_db2.t), got_db, Tol{}));
      }
    }
  }
}

// A window of experts [1, 4) of 5 (the expert cache's lines, models/expert_cache.h): the
// full call's rows and gradients bit for bit on every route, the other rows untouched
// (poison stays poison), bf16 and f32 outputs, a bias, both W modes.
TEST(CudaGroupedGemm, AWindowOfExpertsMatchesTheFullCall) {
  MT_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> counts = {130, 0, 257, 64, 9};
  const int64_t e = 5, k = 64, o = 136, e0 = 1, e1 = 4;
  std::vector<int32_t> offsets{0};
  for (int32_t c : counts) offsets.push_back(offsets.back() + c);
  const int64_t n = offsets.back();
  auto d_x = upload(round_bf16(random_floats(n * k, -1, 1, 91)), DType::bf16, {n, k});
  auto d_w = upload(round_bf16(random_floats(e * o * k, -1, 1, 92)), DType::bf16, {e, o, k});
  auto d_bias = upload(random_floats(e * o, -1, 1, 93), DType::f32, {e, o});
  auto d_dy = upload(round_bf16(random_floats(n * o, -1, 1, 94)), DType::bf16, {n, o});
  const std::vector<float> dw0 = random_floats(e * o * k, -1, 1, 95), db0 = random_floats(e * o, -1, 1, 96);
  auto d_off = upload(offsets, {e + 1});
  const Tensor off_w = d_off.t.rows(e0, e1 + 1), w_w = d_w.t.rows(e0, e1), bias_w = d_bias.t.rows(e0, e1);
  const int64_t r0 = offsets[e0], r1 = offsets[e1];
  auto expect_window = [&](const char* what, const Tensor& full, const Tensor& window, int64_t width) {
    const std::vector<float> f = download(full), w = download(window);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < width; ++j) {
        const size_t i = static_cast<size_t>(r * width + j);
        if (r >= r0 && r < r1) {
          ASSERT_EQ(f[i], w[i]) << what << " row " << r << " col " << j;
        } else {
          ASSERT_TRUE(std::isnan(w[i])) << what << " row " << r << " outside the window was written";
        }
      }
  };
  for (DType out : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(out));
    auto y = poisoned(out, {n, o}), yw = poisoned(out, {n, o});
    cuda::grouped_gemm(d_x.t, d_w.t, d_bias.t, d_off.t, y.t);
    cuda::grouped_gemm(d_x.t, w_w, bias_w, off_w, yw.t);
    expect_window("y", y.t, yw.t, o);
    auto dx = poisoned(out, {n, k}), dxw = poisoned(out, {n, k});
    cuda::grouped_gemm_backward_input(d_dy.t, d_w.t, d_off.t, dx.t);
    cuda::grouped_gemm_backward_input(d_dy.t, w_w, off_w, dxw.t);
    expect_window("dx", dx.t, dxw.t, k);
  }
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
    auto dw = upload(dw0, DType::f32, {e, o, k}), db = upload(db0, DType::f32, {e, o});
    auto dww = upload(dw0, DType::f32, {e, o, k}), dbw = upload(db0, DType::f32, {e, o});
    cuda::grouped_gemm_backward_weight(d_x.t, d_dy.t, d_off.t, dw.t, db.t, accumulate);
    cuda::grouped_gemm_backward_weight(d_x.t, d_dy.t, off_w, dww.t.rows(e0, e1), dbw.t.rows(e0, e1), accumulate);
    const std::vector<float> a = download(dw.t), b = download(dww.t), c = download(db.t), d = download(dbw.t);
    for (int64_t x = 0; x < e; ++x) {
      const bool in = x >= e0 && x < e1;
      for (int64_t i = x * o * k; i < (x + 1) * o * k; ++i)
        ASSERT_EQ(b[static_cast<size_t>(i)], in ? a[static_cast<size_t>(i)] : dw0[static_cast<size_t>(i)]) << x;
      for (int64_t i = x * o; i < (x + 1) * o; ++i)
        ASSERT_EQ(d[static_cast<size_t>(i)], in ? c[static_cast<size_t>(i)] : db0[static_cast<size_t>(i)]) << x;
    }
  }
}

// Speed at the benchmark's shapes (Qwen3-30B-A3B: 8192 tokens, top-8 of 128 experts,
// hidden 2048, expert FFN 768, vocabulary 151936), balanced routing, random bf16 data.
// Not a correctness test; run with --gtest_also_run_disabled_tests.
TEST(CudaGemm, DISABLED_TimeBenchmarkShapes) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t tokens = 8192, e = 128, rows = tokens * 8, d = 2048, inter = 768, vocab = 151936;
  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  std::vector<int32_t> offsets;
  for (int64_t i = 0; i <= e; ++i) offsets.push_back(static_cast<int32_t>(i * rows / e));
  auto off = upload(offsets, {e + 1});
  Tensor none;
  // (K, O) of gate_up and of down.
  const std::pair<int64_t, int64_t> shapes[] = {{d, 2 * inter}, {inter, d}};
  for (auto [k, o] : shapes) {
    auto x = random_device(DType::bf16, {rows, k}, 1), w = random_device(DType::bf16, {e, o, k}, 2);
    auto dy = random_device(DType::bf16, {rows, o}, 3);
    auto y = poisoned(DType::bf16, {rows, o}), dx = poisoned(DType::bf16, {rows, k});
    auto dw = random_device(DType::f32, {e, o, k}, 4);
    const double flops = 2.0 * rows * k * o;
    double f = median_ms(10, [&] { cuda::grouped_gemm(x.t, w.t, none, off.t, y.t); });
    double b = median_ms(10, [&] { cuda::grouped_gemm_backward_input(dy.t, w.t, off.t, dx.t); });
    double wg = median_ms(10, [&] { cuda::grouped_gemm_backward_weight(x.t, dy.t, off.t, dw.t, none, true); });
    std::printf("  grouped_gemm rows=%ld E=%ld K=%ld O=%ld: forward %.3f ms (%.0f TFLOPS), B %.3f ms (%.0f), "
                "W %.3f ms (%.0f)\n",
                static_cast<long>(rows), static_cast<long>(e), static_cast<long>(k), static_cast<long>(o), f,
                tflops(flops, f), b, tflops(flops, b), wg, tflops(flops, wg));
  }
  // GPT-OSS-120B's biased products (hidden 2880): the experts' gate_up (32 of 128 experts
  // on this rank, 8192 tokens top-4, O = 5760) and q, k, v as one expert (O = 64 + 2 x 8
  // heads of 64), with and without bias and dbias, and the dense product through cuBLASLt.
  const struct {
    const char* what;
    int64_t e, rows, k, o;
  } biased[] = {{"gpt-oss experts gate_up", 32, 32768, 2880, 5760}, {"gpt-oss qkv (E=1)", 1, 8192, 2880, 5120}};
  for (const auto& b : biased) {
    std::vector<int32_t> off_b;
    for (int64_t i = 0; i <= b.e; ++i) off_b.push_back(static_cast<int32_t>(i * b.rows / b.e));
    auto ob = upload(off_b, {b.e + 1});
    auto x = random_device(DType::bf16, {b.rows, b.k}, 11), w = random_device(DType::bf16, {b.e, b.o, b.k}, 12);
    auto bias = random_device(DType::f32, {b.e, b.o}, 13), dy = random_device(DType::bf16, {b.rows, b.o}, 14);
    auto y = poisoned(DType::bf16, {b.rows, b.o}), dw = random_device(DType::f32, {b.e, b.o, b.k}, 15);
    auto db = random_device(DType::f32, {b.e, b.o}, 16);
    const double flops = 2.0 * b.rows * b.k * b.o;
    double f = median_ms(10, [&] { cuda::grouped_gemm(x.t, w.t, none, ob.t, y.t); });
    double fb = median_ms(10, [&] { cuda::grouped_gemm(x.t, w.t, bias.t, ob.t, y.t); });
    double wg = median_ms(10, [&] { cuda::grouped_gemm_backward_weight(x.t, dy.t, ob.t, dw.t, none, true); });
    double wb = median_ms(10, [&] { cuda::grouped_gemm_backward_weight(x.t, dy.t, ob.t, dw.t, db.t, true); });
    std::printf("  %s rows=%ld K=%ld O=%ld: forward %.3f ms (%.0f TFLOPS), with bias %.3f ms (%.0f); W %.3f ms, "
                "with dbias %.3f ms\n",
                b.what, static_cast<long>(b.rows), static_cast<long>(b.k), static_cast<long>(b.o), f,
                tflops(flops, f), fb, tflops(flops, fb), wg, wb);
    if (b.e == 1) {
      double dense = median_ms(10, [&] { cuda::gemm(x.t, w.t.view({b.o, b.k}), y.t, false, true); });
      std::printf("    the same x w^T through cuBLASLt, no bias: %.3f ms (%.0f TFLOPS)\n", dense, tflops(flops, dense));
    }
  }

  // The LM head through cuBLASLt, f32 logits, and its weight gradient accumulated in f32.
  auto h = random_device(DType::bf16, {tokens, d}, 5), head = random_device(DType::bf16, {vocab, d}, 6);
  auto logits = poisoned(DType::f32, {tokens, vocab});
  auto dlogits = random_device(DType::bf16, {tokens, vocab}, 7);
  auto dhead = random_device(DType::f32, {vocab, d}, 8);
  const double flops = 2.0 * tokens * d * vocab;
  double f = median_ms(10, [&] { cuda::gemm(h.t, head.t, logits.t, false, true); });
  double wg = median_ms(10, [&] { cuda::gemm(dlogits.t, h.t, dhead.t, true, false, 1.0f, 1.0f); });
  std::printf("  gemm LM head %ldx%ldx%ld: forward %.3f ms (%.0f TFLOPS), weight gradient %.3f ms (%.0f)\n",
              static_cast<long>(tokens), static_cast<long>(vocab), static_cast<long>(d), f, tflops(flops, f), wg,
              tflops(flops, wg));
}

}  // namespace
}  // namespace mt::gpu_test
