#include "train/schedule.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "comm/communicator.h"
#include "core/arena.h"
#include "core/check.h"
#include "kernels/elementwise.h"
#include "models/expert_replicas.h"
#include "parallel/zero3.h"
#include "train/optimizer.h"
#include "train/profile.h"

namespace mt {

namespace {

// Reductions in flight at once: a part's transfer overlaps the next layer's backward;
// more would only hold more staging memory.
constexpr size_t kReductionsInFlight = 2;

constexpr const char* kForwardNames[] = {"attention+router F", "dispatch F", "experts F", "combine F", "aggregate F"};
constexpr const char* kInputNames[] = {"attention+router B", "dispatch B", "experts B", "combine B", "aggregate B"};
constexpr const char* kWeightNames[] = {"attention+router W", "dispatch W", "experts W", "combine W", "aggregate W"};
constexpr const char* kStageNames[] = {"attention", "dispatch", "experts", "combine", "aggregate"};

}  // namespace

const char* profile_name(const Action& a) {
  const int st = static_cast<int>(a.stage);
  switch (a.op) {
    case Op::load: return "load";
    case Op::embed_forward:
    case Op::embed_backward: return "embedding";
    case Op::forward:
    case Op::finish_forward: return kForwardNames[st];
    case Op::head_forward: return "head F";
    case Op::statistics:
    case Op::balance: return "router statistics";
    case Op::head_backward_input: return "head B";
    case Op::head_backward_weight: return "head W";
    case Op::backward_input:
    case Op::finish_backward_input: return kInputNames[st];
    case Op::backward_weight: return kWeightNames[st];
    case Op::gather:
    case Op::finish_gather:
    case Op::attach_gradients: return "zero3 gather";
    case Op::release: return "zero3 release";
    case Op::reduce_start:
    case Op::reduce_finish: return "gradient reduction";
    case Op::copy_embedding:
    case Op::embedding_gradient: return "embedding copy";
    case Op::send_activation:
    case Op::recv_activation:
    case Op::send_gradient:
    case Op::recv_gradient:
    case Op::commit: return "pipeline messages";
  }
  return "?";
}

std::vector<Action> sequential_schedule(const ScheduleShape& s) {
  MT_CHECK(s.layers >= 0 && s.micro_batches >= 1 && s.sweep >= 1)
      << "sequential_schedule: " << s.layers << " layers, " << s.micro_batches << " micro-batches, a sweep of "
      << s.sweep;
  std::vector<Action> a;
  const int64_t L = s.layers;
  // A sweep's head backward follows each micro-batch's head forward (full recomputation
  // shares one block among the sweep, the head's included); alone, it opens the backward.
  const bool sweeping = s.sweep > 1;
  auto head_backward = [&](int m) {
    a.push_back({Op::head_backward_input, m});
    a.push_back({Op::head_backward_weight, m});
  };
  // Micro-batches [m0, m1), layer by layer.
  auto forward = [&](int m0, int m1) {
    if (s.zero3 && L > 0) a.push_back({Op::gather, m0, 0});
    for (int m = m0; m < m1; ++m) {
      a.push_back({Op::load, m});
      a.push_back({Op::embed_forward, m});
    }
    for (int64_t l = 0; l < L; ++l) {
      if (s.zero3) {
        a.push_back({Op::finish_gather, m0, l});
        if (l + 1 < L) a.push_back({Op::gather, m0, l + 1});  // the other weight slot
      }
      for (int m = m0; m < m1; ++m)
        for (Stage st : kStages) {
          a.push_back({Op::forward, m, l, st});
          a.push_back({Op::finish_forward, m, l, st});
        }
      if (s.zero3) a.push_back({Op::release, m0, l});
    }
    for (int m = m0; m < m1; ++m) {
      a.push_back({Op::head_forward, m});
      a.push_back({Op::statistics, m});
      if (sweeping) head_backward(m);
    }
  };
  auto backward = [&](int m0, int m1) {
    if (s.zero3 && L > 0) a.push_back({Op::gather, m0, L - 1});
    if (!sweeping) head_backward(m0);
    for (int64_t l = L - 1; l >= 0; --l) {
      if (s.zero3) {
        a.push_back({Op::finish_gather, m0, l});
        if (l > 0) a.push_back({Op::gather, m0, l - 1});
        a.push_back({Op::attach_gradients, m0, l});  // free: layer l + 2's reduction is finished
      }
      for (int m = m0; m < m1; ++m)
        for (int i = 4; i >= 0; --i) {
          a.push_back({Op::backward_input, m, l, kStages[i]});
          a.push_back({Op::finish_backward_input, m, l, kStages[i]});
          a.push_back({Op::backward_weight, m, l, kStages[i]});
        }
      if (s.zero3) {
        // The gradient slot holds these micro-batches' gradients of the layer: summed into
        // the shards during the next layer's backward.
        a.push_back({Op::release, m0, l});
        a.push_back({Op::reduce_start, m0, l});
        if (l + 1 < L) a.push_back({Op::reduce_finish, m0, l + 1});
      }
    }
    if (s.zero3 && L > 0) a.push_back({Op::reduce_finish, m0, 0});
    for (int m = m0; m < m1; ++m) a.push_back({Op::embed_backward, m});
  };
  const int M = s.micro_batches, G = std::min(s.sweep, M);
  if (s.global_balance) {
    for (int m = 0; m < M; m += G) forward(m, std::min(M, m + G));
    a.push_back({Op::balance, 0});
    for (int m = 0; m < M; m += G) backward(m, std::min(M, m + G));
  } else {
    for (int m = 0; m < M; m += G) {
      forward(m, std::min(M, m + G));
      backward(m, std::min(M, m + G));
    }
  }
  if (s.reduce) add_reductions(a, L, s.zero3);
  return a;
}

void add_reductions(std::vector<Action>& actions, int64_t layers, bool zero3) {
  // A part's last gradient write: a layer's last W, the head's W, the embedding's
  // backward (tied, after the head's W, which writes the same gradient).
  auto part_of = [&](const Action& a) -> std::optional<int64_t> {
    if (a.op == Op::backward_weight && !zero3) return a.layer;
    if (a.op == Op::head_backward_weight) return layers;
    if (a.op == Op::embed_backward) return -1;
    if (a.op == Op::embedding_gradient && a.layer < 0) return -1;  // the copy's, added
    return std::nullopt;
  };
  std::map<int64_t, size_t> last;  // part -> index of its last write
  for (size_t i = 0; i < actions.size(); ++i)
    if (auto part = part_of(actions[i])) last[*part] = i;
  std::vector<Action> out;
  std::deque<int64_t> in_flight;  // parts whose reduction is started and not yet finished
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    out.push_back(a);
    auto part = part_of(a);
    if (!part || last[*part] != i) continue;
    if (in_flight.size() == kReductionsInFlight) {
      out.push_back({Op::reduce_finish, a.micro_batch, in_flight.front()});
      in_flight.pop_front();
    }
    out.push_back({Op::reduce_start, a.micro_batch, *part});
    in_flight.push_back(*part);
  }
  for (int64_t part : in_flight) out.push_back({Op::reduce_finish, out.back().micro_batch, part});
  actions = std::move(out);
}

