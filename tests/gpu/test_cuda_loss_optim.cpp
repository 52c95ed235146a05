// Cross-entropy, AdamW, Muon and the elementwise helpers on the GPU against the CPU backend.
#include <cmath>
#include <cstdio>
#include <sstream>

#include "gpu/gpu_test.h"
#include "kernels/adamw.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/muon.h"

namespace mt::gpu_test {
namespace {

constexpr int32_t kIgnore = -100;

struct CeCase {
  int64_t rows, vocab, ignored;
  DType logits;
};

TEST(CudaCrossEntropy, ForwardAndInPlaceBackwardMatchCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 5000;
  // The CPU table's shapes (ignored labels, one row, V not a multiple of 8), rows read in
  // 16-byte chunks (V a multiple of 8, or of 4 for f32) and not, and Qwen3's vocabulary.
  const CeCase cases[] = {{12, 37, 3, DType::bf16},   {1, 5, 0, DType::bf16},     {40, 1001, 7, DType::bf16},
                          {40, 1001, 7, DType::f32},  {7, 1000, 2, DType::f32},   {9, 4096, 0, DType::bf16},
                          {3, 151936, 1, DType::bf16}};
  for (const CeCase& c : cases) {
    std::ostringstream what;
    what << "N=" << c.rows << " V=" << c.vocab << " ignored=" << c.ignored << " logits=" << dtype_name(c.logits);
    SCOPED_TRACE(what.str());
    const int64_t n = c.rows, v = c.vocab;
    auto logits = random_floats(n * v, -6, 6, ++seed);
    if (c.logits == DType::bf16) logits = round_bf16(logits);
    auto labels = random_ints(n, 0, static_cast<int32_t>(v - 1), ++seed);
    for (int64_t i = 0; i < c.ignored; ++i) labels[(i * 5) % n] = kIgnore;

    std::vector<float> want_lse(n), want_d = logits;
    cpu::CrossEntropySum want = cpu::cross_entropy_forward(host(want_d, {n, v}), host(labels, {n}), kIgnore,
                                                           host(want_lse, {n}));
    const float scale = want.count > 0 ? 1.0f / static_cast<float>(want.count) : 0.0f;
    cpu::cross_entropy_backward(host(want_d, {n, v}), host(labels, {n}), host(want_lse, {n}), kIgnore, scale,
                                host(want_d, {n, v}));

    auto d_logits = upload(logits, c.logits, {n, v}), d_labels = upload(labels, {n});
    auto d_lse = poisoned(DType::f32, {n});
    cpu::CrossEntropySum got = cuda::cross_entropy_forward(d_logits.t, d_labels.t, kIgnore, d_lse.t);
    // lse = m + log(sum of V exponentials): the sums differ by order, V 2^-24 relative on
    // each side, and expf/logf by a few units in the last place: |dlse| <= 2 (V + 8)
    // 2^-24 + 4 2^-24 |lse|. The loss sum adds one such error per counted row.
    const double lse_abs = 2.0 * static_cast<double>(v + 8) * kF32Round;
    EXPECT_TRUE(near("lse", download(d_lse.t), want_lse, Tol{4 * kF32Round, lse_abs}));
    EXPECT_EQ(got.count, want.count);
    EXPECT_NEAR(got.loss_sum, want.loss_sum, static_cast<double>(n) * (lse_abs + 4 * kF32Round * 20));

    // In place, as the model uses it. Each gradient is scale (p - onehot) with p =
    // exp(x - lse): p moves by p |dlse| plus a few roundings, so |d| <= |scale| (|dlse| +
    // 8 2^-24) absolute (p <= 1); then the bf16 rounding for bf16 logits.
    cuda::cross_entropy_backward(d_logits.t, d_labels.t, d_lse.t, kIgnore, scale, d_logits.t);
    const double out_round = c.logits == DType::bf16 ? kBf16Round : 0.0;
    EXPECT_TRUE(near("dlogits", download(d_logits.t), want_d,
                     Tol{out_round, std::fabs(scale) * (lse_abs + 4 * kF32Round * 20 + 8 * kF32Round)}));
  }
}

// The forward given the gradient's buffer writes what the backward would, from the lse
// it just made: the same bits, in place and into a separate buffer, on rows read in
// 16-byte chunks and not, with ignored labels; lse and the loss as the plain forward's.
TEST(CudaCrossEntropy, ForwardWithTheGradientEqualsForwardThenBackward) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 5100;
  const CeCase cases[] = {{12, 37, 3, DType::bf16}, {40, 1001, 7, DType::f32}, {9, 4096, 2, DType::bf16},
                          {3, 151936, 1, DType::bf16}};
  for (const CeCase& c : cases) {
    for (bool in_place : {true, false}) {
      std::ostringstream what;
      what << "N=" << c.rows << " V=" << c.vocab << " logits=" << dtype_name(c.logits) << " in place " << in_place;
      SCOPED_TRACE(what.str());
      const int64_t n = c.rows, v = c.vocab;
      auto logits = random_floats(n * v, -6, 6, ++seed);
      auto labels = random_ints(n, 0, static_cast<int32_t>(v - 1), ++seed);
      for (int64_t i = 0; i < c.ignored; ++i) labels[(i * 5) % n] = kIgnore;
      const float scale = 0.37f;
      auto d_labels = upload(labels, {n});
      auto want = upload(logits, c.logits, {n, v}), got = upload(logits, c.logits, {n, v});
      auto want_lse = poisoned(DType::f32, {n}), got_lse = poisoned(DType::f32, {n});
      auto separate = poisoned(c.logits, {n, v});
      const cpu::CrossEntropySum a = cuda::cross_entropy_forward(want.t, d_labels.t, kIgnore, want_lse.t);
      cuda::cross_entropy_backward(want.t, d_labels.t, want_lse.t, kIgnore, scale, want.t);
      const cpu::CrossEntropySum b =
          cuda::cross_entropy_forward(got.t, d_labels.t, kIgnore, got_lse.t, scale, in_place ? got.t : separate.t);
      EXPECT_EQ(a.loss_sum, b.loss_sum);
      EXPECT_EQ(a.count, b.count);
      EXPECT_EQ(download(want_lse.t), download(got_lse.t));
      EXPECT_EQ(download(want.t), download(in_place ? got.t : separate.t));
      if (!in_place) {  // the logits are kept
        EXPECT_EQ(download(got.t), download(upload(logits, c.logits, {n, v}).t));
      }
    }
  }
}

// A separate f32 gradient buffer for bf16 logits, and a label outside the vocabulary,
// which the GPU reports through a NaN loss.
TEST(CudaCrossEntropy, SeparateOutputAndBadLabel) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 4, v = 24;
  auto logits = round_bf16(random_floats(n * v, -3, 3, 77));
  std::vector<int32_t> labels{3, kIgnore, 23, 0};
  std::vector<float> want_lse(n), want_d(n * v);
  auto s = cpu::cross_entropy_forward(host(logits, {n, v}), host(labels, {n}), kIgnore, host(want_lse, {n}));
  cpu::cross_entropy_backward(host(logits, {n, v}), host(labels, {n}), host(want_lse, {n}), kIgnore, 0.5f,
                              host(want_d, {n, v}));
  auto d_logits = upload(logits, DType::bf16, {n, v}), d_labels = upload(labels, {n});
  auto d_lse = poisoned(DType::f32, {n}), d_grad = poisoned(DType::f32, {n, v});
  auto got = cuda::cross_entropy_forward(d_logits.t, d_labels.t, kIgnore, d_lse.t);
  EXPECT_EQ(got.count, s.count);
  cuda::cross_entropy_backward(d_logits.t, d_labels.t, d_lse.t, kIgnore, 0.5f, d_grad.t);
  // f32 output: only lse and expf differ (see above), V = 24.
  EXPECT_TRUE(near("dlogits", download(d_grad.t), want_d, Tol{0, 0.5 * (2 * 32 + 100) * kF32Round}));

