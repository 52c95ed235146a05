#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/check.h"
#include "io/file.h"
#include "comm/communicator.h"
#include "io/safetensors.h"
#include "kernels/elementwise.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTokenizerFiles[] = {"tokenizer.json",   "tokenizer_config.json", "special_tokens_map.json",
                                           "vocab.json",       "merges.txt",            "added_tokens.json",
                                           "chat_template.jinja", "generation_config.json"};

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// Fault injection for the crash-during-save test: a pause after each file written.
void test_delay() {
  static const char* ms = std::getenv("MOETRAIN_CHECKPOINT_DELAY_MS");
  if (ms != nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ms)));
}

std::vector<int64_t> dims(const Tensor& t) { return {t.shape.d.begin(), t.shape.d.begin() + t.ndim()}; }

// The other way: host f32 values into `dst`, rounded to nearest if it is bf16 (exact
// for the bf16 moments this run's checkpoints hold).
void from_host(const Tensor& dst, const std::vector<float>& host) {
  Tensor in(const_cast<float*>(host.data()), dst.shape, DType::f32);
  if (dst.dtype == DType::f32) return copy(dst, in);
  std::vector<uint8_t> raw(dst.nbytes());
  Tensor staged(raw.data(), dst.shape, dst.dtype);
  cast(in, staged);
  copy(dst, staged);
}

void sync_dir(const fs::path& dir) {
  // The rename of a file or folder is durable only once its parent folder is synced.
  io::write_file_atomic((dir / ".sync").string(), {});
  fs::remove(dir / ".sync");
}

bool complete(const fs::path& dir) { return fs::exists(dir / "COMPLETE"); }

int64_t step_of(const fs::path& dir) {
  std::string n = dir.filename().string();
  if (n.size() != 13 || n.rfind("step-", 0) != 0 || n.find_first_not_of("0123456789", 5) != std::string::npos) return -1;
  return std::stoll(n.substr(5));
}

}  // namespace

