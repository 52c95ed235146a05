// Qwen3-MoE, DeepSeek-V2 and GPT-OSS against Hugging Face transformers (tests/fixtures, made by
// make_hf_fixtures.py in fp32 with eager attention): loss, logits, every parameter
// gradient, and five AdamW steps with clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <filesystem>
#include <functional>
#include <random>
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>

#include "io/file.h"
#include "kernels/elementwise.h"
#include "kernels/fp8_quant.h"
#include "io/safetensors.h"
#include "models/hf_config.h"
#include "models/deepseek_v2.h"
#include "models/gpt_oss.h"
#include "models/qwen3_moe.h"
#include "train/trainer.h"
#include "test_util.h"

#ifndef MOETRAIN_FIXTURES
#error "MOETRAIN_FIXTURES must name tests/fixtures"
#endif

namespace mt {
namespace {

std::string fixture(const std::string& name) { return std::string(MOETRAIN_FIXTURES) + "/" + name; }

std::vector<float> expected(const io::SafetensorsFile& f, const std::string& key) {
  const io::StTensor* t = f.find(key);
  EXPECT_NE(t, nullptr) << key;
  if (t == nullptr) return {};
  std::vector<float> v(static_cast<size_t>(t->numel()));
  f.read_f32(*t, v.data());
  return v;
}

// What the fixture holds for t under `prefix` ("grad.", "final."), in t's layout: for an
// expert's slice of a fused key (GPT-OSS), that slice, transposed as t says.
std::vector<float> expected_of(const io::SafetensorsFile& f, const std::string& prefix, const HfTensor& t) {
  if (t.fused.empty()) return expected(f, prefix + t.name);
  std::vector<float> all = expected(f, prefix + t.fused), out(static_cast<size_t>(t.value.numel()));
  const int64_t n = t.value.numel(), rows = t.value.ndim() == 2 ? t.value.dim(0) : 1, cols = n / rows;
  EXPECT_EQ(all.size() % static_cast<size_t>(n), 0u) << t.fused;
  if (all.size() < static_cast<size_t>((t.fused_index + 1) * n)) return {};
  const float* slice = all.data() + t.fused_index * n;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = t.transposed ? slice[c * rows + r] : slice[r * cols + c];
  return out;
}

double rel_err_norm(const float* got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

Config fixture_config(const std::string& name, int64_t steps) {
  Config c;
  c.model.init = "hf:" + fixture(name);
  c.data.tokens = fixture(name + "/tokens.npy");
  c.training.steps = steps;
  c.optimizer.lr = 1e-3;
  c.optimizer.beta1 = 0.9;
  c.optimizer.beta2 = 0.95;
  c.optimizer.eps = 1e-8;
  c.optimizer.weight_decay = 0;
  c.training.clip_grad_norm = 1.0;
  return c;
}

// Each (key, value) written over `good` must make `parse` fail with an error naming the
// file, cfg.json.
void expect_refused(const nlohmann::json& good, const std::function<void(const nlohmann::json&)>& parse,
                    std::initializer_list<std::pair<const char*, nlohmann::json>> changes) {
  for (const auto& [key, value] : changes) {
    nlohmann::json bad = good;
    bad[key] = value;
    try {
      parse(bad);
      ADD_FAILURE() << key << " = " << value.dump() << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
    }
  }
}

class HfParity : public ::testing::TestWithParam<std::string> {};

TEST_P(HfParity, LossLogitsAndEveryGradient) {
  const std::string name = GetParam();
  io::SafetensorsFile exp(fixture(name + "/expected.safetensors"));
  std::unique_ptr<Model> model = make_model(fixture(name + "/config.json"));
  load_hf(*model, fixture(name));
  TokenBatch data = read_token_batch(fixture(name + "/tokens.npy"), model->vocab_size());
  std::unique_ptr<Stash> s = model->make_stash(data.rows, data.seq);
  std::copy(data.ids.begin(), data.ids.end(), s->ids.i32());
  std::copy(data.labels.begin(), data.labels.end(), s->labels.i32());
  model->embed_forward(*s);
  for (int64_t l = 0; l < model->num_layers(); ++l)
    for (Stage st : kStages) {
      model->stage_forward(l, st, *s);
      model->finish_forward(l, st, *s);
    }
  LossSum loss = model->head_forward(*s, 0.0f);
  double want_loss = expected(exp, "loss")[0];
  EXPECT_NEAR(loss.sum / loss.count, want_loss, 1e-5 * want_loss);

  std::vector<float> want_logits = expected(exp, "logits");
  Tensor logits = model->logits(*s);
  ASSERT_EQ(static_cast<size_t>(logits.numel()), want_logits.size());
  for (size_t i = 0; i < want_logits.size(); ++i)
    ASSERT_NEAR(logits.f32()[i], want_logits[i], 1e-4 * std::max(1.0f, std::fabs(want_logits[i]))) << i;

  // Backward with B and W deliberately apart: every B of a layer first, then its Ws,
  // and the head's W last of all (deferred, as a pipeline schedule may). The gradients
  // start as NaN: the first write of each (no mark yet) must not read them.
  for (const RouterStats& r : model->router_stats(*s))
    model->set_router_prob_grad(*s, r.layer, std::vector<float>(r.counts.size(), 0.0f));
  for (Param& p : model->params()) fill(p.grad, std::numeric_limits<float>::quiet_NaN());
  clear_gradient_marks(model->params());
  model->head_backward_input(*s, static_cast<float>(1.0 / loss.count));
  for (int64_t l = model->num_layers() - 1; l >= 0; --l) {
    for (int i = 4; i >= 0; --i) {
      model->stage_backward_input(l, kStages[i], *s);
      model->finish_backward_input(l, kStages[i], *s);
    }
    for (int i = 4; i >= 0; --i) model->stage_backward_weight(l, kStages[i], *s);
  }
  model->embed_backward(*s);
  model->head_backward_weight(*s);
  std::set<std::string> keys;
  for (const HfTensor& t : model->hf_tensors()) {
    std::vector<float> g = expected_of(exp, "grad.", t);
    ASSERT_EQ(static_cast<size_t>(t.grad.numel()), g.size()) << t.name;
    EXPECT_LT(rel_err_norm(t.grad.f32(), g), 1e-4) << t.name;
    keys.insert(t.fused.empty() ? t.name : t.fused);
  }
  EXPECT_EQ(keys.size() * 2, exp.tensors().size() - 4) << "every checkpoint key has a gradient";
}

TEST_P(HfParity, FiveAdamWStepsWithClipping) {
  const std::string name = GetParam();
  io::SafetensorsFile exp(fixture(name + "/expected.safetensors"));
  std::unique_ptr<Model> model = make_model(fixture(name + "/config.json"));
  load_hf(*model, fixture(name));
  Trainer trainer(fixture_config(name, 5), *model, read_token_batch(fixture(name + "/tokens.npy"), model->vocab_size()));
  std::vector<float> losses = expected(exp, "step_loss"), norms = expected(exp, "step_grad_norm");
  for (int i = 0; i < 5; ++i) {
    StepResult r = trainer.step();
    EXPECT_NEAR(r.loss, losses[i], 1e-4 * losses[i]) << "step " << i + 1;
    EXPECT_NEAR(r.grad_norm, norms[i], 1e-4 * norms[i]) << "step " << i + 1;
  }
  for (const HfTensor& t : model->hf_tensors())
    EXPECT_LT(rel_err_norm(t.value.f32(), expected_of(exp, "final.", t)), 1e-4) << t.name;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfParity,
                         ::testing::Values("qwen3_moe_a", "qwen3_moe_b", "deepseek_v2_a", "deepseek_v2_b", "deepseek_v3_a",
                                           "gpt_oss_a", "qwen3_5_moe_a", "qwen3_5_moe_b"));

// DeepSeek-V3 with two multi-token prediction depths (deepseek_v3_mtp) against the
// float64 formula of make_hf_fixtures.py's write_mtp_fixture, around transformers' own
// layers (transformers runs no MTP): each depth's loss, every key's gradient of loss +
// 0.3 / 2 x their sum at the first step, five AdamW steps with clipping, the weights after.
TEST(MtpParity, DepthLossesGradientsAndFiveSteps) {
  const std::string name = "deepseek_v3_mtp";
  io::SafetensorsFile exp(fixture(name + "/expected.safetensors"));
  ModelOptions options;
  options.mtp = true;
  std::unique_ptr<Model> model = make_model(fixture(name + "/config.json"), options);
  ASSERT_EQ(model->num_layers(), 2);
  ASSERT_EQ(model->mtp_depths(), 2);
  load_hf(*model, fixture(name));
  Trainer trainer(fixture_config(name, 5), *model, read_token_batch(fixture(name + "/tokens.npy"), model->vocab_size()));
  const std::vector<float> losses = expected(exp, "step_loss"), mtp = expected(exp, "step_mtp_loss"),
                           norms = expected(exp, "step_grad_norm");
  for (int i = 0; i < 5; ++i) {
    StepResult r = trainer.step();
    EXPECT_NEAR(r.loss, losses[i], 1e-4 * losses[i]) << "step " << i + 1;
    ASSERT_EQ(r.mtp_loss.size(), 2u);
    for (size_t k = 0; k < 2; ++k) EXPECT_NEAR(r.mtp_loss[k], mtp[2 * i + k], 1e-4 * mtp[2 * i + k]) << "step " << i + 1;
    EXPECT_NEAR(r.grad_norm, norms[i], 1e-4 * norms[i]) << "step " << i + 1;
    if (i > 0) continue;
    size_t keys = 0;
    for (const HfTensor& t : model->hf_tensors()) {
      EXPECT_LT(rel_err_norm(t.grad.f32(), expected_of(exp, "grad.", t)), 1e-4) << t.name;
      keys += t.name.starts_with("model.layers.2.") || t.name.starts_with("model.layers.3.");
    }
    EXPECT_GT(keys, 2u * 3 * 16) << "the depths' layers, experts included, are the model's tensors";
  }
  for (const HfTensor& t : model->hf_tensors())
    EXPECT_LT(rel_err_norm(t.value.f32(), expected_of(exp, "final.", t)), 1e-4) << t.name;
}

// Blockwise FP8 with the depths (their layers' products and eh_proj quantized as the
// layers' are): one step's losses, depths' losses and gradient norm within what e4m3
// costs of the fp32 run's, and not equal to them. Routing is forced, as in Fp8Parity.
TEST(MtpParity, Fp8WithinQuantizationError) {
  std::vector<StepResult> r;
  for (const char* fp8 : {"none", "blockwise"}) {
    Config cfg = fixture_config("deepseek_v3_mtp", 1);
    cfg.training.fp8 = fp8;
    cfg.training.force_balanced_routing = true;
    std::unique_ptr<Model> model = make_model(fixture("deepseek_v3_mtp/config.json"), model_options(cfg));
    load_hf(*model, fixture("deepseek_v3_mtp"));
    Trainer trainer(cfg, *model, read_token_batch(fixture("deepseek_v3_mtp/tokens.npy"), model->vocab_size()));
    r.push_back(trainer.step());
  }
  ASSERT_EQ(r[1].mtp_loss.size(), 2u);
  EXPECT_NEAR(r[1].loss, r[0].loss, 1e-2 * r[0].loss);
  EXPECT_NE(r[1].loss, r[0].loss);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_NEAR(r[1].mtp_loss[k], r[0].mtp_loss[k], 1e-2 * r[0].mtp_loss[k]) << "depth " << k + 1;
    EXPECT_NE(r[1].mtp_loss[k], r[0].mtp_loss[k]) << "depth " << k + 1;
  }
  EXPECT_NEAR(r[1].grad_norm, r[0].grad_norm, 5e-2 * r[0].grad_norm);
}

// The seam itself: each of Linear's FP8 products equals, in float64, the product of the
// dequantized codes of the layouts it should read (the forward: x in 1x128 rows against
// w's blocks; the input gradient: dy's rows against the blocks of w^T), with beta; the
// weight gradient reads no codes (dy^T x unquantized, with the first-write rule); the
// quantizers are checked against float64 in tests/ops/fp8_quant.cpp.
TEST(Fp8Linear, EachProductReadsTheRightCodes) {
  const int64_t n = 37, k = 200, o = 136;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto randn = [&](int64_t count, float scale) {
    std::vector<float> v(static_cast<size_t>(count));
    for (float& x : v) x = normal(rng) * scale;
    return v;
  };
  std::vector<float> x = randn(n * k, 1.0f), wv = randn(o * k, 0.05f), dy = randn(n * o, 0.1f), y0 = randn(n * o, 1.0f);
  std::vector<uint8_t> q(o * k), qt(o * k);
  std::vector<float> sq(fp8::tiles(o) * fp8::block_scale_cols(k)), sqt(fp8::tiles(k) * fp8::block_scale_cols(o)),
      grad(o * k, NAN);
  std::vector<Param> params(1);
  Param& w = params[0];
  w.name = "w";
  w.value = w.compute = Tensor(wv.data(), {o, k}, DType::f32);
  w.grad = Tensor(grad.data(), {o, k}, DType::f32);
  w.fp8 = {Tensor(q.data(), {o, k}, DType::f8e4m3), Tensor(sq.data(), {fp8::tiles(o), fp8::block_scale_cols(k)}, DType::f32),
           Tensor(qt.data(), {k, o}, DType::f8e4m3), Tensor(sqt.data(), {fp8::tiles(k), fp8::block_scale_cols(o)}, DType::f32),
           true};
  refresh_fp8_weights(params);
  const Linear linear(Fp8::blockwise, true);

  // a [M, K] -> its values after 1x128 row quantization (or 128x128 blocks).
  auto dequantized = [&](const std::vector<float>& a, int64_t m, int64_t kk, bool blocks) {
    std::vector<uint8_t> c(m * kk);
    std::vector<float> sc(blocks ? fp8::tiles(m) * fp8::block_scale_cols(kk) : fp8::tiles(kk) * m), out(m * kk);
    const Tensor ta(const_cast<float*>(a.data()), {m, kk}, DType::f32), tc(c.data(), {m, kk}, DType::f8e4m3),
        ts(sc.data(), blocks ? Shape{fp8::tiles(m), fp8::block_scale_cols(kk)} : Shape{fp8::tiles(kk), m}, DType::f32),
        to(out.data(), {m, kk}, DType::f32);
    if (blocks) {
      cpu::quantize_blocks(ta, tc, ts, true);
      cpu::dequantize_blocks(tc, ts, to);
    } else {
      cpu::quantize_rows(ta, tc, ts, true);
      cpu::dequantize_rows(tc, ts, to);
    }
    return out;
  };
  auto transpose = [](const std::vector<float>& a, int64_t m, int64_t kk) {
    std::vector<float> t(a.size());
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < kk; ++j) t[j * m + i] = a[i * kk + j];
    return t;
  };
  // c [M, N] = a [M, K] b [N, K]^T + beta c0 in float64, against got.
  auto check = [&](const char* what, const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t nn,
                   int64_t kk, float beta, const std::vector<float>& c0, const std::vector<float>& got) {
    double worst = 0, norm = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < nn; ++j) {
        double want = beta != 0.0f ? beta * double{c0[i * nn + j]} : 0.0;
        for (int64_t t = 0; t < kk; ++t) want += double{a[i * kk + t]} * b[j * kk + t];
        worst = std::max(worst, std::fabs(got[i * nn + j] - want));
        norm = std::max(norm, std::fabs(want));
      }
    EXPECT_LT(worst, 1e-5 * norm) << what;
  };

