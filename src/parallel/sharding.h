// Sharding of the optimizer state and the gradients over the ranks that hold the same
// weights, in flat per-layer units.
//
// A unit is the parameter blocks of one layer part: the embedding, each layer's dense
// blocks, each layer's experts, the head (Param::layer and Param::expert). Its blocks,
// laid end to end, form one flat vector of `length` elements, padded to a multiple of
// its group's size and cut into equal shards: rank r of the group owns elements
// [r * shard, (r + 1) * shard). Expert units shard over the ranks holding the same
// experts (dp x cp), all others over dp x cp x ep.
//
//   reduce_start     one part's (a layer's) full gradients on every rank -> this
//                    rank's shard of their sum, started; Reduction::wait joins it
//   all_gather       this rank's shard of the weights -> every rank's full weights
//   gather / scatter per-block state laid out like the weights <-> the rank's shards
//
// AdamW's moments and the reduced gradients always live only as shards (8 + 4 bytes
// per parameter divided by the group), and AdamW updates each rank's shard. A unit
// whose group is one rank (experts with dp x cp = 1) has no gradient shard
// (`grad_at` -1): the sum over a group of one is its blocks' own full gradients, which
// AdamW reads in place (grad_of). Only with ZeRO-3 does such a unit keep one, as its
// blocks' gradients live in a slot reused by the next layer. By default
// the weights and the accumulating gradients stay full on every rank (ZeRO-2 memory):
// the updated shards are all-gathered into them after each step. With ZeRO-3
// (`weight_layers` > 0, parallel/zero3.h) the units of decoder layers 0 .. weight_layers-1
// also keep their weights as shards (`value_at` in a separate shard vector), AdamW
// updates those directly, and the bulk reduce_scatter / all_gather below skip them:
// their gradients are reduced layer by layer during the backward.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/param.h"
#include "parallel/buffer.h"

namespace mt::parallel {

// Elements [offset, offset + count) of a contiguous tensor, flat: the pieces of blocks,
// shards and slots that sharding and ZeRO-3 move.
Tensor flat(const Tensor& t, int64_t offset, int64_t count);

// Elements [offset, offset + count) of block `param` sit at `at` in this rank's shard.
struct ShardPiece {
  int param = 0;
  int64_t offset = 0, count = 0, at = 0;
};

struct ShardUnit {
  comm::Communicator* group = nullptr;  // null: a group of one
  int group_size = 1, group_rank = 0;
  std::vector<int> params;      // its blocks, in params() order
  std::vector<int64_t> starts;  // flat start of each block
  int64_t length = 0;           // elements of all its blocks
  int64_t shard = 0;            // elements per rank, padding included
  int64_t state_at = 0;         // where its shard starts in the rank's moment (state) shard vectors
  int64_t grad_at = -1;         // where it starts in the gradient shard vector; -1: none (a group of one)
  std::vector<ShardPiece> pieces;  // this rank's shard, block by block
  int64_t layer = 0;               // Param::layer of its blocks
  int64_t value_at = -1;           // ZeRO-3: where its weight shard starts; -1: weights full
  // Blocks whose master weights are in host memory (Param::offloaded): their state_at
  // numbers the host shard vectors (host_elements), which AdamW keeps in host memory
  // (train/offload.h); all_gather also writes their compute copies and FP8 codes.
  bool offloaded = false;
};

class ShardLayout {
 public:
  ShardLayout() = default;
  // dense and expert may be null (a group of one). Sizes and ranks only are read at
  // construction, so `moetrain plan` can lay out a rank's shards with null groups
  // and the sizes given.
  // Units of layers [0, weight_layers) keep their weights as shards (ZeRO-3).
  ShardLayout(const std::vector<Param>& params, comm::Communicator* dense, comm::Communicator* expert,
              int64_t weight_layers = 0);
  ShardLayout(const std::vector<Param>& params, int dense_size, int expert_size, int64_t weight_layers = 0);

  const std::vector<ShardUnit>& units() const { return units_; }
  int64_t shard_elements() const { return shard_elements_; }      // this rank's, all units
  int64_t grad_elements() const { return grad_elements_; }        // this rank's, units with a gradient shard
  int64_t scratch_elements() const { return scratch_elements_; }  // the largest padded unit
  int64_t value_elements() const { return value_elements_; }      // ZeRO-3 weight shards, all units
  int64_t host_elements() const { return host_elements_; }        // offloaded units' state, in host memory

  // A part's gradients on their way into the shards: the packed inputs (one buffer
  // per unit, alive until the transfer is done) and the transfers.
  struct Reduction {
    std::vector<comm::Request> requests;
    std::vector<Buffer> inputs;
    void wait();
  };
  // Starts writing, into grad_shard f32 [grad_elements], this rank's shard of the sum
  // over each unit's group of the blocks' `grad`, for the units of part `layer`
  // (Param::layer: -1 the embedding, L the head) whose weights are full (ZeRO-3 units
  // are skipped, and so are groups of one: nothing to sum). The gradients are packed
  // before it returns, so they may change afterwards; the shard is written once the
  // Reduction is waited for.
  Reduction reduce_start(const std::vector<Param>& params, int64_t layer, const Tensor& grad_shard) const;
  // The summed gradient of piece p of unit u: its elements of grad_shard, or, for a unit
  // without a gradient shard, of its block's own `grad`.
  static Tensor grad_of(const std::vector<Param>& params, const Tensor& grad_shard, const ShardUnit& u,
                        const ShardPiece& p);
  // Every rank's shard of each block's `value` -> the full `value` on every rank
  // (units whose weights are shards skipped); for an offloaded unit also its blocks'
  // compute copies and FP8 codes, from the gathered values on the device.
  void all_gather(const std::vector<Param>& params, const Tensor& scratch) const;
  // full[i] (f32, laid out like block i) <-> shard (this rank's elements, f32 or bf16;
  // an offloaded unit's in host_shard): the moments for checkpoints. gather is
  // collective; scatter copies this rank's pieces. Both pass one unit at a time through
  // `scratch` [scratch_elements] (f32, on the shard's device), where a bf16 shard is
  // widened or rounded. Offloaded units of a group of one are skipped: their blocks'
  // moments are whole (AdamW names them).
  void gather(const Tensor& shard, const Tensor& host_shard, const std::vector<Tensor>& full,
              const Tensor& scratch) const;
  void scatter(const std::vector<Tensor>& full, const Tensor& shard, const Tensor& host_shard,
               const Tensor& scratch) const;

  // The elements of shard vector `v` that piece p covers, as a flat f32 tensor.
  static Tensor piece_of(const Tensor& v, const ShardPiece& p);

 private:
  void build(const std::vector<Param>& params, comm::Communicator* dense, comm::Communicator* expert, int dense_size,
             int dense_rank, int expert_size, int expert_rank, int64_t weight_layers);
  std::vector<ShardUnit> units_;
  int64_t shard_elements_ = 0, grad_elements_ = 0, scratch_elements_ = 0, value_elements_ = 0, host_elements_ = 0;
};

}  // namespace mt::parallel
