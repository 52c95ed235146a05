// src/data: the tokenizer against Hugging Face fixtures, the corpus builder, the
// memory-mapped dataset.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "core/check.h"
#include "data/corpus.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "io/file.h"
#include "io/npy.h"
#include "test_util.h"

namespace mt::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::error_of;

const fs::path kRoot = MOETRAIN_SOURCE_DIR;
const fs::path kFixtures = kRoot / "tests" / "fixtures" / "tokenizers";
const std::string kQwen = (kRoot / "data" / "tokenizer.json").string();

json read_json(const fs::path& p) {
  std::vector<uint8_t> b = io::read_file(p.string());
  return json::parse(b.begin(), b.end());
}

void write_text(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

// A fresh folder per test, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("moetrain-test-data-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};


// ---- tokenizer ---------------------------------------------------------------------

// Every fixture: ids from Hugging Face tokenizers' encode, and both decodings.
TEST(Tokenizer, MatchesHuggingFaceFixtures) {
  int files = 0;
  for (const auto& e : fs::directory_iterator(kFixtures)) {
    if (!e.path().string().ends_with(".cases.json")) continue;
    ++files;
    json fx = read_json(e.path());
    Tokenizer tok((kFixtures.parent_path() / fx["tokenizer"].get<std::string>()).string());
    for (const json& c : fx["cases"]) {
      SCOPED_TRACE(e.path().filename().string() + " / " + c["name"].get<std::string>());
      std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
      std::vector<int32_t> got = tok.encode(c["text"].get<std::string>());
      EXPECT_EQ(got, want);
      EXPECT_EQ(tok.decode(want), c["decoded"].get<std::string>());
      EXPECT_EQ(tok.decode(want, true), c["decoded_skip_special"].get<std::string>());
    }
  }
  EXPECT_GE(files, 3);
}

// decode(encode(s)) == s for NFC text: random strings over characters from several
// scripts, spaces and punctuation (none that NFC would change).
TEST(Tokenizer, RoundTripsRandomText) {
  Tokenizer tok(kQwen);
  const std::vector<std::string> pool = {"a",   "Z",    "e",  " ",   "  ",
                                         "\n",  "\r\n", "\t", "'s",  "'LL",
                                         "7",   "42",   ".",  "!?",  "é",
                                         "Å",   "ß",    "中", "文",  "の",
                                         "カ",  "한",   "国", "👍",   "👨‍👩‍👧",
                                         "Ｆ",  "١",    "ж",  "λ",   "\xf0\x9d\x94\x98",
                                         "the", " God", "—",  "\x01"};
  std::mt19937 rng(1234);
  for (int i = 0; i < 300; ++i) {
    std::string s;
    int n = static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) s += pool[rng() % pool.size()];
    std::vector<int32_t> ids = tok.encode(s);
    ASSERT_EQ(tok.decode(ids), s) << "text " << json(s).dump();
  }
}

TEST(Tokenizer, VocabularyAndEndOfDocument) {
  Tokenizer tok(kQwen);
  EXPECT_EQ(tok.vocab_size(), 4096);
  EXPECT_EQ(tok.token_id("<|endoftext|>"), 0);
  EXPECT_EQ(tok.token_id("<|im_end|>"), 2);
  EXPECT_EQ(tok.token_id("Ġthe"), tok.encode(" the").at(0));
  EXPECT_FALSE(tok.token_id("no such token").has_value());
  EXPECT_EQ(tok.eos_id(), 0);  // no tokenizer_config.json beside it: <|endoftext|>

  TempDir t;
  fs::copy_file(kQwen, t.path / "tokenizer.json");
  write_text(t.path / "tokenizer_config.json", R"({"eos_token": {"content": "<|im_end|>", "special": true}})");
  EXPECT_EQ(Tokenizer((t.path / "tokenizer.json").string()).eos_id(), 2);
  write_text(t.path / "tokenizer_config.json", R"({"eos_token": "</s>"})");
  Tokenizer none((t.path / "tokenizer.json").string());
  std::string err = error_of([&] { none.eos_id(); });
  EXPECT_NE(err.find("eos_token \"</s>\" is not a token"), std::string::npos) << err;
}

TEST(Tokenizer, InvalidUtf8IsAnError) {
  Tokenizer tok(kQwen);
  std::string err = error_of([&] { tok.encode("abc\xc3("); });
  EXPECT_NE(err.find("not valid UTF-8 at byte 3"), std::string::npos) << err;
  err = error_of([&] { tok.decode(std::vector<int32_t>{4096}); });
  EXPECT_NE(err.find("id 4096 is not a token"), std::string::npos) << err;
}

// A long run of one character class: Qwen's pattern backtracks once per character of
// a run of spaces (\s*[\r\n]+ scans it to its end), and 10 MB of them passed PCRE2's
// match limit. Hugging Face's result follows from the pattern: N spaces and a letter
// are N-1 spaces (\s+(?!\S)) and " a", and the demo vocabulary merges no spaces, so
// the ids are N-1 times that of " " (223), then that of " a" (262). HF gives exactly
// that for N = 10^6; at 10^7 its own regex engine gives up (retry-limit-in-match).
// Runs of letters, digits or punctuation, and GPT-2's pattern, backtrack at most once.
TEST(Tokenizer, LongRunOfSpacesIsCutAsHuggingFaceCutsIt) {
  Tokenizer tok(kQwen);
  const size_t n = 10'000'000;
  std::vector<int32_t> want(n - 1, 223);
  want.push_back(262);
  EXPECT_EQ(tok.encode(std::string(n, ' ') + "a"), want);
}

