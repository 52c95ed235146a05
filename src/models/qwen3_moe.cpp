#include "models/qwen3_moe.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "kernels/elementwise.h"
#include "kernels/rmsnorm.h"
#include "kernels/swiglu.h"
#include "models/decoder.h"
#include "models/hf_config.h"

namespace mt {

bool Qwen3MoeConfig::is_moe_layer(int64_t layer) const {
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end() &&
         num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
}

Qwen3MoeConfig parse_qwen3_moe_config(const nlohmann::json& j, const std::string& where) {
  Qwen3MoeConfig c;
  const HfConfig hf(j, where);
  c.vocab_size = hf.integer({"vocab_size"});
  c.hidden_size = hf.integer({"hidden_size"});
  c.intermediate_size = hf.integer({"intermediate_size"});
  c.moe_intermediate_size = hf.integer({"moe_intermediate_size"});
  c.num_layers = hf.integer({"num_hidden_layers"});
  c.num_heads = hf.integer({"num_attention_heads"});
  c.num_kv_heads = hf.integer({"num_key_value_heads"}, c.num_heads);
  c.head_dim = hf.integer({"head_dim"}, c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  // transformers' defaults
  // Required: a null or missing count would otherwise build a dense model without a word.
  c.num_experts = hf.integer({"num_experts", "num_local_experts"});
  c.top_k = c.num_experts > 0 ? hf.integer({"num_experts_per_tok"}) : 1;
  c.norm_topk_prob = hf.flag({"norm_topk_prob"}, false);
  c.mlp_only_layers = hf.integers({"mlp_only_layers"}, std::vector<int64_t>{});
  c.decoder_sparse_step = hf.integer({"decoder_sparse_step"}, 1);
  c.rms_norm_eps = hf.number({"rms_norm_eps"}, 1e-6);
  c.rope_theta = hf.number({"rope_theta", "rope_parameters.rope_theta"}, 10000.0);
  c.tie_word_embeddings = hf.flag({"tie_word_embeddings"}, false);

  // What this implementation does not do is an error, never a silent difference.
  const std::string act = hf.text({"hidden_act"}, "silu");
  MT_CHECK(act == "silu") << where << ": hidden_act '" << act << "' is not supported (Qwen3-MoE uses silu)";
  MT_CHECK(!hf.flag({"attention_bias"}, false)) << where << ": attention_bias = true is not supported";
  MT_CHECK(!hf.flag({"use_sliding_window"}, false))
      << where << ": use_sliding_window = true is not supported for qwen3_moe";
  const std::string rope_type =
      hf.text({"rope_parameters.rope_type", "rope_scaling.rope_type", "rope_scaling.type"}, "default");
  MT_CHECK(rope_type == "default") << where << ": rope type '" << rope_type << "' is not supported for qwen3_moe";
  MT_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.num_layers > 0 && c.num_heads > 0 && c.head_dim > 0)
      << where << ": vocab_size, hidden_size, num_hidden_layers, num_attention_heads and head_dim must be positive";
  MT_CHECK(c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0)
      << where << ": num_attention_heads " << c.num_heads << " must be a multiple of num_key_value_heads "
      << c.num_kv_heads;
  MT_CHECK(c.head_dim % 2 == 0) << where << ": head_dim " << c.head_dim << " must be even for RoPE";
  MT_CHECK(c.decoder_sparse_step >= 1) << where << ": decoder_sparse_step must be >= 1";
  bool any_moe = false;
  for (int64_t l = 0; l < c.num_layers; ++l) any_moe = any_moe || c.is_moe_layer(l);
  MT_CHECK(!any_moe || (c.top_k >= 1 && c.top_k <= c.num_experts && c.moe_intermediate_size > 0))
      << where << ": num_experts_per_tok " << c.top_k << " must be in [1, num_experts=" << c.num_experts
      << "] and moe_intermediate_size positive";
  return c;
}

namespace {

// QwenAttention's activations (one layer, one micro-batch). With the output gate, q_proj's
// output qg [N, Hq*2Dh] splits into q and gate, and d_q is B's alone (W reads d_qg).
struct Qwen3Acts : AttentionActs {
  Tensor q, k, v;         // projections [N,Hq*Dh], [N,Hkv*Dh]
  Tensor rstd_q, rstd_k;  // q/k norm per head [N*Hq], [N*Hkv]
  Tensor qr, kr;          // normed and rotated
  Tensor att, lse;        // attention output [N,Hq*Dh], [B,Hq,S]
  Tensor d_att, d_qr, d_kr, d_v, d_q, d_k;
  Tensor qg, gate, att_g, d_att_g, d_gate, d_qg;  // the output gate's
};

class QwenAttention final : public Attention {
 public:
  explicit QwenAttention(const QwenAttentionSpec& c) : c_(c) {}

