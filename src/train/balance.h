// Every balance term of a step, in one place: the load-balance loss of
// training.load_balance_type (micro_batch, global_batch or sequence), the router z-loss,
// the expert-bias update (training.expert_bias_update_rate), the routing statistics they
// read, and what the metrics report of them (expert counts, dropped slots, ep rows).
//
// Where each enters the step (the schedule's actions, train/schedule.h):
//   - Before the schedule: the z-loss's factor goes to the model (Model::set_router_z_loss);
//     every MoE layer's forward then sums logsumexp(logits)^2 and its router backward adds
//     the factor times that sum's gradient.
//   - Op::statistics, after a micro-batch's forward: its router statistics are counted.
//     micro_batch and sequence give the model the term's gradient with respect to each
//     router probability at once (Model::set_router_prob_grad), before that micro-batch's
//     backward reads it.
//   - Op::balance, once every forward is done (global_batch only): the counts summed over
//     every rank, then one gradient for every micro-batch.
//   - After the schedule: reduce() sums the terms and counts over the ranks, report() puts
//     them into the step's result, and update_expert_bias() moves each router bias towards
//     the mean load (DeepSeek-V3's auxiliary-loss-free rule).
// The router's backward (models/moe.cpp, Moe::backward_input's router part, kernels/router.h)
// turns the probabilities' gradient and the z-loss's into the logits' gradient.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "models/interface.h"
#include "train/config.h"

namespace mt {

class ExpertReplicas;
struct StepResult;

class StepBalance {
 public:
  struct Ranks {
    comm::Communicator* cp = nullptr;     // a sequence's chunks (null: whole sequences here)
    comm::Communicator* world = nullptr;  // every rank (null: one)
    comm::Communicator* ep = nullptr;     // the expert-parallel group (null: none)
    int64_t dp = 1;                       // data-parallel ranks
  };
  // A step of `sequences` sequences (`tokens` in all) over `micro_batches` micro-batches
  // a rank; sets the model's z-loss factor.
  StepBalance(const TrainingConfig& t, Model& model, int64_t tokens, int64_t sequences, int64_t micro_batches,
              const Ranks& ranks);
  void statistics(Stash& s);                        // Op::statistics of micro-batch s
  void global(const std::vector<Stash*>& stashes);  // Op::balance: every micro-batch's stash
  // The terms, counts and dropped slots summed over the ranks; `also` is summed in the
  // same collective (comm::sum_in_rank_order).
  void reduce(std::vector<double>& also);
  void report(StepResult& r) const;  // after reduce()
  const std::vector<std::vector<int64_t>>& counts() const { return counts_; }
  // The index of each decoder layer among the MoE layers (-1: dense).
  const std::vector<int64_t>& moe_index() const { return moe_index_; }

 private:
  void count(const std::vector<RouterStats>& stats);
  double switch_term(const std::vector<int64_t>& c, const std::vector<double>& ps, int64_t tokens, double weight,
                     std::vector<float>& dprob) const;
  double sequence_term(const RouterStats& st, Stash& s) const;

  const TrainingConfig& t_;
  Model& model_;
  Ranks ranks_;
  ExpertReplicas* replicas_;
  int64_t sequences_, micro_batches_;
  size_t E_;
  bool global_;  // load_balance_type = global_batch
  double z_mean_;  // the z-loss's mean over the step's tokens and MoE layers (0: off)
  std::vector<int64_t> moe_index_, moe_layers_;
  // Per MoE layer, summed over micro-batches (and after reduce() over the ranks).
  std::vector<std::vector<int64_t>> counts_;
  std::vector<std::vector<double>> prob_sums_;
  std::vector<std::vector<int64_t>> slot_rows_;  // with replicas: the rows each slot got
  std::vector<std::vector<RouterStats>> all_;    // global_batch: every micro-batch's routing
  int64_t routed_tokens_ = 0;
  std::vector<int64_t> dropped_ = {0};  // slots over an expert's capacity, all layers
  double lb_total_ = 0, z_total_ = 0;
};

// Moves each MoE layer's router bias by `rate` towards its mean load: up for an expert
// that got fewer than the mean of `counts`, down for one that got more.
void update_expert_bias(std::vector<std::vector<float>>& bias, const std::vector<std::vector<int64_t>>& counts,
                        double rate);

}  // namespace mt
