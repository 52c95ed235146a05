// moetrain generate: continues a prompt with a Hugging Face model folder or a
// checkpoint. Each new token runs the whole sequence's forward again (no KV cache: this
// is for looking at what a model learned and for checks against transformers, not for
// serving) and picks from the last position's logits: greedy at temperature 0, else a
// seeded draw (Philox: the same seed gives the same tokens) from the top-p nucleus.
// With --offload-experts N the routed experts stay in host memory and N of them at a
// time are on the device, in the expert cache's lines of one expert
// (models/expert_cache.h); the tokens/s and the cache's hit rate then go to stderr.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/arena.h"
#include "cli/commands.h"
#include "core/check.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "io/file.h"
#include "kernels/elementwise.h"
#include "models/hf_config.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace mt::cli {

namespace {

namespace fs = std::filesystem;

// "1,2,3" (brackets and spaces allowed) -> ids, each in [0, vocab).
std::vector<int32_t> parse_ids(const std::string& text, int64_t vocab) {
  std::vector<int32_t> ids;
  std::string s = text;
  std::replace_if(s.begin(), s.end(), [](char c) { return c == '[' || c == ']' || c == ' '; }, ',');
  for (size_t at = 0; at < s.size();) {
    size_t end = std::min(s.find(',', at), s.size());
    if (end > at) {
      int64_t id = -1;
      auto [p, ec] = std::from_chars(s.data() + at, s.data() + end, id);
      MT_CHECK(ec == std::errc() && p == s.data() + end && id >= 0 && id < vocab)
          << "--prompt-ids expects ids in [0, " << vocab << ") separated by commas, got '" << s.substr(at, end - at)
          << "' in '" << text << "'";
      ids.push_back(static_cast<int32_t>(id));
    }
    at = end + 1;
  }
  return ids;
}

// The ids that end a generation: eos_token_id (a number or a list) of the folder's
// generation_config.json, else of its config.json; none when neither sets it.
std::vector<int64_t> eos_ids(const fs::path& dir) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    if (!fs::exists(dir / name)) continue;
    std::vector<uint8_t> b = io::read_file((dir / name).string());
    nlohmann::json j = nlohmann::json::parse(b.begin(), b.end(), nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("eos_token_id") || j["eos_token_id"].is_null()) continue;
    const nlohmann::json& e = j["eos_token_id"];
    const bool ids = e.is_array() && std::all_of(e.begin(), e.end(), [](const auto& x) { return x.is_number_integer(); });
    MT_CHECK(e.is_number_integer() || ids)
        << (dir / name).string() << ": eos_token_id should be an id or a list of ids, got " << e.dump();
    return e.is_array() ? e.get<std::vector<int64_t>>() : std::vector<int64_t>{e.get<int64_t>()};
  }
  return {};
}

// The next id from the last position's logits: the largest (temperature 0; a tie goes
// to the lower id, as torch.argmax), else a draw from softmax(logits / temperature)
// over the most likely ids whose probabilities first reach top_p (at least one),
// with a uniform number that depends only on (seed, step).
int32_t pick(const std::vector<float>& logits, double temperature, double top_p, uint64_t seed, int64_t step) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  if (temperature == 0) return order[0];
  std::vector<double> p(order.size());
  double total = 0;
  for (size_t i = 0; i < order.size(); ++i)
    total += p[i] = std::exp((logits[order[i]] - logits[order[0]]) / temperature);
  size_t kept = 0;
  double mass = 0;
  while (kept < p.size() && (kept == 0 || mass < top_p * total)) mass += p[kept++];
  float u = 0;
  fill_uniform(&u, 1, seed, static_cast<uint64_t>(step), 0.0f, 1.0f);  // in (0, 1]
  double target = u * mass, sum = 0;
  for (size_t i = 0; i < kept; ++i)
    if ((sum += p[i]) >= target) return order[i];
  return order[kept - 1];  // rounding left the sum a little short of the target
}

}  // namespace