  std::vector<float> y = y0;
  linear.forward(Tensor(x.data(), {n, k}, DType::f32), {{w, Tensor(y.data(), {n, o}, DType::f32), 1.0f}});
  check("forward", dequantized(x, n, k, false), dequantized(wv, o, k, true), n, o, k, 1.0f, y0, y);

  // The same weight as one group of every row with a bias (GPT-OSS's layers): the
  // forward plus the bias, in float64.
  std::vector<float> bias = randn(o, 0.5f), yb(n * o, NAN), with_bias(n * o);
  std::vector<int32_t> rows = {0, static_cast<int32_t>(n)};
  linear.grouped_forward(Tensor(x.data(), {n, k}, DType::f32), w, Tensor(bias.data(), {o}, DType::f32),
                         Tensor(rows.data(), {2}, DType::i32), Tensor(yb.data(), {n, o}, DType::f32));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < o; ++j) with_bias[i * o + j] = bias[j];
  check("grouped forward with a bias", dequantized(x, n, k, false), dequantized(wv, o, k, true), n, o, k, 1.0f,
        with_bias, yb);

  std::vector<float> dx(n * k, NAN);
  linear.backward_input(Tensor(dy.data(), {n, o}, DType::f32), w, Tensor(dx.data(), {n, k}, DType::f32));
  check("input gradient", dequantized(dy, n, o, false), dequantized(transpose(wv, o, k), k, o, true), n, k, o, 0.0f,
        {}, dx);

  // The weight gradient twice: the step's first write replaces the NaNs, the second adds.
  const std::vector<float> want_dw_a = transpose(dy, n, o), want_dw_b = transpose(x, n, k);
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<float> before = grad;
    linear.backward_weight(Tensor(x.data(), {n, k}, DType::f32), {{Tensor(dy.data(), {n, o}, DType::f32), w}});
    check(pass == 0 ? "weight gradient" : "accumulated weight gradient", want_dw_a, want_dw_b, o, k, n,
          pass == 0 ? 0.0f : 1.0f, before, grad);
  }
}

