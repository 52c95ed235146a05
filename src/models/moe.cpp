#include "models/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/swiglu.h"

#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/device.h"
#endif

namespace mt {

// Calls that take a cpu:: struct are written mt::f(...): argument-dependent lookup would also find cpu::f.
constexpr float kSwigluAlpha = 1.702f;  // GPT-OSS's clamped SwiGLU: gate * sigmoid(alpha * gate)
constexpr int64_t kRowRounding = 128;   // rows are taken in multiples of this

// The experts' activation, clamped at `limit` > 0 (GPT-OSS): hs = swiglu(gu), and its
// input gradient: d_gu from d_hs.
static void swiglu_out(float limit, const Tensor& gu, const Tensor& hs) {
  if (limit > 0)
    clamped_swiglu_forward(gu, limit, kSwigluAlpha, hs);
  else
    swiglu_forward(gu, hs);
}

static void swiglu_in(float limit, const Tensor& gu, const Tensor& d_hs, const Tensor& d_gu) {
  if (limit > 0)
    clamped_swiglu_backward(gu, limit, kSwigluAlpha, d_hs, d_gu);
  else
    swiglu_backward(gu, d_hs, d_gu);
}

// What the expert rows hold, counted (RowMemory), against a budget: the environment's
// MOETRAIN_ROW_POOL_BYTES where set (the hook the pool-exhaustion test uses), else
// ModelOptions::row_memory_limit where set, else the device's memory as the allocator
// finds it. In a plan the rows are only counted.
struct Moe::RowPool {
  bool counting = false;
  size_t in_use = 0, peak = 0, limit = std::numeric_limits<size_t>::max();
  std::string limit_key;  // what set the limit
  double skew = 0;
};

Moe::Moe(const DecoderSpec& c, const ModelOptions& o, std::vector<Param>& params, const Linear& linear)
    : c_(c), o_(o), k_(c.router.top_k), params_(params), linear_(linear),
      act_(o.device == Device::cuda ? DType::bf16 : DType::f32),
      offload_weights_(o.offload_experts && o.offload_weights),
      expert_replicas_(o.ep != nullptr && o.ep->size() > 1 ? o.expert_replicas : 0), ep_(o.ep),
      pool_(std::make_shared<RowPool>()), index_(static_cast<size_t>(c.num_layers)) {
  MT_CHECK(o.routing_skew >= 1.0) << "a routing skew of " << o.routing_skew
                                  << ": the hottest rank gets at least the mean share of rows (>= 1)";
  pool_->counting = o.plan_only;
  if (o.row_memory_limit > 0) {
    pool_->limit = o.row_memory_limit;
    pool_->limit_key = "training.device_memory_limit, less the arenas";
  }
  if (const char* limit = std::getenv("MOETRAIN_ROW_POOL_BYTES")) {
    pool_->limit = std::strtoull(limit, nullptr, 10);
    pool_->limit_key = "MOETRAIN_ROW_POOL_BYTES";
  }
  if (expert_replicas_ > 0) {
    const char* with = o.external_layers ? "parallelism.zero3" : o.fp8 == Fp8::blockwise ? "training.fp8 = blockwise"
                       : o.offload_experts ? "offload.experts" : o.capacity_factor > 0 ? "training.capacity_factor" : nullptr;
    MT_CHECK(with == nullptr) << "parallelism.expert_replicas = " << expert_replicas_ << " with " << with
                              << " is not built yet (replicas are built for dropless bf16 experts held whole on "
                                 "the device, with ZeRO-1/2 sharding)";
  }
  local_experts_ = c_.num_experts;
  if (ep_ != nullptr && ep_->size() > 1) {
    MT_CHECK(c_.num_experts % ep_->size() == 0)
        << "num_experts " << c_.num_experts << " does not split over parallelism.ep = " << ep_->size();
    local_experts_ = c_.num_experts / ep_->size();
    first_expert_ = ep_->rank() * local_experts_;
  } else {
    ep_ = nullptr;
  }
  // parallelism.expert_replicas: an expert Param's storage is S blocks wide, the Param
  // its first E/ep (models/expert_replicas.h; the decoder's arenas hold the storage).
  if (expert_replicas_ > 0) replicas_ = ExpertReplicas(ep_, c_.num_experts, expert_replicas_, o.device);
  lives_ = row_lives();  // ep_ and the mode are settled: the table is the same every stage
}

void Moe::add_params(int64_t l, const std::string& p) {
  const int64_t D = c_.hidden_size, E = local_experts_, I = c_.moe_intermediate_size, Is = c_.shared_intermediate_size;
  auto bias = [&](std::string name, Shape shape, bool expert) {  // f32, never decayed
    const int i = add_param(params_, std::move(name), shape, expert);
    params_[i].matrix = false;
    return i;
  };
  Index x;
  x.router = add_param(params_, p + "router", {c_.num_experts, D});
  x.gate_up = add_param(params_, p + "experts.gate_up", {E, 2 * I, D}, true);
  x.down = add_param(params_, p + "experts.down", {E, D, I}, true);
  if (c_.gpt_oss_experts) {
    x.router_bias = bias(p + "router_bias", {c_.num_experts}, false);
    x.gate_up_bias = bias(p + "experts.gate_up_bias", {E, 2 * I}, true);
    x.down_bias = bias(p + "experts.down_bias", {E, D}, true);
  }
  if (Is > 0) {
    x.shared_gate_up = add_param(params_, p + "shared.gate_up", {2 * Is, D});
    x.shared_down = add_param(params_, p + "shared.down", {D, Is});
    if (c_.shared_expert_gate) x.shared_gate = add_param(params_, p + "shared.gate", {1, D});
  }
  // offload.experts: the routed experts' matrices (of the first offload.layers MoE
  // layers) keep their master weights in the decoder's host arena; their compute copies
  // (on the CPU the master itself) and gradients stay on the device, or with weights
  // join them there (the expert cache's).
  int64_t before = 0;
  for (int64_t j = 0; j < l; ++j) before += holds(j);
  const bool offload =
      o_.offload_experts && !o_.external_layers && (o_.offload_layers == 0 || before < o_.offload_layers);
  for (int i : {x.gate_up, x.down}) {
    params_[i].offloaded = offload;
    params_[i].cached = offload && offload_weights_;
  }
  index_[l] = x;
}

void Moe::make_cache() {
  if (c_.router.scoring == cpu::RouterScoring::sigmoid && !o_.plan_only) make_expert_bias();
  if (!offload_weights_) return;
  // By the block's layer (a multi-token prediction depth's Params are the head's part, L).
  std::vector<std::vector<int>> blocks(static_cast<size_t>(c_.num_layers));
  for (int64_t l = 0; l < c_.num_layers; ++l)
    for (int i : {index_[l].gate_up, index_[l].down, index_[l].gate_up_bias, index_[l].down_bias})
      if (i >= 0 && params_[i].cached) blocks[static_cast<size_t>(l)].push_back(i);
  cache_ = ExpertCache(params_, std::move(blocks), local_experts_,
                       o_.expert_slots > 0 ? o_.expert_slots : 2 * local_experts_, o_.expert_line, o_.device,
                       o_.plan_only);
}

void Moe::hf_tensors(int64_t l, const std::string& p, float out_scale, std::vector<HfTensor>& out) const {
  const Index& x = index_[l];
  if (!c_.gpt_oss_experts) {
    out.push_back(hf_tensor(p + "mlp.gate.weight", params_[x.router]));
    for (int64_t e = 0; e < local_experts_; ++e)
      hf_mlp(out, p + "mlp.experts." + std::to_string(first_expert_ + e) + ".", params_[x.gate_up], params_[x.down],
             e, out_scale, true);
    if (x.shared_gate_up >= 0)
      hf_mlp(out, p + (x.shared_gate >= 0 ? "mlp.shared_expert." : "mlp.shared_experts."), params_[x.shared_gate_up],
             params_[x.shared_down], 0, out_scale, false);
    if (x.shared_gate >= 0) out.push_back(hf_tensor(p + "mlp.shared_expert_gate.weight", params_[x.shared_gate]));
    return;
  }
  out.push_back(hf_tensor(p + "mlp.router.weight", params_[x.router]));
  out.push_back(hf_tensor(p + "mlp.router.bias", params_[x.router_bias], 0.0f, 0.0f));
  // Each expert's slice of the layer's [E, in, out] (and [E, out]) keys.
  for (int64_t e = 0; e < local_experts_; ++e) {
    const int64_t g = first_expert_ + e;
    const std::string q = p + "mlp.experts.";
    auto add = [&](const char* key, int i, float scale, bool transposed) {
      const Param& w = params_[i];
      auto expert = [&](const Tensor& all) {  // block e of [E, ...], without its leading 1
        Shape one = all.shape;
        one.n -= 1;
        std::copy(all.shape.d.begin() + 1, all.shape.d.end(), one.d.begin());
        return all.rows(e, e + 1).view(one);
      };
      out.push_back({.name = q + std::to_string(g) + "." + key, .value = expert(w.value), .grad = expert(w.grad),
                     .init_scale = scale, .expert = true, .fused = q + key, .fused_index = g,
                     .transposed = transposed});
    };
    add("gate_up_proj", x.gate_up, 1.0f, true);
    add("gate_up_proj_bias", x.gate_up_bias, 0.0f, false);
    add("down_proj", x.down, out_scale, true);
    add("down_proj_bias", x.down_bias, 0.0f, false);
  }
}

void Moe::hf_buffers(int64_t l, const std::string& p, std::vector<HfTensor>& out) const {
  if (c_.router.scoring != cpu::RouterScoring::sigmoid) return;
  HfTensor t;
  t.name = p + "mlp.gate.e_score_correction_bias";
  t.value = expert_bias_.empty() ? Tensor{} : expert_bias_[static_cast<size_t>(l)];
  t.init_scale = 0.0f;
  out.push_back(std::move(t));
}

bool Moe::another_ranks_expert(const std::string& name) const {
  size_t at = name.find(".mlp.experts.");
  if (ep_ == nullptr || at == std::string::npos) return false;
  int64_t e = std::atoll(name.c_str() + at + 13);
  return e >= 0 && e < c_.num_experts && (e < first_expert_ || e >= first_expert_ + local_experts_);
}

// What the backward needs of a MoE layer's forward rows: xs (the gate_up W), gu (B's
// SwiGLU), hs (the down W) and, without expert parallelism, ys (the combine's B takes
// dweight from it; with the exchange, `back` holds the outputs on the token's rank, so
// ys goes once it is sent). The gradients live from the B that writes them to the W
// that reads them, or within one B. Selective recomputation keeps neither hs, which the
// experts' B computes again from gu (one SwiGLU), nor, without expert parallelism, xs,
// which their W gathers again from y (with the exchange xs came from other ranks and is
// kept).
std::vector<Moe::RowLife> Moe::row_lives() const {
  const int64_t D = c_.hidden_size, I = c_.moe_intermediate_size;
  constexpr Pass F = Pass::forward, B = Pass::backward_input, W = Pass::backward_weight;
  constexpr Stage dispatch = Stage::dispatch, experts = Stage::experts, combine = Stage::combine;
  const bool selective = o_.recompute == Recompute::selective, regather = selective && !ep_;
  std::vector<RowLife> lives = {{kXs, dispatch, F, experts, regather ? F : W, D},
                                {kGu, experts, F, experts, B, 2 * I},
                                {kHs, experts, F, experts, selective ? F : W, I},
                                {kYs, experts, F, combine, ep_ ? F : B, D},
                                {kDYs, combine, B, experts, W, D},
                                {kDGu, experts, B, experts, W, 2 * I},
                                {kDHs, experts, B, experts, B, I},
                                {kDXs, experts, B, dispatch, B, D}};
  if (selective) lives.push_back({kHs, experts, B, experts, W, I});
  if (regather) lives.push_back({kXs, experts, W, experts, W, D});
  return lives;
}

Tensor& Moe::row_view(Acts& x, Row r) {
  static constexpr Tensor Acts::*kViews[kRowTensors] = {&Acts::xs,   &Acts::gu,   &Acts::hs,   &Acts::ys,
                                                         &Acts::d_ys, &Acts::d_gu, &Acts::d_hs, &Acts::d_xs};
  return x.*kViews[r];
}

int64_t Moe::capacity(int64_t n) const {
  if (o_.capacity_factor <= 0.0) return 0;
  const double fair = static_cast<double>(n * k_) / static_cast<double>(c_.num_experts);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(o_.capacity_factor * fair)));
}

