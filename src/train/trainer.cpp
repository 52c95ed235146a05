#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include <unistd.h>

#include "core/check.h"
#include "core/rng.h"
#include "io/file.h"
#include "io/npy.h"
#include "io/safetensors.h"
#include "kernels/elementwise.h"
#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/device.h"
#include "kernels/cuda/runtime.h"
#endif
#include "models/expert_replicas.h"
#include "models/hf_config.h"
#include "parallel/context_parallel.h"
#include "train/balance.h"
#include "train/checkpoint.h"

namespace mt {

void init_random(Model& m, double init_std, uint64_t seed) {
  std::vector<float> host;
  for (const HfTensor& t : m.hf_tensors()) {
    host.resize(static_cast<size_t>(t.value.numel()));
    if (t.init_scale == 0.0f)
      std::fill(host.begin(), host.end(), t.fill);
    else
      fill_normal(host.data(), t.value.numel(), seed, stream_of(t.name), 0.0f,
                  static_cast<float>(init_std) * t.init_scale);
    copy(t.value, Tensor(host.data(), t.value.shape, DType::f32));
  }
  refresh_compute_weights(m.params());
}

size_t load_hf(Model& m, const std::string& folder) {
  io::HfWeights w(folder);
  // GPT-OSS's release keeps its experts in MXFP4 (io::dequantize_mxfp4).
  const std::string config = folder + "/config.json";
  bool mxfp4 = false;
  int64_t mtp = 0;  // DeepSeek-V3's multi-token prediction layers, after the model's
  HfLayout layout;  // where the folder keeps the model's keys (a multimodal release)
  if (std::filesystem::exists(config)) {
    std::vector<uint8_t> b = io::read_file(config);
    nlohmann::json j = nlohmann::json::parse(b.begin(), b.end(), nullptr, false);
    const HfConfig hf(j, config);
    mxfp4 = hf.text({"quantization_config.quant_method"}, "") == "mxfp4";
    mtp = hf.integer({"num_nextn_predict_layers"}, 0);
    if (j.is_object()) layout = hf_layout(j);
  }
  auto past_the_layers = [&](const std::string& name) {
    const std::string layers = "model.layers.";
    return name.starts_with(layers) && std::atoll(name.c_str() + layers.size()) >= m.num_layers();
  };
  // DeepSeek-V3's releases keep a copy of the embedding and the head with each depth
  // (model.layers.{L + k - 1}.embed_tokens, shared_head.head); moetrain's depths share
  // the model's, as DeepSeek-V3 trains them: a copy is read, and must equal them.
  auto copy_equal = [&](const std::string& name) {
    if (m.mtp_depths() == 0 || !past_the_layers(name)) return false;
    const bool embed = name.ends_with(".embed_tokens.weight"), head = name.ends_with(".shared_head.head.weight");
    if (!embed && !head) return false;
    const std::string own = embed || !w.contains("lm_head.weight") ? "model.embed_tokens.weight" : "lm_head.weight";
    const std::span<const uint8_t> a = w.bytes(name), b = w.bytes(own);
    const bool same = w.tensor(name).dtype == w.tensor(own).dtype && w.shape(name) == w.shape(own) &&
                      std::equal(a.begin(), a.end(), b.begin(), b.end());
    MT_CHECK(same) << folder << ": " << name << " differs from " << own << ", which moetrain's multi-token "
                     << "prediction shares (as DeepSeek-V3 trains it); a folder whose depths have their own is not "
                     << "supported";
    return true;
  };
  std::set<std::string> used;  // the keys the model reads
  size_t aside = 0;
  std::vector<float> host;
  std::vector<HfTensor> tensors = m.hf_tensors(), buffers = m.hf_buffers();
  tensors.insert(tensors.end(), buffers.begin(), buffers.end());
  for (const HfTensor& t : tensors) {
    std::vector<int64_t> shape = hf_shape(t, m.num_experts());
    host.resize(static_cast<size_t>(t.value.numel()));
    const std::string key = layout.folder_key(t.fused.empty() ? t.name : t.fused);
    if (t.fused.empty())
      w.read_f32(key, shape, host.data());
    else  // only this expert's slice: an ep rank reads its own
      w.read_slice_f32(key, shape, t.fused_index, t.transposed, mxfp4, host.data());
    copy(t.value, Tensor(host.data(), t.value.shape, DType::f32));
    used.insert(key);
  }
  refresh_compute_weights(m.params());
  // A key the model does not use is as suspicious as a missing one.
  for (const std::string& folder_name : w.names()) {
    if (layout.aside(folder_name)) {  // a tower no run here trains (the banner counts them)
      ++aside;
      continue;
    }
    const std::string name = folder_name.starts_with(layout.prefix) ? "model." + folder_name.substr(layout.prefix.size())
                                                                    : folder_name;
    const bool quantized = mxfp4 && (name.ends_with("_blocks") || name.ends_with("_scales"));
    const bool ok = used.contains(folder_name) ||
                    (quantized && used.contains(folder_name.substr(0, folder_name.size() - 7))) ||
                    m.held_by_another_rank(name);
      MT_CHECK(ok || copy_equal(name) || mtp == 0 || !past_the_layers(name))
        << folder << ": tensor " << name << " belongs to a multi-token prediction layer (num_nextn_predict_layers "
        << mtp << "), which this run does not build (training.mtp_loss_weight = 0); set it above 0 to train them, "
        << "or import a copy of the folder without those layers' keys";
    MT_CHECK(ok || copy_equal(name)) << folder << ": tensor " << name << " is not a parameter of this model (config mismatch?)";
  }
  return aside;
}

ModelOptions model_options(const Config& cfg) {
  const TrainingConfig& t = cfg.training;
  ModelOptions o;
  o.device = t.device == "cuda" ? Device::cuda : Device::cpu;
  o.force_balanced_routing = t.force_balanced_routing;
  o.sequence_balance = t.load_balance_type == "sequence";
  o.capacity_factor = t.capacity_factor;
  o.fp8 = t.fp8 == "blockwise" ? Fp8::blockwise : Fp8::none;
  o.fp8_pow2 = t.fp8_scale == "pow2";
  o.recompute = t.activation_checkpoint == "full"        ? Recompute::full
                : t.activation_checkpoint == "selective" ? Recompute::selective
                                                         : Recompute::none;
  o.offload_experts = cfg.offload.experts != "none";
  o.offload_layers = cfg.offload.layers;
  o.offload_weights = cfg.offload.experts == "weights";
  o.expert_slots = cfg.offload.gpu_expert_slots;
  o.expert_replicas = cfg.parallelism.expert_replicas;
  // DeepSeek-V3's depths: trained where they have a weight, and with weights from a
  // folder, where it has theirs (a transformers-saved V3 has none: it trains without).
  o.mtp = t.mtp_loss_weight > 0 && (!cfg.model.init.starts_with("hf:") || has_mtp_weights(cfg.model.init.substr(3)));
  o.mtp_loss_weight = t.mtp_loss_weight;
  return o;
}

StepShape step_shape(const Config& cfg, const comm::MeshShape& mesh) {
  StepShape s;
  s.seq = cfg.data.seq_len;
  s.global_batch = cfg.training.global_batch_size;
  if (!cfg.data.tokens.empty()) {
    io::MappedFile file(cfg.data.tokens, "data.tokens");
    const io::NpyHeader h = io::parse_npy_header(file.bytes().data(), file.bytes().size(), cfg.data.tokens);
    MT_CHECK(h.shape.size() == 2 && h.shape[1] >= 2)
        << "data.tokens " << cfg.data.tokens << ": a token matrix [B, T] with T >= 2 was expected, the shape has "
        << h.shape.size() << " dims";
    MT_CHECK(s.seq == 0 || s.seq == h.shape[1] - 1) << "data.seq_len = " << s.seq << " but the token matrix gives "
                                                    << h.shape[1] - 1 << " (its width minus one)";
    MT_CHECK(s.global_batch == 0 || s.global_batch == h.shape[0])
        << "training.global_batch_size = " << s.global_batch << " but data.tokens has " << h.shape[0]
        << " rows, and the token matrix is the whole global batch";
    s.seq = h.shape[1] - 1;
    s.global_batch = h.shape[0];
  }
  MT_CHECK(s.seq > 0) << "data.seq_len must be set (> 0), or data.tokens given to take it from";
  MT_CHECK(s.global_batch > 0) << "training.global_batch_size must be set (> 0), or data.tokens given to take it from";
  const int64_t data_ranks = static_cast<int64_t>(mesh.dp) * mesh.ep;  // the ranks that split the batch
  MT_CHECK(s.global_batch % data_ranks == 0) << "training.global_batch_size " << s.global_batch
                                             << " does not split over dp x ep = " << data_ranks << " data ranks";
  const int64_t per_rank = s.global_batch / data_ranks;
  s.micro_batch = cfg.training.micro_batch_size ? cfg.training.micro_batch_size : per_rank;
  MT_CHECK(per_rank % s.micro_batch == 0)
      << "training.micro_batch_size = " << s.micro_batch << " does not divide the "
      << (data_ranks == 1 ? "global batch of " + std::to_string(per_rank)
                          : std::to_string(per_rank) + " sequences of each of the " + std::to_string(data_ranks) +
                                " data ranks");
  s.micro_batches = static_cast<int>(per_rank / s.micro_batch);
  return s;
}

ScheduleShape schedule_shape(const Config& cfg, int64_t layers, int micro_batches, bool zero3, bool sharded) {
  const TrainingConfig& t = cfg.training;
  return {.layers = layers,
          .micro_batches = micro_batches,
          .global_balance = t.load_balance_type == "global_batch",
          .zero3 = zero3,
          .reduce = sharded,
          .defer_weights = t.activation_checkpoint != "full",
          .sweep = static_cast<int>(t.layer_sweep == 0 ? micro_batches
                                                       : std::min<int64_t>(t.layer_sweep, micro_batches))};
}

MemoryPlan plan_memory(const Config& cfg, int world, int pp_rank, double skew) {
  const comm::MeshShape mesh = comm::mesh_shape(world, static_cast<int>(cfg.parallelism.pp),
                                                static_cast<int>(cfg.parallelism.cp), static_cast<int>(cfg.parallelism.ep));
  MemoryPlan m;
  m.step = step_shape(cfg, mesh);
  const std::string config_json = model_config_path(cfg);
  ModelOptions options = model_options(cfg);
  options.plan_only = true;
  const int64_t L = make_model(config_json, options)->num_layers();
  const Pipeline pipeline = Trainer::pipeline_of(cfg, L);
  // As `train` builds it: with ZeRO-3 on more than one rank the layers' weights are shards;
  // more than one rank shards the moments and the summed gradients (train/optimizer.h).
  m.zero3 = cfg.parallelism.zero3 && world > 1;
  m.replicas = mesh.dp * mesh.cp * mesh.ep;
  m.sharded = m.replicas > 1;
  options.external_layers = m.zero3;
  // With ep > 1 the model is built as rank 0 of the ep group builds it: its share of the
  // experts.
  comm::Communicator ep = comm::Communicator::describing("ep (plan)", 0, mesh.ep);
  if (mesh.ep > 1) options.ep = &ep;
  if (mesh.pp > 1) {
    options.layers = pipeline.layers_of(pp_rank);
    options.embedding = pipeline.owner(-1) == pp_rank;
    options.head = pipeline.owner(L) == pp_rank;
  }
  m.embedding = options.embedding;
  m.head = options.head;
  m.layers = mesh.pp > 1 ? options.layers.size() : static_cast<size_t>(L);
  const ScheduleShape shape = schedule_shape(cfg, L, m.step.micro_batches, m.zero3, m.sharded);
  const std::vector<Action> actions = make_schedule(shape, pipeline, pp_rank);
  std::unique_ptr<Model> model = make_model(config_json, options);
  const auto in_layer = [&](const Param& p) { return p.layer >= 0 && p.layer < L; };
  for (const Param& p : model->params()) {
    if (m.zero3 && in_layer(p)) continue;  // in the shards and the slot below
    (p.offloaded ? m.host : m.weights) += p.value.nbytes();
    (p.cached ? m.host : m.gradients) += p.grad.nbytes();
    if (p.compute.dtype != p.value.dtype) (p.cached ? m.host : m.compute) += p.compute.nbytes();
    m.compute += p.fp8.bytes();
    // offload.experts = weights: the norm and the update read the gradients there, and
    // the update writes the compute copies.
    if (p.cached)
      m.offload_traffic += 2 * p.grad.nbytes() + (p.compute.dtype != p.value.dtype ? p.compute.nbytes() : 0);
  }
  if (const Param* c = model->embedding_copy()) {  // multi-token prediction's under 1F1B
    m.weights += c->value.nbytes();
    m.gradients += c->grad.nbytes();
  }
  // The expert cache (models/expert_cache.h): its frames, and its moves a step.
  m.expert_cache = model->expert_cache_bytes();
  m.expert_replicas = model->expert_replica_bytes();
  const ExpertCacheStats cache = model->expert_cache_traffic(m.step.micro_batches, shape.sweep);
  m.cache_in = static_cast<size_t>(cache.bytes_in);
  m.cache_out = static_cast<size_t>(cache.bytes_out);
  const parallel::ShardLayout layout(model->params(), m.replicas, mesh.ep > 1 ? mesh.dp * mesh.cp : m.replicas,
                                     m.zero3 ? L : 0);
  const DType state = cfg.optimizer.state();
  m.optimizer = m.sharded ? Optimizer::sharded_bytes(layout, state) : Optimizer::moment_bytes(model->params(), state, false);
  m.optimizer += Optimizer::staging_bytes(model->params(), state, cfg.offload.staging_mib);
  // Offloaded blocks: their moments (or shards of them) on the host too, and the
  // update's traffic out, the larger way: this rank's weights and moments, and with a
  // group over dp x cp the gathered weights (train/offload.h).
  m.host += m.sharded ? Optimizer::sharded_host_bytes(layout, state) : Optimizer::moment_bytes(model->params(), state, true);
  for (const parallel::ShardUnit& u : layout.units())
    if (u.offloaded)
      m.offload_traffic += static_cast<size_t>(u.group_size == 1 ? u.length : u.shard) * (4 + 2 * dtype_size(state)) +
                           (u.group_size > 1 ? static_cast<size_t>(u.length) * 4 : 0);
  m.slot = m.zero3 ? parallel::Zero3::slot_bytes(model->params(), layout, options.device) : 0;
  // The micro-batches whose activations the schedule keeps at once on this rank: bare
  // stashes for each one in flight, and each chunk's layer blocks for those working there.
  const int64_t batch = m.step.micro_batch, seq = m.step.seq / mesh.cp;
  int live = 0;
  stash_slots(actions, shape.micro_batches, &live);
  m.activations = model->make_bare_stash(batch, seq)->bytes * static_cast<size_t>(live);
  m.in_flight = std::to_string(live);
  const char* separator = "; of its chunks' layers ";
  for (const ChunkBlocks& c : chunk_blocks(actions, shape.micro_batches, pipeline, pp_rank, L, cfg.training.activation_checkpoint == "full")) {
    m.activations += model->make_block(batch, seq, c.first, c.last)->bytes * static_cast<size_t>(c.count);
    m.in_flight += separator + std::to_string(c.count);
    separator = ", ";
  }
  // The expert rows, played through the rank's schedule: under balanced routing, and with
  // the hottest rank getting `skew` times its share of every layer.
  auto rows_at = [&](double s) {
    ModelOptions with = options;
    with.routing_skew = s;
    std::unique_ptr<Model> counted = make_model(config_json, with);
    return row_peak(actions, *counted, shape.micro_batches, batch, seq);
  };
  m.rows = rows_at(1.0);
  m.rows_skewed = rows_at(skew);
  return m;
}

TokenBatch read_token_batch(const std::string& npy_path, int64_t vocab_size) {
  MT_CHECK(!std::filesystem::is_directory(npy_path))
      << npy_path << " is a folder, where a .npy [B, T] token matrix was expected (a folder of tokenized .bin files "
      << "is data.corpus, for train)";
  io::NpyArray a = io::read_npy(npy_path);
  MT_CHECK(a.header.shape.size() == 2 && a.header.shape[1] >= 2)
      << npy_path << ": expected a [B, T] token matrix with T >= 2, got " << a.header.shape.size() << " dims";
  std::vector<int64_t> all = io::npy_as_int64(a, npy_path);
  TokenBatch b;
  b.rows = a.header.shape[0];
  b.seq = a.header.shape[1] - 1;
  b.ids.resize(static_cast<size_t>(b.rows * b.seq));
  b.labels.resize(b.ids.size());
  for (int64_t r = 0; r < b.rows; ++r)
    for (int64_t t = 0; t <= b.seq; ++t) {
      int64_t v = all[static_cast<size_t>(r * (b.seq + 1) + t)];
      MT_CHECK(v >= 0 && v < vocab_size) << npy_path << ": token " << v << " at row " << r << ", column " << t
                                         << " is outside the vocabulary [0, " << vocab_size << ")";
      if (t < b.seq) b.ids[r * b.seq + t] = static_cast<int32_t>(v);
      if (t > 0) b.labels[r * b.seq + t - 1] = static_cast<int32_t>(v);
    }
  return b;
}

Trainer::Trainer(Config cfg, Model& model, TokenBatch data)
    : cfg_(std::move(cfg)),
      model_(model),
      data_(std::move(data)),
      optimizer_(model.params(), cfg_.optimizer.state(), cfg_.offload.staging_mib),
      profile_(model.device(), cfg_.metrics.profile) {
  global_batch_ = cfg_.training.global_batch_size ? cfg_.training.global_batch_size : data_.rows;
  MT_CHECK(global_batch_ == data_.rows) << "training.global_batch_size = " << global_batch_ << " but data.tokens has "
                                        << data_.rows << " rows, and the token matrix is the whole global batch";
  MT_CHECK(cfg_.data.seq_len == 0 || cfg_.data.seq_len == data_.seq)
      << "data.seq_len = " << cfg_.data.seq_len << " but the token matrix gives " << data_.seq
      << " (its width minus one)";
  seq_ = data_.seq;
  setup();
}

Trainer::Trainer(Config cfg, Model& model, std::unique_ptr<data::Dataset> corpus)
    : cfg_(std::move(cfg)),
      model_(model),
      corpus_(std::move(corpus)),
      optimizer_(model.params(), cfg_.optimizer.state(), cfg_.offload.staging_mib),
      profile_(model.device(), cfg_.metrics.profile) {
  global_batch_ = cfg_.training.global_batch_size;
  MT_CHECK(global_batch_ > 0) << "training.global_batch_size must be set (> 0) to train on data.corpus";
  seq_ = corpus_->seq_len();
  setup();
}

void Trainer::setup() {
  const TrainingConfig& t = cfg_.training;
  if (cfg_.optimizer.name == "muon") optimizer_.use_muon(muon_matrices(model_));
  const Device want = t.device == "cuda" ? Device::cuda : Device::cpu;
  MT_CHECK(model_.device() == want) << "training.device = " << t.device << " but the model was built for the "
                                    << (model_.device() == Device::cuda ? "cuda" : "cpu") << " device";
  MT_CHECK(t.force_balanced_routing == model_.balanced_routing())
      << "training.force_balanced_routing must match the model's option";
  rank_rows_ = global_batch_;
  micro_batch_ = t.micro_batch_size ? t.micro_batch_size : rank_rows_;
  MT_CHECK(rank_rows_ % micro_batch_ == 0) << "training.micro_batch_size = " << micro_batch_
                                           << " does not divide the global batch of " << global_batch_;
  micro_batches_ = rank_rows_ / micro_batch_;
  pipeline_ = pipeline_of(cfg_, model_.num_layers());
  MT_CHECK(t.router_z_loss_coef == 0 || !model_.sigmoid_routing())
      << "training.router_z_loss_coef = " << t.router_z_loss_coef << ": DeepSeek-V3's sigmoid routing has no "
      << "z-loss (its scores are no softmax); set it to 0";
  // A sweep runs each micro-batch's head backward, and with it the depths' layers', before
  // the global-batch balance term is known (schedule.h).
  MT_CHECK(model_.mtp_depths() == 0 || t.load_balance_type != "global_batch" || t.layer_sweep == 1)
      << "training.layer_sweep = " << t.layer_sweep << " with load_balance_type = global_batch and multi-token "
      << "prediction is not built (the depths' layers run their backward before the global term is known); "
      << "set training.layer_sweep = 1";
}

Pipeline Trainer::pipeline_of(const Config& cfg, int64_t layers) {
  return make_pipeline(layers, static_cast<int>(cfg.parallelism.pp), cfg.parallelism.pipeline_schedule);
}

void Trainer::make_stashes() {
  // The schedule says how many micro-batches are alive at once (with the global-batch
  // load-balance loss, all of them). Made at the first step, once the mesh is known: a
  // stash for the whole batch, dropped when set_parallel splits it, would leave the GPU
  // pool holding its memory in pieces.
  ScheduleShape shape =
      schedule_shape(cfg_, model_.num_layers(), static_cast<int>(micro_batches_), zero3_ != nullptr, dp_ != nullptr);
  shape.mtp = model_.mtp_depths() > 0;
  actions_ = make_schedule(shape, pipeline_, pp_rank_);
  int live = 0;
  slot_ = stash_slots(actions_, shape.micro_batches, &live);
  for (int i = 0; i < live; ++i) stashes_.push_back(model_.make_bare_stash(micro_batch_, local_seq()));
  // Each of this rank's chunks lends its layers' activations to a micro-batch only for
  // the span it works there (DualPipeV keeps chunk 0's longer than chunk 1's).
  for (const ChunkBlocks& c : chunk_blocks(actions_, shape.micro_batches, pipeline_, pp_rank_, shape.layers,
                                               cfg_.training.activation_checkpoint == "full")) {
    const size_t base = blocks_.size();
    for (int i = 0; i < c.count; ++i) blocks_.push_back(model_.make_block(micro_batch_, local_seq(), c.first, c.last));
    block_of_.emplace_back();
    for (int m : c.slot) block_of_.back().push_back(blocks_[base + static_cast<size_t>(m)].get());
  }
}

void Trainer::set_parallel(comm::DeviceMesh& mesh) {
  comm::Communicator *all = &mesh.dp_cp_ep(), *expert_all = &mesh.dp_cp(), *ep = &mesh.ep(), *cp = &mesh.cp();
  data_rank_ = mesh.coord().dp * mesh.shape().ep + mesh.coord().ep;
  data_ranks_ = static_cast<int64_t>(mesh.shape().dp) * mesh.shape().ep;
  if (mesh.world().size() > 1) world_ = &mesh.world();
  if (mesh.shape().pp > 1) {
    pp_ = &mesh.pp();
    pp_rank_ = mesh.coord().pp;
    // Created here, where every rank is, rather than at a stage's first message.
    if (model_.device() == Device::cuda) pp_->init_gpu();
  }
  if (ep->size() > 1) ep_ = ep;
  if (cp->size() > 1) {
    cp_ = cp;
    MT_CHECK(seq_ % (2 * cp->size()) == 0) << "sequences of " << seq_ << " positions do not split into 2 * cp = "
                                           << 2 * cp->size() << " equal chunks";
  }
  MT_CHECK(stashes_.empty()) << "Trainer::set_parallel must come before the first step";
  const bool zero3 = cfg_.parallelism.zero3 && all->size() > 1;
  for (const Param& p : model_.params())
    MT_CHECK(zero3 || !in_layer(p) || p.value.data != nullptr)
        << p.name << " has no storage (a model built with external_layers) but ZeRO-3 is not on: "
        << "parallelism.zero3 needs more than one rank";
  if (all->size() == 1) return;
  const int expert_replicas = (ep_ ? expert_all : all)->size();
  MT_CHECK(cfg_.offload.experts != "weights" || expert_replicas == 1)
      << "offload.experts = weights with the experts' state shared by " << expert_replicas
      << " ranks (dp x cp = " << expert_replicas
      << ") is not built yet: their gradients live in host memory, where the collectives do not reduce them. "
         "offload.experts = optimizer takes this mesh; weights takes ep and pp meshes";
  dp_ = all;
  // AdamW's moments and the summed gradients live as shards: dense blocks over every
  // rank, experts over the ranks holding the same experts (this rank alone when
  // dp x cp = 1: no gradient shard then, AdamW reads their gradients); with ZeRO-3
  // the layers' weights too.
  optimizer_.shard(all, ep_ ? expert_all : all, zero3 ? model_.num_layers() : 0);
  if (zero3)
    zero3_ = std::make_unique<parallel::Zero3>(model_.params(), optimizer_.layout(), optimizer_.weight_shards(),
                                               optimizer_.grad_shards(), model_.device());
  MT_CHECK(global_batch_ % data_ranks_ == 0) << "training.global_batch_size " << global_batch_
                                             << " does not split over " << data_ranks_ << " data ranks (dp x ep)";
  rank_rows_ = global_batch_ / data_ranks_;
  micro_batch_ = cfg_.training.micro_batch_size ? cfg_.training.micro_batch_size : rank_rows_;
  MT_CHECK(rank_rows_ % micro_batch_ == 0) << "training.micro_batch_size " << micro_batch_ << " does not divide the "
                                           << rank_rows_ << " sequences of each of " << data_ranks_
                                           << " data ranks (dp x ep)";
  micro_batches_ = rank_rows_ / micro_batch_;
}

void Trainer::load_micro_batch(Stash& s, int64_t index, const TokenBatch& tokens, data::Dataset* corpus) {
  size_t n = static_cast<size_t>(s.batch * s.seq);
  const int32_t *ids, *labels, *ahead = nullptr;  // ahead: [D, n], multi-token prediction's
  const size_t D = static_cast<size_t>(s.mtp_ids.numel()) / std::max<size_t>(n, 1);
  if (corpus && corpus == corpus_.get()) {
    MT_CHECK(step_loaded_ < micro_batches_ && n * static_cast<size_t>(micro_batches_) == step_ids_.size());
    ids = step_ids_.data() + n * static_cast<size_t>(step_loaded_);
    ahead = D > 0 ? step_ahead_.data() + D * n * static_cast<size_t>(step_loaded_) : nullptr;
    labels = step_labels_.data() + n * static_cast<size_t>(step_loaded_++);
  } else if (corpus) {  // validation: the main head's loss only
    host_ids_.resize(n);
    host_labels_.resize(n);
    corpus->next_batch(static_cast<int>(data_rank_), static_cast<int>(data_ranks_), cp_ ? cp_->rank() : 0,
                        cp_ ? cp_->size() : 1, s.batch, host_ids_, host_labels_);
    ids = host_ids_.data();
    labels = host_labels_.data();
  } else {
    const int64_t row =
        index / micro_batches_ * global_batch_ + data_rank_ * rank_rows_ + index % micro_batches_ * micro_batch_;
    ids = tokens.ids.data() + row * seq_;
    labels = tokens.labels.data() + row * seq_;
    // This rank's zigzag columns of each sequence, and the tokens ahead from the whole ones.
    const int64_t c = static_cast<int64_t>(n) / s.batch;
    std::vector<int64_t> pos = cp_ ? parallel::zigzag_positions(seq_, cp_->rank(), cp_->size()) : std::vector<int64_t>();
    for (int64_t t = 0; !cp_ && t < seq_; ++t) pos.push_back(t);
    host_ahead_.resize(D * n);
    data::labels_ahead(labels, s.batch, seq_, pos, host_ahead_);
    ahead = host_ahead_.data();
    if (cp_) {
      host_ids_.resize(n);
      host_labels_.resize(n);
      for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t j = 0; j < c; ++j) {
          host_ids_[b * c + j] = ids[b * seq_ + pos[j]];
          host_labels_[b * c + j] = labels[b * seq_ + pos[j]];
        }
      ids = host_ids_.data();
      labels = host_labels_.data();
    }
  }
  copy(s.ids, Tensor(const_cast<int32_t*>(ids), s.ids.shape, DType::i32));
  copy(s.labels, Tensor(const_cast<int32_t*>(labels), s.labels.shape, DType::i32));
  if (D == 0 || ahead == nullptr) return;
  host_mtp_.resize(2 * D * n);
  data::mtp_tokens({labels, n}, {ahead, D * n}, host_mtp_);
  copy(s.mtp_ids, Tensor(host_mtp_.data(), s.mtp_ids.shape, DType::i32));
  copy(s.mtp_labels, Tensor(host_mtp_.data() + D * n, s.mtp_labels.shape, DType::i32));
}

