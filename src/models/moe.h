// The MoE block: a MoE layer's channel block, from the post-attention norm's output y to
// h' = hm + mo (+ the shared experts' so). The decoder (decoder.h) owns one and calls it
// at each stage of a MoE layer, after its own part of a forward stage and before its own
// part of a backward one:
//   attention  route: the router (`mlp.gate`, or GPT-OSS's `mlp.router` with a bias),
//              top-k with the expert bias (kernels/router.h) or balanced, its statistics
//   dispatch   rows by expert on this rank (kernels/dispatch.h; a capacity keeps the
//              first) or over ep (parallel/expert_parallel.h; expert_replicas.h's slots)
//   experts    grouped gate_up, SwiGLU, down (line by line from expert_cache.h with
//              offload.experts = weights); the shared experts on every token
//   combine    each token's k outputs weighted into mo
//   aggregate  the shared experts' output added to h'
// The gradient enters at the combine's B (d mo = d h') and reaches d_y through the
// experts and the dispatch; at the attention stage's B the router's backward adds the
// balance loss's dprob (set_router_prob_grad) and the z-loss (set_router_z_loss) to the
// logits' gradient, whose product adds to d_y. Expert rows live only while needed (row_lives).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "models/expert_cache.h"
#include "models/expert_replicas.h"
#include "parallel/buffer.h"
#include "parallel/expert_parallel.h"

namespace mt {

class Moe {
 public:
  // The per-row tensors of a layer's experts (Acts::held), sized by the rows its routing
  // brings here and held only while the layer needs them (row_lives).
  enum Row : uint8_t { kXs, kGu, kHs, kYs, kDYs, kDGu, kDHs, kDXs, kRowTensors };

  // A MoE layer's activations for one micro-batch, in the decoder's stash (which
  // allocates them). N = batch * seq tokens, R = the routed rows this rank's experts got
  // (N * top_k without expert parallelism or a capacity).
  struct Acts {
    Tensor logits, idx, weight, probs, dprobs;  // router (f32)
    Tensor lse;  // [N] logsumexp of the router's logits (the z-loss's backward reads it)
    Tensor score_sum;  // [N] with sigmoid scoring: each token's sum of scores (kernels/router.h)
    // prob_sum f32 [E] (probs summed over tokens), counts i32 [E] (slots each expert kept)
    // and z_sum f32 [1] (the router z-loss's sum, when on) side by side in `stats`, so the
    // metrics read them in one copy; with sequence_balance also per stash row, seq_prob_sum
    // f32 [B,E] and seq_counts i32 [B,E] (the router's choices).
    Tensor stats, prob_sum, counts, z_sum, seq_prob_sum, seq_counts;
    // With expert replicas: the slots [N,k] the router's choices go to, and the rows each
    // slot got [ep * S] (in `stats` too; router_stats turns them into counts).
    Tensor slots, slot_counts;
    Tensor offsets, order, slot_row;  // dispatch plan (without expert parallelism)
    int64_t dropped = 0;              // slots over capacity
    Tensor xs, gu, hs, ys;            // the experts' rows
    Tensor sgu, shs, so;              // shared experts: [N, 2Is], [N, Is], output [N, D]
    // With its gate (DecoderSpec::shared_expert_gate): the gate's logit sg [N, 1] and the
    // gated output [N, D]; B's d_so [N, D] (W makes it again) and d_sg [N, 1].
    Tensor sg, gated, d_so, d_sg;
    // The rows R this micro-batch brought to this rank's experts, and the row tensors
    // held now (xs .. d_xs are views of them, R rounded up to kRowRounding).
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
    Tensor d_ys, d_weight, d_hs, d_gu, d_xs, d_logits, d_logits_c, d_sgu, d_shs;
  };

  // What the block sees of its layer and micro-batch: the decoder's tensors.
  struct Io {
    int64_t tokens = 0;  // N
    Tensor y, d_y;       // the block's input [N, D] and its gradient (B writes it)
    Tensor mo;           // the routed experts' output [N, D]
    Tensor h_next, d_next;  // the layer's output h[l+1] and its gradient (d mo)
    Tensor all_rows;        // i32 {0, N} (AttentionIo::all_rows)
    Tensor balanced_idx;    // force_balanced_routing: the fixed expert choice [N, k]
  };

  // The block adds its parameters to the decoder's `params` and runs its products
  // through the decoder's `linear`.
  Moe(const DecoderSpec& c, const ModelOptions& o, std::vector<Param>& params, const Linear& linear);

  // Layer l's parameters, names starting with `prefix` (with offload.experts their
  // storage marked: Param::offloaded, cached); the expert cache, once every Param has
  // its storage; layer l's tensors under Hugging Face names.
  void add_params(int64_t l, const std::string& prefix);
  void make_cache();
  void hf_tensors(int64_t l, const std::string& prefix, float out_scale, std::vector<HfTensor>& out) const;
  // Layer l's expert bias under its Hugging Face name, with sigmoid scoring (DeepSeek-V3's
  // `mlp.gate.e_score_correction_bias`, Model::hf_buffers), after make_cache.
  void hf_buffers(int64_t l, const std::string& prefix, std::vector<HfTensor>& out) const;
  // A key of an expert that another ep rank holds.
  bool another_ranks_expert(const std::string& name) const;
  int router(int64_t l) const { return index_[l].router; }  // -1: none here
  int shared_gate(int64_t l) const { return index_[l].shared_gate; }  // -1: none
  int64_t local_experts() const { return local_experts_; }
  comm::Communicator* ep() const { return ep_; }  // null: every expert lives here
  ExpertCache& cache() { return cache_; }
  const ExpertCache& cache() const { return cache_; }
  ExpertReplicas& replicas() { return replicas_; }
  const ExpertReplicas& replicas() const { return replicas_; }