// Blockwise FP8 (training.fp8 = blockwise) on the CPU, which emulates the GPU's codes,
// against the fp32 model (itself checked against transformers above) on the same
// weights and tokens: loss and every gradient within what e4m3's 4 significant bits
// cost, and measurably not fp32's (the products did quantize). Routing is forced, as the
// benchmark does, so that a token whose top-k flips under quantization does not turn a
// small error into another expert's whole gradient.
class Fp8Parity : public ::testing::TestWithParam<std::string> {};

struct Pass {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  std::vector<std::string> names;
};

Pass forward_backward(const std::string& name, Fp8 fp8) {
  ModelOptions o;
  o.fp8 = fp8;
  o.force_balanced_routing = true;
  std::unique_ptr<Model> model = make_model(fixture(name + "/config.json"), o);
  load_hf(*model, fixture(name));
  TokenBatch data = read_token_batch(fixture(name + "/tokens.npy"), model->vocab_size());
  std::unique_ptr<Stash> s = model->make_stash(data.rows, data.seq);
  std::copy(data.ids.begin(), data.ids.end(), s->ids.i32());
  std::copy(data.labels.begin(), data.labels.end(), s->labels.i32());
  model->embed_forward(*s);
  for (int64_t l = 0; l < model->num_layers(); ++l)
    for (Stage st : kStages) model->stage_forward(l, st, *s);
  const LossSum loss = model->head_forward(*s, 0.0f);
  for (const RouterStats& r : model->router_stats(*s)) {  // a balance gradient that varies by expert
    std::vector<float> dprob(r.counts.size());
    for (size_t e = 0; e < dprob.size(); ++e) dprob[e] = 0.01f * static_cast<float>(e % 3);
    model->set_router_prob_grad(*s, r.layer, dprob);
  }
  clear_gradient_marks(model->params());
  model->head_backward_input(*s, static_cast<float>(1.0 / loss.count));
  for (int64_t l = model->num_layers() - 1; l >= 0; --l)
    for (int i = 4; i >= 0; --i) {
      model->stage_backward_input(l, kStages[i], *s);
      model->stage_backward_weight(l, kStages[i], *s);
    }
  model->embed_backward(*s);
  model->head_backward_weight(*s);
  Pass p;
  p.loss = loss.sum / loss.count;
  for (const HfTensor& t : model->hf_tensors()) {
    p.grads.emplace_back(t.grad.f32(), t.grad.f32() + t.grad.numel());
    p.names.push_back(t.name);
  }
  return p;
}

