// moetrain export-hf: a checkpoint as a Hugging Face model folder that transformers
// and vLLM load as it is.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/check.h"
#include "core/dtype.h"
#include "data/tokenizer.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "models/interface.h"
#include "train/checkpoint.h"

namespace mt::cli {

namespace {

namespace fs = std::filesystem;

// "5GB", "500MB", "64KB", "1000": decimal units, as transformers reads them; at most 1 PB.
int64_t parse_size(const std::string& s) {
  int64_t n = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  const std::string unit(end, s.data() + s.size());
  const int64_t scale = unit.empty() || unit == "B" ? 1 : unit == "KB" ? 1000 : unit == "MB" ? 1000000 : unit == "GB" ? 1000000000 : 0;
  MT_CHECK(ec == std::errc() && n >= 1 && scale > 0 && n <= int64_t{1000000000000000} / scale)
      << "--max-shard-size should look like 5GB, 500MB, 64KB or a byte count (units B, KB, MB, GB; at most 1 PB), "
      << "got '" << s << "'";
  return n * scale;
}

// Hugging Face key `key` [E, ...] from the checkpoint's experts 0..E-1 (`experts`, by
// index), one key each in moetrain's layout; into out, its shape returned.
std::vector<int64_t> stack_experts(const io::HfWeights& w, const fs::path& ckpt, const std::string& key,
                                   const std::vector<HfTensor>& experts, std::vector<float>& out) {
  const int64_t E = static_cast<int64_t>(experts.size());
  std::vector<int64_t> shape;
  std::vector<float> one;
  for (int64_t e = 0; e < E; ++e) {
    const HfTensor& t = experts[static_cast<size_t>(e)];
    MT_CHECK(!t.name.empty() && w.contains(t.name))
        << ckpt.string() << ": Hugging Face key " << key << " holds experts 0.." << E - 1 << ", but expert " << e
        << (t.name.empty() ? " is not one of the model's tensors" : " (" + t.name + ") is not in the checkpoint");
    if (e == 0) {
      shape = hf_shape(t, E);
      out.resize(static_cast<size_t>(E * t.value.numel()));
    }
    MT_CHECK(hf_shape(t, E) == shape) << t.name << ": shape " << t.value.shape.str() << " unlike expert 0's";
    one.resize(static_cast<size_t>(t.value.numel()));
    w.read_f32(t.name, {t.value.shape.d.begin(), t.value.shape.d.begin() + t.value.ndim()}, one.data());
    float* dst = out.data() + e * t.value.numel();
    if (t.transposed)
      io::transpose_f32(one.data(), t.value.dim(0), t.value.dim(1), dst);
    else
      std::copy(one.begin(), one.end(), dst);
  }
  return shape;
}

// What an export writes besides its model*.safetensors shards: config.json, the
// tokenizer's files and the generation config.
bool exported_file(const std::string& n) {
  return n == "config.json" || n.starts_with("tokenizer") || n == "special_tokens_map.json" || n == "vocab.json" ||
         n == "merges.txt" || n == "added_tokens.json" || n == "chat_template.jinja" || n == "generation_config.json";
}

// Where the checkpoint has none: generation_config.json with config.json's bos, eos and
// pad ids (eos: else the tokenizer's end-of-document token, which ends every document of
// a corpus), and beside a tokenizer.json a tokenizer_config.json that loads it as it is.
// Returns the files written.
int write_generation_files(const fs::path& ckpt, const nlohmann::json& config, const fs::path& out) {
  std::unique_ptr<data::Tokenizer> tok;
  if (fs::exists(ckpt / "tokenizer.json")) tok = std::make_unique<data::Tokenizer>((ckpt / "tokenizer.json").string());
  nlohmann::json gen = {{"_from_model_config", true}};
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (config.contains(key) && !config[key].is_null()) gen[key] = config[key];
  if (!gen.contains("eos_token_id") && tok && tok->has_eos()) gen["eos_token_id"] = tok->eos_id();
  int written = 0;
  if (!fs::exists(ckpt / "generation_config.json")) {
    io::write_file_atomic((out / "generation_config.json").string(), {gen.dump(2) + "\n"});
    ++written;
  }
  if (tok && !fs::exists(ckpt / "tokenizer_config.json")) {
    nlohmann::json tc = {{"tokenizer_class", "PreTrainedTokenizerFast"}};
    auto token = [&](int32_t id) { return tok->decode(std::vector<int32_t>{id}); };
    if (gen.contains("bos_token_id") && gen["bos_token_id"].is_number_integer())
      tc["bos_token"] = token(gen["bos_token_id"].get<int32_t>());
    if (gen.contains("eos_token_id") && gen["eos_token_id"].is_number_integer())
      tc["eos_token"] = token(gen["eos_token_id"].get<int32_t>());
    io::write_file_atomic((out / "tokenizer_config.json").string(), {tc.dump(2) + "\n"});
    ++written;
  }
  return written;
}

// The files of an earlier export, which --force may replace: its shards and index, the
// config, tokenizer and generation files.
bool export_file(const std::string& n) {
  return exported_file(n) || (n.starts_with("model") && (n.ends_with(".safetensors") || n.ends_with(".index.json")));
}

// What an export wrote.
struct Written {
  size_t tensors = 0, shards = 0;
  int64_t bytes = 0;
  int copied = 0;  // tokenizer and generation files
  // Expert biases that the architecture has no key for (all but DeepSeek-V3's): dropped.
  bool biases_dropped = false;
};

// The export of checkpoint `ckpt` into the new folder `out`.
Written write_export(const fs::path& ckpt, const fs::path& out, bool bf16, int64_t max_shard) {
  // Experts that Hugging Face keeps as slices of one key per layer (GPT-OSS): the model
  // built from config.json, without memory, says which.
  ModelOptions plan;
  plan.plan_only = true;
  plan.mtp = has_mtp_weights(ckpt.string());
  std::unique_ptr<Model> model = make_model((ckpt / "config.json").string(), plan);
  std::map<std::string, std::vector<HfTensor>> fused;  // key -> its experts, by index
  std::map<std::string, std::string> fused_of;         // checkpoint key -> its fused key
  for (HfTensor& t : model->hf_tensors()) {
    if (t.fused.empty()) continue;
    MT_CHECK(t.fused_index >= 0 && t.fused_index < model->num_experts())
        << t.name << ": expert " << t.fused_index << " of " << model->num_experts();
    fused_of[t.name] = t.fused;
    std::vector<HfTensor>& experts = fused[t.fused];
    experts.resize(static_cast<size_t>(model->num_experts()));
    experts[static_cast<size_t>(t.fused_index)] = std::move(t);
  }

  // model.safetensors, or (expert-parallel runs) the per-rank files of its index.
  io::HfWeights weights(ckpt.string());
  std::error_code ec;
  fs::create_directories(out, ec);
  MT_CHECK(!ec && fs::is_directory(out)) << "cannot create the output folder " << out.string() << ": " << ec.message();

  // Convert every tensor, then cut the list into shards of at most max_shard bytes.
  std::vector<std::vector<uint16_t>> data;  // bf16 values, or fp32 ones as pairs of halves
  std::vector<io::StWrite> all;
  std::vector<float> f;
  for (const std::string& name : weights.names()) {
    auto key = fused_of.find(name);
    std::vector<int64_t> shape;
    if (key == fused_of.end()) {
      shape = weights.shape(name);
      f.resize(static_cast<size_t>(weights.tensor(name).numel()));
      weights.read_f32(name, shape, f.data());
    } else if (fused.contains(key->second)) {  // the key's first expert: the whole key
      shape = stack_experts(weights, ckpt, key->second, fused[key->second], f);
      fused.erase(key->second);
    } else {
      continue;
    }
    std::vector<uint16_t>& converted = data.emplace_back(f.size() * (bf16 ? 1 : 2));
    if (bf16)
      std::transform(f.begin(), f.end(), converted.begin(), bf16_from_f32);
    else
      std::memcpy(converted.data(), f.data(), f.size() * 4);
    all.push_back({key == fused_of.end() ? name : key->second, bf16 ? "BF16" : "F32", shape, converted.data()});
  }
  // DeepSeek-V3's correction biases: the checkpoint's expert bias (zero where it has none),
  // kept in fp32 as the released checkpoints and transformers keep them.
  const std::string saved = saved_expert_bias(ckpt.string());
  const bool dropped = saved != "null" && !model->sigmoid_routing();
  const std::vector<std::vector<float>> bias = saved == "null" ? std::vector<std::vector<float>>{}
                                                                : parse_expert_bias(*model, saved);
  std::vector<HfTensor> buffers = model->hf_buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    f.assign(static_cast<size_t>(model->num_experts()), 0.0f);
    if (i < bias.size()) f = bias[i];
    std::vector<uint16_t>& converted = data.emplace_back(f.size() * 2);
    std::memcpy(converted.data(), f.data(), f.size() * 4);
    all.push_back({buffers[i].name, "F32", {model->num_experts()}, converted.data()});
  }
  MT_CHECK(fused.empty()) << ckpt.string() << ": Hugging Face key " << fused.begin()->first
                          << " holds experts the checkpoint has none of (such as "
                          << fused.begin()->second[0].name << ")";
  std::vector<std::vector<io::StWrite>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    int64_t bytes = static_cast<int64_t>(data[i].size() * 2);
    if (in_shard > 0 && in_shard + bytes > max_shard) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(all[i]);
    in_shard += bytes;
    total += bytes;
  }
  nlohmann::json index;
  index["metadata"]["total_size"] = total;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::string file = shards.size() == 1 ? "model.safetensors" : name;
    io::write_safetensors((out / file).string(), shards[s], {{"format", "pt"}});
    for (const io::StWrite& w : shards[s]) index["weight_map"][w.name] = file;
  }
  if (shards.size() > 1) io::write_file_atomic((out / "model.safetensors.index.json").string(), {index.dump(2)});

  std::vector<uint8_t> cb = io::read_file((ckpt / "config.json").string());
  nlohmann::json config = nlohmann::json::parse(cb.begin(), cb.end(), nullptr, false);
  MT_CHECK(config.is_object()) << (ckpt / "config.json").string() << ": not a JSON object";
  config = text_config(config);  // a multimodal import exports its language model alone
  config.erase("quantization_config");  // what was quantized on import is bf16 or fp32 now
  const char* torch_dtype = bf16 ? "bfloat16" : "float32";
  if (config.contains("dtype")) config["dtype"] = torch_dtype;
  if (config.contains("torch_dtype") || !config.contains("dtype")) config["torch_dtype"] = torch_dtype;
  io::write_file_atomic((out / "config.json").string(), {config.dump(2) + "\n"});
  int copied = 0;
  for (const auto& e : fs::directory_iterator(ckpt)) {
    std::string n = e.path().filename().string();
    if (!exported_file(n) || n == "config.json") continue;  // the tokenizer's and generation files
    std::vector<uint8_t> b = io::read_file(e.path().string());
    io::write_file_atomic((out / n).string(), {std::string_view(reinterpret_cast<const char*>(b.data()), b.size())});
    ++copied;
  }
  return {all.size(), shards.size(), total, copied + write_generation_files(ckpt, config, out), dropped};
}

}  // namespace

