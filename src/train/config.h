// Training configuration: TOML sections as torchtitan names them, every key with a
// default, overridden by --section.key=value on the command line. config.cpp lists
// every key once, with its meaning: `moetrain train --help` and docs/config.md print
// that list.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace mt {

struct JobConfig {
  std::string dump_folder = "runs/default";
};

struct ModelConfig {
  std::string init = "random";  // "random" or "hf:DIR"
  std::string config;           // an HF config.json; defaults to DIR/config.json for hf:DIR
  double init_std = 0.02;       // random init: N(0, init_std), output projections / sqrt(2 * layers)
};

struct DataConfig {
  std::string tokens;  // a .npy [B, T] matrix used as the global batch every step
  std::string corpus;  // a folder of tokenized .bin files
  std::string mixture;  // "W:FOLDER,W:FOLDER": several corpora drawn in proportion (data/dataset.h)
  int64_t seq_len = 0;  // 0: T - 1 of the tokens matrix (required with a corpus)
  bool allow_past_max_positions = false;  // seq_len over config.json's max_position_embeddings
};

// A held-out set's mean loss every `interval` steps (train/trainer.h, Trainer::validate):
// a token matrix, a corpus folder, or the last `split` of data.corpus's documents.
struct ValidationConfig {
  std::string tokens;     // a .npy [B, T] matrix, T - 1 = the training sequence length
  std::string corpus;     // a folder of tokenized .bin files
  double split = 0;       // with data.corpus: the fraction of every file's tokens held out, at a document end
  int64_t interval = 0;   // steps between validations; 0: none
  int64_t steps = -1;     // global batches a validation; -1: every whole one the set holds
};

struct TrainingConfig {
  int64_t steps = 10;
  int64_t global_batch_size = 0;  // sequences per step; 0: all rows of the tokens matrix
  int64_t micro_batch_size = 0;   // sequences per forward on one rank; 0: the rank's whole share
  double clip_grad_norm = 1.0;    // 0: no clipping
  int64_t seed = 0;
  std::string device = "cpu";     // cpu or cuda
  double device_memory_limit = 0;  // GiB a rank may take on its device; 0: what is free
  // Linear layers in blockwise FP8 (none or blockwise; models/linear.h), with the tile
  // scales rounded up to powers of two (pow2) or kept as computed (fp32).
  std::string fp8 = "none";
  std::string fp8_scale = "pow2";
  double load_balance_coef = 0.0;
  std::string load_balance_type = "micro_batch";  // micro_batch, global_batch or sequence
  // The router z-loss's weight (ST-MoE; Megatron's --moe-z-loss-coeff): the mean over MoE
  // layers and tokens of logsumexp(router logits)^2, added to the loss (0: off).
  double router_z_loss_coef = 0.0;
  // DeepSeek-V3's auxiliary-loss-free balancing: after each step every expert's router
  // bias moves by rate x sign(mean load - its load), from the step's counts (0: off).
  double expert_bias_update_rate = 0.0;
  // DeepSeek-V3's multi-token prediction, for a model with num_nextn_predict_layers D:
  // lambda, the weight of the depths' loss (lambda / D times the sum of their mean
  // cross-entropies); 0: the depths are not built (models/decoder.h).
  double mtp_loss_weight = 0.3;
  double capacity_factor = 0.0;   // 0: dropless
  bool force_balanced_routing = false;  // benchmarks: route round-robin, not by the router
  // Recomputation in the backward (torchtitan's names): none, selective or full
  // (ModelOptions::recompute says what each keeps).
  std::string activation_checkpoint = "none";
  // Micro-batches that pass each layer together (train/schedule.h, sequential_schedule):
  // 1 each through the whole model in turn, 0 all of the step's; one pp rank only.
  int64_t layer_sweep = 1;
  int64_t max_skipped_steps = 0;  // steps with a non-finite loss or gradient norm a run may skip
};

struct OptimizerConfig {
  std::string name = "adamw";
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  std::string decay = "matrices";  // which parameters decay: matrices (2-D and up) or all
  // The moments' storage: fp32, or bf16 rounded stochastically (half the bytes and
  // traffic; the update itself is computed in fp32 either way).
  std::string state_dtype = "fp32";
  DType state() const { return state_dtype == "bf16" ? DType::bf16 : DType::f32; }
  // name = muon (train/optimizer.h): its momentum, Nesterov or not, Newton-Schulz steps,
  // and learning rate (0: lr), under the same schedule.
  double muon_momentum = 0.95;
  bool muon_nesterov = true;
  int64_t muon_ns_steps = 5;
  double muon_lr = 0;
};

struct SchedulerConfig {
  int64_t warmup_steps = 0;
  std::string decay = "constant";  // constant, linear, cosine or wsd
  double min_lr_ratio = 0.0;       // the floor, as a fraction of lr
  double decay_ratio = 0.1;        // wsd: the fraction of the steps spent decaying at the end
};