// Measured on these fixtures (widths 12 to 40, so a dot product averages few rounding
// errors): the loss within 0.25% (GPT-OSS's, whose attention and experts have biases and
// more of its products quantize, 0.63%), the gradients' relative errors a median of 0.14
// to 0.30 and at most 0.53; the bounds leave room over those and stay far below what a
// product reading the wrong codes gives (an error of 1 or more).
TEST_P(Fp8Parity, LossAndGradientsWithinQuantizationError) {
  const Pass want = forward_backward(GetParam(), Fp8::none), got = forward_backward(GetParam(), Fp8::blockwise);
  // GPT-OSS's clamp and DeepSeek-V3's group-limited choice (a quantized input flips a
  // near tie of two groups) move the loss further.
  const bool wide = GetParam() == "gpt_oss_a" || GetParam() == "deepseek_v3_a";
  EXPECT_NEAR(got.loss, want.loss, (wide ? 0.01 : 0.005) * want.loss);
  EXPECT_GT(std::fabs(got.loss - want.loss), 1e-6 * want.loss) << "the loss is fp32's: nothing was quantized";
  std::vector<std::pair<double, std::string>> err;
  for (size_t i = 0; i < want.grads.size(); ++i)
    err.emplace_back(rel_err_norm(got.grads[i].data(), want.grads[i]), want.names[i]);
  std::sort(err.begin(), err.end());
  EXPECT_LT(err[err.size() / 2].first, 0.35) << "the median gradient error";
  EXPECT_LT(err.back().first, 0.6) << err.back().second;
  EXPECT_GT(err.back().first, 1e-3) << "every gradient is fp32's: nothing was quantized";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Fp8Parity,
                         ::testing::Values("qwen3_moe_a", "qwen3_moe_b", "deepseek_v2_a", "gpt_oss_a", "deepseek_v3_a"));

// ZeRO-3's slots are not in the FP8 path: refused, with the reason.
TEST(Fp8Parity, RefusesWhatItDoesNotCover) {
  ModelOptions o;
  o.fp8 = Fp8::blockwise;
  o.external_layers = true;
  EXPECT_NE(test::error_of([&] { make_model(fixture("qwen3_moe_a/config.json"), o); }).find("parallelism.zero3"),
            std::string::npos);
}

