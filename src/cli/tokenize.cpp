// moetrain tokenize: JSONL(.zst) files to packed token files (src/data/corpus.h).
// Progress and malformed lines go to stderr; one JSON summary line to stdout.
#include <charconv>
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "core/check.h"
#include "data/corpus.h"

namespace mt::cli {

int run_tokenize(const Args& args) {
  Options opt("tokenize", args, {"tokenizer", "input*", "output", "workers", "field", "strict?"});
  data::TokenizeOptions o;
  o.tokenizer = opt.required("tokenizer");
  o.inputs = opt.list("input");
  MT_CHECK(!o.inputs.empty()) << "moetrain tokenize: --input is required (see --help)";
  o.output = opt.required("output");
  std::string workers = opt.get("workers", "0");
  auto [end, ec] = std::from_chars(workers.data(), workers.data() + workers.size(), o.workers);
  MT_CHECK(ec == std::errc() && end == workers.data() + workers.size() && o.workers >= 0)
      << "moetrain tokenize: --workers expects a count (0 = one per core), got '" << workers << "'";
  o.field = opt.get("field", "text");
  o.strict = opt.has("strict");

  data::TokenizeReport r = data::tokenize_corpus(o);
  std::fprintf(
      stderr, "tokenize: %lld files (%lld already done), %lld documents, %lld tokens, %lld malformed lines skipped\n",
      static_cast<long long>(r.files), static_cast<long long>(r.files_skipped), static_cast<long long>(r.documents),
      static_cast<long long>(r.tokens), static_cast<long long>(r.malformed));
  std::printf(
      "{\"files\": %lld, \"files_skipped\": %lld, \"documents\": %lld, \"tokens\": %lld, \"malformed\": %lld}\n",
      static_cast<long long>(r.files), static_cast<long long>(r.files_skipped), static_cast<long long>(r.documents),
      static_cast<long long>(r.tokens), static_cast<long long>(r.malformed));
  return 0;
}

}  // namespace mt::cli
