#include "io/npy.h"

#include <charconv>
#include <cstring>

#include "core/check.h"
#include "io/file.h"

namespace mt::io {

namespace {

// The value of 'key' in the header's Python dict literal, as raw text.
std::string dict_value(const std::string& h, const std::string& key, const std::string& where) {
  size_t k = h.find("'" + key + "'");
  MT_CHECK(k != std::string::npos) << where << ": .npy header has no '" << key << "': " << h;
  size_t colon = h.find(':', k);
  MT_CHECK(colon != std::string::npos) << where << ": malformed .npy header: " << h;
  size_t b = h.find_first_not_of(' ', colon + 1);
  MT_CHECK(b != std::string::npos) << where << ": .npy header has no value for '" << key << "': " << h;
  if (h[b] == '\'' || h[b] == '(') {
    size_t e = h.find(h[b] == '(' ? ')' : '\'', b + 1);
    MT_CHECK(e != std::string::npos) << where << ": unterminated value of '" << key << "' in .npy header: " << h;
    return h[b] == '(' ? h.substr(b, e - b + 1) : h.substr(b + 1, e - b - 1);
  }
  return h.substr(b, h.find_first_of(",}", b) - b);
}

// A whole token of decimal digits (spaces around allowed), as a non-negative int64.
// from_chars, unlike stoll, neither throws a non-mt::Error nor accepts "-1" or "3x".
int64_t parse_count(const std::string& tok, const std::string& what, const std::string& where) {
  size_t b = tok.find_first_not_of(' ');
  size_t e = tok.find_last_not_of(' ') + 1;
  int64_t v = -1;
  auto r = b == std::string::npos ? std::from_chars_result{nullptr, std::errc::invalid_argument}
                                  : std::from_chars(tok.data() + b, tok.data() + e, v);
  MT_CHECK(r.ec == std::errc() && r.ptr == tok.data() + e && v >= 0)
      << where << ": " << what << " '" << tok << "' in the .npy header is not a non-negative integer";
  return v;
}

size_t descr_bytes(const std::string& d, const std::string& where) {
  MT_CHECK(d.size() >= 3 && (d[0] == '<' || d[0] == '|') && (d[1] == 'i' || d[1] == 'u' || d[1] == 'f'))
      << where << ": unsupported .npy dtype '" << d << "' (expected little-endian int, uint or float)";
  int64_t b = parse_count(d.substr(2), "item size of dtype", where);
  MT_CHECK(b == 1 || b == 2 || b == 4 || b == 8) << where << ": unsupported .npy dtype '" << d << "'";
  return static_cast<size_t>(b);
}

}  // namespace

NpyHeader parse_npy_header(const uint8_t* p, size_t n, const std::string& where) {
  MT_CHECK(n >= 10 && std::memcmp(p, "\x93NUMPY", 6) == 0) << where << ": not a .npy array (bad magic)";
  int major = p[6];
  MT_CHECK(major >= 1 && major <= 3) << where << ": .npy format version " << major << " is not supported";
  size_t start = major == 1 ? 10 : 12;  // the header length is 2 bytes in 1.0, 4 in 2.0 and 3.0
  MT_CHECK(n >= start) << where << ": truncated .npy header";
  size_t len = 0;
  std::memcpy(&len, p + 8, start - 8);  // little-endian, like every host we build for
  constexpr size_t kMaxHeader = 65536;  // numpy's reader takes 10000 unless told otherwise
  MT_CHECK(len <= kMaxHeader) << where << ": a .npy header of " << len << " bytes, over the " << kMaxHeader
                              << " read (numpy writes under 10000): a damaged file, or not a token matrix";
  MT_CHECK(start + len <= n) << where << ": truncated .npy header (" << start + len << " bytes needed, " << n
                             << " present)";
  std::string h(reinterpret_cast<const char*>(p + start), len);
  NpyHeader out;
  out.header_bytes = start + len;
  out.descr = dict_value(h, "descr", where);
  out.item_bytes = descr_bytes(out.descr, where);
  MT_CHECK(dict_value(h, "fortran_order", where) == "False")
      << where << ": Fortran-ordered .npy arrays are not supported (save with C order)";
  std::string shape = dict_value(h, "shape", where);
  // A tuple, so the loop below always finds its ',' or ')'; numpy allows 64 dimensions.
  MT_CHECK(shape.size() >= 2 && shape.front() == '(' && shape.back() == ')' && shape.size() < 1024)
      << where << ": .npy shape " << shape.substr(0, 64) << " is not a tuple of dimensions such as (2, 3)";
  for (size_t i = 1; i < shape.size();) {
    size_t j = shape.find_first_of(",)", i);
    std::string tok = shape.substr(i, j - i);
    if (tok.find_first_not_of(' ') != std::string::npos) out.shape.push_back(parse_count(tok, "dimension", where));
    i = j + 1;
    MT_CHECK(out.shape.size() <= 64) << where << ": .npy shape " << shape << " has more than 64 dimensions";
  }
  // Compared without forming header_bytes + data_bytes, which a corrupt shape could overflow.
  int64_t bytes = static_cast<int64_t>(out.item_bytes);
  for (int64_t d : out.shape)
    MT_CHECK(!__builtin_mul_overflow(bytes, d, &bytes))
        << where << ": .npy shape " << shape << " has more bytes than fit in 64 bits";
  MT_CHECK(static_cast<uint64_t>(bytes) <= n - out.header_bytes)
      << where << ": .npy data truncated: shape needs " << out.data_bytes() << " bytes, " << n - out.header_bytes
      << " present";
  return out;
}

std::string make_npy_header(const std::string& descr, const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  s += shape.size() == 1 ? ",)" : ")";
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + s + ", }";
  size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);  // magic, version 1.0
  out += static_cast<char>(dict.size() & 0xff);
  out += static_cast<char>(dict.size() >> 8);
  return out + dict;
}

NpyArray read_npy(const std::string& path) {
  std::vector<uint8_t> bytes = read_file(path);
  NpyArray a;
  a.header = parse_npy_header(bytes.data(), bytes.size(), path);
  a.data.assign(bytes.begin() + a.header.header_bytes, bytes.begin() + a.header.header_bytes + a.header.data_bytes());
  return a;
}

std::vector<int64_t> npy_as_int64(const NpyArray& a, const std::string& where) {
  const std::string& d = a.header.descr;
  MT_CHECK(d[1] == 'i' || d[1] == 'u') << where << ": expected an integer array, got dtype '" << d << "'";
  bool is_signed = d[1] == 'i';
  std::vector<int64_t> out(static_cast<size_t>(a.header.numel()));
  const uint8_t* p = a.data.data();
  for (size_t i = 0; i < out.size(); ++i) {
    uint64_t v = 0;
    std::memcpy(&v, p + i * a.header.item_bytes, a.header.item_bytes);
    if (is_signed && a.header.item_bytes < 8 && (v >> (8 * a.header.item_bytes - 1)) & 1)
      v |= ~uint64_t{0} << (8 * a.header.item_bytes);  // sign-extend
    out[i] = static_cast<int64_t>(v);
  }
  return out;
}

}  // namespace mt::io
