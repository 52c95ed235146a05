#include "train/optimizer.h"

#include "core/check.h"
#include "kernels/adamw.h"
#include "kernels/elementwise.h"

namespace mt {

namespace {

// Element 0 of a parameter's (or a piece's) rounding-noise key: parameters 2^40 apart.
uint64_t noise_key(size_t param, int64_t offset) {
  return (static_cast<uint64_t>(param) << 40) + static_cast<uint64_t>(offset);
}

}  // namespace

AdamW::AdamW(std::vector<Param>& params, DType state, double staging_mib) : params_(params), state_(state) {
  MT_CHECK(state == DType::f32 || state == DType::bf16)
      << "AdamW keeps its moments in f32 or bf16, not " << dtype_name(state);
  const Device device = params_.empty() ? Device::cpu : params_.front().grad.device;
  arena_ = Arena("optimizer", device, moment_bytes(params_, state_, false));
  host_ = Arena::host("optimizer (host)", moment_bytes(params_, state_, true), device == Device::cuda);
  const int64_t staged = StreamedUpdate::set_elements(params_, state_, staging_mib);
  if (staged > 0) streamed_ = StreamedUpdate(device, state_, staged);
  staging_bytes_ = StreamedUpdate::bytes(state_, staged);
  for (const Param& p : params_) {
    Arena& a = p.offloaded ? host_ : arena_;
    m_.push_back(a.alloc(state_, p.value.shape));
    v_.push_back(a.alloc(state_, p.value.shape));
    fill(m_.back(), 0.0f);
    fill(v_.back(), 0.0f);
    host_m_.push_back(p.offloaded ? m_.back() : Tensor());
    host_v_.push_back(p.offloaded ? v_.back() : Tensor());
  }
}

size_t AdamW::moment_bytes(const std::vector<Param>& params, DType state, bool offloaded) {
  Arena count = Arena::counting(offloaded ? "optimizer (host)" : "optimizer", Device::cpu);
  for (const Param& p : params)
    for (int j = 0; j < 2 && p.offloaded == offloaded; ++j) count.alloc(state, p.value.shape);
  return count.peak();
}

size_t AdamW::staging_bytes(const std::vector<Param>& params, DType state, double staging_mib) {
  return StreamedUpdate::bytes(state, StreamedUpdate::set_elements(params, state, staging_mib));
}

void AdamW::shard(comm::Communicator* dense, comm::Communicator* expert, int64_t weight_layers) {
  layout_ = parallel::ShardLayout(params_, dense, expert, weight_layers);
  const Device device = params_.empty() ? Device::cpu : params_.front().grad.device;
  const Shape shard{layout_.shard_elements()};
  // The full moments go first, so the shards never share the memory with them.
  arena_ = Arena();
  host_ = Arena();
  arena_ = Arena("optimizer", device, sharded_bytes(layout_, state_));
  // Offloaded units' shards in host memory; a group of one's are its blocks' whole moments.
  host_ = Arena::host("optimizer (host)", sharded_host_bytes(layout_, state_), device == Device::cuda);
  host_m_shard_ = host_.alloc(state_, {layout_.host_elements()});
  host_v_shard_ = host_.alloc(state_, {layout_.host_elements()});
  for (const Tensor& t : {host_m_shard_, host_v_shard_}) fill(t, 0.0f);
  host_m_.assign(params_.size(), Tensor());
  host_v_.assign(params_.size(), Tensor());
  for (const parallel::ShardUnit& u : layout_.units())
    if (u.offloaded && u.group_size == 1)
      for (const parallel::ShardPiece& p : u.pieces) {
        const Shape& shape = params_[p.param].value.shape;
        host_m_[p.param] = parallel::ShardLayout::piece_of(host_m_shard_, p).view(shape);
        host_v_[p.param] = parallel::ShardLayout::piece_of(host_v_shard_, p).view(shape);
      }
  m_ = host_m_;
  v_ = host_v_;
  m_shard_ = arena_.alloc(state_, shard);
  v_shard_ = arena_.alloc(state_, shard);
  g_shard_ = arena_.alloc(DType::f32, {layout_.grad_elements()});
  scratch_ = arena_.alloc(DType::f32, {layout_.scratch_elements()});
  if (layout_.value_elements() > 0) w_shard_ = arena_.alloc(DType::f32, {layout_.value_elements()});
  for (const Tensor& t : {m_shard_, v_shard_, g_shard_}) fill(t, 0.0f);
  if (w_shard_.data != nullptr) fill(w_shard_, 0.0f);
  sharded_ = true;
}

size_t AdamW::sharded_bytes(const parallel::ShardLayout& layout, DType state) {
  Arena count = Arena::counting("optimizer", Device::cpu);
  for (int j = 0; j < 2; ++j) count.alloc(state, {layout.shard_elements()});  // m, v
  count.alloc(DType::f32, {layout.grad_elements()});                           // summed gradients
  count.alloc(DType::f32, {layout.scratch_elements()});
  if (layout.value_elements() > 0) count.alloc(DType::f32, {layout.value_elements()});
  return count.peak();
}

size_t AdamW::sharded_host_bytes(const parallel::ShardLayout& layout, DType state) {
  Arena count = Arena::counting("optimizer (host)", Device::cpu);
  for (int j = 0; j < 2; ++j) count.alloc(state, {layout.host_elements()});
  return count.peak();
}

void AdamW::reduce_start(int64_t layer) {
  MT_CHECK(sharded_) << "AdamW::reduce_start: the optimizer is not sharded";
  MT_CHECK(reducing_.count(layer) == 0) << "AdamW::reduce_start: part " << layer << " is already being reduced";
  reducing_.emplace(layer, layout_.reduce_start(params_, layer, g_shard_));
}

void AdamW::reduce_finish(int64_t layer) {
  auto it = reducing_.find(layer);
  MT_CHECK(it != reducing_.end()) << "AdamW::reduce_finish: part " << layer << " was not started";
  it->second.wait();
  reducing_.erase(it);
}

double AdamW::grad_sum_squares() const {
  std::vector<Tensor> grads;
  if (!sharded_) {
    for (const Param& p : params_) grads.push_back(p.grad);
    return sum_squares(grads);
  }
  // Unit by unit, as AdamW reads them: its gradient shard, or a group of one's blocks
  // (which no other rank holds). Consecutive shards stay one tensor, as the GPU's sum
  // is ordered by the tensors' chunks: without groups of one it is the whole vector.
  int64_t begin = 0, end = 0;
  auto shards = [&] {
    if (end > begin) grads.push_back(Tensor(static_cast<float*>(g_shard_.data) + begin, {end - begin}, DType::f32,
                                            g_shard_.device));
    begin = end;
  };
  for (const parallel::ShardUnit& u : layout_.units()) {
    if (u.grad_at >= 0) {
      end = u.grad_at + u.shard;
      continue;
    }
    shards();
    for (const parallel::ShardPiece& p : u.pieces)
      grads.push_back(parallel::ShardLayout::grad_of(params_, g_shard_, u, p));
  }
  shards();
  return sum_squares(grads);
}

void AdamW::materialize_moments() {
  if (!sharded_) return;
  // Host copies for the blocks whose moments are not whole already.
  Arena count = Arena::counting("optimizer moments (host)", Device::cpu);
  for (size_t i = 0; i < params_.size(); ++i)
    for (int j = 0; j < 2 && host_m_[i].data == nullptr; ++j) count.alloc(DType::f32, params_[i].value.shape);
  full_ = Arena("optimizer moments (host)", Device::cpu, count.peak());
  m_ = host_m_;
  v_ = host_v_;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (host_m_[i].data != nullptr) continue;
    m_[i] = full_.alloc(DType::f32, params_[i].value.shape);
    v_[i] = full_.alloc(DType::f32, params_[i].value.shape);
  }
  // One unit at a time through the exchange buffer (bf16 shards widened there): no
  // f32 copy of a whole shard vector, which a checkpoint's peak would have to hold.
  layout_.gather(m_shard_, host_m_shard_, m_, scratch_);
  layout_.gather(v_shard_, host_v_shard_, v_, scratch_);
}

