// A training run's life (train/run.h): from a resolved config to the last step's save.
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "comm/mesh.h"
#include "core/arena.h"
#include "core/check.h"
#include "io/file.h"
#include "models/hf_config.h"
#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/device.h"
#endif
#include "train/checkpoint.h"
#include "train/progress.h"
#include "train/run.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

// SIGTERM, SIGINT and SIGUSR1 ask the loop to finish its step, save and exit with
// kStoppedBySignal (what a preemption needs; a requeue script tells it from success).
// Wrappers and schedulers deliver one request as several signals (timeout forwards its
// own to a process group that got it already; Slurm signals every task of a step):
// those within kSignalWindow of the first are the same request. A signal after that ends
// the process at once, saying so on stderr first. Saves are atomic, so that cannot leave
// a half-written checkpoint behind. Open MPI's mpirun, given SIGTERM, forwards it and
// kills the ranks 1 s later (odls_base_sigkill_timeout); SIGUSR1 it only forwards.
constexpr int kStoppedBySignal = 75;           // sysexits' EX_TEMPFAIL: run it again
constexpr int64_t kSignalWindow = 2000000000;  // ns
std::atomic<int64_t> g_first_signal{0};        // CLOCK_MONOTONIC ns of the first; 0: none
static_assert(std::atomic<int64_t>::is_always_lock_free);

void on_signal(int sig) {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const int64_t now = std::max<int64_t>(1, ts.tv_sec * 1000000000 + ts.tv_nsec);
  int64_t first = 0;
  if (g_first_signal.compare_exchange_strong(first, now) || now - first < kSignalWindow) return;
  const char says[] = "moetrain train: another signal more than 2 s after the first: exiting now, without saving "
                      "this step (the last checkpoint stays)\n";
  ssize_t ignored = write(STDERR_FILENO, says, sizeof says - 1);
  (void)ignored;
  _exit(128 + sig);
}

// One writer a run folder: rank 0 holds <folder>/moetrain.lock (io::FileLock) from before
// it looks for a checkpoint to resume until the run ends, and every rank stops when it
// cannot be had. The folders made for it are removed again when the run is refused
// before it starts (unless `keep`), so a refused run leaves none behind.
struct RunFolder {
  std::vector<fs::path> made;  // outermost first
  std::optional<io::FileLock> lock;
  bool keep = false;
  ~RunFolder() {
    lock.reset();
    std::error_code ec;
    if (!keep)
      for (auto p = made.rbegin(); p != made.rend(); ++p) fs::remove(*p, ec);  // only if empty
  }
};

void claim_run_folder(RunFolder& run, comm::Communicator& world, const std::string& folder) {
  std::string refused;
  if (world.rank() == 0) {
    try {
      for (fs::path p = fs::path(folder).lexically_normal(); !p.empty() && !fs::exists(p); p = p.parent_path())
        run.made.insert(run.made.begin(), p);
      std::error_code ec;
      fs::create_directories(folder, ec);
      MT_CHECK(!ec && fs::is_directory(folder)) << "job.dump_folder: cannot create " << folder << ": " << ec.message();
      run.lock.emplace(folder + "/moetrain.lock", "moetrain train");
    } catch (const io::LockHeld& e) {
      refused = "job.dump_folder " + folder + " is in use: " + e.message +
                "; one run writes a folder at a time: wait for it to end, stop it, or choose another job.dump_folder";
    } catch (const Error& e) {
      refused = "job.dump_folder " + folder + " cannot be written: " + e.message +
                "; make it writable or choose another job.dump_folder";
    }
  }
  std::vector<int64_t> bad = {refused.empty() ? 0 : 1};
  world.all_reduce(Tensor(bad.data(), {1}, DType::i64));
  MT_CHECK(refused.empty()) << refused;
  MT_CHECK(bad[0] == 0) << "rank 0 cannot have the run folder " << folder << " (it says why)";
}

// `v` with `digits` decimals, whole (std::to_string(v).substr cut large figures short).
std::string decimals(double v, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, v);
  return text;
}

std::string gib(size_t b) {
  const double v = static_cast<double>(b) / (1 << 30);
  return decimals(v, v >= 100 ? 0 : v >= 1 ? 2 : 4) + " GiB";
}

