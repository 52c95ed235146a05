#include "models/qwen3_moe.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "kernels/attention.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/router.h"
#include "kernels/cross_entropy.h"
#include "kernels/swiglu.h"
#include "models/hf_config.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"

namespace mt {

using json = nlohmann::json;

bool Qwen3MoeConfig::is_moe_layer(int64_t layer) const {
  for (int64_t l : mlp_only_layers)
    if (l == layer) return false;
  return num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
}

Qwen3MoeConfig parse_qwen3_moe_config(const json& j, const std::string& where) {
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
  c.num_experts = hf.integer({"num_experts", "num_local_experts"}, 0);
  c.top_k = hf.integer({"num_experts_per_tok"}, 1);
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
  if (any_moe) {
    MT_CHECK(c.top_k >= 1 && c.top_k <= c.num_experts && c.moe_intermediate_size > 0)
        << where << ": num_experts_per_tok " << c.top_k << " must be in [1, num_experts=" << c.num_experts
        << "] and moe_intermediate_size positive";
  }
  return c;
}

namespace {

// Every kernel call below goes through the family headers' mt:: dispatchers, which
// pick the backend by the tensors' device. Calls that take a cpu:: struct are written
// mt::f(...): argument-dependent lookup would also find cpu::f.

constexpr int32_t kIgnoreIndex = -100;

// Where each layer's parameters sit in params_ (indices, so the vector may grow).
struct LayerIndex {
  int in_norm, q, k, v, o, q_norm, k_norm, post_norm;
  int router = -1;   // MoE layers: [E, D]
  int gate_up, down;  // MoE: [E, 2I, D] and [E, D, I]; dense: [2I, D] and [D, I]
};

// Activations of one layer for one micro-batch, and the gradients its W stages need.
// N = batch * seq tokens, R = N * top_k routed rows.
struct LayerActs {
  Tensor xn, rstd1;             // input norm [N,D], [N]
  Tensor q, k, v;               // projections [N,Hq*Dh], [N,Hkv*Dh]
  Tensor rstd_q, rstd_k;        // q/k norm per head [N*Hq], [N*Hkv]
  Tensor qn, kn;                // normed q, k
  Tensor qr, kr;                // rotated
  Tensor att, lse;              // attention output [N,Hq*Dh], [B,Hq,S]
  Tensor hm, y, rstd2;          // residual after attention, its norm
  Tensor logits, idx, weight, probs, dprobs;        // router (f32)
  // prob_sum f32 [E] (probs summed over tokens) and counts i32 [E] (slots each expert
  // kept) side by side in `stats`, so the metrics read both in one copy.
  Tensor stats, prob_sum, counts;
  Tensor offsets, order, slot_row;                  // dispatch plan
  int64_t dropped = 0;                              // slots over capacity
  Tensor xs, gu, hs, ys, mo;    // expert (or dense MLP) path
  // Expert parallelism: the exchange plan, the rows R it brought to this rank's experts
  // (xs .. d_xs are allocated for the most R can be and used as rows(0, R)), `back`,
  // every slot's expert output returned to this rank [N*k, D], and the exchange a
  // dispatch or combine stage started, until its finish.
  parallel::RoutedMark routed;  // where the router's idx is complete
  parallel::EpPlan plan;
  Tensor back;
  parallel::EpExchange exchange;
  // Gradients. d_logits is f32 like the router; d_logits_c is what the matrix products
  // read (a bf16 copy on the GPU, d_logits itself on the CPU).
  Tensor d_ys, d_weight, d_hs, d_gu, d_xs, d_y, d_logits, d_logits_c, d_hm, d_att, d_qr, d_kr, d_v, d_qn, d_kn, d_q,
      d_k, d_xn;
};

struct Qwen3Block : ActivationBlock {
  Arena arena;
};

struct Qwen3Stash : Stash {
  Arena arena;
  std::vector<int32_t> positions_host;
  Tensor cos, sin;
  Tensor balanced_idx;               // force_balanced_routing: the fixed expert choice
  std::vector<LayerActs> layers;
  Tensor hf, rstd_f, logits, lse, d_hf;  // head
  LossSum loss;
};

class Qwen3Moe final : public Model {
 public:
  Qwen3Moe(const Qwen3MoeConfig& c, const ModelOptions& o)
      : c_(c), device_(o.device), balanced_(o.force_balanced_routing), plan_only_(o.plan_only),
        external_layers_(o.external_layers), capacity_factor_(o.capacity_factor), ep_(o.ep),
        cp_(o.cp != nullptr && o.cp->size() > 1 ? o.cp : nullptr),
        act_(o.device == Device::cuda ? DType::bf16 : DType::f32), embedding_(o.embedding), head_(o.head) {
    held_.assign(static_cast<size_t>(c.num_layers), o.layers.empty());
    for (int64_t l : o.layers) {
      MT_CHECK(l >= 0 && l < c.num_layers) << "model built for layer " << l << " of " << c.num_layers;
      held_[l] = true;
    }
    MT_CHECK(!c.tie_word_embeddings || embedding_ == head_)
        << "tie_word_embeddings: the embedding and the head share a weight, so they must be on one pipeline rank "
        << "(parallelism.pipeline_schedule = dualpipev places both on rank 0)";
    build_params();
  }

  Device device() const override { return device_; }
  bool balanced_routing() const override { return balanced_; }
  int64_t num_layers() const override { return c_.num_layers; }
  bool is_moe_layer(int64_t layer) const override { return c_.is_moe_layer(layer); }
  int64_t num_experts() const override { return c_.num_experts; }
  int64_t vocab_size() const override { return c_.vocab_size; }
  std::vector<Param>& params() override { return params_; }

  int64_t param_count() const override {
    int64_t n = 0;
    for (const Param& p : params_) n += p.value.numel();
    return n;
  }
  int64_t active_param_count() const override {
    int64_t n = 0;
    for (const Param& p : params_) n += p.expert ? p.value.numel() / local_experts_ * c_.top_k : p.value.numel();
    return n;
  }

