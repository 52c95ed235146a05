// The decoder every model shares, so that a model file holds only what is its own.
//
// A model is an embedding, L pre-norm layers and a head (final norm, output projection,
// cross-entropy). Each layer is
//   xn = rmsnorm(h) -> attention, its output projection added to hm = h + ...
//   y = rmsnorm(hm) -> a dense SwiGLU MLP, or the MoE block: router, dispatch,
//   experts, combine, plus optional shared experts on every token -> h' = hm + mlp(y).
// The decoder owns all of it but the token mixers, which a model supplies one a layer
// (Mixers below: Attention objects, which layers may share), and gives each its kernel
// (Attend: local or ring over cp). The head is its own object too (models/head.h: the
// seam for heads after the last layer; multi-token prediction's depths, DecoderSpec::
// mtp_depths, run behind it: head_forward and head_backward_input). The MoE
// block is its own object (models/moe.h: routing, dispatch local or over ep, the experts
// and their rows, combine, shared experts, router statistics), which the decoder calls
// at each stage of a MoE layer. Its memory: arenas for the weights and the stash's
// blocks, and the recompute modes (ModelOptions::recompute, interface.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/rope.h"
#include "kernels/router.h"
#include "models/interface.h"

namespace mt {

struct DecoderSpec {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0;
  double rms_norm_eps = 1e-6;
  // 1: zero-centred norm weights (Qwen3.5's x rstd (1 + w), kernels/rmsnorm.h), for the
  // layers' two norms and the head's; 0: plain.
  float norm_weight_offset = 0.0f;
  bool tie_word_embeddings = false;
  // DeepSeek-V3's multi-token prediction: D depths after the last layer, each
  //   x = eh_proj([enorm(embed(token k ahead)) | hnorm(h of depth k - 1, or the last layer)])
  //   -> one decoder layer of its own (layer L + k - 1) -> its own norm (shared_head.norm)
  //   -> the model's output projection -> cross-entropy against the token k + 1 ahead,
  // built where ModelOptions::mtp and the head are (where the embedding is not, with a
  // copy of it: Model::embedding_copy). Weights under model.layers.{L + k - 1}. as the
  // released checkpoints name them.
  int64_t mtp_depths = 0;
  // Per layer: the MoE block (else the dense MLP); num_layers + mtp_depths entries.
  std::vector<bool> moe;
  int64_t intermediate_size = 0;  // the dense MLP's
  int64_t num_experts = 0, moe_intermediate_size = 0;
  int64_t shared_intermediate_size = 0;  // shared experts as one MLP this wide (0: none)
  // Qwen's gated shared expert: its output times sigmoid(y . w), w `mlp.shared_expert_gate`
  // [1, D], under Qwen's names (mlp.shared_expert.*; else DeepSeek's mlp.shared_experts.*).
  bool shared_expert_gate = false;
  cpu::RouterConfig router;
  // GPT-OSS's MoE block: `mlp.router` with a bias (else `mlp.gate`), experts with biases,
  // SwiGLU clamped at this limit with gate and up interleaved (0: plain, gate then up),
  // and the experts kept by Hugging Face as one [E, in, out] key per tensor a layer.
  bool gpt_oss_experts = false;
  float swiglu_limit = 0.0f;
  cpu::RopeConfig rope;  // every stash's cos/sin tables [seq, rope.rotary_dim / 2]
};

// Attention as a model calls it: one kernel on this rank's whole sequences, or ring
// attention over the cp group (the zigzag chunks); shapes as cpu::attention_forward.
struct Attend {
  comm::Communicator* cp = nullptr;  // null: whole sequences here
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks, const cpu::AttentionArgs& a,
               const Tensor& out, const Tensor& lse) const;
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks, const cpu::AttentionArgs& a,
                const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                const Tensor& dv, const Tensor& dsinks) const;
};

// One layer's attention activations for one micro-batch, a model's own subclass.
struct AttentionActs {
  virtual ~AttentionActs() = default;
};

