#include "data/dataset.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <utility>

#include "core/check.h"
#include "core/rng.h"
#include "io/npy.h"

namespace mt::data {
namespace fs = std::filesystem;

namespace {

// A bijection of [0, 2^(2*half_bits)): a 6-round Feistel network whose round
// function is Philox keyed by the seed, with the epoch and round in the counter.
uint64_t feistel(uint64_t x, int half_bits, uint64_t seed, uint64_t epoch) {
  uint64_t mask = (uint64_t{1} << half_bits) - 1;
  uint64_t left = x >> half_bits, right = x & mask;
  std::array<uint32_t, 2> key{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  for (uint32_t round = 0; round < 6; ++round) {
    std::array<uint32_t, 4> ctr{static_cast<uint32_t>(right), static_cast<uint32_t>(right >> 32), round,
                                static_cast<uint32_t>(epoch) ^ static_cast<uint32_t>(epoch >> 32) * 0x9E3779B9u};
    std::array<uint32_t, 4> r = philox4x32_10(ctr, key);
    uint64_t f = (static_cast<uint64_t>(r[1]) << 32 | r[0]) & mask;
    left = std::exchange(right, left ^ f);  // (L, R) -> (R, L ^ F(R))
  }
  return (left << half_bits) | right;
}

}  // namespace

Dataset::Dataset(const std::vector<Source>& sources, int64_t seq_len, uint64_t seed, Split split)
    : seq_len_(seq_len), seed_(seed) {
  MT_CHECK(!sources.empty()) << "a dataset needs at least one corpus folder";
  double total = 0;
  for (const Source& src : sources) {
    MT_CHECK(src.weight > 0 && std::isfinite(src.weight))
        << "corpus " << src.folder << ": its weight in the mixture should be > 0, got " << src.weight;
    total += src.weight;
  }
  starts_.push_back(0);
  for (const Source& src : sources) {
    corpora_.push_back({src.weight / total, starts_.back(), 0});
    add_corpus(src.folder, split);
    corpora_.back().samples = starts_.back() - corpora_.back().first;
  }
  rewind();
}

void Dataset::rewind() { cursor_ = {0, std::vector<uint64_t>(corpora_.size() > 1 ? corpora_.size() : 0, 0)}; }

void Dataset::add_corpus(const std::string& folder, Split split) {
  const int64_t seq_len = seq_len_, first_sample = starts_.back();
  const size_t first_file = files_.size();
  int64_t corpus_tokens = 0;
  MT_CHECK(seq_len >= 1) << "dataset " << folder << ": seq_len must be at least 1, got " << seq_len;
  MT_CHECK(fs::is_directory(folder)) << "dataset " << folder
                                     << " is not a folder (expected the output of moetrain tokenize)";
  std::vector<fs::path> bins;
  for (const auto& e : fs::recursive_directory_iterator(folder))
    if (e.is_regular_file() && e.path().extension() == ".bin") bins.push_back(e.path());
  std::sort(bins.begin(), bins.end());
  MT_CHECK(!bins.empty()) << "dataset " << folder << " holds no .bin token files (run moetrain tokenize first)";

  for (const fs::path& p : bins) {
    std::string path = p.string();
    MT_CHECK(!fs::exists(path + ".lock"))
        << path << " is unfinished (" << path << ".lock is there); rerun moetrain tokenize to complete it";
    // The headers and document ends are read through a map once; the tokens as the run goes.
    const io::MappedFile map(path, "token file");
    File& g = files_.emplace_back(File{io::PositionalFile(path, "token file")});
    const uint8_t* base = map.bytes().data();
    size_t size = map.bytes().size();
    io::NpyHeader h = io::parse_npy_header(base, size, path + ", tokens array");
    MT_CHECK(h.shape.size() == 1 && (h.descr == "|u1" || h.descr == "<u2" || h.descr == "<u4"))
        << path << ": tokens array has dtype '" << h.descr << "' and " << h.shape.size()
        << " dimensions (expected a 1-D uint8, uint16 or uint32 array)";
    g.tokens = g.header = static_cast<int64_t>(h.header_bytes);
    g.width = h.item_bytes;
    g.count = h.shape[0];
    size_t off = h.header_bytes + h.data_bytes();
    io::NpyHeader e = io::parse_npy_header(base + off, size - off, path + ", document ends array");
    MT_CHECK(e.shape.size() == 1 && e.descr == "<u8")
        << path << ": document ends array has dtype '" << e.descr << "' (expected 1-D uint64)";
    const uint8_t* ends = base + off + e.header_bytes;
    auto end_at = [&](int64_t i) {
      uint64_t v = 0;
      std::memcpy(&v, ends + i * 8, 8);
      return v;
    };
    const int64_t docs = e.shape[0];
    const uint64_t last = docs > 0 ? end_at(docs - 1) : 0;
    MT_CHECK(last == static_cast<uint64_t>(g.count))
        << path << ": the last document ends at " << last << " but the file holds " << g.count << " tokens";
    if (split.held_out > 0) {
      // The first document end at or after (1 - held_out) of the tokens (ends ascend).
      const double at = (1.0 - split.held_out) * static_cast<double>(g.count);
      int64_t lo = 0, hi = docs - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (static_cast<double>(end_at(mid)) >= at) hi = mid;
        else lo = mid + 1;
      }
      const int64_t cut = docs > 0 ? static_cast<int64_t>(end_at(lo)) : 0;
      if (split.take_held_out) g.tokens += cut * static_cast<int64_t>(g.width);
      g.count = split.take_held_out ? g.count - cut : cut;
    }
    num_tokens_ += g.count;
    corpus_tokens += g.count;
    starts_.push_back(starts_.back() + g.count / (seq_len + 1));
  }
  const std::string part = split.held_out == 0     ? ""
                           : split.take_held_out ? " (the held-out part of validation.split)"
                                                 : " (the part validation.split leaves for training)";
  MT_CHECK(starts_.back() > first_sample)
      << "dataset " << folder << part << ": no file holds a whole sample of seq_len + 1 = " << seq_len + 1
      << " tokens (" << corpus_tokens << " tokens in " << files_.size() - first_file << " files)";
}

std::string Dataset::find_id_past(int64_t vocab, int part, int parts) const {
  std::vector<uint8_t> chunk(size_t{8} << 20);
  for (size_t f = static_cast<size_t>(part); f < files_.size(); f += static_cast<size_t>(parts)) {
    const File& g = files_[f];
    if (vocab >= (int64_t{1} << (8 * std::min<size_t>(g.width, 7)))) continue;
    const int64_t per_chunk = static_cast<int64_t>(chunk.size() / g.width);
    for (int64_t at = 0; at < g.count; at += per_chunk) {
      const int64_t n = std::min(per_chunk, g.count - at);
      g.file.read(g.tokens + at * static_cast<int64_t>(g.width), static_cast<size_t>(n) * g.width, chunk.data());
      auto first_past = [&](auto type) -> int64_t {
        using T = decltype(type);
        const T* ids = reinterpret_cast<const T*>(chunk.data());
        T largest = 0;
        for (int64_t i = 0; i < n; ++i) largest = std::max(largest, ids[i]);  // vectorizes
        if (static_cast<int64_t>(largest) < vocab) return -1;
        for (int64_t i = 0;; ++i)
          if (static_cast<int64_t>(ids[i]) >= vocab) return i;
      };
      const int64_t i = g.width == 1 ? first_past(uint8_t{}) : g.width == 2 ? first_past(uint16_t{}) : first_past(uint32_t{});
      if (i < 0) continue;
      uint32_t id = 0;
      std::memcpy(&id, chunk.data() + i * static_cast<int64_t>(g.width), g.width);
      const int64_t token = (g.tokens - g.header) / static_cast<int64_t>(g.width) + at + i;
      return g.file.path() + ": token id " + std::to_string(id) + " at token " + std::to_string(token) + " (byte " +
             std::to_string(g.tokens + (at + i) * static_cast<int64_t>(g.width)) + ")";
    }
  }
  return "";
}

void Dataset::check_whole() const {
  uint32_t last = 0;
  for (const File& g : files_)
    if (g.count > 0) g.file.read(g.tokens + (g.count - 1) * static_cast<int64_t>(g.width), g.width, &last);
}

int64_t Dataset::sample_at(uint64_t position) const {
  MT_CHECK(corpora_.size() == 1) << "Dataset::sample_at of a mixture";
  return sample_of(0, position);
}

size_t Dataset::next_corpus(const std::vector<uint64_t>& drawn) const {
  const uint64_t n = std::accumulate(drawn.begin(), drawn.end(), uint64_t{0});
  auto behind = [&](size_t k) {
    return corpora_[k].weight * static_cast<double>(n + 1) - static_cast<double>(drawn[k]);
  };
  size_t best = 0;
  for (size_t k = 1; k < corpora_.size(); ++k)
    if (behind(k) > behind(best)) best = k;
  return best;
}

void Dataset::set_cursor(DataCursor c) {
  const uint64_t sum = std::accumulate(c.drawn.begin(), c.drawn.end(), uint64_t{0});
  MT_CHECK(corpora_.size() == 1 ? c.drawn.empty() : c.drawn.size() == corpora_.size() && sum == c.samples_seen)
      << "the data cursor holds draws from " << c.drawn.size() << " corpora (summing to " << sum << " of "
      << c.samples_seen << " samples) but the data is " << corpora_.size() << " corpora";
  cursor_ = std::move(c);
}

std::vector<double> Dataset::shares() const {
  if (corpora_.size() == 1) return {1.0};
  std::vector<double> out;
  for (uint64_t d : cursor_.drawn)
    out.push_back(cursor_.samples_seen > 0 ? static_cast<double>(d) / static_cast<double>(cursor_.samples_seen) : 0.0);
  return out;
}

int64_t Dataset::sample_of(size_t k, uint64_t j) const {
  const Corpus& c = corpora_[k];
  // The first corpus's key is the seed itself (a lone corpus's order is unchanged).
  const uint64_t key = seed_ ^ (static_cast<uint64_t>(k) * 0x9E3779B97F4A7C15ull);
  uint64_t n = static_cast<uint64_t>(c.samples);
  uint64_t epoch = j / n, x = j % n;
  // The smallest even-bit power of two >= n; walking the cycle (re-applying until
  // the value lands below n) keeps the bijection on [0, n).
  int half_bits = 1;
  while (half_bits < 32 && (uint64_t{1} << (2 * half_bits)) < n) ++half_bits;
  do x = feistel(x, half_bits, key, epoch);
  while (x >= n);
  return c.first + static_cast<int64_t>(x);
}

void Dataset::read_sample(int64_t index, int64_t begin, int64_t end, int32_t* out) const {
  MT_CHECK(index >= 0 && index < num_samples() && begin >= 0 && begin <= end && end <= seq_len_ + 1)
      << "sample " << index << " tokens [" << begin << ", " << end << ") (samples: " << num_samples()
      << ", tokens per sample: " << seq_len_ + 1 << ")";
  size_t f = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), index) - starts_.begin() - 1);
  const File& file = files_[f];
  int64_t first = (index - starts_[f]) * (seq_len_ + 1) + begin;
  const int64_t n = end - begin, w = static_cast<int64_t>(file.width);
  std::vector<uint8_t> bytes(static_cast<size_t>(n * w));
  file.file.read(file.tokens + first * w, bytes.size(), bytes.data());
  for (int64_t i = 0; i < n; ++i) {
    uint32_t v = 0;
    std::memcpy(&v, bytes.data() + i * w, file.width);
    out[i] = static_cast<int32_t>(v);
  }
}