int64_t Moe::planned_rows(int64_t tokens) const {
  const int64_t balanced = tokens * k_;
  int64_t most = ep_ ? ep_->size() * tokens * std::min(k_, local_experts_ + expert_replicas_) : balanced;
  const int64_t cap = capacity(ep_ ? tokens * ep_->size() : tokens);
  if (cap > 0) most = std::min(most, cap * local_experts_);
  return std::min(most, static_cast<int64_t>(std::ceil(o_.routing_skew * static_cast<double>(balanced))));
}

void Moe::take_rows(int64_t l, Acts& x, Stage stage, Pass pass, int64_t tokens) {
  const int64_t rows = std::max(kRowRounding, (x.rows + kRowRounding - 1) / kRowRounding * kRowRounding);
  if (stage == Stage::dispatch && pass == Pass::forward && tokens > 0)
    pool_->skew = std::max(pool_->skew, static_cast<double>(x.rows) / static_cast<double>(tokens * k_));
  for (const RowLife& life : lives_) {
    if (life.take_stage != stage || life.take_pass != pass) continue;
    const int r = life.row;
    x.held[r] = parallel::Buffer();  // a forward again without its backward (eval): the old rows first
    const size_t bytes = static_cast<size_t>(rows * life.width) * dtype_size(act_);
    auto refuse = [&](const std::string& why) {
      MT_FAIL() << "layer " << l << " needs " << rows << " expert rows (" << x.rows << " routed here, "
                << static_cast<double>(bytes) / (1 << 20) << " MiB for one of its row tensors) and " << why
                << "; the expert rows already hold " << static_cast<double>(pool_->in_use) / (1 << 20)
                << " MiB. Routing sent this rank " << static_cast<double>(x.rows) / static_cast<double>(tokens * k_)
                << " times its balanced share. Remedies: a capacity (training.capacity_factor), smaller "
                   "micro-batches (training.micro_batch_size), more expert-parallel ranks (parallelism.ep), a "
                   "stronger balance term (training.load_balance_coef); moetrain plan --routing-skew S shows the "
                   "memory a skew needs";
    };
    if (pool_->in_use + bytes > pool_->limit)
      refuse("the pool has " + std::to_string(pool_->limit - pool_->in_use) + " bytes left of its " +
             std::to_string(pool_->limit) + " (" + pool_->limit_key + ")");
    parallel::Buffer b;
    if (!pool_->counting) {
      try {
        b = parallel::make_buffer(o_.device, act_, {rows, life.width});
      } catch (const Error& e) {
        size_t free = 0;
#ifdef MOETRAIN_WITH_CUDA
        if (o_.device == Device::cuda) free = cuda::free_memory();
#endif
        if (o_.device == Device::cpu) free = available_host_memory();
        refuse("the device has " + std::to_string(free) + " bytes free (" + e.message + ")");
      }
    }
    // Counted while held: the storage's last owner gives the bytes back.
    pool_->in_use += bytes;
    pool_->peak = std::max(pool_->peak, pool_->in_use);
    b.storage = std::shared_ptr<void>(b.storage.get(), [inner = b.storage, pool = pool_, bytes](void*) mutable {
      pool->in_use -= bytes;
      inner.reset();
    });
    row_view(x, static_cast<Row>(r)) = b.t.data != nullptr ? b.t : Tensor(nullptr, {rows, life.width}, act_, o_.device);
    x.held[r] = std::move(b);
  }
}

