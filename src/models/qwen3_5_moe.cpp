#include "models/qwen3_5_moe.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/check.h"
#include "kernels/elementwise.h"
#include "kernels/rmsnorm.h"
#include "kernels/swiglu.h"
#include "models/decoder.h"
#include "models/gated_deltanet.h"
#include "models/hf_config.h"

namespace mt {

Qwen35MoeConfig parse_qwen3_5_moe_config(const nlohmann::json& j, const std::string& where) {
  const std::string type = j.value("model_type", "");
  MT_CHECK(type != "qwen3_5_moe")
      << where << ": model_type qwen3_5_moe is the hub's vision-language folder (the language model under "
      << "text_config, its weights under model.language_model.), which is not read yet; a folder that "
      << "transformers' Qwen3_5MoeForCausalLM saves (model_type qwen3_5_moe_text) is";
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

namespace {

// The gated full attention's activations (one layer, one micro-batch).
struct Qwen35Acts : AttentionActs {
  Tensor qg, q, gate, k, v;  // q_proj's [N, H*2Dh] and its halves [N, H*Dh]; k, v [N, Hkv*Dh]
  Tensor rstd_q, rstd_k, qr, kr, att, lse;
  Tensor att_g;                           // the gated output (forward, and W makes it again)
  Tensor d_att_g, d_att, d_q, d_qr, d_kr;  // B only
  Tensor d_gate, d_qg, d_k, d_v;           // W reads d_qg, d_k, d_v
};

class Qwen35Attention final : public Attention {
 public:
  explicit Qwen35Attention(const Qwen35MoeConfig& c) : c_(c) {}

  void add_params(int64_t l, const std::string& p, std::vector<Param>& params) override {
    const int64_t D = c_.hidden_size, Dh = c_.head_dim;
    if (static_cast<int64_t>(w_.size()) < c_.num_layers) w_.resize(static_cast<size_t>(c_.num_layers));
    Index& x = w_[l];
    x.q = add_param(params, p + "q", {2 * c_.num_heads * Dh, D});
    x.k = add_param(params, p + "k", {c_.num_kv_heads * Dh, D});
    x.v = add_param(params, p + "v", {c_.num_kv_heads * Dh, D});
    x.o = add_param(params, p + "o", {D, c_.num_heads * Dh});
    x.q_norm = add_param(params, p + "q_norm", {Dh});
    x.k_norm = add_param(params, p + "k_norm", {Dh});
  }

  void hf_tensors(int64_t l, const std::string& p, std::vector<Param>& params, float out_scale,
                  std::vector<HfTensor>& out) const override {
    const Index& x = w_[l];
    out.push_back(hf_tensor(p + "q_proj.weight", params[x.q]));
    out.push_back(hf_tensor(p + "k_proj.weight", params[x.k]));
    out.push_back(hf_tensor(p + "v_proj.weight", params[x.v]));
    out.push_back(hf_tensor(p + "o_proj.weight", params[x.o], out_scale));
    out.push_back(hf_tensor(p + "q_norm.weight", params[x.q_norm], 0.0f, 0.0f));  // zero-centred
    out.push_back(hf_tensor(p + "k_norm.weight", params[x.k_norm], 0.0f, 0.0f));
  }

  std::unique_ptr<AttentionActs> make_acts() const override { return std::make_unique<Qwen35Acts>(); }

  void allocate(const std::vector<AttentionActs*>& layers, Arena& a, DType act_dtype, int64_t B,
                int64_t S) const override {
    const int64_t N = B * S, Q = c_.num_heads * c_.head_dim, KV = c_.num_kv_heads * c_.head_dim;
    auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
    auto act = [&](Shape sh) { return a.alloc(act_dtype, sh); };
    const Tensor att_g = act({N, Q}), d_att_g = act({N, Q}), d_att = act({N, Q}), d_q = act({N, Q}),
                 d_qr = act({N, Q}), d_kr = act({N, KV}), d_gate = act({N, Q});
    for (AttentionActs* base : layers) {
      auto& x = static_cast<Qwen35Acts&>(*base);
      x.qg = act({N, 2 * Q});
      x.q = act({N, Q});
      x.gate = act({N, Q});
      x.k = act({N, KV});
      x.v = act({N, KV});
      x.rstd_q = f32({N * c_.num_heads});
      x.rstd_k = f32({N * c_.num_kv_heads});
      x.qr = act({N, Q});
      x.kr = act({N, KV});
      x.att = act({N, Q});
      x.lse = f32({B, c_.num_heads, S});
      x.att_g = att_g;
      x.d_att_g = d_att_g;
      x.d_att = d_att;
      x.d_q = d_q;
      x.d_qr = d_qr;
      x.d_kr = d_kr;
      x.d_gate = d_gate;
      x.d_qg = act({N, 2 * Q});
      x.d_k = act({N, KV});
      x.d_v = act({N, KV});
    }
  }

  void forward(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<Qwen35Acts&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    io.linear->forward(io.xn, {{P[w.q], x.qg}, {P[w.k], x.k}, {P[w.v], x.v}});
    // Each head's [query | gate] halves apart.
    const Tensor heads = x.qg.view({N * Hq, 2 * Dh});
    mt::copy_columns(x.q.view({N * Hq, Dh}), 0, heads, 0, Dh, false);
    mt::copy_columns(x.gate.view({N * Hq, Dh}), 0, heads, Dh, Dh, false);
    rmsnorm_rope_forward(x.q.view({B, S, Hq, Dh}), P[w.q_norm].value, eps, io.cos, io.sin, x.qr.view({B, S, Hq, Dh}),
                         x.rstd_q, 1.0f);
    rmsnorm_rope_forward(x.k.view({B, S, Hkv, Dh}), P[w.k_norm].value, eps, io.cos, io.sin,
                         x.kr.view({B, S, Hkv, Dh}), x.rstd_k, 1.0f);
    io.attend->forward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}), Tensor(),
                       args(), x.att.view({B, S, Hq, Dh}), x.lse);
    sigmoid_gate_forward(x.att, x.gate, x.att_g);
    io.linear->forward(x.att_g, {{P[w.o], io.hm, 1.0f}});
  }

