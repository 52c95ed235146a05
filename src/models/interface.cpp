#include "models/interface.h"

#include <nlohmann/json.hpp>

#include "core/arena.h"
#include "core/check.h"
#include "kernels/elementwise.h"
#include "kernels/fp8_quant.h"
#include "models/deepseek_v2.h"
#include "models/gpt_oss.h"
#include "models/hf_config.h"
#include "models/qwen3_5_moe.h"
#include "models/qwen3_moe.h"

namespace mt {

std::unique_ptr<Model> make_model(const std::string& config_json_path, const ModelOptions& options) {
  const nlohmann::json j = read_json_object(config_json_path);
  MT_CHECK(j.contains("model_type") && j["model_type"].is_string()) << config_json_path << ": no model_type";
  std::string type = j["model_type"];
  if (type == "qwen3_moe") return make_qwen3_moe(parse_qwen3_moe_config(j, config_json_path), options);
  if (type == "deepseek_v2" || type == "deepseek_v3" || type == "kimi_k2")
    return make_deepseek_v2(parse_deepseek_v2_config(j, config_json_path), options);
  if (type == "gpt_oss") return make_gpt_oss(parse_gpt_oss_config(j, config_json_path), options);
  if (type == "qwen3_5_moe_text" || type == "qwen3_5_moe")
    return make_qwen3_5_moe(parse_qwen3_5_moe_config(j, config_json_path), options);
  MT_FAIL() << config_json_path << ": model_type '" << type
            << "' is not supported (supported: qwen3_moe, qwen3_5_moe_text, deepseek_v2, deepseek_v3, kimi_k2, "
            << "gpt_oss)";
  return nullptr;
}

bool HfLayout::aside(const std::string& key) const {
  for (const std::string& p : set_aside)
    if (key.starts_with(p)) return true;
  return false;
}

HfLayout hf_layout(const nlohmann::json& config) {
  HfLayout l;
  if (config.value("model_type", "") == "qwen3_5_moe") {
    l.prefix = "model.language_model.";
    l.set_aside = {"model.visual.", "mtp."};
  }
  return l;
}

nlohmann::json text_config(const nlohmann::json& config) {
  if (config.value("model_type", "") != "qwen3_5_moe" || !config.contains("text_config")) return config;
  nlohmann::json t = config["text_config"];
  t["model_type"] = "qwen3_5_moe_text";
  t["architectures"] = nlohmann::json::array({"Qwen3_5MoeForCausalLM"});
  if (!t.contains("tie_word_embeddings") && config.contains("tie_word_embeddings"))
    t["tie_word_embeddings"] = config["tie_word_embeddings"];
  return t;
}

std::vector<int64_t> hf_shape(const HfTensor& t, int64_t experts) {
  std::vector<int64_t> s(t.value.shape.d.begin(), t.value.shape.d.begin() + t.value.ndim());
  if (t.fused.empty()) return s;
  MT_CHECK(!t.transposed || s.size() == 2) << t.name << ": only a matrix can be kept transposed, not one of shape "
                                           << t.value.shape.str();
  if (t.transposed) std::swap(s[0], s[1]);
  s.insert(s.begin(), experts);
  return s;
}

namespace {

// `t` on `device`: itself, or a copy there held until `use` returns (a master weight in
// host memory, Param::offloaded, read by a GPU kernel).
template <typename F>
void on_device(const Tensor& t, Device device, F use) {
  if (t.device == device) return use(t);
  Arena staging("weight staging", device, t.nbytes());
  const Tensor d = staging.alloc(t.dtype, t.shape);
  copy(d, t);
  use(d);
}

}  // namespace

void refresh_compute_weights(std::vector<Param>& params, bool offloaded) {
  for (Param& p : params)
    if (p.value.data != nullptr && p.compute.data != p.value.data && (offloaded || !p.offloaded))
      on_device(p.value, p.compute.device, [&](const Tensor& v) { mt::cast(v, p.compute); });
  refresh_fp8_weights(params, offloaded);
}

void refresh_fp8_weights(std::vector<Param>& params, bool offloaded) {
  for (Param& p : params)
    if (p.value.data != nullptr && p.fp8.q.data != nullptr && (offloaded || !p.offloaded))
      on_device(p.compute, p.fp8.q.device, [&](const Tensor& w) {
        quantize_blocks(w, p.fp8.q, p.fp8.scale, p.fp8.pow2, p.fp8.qt, p.fp8.scale_t);
      });
}

}  // namespace mt