void Trainer::read_step_tokens() {
  const data::DataCursor before = corpus_->cursor();
  const int cp = cp_ ? cp_->size() : 1;
  const size_t n = static_cast<size_t>(micro_batch_ * (seq_ / cp));
  step_ids_.resize(n * static_cast<size_t>(micro_batches_));
  step_labels_.resize(step_ids_.size());
  const size_t D = static_cast<size_t>(model_.mtp_depths());
  step_ahead_.resize(D * step_ids_.size());
  step_loaded_ = 0;
  try {
    read_on_every_rank(
        world_,
        [&] {
          for (int64_t m = 0; m < micro_batches_; ++m)
            corpus_->next_batch(static_cast<int>(data_rank_), static_cast<int>(data_ranks_), cp_ ? cp_->rank() : 0, cp,
                                micro_batch_, std::span(step_ids_).subspan(n * static_cast<size_t>(m), n),
                                std::span(step_labels_).subspan(n * static_cast<size_t>(m), n),
                                std::span(step_ahead_).subspan(D * n * static_cast<size_t>(m), D * n));
        },
        "another rank could not read its tokens of step " + std::to_string(step_ + 1) + " (it names the file)");
  } catch (const StepNotTaken&) {
    corpus_->set_cursor(before);
    throw;
  }
}