// What an attention sees of its layer and micro-batch.
struct AttentionIo {
  int64_t batch = 0, seq = 0;
  Tensor cos, sin;  // rope tables of the micro-batch's positions
  Tensor xn;        // the normed input [N, D]
  Tensor hm;        // forward: holds h; the attention adds its output projection
  Tensor d_hm;      // backward: d loss / d hm
  Tensor d_xn;      // backward_input writes d loss / d xn
  const Attend* attend = nullptr;
  const Linear* linear = nullptr;  // every linear layer's products
  // i32 {0, N}: one group of every row, so that a linear layer with a bias runs as a
  // grouped GEMM (kernels/grouped_gemm.h, whose products take a bias and its gradient).
  Tensor all_rows;
};

// A model's attention: its parameters, activations and stages. Parameter indices
// point into the decoder's params (see add_param); gradients are written through
// grad_beta / grad_zeroed, so a step's first write replaces and later ones add.
class Attention {
 public:
  virtual ~Attention() = default;
  // Adds layer l's parameters, internal names starting with `prefix`.
  virtual void add_params(int64_t l, const std::string& prefix, std::vector<Param>& params) = 0;
  // Layer l's tensors under Hugging Face names; `out_scale` is the init scale of
  // projections into the residual stream.
  virtual void hf_tensors(int64_t l, const std::string& prefix, std::vector<Param>& params, float out_scale,
                          std::vector<HfTensor>& out) const = 0;
  // The Hugging Face module of the layer's mixer: `self_attn.` (softmax attention) or
  // `linear_attn.` (Qwen3.5's gated DeltaNet).
  virtual const char* hf_module() const { return "self_attn."; }
  virtual std::unique_ptr<AttentionActs> make_acts() const = 0;
  // Allocates the activations of these layers of one micro-batch of batch x seq
  // tokens, in order, from `a`; what only a layer's B reads may be shared by them.
  virtual void allocate(const std::vector<AttentionActs*>& layers, Arena& a, DType act, int64_t batch,
                        int64_t seq) const = 0;
  virtual void forward(int64_t l, std::vector<Param>& params, AttentionActs& x, const AttentionIo& io) = 0;
  virtual void backward_input(int64_t l, std::vector<Param>& params, AttentionActs& x, const AttentionIo& io) = 0;
  virtual void backward_weight(int64_t l, std::vector<Param>& params, AttentionActs& x, const AttentionIo& io) = 0;
};

// Parameter helpers for models: a new Param of this shape (storage comes later), and
// a gradient write's factor on the old gradient (0 at the step's first write) or the
// gradient zeroed first (for kernels that only add), or whether it is the step's first
// write (each marks the write made).
int add_param(std::vector<Param>& params, std::string name, Shape shape, bool expert = false);
float grad_beta(Param& p);
const Tensor& grad_zeroed(Param& p);
bool start_grad(Param& p);
// An HfTensor of the whole Param.
HfTensor hf_tensor(std::string name, const Param& p, float init_scale = 1.0f, float fill = 0.0f);
// An MLP's gate_proj, up_proj and down_proj (keys `prefix` + those) from its fused
// gate_up and down, or block e of fused [E, ...] ones.
void hf_mlp(std::vector<HfTensor>& out, const std::string& prefix, const Param& gate_up, const Param& down, int64_t e,
            float out_scale, bool expert);

// What every spec must satisfy, each failure an error naming `where` (the config file)
// and the config.json keys: positive sizes, an even rotary dim, and for MoE layers top_k
// in [1, experts], a positive expert width and groups that divide the experts.
void check_decoder_spec(const DecoderSpec& spec, const std::string& where);

// A layer's token mixer, chosen per layer by the model (softmax attention today: GQA,
// MLA, with sinks and windows; linear attention next): one entry a layer (and one for
// each multi-token prediction depth's layer), and layers may share one object (then its
// allocate() gets all of its layers at once).
using Mixers = std::vector<std::shared_ptr<Attention>>;
Mixers every_layer(std::shared_ptr<Attention> mixer, int64_t layers);

std::unique_ptr<Model> make_decoder(const DecoderSpec& spec, Mixers mixers, const ModelOptions& options);

}  // namespace mt