  labels[2] = static_cast<int32_t>(v);
  auto d_bad = upload(labels, {n});
  EXPECT_TRUE(std::isnan(cuda::cross_entropy_forward(d_logits.t, d_bad.t, kIgnore, d_lse.t).loss_sum));
}

// AdamW is bit for bit the CPU's update (same operations, same order, no fused
// multiply-add on the GPU), so the comparison is exact. The list mixes decayed and
// undecayed blocks, one element, sizes that are not multiples of 4, an empty block,
// and blocks of several 16384-element chunks.
TEST(CudaAdamW, MultiTensorStepMatchesCpuExactly) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 6000;
  const std::vector<int64_t> sizes{1, 103, 0, 40000, 7, 70001};
  for (int64_t step : {1, 1000}) {
    SCOPED_TRACE("step " + std::to_string(step));
    cpu::AdamWStep s;
    s.lr = 3e-3;
    s.beta1 = 0.9;
    s.beta2 = 0.95;
    s.eps = 1e-8;
    s.weight_decay = 0.1;
    s.step = step;
    std::vector<std::vector<float>> p, g, m, v;
    std::vector<DeviceTensor> dev, copies;
    std::vector<AdamWBlock> cpu_blocks, gpu_blocks;
    for (size_t b = 0; b < sizes.size(); ++b) {
      const int64_t n = sizes[b];
      p.push_back(random_floats(n, -1, 1, ++seed));
      g.push_back(random_floats(n, -1, 1, ++seed));
      m.push_back(random_floats(n, -0.1f, 0.1f, ++seed));
      v.push_back(random_floats(n, 1e-4f, 1e-2f, ++seed));
    }
    for (size_t b = 0; b < sizes.size(); ++b) {
      const int64_t n = sizes[b];
      const bool decay = b % 2 == 0;
      for (auto* x : {&p[b], &g[b], &m[b], &v[b]}) dev.push_back(upload(*x, DType::f32, {n}));
      const size_t k = dev.size() - 4;
      // Odd blocks also write their bf16 compute copy in the same pass.
      copies.push_back(poisoned(DType::bf16, {n}));
      gpu_blocks.push_back({dev[k].t, dev[k + 1].t, dev[k + 2].t, dev[k + 3].t, decay,
                            b % 2 == 1 ? copies.back().t : Tensor()});
    }
    for (size_t b = 0; b < sizes.size(); ++b) {
      const int64_t n = sizes[b];
      cpu_blocks.push_back({host(p[b], {n}), host(g[b], {n}), host(m[b], {n}), host(v[b], {n}), b % 2 == 0, Tensor()});
    }
    cpu::adamw_step_multi(cpu_blocks, s);
    cuda::adamw_step_multi(gpu_blocks, s);
    for (size_t b = 0; b < sizes.size(); ++b) {
      SCOPED_TRACE("block " + std::to_string(b));
      EXPECT_TRUE(near("param", download(gpu_blocks[b].param), p[b], Tol{}));
      EXPECT_TRUE(near("m", download(gpu_blocks[b].m), m[b], Tol{}));
      EXPECT_TRUE(near("v", download(gpu_blocks[b].v), v[b], Tol{}));
      if (b % 2 == 1) {
        EXPECT_TRUE(near("bf16 copy", download(copies[b].t), round_bf16(p[b]), Tol{}));
      }
    }
  }
}