namespace {

// Slots shared by micro-batches whose lives do not overlap, first come first served. A
// life is a list of closed intervals of action indices, sorted.
using Life = std::vector<std::pair<size_t, size_t>>;
std::vector<int> share_slots(const std::vector<Life>& lives, int* count) {
  const int M = static_cast<int>(lives.size());
  std::vector<int> order(static_cast<size_t>(M));
  for (int m = 0; m < M; ++m) order[m] = m;
  auto start = [&](int m) { return lives[m].empty() ? SIZE_MAX : lives[m].front().first; };
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return start(x) < start(y); });
  std::vector<int> slot(static_cast<size_t>(M), 0);
  // Per slot: the disjoint intervals of the micro-batches given it, start -> end.
  std::vector<std::map<size_t, size_t>> held;
  auto overlaps = [](const std::map<size_t, size_t>& h, const Life& life) {
    for (auto [a0, a1] : life) {
      auto it = h.upper_bound(a1);  // the latest interval starting by a1 ends the latest
      if (it != h.begin() && std::prev(it)->second >= a0) return true;
    }
    return false;
  };
  for (int m : order) {
    size_t k = 0;
    while (k < held.size() && overlaps(held[k], lives[m])) ++k;
    if (k == held.size()) held.emplace_back();
    for (auto [a0, a1] : lives[m]) held[k][a0] = a1;
    slot[m] = static_cast<int>(k);
  }
  *count = static_cast<int>(held.size());
  return slot;
}