std::string save_checkpoint(const std::string& checkpoints_dir, Model& model, const AdamW& opt, const TrainState& st,
                            const std::string& model_config_path, const std::string& tokenizer_dir, int64_t keep,
                            comm::Communicator* writers, bool write_dense) {
  const int rank = writers ? writers->rank() : 0, ranks = writers ? writers->size() : 1;
  auto barrier = [&] {
    if (ranks > 1) writers->barrier();
  };
  fs::path root(checkpoints_dir);
  fs::path final_dir = root / step_name(st.step);
  fs::path tmp = root / (step_name(st.step) + ".tmp");
  // A step folder already there (a run resumed from an earlier step into the same
  // folder: another branch) is written anew, replaced only once the new one is whole.
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(root, ec);
    MT_CHECK(!ec && fs::is_directory(root)) << "cannot create the checkpoint folder " << root.string() << ": "
                                            << ec.message();
    fs::remove_all(tmp);
    fs::create_directories(tmp, ec);
    MT_CHECK(!ec) << "cannot create " << tmp.string() << ": " << ec.message();
  }
  barrier();

  // Each writer saves what it owns: its experts, and the dense tensors of its layers
  // when it is the first of its ep group; the index files then say which file holds a key.
  std::vector<HfTensor> tensors;
  for (HfTensor& t : model.hf_tensors())
    if (write_dense || t.expert) tensors.push_back(t);
  std::vector<io::StWrite> weights, moments;
  std::vector<std::string> names;
  std::vector<std::vector<float>> host;  // staging, so GPU tensors save the same way
  names.reserve(2 * tensors.size());
  host.reserve(3 * tensors.size());
  for (const HfTensor& t : tensors) {
    host.push_back(to_host(t.value));
    weights.push_back(io::st_f32(t.name, dims(t.value), host.back().data()));
    names.push_back(t.name + ".exp_avg");
    host.push_back(to_host(opt.exp_avg(t.value)));
    moments.push_back(io::st_f32(names.back(), dims(t.value), host.back().data()));
    names.push_back(t.name + ".exp_avg_sq");
    host.push_back(to_host(opt.exp_avg_sq(t.value)));
    moments.push_back(io::st_f32(names.back(), dims(t.value), host.back().data()));
  }
  const std::string suffix = ranks > 1 ? "-part" + std::to_string(rank) : "";
  io::write_safetensors((tmp / ("model" + suffix + ".safetensors")).string(), weights, {{"format", "pt"}});
  test_delay();
  io::write_safetensors((tmp / ("optimizer" + suffix + ".safetensors")).string(), moments);
  test_delay();
  barrier();
  if (rank != 0) {
    barrier();  // rank 0 finishes the checkpoint
    return final_dir.string();
  }
  if (ranks > 1) {
    // The index of each stem lists every writer's keys.
    for (const std::string stem : {"model", "optimizer"}) {
      nlohmann::json index;
      for (int r = 0; r < ranks; ++r) {
        std::string file = stem + "-part" + std::to_string(r) + ".safetensors";
        io::SafetensorsFile f((tmp / file).string());
        for (const io::StTensor& t : f.tensors()) index["weight_map"][t.name] = file;
      }
      io::write_file_atomic((tmp / (stem + ".safetensors.index.json")).string(), {index.dump(2)});
    }
  }
  nlohmann::json state;
  state["format"] = 1;
  state["step"] = st.step;
  state["seed"] = st.seed;
  state["lr"] = st.lr;
  state["data_cursor"] = nlohmann::json::parse(st.data_cursor);
  state["config"] = st.config_toml;
  io::write_file_atomic((tmp / "train_state.json").string(), {state.dump(2)});
  std::vector<uint8_t> config = io::read_file(model_config_path);
  io::write_file_atomic((tmp / "config.json").string(),
                        {std::string_view(reinterpret_cast<const char*>(config.data()), config.size())});
  const fs::path source(tokenizer_dir);
  for (const char* f : kTokenizerFiles) {
    if (tokenizer_dir.empty() || !fs::exists(source / f)) continue;
    std::vector<uint8_t> b = io::read_file((source / f).string());
    io::write_file_atomic((tmp / f).string(), {std::string_view(reinterpret_cast<const char*>(b.data()), b.size())});
  }
  test_delay();
  sync_dir(tmp);
  std::error_code ec;
  fs::remove_all(final_dir, ec);
  MT_CHECK(!ec) << "removing the earlier " << final_dir.string() << " to replace it: " << ec.message();
  fs::rename(tmp, final_dir, ec);
  MT_CHECK(!ec) << "renaming " << tmp.string() << " to " << final_dir.string() << ": " << ec.message();
  sync_dir(root);
  io::write_file_atomic((final_dir / "COMPLETE").string(), {std::to_string(st.step) + "\n"});

  // Keep the newest `keep` complete checkpoints up to this one; drop older ones. Later
  // steps (another branch of the run) are never deleted for this one.
  std::vector<std::pair<int64_t, fs::path>> done;
  for (const auto& e : fs::directory_iterator(root)) {
    int64_t s = step_of(e.path());
    if (s >= 0 && s <= st.step && complete(e.path())) done.emplace_back(s, e.path());
  }
  std::sort(done.begin(), done.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < done.size(); ++i) fs::remove_all(done[i].second);
  barrier();
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& checkpoints_dir) {
  if (!fs::is_directory(checkpoints_dir)) return "";
  int64_t best = -1;
  std::string path;
  for (const auto& e : fs::directory_iterator(checkpoints_dir)) {
    int64_t s = step_of(e.path());
    if (s > best && complete(e.path())) {
      best = s;
      path = e.path().string();
    }
  }
  return path;
}

