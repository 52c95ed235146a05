#include "train/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "io/file.h"
#include "comm/mesh.h"
#include "io/safetensors.h"
#include "kernels/elementwise.h"
#include "train/trainer.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

// A tensor's optimizer state as saved: AdamW's two moments, or Muon's momentum (the
// optimizer's first moment).
std::vector<const char*> optimizer_state(const Optimizer& opt, const HfTensor& t) {
  if (opt.is_muon(t.value)) return {".momentum"};
  return {".exp_avg", ".exp_avg_sq"};
}

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

// Whether `dir` is a checkpoint (a step folder, a run folder, its checkpoints/) rather
// than a Hugging Face model folder (config.json, no train_state).
bool is_checkpoint_folder(const fs::path& dir) {
  return complete(dir) || fs::exists(dir / "train_state.json") || !fs::exists(dir / "config.json");
}

// The marker first: from then on a reader that finds a file missing finds the checkpoint
// incomplete too (one being rotated away), not damaged.
void remove_checkpoint(const fs::path& dir, std::error_code& ec) {
  fs::remove(dir / "COMPLETE", ec);
  if (!ec) fs::remove_all(dir, ec);
}

int64_t step_of(const fs::path& dir) {
  std::string n = dir.filename().string();
  if (n.size() != 13 || n.rfind("step-", 0) != 0 || n.find_first_not_of("0123456789", 5) != std::string::npos) return -1;
  return std::stoll(n.substr(5));
}

// A step folder being replaced is first moved aside to step-N.old, and removed only once
// its replacement is complete: the step of such a folder (-1 for any other name).
int64_t step_set_aside(const fs::path& dir) {
  const std::string n = dir.filename().string();
  return n.size() == 17 && n.ends_with(".old") ? step_of(dir.parent_path() / n.substr(0, 13)) : -1;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// What COMPLETE records: each other file's FileSum as saved. A COMPLETE of the format
// before manifests (the step, or nothing) records none: `legacy`.
struct Manifest {
  bool legacy = false;
  std::map<std::string, io::FileSum> files;
};

Manifest read_manifest(const std::string& dir) {
  const std::vector<uint8_t> raw = io::read_file((fs::path(dir) / "COMPLETE").string());
  const std::string text(raw.begin(), raw.end());
  Manifest m;
  m.legacy = text.find_first_not_of("0123456789\n") == std::string::npos;
  if (m.legacy) return m;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    for (const auto& [name, e] : j.at("files").items()) {
      const std::string x = e.at("xxh3").get<std::string>();
      if (!e.at("bytes").is_number_unsigned()) throw std::invalid_argument("bytes " + e.at("bytes").dump() + " is not a size");
      size_t used = 0;
      m.files[name] = {e.at("bytes").get<uint64_t>(), std::stoull(x, &used, 16)};
      if (used != x.size() || x.size() != 16) throw std::invalid_argument("xxh3 \"" + x + "\" is not 16 hex digits");
    }
  } catch (const std::exception& e) {
    throw DamagedCheckpoint(dir, "COMPLETE is not a manifest ({\"step\": N, \"files\": {name: {\"bytes\": N, "
                                 "\"xxh3\": \"16 hex digits\"}}}): " + std::string(e.what()));
  }
  return m;
}

// What is wrong with file `name` of `dir` against its FileSum as saved: "" if nothing.
std::string file_damage(const std::string& dir, const std::string& name, const io::FileSum& want) {
  const std::string path = (fs::path(dir) / name).string();
  std::error_code ec;
  const uintmax_t bytes = fs::file_size(path, ec);
  if (ec) return name + " is missing (" + ec.message() + ")";
  if (bytes != want.bytes)
    return name + " holds " + std::to_string(bytes) + " bytes, expected " + std::to_string(want.bytes) + " (as saved)" +
           (bytes < want.bytes ? ": truncated" : "");
  const uint64_t got = io::file_sum(path).xxh3;
  if (got != want.xxh3) return name + " has XXH3 checksum " + hex(got) + ", expected " + hex(want.xxh3) + " (as saved)";
  return "";
}

}  // namespace

DamagedCheckpoint::DamagedCheckpoint(const std::string& dir, const std::string& why)
    : Error(dir + "/" + why + "; the checkpoint is damaged: use an earlier one (a run resumes from its newest one "
                "that verifies, unless checkpoint.load names one) or restore the file from a copy",
            ""),
      why(why) {}

