#include "models/decoder.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "kernels/cross_entropy.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "models/expert_cache.h"
#include "models/expert_replicas.h"
#include "kernels/rmsnorm.h"
#include "kernels/swiglu.h"
#include "parallel/buffer.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"

#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/device.h"
#endif

namespace mt {

void Attend::forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                     const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse) const {
  if (cp) return parallel::ring_attention_forward(*cp, q, k, v, sinks, a, out, lse);
  mt::attention_forward(q, k, v, sinks, a, out, lse);
}

void Attend::backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks,
                      const cpu::AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                      const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dsinks) const {
  if (cp) return parallel::ring_attention_backward(*cp, q, k, v, sinks, a, out, lse, dout, dq, dk, dv, dsinks);
  mt::attention_backward(q, k, v, sinks, a, out, lse, dout, dq, dk, dv, dsinks);
}

int add_param(std::vector<Param>& params, std::string name, Shape shape, bool expert) {
  Param p;
  p.name = std::move(name);
  p.value = Tensor(nullptr, shape, DType::f32);
  p.matrix = shape.n >= 2;
  p.expert = expert;
  params.push_back(std::move(p));
  return static_cast<int>(params.size()) - 1;
}

static bool start_grad(Param& p) {
  const bool first = !p.grad_started;
  p.grad_started = true;
  return first;
}

float grad_beta(Param& p) { return start_grad(p) ? 0.0f : 1.0f; }

const Tensor& grad_zeroed(Param& p) {
  if (start_grad(p)) mt::fill(p.grad, 0.0f);
  return p.grad;
}

HfTensor hf_tensor(std::string name, const Param& p, float init_scale, float fill) {
  HfTensor t;
  t.name = std::move(name);
  t.value = p.value;
  t.grad = p.grad;
  t.init_scale = init_scale;
  t.fill = fill;
  return t;
}

HfTensor hf_slice(std::string name, const Param& p, int64_t e, int64_t r0, int64_t r1, float init_scale,
                  bool expert) {
  auto slice = [&](const Tensor& t) {
    Tensor block = t.ndim() == 3 ? t.rows(e, e + 1).view({t.dim(1), t.dim(2)}) : t;
    return block.rows(r0, r1);
  };
  HfTensor t = hf_tensor(std::move(name), p, init_scale);
  t.value = slice(p.value);
  t.grad = slice(p.grad);
  t.expert = expert;
  return t;
}

namespace {

// Every kernel call below goes through the family headers' mt:: dispatchers, which
// pick the backend by the tensors' device. Calls that take a cpu:: struct are written
// mt::f(...): argument-dependent lookup would also find cpu::f.

constexpr int32_t kIgnoreIndex = -100;
constexpr float kSwigluAlpha = 1.702f;  // GPT-OSS's clamped SwiGLU: gate * sigmoid(alpha * gate)

// Where each layer's shared parameters sit in params_ (indices, so the vector may grow).
struct LayerIndex {
  int in_norm, post_norm;
  int router = -1;    // MoE layers: [E, D]
  int gate_up, down;  // MoE: [E, 2I, D] and [E, D, I]; dense: [2I, D] and [D, I]
  int shared_gate_up = -1, shared_down = -1;  // shared experts: [2Is, D], [D, Is]
  int router_bias = -1, gate_up_bias = -1, down_bias = -1;  // GPT-OSS: [E], [E, 2I], [E, D]
};

// The per-row tensors of a MoE layer's experts (LayerActs::held), sized by the rows its
// routing brings here and held only while the layer needs them (Decoder::row_lives).
enum Row : uint8_t { kXs, kGu, kHs, kYs, kDYs, kDGu, kDHs, kDXs, kRowTensors };
enum class Pass : uint8_t { forward, backward_input, backward_weight };
constexpr int64_t kRowRounding = 128;  // rows are taken in multiples of this
// With full recomputation the LM head and the cross-entropy run over chunks of this many
// tokens, so a stash holds [kHeadRows, vocab] logits, not [tokens, vocab] (Liger-Kernel's
// fused linear cross-entropy does the same): past one chunk, the head's B computes each
// chunk's logits again and its weight gradient with them, and its W has nothing left to
// do. Not by default: on the H200 it cost 8% of the 8-layer benchmark's tokens/s (the
// logits' product again, and a host wait a chunk) for 2.2 GB (bench/RESULTS.md).
constexpr int64_t kHeadRows = 1024;

// What the expert rows hold, counted (RowMemory), against a budget: the environment's
// MOETRAIN_ROW_POOL_BYTES where set (the hook the pool-exhaustion test uses), else
// ModelOptions::row_memory_limit where set, else the device's memory as the allocator
// finds it. In a plan the rows are only counted.
struct RowPool {
  bool counting = false;
  size_t in_use = 0, peak = 0, limit = std::numeric_limits<size_t>::max();
  std::string limit_key;  // what set the limit
  double skew = 0;
};

// Activations of one layer for one micro-batch, and the gradients its W stages need.
// N = batch * seq tokens, R = the routed rows this rank's experts got (N * top_k without
// expert parallelism or a capacity).
struct LayerActs {
  std::unique_ptr<AttentionActs> attn;  // the model's attention
  Tensor xn, rstd1;             // input norm [N,D], [N]
  Tensor hm, y, rstd2;          // residual after attention, its norm
  Tensor logits, idx, weight, probs, dprobs;        // router (f32)
  Tensor lse;  // [N] logsumexp of the router's logits (the z-loss's backward reads it)
  // prob_sum f32 [E] (probs summed over tokens), counts i32 [E] (slots each expert kept)
  // and z_sum f32 [1] (the router z-loss's sum, when on) side by side in `stats`, so the
  // metrics read them in one copy; with sequence_balance also per stash row, seq_prob_sum
  // f32 [B,E] and seq_counts i32 [B,E] (the router's choices).
  Tensor stats, prob_sum, counts, z_sum, seq_prob_sum, seq_counts;
  // With expert replicas: the slots [N,k] the router's choices go to, and the rows each
  // slot got [ep * S] (in `stats` too; router_stats turns them into counts).
  Tensor slots, slot_counts;
  Tensor offsets, order, slot_row;                  // dispatch plan (without expert parallelism)
  int64_t dropped = 0;                              // slots over capacity
  Tensor xs, gu, hs, ys, mo;    // expert (or dense MLP) path
  Tensor sgu, shs, so;          // shared experts: [N, 2Is], [N, Is], output [N, D]
  // MoE layers: the rows R this micro-batch brought to this rank's experts, and the
  // row tensors held now (xs .. d_xs are views of them, R rounded up to kRowRounding).
  int64_t rows = 0;
  std::array<parallel::Buffer, kRowTensors> held;
  bool recomputing = false;  // full recomputation: the forward again, before the backward
  // offload.experts = weights: the experts' row offsets in host memory, read at the
  // forward, so that the expert cache's lines run over their windows of the rows.
  std::vector<int32_t> host_offsets;
  // Expert parallelism: the exchange plan, `back`, every slot's expert output returned
  // to this rank [N*k, D], and the exchange a dispatch or combine stage started, until
  // its finish.
  parallel::RoutedMark routed;  // where the router's idx is complete
  parallel::EpPlan plan;
  Tensor back;
  parallel::EpExchange exchange;
  // Gradients. d_logits is f32 like the router; d_logits_c is what the matrix products
  // read (a bf16 copy on the GPU, d_logits itself on the CPU).
  Tensor d_ys, d_weight, d_hs, d_gu, d_xs, d_y, d_logits, d_logits_c, d_hm, d_xn, d_sgu, d_shs;
};

struct DecoderBlock : ActivationBlock {
  Arena arena;
};

struct DecoderStash : Stash {
  Arena arena;
  std::vector<int32_t> positions_host;
  Tensor cos, sin;
  Tensor all_rows;                   // i32 {0, N} (AttentionIo::all_rows)
  Tensor balanced_idx;               // force_balanced_routing: the fixed expert choice
  std::vector<LayerActs> layers;
  Tensor hf, rstd_f, logits, lse, d_hf;  // head
  float logits_grad_scale = 0;  // > 0: head_forward left d(loss)/d(logits) in place, at this scale
  LossSum loss;
};

class Decoder final : public Model {
 public:
  Decoder(const DecoderSpec& c, std::unique_ptr<Attention> attention, const ModelOptions& o)
      : c_(c), k_(c.router.top_k), attention_(std::move(attention)), device_(o.device),
        balanced_(o.force_balanced_routing), sequence_balance_(o.sequence_balance), plan_only_(o.plan_only), external_layers_(o.external_layers),
        capacity_factor_(o.capacity_factor), routing_skew_(o.routing_skew), recompute_(o.recompute),
        offload_experts_(o.offload_experts), offload_layers_(o.offload_layers),
        offload_weights_(o.offload_experts && o.offload_weights), expert_slots_(o.expert_slots),
        expert_line_(o.expert_line), expert_replicas_(o.ep != nullptr && o.ep->size() > 1 ? o.expert_replicas : 0),
        ep_(o.ep),
        act_(o.device == Device::cuda ? DType::bf16 : DType::f32), embedding_(o.embedding), head_(o.head),
        linear_(o.fp8, o.fp8_pow2), pool_(std::make_shared<RowPool>()) {
    MT_CHECK(routing_skew_ >= 1.0) << "a routing skew of " << routing_skew_
                                   << ": the hottest rank gets at least the mean share of rows (>= 1)";
    pool_->counting = plan_only_;
    if (o.row_memory_limit > 0) {
      pool_->limit = o.row_memory_limit;
      pool_->limit_key = "training.device_memory_limit, less the arenas";
    }
    if (const char* limit = std::getenv("MOETRAIN_ROW_POOL_BYTES")) {
      pool_->limit = std::strtoull(limit, nullptr, 10);
      pool_->limit_key = "MOETRAIN_ROW_POOL_BYTES";
    }
    MT_CHECK(!linear_.fp8() || !o.external_layers)
        << "training.fp8 = blockwise with parallelism.zero3 is not built yet (the weight slots gather bf16 copies, "
           "not FP8 ones)";
    attend_.cp = o.cp != nullptr && o.cp->size() > 1 ? o.cp : nullptr;
    held_.assign(static_cast<size_t>(c.num_layers), o.layers.empty());
    for (int64_t l : o.layers) {
      MT_CHECK(l >= 0 && l < c.num_layers) << "model built for layer " << l << " of " << c.num_layers;
      held_[l] = true;
    }
    MT_CHECK(!c.tie_word_embeddings || embedding_ == head_)
        << "tie_word_embeddings: the embedding and the head share a weight, so they must be on one pipeline rank "
        << "(parallelism.pipeline_schedule = dualpipev places both on rank 0)";
    if (expert_replicas_ > 0) {
      const char* with = o.external_layers ? "parallelism.zero3" : linear_.fp8() ? "training.fp8 = blockwise"
                         : o.offload_experts ? "offload.experts" : capacity_factor_ > 0 ? "training.capacity_factor" : nullptr;
      MT_CHECK(with == nullptr) << "parallelism.expert_replicas = " << expert_replicas_ << " with " << with
                                << " is not built yet (replicas are built for dropless bf16 experts held whole on "
                                   "the device, with ZeRO-1/2 sharding)";
    }
    build_params();
    lives_ = row_lives();  // ep_ and the mode are settled: the table is the same every stage
  }

