// ZeRO-3 for the decoder layers (../shared/DESIGN.md, decision 6; parallelism.zero3).
//
// The model is built with ModelOptions::external_layers, so the Params of layers
// 0 .. L-1 have shapes but no storage. Their weights live only as this rank's shards
// (AdamW's weight shard vector, laid out by its ShardLayout), and one working slot,
// sized for the largest layer, holds one layer at a time:
//
//   gather(l)            all-gather layer l's units into the slot (f32 weights, and the
//                        bf16 copies the products read on the GPU); point its Params there
//   reduce_gradients(l)  reduce-scatter the slot's gradients into AdamW's gradient
//                        shards, summed over micro-batches (the first one overwrites)
//   release(l)           its Params have no storage again
//
// The trainer wraps each layer's forward stages in gather/release, and its backward
// stages in gather/reduce_gradients/release. The embedding and the head are not
// handled here: they stay full on every rank, as without ZeRO-3. The gathers block
// (no prefetch of the next layer on a side stream yet), which is why one slot is enough.
//
// Initialisation, Hugging Face import and checkpoints read and write whole tensors:
// materialize() gathers every layer's weights into host memory (collective) and points
// the Params at them, commit() cuts them back into this rank's shards, release_all()
// drops them.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/param.h"
#include "parallel/sharding.h"

namespace mt::parallel {

class Zero3 {
 public:
  // `layout` was built with weight_layers = L; `weights` and `grads` are the f32 shard
  // vectors it lays out (value_elements and shard_elements long); the slot goes on `device`.
  Zero3(std::vector<Param>& params, const ShardLayout& layout, Tensor weights, Tensor grads, Device device);
  // What the constructor allocates on the device: the slot and the reduce-scatter's output.
  static size_t slot_bytes(const std::vector<Param>& params, const ShardLayout& layout, Device device);
  size_t bytes() const { return slot_.capacity(); }

  void gather(int64_t layer);
  void reduce_gradients(int64_t layer, bool accumulate);
  void release(int64_t layer);

  void materialize();
  void commit();
  void release_all();

 private:
  struct Sizes {
    int64_t value = 0, compute = 0, out = 0;  // slot elements: f32 weights (= gradients), bf16 copies; one shard
  };
  static Sizes sizes(const std::vector<Param>& params, const ShardLayout& layout);
  bool is_layer(const Param& p) const;  // in a decoder layer, whose weights are shards
  void detach(int param);                // no storage

  std::vector<Param>& params_;
  ShardLayout layout_;
  Tensor weights_, grads_;
  Device device_;
  std::vector<std::vector<int>> units_of_;  // per layer, its units (indices into layout_.units())
  std::vector<DType> compute_dtype_;        // per Param: what its compute copy is (bf16 on the GPU)
  Arena slot_;
  Tensor value_, grad_, compute_, out_;
  Arena host_;  // materialize(): every layer's weights
};

}  // namespace mt::parallel
