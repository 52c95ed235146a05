// The op table: every CPU kernel at every shape worth checking, forward against a
// float64 reference and backward against central finite differences. See
// tests/ops/op_case.h for what a row checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>

#include "core/dtype.h"
#include "kernels/adamw.h"
#include "kernels/grouped_gemm.h"
#include "ops/cases.h"

namespace mt::test {
namespace {

std::vector<OpCase> table() {
  std::vector<OpCase> t;
  auto add = [&](OpCase c) { t.push_back(std::move(c)); };

  // gemm: every transpose combination, accumulate, one row, odd sizes.
  for (bool ta : {false, true})
    for (bool tb : {false, true}) add(gemm_case(7, 5, 3, ta, tb, 0.0f));
  add(gemm_case(1, 9, 13, false, true, 0.0f));
  add(gemm_case(33, 1, 17, true, false, 0.5f));
  add(gemm_case(130, 24, 129, false, true, 1.0f));

  // embedding: repeated ids, one token.
  add(embedding_case(11, 6, 20));
  add(embedding_case(3, 1, 1));

  // rmsnorm: one row, dims not multiples of 8.
  add(rmsnorm_case(1, 5, 1e-6f));
  add(rmsnorm_case(9, 131, 1e-5f));
  add(rmsnorm_case(4, 6, 1e-6f, true));
  // Zero-centred weights (Qwen3.5): w near 0, the offset 1 added in the kernel.
  add(rmsnorm_case(3, 7, 1e-6f, true, 1.0f));
  // rmsnorm_rope: several heads and batches, a partial rotation, odd positions.
  add(rmsnorm_rope_case(2, 3, 8, 8, {0, 1, 2}));
  add(rmsnorm_rope_case(1, 2, 12, 8, {7, 3, 11, 0}));
  add(rmsnorm_rope_case(1, 2, 12, 4, {5, 0, 9}, 1.0f));

  // cross-entropy: ignored labels, one row, a vocabulary that is not a multiple of 8.
  add(cross_entropy_case(12, 37, 3));
  add(cross_entropy_case(1, 5, 0));
  add(cross_entropy_case(40, 1001, 7));

  // adamw: with and without decay, first and a later step.
  add(adamw_case(1, 0.0f));
  add(adamw_case(7, 0.1f));
  add(adamw_case(1000, 0.01f));

  // elementwise helpers: one element, sizes that are not multiples of 8, both dtypes,
  // a scale that is not a power of two (so bf16 rounds), a list with an empty tensor.
  add(cast_case(1));
  add(cast_case(1001));
  add(add_case(1, DType::f32));
  add(add_case(1001, DType::bf16));
  add(scale_case(37, 0.3f, DType::f32));
  add(scale_case(1001, 0.3f, DType::bf16));
  add(fill_case(13, -2.5f, DType::f32));
  add(fill_case(13, 0.1f, DType::bf16));
  add(sum_squares_case({1}));
  add(sum_squares_case({7, 0, 1001, 33}));

  // column slices, as MLA uses them (5 tokens, 3 heads, latent 4 + rope 2, nope 4, v 3):
  // split kv_a and q, concatenate back, build k from k_nope and k_pe broadcast over the
  // heads, that broadcast's backward (the sum over the heads) run forward, split kv_b; one row.
  add(copy_columns_case({5, 4}, 0, {5, 6}, 0, 4, false));
  add(copy_columns_case({5, 2}, 0, {5, 6}, 4, 2, false));
  add(copy_columns_case({5, 6}, 4, {5, 2}, 0, 2, true));
  add(copy_columns_case({5, 3, 2}, 0, {5, 3, 6}, 4, 2, false));
  add(copy_columns_case({5, 3, 6}, 0, {5, 3, 4}, 0, 4, false));
  add(copy_columns_case({5, 3, 6}, 4, {5, 1, 2}, 0, 2, false));
  add(copy_columns_case({5, 1, 2}, 0, {5, 3, 6}, 4, 2, true));
  add(copy_columns_case({5, 3, 3}, 0, {5, 3, 7}, 4, 3, false));
  add(copy_columns_case({7}, 2, {3}, 0, 3, true));

  // grouped gemm: one row, empty experts (first, last, in between, all but one), K and
  // O not multiples of 8 or 128, with and without bias, overwriting and accumulating; one
  // expert with bias (a dense Linear).
  add(grouped_gemm_case({0, 1, 0}, 5, 3, true, false));
  add(grouped_gemm_case({0, 3, 0, 5, 0}, 7, 6, false, false));
  add(grouped_gemm_case({4, 9, 1, 13}, 33, 20, true, true));
  add(grouped_gemm_case({11}, 129, 9, false, true));
  add(grouped_gemm_case({6, 0, 3, 9}, 12, 130, true, false));
  add(grouped_gemm_case({9}, 6, 5, true, false));

  // swiglu and clamped swiglu: one row, odd widths; GPT-OSS's limit and alpha, and a
  // small limit so the clamps bind in most elements.
  add(swiglu_case(1, 5));
  add(swiglu_case(13, 131));
  add(clamped_swiglu_case(1, 3, 7.0f, 1.702f));
  add(clamped_swiglu_case(17, 45, 7.0f, 1.702f));
  add(clamped_swiglu_case(5, 9, 1.5f, 0.5f));
  // sigmoid gates: elementwise (Qwen3.5's attention output), a gate a row (its shared
  // expert), one column.
  add(sigmoid_gate_case(3, 7, false));
  add(sigmoid_gate_case(5, 9, true));
  add(sigmoid_gate_case(4, 1, true));
  // Gated DeltaNet's short convolution: one token, two sequences (the padding restarts per
  // sequence), fewer tokens than taps, and more channels than one of the backward's blocks.
  add(causal_conv1d_silu_case(1, 1, 3, 4));
  add(causal_conv1d_silu_case(2, 7, 5, 4));
  add(causal_conv1d_silu_case(2, 3, 4, 2));
  add(causal_conv1d_silu_case(2, 9, 67, 4));
  // ... and its gates: one element, several heads, softplus above its threshold.
  add(deltanet_gates_case(1, 1, false));
  add(deltanet_gates_case(5, 3, false));
  add(deltanet_gates_case(6, 4, true));

  // router: k = 1 and k = E, renormalised and not, scale != 1, DeepSeek groups (with
  // just enough eligible experts, too), GPT-OSS scoring, with and without dprobs.
  add(router_case({.rows = 1, .experts = 4, .top_k = 1}));
  add(router_case({.rows = 6, .experts = 8, .top_k = 2, .normalize = true, .dprobs = true}));
  add(router_case({.rows = 5, .experts = 6, .top_k = 6, .scale = 2.5f}));
  add(router_case({.rows = 7, .experts = 8, .top_k = 3, .normalize = true, .scale = 2.5f, .n_group = 4,
                   .topk_group = 2, .dprobs = true}));
  add(router_case({.rows = 9, .experts = 16, .top_k = 4, .n_group = 4, .topk_group = 1}));
  add(router_case({.rows = 5, .experts = 32, .top_k = 4, .gpt_oss = true, .dprobs = true}));
  add(router_case({.rows = 1, .experts = 5, .top_k = 5, .gpt_oss = true}));
  add(router_case({.rows = 3, .experts = 7, .top_k = 1, .gpt_oss = true}));
  // ... and with an expert bias (DeepSeek-V3's loss-free balancing) on each scoring and groups.
  add(router_case({.rows = 9, .experts = 8, .top_k = 2, .normalize = true, .dprobs = true, .bias = true}));
  add(router_case({.rows = 7, .experts = 16, .top_k = 3, .n_group = 4, .topk_group = 2, .bias = true}));
  add(router_case({.rows = 6, .experts = 8, .top_k = 2, .gpt_oss = true, .bias = true}));
  // DeepSeek-V3's sigmoid scoring: plain; groups ranked by their two best with the bias,
  // renormalised and not, scale != 1, with dprobs; k = E; groups of two (the fewest).
  add(router_case({.rows = 5, .experts = 6, .top_k = 1, .sigmoid = true}));
  add(router_case({.rows = 9, .experts = 16, .top_k = 3, .sigmoid = true, .normalize = true, .scale = 2.5f,
                   .n_group = 4, .topk_group = 2, .dprobs = true, .bias = true}));
  add(router_case({.rows = 9, .experts = 16, .top_k = 4, .sigmoid = true, .scale = 2.5f, .n_group = 4,
                   .topk_group = 2, .dprobs = true, .bias = true}));
  add(router_case({.rows = 7, .experts = 32, .top_k = 6, .sigmoid = true, .normalize = true, .n_group = 8,
                   .topk_group = 3, .dprobs = true}));
  add(router_case({.rows = 4, .experts = 8, .top_k = 8, .sigmoid = true, .normalize = true, .scale = 1.5f,
                   .dprobs = true}));
  add(router_case({.rows = 6, .experts = 12, .top_k = 2, .sigmoid = true, .normalize = true, .n_group = 6,
                   .topk_group = 1, .bias = true}));
  // router z-loss: one row, one expert, and logits large enough that logsumexp needs its max.
  add(router_z_case(1, 1, 2.0));
  add(router_z_case(6, 8, 2.0));
  add(router_z_case(4, 128, 30.0));

  // dispatch and combine: one token, k = 1, k = E, first and last expert empty, and
  // capacity dropping (the dropped count is an output of the dispatch rows).
  for (auto row : {dispatch_case, combine_case}) {
    add(row(1, 4, 1, 5, 0, false));
    add(row(13, 6, 2, 7, 0, true));
    add(row(9, 4, 4, 3, 0, false));
    add(row(17, 5, 2, 9, 4, false));
    add(row(20, 8, 3, 6, 5, true));
  }

  // rope: default and both YaRN presets, halves and interleaved, partial rotary, odd
  // heads and tokens, positions that are not 0..T-1 (kept small: fp32 angles lose pos * 2^-23).
  add(rope_case({.batch = 2, .heads = 3, .head_dim = 8, .rotary_dim = 8, .positions = {0, 1, 2}}));
  add(rope_case({.interleaved = true, .head_dim = 10, .rotary_dim = 6, .positions = {7, 3, 11, 0, 2}}));
  add(rope_case({.heads = 5, .head_dim = 12, .rotary_dim = 8, .positions = {5, 6, 7, 8, 9, 10, 11}}));
  add(rope_case({.scaling = RopeScaling::yarn_gpt_oss, .heads = 3, .head_dim = 16, .rotary_dim = 16,
                 .positions = {13, 2, 9, 4, 17}}));
  add(rope_case({.scaling = RopeScaling::yarn_gpt_oss, .interleaved = true, .batch = 2, .heads = 1, .head_dim = 20,
                 .rotary_dim = 16, .positions = {19, 20, 21}}));
  add(rope_case({.scaling = RopeScaling::yarn_deepseek, .interleaved = true, .batch = 2, .heads = 3, .head_dim = 8,
                 .rotary_dim = 8, .positions = {1, 4, 9}}));
  add(rope_case({.scaling = RopeScaling::yarn_deepseek, .heads = 3, .head_dim = 12, .rotary_dim = 8,
                 .positions = {6, 0, 15, 3, 8, 1, 12}}));

  // attention: MHA and GQA, one token (with a sink: alone, its one key takes all the
  // weight and dq is 0), decoding one query against a cache, lengths that are not
  // multiples of 8, a window, sinks (GPT-OSS: GQA + window + sinks), and ring-attention
  // chunks (Tq != Tk, offsets) including blocks where some query rows see no key.
  add(attention_case({.tq = 1, .tk = 1, .hq = 2, .hkv = 2, .dim = 5, .sinks = true}));
  add(attention_case({.tq = 1, .tk = 9, .hq = 4, .hkv = 2, .dim = 16, .q_offset = 8}));
  add(attention_case({.batch = 2, .tq = 7, .tk = 7, .hq = 3, .hkv = 3, .dim = 16}));
  add(attention_case({.tq = 13, .tk = 13, .hq = 6, .hkv = 2, .dim = 5}));
  add(attention_case({.tq = 7, .tk = 7, .hq = 4, .hkv = 1, .dim = 16, .window = 3}));
  add(attention_case({.tq = 7, .tk = 7, .hq = 2, .hkv = 2, .dim = 5, .sinks = true}));
  add(attention_case({.batch = 2, .tq = 13, .tk = 13, .hq = 6, .hkv = 2, .dim = 5, .window = 3, .sinks = true}));
  add(attention_case({.tq = 5, .tk = 7, .hq = 4, .hkv = 2, .dim = 5, .q_offset = 7}));
  add(attention_case({.batch = 2, .tq = 5, .tk = 7, .hq = 4, .hkv = 1, .dim = 5, .window = 4, .q_offset = 7}));
  add(attention_case({.tq = 7, .tk = 5, .hq = 6, .hkv = 2, .dim = 5, .k_offset = 4}));
  add(attention_case({.tq = 7, .tk = 5, .hq = 6, .hkv = 2, .dim = 16, .window = 3, .sinks = true, .k_offset = 4}));
  // MLA's value head dim differing from the query/key one (DeepSeek: 192/128): narrower,
  // with a window and sinks, with rows that see no key, and wider.
  add(attention_case({.batch = 2, .tq = 7, .tk = 7, .hq = 4, .hkv = 2, .dim = 16, .dim_v = 8}));
  add(attention_case({.tq = 13, .tk = 13, .hq = 6, .hkv = 2, .dim = 12, .window = 3, .sinks = true, .dim_v = 5}));
  add(attention_case({.tq = 7, .tk = 5, .hq = 2, .hkv = 1, .dim = 8, .sinks = true, .k_offset = 4, .dim_v = 3}));
  add(attention_case({.tq = 5, .tk = 7, .hq = 4, .hkv = 1, .dim = 4, .window = 4, .q_offset = 7, .dim_v = 9}));

  // gated delta rule: one token, T a multiple of the chunk and not, the default chunk of
  // 64 with T above it, with and without the initial and final states.
  add(gated_delta_case({.dk = 4, .dv = 3, .chunk = 4}));
  add(gated_delta_case({.batch = 2, .tokens = 5, .heads = 2, .dk = 4, .dv = 3, .chunk = 4, .initial_state = true}));
  add(gated_delta_case({.tokens = 16, .heads = 3, .dk = 5, .dv = 4, .chunk = 4, .final_state = true}));
  add(gated_delta_case({.batch = 2, .tokens = 37, .heads = 2, .dk = 8, .dv = 6, .chunk = 16, .initial_state = true,
                        .final_state = true}));
  add(gated_delta_case({.tokens = 70, .heads = 2, .dk = 6, .dv = 5, .initial_state = true, .final_state = true}));
  return t;
}

// |a - b| within tol of max(|b|, a floor at 1% of the output's largest magnitude):
// relative where values are large, absolute near zero where cancellation makes a
// purely relative test meaningless.
::testing::AssertionResult close_enough(const std::string& what, const Vec& got, const Vec& want, double tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << want.size();
  double scale = 1e-12;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    double allowed = tol * std::max(std::fabs(want[i]), 1e-2 * scale);
    if (!(std::fabs(got[i] - want[i]) <= allowed))
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", expected " << want[i]
                                           << " (allowed error " << allowed << ")";
  }
  return ::testing::AssertionSuccess();
}

Vecs draw_inputs(const OpCase& c) {
  std::mt19937_64 g(c.seed);
  Vecs in;
  for (const Input& x : c.inputs) {
    std::uniform_real_distribution<double> d(x.lo, x.hi);
    Vec v(static_cast<size_t>(x.shape.numel()));
    for (double& e : v) {
      do e = d(g);
      while (e == 0.0);
      // Round to fp32 so the reference and the kernel see the same numbers.
      e = static_cast<double>(static_cast<float>(e));
    }
    in.push_back(std::move(v));
  }
  return in;
}

class OpTable : public ::testing::TestWithParam<OpCase> {};

TEST_P(OpTable, ForwardMatchesFloat64Reference) {
  const OpCase& c = GetParam();
  Vecs in = draw_inputs(c);
  Vecs want = c.reference(in);
  Vecs got = c.forward(in);
  ASSERT_EQ(got.size(), c.outputs.size());
  ASSERT_EQ(want.size(), c.outputs.size());
  for (size_t o = 0; o < c.outputs.size(); ++o) EXPECT_TRUE(close_enough(c.outputs[o].name, got[o], want[o], c.fwd_tol));
}

TEST_P(OpTable, BackwardMatchesFiniteDifferences) {
  const OpCase& c = GetParam();
  Vecs in = draw_inputs(c);
  Vecs out = c.reference(in);
  std::mt19937_64 g(c.seed + 1000);
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  Vecs dout;
  bool any = false;
  for (size_t o = 0; o < c.outputs.size(); ++o) {
    Vec v(out[o].size(), 0.0);
    if (c.outputs[o].differentiable)
      for (double& e : v) e = static_cast<double>(static_cast<float>(d(g)));
    any = any || c.outputs[o].differentiable;
    dout.push_back(std::move(v));
  }
  if (!any) GTEST_SKIP() << "no differentiable output";
  auto loss = [&](const Vecs& x) {
    Vecs y = c.reference(x);
    double l = 0;
    for (size_t o = 0; o < y.size(); ++o)
      for (size_t j = 0; j < y[o].size(); ++j) l += dout[o][j] * y[o][j];
    return l;
  };
  Vecs grads = c.backward(in, dout);
  ASSERT_EQ(grads.size(), c.inputs.size());
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    if (!c.inputs[i].differentiable) continue;
    ASSERT_EQ(grads[i].size(), in[i].size()) << c.inputs[i].name;
    // Every element when small; otherwise a fixed random sample of 400 plus the ends.
    std::vector<size_t> pick;
    size_t n = in[i].size();
    if (n <= 600) {
      for (size_t j = 0; j < n; ++j) pick.push_back(j);
    } else {
      std::mt19937_64 s(c.seed + 7 * i);
      pick = {0, n - 1};
      for (int j = 0; j < 400; ++j) pick.push_back(s() % n);
    }
    Vec fd, an;
    for (size_t j : pick) {
      Vecs x = in;
      double h = c.fd_step * std::max(1.0, std::fabs(in[i][j]));
      x[i][j] = in[i][j] + h;
      double up = loss(x);
      x[i][j] = in[i][j] - h;
      double down = loss(x);
      fd.push_back((up - down) / (2 * h));
      an.push_back(grads[i][j]);
    }
    EXPECT_TRUE(close_enough("d" + c.inputs[i].name, an, fd, c.bwd_tol));
  }
}