void Moe::give_rows(Acts& x, Stage stage, Pass pass) {
  for (const RowLife& life : lives_)
    if (life.give_stage == stage && life.give_pass == pass) {
      x.held[life.row] = parallel::Buffer();
      row_view(x, life.row) = Tensor();
    }
}

RowMemory Moe::row_memory() const { return {pool_->peak, pool_->skew}; }

void Moe::reset_row_memory() {
  pool_->peak = pool_->in_use;
  pool_->skew = 0;
}

void Moe::finish_exchange(Acts& x, const Io& io) const {
  switch (x.exchange.kind) {
    case parallel::EpExchange::Kind::none:
      break;
    case parallel::EpExchange::Kind::dispatch_forward:
      parallel::ep_dispatch_forward_finish(x.exchange, x.plan, routed(x).xs);
      break;
    case parallel::EpExchange::Kind::combine_forward:
      parallel::ep_combine_forward_finish(x.exchange, x.plan, x.weight, io.mo);
      break;
    case parallel::EpExchange::Kind::combine_backward:
      parallel::ep_combine_backward_finish(x.exchange, x.plan, routed(x).d_ys);
      break;
    case parallel::EpExchange::Kind::dispatch_backward:
      parallel::ep_dispatch_backward_finish(x.exchange, x.plan, io.d_y);
      break;
  }
}