// The same model under the hub's spelling of the config (num_experts, rope_theta)
// and transformers 5's (num_local_experts, rope_parameters) reads the same.
TEST(Qwen3MoeConfig, HubAndTransformers5Spellings) {
  std::vector<uint8_t> b = io::read_file(fixture("qwen3_moe_b/config.json"));
  nlohmann::json v5 = nlohmann::json::parse(b.begin(), b.end());
  nlohmann::json hub = v5;
  hub.erase("num_local_experts");
  hub["num_experts"] = v5["num_local_experts"];
  hub.erase("rope_parameters");
  hub["rope_theta"] = 1e6;
  Qwen3MoeConfig a = parse_qwen3_moe_config(v5, "v5"), c = parse_qwen3_moe_config(hub, "hub");
  EXPECT_EQ(a.num_experts, 6);
  EXPECT_EQ(c.num_experts, 6);
  EXPECT_EQ(a.rope_theta, 1e6);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(a.is_moe_layer(0));  // decoder_sparse_step 2
  EXPECT_TRUE(a.is_moe_layer(1));
  hub.erase("hidden_size");
  try {
    parse_qwen3_moe_config(hub, "cfg.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.json: missing key hidden_size"), std::string::npos) << e.what();
  }
  hub = v5;
  hub["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_THROW(parse_qwen3_moe_config(hub, "cfg.json"), Error);
}

// DeepSeek-V2's config as the hub spells it (rope_scaling with "type", a top-level
// rope_theta) and as transformers 5 writes it (rope_parameters) read the same; the
// softmax scale carries YaRN's mscale_all_dim; what is not implemented is refused.
TEST(DeepseekV2Config, HubAndTransformers5SpellingsAndRefusals) {
  std::vector<uint8_t> b = io::read_file(fixture("deepseek_v2_a/config.json"));
  nlohmann::json v5 = nlohmann::json::parse(b.begin(), b.end());
  nlohmann::json hub = v5;
  hub.erase("rope_parameters");
  hub["rope_theta"] = 10000.0;
  hub["rope_scaling"] = {{"type", "yarn"},           {"factor", 40.0},           {"beta_fast", 32},
                         {"beta_slow", 1},           {"mscale", 1.0},            {"mscale_all_dim", 0.707},
                         {"original_max_position_embeddings", 4096}};
  DeepseekV2Config a = parse_deepseek_v2_config(v5, "v5"), c = parse_deepseek_v2_config(hub, "hub");
  for (const DeepseekV2Config* x : {&a, &c}) {
    EXPECT_TRUE(x->decoder.rope.yarn);
    EXPECT_EQ(x->decoder.rope.factor, 40.0);
    EXPECT_EQ(x->decoder.rope.rotary_dim, 4);
    EXPECT_EQ(x->decoder.rope.mscale_all_dim, 0.707);
    EXPECT_EQ(x->decoder.router.n_group, 4);
    EXPECT_EQ(x->decoder.router.topk_group, 2);
    EXPECT_FLOAT_EQ(x->decoder.router.scale, 2.5f);
    EXPECT_EQ(x->decoder.shared_intermediate_size, 24);  // 2 shared experts of 12
    EXPECT_EQ(x->decoder.moe, (std::vector<bool>{false, true, true}));  // first_k_dense_replace 1
    EXPECT_EQ(x->q_lora_rank, 0);
  }
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;  // transformers' yarn_get_mscale
  EXPECT_NEAR(a.softmax_scale, m * m / 4.0, 1e-12);     // qk_head_dim 16
  expect_refused(v5, [](const nlohmann::json& j) { parse_deepseek_v2_config(j, "cfg.json"); },
                 {{"topk_method", "noaux_tc"},
                  {"moe_layer_freq", 2},
                  {"num_key_value_heads", 2},
                  {"scoring_func", "sigmoid"},
                  {"qk_rope_head_dim", 3}});
}

// DeepSeek-V3 as transformers 5.17 writes it (deepseek_v3_a), as the hub spells it
// (topk_method and scoring_func given) and as Kimi K2 names it: sigmoid scoring,
// noaux_tc groups, norm_topk_prob honoured; what the router cannot do is refused.
TEST(DeepseekV3Config, SpellingsAndRefusals) {
  std::vector<uint8_t> b = io::read_file(fixture("deepseek_v3_a/config.json"));
  nlohmann::json v5 = nlohmann::json::parse(b.begin(), b.end());
  nlohmann::json hub = v5, kimi = v5;
  hub["topk_method"] = "noaux_tc";
  hub["scoring_func"] = "sigmoid";
  kimi["model_type"] = "kimi_k2";
  for (const nlohmann::json* j : {&v5, &hub, &kimi}) {
    const DeepseekV2Config c = parse_deepseek_v2_config(*j, "cfg");
    EXPECT_EQ(c.decoder.router.scoring, cpu::RouterScoring::sigmoid);
    EXPECT_TRUE(c.decoder.router.normalize);
    EXPECT_EQ(c.decoder.router.n_group, 4);
    EXPECT_EQ(c.decoder.router.topk_group, 2);
    EXPECT_FLOAT_EQ(c.decoder.router.scale, 2.5f);
    // transformers writes num_nextn_predict_layers 1: the depth's layer is a MoE one too.
    EXPECT_EQ(c.decoder.mtp_depths, 1);
    EXPECT_EQ(c.decoder.moe, (std::vector<bool>{false, true, true, true}));
    EXPECT_EQ(c.q_lora_rank, 24);
  }
  nlohmann::json plain = v5;
  plain["norm_topk_prob"] = false;
  EXPECT_FALSE(parse_deepseek_v2_config(plain, "cfg").decoder.router.normalize);
  expect_refused(v5, [](const nlohmann::json& j) { parse_deepseek_v2_config(j, "cfg.json"); },
                 {{"topk_method", "greedy"},
                  {"scoring_func", "softmax"},
                  {"rope_interleave", false},
                  {"n_group", 16},              // groups of one expert: noaux_tc ranks by the two best
                  {"num_experts_per_tok", 9},   // more than topk_group 2 of 4 groups of 4 experts
                  {"n_group", nullptr},
                  {"routed_scaling_factor", nullptr}});
}

