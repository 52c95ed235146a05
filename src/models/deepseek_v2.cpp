#include "models/deepseek_v2.h"

#include <cmath>

#include "core/check.h"
#include "kernels/elementwise.h"
#include "kernels/rmsnorm.h"
#include "models/hf_config.h"

namespace mt {

DeepseekV2Config parse_deepseek_v2_config(const nlohmann::json& j, const std::string& where) {
  DeepseekV2Config c;
  DecoderSpec& d = c.decoder;
  const HfConfig hf(j, where);
  d.vocab_size = hf.integer({"vocab_size"});
  d.hidden_size = hf.integer({"hidden_size"});
  d.num_layers = hf.integer({"num_hidden_layers"});
  d.intermediate_size = hf.integer({"intermediate_size"});
  // Required, as every MoE key is: a null or missing one would build a dense model, or
  // another router, without a word (0 experts is said explicitly).
  d.num_experts = hf.integer({"n_routed_experts"});
  d.moe_intermediate_size = d.num_experts > 0 ? hf.integer({"moe_intermediate_size"}) : 0;
  d.shared_intermediate_size = hf.integer({"n_shared_experts"}, 0) * d.moe_intermediate_size;
  d.rms_norm_eps = hf.number({"rms_norm_eps"}, 1e-6);
  d.tie_word_embeddings = hf.flag({"tie_word_embeddings"}, false);
  d.router.top_k = d.num_experts > 0 ? hf.integer({"num_experts_per_tok"}) : 1;
  // DeepSeek-V3 (and Moonlight, Kimi K2: the same architecture under other names):
  // sigmoid scores, groups by their two best, the correction bias in the choice only.
  const std::string type = hf.text({"model_type"}, "deepseek_v2");
  const bool v3 = type == "deepseek_v3" || type == "kimi_k2";
  if (v3) {
    const std::string method = hf.text({"topk_method"}, "noaux_tc"), scoring = hf.text({"scoring_func"}, "sigmoid");
    MT_CHECK(method == "noaux_tc" && scoring == "sigmoid")
        << where << ": model_type " << type << " routes with topk_method noaux_tc and scoring_func sigmoid, not "
        << method << " and " << scoring;
    d.router.scoring = cpu::RouterScoring::sigmoid;
    d.router.scale = static_cast<float>(hf.number({"routed_scaling_factor"}));
    d.router.normalize = hf.flag({"norm_topk_prob"}, true);
    d.router.n_group = hf.integer({"n_group"});
    d.router.topk_group = hf.integer({"topk_group"});
    MT_CHECK(hf.flag({"rope_interleave"}, true))
        << where << ": rope_interleave = false is not supported (MLA's rope pairs are interleaved, as released)";
  } else {
    d.router.scale = static_cast<float>(hf.number({"routed_scaling_factor"}, 1.0));
    const std::string method = hf.text({"topk_method"}, "greedy");
    MT_CHECK(method == "greedy" || method == "group_limited_greedy")
        << where << ": topk_method '" << method << "' is not supported (greedy or group_limited_greedy)";
    if (method == "group_limited_greedy") {
      d.router.n_group = hf.integer({"n_group"});
      d.router.topk_group = hf.integer({"topk_group"});
    }
    MT_CHECK(hf.text({"scoring_func"}, "softmax") == "softmax") << where << ": only scoring_func softmax is supported";
  }
  const int64_t first_dense = hf.integer({"first_k_dense_replace"}, 0);
  // V3's multi-token prediction depths, each a layer after the model's (index L + k - 1).
  d.mtp_depths = v3 ? hf.integer({"num_nextn_predict_layers"}, 0) : 0;
  MT_CHECK(d.mtp_depths >= 0) << where << ": num_nextn_predict_layers " << d.mtp_depths << " is negative";
  for (int64_t l = 0; l < d.num_layers + d.mtp_depths; ++l) d.moe.push_back(d.num_experts > 0 && l >= first_dense);
  c.num_heads = hf.integer({"num_attention_heads"});
  c.q_lora_rank = hf.integer({"q_lora_rank"}, 0);
  c.kv_lora_rank = hf.integer({"kv_lora_rank"});
  c.qk_nope_head_dim = hf.integer({"qk_nope_head_dim"});
  c.qk_rope_head_dim = hf.integer({"qk_rope_head_dim"});
  c.v_head_dim = hf.integer({"v_head_dim"});
  d.rope = read_rope(hf, c.qk_rope_head_dim);
  double m = 1.0;
  if (d.rope.yarn && d.rope.factor > 1.0) m = 0.1 * d.rope.mscale_all_dim * std::log(d.rope.factor) + 1.0;
  c.softmax_scale = m * m / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));

  // What this implementation does not do is an error, never a silent difference.
  const std::string act = hf.text({"hidden_act"}, "silu");
  MT_CHECK(act == "silu") << where << ": hidden_act '" << act << "' is not supported (DeepSeek-V2 uses silu)";
  MT_CHECK(!hf.flag({"attention_bias"}, false)) << where << ": attention_bias = true is not supported";
  MT_CHECK(hf.integer({"moe_layer_freq"}, 1) == 1) << where << ": moe_layer_freq other than 1 is not supported";
  const int64_t kv_heads = hf.integer({"num_key_value_heads"}, c.num_heads);
  MT_CHECK(kv_heads == c.num_heads) << where << ": num_key_value_heads " << kv_heads
                                    << " must equal num_attention_heads " << c.num_heads << " (MLA)";
  MT_CHECK(c.num_heads > 0 && c.kv_lora_rank > 0 && c.qk_nope_head_dim > 0 && c.v_head_dim > 0)
      << where << ": num_attention_heads, kv_lora_rank, qk_nope_head_dim and v_head_dim must be positive";
  check_decoder_spec(d, where);
  return c;
}

