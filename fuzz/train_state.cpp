// A checkpoint's train_state.json, read as resuming reads it (the step folder holds
// the COMPLETE marker; the folder's name says step 5).
#include "fuzz/fuzz.h"
#include "train/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    mt::fuzz::put("checkpoints/step-00000005/COMPLETE", "5\n");
    return (mt::fuzz::scratch() / "checkpoints/step-00000005").string();
  }();
  mt::fuzz::put("checkpoints/step-00000005/train_state.json", mt::fuzz::as_text(data, size));
  try {
    const mt::TrainState st = mt::read_train_state(dir);
    if (st.step != 5) std::abort();  // the folder's name is cross-checked
  } catch (const mt::Error&) {
  }
  return 0;
}
