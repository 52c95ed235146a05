#include "train/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <utility>

#include "core/check.h"
#include "io/file.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

// kPath: a path (relative ones in a config file are taken against its folder);
// kFixed: fixed on resume, as an exact resume needs it (checkpoint.allow_config_change).
// kList: a mixture's "WEIGHT:PATH,WEIGHT:PATH", each PATH a path.
enum : int { kPath = 1, kFixed = 2, kList = 4 };

struct Key {
  const char* section;
  const char* name;
  int flags;
  const char* meaning;
  std::string dotted() const { return std::string(section) + "." + name; }
};

// Calls f(key, field) for every key: the one list that parsing, overrides, printing,
// the reference and the resume check share. A meaning is one line.
template <typename C, typename F>
void visit(C& c, F&& f) {
  f({"job", "dump_folder", kPath, "the run folder: config.toml, metrics.jsonl, checkpoints/"}, c.job.dump_folder);
  f({"model", "init", kPath | kFixed, "random, or hf:DIR to start from a Hugging Face model folder"}, c.model.init);
  f({"model", "config", kPath | kFixed, "the architecture: a Hugging Face config.json (or hf:DIR's)"}, c.model.config);
  f({"model", "init_std", 0, "random init: N(0, init_std); output projections / sqrt(2 * layers)"}, c.model.init_std);
  f({"data", "tokens", kPath | kFixed, "a .npy [B, T] token matrix: the whole global batch every step"}, c.data.tokens);
  f({"data", "corpus", kPath | kFixed, "a folder of tokenized .bin files (moetrain tokenize)"}, c.data.corpus);
  f({"data", "mixture", kPath | kFixed | kList,
     "several corpora drawn in proportion: \"0.3:folder_a,0.7:folder_b\" (or [{corpus, weight}, ...] in a file)"},
    c.data.mixture);
  f({"data", "seq_len", kFixed, "tokens a sequence; 0: T - 1 of data.tokens (set it with data.corpus)"}, c.data.seq_len);
  f({"data", "allow_past_max_positions", 0,
     "train on sequences longer than config.json's max_position_embeddings (with a warning)"},
    c.data.allow_past_max_positions);
  f({"validation", "tokens", kPath, "a held-out .npy [B, T] token matrix (T - 1 the training sequence length)"},
    c.validation.tokens);
  f({"validation", "corpus", kPath, "a held-out folder of tokenized .bin files"}, c.validation.corpus);
  f({"validation", "split", kFixed,
     "hold out this fraction of each data.corpus file's tokens (its last documents) as the validation set"},
    c.validation.split);
  f({"validation", "interval", 0, "steps between validations (the held-out mean loss, val_loss); 0: none"},
    c.validation.interval);
  f({"validation", "steps", 0, "global batches a validation reads, the same ones each time; -1: every whole one"},
    c.validation.steps);
  f({"training", "steps", 0, "optimizer steps of the whole run (a resumed run continues to it)"}, c.training.steps);
  f({"training", "global_batch_size", kFixed, "sequences a step; 0: every row of data.tokens"},
    c.training.global_batch_size);
  f({"training", "micro_batch_size", kFixed, "sequences a forward on one rank; 0: the rank's whole share"},
    c.training.micro_batch_size);
  f({"training", "clip_grad_norm", 0, "clip the gradients' global norm to this; 0: no clipping"},
    c.training.clip_grad_norm);
  f({"training", "seed", kFixed, "seeds the random init and the corpus order"}, c.training.seed);
  f({"training", "device", 0, "cpu, or cuda (bf16 compute, fp32 master weights; one GPU a rank)"}, c.training.device);
  f({"training", "device_memory_limit", 0,
     "GiB of device memory a rank may take (stands in for a smaller GPU); 0: what is free"},
    c.training.device_memory_limit);
  f({"training", "fp8", 0, "none, or blockwise: linear layers in e4m3 with 1x128 / 128x128 scales"}, c.training.fp8);
  f({"training", "fp8_scale", 0, "pow2 (scales rounded up to powers of two) or fp32 (as computed)"},
    c.training.fp8_scale);
  f({"training", "load_balance_coef", 0, "weight of the load-balance loss added to the cross-entropy"},
    c.training.load_balance_coef);
  f({"training", "load_balance_type", 0,
     "micro_batch or global_batch (the tokens the balance is measured over), or sequence (DeepSeek's seq_aux: each "
     "sequence's term, averaged over them and summed over the MoE layers)"},
    c.training.load_balance_type);
  f({"training", "router_z_loss_coef", 0,
     "weight of the router z-loss (mean over MoE layers and tokens of logsumexp(logits)^2) added to the loss"},
    c.training.router_z_loss_coef);
  f({"training", "expert_bias_update_rate", 0,
     "DeepSeek-V3's loss-free balancing: each step an expert's routing bias (for the top-k choice only) moves by "
     "this x sign(mean load - its load); 0: off"},
    c.training.expert_bias_update_rate);
  f({"training", "mtp_loss_weight", kFixed,
     "multi-token prediction (a model with num_nextn_predict_layers D): the depths' loss weight lambda, lambda / D "
     "times the sum of their mean cross-entropies added to the loss; 0: the depths are not built"},
    c.training.mtp_loss_weight);
  f({"training", "capacity_factor", 0, "an expert keeps ceil(f * tokens * top_k / experts) rows; 0: dropless"},
    c.training.capacity_factor);
  f({"training", "activation_checkpoint", 0,
     "none, selective (recompute the cheap activations) or full (keep each layer's input only)"},
    c.training.activation_checkpoint);
  f({"training", "layer_sweep", 0,
     "micro-batches that go through each layer together (1: each through the model in turn; 0: all of a step's); "
     "with offload.experts = weights a layer's experts are then fetched once a sweep"},
    c.training.layer_sweep);
  f({"training", "force_balanced_routing", 0, "benchmarks: route tokens round-robin, not by the router"},
    c.training.force_balanced_routing);
  f({"training", "max_skipped_steps", 0, "steps with a non-finite loss or gradient norm skipped before the run stops"},
    c.training.max_skipped_steps);
  f({"optimizer", "name", kFixed,
     "adamw, or muon: Muon on the hidden matrices, AdamW (same lr, decay and betas) on the embedding, head, norms, "
     "biases and routers"},
    c.optimizer.name);
  f({"optimizer", "lr", 0, "the peak learning rate"}, c.optimizer.lr);
  f({"optimizer", "beta1", 0, "AdamW's first-moment decay"}, c.optimizer.beta1);
  f({"optimizer", "beta2", 0, "AdamW's second-moment decay"}, c.optimizer.beta2);
  f({"optimizer", "eps", 0, "AdamW's epsilon"}, c.optimizer.eps);
  f({"optimizer", "weight_decay", 0, "decoupled weight decay"}, c.optimizer.weight_decay);
  f({"optimizer", "decay", 0, "which parameters decay: matrices (2-D and up) or all"}, c.optimizer.decay);
  f({"optimizer", "state_dtype", 0, "AdamW's moments (and Muon's momentum) in fp32, or in bf16 rounded stochastically"},
    c.optimizer.state_dtype);
  f({"optimizer", "muon_momentum", 0, "Muon's momentum"}, c.optimizer.muon_momentum);
  f({"optimizer", "muon_nesterov", 0, "Muon orthogonalises g + momentum m (Nesterov) rather than m"},
    c.optimizer.muon_nesterov);
  f({"optimizer", "muon_ns_steps", 0, "Muon's Newton-Schulz iterations"}, c.optimizer.muon_ns_steps);
  f({"optimizer", "muon_lr", 0, "Muon's peak learning rate (0: optimizer.lr); its update is scaled by "
     "0.2 sqrt(max(rows, cols)) so one lr serves both"}, c.optimizer.muon_lr);
  f({"lr_scheduler", "warmup_steps", 0, "steps of linear warmup from 0 to optimizer.lr"}, c.lr_scheduler.warmup_steps);
  f({"lr_scheduler", "decay", 0, "after warmup: constant, linear, cosine or wsd"}, c.lr_scheduler.decay);
  f({"lr_scheduler", "min_lr_ratio", 0, "where the decay ends, as a fraction of optimizer.lr"},
    c.lr_scheduler.min_lr_ratio);
  f({"lr_scheduler", "decay_ratio", 0, "wsd: the fraction of the steps spent decaying at the end"},
    c.lr_scheduler.decay_ratio);
  f({"parallelism", "pp", 0, "pipeline stages (dp = ranks / (pp * cp * ep))"}, c.parallelism.pp);
  f({"parallelism", "cp", 0, "context-parallel ranks (ring attention over a sequence)"}, c.parallelism.cp);
  f({"parallelism", "ep", 0, "expert-parallel ranks (each holds experts / ep experts)"}, c.parallelism.ep);
  f({"parallelism", "zero3", 0, "shard the decoder layers' weights and gradients too (ZeRO-3)"}, c.parallelism.zero3);
  f({"parallelism", "pipeline_schedule", 0, "auto (dualpipev when pp > 1), dualpipev or 1f1b"},
    c.parallelism.pipeline_schedule);
  f({"parallelism", "expert_replicas", 0,
     "slots an ep rank holds for copies of other ranks' hot experts (0: none; needs ep > 1, dropless)"},
    c.parallelism.expert_replicas);
  f({"parallelism", "replan_interval", 0,
     "steps between placements of the replicas, from the experts' loads averaged over steps"},
    c.parallelism.replan_interval);
  f({"offload", "experts", 0,
     "none; optimizer: the routed experts' f32 master weights and AdamW moments in host memory; weights: their "
     "compute copies and gradients too, an LRU cache of gpu_expert_slots experts on the device"},
    c.offload.experts);
  f({"offload", "staging_mib", 0, "MiB of each of the two device buffers an offloaded update streams through"},
    c.offload.staging_mib);
  f({"offload", "layers", 0, "offload the experts of only the first this many MoE layers a rank holds; 0: all"},
    c.offload.layers);
  f({"offload", "gpu_expert_slots", 0,
     "offload.experts = weights: experts a rank's device holds at once (fewer than a layer's: lines of half); 0: two "
     "layers' worth"},
    c.offload.gpu_expert_slots);
  f({"checkpoint", "interval", 0, "steps between checkpoints; 0: none along the way"}, c.checkpoint.interval);
  f({"checkpoint", "save_final", 0, "also save the run's last step (warns when the run would save none)"},
    c.checkpoint.save_final);
  f({"checkpoint", "keep", 0, "the newest complete checkpoints kept"}, c.checkpoint.keep);
  f({"checkpoint", "load", kPath, "resume from this checkpoint folder, not the run's newest"}, c.checkpoint.load);
  f({"checkpoint", "allow_config_change", 0, "resume even though keys marked fixed on resume changed"},
    c.checkpoint.allow_config_change);
  f({"metrics", "log_interval", 0, "steps between lines on stdout (metrics.jsonl has every step)"},
    c.metrics.log_interval);
  f({"metrics", "profile", 0, "time each stage (a breakdown in metrics.jsonl; moetrain plan --profile)"},
    c.metrics.profile);
  f({"metrics", "tensorboard", 0, "also write TensorBoard event files to job.dump_folder/tb"}, c.metrics.tensorboard);
  f({"metrics", "max_lost_lines", 0,
     "metrics.jsonl lines and TensorBoard events that may fail to be written (a full disk); past it the run "
     "saves at its next checkpoint and exits 1"},
    c.metrics.max_lost_lines);
}