  std::vector<HfTensor> hf_tensors() override;
  bool held_by_another_rank(const std::string& name) const override {
    if (name.starts_with("model.layers.")) {
      const int64_t l = std::atoll(name.c_str() + 13);
      if (l >= 0 && l < c_.num_layers && !held_[l]) return true;
    }
    if (name == "model.embed_tokens.weight") return !embedding_;
    if (name == "model.norm.weight" || name == "lm_head.weight") return !head_;
    size_t at = name.find(".mlp.experts.");
    if (ep_ == nullptr || at == std::string::npos) return false;
    int64_t e = std::atoll(name.c_str() + at + 13);
    return e >= 0 && e < c_.num_experts && (e < first_expert_ || e >= first_expert_ + local_experts_);
  }
  std::unique_ptr<Stash> make_bare_stash(int64_t batch, int64_t seq) override;
  std::unique_ptr<ActivationBlock> make_block(int64_t batch, int64_t seq, int64_t first, int64_t last) override;
  void lend(Stash& s, ActivationBlock& b) override;
  void embed_forward(Stash& s) override;
  void stage_forward(int64_t layer, Stage stage, Stash& s) override;
  void stage_backward_input(int64_t layer, Stage stage, Stash& s) override;
  void stage_backward_weight(int64_t layer, Stage stage, Stash& s) override;
  // A layer has at most one exchange in flight: finishing a stage finishes it.
  void finish_forward(int64_t l, Stage, Stash& s) override { finish_exchange(layer_acts(s, l)); }
  void finish_backward_input(int64_t l, Stage, Stash& s) override { finish_exchange(layer_acts(s, l)); }
  LossSum head_forward(Stash& s) override;
  void head_backward_input(Stash& s, float scale) override;
  void head_backward_weight(Stash& s) override;
  void embed_backward(Stash& s) override;
  Tensor logits(Stash& s) override { return static_cast<Qwen3Stash&>(s).logits; }
  std::vector<RouterStats> router_stats(const Stash& s) const override;
  void set_router_prob_grad(Stash& s, int64_t layer, const std::vector<float>& dprob) override;

 private:
  int add_param(std::string name, Shape shape, bool expert);
  void build_params();
  void allocate_bare(Qwen3Stash& s, Arena& a) const;
  void allocate_layers(Qwen3Stash& s, Arena& a, int64_t first, int64_t last) const;
  const Tensor& W(int i) const { return params_[i].value; }    // f32 master (norms, embedding)
  const Tensor& C(int i) const { return params_[i].compute; }  // read by matrix products
  const Tensor& G(int i) const { return params_[i].grad; }
  // Gradient writes: a Param's first write of the step replaces its gradient and later
  // ones add (Param::grad_started), whatever order the schedule runs micro-batches in.
  // beta(i) is a product's factor on the old gradient; Z(i) is the gradient for kernels
  // that only add (norm weights, the embedding), zeroed first when nothing is there yet.
  bool start_grad(int i) {
    const bool first = !params_[i].grad_started;
    params_[i].grad_started = true;
    return first;
  }
  float beta(int i) { return start_grad(i) ? 0.0f : 1.0f; }
  const Tensor& Z(int i) {
    if (start_grad(i)) mt::fill(params_[i].grad, 0.0f);
    return params_[i].grad;
  }
  cpu::RouterConfig router_config() const {
    cpu::RouterConfig r;
    r.top_k = c_.top_k;
    r.normalize = c_.norm_topk_prob;
    return r;
  }
  cpu::AttentionArgs attention_args() const {
    cpu::AttentionArgs a;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.head_dim)));
    return a;
  }
  // The expert path of a MoE layer for this micro-batch: every routed row, or with
  // expert parallelism the R rows the exchange brought to this rank's experts.
  struct Routed {
    Tensor xs, gu, hs, ys, d_ys, d_hs, d_gu, d_xs, offsets;
  };
  Routed routed(LayerActs& x) const {
    if (ep_ == nullptr && x.dropped == 0) return {x.xs, x.gu, x.hs, x.ys, x.d_ys, x.d_hs, x.d_gu, x.d_xs, x.offsets};
    // A capacity keeps the first R rows; the exchange brings R rows.
    const int64_t r = ep_ ? x.plan.local_rows() : x.xs.dim(0) - x.dropped;
    if (ep_ == nullptr)
      return {x.xs.rows(0, r),   x.gu.rows(0, r),   x.hs.rows(0, r),   x.ys.rows(0, r), x.d_ys.rows(0, r),
              x.d_hs.rows(0, r), x.d_gu.rows(0, r), x.d_xs.rows(0, r), x.offsets};
    return {x.xs.rows(0, r),   x.gu.rows(0, r),   x.hs.rows(0, r),   x.ys.rows(0, r), x.d_ys.rows(0, r),
            x.d_hs.rows(0, r), x.d_gu.rows(0, r), x.d_xs.rows(0, r), x.plan.offsets};
  }
  static LayerActs& layer_acts(Stash& s, int64_t l) { return static_cast<Qwen3Stash&>(s).layers[l]; }
  // Finishes the expert-parallel exchange layer x has in flight, whichever it is.
  void finish_exchange(LayerActs& x) const;
  // Rows each expert keeps of a micro-batch of n tokens (0: all).
  int64_t capacity(int64_t n) const {
    if (capacity_factor_ <= 0.0) return 0;
    const double fair = static_cast<double>(n * c_.top_k) / static_cast<double>(c_.num_experts);
    return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(capacity_factor_ * fair)));
  }
  void attention_forward_stage(int64_t l, Qwen3Stash& s);
  void attention_backward_input(int64_t l, Qwen3Stash& s);
  void attention_backward_weight(int64_t l, Qwen3Stash& s);

  Qwen3MoeConfig c_;
  Device device_;
  bool balanced_;
  bool plan_only_;
  bool external_layers_;  // ZeRO-3: the decoder layers' Params have no storage here
  double capacity_factor_;  // 0: dropless
  comm::Communicator* ep_;  // null: every expert lives here
  comm::Communicator* cp_;  // null: whole sequences here
  int64_t local_experts_ = 0, first_expert_ = 0;
  DType act_;  // activations: bf16 on the GPU, f32 on the CPU
  std::vector<bool> held_;  // per layer: built on this rank (pipeline parallelism)
  bool embedding_, head_;
  std::vector<Param> params_;
  Arena values_, grads_, compute_;
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<LayerIndex> layer_;
  cpu::RopeFreqs rope_;
};