// A run whose plan (train/trainer.h, plan_memory: what `moetrain plan` prints) needs
// more than the device has free is refused before anything is allocated, with the
// plan's figures and what the levers would plan to.
// training.device_memory_limit caps `free` (a smaller GPU stood in for); the expert rows
// then get what the limit leaves once the planned arenas are taken (returned; 0: no
// limit), so the run holds no more than the limit but for libraries' workspaces.
// Ranks that share one memory (the CPU ranks of a host, the CUDA ranks given one GPU)
// share its free bytes: `others` is what the plans of the others sharing it need, and
// `sharing` how many ranks they are with this one.
size_t refuse_what_does_not_fit(const Config& cfg, int world, int pp_rank, size_t free, size_t others, int sharing) {
  const MemoryPlan m = plan_memory(cfg, world, pp_rank, 1.0);
  // On the CPU the offloaded blocks' host memory is the device's too.
  const size_t host = cfg.training.device == "cpu" ? m.host : 0, need = m.total() + host;
  const size_t limit = static_cast<size_t>(cfg.training.device_memory_limit * static_cast<double>(size_t{1} << 30));
  const bool capped = limit > 0 && limit < free, together = need + others > free;
  const size_t cap = capped ? limit : free;
  if (need <= cap && !together) return limit > 0 ? cap - (need - m.rows) : 0;
  const std::string shared = together && sharing > 1 ? " (with the " + std::to_string(sharing - 1) +
                                                           " other rank(s) sharing this memory, " +
                                                           gib(need + others) + " together)"
                                                     : "";
  const bool over_limit = capped && need > limit;
  std::string levers;
  for (const char* mode : {"selective", "full"}) {
    if (cfg.training.activation_checkpoint == mode) continue;
    Config other = cfg;
    other.training.activation_checkpoint = mode;
    levers += std::string("; training.activation_checkpoint=") + mode + " plans " + gib(plan_memory(other, world, pp_rank, 1.0).total());
  }
  if (cfg.offload.experts == "none" && !cfg.parallelism.zero3 && cfg.training.device == "cuda") {
    Config other = cfg;
    other.offload.experts = "optimizer";
    const MemoryPlan o = plan_memory(other, world, pp_rank, 1.0);
    levers += "; offload.experts=optimizer plans " + gib(o.total()) + " and " + gib(o.host) +
              " of host memory (offload.layers offloads fewer layers)";
  }
  MT_FAIL() << "the plan for pp rank " << pp_rank << " needs " << gib(need) << " (" << need << " bytes) on the "
            << cfg.training.device << " device (master weights " << gib(m.weights) << ", gradients "
            << gib(m.gradients) << ", optimizer " << gib(m.optimizer) << ", weight copies " << gib(m.compute)
            << ", zero3 slots " << gib(m.slot) << ", activations " << gib(m.activations) << " for micro-batches of "
            << m.step.micro_batch << " x " << m.step.seq << ", expert rows " << gib(m.rows)
            << " under balanced routing" << (host > 0 ? ", offloaded experts and moments " + gib(host) : "") << ")"
            << shared << " but "
            << (over_limit ? "training.device_memory_limit allows " + gib(limit) : "the device has " + gib(free) + " free")
            << ". Levers" << levers << "; a smaller training.micro_batch_size; parallelism.zero3=true; more "
            << "ranks (parallelism.ep, parallelism.pp). moetrain plan with the same flags prints each figure";
  return 0;
}

// With offload.experts on a GPU: the offloaded blocks' master weights and moments of
// this rank (`host`) and of the `others` on its host against the host's free memory.
void refuse_short_host(size_t host, size_t others, int sharing, size_t free) {
  if (host + others <= free) return;
  MT_FAIL() << "offload.experts = optimizer: this rank's offloaded expert weights and moments need " << gib(host) << " ("
            << host << " bytes) of host memory"
            << (sharing > 1 ? ", " + gib(host + others) + " with the " + std::to_string(sharing - 1) +
                                  " other rank(s) on this host,"
                            : "")
            << " but the host has " << gib(free) << " free. Levers: optimizer.state_dtype=bf16 (8 bytes a parameter, "
            << "not 12); fewer ranks a host; more ranks over the experts (parallelism.ep, parallelism.pp); "
            << "offload.experts=none where the device holds them. moetrain plan with the same flags prints each figure";
}

std::string identity_text(const std::map<std::string, std::string>& files) {
  std::string t;
  for (const auto& [name, what] : files) t += name + "\t" + what + "\n";
  return t;
}

// One tokenizer a run: the tokenizer.json beside each corpus (data.corpus, each of
// data.mixture, validation.corpus) and in an hf: model's folder must be the same file
// by content; token ids of another tokenizer train silently wrong. Folders without one
// (corpora tokenized before tokenize kept it) are not compared.
void check_one_tokenizer(const Config& cfg) {
  std::vector<std::pair<std::string, std::string>> found;  // (key, tokenizer.json)
  auto look = [&](const std::string& key, const std::string& folder) {
    const fs::path t = fs::path(folder) / "tokenizer.json";
    if (!folder.empty() && fs::is_regular_file(t)) found.emplace_back(key, t.string());
  };
  for (const MixturePart& part : data_corpora(cfg)) look(cfg.data.mixture.empty() ? "data.corpus" : "data.mixture", part.folder);
  look("validation.corpus", cfg.validation.corpus);
  if (cfg.model.init.starts_with("hf:")) look("model.init", cfg.model.init.substr(3));
  if (found.size() < 2) return;
  const io::FileSum first = io::file_sum(found[0].second);
  for (size_t i = 1; i < found.size(); ++i) {
    const io::FileSum other = io::file_sum(found[i].second);
    MT_CHECK(other.bytes == first.bytes && other.xxh3 == first.xxh3)
        << "two tokenizers in one run: " << found[0].first << "'s " << found[0].second << " (" << first.bytes
        << " bytes) and " << found[i].first << "'s " << found[i].second << " (" << other.bytes << " bytes) differ; "
        << "token ids mean different text under each, so the run would train silently wrong: tokenize every corpus "
        << "with the model's tokenizer.json (moetrain tokenize --tokenizer)";
  }
}

