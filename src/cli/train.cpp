// moetrain train: a config file and/or --section.key=value overrides describe a run;
// the run itself is train/run.h's.
#include <chrono>
#include <cstdio>
#include <utility>

#include "cli/commands.h"
#include "train/config.h"
#include "train/run.h"

namespace mt::cli {

int run_train(const Args& args) {
  const auto started = std::chrono::steady_clock::now();
  install_signal_handlers();
  Options o("train", args, {"config", "print-config?", "config-reference?"});
  if (o.has("config-reference")) {
    std::fputs(config_reference(true).c_str(), stdout);
    return 0;
  }
  Config cfg = load_config(o.get("config"), o.dotted());
  if (o.has("print-config")) {
    std::fputs(config_to_toml(cfg).c_str(), stdout);
    return 0;
  }
  return run_training(std::move(cfg), started);
}

}  // namespace mt::cli
