#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <tuple>

#include "kernels/router.h"
#include "ops/cases.h"
#include "test_util.h"

namespace mt::test {

namespace {

cpu::RouterConfig config_of(const RouterRow& r) {
  cpu::RouterConfig cfg;
  cfg.top_k = r.top_k;
  cfg.scoring = r.gpt_oss   ? cpu::RouterScoring::topk_softmax
                : r.sigmoid ? cpu::RouterScoring::sigmoid
                            : cpu::RouterScoring::softmax_topk;
  cfg.normalize = r.normalize;
  cfg.scale = r.scale;
  cfg.n_group = r.n_group;
  cfg.topk_group = r.topk_group;
  return cfg;
}

// The k best of `score` among `allowed`, best first, ties to the lower index: repeated
// arg-max, which is a different algorithm from the kernel's partial sort.
std::vector<int64_t> best_k(const Vec& score, std::vector<bool> allowed, int64_t k) {
  std::vector<int64_t> out;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < static_cast<int64_t>(score.size()); ++e)
      if (allowed[e] && (best < 0 || score[e] > score[best])) best = e;
    out.push_back(best);
    allowed[best] = false;
  }
  return out;
}

}  // namespace

std::vector<float> router_bias_of(int64_t experts) {
  std::vector<float> b(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) b[static_cast<size_t>(e)] = static_cast<float>(0.3 * std::sin(1.7 * static_cast<double>(e)));
  return b;
}