// GPT-OSS's config as the hub spells it (gpt_oss_mxfp4: rope_scaling, a top-level
// rope_theta, quantization_config) and as transformers 5 writes it (gpt_oss_a) read the
// fields they share the same way; what is not implemented is refused, naming the file.
TEST(GptOssConfig, HubAndTransformers5SpellingsAndRefusals) {
  auto read = [](const std::string& name) {
    std::vector<uint8_t> b = io::read_file(fixture(name + "/config.json"));
    return nlohmann::json::parse(b.begin(), b.end());
  };
  const nlohmann::json v5 = read("gpt_oss_a"), hub = read("gpt_oss_mxfp4");
  GptOssConfig a = parse_gpt_oss_config(v5, "v5"), h = parse_gpt_oss_config(hub, "hub");
  for (const GptOssConfig* x : {&a, &h}) {
    EXPECT_TRUE(x->decoder.rope.yarn);
    EXPECT_EQ(x->decoder.rope.theta, 150000.0);
    EXPECT_EQ(x->decoder.rope.factor, 32.0);
    EXPECT_FALSE(x->decoder.rope.truncate);
    EXPECT_EQ(x->sliding, (std::vector<bool>{true, false}));
    EXPECT_EQ(x->sliding_window, 5);
    EXPECT_EQ(x->decoder.router.scoring, cpu::RouterScoring::topk_softmax);
  }
  EXPECT_EQ(a.decoder.router.top_k, 3);
  EXPECT_EQ(h.decoder.router.top_k, 2);  // num_experts_per_tok (experts_per_token agrees)
  EXPECT_EQ(h.decoder.num_experts, 4);
  expect_refused(v5, [](const nlohmann::json& j) { parse_gpt_oss_config(j, "cfg.json"); },
                 {{"swiglu_limit", 5.0},
                  {"attention_bias", false},
                  {"quantization_config", {{"quant_method", "bitsandbytes"}}},
                  {"layer_types", {"sliding_attention"}},
                  {"num_key_value_heads", 3},
                  {"head_dim", 15}});
}

// The shared config.json reader: the first spelling present wins, "a.b" is a nested
// key, null is absent, fallbacks fill what is missing, and errors name the file and every
// spelling.
TEST(HfConfig, SpellingsNestingFallbacksAndErrors) {
  const nlohmann::json j = nlohmann::json::parse(
      R"({"n": 3, "theta": null, "rope_parameters": {"rope_theta": 5e5}, "list": [1, 2], "name": "x", "b": true})");
  const HfConfig hf(j, "c.json");
  EXPECT_EQ(hf.integer({"missing", "n"}), 3);
  EXPECT_EQ(hf.number({"theta", "rope_parameters.rope_theta"}), 5e5);
  EXPECT_EQ(hf.number({"theta"}, 1e4), 1e4);
  EXPECT_EQ(hf.integers({"list"}), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(hf.text({"name"}), "x");
  EXPECT_TRUE(hf.flag({"b"}));
  EXPECT_FALSE(hf.flag({"rope_parameters.b"}, false));
  auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error([&] { hf.integer({"a", "rope_parameters.a"}); }).find("c.json: missing key a or rope_parameters.a"),
            std::string::npos);
  EXPECT_NE(error([&] { hf.integer({"name"}); }).find("c.json: key name has the wrong type: \"x\""),
            std::string::npos);
  // A config whose expert count, expert width or top-k is null (or absent) is refused,
  // in every family: a null count built a dense model without a word.
  const std::tuple<const char*, const char*, const char*> null_keys[] = {
      {"qwen3_moe_a", "num_local_experts", "missing key num_experts or num_local_experts (absent or null)"},
      {"qwen3_moe_a", "num_experts_per_tok", "missing key num_experts_per_tok (absent or null)"},
      {"deepseek_v2_a", "n_routed_experts", "missing key n_routed_experts (absent or null)"},
      {"deepseek_v2_a", "moe_intermediate_size", "missing key moe_intermediate_size (absent or null)"},
      {"deepseek_v2_a", "num_experts_per_tok", "missing key num_experts_per_tok (absent or null)"},
      {"gpt_oss_a", "num_local_experts", "missing key num_local_experts or num_experts (absent or null)"},
      {"gpt_oss_a", "num_experts_per_tok", "missing key num_experts_per_tok or experts_per_token (absent or null)"}};
  for (const auto& [fixture, key, says] : null_keys) {
    std::vector<uint8_t> b = io::read_file(std::string(MOETRAIN_FIXTURES) + "/" + fixture + "/config.json");
    nlohmann::json cfg = nlohmann::json::parse(b.begin(), b.end());
    ASSERT_TRUE(cfg.contains(key)) << fixture << " " << key;
    cfg[key] = nullptr;
    const std::string path = test::temp_dir("null_experts") + "/config.json";
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    io::write_file_atomic(path, {cfg.dump()});
    const std::string e = error([&] { make_model(path); });
    EXPECT_NE(e.find(says), std::string::npos) << fixture << " " << key << ": " << e;
  }
  // Sizes near 2^62 overflowed the arenas' sizes; a layer count like that spun for ever.
  const nlohmann::json big = nlohmann::json::parse(R"({"n": 4611686018427387904, "m": -2, "l": [1, 16777217]})");
  const HfConfig hb(big, "big.json");
  EXPECT_NE(error([&] { hb.integer({"n"}); }).find("big.json: key n = 4611686018427387904 is out of range"),
            std::string::npos);
  EXPECT_NE(error([&] { hb.integer({"m"}); }).find("key m = -2 is out of range"), std::string::npos);
  EXPECT_NE(error([&] { hb.integers({"l"}); }).find("key l = 16777217 is out of range"), std::string::npos);
  // Integers written as floats: whole ones are taken; others, and 2.5e95 (past int64:
  // converting it was undefined behaviour, found by fuzz_hf_config), are errors.
  const nlohmann::json floats =
      nlohmann::json::parse(R"({"w": 4096.0, "e": 1e3, "f": 2.5e95, "h": 0.5, "l": [1, 2.0, 3.5]})");
  const HfConfig hf2(floats, "f.json");
  EXPECT_EQ(hf2.integer({"w"}), 4096);
  EXPECT_EQ(hf2.integer({"e"}), 1000);
  EXPECT_NE(error([&] { hf2.integer({"f"}); }).find("f.json: key f = 2.5e+95 should be a whole number"),
            std::string::npos);
  EXPECT_NE(error([&] { hf2.integer({"h"}); }).find("key h = 0.5 should be a whole number"), std::string::npos);
  EXPECT_NE(error([&] { hf2.integers({"l"}); }).find("key l = 3.5 should be a whole number"), std::string::npos);
}

