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
// exchange finished right after it starts, each W right after its B. With ZeRO-3 the
// next layer's gather starts before the current layer's stages, and a layer's gradient
// reduction runs during the next layer's backward. With a sweep of G > 1
// (training.layer_sweep) the micro-batches go G at a time, layer by layer: a layer's
// forward for all G, then the next layer's; each one's head forward and backward; then
// the layers' backwards from the last, each for all G. A layer's weights are then used G
// times in a row (the expert cache and ZeRO-3's gathers fetch them once), and every
// parameter's gradient still gets the micro-batches' additions in order, so the losses
// and gradients are those of G = 1 (a tied embedding's two writes interleave otherwise).
// The pipeline schedules keep their own order: a sweep is for one pp rank.
//
// The pipeline schedules (parallelism.pp > 1) give each pp rank its own list over the
// layers it holds (Pipeline): one_f_one_b_schedule and dualpipev_schedule, DeepSeek's
// eight phases, where a forward chunk of one micro-batch and a backward chunk of another
// run stage by stage interleaved, each one's exchanges in flight during the other's
// compute. The residual stream crosses ranks as point-to-point messages (send_*, recv_*),
// started together at the next commit and joined there, as DeepSeek's DualPipe does.
//
// In every schedule, sharded gradients of a part start their reduction right after the
// part's last gradient write and are finished two parts later (add_reductions).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/interface.h"

namespace mt {

namespace comm {
class Communicator;
}
namespace parallel {
class Zero3;
}
class Optimizer;
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
  // Multi-token prediction where the head's pp rank does not hold the embedding (1F1B):
  // that rank's copy (Model::embedding_copy) takes rank 0's weights at the step's start,
  // and at its end rank 0 adds the copy's gradient into the embedding's before reducing
  // it. Blocking point-to-point transfers between the two, in blocks of rows; `layer` -1
  // on rank 0, L on the head's rank.
  copy_embedding,
  embedding_gradient,
  // Pipeline messages of the residual stream h[layer] (activation) or its gradient
  // dh[layer], queued until the next commit, which starts them all and waits for them.
  send_activation,
  recv_activation,
  send_gradient,
  recv_gradient,
  commit,
};

// layer: the decoder layer for stages, gather and release; for reductions the part,
// -1 the embedding, 0 .. L-1 a decoder layer, L the head; for messages the boundary l
// (h[l] is the input of layer l, the output of layer l - 1).
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
  // DualPipeV's zero-bubble W deferral; off, each W follows its B (full recomputation,
  // whose blocks hold one layer at a time, needs that).
  bool defer_weights = true;
  int sweep = 1;  // micro-batches that pass each layer together (sequential_schedule)
  bool mtp = false;  // multi-token prediction depths run with the head (the copy actions)
};

std::vector<Action> sequential_schedule(const ScheduleShape& shape);

// Pipeline parallelism over P ranks: the L decoder layers cut into chunks of
// consecutive layers, as evenly as possible (the first L mod C chunks one layer longer).
// 1F1B: P chunks, rank r holds chunk r. DualPipeV: 2P chunks in a V, rank r holds chunks
// r and 2P-1-r, so rank 0 holds both ends. The embedding goes with the first layer and
// the head with the last.
struct Pipeline {
  int ranks = 1;
  bool dualpipev = false;
  std::vector<int64_t> bounds;  // chunk c: layers [bounds[c], bounds[c + 1])
  int chunks() const { return static_cast<int>(bounds.size()) - 1; }
  int rank_of_chunk(int c) const { return c < ranks ? c : 2 * ranks - 1 - c; }
  // This rank's chunks in the order its micro-batches pass them (phase 0, then 1).
  std::vector<int> chunks_of(int rank) const;
  std::vector<int64_t> layers_of(int rank) const;
  // The rank holding layer l (-1: the embedding's, L: the head's).
  int owner(int64_t layer) const;
  // Which of `rank`'s chunks (0 or 1) holds layer l (clamped to the decoder layers).
  int phase_of(int rank, int64_t layer) const;
};
// `schedule` is parallelism.pipeline_schedule: auto (dualpipev when ranks > 1), 1f1b
// (on one rank the sequential order) or dualpipev (on one rank both chunks of the V
// there: the forward-backward pairing without a pipeline). Errors name what is wrong:
// another schedule, fewer layers than chunks.
Pipeline make_pipeline(int64_t layers, int ranks, const std::string& schedule);