std::string save_checkpoint(const std::string& checkpoints_dir, Model& model, const Optimizer& opt, const TrainState& st,
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
  std::vector<HfTensor> tensors = model.hf_tensors();
  std::erase_if(tensors, [&](const HfTensor& t) { return !write_dense && !t.expert; });
  std::vector<io::StWrite> weights, moments;
  std::vector<std::vector<float>> host;  // staging, so GPU tensors save the same way
  host.reserve(3 * tensors.size());
  for (const HfTensor& t : tensors) {
    host.push_back(to_host(t.value));
    weights.push_back(io::st_f32(t.name, dims(t.value), host.back().data()));
    for (const char* suffix : optimizer_state(opt, t)) {
      host.push_back(to_host(std::string_view(suffix) == ".exp_avg_sq" ? opt.exp_avg_sq(t.value) : opt.exp_avg(t.value)));
      moments.push_back(io::st_f32(t.name + suffix, dims(t.value), host.back().data()));
    }
  }
  auto part = [&](int r) { return ranks > 1 ? "-part" + std::to_string(r) : std::string(); };
  auto path = [&](const std::string& stem) { return (tmp / (stem + part(rank) + ".safetensors")).string(); };
  const io::FileSum model_sum = io::write_safetensors(path("model"), weights, {{"format", "pt"}});
  test_delay();
  const io::FileSum moments_sum = io::write_safetensors(path("optimizer"), moments);
  test_delay();
  // Rank 0's manifest records every writer's files; gathering their sums also waits for them.
  std::vector<int64_t> mine = {static_cast<int64_t>(model_sum.bytes), static_cast<int64_t>(model_sum.xxh3),
                               static_cast<int64_t>(moments_sum.bytes), static_cast<int64_t>(moments_sum.xxh3)};
  std::vector<int64_t> sums = mine;
  sums.resize(4 * static_cast<size_t>(ranks));
  if (ranks > 1)
    writers->all_gather(Tensor(mine.data(), {4}, DType::i64), Tensor(sums.data(), {4 * ranks}, DType::i64));
  if (rank != 0) {
    barrier();  // rank 0 finishes the checkpoint
    return final_dir.string();
  }
  nlohmann::json files;
  auto record = [&](const std::string& name, io::FileSum sum) {
    files[name] = {{"bytes", sum.bytes}, {"xxh3", hex(sum.xxh3)}};
  };
  for (int r = 0; r < ranks; ++r) {
    auto at = [&](int i) { return static_cast<uint64_t>(sums[4 * static_cast<size_t>(r) + i]); };
    record("model" + part(r) + ".safetensors", {at(0), at(1)});
    record("optimizer" + part(r) + ".safetensors", {at(2), at(3)});
  }
  if (ranks > 1) {
    // The index of each stem lists every writer's keys.
    for (const std::string stem : {"model", "optimizer"}) {
      nlohmann::json index;
      for (int r = 0; r < ranks; ++r) {
        std::string file = stem + part(r) + ".safetensors";
        io::SafetensorsFile f((tmp / file).string());
        for (const io::StTensor& t : f.tensors()) index["weight_map"][t.name] = file;
      }
      const std::string name = stem + ".safetensors.index.json";
      record(name, io::write_file_atomic((tmp / name).string(), {index.dump(2)}));
    }
  }
  nlohmann::json state = {{"format", 1}, {"step", st.step}, {"seed", st.seed}, {"lr", st.lr},
                          {"data_cursor", nlohmann::json::parse(st.data_cursor)},
                          {"expert_placement", nlohmann::json::parse(st.expert_placement)},
                          {"expert_bias", nlohmann::json::parse(st.expert_bias)}, {"config", st.config_toml},
                          {"inputs", nlohmann::json::parse(st.inputs)}};
  if (!st.origin.empty()) state["origin"] = st.origin;
  record("train_state.json", io::write_file_atomic((tmp / "train_state.json").string(), {state.dump(2)}));
  auto copy_in = [&](const fs::path& from, const std::string& name) {
    std::vector<uint8_t> b = io::read_file(from.string());
    record(name, io::write_file_atomic((tmp / name).string(),
                                       {std::string_view(reinterpret_cast<const char*>(b.data()), b.size())}));
  };
  copy_in(model_config_path, "config.json");
  const fs::path source(tokenizer_dir);
  for (const char* f : kTokenizerFiles)
    if (!tokenizer_dir.empty() && fs::exists(source / f)) copy_in(source / f, f);
  test_delay();
  sync_dir(tmp);
  // An earlier folder of this step (another branch) is moved aside, not removed, until
  // the new one is complete: at every moment one complete copy of the step exists
  // (complete_checkpoints takes step-N.old while step-N is not complete).
  std::error_code ec;
  const fs::path aside = root / (step_name(st.step) + ".old");
  remove_checkpoint(aside, ec);
  MT_CHECK(!ec) << "removing " << aside.string() << ", left by an interrupted save: " << ec.message();
  if (fs::exists(final_dir)) {
    if (complete(final_dir)) {
      fs::rename(final_dir, aside, ec);
      MT_CHECK(!ec) << "moving the earlier " << final_dir.string() << " aside to replace it: " << ec.message();
    } else {
      remove_checkpoint(final_dir, ec);
      MT_CHECK(!ec) << "removing the incomplete " << final_dir.string() << " to replace it: " << ec.message();
    }
    sync_dir(root);
  }
  fs::rename(tmp, final_dir, ec);
  MT_CHECK(!ec) << "renaming " << tmp.string() << " to " << final_dir.string() << ": " << ec.message();
  sync_dir(root);
  test_delay();
  io::write_file_atomic((final_dir / "COMPLETE").string(),
                        {nlohmann::json{{"step", st.step}, {"files", files}}.dump(2) + "\n"});
  remove_checkpoint(aside, ec);
  MT_CHECK(!ec) << "removing " << aside.string() << " (replaced by " << final_dir.string() << "): " << ec.message();

  // Keep the newest `keep` complete checkpoints up to this one; drop older ones. Later
  // steps (another branch of the run) are never deleted for this one. This one, whole
  // as just written, is always kept: damaged ones cannot leave the run none that loads.
  int64_t kept = 0;
  for (const std::string& dir : complete_checkpoints(root.string()))
    if (std::max(step_of(dir), step_set_aside(dir)) <= st.step && ++kept > keep) {
      remove_checkpoint(dir, ec);
      MT_CHECK(!ec) << "removing " << dir << " (checkpoint.keep = " << keep << "): " << ec.message();
    }
  // What interrupted saves left of earlier steps goes too, now that this step is complete
  // (one run writes the folder at a time): a folder without COMPLETE, a .tmp, an .old
  // whose step is complete; an .old whose step is not takes its name back.
  std::vector<fs::path> entries;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(it->path());
  auto warn = [](const fs::path& p, const std::error_code& e) {
    if (e) std::fprintf(stderr, "moetrain train: warning: cannot tidy %s, left by an interrupted save: %s\n",
                        p.string().c_str(), e.message().c_str());
  };
  for (const fs::path& p : entries) {
    const std::string n = p.filename().string();
    const int64_t s = n.ends_with(".tmp") ? step_of(root / n.substr(0, n.size() - 4)) : step_of(p);
    if (s < 0 || s >= st.step || complete(p)) continue;
    std::error_code e;
    remove_checkpoint(p, e);
    warn(p, e);
  }
  for (const fs::path& p : entries) {
    const int64_t s = step_set_aside(p);
    if (s < 0 || s >= st.step || !fs::exists(p)) continue;
    std::error_code e;
    if (complete(root / step_name(s)) || !complete(p))
      remove_checkpoint(p, e);
    else
      fs::rename(p, root / step_name(s), e);
    warn(p, e);
  }
  barrier();
  return final_dir.string();
}