int Qwen3Moe::add_param(std::string name, Shape shape, bool expert) {
  Param p;
  p.name = std::move(name);
  p.value = Tensor(nullptr, shape, DType::f32);
  p.matrix = shape.n >= 2;
  p.expert = expert;
  params_.push_back(std::move(p));
  return static_cast<int>(params_.size()) - 1;
}

void Qwen3Moe::build_params() {
  const int64_t D = c_.hidden_size, Dh = c_.head_dim;
  local_experts_ = c_.num_experts;
  if (ep_ != nullptr && ep_->size() > 1) {
    MT_CHECK(c_.num_experts % ep_->size() == 0)
        << "num_experts " << c_.num_experts << " does not split over parallelism.ep = " << ep_->size();
    local_experts_ = c_.num_experts / ep_->size();
    first_expert_ = ep_->rank() * local_experts_;
  } else {
    ep_ = nullptr;
  }
  const int64_t E = local_experts_;
  if (embedding_) embed_ = add_param("embed", {c_.vocab_size, D}, false);
  layer_.resize(static_cast<size_t>(c_.num_layers));
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    std::string p = "layers." + std::to_string(l) + ".";
    LayerIndex x{};
    x.in_norm = add_param(p + "input_norm", {D}, false);
    x.q = add_param(p + "q", {c_.num_heads * Dh, D}, false);
    x.k = add_param(p + "k", {c_.num_kv_heads * Dh, D}, false);
    x.v = add_param(p + "v", {c_.num_kv_heads * Dh, D}, false);
    x.o = add_param(p + "o", {D, c_.num_heads * Dh}, false);
    x.q_norm = add_param(p + "q_norm", {Dh}, false);
    x.k_norm = add_param(p + "k_norm", {Dh}, false);
    x.post_norm = add_param(p + "post_norm", {D}, false);
    if (c_.is_moe_layer(l)) {
      const int64_t I = c_.moe_intermediate_size;
      x.router = add_param(p + "router", {c_.num_experts, D}, false);
      x.gate_up = add_param(p + "experts.gate_up", {E, 2 * I, D}, true);
      x.down = add_param(p + "experts.down", {E, D, I}, true);
    } else {
      const int64_t I = c_.intermediate_size;
      x.gate_up = add_param(p + "mlp.gate_up", {2 * I, D}, false);
      x.down = add_param(p + "mlp.down", {D, I}, false);
    }
    layer_[l] = x;
  }
  if (head_) final_norm_ = add_param("final_norm", {D}, false);
  if (head_ && !c_.tie_word_embeddings) lm_head_ = add_param("lm_head", {c_.vocab_size, D}, false);
  for (Param& p : params_) {
    if (p.name.starts_with("layers.")) p.layer = std::atoll(p.name.c_str() + 7);
    if (p.name == "final_norm" || p.name == "lm_head") p.layer = c_.num_layers;
  }

  // Two arenas of identical layout, master weights and their gradients, and on the GPU
  // a third with the bf16 copies of the matrices that the products read. With external
  // layers, only the embedding's and the head's.
  const bool copies = device_ == Device::cuda;
  auto held = [&](const Param& p) { return !external_layers_ || p.layer < 0 || p.layer >= c_.num_layers; };
  Arena count = Arena::counting("parameters", device_), count_c = Arena::counting("compute weights", device_);
  for (const Param& p : params_) {
    if (!held(p)) continue;
    count.alloc(DType::f32, p.value.shape);
    if (copies && p.matrix) count_c.alloc(DType::bf16, p.value.shape);
  }
  auto arena = [&](const char* name, size_t bytes) {
    return plan_only_ ? Arena::counting(name, device_) : Arena(name, device_, bytes);
  };
  values_ = arena("parameters", count.peak());
  grads_ = arena("gradients", count.peak());
  compute_ = arena("compute weights", count_c.peak());
  for (Param& p : params_) {
    if (!held(p)) {
      p.value = Tensor(nullptr, p.value.shape, DType::f32, device_);
      p.grad = p.value;
      p.compute = copies && p.matrix ? Tensor(nullptr, p.value.shape, DType::bf16, device_) : p.value;
      continue;
    }
    p.value = values_.alloc(DType::f32, p.value.shape);
    p.grad = grads_.alloc(DType::f32, p.value.shape);
    p.compute = copies && p.matrix ? compute_.alloc(DType::bf16, p.value.shape) : p.value;
    if (plan_only_) continue;
    mt::fill(p.value, 0.0f);
    mt::fill(p.grad, 0.0f);
  }
  if (!plan_only_) refresh_compute_weights(params_);
  cpu::RopeConfig rc;
  rc.theta = c_.rope_theta;
  rc.rotary_dim = c_.head_dim;
  rope_ = cpu::rope_freqs(rc);
}

