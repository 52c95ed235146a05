// The training loop on one device: micro-batches through the stage protocol,
// gradient accumulation, load-balance loss, clipping, AdamW, the learning-rate
// schedule, and metrics. It knows nothing of any model's internals.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/mesh.h"
#include "data/dataset.h"
#include "models/interface.h"
#include "parallel/placement.h"
#include "parallel/zero3.h"
#include "train/config.h"
#include "train/optimizer.h"
#include "train/profile.h"
#include "train/schedule.h"

namespace mt {

class StepBalance;

// The model's options that the config gives (device, routing, capacity, FP8,
// recomputation), as train, plan and eval's setup build the model; the mesh's groups,
// layers and plan_only are the caller's.
ModelOptions model_options(const Config& cfg);

// A step's shape as train takes it: seq_len and the global batch from the flags, or
// from data.tokens where they give none (a corpus needs both set), the micro-batch, and
// how many a data rank runs (errors name what does not split).
struct StepShape {
  int64_t seq = 0, global_batch = 0, micro_batch = 0;
  int micro_batches = 0;
};
StepShape step_shape(const Config& cfg, const comm::MeshShape& mesh);
// The schedule's shape for that step, as the trainer runs it.
ScheduleShape schedule_shape(const Config& cfg, int64_t layers, int micro_batches, bool zero3, bool sharded);

// One pp rank's memory, from the allocation code a run uses (counting arenas, and its
// schedule played for the expert rows): what `moetrain plan` prints and what train
// checks against the device before it allocates. With ep > 1 it is ep rank 0's model.
struct MemoryPlan {
  StepShape step;
  bool zero3 = false, sharded = false;
  int replicas = 1;  // the ranks the optimizer state is sharded over
  size_t weights = 0;       // master weights on the device
  size_t gradients = 0;     // f32, as many as the master weights but the ZeRO-3 layers'
  size_t compute = 0;       // bf16 and FP8 copies
  size_t optimizer = 0;     // moments (sharded: and summed gradients, weight shards), offload staging
  size_t slot = 0;          // ZeRO-3's layer slots
  size_t activations = 0;   // bare stashes and blocks of the micro-batches in flight
  std::string in_flight;    // how many of those: "4; of its chunks' layers 4, 1"
  size_t rows = 0, rows_skewed = 0;  // expert rows' peak: balanced, and at the skew given
  bool embedding = true, head = true;
  size_t layers = 0;
  // offload.experts: the offloaded blocks' master weights and moments in host memory,
  // and the bytes their update moves each way a step (train/offload.h).
  size_t host = 0, offload_traffic = 0;
  // offload.experts = weights: the expert cache's frames on the device, and the bytes its
  // fetches move in a step (at most: every pass misses, once the cache holds less than
  // every cached expert) and its write-backs.
  size_t expert_cache = 0, cache_in = 0, cache_out = 0;
  size_t expert_replicas = 0;  // parallelism.expert_replicas: the replica slots' weights and gradients
  size_t total() const {
    return weights + gradients + optimizer + compute + slot + activations + rows + expert_cache + expert_replicas;
  }
  size_t total_skewed() const { return total() - rows + rows_skewed; }
};
MemoryPlan plan_memory(const Config& cfg, int world, int pp_rank, double skew);

// Fills every parameter: random (seeded, per Hugging Face name, so any layout gives
// the same values) or from a Hugging Face model folder.
void init_random(Model& m, double init_std, uint64_t seed);
size_t load_hf(Model& m, const std::string& folder);

// Token ids and labels of a [B, T] matrix: inputs are columns 0..T-2, labels 1..T-1.
struct TokenBatch {
  int64_t rows = 0, seq = 0;
  std::vector<int32_t> ids, labels;  // [rows, seq]
};
TokenBatch read_token_batch(const std::string& npy_path, int64_t vocab_size);

struct StepResult {
  int64_t step = 0;          // 1-based
  double loss = 0;           // mean cross-entropy over the global batch
  double lb_loss = 0;        // load-balance term, before its coefficient
  // Multi-token prediction: each depth's mean cross-entropy (its labels: the sequences'
  // positions but their last k), before lambda / D.
  std::vector<double> mtp_loss;
  // training.router_z_loss_coef > 0: the router z-loss, before its coefficient (the mean
  // over MoE layers and tokens of logsumexp(logits)^2).
  bool z_loss_on = false;
  double z_loss = 0;
  // validation.interval: on the steps it divides, the held-out mean loss after the step.
  bool val_on = false;
  double val_loss = 0;
  // data.mixture: each corpus's share of the samples drawn so far (resumes included).
  std::vector<double> data_shares;
  // training.expert_bias_update_rate: each MoE layer's router biases after this step's update.
  std::vector<std::vector<float>> expert_bias;
  double grad_norm = 0;      // global norm before clipping
  double lr = 0;
  double tokens_per_s = 0;
  int64_t tokens = 0;        // labelled positions of the global batch
  double seconds = 0;        // the step's duration
  double time = 0;           // when it ended: Unix seconds, to the millisecond
  size_t memory_bytes = 0;   // parameters, gradients, optimizer state, activations (planned)
  size_t device_memory_bytes = 0;  // GPU: what the process holds on the device, measured
  // The expert rows (models/interface.h, RowMemory), the most of any rank: bytes held at
  // once (included in memory_bytes for this rank's own), and the most rows a layer's
  // micro-batch brought to a rank over its balanced share.
  int64_t expert_row_bytes = 0;
  double routing_skew = 0;
  int64_t host_waits = 0;  // GPU: times the host waited for the device during the step
  // offload.experts (train/offload.h), this rank's: host memory the offloaded blocks and
  // their moments take, and the update's transfers (bytes each way, its wall time).
  size_t host_memory_bytes = 0;
  OffloadTraffic offload;
  ExpertCacheStats expert_cache;  // offload.experts = weights: the step's cache traffic (in `offload` too)
  std::vector<std::vector<int64_t>> expert_counts;  // per MoE layer, tokens per expert (kept)
  std::vector<int64_t> moe_layers;  // the decoder layer of each MoE layer (expert_counts' rows)
  // With expert parallelism, per MoE layer: the most rows an ep rank received over the
  // mean (summed over micro-batches and data-parallel groups). With expert replicas
  // (models/expert_replicas.h) also the placements applied so far and each expert's
  // copies over the ep ranks.
  std::vector<double> ep_rows_max_over_mean;
  int64_t placement_version = 0;
  std::vector<std::vector<int64_t>> expert_copies;
  // offload.experts = weights, per MoE layer and expert: the share of the step's passes
  // over the expert that found it in a device frame (-1: no pass used it).
  std::vector<std::vector<double>> expert_residency;
  int64_t dropped_slots = 0;  // (token, expert) slots over capacity (training.capacity_factor)
  std::vector<ProfileEntry> breakdown;  // metrics.profile: time (and spans) per stage
  // The first of loss, lb_loss and grad_norm that is not finite, or "": such a step's
  // update is not applied (the weights and moments stay as they were).
  std::string non_finite;
};

// A step that stopped before it changed anything: a corpus file could not be read at
// its start (cut short under the run), on this rank or another (every rank throws it at
// the same step). The weights, moments, step count and data order are those of the last
// step done, so the caller may save them before it stops. validate() throws it too, for
// a validation corpus cut short, before any of its forwards.
struct StepNotTaken : Error {
  using Error::Error;
};

// Runs `read` (reading data) on this rank of `world` (null: one rank); where it threw
// here or on another rank, every rank throws StepNotTaken: this rank's message, or
// `elsewhere`. So no rank waits in a collective for one that stopped. Collective.
void read_on_every_rank(comm::Communicator* world, const std::function<void()>& read, const std::string& elsewhere);

class Trainer {
 public:
  // Every step trains on the same token matrix (data.tokens) ...
  Trainer(Config cfg, Model& model, TokenBatch data);
  // ... or on the next global batch of a tokenized corpus (data.corpus).
  Trainer(Config cfg, Model& model, std::unique_ptr<data::Dataset> corpus);
  // The mesh, before step(). The global batch splits over the dp x ep "data ranks";
  // the cp ranks of a data rank share its sequences, each holding its zigzag chunks (the
  // model built with the same cp). Dense gradients are summed over dp x cp x ep, expert
  // gradients (with expert parallelism) over dp x cp, the ranks holding the same
  // experts. Weights are replicated within those groups: every rank takes the same
  // step, or with parallelism.zero3 (more than one rank; the model built with
  // external_layers) the decoder layers' weights and gradients are sharded over them
  // too (parallel/zero3.h). With pp > 1 the model holds this pp rank's layers
  // (pipeline_layers) and the step runs the pipeline schedule; losses, norms and routing
  // statistics are summed over the whole world.
  void set_parallel(comm::DeviceMesh& mesh);
  // The layers a pp rank builds (ModelOptions::layers), embedding and head included.
  static Pipeline pipeline_of(const Config& cfg, int64_t layers);
  StepResult step();  // throws StepNotTaken (above)
  int64_t steps_done() const { return step_; }
  int64_t seq_len() const { return seq_; }
  int64_t global_batch() const { return global_batch_; }
  // Resuming: the optimizer's state is loaded by the checkpoint reader, the step here.
  void set_steps_done(int64_t step) { step_ = step; }
  Optimizer& optimizer() { return optimizer_; }
  // ZeRO-3: every layer's full weights in host memory, for init_random, load_hf and the
  // checkpoint functions, which go through the model's hf_tensors() (collective);
  // commit_weights cuts them back into this rank's shards (after an init or a load),
  // release_weights drops them (after a save). Without ZeRO-3 they do nothing.
  void materialize_weights();
  void commit_weights();
  void release_weights();
  // The checkpoint's one door into the training state (train/checkpoint.cpp): the
  // weights as above and the AdamW moments laid out like them (the sharded ones gathered
  // into host memory), both collective; commit after a load, release after a save.
  void materialize_state();
  void commit_state();
  void release_state();
  // Where the corpus stands, as JSON for train_state.json ("null" for a token matrix).
  std::string data_cursor() const;
  void set_data_cursor(const std::string& json);
  // parallelism.expert_replicas: the placement of every MoE layer, the loads' average and
  // the placements applied, as JSON ("null" without replicas), for checkpoints. Setting
  // it (after the weights are loaded) applies it where the mesh's ep and R are the
  // saved ones; elsewhere the run starts from the owners' placement and says so.
  std::string expert_placement() const;
  void set_expert_placement(const std::string& json, bool say);
  // Validation (train/config.h, [validation]): the held-out set, a token matrix or a
  // corpus (a folder, or data.corpus's held-out Split), given before validate().
  void set_validation(TokenBatch tokens);
  void set_validation(std::unique_ptr<data::Dataset> corpus);
  // How many global batches validate() reads: validation.steps, or with -1 every whole
  // one the set holds (errors: fewer than one, or fewer than validation.steps).
  int64_t validation_batches() const;
  int64_t validation_sequences() const;  // the set's sequences (rows or samples)
  // The held-out set's mean loss over its first validation_batches() global batches (the
  // same ones each time), split over the data ranks and micro-batches as a step is, and
  // run as forwards alone (forward_schedule) by every rank of the mesh; the weights and
  // the training data's cursor are untouched. The loss is `moetrain eval`'s on the same
  // sequences. Collective.
  struct Validation {
    double loss = 0;
    int64_t tokens = 0;
    double seconds = 0;
  };
  Validation validate();
  // training.expert_bias_update_rate: every MoE layer's router bias, as JSON ("null"
  // before the first update), for checkpoints; setting it gives the held layers theirs.
  std::string expert_bias() const;
  void set_expert_bias(const std::string& json);
  // Mean loss and token count of a batch without touching the weights.
  static LossSum evaluate(Model& model, const TokenBatch& data, int64_t micro_batch);
  // The forward of one micro-batch whose ids and labels are in s, on one rank: the
  // embedding, every layer's stages, the head (then model.logits(s) holds its logits).
  static LossSum forward(Model& model, Stash& s);

