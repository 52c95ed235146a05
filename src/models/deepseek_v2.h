// DeepSeek-V2 and V2-Lite (transformers' model_type "deepseek_v2") and DeepSeek-V3
// ("deepseek_v3", also Moonlight's; Kimi K2's "kimi_k2" is the same architecture): the
// config and multi-head latent attention; the MoE block (softmax routing, greedy or
// group-limited, for V2; V3's sigmoid noaux_tc routing with its correction bias,
// kernels/router.h; routed_scaling_factor, shared experts, first_k_dense_replace) is the
// shared decoder's (models/moe.h). V3's multi-token prediction depths
// (num_nextn_predict_layers) are the shared decoder's too (models/decoder.h, mtp_depths):
// this file gives their layers' MLA and MoE flags (docs/models.md).
//
// As transformers 5.17 computes it (the parity reference, tests/fixtures):
//   q = q_proj(x), or q_b_proj(rmsnorm(q_a_proj(x))) with q_lora_rank; per head
//       [nope | rope] of qk_nope_head_dim + qk_rope_head_dim
//   kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_pe (qk_rope_head_dim, all heads)]
//   kv_b_proj(rmsnorm(latent)) = per head [k_nope | v (v_head_dim)]
//   rope on q's and k_pe's rope parts only, pairs interleaved (2i, 2i+1)
//   softmax scale qk_head_dim^-1/2 * m^2, m = 0.1 mscale_all_dim ln(factor) + 1 (YaRN)
//   the q_a and kv_a norms use eps 1e-6 whatever rms_norm_eps says.
// V2: norm_topk_prob is ignored, as transformers 5.17 ignores it (DeepSeek's own code
// renormalises; the released V2 and V2-Lite set it false); V3 honours it. moe_layer_freq
// must be 1.
#pragma once

#include <memory>

#include <nlohmann/json_fwd.hpp>

#include "models/decoder.h"

namespace mt {

struct DeepseekV2Config {
  DecoderSpec decoder;
  int64_t num_heads = 0;
  int64_t q_lora_rank = 0;  // 0: q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  double softmax_scale = 0;
};

DeepseekV2Config parse_deepseek_v2_config(const nlohmann::json& j, const std::string& where);

std::unique_ptr<Model> make_deepseek_v2(const DeepseekV2Config& cfg, const ModelOptions& options);

}  // namespace mt
