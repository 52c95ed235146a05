#include "train/profile.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "parallel/placement.h"

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

StepCosts read_profile(const std::string& path) {
  std::ifstream in(path);
  MT_CHECK(in.good()) << "--profile " << path << ": cannot read it";
  std::string line, last;
  while (std::getline(in, line))
    if (line.find("\"breakdown_counts\"") != std::string::npos) last = line;
  MT_CHECK(!last.empty()) << "--profile " << path << ": no step line with breakdown_ms and breakdown_counts "
                          << "(train with --metrics.profile=true)";
  const nlohmann::json j = nlohmann::json::parse(last, nullptr, false);
  const auto object = [&](const char* key) -> const nlohmann::json& {
    MT_CHECK(j.is_object() && j.contains(key) && j[key].is_object())
        << "--profile " << path << ": its last step line should hold an object \"" << key << "\" (as train "
        << "--metrics.profile=true writes it); the line is " << last.substr(0, 200);
    return j[key];
  };
  const nlohmann::json &ms = object("breakdown_ms"), &counts = object("breakdown_counts");
  const auto count = [&](const std::string& name) {
    const auto n = counts.find(name);
    MT_CHECK(n != counts.end() && n->is_number_integer() && n->get<int64_t>() > 0)
        << "--profile " << path << ": breakdown_counts.\"" << name << "\" should be a count > 0, got "
        << (n == counts.end() ? "none" : n->dump());
    return static_cast<double>(n->get<int64_t>());
  };
  StepCosts c;
  for (const auto& [name, t] : ms.items()) {
    MT_CHECK(t.is_number()) << "--profile " << path << ": breakdown_ms.\"" << name << "\" should be a time in ms, got "
                            << t.dump();
    c.per_action[name] = t.get<double>() / count(name);
  }
  // A layer's stage marks twice per micro-batch (start and finish), the head once.
  const double layers = count("attention+router F") / (2.0 * count("head F"));
  const auto at = [&](const char* name) { return ms.contains(name) ? ms[name].get<double>() : 0.0; };
  c.optimizer_per_layer = (at("optimizer") + at("gradient norm")) / layers;
  return c;
}

std::vector<RoutingSkew> routing_skews(const std::string& path, int64_t experts, int64_t ranks, int64_t interval,
                                       int64_t* steps) {
  std::ifstream in(path);
  MT_CHECK(in.good()) << "--routing " << path << ": cannot read it";
  std::vector<std::vector<std::vector<int64_t>>> trace;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find("\"expert_counts\"") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    const bool ok = !j.is_discarded() && j["expert_counts"].is_array() &&
                    std::all_of(j["expert_counts"].begin(), j["expert_counts"].end(), [&](const nlohmann::json& l) {
                      return l.is_array() && static_cast<int64_t>(l.size()) == experts &&
                             std::all_of(l.begin(), l.end(), [](const nlohmann::json& c) { return c.is_number_integer(); });
                    });
    MT_CHECK(ok) << "--routing " << path << " line " << n << ": expected expert_counts as a list of MoE layers of "
                 << experts << " integer counts (the model's experts), got " << line.substr(0, 200);
    trace.push_back(j["expert_counts"].get<std::vector<std::vector<int64_t>>>());
    MT_CHECK(trace.back().size() == trace.front().size())
        << "--routing " << path << " line " << n << ": " << trace.back().size() << " MoE layers, after "
        << trace.front().size();
  }
  MT_CHECK(!trace.empty()) << "--routing " << path << ": no step line with expert_counts (a run's metrics.jsonl)";
  MT_CHECK(experts % ranks == 0) << "--routing: " << experts << " experts do not split over ep " << ranks;
  *steps = static_cast<int64_t>(trace.size());
  std::vector<RoutingSkew> out;
  for (int64_t r : {0, 1, 2, 4}) {
    RoutingSkew k{r, 0, 0};
    parallel::LoadAverage average;
    std::vector<parallel::Placement> placed(trace.front().size(), parallel::owners_only(experts, ranks, r));
    for (size_t s = 0; s < trace.size(); ++s) {
      for (size_t l = 0; l < placed.size() && s > 0; ++l)
        parallel::replan(placed[l], average.mean[l], static_cast<int64_t>(s) % interval == 0);
      for (size_t l = 0; l < placed.size(); ++l) {
        const std::vector<double> load(trace[s][l].begin(), trace[s][l].end());
        const double skew = parallel::max_over_mean(placed[l], load);
        k.mean += skew / static_cast<double>(trace.size() * placed.size());
        k.worst = std::max(k.worst, skew);
      }
      average.add(trace[s]);
    }
    out.push_back(k);
  }
  return out;
}

}  // namespace mt
