// src/io: safetensors files, Hugging Face model folders and .npy arrays.
//
// Values are checked against references computed here (ldexp for the float
// formats), against the committed fixtures and their generation log, and against
// numpy through tests/io_reference.py, an implementation independent of ours.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"
#include "core/dtype.h"
#include "io/file.h"
#include "io/npy.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace mt::io;
using mt::test::write_npy;

namespace {

const fs::path kFixtures = MOETRAIN_TEST_FIXTURES;

// A fresh folder per test: ctest runs the tests as parallel processes.
class Io : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("moetrain_test_io_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// The message of the mt::Error that f throws; a test failure if it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mt::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an mt::Error";
  return "";
}

// Every part must appear in the message of the error f throws.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  std::string msg = error_of(f);
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::vector<uint8_t> b = read_file(path);
  return std::string(b.begin(), b.end());
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A safetensors file written by hand: length, header text as given, data_bytes bytes.
void write_st_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  write_bytes(path, le64(header.size()) + header + std::string(data_bytes, '\x5a'));
}

// The reference values: sign * significand * 2^exponent, read off the bit fields.
double ref_f16(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return h & 0x8000 ? -v : v;
}

double ref_bf16(uint16_t h) {
  int e = (h >> 7) & 255, m = h & 127;
  double v = e == 255 ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
  return h & 0x8000 ? -v : v;
}

json read_json(const fs::path& p) {
  std::ifstream f(p);
  return json::parse(f);
}

// Runs tests/io_reference.py with numpy, by $MOETRAIN_TEST_PYTHON or else the python3
// CMake found; false (and a skip) if there is neither.
bool run_reference(const std::string& args) {
  const char* env = std::getenv("MOETRAIN_TEST_PYTHON");
  std::string python = env ? env : MOETRAIN_TEST_PYTHON;
  if (python.empty()) return false;
  std::string cmd = "'" + python + "' '" MOETRAIN_TEST_DIR "/io_reference.py' " + args;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return true;
}

#define REFERENCE_OR_SKIP(args) \
  if (!run_reference(args)) GTEST_SKIP() << "no python3 with numpy at configure time (scripts/setup.sh installs it)"

// ---------------------------------------------------------------- safetensors

TEST_F(Io, SafetensorsRoundTripKeepsDtypesShapesOrderAndBytes) {
  std::vector<float> f32 = {1.5f, -2.25f, 3e-38f, 7.0f, -0.0f, 1e30f};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc040, 0x0001, 0x7f7f};  // 1, -3, 2^-133, max finite
  std::vector<int64_t> i64 = {-1, 0, INT64_MAX, INT64_MIN, 42, 7};
  std::vector<uint8_t> u8 = {0, 1, 127, 128, 255};
  double f64 = -0.1;
  std::vector<int32_t> i32 = {-7, 1 << 30, 3};
  std::vector<uint16_t> f16 = {0x3c00, 0xc500, 0x0001, 0x7bff};  // 1, -5, 2^-24, 65504
  std::vector<StWrite> w = {
      st_f32("a.f32", {2, 3}, f32.data()),
      {"b.bf16", "BF16", {4}, bf16.data()},
      {"c.i64", "I64", {3, 1, 2}, i64.data()},
      {"d.u8", "U8", {5}, u8.data()},
      {"e.scalar", "F64", {}, &f64},
      {"f.empty", "F32", {0, 4}, nullptr},
      {"g.i32", "I32", {3}, i32.data()},
      {"h.f16", "F16", {2, 2}, f16.data()},
  };
  std::string p = path("x.safetensors");
  write_safetensors(p, w, {{"format", "pt"}, {"step", "12"}});

  // The layout: 8-byte length, header padded to 8 bytes, data contiguous.
  std::string raw = read_bytes(p);
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  size_t data_bytes = 24 + 8 + 48 + 5 + 8 + 0 + 12 + 8;
  EXPECT_EQ(raw.size(), 8 + header_len + data_bytes);

  SafetensorsFile f(p);
  EXPECT_EQ(f.path(), p);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  ASSERT_EQ(f.tensors().size(), w.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    const StTensor& t = f.tensors()[i];
    EXPECT_EQ(t.name, w[i].name);
    EXPECT_EQ(t.dtype, w[i].dtype);
    EXPECT_EQ(t.shape, w[i].shape);
    EXPECT_EQ(t.begin, offset);
    offset = t.end;
    std::span<const uint8_t> b = f.bytes(t);
    ASSERT_EQ(b.size(), t.end - t.begin);
    if (!b.empty()) {
      EXPECT_EQ(std::memcmp(b.data(), w[i].data, b.size()), 0) << t.name;
    }
    EXPECT_EQ(f.find(t.name), &t);
  }
  EXPECT_EQ(offset, data_bytes);
  EXPECT_EQ(f.find("absent"), nullptr);
  EXPECT_EQ(f.find("e.scalar")->numel(), 1);
  EXPECT_EQ(f.find("f.empty")->numel(), 0);

  std::vector<float> out(6);
  f.read_f32(*f.find("a.f32"), out.data());
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(mt::f32_bits(out[i]), mt::f32_bits(f32[i]));
  f.read_f32(*f.find("b.bf16"), out.data());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -3.0f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -133));
  EXPECT_EQ(out[3], std::ldexp(255.0f, 120));
  f.read_f32(*f.find("h.f16"), out.data());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -5.0f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(out[3], 65504.0f);
  f.read_f32(*f.find("e.scalar"), out.data());
  EXPECT_EQ(out[0], static_cast<float>(-0.1));
  f.read_f32(*f.find("f.empty"), nullptr);
}