void Moe::forward(int64_t l, Stage stage, Acts& x, const Io& io) {
  const Index& w = index_[l];
  const int64_t N = io.tokens;
  if (o_.plan_only) return plan_rows(l, stage, Pass::forward, x, N);
  if (stage != Stage::dispatch) take_rows(l, x, stage, Pass::forward, N);
  switch (stage) {
    case Stage::attention:  // the router, on the post-attention norm's output
      if (w.router_bias >= 0)
        grouped_gemm(io.y, params_[w.router].compute.view({1, c_.num_experts, c_.hidden_size}),
                     params_[w.router_bias].value.view({1, c_.num_experts}), io.all_rows, x.logits);
      else
        gemm(io.y, params_[w.router].compute, x.logits, false, true);
      mt::router_forward(c_.router, x.logits, x.idx, x.weight, x.probs,
                         expert_bias_.empty() ? Tensor{} : expert_bias_[static_cast<size_t>(l)], x.score_sum);
      mt::router_prob_sum(x.probs, x.prob_sum);
      if (z_scale_ != 0) mt::router_z_forward(x.logits, x.lse, x.z_sum);
      if (o_.force_balanced_routing) {
        mt::copy(x.idx, io.balanced_idx);
        mt::fill(x.weight, 1.0f / static_cast<float>(k_));
      }
      if (o_.sequence_balance) {
        // Each sequence's (row's) sums and choices, for the sequence-level balance term.
        const int64_t rows = x.seq_counts.dim(0), T = x.probs.dim(0) / rows, E = c_.num_experts;
        for (int64_t b = 0; b < rows; ++b)
          mt::router_prob_sum(Tensor(x.probs.f32() + b * T * E, {T, E}, DType::f32, x.probs.device),
                              Tensor(x.seq_prob_sum.f32() + b * E, {E}, DType::f32, x.probs.device));
        mt::router_counts(x.idx, x.seq_counts);
      }
      // The expert plan waits for the router, not for what a schedule queues after it.
      if (replicas_.on()) replicas_.route(l, x.idx, x.slots);
      if (ep_) x.routed = parallel::mark_routed(replicas_.on() ? x.slots : x.idx);
      break;
    case Stage::dispatch:
      if (ep_) {
        // The experts see the ep ranks' micro-batches end to end: the capacity is theirs.
        // With replicas the plan's experts are the ranks' slots (models/expert_replicas.h).
        if (replicas_.on())
          x.plan = parallel::ep_plan(*ep_, x.slots, ep_->size() * replicas_.slots(), 0, x.routed);
        else
          x.plan = parallel::ep_plan(*ep_, x.idx, c_.num_experts, capacity(N * ep_->size()), x.routed);
        x.dropped = x.plan.dropped;
        x.rows = x.plan.local_rows();
        take_rows(l, x, stage, Pass::forward, N);
        mt::copy(replicas_.on() ? x.slot_counts : x.counts, x.plan.expert_counts);
        x.exchange = parallel::ep_dispatch_forward_start(*ep_, x.plan, io.y);
      } else {
        x.dropped = mt::dispatch_plan(x.idx, c_.num_experts, capacity(N), x.counts, x.offsets, x.order, x.slot_row);
        x.rows = N * k_ - x.dropped;  // a capacity keeps the first rows
        take_rows(l, x, stage, Pass::forward, N);
        mt::dispatch_forward(io.y, x.order, k_, routed(x).xs);
      }
      break;
    case Stage::experts: {
      Routed r = routed(x);
      if (cache_.caches(l)) {
        cached_experts(l, x, Pass::forward);
      } else {
        linear_.grouped_forward(r.xs, X(w.gate_up), bias(w.gate_up_bias), r.offsets, r.gu);
        swiglu_out(c_.swiglu_limit, r.gu, r.hs);
        linear_.grouped_forward(r.hs, X(w.down), bias(w.down_bias), r.offsets, r.ys);
      }
      if (w.shared_gate_up >= 0) {  // the shared experts see every token
        linear_.forward(io.y, {{params_[w.shared_gate_up], x.sgu}});
        swiglu_forward(x.sgu, x.shs);
        linear_.forward(x.shs, {{params_[w.shared_down], x.so}});
        if (w.shared_gate >= 0) linear_.forward(io.y, {{params_[w.shared_gate], x.sg}});
      }
      break;
    }
    case Stage::combine:
      if (ep_)
        x.exchange = parallel::ep_combine_forward_start(*ep_, x.plan, routed(x).ys, x.back.rows(0, x.plan.returned_rows()));
      else
        mt::combine_forward(routed(x).ys, x.weight, x.slot_row, io.mo);
      break;
    case Stage::aggregate:
      if (w.shared_gate >= 0) {
        sigmoid_gate_forward(x.so, x.sg, x.gated);
        mt::add(io.h_next, x.gated, io.h_next);
      } else if (w.shared_gate_up >= 0) {
        mt::add(io.h_next, x.so, io.h_next);
      }
      break;
  }
  end_forward_rows(x, stage);
}