std::vector<int64_t> Dataset::positions(int cp_rank, int cp_size) const {
  MT_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size) << "cp rank " << cp_rank << " of " << cp_size;
  MT_CHECK(seq_len_ % (2 * cp_size) == 0 || cp_size == 1)
      << "seq_len " << seq_len_ << " must be a multiple of 2 * cp = " << 2 * cp_size << " for the zigzag split";
  std::vector<int64_t> pos;
  if (cp_size == 1) {
    for (int64_t t = 0; t < seq_len_; ++t) pos.push_back(t);
    return pos;
  }
  int64_t chunk = seq_len_ / (2 * cp_size);
  for (int64_t c : {int64_t{cp_rank}, int64_t{2 * cp_size - 1 - cp_rank}})
    for (int64_t t = 0; t < chunk; ++t) pos.push_back(c * chunk + t);
  return pos;
}

void Dataset::next_batch(int dp_rank, int dp_size, int cp_rank, int cp_size, int64_t micro_batch,
                         std::span<int32_t> ids, std::span<int32_t> labels, std::span<int32_t> ahead) {
  MT_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size && micro_batch >= 1)
      << "dp rank " << dp_rank << " of " << dp_size << ", micro_batch " << micro_batch;
  std::vector<int64_t> pos = positions(cp_rank, cp_size);
  int64_t cols = static_cast<int64_t>(pos.size());
  MT_CHECK(static_cast<int64_t>(ids.size()) == micro_batch * cols && labels.size() == ids.size())
      << "next_batch: ids and labels must hold micro_batch * seq_len / cp = " << micro_batch * cols << " each, got "
      << ids.size() << " and " << labels.size();
  const int64_t A = static_cast<int64_t>(ahead.size()) / std::max<int64_t>(static_cast<int64_t>(ids.size()), 1);
  MT_CHECK(static_cast<int64_t>(ahead.size()) == A * micro_batch * cols)
      << "next_batch: ahead must hold planes of micro_batch * seq_len / cp = " << micro_batch * cols << ", got "
      << ahead.size();
  // Whole chunks are contiguous in the sample: read each with the one token after it,
  // which is the chunk's last label (and the A after that, the sample's end allowing).
  int64_t chunk = cp_size == 1 ? seq_len_ : seq_len_ / (2 * cp_size);
  std::vector<int32_t> buf(static_cast<size_t>(chunk + 1 + A));
  // A mixture's draws of the positions before this rank's (every rank counts them all).
  const bool mixture = corpora_.size() > 1;
  std::vector<uint64_t> drawn = cursor_.drawn;
  std::vector<std::pair<size_t, uint64_t>> mine;  // (corpus, its draw) of this rank's rows
  if (mixture)
    for (int64_t i = 0; i < dp_size * micro_batch; ++i) {
      const size_t k = next_corpus(drawn);
      if (i / micro_batch == dp_rank) mine.push_back({k, drawn[k]});
      ++drawn[k];
    }
  for (int64_t b = 0; b < micro_batch; ++b) {
    const int64_t sample = mixture ? sample_of(mine[static_cast<size_t>(b)].first, mine[static_cast<size_t>(b)].second)
                                   : sample_of(0, cursor_.samples_seen + static_cast<uint64_t>(dp_rank * micro_batch + b));
    for (int64_t c = 0; c < cols; c += chunk) {
      const int64_t begin = pos[static_cast<size_t>(c)], end = std::min(begin + chunk + 1 + A, seq_len_ + 1);
      std::fill(buf.begin(), buf.end(), kPastTheEnd);
      read_sample(sample, begin, end, buf.data());
      std::copy_n(buf.begin(), chunk, ids.begin() + b * cols + c);
      std::copy_n(buf.begin() + 1, chunk, labels.begin() + b * cols + c);
      for (int64_t j = 0; j < A; ++j)
        std::copy_n(buf.begin() + 2 + j, chunk, ahead.begin() + (j * micro_batch + b) * cols + c);
    }
  }
  cursor_.samples_seen += static_cast<uint64_t>(dp_size * micro_batch);
  if (mixture) cursor_.drawn = drawn;
}