TEST_F(Io, SafetensorsNumpyReadsWhatWeWrite) {
  std::vector<float> a = {0.1f, -2.5f, 1e-40f, 3.0f};
  std::vector<uint16_t> b = {0x3f80, 0xbf00, 0x0042};
  std::vector<int64_t> c = {INT64_MIN, -3, 9};
  std::string p = path("x.safetensors");
  write_safetensors(p,
                    {st_f32("w.a", {2, 2}, a.data()), {"w.b", "BF16", {3}, b.data()}, {"w.c", "I64", {3, 1}, c.data()}},
                    {{"format", "pt"}});
  REFERENCE_OR_SKIP("st-describe " + p + " " + path("d.json"));
  json d = read_json(path("d.json"));
  EXPECT_EQ(d["__metadata__"], json({{"format", "pt"}}));
  EXPECT_EQ(d["w.a"]["shape"], json({2, 2}));
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(d["w.a"]["values"][i].get<double>(), a[i]);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(d["w.b"]["values"][i].get<double>(), ref_bf16(b[i]));
  EXPECT_EQ(d["w.c"]["shape"], json({3, 1}));
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(d["w.c"]["values"][i].get<int64_t>(), c[i]);
}

// Every one of the 65536 bit patterns, through a file, against ldexp of its fields.
TEST_F(Io, Bf16AndF16ConvertExactlyForEveryBitPattern) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::string p = path("all.safetensors");
  write_safetensors(p, {{"bf16", "BF16", {256, 256}, all.data()}, {"f16", "F16", {65536}, all.data()}});
  SafetensorsFile f(p);
  std::vector<float> out(65536);
  for (const char* name : {"bf16", "f16"}) {
    f.read_f32(*f.find(name), out.data());
    int bad = 0;
    for (size_t i = 0; i < all.size() && bad < 10; ++i) {
      double ref = name[0] == 'b' ? ref_bf16(all[i]) : ref_f16(all[i]);
      bool ok = std::isnan(ref) ? std::isnan(out[i])
                                : static_cast<double>(out[i]) == ref && std::signbit(out[i]) == std::signbit(ref);
      if (!ok) ++bad;
      EXPECT_TRUE(ok) << name << " 0x" << std::hex << all[i] << ": got " << out[i] << ", expected " << ref;
    }
  }
  // A few values spelled out: f16 subnormal, largest subnormal, smallest normal, -inf.
  EXPECT_EQ(f32_from_f16(0x0001), 5.9604644775390625e-08f);
  EXPECT_EQ(f32_from_f16(0x03ff), 6.0975551605224609e-05f);
  EXPECT_EQ(f32_from_f16(0x0400), 6.103515625e-05f);
  EXPECT_EQ(f32_from_f16(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(f32_from_f16(0x7e00)));
}

TEST_F(Io, SafetensorsTensorsAreInDataOrderWhateverTheHeaderOrder) {
  // "z" comes first in the data section but last in the (sorted) header.
  write_st_raw(path("x.safetensors"),
               R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},)"
               R"("z":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})",
               6);
  SafetensorsFile f(path("x.safetensors"));
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "z");
  EXPECT_EQ(f.tensors()[1].name, "a");
  EXPECT_TRUE(f.metadata().empty());
}

TEST_F(Io, SafetensorsFileIsMovable) {
  std::vector<float> v = {4.0f, 5.0f};
  write_safetensors(path("x.safetensors"), {st_f32("v", {2}, v.data())});
  SafetensorsFile a(path("x.safetensors"));
  SafetensorsFile b(std::move(a));
  std::vector<float> out(2);
  b.read_f32(*b.find("v"), out.data());
  EXPECT_EQ(out, v);
  write_safetensors(path("y.safetensors"), {});
  SafetensorsFile c(path("y.safetensors"));
  EXPECT_TRUE(c.tensors().empty());
  c = std::move(b);
  c.read_f32(*c.find("v"), out.data());
  EXPECT_EQ(out, v);
}

TEST_F(Io, AtomicWriterLeavesNoTempFile) {
  std::vector<float> v = {1.0f};
  write_safetensors(path("x.safetensors"), {st_f32("v", {1}, v.data())});
  write_safetensors(path("x.safetensors"), {st_f32("v", {1}, v.data())});  // over an existing file
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"x.safetensors"});
}

