// The pipeline schedules: 1F1B and DeepSeek's DualPipeV, over the schedule unit's
// actions (train/schedule.h).
#include <algorithm>
#include <deque>
#include <map>
#include <numeric>

#include "core/check.h"
#include "train/schedule.h"

namespace mt {

std::vector<int> Pipeline::chunks_of(int rank) const {
  if (!dualpipev) return {rank};
  return {rank, 2 * ranks - 1 - rank};
}

std::vector<int64_t> Pipeline::layers_of(int rank) const {
  std::vector<int64_t> out;
  for (int c = 0; c < chunks(); ++c)
    if (rank_of_chunk(c) == rank)
      for (int64_t l = bounds[c]; l < bounds[c + 1]; ++l) out.push_back(l);
  std::sort(out.begin(), out.end());
  return out;
}

int Pipeline::owner(int64_t layer) const {
  const int64_t l = std::clamp<int64_t>(layer, 0, bounds.back() - 1);
  int c = 0;
  while (bounds[c + 1] <= l) ++c;
  return rank_of_chunk(c);
}

int Pipeline::phase_of(int rank, int64_t layer) const {
  const std::vector<int> c = chunks_of(rank);
  const int64_t l = std::clamp<int64_t>(layer, 0, bounds.back() - 1);
  return c.size() > 1 && l >= bounds[c[1]] && l < bounds[c[1] + 1] ? 1 : 0;
}

Pipeline make_pipeline(int64_t layers, int ranks, const std::string& schedule) {
  MT_CHECK(schedule == "auto" || schedule == "dualpipev" || schedule == "1f1b")
      << "parallelism.pipeline_schedule = " << schedule << ": expected auto, dualpipev or 1f1b";
  Pipeline p;
  p.ranks = ranks;
  p.dualpipev = schedule == "dualpipev" || (schedule == "auto" && ranks > 1);
  const int64_t chunks = p.dualpipev ? 2 * ranks : ranks;
  MT_CHECK(ranks >= 1 && layers >= chunks)
      << "parallelism.pp = " << ranks << " with " << schedule << " cuts the model into " << chunks
      << " chunks of at least one layer, but it has " << layers << " layers";
  p.bounds = {0};
  for (int64_t c = 0; c < chunks; ++c) p.bounds.push_back(p.bounds.back() + layers / chunks + (c < layers % chunks));
  return p;
}

namespace {

// Emits one pp rank's actions chunk by chunk, as DeepSeek's DualPipeV does: counters of
// the micro-batch each phase (the rank's first or second chunk) forwards, backwards,
// sends and receives next; messages queued until a commit; deferred W in a FIFO.
class Emitter {
 public:
  // `training`: the step's schedules, with their needs checked; false: forwards alone.
  Emitter(const ScheduleShape& s, const Pipeline& p, int rank, bool training = true) : s_(s), p_(p), rank_(rank) {
    for (int c : p.chunks_of(rank)) chunk_.push_back({p.bounds[c], p.bounds[c + 1]});
    if (!training) return;
    MT_CHECK(!s.global_balance) << "training.load_balance_type = global_batch needs every micro-batch's forward "
                                << "before the first backward, which a pipeline schedule does not do: use "
                                << "micro_batch with parallelism.pp > 1";
    MT_CHECK(!s.zero3) << "parallelism.zero3 with parallelism.pp > 1 is not supported";
    const int need = p.dualpipev ? 2 * p.ranks : p.ranks;
    MT_CHECK(s.micro_batches >= need) << (p.dualpipev ? "dualpipev" : "1f1b") << " with parallelism.pp = " << p.ranks
                                      << " needs at least " << need << " micro-batches per step, got "
                                      << s.micro_batches << " (global batch / (dp x ep x micro_batch_size))";
  }