TEST(CudaAdamW, SingleTensorStepMatchesCpuExactly) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 1001;
  auto p = random_floats(n, -1, 1, 1), g = random_floats(n, -1, 1, 2);
  auto m = random_floats(n, -0.1f, 0.1f, 3), v = random_floats(n, 1e-4f, 1e-2f, 4);
  auto dp = upload(p, DType::f32, {n}), dg = upload(g, DType::f32, {n});
  auto dm = upload(m, DType::f32, {n}), dv = upload(v, DType::f32, {n});
  cpu::AdamWStep s;
  s.lr = 1e-3;
  s.weight_decay = 0.01;
  s.step = 7;
  cpu::adamw_step(host(p, {n}), host(g, {n}), host(m, {n}), host(v, {n}), s);
  cuda::adamw_step_multi({AdamWBlock{dp.t, dg.t, dm.t, dv.t, true, Tensor(), 0}}, s);
  EXPECT_TRUE(near("param", download(dp.t), p, Tol{}));
  EXPECT_TRUE(near("m", download(dm.t), m, Tol{}));
  EXPECT_TRUE(near("v", download(dv.t), v, Tol{}));
  // Views one element in (a shard's pieces start anywhere): the unvectorised path.
  auto from1 = [](const DeviceTensor& d) { return Tensor(static_cast<float*>(d.t.data) + 1, {n - 1}, DType::f32, Device::cuda); };
  auto tail = [](std::vector<float>& x) { return Tensor(x.data() + 1, {n - 1}, DType::f32); };
  s.step = 8;
  cpu::adamw_step(tail(p), tail(g), tail(m), tail(v), s);
  cuda::adamw_step_multi({AdamWBlock{from1(dp), from1(dg), from1(dm), from1(dv), true, Tensor(), 0}}, s);
  EXPECT_TRUE(near("param (offset views)", download(dp.t), p, Tol{}));
  EXPECT_TRUE(near("m (offset views)", download(dm.t), m, Tol{}));
}

