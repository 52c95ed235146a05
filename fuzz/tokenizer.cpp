// tokenizer.json loading, then encoding and decoding. The input is the file, then
// optionally kTextMark and a text to encode (otherwise a fixed text with every kind of
// piece: words, digits, whitespace runs, added-token spellings, non-ASCII).
#include <vector>

#include "data/tokenizer.h"
#include "fuzz/fuzz.h"

namespace {
constexpr std::string_view kTextMark = "\n#text#\n";
constexpr std::string_view kDefaultText = "Hello, world!  It's 2026:\t12345 tokens\n\n<|endoftext|> caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87  ";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = mt::fuzz::as_text(data, size);
  const size_t mark = input.find(kTextMark);
  const std::string_view text = mark == std::string_view::npos ? kDefaultText : input.substr(mark + kTextMark.size());
  const std::string path = mt::fuzz::put("tokenizer.json", input.substr(0, mark));
  try {
    mt::data::Tokenizer tok(path);
    const std::vector<int32_t> ids = tok.encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= tok.vocab_size()) std::abort();
    tok.decode(ids);
    tok.decode(ids, true);
  } catch (const mt::Error&) {
  }
  return 0;
}
