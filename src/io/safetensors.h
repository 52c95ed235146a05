// safetensors files and Hugging Face model folders.
//
// A safetensors file is an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the data
// section, which the tensors' [begin, end) byte ranges must cover exactly. Files are
// memory-mapped and checked in full when opened, so every later read is in bounds;
// a malformed file is an mt::Error naming the file, the tensor and what is wrong.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/file.h"

namespace mt::io {

struct StTensor {
  std::string name;
  std::string dtype;  // as safetensors spells it: "F32", "BF16", "F16", "I64", "U8", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
  int64_t numel() const { return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>()); }
};

// IEEE half to float, exact for every input (subnormals, infinities, NaN payloads).
float f32_from_f16(uint16_t h);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // movable, not copyable

  const std::string& path() const { return path_; }
  // In the order of their bytes in the data section.
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const StTensor* find(std::string_view name) const;  // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  std::span<const uint8_t> bytes(const StTensor& t) const;
  // t as numel() floats: F32, BF16, F16 and F64 convert; other dtypes are an error.
  void read_f32(const StTensor& t, float* dst) const;

 private:
  std::string path_;
  MappedFile file_;
  size_t data_begin_ = 0;  // 8 + header length
  std::vector<StTensor> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index in tensors_
  std::map<std::string, std::string> metadata_;
};

struct StWrite {
  std::string name;
  std::string dtype;  // "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  const void* data;  // numel * dtype size bytes, row-major
};

inline StWrite st_f32(std::string name, std::vector<int64_t> shape, const float* data) {
  return {std::move(name), "F32", std::move(shape), data};
}

// Writes the tensors in the given order, data contiguous, header padded with spaces
// so the data section starts 8-byte aligned; atomically (write_file_atomic, whose
// FileSum of the file it returns).
FileSum write_safetensors(const std::string& path, const std::vector<StWrite>& tensors,
                          const std::map<std::string, std::string>& metadata = {});

// src [rows, cols] as its transpose dst [cols, rows].
void transpose_f32(const float* src, int64_t rows, int64_t cols, float* dst);

// MXFP4 as GPT-OSS stores its experts (transformers' _convert_moe_packed_tensors): `rows`
// rows of `groups` runs of 32 FP4 (E2M1) values, blocks U8 [rows, groups, 16] (byte b of
// a run: element 2b in its low nibble, 2b + 1 in its high one) and a power-of-two scale
// per run, scales U8 [rows, groups] (2^(s - 127)); into dst as floats [rows, groups * 32].
void dequantize_mxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t rows, int64_t groups, float* dst);

// A Hugging Face model folder: model.safetensors, or else the shards that
// model.safetensors.index.json's "weight_map" names (which is then the list of keys).
class HfWeights {
 public:
  // `stem`.safetensors, or the shards of `stem`.safetensors.index.json ("model" for a
  // Hugging Face folder; checkpoints also keep "optimizer").
  explicit HfWeights(const std::string& folder, const std::string& stem = "model");

  std::vector<std::string> names() const;  // sorted
  bool contains(std::string_view name) const;
  // These are an error for a missing key, naming the folder and close keys.
  const StTensor& tensor(std::string_view name) const;
  std::vector<int64_t> shape(std::string_view name) const { return tensor(name).shape; }
  std::span<const uint8_t> bytes(std::string_view name) const;
  // Tensor `name` as f32 into dst; its shape must be expected_shape.
  void read_f32(std::string_view name, const std::vector<int64_t>& expected_shape, float* dst) const;
  // Slice `index` (of dim 0) of key `name`, whose shape must be `shape`, as f32 into dst;
  // as its transpose (the last two dims swapped) when `transpose`. With `mxfp4`, a key
  // absent from the folder is read from GPT-OSS's name_blocks and name_scales, `shape`
  // then being transformers' dequantized parameter's [E, G * 32, R].
  void read_slice_f32(std::string_view name, const std::vector<int64_t>& shape, int64_t index, bool transpose,
                      bool mxfp4, float* dst) const;

 private:
  struct Entry {
    size_t file;
    const StTensor* tensor;
  };
  const Entry& entry(std::string_view name) const;
  const Entry& entry(std::string_view name, const std::vector<int64_t>& expected_shape) const;
  std::string suggest(std::string_view name) const;  // "; did you mean 'x'?" or ""

  std::string folder_;  // for errors
  std::vector<SafetensorsFile> files_;
  std::map<std::string, Entry, std::less<>> entries_;
};

}  // namespace mt::io
