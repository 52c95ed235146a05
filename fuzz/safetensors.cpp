// The safetensors reader: open (header and ranges checked), then every tensor's bytes
// and, for the float dtypes, its values.
#include <vector>

#include "fuzz/fuzz.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::put("model.safetensors", mt::fuzz::as_text(data, size));
  try {
    mt::io::SafetensorsFile f(path);
    std::vector<float> values;
    for (const mt::io::StTensor& t : f.tensors()) {
      if (f.bytes(t).size() != t.end - t.begin) std::abort();
      if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16" && t.dtype != "F64") continue;
      values.resize(static_cast<size_t>(t.numel()));
      f.read_f32(t, values.data());
    }
  } catch (const mt::Error&) {
  }
  return 0;
}