// The gpt2_style fixture after `edit`, written to dir/tokenizer.json and loaded.
Tokenizer edited_gpt2(const fs::path& dir, const std::function<void(json&)>& edit) {
  json j = read_json(kFixtures / "gpt2_style.json");
  edit(j);
  write_text(dir / "tokenizer.json", j.dump());
  return Tokenizer((dir / "tokenizer.json").string());
}

// Any other regex failure (here a pattern that backtracks exponentially) is an error
// naming the pattern, PCRE2's message and the offset.
TEST(Tokenizer, RegexFailureIsNamed) {
  TempDir t;
  Tokenizer tok = edited_gpt2(t.path, [](json& j) {
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", "(x+x+)+y"}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  });
  std::string err = error_of([&] { tok.encode(std::string(30, 'x') + " y"); });
  for (const char* want : {"pre_tokenizer.pretokenizers[0].pattern.Regex", "match limit exceeded", "from byte 0"})
    EXPECT_NE(err.find(want), std::string::npos) << err;
}

// An added token with empty content: Hugging Face skips it (no id, it matches
// nothing); here it matched at every NUL byte and never moved on.
TEST(Tokenizer, EmptyAddedTokenIsSkipped) {
  TempDir t;
  Tokenizer tok = edited_gpt2(t.path, [](json& j) {
    j["added_tokens"].push_back({{"id", 1509}, {"content", ""}, {"special", true}, {"normalized", false}});
  });
  EXPECT_EQ(tok.encode(std::string("a\0b", 3)), (std::vector<int32_t>{66, 190, 67}));  // HF's ids
  EXPECT_FALSE(tok.token_id("").has_value());
  EXPECT_EQ(tok.vocab_size(), 1502);
}

// Anything the tokenizer does not implement is an error naming it and the key.
TEST(Tokenizer, UnsupportedPartsAreNamed) {
  json base = read_json(kFixtures / "gpt2_style.json");
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    std::vector<std::string> expect;
  };
  std::vector<Case> cases = {
      {"model", [](json& j) { j["model"]["type"] = "WordPiece"; }, {"model.type", "WordPiece"}},
      {"normalizer",
       [](json& j) {
         j["normalizer"] = {{"type", "Lowercase"}};
       },
       {"normalizer", "Lowercase"}},
      {"normalizer seq",
       [](json& j) {
         j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "NFKC"}}}}};
       },
       {"normalizer.normalizers[1]", "NFKC"}},
      {"pre_tokenizer",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}};
       },
       {"pre_tokenizer", "Metaspace"}},
      {"split behavior",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Sequence"},
             {"pretokenizers",
              {{{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"}, {"invert", false}},
               {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
       },
       {"pretokenizers[0].behavior", "Removed"}},
      {"prefix space", [](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; }, {"add_prefix_space"}},
      {"bad regex",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Sequence"},
             {"pretokenizers",
              {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}, {"invert", false}},
               {{"type", "ByteLevel"}}}}};
       },
       {"pattern.Regex", "(unclosed", "PCRE2"}},
      {"post_processor",
       [](json& j) {
         j["post_processor"] = {{"type", "TemplateProcessing"}};
       },
       {"post_processor", "TemplateProcessing"}},
      {"decoder",
       [](json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       },
       {"decoder", "WordPiece"}},
      {"lstrip", [](json& j) { j["added_tokens"][0]["lstrip"] = true; }, {"added_tokens[0].lstrip", "<|endoftext|>"}},
      {"truncation",
       [](json& j) {
         j["truncation"] = {{"max_length", 8}};
       },
       {"truncation"}},
      {"byte fallback", [](json& j) { j["model"]["byte_fallback"] = true; }, {"model.byte_fallback"}},
      {"merge token",
       [](json& j) { j["model"]["merges"][5] = "Ġ zzzq"; },
       {"model.merges[5]", "zzzq is not in model.vocab"}},
      {"merge format", [](json& j) { j["model"]["merges"][0] = "a b c"; }, {"model.merges[0]", "two tokens"}},
      {"byte missing", [](json& j) { j["model"]["vocab"].erase("Ġ"); }, {"no token for byte 0x20"}},
      // Ids that overflowed id + 1, or made the id tables gigabytes long.
      {"vocab id 2^31-1", [](json& j) { j["model"]["vocab"]["zzq"] = 2147483647; }, {"model.vocab", "[0, 2^24)"}},
      {"added id 2^31-1", [](json& j) { j["added_tokens"][0]["id"] = 2147483647; }, {"added_tokens[0]", "[0, 2^24)"}},
      {"sparse id", [](json& j) { j["added_tokens"][0]["id"] = 5000000; }, {"token id 5000000", "far beyond"}},
      // A field of the wrong type names its key (it surfaced as nlohmann's bare type_error).
      {"wrong type", [](json& j) { j["decoder"] = {{"type", 5}}; }, {"key /decoder/type has the wrong JSON type",
                                                                    "type must be string"}},
      {"wrong type deep",
       [](json& j) {
         j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", false}}}}};
       },
       {"key /normalizer/normalizers/1/type has the wrong JSON type"}},
      {"wrong type model", [](json& j) { j["model"]["type"] = 1; }, {"key /model/type has the wrong JSON type"}},
  };
  TempDir t;
  for (const Case& c : cases) {
    json j = base;
    c.edit(j);
    fs::path p = t.path / "tokenizer.json";
    write_text(p, j.dump());
    std::string err = error_of([&] { Tokenizer tok(p.string()); });
    EXPECT_NE(err.find(p.string()), std::string::npos) << c.what << ": " << err;
    for (const std::string& want : c.expect) EXPECT_NE(err.find(want), std::string::npos) << c.what << ": " << err;
  }
}

