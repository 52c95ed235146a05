#include "models/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/check.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/rmsnorm.h"
#include "kernels/swiglu.h"
#include "models/head.h"
#include "models/moe.h"
#include "parallel/context_parallel.h"

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

bool start_grad(Param& p) {
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

// Rows [r0, r1) of block e of a fused [E, rows, cols] (or [rows, cols]) Param.
static HfTensor hf_slice(std::string name, const Param& p, int64_t e, int64_t r0, int64_t r1, float init_scale,
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

void hf_mlp(std::vector<HfTensor>& out, const std::string& prefix, const Param& gate_up, const Param& down, int64_t e,
            float out_scale, bool expert) {
  const int64_t I = gate_up.value.dim(gate_up.value.ndim() - 2) / 2, D = down.value.dim(down.value.ndim() - 2);
  out.push_back(hf_slice(prefix + "gate_proj.weight", gate_up, e, 0, I, 1.0f, expert));
  out.push_back(hf_slice(prefix + "up_proj.weight", gate_up, e, I, 2 * I, 1.0f, expert));
  out.push_back(hf_slice(prefix + "down_proj.weight", down, e, 0, D, out_scale, expert));
}

namespace {

// Every kernel call below goes through the family headers' mt:: dispatchers, which
// pick the backend by the tensors' device. Calls that take a cpu:: struct are written
// mt::f(...): argument-dependent lookup would also find cpu::f.


// Where each layer's own parameters sit in params_ (indices, so the vector may grow); a
// MoE layer's MLP parameters are the block's (Moe).
struct LayerIndex {
  int in_norm, post_norm;
  int gate_up = -1, down = -1;  // the dense MLP: [2I, D] and [D, I]
};
// Activations of one layer for one micro-batch, and the gradients its W stages need
// (N = batch * seq tokens).
struct LayerActs {
  std::unique_ptr<AttentionActs> attn;  // the model's attention
  Tensor xn, rstd1;             // input norm [N,D], [N]
  Tensor hm, y, rstd2;          // residual after attention, its norm
  Tensor gu, hs, mo;            // the dense MLP's path; mo: its (or the routed experts') output
  Moe::Acts moe;                // a MoE layer's block
  Tensor d_hs, d_gu, d_y, d_hm, d_xn;
};

struct DecoderBlock : ActivationBlock {
  Arena arena;
};

// Multi-token prediction depth k's activations (DecoderSpec::mtp_depths): its layer's
// input x = eh_proj(cat) and output `out`, with their gradients; the embedding rows e of
// the tokens k ahead and their norm en, the previous depth's output normed hn, cat =
// [en | hn]. What only one depth's backward reads at a time (d_cat, d_en, d_hn, d_e) is
// one set for every depth, as is d_prev (the gradient of the previous depth's output
// from this one's hnorm).
struct MtpActs {
  Tensor x, out, dx, dout;
  Tensor e, en, rstd_e, hn, rstd_h, cat;
  Tensor d_cat, d_en, d_hn, d_e, d_prev;
};

struct DecoderStash : Stash {
  Arena arena;
  int64_t L = 0;  // the model's layers: past them, a layer is a multi-token prediction depth's
  std::vector<int32_t> positions_host;
  Tensor cos, sin;
  Tensor all_rows;                   // i32 {0, N} (AttentionIo::all_rows)
  Tensor balanced_idx;               // force_balanced_routing: the fixed expert choice
  std::vector<LayerActs> layers;
  Head::Acts head;  // the main head's, and scratch of the depths' heads before it
  std::vector<MtpActs> mtp;
  LossSum loss;
  // Layer l's input and output in the residual stream and their gradients: h[l] and
  // h[l + 1], or a multi-token prediction depth's x and out.
  const Tensor& in(int64_t l) const { return l < L ? h[l] : mtp[l - L].x; }
  const Tensor& out(int64_t l) const { return l < L ? h[l + 1] : mtp[l - L].out; }
  const Tensor& d_in(int64_t l) const { return l < L ? dh[l] : mtp[l - L].dx; }
  const Tensor& d_out(int64_t l) const { return l < L ? dh[l + 1] : mtp[l - L].dout; }
};

// The spec as the decoder builds it: num_layers counts the multi-token prediction
// depths' layers too, where they are built.
DecoderSpec with_mtp_layers(DecoderSpec c, bool mtp) {
  if (mtp) c.num_layers += c.mtp_depths;
  c.moe.resize(static_cast<size_t>(c.num_layers));
  return c;
}

class Decoder final : public Model {
 public:
  Decoder(const DecoderSpec& spec, Mixers mixers, const ModelOptions& o)
      : c_(with_mtp_layers(spec, o.mtp)), L_(spec.num_layers), D_(c_.num_layers - L_), mixers_(std::move(mixers)),
        o_(o), act_(o.device == Device::cuda ? DType::bf16 : DType::f32), linear_(o.fp8, o.fp8_pow2),
        moe_(c_, o, params_, linear_) {
    const DecoderSpec& c = c_;
    mixers_.resize(static_cast<size_t>(c.num_layers));
    MT_CHECK(!linear_.fp8() || !o.external_layers)
        << "training.fp8 = blockwise with parallelism.zero3 is not built yet (the weight slots gather bf16 copies, "
           "not FP8 ones)";
    attend_.cp = o.cp != nullptr && o.cp->size() > 1 ? o.cp : nullptr;
    held_.assign(static_cast<size_t>(c.num_layers), o.layers.empty());
    for (int64_t l : o.layers) {
      MT_CHECK(l >= 0 && l < L_) << "model built for layer " << l << " of " << L_;
      held_[l] = true;
    }
    for (int64_t l = L_; l < c.num_layers; ++l) held_[l] = o.head;
    // The replicas key an expert by its Param::layer, which is L for every depth's.
    MT_CHECK(D_ <= 1 || o.expert_replicas == 0)
        << "parallelism.expert_replicas with " << D_ << " multi-token prediction depths is not built (one depth is)";
    MT_CHECK(!c.tie_word_embeddings || o_.embedding == o_.head)
        << "tie_word_embeddings: the embedding and the head share a weight, so they must be on one pipeline rank "
        << "(parallelism.pipeline_schedule = dualpipev places both on rank 0)";
    build_params();
  }

  Device device() const override { return o_.device; }
  size_t expert_cache_bytes() const override { return moe_.cache().bytes(); }
  ExpertCacheStats expert_cache_traffic(int64_t micro_batches, int64_t sweep) const override {
    return moe_.cache().planned_traffic(micro_batches, sweep);
  }
  ExpertCacheStats flush_expert_cache() override { return moe_.cache().flush(); }
  ExpertReplicas* expert_replicas() override { return moe_.replicas().on() ? &moe_.replicas() : nullptr; }
  size_t expert_replica_bytes() const override { return replica_bytes_; }
  ExpertCacheStats expert_cache_stats() override { return moe_.cache().stats(); }
  bool balanced_routing() const override { return o_.force_balanced_routing; }
  int64_t num_layers() const override { return L_; }
  int64_t mtp_depths() const override { return D_; }
  bool is_moe_layer(int64_t layer) const override { return c_.moe[layer]; }
  int64_t num_experts() const override { return c_.num_experts; }
  int64_t vocab_size() const override { return c_.vocab_size; }
  std::vector<Param>& params() override { return params_; }
  Param* embedding() override { return embed_ >= 0 ? &params_[embed_] : nullptr; }
  Param* embedding_copy() override { return embed_copy_.name.empty() ? nullptr : &embed_copy_; }

  int64_t param_count() const override {
    int64_t n = 0;
    for (const Param& p : params_) n += p.value.numel();
    return n;
  }
  int64_t active_param_count() const override {
    int64_t n = 0;
    for (const Param& p : params_)
      n += p.expert ? p.value.numel() / moe_.local_experts() * c_.router.top_k : p.value.numel();
    return n;
  }

  std::vector<HfTensor> hf_tensors() override;
  bool held_by_another_rank(const std::string& name) const override {
    if (name.starts_with("model.layers.")) {
      const int64_t l = std::atoll(name.c_str() + 13);
      if (l >= 0 && l < c_.num_layers && !held_[l]) return true;
    }
    if (name == "model.embed_tokens.weight") return !o_.embedding;
    if (name == "model.norm.weight" || name == "lm_head.weight") return !o_.head;
    return moe_.another_ranks_expert(name);
  }
  std::unique_ptr<Stash> make_bare_stash(int64_t batch, int64_t seq) override;
  std::unique_ptr<ActivationBlock> make_block(int64_t batch, int64_t seq, int64_t first, int64_t last) override;
  void lend(Stash& s, ActivationBlock& b) override;
  void embed_forward(Stash& s) override;
  void stage_forward(int64_t layer, Stage stage, Stash& s) override;
  void stage_backward_input(int64_t layer, Stage stage, Stash& s) override;
  void stage_backward_weight(int64_t layer, Stage stage, Stash& s) override;
  // A layer has at most one exchange in flight: finishing a stage finishes it.
  void finish_forward(int64_t l, Stage, Stash& s) override { finish_exchange(s, l); }
  void finish_backward_input(int64_t l, Stage, Stash& s) override { finish_exchange(s, l); }
  LossSum head_forward(Stash& s, float grad_scale) override;
  void head_backward_input(Stash& s, float scale) override;
  void head_backward_weight(Stash& s) override;
  void embed_backward(Stash& s) override;
  // The last chunk's: every token's where the micro-batch fits in one.
  Tensor logits(Stash& s) override {
    auto& d = static_cast<DecoderStash&>(s);
    return lm_.logits(d.head, d.batch * d.seq);
  }
  std::vector<RouterStats> router_stats(const Stash& s) const override;
  void set_router_prob_grad(Stash& s, int64_t layer, const std::vector<float>& dprob) override {
    moe_.set_router_prob_grad(layer, layer_acts(s, layer).moe, dprob);
  }
  void set_router_z_loss(double scale) override { moe_.set_router_z_loss(scale); }
  void set_expert_bias(int64_t layer, const std::vector<float>& bias) override { moe_.set_expert_bias(layer, bias); }
  std::vector<float> expert_bias(int64_t layer) const override { return moe_.expert_bias(layer); }
  bool sigmoid_routing() const override { return c_.router.scoring == cpu::RouterScoring::sigmoid; }
  std::vector<HfTensor> hf_buffers() override {
    std::vector<HfTensor> out;
    for (int64_t l = 0; l < c_.num_layers; ++l)
      if (held_[l] && c_.moe[l]) moe_.hf_buffers(l, "model.layers." + std::to_string(l) + ".", out);
    return out;
  }
  RowMemory row_memory() const override { return moe_.row_memory(); }
  void reset_row_memory() override { moe_.reset_row_memory(); }

 private:
  void build_params();
  void allocate_bare(DecoderStash& s, Arena& a) const;
  void allocate_layers(DecoderStash& s, Arena& a, int64_t first, int64_t last) const;
  const Tensor& W(int i) const { return params_[i].value; }  // f32 master (norms, embedding)
  // Gradient writes: a Param's first write of the step replaces its gradient and later
  // ones add (Param::grad_started), whatever order the schedule runs micro-batches in.
  const Tensor& Z(int i) { return grad_zeroed(params_[i]); }
  AttentionIo io(DecoderStash& s, LayerActs& x) const {
    return {s.batch, s.seq, s.cos, s.sin, x.xn, x.hm, x.d_hm, x.d_xn, &attend_, &linear_, s.all_rows};
  }
  // What the MoE block sees of layer l.
  static Moe::Io moe_io(Stash& base, int64_t l) {
    auto& s = static_cast<DecoderStash&>(base);
    LayerActs& x = s.layers[l];
    return {s.batch * s.seq, x.y, x.d_y, x.mo, s.out(l), s.d_out(l), s.all_rows, s.balanced_idx};
  }
  // Full recomputation: layer l's forward again (all but the aggregate, whose output
  // h[l+1] is the next layer's input and kept), exchanges finished at once.
  void recompute_layer(int64_t l, Stash& s);
  static LayerActs& layer_acts(Stash& s, int64_t l) { return static_cast<DecoderStash&>(s).layers[l]; }
  // Finishes the expert-parallel exchange layer l has in flight, whichever it is.
  void finish_exchange(Stash& s, int64_t l) const { moe_.finish_exchange(layer_acts(s, l).moe, moe_io(s, l)); }
  void attention_forward(int64_t l, DecoderStash& s);
  void attention_backward_input(int64_t l, DecoderStash& s);
  // The held layers of a block of [first, last), with the depths' layers where it has the head.
  std::vector<int64_t> block_layers(int64_t first, int64_t last) const;
  // Multi-token prediction: every depth's forward, each one's head with its B and W at
  // once (the main head's scratch serves them before its own forward), and the depths'
  // backward from the last, into the last layer's output gradient.
  std::vector<LossSum> mtp_forward(DecoderStash& s, float grad_scale);
  void mtp_backward(DecoderStash& s);

  DecoderSpec c_;  // with_mtp_layers: num_layers counts the depths' layers
  int64_t L_, D_;  // the model's layers and the multi-token prediction depths built
  Mixers mixers_;  // per layer (layers may share one)
  Attention& mixer(int64_t l) const { return *mixers_[static_cast<size_t>(l)]; }
  Attend attend_;
  ModelOptions o_;  // as given: attend_.cp and held_ are what its cp and layers come to
  size_t replica_bytes_ = 0;  // what the expert replicas' slots add to the arenas
  DType act_;  // activations: bf16 on the GPU, f32 on the CPU
  std::vector<bool> held_;  // per layer: built on this rank (pipeline parallelism)
  Linear linear_;
  std::vector<Param> params_;
  Arena values_, grads_, compute_, fp8_, host_values_;
  int embed_ = -1;
  Head lm_;  // the head (models/head.h), where this rank holds it
  // Multi-token prediction depth k's own parameters (its layer's are layer_[L + k - 1]'s)
  // and its head: its own norm, the model's output projection.
  struct MtpIndex {
    int enorm, hnorm, eh_proj;
  };
  std::vector<MtpIndex> mtp_;
  std::vector<Head> mtp_heads_;
  // The depths' embedding: the model's, or where this rank has the head but not the
  // embedding, a copy (Model::embedding_copy).
  Param embed_copy_;
  Param& mtp_embedding() { return embed_ >= 0 ? params_[embed_] : embed_copy_; }
  std::vector<LayerIndex> layer_;
  cpu::RopeFreqs rope_;
  Moe moe_;  // the MoE layers' block (models/moe.h)
};

void Decoder::build_params() {
  const int64_t D = c_.hidden_size;
  auto add = [&](std::string name, Shape shape) { return add_param(params_, std::move(name), shape); };
  if (o_.embedding) embed_ = add("embed", {c_.vocab_size, D});
  layer_.resize(static_cast<size_t>(c_.num_layers));
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    std::string p = "layers." + std::to_string(l) + ".";
    LayerIndex x{};
    x.in_norm = add(p + "input_norm", {D});
    mixer(l).add_params(l, p, params_);
    x.post_norm = add(p + "post_norm", {D});
    if (c_.moe[l]) {
      moe_.add_params(l, p);
    } else {
      const int64_t I = c_.intermediate_size;
      x.gate_up = add(p + "mlp.gate_up", {2 * I, D});
      x.down = add(p + "mlp.down", {D, I});
    }
    layer_[l] = x;
  }
  if (o_.head) {
    const int norm = add("final_norm", {D});
    const int out = c_.tie_word_embeddings ? embed_ : add("lm_head", {c_.vocab_size, D});
    const bool chunked = o_.recompute == Recompute::full;
    lm_ = Head(&params_, norm, out, !c_.tie_word_embeddings, c_.rms_norm_eps, c_.vocab_size, chunked,
               c_.norm_weight_offset);
    for (int64_t k = 1; k <= D_; ++k) {
      const std::string p = "layers." + std::to_string(L_ + k - 1) + ".";
      mtp_.push_back({add(p + "enorm", {D}), add(p + "hnorm", {D}), add(p + "eh_proj", {D, 2 * D})});
      mtp_heads_.emplace_back(&params_, add(p + "head_norm", {D}), out, false, c_.rms_norm_eps, c_.vocab_size, chunked);
    }
  }
  // A Param's part (Param::layer): its layer, or L for the head's and the multi-token
  // prediction depths' (one part: ZeRO-3 does not gather them, and their gradients are
  // reduced with the head's).
  for (Param& p : params_) {
    if (p.name.starts_with("layers.")) p.layer = std::min(std::atoll(p.name.c_str() + 7), static_cast<long long>(L_));
    if (p.name == "final_norm" || p.name == "lm_head") p.layer = L_;
  }

  // Two arenas, master weights and their gradients, and on the GPU
  // a third with the bf16 copies of the matrices that the products read. With external
  // layers, only the embedding's and the head's. With FP8, a fourth holds the linear
  // layers' weights quantized in both layouts (Param::fp8): a layer's matrices but its
  // router. Those need no bf16 copy (only the FP8 products read them): their compute is
  // the master itself, which they are quantized from, so the GPU's codes are the CPU's
  // for the same master weights.
  const bool copies = o_.device == Device::cuda;
  auto held = [&](const Param& p) { return !o_.external_layers || p.layer < 0 || p.layer >= L_; };
  std::vector<bool> quantized(params_.size(), false);
  if (linear_.fp8()) {
    for (size_t i = 0; i < params_.size(); ++i)
      quantized[i] = params_[i].matrix && params_[i].name.starts_with("layers.");
    for (int64_t l = 0; l < c_.num_layers; ++l)
      for (int i : {moe_.router(l), moe_.shared_gate(l)})  // one-column products stay bf16
        if (i >= 0) quantized[i] = false;
  }
  auto fp8_copy = [&](Arena& a, const Param& p) {
    const Shape t = p.value.ndim() == 3 ? Shape{p.value.dim(0), p.value.dim(2), p.value.dim(1)}
                                        : Shape{p.value.dim(1), p.value.dim(0)};
    return Fp8Copy{a.alloc(DType::f8e4m3, p.value.shape), a.alloc(DType::f32, fp8_block_scale_shape(p.value.shape, false)),
                   a.alloc(DType::f8e4m3, t), a.alloc(DType::f32, fp8_block_scale_shape(p.value.shape, true)),
                   linear_.pow2()};
  };
  // offload.experts: master weights (Param::offloaded, the MoE block's choice) in one more
  // arena, in host memory, and with weights (Param::cached) their compute copies and
  // gradients too.
  Arena count_v = Arena::counting("parameters", o_.device), count_g = Arena::counting("gradients", o_.device),
        count_c = Arena::counting("compute weights", o_.device), count_q = Arena::counting("fp8 weights", o_.device),
        count_h = Arena::counting("parameters (host)", Device::cpu);
  // parallelism.expert_replicas: an expert Param's storage is S blocks wide, the Param
  // its first E/ep (models/expert_replicas.h).
  ExpertReplicas& replicas = moe_.replicas();
  auto storage = [&](const Param& p) {
    Shape s = p.value.shape;
    if (replicas.on() && p.expert) s.d[0] = replicas.slots();
    return s;
  };
  const bool copy = o_.head && D_ > 0 && embed_ < 0;
  if (copy) {
    embed_copy_.name = "embed (copy)";
    embed_copy_.value = Tensor(nullptr, {c_.vocab_size, D}, DType::f32, o_.device);
    count_v.alloc(DType::f32, embed_copy_.value.shape);
    count_g.alloc(DType::f32, embed_copy_.value.shape);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (!held(p)) continue;
    (p.offloaded ? count_h : count_v).alloc(DType::f32, storage(p));
    (p.cached ? count_h : count_g).alloc(DType::f32, storage(p));
    if (copies && p.matrix && !quantized[i]) (p.cached ? count_h : count_c).alloc(DType::bf16, storage(p));
    if (quantized[i]) fp8_copy(count_q, p);
  }
  auto arena = [&](const char* name, size_t bytes) {
    return o_.plan_only ? Arena::counting(name, o_.device) : Arena(name, o_.device, bytes);
  };
  values_ = arena("parameters", count_v.peak());
  grads_ = arena("gradients", count_g.peak());
  compute_ = arena("compute weights", count_c.peak());
  fp8_ = arena("fp8 weights", count_q.peak());
  host_values_ = o_.plan_only ? Arena::counting("parameters (host)", Device::cpu)
                              : Arena::host("parameters (host)", count_h.peak(), o_.device == Device::cuda);
  if (copy) {
    embed_copy_.value = embed_copy_.compute = values_.alloc(DType::f32, embed_copy_.value.shape);
    embed_copy_.grad = grads_.alloc(DType::f32, embed_copy_.value.shape);
    if (!o_.plan_only) mt::fill(embed_copy_.value, 0.0f);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (!held(p)) {
      p.value = Tensor(nullptr, p.value.shape, DType::f32, o_.device);
      p.grad = p.value;
      p.compute =
          copies && p.matrix && !quantized[i] ? Tensor(nullptr, p.value.shape, DType::bf16, o_.device) : p.value;
      continue;
    }
    const int64_t blocks = p.value.ndim() > 0 ? p.value.dim(0) : 0;
    Param wide = p;
    wide.value = (p.offloaded ? host_values_ : values_).alloc(DType::f32, storage(p));
    wide.grad = (p.cached ? host_values_ : grads_).alloc(DType::f32, storage(p));
    wide.compute = copies && p.matrix && !quantized[i]
                       ? (p.cached ? host_values_ : compute_).alloc(DType::bf16, storage(p))
                       : wide.value;
    const bool widened = replicas.on() && p.expert;
    if (widened)  // the R slots' share of the value, the gradient and a bf16 copy
      replica_bytes_ += (wide.value.nbytes() + wide.grad.nbytes() +
                         (wide.compute.dtype != wide.value.dtype ? wide.compute.nbytes() : 0)) /
                        static_cast<size_t>(replicas.slots()) * static_cast<size_t>(replicas.slots() - blocks);
    auto own = [&](const Tensor& t) { return widened ? t.rows(0, blocks) : t; };
    p.value = own(wide.value);
    p.grad = own(wide.grad);
    p.compute = own(wide.compute);
    // In mapped host memory the device's kernels (the norm, AdamW) reach them in place.
    if (p.cached && copies) p.grad.device = p.compute.device = o_.device;
    if (quantized[i]) p.fp8 = fp8_copy(fp8_, p);
    if (widened && !o_.plan_only) replicas.add(p.layer, static_cast<int>(i), wide);
    if (o_.plan_only) continue;
    mt::fill(wide.value, 0.0f);
    mt::fill(wide.grad, 0.0f);
  }
  if (!o_.plan_only) refresh_compute_weights(params_);
  rope_ = cpu::rope_freqs(c_.rope);
  moe_.make_cache();
}

std::vector<HfTensor> Decoder::hf_tensors() {
  std::vector<HfTensor> out;
  const float out_scale = static_cast<float>(1.0 / std::sqrt(2.0 * static_cast<double>(L_)));
  if (o_.embedding) out.push_back(hf_tensor("model.embed_tokens.weight", params_[embed_]));
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    const LayerIndex& x = layer_[l];
    std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back(hf_tensor(p + "input_layernorm.weight", params_[x.in_norm], 0.0f, 1.0f - c_.norm_weight_offset));
    mixer(l).hf_tensors(l, p + mixer(l).hf_module(), params_, out_scale, out);
    out.push_back(
        hf_tensor(p + "post_attention_layernorm.weight", params_[x.post_norm], 0.0f, 1.0f - c_.norm_weight_offset));
    if (c_.moe[l])
      moe_.hf_tensors(l, p, out_scale, out);
    else
      hf_mlp(out, p + "mlp.", params_[x.gate_up], params_[x.down], 0, out_scale, false);
  }
  if (o_.head) lm_.hf_tensors(out);
  for (int64_t k = 1; k <= D_ && o_.head; ++k) {
    const std::string p = "model.layers." + std::to_string(L_ + k - 1) + ".";
    const MtpIndex& x = mtp_[k - 1];
    out.push_back(hf_tensor(p + "enorm.weight", params_[x.enorm], 0.0f, 1.0f));
    out.push_back(hf_tensor(p + "hnorm.weight", params_[x.hnorm], 0.0f, 1.0f));
    out.push_back(hf_tensor(p + "eh_proj.weight", params_[x.eh_proj]));
    mtp_heads_[k - 1].hf_tensors(out, p + "shared_head.norm.weight");
  }
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
  s.L = L_;
  s.h.resize(L_ + 1);
  s.dh.resize(L_ + 1);
  for (int64_t l = 0; l <= L_; ++l) {
    if (!(l < L_ && held_[l]) && !(l > 0 && held_[l - 1]) && !(l == L_ && o_.head)) continue;
    s.h[l] = a.alloc(act_, {N, D});
    s.dh[l] = a.alloc(act_, {N, D});
  }
  s.layers.resize(c_.num_layers);
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    if (!held_[l]) continue;
    s.layers[l].attn = mixer(l).make_acts();
    Moe::Acts& x = s.layers[l].moe;
    if (!c_.moe[l]) continue;
    // What outlives a layer's activations (which full recomputation drops): its routing
    // statistics, read after the head's forward, and the balance gradient set then.
    const int64_t E = c_.num_experts;
    const ExpertReplicas& replicas = moe_.replicas();
    const int64_t slot_counts = replicas.on() ? moe_.ep()->size() * replicas.slots() : 0;
    const int64_t rows = o_.sequence_balance ? B : 0, seq_at = 2 * E + 1 + slot_counts;
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
  if (o_.force_balanced_routing) s.balanced_idx = i32({N, c_.router.top_k});
  if (D_ > 0) {
    s.mtp_ids = i32({D_, B, S});
    s.mtp_labels = i32({D_, B, S});
  }
}

std::vector<int64_t> Decoder::block_layers(int64_t first, int64_t last) const {
  std::vector<int64_t> out;
  for (int64_t l = first; l < last; ++l)
    if (held_[l]) out.push_back(l);
  if (last == L_ && o_.head)
    for (int64_t l = L_; l < L_ + D_; ++l) out.push_back(l);
  return out;
}

void Decoder::allocate_layers(DecoderStash& s, Arena& a, int64_t first, int64_t last) const {
  const int64_t N = s.batch * s.seq, D = c_.hidden_size, E = c_.num_experts, K = c_.router.top_k;
  const int64_t Is = c_.shared_intermediate_size;
  const bool ep = moe_.ep() != nullptr, replicas = moe_.replicas().on();
  auto f32 = [&](Shape sh) { return a.alloc(DType::f32, sh); };
  auto act = [&](Shape sh) { return a.alloc(act_, sh); };
  auto i32 = [&](Shape sh) { return a.alloc(DType::i32, sh); };
  // Gradients that only a layer's own B stages read, each written before it is read:
  // one set serves every layer (a stash's B stages run one layer at a time). What the
  // W stages read (d_hm, d_gu, d_logits_c, d_sgu) stays per layer. A MoE layer's
  // expert rows are not here: routing sizes them (Moe::take_rows).
  bool any_moe = false, any = false;
  int64_t hidden = 0;  // elements of the widest dense d_hs
  // Each mixer's layers, in the order the mixers first appear.
  std::vector<std::pair<Attention*, std::vector<AttentionActs*>>> attn;
  const std::vector<int64_t> layers = block_layers(first, last);
  for (int64_t l : layers) {
    any = true;
    any_moe = any_moe || c_.moe[l];
    if (!c_.moe[l]) hidden = std::max(hidden, N * c_.intermediate_size);
    auto it = std::find_if(attn.begin(), attn.end(), [&](const auto& m) { return m.first == &mixer(l); });
    if (it == attn.end()) it = attn.insert(attn.end(), {&mixer(l), {}});
    it->second.push_back(s.layers[l].attn.get());
  }
  if (!any && !(last == L_ && o_.head)) return;
  // Full recomputation keeps one layer's activations at a time: every layer of the
  // block gets the same bytes.
  const bool one_deep = o_.recompute == Recompute::full;
  if (!one_deep)
    for (auto& [m, layers] : attn) m->allocate(layers, a, act_, s.batch, s.seq);
  const Tensor d_y = act({N, D}), d_xn = act({N, D}), d_hs = hidden > 0 ? act({hidden}) : Tensor(),
               d_shs = any_moe && Is > 0 ? act({N, Is}) : Tensor();
  // What only a layer's forward reads (the router's logits, the MLP's or experts' output
  // and the shared experts'), and B's f32 router gradient where the products read a bf16
  // copy: one set for every layer too. Under selective the norms' outputs xn and y are
  // computed again in W (stage_backward_weight), so they are one set as well.
  const bool renorm = o_.recompute == Recompute::selective;
  const Tensor mo = act({N, D}), logits = any_moe ? f32({N, E}) : Tensor(),
               so = any_moe && Is > 0 ? act({N, D}) : Tensor(),
               gated = any_moe && c_.shared_expert_gate ? act({N, D}) : Tensor(),
               d_so = any_moe && c_.shared_expert_gate ? act({N, D}) : Tensor(),
               d_logits = any_moe && act_ != DType::f32 ? f32({N, E}) : Tensor(),
               xn = renorm ? act({N, D}) : Tensor(), y = renorm ? act({N, D}) : Tensor();
  size_t deepest = a.used();
  for (int64_t l : layers) {
    LayerActs& x = s.layers[l];
    const size_t start = a.used();
    if (one_deep) mixer(l).allocate({x.attn.get()}, a, act_, s.batch, s.seq);
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
      Moe::Acts& m = x.moe;
      if (ep) m.back = act({N * K, D});
      m.logits = logits;
      m.idx = i32({N, K});
      if (replicas) m.slots = i32({N, K});
      m.weight = f32({N, K});
      m.probs = f32({N, E});
      m.lse = f32({N});
      if (c_.router.scoring == cpu::RouterScoring::sigmoid) m.score_sum = f32({N});
      if (!ep) {  // the exchange's plan has its own
        m.offsets = i32({E + 1});
        m.order = i32({N * K});
        m.slot_row = i32({N * K});
      }
      m.d_weight = f32({N, K});
      m.d_logits = act_ == DType::f32 ? f32({N, E}) : d_logits;
      m.d_logits_c = act_ == DType::f32 ? m.d_logits : act({N, E});
      if (Is > 0) {
        m.sgu = act({N, 2 * Is});
        m.shs = act({N, Is});
        m.so = c_.shared_expert_gate ? act({N, D}) : so;  // gated, B reads it
        m.d_sgu = act({N, 2 * Is});
        m.d_shs = d_shs;
        if (c_.shared_expert_gate) {
          m.sg = act({N, 1});
          m.gated = gated;
          m.d_so = d_so;
          m.d_sg = act({N, 1});
        }
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
  if (last != L_ || !o_.head) return;
  lm_.allocate(s.head, a, act_, N, D);
  if (D_ == 0) return;
  s.mtp.resize(static_cast<size_t>(D_));
  const Tensor d_cat = act({N, 2 * D}), d_en = act({N, D}), d_hn = act({N, D}), d_e = act({N, D}),
               d_prev = act({N, D});
  for (MtpActs& x : s.mtp) {
    x.x = act({N, D});
    x.out = act({N, D});
    x.dx = act({N, D});
    x.dout = act({N, D});
    x.e = act({N, D});
    x.en = act({N, D});
    x.rstd_e = f32({N});
    x.hn = act({N, D});
    x.rstd_h = f32({N});
    x.cat = act({N, 2 * D});
    x.d_cat = d_cat;
    x.d_en = d_en;
    x.d_hn = d_hn;
    x.d_e = d_e;
    x.d_prev = d_prev;
  }
}

std::unique_ptr<Stash> Decoder::make_bare_stash(int64_t batch, int64_t seq) {
  MT_CHECK(batch >= 1 && seq >= 1) << "a micro-batch needs at least one sequence of one token, got " << batch << "x"
                                   << seq;
  auto s = std::make_unique<DecoderStash>();
  s->batch = batch;
  s->seq = seq;
  // Plan with a counting arena, then allocate the same sequence for real.
  Arena plan = Arena::counting("activations", o_.device);
  allocate_bare(*s, plan);
  s->bytes = plan.peak();
  if (o_.plan_only) return s;
  s->arena = Arena("activations", o_.device, plan.peak());
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
    if (x.moe.dprobs.data != nullptr) mt::fill(x.moe.dprobs, 0.0f);
  if (o_.force_balanced_routing) {
    std::vector<int32_t> idx(static_cast<size_t>(batch * seq * c_.router.top_k));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i % c_.num_experts);
    mt::copy(s->balanced_idx, Tensor(idx.data(), s->balanced_idx.shape, DType::i32));
  }
  return s;
}

std::unique_ptr<ActivationBlock> Decoder::make_block(int64_t batch, int64_t seq, int64_t first, int64_t last) {
  MT_CHECK(0 <= first && first <= last && last <= L_)
      << "an activation block for layers [" << first << ", " << last << ") of " << L_;
  auto b = std::make_unique<DecoderBlock>();
  b->first = first;
  b->last = last;
  DecoderStash shape;  // the views are thrown away: only the sizes count
  shape.batch = batch;
  shape.seq = seq;
  shape.layers.resize(static_cast<size_t>(c_.num_layers));
  for (int64_t l : block_layers(first, last)) shape.layers[l].attn = mixer(l).make_acts();
  b->arena = Arena::counting("activations", o_.device);
  allocate_layers(shape, b->arena, first, last);
  b->bytes = b->arena.peak();
  if (o_.plan_only) return b;
  b->arena = Arena("activations", o_.device, b->bytes);
  return b;
}

void Decoder::lend(Stash& base, ActivationBlock& block) {
  auto& s = static_cast<DecoderStash&>(base);
  auto& b = static_cast<DecoderBlock&>(block);
  // The same allocation sequence from the start of the block's arena: the same views.
  b.arena.reset();
  allocate_layers(s, b.arena, b.first, b.last);
}

void Decoder::embed_forward(Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  embedding_forward(W(embed_), s.ids.view({s.batch * s.seq}), s.h[0]);
}

void Decoder::attention_forward(int64_t l, DecoderStash& s) {
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const float eps = static_cast<float>(c_.rms_norm_eps);
  rmsnorm_forward(s.in(l), W(w.in_norm), eps, x.xn, x.rstd1, c_.norm_weight_offset);
  // hm = h + attention: the residual, then the attention's output projection onto it.
  mt::copy(x.hm, s.in(l));
  mixer(l).forward(l, params_, *x.attn, io(s, x));
  rmsnorm_forward(x.hm, W(w.post_norm), eps, x.y, x.rstd2, c_.norm_weight_offset);
}

// A MoE layer's block runs after the decoder's part of a forward stage (its router reads
// y) and before its part of a backward one (it adds to d_y, which the post-attention
// norm's backward reads). A plan runs only the block's: it takes and gives back rows.
void Decoder::stage_forward(int64_t l, Stage stage, Stash& base) {
  MT_CHECK(l >= 0 && l < c_.num_layers && held_[l]) << "forward of layer " << l << ", which is not built here";
  auto& s = static_cast<DecoderStash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.moe[l];
  // A stage after an exchange reads its results: one a schedule has not finished yet is
  // finished here (correct, only without the overlap).
  finish_exchange(s, l);
  const bool run = !o_.plan_only;
  if (run && stage == Stage::attention) attention_forward(l, s);
  if (run && stage == Stage::experts && !moe) {
    linear_.forward(x.y, {{params_[w.gate_up], x.gu}});
    swiglu_forward(x.gu, x.hs);
    linear_.forward(x.hs, {{params_[w.down], x.mo}});
  }
  if (run && stage == Stage::aggregate) mt::add(x.hm, x.mo, s.out(l));
  if (moe) moe_.forward(l, stage, x.moe, moe_io(s, l));
}

void Decoder::recompute_layer(int64_t l, Stash& s) {
  Moe::Acts& x = layer_acts(s, l).moe;
  x.recomputing = true;
  for (Stage st : {Stage::attention, Stage::dispatch, Stage::experts, Stage::combine}) {
    stage_forward(l, st, s);
    finish_exchange(s, l);
  }
  x.recomputing = false;
}

void Decoder::attention_backward_input(int64_t l, DecoderStash& s) {
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  // d_hm = dh[l+1] (the residual) + the post-attention norm's input gradient.
  // The norms' weight gradients are taken here, with their input gradients, not in W:
  // their dy buffers are shared by every layer (allocate), and the pass is one.
  rmsnorm_backward(x.hm, W(w.post_norm), x.rstd2, x.d_y, x.d_hm, Z(w.post_norm), s.d_out(l), c_.norm_weight_offset);
  mixer(l).backward_input(l, params_, *x.attn, io(s, x));
  rmsnorm_backward(s.in(l), W(w.in_norm), x.rstd1, x.d_xn, s.d_in(l), Z(w.in_norm), x.d_hm, c_.norm_weight_offset);
}

void Decoder::stage_backward_input(int64_t l, Stage stage, Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.moe[l];
  const Tensor& d_mo = s.d_out(l);  // aggregate: h[l+1] = hm + mo, so d_mo = d_hm = dh[l+1]
  finish_exchange(s, l);  // as in stage_forward
  // The layer's first B (the aggregate's) finds its activations recomputed.
  if (o_.recompute == Recompute::full && stage == Stage::aggregate) recompute_layer(l, s);
  if (moe) moe_.backward_input(l, stage, x.moe, moe_io(s, l));
  if (o_.plan_only) return;
  if (stage == Stage::experts && !moe) {
    linear_.backward_input(d_mo, params_[w.down], x.d_hs);
    swiglu_backward(x.gu, x.d_hs, x.d_gu);
    linear_.backward_input(x.d_gu, params_[w.gate_up], x.d_y);
  }
  if (stage == Stage::attention) attention_backward_input(l, s);
}

void Decoder::stage_backward_weight(int64_t l, Stage stage, Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  const LayerIndex& w = layer_[l];
  LayerActs& x = s.layers[l];
  const bool moe = c_.moe[l];
  // selective: the norms' outputs that this W reads, computed again (allocate_layers).
  const float eps = static_cast<float>(c_.rms_norm_eps);
  const bool renorm = o_.recompute == Recompute::selective && !o_.plan_only;
  if (renorm && (stage == Stage::experts || (stage == Stage::attention && moe)))
    rmsnorm_forward(x.hm, W(w.post_norm), eps, x.y, x.rstd2, c_.norm_weight_offset);
  if (renorm && stage == Stage::attention)
    rmsnorm_forward(s.in(l), W(w.in_norm), eps, x.xn, x.rstd1, c_.norm_weight_offset);
  if (moe) moe_.backward_weight(l, stage, x.moe, moe_io(s, l));
  if (o_.plan_only) return;
  if (stage == Stage::experts && !moe) {
    linear_.backward_weight(x.hs, {{s.d_out(l), params_[w.down]}});
    linear_.backward_weight(x.y, {{x.d_gu, params_[w.gate_up]}});
  }
  if (stage == Stage::attention) mixer(l).backward_weight(l, params_, *x.attn, io(s, x));
}

LossSum Decoder::head_forward(Stash& base, float grad_scale) {
  auto& s = static_cast<DecoderStash&>(base);
  // The depths first: their heads use the main head's buffers, which its forward then
  // leaves to its B. Evaluation (no grad_scale) runs the main head only.
  s.mtp_loss.clear();
  if (D_ > 0 && grad_scale > 0) s.mtp_loss = mtp_forward(s, grad_scale);
  s.loss = lm_.forward(s.h[L_], s.labels.view({s.batch * s.seq}), s.head, grad_scale);
  return s.loss;
}

void Decoder::head_backward_input(Stash& base, float scale) {
  auto& s = static_cast<DecoderStash&>(base);
  lm_.backward_input(s.h[L_], s.labels.view({s.batch * s.seq}), s.head, scale, s.dh[L_]);
  if (!s.mtp_loss.empty()) mtp_backward(s);
}

std::vector<LossSum> Decoder::mtp_forward(DecoderStash& s, float grad_scale) {
  const int64_t N = s.batch * s.seq, D = c_.hidden_size;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  // Depth k's labels are the sequence's positions but its last k, so its mean takes
  // global_batch x (S - k) of them: lambda / D over that, where grad_scale is 1 over
  // global_batch x S (the whole sequence's S, every cp rank's chunks together).
  const double S = static_cast<double>(s.seq) * (attend_.cp ? attend_.cp->size() : 1);
  std::vector<LossSum> losses;
  for (int64_t k = 1; k <= D_; ++k) {
    const int64_t l = L_ + k - 1;
    const MtpIndex& w = mtp_[k - 1];
    MtpActs& x = s.mtp[k - 1];
    const Tensor& prev = k == 1 ? s.h[L_] : s.mtp[k - 2].out;
    const Tensor ids = s.mtp_ids.rows(k - 1, k).view({N}), labels = s.mtp_labels.rows(k - 1, k).view({N});
    embedding_forward(mtp_embedding().value, ids, x.e);
    rmsnorm_forward(x.e, W(w.enorm), eps, x.en, x.rstd_e);
    rmsnorm_forward(prev, W(w.hnorm), eps, x.hn, x.rstd_h);
    mt::copy_columns(x.cat, 0, x.en, 0, D, false);
    mt::copy_columns(x.cat, D, x.hn, 0, D, false);
    linear_.forward(x.cat, {{params_[w.eh_proj], x.x}});
    for (Stage st : kStages) {
      stage_forward(l, st, s);
      finish_exchange(s, l);
    }
    const float scale = static_cast<float>(grad_scale * o_.mtp_loss_weight / static_cast<double>(D_) * S /
                                           std::max(S - static_cast<double>(k), 1.0));
    Head& head = mtp_heads_[k - 1];
    losses.push_back(head.forward(x.out, labels, s.head, scale));
    head.backward_input(x.out, labels, s.head, scale, x.dout);
    head.backward_weight(s.head, N);
  }
  return losses;
}

void Decoder::mtp_backward(DecoderStash& s) {
  const int64_t N = s.batch * s.seq, D = c_.hidden_size;
  for (int64_t k = D_; k >= 1; --k) {
    const int64_t l = L_ + k - 1;
    const MtpIndex& w = mtp_[k - 1];
    MtpActs& x = s.mtp[k - 1];
    // Its output's gradient: its head's (from the forward), and the next depth's hnorm's.
    if (k < D_) mt::add(x.dout, x.d_prev, x.dout);
    for (auto it = std::rbegin(kStages); it != std::rend(kStages); ++it) {
      stage_backward_input(l, *it, s);
      finish_exchange(s, l);
      stage_backward_weight(l, *it, s);
    }
    linear_.backward_input(x.dx, params_[w.eh_proj], x.d_cat);
    linear_.backward_weight(x.cat, {{x.dx, params_[w.eh_proj]}});
    mt::copy_columns(x.d_en, 0, x.d_cat, 0, D, false);
    mt::copy_columns(x.d_hn, 0, x.d_cat, D, D, false);
    rmsnorm_backward(x.e, W(w.enorm), x.rstd_e, x.d_en, x.d_e, Z(w.enorm));
    embedding_backward(s.mtp_ids.rows(k - 1, k).view({N}), x.d_e, grad_zeroed(mtp_embedding()));
    const Tensor& prev = k == 1 ? s.h[L_] : s.mtp[k - 2].out;
    rmsnorm_backward(prev, W(w.hnorm), x.rstd_h, x.d_hn, x.d_prev, Z(w.hnorm));
  }
  mt::add(s.dh[L_], s.mtp[0].d_prev, s.dh[L_]);
}

void Decoder::head_backward_weight(Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  lm_.backward_weight(s.head, s.batch * s.seq);
}

void Decoder::embed_backward(Stash& base) {
  auto& s = static_cast<DecoderStash&>(base);
  // Tied, the head's W may have started this gradient already: Z then adds to it.
  embedding_backward(s.ids.view({s.batch * s.seq}), s.dh[0], Z(embed_));
}

std::vector<RouterStats> Decoder::router_stats(const Stash& base) const {
  const auto& s = static_cast<const DecoderStash&>(base);
  std::vector<RouterStats> out;
  for (int64_t l = 0; l < c_.num_layers; ++l)
    if (held_[l] && c_.moe[l]) out.push_back(moe_.router_stats(l, s.layers[l].moe, s.batch * s.seq));
  return out;
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
  const int64_t per_group = d.num_experts / std::max<int64_t>(d.router.n_group, 1);
  MT_CHECK(!any_moe || d.router.top_k <= d.router.topk_group * per_group)
      << where << ": num_experts_per_tok " << d.router.top_k << " is more than the " << d.router.topk_group * per_group
      << " experts of topk_group " << d.router.topk_group << " groups of " << per_group;
  MT_CHECK(!any_moe || d.router.scoring != cpu::RouterScoring::sigmoid || d.router.n_group == 1 || per_group >= 2)
      << where << ": n_group " << d.router.n_group << " leaves groups of one expert, and noaux_tc ranks a group by "
      << "the sum of its two best scores";
  const bool any_dense = std::find(d.moe.begin(), d.moe.end(), false) != d.moe.end();
  MT_CHECK(!any_dense || d.intermediate_size > 0)
      << where << ": intermediate_size must be positive for the dense layers, got " << d.intermediate_size;
}

std::unique_ptr<Model> make_decoder(const DecoderSpec& spec, Mixers mixers, const ModelOptions& options) {
  const int64_t layers = spec.num_layers + spec.mtp_depths;  // the depths' layers too
  MT_CHECK(static_cast<int64_t>(spec.moe.size()) == layers)
      << "decoder spec: " << spec.moe.size() << " MoE flags for " << layers << " layers";
  MT_CHECK(static_cast<int64_t>(mixers.size()) == layers &&
           std::find(mixers.begin(), mixers.end(), nullptr) == mixers.end())
      << "decoder spec: " << mixers.size() << " token mixers for " << layers << " layers (one a layer)";
  return std::make_unique<Decoder>(spec, std::move(mixers), options);
}

Mixers every_layer(std::shared_ptr<Attention> mixer, int64_t layers) {
  return Mixers(static_cast<size_t>(std::max<int64_t>(layers, 0)), std::move(mixer));
}

}  // namespace mt
