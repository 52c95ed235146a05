// Embedding, RMSNorm, RoPE and the gated activations on the GPU against the CPU backend,
// bf16 activations and f32 weights/statistics as the model runs them, on the CPU op
// table's shapes plus rows wider than one block or warp. Each tolerance is derived where
// it is used; kBf16Round (2^-8) is one rounding of an output to bf16.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <tuple>

#include "gpu/gpu_test.h"
#include "kernels/cuda/runtime.h"
#include "kernels/deltanet.h"
#include "kernels/embedding.h"
#include "kernels/gated_delta.h"
#include "kernels/elementwise.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/router.h"
#include "kernels/swiglu.h"

namespace mt::gpu_test {
namespace {

struct EmbeddingCase {
  int64_t vocab, dim, tokens;
  DType table, out;
};

TEST(CudaEmbedding, ForwardAndBackwardMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 1000;
  // The CPU table's shapes (ids repeat; one token), then a row wider than a block.
  const EmbeddingCase cases[] = {{11, 6, 20, DType::f32, DType::bf16},
                                 {3, 1, 1, DType::bf16, DType::bf16},
                                 {50, 1000, 77, DType::f32, DType::f32},
                                 {7, 2048, 300, DType::bf16, DType::f32}};
  for (const EmbeddingCase& c : cases) {
    std::ostringstream what;
    what << "V=" << c.vocab << " D=" << c.dim << " N=" << c.tokens << " table=" << dtype_name(c.table)
         << " out=" << dtype_name(c.out);
    SCOPED_TRACE(what.str());
    auto table = random_floats(c.vocab * c.dim, -1, 1, ++seed);
    if (c.table == DType::bf16) table = round_bf16(table);
    auto ids = random_ints(c.tokens, 0, static_cast<int32_t>(c.vocab - 1), ++seed);
    auto dout = round_bf16(random_floats(c.tokens * c.dim, -1, 1, ++seed));
    auto dtable0 = random_floats(c.vocab * c.dim, -1, 1, ++seed);

    // Forward: a copy (and at most one rounding to bf16, the same on both sides): exact.
    std::vector<float> want(c.tokens * c.dim);
    cpu::embedding_forward(host(table, {c.vocab, c.dim}), host(ids, {c.tokens}), host(want, {c.tokens, c.dim}));
    if (c.out == DType::bf16) want = round_bf16(want);
    auto d_table = upload(table, c.table, {c.vocab, c.dim});
    auto d_ids = upload(ids, {c.tokens});
    auto d_out = poisoned(c.out, {c.tokens, c.dim});
    cuda::embedding_forward(d_table.t, d_ids.t, d_out.t);
    EXPECT_TRUE(near("out", download(d_out.t), want, Tol{}));

    // Backward into a non-zero f32 gradient. The GPU adds a repeated token's rows in any
    // order, the CPU in token order: each side rounds once per added row (2^-24 of the
    // running sum), so |gpu - cpu| <= 2 N 2^-24 (|dtable0| + sum of |dout| added).
    auto want_dt = dtable0;
    cpu::embedding_backward(host(ids, {c.tokens}), host(dout, {c.tokens, c.dim}), host(want_dt, {c.vocab, c.dim}));
    auto bound = abs_of(dtable0), adout = abs_of(dout);
    cpu::embedding_backward(host(ids, {c.tokens}), host(adout, {c.tokens, c.dim}), host(bound, {c.vocab, c.dim}));
    for (float& b : bound) b = static_cast<float>(b * 2.0 * c.tokens * kF32Round);
    auto d_dout = upload(dout, DType::bf16, {c.tokens, c.dim});
    auto d_dt = upload(dtable0, DType::f32, {c.vocab, c.dim});
    cuda::embedding_backward(d_ids.t, d_dout.t, d_dt.t);
    EXPECT_TRUE(near("dtable", download(d_dt.t), want_dt, Tol{0, 0, bound}));
  }
}

// An id outside the vocabulary gives a NaN row, not a read out of bounds.
TEST(CudaEmbedding, BadIdGivesNanRow) {
  MT_SKIP_WITHOUT_GPU();
  std::vector<float> table = random_floats(4 * 3, -1, 1, 7);
  std::vector<int32_t> ids{1, 4};
  auto d_table = upload(table, DType::f32, {4, 3});
  auto d_ids = upload(ids, {2});
  // Zeros, not poison: the NaN must come from the kernel.
  DeviceTensor d_out(DType::f32, {2, 3});
  CUDA_CHECK(cudaMemsetAsync(d_out.t.data, 0, d_out.t.nbytes(), cuda::stream()));
  cuda::embedding_forward(d_table.t, d_ids.t, d_out.t);
  auto out = download(d_out.t);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(out[j], table[3 + j]);
    EXPECT_TRUE(std::isnan(out[3 + j]));
  }
}

struct NormCase {
  int64_t rows, dim;
  float eps;
  DType act;  // x, y, dy, dx
};

TEST(CudaRmsnorm, ForwardAndBackwardMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 2000;
  // The CPU table's shapes, q/k-norm shapes (many rows of head_dim: the 16-byte dw
  // path over few and many chunks, chunks that are not whole row groups), a hidden row,
  // a narrow one, and the f32 path.
  const NormCase cases[] = {{1, 5, 1e-6f, DType::bf16},      {9, 131, 1e-5f, DType::bf16},
                            {1000, 128, 1e-6f, DType::bf16},   {40000, 128, 1e-6f, DType::bf16},
                            {37, 2048, 1e-6f, DType::bf16},    {8, 16, 1e-6f, DType::bf16},
                            {9, 131, 1e-5f, DType::f32}};
  for (const NormCase& c : cases) {
    std::ostringstream what;
    what << "N=" << c.rows << " D=" << c.dim << " act=" << dtype_name(c.act);
    SCOPED_TRACE(what.str());
    const int64_t n = c.rows, d = c.dim;
    const double u = kF32Round, fd = static_cast<double>(d);
    auto x = random_floats(n * d, -2, 2, ++seed), dy = random_floats(n * d, -1, 1, ++seed);
    if (c.act == DType::bf16) {
      x = round_bf16(x);
      dy = round_bf16(dy);
    }
    auto w = random_floats(d, 0.5f, 1.5f, ++seed), dw0 = random_floats(d, -1, 1, ++seed);
    const double out_round = c.act == DType::bf16 ? kBf16Round : 0.0;

    // Forward. The sum of squares of D terms differs by the order of the additions,
    // D 2^-24 relative on each side; rstd (a square root of its inverse) inherits half
    // of that, y = x rstd w adds two roundings; then y is rounded to bf16.
    std::vector<float> want_y(n * d), want_r(n);
    cpu::rmsnorm_forward(host(x, {n, d}), host(w, {d}), c.eps, host(want_y, {n, d}), host(want_r, {n}));
    auto d_x = upload(x, c.act, {n, d}), d_w = upload(w, DType::f32, {d});
    auto d_y = poisoned(c.act, {n, d}), d_r = poisoned(DType::f32, {n});
    cuda::rmsnorm_forward(d_x.t, d_w.t, c.eps, d_y.t, d_r.t);
    EXPECT_TRUE(near("rstd", download(d_r.t), want_r, Tol{(fd + 4) * u}));
    EXPECT_TRUE(near("y", download(d_y.t), want_y, Tol{out_round + (2 * fd + 8) * u}));

    // Backward from the CPU's rstd, so only the backward's own arithmetic differs.
    // dx = r (w dy - xhat dot), dot = mean(w dy xhat) over D terms of three products
    // each: the sides' dots differ by (2 D + 8) 2^-24 mean|w dy xhat|, and the
    // subtraction may cancel, so the bound is absolute: r (|xhat| mean|w dy xhat|
    // (2 D + 8) + (|w dy| + |xhat dot|) 16) 2^-24 (the last term: the five roundings of
    // the formula on each side), then the bf16 rounding of dx. dw sums N rows of
    // dy x r (two products each): (2 N + 4) 2^-24 sum|dy x r| plus |dw0| 2^-24.
    auto dx_bound = std::vector<float>(n * d), dw_bound = abs_of(dw0);
    for (int64_t i = 0; i < n; ++i) {
      const double r = want_r[i];
      double mean_abs = 0, dot = 0;
      for (int64_t j = 0; j < d; ++j) {
        const double xhat = x[i * d + j] * r, wdy = w[j] * dy[i * d + j];
        mean_abs += std::fabs(wdy * xhat) / fd;
        dot += wdy * xhat / fd;
      }
      for (int64_t j = 0; j < d; ++j) {
        const double xhat = x[i * d + j] * r, wdy = w[j] * dy[i * d + j];
        dx_bound[i * d + j] = static_cast<float>(
            r * (std::fabs(xhat) * mean_abs * (2 * fd + 8) + (std::fabs(wdy) + std::fabs(xhat * dot)) * 16) * u);
        dw_bound[j] += static_cast<float>(std::fabs(dy[i * d + j] * x[i * d + j] * r));
      }
    }
    for (float& b : dw_bound) b = static_cast<float>(b * (2 * n + 4) * u);
    std::vector<float> want_dx(n * d);
    auto want_dw = dw0;
    cpu::rmsnorm_backward(host(x, {n, d}), host(w, {d}), host(want_r, {n}), host(dy, {n, d}), host(want_dx, {n, d}),
                          host(want_dw, {d}));
    auto d_rc = upload(want_r, DType::f32, {n}), d_dy = upload(dy, c.act, {n, d});
    auto d_dx = poisoned(c.act, {n, d}), d_dw = upload(dw0, DType::f32, {d});
    cuda::rmsnorm_backward(d_x.t, d_w.t, d_rc.t, d_dy.t, d_dx.t, d_dw.t);
    EXPECT_TRUE(near("dx", download(d_dx.t), want_dx, Tol{out_round, 0, dx_bound}));
    EXPECT_TRUE(near("dw", download(d_dw.t), want_dw, Tol{0, 0, dw_bound}));
  }
}

// The residual argument against the add it replaces, run after the plain backward on
// the GPU: dx is rounded to its dtype before the residual is added, as the add reads it,
// so the two agree bit for bit. The 16-byte path (hidden rows, q/k rows) and the other
// (a width not a multiple of 8, and f32).
TEST(CudaRmsnorm, ResidualEqualsTheAddAfter) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 2500;
  for (const NormCase& c : {NormCase{37, 2048, 1e-6f, DType::bf16}, NormCase{1000, 128, 1e-6f, DType::bf16},
                            NormCase{9, 131, 1e-5f, DType::bf16}, NormCase{9, 131, 1e-5f, DType::f32}}) {
    std::ostringstream what;
    what << "N=" << c.rows << " D=" << c.dim << " act=" << dtype_name(c.act);
    SCOPED_TRACE(what.str());
    const int64_t n = c.rows, d = c.dim;
    auto x = upload(random_floats(n * d, -2, 2, ++seed), c.act, {n, d});
    auto dy = upload(random_floats(n * d, -1, 1, ++seed), c.act, {n, d});
    auto res = upload(random_floats(n * d, -1, 1, ++seed), c.act, {n, d});
    auto w = upload(random_floats(d, 0.5f, 1.5f, ++seed), DType::f32, {d});
    auto y = poisoned(c.act, {n, d}), r = poisoned(DType::f32, {n});
    cuda::rmsnorm_forward(x.t, w.t, c.eps, y.t, r.t);
    auto dx1 = poisoned(c.act, {n, d}), dx2 = poisoned(c.act, {n, d});
    cuda::rmsnorm_backward(x.t, w.t, r.t, dy.t, dx1.t, Tensor());
    cuda::add(dx1.t, res.t, dx1.t);
    cuda::rmsnorm_backward(x.t, w.t, r.t, dy.t, dx2.t, Tensor(), res.t);
    EXPECT_TRUE(near("dx", download(dx2.t), download(dx1.t), Tol{}));
  }
}

