// A training run's life, for `moetrain train`: the ranks agree on the config and the
// data, rank 0 claims the run folder (one run a folder), the memory plan is checked
// against the device, the model and the trainer are built, weights come from an init, a
// Hugging Face folder or the checkpoint to resume (train/checkpoint.h), then the steps
// run with their metrics, validations, saves and signals, and the summary ends it.
#pragma once

#include <chrono>

#include "train/config.h"

namespace mt {

// SIGTERM, SIGINT and SIGUSR1 ask the run to save and stop (run.cpp says how repeats are
// read); installed first, so a signal during setup is taken too.
void install_signal_handlers();

// The run of `cfg` (load_config's, not yet checked against its inputs) on every rank of
// the launcher's world; the process's exit code: 0, or 75 when stopped by a signal
// (run it again to resume). `started` is when the command began, for the summary.
int run_training(Config cfg, std::chrono::steady_clock::time_point started);

}  // namespace mt