std::vector<HfTensor> Qwen3Moe::hf_tensors() {
  std::vector<HfTensor> out;
  const float out_scale = static_cast<float>(1.0 / std::sqrt(2.0 * static_cast<double>(c_.num_layers)));
  auto add = [&](std::string name, const Param& p, float scale = 1.0f, float fill = 0.0f) {
    out.push_back({std::move(name), p.value, p.grad, scale, fill});
  };
  auto add_view = [&](std::string name, Tensor v, Tensor g, float scale, bool expert = false) {
    out.push_back({std::move(name), v, g, scale, 0.0f, expert});
  };
  // Rows [r0, r1) of block e of a fused [E, rows, cols] (or [rows, cols]) tensor.
  auto slice = [](const Tensor& t, int64_t e, int64_t r0, int64_t r1) {
    Tensor block = t.ndim() == 3 ? t.rows(e, e + 1).view({t.dim(1), t.dim(2)}) : t;
    return block.rows(r0, r1);
  };
  if (embedding_) add("model.embed_tokens.weight", params_[embed_]);
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    const LayerIndex& x = layer_[l];
    std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", params_[x.in_norm], 0.0f, 1.0f);
    add(p + "self_attn.q_proj.weight", params_[x.q]);
    add(p + "self_attn.k_proj.weight", params_[x.k]);
    add(p + "self_attn.v_proj.weight", params_[x.v]);
    add(p + "self_attn.o_proj.weight", params_[x.o], out_scale);
    add(p + "self_attn.q_norm.weight", params_[x.q_norm], 0.0f, 1.0f);
    add(p + "self_attn.k_norm.weight", params_[x.k_norm], 0.0f, 1.0f);
    add(p + "post_attention_layernorm.weight", params_[x.post_norm], 0.0f, 1.0f);
    const Param& gu = params_[x.gate_up];
    const Param& dn = params_[x.down];
    if (c_.is_moe_layer(l)) {
      const int64_t I = c_.moe_intermediate_size;
      add(p + "mlp.gate.weight", params_[x.router]);
      for (int64_t e = 0; e < local_experts_; ++e) {
        std::string q = p + "mlp.experts." + std::to_string(first_expert_ + e) + ".";
        add_view(q + "gate_proj.weight", slice(gu.value, e, 0, I), slice(gu.grad, e, 0, I), 1.0f, true);
        add_view(q + "up_proj.weight", slice(gu.value, e, I, 2 * I), slice(gu.grad, e, I, 2 * I), 1.0f, true);
        add_view(q + "down_proj.weight", slice(dn.value, e, 0, c_.hidden_size), slice(dn.grad, e, 0, c_.hidden_size),
                 out_scale, true);
      }
    } else {
      const int64_t I = c_.intermediate_size;
      add_view(p + "mlp.gate_proj.weight", slice(gu.value, 0, 0, I), slice(gu.grad, 0, 0, I), 1.0f);
      add_view(p + "mlp.up_proj.weight", slice(gu.value, 0, I, 2 * I), slice(gu.grad, 0, I, 2 * I), 1.0f);
      add(p + "mlp.down_proj.weight", dn, out_scale);
    }
  }
  if (head_) add("model.norm.weight", params_[final_norm_], 0.0f, 1.0f);
  if (lm_head_ >= 0) add("lm_head.weight", params_[lm_head_]);
  return out;
}

void Qwen3Moe::allocate_bare(Qwen3Stash& s, Arena& a) const {
  const int64_t B = s.batch, S = s.seq, N = B * S, D = c_.hidden_size, Dh = c_.head_dim;
  auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
  auto i32 = [&](Shape sh) { return a.alloc(DType::i32, sh); };
  s.ids = i32({B, S});
  s.labels = i32({B, S});
  s.cos = f32({S, Dh / 2});
  s.sin = f32({S, Dh / 2});
  // The residual stream where a layer here reads or writes it, or the head reads it.
  s.h.resize(c_.num_layers + 1);
  s.dh.resize(c_.num_layers + 1);
  for (int64_t l = 0; l <= c_.num_layers; ++l) {
    if (!(l < c_.num_layers && held_[l]) && !(l > 0 && held_[l - 1]) && !(l == c_.num_layers && head_)) continue;
    s.h[l] = a.alloc(act_, {N, D});
    s.dh[l] = a.alloc(act_, {N, D});
  }
  s.layers.resize(c_.num_layers);
  if (balanced_) s.balanced_idx = i32({N, c_.top_k});
}

