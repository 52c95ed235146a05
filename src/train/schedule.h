// The schedule unit: the order in which one rank runs a training step, as a flat list
// of actions, and the one runner that executes such a list.
//
// A generator decides the order (which micro-batch's which stage runs when, where an
// exchange's start and finish go, when a layer's weights are gathered and its
// gradients reduced); the runner only executes: model stages through the stage
// protocol (models/interface.h), ZeRO-3's gathers and releases, the optimizer's
// gradient reductions, and the trainer's own actions (loading a micro-batch, routing
// statistics) through a callback. It also marks every action for metrics.profile.
//
//   ScheduleShape shape{.layers = L, .micro_batches = M, .global_balance = ...};
//   run_schedule(sequential_schedule(shape), context);
//
// sequential_schedule is the single-rank order: each micro-batch's forward, head and
// backward in turn (with global_balance, every forward before any backward), each
// exchange finished right after it starts, each W right after its B. Reductions of
// sharded gradients start as soon as a part's last W is done and are finished two
// parts later; with ZeRO-3 the next layer's gather starts before the current layer's
// stages, and a layer's gradient reduction runs during the next layer's backward.
// The pipeline schedules (1F1B, DualPipeV) are further generators over the same actions.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/interface.h"

namespace mt {

namespace parallel {
class Zero3;
}
class AdamW;
class StepProfile;

enum class Op : uint8_t {
  load,                   // trainer: the micro-batch's tokens into its stash
  embed_forward,
  forward,                // a layer's stage; an exchange stage starts its transfer
  finish_forward,         // an exchange stage's transfer joined, the stage completed
  head_forward,           // final norm, LM head, loss (kept in the context's losses)
  statistics,             // trainer: routing statistics of a micro-batch (and its balance gradient)
  balance,                // trainer: the global-batch balance gradient, after every forward
  head_backward_input,
  head_backward_weight,
  backward_input,         // B; an exchange stage starts its transfer
  finish_backward_input,  // an exchange stage's transfer joined
  backward_weight,        // W
  embed_backward,
  // From here on an action names a layer or part (describe() relies on the order).
  gather,                 // ZeRO-3: a layer's weights start coming into a weight slot
  finish_gather,          // ZeRO-3: ... and are there
  release,                // ZeRO-3: the weight slot given back
  attach_gradients,       // ZeRO-3: a gradient slot for the layer's backward
  reduce_start,           // a part's gradients start summing into the optimizer's shards
  reduce_finish,          // ... and are joined
};

// layer: the decoder layer for stages, gather and release; for reductions the part,
// -1 the embedding, 0 .. L-1 a decoder layer, L the head.
struct Action {
  Op op = Op::load;
  int micro_batch = 0;
  int64_t layer = 0;
  Stage stage = Stage::attention;
};

struct ScheduleShape {
  int64_t layers = 0;
  int micro_batches = 1;
  bool global_balance = false;  // the balance term needs every micro-batch's routing first
  bool zero3 = false;           // layers are gathered around their stages and reduced per micro-batch
  bool reduce = false;          // sharded gradients: each part is reduced after its last backward
};

std::vector<Action> sequential_schedule(const ScheduleShape& shape);

// What the runner works on. `stashes[m]` is micro-batch m's (several micro-batches may
// share one when their lifetimes do not overlap).
struct ScheduleContext {
  Model* model = nullptr;
  std::vector<Stash*> stashes;
  float loss_scale = 1.0f;                  // d(loss)/d(logits) scale of head_backward_input
  parallel::Zero3* zero3 = nullptr;         // null: the layers' weights are full here
  AdamW* optimizer = nullptr;               // for reduce_*: sharded
  StepProfile* profile = nullptr;           // null: no marks
  std::function<void(const Action&)> trainer;  // load, statistics, balance
  std::vector<LossSum> losses;              // per micro-batch, filled by head_forward
};

void run_schedule(const std::vector<Action>& actions, ScheduleContext& ctx);

// "F 3 dispatch mb 1", for test messages.
std::string describe(const Action& a);

}  // namespace mt