// A parallel degree no machine reaches, so that products of degrees fit an int.
constexpr int64_t kMaxDegree = int64_t{1} << 16;

template <typename T>
const char* type_name() {
  if constexpr (std::is_same_v<T, std::string>) return "a string";
  else if constexpr (std::is_same_v<T, bool>) return "true or false";
  else if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  else return "a number";
}

std::string weight_text(double w) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, w).ptr);
}

// A value in TOML; a number in the fewest digits that read back the same, as a float.
template <typename T>
std::string toml_text(const T& v) {
  std::ostringstream s;
  if constexpr (std::is_same_v<T, std::string>) {
    s << toml::value<std::string>(v);
  } else if constexpr (std::is_same_v<T, bool>) {
    s << (v ? "true" : "false");
  } else if constexpr (std::is_same_v<T, int64_t>) {
    s << v;
  } else {
    const std::string t = weight_text(v);
    s << t << (t.find_first_of(".en") == std::string::npos ? ".0" : "");
  }
  return s.str();
}

// The path in a path key's value, through `f` (hf:DIR keeps its prefix; "random" and
// empty values are not paths).
template <typename F>
std::string on_path(const std::string& v, F&& f) {
  const size_t skip = v.starts_with("hf:") ? 3 : 0;
  if (v == "random" || v.size() == skip) return v;
  return v.substr(0, skip) + f(fs::path(v.substr(skip))).string();
}

