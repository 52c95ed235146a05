// .npy: the header parser on the raw bytes, then the whole-file reader and the
// integer view that token files and fixtures go through.
#include "fuzz/fuzz.h"
#include "io/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const mt::io::NpyHeader h = mt::io::parse_npy_header(data, size, "fuzz input");
    if (h.header_bytes > size) std::abort();
  } catch (const mt::Error&) {
  }
  const std::string path = mt::fuzz::put("array.npy", mt::fuzz::as_text(data, size));
  try {
    const mt::io::NpyArray a = mt::io::read_npy(path);
    if (a.data.size() != a.header.data_bytes()) std::abort();
    if (a.header.descr.find('i') != std::string::npos || a.header.descr.find('u') != std::string::npos)
      mt::io::npy_as_int64(a, path);
  } catch (const mt::Error&) {
  }
  return 0;
}