std::string case_name(const ::testing::TestParamInfo<OpCase>& info) {
  std::string s;
  for (char ch : info.param.name) s += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Cpu, OpTable, ::testing::ValuesIn(table()), case_name);

}  // namespace
}  // namespace mt::test

namespace mt::test {
namespace {

// A window of experts (what the expert cache runs, models/expert_cache.h): experts
// [1, 3) of 4 as w.rows(1, 3) with offsets.rows(1, 4) over the whole x and y gives the
// full call's rows of those experts, bit for bit, and leaves every other row alone.
TEST(GroupedGemm, AWindowOfExpertsTouchesOnlyItsRows) {
  const int64_t E = 4, K = 5, O = 3;
  std::vector<int32_t> offsets = {0, 2, 5, 5, 8};
  const int64_t N = offsets.back();
  std::mt19937_64 g(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto draw = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = u(g);
    return v;
  };
  std::vector<float> x = draw(N * K), w = draw(E * O * K), b = draw(E * O), dy = draw(N * O), dw0 = draw(E * O * K);
  auto t = [](std::vector<float>& v, Shape s) { return Tensor(v.data(), std::move(s), DType::f32); };
  const Tensor off(offsets.data(), {E + 1}, DType::i32);
  std::vector<float> y(N * O), dx(N * K);
  cpu::grouped_gemm(t(x, {N, K}), t(w, {E, O, K}), t(b, {E, O}), off, t(y, {N, O}));
  cpu::grouped_gemm_backward_input(t(dy, {N, O}), t(w, {E, O, K}), off, t(dx, {N, K}));
  for (bool accumulate : {false, true}) {
    std::vector<float> dw = dw0, db(E * O, 0.5f);
    cpu::grouped_gemm_backward_weight(t(x, {N, K}), t(dy, {N, O}), off, t(dw, {E, O, K}), t(db, {E, O}), accumulate);
    const float poison = -7.0f;
    std::vector<float> wy(N * O, poison), wdx(N * K, poison), wdw(2 * O * K, poison), wdb(2 * O, 0.5f);
    std::copy(dw0.begin() + O * K, dw0.begin() + 3 * O * K, wdw.begin());
    const Tensor ww = t(w, {E, O, K}).rows(1, 3), wb = t(b, {E, O}).rows(1, 3), wo = off.rows(1, 4);
    cpu::grouped_gemm(t(x, {N, K}), ww, wb, wo, t(wy, {N, O}));
    cpu::grouped_gemm_backward_input(t(dy, {N, O}), ww, wo, t(wdx, {N, K}));
    cpu::grouped_gemm_backward_weight(t(x, {N, K}), t(dy, {N, O}), wo, t(wdw, {2, O, K}), t(wdb, {2, O}), accumulate);
    for (int64_t r = 0; r < N; ++r) {
      const bool in = r >= offsets[1] && r < offsets[3];
      for (int64_t j = 0; j < O; ++j) EXPECT_EQ(wy[r * O + j], in ? y[r * O + j] : poison) << r;
      for (int64_t j = 0; j < K; ++j) EXPECT_EQ(wdx[r * K + j], in ? dx[r * K + j] : poison) << r;
    }
    // Expert 2 has no rows: zero without accumulation, its old value with.
    for (int64_t i = 0; i < 2 * O * K; ++i) EXPECT_EQ(wdw[i], dw[O * K + i]) << i;
    for (int64_t j = 0; j < 2 * O; ++j) EXPECT_EQ(wdb[j], db[O + j]) << j;
  }
}

// bf16 moments (optimizer.state_dtype = bf16). One step from random state against a
// float64 AdamW: the parameter sees the unrounded f32 moments, so it is as close as the
// f32 step's; each stored moment is one of the two bf16 values around the exact one.
TEST(AdamWBf16Moments, StepMatchesFloat64AndStoresANeighbour) {
  const int64_t n = 517;
  std::mt19937_64 g(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> p(n), gr(n), m32(n), v32(n);
  std::vector<uint16_t> m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = u(g), gr[i] = u(g);
    m[i] = bf16_from_f32(0.1f * u(g));
    v[i] = bf16_from_f32(1e-4f + 1e-2f * std::fabs(u(g)));
    m32[i] = f32_from_bf16(m[i]), v32[i] = f32_from_bf16(v[i]);
  }
  cpu::AdamWStep s;
  s.lr = 3e-3, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = 0.1, s.step = 5;
  std::vector<float> p0 = p;
  cpu::adamw_step(Tensor(p.data(), {n}, DType::f32), Tensor(gr.data(), {n}, DType::f32),
                  Tensor(m.data(), {n}, DType::bf16), Tensor(v.data(), {n}, DType::bf16), s, 123);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = gr[i], mi = s.beta1 * m32[i] + (1 - s.beta1) * gi, vi = s.beta2 * v32[i] + (1 - s.beta2) * gi * gi;
    const double mhat = mi / (1 - std::pow(s.beta1, 5.0)), vhat = vi / (1 - std::pow(s.beta2, 5.0));
    const double want = p0[i] - s.lr * s.weight_decay * p0[i] - s.lr * mhat / (std::sqrt(vhat) + s.eps);
    ASSERT_NEAR(p[i], want, 1e-6 + 1e-5 * std::fabs(want)) << "element " << i;
    for (auto [stored, exact, name] : {std::tuple{m[i], mi, "m"}, std::tuple{v[i], vi, "v"}}) {
      const uint32_t down = f32_bits(static_cast<float>(exact)) & 0xffff0000u;  // toward zero
      const double lo = f32_from_bits(down), hi = f32_from_bits(down + 0x10000u);
      const double got = f32_from_bf16(stored);
      ASSERT_TRUE(got == lo || got == hi) << name << "[" << i << "] = " << got << ", exact " << exact
                                          << ", neighbours " << lo << " and " << hi;
    }
  }
}

// The reason for stochastic rounding: with beta2 = 0.999 and a constant gradient of 1,
// v after t steps is 1 - 0.999^t. Rounded to nearest, each increment 0.001 (1 - v) falls
// below half a bf16 step long before v nears 1 (it stalls at 0.25); rounded
// stochastically, v is unbiased, and the mean over many elements tracks the exact value.
TEST(AdamWBf16Moments, StochasticRoundingKeepsTheSecondMomentMoving) {
  const int64_t n = 4096, steps = 2000;
  std::vector<float> p(n, 0.5f), gr(n, 1.0f);
  std::vector<uint16_t> m(n, 0), v(n, 0);
  cpu::AdamWStep s;
  s.lr = 0, s.beta1 = 0.9, s.beta2 = 0.999, s.weight_decay = 0;
  uint16_t nearest = 0;  // one element's v, rounded to nearest each step
  for (int64_t t = 1; t <= steps; ++t) {
    s.step = t;
    cpu::adamw_step(Tensor(p.data(), {n}, DType::f32), Tensor(gr.data(), {n}, DType::f32),
                    Tensor(m.data(), {n}, DType::bf16), Tensor(v.data(), {n}, DType::bf16), s, 0);
    nearest = bf16_from_f32(f32_from_bf16(nearest) * 0.999f + 0.001f);
  }
  double mean = 0;
  for (uint16_t x : v) mean += f32_from_bf16(x);
  mean /= n;
  const double exact = 1 - std::pow(0.999, static_cast<double>(steps));  // 0.8648
  EXPECT_NEAR(mean, exact, 3e-3) << "stochastically rounded v, mean over " << n << " elements";
  EXPECT_LT(f32_from_bf16(nearest), exact - 0.2) << "round to nearest should have stalled well below";
  // The first moment (beta1 = 0.9) is 1 - 0.9^t = 1 for every element by now.
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(f32_from_bf16(m[i]), 1.0f) << i;
}

}  // namespace
}  // namespace mt::test
