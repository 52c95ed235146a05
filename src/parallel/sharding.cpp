#include "parallel/sharding.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "core/check.h"
#include "kernels/elementwise.h"
#include "kernels/fp8_quant.h"

namespace mt::parallel {

Tensor flat(const Tensor& t, int64_t offset, int64_t count) {
  MT_CHECK(offset >= 0 && offset + count <= t.numel())
      << "sharding: elements [" << offset << ", " << offset + count << ") of " << t.str();
  return Tensor(static_cast<char*>(t.data) + offset * dtype_size(t.dtype), {count}, t.dtype, t.device);
}

Tensor ShardLayout::piece_of(const Tensor& v, const ShardPiece& p) { return flat(v, p.at, p.count); }

Tensor ShardLayout::grad_of(const std::vector<Param>& params, const Tensor& grad_shard, const ShardUnit& u,
                            const ShardPiece& p) {
  if (u.grad_at < 0) return flat(params[p.param].grad, p.offset, p.count);
  return flat(grad_shard, u.grad_at + p.at - u.state_at, p.count);
}

ShardLayout::ShardLayout(const std::vector<Param>& params, comm::Communicator* dense, comm::Communicator* expert,
                         int64_t weight_layers) {
  build(params, dense, expert, dense ? dense->size() : 1, dense ? dense->rank() : 0, expert ? expert->size() : 1,
        expert ? expert->rank() : 0, weight_layers);
}

ShardLayout::ShardLayout(const std::vector<Param>& params, int dense_size, int expert_size, int64_t weight_layers) {
  build(params, nullptr, nullptr, dense_size, 0, expert_size, 0, weight_layers);
}

void ShardLayout::build(const std::vector<Param>& params, comm::Communicator* dense, comm::Communicator* expert,
                        int dense_size, int dense_rank, int expert_size, int expert_rank, int64_t weight_layers) {
  // Units in order of first appearance, keyed by (layer, expert, offloaded).
  std::map<std::tuple<int64_t, bool, bool>, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    MT_CHECK(p.value.dtype == DType::f32) << "sharding: block " << p.name << " is not f32: " << p.value.str();
    auto [it, added] = index.try_emplace({p.layer, p.expert, p.offloaded}, units_.size());
    if (added) {
      ShardUnit u;
      u.offloaded = p.offloaded;
      u.group = p.expert ? expert : dense;
      u.group_size = p.expert ? expert_size : dense_size;
      u.group_rank = p.expert ? expert_rank : dense_rank;
      u.layer = p.layer;
      units_.push_back(std::move(u));
    }
    ShardUnit& u = units_[it->second];
    u.params.push_back(static_cast<int>(i));
    u.starts.push_back(u.length);
    u.length += p.value.numel();
  }
  for (ShardUnit& u : units_) {
    u.shard = (u.length + u.group_size - 1) / u.group_size;
    // An offloaded unit's state is numbered in the host shard vectors (host_elements).
    MT_CHECK(!u.offloaded || u.layer >= weight_layers)
        << "ShardLayout: layer " << u.layer << "'s offloaded experts cannot keep ZeRO-3 weight shards (config refuses both)";
    int64_t& state = u.offloaded ? host_elements_ : shard_elements_;
    u.state_at = state;
    state += u.shard;
    if (u.layer >= 0 && u.layer < weight_layers) {
      u.value_at = value_elements_;
      value_elements_ += u.shard;
    }
    // A group of one's sum is its blocks' own gradients, read in place; with ZeRO-3
    // those live in a gradient slot only until the layer's reduction.
    if (u.group_size > 1 || u.value_at >= 0) {
      u.grad_at = grad_elements_;
      grad_elements_ += u.shard;
    }
    // Room for the padded unit and, after it, one shard (the reduce-scatter's output).
    scratch_elements_ = std::max(scratch_elements_, (u.group_size + 1) * u.shard);
    const int64_t begin = u.group_rank * u.shard, end = begin + u.shard;
    for (size_t j = 0; j < u.params.size(); ++j) {
      const int64_t b0 = u.starts[j], b1 = b0 + params[u.params[j]].value.numel();
      const int64_t lo = std::max(begin, b0), hi = std::min(end, b1);
      if (lo < hi) u.pieces.push_back({u.params[j], lo - b0, hi - lo, u.state_at + lo - begin});
    }
  }
}

void ShardLayout::Reduction::wait() {
  for (comm::Request& r : requests) r.wait();
  requests.clear();
  inputs.clear();  // after the waits: the transfers read them until then
}