void Moe::plan_rows(int64_t l, Stage stage, Pass pass, Acts& x, int64_t tokens) {
  if (stage == Stage::dispatch && pass == Pass::forward) x.rows = planned_rows(tokens);
  take_rows(l, x, stage, pass, tokens);
  if (pass == Pass::forward)
    end_forward_rows(x, stage);
  else
    give_rows(x, stage, pass);
}

void Moe::end_forward_rows(Acts& x, Stage stage) {
  give_rows(x, stage, Pass::forward);
  if (o_.recompute != Recompute::full || x.recomputing || stage != Stage::combine) return;
  for (int r = 0; r < kRowTensors; ++r) {
    x.held[r] = parallel::Buffer();
    row_view(x, static_cast<Row>(r)) = Tensor();
  }
}

// Each line of the layer's experts with rows in this micro-batch, fetched from the
// cache, runs its products over its window of the rows (kernels/grouped_gemm.h), the
// SwiGLU between them over the window's rows, so the bits are the whole layer's. A W
// is the step's first write of the layer's expert gradients or an addition to them, as
// for gradients on the device; a line without rows in the first write leaves its bias
// gradients at zero, as a whole-layer product would. The next cached layer a pass goes
// to is prefetched behind it.
void Moe::cached_experts(int64_t l, Acts& x, Pass pass) {
  const Index& w = index_[l];
  Routed r = routed(x);
  if (pass == Pass::forward) {
    x.host_offsets.assign(static_cast<size_t>(local_experts_ + 1), 0);
    mt::copy(Tensor(x.host_offsets.data(), {local_experts_ + 1}, DType::i32), r.offsets);
  }
  const std::vector<int32_t>& o = x.host_offsets;
  const bool accumulate = pass == Pass::backward_weight && params_[w.down].grad_started;
  // Where the cached matrices are in a line's Params (blocks in params_ order).
  const int gu = w.gate_up < w.down ? 0 : 1, dn = 1 - gu;
  // Lines write disjoint rows and gradients: any order gives the same bits.
  for (int64_t i : cache_.order(l)) {
    const int64_t e0 = i * cache_.line_experts(), e1 = std::min(local_experts_, e0 + cache_.line_experts());
    const int64_t r0 = o[static_cast<size_t>(e0)], r1 = o[static_cast<size_t>(e1)];
    auto window = [&](const Tensor& t) { return t.data != nullptr ? t.rows(e0, e1) : t; };
    if (r0 == r1) {
      if (pass == Pass::backward_weight && !accumulate)
        for (int b : {w.gate_up_bias, w.down_bias})
          if (b >= 0) mt::fill(window(grad_of(b)), 0.0f);
      continue;
    }
    ExpertCache::Line& line = cache_.fetch(l, i, pass == Pass::backward_weight, accumulate);
    Param &g = line.params[static_cast<size_t>(gu)], &d = line.params[static_cast<size_t>(dn)];
    const Tensor off = r.offsets.rows(e0, e1 + 1);
    if (pass == Pass::forward) {
      linear_.grouped_forward(r.xs, g, window(bias(w.gate_up_bias)), off, r.gu);
      swiglu_out(c_.swiglu_limit, r.gu.rows(r0, r1), r.hs.rows(r0, r1));
      linear_.grouped_forward(r.hs, d, window(bias(w.down_bias)), off, r.ys);
    } else if (pass == Pass::backward_input) {
      linear_.grouped_backward_input(r.d_ys, d, off, r.d_hs);
      swiglu_in(c_.swiglu_limit, r.gu.rows(r0, r1), r.d_hs.rows(r0, r1), r.d_gu.rows(r0, r1));
      linear_.grouped_backward_input(r.d_gu, g, off, r.d_xs);
    } else {
      linear_.grouped_backward_weight(r.hs, r.d_ys, off, d, window(grad_of(w.down_bias)), accumulate);
      linear_.grouped_backward_weight(r.xs, r.d_gu, off, g, window(grad_of(w.gate_up_bias)), accumulate);
    }
    cache_.done(pass == Pass::backward_weight);
  }
  if (pass == Pass::backward_weight) {
    start_grad(params_[w.down]);
    start_grad(params_[w.gate_up]);
  }
  const int64_t step = pass == Pass::forward && !x.recomputing ? 1 : -1;  // a recomputation is in the backward
  for (int64_t next = l + step; next >= 0 && next < c_.num_layers; next += step)
    if (cache_.caches(next)) {
      cache_.prefetch(next);
      break;
    }
}

