#include "kernels/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

// topk_softmax (GPT-OSS) weights are the softmax over the k chosen logits: they sum to
// one already, so `normalize` changes nothing there, and the model has no scaling
// factor, so a scale other than 1 (or expert groups) is rejected rather than ignored.
//
// Experts and groups are ranked by their logits, not their probabilities: softmax is
// monotonic so the order is the same, but fp32 rounding (or underflow to 0) can make
// distinct logits give equal probabilities, and then "ties to the lower expert id"
// would depend on rounding. Sigmoid scoring ranks the scores themselves: its groups
// are ranked by sums of two scores, which no order of the logits gives.
//
// Sigmoid scoring keeps the scores s in probs until the choice and the weights are
// made, then divides them by their sum (router.h has the formulas).

namespace mt::cpu {

namespace {

struct Dims {
  int64_t n, e, k;
};

Dims check_router(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                  const Tensor& probs) {
  MT_CHECK(logits.ndim() == 2) << "router logits should be [N,E], got " << logits.str();
  Dims d{logits.dim(0), logits.dim(1), cfg.top_k};
  MT_CHECK(d.k >= 1 && d.k <= d.e) << "router top_k " << d.k << " should be in [1, " << d.e
                                   << "] (the number of experts)";
  MT_CHECK(cfg.n_group >= 1 && d.e % cfg.n_group == 0)
      << "router n_group " << cfg.n_group << " should divide the " << d.e << " experts";
  if (cfg.n_group > 1) {
    MT_CHECK(cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group)
        << "router topk_group " << cfg.topk_group << " should be in [1, n_group=" << cfg.n_group << "]";
    MT_CHECK(cfg.topk_group * (d.e / cfg.n_group) >= d.k)
        << "router topk_group " << cfg.topk_group << " of " << cfg.n_group << " groups of " << d.e / cfg.n_group
        << " experts leave fewer than top_k=" << d.k << " experts to choose from";
  }
  MT_CHECK(cfg.scoring != RouterScoring::topk_softmax || (cfg.n_group == 1 && cfg.scale == 1.0f))
      << "topk_softmax routing (GPT-OSS) has no expert groups and no scale, got n_group=" << cfg.n_group
      << " scale=" << cfg.scale;
  MT_CHECK(cfg.scoring != RouterScoring::sigmoid || cfg.n_group == 1 || d.e / cfg.n_group >= 2)
      << "sigmoid routing ranks a group by its two best experts: n_group " << cfg.n_group << " of " << d.e
      << " experts leaves " << d.e / cfg.n_group << " a group";
  check_tensor(logits, "router logits", DType::f32, {d.n, d.e});
  check_tensor(idx, "router idx", DType::i32, {d.n, d.k});
  check_tensor(weight, "router weight", DType::f32, {d.n, d.k});
  check_tensor(probs, "router probs", DType::f32, {d.n, d.e});
  return d;
}

// The sigmoid scoring's per-token score sums: required there, refused elsewhere.
void check_score_sum(const RouterConfig& cfg, const Tensor& score_sum, int64_t n) {
  if (cfg.scoring == RouterScoring::sigmoid) {
    MT_CHECK(score_sum.data != nullptr) << "sigmoid routing needs score_sum f32 [" << n
                                        << "] (each token's sum of scores, for the backward), got none";
    check_tensor(score_sum, "router score_sum", DType::f32, {n});
  } else {
    MT_CHECK(score_sum.data == nullptr) << "router score_sum is for sigmoid scoring only, got " << score_sum.str();
  }
}

// The sum of the two largest of v[0..n), n >= 2 (equal values count twice).
float top2_sum(const float* v, int64_t n) {
  float a = -INFINITY, b = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (v[i] > a) {
      b = a;
      a = v[i];
    } else if (v[i] > b) {
      b = v[i];
    }
  }
  return a + b;
}

// Strict order: larger score first, ties to the lower id.
struct Better {
  const float* score;
  bool operator()(int32_t a, int32_t b) const { return score[a] > score[b] || (score[a] == score[b] && a < b); }
};

}  // namespace

