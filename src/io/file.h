// Whole-file reads, read-only maps and atomic writes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mt::io {

std::vector<uint8_t> read_file(const std::string& path);

// A regular file mapped read-only in whole (an empty one maps to no bytes) until
// destroyed; movable. `what` names the file in the open error: "cannot open <what> <path>".
class MappedFile {
 public:
  MappedFile(const std::string& path, std::string_view what);
  std::span<const uint8_t> bytes() const { return {map_.get(), map_ ? map_.get_deleter().size : 0}; }

 private:
  struct Unmap {  // munmap needs the length
    size_t size;
    void operator()(const uint8_t* p) const;
  };
  std::unique_ptr<const uint8_t, Unmap> map_;
};

// Writes the pieces to path.tmp, fsyncs it, renames it over path and fsyncs the
// folder: after a crash either the old file or the complete new one is there.
void write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces);

}  // namespace mt::io