void Qwen3Moe::allocate_layers(Qwen3Stash& s, Arena& a, int64_t first, int64_t last) const {
  const int64_t B = s.batch, S = s.seq, N = B * S, D = c_.hidden_size, Dh = c_.head_dim;
  const int64_t Hq = c_.num_heads, Hkv = c_.num_kv_heads, E = c_.num_experts, K = c_.top_k;
  auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
  auto act = [&](Shape sh) { return a.alloc(act_, sh); };
  auto i32 = [&](Shape sh) { return a.alloc(DType::i32, sh); };
  // Gradients that only a layer's own B stages read, each written before it is read:
  // one set serves every layer (a stash's B stages run one layer at a time). What the
  // W stages read (d_hm, d_q, d_k, d_v, d_gu, d_ys, d_logits_c) stays per layer.
  const int64_t R = ep_ ? ep_->size() * N * std::min(K, local_experts_) : N * K;
  bool any_moe = false;
  int64_t hidden = 0;  // elements of the widest d_hs
  for (int64_t l = first; l < last; ++l) {
    if (!held_[l]) continue;
    any_moe = any_moe || c_.is_moe_layer(l);
    hidden = std::max(hidden, c_.is_moe_layer(l) ? R * c_.moe_intermediate_size : N * c_.intermediate_size);
  }
  if (hidden == 0 && !(last == c_.num_layers && head_)) return;
  const Tensor d_y = act({N, D}), d_att = act({N, Hq * Dh}), d_qr = act({N, Hq * Dh}), d_kr = act({N, Hkv * Dh}),
               d_qn = act({N, Hq * Dh}), d_kn = act({N, Hkv * Dh}), d_xn = act({N, D}), d_hs = act({hidden}),
               d_xs = any_moe ? act({R, D}) : Tensor();
  for (int64_t l = first; l < last; ++l) {
    if (!held_[l]) continue;
    LayerActs& x = s.layers[l];
    x.xn = act({N, D});
    x.rstd1 = f32({N});
    x.q = act({N, Hq * Dh});
    x.k = act({N, Hkv * Dh});
    x.v = act({N, Hkv * Dh});
    x.rstd_q = f32({N * Hq});
    x.rstd_k = f32({N * Hkv});
    x.qn = act({N, Hq * Dh});
    x.kn = act({N, Hkv * Dh});
    x.qr = act({N, Hq * Dh});
    x.kr = act({N, Hkv * Dh});
    x.att = act({N, Hq * Dh});
    x.lse = f32({B, Hq, S});
    x.hm = act({N, D});
    x.y = act({N, D});
    x.rstd2 = f32({N});
    x.d_y = d_y;
    x.d_hm = act({N, D});
    x.d_att = d_att;
    x.d_qr = d_qr;
    x.d_kr = d_kr;
    x.d_v = act({N, Hkv * Dh});
    x.d_qn = d_qn;
    x.d_kn = d_kn;
    x.d_q = act({N, Hq * Dh});
    x.d_k = act({N, Hkv * Dh});
    x.d_xn = d_xn;
    x.mo = act({N, D});
    if (c_.is_moe_layer(l)) {
      // With expert parallelism every rank's N tokens may each bring up to
      // min(k, local experts) rows here.
      const int64_t I = c_.moe_intermediate_size;
      if (ep_) x.back = act({N * K, D});
      x.logits = f32({N, E});
      x.idx = i32({N, K});
      x.weight = f32({N, K});
      x.probs = f32({N, E});
      x.stats = i32({2, E});
      x.prob_sum = Tensor(x.stats.data, {E}, DType::f32, x.stats.device);
      x.counts = x.stats.rows(1, 2).view({E});
      x.dprobs = f32({1, E});  // the same row for every token
      x.offsets = i32({E + 1});
      x.order = i32({R});
      x.slot_row = i32({R});
      x.xs = act({R, D});
      x.gu = act({R, 2 * I});
      x.hs = act({R, I});
      x.ys = act({R, D});
      x.d_ys = act({R, D});
      x.d_weight = f32({N, K});
      x.d_hs = Tensor(d_hs.data, {R, I}, act_, d_hs.device);
      x.d_gu = act({R, 2 * I});
      x.d_xs = d_xs;
      x.d_logits = f32({N, E});
      x.d_logits_c = act_ == DType::f32 ? x.d_logits : act({N, E});
    } else {
      const int64_t I = c_.intermediate_size;
      x.gu = act({N, 2 * I});
      x.hs = act({N, I});
      x.d_hs = Tensor(d_hs.data, {N, I}, act_, d_hs.device);
      x.d_gu = act({N, 2 * I});
    }
  }
  if (last != c_.num_layers || !head_) return;
  s.hf = act({N, D});
  s.rstd_f = f32({N});
  s.logits = act({N, c_.vocab_size});
  s.lse = f32({N});
  s.d_hf = act({N, D});
}

std::unique_ptr<Stash> Qwen3Moe::make_bare_stash(int64_t batch, int64_t seq) {
  MT_CHECK(batch >= 1 && seq >= 1) << "a micro-batch needs at least one sequence of one token, got " << batch << "x"
                                   << seq;
  auto s = std::make_unique<Qwen3Stash>();
  s->batch = batch;
  s->seq = seq;
  // Plan with a counting arena, then allocate the same sequence for real.
  Arena plan = Arena::counting("activations", device_);
  allocate_bare(*s, plan);
  s->bytes = plan.peak();
  if (plan_only_) return s;
  s->arena = Arena("activations", device_, plan.peak());
  allocate_bare(*s, s->arena);
  s->positions_host.resize(static_cast<size_t>(seq));
  if (cp_) {
    std::vector<int64_t> pos = parallel::zigzag_positions(seq * cp_->size(), cp_->rank(), cp_->size());
    for (int64_t t = 0; t < seq; ++t) s->positions_host[t] = static_cast<int32_t>(pos[t]);
  } else {
    for (int64_t t = 0; t < seq; ++t) s->positions_host[t] = static_cast<int32_t>(t);
  }
  mt::rope_tables(rope_, Tensor(s->positions_host.data(), {seq}, DType::i32), s->cos, s->sin);
  if (balanced_) {
    std::vector<int32_t> idx(static_cast<size_t>(batch * seq * c_.top_k));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i % c_.num_experts);
    mt::copy(s->balanced_idx, Tensor(idx.data(), s->balanced_idx.shape, DType::i32));
  }
  return s;
}

std::unique_ptr<ActivationBlock> Qwen3Moe::make_block(int64_t batch, int64_t seq, int64_t first, int64_t last) {
  MT_CHECK(0 <= first && first <= last && last <= c_.num_layers)
      << "an activation block for layers [" << first << ", " << last << ") of " << c_.num_layers;
  auto b = std::make_unique<Qwen3Block>();
  b->first = first;
  b->last = last;
  Qwen3Stash shape;  // the views are thrown away: only the sizes count
  shape.batch = batch;
  shape.seq = seq;
  shape.layers.resize(c_.num_layers);
  b->arena = Arena::counting("activations", device_);
  allocate_layers(shape, b->arena, first, last);
  b->bytes = b->arena.peak();
  if (plan_only_) return b;
  b->arena = Arena("activations", device_, b->bytes);
  allocate_layers(shape, b->arena, first, last);
  for (LayerActs& x : shape.layers)  // no load-balance gradient until the trainer sets one
    if (x.dprobs.data != nullptr) mt::fill(x.dprobs, 0.0f);
  return b;
}

