#include "train/schedule.h"

#include <deque>
#include <set>

#include "core/check.h"
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

// Profile names. An exchange's finish is counted with its stage: the wait is its cost.
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
  }
  return "?";
}

}  // namespace

std::vector<Action> sequential_schedule(const ScheduleShape& s) {
  MT_CHECK(s.layers >= 0 && s.micro_batches >= 1)
      << "sequential_schedule: " << s.layers << " layers and " << s.micro_batches << " micro-batches";
  std::vector<Action> a;
  const int64_t L = s.layers;
  std::deque<int64_t> in_flight;  // parts whose reduction is started and not yet finished
  auto reduce = [&](int m, int64_t part) {
    if (in_flight.size() == kReductionsInFlight) {
      a.push_back({Op::reduce_finish, m, in_flight.front()});
      in_flight.pop_front();
    }
    a.push_back({Op::reduce_start, m, part});
    in_flight.push_back(part);
  };
  auto forward = [&](int m) {
    if (s.zero3 && L > 0) a.push_back({Op::gather, m, 0});
    a.push_back({Op::load, m});
    a.push_back({Op::embed_forward, m});
    for (int64_t l = 0; l < L; ++l) {
      if (s.zero3) {
        a.push_back({Op::finish_gather, m, l});
        if (l + 1 < L) a.push_back({Op::gather, m, l + 1});  // the other weight slot
      }
      for (Stage st : kStages) {
        a.push_back({Op::forward, m, l, st});
        a.push_back({Op::finish_forward, m, l, st});
      }
      if (s.zero3) a.push_back({Op::release, m, l});
    }
    a.push_back({Op::head_forward, m});
    a.push_back({Op::statistics, m});
  };
  auto backward = [&](int m) {
    // Sharded gradients are complete after the last micro-batch's backward of a part.
    const bool last = s.reduce && m == s.micro_batches - 1;
    if (s.zero3 && L > 0) a.push_back({Op::gather, m, L - 1});
    a.push_back({Op::head_backward_input, m});
    a.push_back({Op::head_backward_weight, m});
    if (last) reduce(m, L);
    for (int64_t l = L - 1; l >= 0; --l) {
      if (s.zero3) {
        a.push_back({Op::finish_gather, m, l});
        if (l > 0) a.push_back({Op::gather, m, l - 1});
        a.push_back({Op::attach_gradients, m, l});  // free: layer l + 2's reduction is finished
      }
      for (int i = 4; i >= 0; --i) {
        a.push_back({Op::backward_input, m, l, kStages[i]});
        a.push_back({Op::finish_backward_input, m, l, kStages[i]});
        a.push_back({Op::backward_weight, m, l, kStages[i]});
      }
      if (s.zero3) {
        // The gradient slot holds this micro-batch's gradients of the layer: summed into
        // the shards during the next layer's backward.
        a.push_back({Op::release, m, l});
        a.push_back({Op::reduce_start, m, l});
        if (l + 1 < L) a.push_back({Op::reduce_finish, m, l + 1});
      } else if (last) {
        reduce(m, l);
      }
    }
    if (s.zero3 && L > 0) a.push_back({Op::reduce_finish, m, 0});
    a.push_back({Op::embed_backward, m});
    if (last) reduce(m, -1);
  };
  if (s.global_balance) {
    for (int m = 0; m < s.micro_batches; ++m) forward(m);
    a.push_back({Op::balance, 0});
    for (int m = 0; m < s.micro_batches; ++m) backward(m);
  } else {
    for (int m = 0; m < s.micro_batches; ++m) {
      forward(m);
      backward(m);
    }
  }
  for (int64_t part : in_flight) a.push_back({Op::reduce_finish, s.micro_batches - 1, part});
  return a;
}

void run_schedule(const std::vector<Action>& actions, ScheduleContext& ctx) {
  Model& model = *ctx.model;
  const int64_t L = model.num_layers();
  ctx.losses.assign(ctx.stashes.size(), LossSum{});
  std::set<int64_t> reduced;  // ZeRO-3 layers reduced once this step: later micro-batches add
  for (const Action& a : actions) {
    MT_CHECK(a.micro_batch >= 0 && static_cast<size_t>(a.micro_batch) < ctx.stashes.size())
        << "schedule: " << describe(a) << " but the step has " << ctx.stashes.size() << " micro-batches";
    Stash& s = *ctx.stashes[static_cast<size_t>(a.micro_batch)];
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
      case Op::head_forward: ctx.losses[static_cast<size_t>(a.micro_batch)] = model.head_forward(s); break;
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
          ctx.zero3->reduce_start(a.layer, reduced.count(a.layer) > 0);
          reduced.insert(a.layer);
        } else {
          MT_CHECK(ctx.optimizer != nullptr) << "schedule: " << describe(a) << " without a sharded optimizer";
          ctx.optimizer->reduce_start(a.layer);
        }
        break;
      case Op::reduce_finish:
        if (zero3_layer)
          ctx.zero3->reduce_finish(a.layer);
        else
          ctx.optimizer->reduce_finish(a.layer);
        break;
    }
  }
}

std::string describe(const Action& a) {
  static constexpr const char* kOps[] = {
      "load", "embed F", "F",      "finish F",      "head F",  "statistics",       "balance", "head B",
      "head W", "B",     "finish B", "W",           "embed W", "gather",           "finish gather",
      "release", "attach gradients", "reduce",      "finish reduce"};
  std::string s = kOps[static_cast<int>(a.op)];
  const bool stage = a.op == Op::forward || a.op == Op::finish_forward || a.op == Op::backward_input ||
                     a.op == Op::finish_backward_input || a.op == Op::backward_weight;
  if (stage || a.op >= Op::gather) s += " " + std::to_string(a.layer);  // ZeRO-3 and reductions: a layer or part
  if (stage) s += std::string(" ") + kStageNames[static_cast<int>(a.stage)];
  return s + " mb " + std::to_string(a.micro_batch);
}

}  // namespace mt
