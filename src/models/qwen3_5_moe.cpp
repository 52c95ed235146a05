#include "models/qwen3_5_moe.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "models/decoder.h"
#include "models/gated_deltanet.h"
#include "models/hf_config.h"
#include "models/qwen3_moe.h"

namespace mt {

Qwen35MoeConfig parse_qwen3_5_moe_config(const nlohmann::json& config, const std::string& where) {
  // The hub's folder (qwen3_5_moe): the language model's config under text_config
  // (models/interface.h, hf_layout, says where its keys are).
  const nlohmann::json j = text_config(config);
  MT_CHECK(j.value("model_type", "") == "qwen3_5_moe_text")
      << where << ": model_type qwen3_5_moe should keep its language model's config under text_config";
  Qwen35MoeConfig c;
  const HfConfig hf(j, where);
  c.vocab_size = hf.integer({"vocab_size"});
  c.hidden_size = hf.integer({"hidden_size"});
  c.num_layers = hf.integer({"num_hidden_layers"});
  c.num_heads = hf.integer({"num_attention_heads"});
  c.num_kv_heads = hf.integer({"num_key_value_heads"}, c.num_heads);
  c.head_dim = hf.integer({"head_dim"}, c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.num_experts = hf.integer({"num_experts"});
  c.top_k = hf.integer({"num_experts_per_tok"});
  c.moe_intermediate_size = hf.integer({"moe_intermediate_size"});
  c.shared_intermediate_size = hf.integer({"shared_expert_intermediate_size"}, 0);
  c.rms_norm_eps = hf.number({"rms_norm_eps"}, 1e-6);
  c.rope_theta = hf.number({"rope_parameters.rope_theta", "rope_theta"}, 10000.0);
  c.tie_word_embeddings = hf.flag({"tie_word_embeddings"}, false);
  const double partial = hf.number({"rope_parameters.partial_rotary_factor", "partial_rotary_factor"}, 1.0);
  // transformers: int(head_dim * factor), the rotated dims first in each head.
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * partial);

  const std::string act = hf.text({"hidden_act"}, "silu");
  MT_CHECK(act == "silu") << where << ": hidden_act '" << act << "' is not supported (Qwen3.5 uses silu)";
  MT_CHECK(!hf.flag({"attention_bias"}, false)) << where << ": attention_bias = true is not supported";
  const std::string rope_type = hf.text({"rope_parameters.rope_type", "rope_scaling.rope_type"}, "default");
  MT_CHECK(rope_type == "default") << where << ": rope type '" << rope_type << "' is not supported for qwen3_5_moe";
  MT_CHECK(c.num_layers > 0 && c.head_dim > 0 && c.num_heads > 0) << where
      << ": num_hidden_layers, num_attention_heads and head_dim must be positive";
  MT_CHECK(c.rotary_dim > 0 && c.rotary_dim % 2 == 0 && c.rotary_dim <= c.head_dim)
      << where << ": partial_rotary_factor " << partial << " of head_dim " << c.head_dim << " gives " << c.rotary_dim
      << " rotary dims: expected an even number in [2, head_dim]";
  MT_CHECK(c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0)
      << where << ": num_attention_heads " << c.num_heads << " must be a multiple of num_key_value_heads "
      << c.num_kv_heads;
  // Text positions only: the multimodal rotary sections all take the token's position, so
  // mrope_section changes nothing here.
  c.linear.assign(static_cast<size_t>(c.num_layers), false);
  if (j.contains("layer_types")) {
    const nlohmann::json& types = j["layer_types"];
    MT_CHECK(types.is_array() && static_cast<int64_t>(types.size()) == c.num_layers)
        << where << ": layer_types should list num_hidden_layers = " << c.num_layers << " entries, got "
        << types.dump();
    for (size_t l = 0; l < types.size(); ++l) {
      const std::string t = types[l].is_string() ? types[l].get<std::string>() : types[l].dump();
      MT_CHECK(t == "full_attention" || t == "linear_attention")
          << where << ": layer_types[" << l << "] = " << t << ": expected full_attention or linear_attention";
      c.linear[l] = t == "linear_attention";
    }
  } else {
    // transformers' default: every full_attention_interval-th layer full, the rest linear.
    const int64_t every = hf.integer({"full_attention_interval"}, 4);
    MT_CHECK(every >= 1) << where << ": full_attention_interval must be >= 1";
    for (int64_t l = 0; l < c.num_layers; ++l) c.linear[static_cast<size_t>(l)] = (l + 1) % every != 0;
  }
  if (std::find(c.linear.begin(), c.linear.end(), true) != c.linear.end()) {
    c.linear_key_heads = hf.integer({"linear_num_key_heads"});
    c.linear_value_heads = hf.integer({"linear_num_value_heads"});
    c.linear_key_dim = hf.integer({"linear_key_head_dim"});
    c.linear_value_dim = hf.integer({"linear_value_head_dim"});
    c.linear_conv_kernel = hf.integer({"linear_conv_kernel_dim"}, 4);
  }
  return c;
}

std::unique_ptr<Model> make_qwen3_5_moe(const Qwen35MoeConfig& c, const ModelOptions& options) {
  DecoderSpec d;
  d.vocab_size = c.vocab_size;
  d.hidden_size = c.hidden_size;
  d.num_layers = c.num_layers;
  d.rms_norm_eps = c.rms_norm_eps;
  d.norm_weight_offset = 1.0f;
  d.tie_word_embeddings = c.tie_word_embeddings;
  d.moe.assign(static_cast<size_t>(c.num_layers), true);  // every Qwen3.5 layer is MoE
  d.num_experts = c.num_experts;
  d.moe_intermediate_size = c.moe_intermediate_size;
  d.shared_intermediate_size = c.shared_intermediate_size;
  d.shared_expert_gate = c.shared_intermediate_size > 0;
  d.router.top_k = c.top_k;
  d.router.normalize = true;  // Qwen3.5's router always renormalises the top-k
  d.rope.theta = c.rope_theta;
  d.rope.rotary_dim = c.rotary_dim;
  Mixers mixers = every_layer(make_qwen_attention({.hidden_size = c.hidden_size, .num_layers = c.num_layers,
                                                    .num_heads = c.num_heads, .num_kv_heads = c.num_kv_heads,
                                                    .head_dim = c.head_dim, .rms_norm_eps = c.rms_norm_eps,
                                                    .output_gate = true, .norm_offset = 1.0f}),
                              d.num_layers);
  if (std::find(c.linear.begin(), c.linear.end(), true) != c.linear.end()) {
    const std::shared_ptr<Attention> delta = make_gated_deltanet(
        {.hidden_size = c.hidden_size, .key_heads = c.linear_key_heads, .value_heads = c.linear_value_heads,
         .key_dim = c.linear_key_dim, .value_dim = c.linear_value_dim, .conv_kernel = c.linear_conv_kernel,
         .rms_norm_eps = c.rms_norm_eps},
        d.num_layers, options);
    for (int64_t l = 0; l < c.num_layers; ++l)
      if (c.linear[static_cast<size_t>(l)]) mixers[static_cast<size_t>(l)] = delta;
  }
  return make_decoder(d, std::move(mixers), options);
}

}  // namespace mt
