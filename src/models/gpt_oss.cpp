#include "models/gpt_oss.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "kernels/elementwise.h"
#include "models/hf_config.h"

namespace mt {

GptOssConfig parse_gpt_oss_config(const nlohmann::json& j, const std::string& where) {
  GptOssConfig c;
  DecoderSpec& d = c.decoder;
  const HfConfig hf(j, where);
  d.vocab_size = hf.integer({"vocab_size"});
  d.hidden_size = hf.integer({"hidden_size"});
  d.num_layers = hf.integer({"num_hidden_layers"});
  d.moe_intermediate_size = hf.integer({"intermediate_size"});
  d.num_experts = hf.integer({"num_local_experts", "num_experts"});
  d.moe.assign(static_cast<size_t>(std::max<int64_t>(d.num_layers, 0)), true);
  d.rms_norm_eps = hf.number({"rms_norm_eps"}, 1e-5);
  d.tie_word_embeddings = hf.flag({"tie_word_embeddings"}, false);
  d.router.top_k = hf.integer({"num_experts_per_tok", "experts_per_token"});
  d.router.scoring = cpu::RouterScoring::topk_softmax;
  d.gpt_oss_experts = true;
  d.swiglu_limit = static_cast<float>(hf.number({"swiglu_limit"}, 7.0));
  c.num_heads = hf.integer({"num_attention_heads"});
  c.num_kv_heads = hf.integer({"num_key_value_heads"}, c.num_heads);
  c.head_dim = hf.integer({"head_dim"}, c.num_heads > 0 ? d.hidden_size / c.num_heads : 0);
  c.sliding_window = hf.integer({"sliding_window"}, 0);
  d.rope = read_rope(hf, c.head_dim);
  // transformers' default: sliding on even layers, full on odd ones
  std::vector<std::string> types;
  if (j.contains("layer_types") && j["layer_types"].is_array())
    for (const auto& t : j["layer_types"]) types.push_back(t.is_string() ? t.get<std::string>() : "?");
  MT_CHECK(types.empty() || static_cast<int64_t>(types.size()) == d.num_layers)
      << where << ": layer_types has " << types.size() << " entries for " << d.num_layers << " layers";
  for (int64_t l = 0; l < d.num_layers; ++l) {
    const std::string t = types.empty() ? (l % 2 == 0 ? "sliding_attention" : "full_attention") : types.at(l);
    MT_CHECK(t == "sliding_attention" || t == "full_attention")
        << where << ": layer_types[" << l << "] '" << t << "' is not sliding_attention or full_attention";
    c.sliding.push_back(t == "sliding_attention");
  }

  // What this implementation does not do is an error, never a silent difference.
  MT_CHECK(hf.flag({"attention_bias"}, true)) << where << ": attention_bias = false is not supported for gpt_oss";
  // transformers' GPT-OSS experts clamp at 7 whatever the config says
  MT_CHECK(d.swiglu_limit == 7.0f) << where << ": swiglu_limit " << d.swiglu_limit << " is not supported (7.0)";
  const std::string quant = hf.text({"quantization_config.quant_method"}, "none");
  MT_CHECK(quant == "none" || quant == "mxfp4")
      << where << ": quantization_config.quant_method '" << quant << "' is not supported (mxfp4 is dequantized)";
  MT_CHECK(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0)
      << where << ": num_attention_heads " << c.num_heads << " must be a positive multiple of num_key_value_heads "
      << c.num_kv_heads;
  check_decoder_spec(d, where);
  for (bool s : c.sliding)
    MT_CHECK(!s || c.sliding_window > 0) << where << ": sliding_attention layers need a positive sliding_window";
  return c;
}

namespace {

struct GptOssActs : AttentionActs {
  Tensor q, k, v, qr, kr, att, lse;
  Tensor d_att, d_qr, d_kr, d_q, d_k, d_v;
};

class GptOssAttention final : public Attention {
 public:
  explicit GptOssAttention(const GptOssConfig& c) : c_(c) {}

  void add_params(int64_t l, const std::string& p, std::vector<Param>& params) override {
    const int64_t D = c_.decoder.hidden_size, Q = c_.num_heads * c_.head_dim, KV = c_.num_kv_heads * c_.head_dim;
    if (static_cast<int64_t>(w_.size()) < c_.decoder.num_layers) w_.resize(c_.decoder.num_layers);
    Index& x = w_[l];
    auto vector = [&](std::string name, int64_t n) {  // biases and sinks: f32, never decayed
      const int i = add_param(params, std::move(name), {n});
      params[i].matrix = false;
      return i;
    };
    x.q = add_param(params, p + "q", {Q, D});
    x.q_bias = vector(p + "q_bias", Q);
    x.k = add_param(params, p + "k", {KV, D});
    x.k_bias = vector(p + "k_bias", KV);
    x.v = add_param(params, p + "v", {KV, D});
    x.v_bias = vector(p + "v_bias", KV);
    x.o = add_param(params, p + "o", {D, Q});
    x.o_bias = vector(p + "o_bias", D);
    x.sinks = vector(p + "sinks", c_.num_heads);
  }

  void hf_tensors(int64_t l, const std::string& p, std::vector<Param>& P, float out_scale,
                  std::vector<HfTensor>& out) const override {
    const Index& x = w_[l];
    for (auto [name, w, b] : {std::tuple{"q_proj", x.q, x.q_bias}, {"k_proj", x.k, x.k_bias}, {"v_proj", x.v, x.v_bias},
                              {"o_proj", x.o, x.o_bias}}) {
      out.push_back(hf_tensor(p + name + ".weight", P[w], w == x.o ? out_scale : 1.0f));
      out.push_back(hf_tensor(p + name + ".bias", P[b], 0.0f, 0.0f));
    }
    out.push_back(hf_tensor(p + "sinks", P[x.sinks], 0.0f, 0.0f));
  }