int run_export_hf(const Args& args) {
  Options o("export-hf", args, {"checkpoint", "output", "dtype", "max-shard-size", "force?"});
  const std::string dtype = o.get("dtype", "bf16");
  MT_CHECK(dtype == "bf16" || dtype == "fp32") << "--dtype should be bf16 or fp32, got '" << dtype << "'";
  const int64_t max_shard = parse_size(o.get("max-shard-size", "5GB"));
  const std::string named = o.required("checkpoint");
  // Lexically, so that a/b/../c makes no a/b; a trailing slash names the folder itself.
  fs::path dest = fs::path(o.required("output")).lexically_normal();
  if (!dest.has_filename()) dest = dest.parent_path();
  MT_CHECK(!dest.empty() && dest.filename() != "." && dest.filename() != "..")
      << "--output " << o.required("output") << " should name a folder to write";
  // Never the checkpoint or a folder holding it (the checkpoint found is within `named`).
  const fs::path rel = fs::weakly_canonical(named).lexically_relative(fs::weakly_canonical(dest));
  MT_CHECK(rel.empty() || *rel.begin() == "..")
      << "--output " << dest.string() << " holds the checkpoint " << named
      << " (an export there would replace its fp32 weights); choose another folder";
  std::error_code ec;
  if (dest.has_parent_path()) fs::create_directories(dest.parent_path(), ec);
  MT_CHECK(!ec) << "cannot create " << dest.parent_path().string() << " for --output: " << ec.message();
  // One export an output at a time: DIR.lock beside it, held until the swap is done.
  std::optional<io::FileLock> lock;
  try {
    lock.emplace(dest.string() + ".lock", "moetrain export-hf to " + dest.string());
  } catch (const io::LockHeld& e) {
    MT_FAIL() << "--output " << dest.string() << " is being written by another export: " << e.message
              << "; wait for it to end, or choose another --output";
  } catch (const Error& e) {
    MT_FAIL() << "--output " << dest.string() << ": cannot write beside it (" << e.message
              << "); choose a folder you can write";
  }
  // The export is written beside dest and swapped in whole: no stale shard of an earlier
  // export stays for loaders to prefer. dest may be new or empty; with --force a folder
  // that holds an earlier export and nothing else. Never a checkpoint, and never what
  // export-hf does not write.
  if (fs::exists(dest)) {
    MT_CHECK(fs::is_directory(dest)) << "--output " << dest.string() << " is a file, not a folder";
    MT_CHECK(fs::is_empty(dest) || o.has("force"))
        << "--output " << dest.string() << " is not empty; add --force to replace an earlier export there, or choose "
        << "a new folder";
    MT_CHECK(!fs::exists(dest / "COMPLETE") && !fs::exists(dest / "train_state.json"))
        << "--output " << dest.string() << " holds a checkpoint (" << (fs::exists(dest / "COMPLETE") ? "COMPLETE" : "")
        << (fs::exists(dest / "COMPLETE") && fs::exists(dest / "train_state.json") ? ", " : "")
        << (fs::exists(dest / "train_state.json") ? "train_state.json" : "")
        << "), which an export never replaces, --force or not; choose another folder";
    std::string foreign;
    int named = 0;
    for (const auto& e : fs::directory_iterator(dest)) {
      const std::string n = e.path().filename().string();
      if (e.is_regular_file() && export_file(n)) continue;
      if (named++ < 5) foreign += (foreign.empty() ? "" : ", ") + n + (e.is_directory() ? "/" : "");
    }
    if (named > 5) foreign += " and " + std::to_string(named - 5) + " more";
    MT_CHECK(foreign.empty()) << "--output " << dest.string() << " holds what export-hf does not write (" << foreign
                              << "); --force replaces an earlier export only: move them, or choose another folder";
  }
  const fs::path out = dest.string() + ".tmp", old = dest.string() + ".old";
  // Left by an export that died (this one holds the lock now); and on failure, its own.
  fs::remove_all(out);
  fs::remove_all(old);
  struct Cleanup {
    const fs::path& out;
    bool done = false;
    ~Cleanup() {
      std::error_code ignored;
      if (!done) fs::remove_all(out, ignored);
    }
  } cleanup{out};
  // find_checkpoint verifies it: no damaged file passes into an export. A run saving
  // there may rotate it away meanwhile: read_checkpoint reads the newest again.
  fs::path ckpt;
  Written w;
  read_checkpoint(named, [&](const std::string& dir) {
    ckpt = dir;
    fs::remove_all(out);
    w = write_export(ckpt, out, dtype == "bf16", max_shard);
  });
  if (w.biases_dropped)
    std::fprintf(stderr, "moetrain export-hf: warning: %s's routers carry expert biases (training."
                         "expert_bias_update_rate), which these Hugging Face architectures have no place for: the "
                         "export routes without them (moetrain eval and generate of the checkpoint route with them)\n",
                 ckpt.string().c_str());
  // Swap: until the second rename dest is whole (the old one), after it the new one.
  if (fs::exists(dest)) fs::rename(dest, old);
  fs::rename(out, dest, ec);
  MT_CHECK(!ec) << "renaming " << out.string() << " to " << dest.string() << ": " << ec.message();
  cleanup.done = true;
  fs::remove_all(old);
  std::printf("exported %s: %zu tensors (%s, %zu shard%s, %lld bytes) and %d tokenizer and generation file%s to %s\n",
              ckpt.string().c_str(), w.tensors, dtype.c_str(), w.shards, w.shards == 1 ? "" : "s",
              static_cast<long long>(w.bytes), w.copied, w.copied == 1 ? "" : "s", dest.string().c_str());
  return 0;
}

}  // namespace mt::cli