struct RopeCase {
  cpu::RopeConfig cfg;
  bool interleaved;
  int64_t batch, heads, head_dim;
  std::vector<int32_t> positions;
  bool in_place;
  DType act;
};

cpu::RopeConfig rope_config(int64_t rotary_dim, bool yarn) {
  cpu::RopeConfig c;
  c.rotary_dim = rotary_dim;
  if (yarn) {  // GPT-OSS's settings
    c.theta = 150000.0;
    c.yarn = true;
    c.factor = 32.0;
    c.truncate = false;
  }
  return c;
}

TEST(CudaRope, TablesForwardAndBackwardMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 3000;
  // The CPU table's layouts (halves and interleaved, partial rotary, positions that
  // are not 0..T-1, YaRN scaling), in place and not, and a Qwen3-sized one.
  const RopeCase cases[] = {
      {rope_config(8, false), false, 2, 3, 8, {0, 1, 2}, false, DType::bf16},
      {rope_config(6, false), true, 1, 1, 10, {7, 3, 11, 0, 2}, false, DType::bf16},
      {rope_config(8, false), false, 1, 5, 12, {5, 6, 7, 8, 9, 10, 11}, true, DType::bf16},
      {rope_config(16, true), true, 2, 1, 20, {19, 20, 21}, false, DType::f32},
      {rope_config(16, true), false, 1, 3, 16, {13, 2, 9, 4, 17}, true, DType::f32},
      {rope_config(128, false), false, 2, 4, 128, std::vector<int32_t>(), false, DType::bf16},
  };
  for (RopeCase c : cases) {
    if (c.positions.empty())
      for (int32_t p = 0; p < 300; ++p) c.positions.push_back(p);
    const int64_t t = static_cast<int64_t>(c.positions.size()), half = c.cfg.rotary_dim / 2;
    std::ostringstream what;
    what << "B=" << c.batch << " T=" << t << " H=" << c.heads << " Dh=" << c.head_dim << " rot=" << c.cfg.rotary_dim
         << " yarn=" << c.cfg.yarn << " interleaved=" << c.interleaved << " in_place=" << c.in_place
         << " act=" << dtype_name(c.act);
    SCOPED_TRACE(what.str());
    Shape s{c.batch, t, c.heads, c.head_dim};

    // Tables: computed by the same host code and copied, so equal bit for bit.
    cpu::RopeFreqs f = cpu::rope_freqs(c.cfg);
    std::vector<float> cos_h(t * half), sin_h(t * half);
    cpu::rope_tables(f, host(c.positions, {t}), host(cos_h, {t, half}), host(sin_h, {t, half}));
    auto d_pos = upload(c.positions, {t});
    auto d_cos = poisoned(DType::f32, {t, half}), d_sin = poisoned(DType::f32, {t, half});
    cuda::rope_tables(f, d_pos.t, d_cos.t, d_sin.t);
    EXPECT_TRUE(near("cos", download(d_cos.t), cos_h, Tol{}));
    EXPECT_TRUE(near("sin", download(d_sin.t), sin_h, Tol{}));

    // Each rotated value is a c - e s in f32 on both sides; the GPU may fuse one product
    // into the subtraction. Each side rounds the two products and the result, all at
    // most 2 max|x| max(|cos|, |sin|) in size: within 8 2^-24 of that, absolute; then
    // the bf16 rounding of the output.
    // Pass-through dims are copies: exact.
    double table_max = std::max(max_abs(cos_h), max_abs(sin_h));
    for (bool backward : {false, true}) {
      auto x = random_floats(s.numel(), -1, 1, ++seed);
      if (c.act == DType::bf16) x = round_bf16(x);
      std::vector<float> want(s.numel());
      if (backward)
        cpu::rope_backward(host(x, s), host(cos_h, {t, half}), host(sin_h, {t, half}), c.interleaved, host(want, s));
      else
        cpu::rope_forward(host(x, s), host(cos_h, {t, half}), host(sin_h, {t, half}), c.interleaved, host(want, s));
      auto d_x = upload(x, c.act, s);
      auto d_out = poisoned(c.act, s);
      const Tensor& dst = c.in_place ? d_x.t : d_out.t;
      if (backward)
        cuda::rope_backward(d_x.t, d_cos.t, d_sin.t, c.interleaved, dst);
      else
        cuda::rope_forward(d_x.t, d_cos.t, d_sin.t, c.interleaved, dst);
      const double out_round = c.act == DType::bf16 ? kBf16Round : 0.0;
      EXPECT_TRUE(near(backward ? "dx" : "y", download(dst), want,
                       Tol{out_round, 8 * kF32Round * max_abs(x) * table_max}));
    }
  }
}

