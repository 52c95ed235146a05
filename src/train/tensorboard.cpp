#include "train/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <numeric>

#include "core/check.h"

namespace mt {

namespace {

uint32_t crc32c(const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;  // Castagnoli, reflected
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}

// Protobuf's wire format: a key is (field << 3) | type; 0 varint, 1 fixed64, 2
// length-delimited, 5 fixed32; fixed-width values are little-endian.
void varint(std::string& s, uint64_t v) {
  for (; v >= 0x80; v >>= 7) s += static_cast<char>((v & 0x7f) | 0x80);
  s += static_cast<char>(v);
}
void key(std::string& s, int field, int type) { varint(s, static_cast<uint64_t>(field << 3 | type)); }
template <typename T>
void fixed(std::string& s, int field, T v) {
  key(s, field, sizeof(T) == 8 ? 1 : 5);
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  s.append(b, sizeof(T));
}
void bytes(std::string& s, int field, const std::string& v) {
  key(s, field, 2);
  varint(s, v.size());
  s += v;
}

std::string event(int64_t step, double wall_time) {
  std::string e;
  fixed(e, 1, wall_time);
  key(e, 2, 0);
  varint(e, static_cast<uint64_t>(step));
  return e;
}

}  // namespace

uint32_t tfrecord_masked_crc(const void* data, size_t n) {
  uint32_t c = crc32c(static_cast<const uint8_t*>(data), n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& folder) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double now = static_cast<double>(std::time(nullptr));
  path_ = folder + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host;
  const std::string base = path_;
  for (int i = 1; std::filesystem::exists(path_); ++i) path_ = base + "." + std::to_string(i);
  out_ = io::AppendFile(path_, true);
  std::string first = event(0, now);
  bytes(first, 3, "brain.Event:2");
  const std::string why = record(first);
  MT_CHECK(why.empty()) << "metrics.tensorboard: cannot write " << path_ << ": " << why;
}

std::string TensorBoardWriter::record(const std::string& data) {
  const uint64_t n = data.size();
  const uint32_t crc_n = tfrecord_masked_crc(&n, 8), crc_data = tfrecord_masked_crc(data.data(), data.size());
  std::string frame(reinterpret_cast<const char*>(&n), 8);
  frame.append(reinterpret_cast<const char*>(&crc_n), 4);
  frame += data;
  frame.append(reinterpret_cast<const char*>(&crc_data), 4);
  return out_.append(frame);
}

std::string TensorBoardWriter::scalars(int64_t step, double wall_time,
                                const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes(value, 1, tag);
    fixed(value, 2, v);
    bytes(summary, 1, value);
  }
  std::string e = event(step, wall_time);
  bytes(e, 5, summary);
  return record(e);
}

std::string TensorBoardWriter::restart(int64_t step, double wall_time) {
  std::string e = event(step, wall_time), start;
  key(start, 1, 0);
  varint(start, 1);  // SessionLog.START
  bytes(e, 7, start);
  return record(e);
}

std::vector<std::pair<std::string, float>> step_scalars(const StepResult& r) {
  std::vector<std::pair<std::string, float>> v = {{"loss", static_cast<float>(r.loss)},
                                                  {"lb_loss", static_cast<float>(r.lb_loss)},
                                                  {"grad_norm", static_cast<float>(r.grad_norm)},
                                                  {"lr", static_cast<float>(r.lr)},
                                                  {"tokens_per_s", static_cast<float>(r.tokens_per_s)},
                                                  {"memory_bytes", static_cast<float>(r.memory_bytes)},
                                                  {"dropped_slots", static_cast<float>(r.dropped_slots)},
                                                  {"expert_row_bytes", static_cast<float>(r.expert_row_bytes)},
                                                  {"routing_skew", static_cast<float>(r.routing_skew)}};
  if (r.z_loss_on) v.emplace_back("z_loss", static_cast<float>(r.z_loss));
  if (r.val_on) v.emplace_back("val_loss", static_cast<float>(r.val_loss));
  if (r.device_memory_bytes > 0) v.emplace_back("device_memory_bytes", static_cast<float>(r.device_memory_bytes));
  for (size_t i = 0; i < r.expert_counts.size(); ++i) {
    const std::vector<int64_t>& c = r.expert_counts[i];
    if (c.empty()) continue;
    const double mean = std::max(std::accumulate(c.begin(), c.end(), 0.0) / static_cast<double>(c.size()), 1e-30);
    const std::string layer =
        "expert_load/layer_" + std::to_string(i < r.moe_layers.size() ? r.moe_layers[i] : static_cast<int64_t>(i));
    v.emplace_back(layer + "/max_over_mean", static_cast<float>(*std::max_element(c.begin(), c.end()) / mean));
    v.emplace_back(layer + "/min_over_mean", static_cast<float>(*std::min_element(c.begin(), c.end()) / mean));
  }
  return v;
}

}  // namespace mt