// The same over each path of a key's value (a kList key's several).
template <typename F>
std::string on_paths(const Key& k, const std::string& v, F&& f) {
  if (!(k.flags & kList)) return on_path(v, f);
  std::string out;
  for (const MixturePart& part : mixture_parts(v, k.dotted()))
    out += (out.empty() ? "" : ",") + weight_text(part.weight) + ":" + f(fs::path(part.folder)).string();
  return out;
}

// A key's value as config_to_toml writes it and a resume compares it: TOML, with paths
// absolute (against the working folder), so that the text reads back the same anywhere.
template <typename T>
std::string key_text(const Key& k, const T& v) {
  if constexpr (std::is_same_v<T, std::string>)
    if (k.flags & kPath)
      return toml_text(on_paths(k, v, [](const fs::path& p) { return fs::absolute(p).lexically_normal(); }));
  return toml_text(v);
}

// The known key closest to `dotted` ("section.key"); the same key name in another
// section first (lr under [training] is optimizer.lr).
std::string closest_key(const std::string& dotted) {
  const std::string name = dotted.substr(dotted.find('.') + 1);
  std::vector<std::string> keys;
  std::string same_name;
  const Config c;
  visit(c, [&](const Key& k, const auto&) {
    keys.push_back(k.dotted());
    if (k.name == name) same_name = k.dotted();
  });
  return same_name.empty() ? closest(dotted, keys) : same_name;
}

// One TOML value into a field; `where` is "FILE: [section] key" for messages.
// (An integer is a number too: toml++ reads it as a double.)
template <typename T>
void set_from_toml(const toml::node& n, T& field, const std::string& where) {
  const bool is_t = std::is_same_v<T, std::string> ? n.is_string()
                    : std::is_same_v<T, bool>      ? n.is_boolean()
                    : std::is_same_v<T, int64_t>   ? n.is_integer()
                                                   : n.is_number();
  MT_CHECK(is_t) << where << " should be " << type_name<T>();
  field = *n.value<T>();
}

// A command-line value: strings are taken as written, the rest parsed strictly.
template <typename T>
void set_from_text(const std::string& text, T& field, const std::string& where) {
  if constexpr (std::is_same_v<T, std::string>) {
    field = text;
  } else if constexpr (std::is_same_v<T, bool>) {
    MT_CHECK(text == "true" || text == "false") << where << " should be " << type_name<T>() << ", got '" << text << "'";
    field = text == "true";
  } else {
    std::istringstream s(text);
    T v{};
    s >> v;
    MT_CHECK(!text.empty() && !s.fail() && s.eof()) << where << " should be " << type_name<T>() << ", got '" << text << "'";
    field = v;
  }
}

void check_one_of(const std::string& value, std::initializer_list<const char*> allowed, const char* key) {
  std::string list;
  for (const char* a : allowed) {
    if (value == a) return;
    list += list.empty() ? a : std::string(", ") + a;
  }
  MT_FAIL() << key << " should be one of " << list << ", got '" << value << "'";
}