struct ParallelismConfig {
  int64_t pp = 1, cp = 1, ep = 1;
  // ZeRO-3: with more than one rank, the decoder layers' weights and gradients also
  // live only as shards, each layer gathered just before its stages (parallel/zero3.h).
  bool zero3 = false;
  // auto (dualpipev when pp > 1), dualpipev (2 * pp chunks in a V) or 1f1b
  // (train/schedule.h, make_pipeline).
  std::string pipeline_schedule = "auto";
  // Hot-expert replicas (models/expert_replicas.h): R slots an ep rank more for copies
  // of other ranks' experts, placed from the loads' moving average every
  // replan_interval steps (parallel/placement.h).
  int64_t expert_replicas = 0;
  int64_t replan_interval = 10;
};

// Expert offload to host memory (train/offload.h).
struct OffloadConfig {
  // none; optimizer: the routed experts' master weights and moments on the host; weights:
  // their compute copies and gradients too, through the expert cache (models/expert_cache.h)
  std::string experts = "none";
  double staging_mib = 64;       // MiB of each of the update's two device staging sets
  int64_t layers = 0;            // offload only the first this many MoE layers a rank holds; 0: all
  int64_t gpu_expert_slots = 0;  // weights: experts the device holds at once; 0: two layers' worth
};

struct CheckpointConfig {
  int64_t interval = 0;  // steps between checkpoints; 0: none along the way
  // Save the run's last step as well (step 0 too: the initial weights). With false and
  // no multiple of interval among the steps to run, the run saves nothing (it warns).
  bool save_final = true;
  int64_t keep = 3;      // newest complete checkpoints kept
  std::string load;      // a checkpoint folder to start from instead of the newest
  bool allow_config_change = false;  // resume even if keys that break exact resume changed
};

struct MetricsConfig {
  int64_t log_interval = 1;
  bool profile = false;  // time each stage (a "breakdown" in metrics.jsonl)
  bool tensorboard = false;  // also write TensorBoard event files to DUMP_FOLDER/tb (train/tensorboard.h)
  int64_t max_lost_lines = 0;  // metrics lines or events that could not be written before the run stops
};

struct Config {
  JobConfig job;
  ModelConfig model;
  DataConfig data;
  ValidationConfig validation;
  TrainingConfig training;
  OptimizerConfig optimizer;
  SchedulerConfig lr_scheduler;
  ParallelismConfig parallelism;
  OffloadConfig offload;
  CheckpointConfig checkpoint;
  MetricsConfig metrics;
};

// Reads `toml_path` (may be empty: defaults only), then applies the overrides in
// order. A relative path in the file (job.dump_folder, model.init's hf:DIR,
// model.config, data.tokens, data.corpus, checkpoint.load) is taken against the file's
// folder; one on the command line against the working folder. An unknown key (with the
// closest known one as a suggestion), a value of the wrong type, or an invalid value is
// an error naming the file (or "--section.key") and the key.
Config load_config(const std::string& toml_path, const std::vector<std::pair<std::string, std::string>>& overrides);

// Every key as "[section]" and "key = value" lines in TOML (config.toml, train_state),
// paths made absolute, so the text reads back the same from any folder.
std::string config_to_toml(const Config& c);

// Every key with its type, default and meaning: aligned text (train --help) or the
// Markdown page docs/config.md.
std::string config_reference(bool markdown);

// A key whose value differs from a saved config's; `breaks_resume` for the keys an
// exact resume needs unchanged (the model, the data, the batch sizes, the seed).
struct ConfigChange {
  std::string key, before, after;
  bool breaks_resume = false;
};

// The keys of `c` that differ from `saved_toml` (config_to_toml's text; a key it lacks
// counts as its default, one it has that no longer exists is ignored), in
// config_to_toml's text (relative paths made absolute against the working folder).
std::vector<ConfigChange> config_changes(const std::string& saved_toml, const Config& c);

// The files a run reads, one entry a file ("data.corpus: a.bin", relative to its key's
// folder) with io::file_fingerprint's size and checksum: each input key's files, a
// folder's regular files walked in name order. Ranks compare it with rank 0's. With
// `resume`, only what a resumed run reads again, as a checkpoint records it: the data
// and validation files, and the model's config.json and tokenizer.json (not
// checkpoint.load, nor an hf: model's weights).
std::map<std::string, std::string> input_identity(const Config& c, bool resume);

// Every input path that is set (model.init's hf:DIR, model.config, data.tokens,
// data.corpus, validation.tokens and corpus, checkpoint.load) exists; else an error naming the key and the path.
void check_inputs_exist(const Config& c);

// The model's Hugging Face config.json: model.config, else DIR/config.json of model.init
// = hf:DIR; an error saying what to set when neither is there.
std::string model_config_path(const Config& c);

// data.mixture's parts (`where` names the key in errors), or data.corpus as one of
// weight 1: the corpora a run reads (none with data.tokens).
struct MixturePart {
  std::string folder;
  double weight = 1;
};
std::vector<MixturePart> mixture_parts(const std::string& text, const std::string& where);
std::vector<MixturePart> data_corpora(const Config& c);

// The learning rate at 0-based `step`: linear warmup to lr over warmup_steps, then
// the decay shape down to lr * min_lr_ratio at the last step.
double lr_at(const Config& c, int64_t step);

}  // namespace mt
