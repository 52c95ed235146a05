// Qwen3-MoE, DeepSeek-V2 and GPT-OSS on the GPU against the CPU backend on the Hugging Face
// fixtures: the same five AdamW steps (loss, gradient norm, final weights), and the forward loss.
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

#include "gpu/gpu_test.h"
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

class CudaModel : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaModel, FiveStepsMatchTheCpuBackend) {
  MT_SKIP_WITHOUT_GPU();
  const std::string name = GetParam();
  Config c;
  c.data.tokens = fixture(name + "/tokens.npy");
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
    std::unique_ptr<Model> m = make_model(fixture(name + "/config.json"), o);
    load_hf(*m, fixture(name));
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
                                           "gpt_oss_a"));

}  // namespace
}  // namespace mt
