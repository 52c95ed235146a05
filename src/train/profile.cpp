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

std::vector<std::pair<std::string, double>> StepProfile::finish() {
  if (!enabled_ || names_.empty()) return {};
  mark("end");
  std::map<std::string, double> ms;
  std::vector<std::string> order;
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
    if (!ms.count(names_[i])) order.push_back(names_[i]);
    ms[names_[i]] += t;
  }
  names_.clear();
  times_.clear();
  std::vector<std::pair<std::string, double>> out;
  for (const std::string& n : order) out.emplace_back(n, ms[n]);
  return out;
}

}  // namespace mt