  Device device() const override { return device_; }
  size_t expert_cache_bytes() const override { return cache_.bytes(); }
  ExpertCacheStats expert_cache_traffic(int64_t micro_batches, int64_t sweep) const override {
    return cache_.planned_traffic(micro_batches, sweep);
  }
  ExpertCacheStats flush_expert_cache() override { return cache_.flush(); }
  ExpertReplicas* expert_replicas() override { return replicas_.on() ? &replicas_ : nullptr; }
  size_t expert_replica_bytes() const override { return replica_bytes_; }
  ExpertCacheStats expert_cache_stats() override { return cache_.stats(); }
  bool balanced_routing() const override { return balanced_; }
  int64_t num_layers() const override { return c_.num_layers; }
  bool is_moe_layer(int64_t layer) const override { return c_.moe[layer]; }
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
    for (const Param& p : params_) n += p.expert ? p.value.numel() / local_experts_ * k_ : p.value.numel();
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
  LossSum head_forward(Stash& s, float grad_scale) override;
  void head_backward_input(Stash& s, float scale) override;
  void head_backward_weight(Stash& s) override;
  void embed_backward(Stash& s) override;
  // The last chunk's: every token's where the micro-batch fits in one.
  Tensor logits(Stash& s) override {
    auto& d = static_cast<DecoderStash&>(s);
    const int64_t n = d.batch * d.seq, c = head_rows(n), last = n - (n - 1) / c * c;
    return d.logits.rows(0, last);
  }
  std::vector<RouterStats> router_stats(const Stash& s) const override;
  void set_router_prob_grad(Stash& s, int64_t layer, const std::vector<float>& dprob) override;
  void set_router_z_loss(double scale) override { z_scale_ = scale; }
  void set_expert_bias(int64_t layer, const std::vector<float>& bias) override;
  RowMemory row_memory() const override { return {pool_->peak, pool_->skew}; }
  void reset_row_memory() override {
    pool_->peak = pool_->in_use;
    pool_->skew = 0;
  }

 private:
  void build_params();
  void allocate_bare(DecoderStash& s, Arena& a) const;
  void allocate_layers(DecoderStash& s, Arena& a, int64_t first, int64_t last) const;
  const Tensor& W(int i) const { return params_[i].value; }    // f32 master (norms, embedding)
  const Tensor& C(int i) const { return params_[i].compute; }  // read by matrix products
  const Tensor& G(int i) const { return params_[i].grad; }
  // Gradient writes: a Param's first write of the step replaces its gradient and later
  // ones add (Param::grad_started), whatever order the schedule runs micro-batches in.
  float beta(int i) { return grad_beta(params_[i]); }
  const Tensor& Z(int i) { return grad_zeroed(params_[i]); }
  bool start(int i) { return start_grad(params_[i]); }
  // A bias Param's value or gradient (a grouped GEMM's), empty for none (index -1).
  Tensor bias(int i) { return i >= 0 ? X(i).value : Tensor(); }
  Tensor grad_of(int i) { return i >= 0 ? X(i).grad : Tensor(); }
  // An expert Param as the grouped products see it: with replicas all S blocks, the
  // replicas' after its own (models/expert_replicas.h).
  Param& X(int i) { return replicas_.on() && params_[i].expert ? replicas_.wide(i) : params_[i]; }
  AttentionIo io(DecoderStash& s, LayerActs& x) const {
    return {s.batch, s.seq, s.cos, s.sin, x.xn, x.hm, x.d_hm, x.d_xn, &attend_, &linear_, s.all_rows};
  }
  // The expert path of a MoE layer for this micro-batch: the R rows its routing brought
  // to this rank's experts (every routed row, the first R under a capacity, or with
  // expert parallelism what the exchange brought), of the row tensors held now.
  struct Routed {
    Tensor xs, gu, hs, ys, d_ys, d_hs, d_gu, d_xs, offsets;
  };
  Routed routed(LayerActs& x) const {
    auto rows = [&](const Tensor& t) { return t.data != nullptr ? t.rows(0, x.rows) : Tensor(); };
    return {rows(x.xs),   rows(x.gu),   rows(x.hs),   rows(x.ys), rows(x.d_ys),
            rows(x.d_hs), rows(x.d_gu), rows(x.d_xs), ep_ ? x.plan.offsets : x.offsets};
  }
  // When a row tensor is taken and given back, and its width (a tensor may live twice:
  // recomputed in between).
  struct RowLife {
    Row row;
    Stage take_stage;
    Pass take_pass;
    Stage give_stage;
    Pass give_pass;
    int64_t width;
  };
  std::vector<RowLife> row_lives() const;
  std::vector<RowLife> lives_;  // row_lives(), made once
  static Tensor& row_view(LayerActs& x, Row r);
  // Tokens a chunk of the head's work (kHeadRows).
  int64_t head_rows(int64_t tokens) const {
    return recompute_ == Recompute::full ? std::min(tokens, kHeadRows) : tokens;
  }
  // The experts' activation (clamped for GPT-OSS): hs = swiglu(gu).
  void swiglu_out(const Tensor& gu, const Tensor& hs) const {
    if (c_.swiglu_limit > 0)
      clamped_swiglu_forward(gu, c_.swiglu_limit, kSwigluAlpha, hs);
    else
      swiglu_forward(gu, hs);
  }
  // Its input gradient: d_gu from d_hs.
  void swiglu_in(const Tensor& gu, const Tensor& d_hs, const Tensor& d_gu) const {
    if (c_.swiglu_limit > 0)
      clamped_swiglu_backward(gu, c_.swiglu_limit, kSwigluAlpha, d_hs, d_gu);
    else
      swiglu_backward(gu, d_hs, d_gu);
  }
  // The rows this rank's experts get in a plan: routing_skew times the balanced share,
  // within what the exchange (or a capacity) can bring.
  int64_t planned_rows(int64_t tokens) const;
  // Takes the row tensors that (stage, pass) starts with, and gives back those it ends.
  void take_rows(int64_t l, LayerActs& x, Stage stage, Pass pass, int64_t tokens);
  void give_rows(LayerActs& x, Stage stage, Pass pass);
  // A plan's stage: only the rows it would take and give back.
  void plan_rows(int64_t l, Stage stage, Pass pass, LayerActs& x, int64_t tokens);
  // The rows a forward stage ends with given back: with full recomputation the first
  // forward keeps none past its combine (the backward's recompute takes them again).
  void end_forward_rows(LayerActs& x, Stage stage);
  // Full recomputation: layer l's forward again (all but the aggregate, whose output
  // h[l+1] is the next layer's input and kept), exchanges finished at once.
  void recompute_layer(int64_t l, Stash& s);
  static LayerActs& layer_acts(Stash& s, int64_t l) { return static_cast<DecoderStash&>(s).layers[l]; }
  // Finishes the expert-parallel exchange layer x has in flight, whichever it is.
  void finish_exchange(LayerActs& x) const;
  // Rows each expert keeps of a micro-batch of n tokens (0: all).
  int64_t capacity(int64_t n) const {
    if (capacity_factor_ <= 0.0) return 0;
    const double fair = static_cast<double>(n * k_) / static_cast<double>(c_.num_experts);
    return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(capacity_factor_ * fair)));
  }
  void attention_forward(int64_t l, DecoderStash& s);
  void attention_backward_input(int64_t l, DecoderStash& s);
  // offload.experts = weights: layer l's routed experts' pass, line by line from the
  // expert cache (models/expert_cache.h).
  void cached_experts(int64_t l, LayerActs& x, Pass pass);

  DecoderSpec c_;
  int64_t k_;  // experts a token goes to
  std::unique_ptr<Attention> attention_;
  Attend attend_;
  Device device_;
  bool balanced_;
  bool sequence_balance_;  // router statistics per sequence too
  bool plan_only_;
  bool external_layers_;  // ZeRO-3: the decoder layers' Params have no storage here
  double capacity_factor_;  // 0: dropless
  double routing_skew_;     // plan_only: the rows a MoE layer brings here, over the balanced share
  Recompute recompute_;
  bool offload_experts_;  // the routed experts' master weights in host memory
  int64_t offload_layers_;  // of the first this many MoE layers held here (0: all)
  bool offload_weights_;    // their compute copies and gradients too, through cache_
  int64_t expert_slots_, expert_line_;
  ExpertCache cache_;
  int64_t expert_replicas_;  // R replica slots a rank (0: none)
  ExpertReplicas replicas_;
  size_t replica_bytes_ = 0;  // what their slots add to the arenas
  double z_scale_ = 0;        // the router z-loss's factor on its sum (0: off)
  // The routers' expert biases [E] per layer (empty until set_expert_bias), in bias_arena_.
  Arena bias_arena_;
  std::vector<Tensor> expert_bias_;
  comm::Communicator* ep_;  // null: every expert lives here
  int64_t local_experts_ = 0, first_expert_ = 0;
  DType act_;  // activations: bf16 on the GPU, f32 on the CPU
  std::vector<bool> held_;  // per layer: built on this rank (pipeline parallelism)
  bool embedding_, head_;
  Linear linear_;
  std::shared_ptr<RowPool> pool_;  // shared with the rows held, which give back into it
  std::vector<Param> params_;
  Arena values_, grads_, compute_, fp8_, host_values_;
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<LayerIndex> layer_;
  cpu::RopeFreqs rope_;
};