// rmsnorm_rope against the two ops it fuses, run on the GPU one after the other (each
// checked against the CPU above): the fused kernels round where the ops store, and sum
// in their order, so y, rstd, dx and dw are equal bit for bit. Qwen3's heads (Dh 128,
// rows over several dw chunks that are not whole row groups), a head of 64, and a
// partial rotation (the two ops' path).
// Zero-centred weights (w_offset 1): every path (16-byte rows, the narrow one, f32, the
// fused per-head norm and rotation) gives the bits of plain weights w + 1 made in f32 on
// the host, forward and backward, the weight gradient included.
TEST(CudaRmsnorm, ZeroCentredWeightsEqualTheShiftedWeights) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 4100;
  for (auto [n, d, act] : {std::tuple{37, 2048, DType::bf16}, {9, 131, DType::bf16}, {9, 131, DType::f32}}) {
    SCOPED_TRACE("N=" + std::to_string(n) + " D=" + std::to_string(d));
    const std::vector<float> w = random_floats(d, -0.5f, 0.5f, ++seed);
    std::vector<float> shifted(w);
    for (float& v : shifted) v += 1.0f;
    auto x = upload(random_floats(n * d, -2, 2, ++seed), act, {n, d});
    auto dy = upload(random_floats(n * d, -1, 1, ++seed), act, {n, d});
    auto d_w = upload(w, DType::f32, {d}), d_s = upload(shifted, DType::f32, {d});
    auto y1 = poisoned(act, {n, d}), r1 = poisoned(DType::f32, {n}), y2 = poisoned(act, {n, d}),
         r2 = poisoned(DType::f32, {n});
    cuda::rmsnorm_forward(x.t, d_s.t, 1e-6f, y1.t, r1.t);
    cuda::rmsnorm_forward(x.t, d_w.t, 1e-6f, y2.t, r2.t, 1.0f);
    EXPECT_TRUE(near("y", download(y2.t), download(y1.t), Tol{}));
    auto dx1 = poisoned(act, {n, d}), dx2 = poisoned(act, {n, d});
    auto dw1 = upload(std::vector<float>(d, 0.0f), DType::f32, {d}), dw2 = upload(std::vector<float>(d, 0.0f), DType::f32, {d});
    cuda::rmsnorm_backward(x.t, d_s.t, r1.t, dy.t, dx1.t, dw1.t);
    cuda::rmsnorm_backward(x.t, d_w.t, r1.t, dy.t, dx2.t, dw2.t, Tensor(), 1.0f);
    EXPECT_TRUE(near("dx", download(dx2.t), download(dx1.t), Tol{}));
    EXPECT_TRUE(near("dw", download(dw2.t), download(dw1.t), Tol{}));
  }
  const int64_t b = 2, t = 33, h = 4, dh = 128, n = b * t * h;
  const Shape s{b, t, h, dh};
  std::vector<int32_t> pos(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = static_cast<int32_t>(i);
  auto d_pos = upload(pos, {t});
  auto d_cos = poisoned(DType::f32, {t, dh / 2}), d_sin = poisoned(DType::f32, {t, dh / 2});
  cuda::rope_tables(cpu::rope_freqs(rope_config(dh, false)), d_pos.t, d_cos.t, d_sin.t);
  const std::vector<float> w = random_floats(dh, -0.5f, 0.5f, ++seed);
  std::vector<float> shifted(w);
  for (float& v : shifted) v += 1.0f;
  auto d_w = upload(w, DType::f32, {dh}), d_s = upload(shifted, DType::f32, {dh});
  auto x = upload(random_floats(s.numel(), -2, 2, ++seed), DType::bf16, s);
  auto dy = upload(random_floats(s.numel(), -1, 1, ++seed), DType::bf16, s);
  auto y1 = poisoned(DType::bf16, s), r1 = poisoned(DType::f32, {n}), y2 = poisoned(DType::bf16, s),
       r2 = poisoned(DType::f32, {n});
  cuda::rmsnorm_rope_forward(x.t, d_s.t, 1e-6f, d_cos.t, d_sin.t, y1.t, r1.t);
  cuda::rmsnorm_rope_forward(x.t, d_w.t, 1e-6f, d_cos.t, d_sin.t, y2.t, r2.t, 1.0f);
  EXPECT_TRUE(near("rope y", download(y2.t), download(y1.t), Tol{}));
  auto dx1 = poisoned(DType::bf16, s), dx2 = poisoned(DType::bf16, s);
  auto dw1 = upload(std::vector<float>(dh, 0.0f), DType::f32, {dh}), dw2 = upload(std::vector<float>(dh, 0.0f), DType::f32, {dh});
  cuda::rmsnorm_rope_backward(x.t, d_s.t, r1.t, d_cos.t, d_sin.t, dy.t, dx1.t, dw1.t);
  cuda::rmsnorm_rope_backward(x.t, d_w.t, r1.t, d_cos.t, d_sin.t, dy.t, dx2.t, dw2.t, 1.0f);
  EXPECT_TRUE(near("rope dx", download(dx2.t), download(dx1.t), Tol{}));
  EXPECT_TRUE(near("rope dw", download(dw2.t), download(dw1.t), Tol{}));
}