  void backward_input(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<Qwen35Acts&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
    io.linear->backward_input(io.d_hm, P[w.o], x.d_att_g);
    sigmoid_gate_backward(x.att, x.gate, x.d_att_g, x.d_att, x.d_gate);
    io.attend->backward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}), Tensor(),
                        args(), x.att.view({B, S, Hq, Dh}), x.lse, x.d_att.view({B, S, Hq, Dh}),
                        x.d_qr.view({B, S, Hq, Dh}), x.d_kr.view({B, S, Hkv, Dh}), x.d_v.view({B, S, Hkv, Dh}),
                        Tensor());
    rmsnorm_rope_backward(x.q.view({B, S, Hq, Dh}), P[w.q_norm].value, x.rstd_q, io.cos, io.sin,
                          x.d_qr.view({B, S, Hq, Dh}), x.d_q.view({B, S, Hq, Dh}), grad_zeroed(P[w.q_norm]), 1.0f);
    rmsnorm_rope_backward(x.k.view({B, S, Hkv, Dh}), P[w.k_norm].value, x.rstd_k, io.cos, io.sin,
                          x.d_kr.view({B, S, Hkv, Dh}), x.d_k.view({B, S, Hkv, Dh}), grad_zeroed(P[w.k_norm]), 1.0f);
    const Tensor d_heads = x.d_qg.view({N * Hq, 2 * Dh});
    mt::copy_columns(d_heads, 0, x.d_q.view({N * Hq, Dh}), 0, Dh, false);
    mt::copy_columns(d_heads, Dh, x.d_gate.view({N * Hq, Dh}), 0, Dh, false);
    io.linear->backward_input(x.d_qg, P[w.q], io.d_xn);
    io.linear->backward_input(x.d_k, P[w.k], io.d_xn, 1.0f);
    io.linear->backward_input(x.d_v, P[w.v], io.d_xn, 1.0f);
  }

  void backward_weight(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<Qwen35Acts&>(base);
    sigmoid_gate_forward(x.att, x.gate, x.att_g);  // shared by the layers: made again
    io.linear->backward_weight(x.att_g, {{io.d_hm, P[w.o]}});
    io.linear->backward_weight(io.xn, {{x.d_qg, P[w.q]}, {x.d_k, P[w.k]}, {x.d_v, P[w.v]}});
  }

 private:
  struct Index {
    int q = -1, k = -1, v = -1, o = -1, q_norm = -1, k_norm = -1;
  };
  cpu::AttentionArgs args() const {
    return {.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.head_dim)))};
  }
  Qwen35MoeConfig c_;
  std::vector<Index> w_;
};

}  // namespace

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
  const bool any_linear = std::find(c.linear.begin(), c.linear.end(), true) != c.linear.end();
  MT_CHECK(!any_linear || options.device == Device::cpu)
      << "Qwen3.5's gated DeltaNet layers (layer_types linear_attention) run on the CPU backend only for now: "
      << "their CUDA kernels are not built yet (issue 61)";
  MT_CHECK(!any_linear || options.cp == nullptr || options.cp->size() == 1)
      << "Qwen3.5's gated DeltaNet layers (layer_types linear_attention) with parallelism.cp > 1 are not built yet: "
      << "their state would pass from each rank's chunk to the next (issue 61)";
  Mixers mixers = every_layer(std::make_shared<Qwen35Attention>(c), d.num_layers);
  if (any_linear) {
    const std::shared_ptr<Attention> delta = make_gated_deltanet(
        {.hidden_size = c.hidden_size, .key_heads = c.linear_key_heads, .value_heads = c.linear_value_heads,
         .key_dim = c.linear_key_dim, .value_dim = c.linear_value_dim, .conv_kernel = c.linear_conv_kernel,
         .rms_norm_eps = c.rms_norm_eps},
        d.num_layers);
    for (int64_t l = 0; l < c.num_layers; ++l)
      if (c.linear[static_cast<size_t>(l)]) mixers[static_cast<size_t>(l)] = delta;
  }
  return make_decoder(d, std::move(mixers), options);
}

}  // namespace mt