  // The chunk's input arrives from, and its output goes to, another rank (or not).
  void recv_forward(int ph) { message(Op::recv_activation, begin(ph), p_.owner(begin(ph) - 1), recv_f_[ph]); }
  void send_forward(int ph) { message(Op::send_activation, end(ph), p_.owner(end(ph)), send_f_[ph]); }
  void recv_backward(int ph) { message(Op::recv_gradient, end(ph), p_.owner(end(ph)), recv_b_[ph]); }
  void send_backward(int ph) { message(Op::send_gradient, begin(ph), p_.owner(begin(ph) - 1), send_b_[ph]); }
  void commit() {
    if (pending_) a_.push_back({Op::commit, 0});
    pending_ = false;
  }

  void forward_chunk(int ph, bool recv = true, bool send = true) {
    if (recv) recv_forward(ph);
    commit();
    const int m = forward_start(ph);
    for (int64_t l = begin(ph); l < end(ph); ++l)
      for (Stage st : kStages) forward_stage(m, l, st, true);
    forward_end(ph, m);
    if (send) send_forward(ph);
  }

  void backward_chunk(int ph, bool zero_bubble = false, bool recv = true, bool send = true) {
    if (recv) recv_backward(ph);
    commit();
    zero_bubble = zero_bubble && s_.defer_weights;
    const int m = backward_start(ph, !zero_bubble);
    for (int64_t l = end(ph) - 1; l >= begin(ph); --l)
      for (int i = 4; i >= 0; --i) backward_stage(m, l, kStages[i], !zero_bubble, true);
    backward_end(ph, m, !zero_bubble);
    if (send) send_backward(ph);
  }

  // Forward of phase f's next micro-batch and backward of phase b's, stage by stage:
  // each exchange one of them starts travels while the other computes.
  void forward_backward_chunk(int f, int b, bool recv_f = true) {
    if (recv_f) recv_forward(f);
    recv_backward(b);
    commit();
    const int mf = forward_start(f), mb = backward_start(b, true);
    int64_t lf = begin(f), lb = end(b) - 1;
    for (; lf < end(f) && lb >= begin(b); ++lf, --lb) {
      backward_stage(mb, lb, Stage::aggregate, true, true);
      backward_stage(mb, lb, Stage::combine, true, false);
      forward_stage(mf, lf, Stage::attention, true);
      finish_backward(mb, lb, Stage::combine);
      forward_stage(mf, lf, Stage::dispatch, false);
      backward_stage(mb, lb, Stage::experts, true, true);
      a_.push_back({Op::finish_forward, mf, lf, Stage::dispatch});
      backward_stage(mb, lb, Stage::dispatch, true, false);
      forward_stage(mf, lf, Stage::experts, true);
      finish_backward(mb, lb, Stage::dispatch);
      forward_stage(mf, lf, Stage::combine, false);
      backward_stage(mb, lb, Stage::attention, true, true);
      a_.push_back({Op::finish_forward, mf, lf, Stage::combine});
      forward_stage(mf, lf, Stage::aggregate, true);
    }
    // Chunks of unequal length: the longer one's remaining layers alone.
    for (; lf < end(f); ++lf)
      for (Stage st : kStages) forward_stage(mf, lf, st, true);
    for (; lb >= begin(b); --lb)
      for (int i = 4; i >= 0; --i) backward_stage(mb, lb, kStages[i], true, true);
    backward_end(b, mb, true);
    forward_end(f, mf);
    send_forward(f);
    send_backward(b);
  }

  void action(const Action& a) {
    commit();
    a_.push_back(a);
  }

  // The oldest deferred W (a whole chunk of one micro-batch).
  void weight_chunk() {
    commit();
    if (!s_.defer_weights) return;  // nothing was deferred
    MT_CHECK(!deferred_.empty()) << "schedule: a W with none deferred";
    auto [ph, m] = deferred_.front();
    deferred_.pop_front();
    if (end(ph) == s_.layers) a_.push_back({Op::head_backward_weight, m});
    for (int64_t l = end(ph) - 1; l >= begin(ph); --l)
      for (int i = 4; i >= 0; --i) a_.push_back({Op::backward_weight, m, l, kStages[i]});
    if (begin(ph) == 0) a_.push_back({Op::embed_backward, m});
  }