TEST(CudaRmsnormRope, FusedEqualsTheTwoOps) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 3500;
  struct Case {
    int64_t batch, t, heads, dim, rotary;
  };
  for (const Case& c : {Case{2, 300, 4, 128, 128}, Case{1, 7, 32, 128, 128}, Case{2, 33, 3, 64, 64},
                        Case{1, 5, 2, 16, 8}}) {
    std::ostringstream what;
    what << "B=" << c.batch << " T=" << c.t << " H=" << c.heads << " Dh=" << c.dim << " rot=" << c.rotary;
    SCOPED_TRACE(what.str());
    const Shape s{c.batch, c.t, c.heads, c.dim};
    const int64_t n = c.batch * c.t * c.heads, half = c.rotary / 2;
    std::vector<int32_t> pos(c.t);
    for (int64_t i = 0; i < c.t; ++i) pos[i] = static_cast<int32_t>((i * 7) % (c.t + 3));
    const cpu::RopeFreqs f = cpu::rope_freqs(rope_config(c.rotary, false));
    auto d_pos = upload(pos, {c.t});
    auto d_cos = poisoned(DType::f32, {c.t, half}), d_sin = poisoned(DType::f32, {c.t, half});
    cuda::rope_tables(f, d_pos.t, d_cos.t, d_sin.t);
    auto x = upload(random_floats(s.numel(), -2, 2, ++seed), DType::bf16, s);
    auto dy = upload(random_floats(s.numel(), -1, 1, ++seed), DType::bf16, s);
    auto w = upload(random_floats(c.dim, 0.5f, 1.5f, ++seed), DType::f32, {c.dim});
    const std::vector<float> dw0 = random_floats(c.dim, -1, 1, ++seed);

    auto y1 = poisoned(DType::bf16, s), r1 = poisoned(DType::f32, {n}), y2 = poisoned(DType::bf16, s),
         r2 = poisoned(DType::f32, {n});
    cuda::rmsnorm_forward(x.t.view({n, c.dim}), w.t, 1e-6f, y1.t.view({n, c.dim}), r1.t);
    cuda::rope_forward(y1.t, d_cos.t, d_sin.t, false, y1.t);
    cuda::rmsnorm_rope_forward(x.t, w.t, 1e-6f, d_cos.t, d_sin.t, y2.t, r2.t);
    EXPECT_TRUE(near("y", download(y2.t), download(y1.t), Tol{}));
    EXPECT_TRUE(near("rstd", download(r2.t), download(r1.t), Tol{}));

    auto dn = poisoned(DType::bf16, s), dx1 = poisoned(DType::bf16, s), dx2 = poisoned(DType::bf16, s);
    auto dw1 = upload(dw0, DType::f32, {c.dim}), dw2 = upload(dw0, DType::f32, {c.dim});
    cuda::rope_backward(dy.t, d_cos.t, d_sin.t, false, dn.t);
    cuda::rmsnorm_backward(x.t.view({n, c.dim}), w.t, r1.t, dn.t.view({n, c.dim}), dx1.t.view({n, c.dim}), dw1.t);
    cuda::rmsnorm_rope_backward(x.t, w.t, r1.t, d_cos.t, d_sin.t, dy.t, dx2.t, dw2.t);
    EXPECT_TRUE(near("dx", download(dx2.t), download(dx1.t), Tol{}));
    EXPECT_TRUE(near("dw", download(dw2.t), download(dw1.t), Tol{}));
  }
}

struct GatedCase {
  int64_t rows, inter;
  bool clamped;
  float limit, alpha;
  DType act;
};

TEST(CudaSwiglu, ForwardAndBackwardMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 4000;
  // The CPU table's shapes (one row, odd widths, GPT-OSS's limit and alpha and a small
  // limit that binds often), a Qwen3 expert width, and the f32 path.
  const GatedCase cases[] = {
      {1, 5, false, 0, 0, DType::bf16},         {13, 131, false, 0, 0, DType::bf16},
      {300, 768, false, 0, 0, DType::bf16},     {13, 131, false, 0, 0, DType::f32},
      {1, 3, true, 7.0f, 1.702f, DType::bf16},  {17, 45, true, 7.0f, 1.702f, DType::bf16},
      {5, 9, true, 1.5f, 0.5f, DType::f32},     {64, 2880, true, 7.0f, 1.702f, DType::bf16},
  };
  for (const GatedCase& c : cases) {
    std::ostringstream what;
    what << (c.clamped ? "clamped_swiglu" : "swiglu") << " N=" << c.rows << " I=" << c.inter
         << " act=" << dtype_name(c.act);
    SCOPED_TRACE(what.str());
    const int64_t n = c.rows, i = c.inter;
    const float range = c.clamped ? 10.0f : 4.0f;
    auto gu = random_floats(n * 2 * i, -range, range, ++seed), dh = random_floats(n * i, -1, 1, ++seed);
    if (c.act == DType::bf16) {
      gu = round_bf16(gu);
      dh = round_bf16(dh);
    }
    std::vector<float> want_h(n * i), want_dgu(n * 2 * i);
    if (c.clamped) {
      cpu::clamped_swiglu_forward(host(gu, {n, 2 * i}), c.limit, c.alpha, host(want_h, {n, i}));
      cpu::clamped_swiglu_backward(host(gu, {n, 2 * i}), c.limit, c.alpha, host(dh, {n, i}),
                                   host(want_dgu, {n, 2 * i}));
    } else {
      cpu::swiglu_forward(host(gu, {n, 2 * i}), host(want_h, {n, i}));
      cpu::swiglu_backward(host(gu, {n, 2 * i}), host(dh, {n, i}), host(want_dgu, {n, 2 * i}));
    }
    auto d_gu = upload(gu, c.act, {n, 2 * i}), d_dh = upload(dh, c.act, {n, i});
    auto d_h = poisoned(c.act, {n, i}), d_dgu = poisoned(c.act, {n, 2 * i});
    if (c.clamped) {
      cuda::clamped_swiglu_forward(d_gu.t, c.limit, c.alpha, d_h.t);
      cuda::clamped_swiglu_backward(d_gu.t, c.limit, c.alpha, d_dh.t, d_dgu.t);
    } else {
      cuda::swiglu_forward(d_gu.t, d_h.t);
      cuda::swiglu_backward(d_gu.t, d_dh.t, d_dgu.t);
    }
    // expf differs by at most 2 units in the last place between CUDA and glibc; the
    // sigmoid and the products add a few roundings: 16 2^-24 relative in the forward.
    // The backward's 1 + g (1 - s) cancels near silu's minimum, so its error is
    // absolute, 16 2^-24 of the terms' size |dh| (|up| + 1) (1 + alpha |g|) (alpha = 1
    // for swiglu); the up gradient |dh| |g| is a plain product. Then the bf16 rounding.
    const double out_round = c.act == DType::bf16 ? kBf16Round : 0.0;
    EXPECT_TRUE(near("h", download(d_h.t), want_h, Tol{out_round + 16 * kF32Round}));
    std::vector<float> bound(n * 2 * i);
    const double alpha = c.clamped ? c.alpha : 1.0;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < i; ++j) {
        const int64_t g_at = c.clamped ? r * 2 * i + 2 * j : r * 2 * i + j;
        const int64_t u_at = c.clamped ? g_at + 1 : g_at + i;
        const double d = std::fabs(dh[r * i + j]), g = std::fabs(gu[g_at]), up = std::fabs(gu[u_at]);
        bound[g_at] = static_cast<float>(16 * kF32Round * d * (up + 1) * (1 + alpha * g));
        bound[u_at] = static_cast<float>(16 * kF32Round * d * (g + 1));
      }
    EXPECT_TRUE(near("dgu", download(d_dgu.t), want_dgu, Tol{out_round, 0, bound}));
  }
}

