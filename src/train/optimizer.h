// The optimizer: AdamW over every parameter block, or Muon (optimizer.name = muon) over
// the model's hidden matrices with AdamW over the rest (muon_matrices says which). AdamW
// over the model's parameter blocks, with its moments laid out like them, or,
// sharded over the ranks that hold the same weights, with only this rank's shard of
// the moments and of the summed gradients (parallel/sharding.h); blocks that no other
// rank holds have no gradient shard: AdamW reads their own gradients. Blocks whose
// master weights live in host memory (Param::offloaded) keep their moments there,
// whole, in either case, and are updated through device staging (train/offload.h).
#pragma once

#include <map>
#include <vector>

#include "core/arena.h"
#include "models/interface.h"
#include "parallel/sharding.h"
#include "train/offload.h"
#include "train/config.h"

namespace mt {

// One matrix Muon orthogonalises: elements [offset, offset + rows * cols) of block
// `param`, row-major [rows, cols], which the Hugging Face tensor `name` is.
struct MuonMatrix {
  std::string name;
  int param = 0;
  int64_t offset = 0, rows = 0, cols = 0;
};

// Muon's matrices: every 2-D Hugging Face tensor of the model (each routed expert's
// gate_proj, up_proj and down_proj apiece, MLA's and DeltaNet's projections, the MTP
// eh_proj) but the embedding, the head, the routers and the shared expert's gate; AdamW
// keeps those, the norms, biases, sinks, DeltaNet's A_log, dt_bias and conv. A block is
// wholly Muon's or wholly AdamW's (checked).
std::vector<MuonMatrix> muon_matrices(Model& model);

// Muon, step by step (kernels/muon.h has the arithmetic). After the gradient clipping, on
// each Muon block: the momentum m <- mu m + g and the Nesterov input U = g + mu m, on
// this rank's shard when sharded; then each matrix of U, whole, is orthogonalised by
// Newton-Schulz and scaled by 0.2 sqrt(max(rows, cols)) (Moonlight's, so optimizer.lr's
// scale serves both), and W <- W (1 - lr wd) - lr O with lr = optimizer.muon_lr (else
// optimizer.lr) under the schedule. Sharded (a group of more than one rank), U's shards
// are all-gathered into the blocks' full `grad`; the group's ranks take its matrices
// round-robin, each orthogonalising its own and zeroing the rest, and a reduce-scatter of
// those gradients gives every rank its shard of O exactly (a sum with zeros). So the
// result does not depend on the mesh: the same bits as one rank, given the same U.
// Refused with ZeRO-3 and with offload.experts (not built).

class Optimizer {
 public:
  // The moments in `state` (optimizer.state_dtype): f32, or bf16 rounded stochastically
  // (kernels/adamw.h), which halves their bytes.
  // offload.staging_mib sizes the staging of offloaded blocks' updates.
  explicit Optimizer(std::vector<Param>& params, DType state = DType::f32, double staging_mib = 64);
  // What the unsharded moments of `params` take on the device (the blocks not offloaded),
  // or with `offloaded` the offloaded blocks' in host memory; and, on the device, their staging.
  static size_t moment_bytes(const std::vector<Param>& params, DType state, bool offloaded);
  static size_t staging_bytes(const std::vector<Param>& params, DType state, double staging_mib);
  // One update of every block at 1-based `step` with learning rate `lr`; weight decay
  // applies to matrices, or to everything when optimizer.decay = "all".
  // grad_scale multiplies every gradient as it is read (the clipping factor).
  // Sharded, the gradients are read from this rank's shards (reduce_start), a group
  // of one's from its blocks' own `grad`, and the updated shards are all-gathered
  // into every rank's full weights. Either way every Param's compute copy is current
  // afterwards.
  void step(const OptimizerConfig& cfg, double lr, int64_t step, float grad_scale = 1.0f);
  // optimizer.name = muon: these matrices' blocks are Muon's from here on (call before
  // any step; their first moment is the momentum, their second unused).
  void use_muon(std::vector<MuonMatrix> matrices);
  // Whether `value` (a Param's tensor or a view into one) is Muon's: its state is the
  // momentum (exp_avg) alone.
  bool is_muon(const Tensor& value) const;

