// moetrain train: a config file and/or --section.key=value overrides describe a run.
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "comm/mesh.h"
#include "core/check.h"
#include "io/file.h"
#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/device.h"
#endif
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer.h"

namespace mt::cli {

namespace {

namespace fs = std::filesystem;

// SIGTERM/SIGINT: the first asks the loop to finish its step, save and exit 0 (what
// a SLURM preemption needs); a second ends the process at once. Saves are atomic, so
// that cannot leave a half-written checkpoint behind.
std::atomic<int> g_signals{0};

void on_signal(int sig) {
  if (g_signals.fetch_add(1) > 0) _exit(128 + sig);
}

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

std::string model_config_path(const Config& c) {
  if (!c.model.config.empty()) return c.model.config;
  MT_CHECK(c.model.init.starts_with("hf:"))
      << "model.config is not set: random initialisation needs a Hugging Face config.json for the architecture";
  return (fs::path(c.model.init.substr(3)) / "config.json").string();
}

// metrics.jsonl up to and including `step`: a resumed run continues the file from
// its checkpoint, dropping lines of steps that will be run again.
void truncate_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::ostringstream keep;
  std::string line;
  while (std::getline(in, line)) {
    size_t at = line.find("\"step\":");
    if (at != std::string::npos && std::stoll(line.substr(at + 7)) <= step) keep << line << "\n";
  }
  io::write_file_atomic(path, {keep.str()});
}

}  // namespace