void Qwen3Moe::lend(Stash& base, ActivationBlock& block) {
  auto& s = static_cast<Qwen3Stash&>(base);
  auto& b = static_cast<Qwen3Block&>(block);
  // The same allocation sequence from the start of the block's arena: the same views.
  b.arena.reset();
  allocate_layers(s, b.arena, b.first, b.last);
}

void Qwen3Moe::embed_forward(Stash& base) {
  auto& s = static_cast<Qwen3Stash&>(base);
  embedding_forward(W(embed_), s.ids.view({s.batch * s.seq}), s.h[0]);
}

void Qwen3Moe::attention_forward_stage(int64_t l, Qwen3Stash& s) {
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const int64_t B = s.batch, S = s.seq, N = B * S, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  rmsnorm_forward(s.h[l], W(w.in_norm), eps, x.xn, x.rstd1);
  gemm(x.xn, C(w.q), x.q, false, true);
  gemm(x.xn, C(w.k), x.k, false, true);
  gemm(x.xn, C(w.v), x.v, false, true);
  // Qwen3 normalises each head of q and k before the rotation.
  rmsnorm_forward(x.q.view({N * Hq, Dh}), W(w.q_norm), eps, x.qn.view({N * Hq, Dh}), x.rstd_q);
  rmsnorm_forward(x.k.view({N * Hkv, Dh}), W(w.k_norm), eps, x.kn.view({N * Hkv, Dh}), x.rstd_k);
  rope_forward(x.qn.view({B, S, Hq, Dh}), s.cos, s.sin, false, x.qr.view({B, S, Hq, Dh}));
  rope_forward(x.kn.view({B, S, Hkv, Dh}), s.cos, s.sin, false, x.kr.view({B, S, Hkv, Dh}));
  if (cp_)
    parallel::ring_attention_forward(*cp_, x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}),
                                     x.v.view({B, S, Hkv, Dh}), Tensor(), attention_args(),
                                     x.att.view({B, S, Hq, Dh}), x.lse);
  else
    mt::attention_forward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}),
                          Tensor(), attention_args(), x.att.view({B, S, Hq, Dh}), x.lse);
  // hm = h + att @ Wo^T: the residual, then the output projection accumulated onto it.
  mt::copy(x.hm, s.h[l]);
  gemm(x.att, C(w.o), x.hm, false, true, 1.0f, 1.0f);
  rmsnorm_forward(x.hm, W(w.post_norm), eps, x.y, x.rstd2);
  if (c_.is_moe_layer(l)) {
    gemm(x.y, C(w.router), x.logits, false, true);
    mt::router_forward(router_config(), x.logits, x.idx, x.weight, x.probs);
    mt::router_prob_sum(x.probs, x.prob_sum);
    if (balanced_) {
      mt::copy(x.idx, s.balanced_idx);
      mt::fill(x.weight, 1.0f / static_cast<float>(c_.top_k));
    }
    // The expert plan waits for the router, not for what a schedule queues after it.
    if (ep_) x.routed = parallel::mark_routed(x.idx);
  }
}

void Qwen3Moe::finish_exchange(LayerActs& x) const {
  switch (x.exchange.kind) {
    case parallel::EpExchange::Kind::none:
      break;
    case parallel::EpExchange::Kind::dispatch_forward:
      parallel::ep_dispatch_forward_finish(x.exchange, x.plan, routed(x).xs);
      break;
    case parallel::EpExchange::Kind::combine_forward:
      parallel::ep_combine_forward_finish(x.exchange, x.plan, x.weight, x.mo);
      break;
    case parallel::EpExchange::Kind::combine_backward:
      parallel::ep_combine_backward_finish(x.exchange, x.plan, routed(x).d_ys);
      break;
    case parallel::EpExchange::Kind::dispatch_backward:
      parallel::ep_dispatch_backward_finish(x.exchange, x.plan, x.d_y);
      break;
  }
}

void Qwen3Moe::stage_forward(int64_t l, Stage stage, Stash& base) {
  MT_CHECK(l >= 0 && l < c_.num_layers && held_[l]) << "forward of layer " << l << ", which is not built here";
  auto& s = static_cast<Qwen3Stash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.is_moe_layer(l);
  // A stage after an exchange reads its results: one a schedule has not finished yet is
  // finished here (correct, only without the overlap).
  finish_exchange(x);
  switch (stage) {
    case Stage::attention:
      attention_forward_stage(l, s);
      break;
    case Stage::dispatch:
      if (moe && ep_) {
        // The experts see the ep ranks' micro-batches end to end: the capacity is theirs.
        x.plan =
            parallel::ep_plan(*ep_, x.idx, c_.num_experts, capacity(s.batch * s.seq * ep_->size()), x.routed);
        x.dropped = x.plan.dropped;
        mt::copy(x.counts, x.plan.expert_counts);
        x.exchange = parallel::ep_dispatch_forward_start(*ep_, x.plan, x.y);
      } else if (moe) {
        x.dropped = mt::dispatch_plan(x.idx, c_.num_experts, capacity(s.batch * s.seq), x.counts, x.offsets,
                                      x.order, x.slot_row);
        mt::dispatch_forward(x.y, x.order, c_.top_k, routed(x).xs);
      }
      break;
    case Stage::experts:
      if (moe) {
        Routed r = routed(x);
        grouped_gemm(r.xs, C(w.gate_up), Tensor(), r.offsets, r.gu);
        swiglu_forward(r.gu, r.hs);
        grouped_gemm(r.hs, C(w.down), Tensor(), r.offsets, r.ys);
      } else {
        gemm(x.y, C(w.gate_up), x.gu, false, true);
        swiglu_forward(x.gu, x.hs);
        gemm(x.hs, C(w.down), x.mo, false, true);
      }
      break;
    case Stage::combine:
      if (moe && ep_)
        x.exchange =
            parallel::ep_combine_forward_start(*ep_, x.plan, routed(x).ys, x.back.rows(0, x.plan.returned_rows()));
      else if (moe)
        mt::combine_forward(routed(x).ys, x.weight, x.slot_row, x.mo);
      break;
    case Stage::aggregate:
      mt::add(x.hm, x.mo, s.h[l + 1]);
      break;
  }
}

