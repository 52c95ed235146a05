// moetrain tokenize: JSONL(.zst) files to packed token files (src/data/corpus.h).
// Progress and malformed lines go to stderr; one JSON summary line to stdout.
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
  MT_CHECK(!o.inputs.empty()) << "--input is required: the JSONL(.zst) files or folders to tokenize";
  o.output = opt.required("output");
  o.workers = static_cast<int>(opt.integer("workers", 0, 0, 4096));  // 0: one per core
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
