// The stage protocol: what the trainer and the pipeline schedule see of a model.
//
// A model is an embedding, L decoder layers and a head. Each layer is cut into five
// stages (attention + router, dispatch, experts, combine, aggregate); each stage has
// a forward, a backward_input (B: gradients of its inputs) and a backward_weight
// (W: gradients of its parameters, which DualPipeV defers). Everything a backward
// needs lives in the micro-batch's Stash. The trainer never looks inside a layer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/param.h"
#include <nlohmann/json_fwd.hpp>

#include "core/tensor.h"
#include "models/linear.h"

namespace mt::comm {
class Communicator;
}

namespace mt {

class ExpertReplicas;  // models/expert_replicas.h

enum class Stage : uint8_t { attention, dispatch, experts, combine, aggregate };
constexpr Stage kStages[] = {Stage::attention, Stage::dispatch, Stage::experts, Stage::combine, Stage::aggregate};

// One Hugging Face tensor: a view into a Param (an expert's gate_proj is a slice of
// its layer's fused block). Checkpoints, import and export go through these.
struct HfTensor {
  std::string name;  // the Hugging Face key
  Tensor value;
  Tensor grad;
  // Random initialisation: N(0, init_std * init_scale), or the constant `fill` when
  // init_scale is 0 (norm weights).
  float init_scale = 1.0f;
  float fill = 0.0f;
  bool expert = false;  // an expert's weight (owned by one ep rank)
  // Where a Hugging Face folder keeps it (import, export-hf), when not as `name`: expert
  // `fused_index`'s slice of the key `fused`, which holds all of a layer's experts [E, ...]
  // (GPT-OSS); `transposed`: that slice is this tensor's transpose (its last two dims
  // swapped). Checkpoints keep `name`, one key per expert, in this tensor's layout.
  std::string fused;
  int64_t fused_index = 0;
  bool transposed = false;
};

// The shape a Hugging Face folder keeps t in: t's own, or where `fused` is set, that key's
// [experts, ...] (the slice's last two dims swapped where `transposed`).
std::vector<int64_t> hf_shape(const HfTensor& t, int64_t experts);

// Per MoE layer, per micro-batch: what the load-balance loss and the metrics need.
struct RouterStats {
  int64_t layer = 0;
  int64_t tokens = 0;                // tokens routed
  int64_t top_k = 0;
  std::vector<int64_t> counts;       // slots routed to each expert
  std::vector<double> prob_sum;      // sum over tokens of the router probability
  double z_sum = 0;                  // with the router z-loss: sum over tokens of logsumexp(logits)^2
  // With expert replicas: the rows each slot of the ep ranks got (rank r's slot i at
  // r x S + i; models/expert_replicas.h), of which `counts` are the sums by expert.
  std::vector<int64_t> slot_counts;
  int64_t dropped = 0;               // slots over an expert's capacity (capacity_factor)
  // ModelOptions::sequence_balance: per stash row (a sequence, or with context
  // parallelism this rank's chunks of it) of seq_tokens tokens, [rows, E] row-major: the
  // router's choices of each expert and the probabilities summed.
  int64_t seq_rows = 0, seq_tokens = 0;
  std::vector<int64_t> seq_counts;
  std::vector<double> seq_prob_sum;
};

// Activation memory for the layers [first, last) of one micro-batch (with the head's
// buffers where last is the model's L and the head is here), lent to one stash at a
// time (Model::lend). A schedule that keeps a micro-batch's layers alive for different
// spans, as DualPipeV does a rank's two chunks, gives each chunk's span its own block.
struct ActivationBlock {
  virtual ~ActivationBlock() = default;
  int64_t first = 0, last = 0;
  size_t bytes = 0;
};

struct LossSum {
  double sum = 0;
  int64_t count = 0;
};

// A micro-batch: its tokens, the residual stream, and through a lent block every
// activation its backward will need.
struct Stash {
  virtual ~Stash() = default;
  int64_t batch = 0, seq = 0;
  size_t bytes = 0;  // activation memory held: its own block counts, lent ones do not
  std::unique_ptr<ActivationBlock> own;  // make_stash: the block of every layer here
  Tensor ids;     // i32 [batch, seq]
  Tensor labels;  // i32 [batch, seq]
  // Multi-token prediction (Model::mtp_depths D > 0), i32 [D, batch, seq]: plane k-1
  // holds, for depth k, the token k positions ahead (its embedding input; 0 past the
  // sequence's end) and the token k + 1 ahead (its label; kIgnoreIndex past the end),
  // cut from the whole sequence before the cp split (train/trainer.cpp, mtp_tokens).
  Tensor mtp_ids, mtp_labels;
  std::vector<LossSum> mtp_loss;  // the last training head_forward's, per depth
  // The residual stream [batch * seq, hidden] entering layer l (l = L: the head's input)
  // and its gradient, where this rank has a layer or the head next to it (empty
  // elsewhere): what pipeline stages send each other.
  std::vector<Tensor> h, dh;
};

// The expert cache's traffic since its last flush (offload.experts = weights,
// models/expert_cache.h): experts found in a device frame and fetched, the bytes each
// way, and the compute's waits for them.
struct ExpertCacheStats {
  int64_t hits = 0, misses = 0;
  int64_t bytes_in = 0, bytes_out = 0;
  // Seconds the compute waited for the cache's copies (on the CPU backend, whose copies
  // are the compute's own, all of their time).
  double wait_s = 0;
  // [layer][expert of this rank]: the passes that used each expert, and those that found
  // it in a frame (the residency beside the expert loads).
  std::vector<std::vector<int64_t>> expert_uses, expert_hits;
};

// The memory routing decides: a MoE layer's per-row expert tensors for one micro-batch,
// sized by the rows its routing brings here and held only while the layer needs them
// (models/moe.cpp, Moe::row_lives, says which tensors and when). Counted since the last
// reset_row_memory.
struct RowMemory {
  size_t peak = 0;   // the most bytes held at once
  double skew = 0;   // the most rows a layer's micro-batch brought here over its balanced share (tokens * k)
};

enum class Recompute : uint8_t { none, selective, full };

struct ModelOptions {
  Device device = Device::cpu;  // where parameters, gradients and activations live
  // Benchmarks: every token goes to experts (t*k + j) mod E with weight 1/k, so speed
  // does not depend on what the router learned (the router still trains on the
  // load-balance term).
  bool force_balanced_routing = false;
  // training.load_balance_type = sequence: the router statistics also per sequence (a
  // stash row; RouterStats::seq_*), and the balance gradient a row per sequence.
  bool sequence_balance = false;
  // `moetrain plan`: arenas only count bytes; no memory is allocated or written. The
  // stages then only take and give back their expert rows, counted, as a run would,
  // with each MoE layer bringing `routing_skew` times its balanced share of rows here
  // (at most what the exchange can bring), so a schedule played against the model gives
  // the rows' peak (train/schedule.h, row_peak).
  bool plan_only = false;
  double routing_skew = 1.0;
  // The bytes the expert rows may take at once (0: what the device gives): what
  // training.device_memory_limit leaves once the planned arenas are taken.
  size_t row_memory_limit = 0;
  // Expert parallelism: the experts are split evenly over this group's ranks and the
  // dispatch and combine stages exchange tokens over it.
  comm::Communicator* ep = nullptr;
  // Capacity factor (training.capacity_factor): each expert keeps at most
  // ceil(factor * tokens * top_k / experts) rows of a micro-batch, the earliest tokens
  // first; the others are dropped (their slot adds nothing) and counted. 0: dropless.
  double capacity_factor = 0.0;
  // Context parallelism: a stash's `seq` positions are this rank's zigzag chunks of
  // sequences cp times longer, and attention runs as ring attention over this group.
  comm::Communicator* cp = nullptr;
  // ZeRO-3 (parallel/zero3.h): the decoder layers' Params (layer 0 .. L-1) get no
  // storage; they keep their shapes with null data, and whoever gathers a layer points
  // its value, grad and compute at memory of its own before the layer's stages run.
  // The embedding and the head are allocated as usual.
  bool external_layers = false;
  // Pipeline parallelism: the decoder layers this rank builds (global indices, sorted;
  // empty: all), and whether it holds the embedding and the head. Layers keep their
  // global index in every call and name.
  std::vector<int64_t> layers;
  bool embedding = true, head = true;
  // training.activation_checkpoint. full: between a layer's forward and its backward
  // only its input (the stash's h[l]) and its routing statistics are kept; its first
  // backward stage runs the layer's forward again (exchanges included, so every ep rank
  // recomputes at the same point), and a block holds one layer's activations, shared by
  // its layers (so W must follow each layer's B before the next layer's, as
  // ScheduleShape::defer_weights = false makes DualPipeV do). selective: the norms'
  // outputs xn and y are computed again in W, the experts' SwiGLU output in their B and,
  // without ep, their input rows in their W (models/decoder.cpp: allocate_layers, and
  // models/moe.cpp: Moe::row_lives).
  Recompute recompute = Recompute::none;
  // training.fp8 and training.fp8_scale: the linear layers' products (models/linear.h).
  Fp8 fp8 = Fp8::none;
  bool fp8_pow2 = true;
  // offload.experts = optimizer: the routed experts' matrices keep their f32 master
  // weights in host memory (pinned on the GPU; Param::offloaded), their compute copies and
  // gradients on the device (train/offload.h streams their update).
  bool offload_experts = false;
  // offload.layers: only the first this many MoE layers this rank holds (0: all of them).
  int64_t offload_layers = 0;
  // offload.experts = weights (with offload_experts): their compute copies and gradients
  // in host memory too, `expert_slots` experts of them on the device at once (0: two
  // layers' worth), through the expert cache (models/expert_cache.h).
  bool offload_weights = false;
  int64_t expert_slots = 0;
  // The experts a cache line holds (0: a layer's when the slots hold one, else half the
  // slots); generation takes 1.
  int64_t expert_line = 0;
  // parallelism.expert_replicas: R slots a rank more for copies of hot experts of other
  // ranks (models/expert_replicas.h; needs ep, dropless).
  int64_t expert_replicas = 0;
  // DeepSeek-V3's multi-token prediction (config.json's num_nextn_predict_layers D):
  // whether its D depths are built, with the head (false: a folder's MTP keys are
  // refused, never dropped; train/checkpoint.h, has_mtp_weights, says where the tools
  // build them), and lambda, training.mtp_loss_weight: a training forward adds lambda / D
  // times the sum over depths of their mean cross-entropies.
  bool mtp = false;
  double mtp_loss_weight = 0.3;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual Device device() const = 0;
  virtual bool balanced_routing() const = 0;