void read_on_every_rank(comm::Communicator* world, const std::function<void()>& read, const std::string& elsewhere) {
  std::string failed;
  try {
    read();
  } catch (const Error& e) {
    failed = e.message;
  }
  std::vector<int64_t> bad = {failed.empty() ? 0 : 1};
  if (world && world->size() > 1) world->all_reduce(Tensor(bad.data(), {1}, DType::i64));
  if (bad[0] != 0) throw StepNotTaken(failed.empty() ? elsewhere : failed, "");
}

std::string Trainer::data_cursor() const {
  if (!corpus_) return "null";
  nlohmann::json j;
  j["samples_seen"] = corpus_->cursor().samples_seen;
  if (corpus_->corpora() > 1) j["drawn"] = corpus_->cursor().drawn;
  return j.dump();
}

void Trainer::set_data_cursor(const std::string& json) {
  if (!corpus_) return;
  nlohmann::json j = nlohmann::json::parse(json, nullptr, false);
  const bool drawn = j.is_object() && j.contains("drawn") && j["drawn"].is_array();
  MT_CHECK(j.is_object() && j.contains("samples_seen") && j["samples_seen"].is_number_unsigned() &&
           (drawn || !j.contains("drawn")))
      << "the checkpoint's data cursor " << json << " is not {\"samples_seen\": N} (with a mixture, \"drawn\": "
      << "[each corpus's]); was it written by a run on data.tokens?";
  corpus_->set_cursor({j["samples_seen"].get<uint64_t>(), drawn ? j["drawn"].get<std::vector<uint64_t>>()
                                                                : std::vector<uint64_t>{}});
}