// bf16 moments, rounded stochastically with noise keyed by block key + element: the GPU
// stores exactly the CPU's bits, in the vectorised path (whole blocks, several chunks)
// and the element-wise one (a view one element in, odd sizes).
TEST(CudaAdamW, Bf16MomentsMatchCpuExactly) {
  MT_SKIP_WITHOUT_GPU();
  const std::vector<int64_t> sizes{1, 103, 40000, 70001};
  cpu::AdamWStep s;
  s.lr = 3e-3;
  s.weight_decay = 0.1;
  s.step = 17;
  uint64_t seed = 7000;
  std::vector<std::vector<float>> p, g, m, v;
  for (int64_t n : sizes) {
    p.push_back(random_floats(n, -1, 1, ++seed));
    g.push_back(random_floats(n, -1, 1, ++seed));
    m.push_back(round_bf16(random_floats(n, -0.1f, 0.1f, ++seed)));
    v.push_back(round_bf16(random_floats(n, 1e-4f, 1e-2f, ++seed)));
  }
  std::vector<DeviceTensor> dev;
  std::vector<std::vector<uint16_t>> hm, hv;
  std::vector<AdamWBlock> cpu_blocks, gpu_blocks;
  for (size_t b = 0; b < sizes.size(); ++b) {
    const int64_t n = sizes[b], skip = b == 1 ? 1 : 0;  // block 1: a view one element in
    const uint64_t key = (static_cast<uint64_t>(b) << 40) + 5;
    dev.push_back(upload(p[b], DType::f32, {n}));
    dev.push_back(upload(g[b], DType::f32, {n}));
    dev.push_back(upload(m[b], DType::bf16, {n}));
    dev.push_back(upload(v[b], DType::bf16, {n}));
    const size_t k = dev.size() - 4;
    auto view = [&](const Tensor& t) {
      return Tensor(static_cast<char*>(t.data) + skip * dtype_size(t.dtype), {n - skip}, t.dtype, Device::cuda);
    };
    gpu_blocks.push_back({view(dev[k].t), view(dev[k + 1].t), view(dev[k + 2].t), view(dev[k + 3].t), true, Tensor(),
                          key});
    hm.emplace_back(), hv.emplace_back();
    for (float x : m[b]) hm.back().push_back(bf16_from_f32(x));
    for (float x : v[b]) hv.back().push_back(bf16_from_f32(x));
  }
  for (size_t b = 0; b < sizes.size(); ++b) {
    const int64_t n = sizes[b], skip = b == 1 ? 1 : 0;
    cpu_blocks.push_back({Tensor(p[b].data() + skip, {n - skip}, DType::f32),
                          Tensor(g[b].data() + skip, {n - skip}, DType::f32),
                          Tensor(hm[b].data() + skip, {n - skip}, DType::bf16),
                          Tensor(hv[b].data() + skip, {n - skip}, DType::bf16), true, Tensor(), gpu_blocks[b].key});
  }
  cpu::adamw_step_multi(cpu_blocks, s);
  cuda::adamw_step_multi(gpu_blocks, s);
  for (size_t b = 0; b < sizes.size(); ++b) {
    SCOPED_TRACE("block " + std::to_string(b));
    std::vector<float> want_m, want_v;
    for (uint16_t x : hm[b]) want_m.push_back(f32_from_bf16(x));
    for (uint16_t x : hv[b]) want_v.push_back(f32_from_bf16(x));
    EXPECT_TRUE(near("param", download(dev[4 * b].t), p[b], Tol{}));
    EXPECT_TRUE(near("m", download(dev[4 * b + 2].t), want_m, Tol{}));
    EXPECT_TRUE(near("v", download(dev[4 * b + 3].t), want_v, Tol{}));
  }
}

