#include "train/balance.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"
#include "models/expert_replicas.h"
#include "train/trainer.h"

namespace mt {

namespace {

// Sums host integers over the ranks of `c` (null: one rank).
void sum_i64(comm::Communicator* c, std::vector<int64_t>& v) {
  if (c && !v.empty()) c->all_reduce(Tensor(v.data(), {static_cast<int64_t>(v.size())}, DType::i64));
}

// Sums host numbers over `c` in f32, as a router's probability sums are gathered.
void sum_f32(comm::Communicator& c, std::vector<double>& v) {
  std::vector<float> p(v.begin(), v.end());
  c.all_reduce(Tensor(p.data(), {static_cast<int64_t>(p.size())}, DType::f32));
  v.assign(p.begin(), p.end());
}

}  // namespace

StepBalance::StepBalance(const TrainingConfig& t, Model& model, int64_t tokens, int64_t sequences,
                         int64_t micro_batches, const Ranks& ranks)
    : t_(t), model_(model), ranks_(ranks), replicas_(model.expert_replicas()), sequences_(sequences),
      micro_batches_(micro_batches), E_(static_cast<size_t>(model.num_experts())),
      global_(t.load_balance_type == "global_batch") {
  moe_index_.assign(static_cast<size_t>(model.all_layers()), -1);
  for (int64_t l = 0; l < model.all_layers(); ++l)
    if (model.is_moe_layer(l)) {
      moe_index_[l] = static_cast<int64_t>(moe_layers_.size());
      moe_layers_.push_back(l);
    }
  const size_t layers = moe_layers_.size();
  counts_.assign(layers, std::vector<int64_t>(E_, 0));
  prob_sums_.assign(layers, std::vector<double>(E_, 0.0));
  const size_t slots = replicas_ ? static_cast<size_t>(ranks.ep->size() * replicas_->slots()) : 0;
  slot_rows_.assign(replicas_ ? layers : 0, std::vector<int64_t>(slots, 0));
  // The z-loss's gradient factor on its sum: the mean over the global batch's tokens and
  // the MoE layers, times its coefficient.
  const bool z_on = t.router_z_loss_coef > 0 && layers > 0;
  z_mean_ = z_on ? 1.0 / (static_cast<double>(tokens) * static_cast<double>(layers)) : 0.0;
  model.set_router_z_loss(t.router_z_loss_coef * z_mean_);
}

void StepBalance::count(const std::vector<RouterStats>& stats) {
  for (const RouterStats& st : stats) {
    const size_t i = static_cast<size_t>(moe_index_[st.layer]);
    for (size_t e = 0; e < E_; ++e) {
      counts_[i][e] += st.counts[e];
      prob_sums_[i][e] += st.prob_sum[e];
    }
    dropped_[0] += st.dropped;
    z_total_ += st.z_sum;
    for (size_t j = 0; j < st.slot_counts.size(); ++j) slot_rows_[i][j] += st.slot_counts[j];
  }
  if (!stats.empty()) routed_tokens_ += stats[0].tokens;
}

// The Switch-style term of one layer, in transformers' convention: E * sum_e (tokens
// routed to e / tokens) * (mean probability of e); k when balanced. Its gradient with
// respect to each token's p[e] is E * f_e / tokens (f is constant), times `weight`.
double StepBalance::switch_term(const std::vector<int64_t>& c, const std::vector<double>& ps, int64_t tokens,
                                double weight, std::vector<float>& dprob) const {
  const int64_t E = static_cast<int64_t>(E_);
  double lb = 0;
  dprob.assign(E_, 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    double f = static_cast<double>(c[e]) / static_cast<double>(tokens);
    lb += E * f * ps[e] / static_cast<double>(tokens);
    dprob[e] = static_cast<float>(weight * E * f / static_cast<double>(tokens));
  }
  return lb;
}

// DeepSeek-V2's sequence-level term of one MoE layer's rows (its seq_aux): for each
// sequence b of T tokens, sum_e (count_be E / (T k)) (prob_sum_be / T), where count_be is
// the tokens of b that chose e; the mean over the step's sequences is added, over the MoE
// layers, as DeepSeek adds it. Its gradient with respect to p[e] of each token of b,
// coef count_be E / (T k) / T / sequences, goes to the model. With context parallelism
// each cp rank holds the whole sequence's term and adds 1/cp of it.
double StepBalance::sequence_term(const RouterStats& st, Stash& s) const {
  const int64_t cps = ranks_.cp ? ranks_.cp->size() : 1;
  const int64_t E = static_cast<int64_t>(st.counts.size()), rows = st.seq_rows;
  const double T = static_cast<double>(st.seq_tokens * cps), k = static_cast<double>(st.top_k);
  const double n = static_cast<double>(sequences_);
  std::vector<float> dprob(static_cast<size_t>(rows * E));
  double lb = 0;
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t e = 0; e < E; ++e) {
      const size_t i = static_cast<size_t>(b * E + e);
      const double f = static_cast<double>(st.seq_counts[i]) * static_cast<double>(E) / (T * k);
      lb += f * st.seq_prob_sum[i] / T / n;
      dprob[i] = static_cast<float>(t_.load_balance_coef * f / T / n);
    }
  model_.set_router_prob_grad(s, st.layer, dprob);
  return lb / static_cast<double>(cps);
}