std::string Trainer::expert_placement() const {
  if (model_.expert_replicas() == nullptr || placements_.empty()) return "null";
  nlohmann::json j;
  j["ranks"] = placements_[0].ranks;
  j["replicas"] = placements_[0].replicas;
  j["version"] = placement_version_;
  j["decay"] = loads_.decay;
  j["loads"] = loads_.mean;
  for (const parallel::Placement& p : placements_) j["placements"].push_back({{"slots", p.slots}, {"share", p.share}});
  return j.dump();
}

void Trainer::set_expert_placement(const std::string& json, bool say) {
  ExpertReplicas* rep = model_.expert_replicas();
  if (rep == nullptr) return;  // a mesh without replicas: the checkpoint's experts are logical
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, false);
  const int64_t ranks = ep_->size(), R = cfg_.parallelism.expert_replicas, E = model_.num_experts();
  if (!j.is_object() || j.value("ranks", int64_t{0}) != ranks || j.value("replicas", int64_t{-1}) != R) {
    if (say)
      std::fprintf(stderr, "moetrain: note: the checkpoint has no expert placement for ep %lld with %lld replica slots "
                   "a rank; the replicas start empty and are placed from this run's loads\n",
                   static_cast<long long>(ranks), static_cast<long long>(R));
    return;
  }
  try {
    loads_.decay = j.at("decay").get<double>();
    loads_.mean = j.at("loads").get<std::vector<std::vector<double>>>();
    placement_version_ = j.at("version").get<int64_t>();
    placements_.clear();
    for (const nlohmann::json& l : j.at("placements")) {
      parallel::Placement p = parallel::owners_only(E, ranks, R);
      p.slots = l.at("slots").get<std::vector<std::vector<int32_t>>>();
      p.share = l.at("share").get<std::vector<std::vector<double>>>();
      placements_.push_back(std::move(p));
    }
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL() << "the checkpoint's expert_placement is damaged (" << e.what() << ")";
  }
  for (size_t l = 0; l < placements_.size(); ++l)
    for (int64_t r = 0; r < ranks; ++r) {
      const parallel::Placement& p = placements_[l];
      const bool fits = p.slots.size() == static_cast<size_t>(ranks) && p.share.size() == p.slots.size() &&
                        p.slots[static_cast<size_t>(r)].size() == static_cast<size_t>(p.slots_per_rank()) &&
                        p.share[static_cast<size_t>(r)].size() == p.slots[static_cast<size_t>(r)].size();
      MT_CHECK(fits) << "the checkpoint's expert_placement of MoE layer " << l << " does not have " << ranks
                     << " ranks of " << p.slots_per_rank() << " slots";
      for (int64_t s = 0; s < p.slots_per_rank(); ++s) {
        const int32_t e = p.slots[static_cast<size_t>(r)][static_cast<size_t>(s)];
        const bool own = s < E / ranks;
        MT_CHECK(own ? e == r * (E / ranks) + s : e >= -1 && e < E)
            << "the checkpoint's expert_placement of MoE layer " << l << " puts expert " << e << " in rank " << r
            << "'s slot " << s << " (expected " << (own ? "its own expert" : "an expert or -1") << ")";
      }
    }
  std::vector<int64_t> moe;
  for (int64_t l = 0; l < model_.all_layers(); ++l)
    if (model_.is_moe_layer(l)) moe.push_back(l);
  MT_CHECK(moe.size() == placements_.size()) << "the checkpoint's expert_placement has " << placements_.size()
                                              << " MoE layers; this model has " << moe.size();
  apply_placements(moe);
}