// The sum a writer returns is XXH3-64 of the bytes written, pieces as one stream, and
// what file_sum finds on disk (the digests are xxhash's own for "abc" and "").
TEST_F(Io, WritersReturnTheChecksumOfWhatTheyWrote) {
  FileSum w = write_file_atomic(path("abc"), {"ab", "", "c"});
  EXPECT_EQ(w.bytes, 3u);
  EXPECT_EQ(w.xxh3, 0x78af5f94892f3950u);
  EXPECT_EQ(file_sum(path("abc")).xxh3, w.xxh3);
  EXPECT_EQ(write_file_atomic(path("empty"), {}).xxh3, 0x2d06800538d394c2u);
  EXPECT_EQ(file_sum(path("empty")).xxh3, 0x2d06800538d394c2u);
  std::vector<float> v = {1.0f, 2.0f};
  FileSum st = write_safetensors(path("x.safetensors"), {st_f32("v", {2}, v.data())});
  EXPECT_EQ(st.bytes, fs::file_size(path("x.safetensors")));
  EXPECT_EQ(st.xxh3, file_sum(path("x.safetensors")).xxh3);
}

// A fingerprint is the whole file's checksum up to 128 KiB; past that it sees the size and
// the first and last 64 KiB, and nothing between (what ranks compare at start).
TEST_F(Io, FingerprintsSeeTheSizeAndBothEnds) {
  std::string small(100000, 'a');
  write_file_atomic(path("small"), {small});
  EXPECT_EQ(file_fingerprint(path("small")).xxh3, file_sum(path("small")).xxh3);
  std::string big(1 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 2654435761u >> 24);
  auto print = [&](const std::string& bytes) {
    write_file_atomic(path("big"), {bytes});
    return file_fingerprint(path("big"));
  };
  const FileSum base = print(big);
  EXPECT_EQ(base.bytes, big.size());
  EXPECT_NE(base.xxh3, file_sum(path("big")).xxh3);
  for (size_t at : {size_t{0}, size_t{65535}, big.size() - 65536, big.size() - 1}) {
    std::string b = big;
    b[at] ^= 1;
    EXPECT_NE(print(b).xxh3, base.xxh3) << "byte " << at;
  }
  std::string middle = big;
  middle[65536] ^= 1;
  middle[big.size() / 2] ^= 1;
  EXPECT_EQ(print(middle).xxh3, base.xxh3);  // unseen, by design
  EXPECT_NE(print(big.substr(1)).xxh3, base.xxh3);
  EXPECT_EQ(print(big.substr(1)).bytes, big.size() - 1);
}

TEST_F(Io, WriterRejectsBadTensors) {
  std::vector<float> v = {1.0f, 2.0f};
  std::string p = path("x.safetensors");
  expect_error([&] { write_safetensors(p, {st_f32("v", {2}, v.data()), st_f32("v", {1}, v.data())}); },
               {p, "'v'", "written twice"});
  expect_error([&] { write_safetensors(p, {{"v", "F17", {2}, v.data()}}); }, {p, "'v'", "unknown dtype 'F17'"});
  expect_error([&] { write_safetensors(p, {st_f32("v", {-1}, v.data())}); }, {p, "'v'", "[-1]"});
  expect_error([&] { write_safetensors(p, {st_f32("__metadata__", {1}, v.data())}); }, {p, "reserved"});
  expect_error([&] { write_safetensors(path("no/such/dir/x.safetensors"), {}); }, {"no/such/dir/x.safetensors.tmp"});
  EXPECT_FALSE(fs::exists(p));
}

TEST_F(Io, ReadF32RejectsNonFloatDtypes) {
  std::vector<int64_t> v = {1, 2};
  std::string p = path("x.safetensors");
  write_safetensors(p, {{"ids", "I64", {2}, v.data()}});
  SafetensorsFile f(p);
  float out[2];
  expect_error([&] { f.read_f32(*f.find("ids"), out); }, {p, "'ids'", "I64", "cannot be read as f32"});
}

