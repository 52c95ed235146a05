// moetrain eval: mean next-token loss of a Hugging Face model folder or a checkpoint on a
// token matrix.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/arena.h"
#include "core/check.h"
#include "models/hf_config.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace mt::cli {

int run_eval(const Args& args) {
  Options o("eval", args, {"model", "tokens", "device", "micro-batch"});
  std::string device = o.get("device", "cpu");
  MT_CHECK(device == "cpu" || device == "cuda") << "--device should be cpu or cuda, got '" << device << "'";
  if (device == "cuda") require_gpu("--device cuda");
  const int64_t micro = o.integer("micro-batch", 8, 1, kMaxConfigInteger);
  ModelOptions options;
  options.device = device == "cuda" ? Device::cuda : Device::cpu;
  // A Hugging Face folder, or a checkpoint (verified, as generate and export-hf read it).
  std::string read;
  std::unique_ptr<Model> model = load_model_folder(o.required("model"), options, &read);
  TokenBatch data = read_token_batch(o.required("tokens"), model->vocab_size());
  // Positions past what the model was made for are not an evaluation of it.
  const int64_t max_positions = max_position_embeddings(read + "/config.json");
  MT_CHECK(max_positions == 0 || data.seq <= max_positions)
      << o.required("tokens") << ": sequences of " << data.seq << " positions, past the model's "
      << "max_position_embeddings (" << max_positions << " in " << read << "/config.json)";
  LossSum l = Trainer::evaluate(*model, data, micro);
  const double loss = l.sum / static_cast<double>(l.count);
  MT_CHECK(l.count > 0 && std::isfinite(loss))
      << "the mean loss of " << read << " on " << o.required("tokens") << " is " << loss << " over " << l.count
      << " tokens: the weights hold a non-finite value, or no token has a label";
  std::printf("%s\n", nlohmann::json{{"loss", loss}, {"tokens", l.count}}.dump().c_str());
  return 0;
}

}  // namespace mt::cli