  void add_params(int64_t l, const std::string& p, std::vector<Param>& params) override {
    const int64_t D = c_.hidden_size, Dh = c_.head_dim;
    if (static_cast<int64_t>(w_.size()) < c_.num_layers) w_.resize(static_cast<size_t>(c_.num_layers));
    Index& x = w_[l];
    x.q = add_param(params, p + "q", {(c_.output_gate ? 2 : 1) * c_.num_heads * Dh, D});
    x.k = add_param(params, p + "k", {c_.num_kv_heads * Dh, D});
    x.v = add_param(params, p + "v", {c_.num_kv_heads * Dh, D});
    x.o = add_param(params, p + "o", {D, c_.num_heads * Dh});
    x.q_norm = add_param(params, p + "q_norm", {Dh});
    x.k_norm = add_param(params, p + "k_norm", {Dh});
  }

  void hf_tensors(int64_t l, const std::string& p, std::vector<Param>& params, float out_scale,
                  std::vector<HfTensor>& out) const override {
    const Index& x = w_[l];
    const float one = 1.0f - c_.norm_offset;  // the norms' initial weight
    out.push_back(hf_tensor(p + "q_proj.weight", params[x.q]));
    out.push_back(hf_tensor(p + "k_proj.weight", params[x.k]));
    out.push_back(hf_tensor(p + "v_proj.weight", params[x.v]));
    out.push_back(hf_tensor(p + "o_proj.weight", params[x.o], out_scale));
    out.push_back(hf_tensor(p + "q_norm.weight", params[x.q_norm], 0.0f, one));
    out.push_back(hf_tensor(p + "k_norm.weight", params[x.k_norm], 0.0f, one));
  }

  std::unique_ptr<AttentionActs> make_acts() const override { return std::make_unique<Qwen3Acts>(); }

  void allocate(const std::vector<AttentionActs*>& layers, Arena& a, DType act_dtype, int64_t B,
                int64_t S) const override {
    const int64_t N = B * S, Q = c_.num_heads * c_.head_dim, KV = c_.num_kv_heads * c_.head_dim;
    const bool gated = c_.output_gate;
    auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
    auto act = [&](Shape sh) { return a.alloc(act_dtype, sh); };
    // What only the layer's B reads: one set for all (and with the gate, its output for
    // the forward, made again in W).
    const Tensor d_att = act({N, Q}), d_qr = act({N, Q}), d_kr = act({N, KV});
    const Tensor att_g = gated ? act({N, Q}) : Tensor(), d_att_g = gated ? act({N, Q}) : Tensor(),
                 d_gate = gated ? act({N, Q}) : Tensor(), d_q = gated ? act({N, Q}) : Tensor();
    for (AttentionActs* base : layers) {
      auto& x = static_cast<Qwen3Acts&>(*base);
      if (gated) {
        x.qg = act({N, 2 * Q});
        x.gate = act({N, Q});
      }
      x.q = act({N, Q});
      x.k = act({N, KV});
      x.v = act({N, KV});
      x.rstd_q = f32({N * c_.num_heads});
      x.rstd_k = f32({N * c_.num_kv_heads});
      x.qr = act({N, Q});
      x.kr = act({N, KV});
      x.att = act({N, Q});
      x.lse = f32({B, c_.num_heads, S});
      x.d_att = d_att;
      x.d_qr = d_qr;
      x.d_kr = d_kr;
      x.d_v = act({N, KV});
      x.d_q = gated ? d_q : act({N, Q});
      x.d_k = act({N, KV});
      if (gated) {
        x.att_g = att_g;
        x.d_att_g = d_att_g;
        x.d_gate = d_gate;
        x.d_qg = act({N, 2 * Q});
      }
    }
  }

