// JSON_DIAGNOSTICS: nlohmann's type errors carry the JSON pointer of the value (this file
// only; the library tags its ABI for it), so a field of the wrong type is named. GCC 12
// then warns, wrongly, of std::map's header read past a 32-byte string (-Warray-bounds,
// in code inlined from the library, as it parses); before every include, so it holds there.
#define JSON_DIAGNOSTICS 1
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif
#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/check.h"
#include "io/file.h"

namespace mt::data {
namespace {

using json = nlohmann::json;

// The pattern ByteLevel applies itself when use_regex is true (GPT-2's).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the
// other 68 bytes take the code points from U+0100 on, in byte order.
std::array<uint32_t, 256> byte_level_chars() {
  std::array<uint32_t, 256> cp{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    cp[b] = printable ? b : next++;
  }
  return cp;
}

// Length of the valid UTF-8 sequence at p[0..n), or minus the length of its longest
// valid prefix (at least 1) when invalid. That prefix is Unicode's "maximal
// subpart", which Rust's from_utf8_lossy, and so Hugging Face's decode, turns into
// one U+FFFD.
int utf8_sequence(const unsigned char* p, size_t n) {
  unsigned char c = p[0];
  if (c < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return -1;
  }
  for (int i = 1; i < len; ++i) {
    if (static_cast<size_t>(i) >= n || p[i] < lo || p[i] > hi) return -i;
    lo = 0x80;
    hi = 0xBF;
  }
  return len;
}

size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    int len = utf8_sequence(p + i, s.size() - i);
    if (len < 0) return i;
    i += static_cast<size_t>(len);
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    int len = utf8_sequence(p + i, s.size() - i);
    if (len > 0)
      out.append(s.data() + i, static_cast<size_t>(len));
    else
      out += "\xEF\xBF\xBD";  // one U+FFFD for the whole invalid prefix
    i += static_cast<size_t>(std::abs(len));
  }
  return out;
}

// The bytes a byte-level spelling stands for; nullopt when a character is not in
// the byte map (such a token can only be an added token).
std::optional<std::string> byte_level_bytes(std::string_view spelled) {
  static const std::unordered_map<uint32_t, uint8_t> char_byte = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    std::array<uint32_t, 256> cp = byte_level_chars();
    for (int b = 0; b < 256; ++b) m[cp[b]] = static_cast<uint8_t>(b);
    return m;
  }();
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(spelled.data());
  for (size_t i = 0; i < spelled.size();) {
    utf8proc_int32_t c;
    utf8proc_ssize_t len = utf8proc_iterate(p + i, static_cast<utf8proc_ssize_t>(spelled.size() - i), &c);
    if (len < 0) return std::nullopt;
    auto it = char_byte.find(static_cast<uint32_t>(c));
    if (it == char_byte.end()) return std::nullopt;
    out += static_cast<char>(it->second);
    i += static_cast<size_t>(len);
  }
  return out;
}

// NFC of valid UTF-8 (utf8proc; NUL bytes are kept, as the length is explicit).
std::string nfc_of(std::string_view text) {
  utf8proc_uint8_t* n = nullptr;
  utf8proc_ssize_t len =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &n, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  MT_CHECK(len >= 0) << "NFC normalization failed: " << utf8proc_errmsg(len);
  std::string out(reinterpret_cast<const char*>(n), static_cast<size_t>(len));
  std::free(n);
  return out;
}

// Heterogeneous lookup, so a word can be looked up as a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// (left id, right id) -> (rank, merged id). BPE looks up every adjacent pair of
// every new word here, so the table is flat: open addressing, linear probing.
class MergeTable {
 public:
  struct Entry {
    uint64_t key;
    int32_t rank;
    int32_t id;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are < 2^31: never a key