  std::vector<Action> finish() {
    commit();
    MT_CHECK(deferred_.empty()) << "schedule: " << deferred_.size() << " W never run";
    if (s_.reduce) add_reductions(a_, s_.layers, false);
    return std::move(a_);
  }

 private:
  int64_t begin(int ph) const { return chunk_[ph].first; }
  int64_t end(int ph) const { return chunk_[ph].second; }
  // Nothing to send where the boundary is the embedding's or the peer is this rank.
  void message(Op op, int64_t boundary, int peer, int& counter) {
    if (boundary <= 0 || peer == rank_) return;
    a_.push_back({op, counter++, boundary});
    pending_ = true;
  }
  int forward_start(int ph) {
    const int m = forward_[ph]++;
    if (ph == 0) a_.push_back({Op::load, m});  // every rank reads the batch, in order
    if (begin(ph) == 0) a_.push_back({Op::embed_forward, m});
    return m;
  }
  void forward_end(int ph, int m) {
    if (end(ph) == s_.layers) a_.push_back({Op::head_forward, m});
    if (ph + 1 == static_cast<int>(chunk_.size())) a_.push_back({Op::statistics, m});  // before its first B here
  }
  void forward_stage(int m, int64_t l, Stage st, bool finish) {
    a_.push_back({Op::forward, m, l, st});
    if (finish) a_.push_back({Op::finish_forward, m, l, st});
  }
  int backward_start(int ph, bool weight_now) {
    const int m = backward_[ph]++;
    if (end(ph) == s_.layers) {
      a_.push_back({Op::head_backward_input, m});
      if (weight_now) a_.push_back({Op::head_backward_weight, m});
    }
    return m;
  }
  void backward_end(int ph, int m, bool weight_now) {
    if (!weight_now) {
      deferred_.push_back({ph, m});
    } else if (begin(ph) == 0) {
      a_.push_back({Op::embed_backward, m});
    }
  }
  void backward_stage(int m, int64_t l, Stage st, bool weight_now, bool finish) {
    a_.push_back({Op::backward_input, m, l, st});
    if (finish) finish_backward(m, l, st, weight_now);
  }
  void finish_backward(int m, int64_t l, Stage st, bool weight_now = true) {
    a_.push_back({Op::finish_backward_input, m, l, st});
    if (weight_now) a_.push_back({Op::backward_weight, m, l, st});
  }

