// Checkpoints: exact resume (in the library and across a SIGTERM or a crash in the
// middle of a save), malformed input, and the Hugging Face export.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "io/file.h"
#include "data/tokenizer.h"
#include "io/npy.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "test_util.h"

namespace mt {
namespace {

// The newest complete checkpoint folder under `checkpoints_dir`, or "" if none.
std::string latest_checkpoint(const std::string& checkpoints_dir) {
  const std::vector<std::string> all = complete_checkpoints(checkpoints_dir);
  return all.empty() ? "" : all.front();
}

namespace fs = std::filesystem;
using test::error_of;
const auto run = test::run_command;

// mpirun with two CPU ranks (CI runs as root, which Open MPI refuses unless told), in a
// session folder of its own (test_train.cpp's kMpirun says why).
const std::string kMpirun2 =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 "
    "OMPI_MCA_orte_tmpdir_base=$(mktemp -d /tmp/moetrain-mpi.XXXXXX) mpirun --oversubscribe -np 2 ";

std::string fixture(const std::string& name) { return std::string(MOETRAIN_FIXTURES) + "/" + name; }

std::string temp_dir(const std::string& name) { return test::temp_dir("ckpt_" + name); }

std::string hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::string file_text(const std::string& path) {
  std::vector<uint8_t> b = io::read_file(path);
  return std::string(b.begin(), b.end());
}


// A run with state worth restoring: warmup and cosine decay (the step count matters),
// weight decay, micro-batches, the load-balance loss, clipping.
Config resume_config(const std::string& dump, int64_t steps, const std::string& model) {
  Config c;
  c.model.init = "hf:" + fixture(model);
  c.data.tokens = fixture(model + "/tokens.npy");
  c.job.dump_folder = dump;
  c.training.steps = steps;
  c.training.micro_batch_size = 1;
  c.training.load_balance_coef = 0.01;
  c.training.clip_grad_norm = 0.5;
  c.optimizer.lr = 2e-3;
  c.optimizer.weight_decay = 0.1;
  c.lr_scheduler.warmup_steps = 2;
  c.lr_scheduler.decay = "cosine";
  return c;
}

std::vector<float> all_weights(Model& m) {
  std::vector<float> out;
  for (const HfTensor& t : m.hf_tensors()) out.insert(out.end(), t.value.f32(), t.value.f32() + t.value.numel());
  return out;
}

// Eight steps straight against four, a checkpoint, a fresh model and four more.
void check_exact_resume(const std::string& state_dtype, const std::string& model = "qwen3_moe_a",
                        Fp8 fp8 = Fp8::none, const std::string& optimizer = "adamw") {
  const int64_t n = 4;
  std::string dump = temp_dir("resume_" + state_dtype + model + (fp8 == Fp8::none ? "" : "_fp8") + optimizer);
  ModelOptions options;
  options.fp8 = fp8;
  options.mtp = has_mtp_weights(fixture(model));  // DeepSeek-V3's depths, where the fixture has them
  Config straight_cfg = resume_config(dump, 2 * n, model);
  straight_cfg.optimizer.state_dtype = state_dtype;
  straight_cfg.optimizer.name = optimizer;
  std::unique_ptr<Model> straight = make_model(fixture(model + "/config.json"), options);
  load_hf(*straight, fixture(model));
  Trainer a(straight_cfg, *straight, read_token_batch(straight_cfg.data.tokens, straight->vocab_size()));
  std::vector<StepResult> want;
  for (int64_t i = 0; i < 2 * n; ++i) want.push_back(a.step());

  std::unique_ptr<Model> first = make_model(fixture(model + "/config.json"), options);
  load_hf(*first, fixture(model));
  Trainer b(straight_cfg, *first, read_token_batch(straight_cfg.data.tokens, first->vocab_size()));
  for (int64_t i = 0; i < n; ++i) b.step();
  TrainState st;
  st.step = b.steps_done();
  st.expert_bias = b.expert_bias();  // DeepSeek-V3's correction bias, as save_run keeps it
  std::string dir = save_checkpoint(dump + "/checkpoints", *first, b.optimizer(), st,
                                    fixture(model + "/config.json"), "", 2);
  EXPECT_EQ(latest_checkpoint(dump + "/checkpoints"), dir);

  // A fresh process's view: a new model with other weights, then the checkpoint.
  std::unique_ptr<Model> second = make_model(fixture(model + "/config.json"), options);
  init_random(*second, 0.02, 99);
  Trainer c(straight_cfg, *second, read_token_batch(straight_cfg.data.tokens, second->vocab_size()));
  TrainState back = load_checkpoint(dir, *second, &c.optimizer());
  EXPECT_EQ(back.step, n);
  c.set_expert_bias(back.expert_bias);
  c.set_steps_done(back.step);
  for (int64_t i = n; i < 2 * n; ++i) {
    StepResult r = c.step();
    EXPECT_EQ(r.loss, want[i].loss) << "step " << i + 1;
    EXPECT_EQ(r.grad_norm, want[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(r.lr, want[i].lr) << "step " << i + 1;
    EXPECT_EQ(r.mtp_loss, want[i].mtp_loss) << "step " << i + 1;
  }
  EXPECT_EQ(all_weights(*second), all_weights(*straight));
}

TEST(Checkpoint, ResumeIsBitwiseExact) { check_exact_resume("fp32"); }
TEST(Checkpoint, ResumeIsBitwiseExactForDeepseekV2) { check_exact_resume("fp32", "deepseek_v2_a"); }
// DeepSeek-V3 with two multi-token prediction depths: their weights, moments and losses.
TEST(Checkpoint, ResumeIsBitwiseExactForDeepseekV3) { check_exact_resume("fp32", "deepseek_v3_mtp"); }
// GPT-OSS: its experts checkpointed one tensor each, its biases and sinks with them.
TEST(Checkpoint, ResumeIsBitwiseExactForGptOss) { check_exact_resume("fp32", "gpt_oss_a"); }

// bf16 moments go through the f32 checkpoint exactly, and the rounding noise depends
// only on the step and the element, so the resumed run repeats the straight one.
TEST(Checkpoint, ResumeIsBitwiseExactWithBf16Moments) { check_exact_resume("bf16"); }

// FP8: the weights' codes are derived from the checkpointed master weights on load, so
// the resumed run quantizes exactly as the straight one.
TEST(Checkpoint, ResumeIsBitwiseExactWithFp8) { check_exact_resume("fp32", "deepseek_v2_a", Fp8::blockwise); }

// Muon: the momentum (bf16 here, rounded stochastically) saved as "<key>.momentum" for its
// matrices and AdamW's moments for the rest; on the hybrid Qwen3.5 fixture (DeltaNet's
// projections Muon's, its A_log, dt_bias and conv AdamW's) and on DeepSeek-V2 (MLA).
TEST(Checkpoint, ResumeIsBitwiseExactWithMuon) {
  check_exact_resume("bf16", "qwen3_5_moe_b", Fp8::none, "muon");
  check_exact_resume("fp32", "deepseek_v2_a", Fp8::none, "muon");
}

TEST(Checkpoint, KeepsTheNewestCompleteOnes) {
  std::string dump = temp_dir("keep");
  std::unique_ptr<Model> m = make_model(fixture("qwen3_moe_b/config.json"));
  load_hf(*m, fixture("qwen3_moe_b"));
  Optimizer opt(m->params());
  for (int64_t s : {1, 2, 3, 4}) {
    TrainState st;
    st.step = s;
    save_checkpoint(dump, *m, opt, st, fixture("qwen3_moe_b/config.json"), "", 2);
  }
  // A crash after the rename but before the marker: that folder does not count.
  fs::create_directories(dump + "/step-00000009");
  EXPECT_FALSE(fs::exists(dump + "/step-00000001"));
  EXPECT_FALSE(fs::exists(dump + "/step-00000002"));
  EXPECT_TRUE(fs::exists(dump + "/step-00000003/COMPLETE"));
  EXPECT_EQ(latest_checkpoint(dump), dump + "/step-00000004");
}

// A run resumed from an earlier step into the same folder (a branch): its saves are
// written, over a step folder already there too, and rotation keeps the other branch's
// later steps. A train_state.json whose step is not its folder's is refused.
TEST(Checkpoint, BranchesAreWrittenAndLaterStepsKept) {
  std::string dump = temp_dir("branch");
  std::unique_ptr<Model> m = make_model(fixture("qwen3_moe_b/config.json"));
  load_hf(*m, fixture("qwen3_moe_b"));
  Optimizer opt(m->params());
  auto save = [&](int64_t step) {
    TrainState st;
    st.step = step;
    return save_checkpoint(dump, *m, opt, st, fixture("qwen3_moe_b/config.json"), "", 2);
  };
  auto bytes = [](const std::string& p) {
    std::vector<uint8_t> b = io::read_file(p);
    return std::string(b.begin(), b.end());
  };
  for (int64_t s : {2, 4, 8}) save(s);
  const std::string first8 = bytes(dump + "/step-00000008/model.safetensors");
  m->params()[0].value.f32()[0] += 1.0f;  // the branch's weights differ
  save(6);  // keeps 4 and 6 (the newest two up to 6) and the other branch's 8
  EXPECT_FALSE(fs::exists(dump + "/step-00000002"));
  for (const char* d : {"/step-00000004", "/step-00000006", "/step-00000008"})
    EXPECT_TRUE(fs::exists(dump + d + "/COMPLETE")) << d;
  save(8);
  EXPECT_FALSE(fs::exists(dump + "/step-00000004"));
  EXPECT_FALSE(fs::exists(dump + "/step-00000008.tmp"));
  EXPECT_NE(bytes(dump + "/step-00000008/model.safetensors"), first8) << "step 8 was not written anew";
  // Edited to another step: the manifest refuses it; without one (a checkpoint saved
  // before checksums), the folder's name does, naming both steps.
  std::string state = bytes(dump + "/step-00000006/train_state.json");
  state.replace(state.find("\"step\": 6"), 9, "\"step\": 999");
  std::ofstream(dump + "/step-00000006/train_state.json") << state;
  std::string e = error_of([&] { load_checkpoint(dump + "/step-00000006", *m, &opt); });
  EXPECT_NE(e.find("step-00000006/train_state.json holds"), std::string::npos) << e;
  io::write_file_atomic(dump + "/step-00000006/COMPLETE", {"6\n"});
  e = error_of([&] { load_checkpoint(dump + "/step-00000006", *m, &opt); });
  EXPECT_NE(e.find("step 999 but the folder is step 6"), std::string::npos) << e;
  // A key of the wrong type names the file and the key (it was nlohmann's bare type_error).
  state = bytes(dump + "/step-00000008/train_state.json");
  state.replace(state.find("\"seed\": 0"), 9, "\"seed\": \"x\"");
  std::ofstream(dump + "/step-00000008/train_state.json") << state;
  io::write_file_atomic(dump + "/step-00000008/COMPLETE", {"8\n"});
  const std::string e2 = error_of([&] { read_train_state(dump + "/step-00000008"); });
  EXPECT_NE(e2.find("step-00000008/train_state.json: key \"seed\" is \"x\" (expected an integer)"), std::string::npos)
      << e2;
}

// ---- malformed input ---------------------------------------------------------------

class BrokenCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dump_ = temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    model_ = make_model(fixture("qwen3_moe_a/config.json"));
    load_hf(*model_, fixture("qwen3_moe_a"));
    opt_ = std::make_unique<Optimizer>(model_->params());
    TrainState st;
    st.step = 3;
    dir_ = save_checkpoint(dump_, *model_, *opt_, st, fixture("qwen3_moe_a/config.json"), "", 1);
  }
  // Rewrites model.safetensors through `edit` (which may drop, add or reshape keys).
  void rewrite(const std::function<void(std::vector<io::StWrite>&)>& edit) {
    io::SafetensorsFile f(dir_ + "/model.safetensors");
    std::vector<std::vector<float>> keep;
    std::vector<io::StWrite> w;
    keep.reserve(f.tensors().size() + 1);
    for (const io::StTensor& t : f.tensors()) {
      keep.emplace_back(static_cast<size_t>(t.numel()));
      f.read_f32(t, keep.back().data());
      w.push_back(io::st_f32(t.name, t.shape, keep.back().data()));
    }
    edit(w);
    io::write_safetensors(dir_ + "/model.safetensors.new", w);
    fs::rename(dir_ + "/model.safetensors.new", dir_ + "/model.safetensors");
    unseal();
  }
  // COMPLETE as checkpoints wrote it before checksums, so that the files' own checks are
  // what refuse them.
  void unseal() { io::write_file_atomic(dir_ + "/COMPLETE", {"3\n"}); }
  std::string load_error() {
    return error_of([&] { load_checkpoint(dir_, *model_, opt_.get()); });
  }
  std::string dump_, dir_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Optimizer> opt_;
};

TEST_F(BrokenCheckpoint, MissingKey) {
  rewrite([](std::vector<io::StWrite>& w) {
    w.erase(std::find_if(w.begin(), w.end(), [](auto& x) { return x.name == "model.layers.1.mlp.up_proj.weight"; }));
  });
  std::string e = load_error();
  EXPECT_NE(e.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find(dir_), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, ExtraKey) {
  static float extra[3] = {1, 2, 3};
  rewrite([](std::vector<io::StWrite>& w) { w.push_back(io::st_f32("model.layers.9.bogus.weight", {3}, extra)); });
  std::string e = load_error();
  EXPECT_NE(e.find("model.layers.9.bogus.weight is not a parameter of this model"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, AnotherModelConfig) {
  std::unique_ptr<Model> other = make_model(fixture("qwen3_moe_b/config.json"));
  std::string e = error_of([&] { load_checkpoint(dir_, *other, nullptr); });
  // The first tensor both models have, with both shapes.
  EXPECT_NE(e.find("model.embed_tokens.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("[96,32]"), std::string::npos) << e;
  EXPECT_NE(e.find("[80,24]"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, TruncatedFile) {
  const uintmax_t size = fs::file_size(dir_ + "/optimizer.safetensors");
  fs::resize_file(dir_ + "/optimizer.safetensors", size - 100);
  std::string e = load_error();
  EXPECT_NE(e.find(dir_ + "/optimizer.safetensors holds " + std::to_string(size - 100) + " bytes, expected " +
                   std::to_string(size) + " (as saved): truncated"),
            std::string::npos)
      << e;
  unseal();  // the safetensors header's own check
  e = load_error();
  EXPECT_NE(e.find("optimizer.safetensors: tensor"), std::string::npos) << e;
}

// COMPLETE lists every other file with its size and checksum; a correct checkpoint
// verifies, and a flipped bit in a tensor's data is an error naming the file and both
// checksums. The generate path (no optimizer) does not read the optimizer's file.
TEST_F(BrokenCheckpoint, AFlippedByteIsAnErrorNamingTheFile) {
  nlohmann::json manifest = nlohmann::json::parse(io::read_file(dir_ + "/COMPLETE"));
  EXPECT_EQ(manifest["step"], 3);
  std::set<std::string> listed, there;
  for (const auto& [name, e] : manifest["files"].items()) listed.insert(name);
  for (const auto& e : fs::directory_iterator(dir_)) there.insert(e.path().filename().string());
  there.erase("COMPLETE");
  EXPECT_EQ(listed, there);
  EXPECT_EQ(manifest["files"]["model.safetensors"]["bytes"], fs::file_size(dir_ + "/model.safetensors"));
  EXPECT_NO_THROW(verify_checkpoint(dir_, true));
  EXPECT_EQ(load_error(), "(no error)");

  const std::string file = dir_ + "/optimizer.safetensors";
  std::string b = file_text(file);
  b[b.size() - 5] ^= 0x10;  // one bit of the last tensor's data
  io::write_file_atomic(file, {b});
  const std::string want = manifest["files"]["optimizer.safetensors"]["xxh3"], found = hex(io::file_sum(file).xxh3);
  const std::string e = load_error();
  EXPECT_NE(e.find(file + " has XXH3 checksum " + found + ", expected " + want +
                   " (as saved); the checkpoint is damaged: use an earlier one"),
            std::string::npos)
      << e;
  EXPECT_EQ(error_of([&] { load_checkpoint(dir_, *model_, nullptr); }), "(no error)");
}

// A checkpoint saved before checksums loads, with a note that it cannot be verified; a
// COMPLETE that is neither that nor a manifest is damage.
TEST_F(BrokenCheckpoint, ACheckpointWithoutChecksumsLoadsWithANote) {
  unseal();
  ::testing::internal::CaptureStderr();
  const std::string e = load_error();
  const std::string note = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(e, "(no error)");
  EXPECT_EQ(note, "moetrain: note: " + dir_ + " has no checksums (saved before checkpoints recorded them), so its "
                  "files cannot be verified\n");
  io::write_file_atomic(dir_ + "/COMPLETE", {"{\"step\": 3, \"files\""});
  EXPECT_NE(load_error().find(dir_ + "/COMPLETE is not a manifest"), std::string::npos) << load_error();
}

TEST_F(BrokenCheckpoint, HeaderLiesAboutOffsets) {
  // Grow the first tensor's end offset in the JSON header by one element.
  std::vector<uint8_t> b = io::read_file(dir_ + "/model.safetensors");
  uint64_t n;
  std::memcpy(&n, b.data(), 8);
  std::string header(reinterpret_cast<char*>(b.data()) + 8, n);
  size_t at = header.find("\"data_offsets\":[0,");
  ASSERT_NE(at, std::string::npos) << header.substr(0, 200);
  size_t num = at + 18, end = header.find(']', num);
  std::string bigger = std::to_string(std::stoll(header.substr(num, end - num)) + 4);
  std::string lie = header.substr(0, num) + bigger + header.substr(end);
  lie.resize(n, ' ');  // same header length, so only the offsets lie
  std::memcpy(b.data() + 8, lie.data(), n);
  io::write_file_atomic(dir_ + "/model.safetensors", {std::string_view(reinterpret_cast<char*>(b.data()), b.size())});
  std::string e = load_error();
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
}

TEST_F(BrokenCheckpoint, IncompleteIsRefused) {
  fs::remove(dir_ + "/COMPLETE");
  EXPECT_NE(load_error().find("is not a complete checkpoint"), std::string::npos);
  EXPECT_EQ(latest_checkpoint(dump_), "");
}

TEST_F(BrokenCheckpoint, UnwritableFolder) {
  // A path through a regular file cannot be created, even by root.
  std::ofstream(dump_ + "/plain_file") << "x";
  TrainState st;
  st.step = 4;
  std::string e = error_of([&] {
    save_checkpoint(dump_ + "/plain_file/checkpoints", *model_, *opt_, st, fixture("qwen3_moe_a/config.json"), "", 1);
  });
  EXPECT_NE(e.find("plain_file/checkpoints"), std::string::npos) << e;
}

// ---- the train and export-hf commands ------------------------------------------------


std::string train_cmd(const std::string& dump, int64_t steps, const std::string& extra = "") {
  return std::string(MOETRAIN_BIN) + " train --model.init=hf:" + fixture("qwen3_moe_a") +
         " --data.tokens=" + fixture("qwen3_moe_a/tokens.npy") + " --training.micro_batch_size=1" +
         " --training.load_balance_coef=0.01 --optimizer.lr=2e-3 --lr_scheduler.warmup_steps=3" +
         " --lr_scheduler.decay=cosine --job.dump_folder=" + dump + " --training.steps=" + std::to_string(steps) +
         " " + extra;
}

std::vector<std::string> metric_lines(const std::string& dump) {
  std::ifstream in(dump + "/metrics.jsonl");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    // tokens_per_s and the time differ between runs; everything else must not.
    nlohmann::json j = nlohmann::json::parse(line);
    j.erase("tokens_per_s");
    j.erase("time");
    out.push_back(j.dump());
  }
  return out;
}

// The metrics lines `got` continue the run `want` from its line `first`: loss and
// grad_norm within 1e-5 (another mesh sums in another order).
void expect_continues(const std::vector<std::string>& got, const std::vector<std::string>& want, size_t first,
                      const std::string& what) {
  ASSERT_LE(first + got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    nlohmann::json x = nlohmann::json::parse(got[i]), y = nlohmann::json::parse(want[first + i]);
    for (const char* key : {"loss", "grad_norm"})
      EXPECT_NEAR(x[key].get<double>(), y[key].get<double>(), 1e-5 * y[key].get<double>())
          << what << " step " << first + i + 1 << " " << key;
  }
}

pid_t spawn(const std::string& cmd, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    std::string full = "exec " + cmd + " > " + log + " 2>&1";
    execl("/bin/sh", "sh", "-c", full.c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

bool wait_for(const std::function<bool()>& cond, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST(CheckpointCommands, SigtermSavesAndResumeIsExact) {
  std::string dump = temp_dir("sigterm");
  // A constant schedule after warmup: the cosine horizon depends on training.steps,
  // which differs between the interrupted run and the reference.
  const std::string constant = "--lr_scheduler.decay=constant";
  pid_t pid = spawn(train_cmd(dump, 100000, constant), dump + "/log");
  ASSERT_TRUE(wait_for([&] { return metric_lines(dump).size() >= 3; }, 60)) << "the run did not start";
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 75) << file_text(dump + "/log");
  std::string ckpt = latest_checkpoint(dump + "/checkpoints");
  ASSERT_FALSE(ckpt.empty());
  int64_t stopped = static_cast<int64_t>(metric_lines(dump).size());
  EXPECT_EQ(ckpt, dump + "/checkpoints/step-" + std::string(8 - std::to_string(stopped).size(), '0') +
                      std::to_string(stopped));
  // Resume to stopped + 3 and compare with a straight run of as many steps.
  auto [rc, out] = run(train_cmd(dump, stopped + 3, constant + " --checkpoint.interval=1000000"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
  std::string straight = temp_dir("sigterm_straight");
  auto [rc2, out2] = run(train_cmd(straight, stopped + 3, constant + " --checkpoint.interval=1000000"));
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_EQ(metric_lines(dump), metric_lines(straight));
  io::SafetensorsFile a(latest_checkpoint(dump + "/checkpoints") + "/model.safetensors");
  io::SafetensorsFile b(latest_checkpoint(straight + "/checkpoints") + "/model.safetensors");
  for (const io::StTensor& t : a.tensors()) {
    auto x = a.bytes(t), y = b.bytes(*b.find(t.name));
    ASSERT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << t.name;
  }
}

// ---- reliability: one run a folder, signals as schedulers send them, readers that
// verify and survive rotation, bounded reads ------------------------------------------

// The exit status of a spawned child, or -1 while it runs.
int exited(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, WNOHANG) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// metrics.jsonl holds steps 1..n, each line whole.
void expect_steps_whole(const std::string& dump) {
  std::ifstream in(dump + "/metrics.jsonl");
  std::string line;
  int64_t want = 1;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_TRUE(j.is_object()) << "a broken line in " << dump << "/metrics.jsonl: " << line;
    EXPECT_EQ(j["step"].get<int64_t>(), want++) << dump;
  }
  EXPECT_GT(want, 1) << dump;
}

// Two trains on one folder: the second is refused at once, naming the first's pid, and
// the first goes on untouched, whether started 3 s apart or together; under mpirun too.
TEST(CheckpointCommands, OneRunAFolder) {
  const std::string dump = temp_dir("one_writer");
  const std::string constant = "--lr_scheduler.decay=constant --checkpoint.interval=1000000";
  const pid_t first = spawn(train_cmd(dump, 1000000, constant), dump + ".log");
  ASSERT_TRUE(wait_for([&] { return metric_lines(dump).size() >= 3; }, 60)) << file_text(dump + ".log");
  std::this_thread::sleep_for(std::chrono::seconds(3));
  auto [rc, out] = run(train_cmd(dump, 5, constant));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("job.dump_folder " + dump + " is in use: " + dump + "/moetrain.lock is held by pid " +
                     std::to_string(first) + " on host "),
            std::string::npos)
      << out;
  if (run("command -v mpirun").first == 0) {
    std::tie(rc, out) = run(kMpirun2 + train_cmd(dump, 5, constant + " --parallelism.ep=2"));
    EXPECT_NE(rc, 0) << out;
    EXPECT_NE(out.find("is held by pid " + std::to_string(first)), std::string::npos) << out;
    EXPECT_NE(out.find("error on rank 1: rank 0 cannot have the run folder"), std::string::npos) << out;
  }
  EXPECT_EQ(exited(first), -1) << "the first run stopped";
  kill(first, SIGTERM);
  EXPECT_EQ(wait_exit(first), 75) << file_text(dump + ".log");
  expect_steps_whole(dump);
  EXPECT_FALSE(fs::exists(dump + "/moetrain.lock"));
  // Started together: one runs, the other is refused.
  const std::string both = temp_dir("one_writer_both");
  const pid_t a = spawn(train_cmd(both, 1000000, constant), both + ".a.log");
  const pid_t b = spawn(train_cmd(both, 1000000, constant), both + ".b.log");
  int ra = -1, rb = -1;
  ASSERT_TRUE(wait_for([&] { return (ra = exited(a)) >= 0 || (rb = exited(b)) >= 0; }, 60));
  const pid_t winner = ra >= 0 ? b : a;
  EXPECT_EQ(ra >= 0 ? ra : rb, 1);
  const std::string lost = file_text(both + (ra >= 0 ? ".a.log" : ".b.log"));
  EXPECT_NE(lost.find("is held by pid " + std::to_string(winner)), std::string::npos) << lost;
  ASSERT_TRUE(wait_for([&] { return metric_lines(both).size() >= 3; }, 60));
  kill(winner, SIGTERM);
  EXPECT_EQ(wait_exit(winner), 75);
  expect_steps_whole(both);
}

// A run folder that cannot be written is said to be so, not "in use": a procfs folder
// (no file can be made there, as root too) and, where the test is not root, a folder
// without write permission.
TEST(CheckpointCommands, AnUnwritableFolderIsNotCalledInUse) {
  std::vector<std::string> folders = {"/proc/self"};
  if (geteuid() != 0) {
    folders.push_back(temp_dir("read_only"));
    fs::permissions(folders.back(), fs::perms::owner_read | fs::perms::owner_exec);
  }
  for (const std::string& dump : folders) {
    auto [rc, out] = run(train_cmd(dump, 1, ""));
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find("job.dump_folder " + dump + " cannot be written: cannot open the lock file " + dump +
                       "/moetrain.lock: "),
              std::string::npos)
        << out;
    EXPECT_EQ(out.find("in use"), std::string::npos) << out;
  }
}

// A wrapper that forwards a signal to a group that got it already (timeout does) is one
// request: the step is saved, the exit status is 75, and the run resumes bit for bit.
// So are SIGTERMs sent to every rank (Slurm's form) and a kill of mpirun's process group.
TEST(CheckpointCommands, SignalsThroughWrappersAreOneRequest) {
  const std::string constant = "--lr_scheduler.decay=constant";
  auto resumes_exactly = [&](const std::string& dump, const std::string& launch, const std::string& flags) {
    const int64_t stopped = static_cast<int64_t>(metric_lines(dump).size());
    ASSERT_GE(stopped, 3) << dump;
    EXPECT_EQ(latest_checkpoint(dump + "/checkpoints"),
              dump + "/checkpoints/step-" + std::string(8 - std::to_string(stopped).size(), '0') +
                  std::to_string(stopped));
    auto [rc, out] = run(launch + train_cmd(dump, stopped + 3, constant + flags));
    ASSERT_EQ(rc, 0) << out;
    const std::string straight = dump + "_straight";
    fs::remove_all(straight);  // an earlier run's, in a build folder used again
    std::tie(rc, out) = run(launch + train_cmd(straight, stopped + 3, constant + flags));
    ASSERT_EQ(rc, 0) << out;
    EXPECT_EQ(metric_lines(dump), metric_lines(straight)) << dump;
  };
  const std::string dump = temp_dir("timeout");
  const pid_t wrapper = spawn("timeout -s TERM 600 " + train_cmd(dump, 1000000, constant), dump + ".log");
  ASSERT_TRUE(wait_for([&] { return metric_lines(dump).size() >= 3; }, 60)) << file_text(dump + ".log");
  kill(wrapper, SIGTERM);  // timeout passes it on to moetrain, and to its whole group
  wait_exit(wrapper);
  const std::string log = file_text(dump + ".log");
  EXPECT_NE(log.find("stopped by a signal after step"), std::string::npos) << log;
  EXPECT_EQ(log.find("exiting now"), std::string::npos) << log;
  resumes_exactly(dump, "", "");
  if (run("command -v mpirun").first != 0) GTEST_SKIP() << "mpirun not found";
  // Four sequences, two a rank.
  io::NpyArray three = io::read_npy(fixture("qwen3_moe_a/tokens.npy"));
  std::vector<int64_t> four = io::npy_as_int64(three, "tokens");
  const int64_t t = three.header.shape[1];
  four.insert(four.end(), four.begin(), four.begin() + t);
  test::write_npy(dump + "_four.npy", "<i8", {4, t}, four.data());
  const std::string ep = " --parallelism.ep=2 --data.tokens=" + dump + "_four.npy";
  for (const std::string form : {"ranks", "group"}) {
    const std::string d = temp_dir("mpirun_" + form);
    // mpirun, given SIGTERM itself, kills the ranks odls_base_sigkill_timeout seconds later
    // and waits twice that (the test takes as long): 5 s is enough for this save on a
    // loaded 2-core machine, where 3 s was not always.
    const pid_t m = spawn("setsid env " + kMpirun2 + "--mca odls_base_sigkill_timeout 5 " +
                          train_cmd(d, 1000000, constant + ep), d + ".log");
    ASSERT_TRUE(wait_for([&] { return metric_lines(d).size() >= 3; }, 60)) << file_text(d + ".log");
    if (form == "group") {
      kill(-m, SIGTERM);
    } else {
      auto [rc, ranks] = run("pgrep -P " + std::to_string(m));
      std::istringstream pids(ranks);
      for (pid_t p; pids >> p;) kill(p, SIGTERM);
    }
    const int status = wait_exit(m);
    if (form == "ranks") {
      EXPECT_EQ(status, 75) << file_text(d + ".log");
    }
    resumes_exactly(d, kMpirun2, ep);
  }
}

// eval verifies a checkpoint folder as generate and export-hf do: a flipped byte is an
// error naming the file, never a loss of null; a loss that is not finite is an error.
TEST(CheckpointCommands, EvalVerifiesTheCheckpoint) {
  const std::string dump = temp_dir("eval_verify");
  auto [rc, out] = run(train_cmd(dump, 2));
  ASSERT_EQ(rc, 0) << out;
  const std::string ckpt = dump + "/checkpoints/step-00000002";
  const std::string eval = std::string(MOETRAIN_BIN) + " eval --tokens " + fixture("qwen3_moe_a/tokens.npy") + " --model ";
  std::tie(rc, out) = run(eval + ckpt);
  ASSERT_EQ(rc, 0) << out;
  const double loss = nlohmann::json::parse(out)["loss"].get<double>();
  std::tie(rc, out) = run(eval + dump);  // the run folder: its newest
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["loss"].get<double>(), loss);
  {
    std::fstream f(ckpt + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');  // a float's high byte: a NaN where the manifest is not checked
  }
  std::tie(rc, out) = run(eval + ckpt);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("model.safetensors has XXH3 checksum"), std::string::npos) << out;
  EXPECT_EQ(out.find("null"), std::string::npos) << out;
  // A Hugging Face folder has no manifest: a NaN weight there gives a loss that is refused.
  const std::string hf = dump + "/hf";
  fs::create_directories(hf);
  fs::copy_file(fixture("qwen3_moe_a/config.json"), hf + "/config.json");
  {
    io::SafetensorsFile in(fixture("qwen3_moe_a/model.safetensors"));
    std::vector<std::vector<uint8_t>> data;
    std::vector<io::StWrite> out;
    for (const io::StTensor& t : in.tensors()) {
      auto b = in.bytes(t);
      std::vector<uint8_t>& d = data.emplace_back(b.begin(), b.end());
      if (t.name == "model.norm.weight") {
        ASSERT_EQ(t.dtype, "F32");
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(d.data(), &nan, 4);
      }
      out.push_back({t.name, t.dtype, t.shape, d.data()});
    }
    io::write_safetensors(hf + "/model.safetensors", out, {});
  }
  std::tie(rc, out) = run(eval + hf);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("is nan over 48 tokens: the weights hold a non-finite value"), std::string::npos) << out;
}

// export-hf (and eval) of a run folder while the run saves every step with keep = 1: each
// export is whole and of a step the run saved, with no raw filesystem error, no false
// report of damage and nothing left beside the output.
TEST(CheckpointCommands, ExportsSurviveARunRotatingItsCheckpoints) {
  const std::string dump = temp_dir("rotating");
  const pid_t trainer = spawn(train_cmd(dump, 1000000, "--lr_scheduler.decay=constant --checkpoint.interval=1 "
                                                       "--checkpoint.keep=1"),
                              dump + ".log");
  ASSERT_TRUE(wait_for([&] { return !latest_checkpoint(dump + "/checkpoints").empty(); }, 60));
  // An export that loses its checkpoint twice in a row says so plainly (a slow machine:
  // the sanitizers' build); every other one is whole.
  int whole = 0;
  for (int i = 0; i < 20; ++i) {
    auto [rc, out] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dump + " --output " + dump +
                         "/hf --force");
    EXPECT_EQ(out.find("restore the damaged"), std::string::npos) << out;
    EXPECT_EQ(out.find("directory iterator"), std::string::npos) << out;
    if (rc != 0) {
      EXPECT_NE(out.find("faster than they can be read"), std::string::npos) << i << ": " << out;
      continue;
    }
    ++whole;
    EXPECT_NE(out.find("/checkpoints/step-"), std::string::npos) << out;
    EXPECT_EQ(out.rfind("exported ", 0) == 0 || out.find("\nexported ") != std::string::npos, true) << out;
  }
  std::printf("exports whole while the run rotated: %d of 20\n", whole);
  // How many win the race depends on the machine's load (5 of 20 under the sanitizers on
  // a loaded 2-core machine, where the run saves as fast as an export reads): each one
  // above is whole or says so plainly, and some must get through.
  EXPECT_GE(whole, 1);
  EXPECT_EQ(exited(trainer), -1);
  kill(trainer, SIGTERM);
  EXPECT_EQ(wait_exit(trainer), 75);
  for (const char* left : {"/hf.tmp", "/hf.old", "/hf.lock"}) EXPECT_FALSE(fs::exists(dump + left)) << left;
  for (const auto& e : fs::directory_iterator(dump + "/checkpoints"))
    EXPECT_FALSE(e.path().string().ends_with(".tmp")) << e.path();
  auto [rc, out] = run(std::string(MOETRAIN_BIN) + " eval --model " + dump + "/hf --tokens " +
                       fixture("qwen3_moe_a/tokens.npy"));
  EXPECT_EQ(rc, 0) << out;
}

// Two exports to one output at once: each is refused while the other writes, or runs
// after it; the output is always one checkpoint's export whole, never a blend.
TEST(CheckpointCommands, TwoExportsToOneOutputNeverBlend) {
  const std::string dump = temp_dir("two_exports");
  auto [rc, out] = run(train_cmd(dump, 2, "--checkpoint.interval=1"));
  ASSERT_EQ(rc, 0) << out;
  auto export_cmd = [&](int step, const std::string& dest) {
    return std::string(MOETRAIN_BIN) + " export-hf --force --max-shard-size 20000 --checkpoint " + dump +
           "/checkpoints/step-0000000" + std::to_string(step) + " --output " + dest;
  };
  std::vector<std::string> whole;  // each step's export alone, its shards' bytes
  auto shards_of = [&](const std::string& dir) {
    std::string all;
    for (int k = 1; fs::exists(dir + "/model.safetensors.index.json"); ++k) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05d-of-", k);
      bool found = false;
      for (const auto& e : fs::directory_iterator(dir))
        if (e.path().filename().string().rfind(name, 0) == 0) {
          all += file_text(e.path().string());
          found = true;
        }
      if (!found) break;
    }
    return all;
  };
  for (int step : {1, 2}) {
    std::tie(rc, out) = run(export_cmd(step, dump + "/alone" + std::to_string(step)));
    ASSERT_EQ(rc, 0) << out;
    whole.push_back(shards_of(dump + "/alone" + std::to_string(step)));
    ASSERT_FALSE(whole.back().empty());
  }
  ASSERT_NE(whole[0], whole[1]);
  int refused = 0;
  for (int round = 0; round < 10; ++round) {
    const pid_t a = spawn(export_cmd(1, dump + "/hf"), dump + "/a.log");
    const pid_t b = spawn(export_cmd(2, dump + "/hf"), dump + "/b.log");
    for (auto [pid, log] : {std::pair{a, dump + "/a.log"}, std::pair{b, dump + "/b.log"}}) {
      const int status = wait_exit(pid);
      const std::string text = file_text(log);
      if (status != 0) {
        EXPECT_NE(text.find("is being written by another export"), std::string::npos) << text;
        ++refused;
      }
    }
    const std::string got = shards_of(dump + "/hf");
    EXPECT_TRUE(got == whole[0] || got == whole[1]) << "round " << round << ": the output is not one export whole";
    for (const char* left : {"/hf.tmp", "/hf.old", "/hf.lock"}) EXPECT_FALSE(fs::exists(dump + left)) << left;
  }
  std::printf("exports refused while another wrote: %d of 20\n", refused);
}

// Reads are bounded: a device or a folder where a file belongs is a named error, not a
// read without end; sequences past max_position_embeddings are refused (or allowed, with a
// warning); `..` in a run folder makes no stray folder.
TEST(CheckpointCommands, BadPathsAndLongSequencesAreRefused) {
  const std::string dump = temp_dir("bounded");
  auto [rc, out] = run(train_cmd(dump + "/a", 1, "--data.tokens=/dev/zero"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("/dev/zero is a character device, where a regular file was expected"), std::string::npos) << out;
  std::tie(rc, out) = run(std::string(MOETRAIN_BIN) + " eval --model " + fixture("qwen3_moe_a") + " --tokens /dev/urandom");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("/dev/urandom is a character device"), std::string::npos) << out;
  std::tie(rc, out) = run(train_cmd(dump + "/a", 1, "--data.tokens=" + dump));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("data.tokens = '" + dump + "' is a folder, where a .npy [B, T] token matrix was expected"),
            std::string::npos)
      << out;
  EXPECT_FALSE(fs::exists(dump + "/a"));
  // qwen3_moe_a is made for 64 positions.
  std::vector<int64_t> tokens(2 * 81);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>(i % 50);
  test::write_npy(dump + "/long.npy", "<i8", {2, 81}, tokens.data());
  const std::string long_run = std::string(MOETRAIN_BIN) + " train --model.init=hf:" + fixture("qwen3_moe_a") +
                               " --data.tokens=" + dump + "/long.npy --training.steps=1 --job.dump_folder=" + dump;
  std::tie(rc, out) = run(long_run + "/long");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("sequences of 80 tokens, past the model's max_position_embeddings (64 in "), std::string::npos)
      << out;
  EXPECT_FALSE(fs::exists(dump + "/long"));
  std::tie(rc, out) = run(long_run + "/long --data.allow_past_max_positions=true");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("warning: sequences of 80 tokens"), std::string::npos) << out;
  std::tie(rc, out) = run(std::string(MOETRAIN_BIN) + " generate --model " + fixture("qwen3_moe_a") +
                          " --prompt-ids 1,2,3 --max-new-tokens 100");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("stopped at the model's max_position_embeddings (64 tokens) after 61 new"), std::string::npos)
      << out;
  std::tie(rc, out) = run(train_cmd(dump + "/x/y/../z", 1));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(fs::exists(dump + "/x/z/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dump + "/x/y"));
}


// A resume prints the keys changed since its checkpoint, refuses a change that breaks
// an exact resume (naming the key and both values) unless
// checkpoint.allow_config_change, and keeps every config the run ran with: config.toml
// from its start, config.step-N.toml from each resume at step N.
TEST(CheckpointCommands, ResumeReportsAndRefusesConfigChanges) {
  const std::string dump = temp_dir("config_change"), ckpt = dump + "/checkpoints/step-0000000";
  auto config_of = [&](const std::string& name) {
    std::vector<uint8_t> b = io::read_file(dump + "/" + name);
    return std::string(b.begin(), b.end());
  };
  const std::string every2 = "--checkpoint.interval=2 ";
  auto [rc, out] = run(train_cmd(dump, 2, every2));
  ASSERT_EQ(rc, 0) << out;
  // A changed micro-batch size is refused before anything is written.
  std::tie(rc, out) = run(train_cmd(dump, 4, every2 + "--training.micro_batch_size=3"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("moetrain train: error: training.micro_batch_size (1 -> 3) changed since " + ckpt +
                     "2 was saved, and an exact resume needs them unchanged"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("--checkpoint.allow_config_change=true"), std::string::npos) << out;
  EXPECT_EQ(metric_lines(dump).size(), 2u);
  EXPECT_FALSE(fs::exists(dump + "/config.step-00000002.toml"));
  // Allowed, it resumes and prints what changed.
  std::tie(rc, out) =
      run(train_cmd(dump, 4, every2 + "--training.micro_batch_size=3 --checkpoint.allow_config_change=true"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("config changed since " + ckpt + "2:\n  training.steps: 2 -> 4\n"
                     "  training.micro_batch_size: 1 -> 3\n  checkpoint.allow_config_change: false -> true\n"
                     "moetrain train: "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "2 (step 2)"), std::string::npos) << out;
  EXPECT_EQ(metric_lines(dump).size(), 4u);
  // A change exact resume survives (the learning rate) needs no permission.
  std::tie(rc, out) = run(train_cmd(dump, 5, every2 + "--training.micro_batch_size=3 --optimizer.lr=1e-3"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("config changed since " + ckpt + "4:\n  training.steps: 4 -> 5\n  optimizer.lr: 0.002 -> "
                     "0.001\n  checkpoint.allow_config_change: true -> false\n"),
            std::string::npos)
      << out;
  EXPECT_EQ(metric_lines(dump).size(), 5u);
  // Every config the run ran with is kept.
  EXPECT_NE(config_of("config.toml").find("\nsteps = 2\nglobal_batch_size = 0\nmicro_batch_size = 1\n"),
            std::string::npos);
  EXPECT_NE(config_of("config.step-00000002.toml").find("\nsteps = 4\nglobal_batch_size = 0\nmicro_batch_size = 3\n"),
            std::string::npos);
  EXPECT_NE(config_of("config.step-00000004.toml").find("\nsteps = 5\n"), std::string::npos);
  EXPECT_NE(config_of("config.step-00000004.toml").find("\nlr = 0.001\n"), std::string::npos);
  EXPECT_NE(config_of("config.toml").find("\nlr = 0.002\n"), std::string::npos);
}

TEST(CheckpointCommands, CrashInTheMiddleOfASaveResumesFromThePreviousOne) {
  std::string dump = temp_dir("crash");
  // Each file of a save is followed by a pause, so the kill lands inside the save.
  pid_t pid = spawn("env MOETRAIN_CHECKPOINT_DELAY_MS=400 " + train_cmd(dump, 6, "--checkpoint.interval=2"),
                    dump + "/log");
  ASSERT_TRUE(wait_for([&] { return fs::exists(dump + "/checkpoints/step-00000004.tmp/model.safetensors"); }, 60));
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  EXPECT_EQ(latest_checkpoint(dump + "/checkpoints"), dump + "/checkpoints/step-00000002");
  auto [rc, out] = run(train_cmd(dump, 6, "--checkpoint.interval=2"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("step-00000002 (step 2)"), std::string::npos) << out;
  std::string straight = temp_dir("crash_straight");
  auto [rc2, out2] = run(train_cmd(straight, 6));
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_EQ(metric_lines(dump), metric_lines(straight));
  EXPECT_FALSE(fs::exists(dump + "/checkpoints/step-00000004.tmp"));
}

// A step saved again (here step 4, damaged, skipped by the resume, which trains from
// step 2 and saves step 4 anew) replaces the old folder only once the new one is
// complete: killed in between, the old one sits aside as step-N.old, which a resume
// still considers while step-N is incomplete (and skips, naming it, when damaged); the
// next save clears what the kill left.
TEST(CheckpointCommands, ReplacingAStepKeepsTheOldCopyUntilTheNewIsComplete) {
  const std::string dump = temp_dir("replace"), ckpt = dump + "/checkpoints/step-0000000";
  auto [rc, out] = run(train_cmd(dump, 4, "--checkpoint.interval=2"));
  ASSERT_EQ(rc, 0) << out;
  const std::vector<std::string> straight = metric_lines(dump);
  fs::resize_file(ckpt + "4/model.safetensors", fs::file_size(ckpt + "4/model.safetensors") - 100);
  pid_t pid = spawn("env MOETRAIN_CHECKPOINT_DELAY_MS=300 " + train_cmd(dump, 4, "--checkpoint.interval=2"),
                    dump + "/log");
  ASSERT_TRUE(wait_for([&] { return fs::exists(ckpt + "4.old/COMPLETE"); }, 60)) << file_text(dump + "/log");
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  EXPECT_FALSE(fs::exists(ckpt + "4/COMPLETE"));
  EXPECT_EQ(latest_checkpoint(dump + "/checkpoints"), ckpt + "4.old");
  std::tie(rc, out) = run(train_cmd(dump, 4, "--checkpoint.interval=2"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("warning: skipping " + ckpt + "4.old: model.safetensors holds"), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "2 (step 2)"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(ckpt + "4/COMPLETE"));
  EXPECT_FALSE(fs::exists(ckpt + "4.old"));
  EXPECT_FALSE(fs::exists(ckpt + "4.tmp"));
  EXPECT_EQ(metric_lines(dump), straight);
}

// Auto-resume skips a damaged checkpoint (here the newest, truncated) for the one before
// it, naming it, and loads that one exactly: saved again, its files are byte for byte
// what they were (with checkpoint.keep = 1 too: the checkpoint just saved is kept).
// Named by checkpoint.load, the damaged one is an error; with none intact, so is the run.
TEST(CheckpointCommands, AutoResumeSkipsADamagedCheckpoint) {
  const std::string dump = temp_dir("damaged"), ckpt = dump + "/checkpoints/step-0000000";
  auto [rc, out] = run(train_cmd(dump, 2, "--checkpoint.interval=1"));
  ASSERT_EQ(rc, 0) << out;
  const std::string model1 = file_text(ckpt + "1/model.safetensors");
  const std::string moments1 = file_text(ckpt + "1/optimizer.safetensors");
  const uintmax_t size = fs::file_size(ckpt + "2/model.safetensors");
  fs::resize_file(ckpt + "2/model.safetensors", size - 100);
  const std::string truncated = "model.safetensors holds " + std::to_string(size - 100) + " bytes, expected " +
                                std::to_string(size) + " (as saved): truncated";
  std::tie(rc, out) = run(train_cmd(dump, 2, "--checkpoint.interval=1 --checkpoint.load=" + ckpt + "2"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("moetrain train: error: " + ckpt + "2/" + truncated + "; the checkpoint is damaged"),
            std::string::npos)
      << out;
  std::tie(rc, out) = run(train_cmd(dump, 1, "--checkpoint.interval=1 --checkpoint.keep=1"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("moetrain train: warning: skipping " + ckpt + "2: " + truncated + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "1 (step 1)"), std::string::npos) << out;
  EXPECT_TRUE(file_text(ckpt + "1/model.safetensors") == model1);
  EXPECT_TRUE(file_text(ckpt + "1/optimizer.safetensors") == moments1);
  EXPECT_TRUE(fs::exists(ckpt + "2/COMPLETE"));  // a later step: kept, as it was
  // export-hf and generate, given the run folder, take the newest that verifies too.
  const std::string normal = (fs::path(dump).lexically_normal() / "checkpoints/step-0000000").string();
  const std::string skipped = "moetrain: warning: skipping " + normal + "2: " + truncated + "\n";
  std::tie(rc, out) = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dump + " --output " + dump + "/hf");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find(skipped), std::string::npos) << out;
  EXPECT_NE(out.find("exported " + normal + "1: "), std::string::npos) << out;
  std::tie(rc, out) = run(std::string(MOETRAIN_BIN) + " generate --model " + dump + " --prompt-ids 1,2 --max-new-tokens 1");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find(skipped), std::string::npos) << out;
  fs::remove(ckpt + "1/train_state.json");
  std::tie(rc, out) = run(train_cmd(dump, 1));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("skipping " + ckpt + "1: train_state.json is missing"), std::string::npos) << out;
  EXPECT_NE(out.find("error: no checkpoint in " + dump + "/checkpoints verifies (each is named above)"),
            std::string::npos)
      << out;
}


// `train` on qwen3_moe_b's tokens, one sequence a micro-batch, `steps` steps.
std::string train_b(const std::string& dump, int steps, const std::string& extra) {
  return std::string(MOETRAIN_BIN) + " train --model.init=hf:" + fixture("qwen3_moe_b") +
         " --data.tokens=" + fixture("qwen3_moe_b/tokens.npy") + " --training.load_balance_coef=0.1" +
         " --training.micro_batch_size=1 --training.steps=" + std::to_string(steps) + " --job.dump_folder=" + dump +
         " " + extra;
}

// Expert parallelism: each ep rank writes its experts (model-part<r>, with an index);
// resuming on the same mesh is exact, resuming on one rank reads every expert, and an
// export of it evaluates like one rank's.
TEST(CheckpointCommands, ExpertParallelCheckpointsResumeOnAnyMesh) {
  if (run("command -v mpirun").first != 0) GTEST_SKIP() << "mpirun not found";
  const std::string mpirun = kMpirun2;
  auto cmd = train_b;
  std::string resumed = temp_dir("ep_resumed"), straight = temp_dir("ep_straight"), single = temp_dir("ep_single");
  auto [rc, out] = run(mpirun + cmd(resumed, 4, "--parallelism.ep=2 --checkpoint.interval=2"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(fs::exists(resumed + "/checkpoints/step-00000004/model-part1.safetensors"));
  EXPECT_TRUE(fs::exists(resumed + "/checkpoints/step-00000004/optimizer.safetensors.index.json"));
  auto [rc2, out2] = run(mpirun + cmd(resumed, 6, "--parallelism.ep=2 --checkpoint.interval=2"));
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("resumed from"), std::string::npos) << out2;
  auto [rc3, out3] = run(mpirun + cmd(straight, 6, "--parallelism.ep=2"));
  ASSERT_EQ(rc3, 0) << out3;
  EXPECT_EQ(metric_lines(resumed), metric_lines(straight));
  // One rank picks up the expert-parallel checkpoint of step 4 and finishes the run.
  fs::create_directories(single + "/checkpoints");
  fs::copy(resumed + "/checkpoints/step-00000004", single + "/checkpoints/step-00000004", fs::copy_options::recursive);
  auto [rc4, out4] = run(cmd(single, 6, "--checkpoint.interval=6"));
  ASSERT_EQ(rc4, 0) << out4;
  std::vector<std::string> a = metric_lines(single), b = metric_lines(straight);
  ASSERT_EQ(a.size(), 2u);  // steps 5 and 6 (the folder had no metrics before)
  expect_continues(a, b, 4, "ep=2 -> one rank");
  auto [rc5, out5] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + resumed +
                         "/checkpoints/step-00000006 --output " + resumed + "/hf --dtype fp32");
  ASSERT_EQ(rc5, 0) << out5;
  io::HfWeights exported(resumed + "/hf"), source(fixture("qwen3_moe_b"));
  EXPECT_EQ(exported.names(), source.names());
}

// Expert parallelism: a flipped byte in one rank's part of the newest checkpoint makes
// both ranks fall back to the one before it, which they load exactly (saved again, each
// part is byte for byte what it was). optimizer-part1 is the file that rank 1 both wrote
// and hashes: its finding must reach rank 0, which prints it once.
TEST(CheckpointCommands, ExpertParallelRanksFallBackTogether) {
  if (run("command -v mpirun").first != 0) GTEST_SKIP() << "mpirun not found";
  const std::string dump = temp_dir("ep_damaged"), ckpt = dump + "/checkpoints/step-0000000";
  const std::string ep = "--parallelism.ep=2 --checkpoint.interval=1";
  auto [rc, out] = run(kMpirun2 + train_b(dump, 2, ep));
  ASSERT_EQ(rc, 0) << out;
  const char* parts[] = {"model-part0", "model-part1", "optimizer-part0", "optimizer-part1"};
  std::vector<std::string> saved;
  for (const char* p : parts) saved.push_back(file_text(ckpt + "1/" + p + ".safetensors"));
  std::string b = file_text(ckpt + "2/optimizer-part1.safetensors");
  b[b.size() - 3] ^= 0x01;
  io::write_file_atomic(ckpt + "2/optimizer-part1.safetensors", {b});
  std::tie(rc, out) = run(kMpirun2 + train_b(dump, 1, ep));
  ASSERT_EQ(rc, 0) << out;
  const std::string skip =
      "moetrain train: warning: skipping " + ckpt + "2: optimizer-part1.safetensors has XXH3 checksum ";
  ASSERT_NE(out.find(skip), std::string::npos) << out;
  EXPECT_EQ(out.find(skip, out.find(skip) + 1), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "1 (step 1)"), std::string::npos) << out;
  for (size_t i = 0; i < saved.size(); ++i)
    EXPECT_TRUE(file_text(ckpt + "1/" + parts[i] + ".safetensors") == saved[i]) << parts[i];
}

// Sharded optimizer state (dp = 2: each rank holds half of every unit's moments) is
// saved laid out like the weights, so a checkpoint of one mesh resumes on another: on
// one rank, and on cp = 2, each continuing the single-rank run's losses (1e-5).
TEST(CheckpointCommands, ShardedCheckpointsResumeOnAnotherMesh) {
  if (run("command -v mpirun").first != 0) GTEST_SKIP() << "mpirun not found";
  const std::string mpirun = kMpirun2;
  auto cmd = train_b;
  std::string straight = temp_dir("zero_straight"), sharded = temp_dir("zero_dp2");
  auto [rc, out] = run(cmd(straight, 4, ""));
  ASSERT_EQ(rc, 0) << out;
  auto [rc2, out2] = run(mpirun + cmd(sharded, 2, "--checkpoint.interval=2"));
  ASSERT_EQ(rc2, 0) << out2;
  const std::vector<std::string> want = metric_lines(straight);
  ASSERT_EQ(want.size(), 4u);
  for (const std::string mesh : {"one rank", "cp=2"}) {
    std::string dump = temp_dir(mesh == "cp=2" ? "zero_cp2" : "zero_one");
    fs::create_directories(dump + "/checkpoints");
    fs::copy(sharded + "/checkpoints/step-00000002", dump + "/checkpoints/step-00000002",
             fs::copy_options::recursive);
    auto [rc3, out3] = run(mesh == "cp=2" ? mpirun + cmd(dump, 4, "--parallelism.cp=2") : cmd(dump, 4, ""));
    ASSERT_EQ(rc3, 0) << out3;
    EXPECT_NE(out3.find("resumed from"), std::string::npos) << out3;
    std::vector<std::string> got = metric_lines(dump);
    ASSERT_EQ(got.size(), 2u) << mesh;  // steps 3 and 4
    expect_continues(got, want, 2, mesh);
  }
}

// ZeRO-3 (parallelism.zero3: the layers' weights live as shards too) writes the same
// canonical checkpoint: one from a zero3 dp = 2 run resumes on one rank and on a plain
// dp = 2 run, and a single-rank checkpoint resumes under zero3, each continuing the
// single-rank run's losses and gradient norms (1e-5).
TEST(CheckpointCommands, Zero3CheckpointsResumeOnAnyMesh) {
  if (run("command -v mpirun").first != 0) GTEST_SKIP() << "mpirun not found";
  const std::string mpirun = kMpirun2;
  auto cmd = train_b;
  std::string straight = temp_dir("zero3_straight"), zero3 = temp_dir("zero3_dp2");
  auto [rc, out] = run(cmd(straight, 4, "--checkpoint.interval=2"));
  ASSERT_EQ(rc, 0) << out;
  auto [rc2, out2] = run(mpirun + cmd(zero3, 2, "--checkpoint.interval=2 --parallelism.zero3=true"));
  ASSERT_EQ(rc2, 0) << out2;
  const std::vector<std::string> want = metric_lines(straight);
  ASSERT_EQ(want.size(), 4u);
  struct Resume {
    std::string name, dir, from, launch, extra;
  };
  for (const Resume& r : {Resume{"zero3 -> one rank", "zero3_to_one", zero3, "", ""},
                          Resume{"zero3 -> dp=2", "zero3_to_dp2", zero3, mpirun, ""},
                          Resume{"one rank -> zero3", "one_to_zero3", straight, mpirun, "--parallelism.zero3=true"}}) {
    std::string dump = temp_dir(r.dir);
    fs::create_directories(dump + "/checkpoints");
    fs::copy(r.from + "/checkpoints/step-00000002", dump + "/checkpoints/step-00000002",
             fs::copy_options::recursive);
    auto [rc3, out3] = run(r.launch + cmd(dump, 4, r.extra));
    ASSERT_EQ(rc3, 0) << r.name << "\n" << out3;
    EXPECT_NE(out3.find("resumed from"), std::string::npos) << out3;
    std::vector<std::string> got = metric_lines(dump);
    ASSERT_EQ(got.size(), 2u) << r.name;  // steps 3 and 4
    expect_continues(got, want, 2, r.name);
  }
}

// bf16 moments (optimizer.state_dtype = bf16) when sharded: dp = 2 and zero3 dp = 2
// runs match the single-rank run (the rounding noise is keyed by parameter and
// element, not by shard), and their checkpoints, whose moments pass through f32,
// resume on one rank continuing it (1e-5).
TEST(CheckpointCommands, ShardedBf16MomentsMatchOneRankAndResume) {
  if (run("command -v mpirun").first != 0) GTEST_SKIP() << "mpirun not found";
  const std::string bf16 = " --optimizer.state_dtype=bf16";
  auto cmd = train_b;
  std::string straight = temp_dir("bf16_straight");
  auto [rc, out] = run(cmd(straight, 4, bf16));
  ASSERT_EQ(rc, 0) << out;
  const std::vector<std::string> want = metric_lines(straight);
  ASSERT_EQ(want.size(), 4u);
  // The option takes effect: the f32 run holds more and ends elsewhere.
  std::string f32 = temp_dir("bf16_vs_f32");
  auto [rc1, out1] = run(cmd(f32, 4, ""));
  ASSERT_EQ(rc1, 0) << out1;
  nlohmann::json last16 = nlohmann::json::parse(want[3]), last32 = nlohmann::json::parse(metric_lines(f32)[3]);
  EXPECT_LT(last16["memory_bytes"].get<int64_t>(), last32["memory_bytes"].get<int64_t>());
  EXPECT_NE(last16["loss"].get<double>(), last32["loss"].get<double>());
  for (const std::string mode : {"dp2", "zero3"}) {
    std::string sharded = temp_dir("bf16_" + mode), resumed = temp_dir("bf16_" + mode + "_to_one");
    auto [rc2, out2] = run(kMpirun2 + cmd(sharded, 2, "--checkpoint.interval=2" + bf16 +
                                                           (mode == "zero3" ? " --parallelism.zero3=true" : "")));
    ASSERT_EQ(rc2, 0) << out2;
    std::vector<std::string> got = metric_lines(sharded);
    ASSERT_EQ(got.size(), 2u) << mode;
    expect_continues(got, want, 0, mode);
    fs::create_directories(resumed + "/checkpoints");
    fs::copy(sharded + "/checkpoints/step-00000002", resumed + "/checkpoints/step-00000002",
             fs::copy_options::recursive);
    auto [rc3, out3] = run(cmd(resumed, 4, bf16));
    ASSERT_EQ(rc3, 0) << out3;
    EXPECT_NE(out3.find("resumed from"), std::string::npos) << out3;
    got = metric_lines(resumed);
    ASSERT_EQ(got.size(), 2u) << mode;  // steps 3 and 4
    expect_continues(got, want, 2, mode + " -> one rank");
  }
}

TEST(CheckpointCommands, ExportRoundTripsAndEvaluatesTheSame) {
  std::string dump = temp_dir("export");
  // Zero steps with checkpoints on saves the initial (imported) weights.
  auto [rc, out] = run(train_cmd(dump, 0, "--checkpoint.interval=1"));
  ASSERT_EQ(rc, 0) << out;
  std::string ckpt = dump + "/checkpoints/step-00000000";
  auto [rc2, out2] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + ckpt + " --output " + dump +
                         "/hf32 --dtype fp32");
  ASSERT_EQ(rc2, 0) << out2;
  // The same tensors, byte for byte, as the model we imported.
  io::HfWeights src(fixture("qwen3_moe_a")), exported(dump + "/hf32");
  ASSERT_EQ(src.names(), exported.names());
  for (const std::string& n : src.names()) {
    auto x = src.bytes(n), y = exported.bytes(n);
    ASSERT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << n;
  }
  auto eval = [&](const std::string& model) {
    auto [code, text] = run(std::string(MOETRAIN_BIN) + " eval --model " + model + " --tokens " +
                            fixture("qwen3_moe_a/tokens.npy"));
    EXPECT_EQ(code, 0) << text;
    return nlohmann::json::parse(text)["loss"].get<double>();
  };
  double a = eval(fixture("qwen3_moe_a")), b = eval(dump + "/hf32");
  EXPECT_NEAR(a, b, 1e-6 * a);
  // Sharded bf16: several files and an index that transformers reads; values are the
  // fp32 weights rounded to bf16.
  auto [rc3, out3] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + ckpt + " --output " + dump +
                         "/hf16 --max-shard-size 40KB");
  ASSERT_EQ(rc3, 0) << out3;
  std::vector<uint8_t> ib = io::read_file(dump + "/hf16/model.safetensors.index.json");
  nlohmann::json index = nlohmann::json::parse(ib.begin(), ib.end());
  std::set<std::string> files;
  for (const auto& entry : index["weight_map"].items()) files.insert(entry.value().get<std::string>());
  EXPECT_GE(files.size(), 2u);
  EXPECT_EQ(*files.begin(), "model-00001-of-0000" + std::to_string(files.size()) + ".safetensors");
  io::HfWeights half(dump + "/hf16");
  ASSERT_EQ(half.names(), src.names());
  std::vector<uint8_t> cfg = io::read_file(dump + "/hf16/config.json");
  EXPECT_EQ(nlohmann::json::parse(cfg.begin(), cfg.end())["dtype"], "bfloat16");
  for (const std::string& n : {std::string("model.embed_tokens.weight"), std::string("lm_head.weight")}) {
    std::vector<int64_t> shape = src.shape(n);
    std::vector<float> f(static_cast<size_t>(shape[0] * shape[1])), h(f.size());
    src.read_f32(n, shape, f.data());
    half.read_f32(n, shape, h.data());
    for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(h[i], f32_from_bf16(bf16_from_f32(f[i]))) << n << " " << i;
  }
}

// A run saves its last step unless checkpoint.save_final is false, and warns when it will
// save nothing; export-hf takes a run folder's newest complete checkpoint.
// An export into a non-empty folder needs --force, and then replaces the earlier export
// whole (a sharded export's files do not stay beside the next one's single file); it
// refuses, naming them, a folder with files an export does not write, the checkpoint's
// own folder, a folder that holds it, and another checkpoint.
TEST(CheckpointCommands, ExportReplacesAnEarlierExportWithForce) {
  std::string dump = temp_dir("reexport");
  auto [rc, out] = run(train_cmd(dump, 1));
  ASSERT_EQ(rc, 0) << out;
  const std::string ckpt = dump + "/checkpoints/step-00000001";
  auto export_to = [&](const std::string& dest, const std::string& flags = "") {
    return run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + ckpt + " --output " + dest + " " + flags);
  };
  ASSERT_EQ(export_to(dump + "/hf", "--max-shard-size 20000").first, 0);
  EXPECT_TRUE(fs::exists(dump + "/hf/model.safetensors.index.json"));
  std::ofstream(dump + "/hf/notes.txt") << "keep me";
  auto [rc1, out1] = export_to(dump + "/hf");
  EXPECT_EQ(rc1, 1);
  EXPECT_NE(out1.find("is not empty; add --force to replace an earlier export there"), std::string::npos) << out1;
  std::tie(rc1, out1) = export_to(dump + "/hf", "--force");
  EXPECT_EQ(rc1, 1);
  EXPECT_NE(out1.find("holds what export-hf does not write (notes.txt); --force replaces an earlier export only"),
            std::string::npos)
      << out1;
  EXPECT_TRUE(fs::exists(dump + "/hf/model.safetensors.index.json"));
  fs::remove(dump + "/hf/notes.txt");
  ASSERT_EQ(export_to(dump + "/hf", "--force").first, 0);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dump + "/hf")) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors"}));
  for (const char* left : {"/hf.tmp", "/hf.old", "/hf.lock"}) EXPECT_FALSE(fs::exists(dump + left)) << left;
  for (const std::string& dest : {ckpt, dump}) {
    auto [rc2, out2] = export_to(dest, "--force");
    EXPECT_EQ(rc2, 1) << dest;
    EXPECT_NE(out2.find("holds the checkpoint"), std::string::npos) << out2;
  }
  EXPECT_TRUE(fs::exists(ckpt + "/model.safetensors"));
  // Another checkpoint of the run (step 2's export forced onto step 1's folder).
  std::tie(rc, out) = run(train_cmd(dump, 2));
  ASSERT_EQ(rc, 0) << out;
  const std::vector<uint8_t> before = io::read_file(ckpt + "/model.safetensors");
  std::tie(rc, out) = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dump +
                          "/checkpoints/step-00000002 --output " + ckpt + " --force");
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("holds a checkpoint (COMPLETE, train_state.json), which an export never replaces"),
            std::string::npos)
      << out;
  EXPECT_EQ(io::read_file(ckpt + "/model.safetensors"), before);
  // What an export that died left beside its output is cleared by the next.
  fs::create_directories(dump + "/hf2.tmp");
  std::ofstream(dump + "/hf2.tmp/model-00001-of-00009.safetensors") << "torn";
  std::tie(rc, out) = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dump + " --output " + dump + "/hf2");
  EXPECT_EQ(rc, 0) << out;
  for (const char* left : {"/hf2.tmp", "/hf2.lock", "/hf2/model-00001-of-00009.safetensors"})
    EXPECT_FALSE(fs::exists(dump + left)) << left;
}