// Fixture `name`'s config.json and weights in folder `dir`, each tensor's shape first
// passed through `edit`, and `extra` tensors added.
void copy_fixture(const std::string& dir, const std::string& name,
                  const std::function<void(const std::string&, std::vector<int64_t>&)>& edit,
                  const std::vector<io::StWrite>& extra = {}) {
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(fixture(name + "/config.json"), dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  io::SafetensorsFile src(fixture(name + "/model.safetensors"));
  std::vector<std::vector<float>> keep;
  std::vector<io::StWrite> out = extra;
  for (const io::StTensor& t : src.tensors()) {
    keep.emplace_back(static_cast<size_t>(t.numel()));
    src.read_f32(t, keep.back().data());
    std::vector<int64_t> shape = t.shape;
    edit(t.name, shape);
    out.push_back(io::st_f32(t.name, shape, keep.back().data()));
  }
  io::write_safetensors(dir + "/model.safetensors", out);
}

// A checkpoint whose tensor has the wrong shape names the key, the file and both shapes.
TEST(Qwen3MoeLoad, MisShapedTensorIsNamed) {
  const std::string dir = ::testing::TempDir() + "/misshaped";
  copy_fixture(dir, "qwen3_moe_a", [](const std::string& name, std::vector<int64_t>& shape) {
    if (name == "model.layers.0.self_attn.k_proj.weight") std::swap(shape[0], shape[1]);
  });
  std::unique_ptr<Model> model = make_model(dir + "/config.json");
  try {
    load_hf(*model, dir);
    FAIL() << "no error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("model.layers.0.self_attn.k_proj.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("[24,32]"), std::string::npos) << m;
    EXPECT_NE(m.find("[32,24]"), std::string::npos) << m;
  }
}

// A DeepSeek-V3 folder's multi-token prediction layer (model.layers.61.* of 61 layers) in a
// model built without its depths (training.mtp_loss_weight = 0): refused by name, with
// the reason, not dropped.
TEST(DeepseekV3Load, MultiTokenPredictionKeysAreRefusedByName) {
  const std::string dir = ::testing::TempDir() + "/v3_mtp";
  const std::vector<float> enorm(32, 1.0f);
  copy_fixture(dir, "deepseek_v3_a", [](const std::string&, std::vector<int64_t>&) {},
               {io::st_f32("model.layers.3.enorm.weight", {32}, enorm.data())});
  std::unique_ptr<Model> model = make_model(dir + "/config.json");
  const std::string m = test::error_of([&] { load_hf(*model, dir); });
  EXPECT_NE(m.find("model.layers.3.enorm.weight belongs to a multi-token prediction layer"), std::string::npos) << m;
  EXPECT_NE(m.find("num_nextn_predict_layers 1"), std::string::npos) << m;
}

// The released checkpoints keep a copy of the embedding and the head with each depth
// (model.layers.{L + k - 1}.embed_tokens, shared_head.head): read, and refused where one
// differs from the model's, which the depths share.
TEST(DeepseekV3Load, DepthCopiesOfTheEmbeddingAndHeadAreTheModels) {
  io::SafetensorsFile f(fixture("deepseek_v3_mtp/model.safetensors"));
  std::vector<float> embed(96 * 32), head(96 * 32);
  f.read_f32(*f.find("model.embed_tokens.weight"), embed.data());
  f.read_f32(*f.find("lm_head.weight"), head.data());
  for (bool differ : {false, true}) {
    const std::string dir = ::testing::TempDir() + "/v3_copies" + (differ ? "_differ" : "");
    std::vector<float> copy = head;
    if (differ) copy[5] += 1.0f;
    copy_fixture(dir, "deepseek_v3_mtp", [](const std::string&, std::vector<int64_t>&) {},
                 {io::st_f32("model.layers.2.embed_tokens.weight", {96, 32}, embed.data()),
                  io::st_f32("model.layers.3.shared_head.head.weight", {96, 32}, copy.data())});
    ModelOptions o;
    o.mtp = true;
    std::unique_ptr<Model> model = make_model(dir + "/config.json", o);
    const std::string m = test::error_of([&] { load_hf(*model, dir); });
    const std::string want = differ ? "model.layers.3.shared_head.head.weight differs from lm_head.weight" : "(no error)";
    EXPECT_NE(m.find(want), std::string::npos) << m;
  }
}