// Sigmoid gates against the CPU: elementwise, a gate a row (warp sums), one column; bf16
// and f32. The forward and dv are a sigmoid and a product (expf within 2 ulp of glibc's):
// 16 2^-24 relative, then the storage rounding; a row gate's ds sums C terms in another
// order: (C + 16) 2^-24 of the sum of their sizes.
TEST(CudaSigmoidGate, MatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 4200;
  for (auto [n, c, row_gate, act] : {std::tuple{300, 512, false, DType::bf16}, {64, 2048, true, DType::bf16},
                                     {7, 33, true, DType::f32}, {9, 1, true, DType::f32}, {5, 13, false, DType::f32}}) {
    SCOPED_TRACE("N=" + std::to_string(n) + " C=" + std::to_string(c) + (row_gate ? " row" : ""));
    const int64_t gc = row_gate ? 1 : c;
    auto v = random_floats(n * c, -2, 2, ++seed), s = random_floats(n * gc, -4, 4, ++seed),
         d = random_floats(n * c, -1, 1, ++seed);
    if (act == DType::bf16) {
      v = round_bf16(v);
      s = round_bf16(s);
      d = round_bf16(d);
    }
    std::vector<float> want(n * c), want_dv(n * c), want_ds(n * gc);
    cpu::sigmoid_gate_forward(host(v, {n, c}), host(s, {n, gc}), host(want, {n, c}));
    cpu::sigmoid_gate_backward(host(v, {n, c}), host(s, {n, gc}), host(d, {n, c}), host(want_dv, {n, c}),
                               host(want_ds, {n, gc}));
    auto d_v = upload(v, act, {n, c}), d_s = upload(s, act, {n, gc}), d_d = upload(d, act, {n, c});
    auto out = poisoned(act, {n, c}), dv = poisoned(act, {n, c}), ds = poisoned(act, {n, gc});
    cuda::sigmoid_gate_forward(d_v.t, d_s.t, out.t);
    cuda::sigmoid_gate_backward(d_v.t, d_s.t, d_d.t, dv.t, ds.t);
    const double round = act == DType::bf16 ? kBf16Round : 0.0;
    EXPECT_TRUE(near("out", download(out.t), want, Tol{round + 16 * kF32Round}));
    EXPECT_TRUE(near("dv", download(dv.t), want_dv, Tol{round + 16 * kF32Round}));
    std::vector<float> bound(n * gc, 0.0f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < c; ++j) bound[r * gc + (row_gate ? 0 : j)] += std::fabs(d[r * c + j] * v[r * c + j]) / 4;
    for (float& b : bound) b = static_cast<float>(b * (c + 16) * kF32Round);
    EXPECT_TRUE(near("ds", download(ds.t), want_ds, Tol{round, 0, bound}));
  }
}