void validate(const Config& c) {
  // No key takes inf or NaN (capacity_factor = inf became a capacity of one row).
  visit(c, [](const Key& k, const auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, double>) {
      MT_CHECK(std::isfinite(v)) << k.dotted() << " should be a finite number, got " << v;
    }
  });
  MT_CHECK(c.training.device_memory_limit >= 0.0)
      << "training.device_memory_limit = " << c.training.device_memory_limit << ": expected GiB >= 0 (0: no limit)";
  MT_CHECK(c.training.mtp_loss_weight >= 0.0 && std::isfinite(c.training.mtp_loss_weight))
      << "training.mtp_loss_weight = " << c.training.mtp_loss_weight << ": expected a finite number >= 0 (0: off)";
  MT_CHECK(c.training.expert_bias_update_rate >= 0.0)
      << "training.expert_bias_update_rate = " << c.training.expert_bias_update_rate << ": expected >= 0 (0: off)";
  MT_CHECK(c.training.router_z_loss_coef >= 0.0)
      << "training.router_z_loss_coef = " << c.training.router_z_loss_coef << ": expected >= 0 (0: off)";
  MT_CHECK(c.training.load_balance_coef >= 0.0)
      << "training.load_balance_coef = " << c.training.load_balance_coef << ": expected >= 0 (0: off); a negative "
      << "weight would reward imbalance";
  MT_CHECK(c.model.init_std >= 0.0) << "model.init_std = " << c.model.init_std
                                    << ": expected >= 0 (the standard deviation of the random init)";
  MT_CHECK(c.optimizer.weight_decay >= 0.0)
      << "optimizer.weight_decay = " << c.optimizer.weight_decay << ": expected >= 0 (0: none)";
  MT_CHECK(c.optimizer.eps > 0.0) << "optimizer.eps = " << c.optimizer.eps << ": expected > 0";
  MT_CHECK(c.training.capacity_factor >= 0.0) << "training.capacity_factor = " << c.training.capacity_factor
                                              << ": expected 0 (dropless) or a positive factor";
  MT_CHECK(c.model.init == "random" || c.model.init.starts_with("hf:"))
      << "model.init should be 'random' or 'hf:DIR', got '" << c.model.init << "'";
  check_one_of(c.training.device, {"cpu", "cuda"}, "training.device");
  check_one_of(c.training.fp8, {"none", "blockwise"}, "training.fp8");
  check_one_of(c.training.fp8_scale, {"pow2", "fp32"}, "training.fp8_scale");
  check_one_of(c.training.activation_checkpoint, {"none", "selective", "full"}, "training.activation_checkpoint");
  check_one_of(c.training.load_balance_type, {"micro_batch", "global_batch", "sequence"}, "training.load_balance_type");
  check_one_of(c.parallelism.pipeline_schedule, {"auto", "dualpipev", "1f1b"}, "parallelism.pipeline_schedule");
  check_one_of(c.optimizer.name, {"adamw", "muon"}, "optimizer.name");
  if (c.optimizer.name == "muon") {
    MT_CHECK(c.optimizer.muon_momentum >= 0 && c.optimizer.muon_momentum < 1 && c.optimizer.muon_lr >= 0 &&
             c.optimizer.muon_ns_steps >= 1)
        << "optimizer.muon_momentum should be in [0, 1), muon_lr >= 0 and muon_ns_steps >= 1, got "
        << c.optimizer.muon_momentum << ", " << c.optimizer.muon_lr << " and " << c.optimizer.muon_ns_steps;
    MT_CHECK(!c.parallelism.zero3 && c.offload.experts == "none")
        << "optimizer.name = muon with parallelism.zero3 = " << (c.parallelism.zero3 ? "true" : "false")
        << " and offload.experts = " << c.offload.experts << ": Muon with ZeRO-3 or offloaded experts is not built "
        << "yet (issue 62); use zero3 = false and offload.experts = none, or optimizer.name = adamw";
  }
  check_one_of(c.optimizer.decay, {"matrices", "all"}, "optimizer.decay");
  check_one_of(c.optimizer.state_dtype, {"fp32", "bf16"}, "optimizer.state_dtype");
  check_one_of(c.offload.experts, {"none", "optimizer", "weights"}, "offload.experts");
  MT_CHECK(c.offload.gpu_expert_slots >= 0)
      << "offload.gpu_expert_slots should be >= 0 (0: two layers' worth of experts), got " << c.offload.gpu_expert_slots;
  MT_CHECK(c.offload.experts != "weights" || c.training.fp8 == "none")
      << "offload.experts = weights with training.fp8 = " << c.training.fp8
      << " is not built yet (the cache moves the bf16 copies, not FP8 codes); offload.experts = optimizer takes both";
  MT_CHECK(c.offload.staging_mib > 0) << "offload.staging_mib should be > 0, got " << c.offload.staging_mib;
  MT_CHECK(c.offload.layers >= 0) << "offload.layers should be >= 0 (0: every MoE layer), got " << c.offload.layers;
  MT_CHECK(c.offload.experts == "none" || !c.parallelism.zero3)
      << "offload.experts = " << c.offload.experts << " with parallelism.zero3 is not built yet (ZeRO-3 gathers the layers' master "
      << "weights from shards on the device); choose one";
  MT_CHECK(c.training.layer_sweep >= 0)
      << "training.layer_sweep should be >= 0 (0: all of a step's micro-batches), got " << c.training.layer_sweep;
  MT_CHECK(c.training.layer_sweep == 1 || (c.parallelism.pp == 1 && c.parallelism.pipeline_schedule != "dualpipev"))
      << "training.layer_sweep = " << c.training.layer_sweep << " with parallelism.pp = " << c.parallelism.pp
      << " and pipeline_schedule = " << c.parallelism.pipeline_schedule
      << ": a sweep orders one rank's whole model (the sequential schedule); the pipeline schedules order their "
         "micro-batches themselves. Set layer_sweep = 1, or pp = 1 without dualpipev";
  MT_CHECK(c.training.max_skipped_steps >= 0)
      << "training.max_skipped_steps should be >= 0, got " << c.training.max_skipped_steps;
  check_one_of(c.lr_scheduler.decay, {"constant", "linear", "cosine", "wsd"}, "lr_scheduler.decay");
  MT_CHECK(c.training.steps >= 0) << "training.steps should be >= 0, got " << c.training.steps;
  MT_CHECK(c.training.global_batch_size >= 0 && c.training.micro_batch_size >= 0)
      << "training.global_batch_size and micro_batch_size should be >= 0, got " << c.training.global_batch_size
      << " and " << c.training.micro_batch_size;
  MT_CHECK(c.optimizer.lr >= 0) << "optimizer.lr should be >= 0, got " << c.optimizer.lr;
  MT_CHECK(c.optimizer.beta1 >= 0 && c.optimizer.beta1 < 1 && c.optimizer.beta2 >= 0 && c.optimizer.beta2 < 1)
      << "optimizer.beta1 and beta2 should be in [0, 1), got " << c.optimizer.beta1 << " and " << c.optimizer.beta2;
  MT_CHECK(c.training.clip_grad_norm >= 0) << "training.clip_grad_norm should be >= 0, got " << c.training.clip_grad_norm;
  MT_CHECK(c.lr_scheduler.warmup_steps >= 0) << "lr_scheduler.warmup_steps should be >= 0";
  MT_CHECK(c.lr_scheduler.min_lr_ratio >= 0 && c.lr_scheduler.min_lr_ratio <= 1)
      << "lr_scheduler.min_lr_ratio should be in [0, 1], got " << c.lr_scheduler.min_lr_ratio;
  MT_CHECK(c.lr_scheduler.decay_ratio > 0 && c.lr_scheduler.decay_ratio <= 1)
      << "lr_scheduler.decay_ratio should be in (0, 1], got " << c.lr_scheduler.decay_ratio;
  MT_CHECK(c.parallelism.pp >= 1 && c.parallelism.cp >= 1 && c.parallelism.ep >= 1 &&
           c.parallelism.pp <= kMaxDegree && c.parallelism.cp <= kMaxDegree && c.parallelism.ep <= kMaxDegree)
      << "parallelism.pp, cp and ep should be in [1, " << kMaxDegree << "], got " << c.parallelism.pp << ", "
      << c.parallelism.cp << ", " << c.parallelism.ep;
  MT_CHECK(!c.parallelism.zero3 || c.parallelism.pp == 1)
      << "parallelism.zero3 with parallelism.pp > 1 is not supported (pipeline stages would gather other ranks' layers)";
  MT_CHECK(c.parallelism.expert_replicas >= 0 && c.parallelism.replan_interval >= 1)
      << "parallelism.expert_replicas should be >= 0 and replan_interval >= 1, got " << c.parallelism.expert_replicas
      << " and " << c.parallelism.replan_interval;
  MT_CHECK(c.parallelism.expert_replicas == 0 || c.parallelism.ep > 1)
      << "parallelism.expert_replicas = " << c.parallelism.expert_replicas
      << " needs expert parallelism: replicas are copies on other ep ranks (set parallelism.ep > 1)";
  MT_CHECK(!c.data.tokens.empty() + !c.data.corpus.empty() + !c.data.mixture.empty() <= 1)
      << "more than one of data.tokens, data.corpus and data.mixture is set; choose one";
  mixture_parts(c.data.mixture, "data.mixture");
  const ValidationConfig& v = c.validation;
  const int sources = !v.tokens.empty() + !v.corpus.empty() + (v.split > 0);
  MT_CHECK(v.split >= 0 && v.split < 1) << "validation.split should be in [0, 1) (0: none), got " << v.split;
  MT_CHECK(v.split == 0 || !c.data.corpus.empty() || !c.data.mixture.empty())
      << "validation.split = " << v.split << " holds out part of data.corpus (or each of data.mixture's corpora), "
      << "but neither is set";
  MT_CHECK(sources <= 1) << "validation.tokens, validation.corpus and validation.split name " << sources
                         << " held-out sets; choose one";
  MT_CHECK(v.interval >= 0) << "validation.interval should be >= 0 (0: none), got " << v.interval;
  MT_CHECK(v.steps == -1 || v.steps >= 1) << "validation.steps should be >= 1, or -1 (every whole global batch), got "
                                          << v.steps;
  MT_CHECK((sources == 1) == (v.interval > 0))
      << (sources == 1 ? "a validation set is given but validation.interval is 0: set the steps between validations"
                       : "validation.interval = " + std::to_string(v.interval) +
                             " but no validation set: set validation.tokens, validation.corpus or validation.split");
  MT_CHECK(c.metrics.log_interval >= 1) << "metrics.log_interval should be >= 1";
  MT_CHECK(c.metrics.max_lost_lines >= 0)
      << "metrics.max_lost_lines = " << c.metrics.max_lost_lines << ": expected >= 0 (0: none may be lost)";
  MT_CHECK(c.checkpoint.interval >= 0 && c.checkpoint.keep >= 1)
      << "checkpoint.interval should be >= 0 and checkpoint.keep >= 1";
}

