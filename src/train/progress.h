// What rank 0 prints while `moetrain train` runs: a step line (step N/total, loss,
// lb_loss, grad_norm, lr, tokens/s, memory, step time, elapsed time and ETA), redrawn
// in place behind a bar when standard output is a terminal and printed as plain lines
// every metrics.log_interval steps otherwise (pipes, files, CI), and the run's summary;
// and each step's metrics.jsonl line.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "train/trainer.h"

namespace mt {

// One JSON object per line: the metrics.jsonl contract.
std::string step_json(const StepResult& r);
// "h:mm:ss"
std::string clock_time(double seconds);
// A parameter count as `train` and `plan` print it: "2.528M" below a billion, else "30.532B".
std::string count_text(double n);
// The step line; elapsed and eta in seconds, after the values or (the bar's) before.
std::string step_line(const StepResult& r, int64_t total_steps, double elapsed, double eta, bool times_first = false);

class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  // The run is at step `done` of `total`; `started`: when the command began (elapsed
  // and wall time count from it).
  Progress(int64_t done, int64_t total, int64_t log_interval, bool tty, Clock::time_point started);
  void step(const StepResult& r);
  // A line between steps (a saved checkpoint, a signal): on a terminal it replaces
  // the bar, which the next step draws again.
  void say(const std::string& line);
  // The summary's lines: steps run, wall time, mean tokens/s, final loss, and the last
  // checkpoint written ("" when none was, for `why_none`).
  std::string summary(const std::string& last_checkpoint, const std::string& why_none);
  // Ends the bar's line (on a terminal) and prints the summary.
  void finish(const std::string& last_checkpoint, const std::string& why_none);

 private:
  int64_t first_, total_, log_interval_;
  bool tty_, bar_shown_ = false;
  int columns_ = 0;  // the terminal's width (0: unknown)
  Clock::time_point started_, loop_start_;
  int64_t steps_ = 0, last_step_ = 0, tokens_ = 0;
  double step_seconds_ = 0, last_loss_ = 0;
};

}  // namespace mt