namespace {

constexpr float kLoraEps = 1e-6f;  // the q_a and kv_a norms' eps in transformers

// What only a layer's B reads: one set of scratch serves every layer of a block.
struct MlaScratch {
  Tensor d_att, d_qf, d_k, d_v, d_pe, d_pe_rot, d_qan, d_cn, d_c, d_krot, d_kpe;
};

// One layer's multi-head latent attention. N tokens, H heads, Dn + Dr = Dq (q and k per
// head), Dv (v per head), r the kv latent, Rq the q latent.
struct MlaActs : AttentionActs, MlaScratch {
  Tensor qa, qa_rstd, qan;  // q_lora: [N,Rq], [N], normed
  Tensor q;                 // [N, H*Dq] as projected
  Tensor q_pe, q_rot;       // its rope parts [N*H, Dr], rotated
  Tensor qf;                // [N, H*Dq]: nope and rotated rope parts, what attention reads
  Tensor kva, c, c_rstd, cn;  // [N, r+Dr], the latent [N,r], its norm
  Tensor k_pe, k_rot;       // [N, Dr], rotated
  Tensor kv, k, v;          // [N, H*(Dn+Dv)], [N, H*Dq], [N, H*Dv]
  Tensor att, lse;          // [N, H*Dv], [B,H,S]
  Tensor d_q, d_qa, d_kv, d_kva;  // per layer (read by W); the rest is MlaScratch
};

class MlaAttention final : public Attention {
 public:
  explicit MlaAttention(const DeepseekV2Config& c)
      : c_(c), H(c.num_heads), Dn(c.qk_nope_head_dim), Dr(c.qk_rope_head_dim), Dv(c.v_head_dim),
        Dq(Dn + Dr), r(c.kv_lora_rank), Rq(c.q_lora_rank) {}

  void add_params(int64_t l, const std::string& p, std::vector<Param>& params) override {
    const int64_t D = c_.decoder.hidden_size;
    if (static_cast<int64_t>(w_.size()) <= l) w_.resize(static_cast<size_t>(l) + 1);
    Index& x = w_[l];
    if (Rq > 0) {
      x.q_a = add_param(params, p + "q_a", {Rq, D});
      x.q_a_norm = add_param(params, p + "q_a_norm", {Rq});
      x.q = add_param(params, p + "q_b", {H * Dq, Rq});
    } else {
      x.q = add_param(params, p + "q", {H * Dq, D});
    }
    x.kv_a = add_param(params, p + "kv_a", {r + Dr, D});
    x.kv_a_norm = add_param(params, p + "kv_a_norm", {r});
    x.kv_b = add_param(params, p + "kv_b", {H * (Dn + Dv), r});
    x.o = add_param(params, p + "o", {D, H * Dv});
  }

  void hf_tensors(int64_t l, const std::string& p, std::vector<Param>& P, float out_scale,
                  std::vector<HfTensor>& out) const override {
    const Index& x = w_[l];
    if (Rq > 0) {
      out.push_back(hf_tensor(p + "q_a_proj.weight", P[x.q_a]));
      out.push_back(hf_tensor(p + "q_a_layernorm.weight", P[x.q_a_norm], 0.0f, 1.0f));
      out.push_back(hf_tensor(p + "q_b_proj.weight", P[x.q]));
    } else {
      out.push_back(hf_tensor(p + "q_proj.weight", P[x.q]));
    }
    out.push_back(hf_tensor(p + "kv_a_proj_with_mqa.weight", P[x.kv_a]));
    out.push_back(hf_tensor(p + "kv_a_layernorm.weight", P[x.kv_a_norm], 0.0f, 1.0f));
    out.push_back(hf_tensor(p + "kv_b_proj.weight", P[x.kv_b]));
    out.push_back(hf_tensor(p + "o_proj.weight", P[x.o], out_scale));
  }

