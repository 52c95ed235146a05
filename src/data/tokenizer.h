// Byte-level BPE read from a Hugging Face tokenizer.json, as Qwen2/Qwen3 and
// GPT-2-style models ship it; encode() gives the ids `Tokenizer.encode(text).ids`
// gives in Hugging Face tokenizers, decode() the text `Tokenizer.decode(ids)` gives.
//
// Encoding, in Hugging Face's order:
//   1. added tokens with normalized=false are cut out of the raw text (leftmost,
//      longest match first);
//   2. each remaining piece is normalized (NFC or nothing), and added tokens with
//      normalized=true are cut out of it;
//   3. the pre-tokenizer regexes (a Split with its pattern, or ByteLevel's own GPT-2
//      pattern) cut the rest into words;
//   4. each word's UTF-8 bytes go through BPE: lowest-ranked adjacent pair first.
// ByteLevel's byte-to-character map only renames bytes, so it is applied to the
// vocabulary once at load instead of to every word.
//
// Supported, and anything else in the file is an error naming it: model BPE (no
// dropout, no subword prefix or word suffix, no byte fallback, ignore_merges either
// way, merges spelled "a b" or ["a", "b"]); normalizer none, NFC, or a Sequence of
// NFC; pre-tokenizer ByteLevel or a Sequence of isolated Regex Splits ending in
// ByteLevel (add_prefix_space false); post-processor none or ByteLevel; decoder none
// or ByteLevel; added tokens without lstrip/rstrip/single_word (one with empty
// content is skipped, as Hugging Face skips it); no truncation or padding.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mt::data {

class Tokenizer {
 public:
  // Reads and checks `path` (and the eos_token of a tokenizer_config.json beside it).
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();

  // Appends the ids of `text` (UTF-8; anything else is an error giving the byte
  // offset) to `out`. Not thread-safe: words already seen are cached, so use one
  // Tokenizer per thread. `tokenize` runs one per worker process.
  void encode(std::string_view text, std::vector<int32_t>& out);
  std::vector<int32_t> encode(std::string_view text);

  // The text of `ids`; invalid UTF-8 from partial byte sequences becomes U+FFFD, as
  // Hugging Face does. skip_special drops special added tokens (HF's default).
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // 1 + the largest id of the vocabulary and the added tokens.
  int32_t vocab_size() const;
  // The id of a vocabulary entry (as spelled in the file) or added token.
  std::optional<int32_t> token_id(std::string_view token) const;
  // The token appended to every document by `tokenize`: "eos_token" of
  // tokenizer_config.json beside the file, else the added token <|endoftext|>;
  // an error saying so when neither exists.
  int32_t eos_id() const;
  bool has_eos() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt::data