// One malformed file per case; each error names the file and the problem.
TEST_F(Io, MalformedSafetensorsAreClearErrors) {
  std::string p = path("bad.safetensors");
  auto open = [&] { SafetensorsFile f(p); };

  write_bytes(p, "12345");
  expect_error(open, {p, "5 bytes", "shorter than the 8-byte header length"});
  write_bytes(p, "");
  expect_error(open, {p, "0 bytes"});
  write_bytes(p, le64(1000) + "{}");
  expect_error(open, {p, "header length 1000", "past the end of the file (10 bytes"});
  write_st_raw(p, "{not json", 0);
  expect_error(open, {p, "header is not valid JSON"});
  write_st_raw(p, "[1,2]", 0);
  expect_error(open, {p, "not a JSON object but array"});
  write_st_raw(p, R"({"__metadata__":{"n":1}})", 0);
  expect_error(open, {p, "__metadata__ value of 'n' must be a string"});
  write_st_raw(p, R"({"w":[1]})", 0);
  expect_error(open, {p, "tensor 'w'", "must be an object"});

  for (const char* missing : {"dtype", "shape", "data_offsets"}) {
    json e = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
    e.erase(missing);
    write_st_raw(p, json{{"w", e}}.dump(), 8);
    expect_error(open, {p, "tensor 'w'", std::string("no \"") + missing + "\""});
  }
  write_st_raw(p, R"({"w":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", 8);
  expect_error(open, {p, "tensor 'w'", "unknown dtype 'F17'", "BF16"});
  write_st_raw(p, R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8);
  expect_error(open, {p, "tensor 'w'", "shape entry must be a non-negative integer, found -2"});
  write_st_raw(p, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8);
  expect_error(open, {p, "tensor 'w'", "data_offsets must be [begin, end]"});
  write_st_raw(p, R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8);
  expect_error(open, {p, "tensor 'w'", "[8, 0] are out of order"});
  write_st_raw(p, R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  expect_error(open, {p, "tensor 'w'", "dtype F32 and shape [3] need 12 bytes", "[0, 8] hold 8"});
  write_st_raw(p, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  expect_error(open, {p, "tensor 'w'", "[0, 16] run past the end of the file", "8 bytes"});
  write_st_raw(p,
               R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
               12);
  expect_error(open, {p, "tensor 'b' data_offsets [4, 12] overlap tensor 'a' [0, 8]"});
  write_st_raw(p,
               R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
               12);
  expect_error(open, {p, "bytes [4, 8) of the data section belong to no tensor", "'b'"});
  write_st_raw(p, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 6);
  expect_error(open, {p, "data section has 6 bytes but the tensors cover only 4"});
  // Same key twice: JSON parsers keep one; the file would silently lose a tensor.
  write_st_raw(p,
               R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
               R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               8);
  expect_error(open, {p, "tensor 'a' appears twice in the header"});
  expect_error([&] { SafetensorsFile f(path("missing.safetensors")); },
               {"cannot open safetensors file", path("missing.safetensors")});
  expect_error([&] { SafetensorsFile f(dir_.string()); }, {dir_.string(), "is a folder, where a regular file was expected"});
}

// ------------------------------------------------------------ fixtures

TEST_F(Io, FixtureSingleFileShapesMatchConfig) {
  std::string p = (kFixtures / "qwen3_moe_a" / "model.safetensors").string();
  json cfg = read_json(kFixtures / "qwen3_moe_a" / "config.json");
  int64_t V = cfg["vocab_size"], H = cfg["hidden_size"], I = cfg["intermediate_size"];
  int64_t M = cfg["moe_intermediate_size"], heads = cfg["num_attention_heads"], kv = cfg["num_key_value_heads"];
  int64_t hd = cfg["head_dim"], E = cfg["num_local_experts"], L = cfg["num_hidden_layers"];
  std::set<int64_t> dense(cfg["mlp_only_layers"].begin(), cfg["mlp_only_layers"].end());

  SafetensorsFile f(p);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  auto shape = [&](const std::string& name) {
    const StTensor* t = f.find(name);
    EXPECT_NE(t, nullptr) << name;
    return t ? t->shape : std::vector<int64_t>{-1};
  };
  using S = std::vector<int64_t>;
  EXPECT_EQ(shape("model.embed_tokens.weight"), (S{V, H}));
  EXPECT_EQ(shape("lm_head.weight"), (S{V, H}));
  EXPECT_EQ(shape("model.norm.weight"), (S{H}));
  // Per layer: 2 norms, q/k/v/o, q/k norms; a dense MLP (3) or router + 3 per expert.
  size_t expected_count = 3;
  for (int64_t l = 0; l < L; ++l) {
    std::string pre = "model.layers." + std::to_string(l) + ".";
    EXPECT_EQ(shape(pre + "self_attn.q_proj.weight"), (S{heads * hd, H}));
    EXPECT_EQ(shape(pre + "self_attn.k_proj.weight"), (S{kv * hd, H}));
    EXPECT_EQ(shape(pre + "self_attn.o_proj.weight"), (S{H, heads * hd}));
    EXPECT_EQ(shape(pre + "self_attn.q_norm.weight"), (S{hd}));
    expected_count += 8;
    if (dense.count(l)) {
      EXPECT_EQ(shape(pre + "mlp.gate_proj.weight"), (S{I, H}));
      EXPECT_EQ(shape(pre + "mlp.down_proj.weight"), (S{H, I}));
      expected_count += 3;
    } else {
      EXPECT_EQ(shape(pre + "mlp.gate.weight"), (S{E, H}));
      EXPECT_EQ(shape(pre + "mlp.experts." + std::to_string(E - 1) + ".up_proj.weight"), (S{M, H}));
      EXPECT_EQ(shape(pre + "mlp.experts.0.down_proj.weight"), (S{H, M}));
      expected_count += 1 + 3 * E;
    }
  }
  EXPECT_EQ(f.tensors().size(), expected_count);

  // make_hf_fixtures.py draws every norm weight from U(0.7, 1.3).
  for (const StTensor& t : f.tensors()) {
    if (t.name.find("norm.weight") == std::string::npos) continue;
    std::vector<float> w(static_cast<size_t>(t.numel()));
    f.read_f32(t, w.data());
    for (float x : w) EXPECT_TRUE(x >= 0.7f && x <= 1.3f) << t.name << " " << x;
    EXPECT_NE(w.front(), w.back()) << t.name;
  }
}

TEST_F(Io, FixtureValuesMatchNumpy) {
  std::string p = (kFixtures / "qwen3_moe_a" / "model.safetensors").string();
  REFERENCE_OR_SKIP("st-describe " + p + " " + path("d.json"));
  json d = read_json(path("d.json"));
  SafetensorsFile f(p);
  EXPECT_EQ(d.size(), f.tensors().size() + 1);  // + __metadata__
  for (const StTensor& t : f.tensors()) {
    const json& ref = d[t.name];
    EXPECT_EQ(ref["shape"].get<std::vector<int64_t>>(), t.shape) << t.name;
    std::vector<float> got(static_cast<size_t>(t.numel()));
    f.read_f32(t, got.data());
    ASSERT_EQ(ref["values"].size(), got.size()) << t.name;
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], ref["values"][i].get<double>()) << t.name << "[" << i << "]";
  }
}