std::vector<std::string> complete_checkpoints(const std::string& checkpoints_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  // A run may save and rotate while this lists: a folder gone meanwhile is not listed.
  std::error_code ec;
  for (fs::directory_iterator it(checkpoints_dir, ec), end; !ec && it != end; it.increment(ec))
    if (step_of(it->path()) >= 0 && complete(it->path())) {
      found.emplace_back(step_of(it->path()), it->path().string());
    } else if (const int64_t s = step_set_aside(it->path());
               s >= 0 && complete(it->path()) && !complete(it->path().parent_path() / step_name(s))) {
      found.emplace_back(s, it->path().string());
    }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> out;
  for (const auto& [step, dir] : found) out.push_back(dir);
  return out;
}

std::string find_checkpoint(const std::string& path) {
  MT_CHECK(fs::is_directory(path)) << path << " is not a folder (expected a checkpoint step-NNNNNNNN folder, or a run "
                                   << "folder holding checkpoints/)";
  if (complete(path)) {
    verify_checkpoint(path, false);
    return path;
  }
  fs::path p = fs::path(path).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // a trailing slash
  MT_CHECK(step_of(p) < 0) << path << " is not a complete checkpoint (no COMPLETE marker)";
  const std::string where = fs::is_directory(p / "checkpoints") ? (p / "checkpoints").string() : p.string();
  // The newest whose model files verify, as a resume takes it; each damaged one is named.
  // One that a run's rotation (checkpoint.keep) removed while it was checked is not
  // damaged: the folders are listed again, once.
  for (int look = 0; look < 2; ++look) {
    const std::vector<std::string> found = complete_checkpoints(where);
    MT_CHECK(!found.empty()) << path << " holds no complete checkpoint (looked for step-NNNNNNNN folders with a "
                             << "COMPLETE marker in " << where << ")";
    bool rotated = false;
    for (const std::string& dir : found) {
      try {
        verify_checkpoint(dir, false);
        return dir;
      } catch (const Error& e) {
        if (!complete(dir)) {
          rotated = true;
          continue;
        }
        const auto* damaged = dynamic_cast<const DamagedCheckpoint*>(&e);
        if (damaged == nullptr) throw;
        std::fprintf(stderr, "moetrain: warning: skipping %s: %s\n", dir.c_str(), damaged->why.c_str());
      }
    }
    MT_CHECK(rotated) << "no checkpoint in " << where << " verifies (each is named above): restore the damaged files "
                      << "from a copy, or name a step folder";
  }
  MT_FAIL() << "the checkpoints in " << where << " were removed while being checked, twice: a run saving there "
            << "rotates them (checkpoint.keep) faster than they can be read; try again, or name a step folder";
  return "";
}