// ---- corpus ------------------------------------------------------------------------

struct BinFile {
  io::NpyHeader tokens_h, ends_h;
  std::vector<int64_t> tokens;
  std::vector<uint64_t> ends;
};

// Reads a .bin with io/npy's parser: two arrays back to back.
BinFile read_bin(const fs::path& p) {
  std::vector<uint8_t> b = io::read_file(p.string());
  BinFile f;
  f.tokens_h = io::parse_npy_header(b.data(), b.size(), p.string());
  io::NpyArray t{f.tokens_h, std::vector<uint8_t>(b.begin() + static_cast<std::ptrdiff_t>(f.tokens_h.header_bytes),
                                                  b.begin() + static_cast<std::ptrdiff_t>(f.tokens_h.header_bytes +
                                                                                          f.tokens_h.data_bytes()))};
  f.tokens = io::npy_as_int64(t, p.string());
  size_t off = f.tokens_h.header_bytes + f.tokens_h.data_bytes();
  f.ends_h = io::parse_npy_header(b.data() + off, b.size() - off, p.string());
  f.ends.resize(static_cast<size_t>(f.ends_h.numel()));
  std::memcpy(f.ends.data(), b.data() + off + f.ends_h.header_bytes, f.ends.size() * 8);
  EXPECT_EQ(off + f.ends_h.header_bytes + f.ends_h.data_bytes(), b.size()) << "trailing bytes in " << p;
  return f;
}

TEST(Corpus, TokenTypeIsTheSmallestThatFits) {
  TempDir t;
  std::vector<int32_t> tokens = {0, 5, 255, 7};
  std::vector<uint64_t> ends = {1, 4};
  for (auto [vocab, descr] :
       {std::pair<int64_t, const char*>{256, "|u1"}, {257, "<u2"}, {65536, "<u2"}, {65537, "<u4"}}) {
    fs::path p = t.path / ("v" + std::to_string(vocab) + ".bin");
    write_token_file(p.string(), tokens, ends, vocab);
    BinFile f = read_bin(p);
    EXPECT_EQ(f.tokens_h.descr, descr) << vocab;
    EXPECT_EQ(f.tokens, std::vector<int64_t>({0, 5, 255, 7}));
    EXPECT_EQ(f.ends_h.descr, "<u8");
    EXPECT_EQ(f.ends, ends);
  }
  std::string err = error_of([&] { write_token_file((t.path / "x.bin").string(), tokens, ends, 100); });
  EXPECT_NE(err.find("token 255 at 2 is outside [0, 100)"), std::string::npos) << err;
}

std::string zstd_compress(const std::string& s) {
  std::string out(ZSTD_compressBound(s.size()), '\0');
  size_t n = ZSTD_compress(out.data(), out.size(), s.data(), s.size(), 3);
  out.resize(n);
  return out;
}

// Documents of one fixture as JSONL; the expected tokens are Hugging Face's ids plus
// the end-of-document token.
struct Docs {
  std::string jsonl;
  std::vector<int64_t> tokens;
  std::vector<uint64_t> ends;
};
Docs fixture_docs(size_t first, size_t count) {
  json fx = read_json(kFixtures / "qwen_kjv.cases.json");
  Docs d;
  for (size_t i = first; i < first + count; ++i) {
    const json& c = fx["cases"][i % fx["cases"].size()];
    d.jsonl += json{{"id", i}, {"text", c["text"]}}.dump() + "\n";
    for (int64_t id : c["ids"]) d.tokens.push_back(id);
    d.tokens.push_back(0);
    d.ends.push_back(d.tokens.size());
  }
  return d;
}