// toml++ 3.3 reaches an "unreachable" branch (undefined behaviour; found by fuzzing) when
// it asks whether a code point of U+00A1..U+0499, U+2C5E..U+3057 (but U+3000) or
// U+FB26..U+FEFE is whitespace (its table misses them), which it asks of characters
// outside strings and comments and inside multi-line basic strings ("""). TOML allows
// nothing past ASCII outside strings and comments anyway: such characters are refused
// here, before it sees them, and those three ranges in """ strings. A quote opens a
// string only where a key or value may start (after =, [, {, a comma, a dot or at a
// line's start), as for toml++; a value that is no string, array or inline table is a
// word toml++ scans to the next space or line end, quotes, brackets and = included, so
// nothing opens inside it (not a comment either). A leading byte-order mark stays.
void refuse_what_tomlpp_mishandles(std::string_view text, const std::string& where) {
  enum { kBare, kComment, kBasic, kLiteral, kMultiBasic, kMultiLiteral } in = kBare;
  auto line = [&](size_t at) { return 1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n'); };
  char before = '\n';  // the last character in kBare other than a space or tab
  bool word = false;       // inside such a value
  for (size_t i = text.starts_with("\xEF\xBB\xBF") ? 3 : 0; i < text.size(); ++i) {
    const auto b = static_cast<unsigned char>(text[i]);
    const std::string_view three = text.substr(i, 3);
    switch (in) {
      case kBare: {
        MT_CHECK(b < 0x80) << where << ":" << line(i) << ": a character past ASCII outside a string or comment; TOML "
                           << "allows them only in quoted strings and after #: quote the value or remove it";
        if (b == ' ' || b == '\t' || b == '\r' || b == '\n')
          word = false;
        else if (before == '=' && std::string_view("\"'[{").find(static_cast<char>(b)) == std::string_view::npos)
          word = true;
        const bool opens = !word && std::string_view("=[{,.\n").find(before) != std::string_view::npos;
        if (opens && (three == "\"\"\"" || three == "'''")) {
          in = b == '"' ? kMultiBasic : kMultiLiteral;
          i += 2;
        } else if ((b == '#' && !word) || (opens && (b == '"' || b == '\''))) {
          in = b == '#' ? kComment : b == '"' ? kBasic : kLiteral;
        } else if (b != ' ' && b != '\t' && b != '\r') {
          before = static_cast<char>(b);
        }
        break;
      }
      case kComment:
      case kBasic:
      case kLiteral:
        if (in == kBasic && b == '\\') {
          ++i;  // an escaped quote does not end the string
        } else if (b == '\n' || (in == kBasic && b == '"') || (in == kLiteral && b == '\'')) {
          before = static_cast<char>(b);
          in = kBare;
        }
        break;
      case kMultiBasic:
      case kMultiLiteral: {
        const char quote = in == kMultiBasic ? '"' : '\'';
        if (in == kMultiBasic && b == '\\') {
          // The escaped character, unless past ASCII: toml++ asks whether that is whitespace.
          if (i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) < 0x80) ++i;
        } else if (three == std::string(3, quote)) {
          while (i + 3 < text.size() && text[i + 3] == quote) ++i;  // up to two quotes end the string's text
          i += 2;
          before = quote;
          in = kBare;
        } else if (in == kMultiBasic && b >= 0xC0) {
          char32_t c = b >= 0xF0 ? b & 0x07 : b >= 0xE0 ? b & 0x0F : b & 0x1F;
          for (size_t k = i + 1; k < text.size() && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80 && k < i + 4; ++k)
            c = c << 6 | (static_cast<unsigned char>(text[k]) & 0x3F);
          const bool bad = (c >= 0xA1 && c <= 0x499) || (c >= 0x2C5E && c <= 0x3057 && c != 0x3000) ||
                           (c >= 0xFB26 && c <= 0xFEFE);
          MT_CHECK(!bad) << where << ":" << line(i) << ": the character U+" << std::hex << static_cast<uint32_t>(c)
                         << " in a \"\"\" string is not accepted (toml++ mishandles U+00A1..U+0499, "
                            "U+2C5E..U+3057 and U+FB26..U+FEFE there): use a single-line or ''' string";
        }
        break;
      }
    }
  }
}