void read_checkpoint(const std::string& path, const std::function<void(const std::string& dir)>& read) {
  for (int attempt = 0;; ++attempt) {
    const std::string dir = find_checkpoint(path);
    try {
      read(dir);
      return;
    } catch (const std::exception&) {
      // Gone while read, and not the folder the user named: a run rotated it away.
      if (complete(dir) || fs::path(dir).lexically_normal() == fs::path(path).lexically_normal()) throw;
      MT_CHECK(attempt == 0) << dir << " was removed while being read, as was the one before it: a run saving into "
                             << path << " rotates its checkpoints (checkpoint.keep) faster than they can be read; "
                             << "raise checkpoint.keep, or read a copy";
      std::fprintf(stderr, "moetrain: note: %s was removed while being read (a run rotated it away); reading the "
                   "newest checkpoint again\n", dir.c_str());
    }
  }
}

bool has_mtp_weights(const std::string& folder) {
  const std::vector<std::string> names = io::HfWeights(folder).names();
  return std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.ends_with(".eh_proj.weight"); });
}

namespace {
ModelOptions as_saved(ModelOptions o, const std::string& folder) {
  o.mtp = has_mtp_weights(folder);
  return o;
}
}  // namespace

std::unique_ptr<Model> load_model_folder(const std::string& path, const ModelOptions& options, std::string* read) {
  MT_CHECK(fs::is_directory(path)) << path << " is not a folder (expected a Hugging Face model folder, a checkpoint "
                                   << "step folder or a run folder)";
  std::unique_ptr<Model> model;
  if (!is_checkpoint_folder(path)) {
    model = make_model(path + "/config.json", as_saved(options, path));
    load_hf(*model, path);
    if (read != nullptr) *read = path;
    return model;
  }
  read_checkpoint(path, [&](const std::string& dir) {
    model = make_model(dir + "/config.json", as_saved(options, dir));
    load_checkpoint(dir, *model, nullptr);
    apply_expert_bias(*model, parse_expert_bias(*model, saved_expert_bias(dir)), [](int64_t) { return true; });
    if (read != nullptr) *read = dir;
  });
  return model;
}

std::string saved_expert_bias(const std::string& dir) {
  return fs::exists(fs::path(dir) / "train_state.json") ? read_train_state(dir).expert_bias : "null";
}

