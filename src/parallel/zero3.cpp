#include "parallel/zero3.h"

#include <algorithm>

#include "core/check.h"
#include "kernels/elementwise.h"

namespace mt::parallel {

namespace {

// Elements [offset, offset + count) of a contiguous tensor, flat.
Tensor flat(const Tensor& t, int64_t offset, int64_t count) {
  MT_CHECK(offset >= 0 && offset + count <= t.numel())
      << "zero3: elements [" << offset << ", " << offset + count << ") of " << t.str();
  return Tensor(static_cast<char*>(t.data) + offset * static_cast<int64_t>(dtype_size(t.dtype)), {count}, t.dtype,
                t.device);
}

// bf16 copies start 256-byte aligned in the slot, as the model's own arenas place them.
int64_t aligned(int64_t bf16_elements) { return (bf16_elements + 127) / 128 * 128; }

bool has_copy(const Param& p) { return p.compute.dtype != p.value.dtype; }

}  // namespace

Zero3::Sizes Zero3::sizes(const std::vector<Param>& params, const ShardLayout& layout) {
  // A layer's units laid end to end, each padded to its group (what its all-gather
  // fills); the largest layer sets the slot.
  std::vector<Sizes> per_layer;
  Sizes most;
  for (const ShardUnit& u : layout.units()) {
    if (u.value_at < 0) continue;
    if (per_layer.size() <= static_cast<size_t>(u.layer)) per_layer.resize(static_cast<size_t>(u.layer) + 1);
    Sizes& s = per_layer[static_cast<size_t>(u.layer)];
    s.value += u.group_size * u.shard;
    for (int i : u.params)
      if (has_copy(params[i])) s.compute += aligned(params[i].value.numel());
    most.out = std::max(most.out, u.shard);
  }
  for (const Sizes& s : per_layer) {
    most.value = std::max(most.value, s.value);
    most.compute = std::max(most.compute, s.compute);
  }
  return most;
}

size_t Zero3::slot_bytes(const std::vector<Param>& params, const ShardLayout& layout, Device device) {
  const Sizes s = sizes(params, layout);
  Arena count = Arena::counting("zero3 slot", device);
  count.alloc(DType::f32, {s.value});
  count.alloc(DType::f32, {s.value});
  if (s.compute > 0) count.alloc(DType::bf16, {s.compute});
  count.alloc(DType::f32, {s.out});
  return count.peak();
}

Zero3::Zero3(std::vector<Param>& params, const ShardLayout& layout, Tensor weights, Tensor grads, Device device)
    : params_(params), layout_(layout), weights_(weights), grads_(grads), device_(device) {
  MT_CHECK(weights_.numel() == layout_.value_elements() && grads_.numel() == layout_.shard_elements())
      << "zero3: weight shards " << weights_.str() << " and gradient shards " << grads_.str() << " do not match the "
      << "layout's " << layout_.value_elements() << " and " << layout_.shard_elements() << " elements";
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
  slot_ = Arena("zero3 slot", device, slot_bytes(params_, layout_, device));
  value_ = slot_.alloc(DType::f32, {s.value});
  grad_ = slot_.alloc(DType::f32, {s.value});
  if (s.compute > 0) compute_ = slot_.alloc(DType::bf16, {s.compute});
  out_ = slot_.alloc(DType::f32, {s.out});
}

bool Zero3::is_layer(const Param& p) const {
  return p.layer >= 0 && static_cast<size_t>(p.layer) < units_of_.size();
}

void Zero3::detach(int i) {
  Param& p = params_[i];
  p.value = Tensor(nullptr, p.value.shape, DType::f32, device_);
  p.grad = p.value;
  p.compute = Tensor(nullptr, p.value.shape, compute_dtype_[i], device_);
}

void Zero3::gather(int64_t layer) {
  const auto& units = layout_.units();
  int64_t at = 0, copies_at = 0;
  for (int k : units_of_.at(static_cast<size_t>(layer))) {
    const ShardUnit& u = units[k];
    const int64_t n = u.group_size, s = u.shard;
    Tensor all = flat(value_, at, n * s), mine = flat(weights_, u.value_at, s);
    if (u.group == nullptr || n == 1)
      copy(flat(all, 0, s), mine);
    else
      u.group->all_gather(mine, all);
    for (size_t j = 0; j < u.params.size(); ++j) {
      const int i = u.params[j];
      Param& p = params_[i];
      const int64_t numel = p.value.numel();
      p.value = Tensor(flat(value_, at + u.starts[j], numel).data, p.value.shape, DType::f32, device_);
      p.grad = Tensor(flat(grad_, at + u.starts[j], numel).data, p.value.shape, DType::f32, device_);
      p.grad_started = false;  // the slot's gradients are one micro-batch's, written afresh
      if (compute_dtype_[i] == DType::f32) {
        p.compute = p.value;
      } else {
        p.compute = Tensor(flat(compute_, copies_at, numel).data, p.value.shape, compute_dtype_[i], device_);
        cast(p.value, p.compute);
        copies_at += aligned(numel);
      }
    }
    at += n * s;
  }
}

void Zero3::reduce_gradients(int64_t layer, bool accumulate) {
  const auto& units = layout_.units();
  int64_t at = 0;
  for (int k : units_of_.at(static_cast<size_t>(layer))) {
    const ShardUnit& u = units[k];
    const int64_t n = u.group_size, s = u.shard;
    Tensor in = flat(grad_, at, n * s), mine = flat(grads_, u.state_at, s), out = flat(out_, 0, s);
    // The padding is no block's: zero, so the padded shard sums to zero.
    if (u.length < n * s) fill(flat(in, u.length, n * s - u.length), 0.0f);
    if (u.group == nullptr || n == 1)
      out = flat(in, 0, s);
    else
      u.group->reduce_scatter(in, out);
    if (accumulate)
      add(mine, out, mine);
    else
      copy(mine, out);
    at += n * s;
  }
}

void Zero3::release(int64_t layer) {
  for (int k : units_of_.at(static_cast<size_t>(layer)))
    for (int i : layout_.units()[k].params) detach(i);
}

void Zero3::materialize() {
  Arena count = Arena::counting("zero3 weights (host)", Device::cpu);
  for (const Param& p : params_)
    if (is_layer(p)) count.alloc(DType::f32, p.value.shape);
  host_ = Arena("zero3 weights (host)", Device::cpu, count.peak());
  for (const ShardUnit& u : layout_.units()) {
    if (u.value_at < 0) continue;
    // Through the slot: every unit fits in it.
    const int64_t n = u.group_size, s = u.shard;
    Tensor all = flat(value_, 0, n * s), mine = flat(weights_, u.value_at, s);
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
  for (size_t i = 0; i < params_.size(); ++i)
    if (is_layer(params_[i])) detach(static_cast<int>(i));
  host_ = Arena();
}

}  // namespace mt::parallel