  std::unique_ptr<AttentionActs> make_acts() const override { return std::make_unique<MlaActs>(); }

  void allocate(const std::vector<AttentionActs*>& layers, Arena& a, DType dt, int64_t B,
                int64_t S) const override {
    const int64_t N = B * S;
    auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
    auto act = [&](Shape sh) { return a.alloc(dt, sh); };
    MlaScratch shared;
    shared.d_att = act({N, H * Dv});
    shared.d_qf = act({N, H * Dq});
    shared.d_k = act({N, H * Dq});
    shared.d_v = act({N, H * Dv});
    shared.d_pe = act({N * H, Dr});
    shared.d_pe_rot = act({N * H, Dr});
    if (Rq > 0) shared.d_qan = act({N, Rq});
    shared.d_cn = act({N, r});
    shared.d_c = act({N, r});
    shared.d_krot = act({N, Dr});
    shared.d_kpe = act({N, Dr});
    for (AttentionActs* base : layers) {
      auto& x = static_cast<MlaActs&>(*base);
      if (Rq > 0) {
        x.qa = act({N, Rq});
        x.qa_rstd = f32({N});
        x.qan = act({N, Rq});
        x.d_qa = act({N, Rq});
      }
      x.q = act({N, H * Dq});
      x.q_pe = act({N * H, Dr});
      x.q_rot = act({N * H, Dr});
      x.qf = act({N, H * Dq});
      x.kva = act({N, r + Dr});
      x.c = act({N, r});
      x.c_rstd = f32({N});
      x.cn = act({N, r});
      x.k_pe = act({N, Dr});
      x.k_rot = act({N, Dr});
      x.kv = act({N, H * (Dn + Dv)});
      x.k = act({N, H * Dq});
      x.v = act({N, H * Dv});
      x.att = act({N, H * Dv});
      x.lse = f32({B, H, S});
      x.d_q = act({N, H * Dq});
      x.d_kv = act({N, H * (Dn + Dv)});
      x.d_kva = act({N, r + Dr});
      static_cast<MlaScratch&>(x) = shared;
    }
  }

  void forward(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<MlaActs&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S;
    if (Rq > 0) {
      io.linear->forward(io.xn, {{P[w.q_a], x.qa}, {P[w.kv_a], x.kva}});
      rmsnorm_forward(x.qa, P[w.q_a_norm].value, kLoraEps, x.qan, x.qa_rstd);
      io.linear->forward(x.qan, {{P[w.q], x.q}});
    } else {
      io.linear->forward(io.xn, {{P[w.q], x.q}, {P[w.kv_a], x.kva}});
    }
    // q: the nope part as projected, the rope part rotated.
    const Tensor q = x.q.view({N * H, Dq}), qf = x.qf.view({N * H, Dq});
    copy_columns(qf, 0, q, 0, Dn, false);
    copy_columns(x.q_pe, 0, q, Dn, Dr, false);
    rope_forward(x.q_pe.view({B, S, H, Dr}), io.cos, io.sin, true, x.q_rot.view({B, S, H, Dr}));
    copy_columns(qf, Dn, x.q_rot, 0, Dr, false);
    // k and v: the latent normed and expanded per head, k_pe rotated and shared by all.
    copy_columns(x.c, 0, x.kva, 0, r, false);
    copy_columns(x.k_pe, 0, x.kva, r, Dr, false);
    rmsnorm_forward(x.c, P[w.kv_a_norm].value, kLoraEps, x.cn, x.c_rstd);
    rope_forward(x.k_pe.view({B, S, 1, Dr}), io.cos, io.sin, true, x.k_rot.view({B, S, 1, Dr}));
    io.linear->forward(x.cn, {{P[w.kv_b], x.kv}});
    const Tensor kv = x.kv.view({N * H, Dn + Dv}), k = x.k.view({N * H, Dq});
    copy_columns(k, 0, kv, 0, Dn, false);
    copy_columns(k, Dn, x.k_rot, 0, Dr, false);  // broadcast over the heads
    copy_columns(x.v.view({N * H, Dv}), 0, kv, Dn, Dv, false);
    io.attend->forward(x.qf.view({B, S, H, Dq}), x.k.view({B, S, H, Dq}), x.v.view({B, S, H, Dv}), Tensor(), args(),
                       x.att.view({B, S, H, Dv}), x.lse);
    io.linear->forward(x.att, {{P[w.o], io.hm, 1.0f}});
  }