  std::unique_ptr<AttentionActs> make_acts() const override { return std::make_unique<GptOssActs>(); }

  void allocate(const std::vector<AttentionActs*>& layers, Arena& a, DType dt, int64_t B,
                int64_t S) const override {
    const int64_t N = B * S, Q = c_.num_heads * c_.head_dim, KV = c_.num_kv_heads * c_.head_dim;
    auto act = [&](Shape sh) { return a.alloc(dt, sh); };
    const Tensor d_att = act({N, Q}), d_qr = act({N, Q}), d_kr = act({N, KV});  // only B reads them
    for (AttentionActs* base : layers) {
      auto& x = static_cast<GptOssActs&>(*base);
      x.q = act({N, Q});
      x.k = act({N, KV});
      x.v = act({N, KV});
      x.qr = act({N, Q});
      x.kr = act({N, KV});
      x.att = act({N, Q});
      x.lse = a.alloc(DType::f32, {B, c_.num_heads, S});
      x.d_att = d_att;
      x.d_qr = d_qr;
      x.d_kr = d_kr;
      x.d_q = act({N, Q});
      x.d_k = act({N, KV});
      x.d_v = act({N, KV});
    }
  }

  void forward(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<GptOssActs&>(base);
    const int64_t B = io.batch, S = io.seq, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
    // q, k and v = xn @ W^T + b: grouped GEMMs of one group, which take a bias.
    io.linear->grouped_forward(io.xn, P[w.q], P[w.q_bias].value, io.all_rows, x.q);
    io.linear->grouped_forward(io.xn, P[w.k], P[w.k_bias].value, io.all_rows, x.k);
    io.linear->grouped_forward(io.xn, P[w.v], P[w.v_bias].value, io.all_rows, x.v);
    rope_forward(x.q.view({B, S, Hq, Dh}), io.cos, io.sin, false, x.qr.view({B, S, Hq, Dh}));
    rope_forward(x.k.view({B, S, Hkv, Dh}), io.cos, io.sin, false, x.kr.view({B, S, Hkv, Dh}));
    io.attend->forward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}),
                       P[w.sinks].value, args(l), x.att.view({B, S, Hq, Dh}), x.lse);
    // hm += att @ Wo^T + bo
    io.linear->forward(x.att, {{P[w.o], io.hm, 1.0f}});
    copy_columns(io.hm, 0, P[w.o_bias].value.view({1, c_.decoder.hidden_size}), 0, c_.decoder.hidden_size, true);
  }

  void backward_input(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<GptOssActs&>(base);
    const int64_t B = io.batch, S = io.seq, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
    io.linear->backward_input(io.d_hm, P[w.o], x.d_att);
    io.attend->backward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}),
                        P[w.sinks].value, args(l), x.att.view({B, S, Hq, Dh}), x.lse, x.d_att.view({B, S, Hq, Dh}),
                        x.d_qr.view({B, S, Hq, Dh}), x.d_kr.view({B, S, Hkv, Dh}), x.d_v.view({B, S, Hkv, Dh}),
                        grad_zeroed(P[w.sinks]));
    rope_backward(x.d_qr.view({B, S, Hq, Dh}), io.cos, io.sin, false, x.d_q.view({B, S, Hq, Dh}));
    rope_backward(x.d_kr.view({B, S, Hkv, Dh}), io.cos, io.sin, false, x.d_k.view({B, S, Hkv, Dh}));
    io.linear->backward_input(x.d_q, P[w.q], io.d_xn);
    io.linear->backward_input(x.d_k, P[w.k], io.d_xn, 1.0f);
    io.linear->backward_input(x.d_v, P[w.v], io.d_xn, 1.0f);
  }

  void backward_weight(int64_t l, std::vector<Param>& P, AttentionActs& base, const AttentionIo& io) override {
    const Index& w = w_[l];
    auto& x = static_cast<GptOssActs&>(base);
    linear_weight(P, w.o, w.o_bias, io, x.att, io.d_hm);
    linear_weight(P, w.q, w.q_bias, io, io.xn, x.d_q);
    linear_weight(P, w.k, w.k_bias, io, io.xn, x.d_k);
    linear_weight(P, w.v, w.v_bias, io, io.xn, x.d_v);
  }

 private:
  struct Index {
    int q = -1, k = -1, v = -1, o = -1, q_bias = -1, k_bias = -1, v_bias = -1, o_bias = -1, sinks = -1;
  };
  // The W and b gradients of y = x @ W^T + b: a grouped GEMM of one group.
  static void linear_weight(std::vector<Param>& P, int w, int b, const AttentionIo& io, const Tensor& x,
                            const Tensor& dy) {
    const bool accumulate = !start_grad(P[w]);  // the bias is written with its weight
    P[b].grad_started = true;
    io.linear->grouped_backward_weight(x, dy, io.all_rows, P[w], P[b].grad, accumulate);
  }
  cpu::AttentionArgs args(int64_t l) const {
    return {.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.head_dim))),
            .window = c_.sliding[l] ? c_.sliding_window : 0};
  }
  GptOssConfig c_;
  std::vector<Index> w_;
};

}  // namespace

std::unique_ptr<Model> make_gpt_oss(const GptOssConfig& c, const ModelOptions& options) {
  return make_decoder(c.decoder, every_layer(std::make_shared<GptOssAttention>(c), c.decoder.num_layers), options);
}

}  // namespace mt