// tests/fixtures/generation.log printed the losses and gradient norms that
// expected.safetensors stores (as F32 and F64 tensors).
TEST_F(Io, FixtureExpectedValuesMatchGenerationLog) {
  SafetensorsFile f((kFixtures / "qwen3_moe_a" / "expected.safetensors").string());
  float loss;
  f.read_f32(*f.find("loss"), &loss);
  EXPECT_EQ(loss, 5.1628336906433105f);
  const StTensor* steps = f.find("step_loss");
  ASSERT_NE(steps, nullptr);
  EXPECT_EQ(steps->dtype, "F64");
  std::vector<float> got(5);
  f.read_f32(*steps, got.data());
  EXPECT_EQ(got, (std::vector<float>{5.1628336906433105f, 4.8692946434021f, 4.609086513519287f, 4.386039733886719f,
                                     4.177202224731445f}));
  f.read_f32(*f.find("step_grad_norm"), got.data());
  EXPECT_EQ(got[0], 2.9234230518341064f);
  EXPECT_EQ(got[4], 2.4133431911468506f);
}

TEST_F(Io, HfWeightsShardedFolderMatchesIndex) {
  fs::path folder = kFixtures / "qwen3_moe_b";
  json index = read_json(folder / "model.safetensors.index.json");
  std::vector<std::string> keys;
  for (const auto& [k, v] : index["weight_map"].items()) keys.push_back(k);
  std::sort(keys.begin(), keys.end());

  HfWeights w(folder.string());
  EXPECT_EQ(w.names(), keys);
  int64_t params = 0;
  for (const std::string& k : keys) {
    ASSERT_TRUE(w.contains(k));
    std::vector<int64_t> s = w.shape(k);
    int64_t n = w.tensor(k).numel();
    std::vector<float> v(static_cast<size_t>(n));
    w.read_f32(k, s, v.data());
    EXPECT_EQ(w.bytes(k).size(), static_cast<size_t>(n) * 4);
    EXPECT_NE(v.front(), v.back()) << k;  // real random weights, not a constant page
    params += n;
  }
  // The index's own totals, as transformers wrote them.
  EXPECT_EQ(params, index["metadata"]["total_parameters"].get<int64_t>());
  EXPECT_EQ(params * 4, index["metadata"]["total_size"].get<int64_t>());
  json cfg = read_json(folder / "config.json");
  EXPECT_EQ(w.shape("model.embed_tokens.weight"),
            (std::vector<int64_t>{cfg["vocab_size"].get<int64_t>(), cfg["hidden_size"].get<int64_t>()}));
  // Tied embeddings: no lm_head in the checkpoint.
  EXPECT_FALSE(w.contains("lm_head.weight"));
  expect_error([&] { w.shape("lm_head.weight"); }, {"'lm_head.weight'", folder.string()});
}

TEST_F(Io, HfWeightsShardValuesMatchNumpy) {
  fs::path folder = kFixtures / "qwen3_moe_b";
  HfWeights w(folder.string());
  std::string shard = (folder / "model-00002-of-00003.safetensors").string();
  REFERENCE_OR_SKIP("st-describe " + shard + " " + path("d.json"));
  json d = read_json(path("d.json"));
  d.erase("__metadata__");
  ASSERT_GT(d.size(), 5u);
  for (const auto& [name, ref] : d.items()) {
    std::vector<float> got(ref["values"].size());
    w.read_f32(name, ref["shape"].get<std::vector<int64_t>>(), got.data());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], ref["values"][i].get<double>()) << name << "[" << i << "]";
  }
}

TEST_F(Io, HfWeightsSingleFileFolder) {
  HfWeights w((kFixtures / "qwen3_moe_a").string());
  SafetensorsFile f((kFixtures / "qwen3_moe_a" / "model.safetensors").string());
  std::vector<std::string> names;
  for (const StTensor& t : f.tensors()) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(w.names(), names);
  std::vector<float> a(96 * 32), b(96 * 32);
  w.read_f32("lm_head.weight", {96, 32}, a.data());
  f.read_f32(*f.find("lm_head.weight"), b.data());
  EXPECT_EQ(a, b);
}