void router_forward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                    const Tensor& probs, const Tensor& bias, const Tensor& score_sum) {
  Dims d = check_router(cfg, logits, idx, weight, probs);
  if (bias.data != nullptr) check_tensor(bias, "router bias", DType::f32, {d.e});
  check_score_sum(cfg, score_sum, d.n);
  const float* bp = bias.data != nullptr ? bias.f32() : nullptr;
  const bool topk_softmax = cfg.scoring == RouterScoring::topk_softmax;
  const bool sigmoid = cfg.scoring == RouterScoring::sigmoid;
  const float* lp = logits.f32();
  int32_t* ip = idx.i32();
  float* wp = weight.f32();
  float* pp = probs.f32();
  int64_t group_size = d.e / cfg.n_group;
#pragma omp parallel
  {
    std::vector<int32_t> cand, groups(static_cast<size_t>(cfg.n_group));
    std::vector<float> group_score(static_cast<size_t>(cfg.n_group)), biased(bp ? static_cast<size_t>(d.e) : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < d.n; ++t) {
      const float* l = lp + t * d.e;
      float* p = pp + t * d.e;
      if (sigmoid) {
        for (int64_t e = 0; e < d.e; ++e) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
      } else {
        float m = *std::max_element(l, l + d.e), sum = 0.0f;
        for (int64_t e = 0; e < d.e; ++e) sum += p[e] = std::exp(l[e] - m);
        for (int64_t e = 0; e < d.e; ++e) p[e] /= sum;
      }
      // What the choice ranks: the logits (the sigmoid scores), or with a bias the
      // biased scores.
      if (bp)
        for (int64_t e = 0; e < d.e; ++e) biased[e] = (topk_softmax ? l[e] : p[e]) + bp[e];
      const float* key = bp ? biased.data() : sigmoid ? p : l;

      cand.clear();
      if (cfg.n_group > 1) {
        for (int64_t g = 0; g < cfg.n_group; ++g)
          group_score[g] = sigmoid ? top2_sum(key + g * group_size, group_size)
                                   : *std::max_element(key + g * group_size, key + (g + 1) * group_size);
        std::iota(groups.begin(), groups.end(), 0);
        std::partial_sort(groups.begin(), groups.begin() + cfg.topk_group, groups.end(), Better{group_score.data()});
        for (int64_t j = 0; j < cfg.topk_group; ++j)
          for (int64_t e = groups[j] * group_size; e < (groups[j] + 1) * group_size; ++e)
            cand.push_back(static_cast<int32_t>(e));
      } else {
        cand.resize(static_cast<size_t>(d.e));
        std::iota(cand.begin(), cand.end(), 0);
      }
      std::partial_sort(cand.begin(), cand.begin() + d.k, cand.end(), Better{key});

      int32_t* it = ip + t * d.k;
      float* w = wp + t * d.k;
      std::copy(cand.begin(), cand.begin() + d.k, it);
      if (topk_softmax) {
        // The shift by the largest chosen logit (the first, unless biased) keeps it stable.
        float top = l[it[0]], s = 0.0f;
        for (int64_t j = 1; j < d.k; ++j) top = std::max(top, l[it[j]]);
        for (int64_t j = 0; j < d.k; ++j) s += w[j] = std::exp(l[it[j]] - top);
        for (int64_t j = 0; j < d.k; ++j) w[j] /= s;
      } else {
        float s = 0.0f;
        for (int64_t j = 0; j < d.k; ++j) s += w[j] = p[it[j]];
        // transformers' DeepSeek-V3 adds 1e-20 to the denominator; the softmax sum needs none.
        float f = cfg.normalize ? cfg.scale / (sigmoid ? s + 1e-20f : s) : cfg.scale;
        for (int64_t j = 0; j < d.k; ++j) w[j] *= f;
      }
      if (sigmoid) {
        float s = 0.0f;
        for (int64_t e = 0; e < d.e; ++e) s += p[e];
        score_sum.f32()[t] = s;
        for (int64_t e = 0; e < d.e; ++e) p[e] /= s;
      }
    }
  }
}