void AdamW::commit_moments() {
  if (!sharded_) return;
  MT_CHECK(full_.capacity() > 0 || layout_.shard_elements() == 0) << "AdamW::commit_moments without materialize_moments";
  // Rounded to bf16 in the exchange buffer unit by unit: exact for moments that were
  // bf16 (what this run saved).
  layout_.scatter(m_, m_shard_, host_m_shard_, scratch_);
  layout_.scatter(v_, v_shard_, host_v_shard_, scratch_);
  release_moments();
}

void AdamW::release_moments() {
  if (!sharded_) return;
  m_ = host_m_;
  v_ = host_v_;
  full_ = Arena();
}

void AdamW::step(const OptimizerConfig& cfg, double lr, int64_t step, float grad_scale) {
  const cpu::AdamWStep a{.lr = lr,
                         .beta1 = cfg.beta1,
                         .beta2 = cfg.beta2,
                         .eps = cfg.eps,
                         .weight_decay = cfg.weight_decay,
                         .step = step,
                         .grad_scale = grad_scale};
  auto decay = [&](const Param& p) { return p.matrix || cfg.decay == "all"; };
  std::vector<AdamWBlock> blocks, offloaded;
  // A whole block, its moments `m` and `v`; the bf16 copy and the FP8 codes the products
  // read are written in the same pass.
  auto whole = [&](size_t i, const Tensor& m, const Tensor& v) -> AdamWBlock {
    const Param& p = params_[i];
    return {p.value, p.grad, m, v, decay(p), p.compute.data != p.value.data ? p.compute : Tensor(), noise_key(i, 0),
            p.fp8};
  };
  // An offloaded block: whole, its moments in host memory, streamed (train/offload.h).
  auto offload = [&](size_t i) { offloaded.push_back(whole(i, host_m_[i], host_v_[i])); };
  auto stream = [&] { traffic_ = offloaded.empty() ? OffloadTraffic{} : streamed_.update(offloaded, a); };
  if (!sharded_) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].offloaded)
        offload(i);
      else
        blocks.push_back(whole(i, m_[i], v_[i]));
    mt::adamw_step_multi(blocks, a);
    stream();
    return;
  }
  // This rank's pieces of the weights, updated in place (the full weights', or with
  // ZeRO-3 the layers' weight shards), then shared.
  using parallel::ShardLayout;
  int64_t gathered_in = 0, gathered_out = 0;
  for (const parallel::ShardUnit& u : layout_.units()) {
    if (u.offloaded && u.group_size == 1) {
      for (int i : u.params) offload(static_cast<size_t>(i));
      continue;
    }
    // An offloaded unit's flat pieces (its weights full, its moment shards in host memory)
    // are streamed; all_gather then writes the compute copies and codes.
    for (const parallel::ShardPiece& p : u.pieces) {
      const Param& w = params_[p.param];
      Tensor value = u.value_at >= 0
                         ? Tensor(static_cast<float*>(w_shard_.data) + u.value_at + (p.at - u.state_at), {p.count},
                                  DType::f32, w_shard_.device)
                         : Tensor(static_cast<float*>(w.value.data) + p.offset, {p.count}, DType::f32, w.value.device);
      (u.offloaded ? offloaded : blocks)
          .push_back({value, ShardLayout::grad_of(params_, g_shard_, u, p),
                      ShardLayout::piece_of(u.offloaded ? host_m_shard_ : m_shard_, p),
                      ShardLayout::piece_of(u.offloaded ? host_v_shard_ : v_shard_, p), decay(w), Tensor(),
                      noise_key(p.param, p.offset)});
    }
    if (u.offloaded) {
      gathered_in += u.shard * static_cast<int64_t>(sizeof(float));
      gathered_out += u.length * static_cast<int64_t>(sizeof(float));
    }
  }
  mt::adamw_step_multi(blocks, a);
  stream();
  layout_.all_gather(params_, scratch_);
  // all_gather brings offloaded units' pieces in and their gathered values back out.
  traffic_.bytes_in += gathered_in;
  traffic_.bytes_out += gathered_out;
  refresh_compute_weights(params_, false);
}

Tensor AdamW::moment(const Tensor& value, const std::vector<Tensor>& which) const {
  const char* p = static_cast<const char*>(value.data);
  for (size_t i = 0; i < params_.size(); ++i) {
    const char* base = static_cast<const char*>(params_[i].value.data);
    if (p < base || p + value.nbytes() > base + params_[i].value.nbytes()) continue;
    MT_CHECK(which[i].data != nullptr) << "the optimizer is sharded: its moments laid out like the weights "
                                       << "exist only between materialize_moments and release_moments";
    return Tensor(static_cast<char*>(which[i].data) + (p - base) / dtype_size(value.dtype) * dtype_size(which[i].dtype),
                  value.shape, which[i].dtype, which[i].device);
  }
  MT_FAIL() << "tensor " << value.str() << " is not part of any parameter block";
  return Tensor();
}

}  // namespace mt