void Moe::backward_input(int64_t l, Stage stage, Acts& x, const Io& io) {
  const Index& w = index_[l];
  const Tensor& d_mo = io.d_next;  // aggregate: h[l+1] = hm + mo, so d_mo = d_hm = dh[l+1]
  if (o_.plan_only) return plan_rows(l, stage, Pass::backward_input, x, io.tokens);
  take_rows(l, x, stage, Pass::backward_input, io.tokens);
  switch (stage) {
    case Stage::aggregate:
      break;
    case Stage::combine:
      if (ep_)
        x.exchange = parallel::ep_combine_backward_start(*ep_, x.plan, x.back.rows(0, x.plan.returned_rows()),
                                                         x.weight, d_mo, x.d_weight);
      else
        mt::combine_backward(routed(x).ys, x.weight, x.slot_row, d_mo, routed(x).d_ys, x.d_weight);
      break;
    case Stage::experts: {
      Routed r = routed(x);
      if (o_.recompute == Recompute::selective) swiglu_out(c_.swiglu_limit, r.gu, r.hs);  // W reads it
      if (cache_.caches(l)) {
        cached_experts(l, x, Pass::backward_input);
      } else {
        linear_.grouped_backward_input(r.d_ys, X(w.down), r.offsets, r.d_hs);
        swiglu_in(c_.swiglu_limit, r.gu, r.d_hs, r.d_gu);
        linear_.grouped_backward_input(r.d_gu, X(w.gate_up), r.offsets, r.d_xs);
      }
      if (w.shared_gate_up >= 0) {
        if (w.shared_gate >= 0) sigmoid_gate_backward(x.so, x.sg, d_mo, x.d_so, x.d_sg);
        linear_.backward_input(w.shared_gate >= 0 ? x.d_so : d_mo, params_[w.shared_down], x.d_shs);
        swiglu_backward(x.sgu, x.d_shs, x.d_sgu);
      }
      break;
    }
    case Stage::dispatch:
      if (ep_)
        x.exchange = parallel::ep_dispatch_backward_start(*ep_, x.plan, routed(x).d_xs);
      else
        mt::dispatch_backward(routed(x).d_xs, x.slot_row, io.d_y);
      break;
    case Stage::attention:
      // Router: every token's probability row gets the load-balance gradient (x.dprobs,
      // uploaded by set_router_prob_grad).
      // Forced routing does not come from the logits: only the balance term reaches them.
      if (o_.force_balanced_routing) mt::fill(x.d_weight, 0.0f);
      mt::router_backward(c_.router, x.logits, x.idx, x.weight, x.probs, x.d_weight, x.dprobs, x.d_logits,
                          x.score_sum);
      if (z_scale_ != 0) mt::router_z_backward(x.lse, x.probs, static_cast<float>(z_scale_), x.d_logits);
      if (x.d_logits_c.data != x.d_logits.data) mt::cast(x.d_logits, x.d_logits_c);
      gemm(x.d_logits_c, params_[w.router].compute, io.d_y, false, false, 1.0f, 1.0f);
      // The shared experts' input gradient, after the dispatch's (which overwrites d_y).
      if (w.shared_gate_up >= 0) linear_.backward_input(x.d_sgu, params_[w.shared_gate_up], io.d_y, 1.0f);
      if (w.shared_gate >= 0) linear_.backward_input(x.d_sg, params_[w.shared_gate], io.d_y, 1.0f);
      break;
  }
  give_rows(x, stage, Pass::backward_input);
}