  void reserve(size_t n) {
    int bits = 4;
    while ((size_t{1} << bits) < 2 * n) ++bits;
    slots_.assign(size_t{1} << bits, Entry{kEmpty, 0, 0});
    mask_ = slots_.size() - 1;
    shift_ = 64 - bits;
  }
  static uint64_t key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }
  // A pair listed twice keeps its later rank, as Hugging Face's map does.
  void insert(uint64_t k, int32_t rank, int32_t id) {
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty || slots_[i].key == k) {
        slots_[i] = Entry{k, rank, id};
        return;
      }
    }
  }
  const Entry* find(uint64_t k) const {
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  // The product's top bits, which depend on every bit of the key. (Bits 20 to 31, taken
  // before, depend on the right id alone: pairs with one right id crowded together, and
  // a lookup in the demo vocabulary's merges probed 25 slots on average, now 1.4.)
  size_t slot(uint64_t k) const { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
  int shift_ = 0;
};

// Added tokens, matched leftmost-longest like Hugging Face's Aho-Corasick matcher:
// at the first position where any token matches, the longest one there wins.
struct AddedMatcher {
  std::array<std::vector<std::pair<std::string, int32_t>>, 256> by_first;  // longest first
  bool empty = true;

  void add(const std::string& content, int32_t id) {
    auto& v = by_first[static_cast<unsigned char>(content[0])];
    v.emplace_back(content, id);
    std::stable_sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    empty = false;
  }
  // Calls piece(text) for the text between tokens (all of it, unscanned, when there
  // are none) and token(id) for each token.
  template <typename Piece, typename Token>
  void split(std::string_view text, Piece&& piece, Token&& token) const {
    size_t last = 0;
    for (size_t i = 0; i < text.size() && !empty;) {
      const auto& cands = by_first[static_cast<unsigned char>(text[i])];
      auto hit = std::find_if(cands.begin(), cands.end(),
                              [&](const auto& c) { return text.compare(i, c.first.size(), c.first) == 0; });
      if (hit == cands.end()) {
        ++i;
        continue;
      }
      if (i > last) piece(text.substr(last, i - last));
      token(hit->second);
      i += hit->first.size();
      last = i;
    }
    if (last < text.size()) piece(text.substr(last));
  }
};

struct Regex {
  std::string key;  // where the file has it, for errors
  std::unique_ptr<pcre2_code, decltype(&pcre2_code_free)> code{nullptr, pcre2_code_free};
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match{nullptr, pcre2_match_data_free};
  std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> limits{
      pcre2_match_context_create(nullptr), pcre2_match_context_free};
};

std::string type_of(const json& j) { return j.is_object() && j.contains("type") ? j["type"].dump() : j.dump(); }

bool flag(const json& j, const char* key) { return j.contains(key) && j[key].is_boolean() && j[key].get<bool>(); }

// j[key], or null where j has none. A reference into the document, not a copy as value()
// gives, so that a type error below it names its whole path from the file's root.
const json& field(const json& j, const char* key) {
  static const json none;
  const auto it = j.find(key);
  return it == j.end() ? none : *it;
}

// PCRE2's text for an error code.
std::string pcre2_error(int code) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(code, msg, sizeof msg);
  return reinterpret_cast<const char*>(msg);
}

// The steps of a Sequence (j's `list`, keyed "key.list[i]"), or j itself as the only one.
std::vector<std::pair<const json&, std::string>> steps_of(const json& j, const std::string& key, const char* list) {
  if (j.value("type", std::string()) != "Sequence") return {{j, key}};
  std::vector<std::pair<const json&, std::string>> steps;
  const json& l = field(j, list);
  for (size_t i = 0; i < l.size(); ++i) steps.emplace_back(l[i], key + "." + list + "[" + std::to_string(i) + "]");
  return steps;
}

// Errors about the file name the file and the key, e.g. "tokenizer.json: decoder".
void unsupported(const std::string& file, const std::string& key, const std::string& what) {
  MT_FAIL() << file << ": " << key << ": " << what
            << " is not supported (moetrain reads byte-level BPE tokenizers, see src/data/tokenizer.h)";
}

}  // namespace

// Ids are below 2^24 (the largest vocabularies have ~2^18), so id + 1 never overflows.
constexpr int64_t kMaxIds = int64_t{1} << 24;

