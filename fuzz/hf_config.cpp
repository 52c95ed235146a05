// A model's config.json, parsed and the model planned as `moetrain plan` plans it
// (arenas count bytes; nothing is allocated for weights).
#include <memory>

#include "fuzz/fuzz.h"
#include "models/interface.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::put("config.json", mt::fuzz::as_text(data, size));
  try {
    mt::ModelOptions options;
    options.plan_only = true;
    const std::unique_ptr<mt::Model> model = mt::make_model(path, options);
    if (model->param_count() < model->active_param_count() || model->active_param_count() < 0) std::abort();
  } catch (const mt::Error&) {
  }
  return 0;
}