void Trainer::apply_placements(const std::vector<int64_t>& moe_layers) {
  ExpertReplicas& rep = *model_.expert_replicas();
  const std::vector<int64_t> held = rep.layers();
  for (size_t i = 0; i < moe_layers.size(); ++i)
    if (std::find(held.begin(), held.end(), moe_layers[i]) != held.end()) rep.set_placement(moe_layers[i], placements_[i]);
  rep.refresh();
}

void Trainer::materialize_weights() {
  if (zero3_) zero3_->materialize();
}

void Trainer::commit_weights() {
  if (zero3_) zero3_->commit();
}

void Trainer::release_weights() {
  if (zero3_) zero3_->release_all();
}

void Trainer::materialize_state() {
  optimizer_.materialize_moments();
  materialize_weights();
}

void Trainer::commit_state() {
  commit_weights();
  optimizer_.commit_moments();
}

void Trainer::release_state() {
  release_weights();
  optimizer_.release_moments();
}

// parallelism.expert_replicas (models/expert_replicas.h): every step the loads' average
// takes the step's counts, which are the same on every rank (summed over them all), so
// every rank plans the same placements for the whole model (parallel::replan: the
// copies' shares every step, a new placement every replan_interval steps where it
// pays). Then the owners' new weights go to the replicas.
void Trainer::place_replicas(StepResult& r) {
  const int64_t E = model_.num_experts(), ranks = ep_->size(), R = cfg_.parallelism.expert_replicas;
  if (placements_.empty()) placements_.assign(r.moe_layers.size(), parallel::owners_only(E, ranks, R));
  if (ranks_per_node_ < 0) {
    // The hierarchical plan's nodes: the ep ranks' hostnames (hashed), gathered once.
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    std::vector<int64_t> mine = {static_cast<int64_t>(std::hash<std::string>{}(host) >> 1)}, all(static_cast<size_t>(ranks));
    ep_->all_gather(Tensor(mine.data(), {1}, DType::i64), Tensor(all.data(), {ranks}, DType::i64));
    ranks_per_node_ = parallel::ranks_per_node(all);
  }
  loads_.add(r.expert_counts);
  bool moved = false;
  for (size_t i = 0; i < r.moe_layers.size(); ++i)
    moved |= parallel::replan(placements_[i], loads_.mean[i], r.step % cfg_.parallelism.replan_interval == 0,
                              ranks_per_node_);
  placement_version_ += moved;
  apply_placements(r.moe_layers);
  r.placement_version = placement_version_;
  for (const parallel::Placement& p : placements_) {
    std::vector<int64_t> copies(static_cast<size_t>(E), 0);
    for (const std::vector<int32_t>& slots : p.slots)
      for (int32_t e : slots)
        if (e >= 0) ++copies[static_cast<size_t>(e)];
    r.expert_copies.push_back(std::move(copies));
  }
}