TEST_F(Io, HfWeightsErrorsNameKeysFilesAndShapes) {
  std::string folder = (kFixtures / "qwen3_moe_b").string();
  HfWeights w(folder);
  std::vector<float> buf(80 * 24);
  expect_error([&] { w.read_f32("model.embed_tokens.weight", {24, 80}, buf.data()); },
               {"model-00001-of-00003.safetensors", "'model.embed_tokens.weight'", "has shape [80,24]",
                "expected [24,80]"});
  expect_error([&] { w.read_f32("model.layers.1.mlp.experts.3.gate_proj.weights", {8, 24}, buf.data()); },
               {folder, "no tensor 'model.layers.1.mlp.experts.3.gate_proj.weights'",
                "did you mean 'model.layers.1.mlp.experts.3.gate_proj.weight'"});
  // Nothing close: no suggestion.
  std::string msg = error_of([&] { w.shape("vision_tower.patch_embed"); });
  EXPECT_NE(msg.find("no tensor 'vision_tower.patch_embed'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
}

TEST_F(Io, MalformedHfFoldersAreClearErrors) {
  fs::path src = kFixtures / "qwen3_moe_b";
  for (const auto& e : fs::directory_iterator(src)) fs::copy_file(e.path(), dir_ / e.path().filename());
  std::string index = path("model.safetensors.index.json");
  json good = read_json(index);

  json j = good;
  j["weight_map"]["model.extra.weight"] = "model-00001-of-00003.safetensors";
  write_bytes(index, j.dump());
  expect_error([&] { HfWeights w(dir_.string()); },
               {index, "'model.extra.weight'", "model-00001-of-00003.safetensors", "has no such tensor"});

  j = good;
  j["weight_map"]["model.norm.weight"] = "model-00009-of-00003.safetensors";
  write_bytes(index, j.dump());
  expect_error([&] { HfWeights w(dir_.string()); },
               {index, "names shard model-00009-of-00003.safetensors", "missing from " + dir_.string()});

  write_bytes(index, R"({"metadata": {}})");
  expect_error([&] { HfWeights w(dir_.string()); }, {index, "\"weight_map\""});
  write_bytes(index, "{\"weight_map\": ");
  expect_error([&] { HfWeights w(dir_.string()); }, {index, "not valid JSON"});

  // A broken shard is reported by the shard's own checks.
  write_bytes(index, good.dump());
  write_bytes(path("model-00003-of-00003.safetensors"), "xyz");
  expect_error([&] { HfWeights w(dir_.string()); }, {path("model-00003-of-00003.safetensors"), "shorter"});

  fs::remove(index);
  expect_error([&] { HfWeights w(dir_.string()); },
               {dir_.string(), "neither model.safetensors nor model.safetensors.index.json"});
  expect_error([&] { HfWeights w(path("nowhere")); }, {path("nowhere"), "does not exist"});
}

// Experts kept as slices of one key per layer (GPT-OSS): slice e of down_proj [E, I, D],
// as it is and transposed (moetrain's [D, I]), and of a bias [E, D].
TEST_F(Io, HfWeightsReadsSlicesOfFusedKeys) {
  HfWeights w((kFixtures / "gpt_oss_a").string());
  const std::string down = "model.layers.1.mlp.experts.down_proj", bias = down + "_bias";
  const std::vector<int64_t> shape = w.shape(down);
  ASSERT_EQ(shape, (std::vector<int64_t>{8, 16, 32}));
  std::vector<float> all(8 * 16 * 32), slice(16 * 32), t(16 * 32), b_all(8 * 32), b(32);
  w.read_f32(down, shape, all.data());
  w.read_f32(bias, {8, 32}, b_all.data());
  for (int64_t e : {0, 5, 7}) {
    w.read_slice_f32(down, shape, e, false, false, slice.data());
    w.read_slice_f32(down, shape, e, true, false, t.data());
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t d = 0; d < 32; ++d) {
        ASSERT_EQ(slice[i * 32 + d], all[(e * 16 + i) * 32 + d]) << e << " " << i << " " << d;
        ASSERT_EQ(t[d * 16 + i], all[(e * 16 + i) * 32 + d]) << e << " " << i << " " << d;
      }
    // mxfp4 changes nothing for a key that is there.
    w.read_slice_f32(bias, {8, 32}, e, false, true, b.data());
    EXPECT_EQ(b, std::vector<float>(b_all.begin() + e * 32, b_all.begin() + (e + 1) * 32));
  }
  expect_error([&] { w.read_slice_f32(down, {8, 32, 16}, 1, true, false, t.data()); },
               {"'" + down + "' has shape [8,16,32]", "expected [8,32,16]"});
  expect_error([&] { w.read_slice_f32(down, shape, 8, false, false, t.data()); }, {"no slice 8", "[8,16,32]"});
  expect_error([&] { w.read_slice_f32(bias, {8, 32}, 0, true, false, b.data()); }, {"no slice 0 to transpose"});
  expect_error([&] { w.read_slice_f32(down + "_x", shape, 0, false, true, t.data()); },
               {"no tensor '" + down + "_x_blocks'"});
  float m[6] = {1, 2, 3, 4, 5, 6}, mt[6];
  transpose_f32(m, 2, 3, mt);
  EXPECT_EQ(std::vector<float>(mt, mt + 6), (std::vector<float>{1, 4, 2, 5, 3, 6}));
}

// FP4 nibbles, low one first, times 2^(scale - 127), from the scale's extremes.
TEST_F(Io, Mxfp4DequantizesNibblesAndScales) {
  uint8_t blocks[2 * 16] = {0x91, 0x87, 0x5a}, scales[2] = {129, 0};
  blocks[16] = 0x71;
  std::vector<float> got(64);
  dequantize_mxfp4(blocks, scales, 1, 2, got.data());  // one row of two runs
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 6), (std::vector<float>{2, -2, 24, -0.0f, -4, 12}));
  EXPECT_TRUE(std::signbit(got[3]));
  EXPECT_EQ(got[32], std::ldexp(0.5f, -127));  // subnormal, exact
  EXPECT_EQ(got[33], std::ldexp(6.0f, -127));
  // Scale 255 is E8M0's NaN: transformers (torch.ldexp, x * 2^128 in fp32) gives inf and NaN.
  scales[0] = 255;
  dequantize_mxfp4(blocks, scales, 2, 1, got.data());  // two rows of one run
  EXPECT_EQ(got[0], INFINITY);
  EXPECT_EQ(got[1], -INFINITY);
  EXPECT_TRUE(std::isnan(got[6]));
  EXPECT_EQ(got[32], std::ldexp(0.5f, -127));
}