// The gated delta rule against the CPU's chunked form run in float64 on the same (rounded)
// inputs, with q and k unit rows as the model feeds them: a state in and out, the state's
// gradient in and out, chunks past the first with a partial last one, value tiles with a
// partial last one (Dv 72 = 32 + 32 + 8), and Qwen3.5's head (128 x 128) in bf16. The GPU
// works in f32 through a chunk's products and 64-term triangular solves: errors of a few
// 1e-6 of the largest value of each output, so 1e-4 of it, plus a bf16 output's rounding.
// The tensor-core route rounds the products' operands to tf32 (2^-11 relative): sums of
// up to 2 x 128 such terms, so 4e-3 of the largest value.
TEST(CudaGatedDelta, MatchesFloat64) {
  MT_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t B, T, H, dk, dv;
    DType act;
    bool states;
  };
  uint64_t seed = 6100;
  for (const Case& c : {Case{2, 150, 3, 40, 72, DType::f32, true}, Case{1, 64, 2, 16, 8, DType::f32, false},
                        Case{1, 200, 2, 128, 128, DType::bf16, true}}) {
    SCOPED_TRACE("B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " Dk=" + std::to_string(c.dk) +
                 " Dv=" + std::to_string(c.dv) + " " + std::string(dtype_name(c.act)));
    const int64_t nq = c.B * c.T * c.H * c.dk, nv = c.B * c.T * c.H * c.dv, ns = c.B * c.T * c.H,
                  nst = c.B * c.H * c.dk * c.dv;
    auto unit_rows = [&](std::vector<float> x, float scale) {
      for (int64_t r = 0; r < nq / c.dk; ++r) {
        double n2 = 0;
        for (int64_t a = 0; a < c.dk; ++a) n2 += double(x[r * c.dk + a]) * x[r * c.dk + a];
        for (int64_t a = 0; a < c.dk; ++a) x[r * c.dk + a] = float(x[r * c.dk + a] * scale / std::sqrt(n2));
      }
      return x;
    };
    auto q = unit_rows(random_floats(nq, -1, 1, ++seed), 1.0f / std::sqrt(float(c.dk)));
    auto k = unit_rows(random_floats(nq, -1, 1, ++seed), 1.0f);
    auto v = random_floats(nv, -1, 1, ++seed), dout = random_floats(nv, -1, 1, ++seed);
    auto g = random_floats(ns, -0.6f, -0.01f, ++seed), beta = random_floats(ns, 0.05f, 0.95f, ++seed);
    auto s_in = c.states ? random_floats(nst, -0.5f, 0.5f, ++seed) : std::vector<float>();
    auto ds_out = c.states ? random_floats(nst, -0.5f, 0.5f, ++seed) : std::vector<float>();
    if (c.act == DType::bf16) q = round_bf16(q), k = round_bf16(k), v = round_bf16(v), dout = round_bf16(dout);
    // float64 reference
    auto wide = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    const auto q8 = wide(q), k8 = wide(k), v8 = wide(v), g8 = wide(g), b8 = wide(beta), si8 = wide(s_in),
               do8 = wide(dout), dso8 = wide(ds_out);
    std::vector<double> o8(nv), so8(nst), dq8(nq), dk8(nq), dv8(nv), dg8(ns), db8(ns), dsi8(nst);
    const cpu::GatedDeltaDims n{c.B, c.T, c.H, c.dk, c.dv, 64};
    cpu::gated_delta_chunked_forward<double>(n, q8.data(), k8.data(), v8.data(), g8.data(), b8.data(),
                                             c.states ? si8.data() : nullptr, o8.data(), so8.data());
    cpu::gated_delta_chunked_backward<double>(n, q8.data(), k8.data(), v8.data(), g8.data(), b8.data(),
                                              c.states ? si8.data() : nullptr, do8.data(),
                                              c.states ? dso8.data() : nullptr, dq8.data(), dk8.data(), dv8.data(),
                                              dg8.data(), db8.data(), dsi8.data());
    const Shape sq{c.B, c.T, c.H, c.dk}, sv{c.B, c.T, c.H, c.dv}, ss{c.B, c.T, c.H}, sst{c.B, c.H, c.dk, c.dv};
    for (const bool tensor_cores : {false, true}) {
      SCOPED_TRACE(tensor_cores ? "tensor cores (tf32)" : "SIMT (f32)");
      cuda::set_gated_delta_tensor_cores(tensor_cores);
      const double rel = tensor_cores ? 4e-3 : 1e-4;
      auto d_q = upload(q, c.act, sq), d_k = upload(k, c.act, sq), d_v = upload(v, c.act, sv),
           d_do = upload(dout, c.act, sv), d_g = upload(g, DType::f32, ss), d_b = upload(beta, DType::f32, ss);
      auto state = [&](const std::vector<float>& x) {  // empty (no state) when the case has none
        return c.states ? upload(x, DType::f32, sst) : DeviceTensor(DType::f32, Shape{0});
      };
      auto d_si = state(s_in), d_dso = state(ds_out);
      auto out = poisoned(c.act, sv), s_out = poisoned(DType::f32, sst), dq = poisoned(c.act, sq),
           dk = poisoned(c.act, sq), dv = poisoned(c.act, sv), dg = poisoned(DType::f32, ss),
           db = poisoned(DType::f32, ss), ds_in = poisoned(DType::f32, sst);
      cuda::gated_delta_forward(d_q.t, d_k.t, d_v.t, d_g.t, d_b.t, d_si.t, out.t, s_out.t);
      cuda::gated_delta_backward(d_q.t, d_k.t, d_v.t, d_g.t, d_b.t, d_si.t, d_do.t, d_dso.t, dq.t, dk.t, dv.t, dg.t,
                                 db.t, ds_in.t);
      const double round = c.act == DType::bf16 ? kBf16Round : 0.0;
      auto check = [&](const char* what, const Tensor& got, const std::vector<double>& want, double rounding) {
        std::vector<float> w(want.begin(), want.end());
        double top = 0;
        for (double x : want) top = std::max(top, std::fabs(x));
        EXPECT_GT(top, 0.0) << what;
        EXPECT_TRUE(near(what, download(got), w, Tol{rounding, rel * top}));
      };
      check("out", out.t, o8, round);
      check("state_out", s_out.t, so8, 0);
      check("dq", dq.t, dq8, round);
      check("dk", dk.t, dk8, round);
      check("dv", dv.t, dv8, round);
      check("dg", dg.t, dg8, 0);
      check("dbeta", db.t, db8, 0);
      check("d_state_in", ds_in.t, dsi8, 0);
      // Twice: the same bits (every sum in a fixed order).
      auto dq2 = poisoned(c.act, sq), dk2 = poisoned(c.act, sq), dv2 = poisoned(c.act, sv),
           dg2 = poisoned(DType::f32, ss), db2 = poisoned(DType::f32, ss);
      cuda::gated_delta_backward(d_q.t, d_k.t, d_v.t, d_g.t, d_b.t, d_si.t, d_do.t, d_dso.t, dq2.t, dk2.t, dv2.t, dg2.t,
                                 db2.t, Tensor());
      EXPECT_EQ(download(dq2.t), download(dq.t));
      EXPECT_EQ(download(dg2.t), download(dg.t));
    }
    cuda::set_gated_delta_tensor_cores(true);
  }
}