  // From here on the moments (zero: call before any step or load) live as this rank's
  // shards over `dense` (dense blocks) and `expert` (expert blocks); either may be null.
  // ZeRO-3 (weight_layers = L): the weights of layers 0 .. L-1 are shards too, held here
  // (weight_shards) and updated in place; parallel::Zero3 gathers them for the stages
  // and reduces their gradients into grad_shards.
  void shard(comm::Communicator* dense, comm::Communicator* expert, int64_t weight_layers = 0);
  const parallel::ShardLayout& layout() const { return layout_; }
  Tensor weight_shards() const { return w_shard_; }
  Tensor grad_shards() const { return g_shard_; }  // f32 [layout().grad_elements()]
  // What shard() allocates for a layout: moment and gradient shards, exchange buffer.
  static size_t sharded_bytes(const parallel::ShardLayout& layout, DType state);
  // What shard() allocates in host memory: the offloaded units' moment shards.
  static size_t sharded_host_bytes(const parallel::ShardLayout& layout, DType state);
  // Sharded: this rank's shard of every rank's gradients of one part (-1 the embedding,
  // 0 .. L-1 a decoder layer, L the head), summed, in two halves so the transfer
  // overlaps the backward of the parts before it: start once the part's gradients of
  // the step are complete; the shards hold the sums after reduce_finish. Collective,
  // started in the same order on every rank. With ZeRO-3 the layers' units are
  // skipped (parallel::Zero3 reduces them per micro-batch).
  void reduce_start(int64_t layer);
  void reduce_finish(int64_t layer);
  // Sum of squares of the gradients this step reads: this rank's shards and its groups
  // of one's blocks when sharded (every element on exactly one rank of each group),
  // else every block.
  double grad_sum_squares() const;

  // The moments of `value`, a Param's tensor or a view into one (an HfTensor), in the
  // state dtype unsharded and f32 (host) when materialized. Sharded,
  // they exist laid out like the weights (in host memory) only between
  // materialize_moments (collective: gathers the shards) and release_moments;
  // commit_moments first takes this rank's shards back from them (after a load). Both
  // pass through the exchange buffer, so they need no device memory of their own.
  Tensor exp_avg(const Tensor& value) const { return moment(value, m_); }
  Tensor exp_avg_sq(const Tensor& value) const { return moment(value, v_); }
  void materialize_moments();
  void commit_moments();
  void release_moments();
  // Moments, and when sharded the gradient shards, the exchange buffer and (ZeRO-3) the
  // layers' weight shards.
  size_t bytes() const { return arena_.capacity() + staging_bytes_; }
  size_t host_bytes() const { return host_.capacity(); }
  // The last step's transfers of offloaded blocks (none without them).
  const OffloadTraffic& traffic() const { return traffic_; }

 private:
  Tensor moment(const Tensor& value, const std::vector<Tensor>& which) const;
  int param_of(const Tensor& value) const;
  // Muon's half of step: the momentum on `blocks` (f32 grad -> U in place; m), then the
  // matrices orthogonalised and applied (sharded: through the blocks' full grads).
  void muon_step(const OptimizerConfig& cfg, double lr, int64_t step, float grad_scale);
  std::vector<MuonMatrix> muon_matrices_;
  std::vector<char> muon_;  // per block
  std::vector<Param>& params_;
  DType state_ = DType::f32;
  Arena arena_;
  std::vector<Tensor> m_, v_;  // unsharded: the moments; sharded: views of full_ while materialized
  // Offloaded blocks' moments (null for the others), in host memory; m_ and v_ name them
  // too, sharded or not.
  Arena host_;
  std::vector<Tensor> host_m_, host_v_;  // sharded: those of offloaded units of a group of one
  Tensor host_m_shard_, host_v_shard_;  // sharded: offloaded units' moment shards
  StreamedUpdate streamed_;
  size_t staging_bytes_ = 0;
  OffloadTraffic traffic_;
  // Sharded state.
  bool sharded_ = false;
  parallel::ShardLayout layout_;
  Tensor m_shard_, v_shard_, g_shard_, w_shard_, scratch_;
  std::map<int64_t, parallel::ShardLayout::Reduction> reducing_;  // parts in flight
  Arena full_;  // host copies of the moments, laid out like the weights
};

}  // namespace mt