TEST(CheckpointCommands, RunsSaveTheirEndAndExportTakesTheNewest) {
  std::string dump = temp_dir("final");
  auto [rc, out] = run(train_cmd(dump, 2));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(latest_checkpoint(dump + "/checkpoints"), dump + "/checkpoints/step-00000002");
  EXPECT_EQ(out.find("warning"), std::string::npos) << out;
  fs::create_directories(dump + "/checkpoints/step-00000009");  // unfinished: no COMPLETE
  auto [rc2, out2] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dump + " --output " + dump + "/hf");
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("/checkpoints/step-00000002: 80 tensors"), std::string::npos) << out2;
  EXPECT_EQ(io::HfWeights(dump + "/hf").names(), io::HfWeights(fixture("qwen3_moe_a")).names());
  auto [rc3, out3] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dump +
                         "/checkpoints/step-00000009 --output " + dump + "/hf2");
  EXPECT_EQ(rc3, 1);
  EXPECT_NE(out3.find("step-00000009 is not a complete checkpoint"), std::string::npos) << out3;

  std::string none = temp_dir("no_final");
  auto [rc4, out4] = run(train_cmd(none, 2, "--checkpoint.save_final=false --checkpoint.interval=3"));
  ASSERT_EQ(rc4, 0) << out4;
  EXPECT_NE(out4.find("warning: this run will save no checkpoint: checkpoint.save_final is false and "
                      "checkpoint.interval (3) divides none of steps 1..2"),
            std::string::npos)
      << out4;
  EXPECT_EQ(latest_checkpoint(none + "/checkpoints"), "");
  auto [rc5, out5] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + none + " --output " + none + "/hf");
  EXPECT_EQ(rc5, 1);
  EXPECT_NE(out5.find("holds no complete checkpoint"), std::string::npos) << out5;
  // Periodic saves alone: steps 2 and 4 of 5, not the 5th.
  std::string periodic = temp_dir("periodic");
  auto [rc6, out6] = run(train_cmd(periodic, 5, "--checkpoint.save_final=false --checkpoint.interval=2"));
  ASSERT_EQ(rc6, 0) << out6;
  EXPECT_EQ(out6.find("warning"), std::string::npos) << out6;
  EXPECT_EQ(latest_checkpoint(periodic + "/checkpoints"), periodic + "/checkpoints/step-00000004");
  EXPECT_TRUE(fs::exists(periodic + "/checkpoints/step-00000002/COMPLETE"));
}