// Ranks agree or stop: every rank's resolved config must be rank 0's (ranks started with
// different flags, say training.steps, hung in a collective), and so must the data that
// config names (a node with a stale copy of the corpus at the same path trained on other
// tokens, silently). Each rank that differs names its keys and files; every rank stops.
void agree_with_rank0(comm::Communicator& world, const Config& cfg) {
  if (world.size() == 1) return;
  const std::string zero = comm::broadcast_text(world, config_to_toml(cfg), 0);
  std::string differs;
  for (const ConfigChange& c : config_changes(zero, cfg))
    differs += (differs.empty() ? "" : ", ") + c.key + " (rank 0: " + c.before + ", here: " + c.after + ")";
  // Every rank takes part in the broadcast, also one whose config differs already.
  const std::map<std::string, std::string> here = input_identity(cfg, false);
  std::map<std::string, std::string> theirs;
  std::istringstream lines(comm::broadcast_text(world, identity_text(here), 0));
  for (std::string line; std::getline(lines, line);)
    theirs[line.substr(0, line.find('\t'))] = line.substr(line.find('\t') + 1);
  int named = 0;
  auto note = [&](const std::string& name, const std::string& zero_has, const std::string& here_has) {
    if (named++ < 4) differs += (differs.empty() ? "" : ", ") + name + " (rank 0: " + zero_has + ", here: " + here_has + ")";
  };
  for (const auto& [name, what] : theirs)
    if (!here.contains(name)) note(name, what, "no such file");
    else if (here.at(name) != what) note(name, what, here.at(name));
  for (const auto& [name, what] : here)
    if (!theirs.contains(name)) note(name, "no such file", what);
  if (named > 4) differs += " and " + std::to_string(named - 4) + " more file(s)";
  std::vector<int64_t> bad = {differs.empty() ? 0 : 1};
  world.all_reduce(Tensor(bad.data(), {1}, DType::i64));
  MT_CHECK(differs.empty()) << "this rank's config or data differs from rank 0's: " << differs
                            << "; every rank must run the same command with the same config, on the same files";
  MT_CHECK(bad[0] == 0) << bad[0] << " rank(s) run another config or read other data than rank 0 (each names its keys "
                        << "and files); every rank must run the same command with the same config, on the same files";
}

// metrics.jsonl up to and including `step`: a resumed run continues the file from
// its checkpoint, dropping lines of steps that will be run again, and lines that are
// not JSON objects (a run killed mid-write leaves a torn last line): their count.
int64_t truncate_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::ostringstream keep;
  std::string line;
  int64_t torn = 0;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    torn += !j.is_object();
    if (j.is_object() && j.value("step", step + 1) <= step) keep << line << "\n";
  }
  io::write_file_atomic(path, {keep.str()});
  return torn;
}

// Before the first step: what runs, on what, from where, into where.
void print_banner(const Config& c, const comm::DeviceMesh& mesh, const std::string& model_config, int64_t layers,
                  const std::vector<int64_t>& params, const Trainer& t) {
  std::vector<uint8_t> b = io::read_file(model_config);
  const std::string type = nlohmann::json::parse(b.begin(), b.end(), nullptr, false).value("model_type", "?");
  const comm::MeshShape& m = mesh.shape();
  std::printf("moetrain train: %s (%s), %lld layers, %s parameters (%s active)\n", type.c_str(),
              model_config.c_str(), static_cast<long long>(layers), count_text(static_cast<double>(params[0])).c_str(),
              count_text(static_cast<double>(params[1])).c_str());
  std::printf("  mesh: dp %d x cp %d x ep %d x pp %d (%d rank%s), %s%s\n", m.dp, m.cp, m.ep, m.pp, m.size(),
              m.size() == 1 ? "" : "s",
              c.training.device.c_str(), c.parallelism.zero3 && m.size() > 1 ? ", zero3" : "");
  const std::string micro = c.training.micro_batch_size ? std::to_string(c.training.micro_batch_size) : "whole share";
  std::string data = c.data.tokens.empty() ? "" : "tokens " + c.data.tokens;
  double weights = 0;
  for (const MixturePart& part : data_corpora(c)) weights += part.weight;
  for (const MixturePart& part : data_corpora(c))
    data += (data.empty() ? "corpus " : ", ") + part.folder +
            (c.data.mixture.empty() ? "" : " (share " + decimals(part.weight / weights, 3) + ")");
  std::printf("  data: %s, seq_len %lld, global batch %lld sequences (%lld tokens a step), micro-batch %s\n",
              data.c_str(), static_cast<long long>(t.seq_len()),
              static_cast<long long>(t.global_batch()), static_cast<long long>(t.seq_len() * t.global_batch()),
              micro.c_str());
  const std::string every = std::to_string(c.checkpoint.interval);
  const std::string end = c.checkpoint.save_final ? " and at the end" : "";
  const std::string saves = c.checkpoint.interval > 0 ? "checkpoints/ every " + every + " steps" + end
                            : c.checkpoint.save_final ? std::string("checkpoints/ at the end")
                                                      : std::string("no checkpoints");
  std::printf("  run folder: %s (metrics.jsonl%s, %s)\n", c.job.dump_folder.c_str(),
              c.metrics.tensorboard ? ", TensorBoard events in tb/" : "", saves.c_str());
}

}  // namespace

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaction(sig, &sa, nullptr);
}