TEST(Corpus, TokenizesPlainAndZstdFilesAndFolders) {
  TempDir t;
  Docs a = fixture_docs(0, 29), b = fixture_docs(5, 40), c = fixture_docs(11, 3);
  write_text(t.path / "in" / "a.jsonl", a.jsonl);
  write_text(t.path / "in" / "sub" / "b.jsonl.zst", zstd_compress(b.jsonl));
  // Two zstd frames back to back, and no newline after the last line.
  std::string half1 = c.jsonl.substr(0, c.jsonl.find('\n') + 1), half2 = c.jsonl.substr(half1.size());
  half2.pop_back();
  write_text(t.path / "c.jsonl.zst", zstd_compress(half1) + zstd_compress(half2));
  write_text(t.path / "in" / "notes.txt", "not an input");

  TokenizeOptions o{kQwen, {(t.path / "in").string(), (t.path / "c.jsonl.zst").string()}, (t.path / "out").string(), 2};
  TokenizeReport r = tokenize_corpus(o);
  EXPECT_EQ(r.files, 3);
  EXPECT_EQ(r.files_skipped, 0);
  EXPECT_EQ(r.documents, 72);
  EXPECT_EQ(r.malformed, 0);
  for (auto [name, docs] : {std::pair<const char*, Docs*>{"a.bin", &a}, {"sub/b.bin", &b}, {"c.bin", &c}}) {
    BinFile f = read_bin(t.path / "out" / name);
    EXPECT_EQ(f.tokens_h.descr, "<u2") << name;
    EXPECT_EQ(f.tokens, docs->tokens) << name;
    EXPECT_EQ(f.ends, docs->ends) << name;
  }
  EXPECT_EQ(r.tokens, static_cast<int64_t>(a.tokens.size() + b.tokens.size() + c.tokens.size()));
}

