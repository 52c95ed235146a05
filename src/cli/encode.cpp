// moetrain encode: the ids of a text, as one JSON array on stdout.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "cli/commands.h"
#include "data/tokenizer.h"

namespace mt::cli {

int run_encode(const Args& args) {
  Options opt("encode", args, {"tokenizer", "text"});
  data::Tokenizer tok(opt.required("tokenizer"));
  // Else standard input byte for byte (istreambuf_iterator skips nothing): no newline is added or removed.
  const std::string text =
      opt.has("text") ? opt.get("text") : std::string(std::istreambuf_iterator<char>(std::cin), {});
  std::vector<int32_t> ids = tok.encode(text);
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  std::printf("%s]\n", out.c_str());
  return 0;
}

}  // namespace mt::cli
