// Hot-expert replicas under expert parallelism (parallelism.expert_replicas = R). Each
// ep rank's expert Params are stored S = E/ep + R blocks wide: first its own experts (the
// Params themselves, which the optimizer, the sharding and the checkpoints see: logical
// experts only), then R replica slots that the layer's placement fills. The placement,
// its planner and the routing rule are parallel/placement.h; the trainer plans
// (train/trainer.cpp: the loads' moving average every step, a new placement every
// parallelism.replan_interval steps). This file is the rest of the mechanism:
//   route      the router's idx -> slots numbered over the ranks (kernels/dispatch.h,
//              ep_route_slots, on the device), which the ep plan takes as its experts,
//              S a rank (parallel/expert_parallel.h), so the exchange is unchanged;
//   products   the MoE block's grouped GEMMs run over all S blocks (wide(); models/moe.h);
//   gradients  once a layer's gradients are final, each replica's gradient goes to its
//              expert's owner, which adds them to its own in a fixed order (source
//              rank, then slot): before the dp reduction (train/schedule.cpp at
//              reduce_start) or, unsharded, before the norm (the trainer);
//   weights    after the optimizer step the owners send their replicated experts'
//              compute weights to the holders (refresh). A new placement takes effect
//              there too: owners never change, so a re-placement moves only weights,
//              never optimizer state.
// With R = 0 none of this exists and the decoder runs as before, bit for bit.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "comm/communicator.h"
#include "core/param.h"
#include "parallel/buffer.h"
#include "parallel/placement.h"

namespace mt {

class ExpertReplicas {
 public:
  ExpertReplicas() = default;
  ExpertReplicas(comm::Communicator* ep, int64_t experts, int64_t replicas, Device device);
  bool on() const { return replicas_ > 0; }
  int64_t slots() const { return own_ + replicas_; }  // S

  // Layer l's expert Param `index` and its wide storage (S blocks; the Param is its
  // first E/ep). The wide Param's value, grad and compute are what the products use.
  void add(int64_t layer, int index, const Param& wide);
  Param& wide(int index) { return wide_.at(index); }

  // Sets a layer's placement (uploading its routing table); its replicas are filled at
  // the next refresh. Returns whether it changed.
  bool set_placement(int64_t layer, const parallel::Placement& p);
  std::vector<int64_t> layers() const;

  // idx i32 [N,k] (experts) -> slots i32 [N,k] (slots over the ranks), on idx's device.
  void route(int64_t layer, const Tensor& idx, const Tensor& slots) const;
  // Slot counts [ep * S] (the plan's) -> counts a logical expert [E].
  std::vector<int64_t> expert_counts(int64_t layer, const std::vector<int32_t>& slot_counts) const;

  // Collective over ep: layer l's replica gradients added to their owners' (once a
  // step: a second call before the next refresh does nothing).
  void sum_gradients(int64_t layer);
  // Collective over ep: every layer's replicas get their owners' compute weights.
  void refresh();

 private:
  struct Layer {
    parallel::Placement placement;
    std::vector<int> params;  // the layer's expert Params
    parallel::Buffer table;   // the routing table on the device: mine, first, slot, bound
    Tensor mine, first, slot, bound;
    bool summed = false;
  };
  // Moves one Param's rows between owners and holders: to_owners sends the holders'
  // replica gradients (and adds them), else the owners' compute rows go to the holders.
  void exchange(const Layer& l, const Param& wide, bool to_owners);
  comm::Communicator* ep_ = nullptr;
  Device device_ = Device::cpu;
  int64_t experts_ = 0, ranks_ = 1, rank_ = 0, own_ = 0, replicas_ = 0;
  std::map<int64_t, Layer> layers_;
  std::map<int, Param> wide_;
};

}  // namespace mt