TEST(Corpus, MalformedLinesAreSkippedOrFatalWithStrict) {
  TempDir t;
  std::string text =
      "{\"text\": \"one\"}\n"
      "{\"text\": \"two\"\n"     // line 2: truncated JSON
      "\n"                       // blank: no document, not malformed
      "{\"body\": \"three\"}\n"  // line 4: no text field
      "{\"text\": 4}\n"          // line 5: not a string
      "[\"text\"]\n"             // line 6: not an object
      "{\"text\": \"\"}\n";      // an empty document: just the end token
  write_text(t.path / "m.jsonl", text);
  TokenizeOptions o{kQwen, {(t.path / "m.jsonl").string()}, (t.path / "out").string(), 1};
  TokenizeReport r = tokenize_corpus(o);
  EXPECT_EQ(r.documents, 2);
  EXPECT_EQ(r.malformed, 4);
  BinFile f = read_bin(t.path / "out" / "m.bin");
  Tokenizer tok(kQwen);
  std::vector<int64_t> want;
  for (int32_t id : tok.encode("one")) want.push_back(id);
  want.push_back(0);
  want.push_back(0);
  EXPECT_EQ(f.tokens, want);
  EXPECT_EQ(f.ends, std::vector<uint64_t>({want.size() - 1, want.size()}));

  o.output = (t.path / "strict").string();
  o.strict = true;
  std::string err = error_of([&] { tokenize_corpus(o); });
  EXPECT_NE(err.find((t.path / "m.jsonl").string() + ":2: not valid JSON"), std::string::npos) << err;
  EXPECT_NE(err.find("--strict"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(t.path / "strict" / "m.bin.lock"));  // unfinished, so a rerun redoes it
  EXPECT_FALSE(fs::exists(t.path / "strict" / "m.bin"));

  o.field = "body";
  o.strict = false;
  o.output = (t.path / "body").string();
  r = tokenize_corpus(o);
  EXPECT_EQ(r.documents, 1);
  EXPECT_EQ(r.malformed, 5);
}

TEST(Corpus, RerunRedoesOnlyLockedOrMissingFiles) {
  TempDir t;
  for (int i = 0; i < 3; ++i)
    write_text(t.path / "in" / ("f" + std::to_string(i) + ".jsonl"), fixture_docs(i, 5).jsonl);
  TokenizeOptions o{kQwen, {(t.path / "in").string()}, (t.path / "out").string(), 2};
  tokenize_corpus(o);
  fs::path out = t.path / "out";
  // f0: finished, but marked in flight, as after a kill; f1: finished; f2: missing.
  write_text(out / "f0.bin", "garbage from an interrupted write");
  write_text(out / "f0.bin.lock", "");
  write_text(out / "f1.bin", "left alone");
  fs::remove(out / "f2.bin");
  TokenizeReport r = tokenize_corpus(o);
  EXPECT_EQ(r.files, 3);
  EXPECT_EQ(r.files_skipped, 1);
  EXPECT_EQ(r.documents, 10);
  EXPECT_FALSE(fs::exists(out / "f0.bin.lock"));
  EXPECT_EQ(read_bin(out / "f0.bin").ends.size(), 5u);
  EXPECT_EQ(io::read_file((out / "f1.bin").string()),
            std::vector<uint8_t>({'l', 'e', 'f', 't', ' ', 'a', 'l', 'o', 'n', 'e'}));
  EXPECT_EQ(read_bin(out / "f2.bin").ends.size(), 5u);
  r = tokenize_corpus(o);
  EXPECT_EQ(r.files_skipped, 3);
}

TEST(Corpus, BadInputsAreNamed) {
  TempDir t;
  write_text(t.path / "x" / "a.jsonl", "{}\n");
  write_text(t.path / "y" / "a.jsonl", "{}\n");
  write_text(t.path / "z.json", "{}\n");
  auto run = [&](std::vector<std::string> in) {
    return error_of([&] { tokenize_corpus({kQwen, in, (t.path / "out").string(), 1}); });
  };
  std::string err = run({(t.path / "x" / "a.jsonl").string(), (t.path / "y" / "a.jsonl").string()});
  EXPECT_NE(err.find("would both be written to"), std::string::npos) << err;
  err = run({(t.path / "z.json").string()});
  EXPECT_NE(err.find("is not a .jsonl or .jsonl.zst file"), std::string::npos) << err;
  err = run({(t.path / "nowhere").string()});
  EXPECT_NE(err.find("does not exist"), std::string::npos) << err;
}

// A bad file is skipped, left without .bin, .tmp and .lock (so a rerun tries it
// again), and the other files are done; with strict it stops the run.
TEST(Corpus, BadFilesAreSkippedOrFatalWithStrict) {
  TempDir t;
  Docs good = fixture_docs(0, 29);
  fs::path in = t.path / "in", out = t.path / "out";
  write_text(in / "good.jsonl", good.jsonl);
  std::string whole = zstd_compress(good.jsonl);
  write_text(in / "truncated.jsonl.zst", whole.substr(0, whole.size() / 2));
  std::string corrupt = whole.substr(0, 4);  // zstd's magic number, then noise
  std::mt19937 rng(7);
  for (int i = 0; i < 1000; ++i) corrupt += static_cast<char>(rng());
  write_text(in / "corrupt.jsonl.zst", corrupt);
  // As a killed run leaves it: the .bin of a file in flight must go with the lock.
  for (const char* ext : {".bin", ".bin.tmp", ".bin.lock"}) write_text(out / (std::string("corrupt") + ext), "x");

  TokenizeOptions o{kQwen, {in.string()}, out.string(), 2};
  TokenizeReport r = tokenize_corpus(o);
  EXPECT_EQ(r.bad_files,
            (std::vector<std::string>{(in / "corrupt.jsonl.zst").string(), (in / "truncated.jsonl.zst").string()}));
  EXPECT_EQ(r.documents, 29);
  BinFile f = read_bin(out / "good.bin");
  EXPECT_EQ(f.tokens, good.tokens);
  EXPECT_EQ(f.ends, good.ends);
  for (const char* name : {"corrupt", "truncated"})
    for (const char* ext : {".bin", ".bin.tmp", ".bin.lock"})
      EXPECT_FALSE(fs::exists(out / (std::string(name) + ext))) << name << ext;

  o.strict = true;
  for (auto [name, want] : {std::pair<const char*, const char*>{"truncated", "truncated.jsonl.zst: truncated zstd"},
                            {"corrupt", "corrupt.jsonl.zst: zstd: "}}) {
    o.inputs = {(in / (std::string(name) + ".jsonl.zst")).string()};
    std::string err = error_of([&] { tokenize_corpus(o); });
    EXPECT_NE(err.find(want), std::string::npos) << err;
    EXPECT_TRUE(fs::exists(out / (std::string(name) + ".bin.lock")));  // unfinished, as a strict run leaves it
  }
}

// ---- dataset -----------------------------------------------------------------------

// Token t of file f is (1000 * f + t) % 60000, so every value says where it came from.
int32_t token_at(int f, int64_t t) { return static_cast<int32_t>((1000 * f + t) % 60000); }

// Files of 1000, 257 and 64 tokens (one document each).
fs::path make_corpus(const fs::path& dir) {
  const int64_t sizes[] = {1000, 257, 64};
  for (int f = 0; f < 3; ++f) {
    std::vector<int32_t> tokens(static_cast<size_t>(sizes[f]));
    for (int64_t t = 0; t < sizes[f]; ++t) tokens[static_cast<size_t>(t)] = token_at(f, t);
    std::vector<uint64_t> ends = {static_cast<uint64_t>(sizes[f])};
    fs::create_directories(dir / "sub");
    write_token_file((dir / (f == 1 ? "sub/b.bin" : f == 0 ? "a.bin" : "c.bin")).string(), tokens, ends, 60000);
  }
  return dir;
}

TEST(Dataset, WindowsAndLabels) {
  TempDir t;
  Dataset ds(make_corpus(t.path).string(), 15, 7);  // windows of 16 tokens
  // a.bin: 62 windows; c.bin: 4; sub/b.bin: 16 (the tails are dropped). Sorted paths: a, c, sub/b.
  EXPECT_EQ(ds.num_samples(), 62 + 4 + 16);
  EXPECT_EQ(ds.num_tokens(), 1000 + 257 + 64);
  std::vector<int32_t> s(16);
  ds.read_sample(0, 0, 16, s.data());
  EXPECT_EQ(s[0], token_at(0, 0));
  EXPECT_EQ(s[15], token_at(0, 15));
  ds.read_sample(61, 0, 16, s.data());
  EXPECT_EQ(s[0], token_at(0, 61 * 16));
  ds.read_sample(62, 0, 16, s.data());  // first of c.bin
  EXPECT_EQ(s[0], token_at(2, 0));
  ds.read_sample(66 + 15, 0, 16, s.data());  // last of sub/b.bin
  EXPECT_EQ(s[15], token_at(1, 15 * 16 + 15));

  std::vector<int32_t> ids(2 * 15), labels(2 * 15);
  ds.next_batch(0, 1, 0, 1, 2, ids, labels);
  for (int b = 0; b < 2; ++b) {
    ds.read_sample(ds.sample_at(static_cast<uint64_t>(b)), 0, 16, s.data());
    for (int k = 0; k < 15; ++k) {
      EXPECT_EQ(ids[static_cast<size_t>(b * 15 + k)], s[static_cast<size_t>(k)]);
      EXPECT_EQ(labels[static_cast<size_t>(b * 15 + k)], s[static_cast<size_t>(k + 1)]);
    }
  }
  EXPECT_EQ(ds.cursor().samples_seen, 2u);
}

// validation.split: each file is cut at the first document end at or after (1 - f) of
// its tokens. Documents of 100 tokens in a file of 1000, f = 0.25: the cut is at 800
// (750 is inside the 8th document); training reads [0, 800), the held-out set [800,
// 1000). A file of one document has no end inside it: all of it trains.
TEST(Dataset, SplitHoldsOutWholeDocumentsAtTheEndOfEachFile) {
  TempDir t;
  std::vector<int32_t> tokens(1000);
  for (int64_t i = 0; i < 1000; ++i) tokens[static_cast<size_t>(i)] = token_at(0, i);
  std::vector<uint64_t> ends;
  for (uint64_t e = 100; e <= 1000; e += 100) ends.push_back(e);
  write_token_file((t.path / "a.bin").string(), tokens, ends, 60000);
  std::vector<int32_t> one(160);
  for (int64_t i = 0; i < 160; ++i) one[static_cast<size_t>(i)] = token_at(1, i);
  write_token_file((t.path / "b.bin").string(), one, std::vector<uint64_t>{160}, 60000);

  Dataset train(t.path.string(), 15, 7, Split{0.25, false}), held(t.path.string(), 15, 7, Split{0.25, true});
  EXPECT_EQ(train.num_tokens(), 800 + 160);
  EXPECT_EQ(held.num_tokens(), 200);
  EXPECT_EQ(train.num_samples(), 800 / 16 + 160 / 16);
  EXPECT_EQ(held.num_samples(), 200 / 16);
  std::vector<int32_t> s(16);
  std::set<int32_t> seen;
  for (int64_t i = 0; i < train.num_samples(); ++i) {
    train.read_sample(i, 0, 16, s.data());
    seen.insert(s.begin(), s.end());
  }
  for (int64_t i = 0; i < held.num_samples(); ++i) {
    held.read_sample(i, 0, 16, s.data());
    for (int32_t v : s) {
      EXPECT_GE(v, token_at(0, 800)) << "held-out sample " << i << " holds a training token";
      EXPECT_LT(v, token_at(0, 1000));
      EXPECT_FALSE(seen.contains(v));
    }
  }
  held.read_sample(0, 0, 16, s.data());
  EXPECT_EQ(s[0], token_at(0, 800));
  // Too little held out for one sample is named.
  const std::string err = error_of([&] { Dataset d(t.path.string(), 300, 7, Split{0.25, true}); });
  EXPECT_NE(err.find("held-out part of validation.split"), std::string::npos) << err;
}

// data.mixture: corpora a (token_at(0, .), 640 tokens) and b (token_at(1, .), 320), weights
// 0.25 and 0.75. Over 400 global batches of 8 (a's 40 samples are seen 20 times, b's 20
// 120 times) each corpus's share is its weight within one sample at every batch; every
// sample is one of its corpus's windows; a 2-rank split reads the same global batches;
// and a cursor saved halfway continues with the same sequences.
TEST(Dataset, MixtureDrawsInProportionAndResumes) {
  TempDir t;
  for (int f = 0; f < 2; ++f) {
    std::vector<int32_t> tokens(static_cast<size_t>(f == 0 ? 640 : 320));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = token_at(f, static_cast<int64_t>(i));
    fs::create_directories(t.path / (f == 0 ? "a" : "b"));
    write_token_file((t.path / (f == 0 ? "a/x.bin" : "b/x.bin")).string(), tokens,
                     std::vector<uint64_t>{tokens.size()}, 60000);
  }
  const std::vector<Source> sources = {{(t.path / "a").string(), 0.25}, {(t.path / "b").string(), 0.75}};
  Dataset one(sources, 15, 3), two(sources, 15, 3);
  std::vector<int32_t> ids(8 * 15), labels(ids.size()), half(4 * 15), half_labels(half.size());
  std::vector<std::vector<int32_t>> batches;
  int64_t from_a = 0, seen = 0;
  for (int step = 0; step < 400; ++step) {
    one.next_batch(0, 1, 0, 1, 8, ids, labels);
    batches.push_back(ids);
    for (int64_t b = 0; b < 8; ++b) {
      const int32_t first = ids[static_cast<size_t>(b * 15)];
      const bool a = first < 1000;
      from_a += a;
      ++seen;
      EXPECT_EQ(first % 1000 % 16, 0) << "a sample starts a window";
      EXPECT_LT(first % 1000, a ? 640 : 320);
    }
    EXPECT_LE(std::fabs(static_cast<double>(from_a) - 0.25 * static_cast<double>(seen)), 1.0) << "batch " << step;
    // Two data ranks: rank d has rows [4d, 4d + 4) of the same global batch.
    for (int d = 0; d < 2; ++d) {
      const DataCursor before = two.cursor();
      two.next_batch(d, 2, 0, 1, 4, half, half_labels);
      EXPECT_TRUE(std::equal(half.begin(), half.end(), ids.begin() + d * 4 * 15)) << "batch " << step << " rank " << d;
      if (d == 0) two.set_cursor(before);
    }
  }
  EXPECT_EQ(one.shares(), (std::vector<double>{0.25, 0.75}));
  Dataset resumed(sources, 15, 3), fresh(sources, 15, 3);
  for (int step = 0; step < 200; ++step) fresh.next_batch(0, 1, 0, 1, 8, ids, labels);
  resumed.set_cursor(fresh.cursor());
  for (int step = 200; step < 400; ++step) {
    resumed.next_batch(0, 1, 0, 1, 8, ids, labels);
    EXPECT_EQ(ids, batches[static_cast<size_t>(step)]) << "batch " << step;
  }
  const std::string err = error_of([&] { one.set_cursor({5, {}}); });
  EXPECT_NE(err.find("holds draws from 0 corpora"), std::string::npos) << err;
}

TEST(Dataset, ShuffleIsAPermutationFixedBySeedAndEpoch) {
  TempDir t;
  fs::path dir = make_corpus(t.path);
  Dataset ds(dir.string(), 15, 7), same(dir.string(), 15, 7), other(dir.string(), 15, 8);
  uint64_t n = static_cast<uint64_t>(ds.num_samples());
  std::vector<int64_t> e0, e1, o0;
  for (uint64_t p = 0; p < n; ++p) {
    e0.push_back(ds.sample_at(p));
    e1.push_back(ds.sample_at(n + p));
    o0.push_back(other.sample_at(p));
    EXPECT_EQ(same.sample_at(p), e0.back());
  }
  for (auto* order : {&e0, &e1, &o0}) {
    std::vector<int64_t> sorted = *order;
    std::sort(sorted.begin(), sorted.end());
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], static_cast<int64_t>(i));
  }
  EXPECT_NE(e0, e1);  // a new epoch, a new order
  EXPECT_NE(e0, o0);  // a new seed, a new order
  int fixed = 0;
  for (uint64_t i = 0; i < n; ++i) fixed += e0[i] == static_cast<int64_t>(i);
  EXPECT_LT(fixed, 10);  // shuffled, not the identity
}