void StepBalance::statistics(Stash& s) {
  std::vector<RouterStats> stats = model_.router_stats(s);
  if (global_) {
    all_.push_back(stats);
    count(all_.back());
    return;
  }
  count(stats);
  comm::Communicator* cp = ranks_.cp;
  const int64_t cps = cp ? cp->size() : 1;
  for (RouterStats& st : stats) {
    if (t_.load_balance_type == "sequence") {
      MT_CHECK(st.seq_rows > 0) << "training.load_balance_type = sequence, but the model was built without "
                                << "ModelOptions::sequence_balance (model_options sets it from the config)";
      if (cp) {  // a row's sequence spans the cp ranks: every one's chunks
        sum_i64(cp, st.seq_counts);
        sum_f32(*cp, st.seq_prob_sum);
      }
      lb_total_ += sequence_term(st, s);
      continue;
    }
    // A micro-batch's routing is over its whole sequences: with context parallelism,
    // over every cp rank's chunks.
    if (cp) {
      st.counts.push_back(st.tokens);
      sum_i64(cp, st.counts);
      st.tokens = st.counts.back();
      st.counts.pop_back();
      sum_f32(*cp, st.prob_sum);
    }
    // Every micro-batch of every data rank weighs the same in the mean; its cp ranks
    // each hold the same term, so each adds 1/cp of it to the sum.
    std::vector<float> dprob;
    const double n = static_cast<double>(moe_layers_.size() * micro_batches_ * (ranks_.dp / cps));
    lb_total_ += switch_term(st.counts, st.prob_sum, st.tokens, t_.load_balance_coef / n, dprob) /
                 (n * static_cast<double>(cps));
    model_.set_router_prob_grad(s, st.layer, dprob);
  }
}

void StepBalance::global(const std::vector<Stash*>& stashes) {
  // Routing over the whole global batch: every rank's counts and probabilities.
  std::vector<int64_t> routed = {routed_tokens_};
  sum_i64(ranks_.world, routed);
  routed_tokens_ = routed[0];
  for (size_t i = 0; i < counts_.size(); ++i) {
    sum_i64(ranks_.world, counts_[i]);
    comm::sum_in_rank_order(ranks_.world, prob_sums_[i]);
  }
  const double layers = static_cast<double>(counts_.size());
  for (size_t i = 0; i < counts_.size(); ++i) {
    std::vector<float> dprob;
    lb_total_ += switch_term(counts_[i], prob_sums_[i], routed_tokens_, t_.load_balance_coef / layers, dprob) / layers;
    for (size_t mb = 0; mb < stashes.size(); ++mb) model_.set_router_prob_grad(*stashes[mb], all_[mb][i].layer, dprob);
  }
}

void StepBalance::reduce(std::vector<double>& also) {
  if (!ranks_.world) return;
  also.push_back(lb_total_);
  also.push_back(z_total_);
  comm::sum_in_rank_order(ranks_.world, also);
  z_total_ = also.back();
  also.pop_back();
  if (!global_) lb_total_ = also.back();  // the global-batch term is the same on every rank already
  also.pop_back();
  if (!global_)
    for (auto& c : counts_) sum_i64(ranks_.world, c);
  for (auto& c : slot_rows_) sum_i64(ranks_.world, c);
  sum_i64(ranks_.world, dropped_);
}

void StepBalance::report(StepResult& r) const {
  r.moe_layers = moe_layers_;
  r.lb_loss = lb_total_;
  r.z_loss_on = z_mean_ > 0;
  r.z_loss = z_total_ * z_mean_;
  r.expert_counts = counts_;
  r.dropped_slots = dropped_[0];
  if (!ranks_.ep) return;
  // The rows each ep rank received: its slots' (replicas) or its own experts'.
  const int64_t ranks = ranks_.ep->size();
  for (size_t i = 0; i < counts_.size(); ++i) {
    std::vector<double> rows(static_cast<size_t>(ranks), 0.0);
    const std::vector<int64_t>& by = replicas_ ? slot_rows_[i] : counts_[i];
    for (size_t j = 0; j < by.size(); ++j) rows[j * static_cast<size_t>(ranks) / by.size()] += static_cast<double>(by[j]);
    const double total = std::accumulate(rows.begin(), rows.end(), 0.0);
    r.ep_rows_max_over_mean.push_back(
        total > 0 ? *std::max_element(rows.begin(), rows.end()) * static_cast<double>(ranks) / total : 1.0);
  }
}

void update_expert_bias(std::vector<std::vector<float>>& bias, const std::vector<std::vector<int64_t>>& counts,
                        double rate) {
  const float step = static_cast<float>(rate);
  for (size_t i = 0; i < counts.size(); ++i) {
    if (bias.size() <= i) bias.emplace_back(counts[i].size(), 0.0f);
    const double mean = static_cast<double>(std::accumulate(counts[i].begin(), counts[i].end(), int64_t{0})) /
                        static_cast<double>(counts[i].size());
    for (size_t e = 0; e < counts[i].size(); ++e) {
      const double behind = mean - static_cast<double>(counts[i][e]);
      bias[i][e] += behind > 0 ? step : behind < 0 ? -step : 0.0f;
    }
  }
}

}  // namespace mt