struct Tokenizer::Impl {
  std::string path;
  bool nfc = false;
  bool has_decoder = false;
  std::vector<Regex> regexes;     // applied in order: each cuts the previous one's pieces
  StringMap<int32_t> vocab;       // as spelled in the file (byte-level characters)
  StringMap<int32_t> byte_vocab;  // raw bytes -> id, with ignore_merges only (else empty)
  std::array<int32_t, 256> byte_id{};
  MergeTable merges;
  AddedMatcher raw_added, normalized_added;
  StringMap<int32_t> added_ids;      // content -> id
  std::vector<std::string> decoded;  // id -> bytes the decoder emits
  enum Kind : uint8_t { kNone, kToken, kSpecial };
  std::vector<Kind> kind;  // ids may have gaps
  int32_t vocab_size = 0;
  std::optional<int32_t> eos;
  std::string eos_problem;

  // Reused by encode(); see the thread-safety note in the header.
  StringMap<std::vector<int32_t>> cache;
  struct Symbol {
    int32_t id, prev, next;
  };
  struct Candidate {
    int32_t rank, pos, id;
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;

  void load(const std::string& file);
  void load_model(const json& model);
  void load_normalizer(const json& normalizer);
  void load_pre_tokenizer(const json& pre_tokenizer);
  void load_added_tokens(const json& added_tokens);
  void load_eos();
  std::optional<int32_t> token_id(std::string_view token) const;
  void encode(std::string_view text, std::vector<int32_t>& out);
  void pre_tokenize(std::string_view piece, size_t level, std::vector<int32_t>& out);
  void bpe(std::string_view word, std::vector<int32_t>& out);
};

void Tokenizer::Impl::load(const std::string& file) {
  path = file;
  std::vector<uint8_t> bytes = io::read_file(file);
  json j = json::parse(bytes.begin(), bytes.end(), nullptr, false);
  MT_CHECK(!j.is_discarded() && j.is_object())
      << file << ": not a JSON object (expected a Hugging Face tokenizer.json)";
  for (const char* key : {"truncation", "padding"})
    if (j.contains(key) && !j[key].is_null()) unsupported(file, key, std::string(key) + " " + j[key].dump());
  MT_CHECK(j.contains("model") && j["model"].is_object()) << file << ": model: missing";
  load_model(j["model"]);
  load_normalizer(field(j, "normalizer"));
  MT_CHECK(j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
      << file << ": pre_tokenizer: missing; a byte-level BPE needs a ByteLevel pre-tokenizer";
  load_pre_tokenizer(j["pre_tokenizer"]);
  const json& pp = field(j, "post_processor");
  if (!pp.is_null() && pp.value("type", std::string()) != "ByteLevel")
    unsupported(file, "post_processor", "post-processor " + type_of(pp));
  const json& dec = field(j, "decoder");
  if (!dec.is_null() && dec.value("type", std::string()) != "ByteLevel")
    unsupported(file, "decoder", "decoder " + type_of(dec));
  has_decoder = !dec.is_null();
  load_added_tokens(field(j, "added_tokens"));
}

void Tokenizer::Impl::load_model(const json& m) {
  if (m.value("type", std::string("BPE")) != "BPE") unsupported(path, "model.type", "model " + type_of(m));
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"] != 0.0)
    unsupported(path, "model.dropout", "BPE dropout " + m["dropout"].dump());
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && !m[key].is_null() && m[key] != "")
      unsupported(path, std::string("model.") + key, m[key].dump());
  if (flag(m, "byte_fallback")) unsupported(path, "model.byte_fallback", "byte_fallback true");
  MT_CHECK(m.contains("vocab") && m["vocab"].is_object()) << path << ": model.vocab: missing or not an object";
  MT_CHECK(m.contains("merges") && m["merges"].is_array()) << path << ": model.merges: missing or not a list";

  for (const auto& [token, id] : m["vocab"].items()) {
    MT_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < kMaxIds)
        << path << ": model.vocab: token " << json(token).dump() << " has id " << id.dump()
        << " (expected an integer in [0, 2^24))";
    vocab.emplace(token, id.get<int32_t>());
    vocab_size = std::max(vocab_size, id.get<int32_t>() + 1);
  }
  const std::array<uint32_t, 256> cp = byte_level_chars();
  for (int b = 0; b < 256; ++b) {
    utf8proc_uint8_t utf8[4];
    utf8proc_ssize_t len = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp[b]), utf8);
    std::string spelled(reinterpret_cast<const char*>(utf8), static_cast<size_t>(len));
    auto it = vocab.find(spelled);
    MT_CHECK(it != vocab.end()) << path << ": model.vocab: no token for byte 0x" << std::hex << b << " ('" << spelled
                                << "'); a byte-level BPE vocabulary has all 256";
    byte_id[b] = it->second;
  }
  if (flag(m, "ignore_merges"))
    for (const auto& [spelled, id] : vocab)
      if (auto b = byte_level_bytes(spelled)) byte_vocab.emplace(*b, id);

  const json& ml = m["merges"];
  merges.reserve(ml.size());
  for (size_t i = 0; i < ml.size(); ++i) {
    std::string a, b;
    const json& e = ml[i];
    std::string key = "model.merges[" + std::to_string(i) + "]";
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      MT_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos)
          << path << ": " << key << ": " << e.dump() << " (expected two tokens separated by one space)";
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      MT_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string())
          << path << ": " << key << ": " << e.dump() << " (expected \"a b\" or [\"a\", \"b\"])";
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    const std::string& missing = ia == vocab.end() ? a : ib == vocab.end() ? b : a + b;
    MT_CHECK(ia != vocab.end() && ib != vocab.end() && iab != vocab.end())
        << path << ": " << key << ": " << e.dump() << ": " << missing << " is not in model.vocab";
    merges.insert(MergeTable::key(ia->second, ib->second), static_cast<int32_t>(i), iab->second);
  }
}