std::vector<std::vector<float>> parse_expert_bias(const Model& model, const std::string& json) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, false);
  if (j.is_null()) return {};
  size_t moe = 0;
  for (int64_t l = 0; l < model.all_layers(); ++l) moe += model.is_moe_layer(l);
  const size_t E = static_cast<size_t>(model.num_experts());
  bool fits = j.is_array() && j.size() == moe;
  for (size_t i = 0; fits && i < j.size(); ++i) {
    fits = j[i].is_array() && j[i].size() == E;
    for (size_t e = 0; fits && e < E; ++e) fits = j[i][e].is_number();
  }
  MT_CHECK(fits) << "the checkpoint's expert_bias is not " << moe << " MoE layers of " << E
                 << " numbers: was it saved with another model?";
  return j.get<std::vector<std::vector<float>>>();
}

void apply_expert_bias(Model& model, const std::vector<std::vector<float>>& bias,
                       const std::function<bool(int64_t)>& held) {
  size_t i = 0;
  for (int64_t l = 0; l < model.all_layers() && !bias.empty(); ++l) {
    if (!model.is_moe_layer(l)) continue;
    if (held(l)) model.set_expert_bias(l, bias[i]);
    ++i;
  }
}

TrainState read_train_state(const std::string& dir) {
  MT_CHECK(complete(dir)) << dir << " is not a complete checkpoint (no COMPLETE marker)";
  const Manifest m = read_manifest(dir);
  if (!m.legacy) {
    const auto it = m.files.find("train_state.json");
    const std::string why = it == m.files.end() ? "COMPLETE does not list train_state.json"
                                                : file_damage(dir, "train_state.json", it->second);
    if (!why.empty()) throw DamagedCheckpoint(dir, why);
  }
  std::vector<uint8_t> b = io::read_file((fs::path(dir) / "train_state.json").string());
  nlohmann::json j = nlohmann::json::parse(b.begin(), b.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer())
    throw DamagedCheckpoint(dir, "train_state.json does not read: expected a JSON object with an integer \"step\"");
  // Each key's type, checked before it is read, so that a wrong one is named.
  struct Expect {
    const char* key;
    bool (nlohmann::json::*is)() const noexcept;
    const char* what;
  };
  for (const Expect& x : {Expect{"seed", &nlohmann::json::is_number_integer, "an integer"},
                          Expect{"lr", &nlohmann::json::is_number, "a number"},
                          Expect{"config", &nlohmann::json::is_string, "a string"},
                          Expect{"origin", &nlohmann::json::is_string, "a string"}})
    MT_CHECK(!j.contains(x.key) || (j[x.key].*x.is)())
        << dir << "/train_state.json: key \"" << x.key << "\" is " << j[x.key].dump() << " (expected " << x.what
        << "); the file was edited or is damaged";
  TrainState st;
  st.step = j["step"].get<int64_t>();
  st.seed = j.value("seed", int64_t{0});
  st.lr = j.value("lr", 0.0);
  st.data_cursor = j.contains("data_cursor") ? j["data_cursor"].dump() : "null";
  st.expert_placement = j.contains("expert_placement") ? j["expert_placement"].dump() : "null";
  st.expert_bias = j.contains("expert_bias") ? j["expert_bias"].dump() : "null";
  st.config_toml = j.value("config", std::string());
  st.origin = j.value("origin", std::string());
  st.inputs = j.contains("inputs") ? j["inputs"].dump() : "null";
  // The folder's name says the step too (a step edited to 999 was trusted, and rotation
  // then deleted good checkpoints).
  fs::path folder = fs::path(dir).lexically_normal();
  if (!folder.has_filename()) folder = folder.parent_path();  // a trailing slash
  const int64_t named = step_of(folder);
  MT_CHECK(named < 0 || named == st.step) << dir << "/train_state.json: step " << st.step << " but the folder is step "
                                          << named << "; the checkpoint was edited or moved";
  return st;
}