void Decoder::build_params() {
  const int64_t D = c_.hidden_size;
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
  auto add = [&](std::string name, Shape shape, bool expert = false) {
    return add_param(params_, std::move(name), shape, expert);
  };
  auto bias = [&](std::string name, Shape shape, bool expert) {  // f32, never decayed
    const int i = add(std::move(name), shape, expert);
    params_[i].matrix = false;
    return i;
  };
  if (embedding_) embed_ = add("embed", {c_.vocab_size, D});
  layer_.resize(static_cast<size_t>(c_.num_layers));
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    std::string p = "layers." + std::to_string(l) + ".";
    LayerIndex x{};
    x.in_norm = add(p + "input_norm", {D});
    attention_->add_params(l, p, params_);
    x.post_norm = add(p + "post_norm", {D});
    if (c_.moe[l]) {
      const int64_t I = c_.moe_intermediate_size, Is = c_.shared_intermediate_size;
      x.router = add(p + "router", {c_.num_experts, D});
      x.gate_up = add(p + "experts.gate_up", {E, 2 * I, D}, true);
      x.down = add(p + "experts.down", {E, D, I}, true);
      if (c_.gpt_oss_experts) {
        x.router_bias = bias(p + "router_bias", {c_.num_experts}, false);
        x.gate_up_bias = bias(p + "experts.gate_up_bias", {E, 2 * I}, true);
        x.down_bias = bias(p + "experts.down_bias", {E, D}, true);
      }
      if (Is > 0) {
        x.shared_gate_up = add(p + "shared.gate_up", {2 * Is, D});
        x.shared_down = add(p + "shared.down", {D, Is});
      }
    } else {
      const int64_t I = c_.intermediate_size;
      x.gate_up = add(p + "mlp.gate_up", {2 * I, D});
      x.down = add(p + "mlp.down", {D, I});
    }
    layer_[l] = x;
  }
  if (head_) final_norm_ = add("final_norm", {D});
  if (head_ && !c_.tie_word_embeddings) lm_head_ = add("lm_head", {c_.vocab_size, D});
  for (Param& p : params_) {
    if (p.name.starts_with("layers.")) p.layer = std::atoll(p.name.c_str() + 7);
    if (p.name == "final_norm" || p.name == "lm_head") p.layer = c_.num_layers;
  }

  // Two arenas, master weights and their gradients, and on the GPU
  // a third with the bf16 copies of the matrices that the products read. With external
  // layers, only the embedding's and the head's. With FP8, a fourth holds the linear
  // layers' weights quantized in both layouts (Param::fp8): a layer's matrices but its
  // router. Those need no bf16 copy (only the FP8 products read them): their compute is
  // the master itself, which they are quantized from, so the GPU's codes are the CPU's
  // for the same master weights.
  const bool copies = device_ == Device::cuda;
  auto held = [&](const Param& p) { return !external_layers_ || p.layer < 0 || p.layer >= c_.num_layers; };
  std::vector<bool> quantized(params_.size(), false);
  if (linear_.fp8()) {
    for (size_t i = 0; i < params_.size(); ++i)
      quantized[i] = params_[i].matrix && params_[i].layer >= 0 && params_[i].layer < c_.num_layers;
    for (int64_t l = 0; l < c_.num_layers; ++l)
      if (held_[l] && layer_[l].router >= 0) quantized[layer_[l].router] = false;
  }
  auto fp8_copy = [&](Arena& a, const Param& p) {
    const Shape t = p.value.ndim() == 3 ? Shape{p.value.dim(0), p.value.dim(2), p.value.dim(1)}
                                        : Shape{p.value.dim(1), p.value.dim(0)};
    return Fp8Copy{a.alloc(DType::f8e4m3, p.value.shape), a.alloc(DType::f32, fp8_block_scale_shape(p.value.shape, false)),
                   a.alloc(DType::f8e4m3, t), a.alloc(DType::f32, fp8_block_scale_shape(p.value.shape, true)),
                   linear_.pow2()};
  };
  // offload.experts: the routed experts' matrices (of the first offload.layers MoE
  // layers) keep their master weights in one more arena, in host memory; their compute
  // copies (on the CPU the master itself) and gradients stay here.
  std::vector<bool> offload(static_cast<size_t>(c_.num_layers), false);
  for (int64_t l = 0, moe = 0; l < c_.num_layers; ++l)
    if (held_[l] && c_.moe[l]) offload[l] = offload_experts_ && (offload_layers_ == 0 || moe++ < offload_layers_);
  for (Param& p : params_) {
    p.offloaded = held(p) && p.expert && p.matrix && offload[static_cast<size_t>(p.layer)];
    p.cached = p.offloaded && offload_weights_;
  }
  Arena count_v = Arena::counting("parameters", device_), count_g = Arena::counting("gradients", device_),
        count_c = Arena::counting("compute weights", device_), count_q = Arena::counting("fp8 weights", device_),
        count_h = Arena::counting("parameters (host)", Device::cpu);
  // parallelism.expert_replicas: an expert Param's storage is S blocks wide, the Param
  // its first E/ep (models/expert_replicas.h).
  if (expert_replicas_ > 0) replicas_ = ExpertReplicas(ep_, c_.num_experts, expert_replicas_, device_);
  auto storage = [&](const Param& p) {
    Shape s = p.value.shape;
    if (replicas_.on() && p.expert) s.d[0] = replicas_.slots();
    return s;
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (!held(p)) continue;
    (p.offloaded ? count_h : count_v).alloc(DType::f32, storage(p));
    (p.cached ? count_h : count_g).alloc(DType::f32, storage(p));
    if (copies && p.matrix && !quantized[i]) (p.cached ? count_h : count_c).alloc(DType::bf16, storage(p));
    if (quantized[i]) fp8_copy(count_q, p);
  }
  auto arena = [&](const char* name, size_t bytes) {
    return plan_only_ ? Arena::counting(name, device_) : Arena(name, device_, bytes);
  };
  values_ = arena("parameters", count_v.peak());
  grads_ = arena("gradients", count_g.peak());
  compute_ = arena("compute weights", count_c.peak());
  fp8_ = arena("fp8 weights", count_q.peak());
  host_values_ = plan_only_ ? Arena::counting("parameters (host)", Device::cpu)
                            : Arena::host("parameters (host)", count_h.peak(), device_ == Device::cuda);
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (!held(p)) {
      p.value = Tensor(nullptr, p.value.shape, DType::f32, device_);
      p.grad = p.value;
      p.compute = copies && p.matrix && !quantized[i] ? Tensor(nullptr, p.value.shape, DType::bf16, device_) : p.value;
      continue;
    }
    const int64_t blocks = p.value.ndim() > 0 ? p.value.dim(0) : 0;
    Param wide = p;
    wide.value = (p.offloaded ? host_values_ : values_).alloc(DType::f32, storage(p));
    wide.grad = (p.cached ? host_values_ : grads_).alloc(DType::f32, storage(p));
    wide.compute = copies && p.matrix && !quantized[i]
                       ? (p.cached ? host_values_ : compute_).alloc(DType::bf16, storage(p))
                       : wide.value;
    const bool widened = replicas_.on() && p.expert;
    if (widened)  // the R slots' share of the value, the gradient and a bf16 copy
      replica_bytes_ += (wide.value.nbytes() + wide.grad.nbytes() +
                         (wide.compute.dtype != wide.value.dtype ? wide.compute.nbytes() : 0)) /
                        static_cast<size_t>(replicas_.slots()) * static_cast<size_t>(expert_replicas_);
    auto own = [&](const Tensor& t) { return widened ? t.rows(0, blocks) : t; };
    p.value = own(wide.value);
    p.grad = own(wide.grad);
    p.compute = own(wide.compute);
    // In mapped host memory the device's kernels (the norm, AdamW) reach them in place.
    if (p.cached && copies) p.grad.device = p.compute.device = device_;
    if (quantized[i]) p.fp8 = fp8_copy(fp8_, p);
    if (widened && !plan_only_) replicas_.add(p.layer, static_cast<int>(i), wide);
    if (plan_only_) continue;
    mt::fill(wide.value, 0.0f);
    mt::fill(wide.grad, 0.0f);
  }
  if (!plan_only_) refresh_compute_weights(params_);
  rope_ = cpu::rope_freqs(c_.rope);
  if (!offload_weights_) return;
  std::vector<std::vector<int>> blocks(static_cast<size_t>(c_.num_layers));
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].cached) blocks[static_cast<size_t>(params_[i].layer)].push_back(static_cast<int>(i));
  cache_ = ExpertCache(params_, std::move(blocks), local_experts_, expert_slots_ > 0 ? expert_slots_ : 2 * local_experts_,
                       expert_line_, device_, plan_only_);
}