void Tokenizer::Impl::load_normalizer(const json& nz) {
  if (nz.is_null()) return;
  for (const auto& [n, key] : steps_of(nz, "normalizer", "normalizers")) {
    if (n.value("type", std::string()) != "NFC") unsupported(path, key, "normalizer " + type_of(n));
    nfc = true;
  }
}

void Tokenizer::Impl::load_pre_tokenizer(const json& pt) {
  auto compile = [&](const std::string& pattern, const std::string& key) {
    int err;
    PCRE2_SIZE offset;
    Regex r{key};
    r.code.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                               &err, &offset, nullptr));
    MT_CHECK(r.code != nullptr) << path << ": " << key << ": regex " << json(pattern).dump()
                                << " does not compile with PCRE2 at offset " << offset << ": " << pcre2_error(err);
    // JIT is an optimisation: pcre2_match uses it when it compiled, interprets otherwise.
    pcre2_jit_compile(r.code.get(), PCRE2_JIT_COMPLETE);
    r.match.reset(pcre2_match_data_create_from_pattern(r.code.get(), nullptr));
    regexes.push_back(std::move(r));
  };
  bool byte_level = false;
  for (const auto& [s, key] : steps_of(pt, "pre_tokenizer", "pretokenizers")) {
    std::string type = s.value("type", std::string());
    MT_CHECK(!byte_level) << path << ": " << key << ": " << type_of(s)
                          << " after ByteLevel is not supported (ByteLevel must come last)";
    if (type == "ByteLevel") {
      if (flag(s, "add_prefix_space")) unsupported(path, key + ".add_prefix_space", "ByteLevel add_prefix_space true");
      if (s.value("use_regex", true)) compile(kGpt2Pattern, key);
      byte_level = true;
    } else if (type == "Split") {
      const json& p = field(s, "pattern");
      if (!p.is_object() || !p.contains("Regex") || !p["Regex"].is_string())
        unsupported(path, key + ".pattern", "Split pattern " + p.dump() + " (only {\"Regex\": ...})");
      if (s.value("behavior", std::string()) != "Isolated")
        unsupported(path, key + ".behavior",
                    "Split behavior " + s.value("behavior", json()).dump() + " (only Isolated)");
      if (flag(s, "invert")) unsupported(path, key + ".invert", "Split invert true");
      compile(p["Regex"].get<std::string>(), key + ".pattern.Regex");
    } else {
      unsupported(path, key, "pre-tokenizer " + type_of(s));
    }
  }
  MT_CHECK(byte_level) << path << ": pre_tokenizer: no ByteLevel step; moetrain reads byte-level BPE only";
}