namespace {

// One token's sigmoid backward (router.h has the formula): p the normalised scores,
// S their sum before normalisation, dp the balance gradient row (or null).
void sigmoid_token_backward(const RouterConfig& cfg, int64_t e_n, int64_t k, const int32_t* it, const float* p,
                            float S, const float* dw, const float* dp, float* dl) {
  float pdot = 0.0f;
  if (dp != nullptr)
    for (int64_t e = 0; e < e_n; ++e) pdot += p[e] * dp[e];
  for (int64_t e = 0; e < e_n; ++e) dl[e] = dp != nullptr ? (dp[e] - pdot) / S : 0.0f;
  if (cfg.normalize) {
    float den = 1e-20f, dot = 0.0f;
    for (int64_t j = 0; j < k; ++j) den += p[it[j]] * S;
    for (int64_t j = 0; j < k; ++j) dot += dw[j] * p[it[j]] * S;
    dot /= den;
    for (int64_t j = 0; j < k; ++j) dl[it[j]] += cfg.scale / den * (dw[j] - dot);
  } else {
    for (int64_t j = 0; j < k; ++j) dl[it[j]] += cfg.scale * dw[j];
  }
  for (int64_t e = 0; e < e_n; ++e) {
    const float s = p[e] * S;
    dl[e] *= s * (1.0f - s);
  }
}

}  // namespace

void router_backward(const RouterConfig& cfg, const Tensor& logits, const Tensor& idx, const Tensor& weight,
                     const Tensor& probs, const Tensor& dweight, const Tensor& dprobs, const Tensor& dlogits,
                     const Tensor& score_sum) {
  Dims d = check_router(cfg, logits, idx, weight, probs);
  check_score_sum(cfg, score_sum, d.n);
  check_tensor(dweight, "router dweight", DType::f32, {d.n, d.k});
  check_tensor(dlogits, "router dlogits", DType::f32, {d.n, d.e});
  const int64_t groups = dprobs.data != nullptr && dprobs.ndim() == 2 ? dprobs.dim(0) : 1;
  MT_CHECK(groups >= 1 && d.n % groups == 0) << "router dprobs " << dprobs.str() << ": its rows should divide the "
                                             << d.n << " tokens";
  if (dprobs.data != nullptr) check_tensor(dprobs, "router dprobs", DType::f32, {groups, d.e});
  const int64_t group = std::max<int64_t>(1, d.n / groups);  // tokens a dprobs row
  const int32_t* ip = idx.i32();
  for (int64_t s = 0; s < d.n * d.k; ++s)
    MT_CHECK(ip[s] >= 0 && ip[s] < d.e) << "router idx of token " << s / d.k << " slot " << s % d.k << " is " << ip[s]
                                        << ", outside [0, " << d.e << ")";
  const float* wp = weight.f32();
  const float* pp = probs.f32();
  const float* dwp = dweight.f32();
  const float* dpp = dprobs.data != nullptr ? dprobs.f32() : nullptr;
  float* out = dlogits.f32();
  const bool topk_softmax = cfg.scoring == RouterScoring::topk_softmax;
  const bool sigmoid = cfg.scoring == RouterScoring::sigmoid;
  const float* ssp = sigmoid ? score_sum.f32() : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.n; ++t) {
    const int32_t* it = ip + t * d.k;
    const float* p = pp + t * d.e;
    const float* dw = dwp + t * d.k;
    float* dl = out + t * d.e;
    if (sigmoid) {
      sigmoid_token_backward(cfg, d.e, d.k, it, p, ssp[t], dw, dpp != nullptr ? dpp + t / group * d.e : nullptr, dl);
      continue;
    }
    // dl first holds the gradient with respect to probs, then goes through the softmax.
    for (int64_t e = 0; e < d.e; ++e) dl[e] = dpp != nullptr ? dpp[t / group * d.e + e] : 0.0f;
    if (!topk_softmax) {
      if (cfg.normalize) {
        // w_j = scale * p_j / S with S the sum of the k chosen probabilities.
        float s = 0.0f, dot = 0.0f;
        for (int64_t j = 0; j < d.k; ++j) s += p[it[j]];
        for (int64_t j = 0; j < d.k; ++j) dot += dw[j] * p[it[j]];
        dot /= s;
        for (int64_t j = 0; j < d.k; ++j) dl[it[j]] += cfg.scale / s * (dw[j] - dot);
      } else {
        for (int64_t j = 0; j < d.k; ++j) dl[it[j]] += cfg.scale * dw[j];
      }
    }
    float pdot = 0.0f;
    for (int64_t e = 0; e < d.e; ++e) pdot += p[e] * dl[e];
    for (int64_t e = 0; e < d.e; ++e) dl[e] = p[e] * (dl[e] - pdot);
    if (topk_softmax) {
      // The k weights are a softmax of the k chosen logits on their own.
      const float* w = wp + t * d.k;
      float wdot = 0.0f;
      for (int64_t j = 0; j < d.k; ++j) wdot += w[j] * dw[j];
      for (int64_t j = 0; j < d.k; ++j) dl[it[j]] += w[j] * (dw[j] - wdot);
    }
  }
}