// Muon's momentum is the CPU's operations in the CPU's order with no fused multiply-add:
// equal bit for bit, for an f32 and a bf16 momentum (rounded stochastically, keyed as
// AdamW's), with and without Nesterov, with a clipping factor, in place (out = grad) and
// into a separate output. Sizes: one element, not a multiple of the block, several grids.
TEST(CudaMuon, MomentumMatchesCpuExactly) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 9000;
  const uint64_t key = (uint64_t{3} << 40) + 11;
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{70001}}) {
    for (DType m_dtype : {DType::f32, DType::bf16}) {
      for (bool nesterov : {true, false}) {
        for (bool in_place : {true, false}) {
          std::ostringstream what;
          what << "n=" << n << " m " << dtype_name(m_dtype) << " nesterov " << nesterov << " in place " << in_place;
          SCOPED_TRACE(what.str());
          cpu::MuonMomentum s;
          s.mu = 0.95f;
          s.nesterov = nesterov;
          s.grad_scale = 0.37f;
          s.step = 12;
          const auto g = random_floats(n, -1, 1, ++seed);
          auto m = random_floats(n, -0.1f, 0.1f, ++seed);
          if (m_dtype == DType::bf16) m = round_bf16(m);

          std::vector<float> want_grad = g, want_out(n), want_m = m;
          std::vector<uint16_t> m_bits;
          for (float x : m) m_bits.push_back(bf16_from_f32(x));
          const Tensor cpu_m = m_dtype == DType::bf16 ? Tensor(m_bits.data(), {n}, DType::bf16) : host(want_m, {n});
          cpu::muon_momentum(host(want_grad, {n}), cpu_m, in_place ? host(want_grad, {n}) : host(want_out, {n}), s,
                             key);
          if (in_place) want_out = want_grad;
          if (m_dtype == DType::bf16)
            for (int64_t i = 0; i < n; ++i) want_m[i] = f32_from_bf16(m_bits[i]);

          auto d_grad = upload(g, DType::f32, {n}), d_m = upload(m, m_dtype, {n});
          auto d_out = poisoned(DType::f32, {n});
          const Tensor out = in_place ? d_grad.t : d_out.t;
          cuda::muon_momentum(d_grad.t, d_m.t, out, s, key);
          EXPECT_TRUE(near("out", download(out), want_out, Tol{}));
          EXPECT_TRUE(near("m", download(d_m.t), want_m, Tol{}));
          if (!in_place) {
            EXPECT_TRUE(near("grad (kept)", download(d_grad.t), g, Tol{}));
          }
        }
      }
    }
  }
}