// GPT-OSS's MXFP4 experts against transformers' own dequantization (expected.safetensors,
// its parameter [E, in, out]): read as it keeps them and in moetrain's [out, in].
TEST_F(Io, Mxfp4MatchesTransformers) {
  HfWeights w((kFixtures / "gpt_oss_mxfp4").string()), want((kFixtures / "gpt_oss_mxfp4").string(), "expected");
  for (std::string l : {"0", "1"})
    for (std::string k : {"gate_up_proj", "down_proj"}) {
      const std::string key = "model.layers." + l + ".mlp.experts." + k;
      const std::vector<int64_t> shape = want.shape("dequant." + key);  // [E, C, R]
      const int64_t E = shape[0], C = shape[1], R = shape[2];
      std::vector<float> ref(E * C * R), hf(C * R), ours(C * R);
      want.read_f32("dequant." + key, shape, ref.data());
      EXPECT_FALSE(w.contains(key));
      for (int64_t e = 0; e < E; ++e) {
        w.read_slice_f32(key, shape, e, false, true, hf.data());
        w.read_slice_f32(key, shape, e, true, true, ours.data());
        for (int64_t c = 0; c < C; ++c)
          for (int64_t r = 0; r < R; ++r) {
            ASSERT_EQ(hf[c * R + r], ref[(e * C + c) * R + r]) << key << " " << e << " " << c << " " << r;
            ASSERT_EQ(ours[r * C + c], ref[(e * C + c) * R + r]) << key << " " << e << " " << c << " " << r;
          }
      }
      expect_error([&] { w.read_slice_f32(key, {E, C + 32, R}, 0, true, true, ours.data()); },
                   {"MXFP4 tensor '" + key + "'", "needs U8", "_blocks [" + std::to_string(E) + "," +
                    std::to_string(R) + "," + std::to_string(C / 32 + 1) + ",16]"});
    }
}

// ---------------------------------------------------------------- npy

template <typename T>
void expect_npy_round_trip(const std::string& p, const std::string& descr, const std::vector<int64_t>& shape,
                           const std::vector<T>& v) {
  write_npy(p, descr, shape, v.data());
  std::string raw = read_bytes(p);
  NpyArray a = read_npy(p);
  EXPECT_EQ(a.header.descr, descr);
  EXPECT_EQ(a.header.shape, shape);
  EXPECT_EQ(a.header.item_bytes, sizeof(T));
  EXPECT_EQ(a.header.header_bytes % 64, 0u) << "data must start 64-byte aligned";
  EXPECT_EQ(raw.size(), a.header.header_bytes + v.size() * sizeof(T));
  ASSERT_EQ(a.data.size(), v.size() * sizeof(T));
  EXPECT_TRUE(std::equal(a.data.begin(), a.data.end(), reinterpret_cast<const uint8_t*>(v.data())));
  if constexpr (std::is_integral_v<T>) {
    std::vector<int64_t> as64 = npy_as_int64(a, p);
    EXPECT_EQ(as64, std::vector<int64_t>(v.begin(), v.end()));
  }
}