// A rerun with no steps left (training.steps at or below the checkpoint's step) saves
// nothing: its newest checkpoint stays the very folder it was (a re-save deleted it and
// renamed a copy over it, and a kill in between left only step-N.tmp).
TEST(CheckpointCommands, ARerunWithNoStepsLeftLeavesItsCheckpointAlone) {
  std::string dump = temp_dir("no_steps_left");
  auto [rc, out] = run(train_cmd(dump, 2));
  ASSERT_EQ(rc, 0) << out;
  const std::string step = dump + "/checkpoints/step-00000002";
  struct stat before {}, after {};
  ASSERT_EQ(stat((step + "/COMPLETE").c_str(), &before), 0);
  const std::string metrics = file_text(dump + "/metrics.jsonl");
  for (int64_t steps : {2, 1}) {
    auto [rc2, out2] = run(train_cmd(dump, steps));
    ASSERT_EQ(rc2, 0) << out2;
    EXPECT_NE(out2.find("summary: no steps run (the run was at step 2 of " + std::to_string(steps) + ")"),
              std::string::npos)
        << out2;
    EXPECT_EQ(out2.find("saved "), std::string::npos) << out2;
    EXPECT_NE(out2.find("checkpoint: " + step), std::string::npos) << out2;
    ASSERT_EQ(stat((step + "/COMPLETE").c_str(), &after), 0);
    EXPECT_EQ(after.st_ino, before.st_ino) << "step-00000002 was written again";
    EXPECT_FALSE(fs::exists(step + ".tmp"));
    EXPECT_EQ(file_text(dump + "/metrics.jsonl"), metrics);
  }
}