  void forward(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<Qwen3Acts&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    if (c_.output_gate) {  // each head's [query | gate] halves apart
      io.linear->forward(io.xn, {{P[w.q], x.qg}, {P[w.k], x.k}, {P[w.v], x.v}});
      const Tensor heads = x.qg.view({N * Hq, 2 * Dh});
      mt::copy_columns(x.q.view({N * Hq, Dh}), 0, heads, 0, Dh, false);
      mt::copy_columns(x.gate.view({N * Hq, Dh}), 0, heads, Dh, Dh, false);
    } else {
      io.linear->forward(io.xn, {{P[w.q], x.q}, {P[w.k], x.k}, {P[w.v], x.v}});
    }
    // Normed and rotated in one pass: the backward needs only q, k and rstd.
    rmsnorm_rope_forward(x.q.view({B, S, Hq, Dh}), P[w.q_norm].value, eps, io.cos, io.sin, x.qr.view({B, S, Hq, Dh}),
                         x.rstd_q, c_.norm_offset);
    rmsnorm_rope_forward(x.k.view({B, S, Hkv, Dh}), P[w.k_norm].value, eps, io.cos, io.sin,
                         x.kr.view({B, S, Hkv, Dh}), x.rstd_k, c_.norm_offset);
    io.attend->forward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}), Tensor(),
                       args(), x.att.view({B, S, Hq, Dh}), x.lse);
    if (c_.output_gate) sigmoid_gate_forward(x.att, x.gate, x.att_g);
    io.linear->forward(c_.output_gate ? x.att_g : x.att, {{P[w.o], io.hm, 1.0f}});
  }

  void backward_input(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<Qwen3Acts&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
    if (c_.output_gate) {
      io.linear->backward_input(io.d_hm, P[w.o], x.d_att_g);
      sigmoid_gate_backward(x.att, x.gate, x.d_att_g, x.d_att, x.d_gate);
    } else {
      io.linear->backward_input(io.d_hm, P[w.o], x.d_att);
    }
    io.attend->backward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}), Tensor(),
                        args(), x.att.view({B, S, Hq, Dh}), x.lse, x.d_att.view({B, S, Hq, Dh}),
                        x.d_qr.view({B, S, Hq, Dh}), x.d_kr.view({B, S, Hkv, Dh}), x.d_v.view({B, S, Hkv, Dh}),
                        Tensor());
    rmsnorm_rope_backward(x.q.view({B, S, Hq, Dh}), P[w.q_norm].value, x.rstd_q, io.cos, io.sin,
                          x.d_qr.view({B, S, Hq, Dh}), x.d_q.view({B, S, Hq, Dh}), grad_zeroed(P[w.q_norm]),
                          c_.norm_offset);
    rmsnorm_rope_backward(x.k.view({B, S, Hkv, Dh}), P[w.k_norm].value, x.rstd_k, io.cos, io.sin,
                          x.d_kr.view({B, S, Hkv, Dh}), x.d_k.view({B, S, Hkv, Dh}), grad_zeroed(P[w.k_norm]),
                          c_.norm_offset);
    if (c_.output_gate) {
      const Tensor d_heads = x.d_qg.view({N * Hq, 2 * Dh});
      mt::copy_columns(d_heads, 0, x.d_q.view({N * Hq, Dh}), 0, Dh, false);
      mt::copy_columns(d_heads, Dh, x.d_gate.view({N * Hq, Dh}), 0, Dh, false);
    }
    io.linear->backward_input(c_.output_gate ? x.d_qg : x.d_q, P[w.q], io.d_xn);
    io.linear->backward_input(x.d_k, P[w.k], io.d_xn, 1.0f);
    io.linear->backward_input(x.d_v, P[w.v], io.d_xn, 1.0f);
  }

  void backward_weight(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<Qwen3Acts&>(base);
    if (c_.output_gate) sigmoid_gate_forward(x.att, x.gate, x.att_g);  // shared by the layers: made again
    io.linear->backward_weight(c_.output_gate ? x.att_g : x.att, {{io.d_hm, P[w.o]}});
    io.linear->backward_weight(io.xn,
                               {{c_.output_gate ? x.d_qg : x.d_q, P[w.q]}, {x.d_k, P[w.k]}, {x.d_v, P[w.v]}});
  }

 private:
  struct Index {
    int q = -1, k = -1, v = -1, o = -1, q_norm = -1, k_norm = -1;
  };
  cpu::AttentionArgs args() const {
    return {.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.head_dim)))};
  }
  QwenAttentionSpec c_;
  std::vector<Index> w_;  // per layer, where its parameters sit in the decoder's params
};

}  // namespace

std::unique_ptr<Model> make_qwen3_moe(const Qwen3MoeConfig& c, const ModelOptions& options) {
  DecoderSpec d;
  d.vocab_size = c.vocab_size;
  d.hidden_size = c.hidden_size;
  d.num_layers = c.num_layers;
  d.rms_norm_eps = c.rms_norm_eps;
  d.tie_word_embeddings = c.tie_word_embeddings;
  for (int64_t l = 0; l < c.num_layers; ++l) d.moe.push_back(c.is_moe_layer(l));
  d.intermediate_size = c.intermediate_size;
  d.num_experts = c.num_experts;
  d.moe_intermediate_size = c.moe_intermediate_size;
  d.router.top_k = c.top_k;
  d.router.normalize = c.norm_topk_prob;
  d.rope.theta = c.rope_theta;
  d.rope.rotary_dim = c.head_dim;
  return make_decoder(d, every_layer(make_qwen_attention({.hidden_size = c.hidden_size, .num_layers = c.num_layers,
                                                          .num_heads = c.num_heads, .num_kv_heads = c.num_kv_heads,
                                                          .head_dim = c.head_dim, .rms_norm_eps = c.rms_norm_eps}),
                                     d.num_layers),
                      options);
}

std::shared_ptr<Attention> make_qwen_attention(const QwenAttentionSpec& spec) {
  return std::make_shared<QwenAttention>(spec);
}

}  // namespace mt
