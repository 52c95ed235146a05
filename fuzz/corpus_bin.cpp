// A corpus token file (.bin: two .npy arrays) as training opens it, then the first
// batches read from it. seq_len is small so that short inputs still make samples.
#include <vector>

#include "data/dataset.h"
#include "fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::put("corpus/part.bin", mt::fuzz::as_text(data, size));
  try {
    mt::data::Dataset ds((mt::fuzz::scratch() / "corpus").string(), 4, 1);
    std::vector<int32_t> ids(8), labels(8);
    for (int i = 0; i < 3; ++i) ds.next_batch(0, 1, 0, 1, 2, ids, labels);
  } catch (const mt::Error&) {
  }
  return 0;
}
