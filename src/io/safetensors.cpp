#include "io/safetensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/check.h"
#include "core/dtype.h"

namespace mt::io {

namespace fs = std::filesystem;
// Plain (std::map) objects: headers of checkpoints hold tens of thousands of keys,
// too many for ordered_json's linear lookups; file order comes from the offsets.
using Json = nlohmann::json;

namespace {

struct DTypeSize {
  std::string_view name;
  size_t bytes;
};

// The byte-sized dtypes of the safetensors format (the sub-byte F4/F6 kinds are not
// supported: no model we import stores them).
constexpr DTypeSize kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
    {"U16", 2},  {"I16", 2}, {"F16", 2}, {"BF16", 2},    {"U32", 4},     {"I32", 4},
    {"F32", 4},  {"U64", 8}, {"I64", 8}, {"F64", 8},     {"C64", 8},
};

std::string known_dtypes() {
  std::string s;
  for (const DTypeSize& d : kDTypes) s.append(s.empty() ? "" : ", ").append(d.name);
  return s;
}

// Bytes per element of a safetensors dtype; an error listing the known ones otherwise.
size_t st_dtype_size(std::string_view dtype, const std::string& where) {
  const DTypeSize* it = std::find_if(std::begin(kDTypes), std::end(kDTypes),
                                     [&](const DTypeSize& d) { return d.name == dtype; });
  MT_CHECK(it != std::end(kDTypes)) << where << ": unknown dtype '" << dtype << "' (known: " << known_dtypes()
                                    << ")";
  return it->bytes;
}

// "[2,3]", the spelling every shape in an error message uses.
std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s.append(i ? "," : "").append(std::to_string(shape[i]));
  return s + "]";
}

bool mul_fits(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

uint64_t json_uint(const Json& v, const std::string& where, const std::string& what) {
  MT_CHECK(v.is_number_unsigned()) << where << ": " << what << " must be a non-negative integer, found " << v.dump();
  return v.get<uint64_t>();
}

StTensor parse_entry(const std::string& name, const Json& e, const std::string& path) {
  std::string where = path + ": tensor '" + name + "'";
  MT_CHECK(e.is_object()) << where << ": header entry must be an object with dtype, shape and data_offsets, found "
                          << e.dump();
  for (const char* key : {"dtype", "shape", "data_offsets"})
    MT_CHECK(e.contains(key)) << where << ": header entry has no \"" << key << "\": " << e.dump();
  StTensor t;
  t.name = name;
  const Json& dtype = e["dtype"];
  MT_CHECK(dtype.is_string()) << where << ": dtype must be a string, found " << dtype.dump();
  t.dtype = dtype.get<std::string>();
  size_t item = st_dtype_size(t.dtype, where);

  const Json& shape = e["shape"];
  MT_CHECK(shape.is_array()) << where << ": shape must be an array, found " << shape.dump();
  int64_t numel = 1;
  for (const Json& d : shape) {
    uint64_t v = json_uint(d, where, "each shape entry");
    MT_CHECK(v <= INT64_MAX && mul_fits(numel, static_cast<int64_t>(v), &numel))
        << where << ": shape " << shape.dump() << " has more elements than fit in 64 bits";
    t.shape.push_back(static_cast<int64_t>(v));
  }

  const Json& off = e["data_offsets"];
  MT_CHECK(off.is_array() && off.size() == 2) << where << ": data_offsets must be [begin, end], found " << off.dump();
  t.begin = json_uint(off[0], where, "data_offsets[0]");
  t.end = json_uint(off[1], where, "data_offsets[1]");
  MT_CHECK(t.begin <= t.end) << where << ": data_offsets [" << t.begin << ", " << t.end
                             << "] are out of order (end before begin)";
  int64_t need;
  MT_CHECK(mul_fits(numel, static_cast<int64_t>(item), &need))
      << where << ": shape " << shape_str(t.shape) << " has more bytes than fit in 64 bits";
  MT_CHECK(t.end - t.begin == static_cast<uint64_t>(need))
      << where << ": dtype " << t.dtype << " and shape " << shape_str(t.shape) << " need " << need
      << " bytes, but data_offsets [" << t.begin << ", " << t.end << "] hold " << t.end - t.begin;
  return t;
}

// Levenshtein distance, to suggest the keys closest to a missing one.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0]++;
    for (size_t j = 1; j <= b.size(); ++j)
      diag = std::exchange(row[j], std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])}));
  }
  return row[b.size()];
}

}  // namespace