// The update, two products and a difference, each rounded once: equal bit for bit.
TEST(CudaMuon, ApplyMatchesCpuExactly) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 9100;
  const float lr = 0.02f, decay = 1.0f - lr * 0.1f, step = lr * 0.2f * std::sqrt(96.0f);
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{70001}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    auto p = random_floats(n, -1, 1, ++seed), o = random_floats(n, -1.2f, 1.2f, ++seed);
    auto d_p = upload(p, DType::f32, {n}), d_o = upload(o, DType::f32, {n});
    cpu::muon_apply(host(p, {n}), host(o, {n}), decay, step);
    cuda::muon_apply(d_p.t, d_o.t, decay, step);
    EXPECT_TRUE(near("param", download(d_p.t), p, Tol{}));
  }
}

// |got - want|_F / |want|_F.
double relative_frobenius(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

// The diagonal of O O^T in the wide orientation (O^T O when O [r, c] is tall): NS5 leaves
// the singular values roughly in [0.7, 1.2], so each entry, a weighted mean of their
// squares, lies well inside [0.5, 1.5].
::testing::AssertionResult near_orthogonal(const std::string& what, const std::vector<float>& o, int64_t r,
                                           int64_t c) {
  const bool tall = r > c;
  const int64_t p = tall ? c : r, q = tall ? r : c;
  for (int64_t i = 0; i < p; ++i) {
    double d = 0;
    for (int64_t j = 0; j < q; ++j) {
      const double x = o[static_cast<size_t>(tall ? j * c + i : i * c + j)];
      d += x * x;
    }
    if (!(d >= 0.5 && d <= 1.5))
      return ::testing::AssertionFailure() << what << ": diagonal entry " << i << " of the Gram matrix is " << d
                                           << ", outside [0.5, 1.5]";
  }
  return ::testing::AssertionSuccess();
}

// Newton-Schulz: the GPU's products are bf16 with f32 sums and its iterate is bf16, the
// CPU's all f32, so they agree to bf16 accuracy carried through five iterations: within
// 3e-2 of the CPU's result in Frobenius norm. Square, tall (the transposed path) and wide
// matrices, three in one call (the per-matrix loop, buffers reused). With no iterations
// only the normalisation and the orientation remain: the CPU's values rounded to bf16,
// give or take one bf16 step where the norms' sums (in double, in other orders) differ in
// the last bit of the f32 scale.
TEST(CudaMuon, NewtonSchulzMatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 9200;
  const Shape shapes[] = {{64, 64}, {96, 40}, {40, 96}};
  for (const Shape& shape : shapes) {
    for (int steps : {5, 0}) {
      SCOPED_TRACE("shape " + shape.str() + " steps " + std::to_string(steps));
      const int64_t r = shape[0], c = shape[1], count = 3;
      std::vector<std::vector<float>> want;
      std::vector<DeviceTensor> dev;
      std::vector<Tensor> cpu_list, gpu_list;
      for (int64_t k = 0; k < count; ++k) {
        want.push_back(random_floats(r * c, -1, 1, ++seed));
        dev.push_back(upload(want.back(), DType::f32, shape));
        gpu_list.push_back(dev.back().t);
      }
      for (auto& w : want) cpu_list.push_back(host(w, shape));
      cpu::newton_schulz(cpu_list, steps);
      cuda::newton_schulz(gpu_list, steps);
      for (int64_t k = 0; k < count; ++k) {
        SCOPED_TRACE("matrix " + std::to_string(k));
        const auto got = download(dev[k].t);
        if (steps == 0) {
          EXPECT_TRUE(near("normalised", got, round_bf16(want[k]), Tol{2 * kBf16Round}));
          continue;
        }
        EXPECT_LT(relative_frobenius(got, want[k]), 3e-2);
        EXPECT_TRUE(near_orthogonal("cpu", want[k], r, c));
        EXPECT_TRUE(near_orthogonal("gpu", got, r, c));
      }
    }
  }
}

// cast, add, scale and fill compute one f32 operation per element and round once, as
// the CPU does: equal bit for bit. Sizes: one element, not a multiple of the block,
// more than one grid's worth of grid-stride iterations.
TEST(CudaElementwise, MatchCpuExactly) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 7000;
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{3000000}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " " + std::string(dtype_name(dt)));
      auto a = random_floats(n, -2, 2, ++seed), b = random_floats(n, -2, 2, ++seed);
      auto round = [&](std::vector<float> x) { return dt == DType::bf16 ? round_bf16(std::move(x)) : x; };

      // cast f32 -> dt -> f32 through the GPU, against the same through the CPU.
      auto d_src = upload(a, DType::f32, {n});
      auto d_mid = poisoned(dt, {n}), d_back = poisoned(DType::f32, {n});
      cuda::cast(d_src.t, d_mid.t);
      cuda::cast(d_mid.t, d_back.t);
      EXPECT_TRUE(near("cast", download(d_back.t), round(a), Tol{}));

      // add into a poisoned output, then in place.
      auto ra = round(a), rb = round(b);
      std::vector<float> want(n);
      for (int64_t i = 0; i < n; ++i) want[i] = ra[i] + rb[i];
      want = round(want);
      auto d_a = upload(ra, dt, {n}), d_b = upload(rb, dt, {n}), d_sum = poisoned(dt, {n});
      cuda::add(d_a.t, d_b.t, d_sum.t);
      EXPECT_TRUE(near("add", download(d_sum.t), want, Tol{}));
      cuda::add(d_a.t, d_b.t, d_a.t);
      EXPECT_TRUE(near("add in place", download(d_a.t), want, Tol{}));

      for (float& x : want) x *= 0.3f;
      want = round(want);
      cuda::scale(d_a.t, 0.3f);
      EXPECT_TRUE(near("scale", download(d_a.t), want, Tol{}));

      cuda::fill(d_a.t, 0.1f);
      EXPECT_TRUE(near("fill", download(d_a.t), round(std::vector<float>(n, 0.1f)), Tol{}));
    }
  }
}