// The convolution and the gates against the CPU, bf16 and f32 activations. The forward
// and dx sum K (4) products in the CPU's order: a few f32 roundings, then the storage's;
// dw sums B T products per weight in blocks of 256 tokens (another order): (B T + 16)
// 2^-24 of the sum of their sizes; the gates' per-head sums likewise over N rows.
TEST(CudaDeltaNet, ConvAndGatesMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 6200;
  for (auto [B, T, C, K, act] : {std::tuple{2, 300, 70, 4, DType::bf16}, {1, 5, 9, 4, DType::f32},
                                 {3, 17, 33, 2, DType::f32}}) {
    SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C));
    auto x = random_floats(int64_t{B} * T * C, -2, 2, ++seed), dy = random_floats(int64_t{B} * T * C, -1, 1, ++seed);
    auto w = random_floats(int64_t{C} * K, -0.5, 0.5, ++seed);
    if (act == DType::bf16) x = round_bf16(x), dy = round_bf16(dy);
    std::vector<float> y(x.size()), dx(x.size()), dw(w.size(), 0.25f);
    const Shape sx{B, T, C}, sw{C, K};
    cpu::causal_conv1d_silu_forward(host(x, sx), host(w, sw), host(y, sx));
    cpu::causal_conv1d_silu_backward(host(x, sx), host(w, sw), host(dy, sx), host(dx, sx), host(dw, sw));
    auto d_x = upload(x, act, sx), d_dy = upload(dy, act, sx), d_w = upload(w, DType::f32, sw);
    auto d_y = poisoned(act, sx), d_dx = poisoned(act, sx);
    auto d_dw = upload(std::vector<float>(w.size(), 0.25f), DType::f32, sw);
    cuda::causal_conv1d_silu_forward(d_x.t, d_w.t, d_y.t);
    cuda::causal_conv1d_silu_backward(d_x.t, d_w.t, d_dy.t, d_dx.t, d_dw.t);
    const double round = act == DType::bf16 ? kBf16Round : 0.0;
    EXPECT_TRUE(near("y", download(d_y.t), y, Tol{round + 32 * kF32Round, 1e-6}));
    EXPECT_TRUE(near("dx", download(d_dx.t), dx, Tol{round + 64 * kF32Round, 1e-6}));
    EXPECT_TRUE(near("dw", download(d_dw.t), dw, Tol{0, (B * T + 16) * kF32Round * 2.0 * K}));
  }
  for (auto [N, H, act] : {std::tuple{300, 5, DType::bf16}, {7, 32, DType::f32}}) {
    auto a = random_floats(int64_t{N} * H, -3, 3, ++seed), b = random_floats(int64_t{N} * H, -3, 3, ++seed);
    auto A_log = random_floats(H, -1, 1, ++seed), dt = random_floats(H, -1, 1, ++seed);
    auto dg = random_floats(int64_t{N} * H, -1, 1, ++seed), dbeta = random_floats(int64_t{N} * H, -1, 1, ++seed);
    a[0] = 30.0f;  // past softplus's threshold
    if (act == DType::bf16) a = round_bf16(a), b = round_bf16(b);
    std::vector<float> g(a.size()), beta(a.size()), da(a.size()), db(a.size()), dA(H, 0.5f), ddt(H, -0.5f);
    const Shape s{N, H}, sh{H};
    cpu::deltanet_gates_forward(host(a, s), host(b, s), host(A_log, sh), host(dt, sh), host(g, s), host(beta, s));
    cpu::deltanet_gates_backward(host(a, s), host(b, s), host(A_log, sh), host(dt, sh), host(dg, s), host(dbeta, s),
                                 host(da, s), host(db, s), host(dA, sh), host(ddt, sh));
    auto d_a = upload(a, act, s), d_b = upload(b, act, s), d_A = upload(A_log, DType::f32, sh),
         d_dt = upload(dt, DType::f32, sh), d_dg = upload(dg, DType::f32, s), d_dbeta = upload(dbeta, DType::f32, s);
    auto d_g = poisoned(DType::f32, s), d_beta = poisoned(DType::f32, s), d_da = poisoned(act, s),
         d_db = poisoned(act, s);
    auto d_dA = upload(std::vector<float>(H, 0.5f), DType::f32, sh), d_ddt = upload(std::vector<float>(H, -0.5f), DType::f32, sh);
    cuda::deltanet_gates_forward(d_a.t, d_b.t, d_A.t, d_dt.t, d_g.t, d_beta.t);
    cuda::deltanet_gates_backward(d_a.t, d_b.t, d_A.t, d_dt.t, d_dg.t, d_dbeta.t, d_da.t, d_db.t, d_dA.t, d_ddt.t);
    const double round = act == DType::bf16 ? kBf16Round : 0.0;
    EXPECT_TRUE(near("g", download(d_g.t), g, Tol{32 * kF32Round}));
    EXPECT_TRUE(near("beta", download(d_beta.t), beta, Tol{16 * kF32Round}));
    EXPECT_TRUE(near("da", download(d_da.t), da, Tol{round + 32 * kF32Round, 1e-7}));
    EXPECT_TRUE(near("db", download(d_db.t), db, Tol{round + 32 * kF32Round, 1e-7}));
    const double sums = (N + 16) * kF32Round * 3.0 * 30;  // |dg| <= 1, |scale softplus| <= e 33
    EXPECT_TRUE(near("dA_log", download(d_dA.t), dA, Tol{0, sums}));
    EXPECT_TRUE(near("ddt_bias", download(d_ddt.t), ddt, Tol{0, sums}));
  }
}

// The load-balance statistics summed on the device, and the backward fed one dprobs row
// for every token, against the CPU (which test_ops checks against float64 and full rows).
TEST(CudaRouter, ProbSumsAndOneRowDprobsMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 1000, e = 130, k = 4;  // several 256-token chunks, a partial last one
  std::vector<float> logits = random_floats(n * e, -3, 3, 11), dweight = random_floats(n * k, -1, 1, 12),
                     row = random_floats(e, -1, 1, 13);
  cpu::RouterConfig cfg;
  cfg.top_k = k;
  cfg.normalize = true;
  std::vector<int32_t> idx_ref(n * k);
  std::vector<float> w_ref(n * k), p_ref(n * e), sums_ref(e), dl_ref(n * e);
  cpu::router_forward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}));
  cpu::router_prob_sum(host(p_ref, {n, e}), host(sums_ref, {e}));
  cpu::router_backward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}),
                       host(dweight, {n, k}), host(row, {1, e}), host(dl_ref, {n, e}));
  DeviceTensor ld = upload(logits, DType::f32, {n, e}), dwd = upload(dweight, DType::f32, {n, k}),
               rowd = upload(row, DType::f32, {1, e});
  DeviceTensor idx = poisoned(DType::i32, {n, k}), w = poisoned(DType::f32, {n, k}), p = poisoned(DType::f32, {n, e}),
               sums = poisoned(DType::f32, {e}), dl = poisoned(DType::f32, {n, e});
  mt::router_forward(cfg, ld.t, idx.t, w.t, p.t);
  mt::router_prob_sum(p.t, sums.t);
  mt::router_backward(cfg, ld.t, idx.t, w.t, p.t, dwd.t, rowd.t, dl.t);
  ASSERT_EQ(download_ints(idx.t), idx_ref);
  // Sums of n probabilities each within f32 rounding of the CPU's: n roundings at most.
  EXPECT_TRUE(near("prob sums", download(sums.t), sums_ref, Tol(n * kF32Round, 0)));
  EXPECT_TRUE(near("dlogits", download(dl.t), dl_ref, Tol(1e-5, 1e-6)));
}