void Tokenizer::Impl::load_added_tokens(const json& at) {
  std::vector<std::tuple<std::string, int32_t, bool>> added;  // spelling the decoder sees, id, special
  for (size_t i = 0; i < at.size(); ++i) {
    const json& t = at[i];
    std::string key = "added_tokens[" + std::to_string(i) + "]";
    MT_CHECK(t.is_object() && t.contains("content") && t["content"].is_string() && t.contains("id") &&
             t["id"].is_number_integer() && t["id"].get<int64_t>() >= 0 && t["id"].get<int64_t>() < kMaxIds)
        << path << ": " << key << ": " << t.dump()
        << " (expected an object with a content string and an id in [0, 2^24))";
    std::string content = t["content"].get<std::string>();
    // Hugging Face skips an empty added token: it gets no id and matches nothing (here it
    // matched at every NUL byte without moving on, forever).
    if (content.empty()) continue;
    for (const char* f : {"lstrip", "rstrip", "single_word"})
      if (flag(t, f)) unsupported(path, key + "." + f, std::string(f) + " true on " + t["content"].dump());
    int32_t id = t["id"].get<int32_t>();
    // Hugging Face matches a normalized token in normalized text by its normalized
    // spelling, and keeps it under that spelling, which is what its decoder sees.
    bool normalized = t.value("normalized", !t.value("special", false));
    std::string spelled = normalized && nfc ? nfc_of(content) : content;
    (normalized ? normalized_added : raw_added).add(spelled, id);
    added_ids[content] = id;
    added.emplace_back(spelled, id, t.value("special", false));
    vocab_size = std::max(vocab_size, id + 1);
  }
  // The id tables below are as long as the largest id: a few stray huge ids in a small
  // file (corrupt, or not a vocabulary) would allocate gigabytes.
  const int64_t listed = static_cast<int64_t>(vocab.size() + at.size());
  MT_CHECK(vocab_size <= 4 * listed + 65536)
      << path << ": token id " << vocab_size - 1 << " is far beyond the " << listed
      << " tokens the file lists (expected ids below about that count); is the file corrupt?";

  decoded.assign(static_cast<size_t>(vocab_size), std::string());
  kind.assign(static_cast<size_t>(vocab_size), kNone);
  // ByteLevel decoding: a token whose every character is in the byte map gives
  // those bytes; any other token gives its own UTF-8 text.
  auto set_decoded = [&](const std::string& spelled, int32_t id) {
    std::optional<std::string> b = byte_level_bytes(spelled);
    decoded[static_cast<size_t>(id)] = b ? *b : spelled;
    kind[static_cast<size_t>(id)] = kToken;
  };
  for (const auto& [spelled, id] : vocab) set_decoded(spelled, id);
  for (const auto& [spelled, id, special] : added) {
    set_decoded(spelled, id);
    if (special) kind[static_cast<size_t>(id)] = kSpecial;
  }
}