OpCase router_case(const RouterRow& r) {
  int64_t n = r.rows, e = r.experts, k = r.top_k;
  std::ostringstream name;
  name << "router N=" << n << " E=" << e << " k=" << k
       << (r.gpt_oss ? " topk_softmax" : r.sigmoid ? " sigmoid" : " softmax_topk")
       << " norm=" << r.normalize << " scale=" << r.scale << " groups=" << r.n_group << "/" << r.topk_group
       << " dprobs=" << r.dprobs << (r.bias ? " bias" : "");
  OpCase c;
  c.name = name.str();
  // A modest logit range: the top-k choice never sits within a finite-difference step
  // of a tie, so the reference is smooth where it is probed.
  c.inputs = {{"logits", {n, e}, -2.0, 2.0}};
  // Sigmoid scoring also writes each token's sum of scores (compared, not differentiated).
  c.outputs = {{"idx", false}, {"weight"}, {"probs", r.dprobs}};
  if (r.sigmoid) c.outputs.push_back({"score_sum", false});
  const std::vector<float> bias_f = r.bias ? router_bias_of(e) : std::vector<float>{};
  c.reference = [=](const Vecs& in) {
    Vec idx, weight, probs, score_sums;
    int64_t group = e / r.n_group;
    for (int64_t t = 0; t < n; ++t) {
      // p: the score, a softmax probability or (sigmoid) 1 / (1 + exp(-l)).
      Vec l(in[0].begin() + t * e, in[0].begin() + (t + 1) * e), p(e);
      double m = l[0], sum = 0;
      for (double v : l) m = std::max(m, v);
      for (int64_t x = 0; x < e; ++x) sum += p[x] = r.sigmoid ? 1 / (1 + std::exp(-l[x])) : std::exp(l[x] - m);
      if (r.sigmoid) {
        score_sums.push_back(sum);
        for (double v : p) probs.push_back(v / sum);
      } else {
        for (double& v : p) v /= sum;
        probs.insert(probs.end(), p.begin(), p.end());
      }

      // The choice ranks the score (the probability, the sigmoid, or GPT-OSS's logit)
      // plus the bias; groups by their best (sigmoid: the sum of their two best).
      Vec key = r.gpt_oss ? l : p;
      for (int64_t x = 0; x < e && r.bias; ++x) key[x] += bias_f[x];
      std::vector<bool> allowed(e, true);
      if (r.n_group > 1) {
        Vec group_score(r.n_group);
        for (int64_t g = 0; g < r.n_group; ++g) {
          Vec members(key.begin() + g * group, key.begin() + (g + 1) * group);
          std::sort(members.begin(), members.end(), std::greater<>());
          group_score[g] = r.sigmoid ? members[0] + members[1] : members[0];
        }
        std::vector<int64_t> groups = best_k(group_score, std::vector<bool>(r.n_group, true), r.topk_group);
        for (int64_t x = 0; x < e; ++x) allowed[x] = std::find(groups.begin(), groups.end(), x / group) != groups.end();
      }
      std::vector<int64_t> top = best_k(key, allowed, k);
      Vec w;
      if (r.gpt_oss) {
        double s = 0, mx = l[top[0]];
        for (int64_t x : top) mx = std::max(mx, l[x]);
        for (int64_t x : top) s += std::exp(l[x] - mx);
        for (int64_t x : top) w.push_back(std::exp(l[x] - mx) / s);
      } else {
        // transformers' DeepSeek-V3 adds 1e-20 to the sigmoid scores' sum.
        double s = r.sigmoid ? 1e-20 : 0;
        for (int64_t x : top) s += p[x];
        for (int64_t x : top) w.push_back(p[x] * r.scale / (r.normalize ? s : 1.0));
      }
      idx.insert(idx.end(), top.begin(), top.end());
      weight.insert(weight.end(), w.begin(), w.end());
    }
    if (r.sigmoid) return Vecs{idx, weight, probs, score_sums};
    return Vecs{idx, weight, probs};
  };
  c.forward = [=](const Vecs& in) {
    auto logits = HostTensor::f32({n, e}, in[0]), idx = HostTensor::i32({n, k});
    auto weight = HostTensor::f32({n, k}), probs = HostTensor::f32({n, e});
    auto bias = r.bias ? HostTensor::f32({e}, Vec(bias_f.begin(), bias_f.end())) : HostTensor{};
    auto sums = r.sigmoid ? HostTensor::f32({n}) : HostTensor{};
    cpu::router_forward(config_of(r), logits.t, idx.t, weight.t, probs.t, bias.t, sums.t);
    if (r.sigmoid) return Vecs{idx.vec(), weight.vec(), probs.vec(), sums.vec()};
    return Vecs{idx.vec(), weight.vec(), probs.vec()};
  };
  // Without dprobs the kernel gets an empty tensor, the path a model without a
  // load-balance loss takes.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    cpu::RouterConfig cfg = config_of(r);
    auto logits = HostTensor::f32({n, e}, in[0]), idx = HostTensor::i32({n, k});
    auto weight = HostTensor::f32({n, k}), probs = HostTensor::f32({n, e});
    auto bias = r.bias ? HostTensor::f32({e}, Vec(bias_f.begin(), bias_f.end())) : HostTensor{};
    auto sums = r.sigmoid ? HostTensor::f32({n}) : HostTensor{};
    cpu::router_forward(cfg, logits.t, idx.t, weight.t, probs.t, bias.t, sums.t);
    auto dweight = HostTensor::f32({n, k}, dout[1]);
    auto dprobs = r.dprobs ? HostTensor::f32({n, e}, dout[2]) : HostTensor{};
    auto dlogits = HostTensor::f32({n, e}, in[0]);
    cpu::router_backward(cfg, logits.t, idx.t, weight.t, probs.t, dweight.t, dprobs.t, dlogits.t, sums.t);
    return Vecs{dlogits.vec()};
  };
  return c;
}