void labels_ahead(const int32_t* labels, int64_t rows, int64_t seq, const std::vector<int64_t>& cols,
                  std::span<int32_t> ahead) {
  const int64_t c = static_cast<int64_t>(cols.size()), A = static_cast<int64_t>(ahead.size()) / std::max<int64_t>(rows * c, 1);
  std::fill(ahead.begin(), ahead.end(), Dataset::kPastTheEnd);
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t j = 0; j < c; ++j)
        if (cols[j] + a + 1 < seq) ahead[(a * rows + b) * c + j] = labels[b * seq + cols[j] + a + 1];
}

void mtp_tokens(std::span<const int32_t> labels, std::span<const int32_t> ahead, std::span<int32_t> out) {
  const size_t n = labels.size(), A = ahead.size() / std::max<size_t>(n, 1);
  MT_CHECK(out.size() == 2 * A * n) << "mtp_tokens: " << out.size() << " outputs for " << A << " depths of " << n;
  for (size_t k = 1; k <= A; ++k)
    for (size_t i = 0; i < n; ++i) {
      out[(k - 1) * n + i] = std::max(k == 1 ? labels[i] : ahead[(k - 2) * n + i], 0);
      out[(A + k - 1) * n + i] = ahead[(k - 1) * n + i];
    }
}

}  // namespace mt::data