void router_prob_sum(const Tensor& probs, const Tensor& sums) {
  MT_CHECK(probs.dtype == DType::f32 && probs.ndim() == 2) << "router_prob_sum wants probs f32 [N,E], got "
                                                            << probs.str();
  const int64_t n = probs.dim(0), e_n = probs.dim(1);
  check_tensor(sums, "router prob sums", DType::f32, {e_n});
  const float* p = probs.f32();
  float* out = sums.f32();
  for (int64_t e = 0; e < e_n; ++e) {
    double s = 0;
    for (int64_t t = 0; t < n; ++t) s += p[t * e_n + e];
    out[e] = static_cast<float>(s);
  }
}

void router_counts(const Tensor& idx, const Tensor& counts) {
  MT_CHECK(idx.dtype == DType::i32 && idx.ndim() == 2 && counts.dtype == DType::i32 && counts.ndim() == 2 &&
           counts.dim(0) >= 1 && idx.dim(0) % counts.dim(0) == 0)
      << "router_counts wants idx i32 [N,k] and counts i32 [G,E] with G dividing N, got " << idx.str() << " and "
      << counts.str();
  const int64_t slots = idx.numel() / counts.dim(0), e_n = counts.dim(1);
  std::fill(counts.i32(), counts.i32() + counts.numel(), 0);
  for (int64_t s = 0; s < idx.numel(); ++s) {
    const int32_t e = idx.i32()[s];
    MT_CHECK(e >= 0 && e < e_n) << "router idx of slot " << s << " is " << e << ", outside [0, " << e_n << ")";
    ++counts.i32()[s / slots * e_n + e];
  }
}

namespace {

// logsumexp of one row, in double.
double row_lse(const float* l, int64_t e_n) {
  double m = l[0], s = 0;
  for (int64_t e = 1; e < e_n; ++e) m = std::max(m, double{l[e]});
  for (int64_t e = 0; e < e_n; ++e) s += std::exp(l[e] - m);
  return m + std::log(s);
}

}  // namespace

void router_z_forward(const Tensor& logits, const Tensor& lse, const Tensor& sum) {
  MT_CHECK(logits.dtype == DType::f32 && logits.ndim() == 2 && logits.dim(1) >= 1)
      << "router_z_forward wants logits f32 [N,E], got " << logits.str();
  const int64_t n = logits.dim(0), e_n = logits.dim(1);
  check_tensor(lse, "router z lse", DType::f32, {n});
  check_tensor(sum, "router z sum", DType::f32, {1});
  double s = 0;
  for (int64_t t = 0; t < n; ++t) {
    const double v = row_lse(logits.f32() + t * e_n, e_n);
    lse.f32()[t] = static_cast<float>(v);
    s += v * v;
  }
  sum.f32()[0] = static_cast<float>(s);
}

void router_z_backward(const Tensor& lse, const Tensor& probs, float scale, const Tensor& dlogits) {
  MT_CHECK(probs.dtype == DType::f32 && probs.ndim() == 2) << "router_z_backward wants probs f32 [N,E], got "
                                                            << probs.str();
  const int64_t n = probs.dim(0), e_n = probs.dim(1);
  check_tensor(lse, "router z lse", DType::f32, {n});
  check_tensor(dlogits, "router z dlogits", DType::f32, {n, e_n});
  for (int64_t t = 0; t < n; ++t)
    for (int64_t e = 0; e < e_n; ++e)
      dlogits.f32()[t * e_n + e] += 2.0f * scale * lse.f32()[t] * probs.f32()[t * e_n + e];
}

}  // namespace mt::cpu