toml::table parse_toml(std::string_view text, const std::string& where) {
  refuse_what_tomlpp_mishandles(text, where);
  try {
    return toml::parse(text, where);
  } catch (const toml::parse_error& e) {
    MT_FAIL() << where << ":" << e.source().begin.line << ":" << e.source().begin.column << ": " << e.description();
  }
  return {};
}

// [{corpus = "a", weight = 0.3}, ...] as data.mixture's text, "0.3:a,...".
std::string mixture_from_toml(const toml::array& parts, const std::string& where) {
  std::string out;
  for (const toml::node& n : parts) {
    const toml::table* t = n.as_table();
    MT_CHECK(t && t->size() == 2 && (*t)["corpus"].is_string() && (*t)["weight"].is_number())
        << where << ": each entry should be {corpus = \"FOLDER\", weight = W}";
    const std::string folder = *(*t)["corpus"].value<std::string>();
    MT_CHECK(folder.find(',') == std::string::npos) << where << ": the folder " << folder << " has a comma, which "
                                                    << "the mixture's text form cannot hold; rename it";
    if (!out.empty()) out.append(",");
    out.append(weight_text(*(*t)["weight"].value<double>())).append(":").append(folder);
  }
  return out;
}

// The input paths that are set: model.init's hf:DIR, model.config, data.tokens,
// data.corpus, validation.tokens and corpus, checkpoint.load; each with its key, its value and the path in it.
struct InputPath {
  std::string key, value, path;  // "model.init", "hf:/m", "/m"
};
std::vector<InputPath> input_paths(const Config& c) {
  std::vector<InputPath> out;
  visit(c, [&](const Key& k, const auto& field) {
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::string>)
      if ((k.flags & kPath) && k.dotted() != "job.dump_folder")
        on_paths(k, field, [&](const fs::path& p) {
          out.push_back({k.dotted(), field, p.string()});
          return p;
        });
  });
  return out;
}

}  // namespace

