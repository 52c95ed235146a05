// Qwen3-MoE (transformers' model_type "qwen3_moe"): its config and its attention
// (grouped-query, q/k norms per head, RoPE), which Qwen3.5 (qwen3_5_moe.h) uses with an
// output gate; the rest is the shared decoder (models/decoder.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "models/interface.h"

namespace mt {
class Attention;  // models/decoder.h
}

namespace mt {

struct Qwen3MoeConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense layers
  int64_t moe_intermediate_size = 0;  // each expert
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  bool norm_topk_prob = false;
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;

  bool is_moe_layer(int64_t layer) const;
};

// Reads either spelling of each field (the hub's and transformers 5's); `where`
// (the file) is named in errors, with the key.
Qwen3MoeConfig parse_qwen3_moe_config(const nlohmann::json& j, const std::string& where);

std::unique_ptr<Model> make_qwen3_moe(const Qwen3MoeConfig& cfg, const ModelOptions& options);

// Qwen's grouped-query attention with per-head q/k norms before the rotation (the
// decoder's rope tables: the first rotary_dim dims of each head). Qwen3.5's adds an
// output gate (q_proj yields each head's [query | gate], the output is multiplied by
// sigmoid(gate) before o_proj) and zero-centred norm weights (norm_offset 1).
struct QwenAttentionSpec {
  int64_t hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  bool output_gate = false;
  float norm_offset = 0.0f;
};
std::shared_ptr<Attention> make_qwen_attention(const QwenAttentionSpec& spec);

}  // namespace mt