ShardLayout::Reduction ShardLayout::reduce_start(const std::vector<Param>& params, int64_t layer,
                                                 const Tensor& grad_shard) const {
  Reduction r;
  for (const ShardUnit& u : units_) {
    if (u.layer != layer || u.value_at >= 0 || u.grad_at < 0) continue;
    const int64_t n = u.group_size, s = u.shard;
    MT_CHECK(u.group != nullptr) << "ShardLayout::reduce_start: part " << layer << " has a unit over " << n
                                 << " ranks but no communicator (a layout of sizes only, for the plan)";
    Tensor mine = flat(grad_shard, u.grad_at, s);
    Buffer in = make_buffer(grad_shard.device, DType::f32, {n * s});
    for (size_t j = 0; j < u.params.size(); ++j) {
      const Tensor& g = params[u.params[j]].grad;
      copy(flat(in.t, u.starts[j], g.numel()), flat(g, 0, g.numel()));
    }
    // The padding is no block's: zero, so the padded shard sums to zero.
    if (u.length < n * s) fill(flat(in.t, u.length, n * s - u.length), 0.0f);
    r.requests.push_back(u.group->start_reduce_scatter(in.t, mine, comm::Traffic::gradient));
    r.inputs.push_back(std::move(in));
  }
  return r;
}

void ShardLayout::all_gather(const std::vector<Param>& params, const Tensor& scratch) const {
  for (const ShardUnit& u : units_) {
    // A group of one updated its full blocks in place; ZeRO-3 units keep their shards.
    if (u.group == nullptr || u.group_size == 1 || u.value_at >= 0) continue;
    const int64_t n = u.group_size, s = u.shard;
    Tensor mine = flat(scratch, n * s, s), all = flat(scratch, 0, n * s);
    for (const ShardPiece& p : u.pieces)
      copy(flat(mine, p.at - u.state_at, p.count), flat(params[p.param].value, p.offset, p.count));
    u.group->all_gather(mine, all);
    for (size_t j = 0; j < u.params.size(); ++j) {
      const Param& w = params[u.params[j]];
      const Tensor gathered = flat(all, u.starts[j], w.value.numel());
      copy(flat(w.value, 0, w.value.numel()), gathered);
      if (!u.offloaded) continue;
      // The master is in host memory: the copies the products read come from the
      // gathered values on the device instead (refresh_compute_weights skips them).
      const Tensor values = gathered.view(w.value.shape);
      if (w.compute.data != w.value.data) cast(values, w.compute);
      if (w.fp8.q.data != nullptr)
        quantize_blocks(values, w.fp8.q, w.fp8.scale, w.fp8.pow2, w.fp8.qt, w.fp8.scale_t);
    }
  }
}

void ShardLayout::gather(const Tensor& shard, const Tensor& host_shard, const std::vector<Tensor>& full,
                         const Tensor& scratch) const {
  for (const ShardUnit& u : units_) {
    const int64_t n = u.group_size, s = u.shard;
    if (u.offloaded && n == 1) continue;  // its blocks' moments are whole already
    // This rank's shard, as f32, after the room for the whole unit (an offloaded one's
    // widened on the host: it lives there).
    Tensor all = flat(scratch, 0, n * s), mine = flat(scratch, n * s, s);
    if (u.offloaded) {
      std::vector<float> wide(static_cast<size_t>(s));
      cpu::cast(flat(host_shard, u.state_at, s), Tensor(wide.data(), {s}, DType::f32));
      copy(mine, Tensor(wide.data(), {s}, DType::f32));
    } else {
      cast(flat(shard, u.state_at, s), mine);
    }
    if (u.group == nullptr || n == 1)
      copy(flat(all, 0, s), mine);
    else
      u.group->all_gather(mine, all);
    for (size_t j = 0; j < u.params.size(); ++j) {
      const Tensor& f = full[u.params[j]];
      copy(flat(f, 0, f.numel()), flat(all, u.starts[j], f.numel()));
    }
  }
}

void ShardLayout::scatter(const std::vector<Tensor>& full, const Tensor& shard, const Tensor& host_shard,
                          const Tensor& scratch) const {
  for (const ShardUnit& u : units_) {
    if (u.offloaded && u.group_size == 1) continue;
    // Assembled as f32 on the shard's device (full is host memory), then cast there.
    Tensor mine = flat(scratch, 0, u.shard);
    fill(mine, 0.0f);
    for (const ShardPiece& p : u.pieces)
      copy(flat(mine, p.at - u.state_at, p.count), flat(full[p.param], p.offset, p.count));
    if (!u.offloaded) {
      cast(mine, flat(shard, u.state_at, u.shard));
      continue;
    }
    std::vector<float> wide(static_cast<size_t>(u.shard));
    copy(Tensor(wide.data(), {u.shard}, DType::f32), mine);
    cpu::cast(Tensor(wide.data(), {u.shard}, DType::f32), flat(host_shard, u.state_at, u.shard));
  }
}

}  // namespace mt::parallel