// checkpoint.load applies to a run folder's first start: a requeued fine-tuning command
// (the same load, the folder now holding its own checkpoints) continues from those.
TEST(CheckpointCommands, ARequeuedLoadContinuesTheRunsOwnCheckpoints) {
  const std::string base = temp_dir("requeue_base"), tuned = temp_dir("requeue_tuned"), straight = temp_dir("requeue_straight");
  auto [rc, out] = run(train_cmd(base, 2));
  ASSERT_EQ(rc, 0) << out;
  // A constant lr after warmup: cosine's horizon is training.steps, which the two commands differ in.
  const std::string load = " --lr_scheduler.decay=constant --checkpoint.load=" + base + "/checkpoints/step-00000002";
  std::tie(rc, out) = run(train_cmd(tuned, 4, load));  // as if preempted after step 4
  ASSERT_EQ(rc, 0) << out;
  std::tie(rc, out) = run(train_cmd(tuned, 6, load));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("resumed from " + tuned + "/checkpoints/step-00000004 (step 4)"), std::string::npos) << out;
  EXPECT_NE(out.find("note: checkpoint.load = " + base + "/checkpoints/step-00000002 applies to a run's first start"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("summary: 2 steps (5 to 6 of 6)"), std::string::npos) << out;
  std::tie(rc, out) = run(train_cmd(straight, 6, load));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(metric_lines(tuned), metric_lines(straight));
}

