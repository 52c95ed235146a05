#include "models/expert_replicas.h"

#include <cstring>

#include "core/check.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"

namespace mt {

ExpertReplicas::ExpertReplicas(comm::Communicator* ep, int64_t experts, int64_t replicas, Device device)
    : ep_(ep), device_(device), experts_(experts), replicas_(replicas) {
  MT_CHECK(replicas == 0 || ep != nullptr)
      << "parallelism.expert_replicas = " << replicas << " needs expert parallelism (parallelism.ep > 1)";
  ranks_ = ep ? ep->size() : 1;
  rank_ = ep ? ep->rank() : 0;
  own_ = experts / ranks_;
}

void ExpertReplicas::add(int64_t layer, int index, const Param& wide) {
  MT_CHECK(wide.value.ndim() >= 1 && wide.value.dim(0) == slots())
      << wide.name << ": replica storage of " << wide.value.str() << ", expected " << slots() << " blocks";
  Layer& l = layers_[layer];
  if (l.params.empty()) set_placement(layer, parallel::owners_only(experts_, ranks_, replicas_));
  l.params.push_back(index);
  wide_[index] = wide;
}

std::vector<int64_t> ExpertReplicas::layers() const {
  std::vector<int64_t> out;
  for (const auto& [l, x] : layers_) out.push_back(l);
  return out;
}

bool ExpertReplicas::set_placement(int64_t layer, const parallel::Placement& p) {
  MT_CHECK(p.experts == experts_ && p.ranks == ranks_ && p.replicas == replicas_)
      << "expert placement for layer " << layer << ": " << p.experts << " experts over " << p.ranks << " ranks with "
      << p.replicas << " replica slots, expected " << experts_ << ", " << ranks_ << " and " << replicas_;
  Layer& l = layers_[layer];
  if (l.table.storage && l.placement == p) return false;
  l.placement = p;
  const parallel::RouteTable t = parallel::route_table(p, rank_);
  // One i32 buffer: mine, first, slot, then bound's i64 words (8-byte aligned).
  const int64_t e = experts_, c = static_cast<int64_t>(t.slot.size());
  const int64_t at_bound = (2 * e + 1 + c + 1) / 2 * 2, words = at_bound + 2 * c;
  std::vector<int32_t> host(static_cast<size_t>(words), 0);
  std::copy(t.mine.begin(), t.mine.end(), host.begin());
  std::copy(t.first.begin(), t.first.end(), host.begin() + e);
  std::copy(t.slot.begin(), t.slot.end(), host.begin() + 2 * e + 1);
  std::memcpy(host.data() + at_bound, t.bound.data(), t.bound.size() * sizeof(int64_t));
  l.table = parallel::make_buffer(device_, DType::i32, {words});
  mt::copy(l.table.t, Tensor(host.data(), {words}, DType::i32));
  int32_t* base = l.table.t.i32();
  l.mine = Tensor(base, {e}, DType::i32, device_);
  l.first = Tensor(base + e, {e + 1}, DType::i32, device_);
  l.slot = Tensor(base + 2 * e + 1, {c}, DType::i32, device_);
  l.bound = Tensor(base + at_bound, {c}, DType::i64, device_);
  return true;
}

void ExpertReplicas::route(int64_t layer, const Tensor& idx, const Tensor& slots) const {
  const Layer& l = layers_.at(layer);
  mt::ep_route_slots(idx, l.mine, l.first, l.slot, l.bound, slots);
}

std::vector<int64_t> ExpertReplicas::expert_counts(int64_t layer, const std::vector<int32_t>& slot_counts) const {
  const parallel::Placement& p = layers_.at(layer).placement;
  MT_CHECK(static_cast<int64_t>(slot_counts.size()) == ranks_ * slots())
      << "expert replicas: " << slot_counts.size() << " slot counts, expected " << ranks_ * slots();
  std::vector<int64_t> out(static_cast<size_t>(experts_), 0);
  for (int64_t r = 0; r < ranks_; ++r)
    for (int64_t i = 0; i < slots(); ++i) {
      const int32_t e = p.slots[static_cast<size_t>(r)][static_cast<size_t>(i)];
      const int32_t n = slot_counts[static_cast<size_t>(r * slots() + i)];
      MT_CHECK(e >= 0 || n == 0) << "expert replicas: " << n << " rows routed to rank " << r << "'s empty slot " << i;
      if (e >= 0) out[static_cast<size_t>(e)] += n;
    }
  return out;
}

void ExpertReplicas::exchange(const Layer& l, const Param& wide, bool to_owners) {
  const parallel::Placement& p = l.placement;
  const Tensor& t = to_owners ? wide.grad : wide.compute;
  const int64_t width = t.numel() / slots();
  // (holder rank, its slot, the expert's block on its owner) of every replica, by holder.
  struct Copy {
    int64_t holder, slot, owner, block;
  };
  std::vector<Copy> copies;
  for (int64_t r = 0; r < ranks_; ++r)
    for (int64_t i = own_; i < slots(); ++i) {
      const int32_t e = p.slots[static_cast<size_t>(r)][static_cast<size_t>(i)];
      if (e >= 0) copies.push_back({r, i, p.owner(e), e - p.owner(e) * own_});
    }
  // Rows go from `from` to `to` ranks; each side lists its rows by peer, then holder slot.
  std::vector<int64_t> send(static_cast<size_t>(ranks_), 0), recv(send);
  std::vector<int64_t> send_rows, recv_rows;  // blocks of t, in the buffers' order
  for (int64_t peer = 0; peer < ranks_; ++peer)
    for (const Copy& c : copies) {
      const int64_t from = to_owners ? c.holder : c.owner, to = to_owners ? c.owner : c.holder;
      if (from == rank_ && to == peer) {
        ++send[static_cast<size_t>(peer)];
        send_rows.push_back(to_owners ? c.slot : c.block);
      }
      if (to == rank_ && from == peer) {
        ++recv[static_cast<size_t>(peer)];
        recv_rows.push_back(to_owners ? c.block : c.slot);
      }
    }
  auto block = [&](int64_t b) { return t.rows(b, b + 1).view({width}); };
  parallel::Buffer out = parallel::make_buffer(t.device, t.dtype, {static_cast<int64_t>(send_rows.size()), width});
  parallel::Buffer in = parallel::make_buffer(t.device, t.dtype, {static_cast<int64_t>(recv_rows.size()), width});
  for (size_t i = 0; i < send_rows.size(); ++i)
    mt::copy(out.t.rows(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1).view({width}), block(send_rows[i]));
  for (int64_t& n : send) n *= width;
  for (int64_t& n : recv) n *= width;
  ep_->all_to_all_v(out.t, send, in.t, recv);
  // Added by source rank, then slot: the same order whatever the schedule.
  for (size_t i = 0; i < recv_rows.size(); ++i) {
    const Tensor row = in.t.rows(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1).view({width});
    if (to_owners)
      mt::add(block(recv_rows[i]), row, block(recv_rows[i]));
    else
      mt::copy(block(recv_rows[i]), row);
  }
}

void ExpertReplicas::sum_gradients(int64_t layer) {
  auto it = layers_.find(layer);
  if (it == layers_.end() || it->second.summed) return;
  for (int i : it->second.params) exchange(it->second, wide_.at(i), true);
  it->second.summed = true;
}

void ExpertReplicas::refresh() {
  for (auto& [index, l] : layers_) {
    for (int i : l.params) exchange(l, wide_.at(i), false);
    l.summed = false;
  }
}

}  // namespace mt