void Tokenizer::Impl::load_eos() {
  std::filesystem::path cfg = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::string name = "<|endoftext|>";
  std::string source = "the default <|endoftext|>";
  if (std::filesystem::exists(cfg)) {
    std::vector<uint8_t> bytes = io::read_file(cfg.string());
    json c = json::parse(bytes.begin(), bytes.end(), nullptr, false);
    MT_CHECK(!c.is_discarded()) << cfg.string() << ": not valid JSON";
    const json& e = field(c, "eos_token");
    const json& content = e.is_object() ? field(e, "content") : e;
    MT_CHECK(e.is_null() || content.is_string()) << cfg.string() << ": key eos_token is " << e.dump()
                                                 << " (expected a token's text, or an object with a content string)";
    if (!e.is_null()) name = content.get<std::string>();
    if (!e.is_null()) source = cfg.string() + " eos_token \"" + name + "\"";
  }
  eos = token_id(name);
  if (!eos)
    eos_problem = path + ": no end-of-document token: " + source +
                  " is not a token; put a tokenizer_config.json with \"eos_token\" beside the tokenizer.json";
}

std::optional<int32_t> Tokenizer::Impl::token_id(std::string_view token) const {
  if (auto it = added_ids.find(token); it != added_ids.end()) return it->second;
  if (auto it = vocab.find(token); it != vocab.end()) return it->second;
  return std::nullopt;
}

void Tokenizer::Impl::encode(std::string_view text, std::vector<int32_t>& out) {
  size_t bad = first_invalid_utf8(text);
  MT_CHECK(bad == std::string_view::npos) << "text is not valid UTF-8 at byte " << bad << " of " << text.size();
  auto emit = [&](int32_t id) { out.push_back(id); };
  raw_added.split(
      text,
      [&](std::string_view piece) {
        // Nothing below U+0300 changes under NFC or composes with what precedes it,
        // so text without a lead byte >= 0xCC is already normalized.
        std::string composed;
        if (nfc &&
            std::any_of(piece.begin(), piece.end(), [](char c) { return static_cast<unsigned char>(c) >= 0xCC; })) {
          composed = nfc_of(piece);
          piece = composed;
        }
        normalized_added.split(piece, [&](std::string_view p) { pre_tokenize(p, 0, out); }, emit);
      },
      emit);
}

// Hugging Face's Split with behavior Isolated: every match is a piece, and so is
// every stretch of text between matches.
void Tokenizer::Impl::pre_tokenize(std::string_view piece, size_t level, std::vector<int32_t>& out) {
  if (level == regexes.size()) {
    bpe(piece, out);
    return;
  }
  const Regex& r = regexes[level];
  auto subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
  // PCRE2 stops a match after 10^7 backtracking steps by default, but a pattern that is
  // linear still backtracks once per character of a run: Qwen's \s*[\r\n]+ scans a run
  // of spaces to its end before it gives up, so 10 MB of spaces failed. A limit growing
  // with the text lets such runs through and still stops exponential backtracking.
  pcre2_set_match_limit(r.limits.get(),
                        static_cast<uint32_t>(std::min<uint64_t>(10'000'000 + 16 * uint64_t{piece.size()}, UINT32_MAX)));
  size_t gap = 0, from = 0;
  while (from <= piece.size()) {
    int rc = pcre2_match(r.code.get(), subject, piece.size(), from, PCRE2_NO_UTF_CHECK, r.match.get(),
                         r.limits.get());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    // 0 only says the ovector is short of captures; the whole match is in it.
    MT_CHECK(rc >= 0) << path << ": " << r.key << ": the regex failed searching from byte " << from << " of a "
                      << piece.size() << "-byte piece of the text (PCRE2: " << pcre2_error(rc)
                      << "); a pattern that backtracks without bound needs rewriting";
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(r.match.get());
    size_t b = ov[0], e = ov[1];
    if (b > gap) pre_tokenize(piece.substr(gap, b - gap), level + 1, out);
    if (e > b) pre_tokenize(piece.substr(b, e - b), level + 1, out);
    gap = e;
    // An empty match yields no piece but still ends the stretch before it, as in
    // Hugging Face; the search goes on after the next character.
    from = e;
    if (e == b) {
      if (b == piece.size()) break;
      do ++from;
      while (from < piece.size() && (static_cast<unsigned char>(piece[from]) & 0xC0) == 0x80);
    }
  }
  if (gap < piece.size()) pre_tokenize(piece.substr(gap), level + 1, out);
}

