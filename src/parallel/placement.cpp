#include "parallel/placement.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace mt::parallel {

std::vector<int64_t> Placement::holders(int64_t expert) const {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < ranks; ++r) {
    const std::vector<int32_t>& s = slots[static_cast<size_t>(r)];
    if (std::find(s.begin(), s.end(), static_cast<int32_t>(expert)) != s.end()) out.push_back(r);
  }
  return out;
}

namespace {

// The share of `expert`'s rows that rank r's copy receives (0: none there).
double share_on(const Placement& p, int64_t r, int64_t expert) {
  const std::vector<int32_t>& s = p.slots[static_cast<size_t>(r)];
  const auto it = std::find(s.begin(), s.end(), static_cast<int32_t>(expert));
  return it == s.end() ? 0.0 : p.share[static_cast<size_t>(r)][static_cast<size_t>(it - s.begin())];
}

}  // namespace

RouteTable route_table(const Placement& p, int64_t sender) {
  const int64_t S = p.slots_per_rank();
  RouteTable t;
  t.mine.assign(static_cast<size_t>(p.experts), -1);
  t.first.assign(static_cast<size_t>(p.experts + 1), 0);
  const std::vector<int32_t>& own = p.slots[static_cast<size_t>(sender)];
  for (size_t i = 0; i < own.size(); ++i)
    if (own[i] >= 0) t.mine[static_cast<size_t>(own[i])] = static_cast<int32_t>(sender * S + static_cast<int64_t>(i));
  const double floor = 1.0 / static_cast<double>(p.ranks);
  for (int64_t e = 0; e < p.experts; ++e) {
    std::vector<std::pair<int32_t, double>> copies;  // (slot, share above the floor)
    double total = 0;
    for (int64_t r = 0; r < p.ranks; ++r) {
      const std::vector<int32_t>& s = p.slots[static_cast<size_t>(r)];
      const auto it = std::find(s.begin(), s.end(), static_cast<int32_t>(e));
      if (it == s.end()) continue;
      const double above = std::max(share_on(p, r, e) - floor, 0.0);
      copies.emplace_back(static_cast<int32_t>(r * S + (it - s.begin())), above);
      total += above;
    }
    double sum = 0;
    for (size_t i = 0; i < copies.size(); ++i) {
      sum += copies[i].second;
      const bool last = i + 1 == copies.size();
      t.slot.push_back(copies[i].first);
      t.bound.push_back(last ? int64_t{1} << 32 : total <= 0 ? 0 : static_cast<int64_t>(std::ldexp(sum / total, 32)));
    }
    t.first[static_cast<size_t>(e + 1)] = static_cast<int32_t>(t.slot.size());
  }
  return t;
}

int32_t route_slot(const RouteTable& t, int64_t expert, int64_t token) {
  const size_t e = static_cast<size_t>(expert);
  if (t.mine[e] >= 0) return t.mine[e];
  const int64_t u = static_cast<uint32_t>(static_cast<uint64_t>(token) * 2654435769u);
  for (int32_t i = t.first[e]; i < t.first[e + 1]; ++i)
    if (u < t.bound[static_cast<size_t>(i)]) return t.slot[static_cast<size_t>(i)];
  return t.slot[static_cast<size_t>(t.first[e + 1] - 1)];
}

int64_t Placement::route(int64_t expert, int64_t sender, int64_t token) const {
  return route_slot(route_table(*this, sender), expert, token) / slots_per_rank();
}

std::vector<double> Placement::rank_loads(const std::vector<double>& load) const {
  std::vector<double> out(static_cast<size_t>(ranks), 0.0);
  for (int64_t r = 0; r < ranks; ++r)
    for (size_t i = 0; i < slots[static_cast<size_t>(r)].size(); ++i) {
      const int32_t e = slots[static_cast<size_t>(r)][i];
      if (e >= 0) out[static_cast<size_t>(r)] += share[static_cast<size_t>(r)][i] * load[static_cast<size_t>(e)];
    }
  return out;
}