std::string find_checkpoint(const std::string& path) {
  MT_CHECK(fs::is_directory(path)) << path << " is not a folder (expected a checkpoint step-NNNNNNNN folder, or a run "
                                   << "folder holding checkpoints/)";
  if (complete(path)) return path;
  fs::path p = fs::path(path).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // a trailing slash
  MT_CHECK(step_of(p) < 0) << path << " is not a complete checkpoint (no COMPLETE marker)";
  const std::string where = fs::is_directory(p / "checkpoints") ? (p / "checkpoints").string() : p.string();
  std::string found = latest_checkpoint(where);
  MT_CHECK(!found.empty()) << path << " holds no complete checkpoint (looked for step-NNNNNNNN folders with a COMPLETE "
                           << "marker in " << where << ")";
  return found;
}

TrainState read_train_state(const std::string& dir) {
  MT_CHECK(complete(dir)) << dir << " is not a complete checkpoint (no COMPLETE marker)";
  std::vector<uint8_t> b = io::read_file((fs::path(dir) / "train_state.json").string());
  nlohmann::json j = nlohmann::json::parse(b.begin(), b.end(), nullptr, false);
  MT_CHECK(!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer())
      << dir << "/train_state.json: expected a JSON object with an integer \"step\"";
  TrainState st;
  try {
    st.step = j["step"].get<int64_t>();
    st.seed = j.value("seed", int64_t{0});
    st.lr = j.value("lr", 0.0);
    st.data_cursor = j.contains("data_cursor") ? j["data_cursor"].dump() : "null";
    st.config_toml = j.value("config", std::string());
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL() << dir << "/train_state.json: a key has the wrong type (seed and step integers, lr a number, config a "
              << "string): " << e.what();
  }
  // The folder's name says the step too (a step edited to 999 was trusted, and rotation
  // then deleted good checkpoints).
  fs::path folder = fs::path(dir).lexically_normal();
  if (!folder.has_filename()) folder = folder.parent_path();  // a trailing slash
  const int64_t named = step_of(folder);
  MT_CHECK(named < 0 || named == st.step) << dir << "/train_state.json: step " << st.step << " but the folder is step "
                                          << named << "; the checkpoint was edited or moved";
  return st;
}

TrainState load_checkpoint(const std::string& dir, Model& model, AdamW* opt) {
  MT_CHECK(complete(dir)) << dir << " is not a complete checkpoint (no COMPLETE marker)";
  io::HfWeights weights(dir);
  std::vector<HfTensor> tensors = model.hf_tensors();
  std::vector<float> host;
  auto load = [&](const Tensor& dst) { from_host(dst, host); };
  for (const HfTensor& t : tensors) {
    host.resize(static_cast<size_t>(t.value.numel()));
    weights.read_f32(t.name, dims(t.value), host.data());
    load(t.value);
  }
  refresh_compute_weights(model.params());
  for (const std::string& name : weights.names()) {
    bool used = std::any_of(tensors.begin(), tensors.end(), [&](const HfTensor& t) { return t.name == name; });
    used = used || model.held_by_another_rank(name);
    MT_CHECK(used) << dir << "/model.safetensors: tensor " << name
                   << " is not a parameter of this model (was the checkpoint written for another config?)";
  }
  if (opt != nullptr) {
    io::HfWeights moments(dir, "optimizer");
    for (const HfTensor& t : tensors) {
      for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) {
        host.resize(static_cast<size_t>(t.value.numel()));
        moments.read_f32(t.name + suffix, dims(t.value), host.data());
        load(std::string_view(suffix) == ".exp_avg_sq" ? opt->exp_avg_sq(t.value) : opt->exp_avg(t.value));
      }
    }
    for (const std::string& name : moments.names()) {
      std::string base = name.substr(0, name.rfind(".exp_avg"));
      bool used = std::any_of(tensors.begin(), tensors.end(), [&](const HfTensor& t) { return t.name == base; }) ||
                  model.held_by_another_rank(base);
      MT_CHECK(used) << dir << ": optimizer state " << name << " belongs to no parameter of this model";
    }
  }
  return read_train_state(dir);
}

}  // namespace mt