std::vector<HfTensor> Decoder::hf_tensors() {
  std::vector<HfTensor> out;
  const float out_scale = static_cast<float>(1.0 / std::sqrt(2.0 * static_cast<double>(c_.num_layers)));
  // An MLP's gate_proj, up_proj and down_proj from its fused gate_up and down (block e).
  auto mlp = [&](const std::string& q, int gate_up, int down, int64_t e, bool expert) {
    const Param &gu = params_[gate_up], &dn = params_[down];
    const int64_t I = gu.value.dim(gu.value.ndim() - 2) / 2;
    out.push_back(hf_slice(q + "gate_proj.weight", gu, e, 0, I, 1.0f, expert));
    out.push_back(hf_slice(q + "up_proj.weight", gu, e, I, 2 * I, 1.0f, expert));
    out.push_back(hf_slice(q + "down_proj.weight", dn, e, 0, c_.hidden_size, out_scale, expert));
  };
  if (embedding_) out.push_back(hf_tensor("model.embed_tokens.weight", params_[embed_]));
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    const LayerIndex& x = layer_[l];
    std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back(hf_tensor(p + "input_layernorm.weight", params_[x.in_norm], 0.0f, 1.0f));
    attention_->hf_tensors(l, p + "self_attn.", params_, out_scale, out);
    out.push_back(hf_tensor(p + "post_attention_layernorm.weight", params_[x.post_norm], 0.0f, 1.0f));
    if (c_.moe[l] && c_.gpt_oss_experts) {
      out.push_back(hf_tensor(p + "mlp.router.weight", params_[x.router]));
      out.push_back(hf_tensor(p + "mlp.router.bias", params_[x.router_bias], 0.0f, 0.0f));
      // Each expert's slice of the layer's [E, in, out] (and [E, out]) keys.
      for (int64_t e = 0; e < local_experts_; ++e) {
        const int64_t g = first_expert_ + e;
        const std::string q = p + "mlp.experts.";
        auto add = [&](const char* key, int i, float scale, bool transposed) {
          const Param& w = params_[i];
          auto expert = [&](const Tensor& all) {  // block e of [E, ...], without its leading 1
            Shape one = all.shape;
            one.n -= 1;
            std::copy(all.shape.d.begin() + 1, all.shape.d.end(), one.d.begin());
            return all.rows(e, e + 1).view(one);
          };
          HfTensor t = hf_tensor(q + std::to_string(g) + "." + key, w, scale);
          t.value = expert(w.value);
          t.grad = expert(w.grad);
          t.expert = true;
          t.fused = q + key;
          t.fused_index = g;
          t.transposed = transposed;
          out.push_back(t);
        };
        add("gate_up_proj", x.gate_up, 1.0f, true);
        add("gate_up_proj_bias", x.gate_up_bias, 0.0f, false);
        add("down_proj", x.down, out_scale, true);
        add("down_proj_bias", x.down_bias, 0.0f, false);
      }
    } else if (c_.moe[l]) {
      out.push_back(hf_tensor(p + "mlp.gate.weight", params_[x.router]));
      for (int64_t e = 0; e < local_experts_; ++e)
        mlp(p + "mlp.experts." + std::to_string(first_expert_ + e) + ".", x.gate_up, x.down, e, true);
      if (x.shared_gate_up >= 0) mlp(p + "mlp.shared_experts.", x.shared_gate_up, x.shared_down, 0, false);
    } else {
      mlp(p + "mlp.", x.gate_up, x.down, 0, false);
    }
  }
  if (head_) out.push_back(hf_tensor("model.norm.weight", params_[final_norm_], 0.0f, 1.0f));
  if (lm_head_ >= 0) out.push_back(hf_tensor("lm_head.weight", params_[lm_head_]));
  return out;
}

void Decoder::allocate_bare(DecoderStash& s, Arena& a) const {
  const int64_t B = s.batch, S = s.seq, N = B * S, D = c_.hidden_size, Dr = c_.rope.rotary_dim;
  auto i32 = [&](Shape sh) { return a.alloc(DType::i32, sh); };
  s.ids = i32({B, S});
  s.labels = i32({B, S});
  s.cos = a.alloc(DType::f32, {S, Dr / 2});
  s.sin = a.alloc(DType::f32, {S, Dr / 2});
  s.all_rows = i32({2});
  // The residual stream where a layer here reads or writes it, or the head reads it.
  s.h.resize(c_.num_layers + 1);
  s.dh.resize(c_.num_layers + 1);
  for (int64_t l = 0; l <= c_.num_layers; ++l) {
    if (!(l < c_.num_layers && held_[l]) && !(l > 0 && held_[l - 1]) && !(l == c_.num_layers && head_)) continue;
    s.h[l] = a.alloc(act_, {N, D});
    s.dh[l] = a.alloc(act_, {N, D});
  }
  s.layers.resize(c_.num_layers);
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    LayerActs& x = s.layers[l];
    x.attn = attention_->make_acts();
    if (!c_.moe[l]) continue;
    // What outlives a layer's activations (which full recomputation drops): its routing
    // statistics, read after the head's forward, and the balance gradient set then.
    const int64_t E = c_.num_experts;
    const int64_t slot_counts = replicas_.on() ? ep_->size() * replicas_.slots() : 0;
    const int64_t rows = sequence_balance_ ? B : 0, seq_at = 2 * E + 1 + slot_counts;
    x.stats = i32({seq_at + 2 * rows * E});
    auto part = [&](int64_t at, Shape shape, DType d) {  // (a plan's arenas have no storage)
      return Tensor(x.stats.data != nullptr ? x.stats.i32() + at : nullptr, shape, d, x.stats.device);
    };
    x.prob_sum = part(0, {E}, DType::f32);
    x.counts = part(E, {E}, DType::i32);
    x.z_sum = part(2 * E, {1}, DType::f32);
    if (slot_counts > 0) x.slot_counts = part(2 * E + 1, {slot_counts}, DType::i32);
    if (rows > 0) {
      x.seq_prob_sum = part(seq_at, {rows, E}, DType::f32);
      x.seq_counts = part(seq_at + rows * E, {rows, E}, DType::i32);
    }
    x.dprobs = a.alloc(DType::f32, {std::max<int64_t>(rows, 1), E});  // a row for every token, or each sequence's
  }
  if (balanced_) s.balanced_idx = i32({N, k_});
}