// The step's story; each phase is a function below, the balance terms train/balance.h.
StepResult Trainer::step() {
  if (stashes_.empty()) make_stashes();
  model_.reset_row_memory();
  const auto start = std::chrono::steady_clock::now();
#ifdef MOETRAIN_WITH_CUDA
  const int64_t host_waits_at_start = model_.device() == Device::cuda ? cuda::host_waits() : 0;
#else
  const int64_t host_waits_at_start = 0;
#endif
  // The step's tokens first: a corpus that cannot be read stops every rank here, before
  // anything changed (StepNotTaken).
  if (corpus_) read_step_tokens();
  StepResult r;
  r.step = ++step_;
  StepBalance balance(cfg_.training, model_, global_batch_ * seq_, global_batch_, micro_batches_,
                      {cp_, world_, ep_, dp_ ? dp_->size() : 1});
  const double loss_sum = run_step_schedule(balance);  // forwards, backwards, the schedule's reductions
  finish_gradients(r, balance);                        // replicas' and the expert cache's
  reduce_step(r, balance, loss_sum);                   // loss, terms, norm over the ranks; non-finite?
  apply_step(r, balance);                              // the update, biases and placements
  measure_step(r, start, host_waits_at_start);         // time and memory
  return r;
}

double Trainer::run_step_schedule(StepBalance& balance) {
  ScheduleContext ctx;
  ctx.model = &model_;
  for (int mb = 0; mb < micro_batches_; ++mb) ctx.stashes.push_back(stashes_[static_cast<size_t>(slot_[mb])].get());
  // The trainer's own actions of the schedule.
  ctx.trainer = [&](const Action& a) {
    Stash& s = *ctx.stashes[static_cast<size_t>(a.micro_batch)];
    if (a.op == Op::load) load_micro_batch(s, a.micro_batch, data_, corpus_.get());
    else if (a.op == Op::statistics) balance.statistics(s);
    else if (a.op == Op::balance) balance.global(ctx.stashes);
  };
  ctx.loss_scale = static_cast<float>(1.0 / static_cast<double>(global_batch_ * seq_));
  ctx.zero3 = zero3_.get();
  ctx.optimizer = dp_ ? &optimizer_ : nullptr;
  ctx.profile = &profile_;
  ctx.pipeline = &pipeline_;
  ctx.pp = pp_;
  ctx.pp_rank = pp_rank_;
  ctx.blocks = block_of_;
  clear_gradient_marks(model_.params());  // the step's first write of each gradient replaces it
  run_schedule(actions_, ctx);
  mtp_losses_ = ctx.mtp_losses;
  double loss_sum = 0;
  for (const LossSum& l : ctx.losses) loss_sum += l.sum;
  return loss_sum;
}

