// Where a training step's time goes, by stage (metrics.profile = true).
//
// mark("experts B") closes the span opened by the previous mark and opens a new one;
// finish() returns the milliseconds spent under each name and how many spans it had
// (what `moetrain plan --schedule --profile` divides by to cost one action). On the
// GPU the marks are CUDA events on the backend's stream, so nothing waits until
// finish(); on the CPU they read the clock.
#pragma once

#include <chrono>
#include <cstdint>
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

}  // namespace mt