void Decoder::allocate_layers(DecoderStash& s, Arena& a, int64_t first, int64_t last) const {
  const int64_t N = s.batch * s.seq, D = c_.hidden_size, E = c_.num_experts, K = k_;
  const int64_t Is = c_.shared_intermediate_size;
  auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
  auto act = [&](Shape sh) { return a.alloc(act_, sh); };
  auto i32 = [&](Shape sh) { return a.alloc(DType::i32, sh); };
  // Gradients that only a layer's own B stages read, each written before it is read:
  // one set serves every layer (a stash's B stages run one layer at a time). What the
  // W stages read (d_hm, d_gu, d_logits_c, d_sgu) stays per layer. A MoE layer's
  // expert rows are not here: routing sizes them (take_rows).
  bool any_moe = false, any = false;
  int64_t hidden = 0;  // elements of the widest dense d_hs
  std::vector<AttentionActs*> attn;
  for (int64_t l = first; l < last; ++l) {
    if (!held_[l]) continue;
    any = true;
    any_moe = any_moe || c_.moe[l];
    if (!c_.moe[l]) hidden = std::max(hidden, N * c_.intermediate_size);
    attn.push_back(s.layers[l].attn.get());
  }
  if (!any && !(last == c_.num_layers && head_)) return;
  // Full recomputation keeps one layer's activations at a time: every layer of the
  // block gets the same bytes.
  const bool one_deep = recompute_ == Recompute::full;
  if (!one_deep) attention_->allocate(attn, a, act_, s.batch, s.seq);
  const Tensor d_y = act({N, D}), d_xn = act({N, D}), d_hs = hidden > 0 ? act({hidden}) : Tensor(),
               d_shs = any_moe && Is > 0 ? act({N, Is}) : Tensor();
  // What only a layer's forward reads (the router's logits, the MLP's or experts' output
  // and the shared experts'), and B's f32 router gradient where the products read a bf16
  // copy: one set for every layer too. Under selective the norms' outputs xn and y are
  // computed again in W (stage_backward_weight), so they are one set as well.
  const bool renorm = recompute_ == Recompute::selective;
  const Tensor mo = act({N, D}), logits = any_moe ? f32({N, E}) : Tensor(),
               so = any_moe && Is > 0 ? act({N, D}) : Tensor(),
               d_logits = any_moe && act_ != DType::f32 ? f32({N, E}) : Tensor(),
               xn = renorm ? act({N, D}) : Tensor(), y = renorm ? act({N, D}) : Tensor();
  size_t deepest = a.used();
  for (int64_t l = first; l < last; ++l) {
    if (!held_[l]) continue;
    LayerActs& x = s.layers[l];
    const size_t start = a.used();
    if (one_deep) attention_->allocate({x.attn.get()}, a, act_, s.batch, s.seq);
    x.xn = renorm ? xn : act({N, D});
    x.rstd1 = f32({N});
    x.hm = act({N, D});
    x.y = renorm ? y : act({N, D});
    x.rstd2 = f32({N});
    x.d_y = d_y;
    x.d_hm = act({N, D});
    x.d_xn = d_xn;
    x.mo = mo;
    if (c_.moe[l]) {
      if (ep_) x.back = act({N * K, D});
      x.logits = logits;
      x.idx = i32({N, K});
      if (replicas_.on()) x.slots = i32({N, K});
      x.weight = f32({N, K});
      x.probs = f32({N, E});
      x.lse = f32({N});
      if (!ep_) {  // the exchange's plan has its own
        x.offsets = i32({E + 1});
        x.order = i32({N * K});
        x.slot_row = i32({N * K});
      }
      x.d_weight = f32({N, K});
      x.d_logits = act_ == DType::f32 ? f32({N, E}) : d_logits;
      x.d_logits_c = act_ == DType::f32 ? x.d_logits : act({N, E});
      if (Is > 0) {
        x.sgu = act({N, 2 * Is});
        x.shs = act({N, Is});
        x.so = so;
        x.d_sgu = act({N, 2 * Is});
        x.d_shs = d_shs;
      }
    } else {
      const int64_t I = c_.intermediate_size;
      x.gu = act({N, 2 * I});
      x.hs = act({N, I});
      x.d_hs = Tensor(d_hs.data, {N, I}, act_, d_hs.device);
      x.d_gu = act({N, 2 * I});
    }
    deepest = std::max(deepest, a.used());
    if (one_deep) a.rewind(start);
  }
  a.rewind(deepest);
  if (last != c_.num_layers || !head_) return;
  s.hf = act({N, D});
  s.rstd_f = f32({N});
  s.logits = act({head_rows(N), c_.vocab_size});
  s.lse = f32({N});
  s.d_hf = act({N, D});
}

std::unique_ptr<Stash> Decoder::make_bare_stash(int64_t batch, int64_t seq) {
  MT_CHECK(batch >= 1 && seq >= 1) << "a micro-batch needs at least one sequence of one token, got " << batch << "x"
                                   << seq;
  auto s = std::make_unique<DecoderStash>();
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
  if (attend_.cp) {
    const int cp = attend_.cp->size();
    std::vector<int64_t> pos = parallel::zigzag_positions(seq * cp, attend_.cp->rank(), cp);
    for (int64_t t = 0; t < seq; ++t) s->positions_host[t] = static_cast<int32_t>(pos[t]);
  } else {
    for (int64_t t = 0; t < seq; ++t) s->positions_host[t] = static_cast<int32_t>(t);
  }
  mt::rope_tables(rope_, Tensor(s->positions_host.data(), {seq}, DType::i32), s->cos, s->sin);
  int32_t all_rows[2] = {0, static_cast<int32_t>(batch * seq)};
  mt::copy(s->all_rows, Tensor(all_rows, {2}, DType::i32));
  for (LayerActs& x : s->layers)  // no load-balance gradient until the trainer sets one
    if (x.dprobs.data != nullptr) mt::fill(x.dprobs, 0.0f);
  if (balanced_) {
    std::vector<int32_t> idx(static_cast<size_t>(batch * seq * k_));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i % c_.num_experts);
    mt::copy(s->balanced_idx, Tensor(idx.data(), s->balanced_idx.shape, DType::i32));
  }
  return s;
}

std::unique_ptr<ActivationBlock> Decoder::make_block(int64_t batch, int64_t seq, int64_t first, int64_t last) {
  MT_CHECK(0 <= first && first <= last && last <= c_.num_layers)
      << "an activation block for layers [" << first << ", " << last << ") of " << c_.num_layers;
  auto b = std::make_unique<DecoderBlock>();
  b->first = first;
  b->last = last;
  DecoderStash shape;  // the views are thrown away: only the sizes count
  shape.batch = batch;
  shape.seq = seq;
  shape.layers.resize(c_.num_layers);
  for (int64_t l = first; l < last; ++l)
    if (held_[l]) shape.layers[l].attn = attention_->make_acts();
  b->arena = Arena::counting("activations", device_);
  allocate_layers(shape, b->arena, first, last);
  b->bytes = b->arena.peak();
  if (plan_only_) return b;
  b->arena = Arena("activations", device_, b->bytes);
  return b;
}

void Decoder::lend(Stash& base, ActivationBlock& block) {
  auto& s = static_cast<DecoderStash&>(base);
  auto& b = static_cast<DecoderBlock&>(block);
  // The same allocation sequence from the start of the block's arena: the same views.
  b.arena.reset();
  allocate_layers(s, b.arena, b.first, b.last);
}

// What the backward needs of a MoE layer's forward rows: xs (the gate_up W), gu (B's
// SwiGLU), hs (the down W) and, without expert parallelism, ys (the combine's B takes
// dweight from it; with the exchange, `back` holds the outputs on the token's rank, so
// ys goes once it is sent). The gradients live from the B that writes them to the W
// that reads them, or within one B. Selective recomputation keeps neither hs, which the
// experts' B computes again from gu (one SwiGLU), nor, without expert parallelism, xs,
// which their W gathers again from y (with the exchange xs came from other ranks and is
// kept).
std::vector<Decoder::RowLife> Decoder::row_lives() const {
  const int64_t D = c_.hidden_size, I = c_.moe_intermediate_size;
  constexpr Pass F = Pass::forward, B = Pass::backward_input, W = Pass::backward_weight;
  constexpr Stage dispatch = Stage::dispatch, experts = Stage::experts, combine = Stage::combine;
  const bool selective = recompute_ == Recompute::selective, regather = selective && !ep_;
  std::vector<RowLife> lives = {{kXs, dispatch, F, experts, regather ? F : W, D},
                                {kGu, experts, F, experts, B, 2 * I},
                                {kHs, experts, F, experts, selective ? F : W, I},
                                {kYs, experts, F, combine, ep_ ? F : B, D},
                                {kDYs, combine, B, experts, W, D},
                                {kDGu, experts, B, experts, W, 2 * I},
                                {kDHs, experts, B, experts, B, I},
                                {kDXs, experts, B, dispatch, B, D}};
  if (selective) lives.push_back({kHs, experts, B, experts, W, I});
  if (regather) lives.push_back({kXs, experts, W, experts, W, D});
  return lives;
}

Tensor& Decoder::row_view(LayerActs& x, Row r) {
  switch (r) {
    case kXs: return x.xs;
    case kGu: return x.gu;
    case kHs: return x.hs;
    case kYs: return x.ys;
    case kDYs: return x.d_ys;
    case kDGu: return x.d_gu;
    case kDHs: return x.d_hs;
    default: return x.d_xs;
  }
}

int64_t Decoder::planned_rows(int64_t tokens) const {
  const int64_t balanced = tokens * k_;
  int64_t most = ep_ ? ep_->size() * tokens * std::min(k_, local_experts_ + expert_replicas_) : balanced;
  const int64_t cap = capacity(ep_ ? tokens * ep_->size() : tokens);
  if (cap > 0) most = std::min(most, cap * local_experts_);
  return std::min(most, static_cast<int64_t>(std::ceil(routing_skew_ * static_cast<double>(balanced))));
}

