// What every fuzz target shares: a scratch folder of its own process, where the input
// is written as the file the reader under test opens (the readers take paths, and
// reading through the real file and mmap path is what users run).
//
// A target feeds the bytes to one reader and accepts two outcomes: success, or an
// mt::Error (a message for a person). Anything else escaping (another exception type,
// a crash, a sanitizer report, a hang, unbounded memory) is a finding.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/check.h"

namespace mt::fuzz {

inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path d = std::filesystem::temp_directory_path() / ("moetrain-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

// Writes `bytes` to scratch()/name (plainly: atomicity is not under test) and returns the path.
inline std::string put(const std::string& name, std::string_view bytes) {
  const std::filesystem::path p = scratch() / name;
  std::filesystem::create_directories(p.parent_path());
  std::FILE* f = std::fopen(p.c_str(), "wb");
  if (!f) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
  return p.string();
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace mt::fuzz
