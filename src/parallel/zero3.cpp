#include "parallel/zero3.h"

#include <algorithm>

#include "core/check.h"
#include "kernels/elementwise.h"

namespace mt::parallel {

namespace {

// bf16 copies start 256-byte aligned in the slot, as the model's own arenas place them.
int64_t aligned(int64_t bf16_elements) { return (bf16_elements + 127) / 128 * 128; }

bool has_copy(const Param& p) { return p.compute.dtype != p.value.dtype; }

// The slot of `slots` holding `layer`; with layer -1, a free one.
template <typename Slot>
Slot& slot_of(Slot (&slots)[2], int64_t layer, const char* op, const char* what) {
  for (Slot& s : slots)
    if (s.layer == layer) return s;
  MT_FAIL() << "Zero3::" << op << ": "
            << (layer < 0 ? std::string("both ") + what + " slots are taken (layers " +
                                std::to_string(slots[0].layer) + " and " + std::to_string(slots[1].layer) + ")"
                          : "layer " + std::to_string(layer) + " holds no " + what + " slot");
  return slots[0];
}

}  // namespace

Zero3::Sizes Zero3::sizes(const std::vector<Param>& params, const ShardLayout& layout) {
  // A layer's units laid end to end, each padded to its group (what its all-gather
  // fills), and its units' shards (what a reduce-scatter that adds lands in first); the
  // largest layer sets the slots.
  std::vector<Sizes> per_layer;
  for (const ShardUnit& u : layout.units()) {
    if (u.value_at < 0) continue;
    if (per_layer.size() <= static_cast<size_t>(u.layer)) per_layer.resize(static_cast<size_t>(u.layer) + 1);
    Sizes& s = per_layer[static_cast<size_t>(u.layer)];
    s.value += u.group_size * u.shard;
    s.out += u.shard;
    for (int i : u.params)
      if (has_copy(params[i])) s.compute += aligned(params[i].value.numel());
  }
  Sizes most;
  for (const Sizes& s : per_layer) {
    most.value = std::max(most.value, s.value);
    most.compute = std::max(most.compute, s.compute);
    most.out = std::max(most.out, s.out);
  }
  return most;
}

size_t Zero3::slot_bytes(const std::vector<Param>& params, const ShardLayout& layout, Device device) {
  const Sizes s = sizes(params, layout);
  Arena count = Arena::counting("zero3 slots", device);
  for (int k = 0; k < 2; ++k) {
    count.alloc(DType::f32, {s.value});  // weights
    if (s.compute > 0) count.alloc(DType::bf16, {s.compute});
    count.alloc(DType::f32, {s.value});  // gradients
    count.alloc(DType::f32, {s.out});
  }
  return count.peak();
}

Zero3::Zero3(std::vector<Param>& params, const ShardLayout& layout, Tensor weights, Tensor grads, Device device)
    : params_(params), layout_(layout), weights_(weights), grads_(grads), device_(device) {
  MT_CHECK(weights_.numel() == layout_.value_elements() && grads_.numel() == layout_.grad_elements())
      << "zero3: weight shards " << weights_.str() << " and gradient shards " << grads_.str() << " do not match the "
      << "layout's " << layout_.value_elements() << " and " << layout_.grad_elements() << " elements";
  const auto& units = layout_.units();
  for (size_t k = 0; k < units.size(); ++k) {
    if (units[k].value_at < 0) continue;
    const size_t l = static_cast<size_t>(units[k].layer);
    if (units_of_.size() <= l) units_of_.resize(l + 1);
    units_of_[l].push_back(static_cast<int>(k));
  }
  for (const Param& p : params_) {
    compute_dtype_.push_back(p.compute.dtype);
    MT_CHECK(!is_layer(p) || p.value.data == nullptr)
        << "zero3: " << p.name << " has storage of its own: build the model with ModelOptions::external_layers";
  }
  const Sizes s = sizes(params_, layout_);
  slot_ = Arena("zero3 slots", device, slot_bytes(params_, layout_, device));
  for (int k = 0; k < 2; ++k) {
    wslots_[k].value = slot_.alloc(DType::f32, {s.value});
    if (s.compute > 0) wslots_[k].compute = slot_.alloc(DType::bf16, {s.compute});
    gslots_[k].grad = slot_.alloc(DType::f32, {s.value});
    gslots_[k].out = slot_.alloc(DType::f32, {s.out});
  }
}

bool Zero3::is_layer(const Param& p) const {
  return p.layer >= 0 && static_cast<size_t>(p.layer) < units_of_.size();
}

void Zero3::detach(int i) {
  Param& p = params_[i];
  p.value = Tensor(nullptr, p.value.shape, DType::f32, device_);
  p.compute = Tensor(nullptr, p.value.shape, compute_dtype_[i], device_);
}

const std::vector<int>& Zero3::units_of(int64_t layer, const char* op) const {
  MT_CHECK(layer >= 0 && static_cast<size_t>(layer) < units_of_.size())
      << "Zero3::" << op << ": layer " << layer << " is not one of the " << units_of_.size() << " sharded layers";
  return units_of_[static_cast<size_t>(layer)];
}

void Zero3::gather_start(int64_t layer) {
  const std::vector<int>& units = units_of(layer, "gather_start");
  MT_CHECK(wslots_[0].layer != layer && wslots_[1].layer != layer)
      << "Zero3::gather_start: layer " << layer << " is gathered already";
  WeightSlot& w = slot_of(wslots_, -1, "gather_start", "weight");
  w.layer = layer;
  int64_t at = 0, copies_at = 0;
  for (int k : units) {
    const ShardUnit& u = layout_.units()[k];
    const int64_t n = u.group_size, s = u.shard;
    Tensor all = flat(w.value, at, n * s), mine = flat(weights_, u.value_at, s);
    if (u.group == nullptr || n == 1)
      copy(flat(all, 0, s), mine);
    else
      w.gathers.push_back(u.group->start_all_gather(mine, all, comm::Traffic::gather));
    for (size_t j = 0; j < u.params.size(); ++j) {
      const int i = u.params[j];
      Param& p = params_[i];
      const int64_t numel = p.value.numel();
      p.value = Tensor(flat(w.value, at + u.starts[j], numel).data, p.value.shape, DType::f32, device_);
      if (compute_dtype_[i] == DType::f32) {
        p.compute = p.value;
      } else {
        p.compute = Tensor(flat(w.compute, copies_at, numel).data, p.value.shape, compute_dtype_[i], device_);
        copies_at += aligned(numel);
      }
    }
    at += n * s;
  }
}

void Zero3::gather_finish(int64_t layer) {
  WeightSlot& w = slot_of(wslots_, layer, "gather_finish", "weight");
  for (comm::Request& r : w.gathers) r.wait();
  w.gathers.clear();
  for (int k : units_of(layer, "gather_finish"))
    for (int i : layout_.units()[k].params)
      if (params_[i].compute.data != params_[i].value.data) cast(params_[i].value, params_[i].compute);
}

void Zero3::release(int64_t layer) {
  WeightSlot& w = slot_of(wslots_, layer, "release", "weight");
  MT_CHECK(w.gathers.empty()) << "Zero3::release: layer " << layer << "'s gather was never finished";
  w.layer = -1;
  for (int k : units_of(layer, "release"))
    for (int i : layout_.units()[k].params) detach(i);
}

void Zero3::attach_gradients(int64_t layer) {
  const std::vector<int>& units = units_of(layer, "attach_gradients");
  GradSlot& g = slot_of(gslots_, -1, "attach_gradients", "gradient");
  g.layer = layer;
  int64_t at = 0;
  for (int k : units) {
    const ShardUnit& u = layout_.units()[k];
    for (size_t j = 0; j < u.params.size(); ++j) {
      Param& p = params_[u.params[j]];
      p.grad = Tensor(flat(g.grad, at + u.starts[j], p.value.numel()).data, p.value.shape, DType::f32, device_);
      p.grad_started = false;  // the slot's gradients are one micro-batch's, written afresh
    }
    at += u.group_size * u.shard;
  }
}

void Zero3::reduce_start(int64_t layer, bool accumulate) {
  GradSlot& g = slot_of(gslots_, layer, "reduce_start", "gradient");
  MT_CHECK(g.reductions.empty()) << "Zero3::reduce_start: layer " << layer << " is being reduced already";
  g.accumulate = accumulate;
  int64_t at = 0, out_at = 0;
  for (int k : units_of(layer, "reduce_start")) {
    const ShardUnit& u = layout_.units()[k];
    const int64_t n = u.group_size, s = u.shard;
    Tensor in = flat(g.grad, at, n * s), mine = flat(grads_, u.grad_at, s);
    // A sum that adds lands in `out` first, and is added at the finish.
    Tensor out = accumulate ? flat(g.out, out_at, s) : mine;
    // The padding is no block's: zero, so the padded shard sums to zero.
    if (u.length < n * s) fill(flat(in, u.length, n * s - u.length), 0.0f);
    if (u.group == nullptr || n == 1)
      copy(out, flat(in, 0, s));
    else
      g.reductions.push_back(u.group->start_reduce_scatter(in, out, comm::Traffic::gradient));
    at += n * s;
    out_at += s;
  }
}

void Zero3::reduce_finish(int64_t layer) {
  GradSlot& g = slot_of(gslots_, layer, "reduce_finish", "gradient");
  for (comm::Request& r : g.reductions) r.wait();
  g.reductions.clear();
  int64_t out_at = 0;
  for (int k : units_of(layer, "reduce_finish")) {
    const ShardUnit& u = layout_.units()[k];
    if (g.accumulate) {
      Tensor mine = flat(grads_, u.grad_at, u.shard);
      add(mine, flat(g.out, out_at, u.shard), mine);
    }
    out_at += u.shard;
    for (int i : u.params) params_[i].grad = Tensor(nullptr, params_[i].value.shape, DType::f32, device_);
  }
  g.layer = -1;
}

void Zero3::materialize() {
  Arena count = Arena::counting("zero3 weights (host)", Device::cpu);
  for (const Param& p : params_)
    if (is_layer(p)) count.alloc(DType::f32, p.value.shape);
  // Counted in the params' order, taken in the units': the last tensor's padding to the
  // arena's alignment may fall elsewhere, so one alignment more.
  host_ = Arena("zero3 weights (host)", Device::cpu, count.peak() + Arena::kAlign);
  for (const ShardUnit& u : layout_.units()) {
    if (u.value_at < 0) continue;
    // Through a weight slot (none is in use outside a step): every unit fits in it.
    const int64_t n = u.group_size, s = u.shard;
    Tensor all = flat(wslots_[0].value, 0, n * s), mine = flat(weights_, u.value_at, s);
    if (u.group == nullptr || n == 1)
      copy(flat(all, 0, s), mine);
    else
      u.group->all_gather(mine, all);
    for (size_t j = 0; j < u.params.size(); ++j) {
      Param& p = params_[u.params[j]];
      p.value = host_.alloc(DType::f32, p.value.shape);
      copy(flat(p.value, 0, p.value.numel()), flat(all, u.starts[j], p.value.numel()));
      p.grad = Tensor(nullptr, p.value.shape, DType::f32, Device::cpu);
      p.compute = p.value;  // nothing runs on them; refresh_compute_weights leaves them alone
    }
  }
}

void Zero3::commit() {
  MT_CHECK(host_.capacity() > 0 || layout_.value_elements() == 0) << "Zero3::commit without materialize";
  for (const ShardUnit& u : layout_.units()) {
    if (u.value_at < 0) continue;
    fill(flat(weights_, u.value_at, u.shard), 0.0f);
    for (const ShardPiece& p : u.pieces)
      copy(flat(weights_, u.value_at + p.at - u.state_at, p.count), flat(params_[p.param].value, p.offset, p.count));
  }
  release_all();
}

void Zero3::release_all() {
  for (const WeightSlot& w : wslots_)
    MT_CHECK(w.layer < 0) << "Zero3::release_all: layer " << w.layer << " is still gathered";
  for (size_t i = 0; i < params_.size(); ++i)
    if (is_layer(params_[i])) {
      detach(static_cast<int>(i));
      params_[i].grad = params_[i].value;
    }
  host_ = Arena();
}

}  // namespace mt::parallel