// A branch from an earlier step of the same folder moves the later checkpoints and
// metrics lines to branches/from-step-N/; a plain resume then continues the branch, and
// the branch's own command, run again, continues it too rather than branching anew.
TEST(CheckpointCommands, BranchingSetsTheAbandonedStepsAside) {
  const std::string dump = temp_dir("branching"), ckpt = dump + "/checkpoints/step-0000000";
  auto [rc, out] = run(train_cmd(dump, 6, "--checkpoint.interval=2"));
  ASSERT_EQ(rc, 0) << out;
  const std::vector<std::string> first = metric_lines(dump);
  const std::string branch = " --checkpoint.interval=2 --optimizer.lr=1e-3 --checkpoint.allow_config_change=true"
                             " --checkpoint.load=" + ckpt + "2";
  std::tie(rc, out) = run(train_cmd(dump, 4, branch));
  ASSERT_EQ(rc, 0) << out;
  const std::string aside = dump + "/branches/from-step-00000002";
  EXPECT_NE(out.find("note: branching from step 2: the 2 later checkpoint(s) of this folder and its metrics lines "
                     "after step 2 moved to " + aside),
            std::string::npos)
      << out;
  for (const char* s : {"4", "6"}) EXPECT_TRUE(fs::exists(aside + "/checkpoints/step-0000000" + std::string(s) + "/COMPLETE"));
  EXPECT_FALSE(fs::exists(ckpt + "6"));
  const std::vector<std::string> moved = metric_lines(aside);
  ASSERT_EQ(moved.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(moved[i], first[i + 2]);
  const std::vector<std::string> lines = metric_lines(dump);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[1], first[1]);
  EXPECT_NE(lines[2], first[2]) << "step 3 of the branch trains at another lr";
  // A plain resume continues the branch, not the abandoned line.
  std::tie(rc, out) = run(train_cmd(dump, 5, "--checkpoint.interval=2 --optimizer.lr=1e-3"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "4 (step 4)"), std::string::npos) << out;
  // The branch's command again continues it, from its newest.
  std::tie(rc, out) = run(train_cmd(dump, 6, branch));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("resumed from " + ckpt + "5 (step 5)"), std::string::npos) << out;
  EXPECT_NE(out.find("note: checkpoint.load = " + ckpt + "2 was this run's branch point"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dump + "/branches/from-step-00000002-2"));
  EXPECT_EQ(metric_lines(dump).size(), 6u);
}