int run_training(Config cfg, std::chrono::steady_clock::time_point started) {
  check_inputs_exist(cfg);
  check_one_tokenizer(cfg);
  // DeepSeek-V2's config.json asks for its sequence-level balance loss (seq_aux, with
  // aux_loss_alpha): taken while the config leaves both balance keys at their defaults.
  std::string adopted;
  const Config defaults;
  if (cfg.training.load_balance_type == defaults.training.load_balance_type &&
      cfg.training.load_balance_coef == defaults.training.load_balance_coef) {
    const SequenceBalance b = sequence_balance(model_config_path(cfg));
    if (b.seq_aux && b.alpha > 0) {
      cfg.training.load_balance_type = "sequence";
      cfg.training.load_balance_coef = b.alpha;
      adopted = "  balance: DeepSeek's sequence-level loss, weight " + std::to_string(b.alpha) + ", as " +
                model_config_path(cfg) + " asks (seq_aux, aux_loss_alpha); training.load_balance_type or " +
                "load_balance_coef set otherwise overrides it\n";
    }
  }
  if (cfg.training.device == "cuda") require_gpu("training.device = cuda");
  // Every rank runs this same function; rank 0 alone writes the run folder.
  comm::World& world = comm::world();
  const bool writer = world.rank() == 0;
  agree_with_rank0(world.comm(), cfg);
  // Ranks that share a GPU (comm::share_gpus) each take an equal share of its memory
  // unless the user set a limit, so the refusal below and the expert rows' pool plan
  // with their own share.
  const comm::GpuSharing& gpu_sharing = world.gpu_sharing();
  [[maybe_unused]] const int on_my_gpu = gpu_sharing.ranks_on_gpu.empty() ? 1 : gpu_sharing.ranks_on_gpu[static_cast<size_t>(world.rank())];
#ifdef MOETRAIN_WITH_CUDA
  if (cfg.training.device == "cuda" && on_my_gpu > 1 && cfg.training.device_memory_limit == 0)
    cfg.training.device_memory_limit =
        static_cast<double>(cuda::total_memory()) / on_my_gpu / static_cast<double>(size_t{1} << 30);
#endif
  const std::string folder = cfg.job.dump_folder, checkpoints = folder + "/checkpoints";
  RunFolder run_folder;
  claim_run_folder(run_folder, world.comm(), folder);
  // Where the run starts; a branch's later checkpoints move aside before any rank reads.
  const ResumeChoice start = choose_resume(cfg);
  if (writer) set_branch_aside(cfg, start);
  world.comm().barrier();
  comm::DeviceMesh mesh(world.comm(), static_cast<int>(cfg.parallelism.pp), static_cast<int>(cfg.parallelism.cp),
                        static_cast<int>(cfg.parallelism.ep));
  const std::string config_json = model_config_path(cfg);
  ModelOptions options = model_options(cfg);
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
  // The host's memory the kernel could give now, or the GPU's free memory; and which
  // memory this rank's plan draws on: its host's, and on CUDA its GPU's. Every rank
  // learns every other's plan, to sum those that share it.
  size_t free = available_host_memory();
  int gpu = -1;
#ifdef MOETRAIN_WITH_CUDA
  if (options.device == Device::cuda) {
    cuda::note_memory_baseline();  // before the first allocation
    free = cuda::free_memory();
    gpu = cuda::current_device();
  }
#endif
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  // Per rank: the memory its device plan draws on and what it needs there, and its host
  // and the offloaded bytes it needs there (counted in the first on the CPU).
  const int64_t memory = static_cast<int64_t>(std::hash<std::string>{}(std::string(host) + "/" + std::to_string(gpu)) >> 1);
  const int64_t host_key = static_cast<int64_t>(std::hash<std::string>{}(std::string(host)) >> 1);
  const MemoryPlan plan = plan_memory(cfg, world.size(), mesh.coord().pp, 1.0);
  const bool on_host = options.device == Device::cpu;
  std::vector<int64_t> plans(4 * static_cast<size_t>(world.size()), 0);
  const size_t me = 4 * static_cast<size_t>(world.rank());
  plans[me] = memory;
  plans[me + 1] = static_cast<int64_t>(plan.total() + (on_host ? plan.host : 0));
  plans[me + 2] = host_key;
  plans[me + 3] = on_host ? 0 : static_cast<int64_t>(plan.host);
  if (world.size() > 1) world.comm().all_reduce(Tensor(plans.data(), {static_cast<int64_t>(plans.size())}, DType::i64));
  size_t others = 0, host_others = 0;
  int sharing = 0, host_sharing = 0;
  for (size_t r = 0; r < static_cast<size_t>(world.size()); ++r) {
    if (plans[4 * r] == memory) {
      ++sharing;
      if (4 * r != me) others += static_cast<size_t>(plans[4 * r + 1]);
    }
    if (plans[4 * r + 2] == host_key && plans[4 * r + 3] > 0) {
      ++host_sharing;
      if (4 * r != me) host_others += static_cast<size_t>(plans[4 * r + 3]);
    }
  }
  options.row_memory_limit = refuse_what_does_not_fit(cfg, world.size(), mesh.coord().pp, free, others, sharing);
  if (!on_host && plan.host > 0) refuse_short_host(plan.host, host_others, host_sharing, available_host_memory());
  std::unique_ptr<Model> model = make_model(config_json, options);
  std::vector<data::Source> corpora;
  for (const MixturePart& part : data_corpora(cfg)) corpora.push_back({part.folder, part.weight});
  MT_CHECK(!cfg.data.tokens.empty() || !corpora.empty())
      << "no data: set data.tokens (a .npy [B, T] token matrix), data.corpus (a folder of tokenized .bin files) or "
      << "data.mixture (several, weighted)";
  MT_CHECK(corpora.empty() || cfg.data.seq_len > 0) << "data.seq_len must be set (> 0) with data.corpus or data.mixture";

  // A corpus's token ids are checked against the vocabulary once, here, with the ranks
  // splitting its files: an id past it names its file and offset before step 1.
  const int64_t vocab = model->vocab_size();
  auto corpus = [&](const std::vector<data::Source>& sources, int64_t seq_len, data::Split split, const char* key) {
    auto d = std::make_unique<data::Dataset>(sources, seq_len, cfg.training.seed, split);
    const std::string range = "the model's vocabulary [0, " + std::to_string(vocab) + ")";
    read_on_every_rank(
        &world.comm(),
        [&] {
          const std::string found = d->find_id_past(vocab, world.rank(), world.size());
          MT_CHECK(found.empty()) << key << ": " << found << " is outside " << range << " of " << config_json
                                  << ": was " << key << " tokenized with another tokenizer?";
        },
        std::string(key) + ": another rank found a token id outside " + range +
            " or could not read a file (it names the file)");
    return d;
  };
  std::unique_ptr<Trainer> made;
  if (corpora.empty())
    made = std::make_unique<Trainer>(cfg, *model, read_token_batch(cfg.data.tokens, vocab));
  else
    made = std::make_unique<Trainer>(cfg, *model,
                                     corpus(corpora, cfg.data.seq_len, data::Split{cfg.validation.split, false},
                                            cfg.data.mixture.empty() ? "data.corpus" : "data.mixture"));
  Trainer& trainer = *made;
  const ValidationConfig& val = cfg.validation;
  if (!val.tokens.empty())
    trainer.set_validation(read_token_batch(val.tokens, vocab));
  else if (!val.corpus.empty())
    trainer.set_validation(corpus({{val.corpus, 1.0}}, trainer.seq_len(), {}, "validation.corpus"));
  else if (val.split > 0)
    trainer.set_validation(corpus(corpora, trainer.seq_len(), data::Split{val.split, true}, "validation.split"));
  // Positions past what the model was made for (as eval refuses them).
  const int64_t max_positions = max_position_embeddings(config_json);
  if (max_positions > 0 && trainer.seq_len() > max_positions) {
    const std::string past = "sequences of " + std::to_string(trainer.seq_len()) + " tokens, past the model's " +
                             "max_position_embeddings (" + std::to_string(max_positions) + " in " + config_json + ")";
    MT_CHECK(cfg.data.allow_past_max_positions)
        << past << ": set data.seq_len to at most " << max_positions << ", raise max_position_embeddings in a copy of "
        << "config.json (with the rope scaling it needs), or train past it with data.allow_past_max_positions = true";
    if (writer) std::fprintf(stderr, "moetrain train: warning: %s (data.allow_past_max_positions)\n", past.c_str());
  }
  trainer.set_parallel(mesh);
  // Weights are filled once the trainer has sharded them: with ZeRO-3 through full host
  // copies of the layers, cut into this rank's shards after.
  std::string resume;
  TrainState saved;
  size_t set_aside = 0;  // a multimodal release's towers (HfLayout)
  if (start.tries.empty()) {
    trainer.materialize_weights();
    if (cfg.model.init == "random")
      init_random(*model, cfg.model.init_std, static_cast<uint64_t>(cfg.training.seed));
    else
      set_aside = load_hf(*model, cfg.model.init.substr(3));
    trainer.commit_weights();
  } else {
    std::tie(resume, saved) = resume_run(cfg, start.tries, *model, trainer, world.comm(), writer);
  }
  // Parameters of the whole model: each pp rank counts its own, its experts those of one
  // ep rank, which hold equal shares of every MoE layer's experts.
  std::vector<int64_t> counts = {model->param_count(), model->active_param_count()};
  for (const Param& p : model->params())
    if (p.expert) counts[0] += p.value.numel() * (mesh.shape().ep - 1);
  if (mesh.shape().pp > 1) mesh.pp().all_reduce(Tensor(counts.data(), {2}, DType::i64));
  if (writer) {
    print_banner(cfg, mesh, config_json, model->num_layers(), counts, trainer);
    std::printf("  OpenMP threads a rank: %d\n%s", omp_get_max_threads(), adopted.c_str());
    if (set_aside > 0)
      std::printf("  set aside from %s: %zu tensors of what no run here trains (a vision tower, MTP layers)\n",
                  cfg.model.init.substr(3).c_str(), set_aside);
    if (gpu_sharing.staged && cfg.training.device == "cuda")
      std::printf("  gpus: %s; each rank on a shared GPU may take %.2f GiB (training.device_memory_limit)\n",
                  gpu_sharing.text.c_str(), cfg.training.device_memory_limit);
    if (val.interval > 0) {
      const std::string set = !val.tokens.empty() ? val.tokens
                              : val.split > 0     ? "the last " + decimals(val.split * 100, 2) +
                                                    "% of each corpus file's tokens, cut at a document end " +
                                                    "(held out of training)"
                                                  : val.corpus;
      std::printf("  validation: every %lld steps, %lld global batch(es) of %lld of the %lld sequences of %s\n",
                  static_cast<long long>(val.interval), static_cast<long long>(trainer.validation_batches()),
                  static_cast<long long>(trainer.global_batch()),
                  static_cast<long long>(trainer.validation_sequences()), set.c_str());
    }
    const std::string seed = std::to_string(cfg.training.seed);
    const std::string init =
        cfg.model.init == "random" ? "random weights (seed " + seed + ")" : "weights from " + cfg.model.init.substr(3);
    if (resume.empty())
      std::printf("  start: fresh, %s\n", init.c_str());
    else
      std::printf("  start: resumed from %s (step %lld)\n", resume.c_str(), static_cast<long long>(saved.step));
    if (!start.note.empty()) std::printf("  note: %s\n", start.note.c_str());
    for (const std::string& dir : start.incomplete)
      std::printf("  note: skipping %s: no COMPLETE marker (an interrupted save; removed once a later step is "
                  "saved)\n", dir.c_str());
    std::fflush(stdout);
  }
  TrainState state;
  state.seed = cfg.training.seed;
  state.config_toml = config_to_toml(cfg);
  state.inputs = nlohmann::json(input_identity(cfg, true)).dump();
  // The line of checkpoints this run continues: checkpoint.load's when it started from it.
  state.origin = resume.empty() ? "" : !cfg.checkpoint.load.empty() && resume == cfg.checkpoint.load ? start.origin
                                                                                                       : saved.origin;
  // The run folder is kept once everything above has accepted the run: a refused run
  // leaves none behind (RunFolder). A resumed run appends to what truncate_metrics kept.
  io::AppendFile metrics;
  run_folder.keep = true;
  if (writer) {
    // A fresh start in a folder an earlier run wrote (without a checkpoint) moves that
    // run's metrics and configs aside rather than overwriting them.
    std::error_code size_ec;
    if (resume.empty() && fs::is_regular_file(folder + "/metrics.jsonl") &&
        fs::file_size(folder + "/metrics.jsonl", size_ec) > 0 && !size_ec) {
      char stamp[32];
      const std::time_t now = std::time(nullptr);
      std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::gmtime(&now));
      const fs::path aside = fs::path(folder) / (std::string("earlier-run-") + stamp);
      fs::create_directories(aside);
      for (const fs::directory_entry& e : fs::directory_iterator(folder)) {
        const std::string n = e.path().filename().string();
        if (n == "metrics.jsonl" || n == "tb" || (n.starts_with("config") && n.ends_with(".toml")))
          fs::rename(e.path(), aside / n);
      }
      std::printf("  note: %s held an earlier run's metrics.jsonl and no checkpoint to resume; its metrics and "
                  "configs are now in %s\n", folder.c_str(), aside.string().c_str());
    }
    // config.toml is the config a run started with; a resume from step N keeps its own
    // beside it, as config.step-0000000N.toml (N as the checkpoint folders write it).
    char name[64] = "config.toml";
    if (!resume.empty()) std::snprintf(name, sizeof name, "config.step-%08lld.toml", static_cast<long long>(saved.step));
    io::write_file_atomic(folder + "/" + name, {config_to_toml(cfg)});
    const int64_t torn = resume.empty() ? 0 : truncate_metrics(folder + "/metrics.jsonl", trainer.steps_done());
    if (torn > 0)
      std::printf("note: %s/metrics.jsonl had %lld line(s) that are not JSON (a torn write of the interrupted run); "
                  "dropped\n", folder.c_str(), static_cast<long long>(torn));
    metrics = io::AppendFile(folder + "/metrics.jsonl", resume.empty());
  }
  mesh.world().barrier();
  std::unique_ptr<TensorBoardWriter> tb;
  if (writer && cfg.metrics.tensorboard) {
    tb = std::make_unique<TensorBoardWriter>(folder + "/tb");
    // Earlier files of the folder may hold the steps about to run again (or a previous
    // run's): TensorBoard drops them from here on.
    const std::string why = tb->restart(trainer.steps_done() + 1, static_cast<double>(std::time(nullptr)));
    MT_CHECK(why.empty()) << "metrics.tensorboard: cannot write " << tb->path() << ": " << why;
  }
  // Metrics that could not be written (a full disk): each a warning naming the file and
  // the step, the next step tries again; past metrics.max_lost_lines the run saves at its
  // next checkpoint and exits 1, so no weights are lost and no run ends silently short.
  int64_t lost = 0;
  auto note_lost = [&](const std::string& why, const std::string& path, int64_t step) {
    if (why.empty()) return;
    ++lost;
    std::fprintf(stderr,
                 "moetrain train: warning: %s: step %lld could not be written (%s); it is lost, the next step tries "
                 "again (%lld lost, metrics.max_lost_lines = %lld)\n",
                 path.c_str(), static_cast<long long>(step), why.c_str(), static_cast<long long>(lost),
                 static_cast<long long>(cfg.metrics.max_lost_lines));
  };
  // Under a launcher, rank 0's standard output is mpirun's pseudo-terminal whatever
  // mpirun's own output is (a file, a pipe): plain lines there, the bar only when alone.
  const bool terminal = isatty(STDOUT_FILENO) == 1 && world.launch().launcher == "none";
  Progress progress(trainer.steps_done(), cfg.training.steps, cfg.metrics.log_interval, terminal,
                    started);
  std::string last_checkpoint;

  // A step this run folder already holds complete, as resumed, is never saved again: a
  // rerun with no steps left would otherwise replace its newest checkpoint with itself.
  int64_t saved_step = -1;
  std::error_code same_ec;
  if (!resume.empty() && fs::exists(checkpoints) &&
      fs::equivalent(fs::path(resume).parent_path(), checkpoints, same_ec) && saved.step == trainer.steps_done()) {
    saved_step = saved.step;
    last_checkpoint = resume;
  }
  auto save = [&](double lr) {
    if (saved_step == trainer.steps_done()) return;
    saved_step = trainer.steps_done();
    state.step = trainer.steps_done();
    state.lr = lr;
    state.data_cursor = trainer.data_cursor();
    state.expert_placement = trainer.expert_placement();
    state.expert_bias = trainer.expert_bias();
    const std::string dir = save_run(cfg, *model, trainer, mesh, state, config_json);
    if (writer) {
      progress.say("saved " + dir);
      last_checkpoint = dir;
    }
  };
  const int64_t every = cfg.checkpoint.interval, done = trainer.steps_done(), steps = cfg.training.steps;
  if (writer && !cfg.checkpoint.save_final && (every == 0 || steps / every <= done / every)) {
    std::string why = every == 0 ? "is 0" : "divides none of steps " + std::to_string(done + 1) + ".." +
                                                std::to_string(steps);
    std::fprintf(stderr,
                 "moetrain train: warning: this run will save no checkpoint: checkpoint.save_final is false and "
                 "checkpoint.interval (%lld) %s; set checkpoint.save_final = true to keep its weights\n",
                 static_cast<long long>(every), why.c_str());
  }
  double lr = 0;
  int64_t skipped = 0;  // steps not applied (non-finite), this run
  bool metrics_lost = false;  // past metrics.max_lost_lines, on every rank
  while (trainer.steps_done() < cfg.training.steps) {
    StepResult r;
    try {
      r = trainer.step();
    } catch (const StepNotTaken& e) {
      // Nothing of the step was done: the last step done is saved, then the run stops.
      if (trainer.steps_done() > 0) save(lr);
      MT_FAIL() << e.message << ". Stopped before step " << trainer.steps_done() + 1 << "; the last checkpoint is "
                << (last_checkpoint.empty() ? std::string("none of this run's") : last_checkpoint)
                << " (step " << trainer.steps_done() << ")";
    }
    lr = r.lr;
    Trainer::Validation v;
    if (val.interval > 0 && r.step % val.interval == 0) {
      try {
        v = trainer.validate();
      } catch (const StepNotTaken& e) {
        // The step is done: its line and its checkpoint are kept, then the run stops.
        if (writer) note_lost(metrics.append(step_json(r) + "\n"), metrics.path(), r.step);
        save(lr);
        MT_FAIL() << e.message << ". Stopped at the validation after step " << r.step
                  << "; the last checkpoint is " << (last_checkpoint.empty() ? std::string("saved") : last_checkpoint)
                  << " (step " << trainer.steps_done() << ")";
      }
      r.val_on = true;
      r.val_loss = v.loss;
    }
    if (writer) {
      note_lost(metrics.append(step_json(r) + "\n"), metrics.path(), r.step);
      if (tb) note_lost(tb->scalars(r.step, r.time, step_scalars(r)), tb->path(), r.step);
      progress.step(r);
      if (r.val_on)
        progress.say("validation after step " + std::to_string(r.step) + ": val_loss " + std::to_string(v.loss) +
                     " over " + std::to_string(v.tokens) + " tokens (" + decimals(v.seconds, 2) + " s)");
    }
    if (!r.non_finite.empty()) {
      // Not applied (trainer.h). Within the allowance the run goes on; past it, it stops
      // before saving anything: no checkpoint holds a non-finite step.
      const std::string what = "step " + std::to_string(r.step) + ": the " + r.non_finite +
                               " is not finite (loss " + std::to_string(r.loss) + ", grad_norm " +
                               std::to_string(r.grad_norm) + "); its update was not applied";
      MT_CHECK(++skipped <= cfg.training.max_skipped_steps)
          << what << ". Stopping: " << skipped - 1 << " such steps were allowed (training.max_skipped_steps = "
          << cfg.training.max_skipped_steps << "); the last checkpoint is "
          << (last_checkpoint.empty() ? std::string("none of this run's") : last_checkpoint)
          << (r.step == 1 && resume.empty()
                  ? ". It came before any update, so the learning rate is not the cause: the initial weights (model.init, "
                    "model.init_std) or the config (the model's config.json, its dtype and sizes) give a non-finite "
                    "forward; moetrain eval on the weights shows the loss alone"
                  : ". A lower optimizer.lr or training.clip_grad_norm may help (docs/playbooks/debug-loss-spike.md)");
      if (writer) progress.say("warning: " + what + " (" + std::to_string(skipped) + " of training.max_skipped_steps = " +
                               std::to_string(cfg.training.max_skipped_steps) + ")");
    }
    // A signal reaches one rank or all, lost metrics rank 0 alone; every rank stops at
    // the same step.
    std::vector<int64_t> signalled = {g_first_signal.load() != 0 ? 1 : 0, lost > cfg.metrics.max_lost_lines ? 1 : 0};
    mesh.world().all_reduce(Tensor(signalled.data(), {2}, DType::i64));
    bool stop = signalled[0] > 0;
    metrics_lost = signalled[1] > 0;
    if ((cfg.checkpoint.interval > 0 && r.step % cfg.checkpoint.interval == 0) || stop) save(lr);
    if (metrics_lost && saved_step == r.step && !stop) break;
    if (stop) {
      if (writer) {
        progress.say("stopped by a signal after step " + std::to_string(r.step) + " (exit status " +
                     std::to_string(kStoppedBySignal) + ": resume by running the same command again)");
        progress.finish(last_checkpoint, "");
      }
      mesh.world().barrier();  // no rank ends the job before rank 0 has said so
      return kStoppedBySignal;
    }
  }
  // The end of a run is kept unless told not to (step 0 too: an export of the initial weights).
  if (cfg.checkpoint.save_final || metrics_lost) save(lr);
  if (writer) {
    progress.finish(last_checkpoint, "checkpoint.save_final = false and no step a multiple of checkpoint.interval");
    if (lost > 0)
      std::fprintf(stderr, "moetrain train: %s: %lld metrics line(s) or event(s) could not be written (warnings above)\n",
                   metrics_lost ? "error" : "warning", static_cast<long long>(lost));
    if (metrics_lost)
      std::fprintf(stderr, "moetrain train: error: stopped after step %lld, saved as %s, since more than "
                   "metrics.max_lost_lines = %lld could not be written: free space where %s is, then resume by running "
                   "the same command again (or raise metrics.max_lost_lines)\n",
                   static_cast<long long>(trainer.steps_done()), last_checkpoint.c_str(),
                   static_cast<long long>(cfg.metrics.max_lost_lines), folder.c_str());
  }
  mesh.world().barrier();
  return metrics_lost ? 1 : 0;
}

}  // namespace mt