  // Layers of the whole model; is_moe_layer answers for any of them, held here or not.
  virtual int64_t num_layers() const = 0;
  // Multi-token prediction's depths D, built with the head (models/decoder.h): their
  // decoder layers are L .. L + D - 1 after the model's L, which is_moe_layer,
  // router_stats, set_router_prob_grad and the expert bias take as any other layer's.
  // The schedules never see them: head_forward runs them (when it is given a grad_scale)
  // and head_backward_input their backward. all_layers() is L + D.
  virtual int64_t mtp_depths() const { return 0; }
  int64_t all_layers() const { return num_layers() + mtp_depths(); }
  // The depths embed the tokens ahead where the head is. Where a pipeline puts the head
  // on another rank than the embedding (1F1B at pp > 1), that rank holds a copy of the
  // embedding outside params(): embedding_copy() there, embedding() the original on its
  // own rank (else null). The copy is no parameter: no optimizer state, norm, checkpoint
  // or export sees it. The schedule's copy_embedding and embedding_gradient actions
  // (train/schedule.h) give it the original's weights each step and add its gradient
  // into the original's.
  virtual Param* embedding() { return nullptr; }
  virtual Param* embedding_copy() { return nullptr; }
  virtual bool is_moe_layer(int64_t layer) const = 0;
  virtual int64_t num_experts() const = 0;
  virtual int64_t vocab_size() const = 0;
  // Parameters in 6 * N FLOPs terms: all, and those one token uses (top-k experts), of
  // what this rank holds.
  virtual int64_t param_count() const = 0;
  virtual int64_t active_param_count() const = 0;