int run_train(const Args& args) {
  install_signal_handlers();
  Options o("train", args, {"config"});
  Config cfg = load_config(o.get("config"), o.dotted());
  // Every rank runs this same function; rank 0 alone writes the run folder.
  comm::World& world = comm::world();
  comm::DeviceMesh mesh(world.comm(), static_cast<int>(cfg.parallelism.pp), static_cast<int>(cfg.parallelism.cp),
                        static_cast<int>(cfg.parallelism.ep));
  const bool writer = world.rank() == 0;
  const std::string config_json = model_config_path(cfg);
  ModelOptions options;
  options.device = cfg.training.device == "cuda" ? Device::cuda : Device::cpu;
  options.force_balanced_routing = cfg.training.force_balanced_routing;
  options.capacity_factor = cfg.training.capacity_factor;
  options.fp8 = cfg.training.fp8 == "blockwise" ? Fp8::blockwise : Fp8::none;
  options.fp8_pow2 = cfg.training.fp8_scale == "pow2";
  options.ep = &mesh.ep();
  options.cp = &mesh.cp();
  // ZeRO-3 shards the layers' weights over the ranks; one rank keeps them whole.
  options.external_layers = cfg.parallelism.zero3 && world.size() > 1;
  // A pipeline stage builds its own layers only.
  if (mesh.shape().pp > 1) {
    ModelOptions counting;
    counting.plan_only = true;
    std::unique_ptr<Model> whole = make_model(config_json, counting);
    const Pipeline p = Trainer::pipeline_of(cfg, whole->num_layers());
    options.layers = p.layers_of(mesh.coord().pp);
    options.embedding = p.owner(-1) == mesh.coord().pp;
    options.head = p.owner(whole->num_layers()) == mesh.coord().pp;
  }
#ifdef MOETRAIN_WITH_CUDA
  if (options.device == Device::cuda) cuda::note_memory_baseline();  // before the first allocation
#endif
  std::unique_ptr<Model> model = make_model(config_json, options);
  MT_CHECK(!cfg.data.tokens.empty() || !cfg.data.corpus.empty())
      << "no data: set data.tokens (a .npy [B, T] token matrix) or data.corpus (a folder of tokenized .bin files)";
  MT_CHECK(cfg.data.corpus.empty() || cfg.data.seq_len > 0) << "data.seq_len must be set (> 0) with data.corpus";

  const std::string folder = cfg.job.dump_folder, checkpoints = folder + "/checkpoints";
  std::string resume = cfg.checkpoint.load.empty() ? latest_checkpoint(checkpoints) : cfg.checkpoint.load;
  std::unique_ptr<Trainer> made;
  if (cfg.data.corpus.empty())
    made = std::make_unique<Trainer>(cfg, *model, read_token_batch(cfg.data.tokens, model->vocab_size()));
  else
    made = std::make_unique<Trainer>(cfg, *model, std::make_unique<data::Dataset>(cfg.data.corpus, cfg.data.seq_len,
                                                                                  cfg.training.seed));
  Trainer& trainer = *made;
  trainer.set_parallel(mesh);
  // Weights are filled once the trainer has sharded them: with ZeRO-3 through full host
  // copies of the layers, cut into this rank's shards after.
  if (resume.empty()) {
    trainer.materialize_weights();
    if (cfg.model.init == "random")
      init_random(*model, cfg.model.init_std, static_cast<uint64_t>(cfg.training.seed));
    else
      load_hf(*model, cfg.model.init.substr(3));
    trainer.commit_weights();
  }
  // Parameters of the whole model: each pp rank counts its own (of one ep rank's experts).
  std::vector<int64_t> counts = {model->param_count(), model->active_param_count()};
  if (mesh.shape().pp > 1) mesh.pp().all_reduce(Tensor(counts.data(), {2}, DType::i64));
  if (writer)
    std::printf("moetrain train: %lld layers, %.3fM parameters (%.3fM active), mesh %s, OpenMP threads a rank: %d\n",
                static_cast<long long>(model->num_layers()), counts[0] / 1e6, counts[1] / 1e6, mesh.str().c_str(),
                omp_get_max_threads());
  TrainState state;
  state.seed = cfg.training.seed;
  state.config_toml = config_to_toml(cfg);
  if (!resume.empty()) {
    // Sharded moments are read laid out like the weights, then cut into this rank's shards.
    trainer.optimizer().materialize_moments();
    trainer.materialize_weights();
    TrainState from = load_checkpoint(resume, *model, &trainer.optimizer());
    trainer.commit_weights();
    trainer.optimizer().commit_moments();
    trainer.set_steps_done(from.step);
    trainer.set_data_cursor(from.data_cursor);
    if (writer) std::printf("resumed from %s (step %lld)\n", resume.c_str(), static_cast<long long>(from.step));
  }
  // The run folder is made once everything above has accepted the run: a refused run
  // leaves none behind. A resumed run appends to what truncate_metrics kept.
  std::ofstream metrics;
  if (writer) {
    std::error_code ec;
    fs::create_directories(folder, ec);
    MT_CHECK(!ec && fs::is_directory(folder)) << "job.dump_folder: cannot create " << folder << ": " << ec.message();
    io::write_file_atomic(folder + "/config.toml", {config_to_toml(cfg)});
    if (!resume.empty()) truncate_metrics(folder + "/metrics.jsonl", trainer.steps_done());
    metrics.open(folder + "/metrics.jsonl", resume.empty() ? std::ios::trunc : std::ios::app);
    MT_CHECK(metrics.good()) << "cannot write " << folder << "/metrics.jsonl";
  }
  mesh.world().barrier();

  int64_t saved_step = -1;
  auto save = [&](double lr) {
    if (saved_step == trainer.steps_done()) return;
    saved_step = trainer.steps_done();
    state.step = trainer.steps_done();
    state.lr = lr;
    state.data_cursor = trainer.data_cursor();
    // Weights are replicated over dp and cp: the pp x ep ranks of the first replica
    // write, each its own experts and (ep rank 0) its layers' dense weights. Sharded
    // moments are first gathered (and with ZeRO-3 the layers' weights), which every rank
    // takes part in.
    trainer.optimizer().materialize_moments();
    trainer.materialize_weights();
    if (mesh.coord().dp == 0 && mesh.coord().cp == 0) {
      std::string dir =
          save_checkpoint(checkpoints, *model, trainer.optimizer(), state, config_json, cfg.checkpoint.keep,
                          &mesh.pp_ep(), mesh.coord().ep == 0);
      if (writer) std::printf("saved %s\n", dir.c_str());
    }
    trainer.release_weights();
    trainer.optimizer().release_moments();
    mesh.world().barrier();
  };
  double lr = 0;
  while (trainer.steps_done() < cfg.training.steps) {
    StepResult r = trainer.step();
    lr = r.lr;
    if (writer) {
      metrics << step_json(r) << "\n";
      metrics.flush();
      if (r.step % cfg.metrics.log_interval == 0 || r.step == cfg.training.steps)
        std::printf("%s\n", step_line(r).c_str());
      std::fflush(stdout);
    }
    // A signal reaches one rank or all; every rank stops at the same step.
    std::vector<int64_t> signalled = {g_signals.load() > 0 ? 1 : 0};
    mesh.world().all_reduce(Tensor(signalled.data(), {1}, DType::i64));
    bool stop = signalled[0] > 0;
    if ((cfg.checkpoint.interval > 0 && r.step % cfg.checkpoint.interval == 0) || stop) save(lr);
    if (stop) {
      if (writer) std::printf("stopped by a signal after step %lld\n", static_cast<long long>(r.step));
      return 0;
    }
  }
  // The end of a run is always kept when checkpoints are on (step 0 too: an export of
  // the initial weights).
  if (cfg.checkpoint.interval > 0) save(lr);
  return 0;
}

}  // namespace mt::cli
