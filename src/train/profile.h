// Where a training step's time goes, by stage (metrics.profile = true); and what
// `moetrain plan` reads back from a run's metrics.jsonl: a profiled step's costs and the
// experts' recorded loads replayed against replica placements.
//
// mark("experts B") closes the span opened by the previous mark and opens a new one;
// finish() returns the milliseconds spent under each name and how many spans it had
// (what `moetrain plan --schedule --profile` divides by to cost one action). On the
// GPU the marks are CUDA events on the backend's stream, so nothing waits until
// finish(); on the CPU they read the clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

struct ProfileEntry {
  std::string name;
  double ms = 0;
  int64_t count = 0;
};

class StepProfile {
 public:
  StepProfile(Device device, bool enabled);
  ~StepProfile();
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;

  void mark(const char* name);
  std::vector<ProfileEntry> finish();

 private:
  Device device_;
  bool enabled_;
  std::vector<const char*> names_;
  std::vector<void*> events_;  // cudaEvent_t, one per mark, reused across steps
  std::vector<std::chrono::steady_clock::time_point> times_;
};

// A profile of one step (the last line of a metrics.jsonl written with metrics.profile):
// the milliseconds of one action under each profile name, and of the optimizer and the
// gradient norm per decoder layer.
struct StepCosts {
  std::map<std::string, double> per_action;
  double optimizer_per_layer = 0;
};
StepCosts read_profile(const std::string& path);

// A run's recorded loads (each step line's expert_counts in a metrics.jsonl: [MoE layer]
// [expert], summed over the ranks) played against placements with R = 0, 1, 2 and 4
// replica slots a rank at ep `ranks` (parallel/placement.h), as a run would: each step
// routed by the placement that parallel::replan made from the moving average of the
// steps before it (a new one every `interval` steps). Per R: the busiest rank's rows
// over the mean, the mean over steps and layers, and the worst.
struct RoutingSkew {
  int64_t replicas = 0;
  double mean = 0, worst = 0;
};
std::vector<RoutingSkew> routing_skews(const std::string& path, int64_t experts, int64_t ranks, int64_t interval,
                                       int64_t* steps);

}  // namespace mt