void balance_shares(Placement& p, const std::vector<double>& load) {
  MT_CHECK(static_cast<int64_t>(load.size()) == p.experts)
      << "expert placement: " << load.size() << " loads for " << p.experts << " experts";
  std::vector<std::vector<int64_t>> held(static_cast<size_t>(p.experts));
  for (int64_t r = 0; r < p.ranks; ++r)
    for (int32_t e : p.slots[static_cast<size_t>(r)])
      if (e >= 0) held[static_cast<size_t>(e)].push_back(r);
  auto set = [&](int64_t r, int64_t e, double v) {
    const std::vector<int32_t>& s = p.slots[static_cast<size_t>(r)];
    p.share[static_cast<size_t>(r)][static_cast<size_t>(std::find(s.begin(), s.end(), static_cast<int32_t>(e)) - s.begin())] = v;
  };
  for (int64_t e = 0; e < p.experts; ++e)
    for (int64_t r : held[static_cast<size_t>(e)]) set(r, e, 1.0 / static_cast<double>(held[static_cast<size_t>(e)].size()));
  std::vector<double> rank = p.rank_loads(load);
  const double floor = 1.0 / static_cast<double>(p.ranks);
  for (int sweep = 0; sweep < 4; ++sweep)
    for (int64_t e = 0; e < p.experts; ++e) {
      const std::vector<int64_t>& h = held[static_cast<size_t>(e)];
      const double l = load[static_cast<size_t>(e)];
      if (h.size() < 2 || l <= 0) continue;
      // Take e's rows off its holders, give each its floor, then fill the lowest up to one
      // level with the rest.
      std::vector<double> level;
      for (int64_t r : h) {
        rank[static_cast<size_t>(r)] -= share_on(p, r, e) * l;
        level.push_back(rank[static_cast<size_t>(r)] + floor * l);
      }
      std::vector<double> sorted = level;
      std::sort(sorted.begin(), sorted.end());
      double rest = l * (1 - floor * static_cast<double>(h.size())), fill = 0;
      for (size_t k = 1; k <= sorted.size(); ++k) {
        fill = (std::accumulate(sorted.begin(), sorted.begin() + static_cast<ptrdiff_t>(k), 0.0) + rest) / static_cast<double>(k);
        if (k == sorted.size() || fill <= sorted[k]) break;
      }
      for (size_t i = 0; i < h.size(); ++i) {
        const double rows = floor * l + std::max(fill - level[i], 0.0);
        set(h[i], e, rows / l);
        rank[static_cast<size_t>(h[i])] += rows;
      }
    }
}

Placement owners_only(int64_t experts, int64_t ranks, int64_t replicas) {
  MT_CHECK(ranks >= 1 && experts % ranks == 0 && replicas >= 0)
      << "expert placement: " << experts << " experts over " << ranks << " ranks with " << replicas
      << " replica slots a rank (expected ranks dividing the experts, replicas >= 0)";
  Placement p;
  p.experts = experts;
  p.ranks = ranks;
  p.replicas = replicas;
  const int64_t own = experts / ranks;
  p.slots.assign(static_cast<size_t>(ranks), std::vector<int32_t>(static_cast<size_t>(own + replicas), -1));
  p.share.assign(static_cast<size_t>(ranks), std::vector<double>(static_cast<size_t>(own + replicas), 0.0));
  for (int64_t r = 0; r < ranks; ++r)
    for (int64_t i = 0; i < own; ++i) {
      p.slots[static_cast<size_t>(r)][static_cast<size_t>(i)] = static_cast<int32_t>(r * own + i);
      p.share[static_cast<size_t>(r)][static_cast<size_t>(i)] = 1.0;
    }
  return p;
}