void Decoder::take_rows(int64_t l, LayerActs& x, Stage stage, Pass pass, int64_t tokens) {
  const int64_t rows = std::max(kRowRounding, (x.rows + kRowRounding - 1) / kRowRounding * kRowRounding);
  if (stage == Stage::dispatch && pass == Pass::forward && tokens > 0)
    pool_->skew = std::max(pool_->skew, static_cast<double>(x.rows) / static_cast<double>(tokens * k_));
  for (const RowLife& life : lives_) {
    if (life.take_stage != stage || life.take_pass != pass) continue;
    const int r = life.row;
    x.held[r] = parallel::Buffer();  // a forward again without its backward (eval): the old rows first
    const size_t bytes = static_cast<size_t>(rows * life.width) * dtype_size(act_);
    auto refuse = [&](const std::string& why) {
      MT_FAIL() << "layer " << l << " needs " << rows << " expert rows (" << x.rows << " routed here, "
                << static_cast<double>(bytes) / (1 << 20) << " MiB for one of its row tensors) and " << why
                << "; the expert rows already hold " << static_cast<double>(pool_->in_use) / (1 << 20)
                << " MiB. Routing sent this rank " << static_cast<double>(x.rows) / static_cast<double>(tokens * k_)
                << " times its balanced share. Remedies: a capacity (training.capacity_factor), smaller "
                   "micro-batches (training.micro_batch_size), more expert-parallel ranks (parallelism.ep), a "
                   "stronger balance term (training.load_balance_coef); moetrain plan --routing-skew S shows the "
                   "memory a skew needs";
    };
    if (pool_->in_use + bytes > pool_->limit)
      refuse("the pool has " + std::to_string(pool_->limit - pool_->in_use) + " bytes left of its " +
             std::to_string(pool_->limit) + " (" + pool_->limit_key + ")");
    parallel::Buffer b;
    if (!pool_->counting) {
      try {
        b = parallel::make_buffer(device_, act_, {rows, life.width});
      } catch (const Error& e) {
        size_t free = 0;
#ifdef MOETRAIN_WITH_CUDA
        if (device_ == Device::cuda) free = cuda::free_memory();
#endif
        if (device_ == Device::cpu) free = available_host_memory();
        refuse("the device has " + std::to_string(free) + " bytes free (" + e.message + ")");
      }
    }
    // Counted while held: the storage's last owner gives the bytes back.
    pool_->in_use += bytes;
    pool_->peak = std::max(pool_->peak, pool_->in_use);
    b.storage = std::shared_ptr<void>(b.storage.get(), [inner = b.storage, pool = pool_, bytes](void*) mutable {
      pool->in_use -= bytes;
      inner.reset();
    });
    row_view(x, static_cast<Row>(r)) = b.t.data != nullptr ? b.t : Tensor(nullptr, {rows, life.width}, act_, device_);
    x.held[r] = std::move(b);
  }
}

void Decoder::give_rows(LayerActs& x, Stage stage, Pass pass) {
  for (const RowLife& life : lives_)
    if (life.give_stage == stage && life.give_pass == pass) {
      x.held[life.row] = parallel::Buffer();
      row_view(x, life.row) = Tensor();
    }
}

void Decoder::embed_forward(Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  embedding_forward(W(embed_), s.ids.view({s.batch * s.seq}), s.h[0]);
}

void Decoder::attention_forward(int64_t l, DecoderStash& s) {
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const float eps = static_cast<float>(c_.rms_norm_eps);
  rmsnorm_forward(s.h[l], W(w.in_norm), eps, x.xn, x.rstd1);
  // hm = h + attention: the residual, then the attention's output projection onto it.
  mt::copy(x.hm, s.h[l]);
  attention_->forward(l, params_, *x.attn, io(s, x));
  rmsnorm_forward(x.hm, W(w.post_norm), eps, x.y, x.rstd2);
  if (c_.moe[l]) {
    if (w.router_bias >= 0)
      grouped_gemm(x.y, C(w.router).view({1, c_.num_experts, c_.hidden_size}), W(w.router_bias).view({1, c_.num_experts}),
                   s.all_rows, x.logits);
    else
      gemm(x.y, C(w.router), x.logits, false, true);
    mt::router_forward(c_.router, x.logits, x.idx, x.weight, x.probs,
                       expert_bias_.empty() ? Tensor{} : expert_bias_[static_cast<size_t>(l)]);
    mt::router_prob_sum(x.probs, x.prob_sum);
    if (z_scale_ != 0) mt::router_z_forward(x.logits, x.lse, x.z_sum);
    if (balanced_) {
      mt::copy(x.idx, s.balanced_idx);
      mt::fill(x.weight, 1.0f / static_cast<float>(k_));
    }
    if (sequence_balance_) {
      // Each sequence's (row's) sums and choices, for the sequence-level balance term.
      const int64_t rows = x.seq_counts.dim(0), T = x.probs.dim(0) / rows, E = c_.num_experts;
      for (int64_t b = 0; b < rows; ++b)
        mt::router_prob_sum(Tensor(x.probs.f32() + b * T * E, {T, E}, DType::f32, x.probs.device),
                            Tensor(x.seq_prob_sum.f32() + b * E, {E}, DType::f32, x.probs.device));
      mt::router_counts(x.idx, x.seq_counts);
    }
    // The expert plan waits for the router, not for what a schedule queues after it.
    if (replicas_.on()) replicas_.route(l, x.idx, x.slots);
    if (ep_) x.routed = parallel::mark_routed(replicas_.on() ? x.slots : x.idx);
  }
}