// One interval a micro-batch: from the first action that life_end gives an end for
// (nothing: the action does not touch it) to the latest such end.
std::vector<Life> whole_lives(const std::vector<Action>& actions, int micro_batches,
                              const std::function<std::optional<size_t>(size_t)>& life_end) {
  std::vector<Life> lives(static_cast<size_t>(micro_batches));
  for (size_t i = 0; i < actions.size(); ++i) {
    const std::optional<size_t> end = life_end(i);
    if (!end) continue;
    Life& l = lives[static_cast<size_t>(actions[i].micro_batch)];
    if (l.empty())
      l.push_back({i, *end});
    else
      l.front().second = std::max(l.front().second, *end);
  }
  return lives;
}

bool is_message(Op op) { return op >= Op::send_activation && op <= Op::recv_gradient; }

// The chunk of this rank whose block an action works in: 0 or 1, 2 for both (routing
// statistics read every layer), -1 for none (tokens, the embedding and messages use the
// bare stash).
int block_phase(const Action& a, const Pipeline& p, int rank, int64_t layers) {
  switch (a.op) {
    case Op::forward: case Op::finish_forward: case Op::backward_input: case Op::finish_backward_input:
    case Op::backward_weight: return p.phase_of(rank, a.layer);
    case Op::head_forward: case Op::head_backward_input: case Op::head_backward_weight:
      return p.phase_of(rank, layers - 1);
    case Op::statistics: case Op::balance: return 2;
    default: return -1;
  }
}

}  // namespace

std::vector<int> stash_slots(const std::vector<Action>& actions, int micro_batches, int* count) {
  auto life_end = [&](size_t i) -> std::optional<size_t> {
    const Op op = actions[i].op;
    if (op > Op::embed_backward && !is_message(op)) return std::nullopt;
    size_t end = i;
    if (op == Op::send_activation || op == Op::send_gradient)
      while (end < actions.size() && actions[end].op != Op::commit) ++end;  // read until its commit
    return end;
  };
  return share_slots(whole_lives(actions, micro_batches, life_end), count);
}

std::vector<ChunkBlocks> chunk_blocks(const std::vector<Action>& actions, int micro_batches, const Pipeline& p,
                                      int rank, int64_t layers, bool one_layer) {
  std::vector<ChunkBlocks> out;
  for (int c : p.chunks_of(rank)) {
    const int phase = static_cast<int>(out.size());
    ChunkBlocks b;
    b.first = p.bounds[c];
    b.last = p.bounds[c + 1];
    auto touches = [&](size_t i) {
      const int ph = block_phase(actions[i], p, rank, layers);
      return ph == phase || ph == 2;
    };
    std::vector<Life> lives;
    if (!one_layer) {
      lives = whole_lives(actions, micro_batches,
                          [&](size_t i) -> std::optional<size_t> { return touches(i) ? std::optional(i) : std::nullopt; });
    } else {
      // A visit goes on while the micro-batch's next action in the block is on the same
      // layer (the head: `layers`); routing statistics live in the bare stash.
      lives.resize(static_cast<size_t>(micro_batches));
      std::vector<int64_t> at(static_cast<size_t>(micro_batches), -2);
      for (size_t i = 0; i < actions.size(); ++i) {
        const Action& a = actions[i];
        if (a.op == Op::statistics || a.op == Op::balance || !touches(i)) continue;
        const bool head = a.op == Op::head_forward || a.op == Op::head_backward_input || a.op == Op::head_backward_weight;
        const int64_t key = head ? layers : a.layer;
        Life& l = lives[static_cast<size_t>(a.micro_batch)];
        if (at[static_cast<size_t>(a.micro_batch)] == key)
          l.back().second = i;
        else
          l.push_back({i, i});
        at[static_cast<size_t>(a.micro_batch)] = key;
      }
    }
    b.slot = share_slots(lives, &b.count);
    out.push_back(std::move(b));
  }
  return out;
}

size_t row_peak(const std::vector<Action>& actions, Model& model, int micro_batches, int64_t batch, int64_t seq) {
  std::vector<std::unique_ptr<Stash>> stashes;
  for (int m = 0; m < micro_batches; ++m) stashes.push_back(model.make_bare_stash(batch, seq));
  model.reset_row_memory();
  for (const Action& a : actions) {
    Stash& s = *stashes.at(static_cast<size_t>(a.micro_batch));
    if (a.op == Op::forward) model.stage_forward(a.layer, a.stage, s);
    if (a.op == Op::backward_input) model.stage_backward_input(a.layer, a.stage, s);
    if (a.op == Op::backward_weight) model.stage_backward_weight(a.layer, a.stage, s);
  }
  return model.row_memory().peak;
}