// copy_columns makes the same f32 additions in the same order on both sides and rounds
// once: equal bit for bit, for each dtype of dst and of src. MLA's shapes (DeepSeek-V2:
// 128 heads, nope 128, rope 64, v 128, kv latent 512) for a few tokens: the splits, the
// concatenation, k_pe broadcast over the heads and its backward (the sum over them, into an
// f32 gradient); a row count past one grid's worth of grid-stride iterations; one row.
TEST(CudaElementwise, CopyColumnsMatchCpuExactly) {
  MT_SKIP_WITHOUT_GPU();
  struct Case {
    Shape dst;
    int64_t dst_col;
    Shape src;
    int64_t src_col, width;
    bool accumulate;
    DType dst_dtype, src_dtype;
  };
  const int64_t n = 37, h = 128;
  const Case cases[] = {
      {{n, 512}, 0, {n, 576}, 0, 512, false, DType::bf16, DType::bf16},
      {{n, 64}, 0, {n, 576}, 512, 64, false, DType::f32, DType::f32},
      {{n, h, 64}, 0, {n, h, 192}, 128, 64, false, DType::bf16, DType::bf16},
      {{n, h, 192}, 128, {n, h, 64}, 0, 64, true, DType::bf16, DType::bf16},
      {{n, h, 192}, 128, {n, 1, 64}, 0, 64, false, DType::bf16, DType::bf16},
      {{n, 1, 64}, 0, {n, h, 192}, 128, 64, true, DType::f32, DType::bf16},
      {{n, 1, 64}, 0, {n, h, 192}, 128, 64, false, DType::bf16, DType::f32},
      {{n, h, 128}, 0, {n, h, 256}, 128, 128, false, DType::bf16, DType::bf16},
      {{50000, 40}, 3, {50000, 72}, 30, 37, true, DType::f32, DType::bf16},
      {{9}, 2, {3}, 0, 3, false, DType::bf16, DType::f32},
  };
  uint64_t seed = 7500;
  for (const Case& c : cases) {
    std::ostringstream what;
    what << "dst " << c.dst.str() << " " << dtype_name(c.dst_dtype) << " col " << c.dst_col << ", src "
         << c.src.str() << " " << dtype_name(c.src_dtype) << " col " << c.src_col << ", width " << c.width
         << " acc " << c.accumulate;
    SCOPED_TRACE(what.str());
    auto round = [](DType dt, std::vector<float> x) { return dt == DType::bf16 ? round_bf16(std::move(x)) : x; };
    auto dst0 = round(c.dst_dtype, random_floats(c.dst.numel(), -2, 2, ++seed));
    auto src = round(c.src_dtype, random_floats(c.src.numel(), -2, 2, ++seed));
    auto want = dst0;
    cpu::copy_columns(host(want, c.dst), c.dst_col, host(src, c.src), c.src_col, c.width, c.accumulate);
    want = round(c.dst_dtype, want);
    auto d_dst = upload(dst0, c.dst_dtype, c.dst), d_src = upload(src, c.src_dtype, c.src);
    cuda::copy_columns(d_dst.t, c.dst_col, d_src.t, c.src_col, c.width, c.accumulate);
    EXPECT_TRUE(near("dst", download(d_dst.t), want, Tol{}));
  }
}