void Decoder::finish_exchange(LayerActs& x) const {
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

void Decoder::stage_forward(int64_t l, Stage stage, Stash& base) {
  MT_CHECK(l >= 0 && l < c_.num_layers && held_[l]) << "forward of layer " << l << ", which is not built here";
  auto& s = static_cast<DecoderStash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.moe[l];
  const int64_t N = s.batch * s.seq;
  // A stage after an exchange reads its results: one a schedule has not finished yet is
  // finished here (correct, only without the overlap).
  finish_exchange(x);
  if (plan_only_) return plan_rows(l, stage, Pass::forward, x, N);
  if (moe && stage != Stage::dispatch) take_rows(l, x, stage, Pass::forward, N);
  switch (stage) {
    case Stage::attention:
      attention_forward(l, s);
      break;
    case Stage::dispatch:
      if (moe && ep_) {
        // The experts see the ep ranks' micro-batches end to end: the capacity is theirs.
        // With replicas the plan's experts are the ranks' slots (models/expert_replicas.h).
        if (replicas_.on())
          x.plan = parallel::ep_plan(*ep_, x.slots, ep_->size() * replicas_.slots(), 0, x.routed);
        else
          x.plan = parallel::ep_plan(*ep_, x.idx, c_.num_experts, capacity(N * ep_->size()), x.routed);
        x.dropped = x.plan.dropped;
        x.rows = x.plan.local_rows();
        take_rows(l, x, stage, Pass::forward, N);
        mt::copy(replicas_.on() ? x.slot_counts : x.counts, x.plan.expert_counts);
        x.exchange = parallel::ep_dispatch_forward_start(*ep_, x.plan, x.y);
      } else if (moe) {
        x.dropped = mt::dispatch_plan(x.idx, c_.num_experts, capacity(N), x.counts, x.offsets, x.order, x.slot_row);
        x.rows = N * k_ - x.dropped;  // a capacity keeps the first rows
        take_rows(l, x, stage, Pass::forward, N);
        mt::dispatch_forward(x.y, x.order, k_, routed(x).xs);
      }
      break;
    case Stage::experts:
      if (moe) {
        Routed r = routed(x);
        if (cache_.caches(l)) {
          cached_experts(l, x, Pass::forward);
        } else {
          linear_.grouped_forward(r.xs, X(w.gate_up), bias(w.gate_up_bias), r.offsets, r.gu);
          swiglu_out(r.gu, r.hs);
          linear_.grouped_forward(r.hs, X(w.down), bias(w.down_bias), r.offsets, r.ys);
        }
        if (w.shared_gate_up >= 0) {  // the shared experts see every token
          linear_.forward(x.y, {{params_[w.shared_gate_up], x.sgu}});
          swiglu_forward(x.sgu, x.shs);
          linear_.forward(x.shs, {{params_[w.shared_down], x.so}});
        }
      } else {
        linear_.forward(x.y, {{params_[w.gate_up], x.gu}});
        swiglu_forward(x.gu, x.hs);
        linear_.forward(x.hs, {{params_[w.down], x.mo}});
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
      if (moe && w.shared_gate_up >= 0) mt::add(s.h[l + 1], x.so, s.h[l + 1]);
      break;
  }
  if (moe) end_forward_rows(x, stage);
}

void Decoder::plan_rows(int64_t l, Stage stage, Pass pass, LayerActs& x, int64_t tokens) {
  if (!c_.moe[l]) return;
  if (stage == Stage::dispatch && pass == Pass::forward) x.rows = planned_rows(tokens);
  take_rows(l, x, stage, pass, tokens);
  if (pass == Pass::forward)
    end_forward_rows(x, stage);
  else
    give_rows(x, stage, pass);
}

void Decoder::end_forward_rows(LayerActs& x, Stage stage) {
  give_rows(x, stage, Pass::forward);
  if (recompute_ != Recompute::full || x.recomputing || stage != Stage::combine) return;
  for (int r = 0; r < kRowTensors; ++r) {
    x.held[r] = parallel::Buffer();
    row_view(x, static_cast<Row>(r)) = Tensor();
  }
}

// Each line of the layer's experts with rows in this micro-batch, fetched from the
// cache, runs its products over its window of the rows (kernels/grouped_gemm.h), the
// SwiGLU between them over the window's rows, so the bits are the whole layer's. A W
// is the step's first write of the layer's expert gradients or an addition to them, as
// for gradients on the device; a line without rows in the first write leaves its bias
// gradients at zero, as a whole-layer product would. The next cached layer a pass goes
// to is prefetched behind it.
void Decoder::cached_experts(int64_t l, LayerActs& x, Pass pass) {
  const LayerIndex& w = layer_[l];
  Routed r = routed(x);
  if (pass == Pass::forward) {
    x.host_offsets.assign(static_cast<size_t>(local_experts_ + 1), 0);
    mt::copy(Tensor(x.host_offsets.data(), {local_experts_ + 1}, DType::i32), r.offsets);
  }
  const std::vector<int32_t>& o = x.host_offsets;
  const bool accumulate = pass == Pass::backward_weight && params_[w.down].grad_started;
  // Where the cached matrices are in a line's Params (blocks in params_ order).
  const int gu = w.gate_up < w.down ? 0 : 1, dn = 1 - gu;
  // Lines write disjoint rows and gradients: any order gives the same bits.
  for (int64_t i : cache_.order(l)) {
    const int64_t e0 = i * cache_.line_experts(), e1 = std::min(local_experts_, e0 + cache_.line_experts());
    const int64_t r0 = o[static_cast<size_t>(e0)], r1 = o[static_cast<size_t>(e1)];
    auto window = [&](const Tensor& t) { return t.data != nullptr ? t.rows(e0, e1) : t; };
    if (r0 == r1) {
      if (pass == Pass::backward_weight && !accumulate)
        for (int b : {w.gate_up_bias, w.down_bias})
          if (b >= 0) mt::fill(window(grad_of(b)), 0.0f);
      continue;
    }
    ExpertCache::Line& line = cache_.fetch(l, i, pass == Pass::backward_weight, accumulate);
    Param &g = line.params[static_cast<size_t>(gu)], &d = line.params[static_cast<size_t>(dn)];
    const Tensor off = r.offsets.rows(e0, e1 + 1);
    if (pass == Pass::forward) {
      linear_.grouped_forward(r.xs, g, window(bias(w.gate_up_bias)), off, r.gu);
      swiglu_out(r.gu.rows(r0, r1), r.hs.rows(r0, r1));
      linear_.grouped_forward(r.hs, d, window(bias(w.down_bias)), off, r.ys);
    } else if (pass == Pass::backward_input) {
      linear_.grouped_backward_input(r.d_ys, d, off, r.d_hs);
      swiglu_in(r.gu.rows(r0, r1), r.d_hs.rows(r0, r1), r.d_gu.rows(r0, r1));
      linear_.grouped_backward_input(r.d_gu, g, off, r.d_xs);
    } else {
      linear_.grouped_backward_weight(r.hs, r.d_ys, off, d, window(grad_of(w.down_bias)), accumulate);
      linear_.grouped_backward_weight(r.xs, r.d_gu, off, g, window(grad_of(w.gate_up_bias)), accumulate);
    }
    cache_.done(pass == Pass::backward_weight);
  }
  if (pass == Pass::backward_weight) {
    start(w.down);
    start(w.gate_up);
  }
  const int64_t step = pass == Pass::forward && !x.recomputing ? 1 : -1;  // a recomputation is in the backward
  for (int64_t next = l + step; next >= 0 && next < c_.num_layers; next += step)
    if (cache_.caches(next)) {
      cache_.prefetch(next);
      break;
    }
}

void Decoder::recompute_layer(int64_t l, Stash& s) {
  LayerActs& x = layer_acts(s, l);
  x.recomputing = true;
  for (Stage st : {Stage::attention, Stage::dispatch, Stage::experts, Stage::combine}) {
    stage_forward(l, st, s);
    finish_exchange(x);
  }
  x.recomputing = false;
}

void Decoder::attention_backward_input(int64_t l, DecoderStash& s) {
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  if (c_.moe[l]) {
    // Router: every token's probability row gets the load-balance gradient (x.dprobs,
    // uploaded by set_router_prob_grad).
    // Forced routing does not come from the logits: only the balance term reaches them.
    if (balanced_) mt::fill(x.d_weight, 0.0f);
    mt::router_backward(c_.router, x.logits, x.idx, x.weight, x.probs, x.d_weight, x.dprobs, x.d_logits);
    if (z_scale_ != 0) mt::router_z_backward(x.lse, x.probs, static_cast<float>(z_scale_), x.d_logits);
    if (x.d_logits_c.data != x.d_logits.data) mt::cast(x.d_logits, x.d_logits_c);
    gemm(x.d_logits_c, C(w.router), x.d_y, false, false, 1.0f, 1.0f);
    // The shared experts' input gradient, after the dispatch's (which overwrites d_y).
    if (w.shared_gate_up >= 0) linear_.backward_input(x.d_sgu, params_[w.shared_gate_up], x.d_y, 1.0f);
  }
  // d_hm = dh[l+1] (the residual) + the post-attention norm's input gradient.
  // The norms' weight gradients are taken here, with their input gradients, not in W:
  // their dy buffers are shared by every layer (allocate), and the pass is one.
  rmsnorm_backward(x.hm, W(w.post_norm), x.rstd2, x.d_y, x.d_hm, Z(w.post_norm), s.dh[l + 1]);
  attention_->backward_input(l, params_, *x.attn, io(s, x));
  rmsnorm_backward(s.h[l], W(w.in_norm), x.rstd1, x.d_xn, s.dh[l], Z(w.in_norm), x.d_hm);
}

void Decoder::stage_backward_input(int64_t l, Stage stage, Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.moe[l];
  const Tensor& d_mo = s.dh[l + 1];  // aggregate: h[l+1] = hm + mo, so d_mo = d_hm = dh[l+1]
  finish_exchange(x);  // as in stage_forward
  // The layer's first B (the aggregate's) finds its activations recomputed.
  if (recompute_ == Recompute::full && stage == Stage::aggregate) recompute_layer(l, s);
  if (plan_only_) return plan_rows(l, stage, Pass::backward_input, x, s.batch * s.seq);
  if (moe) take_rows(l, x, stage, Pass::backward_input, s.batch * s.seq);
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
        if (recompute_ == Recompute::selective) swiglu_out(r.gu, r.hs);  // W reads it
        if (cache_.caches(l)) {
          cached_experts(l, x, Pass::backward_input);
        } else {
          linear_.grouped_backward_input(r.d_ys, X(w.down), r.offsets, r.d_hs);
          swiglu_in(r.gu, r.d_hs, r.d_gu);
          linear_.grouped_backward_input(r.d_gu, X(w.gate_up), r.offsets, r.d_xs);
        }
        if (w.shared_gate_up >= 0) {
          linear_.backward_input(d_mo, params_[w.shared_down], x.d_shs);
          swiglu_backward(x.sgu, x.d_shs, x.d_sgu);
        }
      } else {
        linear_.backward_input(d_mo, params_[w.down], x.d_hs);
        swiglu_backward(x.gu, x.d_hs, x.d_gu);
        linear_.backward_input(x.d_gu, params_[w.gate_up], x.d_y);
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
  if (moe) give_rows(x, stage, Pass::backward_input);
}

void Decoder::stage_backward_weight(int64_t l, Stage stage, Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.moe[l];
  if (plan_only_) return plan_rows(l, stage, Pass::backward_weight, x, s.batch * s.seq);
  if (moe) take_rows(l, x, stage, Pass::backward_weight, s.batch * s.seq);
  // selective: the norms' outputs that this W reads, computed again (allocate_layers).
  const float eps = static_cast<float>(c_.rms_norm_eps);
  if (recompute_ == Recompute::selective && (stage == Stage::experts || (stage == Stage::attention && moe)))
    rmsnorm_forward(x.hm, W(w.post_norm), eps, x.y, x.rstd2);
  if (recompute_ == Recompute::selective && stage == Stage::attention)
    rmsnorm_forward(s.h[l], W(w.in_norm), eps, x.xn, x.rstd1);
  switch (stage) {
    case Stage::experts:
      if (moe) {
        Routed r = routed(x);
        if (recompute_ == Recompute::selective && !ep_) mt::dispatch_forward(x.y, x.order, k_, r.xs);
        // A bias is written with its weight: one mark serves both.
        if (cache_.caches(l)) {
          cached_experts(l, x, Pass::backward_weight);
        } else {
          linear_.grouped_backward_weight(r.hs, r.d_ys, r.offsets, X(w.down), grad_of(w.down_bias),
                                          !start(w.down));
          linear_.grouped_backward_weight(r.xs, r.d_gu, r.offsets, X(w.gate_up), grad_of(w.gate_up_bias),
                                          !start(w.gate_up));
        }
        if (w.shared_gate_up >= 0) {
          linear_.backward_weight(x.shs, {{s.dh[l + 1], params_[w.shared_down]}});
          linear_.backward_weight(x.y, {{x.d_sgu, params_[w.shared_gate_up]}});
        }
      } else {
        linear_.backward_weight(x.hs, {{s.dh[l + 1], params_[w.down]}});
        linear_.backward_weight(x.y, {{x.d_gu, params_[w.gate_up]}});
      }
      break;
    case Stage::attention:
      if (moe && w.router_bias >= 0)
        grouped_gemm_backward_weight(x.y, x.d_logits_c, s.all_rows, G(w.router).view({1, c_.num_experts, c_.hidden_size}),
                                     G(w.router_bias).view({1, c_.num_experts}), !start(w.router));
      else if (moe)
        gemm(x.d_logits_c, x.y, G(w.router), true, false, 1.0f, beta(w.router));
      attention_->backward_weight(l, params_, *x.attn, io(s, x));
      break;
    case Stage::dispatch:
    case Stage::combine:
    case Stage::aggregate:
      break;  // no parameters
  }
  if (moe) give_rows(x, stage, Pass::backward_weight);
}

LossSum Decoder::head_forward(Stash& base, float grad_scale) {
  auto& s = static_cast<DecoderStash&>(base);
  const int64_t N = s.batch * s.seq;
  rmsnorm_forward(s.h[c_.num_layers], W(final_norm_), static_cast<float>(c_.rms_norm_eps), s.hf, s.rstd_f);
  s.loss = {};
  // One chunk: its logits become their gradient in the cross-entropy's pass (the
  // backward starts from them); chunks are made again by the backward.
  s.logits_grad_scale = N <= head_rows(N) ? grad_scale : 0.0f;
  for (int64_t r0 = 0, c = head_rows(N); r0 < N; r0 += c) {
    const int64_t r1 = std::min(N, r0 + c);
    const Tensor logits = s.logits.rows(0, r1 - r0);
    gemm(s.hf.rows(r0, r1), C(lm_head_ >= 0 ? lm_head_ : embed_), logits, false, true);
    cpu::CrossEntropySum ce =
        cross_entropy_forward(logits, s.labels.view({N}).rows(r0, r1), kIgnoreIndex, s.lse.rows(r0, r1),
                              s.logits_grad_scale, s.logits_grad_scale > 0 ? logits : Tensor());
    s.loss.sum += ce.loss_sum;
    s.loss.count += ce.count;
  }
  return s.loss;
}

void Decoder::head_backward_input(Stash& base, float scale) {
  auto& s = static_cast<DecoderStash&>(base);
  const int64_t N = s.batch * s.seq;
  const int out = lm_head_ >= 0 ? lm_head_ : embed_;
  const int64_t c = head_rows(N);
  const bool chunked = N > c;
  MT_CHECK(s.logits_grad_scale == 0 || s.logits_grad_scale == scale)
      << "head backward at scale " << scale << ", but its forward made the gradient at " << s.logits_grad_scale;
  for (int64_t r0 = 0; r0 < N; r0 += c) {
    const int64_t r1 = std::min(N, r0 + c);
    const Tensor logits = s.logits.rows(0, r1 - r0), hf = s.hf.rows(r0, r1);
    if (chunked) gemm(hf, C(out), logits, false, true);  // one chunk's are still there
    // In place: the chunk's logits become d(loss)/d(logits), which the weight's gradient
    // reads (here, or in W when there is one chunk).
    if (s.logits_grad_scale == 0)
      cross_entropy_backward(logits, s.labels.view({N}).rows(r0, r1), s.lse.rows(r0, r1), kIgnoreIndex, scale, logits);
    gemm(logits, C(out), s.d_hf.rows(r0, r1), false, false);
    if (chunked) gemm(logits, hf, G(out), true, false, 1.0f, beta(out));
  }
  rmsnorm_backward(s.h[c_.num_layers], W(final_norm_), s.rstd_f, s.d_hf, s.dh[c_.num_layers], Z(final_norm_));
}

void Decoder::head_backward_weight(Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  const int out = lm_head_ >= 0 ? lm_head_ : embed_;
  if (s.batch * s.seq <= head_rows(s.batch * s.seq)) gemm(s.logits, s.hf, G(out), true, false, 1.0f, beta(out));
}

void Decoder::embed_backward(Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  // Tied, the head's W may have started this gradient already: Z then adds to it.
  embedding_backward(s.ids.view({s.batch * s.seq}), s.dh[0], Z(embed_));
}

std::vector<RouterStats> Decoder::router_stats(const Stash& base) const {
  const auto& s = static_cast<const DecoderStash&>(base);
  std::vector<RouterStats> out;
  const int64_t N = s.batch * s.seq, E = c_.num_experts;
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l] || !c_.moe[l]) continue;
    const LayerActs& x = s.layers[l];
    RouterStats r;
    r.layer = l;
    r.tokens = N;
    r.top_k = k_;
    r.dropped = x.dropped;
    // The probabilities summed where they were made (router_prob_sum) and the slots each
    // expert kept, counted by the dispatch plan: one copy of both to the host.
    std::vector<int32_t> stats(static_cast<size_t>(x.stats.numel()));
    mt::copy(Tensor(stats.data(), {x.stats.numel()}, DType::i32), x.stats);
    std::vector<float> sums(static_cast<size_t>(E));
    std::memcpy(sums.data(), stats.data(), sums.size() * sizeof(float));
    r.prob_sum.assign(sums.begin(), sums.end());
    r.counts.assign(stats.begin() + E, stats.begin() + 2 * E);
    if (z_scale_ != 0) {
      float z = 0;
      std::memcpy(&z, stats.data() + 2 * E, sizeof z);
      r.z_sum = z;
    }
    const int64_t slot_end = 2 * E + 1 + (replicas_.on() ? x.slot_counts.numel() : 0);
    if (replicas_.on()) {  // the plan counted slots: each expert's are the sum of its copies'
      r.slot_counts.assign(stats.begin() + 2 * E + 1, stats.begin() + slot_end);
      r.counts = replicas_.expert_counts(l, std::vector<int32_t>(stats.begin() + 2 * E + 1, stats.begin() + slot_end));
    }
    if (sequence_balance_) {
      r.seq_rows = x.seq_counts.dim(0);
      r.seq_tokens = N / r.seq_rows;
      const int64_t n = r.seq_rows * E;
      std::vector<float> f(static_cast<size_t>(n));
      std::memcpy(f.data(), stats.data() + slot_end, f.size() * sizeof(float));
      r.seq_prob_sum.assign(f.begin(), f.end());
      r.seq_counts.assign(stats.begin() + slot_end + n, stats.begin() + slot_end + 2 * n);
    }
    out.push_back(std::move(r));
  }
  return out;
}