OpCase router_z_case(int64_t n, int64_t e, double range) {
  OpCase c;
  c.name = "router_z N=" + std::to_string(n) + " E=" + std::to_string(e) + " range=" + std::to_string(static_cast<int>(range));
  c.inputs = {{"logits", {n, e}, -range, range}};
  c.outputs = {{"z"}, {"lse", false}};
  c.reference = [=](const Vecs& in) {
    Vec z = {0.0}, lse;
    for (int64_t t = 0; t < n; ++t) {
      double m = in[0][t * e], s = 0;
      for (int64_t x = 0; x < e; ++x) m = std::max(m, in[0][t * e + x]);
      for (int64_t x = 0; x < e; ++x) s += std::exp(in[0][t * e + x] - m);
      lse.push_back(m + std::log(s));
      z[0] += lse.back() * lse.back();
    }
    return Vecs{z, lse};
  };
  c.forward = [=](const Vecs& in) {
    auto logits = HostTensor::f32({n, e}, in[0]), lse = HostTensor::f32({n}), z = HostTensor::f32({1});
    cpu::router_z_forward(logits.t, lse.t, z.t);
    return Vecs{z.vec(), lse.vec()};
  };
  // The backward reads the forward's lse and the router's probs (softmax of the logits,
  // router_forward's); its gradient is added: start from ones and take them off again.
  c.backward = [=](const Vecs& in, const Vecs& dout) {
    auto logits = HostTensor::f32({n, e}, in[0]), lse = HostTensor::f32({n}), z = HostTensor::f32({1});
    cpu::router_z_forward(logits.t, lse.t, z.t);
    cpu::RouterConfig cfg;
    cfg.top_k = 1;
    auto idx = HostTensor::i32({n, 1}), weight = HostTensor::f32({n, 1}), probs = HostTensor::f32({n, e});
    cpu::router_forward(cfg, logits.t, idx.t, weight.t, probs.t);
    auto d = HostTensor::f32({n, e}, Vec(n * e, 1.0));
    cpu::router_z_backward(lse.t, probs.t, static_cast<float>(dout[0][0]), d.t);
    Vec g = d.vec();
    for (double& v : g) v -= 1.0;
    return Vecs{g};
  };
  return c;
}

namespace {

TEST(Router, RejectsBadConfig) {
  auto expect_error = [](const RouterRow& r, const std::string& part) {
    auto logits = HostTensor::f32({2, r.experts}), idx = HostTensor::i32({2, r.top_k});
    auto weight = HostTensor::f32({2, r.top_k}), probs = HostTensor::f32({2, r.experts});
    try {
      cpu::router_forward(config_of(r), logits.t, idx.t, weight.t, probs.t);
      ADD_FAILURE() << "config accepted, expected an error mentioning '" << part << "'";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(part), std::string::npos) << err.what();
    }
  };
  expect_error({.experts = 4, .top_k = 5}, "top_k 5 should be in [1, 4]");
  expect_error({.experts = 6, .top_k = 2, .n_group = 4}, "n_group 4 should divide the 6 experts");
  expect_error({.experts = 8, .top_k = 3, .n_group = 4, .topk_group = 1}, "fewer than top_k=3");
  expect_error({.experts = 8, .top_k = 2, .gpt_oss = true, .scale = 2.0}, "no expert groups and no scale");
  expect_error({.experts = 8, .top_k = 2, .sigmoid = true, .n_group = 8, .topk_group = 4},
               "ranks a group by its two best experts: n_group 8 of 8 experts leaves 1 a group");
  expect_error({.experts = 8, .top_k = 2, .sigmoid = true}, "sigmoid routing needs score_sum f32 [2]");
  // score_sum belongs to sigmoid scoring: given to softmax scoring, it is refused.
  auto logits = HostTensor::f32({2, 8}), idx = HostTensor::i32({2, 2}), weight = HostTensor::f32({2, 2});
  auto probs = HostTensor::f32({2, 8}), sums = HostTensor::f32({2});
  cpu::RouterConfig cfg;
  cfg.top_k = 2;
  EXPECT_NE(error_of([&] { cpu::router_forward(cfg, logits.t, idx.t, weight.t, probs.t, {}, sums.t); })
                .find("score_sum is for sigmoid scoring only"),
            std::string::npos);
}

