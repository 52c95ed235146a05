// Qwen3.5-MoE's language model (transformers' model_type "qwen3_5_moe_text", saved by
// Qwen3_5MoeForCausalLM): its config and its gated full attention; the rest is the shared
// decoder (models/decoder.h) with zero-centred norms (DecoderSpec::norm_weight_offset)
// and a gated shared expert (DecoderSpec::shared_expert_gate).
//
// Full-attention layers are Qwen3's attention with its output gate (models/qwen3_moe.h):
// q_proj yields each head's query and an output gate side by side ([q | gate] per head),
// q and k are RMS-normed per head with zero-centred weights and rotated on the first
// partial_rotary_factor of the head's dims, and the attention's output is multiplied by
// sigmoid(gate) before o_proj. The other layers (layer_types
// "linear_attention") are gated DeltaNet, models/gated_deltanet.h (the CPU backend only for
// now). The hub's vision-language folder (model_type "qwen3_5_moe": the language model's
// config under text_config, its weights under model.language_model.) imports its
// language model; the vision tower and the MTP weights are set aside (HfLayout).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "models/interface.h"

namespace mt {

struct Qwen35MoeConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  int64_t num_experts = 0, top_k = 0, moe_intermediate_size = 0, shared_intermediate_size = 0;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  std::vector<bool> linear;  // per layer: gated DeltaNet (else full attention)
  int64_t linear_key_heads = 0, linear_value_heads = 0, linear_key_dim = 0, linear_value_dim = 0;
  int64_t linear_conv_kernel = 4;
};

// `where` (the file) is named in errors, with the key.
Qwen35MoeConfig parse_qwen3_5_moe_config(const nlohmann::json& j, const std::string& where);

std::unique_ptr<Model> make_qwen3_5_moe(const Qwen35MoeConfig& cfg, const ModelOptions& options);

}  // namespace mt