  virtual std::vector<Param>& params() = 0;
  // This rank's tensors; with expert parallelism only its own experts.
  virtual std::vector<HfTensor> hf_tensors() = 0;
  // The tensors a Hugging Face folder keeps that no optimizer trains, with this rank's
  // layers: DeepSeek-V3's per-expert routing bias (`mlp.gate.e_score_correction_bias`
  // [E] f32, the model's expert bias, set_expert_bias). load_hf reads them; a checkpoint
  // keeps them as the expert bias in train_state.json, and export-hf writes them from it.
  virtual std::vector<HfTensor> hf_buffers() { return {}; }
  // A Hugging Face key this model has, on another rank (another rank's expert or
  // pipeline stage).
  virtual bool held_by_another_rank(const std::string& name) const = 0;

  // Activations for `batch` sequences of `seq` tokens, each from one planned arena: a
  // bare stash (tokens, rope tables, the residual stream and its gradient) and blocks of
  // layer activations to lend it. make_stash is both, its block lent for good.
  virtual std::unique_ptr<Stash> make_bare_stash(int64_t batch, int64_t seq) = 0;
  virtual std::unique_ptr<ActivationBlock> make_block(int64_t batch, int64_t seq, int64_t first, int64_t last) = 0;
  // s's layers [b.first, b.last) (and the head, where b has it) work in b's memory from
  // now on; b's previous borrower must be done with them.
  virtual void lend(Stash& s, ActivationBlock& b) = 0;
  std::unique_ptr<Stash> make_stash(int64_t batch, int64_t seq) {
    std::unique_ptr<Stash> s = make_bare_stash(batch, seq);
    s->own = make_block(batch, seq, 0, num_layers());
    s->bytes += s->own->bytes;
    lend(*s, *s->own);
    return s;
  }