float f32_from_f16(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  // Infinity, or NaN with its payload kept in the top mantissa bits.
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24, exact in fp32 (11 significant bits at most).
    float v = static_cast<float>(man) * 0x1p-24f;
    return sign ? -v : v;
  }
  // Rebias the exponent from 15 to 127; the 10 mantissa bits move up unchanged.
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), file_(path, "safetensors file") {
  const uint8_t* map = file_.bytes().data();
  size_t size = file_.bytes().size();
  MT_CHECK(size >= 8) << path << ": not a safetensors file: " << size
                      << " bytes, shorter than the 8-byte header length";
  uint64_t header_len;
  std::memcpy(&header_len, map, 8);  // little-endian, like every host we build for
  constexpr uint64_t kMaxHeader = 100000000;  // the safetensors format's own limit
  MT_CHECK(header_len <= kMaxHeader) << path << ": header length " << header_len << ", over the format's limit of "
                                     << kMaxHeader << " bytes (a damaged file, or not a safetensors file)";
  MT_CHECK(header_len <= size - 8) << path << ": header length " << header_len << " runs past the end of the file ("
                                   << size << " bytes; truncated, or not a safetensors file)";
  data_begin_ = 8 + static_cast<size_t>(header_len);
  std::string_view text(reinterpret_cast<const char*>(map + 8), header_len);

  // JSON allows a key twice and nlohmann keeps only the last; catch it while parsing.
  std::string duplicate;
  std::set<std::string> seen;
  Json header;
  try {
    header = Json::parse(text, [&](int depth, Json::parse_event_t ev, Json& parsed) {
      if (depth == 1 && ev == Json::parse_event_t::key && !seen.insert(parsed.get<std::string>()).second &&
          duplicate.empty())
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const Json::exception& e) {
    MT_FAIL() << path << ": header is not valid JSON: " << e.what();
  }
  MT_CHECK(header.is_object()) << path << ": header is not a JSON object but " << header.type_name();
  MT_CHECK(duplicate.empty()) << path << ": tensor '" << duplicate << "' appears twice in the header";

  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") {
      MT_CHECK(e.is_object()) << path << ": __metadata__ must be an object of strings, found " << e.dump();
      for (const auto& [k, v] : e.items()) {
        MT_CHECK(v.is_string()) << path << ": __metadata__ value of '" << k << "' must be a string, found "
                                << v.dump();
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    tensors_.push_back(parse_entry(name, e, path));
  }

  // The tensors must tile the data section: sorted by offset, each starts where
  // the previous ends and the last ends at the end of the file. This catches
  // overlaps, holes, truncation and trailing bytes alike.
  std::stable_sort(tensors_.begin(), tensors_.end(), [](const StTensor& a, const StTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t data_bytes = size - data_begin_;
  uint64_t covered = 0;
  const StTensor* prev = nullptr;
  for (const StTensor& t : tensors_) {
    MT_CHECK(t.end <= data_bytes) << path << ": tensor '" << t.name << "' data_offsets [" << t.begin << ", "
                                  << t.end << "] run past the end of the file (data section of " << data_bytes
                                  << " bytes; truncated?)";
    MT_CHECK(t.begin >= covered) << path << ": tensor '" << t.name << "' data_offsets [" << t.begin << ", " << t.end
                                 << "] overlap tensor '" << prev->name << "' [" << prev->begin << ", " << prev->end
                                 << "]";
    MT_CHECK(t.begin == covered) << path << ": bytes [" << covered << ", " << t.begin
                                 << ") of the data section belong to no tensor (a gap before '" << t.name << "')";
    covered = t.end;
    prev = &t;
  }
  MT_CHECK(covered == data_bytes) << path << ": the data section has " << data_bytes
                                  << " bytes but the tensors cover only " << covered << " (trailing bytes)";
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

const StTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> SafetensorsFile::bytes(const StTensor& t) const {
  MT_CHECK(t.begin <= t.end && t.end <= file_.bytes().size() - data_begin_)
      << path_ << ": tensor '" << t.name << "' [" << t.begin << ", " << t.end << "] is not a tensor of this file";
  return file_.bytes().subspan(data_begin_ + t.begin, t.end - t.begin);
}

void SafetensorsFile::read_f32(const StTensor& t, float* dst) const {
  const uint8_t* p = bytes(t).data();
  size_t n = static_cast<size_t>(t.numel());
  // The data section need not be aligned for the element type, so elements are
  // memcpy'd rather than read through a cast pointer.
  if (t.dtype == "F32") {
    if (n > 0) std::memcpy(dst, p, n * 4);
  } else if (t.dtype == "BF16" || t.dtype == "F16") {
    bool bf16 = t.dtype == "BF16";
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      dst[i] = bf16 ? f32_from_bf16(h) : f32_from_f16(h);
    }
  } else if (t.dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, p + 8 * i, 8);
      dst[i] = static_cast<float>(d);
    }
  } else {
    MT_FAIL() << path_ << ": tensor '" << t.name << "' has dtype " << t.dtype
              << ", which cannot be read as f32 (F32, BF16, F16 or F64 expected)";
  }
}

FileSum write_safetensors(const std::string& path, const std::vector<StWrite>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string_view> names;
  std::vector<std::string_view> pieces(2);  // length and header, filled in below
  uint64_t offset = 0;
  for (const StWrite& t : tensors) {
    std::string where = path + ": tensor '" + t.name + "'";
    MT_CHECK(t.name != "__metadata__") << where << ": the name is reserved for the metadata";
    MT_CHECK(names.insert(t.name).second) << where << ": written twice";
    int64_t bytes = static_cast<int64_t>(st_dtype_size(t.dtype, where));
    for (int64_t d : t.shape)
      MT_CHECK(d >= 0 && mul_fits(bytes, d, &bytes)) << where << ": invalid shape " << shape_str(t.shape);
    MT_CHECK(t.data != nullptr || bytes == 0) << where << ": no data for " << bytes << " bytes";
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    pieces.emplace_back(static_cast<const char*>(t.data), static_cast<size_t>(bytes));
    offset += static_cast<uint64_t>(bytes);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    MT_FAIL() << path << ": cannot encode the safetensors header (tensor names must be UTF-8): " << e.what();
  }
  // Pad with spaces (still valid JSON) so the data section starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t len = text.size();  // little-endian, like every host we build for
  pieces[0] = std::string_view(reinterpret_cast<const char*>(&len), 8);
  pieces[1] = text;
  return write_file_atomic(path, pieces);
}

HfWeights::HfWeights(const std::string& folder, const std::string& stem) : folder_(folder) {
  fs::path dir(folder);
  fs::path single = dir / (stem + ".safetensors");
  fs::path index = dir / (stem + ".safetensors.index.json");
  MT_CHECK(fs::is_directory(dir)) << "Hugging Face model folder " << folder << " does not exist (or is not a folder)";
  // transformers prefers the single file when both are present; so do we.
  if (fs::exists(single)) {
    files_.emplace_back(single.string());
    for (const StTensor& t : files_[0].tensors()) entries_.emplace(t.name, Entry{0, &t});
    return;
  }
  MT_CHECK(fs::exists(index)) << folder << ": not a Hugging Face model folder: neither " << stem
                              << ".safetensors nor " << stem << ".safetensors.index.json is there";
  std::vector<uint8_t> raw = read_file(index.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(raw.begin(), raw.end());
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL() << index.string() << ": not valid JSON: " << e.what();
  }
  MT_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object())
      << index.string() << ": expected an object with a \"weight_map\" object (tensor name -> shard file)";

  // Each shard is opened once, when a key first names it.
  std::map<std::string, size_t> shard_index;  // file name -> index in files_
  for (const auto& [key, shard] : j["weight_map"].items()) {
    MT_CHECK(shard.is_string()) << index.string() << ": weight_map[\"" << key << "\"] must be a file name, found "
                                << shard.dump();
    auto [it, first] = shard_index.emplace(shard.get<std::string>(), files_.size());
    if (first) {
      fs::path p = dir / it->first;
      MT_CHECK(fs::exists(p)) << index.string() << " names shard " << it->first << ", which is missing from " << folder;
      files_.emplace_back(p.string());
    }
    size_t i = it->second;
    const StTensor* t = files_[i].find(key);
    MT_CHECK(t != nullptr) << index.string() << " maps '" << key << "' to " << files_[i].path()
                           << ", which has no such tensor";
    entries_.emplace(key, Entry{i, t});
  }
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

bool HfWeights::contains(std::string_view name) const { return entries_.find(name) != entries_.end(); }

std::string HfWeights::suggest(std::string_view name) const {
  // Offer the closest keys, when close enough to be a plausible misspelling.
  size_t budget = std::max<size_t>(3, name.size() / 4);
  std::vector<std::pair<size_t, std::string_view>> close;
  for (const auto& [key, e] : entries_) {
    size_t d = edit_distance(name, key);
    if (d <= budget) close.emplace_back(d, key);
  }
  std::sort(close.begin(), close.end());
  std::string hint;
  for (size_t i = 0; i < close.size() && i < 2; ++i)
    hint.append(i ? " or '" : "; did you mean '").append(close[i].second).append("'");
  return hint.empty() ? hint : hint + "?";
}

const HfWeights::Entry& HfWeights::entry(std::string_view name) const {
  auto it = entries_.find(name);
  MT_CHECK(it != entries_.end()) << folder_ << ": no tensor '" << name << "' in the model (" << entries_.size()
                                 << " tensors)" << suggest(name);
  return it->second;
}

const StTensor& HfWeights::tensor(std::string_view name) const { return *entry(name).tensor; }

std::span<const uint8_t> HfWeights::bytes(std::string_view name) const {
  const Entry& e = entry(name);
  return files_[e.file].bytes(*e.tensor);
}

const HfWeights::Entry& HfWeights::entry(std::string_view name, const std::vector<int64_t>& expected_shape) const {
  const Entry& e = entry(name);
  MT_CHECK(e.tensor->shape == expected_shape)
      << files_[e.file].path() << ": tensor '" << name << "' has shape " << shape_str(e.tensor->shape)
      << ", expected " << shape_str(expected_shape);
  return e;
}

void HfWeights::read_f32(std::string_view name, const std::vector<int64_t>& expected_shape, float* dst) const {
  const Entry& e = entry(name, expected_shape);
  files_[e.file].read_f32(*e.tensor, dst);
}

void HfWeights::read_slice_f32(std::string_view name, const std::vector<int64_t>& shape, int64_t index,
                               bool transpose, bool mxfp4, float* dst) const {
  MT_CHECK(shape.size() >= 2 && index >= 0 && index < shape[0] && (!transpose || shape.size() == 3))
      << folder_ << ": no slice " << index << (transpose ? " to transpose" : "") << " in tensor '" << name
      << "' of shape " << shape_str(shape);
  const int64_t n = std::accumulate(shape.begin() + 1, shape.end(), int64_t{1}, std::multiplies<>());
  // Dequantized slices come out [R, G * 32]: the parameter's slice transposed.
  const bool quantized = mxfp4 && !contains(name);
  std::vector<float> read(transpose != quantized ? n : 0);
  float* out = read.empty() ? dst : read.data();
  if (quantized) {
    const std::string key(name);
    const int64_t rows = shape.back(), groups = shape.size() == 3 ? shape[1] / 32 : 0;
    const StTensor &b = tensor(key + "_blocks"), &s = tensor(key + "_scales");
    const std::vector<int64_t> want_b = {shape[0], rows, groups, 16}, want_s = {shape[0], rows, groups};
    MT_CHECK(shape.size() == 3 && groups * 32 == shape[1] && b.dtype == "U8" && s.dtype == "U8" &&
             b.shape == want_b && s.shape == want_s)
        << folder_ << ": MXFP4 tensor '" << name << "' of shape " << shape_str(shape) << " needs U8 " << key
        << "_blocks [" << shape[0] << "," << rows << "," << groups << ",16] and _scales [" << shape[0] << "," << rows
        << "," << groups << "], found " << b.dtype << " " << shape_str(b.shape) << " and " << s.dtype << " "
        << shape_str(s.shape);
    dequantize_mxfp4(bytes(key + "_blocks").data() + index * rows * groups * 16,
                     bytes(key + "_scales").data() + index * rows * groups, rows, groups, out);
  } else {
    // The slices lie one after another in the tensor's bytes: read slice `index` as a
    // tensor of its own.
    const Entry& e = entry(name, shape);
    StTensor slice = *e.tensor;
    const uint64_t size = (slice.end - slice.begin) / static_cast<uint64_t>(shape[0]);
    slice.shape.erase(slice.shape.begin());
    slice.begin += static_cast<uint64_t>(index) * size;
    slice.end = slice.begin + size;
    files_[e.file].read_f32(slice, out);
  }
  if (out != dst) transpose_f32(out, quantized ? shape[2] : shape[1], quantized ? shape[1] : shape[2], dst);
}

void transpose_f32(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

void dequantize_mxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t rows, int64_t groups, float* dst) {
  static constexpr float kFp4[16] = {+0.0f, 0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int64_t g = 0; g < rows * groups; ++g) {
    // A product with 2^(s - 127), as torch.ldexp computes it: s = 255, E8M0's NaN, gives
    // infinities and NaN (0 * inf) there too.
    const float scale = std::ldexp(1.0f, static_cast<int>(scales[g]) - 127);
    for (int64_t b = 0; b < 16; ++b) {
      dst[g * 32 + 2 * b] = kFp4[blocks[g * 16 + b] & 15] * scale;
      dst[g * 32 + 2 * b + 1] = kFp4[blocks[g * 16 + b] >> 4] * scale;
    }
  }
}

}  // namespace mt::io