// The squares are exact in double and each side adds them in its own order: n
// additions, each within 2^-53 of the running sum, on each side.
TEST(CudaElementwise, SumSquaresMatchesCpu) {
  MT_SKIP_WITHOUT_GPU();
  uint64_t seed = 8000;
  std::vector<int64_t> sizes{1, 0, 16384, 16385, 7, 1000003};
  // More tensors than one launch's table (256) takes, to cover the multi-launch path.
  for (int i = 0; i < 300; ++i) sizes.push_back(1 + i % 37);
  std::vector<std::vector<float>> xs;
  std::vector<DeviceTensor> dev;
  std::vector<Tensor> cpu_list, gpu_list;
  int64_t total = 0;
  for (int64_t n : sizes) {
    xs.push_back(random_floats(n, -2, 2, ++seed));
    dev.push_back(upload(xs.back(), DType::f32, {n}));
    total += n;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    cpu_list.push_back(host(xs[i], {sizes[i]}));
    gpu_list.push_back(dev[i].t);
  }
  const double want = cpu::sum_squares(cpu_list), got = cuda::sum_squares(gpu_list);
  EXPECT_NEAR(got, want, 2.0 * static_cast<double>(total) * std::ldexp(1.0, -53) * want);
  EXPECT_EQ(cuda::sum_squares(gpu_list), got) << "the device reduction must repeat bit for bit";
  EXPECT_EQ(cuda::sum_squares({}), 0.0);
}

// Speed of the fused cross-entropy at the benchmark's LM head (8192 rows of 151936),
// as bytes moved: the forward reads the logits once, the backward reads and writes them.
// Not a correctness test; run with --gtest_also_run_disabled_tests.
TEST(CudaCrossEntropy, DISABLED_TimeBenchmarkShape) {
  MT_SKIP_WITHOUT_GPU();
  const int64_t n = 8192, v = 151936;
  std::vector<int32_t> labels = random_ints(n, 0, static_cast<int32_t>(v - 1), 9);
  auto d_labels = upload(labels, {n});
  auto lse = poisoned(DType::f32, {n});
  for (DType dt : {DType::bf16, DType::f32}) {
    auto logits = random_device(dt, {n, v}, 10);
    const double bytes = static_cast<double>(logits.t.nbytes());
    double f = median_ms(10, [&] { cuda::cross_entropy_forward(logits.t, d_labels.t, kIgnore, lse.t); });
    double b = median_ms(10, [&] {
      cuda::cross_entropy_backward(logits.t, d_labels.t, lse.t, kIgnore, 1.0f / n, logits.t);
    });
    std::printf("  cross_entropy %s N=%ld V=%ld: forward %.3f ms (%.0f GB/s, with its sync), backward %.3f ms "
                "(%.0f GB/s)\n",
                dtype_name(dt).data(), static_cast<long>(n), static_cast<long>(v), f, bytes / (f * 1e6), b,
                2 * bytes / (b * 1e6));
  }
}

}  // namespace
}  // namespace mt::gpu_test