namespace {

// copy_embedding and embedding_gradient (schedule.h): rank 0's embedding and the head's
// rank's copy, in blocks of rows (a bounded buffer for the gradient to add).
void exchange_embedding(const Action& a, ScheduleContext& ctx) {
  const bool original = a.layer < 0;
  Param* p = original ? ctx.model->embedding() : ctx.model->embedding_copy();
  MT_CHECK(p != nullptr && ctx.pipeline != nullptr && ctx.pp != nullptr)
      << "schedule: " << describe(a) << " on a rank without the embedding's " << (original ? "weights" : "copy")
      << " or without a pipeline";
  const int peer = ctx.pipeline->owner(original ? ctx.model->num_layers() : -1);
  const int64_t V = p->value.dim(0), H = p->value.dim(1);
  const int64_t rows = std::max<int64_t>(1, (int64_t{64} << 20) / (H * 4));
  if (a.op == Op::copy_embedding) {
    for (int64_t r = 0; r < V; r += rows) {
      const Tensor block = p->value.rows(r, std::min(V, r + rows));
      if (original) ctx.pp->send(block, peer);
      else ctx.pp->recv(block, peer);
    }
    p->grad_started = false;  // the step's first write replaces the copy's gradient
    return;
  }
  if (!original) {
    if (!p->grad_started) mt::fill(p->grad, 0.0f);
    for (int64_t r = 0; r < V; r += rows) ctx.pp->send(p->grad.rows(r, std::min(V, r + rows)), peer);
    return;
  }
  Arena buffer("embedding copy's gradient", p->grad.device, static_cast<size_t>(std::min(V, rows) * H * 4));
  const Tensor in = buffer.alloc(DType::f32, {std::min(V, rows), H});
  const Tensor& grad = p->grad;
  if (!p->grad_started) mt::fill(grad, 0.0f);
  p->grad_started = true;
  for (int64_t r = 0; r < V; r += rows) {
    const int64_t n = std::min(V, r + rows) - r;
    const Tensor part = in.rows(0, n), mine = grad.rows(r, r + n);
    ctx.pp->recv(part, peer);
    mt::add(mine, part, mine);
  }
}

}  // namespace