// DeepSeek-V3's choice on one token with chosen sigmoid scores, 4 groups of 2 experts, the
// best 2 groups eligible, k = 2, scale 2.5: what each step of the formula decides, by hand.
//   scores  0.95 0.05 | 0.80 0.75 | 0.70 0.65 | 0.10 0.20   (sum 4.2)
//   groups by the sum of their two best: 1.00, 1.55, 1.35, 0.30 -> groups 1, 2
//   (by their best, 0.95 0.80 0.70 0.20, it would be groups 0, 1 and experts 0, 2).
// A bias moves the choice, of groups too, never the weights; a bias that lowers every
// eligible score below 0 changes nothing (ineligible experts are out, not scored 0); and
// transformers' 1e-20 shows where the chosen scores are that small.
TEST(Router, SigmoidGroupsRankByTheirTwoBestAndTheBiasMovesOnlyTheChoice) {
  const std::vector<double> s = {0.95, 0.05, 0.80, 0.75, 0.70, 0.65, 0.10, 0.20};
  const int64_t e = 8, k = 2;
  Vec logit;
  for (double v : s) logit.push_back(std::log(v / (1 - v)));
  auto run = [&](const Vec& l, const std::vector<double>& bias, bool normalize) {
    cpu::RouterConfig cfg;
    cfg.top_k = k;
    cfg.scoring = cpu::RouterScoring::sigmoid;
    cfg.normalize = normalize;
    cfg.scale = 2.5f;
    cfg.n_group = 4;
    cfg.topk_group = 2;
    auto logits = HostTensor::f32({1, e}, l), idx = HostTensor::i32({1, k}), weight = HostTensor::f32({1, k});
    auto probs = HostTensor::f32({1, e}), sums = HostTensor::f32({1});
    auto b = bias.empty() ? HostTensor{} : HostTensor::f32({e}, Vec(bias.begin(), bias.end()));
    cpu::router_forward(cfg, logits.t, idx.t, weight.t, probs.t, b.t, sums.t);
    return std::tuple{std::vector<int32_t>(idx.i.begin(), idx.i.end()), weight.vec(), probs.vec(), sums.vec()[0]};
  };
  struct Want {
    const char* what;
    std::vector<double> bias;
    bool normalize;
    std::vector<int32_t> idx;
    Vec weight;
  };
  std::vector<double> lift4(e, 0.0), lift7(e, 0.0), down(e, -1.0);
  lift4[4] = 0.3;  // group 2: 1.00 + 0.65 = 1.65 passes group 1, expert 4 (1.00) passes 2
  lift7[7] = 1.3;  // group 3: 1.50 + 0.10 = 1.60 passes group 1 (1.55): groups 3 and 1
  const Want wants[] = {
      {"no bias", {}, true, {2, 3}, {2.5 * 0.80 / 1.55, 2.5 * 0.75 / 1.55}},
      {"no bias, not renormalised", {}, false, {2, 3}, {2.5 * 0.80, 2.5 * 0.75}},
      {"bias on expert 4", lift4, true, {4, 2}, {2.5 * 0.70 / 1.50, 2.5 * 0.80 / 1.50}},
      {"bias on expert 4, not renormalised", lift4, false, {4, 2}, {2.5 * 0.70, 2.5 * 0.80}},
      {"bias on expert 7", lift7, true, {7, 2}, {2.5 * 0.20 / 1.00, 2.5 * 0.80 / 1.00}},
      {"bias -1 everywhere", down, true, {2, 3}, {2.5 * 0.80 / 1.55, 2.5 * 0.75 / 1.55}},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.what);
    auto [idx, weight, probs, sum] = run(logit, w.bias, w.normalize);
    EXPECT_EQ(idx, w.idx);
    for (int64_t j = 0; j < k; ++j) EXPECT_NEAR(weight[j], w.weight[j], 2e-6) << "slot " << j;
    EXPECT_NEAR(sum, 4.2, 4e-6);
    for (int64_t x = 0; x < e; ++x) EXPECT_NEAR(probs[x], s[x] / 4.2, 1e-7) << "expert " << x;
  }
  // Every score 1 / (1 + e^46) ~ 1.05e-20: the groups and the experts tie (the lower ids
  // win) and each weight is 2.5 s / (2 s + 1e-20), not 2.5 / 2.
  auto [idx, weight, probs, sum] = run(Vec(e, -46.0), {}, true);
  const double tiny = 1 / (1 + std::exp(46.0));
  EXPECT_EQ(idx, (std::vector<int32_t>{0, 1}));
  for (int64_t j = 0; j < k; ++j) EXPECT_NEAR(weight[j], 2.5 * tiny / (2 * tiny + 1e-20), 1e-5) << "slot " << j;
  for (int64_t x = 0; x < e; ++x) EXPECT_NEAR(probs[x], 1.0 / 8, 1e-7) << "expert " << x;
}