// GPT-OSS's experts alone, as a model gives them (expert slices of one key per layer,
// transposed to [out, in] but for the biases), every other key said to be another
// rank's: load_hf's side of fused keys, without the GPT-OSS model.
class FusedExperts final : public Model {
 public:
  FusedExperts(const std::string& folder, int64_t first, int64_t last, int64_t layers) : layers_(layers) {
    std::vector<uint8_t> b = io::read_file(folder + "/config.json");
    nlohmann::json j = nlohmann::json::parse(b.begin(), b.end());
    experts_ = j["num_local_experts"];
    const int64_t D = j["hidden_size"], I = j["intermediate_size"];
    data_.reserve(static_cast<size_t>(4 * layers * (last - first)));
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t e = first; e < last; ++e)
        for (auto [k, shape, transposed] : {std::tuple{"gate_up_proj", Shape{2 * I, D}, true},
                                            {"gate_up_proj_bias", Shape{2 * I}, false},
                                            {"down_proj", Shape{D, I}, true},
                                            {"down_proj_bias", Shape{D}, false}}) {
          const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
          Tensor v(data_.emplace_back(static_cast<size_t>(shape.numel())).data(), shape, DType::f32);
          tensors_.push_back({p + std::to_string(e) + "." + k, v, v, 1.0f, 0.0f, true, p + k, e, transposed});
        }
  }
  const float* value(const std::string& name) const {
    for (const HfTensor& t : tensors_)
      if (t.name == name) return t.value.f32();
    ADD_FAILURE() << "no " << name;
    return nullptr;
  }
  std::vector<HfTensor> hf_tensors() override { return tensors_; }
  bool held_by_another_rank(const std::string& name) const override {
    return name.find(".mlp.experts.") == std::string::npos;
  }
  int64_t num_experts() const override { return experts_; }
  int64_t num_layers() const override { return layers_; }
  std::vector<Param>& params() override { return params_; }  // none: nothing to refresh
  Device device() const override { return Device::cpu; }
  bool balanced_routing() const override { return false; }
  bool is_moe_layer(int64_t) const override { return true; }
  int64_t vocab_size() const override { return 0; }
  int64_t param_count() const override { return 0; }
  int64_t active_param_count() const override { return 0; }
  std::unique_ptr<Stash> make_bare_stash(int64_t, int64_t) override { return nullptr; }
  std::unique_ptr<ActivationBlock> make_block(int64_t, int64_t, int64_t, int64_t) override { return nullptr; }
  void lend(Stash&, ActivationBlock&) override {}
  void embed_forward(Stash&) override {}
  void stage_forward(int64_t, Stage, Stash&) override {}
  void stage_backward_input(int64_t, Stage, Stash&) override {}
  void stage_backward_weight(int64_t, Stage, Stash&) override {}
  void finish_forward(int64_t, Stage, Stash&) override {}
  void finish_backward_input(int64_t, Stage, Stash&) override {}
  LossSum head_forward(Stash&, float) override { return {}; }
  void head_backward_input(Stash&, float) override {}
  void head_backward_weight(Stash&) override {}
  void embed_backward(Stash&) override {}
  Tensor logits(Stash&) override { return {}; }
  std::vector<RouterStats> router_stats(const Stash&) const override { return {}; }
  void set_router_prob_grad(Stash&, int64_t, const std::vector<float>&) override {}
  void set_expert_bias(int64_t, const std::vector<float>&) override {}

 private:
  int64_t layers_, experts_;
  std::vector<std::vector<float>> data_;
  std::vector<HfTensor> tensors_;
  std::vector<Param> params_;
};

// Fused keys as gpt_oss_a keeps them (f32) and MXFP4 ones (gpt_oss_mxfp4, against
// transformers' dequantization, [E, in, out]), for all experts and for an ep rank's two;
// a layer whose keys nothing reads is still an error.
TEST(LoadHf, FusedAndMxfp4Experts) {
  for (std::string name : {"gpt_oss_a", "gpt_oss_mxfp4"}) {
    const bool mxfp4 = name == "gpt_oss_mxfp4";
    io::HfWeights src(fixture(name)), want(fixture(name), mxfp4 ? "expected" : "model");
    for (auto [first, last] : {std::pair<int64_t, int64_t>{0, mxfp4 ? 4 : 8}, {2, 4}}) {
      FusedExperts m(fixture(name), first, last, 2);
      load_hf(m, fixture(name));
      for (std::string l : {"0", "1"})
        for (std::string k : {"gate_up_proj", "down_proj"}) {
          const std::string key = "model.layers." + l + ".mlp.experts." + k, wkey = (mxfp4 ? "dequant." : "") + key;
          const std::vector<int64_t> shape = want.shape(wkey), bshape = src.shape(key + "_bias");
          const int64_t in = shape[1], out = shape[2];
          std::vector<float> w(static_cast<size_t>(shape[0] * in * out)), bias(static_cast<size_t>(out * shape[0]));
          want.read_f32(wkey, shape, w.data());
          src.read_f32(key + "_bias", bshape, bias.data());
          for (int64_t e = first; e < last; ++e) {
            const std::string p = "model.layers." + l + ".mlp.experts." + std::to_string(e) + "." + k;
            const float *got = m.value(p), *got_bias = m.value(p + "_bias");
            for (int64_t o = 0; o < out; ++o) {
              ASSERT_EQ(got_bias[o], bias[e * out + o]) << name << " " << p << "_bias " << o;
              for (int64_t i = 0; i < in; ++i)
                ASSERT_EQ(got[o * in + i], w[(e * in + i) * out + o]) << name << " " << p << " " << o << " " << i;
            }
          }
        }
    }
    FusedExperts one_layer(fixture(name), 0, 4, 1);
    try {
      load_hf(one_layer, fixture(name));
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tensor model.layers.1.mlp.experts."), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace mt