 private:
  bool in_layer(const Param& p) const { return p.layer >= 0 && p.layer < model_.num_layers(); }
  void setup();
  void make_stashes();
  // Micro-batch `index` of a step's (or a validation's: index / micro_batches_ is its
  // global batch) from a token matrix or, when given, a corpus.
  void load_micro_batch(Stash& s, int64_t index, const TokenBatch& tokens, data::Dataset* corpus);
  // data.corpus: this rank's tokens of the whole step, read before any compute (in the
  // order its loads take them), the ranks agreeing that each could; else StepNotTaken.
  void read_step_tokens();
  // The phases of step(), in order (trainer.cpp says what each does).
  double run_step_schedule(StepBalance& balance);
  void finish_gradients(StepResult& r, const StepBalance& balance);
  void reduce_step(StepResult& r, StepBalance& balance, double loss_sum);
  void apply_step(StepResult& r, const StepBalance& balance);
  void measure_step(StepResult& r, std::chrono::steady_clock::time_point start, int64_t host_waits_at_start);

  Config cfg_;
  Model& model_;
  TokenBatch data_;                       // data.tokens
  std::unique_ptr<data::Dataset> corpus_;  // data.corpus
  TokenBatch val_tokens_;                  // validation.tokens
  std::unique_ptr<data::Dataset> val_corpus_;  // validation.corpus or .split
  int64_t seq_ = 0, global_batch_ = 0;
  std::vector<int32_t> host_ids_, host_labels_;  // a corpus micro-batch on its way to the device
  std::vector<int32_t> step_ids_, step_labels_;  // read_step_tokens's, micro-batch after micro-batch
  // Multi-token prediction's tokens ahead (data::Dataset::next_batch's `ahead`), read_step_tokens's and
  // a micro-batch's; the depths' summed losses of the step (run_step_schedule's).
  std::vector<int32_t> step_ahead_, host_ahead_, host_mtp_;
  std::vector<LossSum> mtp_losses_;
  int64_t step_loaded_ = 0;                      // micro-batches of them loaded this step
  comm::Communicator* dp_ = nullptr;              // the data ranks; null: one rank
  comm::Communicator* ep_ = nullptr;              // null: no expert parallelism
  comm::Communicator* cp_ = nullptr;              // null: whole sequences on this rank
  int64_t data_rank_ = 0, data_ranks_ = 1;
  int64_t local_seq() const { return cp_ ? seq_ / cp_->size() : seq_; }
  int64_t rank_rows_ = 0;                         // sequences of the global batch this rank trains on
  int64_t micro_batch_ = 0, micro_batches_ = 0, step_ = 0;
  comm::Communicator* pp_ = nullptr;     // null: one pipeline stage
  comm::Communicator* world_ = nullptr;  // host sums (null: one rank)
  Pipeline pipeline_;
  int pp_rank_ = 0;
  std::vector<Action> actions_;                  // the step's schedule, made at the first step
  std::vector<int> slot_;                        // micro-batch -> its stash
  std::vector<std::unique_ptr<Stash>> stashes_;  // one per micro-batch in flight
  std::vector<std::unique_ptr<ActivationBlock>> blocks_;  // per chunk, one per micro-batch working there
  std::vector<std::vector<ActivationBlock*>> block_of_;  // [chunk][micro-batch]
  Optimizer optimizer_;
  std::unique_ptr<parallel::Zero3> zero3_;  // null: the layers' weights are full here
  // parallelism.expert_replicas: the experts' loads averaged over steps, and the
  // placements applied (place_replicas).
  parallel::LoadAverage loads_;
  std::vector<parallel::Placement> placements_;  // per MoE layer of the whole model
  int64_t ranks_per_node_ = -1;                   // of the ep group, from its hostnames (-1: not read yet)
  int64_t placement_version_ = 0;
  void place_replicas(StepResult& r);
  // Per MoE layer of the whole model (empty: never updated), and its update from the
  // step's counts, summed over every rank.
  std::vector<std::vector<float>> expert_bias_;
  std::vector<std::vector<float>> model_expert_bias();
  // The placements of the MoE layers this rank holds into the model, then the replicas'
  // weights from their owners.
  void apply_placements(const std::vector<int64_t>& moe_layers);
  StepProfile profile_;
};


}  // namespace mt