  virtual void embed_forward(Stash& s) = 0;
  virtual void stage_forward(int64_t layer, Stage stage, Stash& s) = 0;
  virtual void stage_backward_input(int64_t layer, Stage stage, Stash& s) = 0;
  virtual void stage_backward_weight(int64_t layer, Stage stage, Stash& s) = 0;
  // The exchange stages (dispatch and combine; with expert parallelism their tokens
  // travel between ranks) only start their transfers in stage_forward and
  // stage_backward_input; these finish them (wait, then complete the stage), so a
  // schedule can run other work, another micro-batch's stages, while they travel. Every
  // started stage is finished before anything reads its results; for a stage with
  // nothing in flight they do nothing.
  virtual void finish_forward(int64_t layer, Stage stage, Stash& s) = 0;
  virtual void finish_backward_input(int64_t layer, Stage stage, Stash& s) = 0;
  // Final norm, output projection, cross-entropy against s.labels. grad_scale > 0 says
  // a head_backward_input with that scale follows: the cross-entropy's pass may then
  // leave d(loss)/d(logits) in place of the logits, so the backward need not read them
  // again. 0 (evaluation) keeps the logits.
  virtual LossSum head_forward(Stash& s, float grad_scale) = 0;
  // d(loss)/d(logits) = scale * (softmax - onehot), then the input gradient (B, the
  // final norm's weight gradient with it) and the output projection's gradient (W).
  virtual void head_backward_input(Stash& s, float scale) = 0;
  virtual void head_backward_weight(Stash& s) = 0;
  virtual void embed_backward(Stash& s) = 0;

