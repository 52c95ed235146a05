#include "train/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace mt {

namespace {

std::string format(const char* fmt, auto... args) {
  char b[512];
  std::snprintf(b, sizeof b, fmt, args...);
  return b;
}

// "121.2 MiB" below 1 GiB, else "1.25 GiB".
std::string bytes_text(double bytes) {
  return bytes < (1 << 30) ? format("%.1f MiB", bytes / (1 << 20)) : format("%.2f GiB", bytes / (1 << 30));
}

std::string span(double seconds) { return seconds < 60 ? format("%.1f s", seconds) : clock_time(seconds); }

}  // namespace

std::string count_text(double n) { return n < 1e9 ? format("%.3fM", n / 1e6) : format("%.3fB", n / 1e9); }

std::string clock_time(double seconds) {
  const long t = static_cast<long>(std::max(0.0, seconds) + 0.5);
  return format("%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
}

std::string step_line(const StepResult& r, int64_t total_steps, double elapsed, double eta, bool times_first) {
  const std::string step =
      format("step %lld/%lld  ", static_cast<long long>(r.step), static_cast<long long>(total_steps));
  // Memory measured on a GPU; planned (the arenas `moetrain plan` prints) on the CPU.
  const std::string memory =
      bytes_text(static_cast<double>(r.device_memory_bytes > 0 ? r.device_memory_bytes : r.memory_bytes));
  const std::string values =
      format("loss %.4f  lb_loss %.4f  ", r.loss, r.lb_loss) + (r.z_loss_on ? format("z_loss %.4f  ", r.z_loss) : "") +
      format("grad_norm %.4f  lr %.3e  tokens/s %.0f  memory %s  step_time %.3fs", r.grad_norm, r.lr, r.tokens_per_s,
             memory.c_str(), r.seconds);
  const std::string e = clock_time(elapsed), left = clock_time(eta);
  return times_first ? step + "eta " + left + "  elapsed " + e + "  " + values
                     : step + values + "  elapsed " + e + "  eta " + left;
}

Progress::Progress(int64_t done, int64_t total, int64_t log_interval, bool tty, Clock::time_point started)
    : first_(done),
      total_(total),
      log_interval_(log_interval),
      tty_(tty),
      started_(started),
      loop_start_(Clock::now()) {
  struct winsize w {};
  if (tty_ && ioctl(STDOUT_FILENO, TIOCGWINSZ, &w) == 0) columns_ = w.ws_col;
}

void Progress::step(const StepResult& r) {
  ++steps_;
  last_step_ = r.step;
  last_loss_ = r.loss;
  tokens_ += r.tokens;
  step_seconds_ += r.seconds;
  const auto now = Clock::now();
  const double loop = std::chrono::duration<double>(now - loop_start_).count();
  const double eta = loop / static_cast<double>(steps_) * static_cast<double>(total_ - r.step);
  const std::string line = step_line(r, total_, std::chrono::duration<double>(now - started_).count(), eta, tty_);
  if (!tty_) {
    if (r.step % log_interval_ == 0 || r.step == total_) std::printf("%s\n", line.c_str());
  } else {
    // [#####     ] step N/total  eta ..., cut to the terminal's width so that \r
    // returns to the start of this one line (the times first, so they stay).
    const int width = 20, filled = static_cast<int>(width * r.step / std::max<int64_t>(total_, 1));
    std::string bar = "[";
    bar.append(static_cast<size_t>(filled), '#').append(static_cast<size_t>(width - filled), ' ').append("] ") += line;
    if (columns_ > 1 && bar.size() >= static_cast<size_t>(columns_)) bar.resize(static_cast<size_t>(columns_ - 1));
    std::printf("\r%s\033[K", bar.c_str());
    bar_shown_ = true;
  }
  std::fflush(stdout);
}

void Progress::say(const std::string& line) {
  std::printf(bar_shown_ ? "\r\033[K%s\n" : "%s\n", line.c_str());
  bar_shown_ = false;
  std::fflush(stdout);
}

std::string Progress::summary(const std::string& last_checkpoint, const std::string& why_none) {
  const double wall = std::chrono::duration<double>(Clock::now() - started_).count();
  std::string s;
  if (steps_ == 0)
    s = format("summary: no steps run (the run was at step %lld of %lld) in %s\n", static_cast<long long>(first_),
               static_cast<long long>(total_), span(wall).c_str());
  else
    s = format("summary: %lld steps (%lld to %lld of %lld) in %s, %.0f tokens/s mean, final loss %.4f\n",
               static_cast<long long>(steps_), static_cast<long long>(first_ + 1), static_cast<long long>(last_step_),
               static_cast<long long>(total_), span(wall).c_str(),
               static_cast<double>(tokens_) / std::max(step_seconds_, 1e-9), last_loss_);
  return s + (last_checkpoint.empty() ? "checkpoint: none written (" + why_none + ")\n"
                                      : "checkpoint: " + last_checkpoint + "\n");
}

void Progress::finish(const std::string& last_checkpoint, const std::string& why_none) {
  if (bar_shown_) std::printf("\n");
  bar_shown_ = false;
  std::printf("%s", summary(last_checkpoint, why_none).c_str());
  std::fflush(stdout);
}

std::string step_json(const StepResult& r) {
  nlohmann::json j;
  j["step"] = r.step;
  j["loss"] = r.loss;
  j["lb_loss"] = r.lb_loss;
  if (r.z_loss_on) j["z_loss"] = r.z_loss;
  if (r.val_on) j["val_loss"] = r.val_loss;
  if (!r.mtp_loss.empty()) j["mtp_loss"] = r.mtp_loss;
  if (!r.data_shares.empty()) j["data_shares"] = r.data_shares;
  if (!r.expert_bias.empty()) j["expert_bias"] = r.expert_bias;
  j["grad_norm"] = r.grad_norm;
  j["lr"] = r.lr;
  if (!r.non_finite.empty()) j["skipped"] = r.non_finite;  // NaN and inf print as null
  j["tokens_per_s"] = r.tokens_per_s;
  j["memory_bytes"] = r.memory_bytes;
  j["expert_row_bytes"] = r.expert_row_bytes;
  j["routing_skew"] = r.routing_skew;
  if (r.device_memory_bytes > 0) {
    j["device_memory_bytes"] = r.device_memory_bytes;
    j["host_waits"] = r.host_waits;
  }
  if (r.host_memory_bytes > 0) {
    j["host_memory_bytes"] = r.host_memory_bytes;
    j["offload_bytes_in"] = r.offload.bytes_in;
    j["offload_bytes_out"] = r.offload.bytes_out;
    j["offload_s"] = r.offload.seconds;
  }
  if (r.expert_cache.hits + r.expert_cache.misses > 0) {
    j["expert_cache_hit_rate"] = static_cast<double>(r.expert_cache.hits) /
                                 static_cast<double>(r.expert_cache.hits + r.expert_cache.misses);
    j["expert_cache_wait_s"] = r.expert_cache.wait_s;
  }
  for (const std::vector<double>& layer : r.expert_residency) {
    nlohmann::json& row = j["expert_cache_residency"].emplace_back(nlohmann::json::array());
    for (double v : layer) row.push_back(v < 0 ? nlohmann::json() : nlohmann::json(v));
  }
  j["time"] = r.time;
  j["expert_counts"] = r.expert_counts;
  j["moe_layers"] = r.moe_layers;
  j["dropped_slots"] = r.dropped_slots;
  if (!r.ep_rows_max_over_mean.empty()) j["ep_rows_max_over_mean"] = r.ep_rows_max_over_mean;
  if (!r.expert_copies.empty()) {
    j["placement_version"] = r.placement_version;
    j["expert_copies"] = r.expert_copies;
  }
  for (const ProfileEntry& e : r.breakdown) {
    j["breakdown_ms"][e.name] = e.ms;
    j["breakdown_counts"][e.name] = e.count;
  }
  return j.dump();
}

}  // namespace mt