int run_generate(const Args& args) {
  Options o("generate", args,
            {"model", "prompt", "prompt-ids", "max-new-tokens", "temperature", "top-p", "seed", "device",
             "past-max-positions?", "offload-experts"});
  fs::path dir = o.required("model");
  const std::string device = o.get("device", "cpu");
  MT_CHECK(device == "cpu" || device == "cuda") << "--device should be cpu or cuda, got '" << device << "'";
  if (device == "cuda") require_gpu("--device cuda");
  const int64_t max_new = o.integer("max-new-tokens", 32, 0, kMaxConfigInteger);
  const double temperature = o.number("temperature", 0.0, 0.0, 1e6);  // 0: greedy
  const double top_p = o.number("top-p", 1.0, 1e-9, 1.0);
  const uint64_t seed = static_cast<uint64_t>(o.integer("seed", 0, 0));
  MT_CHECK(o.has("prompt") != o.has("prompt-ids")) << "give one of --prompt TEXT and --prompt-ids 1,2,3";

  // A Hugging Face folder, or a checkpoint: a step folder, or a run folder's newest.
  ModelOptions options;
  options.device = device == "cuda" ? Device::cuda : Device::cpu;
  if (o.has("offload-experts")) {
    options.offload_experts = options.offload_weights = true;
    options.expert_slots = o.integer("offload-experts", 1, 1, kMaxConfigInteger);
    options.expert_line = 1;
  }
  std::string read;
  std::unique_ptr<Model> model = load_model_folder(dir.string(), options, &read);
  dir = read;
  std::unique_ptr<data::Tokenizer> tok;
  if (fs::exists(dir / "tokenizer.json")) tok = std::make_unique<data::Tokenizer>((dir / "tokenizer.json").string());
  MT_CHECK(tok || !o.has("prompt")) << dir.string() << " has no tokenizer.json to encode --prompt with; give the ids "
                                    << "with --prompt-ids 1,2,3";
  std::vector<int32_t> ids =
      o.has("prompt") ? tok->encode(o.get("prompt")) : parse_ids(o.get("prompt-ids"), model->vocab_size());
  MT_CHECK(!ids.empty()) << "the prompt is empty: it should have at least one token";
  for (int32_t id : ids)
    MT_CHECK(id < model->vocab_size()) << "prompt token " << id << " is outside the model's vocabulary of "
                                       << model->vocab_size() << " (is " << dir.string()
                                       << "/tokenizer.json the model's?)";

  // Positions past what the model was made for: not without --past-max-positions.
  const int64_t max_positions = o.has("past-max-positions") ? 0 : max_position_embeddings((dir / "config.json").string());
  MT_CHECK(max_positions == 0 || static_cast<int64_t>(ids.size()) <= max_positions)
      << "the prompt has " << ids.size() << " tokens, past the model's max_position_embeddings (" << max_positions
      << " in " << dir.string() << "/config.json); shorten it, or add --past-max-positions";
  const std::vector<int64_t> eos = eos_ids(dir);
  const size_t prompt = ids.size();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < max_new; ++step) {
    const int64_t T = static_cast<int64_t>(ids.size());
    if (max_positions > 0 && T >= max_positions) {
      std::fprintf(stderr, "moetrain generate: stopped at the model's max_position_embeddings (%lld tokens) after %lld "
                   "new; --past-max-positions goes on\n", static_cast<long long>(max_positions),
                   static_cast<long long>(step));
      break;
    }
    std::unique_ptr<Stash> s = model->make_stash(1, T);
    std::vector<int32_t> labels(ids.size(), 0);  // the head's loss is computed and not used
    copy(s->ids, Tensor(ids.data(), s->ids.shape, DType::i32));
    copy(s->labels, Tensor(labels.data(), s->labels.shape, DType::i32));
    Trainer::forward(*model, *s);
    const Tensor logits = model->logits(*s);  // [T, V]; the last position's row to the host, in f32
    ids.push_back(pick(to_host(logits.rows(T - 1, T)), temperature, top_p, seed, step));
    if (std::find(eos.begin(), eos.end(), ids.back()) != eos.end()) break;
  }
  if (o.has("offload-experts")) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "moetrain generate: %zu new tokens in %.3f s (%.2f tokens/s)\n", ids.size() - prompt, seconds,
                 static_cast<double>(ids.size() - prompt) / std::max(seconds, 1e-9));
    const ExpertCacheStats c = model->expert_cache_stats();
    int64_t uses = 0;
    for (const std::vector<int64_t>& layer : c.expert_uses) uses = std::accumulate(layer.begin(), layer.end(), uses);
    std::fprintf(stderr, "moetrain generate: expert cache of %lld slots: %lld experts used, %lld of them (%.1f%%) found "
                 "on the device; %lld loaded, %.3f GB copied in, %.3f s waited for\n",
                 static_cast<long long>(options.expert_slots), static_cast<long long>(uses),
                 static_cast<long long>(c.hits), 100.0 * static_cast<double>(c.hits) / std::max<double>(1, uses),
                 static_cast<long long>(c.misses), static_cast<double>(c.bytes_in) / 1e9, c.wait_s);
  }
  if (tok) std::printf("%s\n", tok->decode(ids, true).c_str());
  std::string out = "[";
  for (size_t i = prompt; i < ids.size(); ++i) out += (i > prompt ? ", " : "") + std::to_string(ids[i]);
  std::printf("%s]\n", out.c_str());
  return 0;
}

}  // namespace mt::cli
