// Qwen3-MoE (transformers' model_type "qwen3_moe"): its config and its attention
// (grouped-query, q/k norms per head, RoPE); the rest is the shared decoder
// (models/decoder.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "models/interface.h"

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

}  // namespace mt
