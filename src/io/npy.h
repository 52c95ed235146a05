// NumPy .npy arrays (format 1.0-3.0, C order, little-endian): the token batches of
// `moetrain eval` / `[data] tokens`, and the two arrays inside each corpus `.bin`.
#pragma once

#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace mt::io {

struct NpyHeader {
  std::string descr;           // e.g. "<i4", "<i8", "<u2", "<f4", "|u1"
  std::vector<int64_t> shape;
  size_t header_bytes = 0;     // magic + header; the data starts here
  size_t item_bytes = 0;
  int64_t numel() const { return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>()); }
  size_t data_bytes() const { return static_cast<size_t>(numel()) * item_bytes; }
};

// Parses the header at p[0..n). `where` names the source in errors (a file path,
// "corpus.bin, second array").
NpyHeader parse_npy_header(const uint8_t* p, size_t n, const std::string& where);

// A header for `descr` and `shape`, padded so the data starts 64-byte aligned.
std::string make_npy_header(const std::string& descr, const std::vector<int64_t>& shape);

struct NpyArray {
  NpyHeader header;
  std::vector<uint8_t> data;
};

NpyArray read_npy(const std::string& path);

// Any integer array as int64 (i1..i8, u1..u8), for token matrices.
std::vector<int64_t> npy_as_int64(const NpyArray& a, const std::string& where);

}  // namespace mt::io