TEST_F(Io, NpyRoundTrip) {
  expect_npy_round_trip<int32_t>(path("a.npy"), "<i4", {2, 3}, {-1, 2, INT32_MIN, INT32_MAX, 0, 77});
  expect_npy_round_trip<int64_t>(path("b.npy"), "<i8", {4}, {INT64_MIN, -5, 6, INT64_MAX});
  expect_npy_round_trip<uint16_t>(path("c.npy"), "<u2", {3, 1}, {0, 65535, 32768});
  expect_npy_round_trip<float>(path("d.npy"), "<f4", {5}, {0.5f, -1e-42f, 3.0f, -0.0f, 1e38f});
  expect_npy_round_trip<int32_t>(path("e.npy"), "<i4", {0, 3}, {});
  expect_npy_round_trip<int64_t>(path("f.npy"), "<i8", {}, {9});
  // A header long enough to need a second 64-byte block.
  expect_npy_round_trip<uint8_t>(path("g.npy"), "|u1", {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {200});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
  for (const std::string& n : names) EXPECT_EQ(n.find(".tmp"), std::string::npos) << n;
}

TEST_F(Io, MalformedNpyAreClearErrors) {
  std::vector<int32_t> v = {1, 2, 3, 4, 5, 6};
  std::string p = path("a.npy");
  write_npy(p, "<i4", {2, 3}, v.data());
  std::string good = read_bytes(p);

  write_bytes(p, good.substr(0, good.size() - 1));
  expect_error([&] { read_npy(p); }, {p, "truncated", "needs 24 bytes, 23 present"});
  write_bytes(p, good.substr(0, 40));
  expect_error([&] { read_npy(p); }, {p, "truncated .npy header"});
  write_bytes(p, "not numpy at all");
  expect_error([&] { read_npy(p); }, {p, "bad magic"});

  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    EXPECT_EQ(from.size(), to.size()) << "keep the header length";
    s.replace(at, from.size(), to);
    write_bytes(p, s);
  };
  with("'fortran_order': False", "'fortran_order': True ");
  expect_error([&] { read_npy(p); }, {p, "Fortran"});
  with("'<i4'", "'>i4'");
  expect_error([&] { read_npy(p); }, {p, "unsupported .npy dtype '>i4'"});
  with("'<i4'", "'<ix'");
  expect_error([&] { read_npy(p); }, {p, "'x'", "not a non-negative integer"});
  with("(2, 3)", "(2,-3)");
  expect_error([&] { read_npy(p); }, {p, "dimension '-3'", "not a non-negative integer"});
  with("'shape': (2, 3)", "'shape': (2, 3 ");
  expect_error([&] { read_npy(p); }, {p, "unterminated value of 'shape'"});
  // Not a tuple (this looped forever, growing memory).
  with("'shape': (2, 3), ", "'shape': 6,      ");
  expect_error([&] { read_npy(p); }, {p, "shape 6 is not a tuple"});
  with("'shape': (2, 3), ", "'shape': [2, 3], ");
  expect_error([&] { read_npy(p); }, {p, "shape [2 is not a tuple"});
}

TEST_F(Io, NumpyReadsWhatWeWriteNpy) {
  std::vector<int32_t> a = {-3, 0, INT32_MAX, 5, 6, INT32_MIN};
  std::vector<int64_t> b = {INT64_MIN + 1, 2, INT64_MAX};
  std::vector<uint16_t> c = {0, 1, 65535, 40000};
  std::vector<float> d = {0.25f, -7.5f, 1e-40f};
  write_npy(path("a.npy"), "<i4", {2, 3}, a.data());
  write_npy(path("b.npy"), "<i8", {3}, b.data());
  write_npy(path("c.npy"), "<u2", {4, 1}, c.data());
  write_npy(path("d.npy"), "<f4", {3}, d.data());
  for (const char* n : {"a", "b", "c", "d"})
    if (!run_reference(std::string("npy-describe ") + path(std::string(n) + ".npy") + " " +
                       path(std::string(n) + ".json")))
      GTEST_SKIP() << "no python3 with numpy at configure time (scripts/setup.sh installs it)";
  auto check = [&](const char* n, const std::string& descr, const std::vector<int64_t>& shape, auto& values) {
    json j = read_json(path(std::string(n) + ".json"));
    EXPECT_EQ(j["descr"], descr) << n;
    EXPECT_EQ(j["shape"].get<std::vector<int64_t>>(), shape) << n;
    EXPECT_FALSE(j["fortran_order"].get<bool>()) << n;
    ASSERT_EQ(j["values"].size(), values.size()) << n;
    for (size_t i = 0; i < values.size(); ++i)
      EXPECT_EQ(j["values"][i].get<typename std::decay_t<decltype(values)>::value_type>(), values[i]) << n << i;
  };
  check("a", "<i4", {2, 3}, a);
  check("b", "<i8", {3}, b);
  check("c", "<u2", {4, 1}, c);
  check("d", "<f4", {3}, d);
}

TEST_F(Io, WeReadWhatNumpyWrites) {
  REFERENCE_OR_SKIP("npy-write " + dir_.string());
  json manifest = read_json(dir_ / "manifest.json");
  ASSERT_EQ(manifest.size(), 9u);
  for (const json& m : manifest) {
    std::string p = path(m["file"].get<std::string>());
    if (m["fortran_order"].get<bool>()) {
      expect_error([&] { read_npy(p); }, {p, "Fortran"});
      continue;
    }
    NpyArray a = read_npy(p);
    std::string descr = m["descr"];
    EXPECT_EQ(a.header.descr, descr) << p;
    EXPECT_EQ(a.header.shape, m["shape"].get<std::vector<int64_t>>()) << p;
    // values are flat, in C order (a 0-d array gives one)
    if (descr[1] == 'f') {
      std::vector<double> want = m["values"].get<std::vector<double>>();
      ASSERT_EQ(a.data.size(), want.size() * a.header.item_bytes) << p;
      for (size_t i = 0; i < want.size(); ++i) {
        double got;
        if (a.header.item_bytes == 4) {
          float f;
          std::memcpy(&f, a.data.data() + 4 * i, 4);
          got = f;
        } else {
          std::memcpy(&got, a.data.data() + 8 * i, 8);
        }
        EXPECT_EQ(got, want[i]) << p << "[" << i << "]";
      }
    } else {
      std::vector<int64_t> want = m["values"].get<std::vector<int64_t>>();
      EXPECT_EQ(npy_as_int64(a, p), want) << p;
    }
  }
}

}  // namespace