// The replicas' gradients into their owners' before the norm (the layers that the
// schedule's reductions summed already are skipped); with offload.experts = weights the
// gradients the cache holds go back to host memory, where the norm and the update read
// them, and the experts' residency is counted.
void Trainer::finish_gradients(StepResult& r, const StepBalance& balance) {
  if (ExpertReplicas* replicas = model_.expert_replicas()) {
    profile_.mark("replica gradients");
    for (int64_t l : replicas->layers()) replicas->sum_gradients(l);
  }
  r.expert_cache = model_.flush_expert_cache();
  if (cfg_.offload.experts != "weights") return;
  // [MoE layer][expert] over the whole model: each expert lives on one rank (the tier
  // refuses experts shared by dp x cp ranks), its ep rank's slice of the experts.
  const std::vector<int64_t>& moe_index = balance.moe_index();
  const size_t E = static_cast<size_t>(model_.num_experts()), layers = balance.counts().size();
  std::vector<int64_t> uses(layers * E, 0), hits(uses.size(), 0);
  const ExpertCacheStats& c = r.expert_cache;
  for (size_t l = 0; l < c.expert_uses.size(); ++l) {
    if (moe_index[l] < 0) continue;
    const size_t local = c.expert_uses[l].size();
    const size_t at = static_cast<size_t>(moe_index[l]) * E + (ep_ ? static_cast<size_t>(ep_->rank()) * local : 0);
    std::copy_n(c.expert_uses[l].begin(), local, uses.begin() + at);
    std::copy_n(c.expert_hits[l].begin(), local, hits.begin() + at);
  }
  if (world_) {
    world_->all_reduce(Tensor(uses.data(), {static_cast<int64_t>(uses.size())}, DType::i64));
    world_->all_reduce(Tensor(hits.data(), {static_cast<int64_t>(hits.size())}, DType::i64));
  }
  r.expert_residency.assign(layers, std::vector<double>(E, -1.0));
  for (size_t i = 0; i < uses.size(); ++i)
    if (uses[i] > 0) r.expert_residency[i / E][i % E] = static_cast<double>(hits[i]) / static_cast<double>(uses[i]);
}

// The global gradient norm in double: each rank's shard of the gradients was summed
// over the ranks that share its blocks during the backward (the schedule's reductions);
// every element lives on one rank of its group, so the squares of all shards add up to
// the global norm over the whole mesh (experts of every ep rank and layers of every pp
// rank too). The loss, the norm and the balance terms are then the same numbers on every
// rank, so every rank skips the same non-finite steps.
void Trainer::reduce_step(StepResult& r, StepBalance& balance, double loss_sum) {
  profile_.mark("gradient norm");
  std::vector<double> sums = {loss_sum, optimizer_.grad_sum_squares()};
  // Multi-token prediction's per depth: only the head's ranks have them.
  const size_t depths = static_cast<size_t>(model_.mtp_depths());
  mtp_losses_.resize(cfg_.training.mtp_loss_weight > 0 ? depths : 0);
  for (const LossSum& l : mtp_losses_) sums.insert(sums.end(), {l.sum, static_cast<double>(l.count)});
  balance.reduce(sums);
  r.loss = sums[0] / static_cast<double>(global_batch_ * seq_);
  r.grad_norm = std::sqrt(sums[1]);
  r.mtp_loss.clear();
  for (size_t k = 0; k < mtp_losses_.size(); ++k) r.mtp_loss.push_back(sums[2 + 2 * k] / std::max(sums[3 + 2 * k], 1.0));
  balance.report(r);
  for (auto [name, v] : {std::pair{"loss", r.loss}, {"lb_loss", r.lb_loss}, {"grad_norm", r.grad_norm}})
    if (!std::isfinite(v) && r.non_finite.empty()) r.non_finite = name;
  for (double v : r.mtp_loss)
    if (!std::isfinite(v) && r.non_finite.empty()) r.non_finite = "mtp_loss";
}

// torch's clipping factor (a factor of exactly 1 changes nothing, so it is skipped),
// applied by the optimizer as it reads each gradient; the update unless the step is not
// finite; then the expert biases and the replicas' placements.
void Trainer::apply_step(StepResult& r, const StepBalance& balance) {
  const TrainingConfig& t = cfg_.training;
  const float clip =
      t.clip_grad_norm > 0 ? static_cast<float>(std::min(1.0, t.clip_grad_norm / (r.grad_norm + 1e-6))) : 1.0f;
  r.lr = lr_at(cfg_, r.step - 1);
  profile_.mark("optimizer");
  if (r.non_finite.empty()) optimizer_.step(cfg_.optimizer, r.lr, r.step, clip);  // compute copies included
  if (corpus_ && corpus_->corpora() > 1) r.data_shares = corpus_->shares();
  if (expert_bias_.empty() && model_.sigmoid_routing()) expert_bias_ = model_expert_bias();
  if (t.expert_bias_update_rate > 0 && r.non_finite.empty()) {
    update_expert_bias(expert_bias_, balance.counts(), t.expert_bias_update_rate);
    apply_expert_bias(model_, expert_bias_, [&](int64_t l) { return pipeline_.owner(l) == pp_rank_; });
  }
  if (t.expert_bias_update_rate > 0 || !model_.sigmoid_routing()) r.expert_bias = expert_bias_;
  if (model_.expert_replicas()) {
    profile_.mark("replica weights");
    place_replicas(r);
  }
  r.breakdown = profile_.finish();
}

// The step's time, and the memory it held: the optimizer's, the parameters' (values,
// gradients, compute copies, FP8 copies; in host memory where offloaded), the stashes'
// and blocks', the expert rows' peak; with the offload traffic.
void Trainer::measure_step(StepResult& r, std::chrono::steady_clock::time_point start,
                           [[maybe_unused]] int64_t host_waits_at_start) {
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.tokens = global_batch_ * seq_;
  r.tokens_per_s = static_cast<double>(r.tokens) / std::max(r.seconds, 1e-9);
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  r.time = static_cast<double>(std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count()) / 1e3;
  size_t bytes = optimizer_.bytes() + (zero3_ ? zero3_->bytes() : 0);
  r.host_memory_bytes = optimizer_.host_bytes();
  r.offload = optimizer_.traffic();
  // The weights tier's moves: the cache's, and the norm's and the update's reads of the
  // gradients and the update's writes of the compute copies, in host memory.
  r.offload.bytes_in += r.expert_cache.bytes_in;
  r.offload.bytes_out += r.expert_cache.bytes_out;
  bytes += model_.expert_cache_bytes() + model_.expert_replica_bytes();
  for (const Param& p : model_.params()) {
    if (zero3_ && in_layer(p)) continue;  // shards (optimizer) and the slot (zero3)
    const bool copy = p.compute.data != p.value.data;  // bf16 copies on the GPU
    (p.cached ? r.host_memory_bytes : bytes) += p.grad.nbytes() + (copy ? p.compute.nbytes() : 0);
    (p.offloaded ? r.host_memory_bytes : bytes) += p.value.nbytes();
    bytes += p.fp8.bytes();
    if (!p.cached) continue;
    r.offload.bytes_in += 2 * static_cast<int64_t>(p.grad.nbytes());
    r.offload.bytes_out += copy ? static_cast<int64_t>(p.compute.nbytes()) : 0;
  }
  for (const auto& s : stashes_) bytes += s->bytes;
  for (const auto& b : blocks_) bytes += b->bytes;
  // The expert rows this rank held at most; the metrics give the most of any rank.
  const RowMemory rows = model_.row_memory();
  r.memory_bytes = bytes + rows.peak;
  r.expert_row_bytes = static_cast<int64_t>(rows.peak);
  r.routing_skew = rows.skew;
  if (world_) {
    std::vector<double> each(2 * static_cast<size_t>(world_->size()), 0.0);
    each[2 * static_cast<size_t>(world_->rank())] = static_cast<double>(rows.peak);
    each[2 * static_cast<size_t>(world_->rank()) + 1] = rows.skew;
    comm::sum_in_rank_order(world_, each);
    for (size_t i = 0; i < each.size(); i += 2) {
      r.expert_row_bytes = std::max(r.expert_row_bytes, static_cast<int64_t>(each[i]));
      r.routing_skew = std::max(r.routing_skew, each[i + 1]);
    }
  }
#ifdef MOETRAIN_WITH_CUDA
  if (model_.device() == Device::cuda) {
    r.device_memory_bytes = cuda::memory_held();
    r.host_waits = cuda::host_waits() - host_waits_at_start;
  }
#endif
}