  void backward_input(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<MlaActs&>(base);
    const int64_t B = io.batch, S = io.seq, N = B * S;
    io.linear->backward_input(io.d_hm, P[w.o], x.d_att);
    io.attend->backward(x.qf.view({B, S, H, Dq}), x.k.view({B, S, H, Dq}), x.v.view({B, S, H, Dv}), Tensor(), args(),
                        x.att.view({B, S, H, Dv}), x.lse, x.d_att.view({B, S, H, Dv}), x.d_qf.view({B, S, H, Dq}),
                        x.d_k.view({B, S, H, Dq}), x.d_v.view({B, S, H, Dv}), Tensor());
    // kv: d_kv = [d_k nope | d_v] per head; k_pe's gradient summed over the heads.
    const Tensor d_kv = x.d_kv.view({N * H, Dn + Dv}), d_k = x.d_k.view({N * H, Dq});
    copy_columns(d_kv, 0, d_k, 0, Dn, false);
    copy_columns(d_kv, Dn, x.d_v.view({N * H, Dv}), 0, Dv, false);
    copy_columns(x.d_krot, 0, d_k, Dn, Dr, false);
    io.linear->backward_input(x.d_kv, P[w.kv_b], x.d_cn);
    rmsnorm_backward(x.c, P[w.kv_a_norm].value, x.c_rstd, x.d_cn, x.d_c, grad_zeroed(P[w.kv_a_norm]));
    rope_backward(x.d_krot.view({B, S, 1, Dr}), io.cos, io.sin, true, x.d_kpe.view({B, S, 1, Dr}));
    copy_columns(x.d_kva, 0, x.d_c, 0, r, false);
    copy_columns(x.d_kva, r, x.d_kpe, 0, Dr, false);
    io.linear->backward_input(x.d_kva, P[w.kv_a], io.d_xn);
    // q: the nope part's gradient as it is, the rope part's rotated back.
    const Tensor d_qf = x.d_qf.view({N * H, Dq}), d_q = x.d_q.view({N * H, Dq});
    copy_columns(d_q, 0, d_qf, 0, Dn, false);
    copy_columns(x.d_pe_rot, 0, d_qf, Dn, Dr, false);
    rope_backward(x.d_pe_rot.view({B, S, H, Dr}), io.cos, io.sin, true, x.d_pe.view({B, S, H, Dr}));
    copy_columns(d_q, Dn, x.d_pe, 0, Dr, false);
    if (Rq > 0) {
      io.linear->backward_input(x.d_q, P[w.q], x.d_qan);
      rmsnorm_backward(x.qa, P[w.q_a_norm].value, x.qa_rstd, x.d_qan, x.d_qa, grad_zeroed(P[w.q_a_norm]));
      io.linear->backward_input(x.d_qa, P[w.q_a], io.d_xn, 1.0f);
    } else {
      io.linear->backward_input(x.d_q, P[w.q], io.d_xn, 1.0f);
    }
  }

  void backward_weight(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<MlaActs&>(base);
    const Linear& f = *io.linear;
    f.backward_weight(x.att, {{io.d_hm, P[w.o]}});
    f.backward_weight(x.cn, {{x.d_kv, P[w.kv_b]}});
    if (Rq > 0) {
      f.backward_weight(x.qan, {{x.d_q, P[w.q]}});
      f.backward_weight(io.xn, {{x.d_kva, P[w.kv_a]}, {x.d_qa, P[w.q_a]}});
    } else {
      f.backward_weight(io.xn, {{x.d_kva, P[w.kv_a]}, {x.d_q, P[w.q]}});
    }
  }

 private:
  struct Index {
    int q_a = -1, q_a_norm = -1, q = -1, kv_a = -1, kv_a_norm = -1, kv_b = -1, o = -1;
  };
  cpu::AttentionArgs args() const { return {.scale = static_cast<float>(c_.softmax_scale)}; }
  DeepseekV2Config c_;
  int64_t H, Dn, Dr, Dv, Dq, r, Rq;
  std::vector<Index> w_;
};

}  // namespace

std::unique_ptr<Model> make_deepseek_v2(const DeepseekV2Config& c, const ModelOptions& options) {
  return make_decoder(c.decoder,
                      every_layer(std::make_shared<MlaAttention>(c), c.decoder.num_layers + c.decoder.mtp_depths), options);
}

}  // namespace mt
