// moetrain eval: mean next-token loss of a Hugging Face model folder on a token matrix.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/arena.h"
#include "core/check.h"
#include "io/file.h"
#include "models/hf_config.h"
#include "train/trainer.h"

namespace mt::cli {

int run_eval(const Args& args) {
  Options o("eval", args, {"model", "tokens", "device", "micro-batch"});
  std::string folder = o.required("model");
  std::string device = o.get("device", "cpu");
  MT_CHECK(device == "cpu" || device == "cuda") << "--device should be cpu or cuda, got '" << device << "'";
  if (device == "cuda") require_gpu("--device cuda");
  const int64_t micro = o.integer("micro-batch", 8, 1, kMaxConfigInteger);
  ModelOptions options;
  options.device = device == "cuda" ? Device::cuda : Device::cpu;
  std::unique_ptr<Model> model = make_model(folder + "/config.json", options);
  load_hf(*model, folder);
  TokenBatch data = read_token_batch(o.required("tokens"), model->vocab_size());
  // Positions past what the model was made for are not an evaluation of it.
  const std::vector<uint8_t> b = io::read_file(folder + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(b.begin(), b.end(), nullptr, false);
  const nlohmann::json max_positions = config.is_object() ? config.value("max_position_embeddings", nlohmann::json())
                                                          : nlohmann::json();
  MT_CHECK(!max_positions.is_number_integer() || data.seq <= max_positions.get<int64_t>())
      << o.required("tokens") << ": sequences of " << data.seq << " positions, past the model's "
      << "max_position_embeddings (" << max_positions.dump() << " in " << folder << "/config.json)";
  LossSum l = Trainer::evaluate(*model, data, micro);
  nlohmann::json j;
  j["loss"] = l.sum / static_cast<double>(l.count);
  j["tokens"] = l.count;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace mt::cli
