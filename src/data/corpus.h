// The corpus builder behind `moetrain tokenize`: JSONL(.zst) documents in, one
// token file per input file out.
//
// Token file (.bin): two consecutive NumPy .npy arrays, as PithTrain writes them,
// so `np.load(f); np.load(f)` on one open file reads both:
//   tokens   [n]  the smallest unsigned type that holds every id (u1, u2 or u4)
//   doc_ends [d]  uint64, cumulative: document i is tokens[ends[i-1]:ends[i]]
// Every document ends with the tokenizer's end-of-document token (see eos_id()).
// The folder also gets a copy of the tokenizer.json (and a tokenizer_config.json beside
// it), which training puts into its checkpoints and export-hf into the model folder.
//
// Resuming: each output is written to X.bin.tmp and renamed to X.bin; a X.bin.lock
// beside it exists from before the work starts until after the rename. A rerun
// skips every X.bin without a lock and redoes the rest, so a killed run loses at
// most the files in flight, and reruns give byte-identical files. Files are
// tokenized by forked worker processes, largest first.
//
// Bad input: a malformed line (not JSON, no text field) is reported and skipped. A
// bad file (unreadable, corrupt or truncated zstd, a document the tokenizer rejects)
// is reported, gets no .bin (nor .tmp or .lock, so a rerun tries it again) and the
// other files go on; the report lists it, and `tokenize` exits 1 at the end. With
// strict, either stops the run.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mt::data {

struct TokenizeOptions {
  std::string tokenizer;            // tokenizer.json
  std::vector<std::string> inputs;  // .jsonl / .jsonl.zst files, or folders searched for them
  std::string output;               // folder for the .bin files (created)
  int workers = 0;                  // worker processes; 0: one per core
  std::string field = "text";       // the JSON string field holding a document
  bool strict = false;              // a malformed line or bad file is an error, not skipped
};

struct TokenizeReport {
  int64_t files = 0;          // input files found
  int64_t files_skipped = 0;  // of those, already done by an earlier run
  int64_t documents = 0;      // in the files done now
  int64_t tokens = 0;
  int64_t malformed = 0;               // lines skipped
  std::vector<std::string> bad_files;  // inputs skipped as unreadable or corrupt, sorted
};

// Runs the whole build; throws mt::Error on failure other than bad files (unfinished
// files keep their .lock, so a rerun resumes).
TokenizeReport tokenize_corpus(const TokenizeOptions& options);

// Writes one token file atomically: ids must lie in [0, vocab_size), which picks
// the token type; doc_ends are cumulative token counts.
void write_token_file(const std::string& path, std::span<const int32_t> tokens, std::span<const uint64_t> doc_ends,
                      int64_t vocab_size);

}  // namespace mt::data