void Trainer::set_validation(TokenBatch tokens) {
  MT_CHECK(tokens.seq == seq_) << "validation.tokens holds sequences of " << tokens.seq << " positions (its width minus "
                               << "one) but training's are " << seq_ << ": the held-out set must have the same shape";
  val_tokens_ = std::move(tokens);
  validation_batches();
}

void Trainer::set_validation(std::unique_ptr<data::Dataset> corpus) {
  MT_CHECK(corpus->seq_len() == seq_) << "the validation corpus's samples are " << corpus->seq_len()
                                      << " tokens but training's sequences are " << seq_;
  val_corpus_ = std::move(corpus);
  validation_batches();
}

int64_t Trainer::validation_sequences() const {
  return val_corpus_ ? val_corpus_->num_samples() : val_tokens_.rows;
}

int64_t Trainer::validation_batches() const {
  const int64_t whole = validation_sequences() / global_batch_, want = cfg_.validation.steps;
  const std::string set = val_corpus_ ? (cfg_.validation.corpus.empty() ? "the held-out split of data.corpus"
                                                                        : "validation.corpus")
                                      : "validation.tokens";
  MT_CHECK(whole >= 1 && want <= whole)
      << set << " holds " << validation_sequences() << " sequences of " << seq_ << " tokens, "
      << (whole < 1 ? "fewer than one" : std::to_string(whole)) << " global batch(es) of " << global_batch_
      << (whole < 1 ? "" : ", fewer than validation.steps = " + std::to_string(want))
      << ": a validation reads whole global batches (training.global_batch_size)";
  return want > 0 ? want : whole;
}

Trainer::Validation Trainer::validate() {
  MT_CHECK(val_corpus_ || val_tokens_.rows > 0) << "Trainer::validate without a validation set";
  if (stashes_.empty()) make_stashes();
  const auto start = std::chrono::steady_clock::now();
  const ScheduleShape shape{.layers = model_.num_layers(),
                            .micro_batches = static_cast<int>(validation_batches() * micro_batches_),
                            .zero3 = zero3_ != nullptr};
  // One micro-batch at a time: the step's first stash and blocks serve them all.
  ScheduleContext ctx;
  ctx.model = &model_;
  ctx.stashes.assign(static_cast<size_t>(shape.micro_batches), stashes_[static_cast<size_t>(slot_[0])].get());
  for (const std::vector<ActivationBlock*>& chunk : block_of_)
    ctx.blocks.emplace_back(static_cast<size_t>(shape.micro_batches), chunk[0]);
  ctx.zero3 = zero3_.get();
  ctx.pipeline = &pipeline_;
  ctx.pp = pp_;
  ctx.pp_rank = pp_rank_;
  if (val_corpus_) {
    // A validation corpus cut short stops every rank here, before its forwards
    // (StepNotTaken: the step before it is done and may be saved).
    read_on_every_rank(world_, [&] { val_corpus_->check_whole(); },
                       "another rank cannot read its validation corpus (it names the file)");
    val_corpus_->rewind();
  }
  ctx.trainer = [&](const Action& a) {
    if (a.op == Op::load) load_micro_batch(*ctx.stashes[0], a.micro_batch, val_tokens_, val_corpus_.get());
  };
  run_schedule(forward_schedule(shape, pipeline_, pp_rank_), ctx);
  std::vector<double> sums = {0, 0};
  for (const LossSum& l : ctx.losses) {
    sums[0] += l.sum;
    sums[1] += static_cast<double>(l.count);
  }
  comm::sum_in_rank_order(world_, sums);
  Validation v;
  v.tokens = static_cast<int64_t>(sums[1]);
  v.loss = sums[0] / std::max(sums[1], 1.0);
  v.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return v;
}

// Every MoE layer's bias as the model holds it (from its import): each pp stage gives
// its layers', zero elsewhere, summed over the stages (exact: one term is not zero).
std::vector<std::vector<float>> Trainer::model_expert_bias() {
  std::vector<double> all;
  for (int64_t l = 0; l < model_.all_layers(); ++l) {
    if (!model_.is_moe_layer(l)) continue;
    const bool here = pipeline_.owner(l) == pp_rank_;
    std::vector<float> b = here ? model_.expert_bias(l) : std::vector<float>(model_.num_experts(), 0.0f);
    all.insert(all.end(), b.begin(), b.end());
  }
  comm::sum_in_rank_order(pp_, all);
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < all.size(); i += static_cast<size_t>(model_.num_experts()))
    out.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(i),
                     all.begin() + static_cast<std::ptrdiff_t>(i + model_.num_experts()));
  return out;
}

std::string Trainer::expert_bias() const {
  return expert_bias_.empty() ? "null" : nlohmann::json(expert_bias_).dump();
}

void Trainer::set_expert_bias(const std::string& json) {
  expert_bias_ = parse_expert_bias(model_, json);
  apply_expert_bias(model_, expert_bias_, [&](int64_t l) { return pipeline_.owner(l) == pp_rank_; });
}

LossSum Trainer::evaluate(Model& model, const TokenBatch& data, int64_t micro_batch) {
  LossSum total;
  std::unique_ptr<Stash> s;
  for (int64_t row = 0; row < data.rows; row += micro_batch) {
    const int64_t n = std::min(micro_batch, data.rows - row);
    if (!s || s->batch != n) s = model.make_stash(n, data.seq);
    copy(s->ids, Tensor(const_cast<int32_t*>(data.ids.data()) + row * data.seq, s->ids.shape, DType::i32));
    copy(s->labels, Tensor(const_cast<int32_t*>(data.labels.data()) + row * data.seq, s->labels.shape, DType::i32));
    LossSum part = forward(model, *s);
    total.sum += part.sum;
    total.count += part.count;
  }
  return total;
}

LossSum Trainer::forward(Model& model, Stash& s) {
  model.embed_forward(s);
  for (int64_t l = 0; l < model.num_layers(); ++l)
    for (Stage st : kStages) {
      model.stage_forward(l, st, s);
      model.finish_forward(l, st, s);
    }
  return model.head_forward(s, 0.0f);
}


}  // namespace mt
