#include "train/optimizer.h"

#include "core/check.h"
#include <cmath>
#include <map>
#include <set>

#include "kernels/adamw.h"
#include "kernels/elementwise.h"
#include "kernels/muon.h"

namespace mt {

namespace {

// Element 0 of a parameter's (or a piece's) rounding-noise key: parameters 2^40 apart.
uint64_t noise_key(size_t param, int64_t offset) {
  return (static_cast<uint64_t>(param) << 40) + static_cast<uint64_t>(offset);
}

}  // namespace

Optimizer::Optimizer(std::vector<Param>& params, DType state, double staging_mib) : params_(params), state_(state) {
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

size_t Optimizer::moment_bytes(const std::vector<Param>& params, DType state, bool offloaded) {
  Arena count = Arena::counting(offloaded ? "optimizer (host)" : "optimizer", Device::cpu);
  for (const Param& p : params)
    for (int j = 0; j < 2 && p.offloaded == offloaded; ++j) count.alloc(state, p.value.shape);
  return count.peak();
}

size_t Optimizer::staging_bytes(const std::vector<Param>& params, DType state, double staging_mib) {
  return StreamedUpdate::bytes(state, StreamedUpdate::set_elements(params, state, staging_mib));
}

void Optimizer::shard(comm::Communicator* dense, comm::Communicator* expert, int64_t weight_layers) {
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

size_t Optimizer::sharded_bytes(const parallel::ShardLayout& layout, DType state) {
  Arena count = Arena::counting("optimizer", Device::cpu);
  for (int j = 0; j < 2; ++j) count.alloc(state, {layout.shard_elements()});  // m, v
  count.alloc(DType::f32, {layout.grad_elements()});                           // summed gradients
  count.alloc(DType::f32, {layout.scratch_elements()});
  if (layout.value_elements() > 0) count.alloc(DType::f32, {layout.value_elements()});
  return count.peak();
}

size_t Optimizer::sharded_host_bytes(const parallel::ShardLayout& layout, DType state) {
  Arena count = Arena::counting("optimizer (host)", Device::cpu);
  for (int j = 0; j < 2; ++j) count.alloc(state, {layout.host_elements()});
  return count.peak();
}

void Optimizer::reduce_start(int64_t layer) {
  MT_CHECK(sharded_) << "Optimizer::reduce_start: the optimizer is not sharded";
  MT_CHECK(reducing_.count(layer) == 0) << "Optimizer::reduce_start: part " << layer << " is already being reduced";
  reducing_.emplace(layer, layout_.reduce_start(params_, layer, g_shard_));
}

void Optimizer::reduce_finish(int64_t layer) {
  auto it = reducing_.find(layer);
  MT_CHECK(it != reducing_.end()) << "Optimizer::reduce_finish: part " << layer << " was not started";
  it->second.wait();
  reducing_.erase(it);
}

double Optimizer::grad_sum_squares() const {
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

void Optimizer::materialize_moments() {
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

void Optimizer::commit_moments() {
  if (!sharded_) return;
  MT_CHECK(full_.capacity() > 0 || layout_.shard_elements() == 0) << "Optimizer::commit_moments without materialize_moments";
  // Rounded to bf16 in the exchange buffer unit by unit: exact for moments that were
  // bf16 (what this run saved).
  layout_.scatter(m_, m_shard_, host_m_shard_, scratch_);
  layout_.scatter(v_, v_shard_, host_v_shard_, scratch_);
  release_moments();
}

void Optimizer::release_moments() {
  if (!sharded_) return;
  m_ = host_m_;
  v_ = host_v_;
  full_ = Arena();
}

void Optimizer::step(const OptimizerConfig& cfg, double lr, int64_t step, float grad_scale) {
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
  auto muon = [&](size_t i) { return !muon_.empty() && muon_[i] != 0; };
  if (!sharded_) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (muon(i))
        continue;
      else if (params_[i].offloaded)
        offload(i);
      else
        blocks.push_back(whole(i, m_[i], v_[i]));
    mt::adamw_step_multi(blocks, a);
    stream();
    if (!muon_.empty()) muon_step(cfg, lr, step, grad_scale);
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
      if (muon(static_cast<size_t>(p.param))) continue;
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
  if (!muon_.empty()) muon_step(cfg, lr, step, grad_scale);
  layout_.all_gather(params_, scratch_);
  // all_gather brings offloaded units' pieces in and their gathered values back out.
  traffic_.bytes_in += gathered_in;
  traffic_.bytes_out += gathered_out;
  refresh_compute_weights(params_, false);
}

int Optimizer::param_of(const Tensor& value) const {
  const char* p = static_cast<const char*>(value.data);
  for (size_t i = 0; i < params_.size(); ++i) {
    const char* base = static_cast<const char*>(params_[i].value.data);
    if (p >= base && p + value.nbytes() <= base + params_[i].value.nbytes()) return static_cast<int>(i);
  }
  MT_FAIL() << "tensor " << value.str() << " is not part of any parameter block";
  return -1;
}

Tensor Optimizer::moment(const Tensor& value, const std::vector<Tensor>& which) const {
  const size_t i = static_cast<size_t>(param_of(value));
  const char* p = static_cast<const char*>(value.data);
  const char* base = static_cast<const char*>(params_[i].value.data);
  MT_CHECK(which[i].data != nullptr) << "the optimizer is sharded: its moments laid out like the weights "
                                     << "exist only between materialize_moments and release_moments";
  return Tensor(static_cast<char*>(which[i].data) + (p - base) / dtype_size(value.dtype) * dtype_size(which[i].dtype),
                value.shape, which[i].dtype, which[i].device);
}

bool Optimizer::is_muon(const Tensor& value) const {
  return !muon_.empty() && muon_[static_cast<size_t>(param_of(value))] != 0;
}

std::vector<MuonMatrix> muon_matrices(Model& model) {
  const std::vector<Param>& params = model.params();
  auto adamw_keeps = [](const std::string& n) {
    return n.find("embed_tokens") != std::string::npos || n.starts_with("lm_head") ||
           n.find("shared_head.head") != std::string::npos || n.ends_with(".mlp.gate.weight") ||
           n.ends_with(".mlp.router.weight") || n.ends_with(".shared_expert_gate.weight");
  };
  std::vector<MuonMatrix> out;
  std::vector<int64_t> covered(params.size(), 0);
  for (const HfTensor& t : model.hf_tensors()) {
    if (t.value.ndim() != 2 || t.value.data == nullptr || adamw_keeps(t.name)) continue;
    const char* p = static_cast<const char*>(t.value.data);
    for (size_t i = 0; i < params.size(); ++i) {
      const char* base = static_cast<const char*>(params[i].value.data);
      if (p < base || p + t.value.nbytes() > base + params[i].value.nbytes()) continue;
      out.push_back({t.name, static_cast<int>(i), (p - base) / static_cast<int64_t>(sizeof(float)), t.value.dim(0),
                     t.value.dim(1)});
      covered[i] += t.value.numel();
      break;
    }
  }
  for (size_t i = 0; i < params.size(); ++i)
    MT_CHECK(covered[i] == 0 || covered[i] == params[i].value.numel())
        << "block " << params[i].name << ": Muon's matrices cover " << covered[i] << " of its "
        << params[i].value.numel() << " elements; a block must be wholly Muon's or AdamW's";
  return out;
}

void Optimizer::use_muon(std::vector<MuonMatrix> matrices) {
  muon_matrices_ = std::move(matrices);
  muon_.assign(params_.size(), 0);
  for (const MuonMatrix& x : muon_matrices_) {
    const Param& p = params_[static_cast<size_t>(x.param)];
    MT_CHECK(!p.offloaded && p.value.data != nullptr)
        << "Muon: block " << p.name << " is offloaded or sharded (ZeRO-3), which Muon does not handle yet";
    muon_[static_cast<size_t>(x.param)] = 1;
  }
}

void Optimizer::muon_step(const OptimizerConfig& cfg, double lr, int64_t step, float grad_scale) {
  using parallel::ShardLayout;
  using parallel::ShardUnit;
  // Muon's learning rate under the schedule that gave `lr`; its matrices always decay.
  const double base = cfg.muon_lr > 0 ? cfg.muon_lr : cfg.lr;
  const double lr_m = cfg.lr > 0 ? base * (lr / cfg.lr) : 0.0;
  const float decay = static_cast<float>(1.0 - lr_m * cfg.weight_decay), rate = static_cast<float>(lr_m);
  const cpu::MuonMomentum mom{.mu = static_cast<float>(cfg.muon_momentum),
                              .nesterov = cfg.muon_nesterov,
                              .grad_scale = grad_scale,
                              .step = step};
  auto is = [&](int i) { return muon_[static_cast<size_t>(i)] != 0; };
  // The unit (sharded) each Muon block belongs to.
  std::vector<const ShardUnit*> unit_of(params_.size(), nullptr);
  if (sharded_)
    for (const ShardUnit& u : layout_.units())
      for (int i : u.params) unit_of[static_cast<size_t>(i)] = &u;
  auto shared = [&](const ShardUnit* u) { return u != nullptr && u->group != nullptr && u->group_size > 1; };
  // 1. The momentum and U = g + mu m, in place of the gradient (this rank's shard).
  if (!sharded_) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (muon_[i]) mt::muon_momentum(params_[i].grad, m_[i], params_[i].grad, mom, noise_key(i, 0));
  } else {
    for (const ShardUnit& u : layout_.units())
      for (const parallel::ShardPiece& p : u.pieces)
        if (is(p.param)) {
          const Tensor g = ShardLayout::grad_of(params_, g_shard_, u, p);
          mt::muon_momentum(g, ShardLayout::piece_of(m_shard_, p), g, mom, noise_key(p.param, p.offset));
        }
    // 2. U whole in the blocks' gradients on every rank of a group.
    for (const ShardUnit& u : layout_.units()) {
      if (!shared(&u) || std::none_of(u.params.begin(), u.params.end(), is)) continue;
      const int64_t n = u.group_size, s = u.shard;
      const Tensor mine = parallel::flat(scratch_, n * s, s), all = parallel::flat(scratch_, 0, n * s);
      fill(mine, 0.0f);
      for (const parallel::ShardPiece& p : u.pieces)
        copy(parallel::flat(mine, p.at - u.state_at, p.count), ShardLayout::grad_of(params_, g_shard_, u, p));
      u.group->all_gather(mine, all);
      for (size_t j = 0; j < u.params.size(); ++j)
        if (is(u.params[j])) {
          const Tensor& g = params_[static_cast<size_t>(u.params[j])].grad;
          copy(parallel::flat(g, 0, g.numel()), parallel::flat(all, u.starts[j], g.numel()));
        }
    }
  }
  // 3. Each matrix orthogonalised and scaled by its rank of the group (round-robin over
  // the unit's matrices in order), the others' zeroed; matrices of one shape together.
  std::map<std::pair<int64_t, int64_t>, std::vector<Tensor>> mine;
  std::vector<std::pair<Tensor, float>> scaled;
  std::map<const ShardUnit*, int> seen;
  std::set<int64_t> reduce_layers;
  for (const MuonMatrix& x : muon_matrices_) {
    const Tensor& g = params_[static_cast<size_t>(x.param)].grad;
    const Tensor view = parallel::flat(g, x.offset, x.rows * x.cols).view({x.rows, x.cols});
    const ShardUnit* u = unit_of[static_cast<size_t>(x.param)];
    const int k = seen[u]++;
    if (shared(u)) reduce_layers.insert(u->layer);
    if (shared(u) && k % u->group_size != u->group_rank) {
      fill(view, 0.0f);
      continue;
    }
    mine[{x.rows, x.cols}].push_back(view);
    scaled.emplace_back(view, static_cast<float>(0.2 * std::sqrt(static_cast<double>(std::max(x.rows, x.cols)))));
  }
  for (const auto& [shape, views] : mine) mt::newton_schulz(views, static_cast<int>(cfg.muon_ns_steps));
  for (const auto& [view, factor] : scaled) mt::scale(view, factor);
  // 4. Sharded: each rank's shard of O, the sum over the group of its owner's O and zeros.
  if (sharded_) {
    for (int64_t layer : reduce_layers) layout_.reduce_start(params_, layer, g_shard_).wait();
    for (const ShardUnit& u : layout_.units())
      for (const parallel::ShardPiece& p : u.pieces)
        if (is(p.param))
          mt::muon_apply(parallel::flat(params_[static_cast<size_t>(p.param)].value, p.offset, p.count),
                         ShardLayout::grad_of(params_, g_shard_, u, p), decay, rate);
    return;  // step's all_gather shares the weights and refreshes the copies
  }
  std::vector<Param> updated;
  for (size_t i = 0; i < params_.size(); ++i)
    if (muon_[i]) {
      mt::muon_apply(params_[i].value, params_[i].grad, decay, rate);
      updated.push_back(params_[i]);
    }
  refresh_compute_weights(updated, false);
}

}  // namespace mt
