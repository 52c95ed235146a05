#include "train/profile.h"

#include <map>

#ifdef MOETRAIN_WITH_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace mt {

StepProfile::StepProfile(Device device, bool enabled) : device_(device), enabled_(enabled) {}

StepProfile::~StepProfile() {
#ifdef MOETRAIN_WITH_CUDA
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
#endif
}

void StepProfile::mark(const char* name) {
  if (!enabled_) return;
  names_.push_back(name);
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) {
    const size_t i = names_.size() - 1;
    if (events_.size() <= i) {
      cudaEvent_t e;
      CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[i]), cuda::stream()));
    return;
  }
#endif
  times_.push_back(std::chrono::steady_clock::now());
}

std::vector<ProfileEntry> StepProfile::finish() {
  if (!enabled_ || names_.empty()) return {};
  mark("end");
  std::map<std::string, size_t> index;
  std::vector<ProfileEntry> out;
#ifdef MOETRAIN_WITH_CUDA
  if (device_ == Device::cuda) CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[names_.size() - 1])));
#endif
  for (size_t i = 0; i + 1 < names_.size(); ++i) {
    double t = 0;
#ifdef MOETRAIN_WITH_CUDA
    if (device_ == Device::cuda) {
      float f = 0;
      CUDA_CHECK(cudaEventElapsedTime(&f, static_cast<cudaEvent_t>(events_[i]), static_cast<cudaEvent_t>(events_[i + 1])));
      t = f;
    }
#endif
    if (device_ == Device::cpu) t = std::chrono::duration<double, std::milli>(times_[i + 1] - times_[i]).count();
    auto [at, fresh] = index.try_emplace(names_[i], out.size());
    if (fresh) out.push_back({names_[i]});
    out[at->second].ms += t;
    ++out[at->second].count;
  }
  names_.clear();
  times_.clear();
  return out;
}

}  // namespace mt