// router_prob_sum against sums in float64; and a one-row dprobs [1,E] gives the same
// dlogits, bit for bit, as the full [N,E] matrix of that row repeated.
TEST(Router, ProbSumAndOneRowDprobs) {
  const int64_t n = 37, e = 9, k = 3;
  cpu::RouterConfig cfg;
  cfg.top_k = k;
  cfg.normalize = true;
  Vec lv(n * e);
  for (int64_t i = 0; i < n * e; ++i) lv[i] = std::sin(0.37 * static_cast<double>(i)) * 2;
  auto logits = HostTensor::f32({n, e}, lv), idx = HostTensor::i32({n, k});
  auto weight = HostTensor::f32({n, k}), probs = HostTensor::f32({n, e}), sums = HostTensor::f32({e});
  cpu::router_forward(cfg, logits.t, idx.t, weight.t, probs.t);
  cpu::router_prob_sum(probs.t, sums.t);
  Vec p = probs.vec(), s = sums.vec();
  for (int64_t x = 0; x < e; ++x) {
    double want = 0;
    for (int64_t t = 0; t < n; ++t) want += p[t * e + x];
    EXPECT_NEAR(s[x], want, 1e-7 * want) << "expert " << x;
  }
  Vec row(e), rows(n * e), dw(n * k);
  for (int64_t x = 0; x < e; ++x) row[x] = 0.1 * static_cast<double>(x) - 0.3;
  for (int64_t i = 0; i < n * e; ++i) rows[i] = row[i % e];
  for (int64_t i = 0; i < n * k; ++i) dw[i] = std::cos(static_cast<double>(i));
  auto dweight = HostTensor::f32({n, k}, dw), one = HostTensor::f32({1, e}, row), full = HostTensor::f32({n, e}, rows);
  auto d1 = HostTensor::f32({n, e}), d2 = HostTensor::f32({n, e});
  cpu::router_backward(cfg, logits.t, idx.t, weight.t, probs.t, dweight.t, one.t, d1.t);
  cpu::router_backward(cfg, logits.t, idx.t, weight.t, probs.t, dweight.t, full.t, d2.t);
  EXPECT_EQ(d1.vec(), d2.vec());
}

// The sequence-level balance term's pieces: router_counts of G = 4 groups of 9 tokens
// against counting the choices by hand, and a dprobs of G rows gives the same dlogits, bit
// for bit, as the full [N,E] matrix of each group's row repeated over its tokens.
TEST(Router, GroupCountsAndGroupDprobs) {
  const int64_t n = 36, e = 7, k = 2, g = 4;
  cpu::RouterConfig cfg;
  cfg.top_k = k;
  Vec lv(n * e);
  for (int64_t i = 0; i < n * e; ++i) lv[i] = std::sin(0.41 * static_cast<double>(i)) * 2;
  auto logits = HostTensor::f32({n, e}, lv), idx = HostTensor::i32({n, k});
  auto weight = HostTensor::f32({n, k}), probs = HostTensor::f32({n, e}), counts = HostTensor::i32({g, e});
  cpu::router_forward(cfg, logits.t, idx.t, weight.t, probs.t);
  cpu::router_counts(idx.t, counts.t);
  std::vector<int64_t> want(g * e, 0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) ++want[t / (n / g) * e + idx.t.i32()[t * k + j]];
  EXPECT_EQ(std::vector<int64_t>(counts.t.i32(), counts.t.i32() + g * e), want);
  Vec rows(g * e), full(n * e), dw(n * k);
  for (int64_t i = 0; i < g * e; ++i) rows[i] = 0.05 * static_cast<double>(i % 11) - 0.2;
  for (int64_t i = 0; i < n * e; ++i) full[i] = rows[i / e / (n / g) * e + i % e];
  for (int64_t i = 0; i < n * k; ++i) dw[i] = std::cos(static_cast<double>(i));
  auto dweight = HostTensor::f32({n, k}, dw), grouped = HostTensor::f32({g, e}, rows), each = HostTensor::f32({n, e}, full);
  auto d1 = HostTensor::f32({n, e}), d2 = HostTensor::f32({n, e});
  cpu::router_backward(cfg, logits.t, idx.t, weight.t, probs.t, dweight.t, grouped.t, d1.t);
  cpu::router_backward(cfg, logits.t, idx.t, weight.t, probs.t, dweight.t, each.t, d2.t);
  EXPECT_EQ(d1.vec(), d2.vec());
  auto bad = HostTensor::i32({5, e});
  EXPECT_NE(error_of([&] { cpu::router_counts(idx.t, bad.t); }).find("G dividing N"), std::string::npos);
}

}  // namespace

}  // namespace mt::test
