// moetrain train: a config file and/or --section.key=value overrides describe a run.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cli/commands.h"
#include "core/check.h"
#include "io/file.h"
#include "train/config.h"
#include "train/trainer.h"

namespace mt::cli {

namespace {

std::string model_config_path(const Config& c) {
  if (!c.model.config.empty()) return c.model.config;
  MT_CHECK(c.model.init.starts_with("hf:"))
      << "model.config is not set: random initialisation needs a Hugging Face config.json for the architecture";
  return (std::filesystem::path(c.model.init.substr(3)) / "config.json").string();
}

}  // namespace

int run_train(const Args& args) {
  Options o("train", args, {"config"});
  Config cfg = load_config(o.get("config"), o.dotted());
  std::unique_ptr<Model> model = make_model(model_config_path(cfg));
  if (cfg.model.init == "random")
    init_random(*model, cfg.model.init_std, static_cast<uint64_t>(cfg.training.seed));
  else
    load_hf(*model, cfg.model.init.substr(3));
  MT_CHECK(cfg.data.corpus.empty()) << "data.corpus: training from a tokenized corpus is not wired into train yet; "
                                       "use data.tokens";
  MT_CHECK(!cfg.data.tokens.empty()) << "data.tokens is not set: give a .npy [B, T] token matrix";
  MT_CHECK(cfg.checkpoint.interval == 0) << "checkpoint.interval: checkpoints are not built yet";
  TokenBatch data = read_token_batch(cfg.data.tokens, model->vocab_size());

  std::filesystem::create_directories(cfg.job.dump_folder);
  std::string folder = cfg.job.dump_folder;
  io::write_file_atomic(folder + "/config.toml", {config_to_toml(cfg)});
  std::ofstream metrics(folder + "/metrics.jsonl", std::ios::trunc);
  MT_CHECK(metrics.good()) << "cannot write " << folder << "/metrics.jsonl";

  std::printf("moetrain train: %lld layers, %.3fM parameters (%.3fM active), %lld x %lld tokens per step\n",
              static_cast<long long>(model->num_layers()), model->param_count() / 1e6,
              model->active_param_count() / 1e6, static_cast<long long>(data.rows),
              static_cast<long long>(data.seq));
  Trainer trainer(cfg, *model, std::move(data));
  for (int64_t i = 0; i < cfg.training.steps; ++i) {
    StepResult r = trainer.step();
    metrics << step_json(r) << "\n";
    metrics.flush();
    if (r.step % cfg.metrics.log_interval == 0 || i + 1 == cfg.training.steps) std::printf("%s\n", step_line(r).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace mt::cli