// pp rank `rank`'s list. They need micro_batches >= P (1F1B) or >= 2P (DualPipeV), and
// neither global_balance nor zero3 (errors say so).
std::vector<Action> one_f_one_b_schedule(const ScheduleShape& shape, const Pipeline& p, int rank);
std::vector<Action> dualpipev_schedule(const ScheduleShape& shape, const Pipeline& p, int rank);
// Forwards alone (validation, train/trainer.h): each micro-batch through every chunk of
// the V or the pipe in turn, its messages committed at once, so one stash and one block a
// chunk serve them all; with zero3 (one chunk) each layer gathered around its stages.
// It takes any number of micro-batches.
std::vector<Action> forward_schedule(const ScheduleShape& shape, const Pipeline& p, int rank);
// The one a run uses: sequential on one pp rank (unless dualpipev), else the pipeline's.
std::vector<Action> make_schedule(const ScheduleShape& shape, const Pipeline& p, int rank);

// Every pp rank's list played out against the others' with `cost(rank, action)` seconds
// of compute an action: a rank runs its actions in order; a commit starts when the rank
// reaches it and ends when every message in it has been posted by its peer too (k-th
// send from a to b meets b's k-th receive from a, which must name the same tensor and
// micro-batch). Messages take no time. An error names the first rank that can never go
// on (a deadlock) or the first mismatched message.
struct Timeline {
  struct Box {
    double start = 0, end = 0;
    Action action;
  };
  std::vector<std::vector<Box>> ranks;  // per rank, actions with a cost in the order they ran
  double step = 0;                      // when the last rank finishes
  std::vector<double> busy;             // per rank: seconds of compute
  double bubble() const;                // idle share of P x step
};
Timeline simulate(const std::vector<std::vector<Action>>& per_rank, const Pipeline& p,
                  const std::function<double(int, const Action&)>& cost);

// Inserts the reductions of sharded gradients (each part's after its last gradient
// write, at most two in flight). With zero3 the layers are reduced by the schedule
// itself, so only the embedding and the head are added.
void add_reductions(std::vector<Action>& actions, int64_t layers, bool zero3);

// A stash for each micro-batch, shared by micro-batches whose lives on this rank (first
// to last action touching the stash, a send until its commit) do not overlap: slot[m]
// and the number of stashes.
std::vector<int> stash_slots(const std::vector<Action>& actions, int micro_batches, int* count);
// The same for the activation blocks (models/interface.h) of each of the rank's chunks:
// a micro-batch holds one from its first to its last stage (or head) action there. With
// `one_layer` (full recomputation: a block holds one layer's activations, and nothing in
// it outlives the layer's forward or its backward) only during each visit, the run of
// its actions on one layer or the head: micro-batches whose visits do not overlap share.
struct ChunkBlocks {
  int64_t first = 0, last = 0;  // the chunk's layers
  std::vector<int> slot;        // micro-batch -> its block
  int count = 0;                // blocks
};
std::vector<ChunkBlocks> chunk_blocks(const std::vector<Action>& actions, int micro_batches, const Pipeline& p,
                                      int rank, int64_t layers, bool one_layer = false);

// The most bytes of expert rows (RowMemory) the model holds at once over `actions`: their
// stage calls played in order against a plan-only model (ModelOptions::plan_only), whose
// stages only take and give back the rows its routing skew says, on one stash of
// batch x seq tokens a micro-batch. Its peak is what a run with that routing reports.
size_t row_peak(const std::vector<Action>& actions, Model& model, int micro_batches, int64_t batch, int64_t seq);

// What the runner works on. `stashes[m]` is micro-batch m's (several micro-batches may
// share one when their lifetimes do not overlap); `blocks[phase][m]` the activation
// block it borrows for the rank's chunk `phase`, lent by the runner at the first action
// there (none: the stashes have their own).
struct ScheduleContext {
  Model* model = nullptr;
  std::vector<Stash*> stashes;
  std::vector<std::vector<ActivationBlock*>> blocks;
  int pp_rank = 0;
  float loss_scale = 1.0f;                  // d(loss)/d(logits) scale of head_backward_input
  parallel::Zero3* zero3 = nullptr;         // null: the layers' weights are full here
  Optimizer* optimizer = nullptr;               // for reduce_*: sharded
  StepProfile* profile = nullptr;           // null: no marks
  const Pipeline* pipeline = nullptr;       // for messages: whose layers are whose
  comm::Communicator* pp = nullptr;         // ... and the pp group they go over
  std::function<void(const Action&)> trainer;  // load, statistics, balance
  std::vector<LossSum> losses;              // per micro-batch, filled by head_forward
  std::vector<LossSum> mtp_losses;          // per multi-token prediction depth, summed over micro-batches
};

void run_schedule(const std::vector<Action>& actions, ScheduleContext& ctx);

// "F 3 dispatch mb 1", for test messages.
std::string describe(const Action& a);
// The metrics.profile name an action's time is counted under ("experts B"); an
// exchange's finish is counted with its stage, since the wait is its cost.
const char* profile_name(const Action& a);

}  // namespace mt