  // Layer l's stages (a plan's only take and give back their rows). A layer has at most
  // one exchange in flight: finish_exchange finishes it, whichever it is.
  void forward(int64_t l, Stage stage, Acts& x, const Io& io);
  void backward_input(int64_t l, Stage stage, Acts& x, const Io& io);
  void backward_weight(int64_t l, Stage stage, Acts& x, const Io& io);
  void finish_exchange(Acts& x, const Io& io) const;

  // As Model's functions of these names, for one layer.
  RouterStats router_stats(int64_t l, const Acts& x, int64_t tokens) const;
  void set_router_prob_grad(int64_t l, Acts& x, const std::vector<float>& dprob);
  void set_router_z_loss(double scale);
  void set_expert_bias(int64_t l, const std::vector<float>& bias);
  std::vector<float> expert_bias(int64_t l) const;
  RowMemory row_memory() const;
  void reset_row_memory();

 private:
  struct RowPool;
  enum class Pass : uint8_t { forward, backward_input, backward_weight };
  // Where a layer's parameters sit in params_ (indices, so the vector may grow).
  struct Index {
    int router = -1;              // [E, D]
    int gate_up = -1, down = -1;  // [E, 2I, D] and [E, D, I]
    int shared_gate_up = -1, shared_down = -1;                // shared experts: [2Is, D], [D, Is]
    int shared_gate = -1;                                     // its gate: [1, D]
    int router_bias = -1, gate_up_bias = -1, down_bias = -1;  // GPT-OSS: [E], [E, 2I], [E, D]
  };
  bool holds(int64_t l) const { return l >= 0 && l < c_.num_layers && router(l) >= 0; }
  // A bias Param's value or gradient (a grouped GEMM's), empty for none (index -1).
  Tensor bias(int i) { return i >= 0 ? X(i).value : Tensor(); }
  Tensor grad_of(int i) { return i >= 0 ? X(i).grad : Tensor(); }
  // An expert Param as the grouped products see it: with replicas all S blocks, the
  // replicas' after its own (models/expert_replicas.h).
  Param& X(int i) { return replicas_.on() && params_[i].expert ? replicas_.wide(i) : params_[i]; }
  // The expert path of a MoE layer for this micro-batch: the R rows its routing brought
  // to this rank's experts (every routed row, the first R under a capacity, or with
  // expert parallelism what the exchange brought), of the row tensors held now.
  struct Routed {
    Tensor xs, gu, hs, ys, d_ys, d_hs, d_gu, d_xs, offsets;
  };
  Routed routed(Acts& x) const {
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
  static Tensor& row_view(Acts& x, Row r);
  // The rows this rank's experts get in a plan: routing_skew times the balanced share,
  // within what the exchange (or a capacity) can bring.
  int64_t planned_rows(int64_t tokens) const;
  // Takes the row tensors that (stage, pass) starts with, and gives back those it ends.
  void take_rows(int64_t l, Acts& x, Stage stage, Pass pass, int64_t tokens);
  void give_rows(Acts& x, Stage stage, Pass pass);
  // A plan's stage: only the rows it would take and give back.
  void plan_rows(int64_t l, Stage stage, Pass pass, Acts& x, int64_t tokens);
  // The rows a forward stage ends with given back: with full recomputation the first
  // forward keeps none past its combine (the backward's recompute takes them again).
  void end_forward_rows(Acts& x, Stage stage);
  // Rows each expert keeps of a micro-batch of n tokens (0: all).
  int64_t capacity(int64_t n) const;
  // offload.experts = weights: layer l's routed experts' pass, line by line from the
  // expert cache (models/expert_cache.h).
  void cached_experts(int64_t l, Acts& x, Pass pass);

  DecoderSpec c_;
  ModelOptions o_;  // as given: ep_, offload_weights_ and expert_replicas_ are what they come to
  int64_t k_;       // experts a token goes to
  std::vector<Param>& params_;
  const Linear& linear_;
  DType act_;             // activations: bf16 on the GPU, f32 on the CPU
  bool offload_weights_;  // offload.experts = weights: through cache_
  ExpertCache cache_;
  int64_t expert_replicas_;  // R replica slots a rank (0: none)
  ExpertReplicas replicas_;
  double z_scale_ = 0;  // the router z-loss's factor on its sum (0: off)
  // The routers' expert biases [E] per layer (empty until set_expert_bias, or with sigmoid
  // scoring made zero by make_cache), in bias_arena_.
  void make_expert_bias();
  Arena bias_arena_;
  std::vector<Tensor> expert_bias_;
  comm::Communicator* ep_;  // null: every expert lives here
  int64_t local_experts_ = 0, first_expert_ = 0;
  std::shared_ptr<RowPool> pool_;  // shared with the rows held, which give back into it
  std::vector<Index> index_;       // per layer (router -1: not a MoE layer held here)
  std::vector<RowLife> lives_;     // row_lives(), made once
};

}  // namespace mt