void Qwen3Moe::attention_backward_input(int64_t l, Qwen3Stash& s) {
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const int64_t B = s.batch, S = s.seq, N = B * S, Dh = c_.head_dim, Hq = c_.num_heads, Hkv = c_.num_kv_heads;
  if (c_.is_moe_layer(l)) {
    // Router: every token's probability row gets the load-balance gradient (x.dprobs,
    // uploaded by set_router_prob_grad).
    // Forced routing does not come from the logits: only the balance term reaches them.
    if (balanced_) mt::fill(x.d_weight, 0.0f);
    mt::router_backward(router_config(), x.logits, x.idx, x.weight, x.probs, x.d_weight, x.dprobs, x.d_logits);
    if (x.d_logits_c.data != x.d_logits.data) mt::cast(x.d_logits, x.d_logits_c);
    gemm(x.d_logits_c, C(w.router), x.d_y, false, false, 1.0f, 1.0f);
  }
  // d_hm = dh[l+1] (the residual) + the post-attention norm's input gradient.
  // The norms' weight gradients are taken here, with their input gradients, not in W:
  // their dy buffers are shared by every layer (allocate), and the pass is one.
  rmsnorm_backward(x.hm, W(w.post_norm), x.rstd2, x.d_y, x.d_hm, Z(w.post_norm));
  mt::add(x.d_hm, s.dh[l + 1], x.d_hm);
  gemm(x.d_hm, C(w.o), x.d_att, false, false);
  if (cp_)
    parallel::ring_attention_backward(*cp_, x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}),
                                      x.v.view({B, S, Hkv, Dh}), Tensor(), attention_args(),
                                      x.att.view({B, S, Hq, Dh}), x.lse, x.d_att.view({B, S, Hq, Dh}),
                                      x.d_qr.view({B, S, Hq, Dh}), x.d_kr.view({B, S, Hkv, Dh}),
                                      x.d_v.view({B, S, Hkv, Dh}), Tensor());
  else
    mt::attention_backward(x.qr.view({B, S, Hq, Dh}), x.kr.view({B, S, Hkv, Dh}), x.v.view({B, S, Hkv, Dh}),
                           Tensor(), attention_args(), x.att.view({B, S, Hq, Dh}), x.lse, x.d_att.view({B, S, Hq, Dh}),
                           x.d_qr.view({B, S, Hq, Dh}), x.d_kr.view({B, S, Hkv, Dh}), x.d_v.view({B, S, Hkv, Dh}),
                           Tensor());
  rope_backward(x.d_qr.view({B, S, Hq, Dh}), s.cos, s.sin, false, x.d_qn.view({B, S, Hq, Dh}));
  rope_backward(x.d_kr.view({B, S, Hkv, Dh}), s.cos, s.sin, false, x.d_kn.view({B, S, Hkv, Dh}));
  rmsnorm_backward(x.q.view({N * Hq, Dh}), W(w.q_norm), x.rstd_q, x.d_qn.view({N * Hq, Dh}),
                   x.d_q.view({N * Hq, Dh}), Z(w.q_norm));
  rmsnorm_backward(x.k.view({N * Hkv, Dh}), W(w.k_norm), x.rstd_k, x.d_kn.view({N * Hkv, Dh}),
                   x.d_k.view({N * Hkv, Dh}), Z(w.k_norm));
  gemm(x.d_q, C(w.q), x.d_xn, false, false);
  gemm(x.d_k, C(w.k), x.d_xn, false, false, 1.0f, 1.0f);
  gemm(x.d_v, C(w.v), x.d_xn, false, false, 1.0f, 1.0f);
  rmsnorm_backward(s.h[l], W(w.in_norm), x.rstd1, x.d_xn, s.dh[l], Z(w.in_norm));
  mt::add(s.dh[l], x.d_hm, s.dh[l]);
}

void Qwen3Moe::attention_backward_weight(int64_t l, Qwen3Stash& s) {
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  if (c_.is_moe_layer(l)) gemm(x.d_logits_c, x.y, G(w.router), true, false, 1.0f, beta(w.router));
  gemm(x.d_hm, x.att, G(w.o), true, false, 1.0f, beta(w.o));
  gemm(x.d_q, x.xn, G(w.q), true, false, 1.0f, beta(w.q));
  gemm(x.d_k, x.xn, G(w.k), true, false, 1.0f, beta(w.k));
  gemm(x.d_v, x.xn, G(w.v), true, false, 1.0f, beta(w.v));
}

void Qwen3Moe::stage_backward_input(int64_t l, Stage stage, Stash& base) {
  auto& s = static_cast<Qwen3Stash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.is_moe_layer(l);
  const Tensor& d_mo = s.dh[l + 1];  // aggregate: h[l+1] = hm + mo, so d_mo = d_hm = dh[l+1]
  finish_exchange(x);  // as in stage_forward
  switch (stage) {
    case Stage::aggregate:
      break;
    case Stage::combine:
      if (moe && ep_)
        x.exchange = parallel::ep_combine_backward_start(*ep_, x.plan, x.back.rows(0, x.plan.returned_rows()),
                                                         x.weight, d_mo, x.d_weight);
      else if (moe)
        mt::combine_backward(routed(x).ys, x.weight, x.slot_row, d_mo, routed(x).d_ys, x.d_weight);
      break;
    case Stage::experts:
      if (moe) {
        Routed r = routed(x);
        grouped_gemm_backward_input(r.d_ys, C(w.down), r.offsets, r.d_hs);
        swiglu_backward(r.gu, r.d_hs, r.d_gu);
        grouped_gemm_backward_input(r.d_gu, C(w.gate_up), r.offsets, r.d_xs);
      } else {
        gemm(d_mo, C(w.down), x.d_hs, false, false);
        swiglu_backward(x.gu, x.d_hs, x.d_gu);
        gemm(x.d_gu, C(w.gate_up), x.d_y, false, false);
      }
      break;
    case Stage::dispatch:
      if (moe && ep_)
        x.exchange = parallel::ep_dispatch_backward_start(*ep_, x.plan, routed(x).d_xs);
      else if (moe)
        mt::dispatch_backward(routed(x).d_xs, x.slot_row, x.d_y);
      break;
    case Stage::attention:
      attention_backward_input(l, s);
      break;
  }
}