std::vector<MixturePart> mixture_parts(const std::string& text, const std::string& where) {
  std::vector<MixturePart> out;
  if (text.empty()) return out;
  for (size_t at = 0; at <= text.size();) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string part = text.substr(at, end - at), w = part.substr(0, part.find(':'));
    double weight = 0;
    const auto [ptr, ec] = std::from_chars(w.data(), w.data() + w.size(), weight);
    MT_CHECK(part.find(':') != std::string::npos && ec == std::errc() && ptr == w.data() + w.size() && weight > 0 &&
             std::isfinite(weight) && part.size() > w.size() + 1)
        << where << ": '" << part << "' should be WEIGHT:FOLDER with a weight > 0 (\"0.3:corpora/a,0.7:corpora/b\")";
    out.push_back({part.substr(w.size() + 1), weight});
    at = end + 1;
  }
  return out;
}

std::vector<MixturePart> data_corpora(const Config& c) {
  if (!c.data.corpus.empty()) return {{c.data.corpus, 1.0}};
  return mixture_parts(c.data.mixture, "data.mixture");
}

Config load_config(const std::string& toml_path, const std::vector<std::pair<std::string, std::string>>& overrides) {
  Config c;
  if (!toml_path.empty()) {
    const std::vector<uint8_t> bytes = io::read_file(toml_path);
    const toml::table t =
        parse_toml(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), toml_path);
    const fs::path folder = fs::path(toml_path).parent_path();
    for (auto&& [section, node] : t) {
      std::string sec(section.str());
      MT_CHECK(node.is_table()) << toml_path << ": '" << sec << "' should be a [section]";
      for (auto&& entry : *node.as_table()) {  // not a structured binding: lambdas below use it (clang 14)
        const std::string k(entry.first.str());
        const toml::node& value = entry.second;
        bool found = false;
        visit(c, [&](const Key& known, auto& field) {
          if (sec != known.section || k != known.name) return;
          const std::string where = toml_path + ": [" + sec + "] " + k;
          if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::string>)
            if ((known.flags & kList) && value.is_array()) field = mixture_from_toml(*value.as_array(), where);
          if (!(known.flags & kList) || !value.is_array()) set_from_toml(value, field, where);
          if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::string>)
            if (known.flags & kPath)
              field = on_paths(known, field,
                               [&](const fs::path& p) { return p.is_absolute() ? p : (folder / p).lexically_normal(); });
          found = true;
        });
        if (found) continue;
        const std::string near = closest_key(sec + "." + k);
        MT_FAIL() << toml_path << ": unknown key [" << sec << "] " << k << "; did you mean [" << near.substr(0, near.find('.'))
                  << "] " << near.substr(near.find('.') + 1) << "? (moetrain train --help lists every key)";
      }
    }
  }
  for (const auto& override : overrides) {
    const std::string &dotted = override.first, &text = override.second;
    bool found = false;
    visit(c, [&](const Key& k, auto& field) {
      if (dotted != k.dotted()) return;
      set_from_text(text, field, "--" + dotted);
      // `..` lexically, as in a config file: a/b/../c is a/c, so no a/b is made for a run
      // folder (the rest as written).
      if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::string>)
        if (k.flags & kPath)
          field = on_paths(k, field, [](const fs::path& p) {
            return std::find(p.begin(), p.end(), fs::path("..")) != p.end() ? p.lexically_normal() : p;
          });
      found = true;
    });
    MT_CHECK(found) << "unknown option --" << dotted << ": no such config key; did you mean --" << closest_key(dotted)
                    << "? (moetrain train --help lists every key)";
  }
  validate(c);
  return c;
}

std::string config_to_toml(const Config& c) {
  std::ostringstream s;
  std::string current;
  visit(c, [&](const Key& k, const auto& field) {
    if (current != k.section) s << (current.empty() ? "" : "\n") << "[" << k.section << "]\n";
    current = k.section;
    s << k.name << " = " << key_text(k, field) << "\n";
  });
  return s.str();
}

std::string config_reference(bool markdown) {
  std::ostringstream s;
  if (markdown)
    s << "# Configuration keys\n\n"
         "Generated from the key list in src/train/config.cpp by\n"
         "`moetrain train --config-reference > docs/config.md`; the ctest test `config_doc` fails\n"
         "when this page is out of date. `moetrain train --help` prints the same list.\n\n"
         "A run is described by a TOML file (`--config FILE.toml`, keys under `[section]`) and\n"
         "`--section.key=value` overrides, applied in order after the file. Every key has a\n"
         "default, so overrides alone can describe a run; `--print-config` prints the resolved\n"
         "config as TOML and exits. An unknown key is an error naming the closest known one.\n\n"
         "- Paths (type `path`): a relative path in a config file is taken against the file's\n"
         "  folder, one on the command line against the working folder; `..` is taken\n"
         "  lexically (`a/b/../c` is `a/c`).\n"
         "- Resume: a run whose `job.dump_folder` holds a checkpoint (or given\n"
         "  `checkpoint.load`) resumes from it and prints every key changed since that\n"
         "  checkpoint was saved (old -> new). A change of a key marked *fixed on resume*\n"
         "  breaks an exact resume and is refused unless `checkpoint.allow_config_change =\n"
         "  true`. The run folder keeps `config.toml`, the config the run started with, and\n"
         "  `config.step-NNNNNNNN.toml`, the config of each resume from step N.\n";
  std::string current;
  const Config defaults;
  char line[512];
  visit(defaults, [&](const Key& k, const auto& field) {
    using T = std::decay_t<decltype(field)>;
    const char* type = k.flags & kPath                    ? "path"
                       : std::is_same_v<T, std::string> ? "string"
                       : std::is_same_v<T, bool>        ? "bool"
                       : std::is_same_v<T, int64_t>     ? "integer"
                                                        : "number";
    const std::string meaning =
        std::string(k.meaning) + (k.flags & kFixed ? (markdown ? " (*fixed on resume*)" : " (fixed on resume)") : "");
    if (markdown) {
      if (current != k.section)
        s << "\n## [" << k.section << "]\n\n| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
      s << "| `" << k.dotted() << "` | " << type << " | `" << toml_text(field) << "` | " << meaning << " |\n";
    } else {
      std::snprintf(line, sizeof line, "  %-31s %-8s %-14s %s\n", k.dotted().c_str(), type, toml_text(field).c_str(),
                    meaning.c_str());
      s << line;
    }
    current = k.section;
  });
  return s.str();
}

