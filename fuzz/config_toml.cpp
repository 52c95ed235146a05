// A training config (TOML), loaded and validated as `train` loads it. A config that
// loads must survive its own round trip: written back as TOML (what checkpoints keep),
// it differs from itself in no key.
#include "fuzz/fuzz.h"
#include "train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::put("config.toml", mt::fuzz::as_text(data, size));
  try {
    const mt::Config c = mt::load_config(path, {});
    if (!mt::config_changes(mt::config_to_toml(c), c).empty()) std::abort();
  } catch (const mt::Error&) {
  }
  return 0;
}