void verify_checkpoint(const std::string& dir, bool optimizer, comm::Communicator* ranks) {
  const int rank = ranks ? ranks->rank() : 0, size = ranks ? ranks->size() : 1;
  const Manifest m = read_manifest(dir);
  if (m.legacy) {
    // Loaded rather than refused: refusing would strand every run saved before manifests,
    // and the safetensors files' own checks still catch truncation.
    if (rank == 0)
      std::fprintf(stderr, "moetrain: note: %s has no checksums (saved before checkpoints recorded them), so its "
                   "files cannot be verified\n", dir.c_str());
    return;
  }
  std::string why;
  size_t i = 0;
  for (const auto& [name, want] : m.files)
    if ((optimizer || !name.starts_with("optimizer")) && i++ % size == static_cast<size_t>(rank) && why.empty())
      why = file_damage(dir, name, want);
  if (size > 1) {
    // The first rank that found damage speaks for all: every rank falls back or goes on.
    std::vector<int64_t> found(static_cast<size_t>(size));
    int64_t mine = why.empty() ? 0 : 1;
    ranks->all_gather(Tensor(&mine, {1}, DType::i64), Tensor(found.data(), {size}, DType::i64));
    const auto first = std::find(found.begin(), found.end(), 1);
    if (first == found.end()) return;
    why = comm::broadcast_text(*ranks, why, static_cast<int>(first - found.begin()));
  }
  if (!why.empty()) throw DamagedCheckpoint(dir, why);
}

TrainState load_checkpoint(const std::string& dir, Model& model, Optimizer* opt, comm::Communicator* ranks) {
  MT_CHECK(complete(dir)) << dir << " is not a complete checkpoint (no COMPLETE marker)";
  verify_checkpoint(dir, opt != nullptr, ranks);
  io::HfWeights weights(dir);
  std::vector<HfTensor> tensors = model.hf_tensors();
  std::vector<float> host;
  // Whether tensor `name` belongs to the model: to this rank's part of it, or another's.
  auto owned = [&](const std::string& name) {
    return std::any_of(tensors.begin(), tensors.end(), [&](const HfTensor& t) { return t.name == name; }) ||
           model.held_by_another_rank(name);
  };
  for (const HfTensor& t : tensors) {
    host.resize(static_cast<size_t>(t.value.numel()));
    weights.read_f32(t.name, dims(t.value), host.data());
    from_host(t.value, host);
  }
  refresh_compute_weights(model.params());
  for (const std::string& name : weights.names())
    MT_CHECK(owned(name)) << dir << "/model.safetensors: tensor " << name
                          << " is not a parameter of this model (was the checkpoint written for another config?)";
  if (opt != nullptr) {
    io::HfWeights moments(dir, "optimizer");
    for (const HfTensor& t : tensors) {
      for (const char* suffix : optimizer_state(*opt, t)) {
        host.resize(static_cast<size_t>(t.value.numel()));
        moments.read_f32(t.name + suffix, dims(t.value), host.data());
        from_host(std::string_view(suffix) == ".exp_avg_sq" ? opt->exp_avg_sq(t.value) : opt->exp_avg(t.value), host);
      }
    }
    for (const std::string& name : moments.names())
      MT_CHECK(owned(name.substr(0, name.rfind('.'))))
          << dir << ": optimizer state " << name << " belongs to no parameter of this model";
  }
  return read_train_state(dir);
}

namespace {

// Where the tokenizer a checkpoint carries comes from: the corpus's (tokenize copies it
// there), else the folder of an hf:DIR model or of model.config.
std::string tokenizer_dir(const Config& c, const std::string& config_json) {
  const std::vector<MixturePart> corpora = data_corpora(c);
  for (const std::string& d : {corpora.empty() ? std::string() : corpora[0].folder,
                               c.model.init.starts_with("hf:") ? c.model.init.substr(3) : ""})
    if (!d.empty() && fs::exists(fs::path(d) / "tokenizer.json")) return d;
  return fs::path(config_json).parent_path().string();
}

// A resume from checkpoint `dir`, saved with `saved` (TOML): a change of a key that an
// exact resume needs unchanged is refused unless checkpoint.allow_config_change; `print`
// prints every changed key.
void compare_with_checkpoint(const Config& cfg, const std::string& dir, const TrainState& saved, bool print) {
  std::vector<ConfigChange> changes = config_changes(saved.config_toml, cfg);
  // The files it reads, by content: a model config.json edited in place, a corpus file
  // added, rewritten or removed changes the run as a changed key would.
  const nlohmann::json was = nlohmann::json::parse(saved.inputs, nullptr, false);
  if (was.is_object()) {
    const std::map<std::string, std::string> now = input_identity(cfg, true);
    // The validation set changes what val_loss means, not the training: named, not refused.
    auto breaks = [](const std::string& file) { return !file.starts_with("validation."); };
    for (const auto& [file, what] : was.items()) {
      const auto it = now.find(file);
      const std::string before = what.is_string() ? what.get<std::string>() : what.dump();
      if (it == now.end()) changes.push_back({file, before, "no such file", breaks(file)});
      else if (it->second != before) changes.push_back({file, before, it->second, breaks(file)});
    }
    for (const auto& [file, what] : now)
      if (!was.contains(file)) changes.push_back({file, "no such file", what, breaks(file)});
  }
  std::string fixed;
  for (const ConfigChange& c : changes)
    if (c.breaks_resume) fixed += (fixed.empty() ? "" : ", ") + c.key + " (" + c.before + " -> " + c.after + ")";
  MT_CHECK(fixed.empty() || cfg.checkpoint.allow_config_change)
      << fixed << " changed since " << dir << " was saved, and an exact resume needs them unchanged: set them back "
      << "(restore the files), start a new run (another job.dump_folder), or resume anyway with "
      << "--checkpoint.allow_config_change=true";
  if (!print || changes.empty()) return;
  std::printf("config changed since %s:\n", dir.c_str());
  for (const ConfigChange& c : changes) std::printf("  %s: %s -> %s\n", c.key.c_str(), c.before.c_str(), c.after.c_str());
}

}  // namespace