std::vector<ConfigChange> config_changes(const std::string& saved_toml, const Config& c) {
  const toml::table t = parse_toml(saved_toml, "the checkpoint's saved config");
  Config saved;
  std::vector<std::string> before;
  visit(saved, [&](const Key& k, auto& field) {
    if (const toml::node* n = t.at_path(k.dotted()).node()) set_from_toml(*n, field, "the checkpoint's " + k.dotted());
    before.push_back(key_text(k, field));
  });
  std::vector<ConfigChange> changes;
  size_t i = 0;
  visit(c, [&](const Key& k, const auto& field) {
    const std::string after = key_text(k, field);
    if (after != before[i]) changes.push_back({k.dotted(), before[i], after, (k.flags & kFixed) != 0});
    ++i;
  });
  return changes;
}

std::map<std::string, std::string> input_identity(const Config& c, bool resume) {
  std::map<std::string, std::string> out;
  auto add = [&](const std::string& key, const fs::path& file, const fs::path& under) {
    const io::FileSum f = io::file_fingerprint(file.string());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(f.xxh3));
    out[key + ": " + file.lexically_relative(under).string()] = std::to_string(f.bytes) + " bytes, checksum " + hex;
  };
  for (const InputPath& in : input_paths(c)) {
    const bool model = in.key == "model.init" || in.key == "model.config";
    if (resume && !in.key.starts_with("data.") && !in.key.starts_with("validation.") && !model) continue;
    if (!fs::is_directory(in.path)) {
      add(in.key, in.path, fs::path(in.path).parent_path());
      continue;
    }
    if (resume && model) {
      for (const char* name : {"config.json", "tokenizer.json"})
        if (fs::exists(fs::path(in.path) / name)) add(in.key, fs::path(in.path) / name, in.path);
      continue;
    }
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(in.path))
      if (e.is_regular_file()) add(in.key, e.path(), in.path);
  }
  return out;
}

void check_inputs_exist(const Config& c) {
  for (const InputPath& in : input_paths(c)) {
    MT_CHECK(fs::exists(in.path)) << in.key << " = " << toml_text(in.value) << ": " << in.path
                                  << " does not exist (a relative path is taken against the config file's folder, "
                                     "or on the command line against the working folder)";
    const std::string section = in.key.substr(0, in.key.find('.'));
    MT_CHECK(!in.key.ends_with(".tokens") || !fs::is_directory(in.path))
        << in.key << " = " << toml_text(in.value) << " is a folder, where a .npy [B, T] token matrix was expected (a "
        << "folder of tokenized .bin files is " << section << ".corpus)";
    MT_CHECK(!(in.key.ends_with(".corpus") || in.key == "data.mixture") || fs::is_directory(in.path))
        << in.key << " = " << toml_text(in.value) << " is not a folder (expected moetrain tokenize's output folder; "
        << "a .npy token matrix is " << section << ".tokens)";
  }
}

std::string model_config_path(const Config& c) {
  if (!c.model.config.empty()) return c.model.config;
  MT_CHECK(c.model.init.starts_with("hf:"))
      << "model.config is not set: model.init = random needs the architecture as a Hugging Face config.json "
         "(--model.config=PATH), or start from a model folder with --model.init=hf:DIR";
  return (fs::path(c.model.init.substr(3)) / "config.json").string();
}

double lr_at(const Config& c, int64_t step) {
  const SchedulerConfig& s = c.lr_scheduler;
  double lr = c.optimizer.lr, floor = lr * s.min_lr_ratio;
  if (step < s.warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  int64_t total = c.training.steps;
  if (s.decay == "constant") return lr;
  if (s.decay == "wsd") {
    // Warmup, a stable plateau, then linear decay over the last decay_ratio of steps.
    int64_t decay_steps = std::max<int64_t>(1, static_cast<int64_t>(std::llround(s.decay_ratio * total)));
    int64_t start = std::max(s.warmup_steps, total - decay_steps);
    if (step < start) return lr;
    double p = static_cast<double>(step - start + 1) / static_cast<double>(total - start);
    return lr + (floor - lr) * std::min(1.0, p);
  }
  int64_t span = total - s.warmup_steps;
  double p = span <= 1 ? 1.0 : static_cast<double>(step - s.warmup_steps) / static_cast<double>(span - 1);
  p = std::min(1.0, std::max(0.0, p));
  if (s.decay == "linear") return lr + (floor - lr) * p;
  return floor + (lr - floor) * 0.5 * (1.0 + std::cos(3.141592653589793 * p));  // cosine
}

}  // namespace mt