// The samples of each global batch are the same, in the same order, however the
// batch is split over dp ranks and micro-batches.
TEST(Dataset, GlobalBatchesIndependentOfRankCount) {
  TempDir t;
  fs::path dir = make_corpus(t.path);
  const int64_t global = 8, steps = 5, cols = 15;
  auto run = [&](int dp, int64_t micro) {
    std::vector<std::unique_ptr<Dataset>> ranks;
    for (int r = 0; r < dp; ++r) ranks.push_back(std::make_unique<Dataset>(dir.string(), 15, 3));
    std::vector<int32_t> all;
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t m = 0; m < global / (dp * micro); ++m) {
        std::vector<std::vector<int32_t>> per_rank;
        for (int r = 0; r < dp; ++r) {
          std::vector<int32_t> ids(static_cast<size_t>(micro * cols)), labels(ids.size());
          ranks[static_cast<size_t>(r)]->next_batch(r, dp, 0, 1, micro, ids, labels);
          per_rank.push_back(ids);
        }
        for (auto& ids : per_rank) all.insert(all.end(), ids.begin(), ids.end());
      }
    for (auto& r : ranks) EXPECT_EQ(r->cursor().samples_seen, static_cast<uint64_t>(global * steps));
    return all;
  };
  std::vector<int32_t> one = run(1, 8);
  EXPECT_EQ(one.size(), static_cast<size_t>(global * steps * cols));
  EXPECT_EQ(run(1, 2), one);
  EXPECT_EQ(run(2, 4), one);
  EXPECT_EQ(run(2, 1), one);
  EXPECT_EQ(run(4, 2), one);
  EXPECT_EQ(run(8, 1), one);
}