// Hugging Face's BPE merge loop: a heap of candidate pairs ordered by (rank,
// position); a popped pair is applied only if both symbols still hold what it was
// made from, and each merge offers the pairs it forms with its neighbours.
void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) {
  if (word.size() == 1) {
    out.push_back(byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (auto it = cache.find(word); it != cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  if (auto it = byte_vocab.find(word); it != byte_vocab.end()) {
    out.push_back(it->second);
    return;
  }
  int32_t n = static_cast<int32_t>(word.size());
  symbols.resize(word.size());
  for (int32_t i = 0; i < n; ++i)
    symbols[i] = {byte_id[static_cast<unsigned char>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  // Offers the pair of symbol `pos` and its right neighbour, if it is a merge.
  auto offer = [&](int32_t pos) {
    if (pos < 0 || symbols[pos].next < 0) return;
    if (const auto* m = merges.find(MergeTable::key(symbols[pos].id, symbols[symbols[pos].next].id))) {
      heap.push_back({m->rank, pos, m->id});
      std::push_heap(heap.begin(), heap.end(), later);
    }
  };
  heap.clear();
  for (int32_t i = 0; i + 1 < n; ++i) offer(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Candidate top = heap.back();
    heap.pop_back();
    Symbol& s = symbols[top.pos];
    if (s.id < 0 || s.next < 0) continue;
    Symbol& right = symbols[s.next];
    const auto* m = merges.find(MergeTable::key(s.id, right.id));
    if (m == nullptr || m->id != top.id) continue;  // stale: a neighbour changed since
    s.id = top.id;
    int32_t after = right.next;
    right.id = -1;
    s.next = after;
    if (after >= 0) symbols[after].prev = top.pos;
    offer(s.prev);
    offer(top.pos);
  }
  size_t first = out.size();
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
  // Bounded: a corpus with endless distinct words must not grow the cache forever, and
  // long words (as Hugging Face, below 256 bytes only) are rarely seen twice.
  if (word.size() >= 256) return;
  if (cache.size() >= (1u << 18)) cache.clear();
  cache.emplace(std::string(word), std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
}

Tokenizer::Tokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  try {
    impl_->load(path);
    impl_->load_eos();
  } catch (const nlohmann::json::exception& e) {  // a field of the wrong type, read with value()/get()
    // e.what() is "[json.exception.type_error.302] (/model/type) type must be string, ...".
    std::string what = e.what();
    what = what.substr(std::min(what.find("] ") + 2, what.size()));
    std::string key = "a field";
    if (what.starts_with("(") && what.find(") ") != std::string::npos) {
      key = "key " + what.substr(1, what.find(") ") - 1);
      what = what.substr(what.find(") ") + 2);
    }
    MT_FAIL() << path << ": " << key << " has the wrong JSON type for a Hugging Face tokenizer.json: " << what;
  }
}
Tokenizer::~Tokenizer() = default;

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out) { impl_->encode(text, out); }

std::vector<int32_t> Tokenizer::encode(std::string_view text) {
  std::vector<int32_t> out;
  impl_->encode(text, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  MT_CHECK(impl_->has_decoder) << impl_->path << ": has no decoder, so ids cannot be turned back into text";
  std::string bytes;
  for (int32_t id : ids) {
    MT_CHECK(id >= 0 && id < impl_->vocab_size && impl_->kind[static_cast<size_t>(id)] != Impl::kNone)
        << "decode: id " << id << " is not a token of " << impl_->path;
    if (skip_special && impl_->kind[static_cast<size_t>(id)] == Impl::kSpecial) continue;
    bytes += impl_->decoded[static_cast<size_t>(id)];
  }
  return utf8_lossy(bytes);
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const { return impl_->token_id(token); }

bool Tokenizer::has_eos() const { return impl_->eos.has_value(); }

int32_t Tokenizer::eos_id() const {
  MT_CHECK(impl_->eos.has_value()) << impl_->eos_problem;
  return *impl_->eos;
}

}  // namespace mt::data
