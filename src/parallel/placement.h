// Expert placement under expert parallelism: which ep ranks hold which experts of a
// layer, and the planner that chooses it from the experts' loads (hot experts get
// replicas on other ranks, so that the busiest rank receives fewer rows).
//
// E experts over P ranks: rank r owns experts [r*E/P, (r+1)*E/P) (their master weights
// and optimizer state stay there, sharded as without replicas) and holds R more slots,
// each a replica of an expert another rank owns (-1: empty). A replica computes with
// its expert's weights; its gradient is summed into the owner's.
//
// The planner is DeepSeek's EPLB with the owners fixed:
//   1. replication: the P*R replicas go one at a time to the expert with the highest
//      load per copy (load / copies; ties to the lower expert), at most one copy a rank;
//   2. packing: the replicas, heaviest per copy first (ties: lower expert), each to the
//      rank of least predicted load (ties: lower rank) that has a free slot and no copy
//      of it yet; a rank's predicted load is the sum over its slots of load / copies;
//   3. the copies' shares of each expert's rows (balance_shares, below).
// With several nodes (ranks node-major, `ranks_per_node` each) it runs per node: an
// expert's replicas stay on its owner's node, so their weights and gradients move over
// the node's own links, and the node's slots go to the node's experts.
//
// Each copy of an expert has a share of its rows, the shares of its copies summing to 1.
// With senders spread evenly, a holder receives at least its own senders' rows, 1/P of
// the expert's; balance_shares gives the rest to the holders of least predicted load
// (water-filling, in fixed sweeps over the experts in order). Shares only steer routing,
// so they can be refreshed every step from the average without moving any weights.
//
// Routing to replicas (the rule the dispatch applies): a slot of token t on rank q for
// expert e goes to q itself when q holds a copy of e. Else, with u(t) = t x 2654435769
// mod 2^32 (frac(t x 0.618...) in 32 bits: the golden-ratio sequence, even over any run
// of tokens), to the first copy in rank order whose running sum of (share - 1/P),
// scaled to 2^32 by their total, exceeds u(t): each copy receives its share of the
// expert's rows. Integers only, so the host and the device route alike.
//
// Loads are a layer's slots an expert received a step (the metrics' expert_counts, summed
// over the ranks), averaged over steps by an exponential moving average.
#pragma once

#include <cstdint>
#include <vector>

namespace mt::parallel {

struct Placement {
  int64_t experts = 0, ranks = 1, replicas = 0;  // E, P, R
  // [r][i]: rank r's slot i, i < E/P + R: its own experts in order, then its replicas
  // (-1: a slot the planner left empty).
  std::vector<std::vector<int32_t>> slots;
  // [r][i]: the share of expert slots[r][i]'s rows that copy receives (1 with no
  // replicas; 0 for an empty slot).
  std::vector<std::vector<double>> share;

  int64_t slots_per_rank() const { return experts / ranks + replicas; }
  int64_t owner(int64_t expert) const { return expert / (experts / ranks); }
  // The ranks that hold a copy of `expert`, in rank order (its owner among them).
  std::vector<int64_t> holders(int64_t expert) const;
  // The rank that slot (token, expert) of a token on `sender` goes to (the rule above).
  int64_t route(int64_t expert, int64_t sender, int64_t token) const;
  // Each rank's predicted load: the sum over its slots of share x load.
  std::vector<double> rank_loads(const std::vector<double>& load) const;
  bool operator==(const Placement& o) const = default;
};

// The rule above for the senders of one rank, as the dispatch's kernel reads it
// (kernels/dispatch.h, ep_route_slots). Slots are numbered over the ranks: rank r's slot
// i is r x S + i (S = slots_per_rank()).
struct RouteTable {
  std::vector<int32_t> mine;   // [E] the sender's own slot of each expert (-1: none there)
  std::vector<int32_t> first;  // [E+1] each expert's copies in `slot` and `bound`
  std::vector<int32_t> slot;   // the copies' slots, in rank order
  std::vector<int64_t> bound;  // their upper bounds on u(t); each expert's last is 2^32
};
RouteTable route_table(const Placement& p, int64_t sender);
// The slot a table sends (token, expert) to: the kernel's rule, on the host.
int32_t route_slot(const RouteTable& t, int64_t expert, int64_t token);

// Every rank its own experts and R empty slots: the placement without replicas.
Placement owners_only(int64_t experts, int64_t ranks, int64_t replicas);

// The planner above for one layer's loads [E] (>= 0). ranks_per_node divides ranks
// (ranks: one node).
Placement plan_placement(const std::vector<double>& load, int64_t ranks, int64_t replicas, int64_t ranks_per_node = 0);

// Sets p's shares for one layer's loads [E] (the rule above); even shares where an
// expert has no load.
void balance_shares(Placement& p, const std::vector<double>& load);

// The highest over the mean of rank_loads (1: even; 1 when there is no load).
double max_over_mean(const Placement& p, const std::vector<double>& load);

// The ranks a node, from each ep rank's host (any key, such as a hash of its hostname):
// g when the ranks come node-major in equal groups of g on distinct hosts, else 0 (one
// node, or a layout the hierarchical planner cannot use: then it plans flat).
int64_t ranks_per_node(const std::vector<int64_t>& host_of_rank);

// A run's re-placement of one layer, every step from the loads' average: the copies'
// shares refreshed (no weights move); where `plan` (every replan_interval steps) the
// planner's placement instead, when it lowers max_over_mean by more than kReplanGain
// (SmartMoE's rule: a move must pay). Returns whether the slots changed.
constexpr double kReplanGain = 0.02;
bool replan(Placement& p, const std::vector<double>& load, bool plan, int64_t ranks_per_node = 0);

// The exponential moving average of each layer's expert loads: the first step's counts,
// then decay * average + (1 - decay) * counts.
struct LoadAverage {
  double decay = 0.9;
  std::vector<std::vector<double>> mean;  // [layer][expert]
  void add(const std::vector<std::vector<int64_t>>& counts);
};

}  // namespace mt::parallel
