// GPT-OSS-20B and 120B (transformers' model_type "gpt_oss"): the config and its
// attention: grouped-query heads with biases on q, k, v and o, a learned sink logit per
// head (trained: its gradient comes from the attention backward), a sliding window on
// the layers layer_types calls "sliding_attention", RoPE on half-split pairs (YaRN), no
// q/k norms. The MoE block is the shared decoder's in its GPT-OSS form (router bias,
// top-k then softmax over the chosen, expert biases, clamped SwiGLU with gate and up
// interleaved, experts as one Hugging Face key per tensor a layer; models/decoder.h).
// The released checkpoints' MXFP4 experts are dequantized on import (train/trainer.h,
// load_hf); quantization_config other than mxfp4 is refused.
#pragma once

#include <memory>

#include <nlohmann/json_fwd.hpp>

#include "models/decoder.h"

namespace mt {

struct GptOssConfig {
  DecoderSpec decoder;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t sliding_window = 0;
  std::vector<bool> sliding;  // per layer
};

GptOssConfig parse_gpt_oss_config(const nlohmann::json& j, const std::string& where);

std::unique_ptr<Model> make_gpt_oss(const GptOssConfig& cfg, const ModelOptions& options);

}  // namespace mt
