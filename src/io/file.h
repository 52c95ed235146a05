// Whole-file reads and atomic writes.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mt::io {

std::vector<uint8_t> read_file(const std::string& path);

// Writes the pieces to path.tmp, fsyncs it, renames it over path and fsyncs the
// folder: after a crash either the old file or the complete new one is there.
void write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces);

}  // namespace mt::io