TEST(Dataset, ContextParallelChunksAreSlicesOfTheSample) {
  TempDir t;
  Dataset full(make_corpus(t.path).string(), 16, 5);  // 16 = 2 * cp * 4 for cp = 2; 2 * cp * 2 for cp = 4
  for (int cp : {2, 4}) {
    std::vector<std::vector<int32_t>> ids_r, labels_r, ahead_r;
    for (int r = 0; r < cp; ++r) {
      Dataset ds(t.path.string(), 16, 5);
      std::vector<int32_t> ids(static_cast<size_t>(3 * 16 / cp)), labels(ids.size()), ahead(3 * ids.size());
      ds.next_batch(0, 1, r, cp, 3, ids, labels, ahead);  // 3 planes ahead: multi-token prediction's
      ids_r.push_back(ids);
      labels_r.push_back(labels);
      ahead_r.push_back(ahead);
    }
    std::vector<int32_t> s(17);
    int64_t chunk = 16 / (2 * cp);
    for (int64_t b = 0; b < 3; ++b) {
      full.read_sample(full.sample_at(static_cast<uint64_t>(b)), 0, 17, s.data());
      std::vector<int> covered(16, 0);
      for (int r = 0; r < cp; ++r) {
        std::vector<int64_t> pos = full.positions(r, cp);
        ASSERT_EQ(pos.size(), static_cast<size_t>(16 / cp));
        EXPECT_EQ(pos[0], r * chunk);
        EXPECT_EQ(pos[static_cast<size_t>(chunk)], (2 * cp - 1 - r) * chunk);
        for (size_t k = 0; k < pos.size(); ++k) {
          size_t col = static_cast<size_t>(b) * pos.size() + k;
          EXPECT_EQ(ids_r[static_cast<size_t>(r)][col], s[static_cast<size_t>(pos[k])]) << "cp " << cp << " rank " << r;
          EXPECT_EQ(labels_r[static_cast<size_t>(r)][col], s[static_cast<size_t>(pos[k] + 1)]);
          // Plane j: the token j + 2 after, across the chunk's end, kPastTheEnd past the sample's.
          for (int64_t j = 0; j < 3; ++j) {
            const int64_t at = pos[k] + 2 + j;
            EXPECT_EQ(ahead_r[static_cast<size_t>(r)][static_cast<size_t>(j * 3) * pos.size() + col],
                      at <= 16 ? s[static_cast<size_t>(at)] : Dataset::kPastTheEnd)
                << "cp " << cp << " rank " << r << " plane " << j;
          }
          ++covered[static_cast<size_t>(pos[k])];
        }
      }
      EXPECT_EQ(covered, std::vector<int>(16, 1));  // the ranks together hold each position once
    }
    // The same planes from whole label rows (a token matrix's path), and depth k's tokens.
    for (int r = 0; r < cp; ++r) {
      std::vector<int32_t> whole(3 * 16), ahead(ahead_r[static_cast<size_t>(r)].size());
      for (int64_t b = 0; b < 3; ++b) {
        full.read_sample(full.sample_at(static_cast<uint64_t>(b)), 1, 17, whole.data() + b * 16);
      }
      labels_ahead(whole.data(), 3, 16, full.positions(r, cp), ahead);
      EXPECT_EQ(ahead, ahead_r[static_cast<size_t>(r)]) << "cp " << cp << " rank " << r;
      const std::vector<int32_t>& labels = labels_r[static_cast<size_t>(r)];
      std::vector<int32_t> mtp(2 * ahead.size());
      mtp_tokens(labels, ahead, mtp);
      const size_t n = labels.size();
      for (size_t i = 0; i < n; ++i)
        for (size_t k = 1; k <= 3; ++k) {
          const int32_t in = k == 1 ? labels[i] : ahead[(k - 2) * n + i];
          EXPECT_EQ(mtp[(k - 1) * n + i], in == Dataset::kPastTheEnd ? 0 : in);
          EXPECT_EQ(mtp[(3 + k - 1) * n + i], ahead[(k - 1) * n + i]);
        }
    }
  }
  Dataset ds(t.path.string(), 15, 5);
  std::vector<int32_t> ids(15), labels(15);
  std::string err = error_of([&] { ds.next_batch(0, 1, 0, 2, 1, ids, labels); });
  EXPECT_NE(err.find("seq_len 15 must be a multiple of 2 * cp = 4"), std::string::npos) << err;
}