ResumeChoice choose_resume(const Config& cfg) {
  ResumeChoice c;
  const fs::path folder(cfg.job.dump_folder), own_dir = folder / "checkpoints";
  const std::vector<std::string> own = complete_checkpoints(own_dir.string());
  const std::string& load = cfg.checkpoint.load;
  MT_CHECK(load.empty() || is_checkpoint_folder(load))
      << "checkpoint.load = " << load << " is a Hugging Face model folder, not a moetrain checkpoint (no COMPLETE, no "
      << "train_state.json): start from its weights with model.init=hf:" << load;
  // Step folders an interrupted save left (no COMPLETE) are named: a resume skips them.
  std::error_code it_ec;
  for (fs::directory_iterator it(own_dir, it_ec), end; !it_ec && it != end; it.increment(it_ec))
    if ((step_of(it->path()) >= 0 || it->path().filename().string().ends_with(".tmp")) && !complete(it->path()))
      c.incomplete.push_back(it->path().string());
  std::sort(c.incomplete.begin(), c.incomplete.end());
  if (load.empty()) {
    c.tries = own;
    return c;
  }
  c.origin = fs::absolute(load).lexically_normal().string();
  if (c.origin.ends_with("/")) c.origin.pop_back();
  c.tries = {load};
  if (own.empty()) return c;
  std::error_code ec;
  const bool inside = fs::equivalent(fs::path(c.origin).parent_path(), own_dir, ec);
  if (!inside) {
    c.tries = own;
    c.note = "checkpoint.load = " + load + " applies to a run's first start: " + folder.string() +
             " holds checkpoints of its own since, so this run resumes from its newest (another job.dump_folder " +
             "starts from " + load + " again)";
    return c;
  }
  // A checkpoint of this folder: the requeue of a branch from it, or a new branch.
  std::string newest_origin;
  try {
    newest_origin = read_train_state(own.front()).origin;
  } catch (const Error&) {
    // Damaged: resume_run names it; the branch is judged by the others.
  }
  if (newest_origin == c.origin && !fs::equivalent(own.front(), c.origin, ec)) {
    c.tries = own;
    c.note = "checkpoint.load = " + load + " was this run's branch point, and the branch has gone on since: resuming "
             "from its newest checkpoint (checkpoint.load applies to the branch's first start)";
    return c;
  }
  const int64_t from = read_train_state(load).step;
  for (const std::string& dir : own)
    if (std::max(step_of(dir), step_set_aside(dir)) > from) c.set_aside.push_back(dir);
  if (c.set_aside.empty()) return c;
  c.branch_step = from;
  const std::string base = (folder / "branches" / ("from-" + step_name(from))).string();
  c.branch_dir = base;
  for (int k = 2; fs::exists(c.branch_dir); ++k) c.branch_dir = base + "-" + std::to_string(k);
  c.note = "branching from step " + std::to_string(from) + ": the " + std::to_string(c.set_aside.size()) +
           " later checkpoint(s) of this folder and its metrics lines after step " + std::to_string(from) +
           " moved to " + c.branch_dir;
  return c;
}