void Moe::backward_weight(int64_t l, Stage stage, Acts& x, const Io& io) {
  const Index& w = index_[l];
  if (o_.plan_only) return plan_rows(l, stage, Pass::backward_weight, x, io.tokens);
  take_rows(l, x, stage, Pass::backward_weight, io.tokens);
  switch (stage) {
    case Stage::experts: {
      Routed r = routed(x);
      if (o_.recompute == Recompute::selective && !ep_) mt::dispatch_forward(io.y, x.order, k_, r.xs);
      // A bias is written with its weight: one mark serves both.
      if (cache_.caches(l)) {
        cached_experts(l, x, Pass::backward_weight);
      } else {
        linear_.grouped_backward_weight(r.hs, r.d_ys, r.offsets, X(w.down), grad_of(w.down_bias),
                                        !start_grad(params_[w.down]));
        linear_.grouped_backward_weight(r.xs, r.d_gu, r.offsets, X(w.gate_up), grad_of(w.gate_up_bias),
                                        !start_grad(params_[w.gate_up]));
      }
      if (w.shared_gate_up >= 0) {
        // Gated, the output's gradient sigmoid(sg) d_next again (the forward's formula).
        if (w.shared_gate >= 0) sigmoid_gate_forward(io.d_next, x.sg, x.d_so);
        linear_.backward_weight(x.shs, {{w.shared_gate >= 0 ? x.d_so : io.d_next, params_[w.shared_down]}});
        linear_.backward_weight(io.y, {{x.d_sgu, params_[w.shared_gate_up]}});
        if (w.shared_gate >= 0) linear_.backward_weight(io.y, {{x.d_sg, params_[w.shared_gate]}});
      }
      break;
    }
    case Stage::attention:
      if (w.router_bias >= 0)
        grouped_gemm_backward_weight(io.y, x.d_logits_c, io.all_rows,
                                     params_[w.router].grad.view({1, c_.num_experts, c_.hidden_size}),
                                     params_[w.router_bias].grad.view({1, c_.num_experts}),
                                     !start_grad(params_[w.router]));
      else
        gemm(x.d_logits_c, io.y, params_[w.router].grad, true, false, 1.0f, grad_beta(params_[w.router]));
      break;
    case Stage::dispatch:
    case Stage::combine:
    case Stage::aggregate:
      break;  // no parameters
  }
  give_rows(x, stage, Pass::backward_weight);
}