TEST(Dataset, ResumeContinuesWithTheNextSample) {
  TempDir t;
  fs::path dir = make_corpus(t.path);
  Dataset a(dir.string(), 15, 11);
  std::vector<int32_t> ids(4 * 15), labels(ids.size());
  std::vector<std::vector<int32_t>> batches;
  DataCursor saved;
  for (int i = 0; i < 30; ++i) {  // 30 * 4 = 120 samples: into the second epoch
    if (i == 17) saved = a.cursor();
    a.next_batch(0, 1, 0, 1, 4, ids, labels);
    batches.push_back(ids);
  }
  EXPECT_EQ(saved.samples_seen, 68u);
  Dataset b(dir.string(), 15, 11);
  b.set_cursor(saved);
  for (int i = 17; i < 30; ++i) {
    b.next_batch(0, 1, 0, 1, 4, ids, labels);
    EXPECT_EQ(ids, batches[static_cast<size_t>(i)]) << "batch " << i;
  }
}

TEST(Dataset, ErrorsNameTheFile) {
  TempDir t;
  fs::path dir = make_corpus(t.path);
  std::string err = error_of([&] { Dataset ds(dir.string(), 1000, 1); });
  EXPECT_NE(err.find("no file holds a whole sample of seq_len + 1 = 1001 tokens"), std::string::npos) << err;
  write_text(dir / "c.bin.lock", "");
  err = error_of([&] { Dataset ds(dir.string(), 15, 1); });
  EXPECT_NE(err.find("c.bin is unfinished"), std::string::npos) << err;
  fs::remove(dir / "c.bin.lock");
  write_text(dir / "d.bin", io::make_npy_header("<i4", {2}) + std::string(8, '\0'));
  err = error_of([&] { Dataset ds(dir.string(), 15, 1); });
  EXPECT_NE(err.find("d.bin: tokens array has dtype '<i4'"), std::string::npos) << err;
  err = error_of([&] { Dataset ds((t.path / "nothing").string(), 15, 1); });
  EXPECT_NE(err.find("is not a folder"), std::string::npos) << err;
}

}  // namespace
}  // namespace mt::data