// metrics.jsonl and the TensorBoard events on a full disk (/dev/full: every write fails
// with ENOSPC). Each lost step is a warning naming the file; with metrics.max_lost_lines
// = 0 (the default) the run goes on to its next checkpoint, saves it and exits 1; with a
// larger allowance it ends as usual and counts what was lost.
TEST(CheckpointCommands, MetricsThatCannotBeWrittenAreNamedCountedAndStopTheRun) {
  const std::string dump = temp_dir("metrics_full");
  fs::create_directories(dump);
  fs::create_symlink("/dev/full", dump + "/metrics.jsonl");
  auto [rc, out] = run(train_cmd(dump, 6, "--checkpoint.interval=4 --checkpoint.save_final=false"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("warning: " + dump + "/metrics.jsonl: step 1 could not be written (No space left on device); "
                     "it is lost, the next step tries again (1 lost, metrics.max_lost_lines = 0)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("step 4 could not be written"), std::string::npos) << out;
  EXPECT_EQ(out.find("step 5 could not be written"), std::string::npos) << "the run should stop at step 4: " << out;
  EXPECT_NE(out.find("error: stopped after step 4, saved as " + dump + "/checkpoints/step-00000004, since more than "
                     "metrics.max_lost_lines = 0 could not be written"),
            std::string::npos)
      << out;
  EXPECT_TRUE(fs::exists(dump + "/checkpoints/step-00000004/COMPLETE"));

  const std::string allowed = temp_dir("metrics_full_allowed");
  fs::create_directories(allowed);
  fs::create_symlink("/dev/full", allowed + "/metrics.jsonl");
  std::tie(rc, out) = run(train_cmd(allowed, 3, "--metrics.max_lost_lines=100"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("step 3 could not be written"), std::string::npos) << out;
  EXPECT_NE(out.find("warning: 3 metrics line(s) or event(s) could not be written"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(allowed + "/checkpoints/step-00000003/COMPLETE"));
}

// A disk full for a moment (a small tmpfs, filled, then freed while the run goes on):
// the lines of those steps are lost and counted, every later one is written, and the
// file holds whole lines only.
TEST(CheckpointCommands, MetricsResumeOnceTheDiskHasRoomAgain) {
  const std::string dump = temp_dir("metrics_moment"), disk = temp_dir("metrics_moment_disk");
  fs::create_directories(disk);
  if (std::system(("mount -t tmpfs -o size=64k tmpfs " + disk + " 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (not root): the /dev/full test above covers the failure";
  struct Unmount {
    std::string at;
    ~Unmount() { [[maybe_unused]] const int rc = std::system(("umount " + at).c_str()); }
  } unmount{disk};
  // The disk is full but for one page (4 KiB): the first few lines fit.
  [[maybe_unused]] const int filled = std::system(("head -c 1000000 /dev/zero > " + disk + "/filler 2>/dev/null").c_str());
  fs::resize_file(disk + "/filler", fs::file_size(disk + "/filler") - 4096);
  fs::create_directories(dump);
  fs::create_symlink(disk + "/metrics.jsonl", dump + "/metrics.jsonl");
  pid_t pid = spawn(train_cmd(dump, 60, "--metrics.max_lost_lines=1000 --lr_scheduler.decay=constant"), dump + "/log");
  ASSERT_TRUE(wait_for(
      [&] { return fs::exists(dump + "/log") && file_text(dump + "/log").find("could not be written") != std::string::npos; },
      60))
      << file_text(dump + "/log");
  fs::remove(disk + "/filler");
  EXPECT_EQ(wait_exit(pid), 0) << file_text(dump + "/log");
  const std::string log = file_text(dump + "/log");
  std::vector<int64_t> steps;
  std::istringstream in(file_text(disk + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_TRUE(j.is_object()) << "a torn line: " << line;
    steps.push_back(j["step"].get<int64_t>());
  }
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.back(), 60) << "the lines after the disk had room again";
  const int64_t lost = 60 - static_cast<int64_t>(steps.size());
  EXPECT_GE(lost, 1);
  EXPECT_NE(log.find("warning: " + std::to_string(lost) + " metrics line(s) or event(s) could not be written"),
            std::string::npos)
      << log;
}

// The messages of a few misuses: a Hugging Face folder given as checkpoint.load names
// model.init; an interrupted save's folder is named as it is skipped; a fresh start over
// an earlier run's metrics moves them aside instead of overwriting them.
TEST(CheckpointCommands, MisusesAreNamed) {
  const std::string dump = temp_dir("misuses");
  auto [rc, out] = run(train_cmd(dump, 2, "--checkpoint.load=" + fixture("qwen3_moe_a")));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("checkpoint.load = " + fixture("qwen3_moe_a") + " is a Hugging Face model folder, not a moetrain "
                     "checkpoint (no COMPLETE, no train_state.json): start from its weights with model.init=hf:"),
            std::string::npos)
      << out;
  std::tie(rc, out) = run(train_cmd(dump, 2, "--checkpoint.save_final=false"));
  ASSERT_EQ(rc, 0) << out;
  const std::string earlier = file_text(dump + "/metrics.jsonl");
  fs::create_directories(dump + "/checkpoints/step-00000009");
  std::tie(rc, out) = run(train_cmd(dump, 1, "--checkpoint.save_final=false"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("note: skipping " + dump + "/checkpoints/step-00000009: no COMPLETE marker"), std::string::npos)
      << out;
  const size_t at = out.find("its metrics and configs are now in " + dump + "/earlier-run-");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string aside = out.substr(at + 35, out.find('\n', at) - at - 35);
  EXPECT_EQ(file_text(aside + "/metrics.jsonl"), earlier);
  EXPECT_TRUE(fs::exists(aside + "/config.toml"));
  EXPECT_EQ(metric_lines(dump).size(), 1u);
}

nlohmann::json json_file(const std::string& path) { return nlohmann::json::parse(file_text(path)); }

// tokenize keeps its tokenizer beside the corpus; a run on the corpus carries it into its
// checkpoints and export-hf into the model folder, with a tokenizer_config.json and a
// generation_config.json; generate encodes a text prompt with it and prints the decoding.
TEST(CheckpointCommands, TheCorpusTokenizerTravelsToTheExport) {
  const std::string dir = temp_dir("corpus_tokenizer"), root = std::string(MOETRAIN_FIXTURES) + "/../..";
  const std::string tokenizer = root + "/data/tokenizer.json";
  std::string jsonl;
  for (int i = 0; i < 8; ++i)
    jsonl += "{\"text\": \"And God said, Let there be light: and there was light. And the evening and the morning "
             "were the day " + std::to_string(i) + ".\"}\n";
  io::write_file_atomic(dir + "/kjv.jsonl", {jsonl});
  auto [rc, out] = run(std::string(MOETRAIN_BIN) + " tokenize --tokenizer " + tokenizer + " --input " + dir +
                       "/kjv.jsonl --output " + dir + "/corpus");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(file_text(dir + "/corpus/tokenizer.json"), file_text(tokenizer));
  auto [rc2, out2] = run(std::string(MOETRAIN_BIN) + " train --model.config=" + root + "/configs/demo/config.json" +
                         " --data.corpus=" + dir + "/corpus --data.seq_len=16 --training.steps=1" +
                         " --training.global_batch_size=2 --job.dump_folder=" + dir + "/run");
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_EQ(file_text(dir + "/run/checkpoints/step-00000001/tokenizer.json"), file_text(tokenizer));
  auto [rc3, out3] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dir + "/run --output " + dir +
                         "/hf --dtype fp32");
  ASSERT_EQ(rc3, 0) << out3;
  EXPECT_NE(out3.find("and 3 tokenizer and generation files"), std::string::npos) << out3;
  EXPECT_EQ(file_text(dir + "/hf/tokenizer.json"), file_text(tokenizer));
  nlohmann::json tc = json_file(dir + "/hf/tokenizer_config.json"), gen = json_file(dir + "/hf/generation_config.json");
  EXPECT_EQ(tc["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(tc["eos_token"], "<|endoftext|>");
  EXPECT_EQ(gen["eos_token_id"], 0);  // the demo config has none: the tokenizer's end of document
  EXPECT_FALSE(gen.contains("bos_token_id"));

  // The prompt's ids and the continuation, decoded: from the export and from the run.
  const std::string prompt = "In the beginning";
  std::vector<std::vector<int64_t>> ids;
  for (const std::string& model : {dir + "/hf", dir + "/run"}) {
    auto [rc4, out4] = run(std::string(MOETRAIN_BIN) + " generate --model " + model + " --prompt '" + prompt +
                           "' --max-new-tokens 5");
    ASSERT_EQ(rc4, 0) << out4;
    std::string text = out4.substr(0, out4.rfind('\n', out4.size() - 2));
    nlohmann::json got = nlohmann::json::parse(out4.substr(text.size() + 1));
    ASSERT_TRUE(got.is_array() && !got.empty() && got.size() <= 5) << out4;
    data::Tokenizer tok(tokenizer);
    std::vector<int32_t> all = tok.encode(prompt);
    for (const auto& id : got) all.push_back(id.get<int32_t>());
    EXPECT_EQ(text, tok.decode(all, true)) << out4;
    EXPECT_EQ(text.substr(0, prompt.size()), prompt);
    ids.push_back(got.get<std::vector<int64_t>>());
  }
  // The same weights (fp32 export); the export alone stops at eos (generation_config.json).
  ASSERT_LE(ids[0].size(), ids[1].size());
  EXPECT_EQ(ids[0], std::vector<int64_t>(ids[1].begin(), ids[1].begin() + ids[0].size()));
  if (ids[0].size() < 5) {
    EXPECT_EQ(ids[0].back(), 0);
  }
}

// The tokenizer of an hf:DIR model (tokenizer.json and tokenizer_config.json) travels the
// same way, and generate refuses a text whose ids the model's vocabulary cannot hold.
TEST(CheckpointCommands, AnHfModelsTokenizerTravelsToTheExport) {
  const std::string dir = temp_dir("hf_tokenizer");
  for (const char* f : {"config.json", "model.safetensors"})
    fs::copy_file(fixture(std::string("qwen3_moe_a/") + f), dir + "/" + f);
  fs::copy_file(fixture("tokenizers/gpt2_style.json"), dir + "/tokenizer.json");
  io::write_file_atomic(dir + "/tokenizer_config.json", {"{\"eos_token\": \"<pad>\"}\n"});
  auto [rc, out] = run(std::string(MOETRAIN_BIN) + " train --model.init=hf:" + dir + " --data.tokens=" +
                       fixture("qwen3_moe_a/tokens.npy") + " --training.steps=0 --job.dump_folder=" + dir + "/run");
  ASSERT_EQ(rc, 0) << out;
  auto [rc2, out2] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dir + "/run --output " + dir + "/hf");
  ASSERT_EQ(rc2, 0) << out2;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_EQ(file_text(dir + "/run/checkpoints/step-00000000/" + f), file_text(dir + "/" + f)) << f;
    EXPECT_EQ(file_text(dir + "/hf/" + f), file_text(dir + "/" + f)) << f;
  }
  EXPECT_EQ(json_file(dir + "/hf/generation_config.json")["eos_token_id"], 1);  // <pad>, by tokenizer_config.json
  auto [rc3, out3] = run(std::string(MOETRAIN_BIN) + " generate --model " + dir + "/hf --prompt Café");
  EXPECT_EQ(rc3, 1);
  EXPECT_NE(out3.find("prompt token 1500 is outside the model's vocabulary of 96"), std::string::npos) << out3;
}

// What export-hf reads of config.json: quantization_config goes (an MXFP4 import exports
// bf16 or fp32), and a model_type it cannot build is an error naming it.
TEST(CheckpointCommands, ExportDropsQuantizationAndNeedsAKnownModel) {
  std::string dir = temp_dir("export_config");
  fs::copy_file(fixture("qwen3_moe_a/model.safetensors"), dir + "/model.safetensors");
  io::write_file_atomic(dir + "/COMPLETE", {""});
  std::vector<uint8_t> b = io::read_file(fixture("qwen3_moe_a/config.json"));
  nlohmann::json config = nlohmann::json::parse(b.begin(), b.end());
  config["quantization_config"] = {{"quant_method", "mxfp4"}};
  io::write_file_atomic(dir + "/config.json", {config.dump()});
  auto [rc, out] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dir + " --output " + dir + "/hf");
  ASSERT_EQ(rc, 0) << out;
  b = io::read_file(dir + "/hf/config.json");
  EXPECT_FALSE(nlohmann::json::parse(b.begin(), b.end()).contains("quantization_config"));
  EXPECT_EQ(io::HfWeights(dir + "/hf").names(), io::HfWeights(fixture("qwen3_moe_a")).names());
  config["model_type"] = "llama";
  io::write_file_atomic(dir + "/config.json", {config.dump()});
  auto [rc2, out2] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dir + " --output " + dir + "/hf2");
  EXPECT_NE(rc2, 0);
  EXPECT_NE(out2.find("model_type 'llama' is not supported"), std::string::npos) << out2;
  EXPECT_FALSE(fs::exists(dir + "/hf2"));
}

// GPT-OSS keeps a layer's experts in fused [E, in, out] keys; moetrain's checkpoints keep
// one tensor an expert. Imported, saved and exported again (one rank, and ep 2 with each
// rank's part holding its experts), the folder is the fixture's, key for key and byte for
// byte; without one expert's tensors the export names what is missing.
TEST(CheckpointCommands, GptOssFusedExpertsRoundTrip) {
  if (run("command -v mpirun").first != 0) GTEST_SKIP() << "mpirun not found";
  io::HfWeights src(fixture("gpt_oss_a"));
  std::string full;  // the one-rank checkpoint
  for (int ep : {1, 2}) {
    std::string dump = temp_dir("gpt_oss_ep" + std::to_string(ep));
    auto [rc, out] = run((ep > 1 ? kMpirun2 : std::string()) + MOETRAIN_BIN + " train --model.init=hf:" +
                         fixture("gpt_oss_a") + " --data.tokens=" + fixture("gpt_oss_mxfp4/tokens.npy") +  // 2 rows
                         " --training.steps=0 --checkpoint.interval=1 --parallelism.ep=" + std::to_string(ep) +
                         " --job.dump_folder=" + dump);
    ASSERT_EQ(rc, 0) << out;
    const std::string ckpt = dump + "/checkpoints/step-00000000";
    if (ep == 1) full = ckpt;
    EXPECT_TRUE(io::HfWeights(ckpt).contains("model.layers.1.mlp.experts.7.gate_up_proj"));
    auto [rc2, out2] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + ckpt + " --output " + dump +
                           "/hf --dtype fp32");
    ASSERT_EQ(rc2, 0) << out2;
    io::HfWeights exported(dump + "/hf");
    ASSERT_EQ(src.names(), exported.names()) << "ep " << ep;
    for (const std::string& n : src.names()) {
      auto x = src.bytes(n), y = exported.bytes(n);
      ASSERT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << n << ", ep " << ep;
    }
  }
  // A checkpoint whose expert 3 of layer 0 is gone (its tensors dropped from the file).
  const std::string dir = temp_dir("gpt_oss_missing");
  io::HfWeights ck(full);
  std::vector<io::StWrite> keep;
  std::vector<std::vector<float>> data;
  for (const std::string& n : ck.names()) {
    if (n.starts_with("model.layers.0.mlp.experts.3.")) continue;
    std::vector<int64_t> shape = ck.shape(n);
    std::vector<float>& v = data.emplace_back(static_cast<size_t>(ck.tensor(n).numel()));
    ck.read_f32(n, shape, v.data());
    keep.push_back(io::st_f32(n, shape, v.data()));
  }
  io::write_safetensors(dir + "/model.safetensors", keep, {{"format", "pt"}});
  fs::copy_file(full + "/config.json", dir + "/config.json");
  io::write_file_atomic(dir + "/COMPLETE", {""});
  auto [rc, out] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dir + " --output " + dir + "/hf");
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("is not in the checkpoint"), std::string::npos) << out;
  EXPECT_NE(out.find("expert 3 (model.layers.0.mlp.experts.3."), std::string::npos) << out;
}

// The hub's MXFP4 experts (U8 blocks and scales, quantization_config in config.json)
// load as transformers dequantizes them: the same eval loss as transformers on the
// fixture; exported, the folder is bf16 with fused keys and no quantization_config.
TEST(CheckpointCommands, GptOssMxfp4ImportsAsTransformersDequantizes) {
  io::SafetensorsFile exp(fixture("gpt_oss_mxfp4/expected.safetensors"));
  float want = 0;
  exp.read_f32(*exp.find("loss"), &want);
  ASSERT_GT(want, 0.0f);
  auto [rc, out] = run(std::string(MOETRAIN_BIN) + " eval --model " + fixture("gpt_oss_mxfp4") + " --tokens " +
                       fixture("gpt_oss_mxfp4/tokens.npy"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NEAR(nlohmann::json::parse(out)["loss"].get<double>(), want, 1e-5 * want) << out;
  std::string dump = temp_dir("gpt_oss_mxfp4");
  auto [rc2, out2] = run(std::string(MOETRAIN_BIN) + " train --model.init=hf:" + fixture("gpt_oss_mxfp4") +
                         " --data.tokens=" + fixture("gpt_oss_mxfp4/tokens.npy") +
                         " --training.steps=0 --checkpoint.interval=1 --job.dump_folder=" + dump);
  ASSERT_EQ(rc2, 0) << out2;
  auto [rc3, out3] = run(std::string(MOETRAIN_BIN) + " export-hf --checkpoint " + dump +
                         "/checkpoints/step-00000000 --output " + dump + "/hf");
  ASSERT_EQ(rc3, 0) << out3;
  io::HfWeights exported(dump + "/hf");
  EXPECT_EQ(exported.shape("model.layers.1.mlp.experts.gate_up_proj"), (std::vector<int64_t>{4, 64, 192}));
  EXPECT_FALSE(exported.contains("model.layers.1.mlp.experts.gate_up_proj_blocks"));
  std::vector<uint8_t> b = io::read_file(dump + "/hf/config.json");
  EXPECT_FALSE(nlohmann::json::parse(b.begin(), b.end()).contains("quantization_config"));
  auto [rc4, out4] = run(std::string(MOETRAIN_BIN) + " eval --model " + dump + "/hf --tokens " +
                         fixture("gpt_oss_mxfp4/tokens.npy"));
  ASSERT_EQ(rc4, 0) << out4;
  EXPECT_NEAR(nlohmann::json::parse(out4)["loss"].get<double>(), want, 1e-2 * want) << out4;  // bf16 weights
}

}  // namespace
}  // namespace mt
