// Muon's kernels (kernels/muon.h) against references written here in double: Newton-Schulz
// on a square, a tall and a wide matrix and on a layer's experts at once; the momentum
// and the update element by element.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/muon.h"
#include "models/interface.h"
#include "train/optimizer.h"
#include "train/trainer.h"

namespace mt {
namespace {

using Mat = std::vector<double>;  // row-major

// a [n, k] times b [k, m]
Mat matmul(const Mat& a, const Mat& b, int64_t n, int64_t k, int64_t m) {
  Mat c(static_cast<size_t>(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t l = 0; l < k; ++l)
      for (int64_t j = 0; j < m; ++j) c[i * m + j] += a[i * k + l] * b[l * m + j];
  return c;
}

Mat transpose(const Mat& a, int64_t n, int64_t m) {
  Mat t(a.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) t[j * n + i] = a[i * m + j];
  return t;
}

// The quintic iteration in double, written from its definition.
Mat newton_schulz_reference(Mat g, int64_t rows, int64_t cols, int steps) {
  const bool tall = rows > cols;
  if (tall) g = transpose(g, rows, cols);
  const int64_t p = tall ? cols : rows, q = tall ? rows : cols;
  double norm = 0;
  for (double x : g) norm += x * x;
  norm = std::sqrt(norm) + 1e-7;
  for (double& x : g) x /= norm;
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  for (int it = 0; it < steps; ++it) {
    const Mat A = matmul(g, transpose(g, p, q), p, q, p);
    const Mat AA = matmul(A, A, p, p, p);
    Mat B(A.size());
    for (size_t i = 0; i < A.size(); ++i) B[i] = b * A[i] + c * AA[i];
    const Mat BX = matmul(B, g, p, p, q);
    for (size_t i = 0; i < g.size(); ++i) g[i] = a * g[i] + BX[i];
  }
  return tall ? transpose(g, p, q) : g;
}

std::vector<float> random_matrix(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = d(rng);
  return x;
}

TEST(Muon, NewtonSchulzMatchesFloat64) {
  struct Case {
    int64_t rows, cols, count;
  };
  // square, tall (transposed inside), wide, and a layer's three experts in one call
  for (const Case& k : {Case{16, 16, 1}, Case{24, 10, 1}, Case{10, 24, 1}, Case{12, 8, 3}}) {
    SCOPED_TRACE(std::to_string(k.rows) + "x" + std::to_string(k.cols) + " x" + std::to_string(k.count));
    const int64_t n = k.rows * k.cols;
    std::vector<float> all = random_matrix(n * k.count, static_cast<uint64_t>(7 + k.rows));
    std::vector<Tensor> views;
    for (int64_t e = 0; e < k.count; ++e) views.push_back(Tensor(all.data() + e * n, {k.rows, k.cols}, DType::f32));
    const std::vector<float> before = all;
    cpu::newton_schulz(views, 5);
    for (int64_t e = 0; e < k.count; ++e) {
      const Mat want = newton_schulz_reference(Mat(before.begin() + e * n, before.begin() + (e + 1) * n), k.rows,
                                               k.cols, 5);
      double num = 0, den = 0;
      for (int64_t i = 0; i < n; ++i) {
        num += (all[e * n + i] - want[i]) * (all[e * n + i] - want[i]);
        den += want[i] * want[i];
      }
      EXPECT_LT(std::sqrt(num / den), 1e-5) << "matrix " << e;
      // Orthogonalised: the wide orientation's rows near unit length and near orthogonal
      // (the quintic's fixed band is about [0.7, 1.2] for the singular values).
      const Mat o(all.begin() + e * n, all.begin() + (e + 1) * n);
      const bool tall = k.rows > k.cols;
      const int64_t p = tall ? k.cols : k.rows, q = tall ? k.rows : k.cols;
      const Mat w = tall ? transpose(o, k.rows, k.cols) : o;
      const Mat gram = matmul(w, transpose(w, p, q), p, q, p);
      for (int64_t i = 0; i < p; ++i) {
        EXPECT_GT(gram[i * p + i], 0.4) << "row " << i;
        EXPECT_LT(gram[i * p + i], 1.6) << "row " << i;
      }
    }
  }
}

TEST(Muon, MomentumAndUpdateElementByElement) {
  const int64_t n = 37;
  const std::vector<float> g0 = random_matrix(n, 1), m0 = random_matrix(n, 2), p0 = random_matrix(n, 3);
  for (bool nesterov : {true, false}) {
    std::vector<float> g = g0, m = m0;
    cpu::MuonMomentum s{.mu = 0.95f, .nesterov = nesterov, .grad_scale = 0.5f, .step = 3};
    cpu::muon_momentum(Tensor(g.data(), {n}, DType::f32), Tensor(m.data(), {n}, DType::f32),
                       Tensor(g.data(), {n}, DType::f32), s);
    for (int64_t i = 0; i < n; ++i) {
      const double gs = 0.5 * g0[i], mi = 0.95 * m0[i] + gs, u = nesterov ? gs + 0.95 * mi : mi;
      EXPECT_NEAR(m[i], mi, 1e-6 * (1 + std::fabs(mi))) << i;
      EXPECT_NEAR(g[i], u, 1e-6 * (1 + std::fabs(u))) << i;
    }
  }
  // bf16 momentum: stored as one of the two bf16 neighbours of the f32 value.
  std::vector<uint16_t> mb(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) mb[i] = bf16_from_f32(m0[i]);
  std::vector<float> g = g0, out(static_cast<size_t>(n));
  cpu::muon_momentum(Tensor(g.data(), {n}, DType::f32), Tensor(mb.data(), {n}, DType::bf16),
                     Tensor(out.data(), {n}, DType::f32), cpu::MuonMomentum{}, 11);
  for (int64_t i = 0; i < n; ++i) {
    const float want = 0.95f * f32_from_bf16(bf16_from_f32(m0[i])) + g0[i];
    const float lo = f32_from_bf16(static_cast<uint16_t>(f32_bits(want) >> 16));
    const float hi = f32_from_bf16(static_cast<uint16_t>((f32_bits(want) >> 16) + 1));
    const float got = f32_from_bf16(mb[i]);
    EXPECT_TRUE(got == lo || got == hi) << i << ": " << got << " not a neighbour of " << want;
    EXPECT_NEAR(out[i], g0[i] + 0.95 * want, 1e-5 * (1 + std::fabs(want))) << i;
  }
  // The update: p (1 - lr wd) - lr o.
  std::vector<float> p = p0;
  cpu::muon_apply(Tensor(p.data(), {n}, DType::f32), Tensor(const_cast<float*>(g0.data()), {n}, DType::f32), 0.99f,
                  0.02f);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(p[i], 0.99 * p0[i] - 0.02 * g0[i], 1e-6) << i;
}

// One training step of each family's fixture with optimizer.name = muon against the
// gradient of the same step (a run with lr 0 keeps its gradients): every Muon matrix moves
// by lr (wd W + 0.2 sqrt(max(rows, cols)) NS5(g)) (the first step's U = (1 + mu) g
// normalises to g's), computed here in double; every other tensor moves exactly as
// AdamW moves it in a run with optimizer.name = adamw.
TEST(Muon, OneTrainingStepMovesEachMatrixByTheFormula) {
  for (const std::string name : {"qwen3_moe_a", "deepseek_v2_a", "gpt_oss_a", "qwen3_5_moe_b"}) {
    SCOPED_TRACE(name);
    const std::string dir = std::string(MOETRAIN_FIXTURES) + "/" + name;
    const double lr = 1e-2, wd = 0.1;
    struct Run {
      std::unique_ptr<Model> model;
      std::vector<HfTensor> tensors;
    };
    auto run = [&](const std::string& optimizer, double rate) {
      Config c;
      c.data.tokens = dir + "/tokens.npy";
      c.training.steps = 1;
      c.training.load_balance_coef = 0.01;
      c.optimizer.name = optimizer;
      c.optimizer.lr = rate;
      c.optimizer.weight_decay = wd;
      Run r{make_model(dir + "/config.json", ModelOptions{}), {}};
      load_hf(*r.model, dir);
      Trainer t(c, *r.model, read_token_batch(c.data.tokens, r.model->vocab_size()));
      t.step();
      r.tensors = r.model->hf_tensors();
      return r;
    };
    Run still = run("adamw", 0.0), adamw = run("adamw", lr), muon = run("muon", lr);
    std::vector<MuonMatrix> matrices = muon_matrices(*muon.model);
    ASSERT_FALSE(matrices.empty());
    size_t checked = 0;
    for (size_t i = 0; i < still.tensors.size(); ++i) {
      const HfTensor &w0 = still.tensors[i], &w1 = muon.tensors[i];
      const int64_t n = w0.value.numel();
      const bool is_matrix = std::any_of(matrices.begin(), matrices.end(), [&](const MuonMatrix& x) {
        return x.name == w0.name;
      });
      if (!is_matrix) {
        const HfTensor& wa = adamw.tensors[i];
        for (int64_t j = 0; j < n; ++j) ASSERT_EQ(w1.value.f32()[j], wa.value.f32()[j]) << w0.name << " " << j;
        continue;
      }
      const int64_t rows = w0.value.dim(0), cols = w0.value.dim(1);
      const Mat o = newton_schulz_reference(Mat(w0.grad.f32(), w0.grad.f32() + n), rows, cols, 5);
      const double factor = 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
      double num = 0, den = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double want_step = lr * wd * w0.value.f32()[j] + lr * factor * o[j];
        const double got_step = static_cast<double>(w0.value.f32()[j]) - w1.value.f32()[j];
        num += (got_step - want_step) * (got_step - want_step);
        den += want_step * want_step;
      }
      EXPECT_LT(std::sqrt(num / den), 1e-4) << w0.name;
      ++checked;
    }
    EXPECT_EQ(checked, matrices.size());
  }
}

}  // namespace
}  // namespace mt