void set_branch_aside(const Config& cfg, const ResumeChoice& c) {
  if (c.set_aside.empty()) return;
  const fs::path branch(c.branch_dir), checkpoints = branch / "checkpoints";
  std::error_code ec;
  fs::create_directories(checkpoints, ec);
  MT_CHECK(!ec) << "cannot create " << checkpoints.string() << " for the branch's set-aside checkpoints: "
                << ec.message();
  // The metrics lines after the branch point go with them: the run's own file keeps
  // what precedes the branch (run.cpp truncates it on resume).
  const std::string metrics = cfg.job.dump_folder + "/metrics.jsonl";
  if (fs::exists(metrics)) {
    std::vector<uint8_t> b = io::read_file(metrics);
    std::istringstream in(std::string(b.begin(), b.end()));
    std::string line, later;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("step", int64_t{0}) > c.branch_step) later += line + "\n";
    }
    io::write_file_atomic((branch / "metrics.jsonl").string(), {later});
  }
  for (const std::string& dir : c.set_aside) {
    fs::rename(dir, checkpoints / fs::path(dir).filename(), ec);
    MT_CHECK(!ec) << "moving " << dir << " to " << checkpoints.string() << " (a branch's set-aside checkpoints): "
                  << ec.message();
  }
  sync_dir(checkpoints);
  sync_dir(fs::path(cfg.job.dump_folder) / "checkpoints");
}

std::pair<std::string, TrainState> resume_run(const Config& cfg, const std::vector<std::string>& tries, Model& model,
                                              Trainer& trainer, comm::Communicator& world, bool print) {
  // Sharded moments are read laid out like the weights, then cut into this rank's shards.
  trainer.materialize_state();
  // load_checkpoint checks every file first, alike on every rank; the load of the one
  // before a damaged one (skipped, as checkpoint.h says) writes every key again.
  std::string resume;
  TrainState saved;
  for (const std::string& dir : tries) {
    try {
      saved = read_train_state(dir);
      if (!saved.config_toml.empty()) compare_with_checkpoint(cfg, dir, saved, false);
      // Another optimizer (allowed by checkpoint.allow_config_change): its state starts afresh.
      const std::vector<ConfigChange> changed =
          saved.config_toml.empty() ? std::vector<ConfigChange>{} : config_changes(saved.config_toml, cfg);
      const bool other_optimizer = std::any_of(changed.begin(), changed.end(),
                                               [](const ConfigChange& c) { return c.key == "optimizer.name"; });
      if (other_optimizer && print)
        std::printf("optimizer.name changed since %s was saved: the optimizer's state starts afresh\n", dir.c_str());
      load_checkpoint(dir, model, other_optimizer ? nullptr : &trainer.optimizer(), &world);
      resume = dir;
      break;
    } catch (const DamagedCheckpoint& e) {
      if (!cfg.checkpoint.load.empty()) throw;
      if (print) std::fprintf(stderr, "moetrain train: warning: skipping %s: %s\n", dir.c_str(), e.why.c_str());
    }
  }
  MT_CHECK(!resume.empty()) << "no checkpoint in " << cfg.job.dump_folder << "/checkpoints verifies (each is named "
                            << "above): restore the damaged files from a copy, or start afresh in another "
                            << "job.dump_folder";
  if (!saved.config_toml.empty()) compare_with_checkpoint(cfg, resume, saved, print);
  trainer.commit_state();
  trainer.set_steps_done(saved.step);
  trainer.set_data_cursor(saved.data_cursor);
  trainer.set_expert_placement(saved.expert_placement, print);
  trainer.set_expert_bias(saved.expert_bias);
  return {resume, saved};
}

std::string save_run(const Config& cfg, Model& model, Trainer& trainer, comm::DeviceMesh& mesh, const TrainState& state,
                     const std::string& config_json) {
  trainer.materialize_state();
  std::string dir;
  if (mesh.coord().dp == 0 && mesh.coord().cp == 0)
    dir = save_checkpoint(cfg.job.dump_folder + "/checkpoints", model, trainer.optimizer(), state, config_json,
                          tokenizer_dir(cfg, config_json), cfg.checkpoint.keep, &mesh.pp_ep(), mesh.coord().ep == 0);
  trainer.release_state();
  mesh.world().barrier();
  return mesh.world().rank() == 0 ? dir : "";
}

}  // namespace mt