  // The logits of the last head_forward, [batch * seq, vocab] (parity tests, generate),
  // when it was given no grad_scale.
  virtual Tensor logits(Stash& s) = 0;
  virtual std::vector<RouterStats> router_stats(const Stash& s) const = 0;
  // The load-balance loss's gradient with respect to each router probability of a
  // layer: every token's p[e] gets dprob[e], or with sequence_balance ([rows, E]) the
  // tokens of row b get dprob[b * E + e]. Applied by that layer's attention B.
  virtual void set_router_prob_grad(Stash& s, int64_t layer, const std::vector<float>& dprob) = 0;
  // The router z-loss (training.router_z_loss_coef): from now on every MoE layer's
  // forward sums logsumexp(logits)^2 over its tokens (RouterStats::z_sum) and its
  // backward adds scale x that sum's gradient to the router's (0: off).
  virtual void set_router_z_loss(double /*scale*/) {}
  // DeepSeek-V3's auxiliary-loss-free balancing (training.expert_bias_update_rate): the
  // per-expert bias [E] a held MoE layer's router adds to its scores for the top-k choice
  // only (kernels/router.h); zero until set.
  virtual void set_expert_bias(int64_t layer, const std::vector<float>& bias) = 0;
  // A held MoE layer's expert bias [E] as the router uses it (zeros where none is set).
  virtual std::vector<float> expert_bias(int64_t /*layer*/) const { return {}; }
  // DeepSeek-V3's sigmoid routing: its routers keep an expert bias in the Hugging Face
  // format (hf_buffers), which a run carries from the import on; no z-loss applies.
  virtual bool sigmoid_routing() const { return false; }

  // The expert rows' memory (RowMemory) since the last reset; a trainer resets it at
  // each step's start. A model without routed rows holds none.
  virtual RowMemory row_memory() const { return {}; }
  virtual void reset_row_memory() {}
  // offload.experts = weights: the expert cache's device bytes, the traffic a plan
  // predicts for a step of this many micro-batches in sweeps of `sweep` (ScheduleShape),
  // and its flush before the gradient norm (every changed gradient back in host memory,
  // the lines dropped), which returns the traffic since the last (models/expert_cache.h).
  virtual size_t expert_cache_bytes() const { return 0; }
  virtual ExpertCacheStats expert_cache_traffic(int64_t /*micro_batches*/, int64_t /*sweep*/) const { return {}; }
  virtual ExpertCacheStats flush_expert_cache() { return {}; }
  // The traffic since the last flush, the cache left as it is (generation reads it).
  virtual ExpertCacheStats expert_cache_stats() { return {}; }
  // parallelism.expert_replicas: the replicas, their placement and their moves; null
  // without them.
  virtual ExpertReplicas* expert_replicas() { return nullptr; }
  // The bytes their slots add to the experts' weights and gradients (in a plan too).
  virtual size_t expert_replica_bytes() const { return 0; }
};

// One switch on config.json's model_type.
std::unique_ptr<Model> make_model(const std::string& config_json_path, const ModelOptions& options = {});

// Where a Hugging Face folder keeps a model's keys. Most keep them as the model names them
// (`model.`...); a multimodal release keeps its language model under another prefix and
// towers beside it that no run here trains (Qwen3.5's hub folder, model_type qwen3_5_moe:
// model.language_model., with model.visual. and mtp. set aside). From config.json's
// object; `text_config` is what export-hf writes for the language model alone (the
// config unchanged where the folder is one already).
struct HfLayout {
  std::string prefix = "model.";
  std::vector<std::string> set_aside;  // key prefixes read by no one
  std::string folder_key(const std::string& model_key) const {
    return model_key.starts_with("model.") ? prefix + model_key.substr(6) : model_key;
  }
  bool aside(const std::string& key) const;
};
HfLayout hf_layout(const nlohmann::json& config);
nlohmann::json text_config(const nlohmann::json& config);

// Brings every Param's compute copy up to date with its master value (after an
// optimizer step or a load); nothing to do on the CPU, where they are the same, nor
// for a Param without storage (an ungathered ZeRO-3 layer).
// And the FP8 copies (Param::fp8) of the weights that have them. A master in host
// memory (Param::offloaded) is staged on the device for it, unless `offloaded` is false:
// then those are left alone (the optimizer's streamed update wrote theirs).
void refresh_compute_weights(std::vector<Param>& params, bool offloaded = true);
// Only the FP8 copies (after a sharded optimizer pass; the unsharded one writes them).
void refresh_fp8_weights(std::vector<Param>& params, bool offloaded = true);

}  // namespace mt