void Qwen3Moe::stage_backward_weight(int64_t l, Stage stage, Stash& base) {
  auto& s = static_cast<Qwen3Stash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.is_moe_layer(l);
  switch (stage) {
    case Stage::experts:
      if (moe) {
        Routed r = routed(x);
        grouped_gemm_backward_weight(r.hs, r.d_ys, r.offsets, G(w.down), Tensor(), !start_grad(w.down));
        grouped_gemm_backward_weight(r.xs, r.d_gu, r.offsets, G(w.gate_up), Tensor(), !start_grad(w.gate_up));
      } else {
        gemm(s.dh[l + 1], x.hs, G(w.down), true, false, 1.0f, beta(w.down));
        gemm(x.d_gu, x.y, G(w.gate_up), true, false, 1.0f, beta(w.gate_up));
      }
      break;
    case Stage::attention:
      attention_backward_weight(l, s);
      break;
    case Stage::dispatch:
    case Stage::combine:
    case Stage::aggregate:
      break;  // no parameters
  }
}

LossSum Qwen3Moe::head_forward(Stash& base) {
  auto& s = static_cast<Qwen3Stash&>(base);
  const int64_t N = s.batch * s.seq;
  rmsnorm_forward(s.h[c_.num_layers], W(final_norm_), static_cast<float>(c_.rms_norm_eps), s.hf, s.rstd_f);
  gemm(s.hf, C(lm_head_ >= 0 ? lm_head_ : embed_), s.logits, false, true);
  cpu::CrossEntropySum ce = cross_entropy_forward(s.logits, s.labels.view({N}), kIgnoreIndex, s.lse);
  s.loss = {ce.loss_sum, ce.count};
  return s.loss;
}

void Qwen3Moe::head_backward_input(Stash& base, float scale) {
  auto& s = static_cast<Qwen3Stash&>(base);
  const int64_t N = s.batch * s.seq;
  // In place: from here on s.logits holds d(loss)/d(logits), which the W half reads.
  cross_entropy_backward(s.logits, s.labels.view({N}), s.lse, kIgnoreIndex, scale, s.logits);
  gemm(s.logits, C(lm_head_ >= 0 ? lm_head_ : embed_), s.d_hf, false, false);
  rmsnorm_backward(s.h[c_.num_layers], W(final_norm_), s.rstd_f, s.d_hf, s.dh[c_.num_layers], Z(final_norm_));
}

void Qwen3Moe::head_backward_weight(Stash& base) {
  auto& s = static_cast<Qwen3Stash&>(base);
  const int out = lm_head_ >= 0 ? lm_head_ : embed_;
  gemm(s.logits, s.hf, G(out), true, false, 1.0f, beta(out));
}

void Qwen3Moe::embed_backward(Stash& base) {
  auto& s = static_cast<Qwen3Stash&>(base);
  // Tied, the head's W may have started this gradient already: Z then adds to it.
  embedding_backward(s.ids.view({s.batch * s.seq}), s.dh[0], Z(embed_));
}

std::vector<RouterStats> Qwen3Moe::router_stats(const Stash& base) const {
  const auto& s = static_cast<const Qwen3Stash&>(base);
  std::vector<RouterStats> out;
  const int64_t N = s.batch * s.seq, E = c_.num_experts;
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l] || !c_.is_moe_layer(l)) continue;
    const LayerActs& x = s.layers[l];
    RouterStats r;
    r.layer = l;
    r.tokens = N;
    r.top_k = c_.top_k;
    r.dropped = x.dropped;
    // The probabilities summed where they were made (router_prob_sum) and the slots each
    // expert kept, counted by the dispatch plan: one copy of both to the host.
    std::vector<int32_t> stats(static_cast<size_t>(2 * E));
    mt::copy(Tensor(stats.data(), {2, E}, DType::i32), x.stats);
    std::vector<float> sums(static_cast<size_t>(E));
    std::memcpy(sums.data(), stats.data(), sums.size() * sizeof(float));
    r.prob_sum.assign(sums.begin(), sums.end());
    r.counts.assign(stats.begin() + E, stats.end());
    out.push_back(std::move(r));
  }
  return out;
}

void Qwen3Moe::set_router_prob_grad(Stash& base, int64_t layer, const std::vector<float>& dprob) {
  auto& s = static_cast<Qwen3Stash&>(base);
  MT_CHECK(held_[layer] && c_.is_moe_layer(layer) && static_cast<int64_t>(dprob.size()) == c_.num_experts)
      << "load-balance gradient for layer " << layer << " with " << dprob.size() << " experts";
  // Uploaded now, between the forward and the backward, where the trainer has waited
  // for the device anyway (router statistics), rather than as a stall inside the backward.
  mt::copy(s.layers[layer].dprobs, Tensor(const_cast<float*>(dprob.data()), {1, c_.num_experts}, DType::f32));
}

}  // namespace

std::unique_ptr<Model> make_qwen3_moe(const Qwen3MoeConfig& cfg, const ModelOptions& options) {
  return std::make_unique<Qwen3Moe>(cfg, options);
}

}  // namespace mt