// The sequence-level term's counts (a block a group) and the backward fed a dprobs row a
// group of tokens, against the CPU (which test_ops checks by hand and with full rows).
TEST(CudaRouter, GroupCountsAndGroupDprobsMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 1024, e = 130, k = 6, g = 4;
  std::vector<float> logits = random_floats(n * e, -3, 3, 21), dweight = random_floats(n * k, -1, 1, 22),
                     rows = random_floats(g * e, -1, 1, 23);
  cpu::RouterConfig cfg;
  cfg.top_k = k;
  std::vector<int32_t> idx_ref(n * k), counts_ref(g * e);
  std::vector<float> w_ref(n * k), p_ref(n * e), dl_ref(n * e);
  cpu::router_forward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}));
  cpu::router_counts(host(idx_ref, {n, k}), host(counts_ref, {g, e}));
  cpu::router_backward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}),
                       host(dweight, {n, k}), host(rows, {g, e}), host(dl_ref, {n, e}));
  DeviceTensor ld = upload(logits, DType::f32, {n, e}), dwd = upload(dweight, DType::f32, {n, k}),
               rowsd = upload(rows, DType::f32, {g, e});
  DeviceTensor idx = poisoned(DType::i32, {n, k}), w = poisoned(DType::f32, {n, k}), p = poisoned(DType::f32, {n, e}),
               counts = poisoned(DType::i32, {g, e}), dl = poisoned(DType::f32, {n, e});
  mt::router_forward(cfg, ld.t, idx.t, w.t, p.t);
  mt::router_counts(idx.t, counts.t);
  mt::router_backward(cfg, ld.t, idx.t, w.t, p.t, dwd.t, rowsd.t, dl.t);
  ASSERT_EQ(download_ints(idx.t), idx_ref);
  EXPECT_EQ(download_ints(counts.t), counts_ref);
  EXPECT_TRUE(near("dlogits", download(dl.t), dl_ref, Tol(1e-5, 1e-6)));
}

// An expert bias (DeepSeek-V3's loss-free balancing) ranks the choice on the device as
// on the CPU: softmax scoring with groups, and GPT-OSS's; the same experts, and weights
// of the unbiased scores.
TEST(CudaRouter, BiasedChoiceMatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 300, e = 64, k = 6;
  std::vector<float> logits = random_floats(n * e, -3, 3, 31), bias = random_floats(e, -0.05f, 0.05f, 32);
  for (bool gpt_oss : {false, true}) {
    SCOPED_TRACE(gpt_oss ? "topk_softmax" : "softmax_topk with groups");
    cpu::RouterConfig cfg;
    cfg.top_k = k;
    if (gpt_oss) {
      cfg.scoring = cpu::RouterScoring::topk_softmax;
    } else {
      cfg.normalize = true;
      cfg.n_group = 8;
      cfg.topk_group = 3;
    }
    std::vector<int32_t> idx_ref(n * k), idx_plain(n * k);
    std::vector<float> w_ref(n * k), p_ref(n * e);
    cpu::router_forward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}),
                        host(bias, {e}));
    cpu::router_forward(cfg, host(logits, {n, e}), host(idx_plain, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}));
    EXPECT_NE(idx_ref, idx_plain) << "the bias should move some choices";
    cpu::router_forward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}),
                        host(bias, {e}));
    DeviceTensor ld = upload(logits, DType::f32, {n, e}), bd = upload(bias, DType::f32, {e});
    DeviceTensor idx = poisoned(DType::i32, {n, k}), w = poisoned(DType::f32, {n, k}), p = poisoned(DType::f32, {n, e});
    mt::router_forward(cfg, ld.t, idx.t, w.t, p.t, bd.t);
    EXPECT_EQ(download_ints(idx.t), idx_ref);
    EXPECT_TRUE(near("weights", download(w.t), w_ref, Tol(1e-5, 1e-6)));
  }
}

// DeepSeek-V3's sigmoid scoring on the device against the CPU (which test_ops checks
// against float64 and finite differences): V3's shape (256 experts, 8 groups of which 4
// are eligible, k = 8, renormalised, scale 2.5) with a bias and a dprobs row a sequence,
// then no groups, no bias and a width that is not a multiple of 32. The same experts;
// weights, normalised scores, score sums and dlogits within a few f32 roundings (expf
// differs by 2 units in the last place at most, the warp sums add in another order).
TEST(CudaRouter, SigmoidMatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t n, e, k, n_group, topk_group, g;
    bool normalize, bias;
    float scale;
  };
  const Case cases[] = {{1000, 256, 8, 8, 4, 4, true, true, 2.5f}, {333, 130, 6, 1, 1, 1, false, false, 1.0f}};
  uint64_t seed = 40;
  for (const Case& c : cases) {
    std::ostringstream what;
    what << "N=" << c.n << " E=" << c.e << " k=" << c.k << " groups=" << c.n_group << "/" << c.topk_group;
    SCOPED_TRACE(what.str());
    const int64_t n = c.n, e = c.e, k = c.k;
    std::vector<float> logits = random_floats(n * e, -3, 3, ++seed), dweight = random_floats(n * k, -1, 1, ++seed),
                       rows = random_floats(c.g * e, -1, 1, ++seed), bias = random_floats(e, -0.05f, 0.05f, ++seed);
    cpu::RouterConfig cfg;
    cfg.top_k = k;
    cfg.scoring = cpu::RouterScoring::sigmoid;
    cfg.normalize = c.normalize;
    cfg.scale = c.scale;
    cfg.n_group = c.n_group;
    cfg.topk_group = c.topk_group;
    std::vector<int32_t> idx_ref(n * k);
    std::vector<float> w_ref(n * k), p_ref(n * e), s_ref(n), dl_ref(n * e);
    const Tensor bias_h = c.bias ? host(bias, {e}) : Tensor();
    cpu::router_forward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}),
                        bias_h, host(s_ref, {n}));
    cpu::router_backward(cfg, host(logits, {n, e}), host(idx_ref, {n, k}), host(w_ref, {n, k}), host(p_ref, {n, e}),
                         host(dweight, {n, k}), host(rows, {c.g, e}), host(dl_ref, {n, e}), host(s_ref, {n}));
    DeviceTensor ld = upload(logits, DType::f32, {n, e}), dwd = upload(dweight, DType::f32, {n, k}),
                 rowsd = upload(rows, DType::f32, {c.g, e}), bd = upload(bias, DType::f32, {e});
    DeviceTensor idx = poisoned(DType::i32, {n, k}), w = poisoned(DType::f32, {n, k}), p = poisoned(DType::f32, {n, e}),
                 sums = poisoned(DType::f32, {n}), dl = poisoned(DType::f32, {n, e});
    mt::router_forward(cfg, ld.t, idx.t, w.t, p.t, c.bias ? bd.t : Tensor(), sums.t);
    mt::router_backward(cfg, ld.t, idx.t, w.t, p.t, dwd.t, rowsd.t, dl.t, sums.t);
    ASSERT_EQ(download_ints(idx.t), idx_ref);
    EXPECT_TRUE(near("weights", download(w.t), w_ref, Tol(1e-5, 1e-6)));
    // A sum of E positive scores is within (E - 1) roundings of exact in any order, so the
    // two orders differ by 2 E of them at most; probs divide by it (a few more roundings).
    const double sum_tol = 2.0 * static_cast<double>(e) * kF32Round;
    EXPECT_TRUE(near("probs", download(p.t), p_ref, Tol(sum_tol + 8 * kF32Round, 0)));
    EXPECT_TRUE(near("score sums", download(sums.t), s_ref, Tol(sum_tol, 0)));
    EXPECT_TRUE(near("dlogits", download(dl.t), dl_ref, Tol(1e-5, 1e-6)));
  }
}

}  // namespace
}  // namespace mt::gpu_test