Placement plan_placement(const std::vector<double>& load, int64_t ranks, int64_t replicas, int64_t ranks_per_node) {
  const int64_t experts = static_cast<int64_t>(load.size());
  Placement p = owners_only(experts, ranks, replicas);
  const int64_t g = ranks_per_node > 0 ? ranks_per_node : ranks;
  MT_CHECK(ranks % g == 0) << "expert placement: nodes of " << g << " ranks do not divide " << ranks << " ranks";
  for (double l : load) MT_CHECK(l >= 0) << "expert placement: a load of " << l << " (expected >= 0)";
  const int64_t own = experts / ranks;
  for (int64_t first = 0; first < ranks; first += g) {
    // This node's experts and their copies (one each: the owner's).
    const int64_t e0 = first * own, e1 = (first + g) * own;
    std::vector<int64_t> copies(static_cast<size_t>(experts), 1);
    auto per_copy = [&](int64_t e) { return load[static_cast<size_t>(e)] / static_cast<double>(copies[static_cast<size_t>(e)]); };
    // 1. Replication: each replica to the expert of highest load per copy.
    std::vector<int64_t> extra;
    for (int64_t n = 0; n < g * replicas; ++n) {
      int64_t best = -1;
      for (int64_t e = e0; e < e1; ++e)
        if (copies[static_cast<size_t>(e)] < g && (best < 0 || per_copy(e) > per_copy(best))) best = e;
      if (best < 0) break;  // every expert on every rank of the node
      ++copies[static_cast<size_t>(best)];
      extra.push_back(best);
    }
    // 2. Packing: heaviest per copy first, to the least loaded rank that can take it.
    std::stable_sort(extra.begin(), extra.end(), [&](int64_t a, int64_t b) {
      return per_copy(a) > per_copy(b) || (per_copy(a) == per_copy(b) && a < b);
    });
    std::vector<double> rank_load(static_cast<size_t>(g), 0.0);
    std::vector<int64_t> used(static_cast<size_t>(g), 0);
    for (int64_t r = 0; r < g; ++r)
      for (int64_t i = 0; i < own; ++i) rank_load[static_cast<size_t>(r)] += per_copy((first + r) * own + i);
    for (int64_t e : extra) {
      int64_t to = -1;
      for (int64_t r = 0; r < g; ++r) {
        const std::vector<int32_t>& s = p.slots[static_cast<size_t>(first + r)];
        const bool has = std::find(s.begin(), s.end(), static_cast<int32_t>(e)) != s.end();
        if (used[static_cast<size_t>(r)] < replicas && !has &&
            (to < 0 || rank_load[static_cast<size_t>(r)] < rank_load[static_cast<size_t>(to)]))
          to = r;
      }
      if (to < 0) continue;  // the ranks with room hold it already: the slot stays empty
      p.slots[static_cast<size_t>(first + to)][static_cast<size_t>(own + used[static_cast<size_t>(to)]++)] =
          static_cast<int32_t>(e);
      rank_load[static_cast<size_t>(to)] += per_copy(e);
    }
  }
  balance_shares(p, load);
  return p;
}

double max_over_mean(const Placement& p, const std::vector<double>& load) {
  const std::vector<double> r = p.rank_loads(load);
  const double total = std::accumulate(r.begin(), r.end(), 0.0);
  if (total <= 0) return 1.0;
  return *std::max_element(r.begin(), r.end()) / (total / static_cast<double>(r.size()));
}

int64_t ranks_per_node(const std::vector<int64_t>& host_of_rank) {
  const int64_t n = static_cast<int64_t>(host_of_rank.size());
  int64_t g = 1;
  while (g < n && host_of_rank[static_cast<size_t>(g)] == host_of_rank[0]) ++g;
  if (g == n || n % g != 0) return 0;
  std::vector<int64_t> seen;
  for (int64_t first = 0; first < n; first += g) {
    const int64_t h = host_of_rank[static_cast<size_t>(first)];
    if (std::find(seen.begin(), seen.end(), h) != seen.end()) return 0;
    seen.push_back(h);
    for (int64_t r = first; r < first + g; ++r)
      if (host_of_rank[static_cast<size_t>(r)] != h) return 0;
  }
  return g;
}

bool replan(Placement& p, const std::vector<double>& load, bool plan, int64_t ranks_per_node) {
  balance_shares(p, load);
  if (!plan) return false;
  Placement next = plan_placement(load, p.ranks, p.replicas, ranks_per_node);
  if (max_over_mean(next, load) >= (1 - kReplanGain) * max_over_mean(p, load)) return false;
  const bool moved = next.slots != p.slots;
  p = std::move(next);
  return moved;
}

void LoadAverage::add(const std::vector<std::vector<int64_t>>& counts) {
  const bool first = mean.empty();
  if (first)
    for (const std::vector<int64_t>& c : counts) mean.emplace_back(c.size(), 0.0);
  MT_CHECK(mean.size() == counts.size()) << "expert loads: " << counts.size() << " layers, after " << mean.size();
  for (size_t l = 0; l < counts.size(); ++l) {
    MT_CHECK(mean[l].size() == counts[l].size())
        << "expert loads: layer " << l << " has " << counts[l].size() << " experts, after " << mean[l].size();
    for (size_t e = 0; e < counts[l].size(); ++e) {
      const double c = static_cast<double>(counts[l][e]);
      mean[l][e] = first ? c : decay * mean[l][e] + (1 - decay) * c;
    }
  }
}

}  // namespace mt::parallel
