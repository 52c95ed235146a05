// moetrain tokenize: JSONL(.zst) files to packed token files (src/data/corpus.h).
// Progress, malformed lines and bad files go to stderr; one JSON summary line to stdout.
// Exits 1 when a bad file was skipped.
#include <algorithm>
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
  if (!r.bad_files.empty()) {
    std::string names;
    for (size_t i = 0; i < std::min<size_t>(r.bad_files.size(), 5); ++i) names += (i ? ", " : "") + r.bad_files[i];
    if (r.bad_files.size() > 5) names += " and " + std::to_string(r.bad_files.size() - 5) + " more";
    std::fprintf(stderr,
                 "tokenize: skipped %zu bad file%s, left without .bin (the errors above say why; fix or remove them, "
                 "then rerun to redo only those): %s\n",
                 r.bad_files.size(), r.bad_files.size() == 1 ? "" : "s", names.c_str());
  }
  std::printf(
      "{\"files\": %lld, \"files_skipped\": %lld, \"bad_files\": %zu, \"documents\": %lld, \"tokens\": %lld, "
      "\"malformed\": %lld}\n",
      static_cast<long long>(r.files), static_cast<long long>(r.files_skipped), r.bad_files.size(),
      static_cast<long long>(r.documents), static_cast<long long>(r.tokens), static_cast<long long>(r.malformed));
  // Every line skipped (a misspelled --field, say) is not a corpus, whatever else went well.
  if (r.documents == 0 && r.malformed > 0 && r.files > r.files_skipped) {
    std::fprintf(stderr,
                 "tokenize: error: no document was found: all %lld lines were skipped (see above); is the JSON field "
                 "holding the text \"%s\"? (--field names it)\n",
                 static_cast<long long>(r.malformed), o.field.c_str());
    return 1;
  }
  return r.bad_files.empty() ? 0 : 1;  // scripts must notice, though every other file is done
}

}  // namespace mt::cli
