// Qwen3-MoE, DeepSeek-V2 and GPT-OSS on the GPU against the CPU backend on the Hugging Face
// fixtures: the same five AdamW steps (loss, gradient norm, final weights), and the forward loss.
// Then GPT-OSS with heads of 64 from random weights, so its sinks and windows take cuDNN's
// attention (the fixtures' heads of 16 run on our kernel), checked the same way.
//
// Tolerances. The GPU computes in bf16 (8 significant bits, 2^-8 relative rounding
// error at worst) with f32 accumulation and f32 master weights; the CPU in f32. One
// layer rounds its activations about a dozen times on the way through (norm outputs,
// projections, attention, expert products, residual adds), so a hidden state after the
// 2-3 layers of these fixtures carries ~ sqrt(36) * 2^-9 ~ 1e-2 relative noise in each
// element. The loss is a mean over 24-48 tokens of log-softmax terms of size ~5 whose
// per-element noise averages down: 1e-2 relative is a bound with margin. The gradient
// norm sums squares of gradients that passed through the same roundings twice (forward
// and backward): 3e-2. AdamW normalises each update, so after 5 steps of lr 1e-3 the
// weights differ by at most a few lr-sized steps where the gradient's sign is fragile:
// relative error in norm 1e-2 of weights of norm ~O(1).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "gpu/gpu_test.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/elementwise.h"
#include "train/trainer.h"

namespace mt {
namespace {

std::string fixture(const std::string& name) { return std::string(MOETRAIN_TEST_FIXTURES) + "/" + name; }

std::vector<float> weights_on_host(Model& m) {
  std::vector<float> out;
  for (const HfTensor& t : m.hf_tensors()) {
    std::vector<float> v(static_cast<size_t>(t.value.numel()));
    copy(Tensor(v.data(), t.value.shape, DType::f32), t.value);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Five AdamW steps of the model of config.json on the CPU and on the GPU, each model set up
// by `init`; the steps and the final weights must agree within the header's tolerances.
void five_steps_match(const std::string& name, const std::string& config, const std::string& tokens,
                      const std::function<void(Model&)>& init) {
  Config c;
  c.data.tokens = tokens;
  c.training.steps = 5;
  c.optimizer.lr = 1e-3;
  c.optimizer.weight_decay = 0;
  c.training.load_balance_coef = 0.01;
  std::vector<StepResult> runs[2];
  std::vector<float> weights[2];
  for (int gpu = 0; gpu < 2; ++gpu) {
    ModelOptions o;
    o.device = gpu ? Device::cuda : Device::cpu;
    Config cc = c;
    cc.training.device = gpu ? "cuda" : "cpu";
    std::unique_ptr<Model> m = make_model(config, o);
    init(*m);
    Trainer t(cc, *m, read_token_batch(c.data.tokens, m->vocab_size()));
    for (int i = 0; i < 5; ++i) runs[gpu].push_back(t.step());
    weights[gpu] = weights_on_host(*m);
  }
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(runs[1][i].loss, runs[0][i].loss, 1e-2 * runs[0][i].loss) << "step " << i + 1;
    EXPECT_NEAR(runs[1][i].grad_norm, runs[0][i].grad_norm, 3e-2 * runs[0][i].grad_norm) << "step " << i + 1;
    EXPECT_NEAR(runs[1][i].lb_loss, runs[0][i].lb_loss, 2e-2 * runs[0][i].lb_loss) << "step " << i + 1;
    std::printf("%s step %d: loss cpu %.6f gpu %.6f, grad norm cpu %.6f gpu %.6f\n", name.c_str(), i + 1,
                runs[0][i].loss, runs[1][i].loss, runs[0][i].grad_norm, runs[1][i].grad_norm);
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < weights[0].size(); ++i) {
    num += (weights[1][i] - weights[0][i]) * static_cast<double>(weights[1][i] - weights[0][i]);
    den += weights[0][i] * static_cast<double>(weights[0][i]);
  }
  EXPECT_LT(std::sqrt(num / den), 1e-2);
}

class CudaModel : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaModel, FiveStepsMatchTheCpuBackend) {
  MT_SKIP_WITHOUT_GPU();
  const std::string name = GetParam();
  five_steps_match(name, fixture(name + "/config.json"), fixture(name + "/tokens.npy"),
                   [&](Model& m) { load_hf(m, fixture(name)); });
}

TEST_P(CudaModel, EvalLossMatchesTheCpuBackend) {
  MT_SKIP_WITHOUT_GPU();
  const std::string name = GetParam();
  LossSum l[2];
  for (int gpu = 0; gpu < 2; ++gpu) {
    ModelOptions o;
    o.device = gpu ? Device::cuda : Device::cpu;
    std::unique_ptr<Model> m = make_model(fixture(name + "/config.json"), o);
    load_hf(*m, fixture(name));
    l[gpu] = Trainer::evaluate(*m, read_token_batch(fixture(name + "/tokens.npy"), m->vocab_size()), 8);
  }
  EXPECT_EQ(l[0].count, l[1].count);
  EXPECT_NEAR(l[1].sum / l[1].count, l[0].sum / l[0].count, 1e-2 * l[0].sum / l[0].count);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaModel,
                         ::testing::Values("qwen3_moe_a", "qwen3_moe_b", "deepseek_v2_a", "deepseek_v2_b",
                                           "gpt_oss_a", "deepseek_v3_a"));

// gpt_oss_a's config with heads of 64 (its tokens: 3 rows of 16 positions, so the 5-key
// window cuts the sliding layer's rows), random weights: both layers' attention runs on
// cuDNN with sinks, the sliding one with its window too.
TEST(CudaModelCudnn, GptOssWithSinksAndWindowOnCudnnMatchesTheCpuBackend) {
  MT_SKIP_WITHOUT_GPU();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "moetrain_gpt_oss_d64";
  std::filesystem::create_directories(dir);
  std::ifstream in(fixture("gpt_oss_a/config.json"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string from = "\"head_dim\": 16", to = "\"head_dim\": 64";
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << "gpt_oss_a's config.json no longer has " << from;
  text.replace(at, from.size(), to);
  std::ofstream(dir / "config.json") << text;
  const int64_t calls = cuda::attention_cudnn_calls();
  five_steps_match("gpt_oss d64", (dir / "config.json").string(), fixture("gpt_oss_a/tokens.npy"),
                   [](Model& m) { init_random(m, 0.15, 7); });
  EXPECT_GT(cuda::attention_cudnn_calls(), calls) << "GPT-OSS's attention did not reach cuDNN";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mt