  const ScheduleShape& s_;
  const Pipeline& p_;
  int rank_;
  std::vector<std::pair<int64_t, int64_t>> chunk_;  // per phase: layers [first, second)
  int forward_[2] = {0, 0}, backward_[2] = {0, 0};
  int send_f_[2] = {0, 0}, recv_f_[2] = {0, 0}, send_b_[2] = {0, 0}, recv_b_[2] = {0, 0};
  std::deque<std::pair<int, int>> deferred_;  // (phase, micro-batch) of W not yet run
  bool pending_ = false;
  std::vector<Action> a_;
};

}  // namespace

std::vector<Action> one_f_one_b_schedule(const ScheduleShape& s, const Pipeline& p, int rank) {
  Emitter e(s, p, rank);
  // Warm-up forwards fill the pipeline below this rank; then one forward, one backward.
  const int warmup = std::min(p.ranks - rank - 1, s.micro_batches);
  // Multi-token prediction's embedding copy, where the head is not on rank 0.
  const int64_t L = s.layers;
  const bool copy = s.mtp && p.owner(-1) != p.owner(L) && (rank == p.owner(-1) || rank == p.owner(L));
  const int64_t side = rank == p.owner(-1) ? -1 : L;
  if (copy) e.action({Op::copy_embedding, 0, side});
  for (int i = 0; i < warmup; ++i) e.forward_chunk(0);
  for (int i = 0; i < s.micro_batches - warmup; ++i) {
    e.forward_chunk(0);
    e.backward_chunk(0);
  }
  for (int i = 0; i < warmup; ++i) e.backward_chunk(0);
  if (copy) e.action({Op::embedding_gradient, s.micro_batches - 1, side});
  return e.finish();
}

std::vector<Action> dualpipev_schedule(const ScheduleShape& s, const Pipeline& p, int rank) {
  MT_CHECK(p.dualpipev) << "dualpipev_schedule of a pipeline cut for 1f1b";
  Emitter e(s, p, rank);
  const int P = p.ranks, M = s.micro_batches;
  const bool last = rank == P - 1;

  // Step 1: nF0. Fill the V's first arm below this rank.
  for (int i = 0; i < (P - rank - 1) * 2; ++i) e.forward_chunk(0);

  // Step 2: nF0F1. The first arm and the second in turn.
  e.recv_forward(0);
  for (int i = 0; i <= rank; ++i) {
    e.forward_chunk(0, false, false);
    e.recv_forward(0);
    e.forward_chunk(1, true, !last || i < rank);
    e.send_forward(0);
  }

  // Step 3: nB1W1F1. The first backwards, their W deferred into the next forward's bubble.
  for (int i = 0; i < P - rank - 1; ++i) {
    e.backward_chunk(1, true);
    e.recv_forward(1);
    e.weight_chunk();
    e.forward_chunk(1, false);
  }

  // Step 4: nF0B1F1B0. The steady state: every forward paired with a backward.
  for (int i = 0; i < M - 2 * P + rank + 1; ++i) {
    if (i == 0 && last) {
      // Not overlapped: the second chunk's backward needs this forward's output here.
      e.forward_chunk(0, false, false);
      e.send_forward(1);
      e.backward_chunk(1, false, true, false);
      e.send_forward(0);
      e.send_backward(1);
    } else {
      e.forward_backward_chunk(0, 1, i != 0);
    }
    e.forward_backward_chunk(1, 0);
  }

  // Step 5: nB1F1B0.
  for (int i = 0; i < P - rank - 1; ++i) {
    e.backward_chunk(1);
    e.forward_backward_chunk(1, 0);
  }

  // Step 6: nB1B0. The second half of these defer their W (zero bubble).
  bool zero_bubble = false;
  for (int i = 0; i <= rank; ++i) {
    if (i == (rank + 1) / 2 && rank % 2 == 1) zero_bubble = true;
    e.backward_chunk(1, zero_bubble);
    if (i == (rank + 1) / 2 && rank % 2 == 0) zero_bubble = true;
    e.backward_chunk(0, zero_bubble);
  }

  // Step 7: nWB0. Deferred W between the last backwards.
  for (int i = 0; i < P - rank - 1; ++i) {
    e.weight_chunk();
    e.backward_chunk(0, true);
  }

  // Step 8: nW. The rest of the deferred W.
  for (int i = 0; i <= rank; ++i) e.weight_chunk();
  return e.finish();
}

std::vector<Action> forward_schedule(const ScheduleShape& s, const Pipeline& p, int rank) {
  MT_CHECK(!s.zero3 || p.chunks() == 1) << "forward_schedule: ZeRO-3 runs on one pp rank's sequential order";
  Emitter e(s, p, rank, false);
  for (int m = 0; m < s.micro_batches; ++m)
    for (int ph = 0; ph < static_cast<int>(p.chunks_of(rank).size()); ++ph) {
      e.forward_chunk(ph);
      e.commit();
    }
  std::vector<Action> a = e.finish();
  if (!s.zero3) return a;
  // Each layer's weights gathered for its stages and released after them.
  std::vector<Action> out;
  int64_t open = -1;  // the layer whose weights are gathered
  for (const Action& x : a) {
    const bool stage = x.op == Op::forward || x.op == Op::finish_forward;
    if (open >= 0 && (!stage || x.layer != open)) {
      out.push_back({Op::release, x.micro_batch, open});
      open = -1;
    }
    if (stage && open < 0) {
      out.push_back({Op::gather, x.micro_batch, x.layer});
      out.push_back({Op::finish_gather, x.micro_batch, x.layer});
      open = x.layer;
    }
    out.push_back(x);
  }
  return out;
}

std::vector<Action> make_schedule(const ScheduleShape& s, const Pipeline& p, int rank) {
  if (p.ranks == 1 && !p.dualpipev) return sequential_schedule(s);
  return p.dualpipev ? dualpipev_schedule(s, p, rank) : one_f_one_b_schedule(s, p, rank);
}

double Timeline::bubble() const {
  const double busy_all = std::accumulate(busy.begin(), busy.end(), 0.0);
  return step > 0 ? 1.0 - busy_all / (step * static_cast<double>(busy.size())) : 0.0;
}

Timeline simulate(const std::vector<std::vector<Action>>& per_rank, const Pipeline& p,
                  const std::function<double(int, const Action&)>& cost) {
  const int P = static_cast<int>(per_rank.size());
  auto is_message = [](const Action& m) { return m.op >= Op::send_activation && m.op <= Op::recv_gradient; };
  auto is_send = [](const Action& m) { return m.op == Op::send_activation || m.op == Op::send_gradient; };
  auto is_activation = [](const Action& m) { return m.op == Op::send_activation || m.op == Op::recv_activation; };
  // h[l] travels from layer l - 1's rank to layer l's, dh[l] back.
  auto peer_of = [&](const Action& m) { return p.owner(!is_activation(m) == is_send(m) ? m.layer - 1 : m.layer); };
  // Per (sender, receiver): what was posted so far, in order, with the time.
  std::map<std::pair<int, int>, std::vector<std::pair<Action, double>>> sends, recvs;
  Timeline t;
  t.ranks.resize(P);
  t.busy.assign(P, 0.0);
  std::vector<size_t> at(P, 0);       // next action
  std::vector<double> clock(P, 0.0);
  std::vector<size_t> batch(P, 0);    // the action after the last commit
  struct Waiting {
    Action m;
    std::pair<int, int> key;  // (sender, receiver)
    size_t k;  // its place among the pair's messages this way
  };
  std::vector<std::vector<Waiting>> waiting(P);  // the messages of the commit a rank is at
  std::vector<bool> posted(P, false);
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < P; ++r) {
      while (at[r] < per_rank[r].size()) {
        const Action& a = per_rank[r][at[r]];
        if (is_message(a)) {
          ++at[r];
          continue;
        }
        if (a.op != Op::commit) {
          const double c = cost(r, a);
          if (c > 0) t.ranks[r].push_back({clock[r], clock[r] + c, a});
          clock[r] += c;
          t.busy[r] += c;
          ++at[r];
          moved = true;
          continue;
        }
        if (!posted[r]) {
          waiting[r].clear();
          for (size_t i = batch[r]; i < at[r]; ++i) {
            const Action& m = per_rank[r][i];
            if (!is_message(m)) continue;
            const int q = peer_of(m);
            const std::pair<int, int> key = is_send(m) ? std::make_pair(r, q) : std::make_pair(q, r);
            auto& list = is_send(m) ? sends[key] : recvs[key];
            waiting[r].push_back({m, key, list.size()});
            list.push_back({m, clock[r]});
          }
          posted[r] = moved = true;
        }
        // Done when each message's counterpart is posted (rendezvous).
        double ready = clock[r];
        bool all = true;
        for (const Waiting& w : waiting[r]) {
          const auto& theirs = is_send(w.m) ? recvs[w.key] : sends[w.key];
          if (w.k >= theirs.size()) {
            all = false;
            break;
          }
          const Action& o = theirs[w.k].first;
          MT_CHECK(o.layer == w.m.layer && o.micro_batch == w.m.micro_batch && is_activation(o) == is_activation(w.m))
              << "pipeline: rank " << r << "'s " << describe(w.m) << " meets " << describe(o);
          ready = std::max(ready, theirs[w.k].second);
        }
        if (!all) break;
        clock[r] = ready;
        posted[r] = false;
        batch[r] = ++at[r];
        moved = true;
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    MT_CHECK(at[r] == per_rank[r].size()) << "pipeline: rank " << r << " waits forever at action " << at[r] << " ("
                                          << describe(per_rank[r][at[r]]) << ")";
    t.step = std::max(t.step, clock[r]);
  }
  return t;
}

}  // namespace mt
