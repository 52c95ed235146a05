// ZeRO-3 for the decoder layers (parallelism.zero3).
//
// The model is built with ModelOptions::external_layers, so the Params of layers
// 0 .. L-1 have shapes but no storage. Their weights live only as this rank's shards
// (AdamW's weight shard vector, laid out by its ShardLayout). Two weight slots, each
// sized for the largest layer, hold the layers being computed, so the next layer's
// all-gather runs while the current one computes; two gradient slots hold a layer's
// gradients while its backward writes them and while they are reduce-scattered, so
// that reduction runs while the layer before computes:
//
//   gather_start(l)     layer l into a free weight slot: its Params point there and
//                       the all-gathers start (f32 weights)
//   gather_finish(l)    joined; the bf16 copies the products read made (GPU)
//   release(l)          its weight slot free again
//   attach_gradients(l) a free gradient slot becomes its Params' `grad`, written afresh
//   reduce_start(l, acc) the slot's gradients start summing into AdamW's gradient
//                       shards (over them, or added: later micro-batches)
//   reduce_finish(l)    joined; the gradient slot free again
//
// The schedule (train/schedule.h) emits these around a layer's stages. The embedding
// and the head are not handled here: they stay full on every rank, as without ZeRO-3.
//
// Initialisation, Hugging Face import and checkpoints read and write whole tensors:
// materialize() gathers every layer's weights into host memory (collective) and points
// the Params at them, commit() cuts them back into this rank's shards, release_all()
// drops them.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/arena.h"
#include "core/param.h"
#include "parallel/sharding.h"

namespace mt::parallel {

class Zero3 {
 public:
  // `layout` was built with weight_layers = L; `weights` and `grads` are the f32 shard
  // vectors it lays out (value_elements and grad_elements long: every ZeRO-3 unit has a
  // gradient shard, groups of one included); the slots go on `device`.
  Zero3(std::vector<Param>& params, const ShardLayout& layout, Tensor weights, Tensor grads, Device device);
  // What the constructor allocates on the device: the weight and gradient slots.
  static size_t slot_bytes(const std::vector<Param>& params, const ShardLayout& layout, Device device);
  size_t bytes() const { return slot_.capacity(); }

  void gather_start(int64_t layer);
  void gather_finish(int64_t layer);
  void release(int64_t layer);
  void attach_gradients(int64_t layer);
  void reduce_start(int64_t layer, bool accumulate);
  void reduce_finish(int64_t layer);

  void materialize();
  void commit();
  void release_all();

 private:
  struct Sizes {
    // slot elements: f32 weights (= gradients), bf16 copies, the layer's shards
    int64_t value = 0, compute = 0, out = 0;
  };
  struct WeightSlot {
    int64_t layer = -1;  // -1: free
    Tensor value, compute;
    std::vector<comm::Request> gathers;
  };
  struct GradSlot {
    int64_t layer = -1;
    Tensor grad, out;
    std::vector<comm::Request> reductions;
    bool accumulate = false;
  };
  static Sizes sizes(const std::vector<Param>& params, const ShardLayout& layout);
  bool is_layer(const Param& p) const;  // in a decoder layer, whose weights are shards
  void detach(int param);                // its weights without storage
  const std::vector<int>& units_of(int64_t layer, const char* op) const;

  std::vector<Param>& params_;
  ShardLayout layout_;
  Tensor weights_, grads_;
  Device device_;
  std::vector<std::vector<int>> units_of_;  // per layer, its units (indices into layout_.units())
  std::vector<DType> compute_dtype_;        // per Param: what its compute copy is (bf16 on the GPU)
  Arena slot_;
  WeightSlot wslots_[2];
  GradSlot gslots_[2];
  Arena host_;  // materialize(): every layer's weights
};

}  // namespace mt::parallel
