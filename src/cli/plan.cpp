// moetrain plan: the mesh and the memory a run will hold, from the same allocation
// code that training uses (arenas in counting mode), before anything is launched.
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "comm/mesh.h"
#include "core/arena.h"
#include "core/check.h"
#include "models/interface.h"
#include "parallel/sharding.h"
#include "parallel/zero3.h"
#include "train/config.h"
#include "train/optimizer.h"

namespace mt::cli {

int run_plan(const Args& args) {
  Options o("plan", args, {"config", "world"});
  Config cfg = load_config(o.get("config"), o.dotted());
  const int world = std::stoi(o.get("world", "1"));
  comm::MeshShape mesh = comm::mesh_shape(world, static_cast<int>(cfg.parallelism.pp),
                                          static_cast<int>(cfg.parallelism.cp), static_cast<int>(cfg.parallelism.ep));
  std::string config_json = cfg.model.config;
  if (config_json.empty()) {
    MT_CHECK(cfg.model.init.starts_with("hf:")) << "model.config is not set and model.init is not hf:DIR";
    config_json = (std::filesystem::path(cfg.model.init.substr(3)) / "config.json").string();
  }
  ModelOptions options;
  options.device = cfg.training.device == "cuda" ? Device::cuda : Device::cpu;
  options.plan_only = true;
  // As `train` builds it: with ZeRO-3 on more than one rank the layers' weights are shards.
  const bool zero3 = cfg.parallelism.zero3 && world > 1;
  options.external_layers = zero3;
  // With ep > 1 the model is built as rank 0 of the ep group builds it: its share of the
  // experts, and expert buffers sized for the exchange.
  comm::Communicator ep = comm::Communicator::describing("ep (plan)", 0, mesh.ep);
  if (mesh.ep > 1) options.ep = &ep;
  std::unique_ptr<Model> model = make_model(config_json, options);

  int64_t seq = cfg.data.seq_len, global = cfg.training.global_batch_size;
  MT_CHECK(seq > 0 && global > 0) << "plan needs data.seq_len and training.global_batch_size (> 0)";
  const int64_t data_ranks = static_cast<int64_t>(mesh.dp) * mesh.ep;  // the ranks that split the batch
  MT_CHECK(global % data_ranks == 0) << "training.global_batch_size " << global << " does not split over dp x ep = "
                                     << data_ranks << " data ranks";
  int64_t per_rank = global / data_ranks;
  int64_t micro = cfg.training.micro_batch_size ? cfg.training.micro_batch_size : per_rank;
  MT_CHECK(per_rank % micro == 0) << "training.micro_batch_size " << micro << " does not divide the " << per_rank
                                  << " sequences of a rank";
  const int64_t live = cfg.training.load_balance_type == "global_batch" ? per_rank / micro : 1;
  size_t weights = 0, compute = 0;
  const auto in_layer = [&](const Param& p) { return p.layer >= 0 && p.layer < model->num_layers(); };
  for (const Param& p : model->params()) {
    if (zero3 && in_layer(p)) continue;  // in the shards and the slot below
    weights += p.value.nbytes();
    if (p.compute.dtype != p.value.dtype) compute += p.compute.nbytes();
  }
  // More than one rank shards the moments and the summed gradients (train/optimizer.h).
  const int replicas = mesh.dp * mesh.cp * mesh.ep;
  const bool sharded = replicas > 1;
  const parallel::ShardLayout layout(model->params(), replicas, mesh.ep > 1 ? mesh.dp * mesh.cp : replicas,
                                     zero3 ? model->num_layers() : 0);
  const DType state = cfg.optimizer.state();
  const size_t optimizer =
      sharded ? AdamW::sharded_bytes(layout, state) : AdamW::moment_bytes(model->params(), state);
  const size_t slot = zero3 ? parallel::Zero3::slot_bytes(model->params(), layout, options.device) : 0;
  const size_t activations = model->make_stash(micro, seq / mesh.cp)->bytes * static_cast<size_t>(live);
  const size_t total = 2 * weights + optimizer + compute + slot + activations;
  auto gib = [](size_t b) { return static_cast<double>(b) / (1ull << 30); };
  std::printf("mesh: world %d = pp %d x dp %d x cp %d x ep %d\n", world, mesh.pp, mesh.dp, mesh.cp, mesh.ep);
  std::printf("model: %lld layers, %.3fB parameters (%.3fB active per token), device %s\n",
              static_cast<long long>(model->num_layers()), model->param_count() / 1e9,
              model->active_param_count() / 1e9, cfg.training.device.c_str());
  if (zero3)
    std::printf("per rank (with zero3 the layers' weights live in the AdamW shards, the embedding and\n"
                "head in full):\n");
  else
    std::printf("per rank (1/ep of the experts; weights and accumulating gradients are sharded only\n"
                "with zero3):\n");
  std::printf("  master weights (f32)      %10.3f GiB%s\n", gib(weights), zero3 ? " (embedding and head)" : "");
  std::printf("  gradients (f32)           %10.3f GiB%s\n", gib(weights), zero3 ? " (embedding and head)" : "");
  if (sharded)
    std::printf("  AdamW shards              %10.3f GiB (moments and summed gradients%s over %d ranks)\n",
                gib(optimizer), zero3 ? ", layers' weights" : "", replicas);
  else
    std::printf("  AdamW moments (2 x %s)  %10.3f GiB\n", state == DType::bf16 ? "bf16" : "f32 ", gib(optimizer));
  std::printf("  bf16 weight copies        %10.3f GiB\n", gib(compute));
  if (zero3)
    std::printf("  zero3 layer slots         %10.3f GiB (two layers' weights and copies, two layers' gradients)\n",
                gib(slot));
  std::printf("  activations               %10.3f GiB (%lld live micro-batch%s of %lld x %lld tokens)\n",
              gib(activations), static_cast<long long>(live), live == 1 ? "" : "es", static_cast<long long>(micro),
              static_cast<long long>(seq / mesh.cp));
  std::printf("  total                     %10.3f GiB (%zu bytes)\n", gib(total), total);
  return 0;
}

}  // namespace mt::cli