RouterStats Moe::router_stats(int64_t l, const Acts& x, int64_t tokens) const {
  const int64_t N = tokens, E = c_.num_experts;
  RouterStats r;
  r.layer = l;
  r.tokens = N;
  r.top_k = k_;
  r.dropped = x.dropped;
  // The probabilities summed where they were made (router_prob_sum) and the slots each
  // expert kept, counted by the dispatch plan: one copy of both to the host.
  std::vector<int32_t> stats(static_cast<size_t>(x.stats.numel()));
  mt::copy(Tensor(stats.data(), {x.stats.numel()}, DType::i32), x.stats);
  auto floats = [&](int64_t at, int64_t n) {  // the f32 words of stats [at, at + n)
    std::vector<float> f(static_cast<size_t>(n));
    std::memcpy(f.data(), stats.data() + at, f.size() * sizeof(float));
    return std::vector<double>(f.begin(), f.end());
  };
  r.prob_sum = floats(0, E);
  r.counts.assign(stats.begin() + E, stats.begin() + 2 * E);
  if (z_scale_ != 0) r.z_sum = floats(2 * E, 1)[0];
  const int64_t slot_end = 2 * E + 1 + (replicas_.on() ? x.slot_counts.numel() : 0);
  if (replicas_.on()) {  // the plan counted slots: each expert's are the sum of its copies'
    r.slot_counts.assign(stats.begin() + 2 * E + 1, stats.begin() + slot_end);
    r.counts = replicas_.expert_counts(l, std::vector<int32_t>(stats.begin() + 2 * E + 1, stats.begin() + slot_end));
  }
  if (o_.sequence_balance) {
    r.seq_rows = x.seq_counts.dim(0);
    r.seq_tokens = N / r.seq_rows;
    const int64_t n = r.seq_rows * E;
    r.seq_prob_sum = floats(slot_end, n);
    r.seq_counts.assign(stats.begin() + slot_end + n, stats.begin() + slot_end + 2 * n);
  }
  return r;
}

void Moe::set_expert_bias(int64_t layer, const std::vector<float>& bias) {
  const int64_t E = c_.num_experts;
  MT_CHECK(holds(layer) && static_cast<int64_t>(bias.size()) == E)
      << "an expert bias of " << bias.size() << " values for layer " << layer << ", which is not a MoE layer held "
      << "here with " << E << " experts";
  if (expert_bias_.empty()) make_expert_bias();
  mt::copy(expert_bias_[static_cast<size_t>(layer)], Tensor(const_cast<float*>(bias.data()), {E}, DType::f32));
}

std::vector<float> Moe::expert_bias(int64_t l) const {
  std::vector<float> out(static_cast<size_t>(c_.num_experts), 0.0f);
  if (!expert_bias_.empty() && holds(l))
    mt::copy(Tensor(out.data(), {c_.num_experts}, DType::f32), expert_bias_[static_cast<size_t>(l)]);
  return out;
}

// Every held MoE layer's, zero.
void Moe::make_expert_bias() {
  const int64_t E = c_.num_experts;
  int64_t layers = 0;
  for (int64_t l = 0; l < c_.num_layers; ++l) layers += holds(l);
  bias_arena_ = Arena("expert bias", o_.device, static_cast<size_t>(layers) * (E * sizeof(float) + Arena::kAlign));
  expert_bias_.resize(static_cast<size_t>(c_.num_layers));
  for (int64_t l = 0; l < c_.num_layers; ++l)
    if (holds(l)) {
      expert_bias_[static_cast<size_t>(l)] = bias_arena_.alloc(DType::f32, {E});
      mt::fill(expert_bias_[static_cast<size_t>(l)], 0.0f);
    }
}

void Moe::set_router_z_loss(double scale) {
  // Its gradient reads probs as softmax(logits); sigmoid scoring's are normalised scores.
  MT_CHECK(scale == 0 || c_.router.scoring != cpu::RouterScoring::sigmoid)
      << "training.router_z_loss_coef: sigmoid routing (DeepSeek-V3) has no z-loss; set it to 0";
  z_scale_ = scale;
}

void Moe::set_router_prob_grad(int64_t layer, Acts& x, const std::vector<float>& dprob) {
  const Tensor& dprobs = x.dprobs;
  MT_CHECK(holds(layer) && static_cast<int64_t>(dprob.size()) == dprobs.numel())
      << "load-balance gradient for layer " << layer << " with " << dprob.size() << " values, not "
      << dprobs.numel() << " (" << dprobs.str() << ")";
  // Uploaded now, between the forward and the backward, where the trainer has waited
  // for the device anyway (router statistics), rather than as a stall inside the backward.
  mt::copy(dprobs, Tensor(const_cast<float*>(dprob.data()), dprobs.shape, DType::f32));
}

}  // namespace mt