void run_schedule(const std::vector<Action>& actions, ScheduleContext& ctx) {
  Model& model = *ctx.model;
  const int64_t L = model.num_layers();
  ctx.losses.assign(ctx.stashes.size(), LossSum{});
  std::set<int64_t> reduced;  // ZeRO-3 layers reduced once this step: later micro-batches add
  std::vector<comm::P2P> pending;  // pipeline messages until the next commit
  std::map<const Stash*, std::array<ActivationBlock*, 2>> lent;  // this step's
  // A head backward to come lets the head's forward leave the logits' gradient in place.
  const bool backward = std::any_of(actions.begin(), actions.end(),
                                    [](const Action& a) { return a.op == Op::head_backward_input; });
  for (const Action& a : actions) {
    MT_CHECK(a.micro_batch >= 0 && static_cast<size_t>(a.micro_batch) < ctx.stashes.size())
        << "schedule: " << describe(a) << " but the step has " << ctx.stashes.size() << " micro-batches";
    Stash& s = *ctx.stashes[static_cast<size_t>(a.micro_batch)];
    const int phase = ctx.blocks.empty() ? -1 : block_phase(a, *ctx.pipeline, ctx.pp_rank, L);
    for (size_t q = 0; phase >= 0 && q < ctx.blocks.size(); ++q) {
      if (phase != 2 && static_cast<int>(q) != phase) continue;
      ActivationBlock* b = ctx.blocks[q][static_cast<size_t>(a.micro_batch)];
      if (lent[&s][q] == b) continue;
      model.lend(s, *b);
      lent[&s][q] = b;
    }
    if (ctx.profile != nullptr && a.op != Op::release) ctx.profile->mark(profile_name(a));
    const bool zero3_layer = ctx.zero3 != nullptr && a.layer >= 0 && a.layer < L;
    auto zero3 = [&]() -> parallel::Zero3& {
      MT_CHECK(ctx.zero3 != nullptr) << "schedule: " << describe(a) << " without ZeRO-3";
      return *ctx.zero3;
    };
    switch (a.op) {
      case Op::load:
      case Op::statistics:
      case Op::balance:
        ctx.trainer(a);
        break;
      case Op::embed_forward: model.embed_forward(s); break;
      case Op::forward: model.stage_forward(a.layer, a.stage, s); break;
      case Op::finish_forward: model.finish_forward(a.layer, a.stage, s); break;
      case Op::head_forward:
        ctx.losses[static_cast<size_t>(a.micro_batch)] = model.head_forward(s, backward ? ctx.loss_scale : 0.0f);
        ctx.mtp_losses.resize(std::max(ctx.mtp_losses.size(), s.mtp_loss.size()));
        for (size_t k = 0; k < s.mtp_loss.size(); ++k) {
          ctx.mtp_losses[k].sum += s.mtp_loss[k].sum;
          ctx.mtp_losses[k].count += s.mtp_loss[k].count;
        }
        break;
      case Op::head_backward_input: model.head_backward_input(s, ctx.loss_scale); break;
      case Op::head_backward_weight: model.head_backward_weight(s); break;
      case Op::backward_input: model.stage_backward_input(a.layer, a.stage, s); break;
      case Op::finish_backward_input: model.finish_backward_input(a.layer, a.stage, s); break;
      case Op::backward_weight: model.stage_backward_weight(a.layer, a.stage, s); break;
      case Op::embed_backward: model.embed_backward(s); break;
      case Op::gather: zero3().gather_start(a.layer); break;
      case Op::finish_gather: zero3().gather_finish(a.layer); break;
      case Op::release: zero3().release(a.layer); break;
      case Op::attach_gradients: zero3().attach_gradients(a.layer); break;
      case Op::reduce_start:
        if (zero3_layer) {
          ctx.zero3->reduce_start(a.layer, !reduced.insert(a.layer).second);
        } else {
          MT_CHECK(ctx.optimizer != nullptr) << "schedule: " << describe(a) << " without a sharded optimizer";
          // A layer's replica gradients join their owners' before the owners' are summed.
          if (ExpertReplicas* r = ctx.model->expert_replicas()) r->sum_gradients(a.layer);
          ctx.optimizer->reduce_start(a.layer);
        }
        break;
      case Op::reduce_finish:
        if (zero3_layer)
          ctx.zero3->reduce_finish(a.layer);
        else
          ctx.optimizer->reduce_finish(a.layer);
        break;
      case Op::copy_embedding:
      case Op::embedding_gradient: exchange_embedding(a, ctx); break;
      case Op::send_activation:
      case Op::recv_activation:
      case Op::send_gradient:
      case Op::recv_gradient: {
        MT_CHECK(ctx.pipeline != nullptr && ctx.pp != nullptr) << "schedule: " << describe(a) << " without a pipeline";
        // h[l] travels from layer l - 1's rank to layer l's, dh[l] back.
        const bool grad = a.op == Op::send_gradient || a.op == Op::recv_gradient;
        const bool send = a.op == Op::send_activation || a.op == Op::send_gradient;
        const int64_t peer_layer = grad == send ? a.layer - 1 : a.layer;
        pending.push_back({send, (grad ? s.dh : s.h)[a.layer], ctx.pipeline->owner(peer_layer)});
        break;
      }
      case Op::commit:
        ctx.pp->start(pending).wait();
        pending.clear();
        break;
    }
  }
  MT_CHECK(pending.empty()) << "schedule: " << pending.size() << " pipeline messages never committed";
}

std::string describe(const Action& a) {
  static constexpr const char* kOps[] = {
      "load", "embed F", "F",      "finish F",      "head F",  "statistics",       "balance", "head B",
      "head W", "B",     "finish B", "W",           "embed W", "gather",           "finish gather",
      "release", "attach gradients", "reduce",      "finish reduce", "copy embedding", "embedding gradient", "send h", "recv h", "send dh", "recv dh",
      "commit"};
  std::string s = kOps[static_cast<int>(a.op)];
  const bool stage = a.op == Op::forward || a.op == Op::finish_forward || a.op == Op::backward_input ||
                     a.op == Op::finish_backward_input || a.op == Op::backward_weight;
  // ZeRO-3 and reductions name a layer or part.
  if (stage || (a.op >= Op::gather && a.op != Op::commit)) s.append(" ").append(std::to_string(a.layer));
  if (stage) s.append(" ").append(kStageNames[static_cast<int>(a.stage)]);
  return s.append(" mb ").append(std::to_string(a.micro_batch));
}

}  // namespace mt