void Decoder::set_expert_bias(int64_t layer, const std::vector<float>& bias) {
  const int64_t E = c_.num_experts;
  MT_CHECK(layer >= 0 && layer < c_.num_layers && held_[layer] && c_.moe[layer] &&
           static_cast<int64_t>(bias.size()) == E)
      << "an expert bias of " << bias.size() << " values for layer " << layer << ", which is not a MoE layer held "
      << "here with " << E << " experts";
  if (expert_bias_.empty()) {
    // Every held MoE layer's, zero, at the first call.
    int64_t layers = 0;
    for (int64_t l = 0; l < c_.num_layers; ++l) layers += held_[l] && c_.moe[l];
    bias_arena_ = Arena("expert bias", device_, static_cast<size_t>(layers) * (E * sizeof(float) + Arena::kAlign));
    expert_bias_.resize(static_cast<size_t>(c_.num_layers));
    for (int64_t l = 0; l < c_.num_layers; ++l)
      if (held_[l] && c_.moe[l]) {
        expert_bias_[static_cast<size_t>(l)] = bias_arena_.alloc(DType::f32, {E});
        mt::fill(expert_bias_[static_cast<size_t>(l)], 0.0f);
      }
  }
  mt::copy(expert_bias_[static_cast<size_t>(layer)], Tensor(const_cast<float*>(bias.data()), {E}, DType::f32));
}

void Decoder::set_router_prob_grad(Stash& base, int64_t layer, const std::vector<float>& dprob) {
  auto& s = static_cast<DecoderStash&>(base);
  const Tensor& dprobs = s.layers[layer].dprobs;
  MT_CHECK(held_[layer] && c_.moe[layer] && static_cast<int64_t>(dprob.size()) == dprobs.numel())
      << "load-balance gradient for layer " << layer << " with " << dprob.size() << " values, not "
      << dprobs.numel() << " (" << dprobs.str() << ")";
  // Uploaded now, between the forward and the backward, where the trainer has waited
  // for the device anyway (router statistics), rather than as a stall inside the backward.
  mt::copy(dprobs, Tensor(const_cast<float*>(dprob.data()), dprobs.shape, DType::f32));
}

}  // namespace

void check_decoder_spec(const DecoderSpec& d, const std::string& where) {
  MT_CHECK(d.vocab_size > 0 && d.hidden_size > 0 && d.num_layers > 0)
      << where << ": vocab_size, hidden_size and num_hidden_layers must be positive, got " << d.vocab_size << ", "
      << d.hidden_size << ", " << d.num_layers;
  MT_CHECK(d.rope.rotary_dim > 0 && d.rope.rotary_dim % 2 == 0)
      << where << ": the rotary dim (head_dim, or qk_rope_head_dim) " << d.rope.rotary_dim
      << " must be positive and even";
  const bool any_moe = std::find(d.moe.begin(), d.moe.end(), true) != d.moe.end();
  MT_CHECK(!any_moe || (d.router.top_k >= 1 && d.router.top_k <= d.num_experts && d.moe_intermediate_size > 0))
      << where << ": num_experts_per_tok " << d.router.top_k << " must be in [1, " << d.num_experts
      << " experts] and the experts' intermediate size (" << d.moe_intermediate_size << ") positive";
  MT_CHECK(!any_moe || (d.router.n_group >= 1 && d.num_experts % d.router.n_group == 0 &&
                        d.router.topk_group >= 1 && d.router.topk_group <= d.router.n_group))
      << where << ": n_group " << d.router.n_group << " must divide the " << d.num_experts
      << " experts and topk_group " << d.router.topk_group << " be in [1, n_group]";
  const bool any_dense = std::find(d.moe.begin(), d.moe.end(), false) != d.moe.end();
  MT_CHECK(!any_dense || d.intermediate_size > 0)
      << where << ": intermediate_size must be positive for the dense layers, got " << d.intermediate_size;
}

std::unique_ptr<Model> make_decoder(const DecoderSpec& spec, std::unique_ptr<Attention> attention,
                                    const ModelOptions& options) {
  MT_CHECK(static_cast<int64_t>(spec.moe.size()) == spec.num_layers)
      << "decoder spec: " << spec.moe.size() << " MoE flags for " << spec.num_layers << " layers";
  return std::make_unique<Decoder>(spec, std::move(attention), options);
}

}  // namespace mt
