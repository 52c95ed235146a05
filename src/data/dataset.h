// Training samples from a folder of token files (the .bin files `moetrain tokenize`
// writes, see corpus.h): their headers and document ends mapped once at start, their
// tokens read with pread as the run goes (io::PositionalFile), so a file cut short under
// a run stops it with an error naming the file rather than SIGBUS.
//
// Samples: each file is cut into non-overlapping windows of seq_len + 1 tokens
// (documents are packed, so a window may span several; a file's tail shorter than a
// window is not used). A window gives seq_len inputs, tokens[0..seq_len), and
// seq_len labels, tokens[1..seq_len]. Windows of all files, in sorted path order,
// are numbered 0..num_samples()-1.
//
// Order: epoch e visits every sample once, in a permutation fixed by (seed, e) alone:
// a keyed Feistel network over the sample indices, so nothing of size num_samples is
// stored, and the global order is the same whatever the number of ranks.
//
// Batches: every rank calls next_batch() once per micro-batch with the same dp_size
// and micro_batch. The call takes the next dp_size * micro_batch positions of the
// global order (every rank's cursor advances past all of them); data-parallel rank d
// gets [d * micro_batch, (d + 1) * micro_batch) of those. A global batch of
// B = dp * micro * n_micro samples is then the same for any split into dp ranks and
// micro-batches.
//
// Mixtures (data.mixture): several corpora, each with a weight. Position p of the
// global order draws from the corpus furthest behind its share, the k with the largest
// w_k (p + 1) - drawn_k (the first on a tie): after any n positions every corpus has
// drawn within one sample of w_k n, and which corpus a position draws from depends on
// the weights alone. Within corpus k the samples follow its own permutation, by (seed,
// k, epoch), its epochs counted by its own draws. The cursor keeps each corpus's draws.
//
// Context parallelism: each sequence is cut into 2 * cp_size chunks; cp rank r reads
// only chunks r and 2 * cp_size - 1 - r (the zigzag that balances causal attention),
// as rows [chunk r | chunk 2cp-1-r], inputs and labels alike. positions() gives the
// sequence position of each column, for RoPE.
//
//   mt::data::Dataset ds("corpus/", seq_len, seed);
//   ds.set_cursor(saved);                                  // on resume
//   std::vector<int32_t> ids(micro * seq_len / cp), labels(ids.size());
//   ds.next_batch(dp_rank, dp, cp_rank, cp, micro, ids, labels);
//   saved = ds.cursor();                                   // into train_state.json
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "io/file.h"

namespace mt::data {

// Where the sample order stands: global samples consumed so far, by all ranks
// together. Resuming from it continues with the next unseen sample; it is the
// same number on every rank. The order depends on the corpus (its sample count),
// so resuming on a changed corpus folder continues in a different order.
struct DataCursor {
  uint64_t samples_seen = 0;
  std::vector<uint64_t> drawn;  // a mixture's: samples drawn from each corpus (summing to samples_seen)
};

// A corpus of a mixture: a folder of .bin files and its weight (any positive scale).
struct Source {
  std::string folder;
  double weight = 1;
};

// A held-out split (validation.split): each file is cut at its first document end at or
// after (1 - held_out) of its tokens; training reads the documents before the cut, the
// held-out set those after it, so no document is in both. The cut depends on the file
// alone, not on seq_len or the seed.
struct Split {
  double held_out = 0;     // 0: the whole files
  bool take_held_out = false;
};

class Dataset {
 public:
  // Maps every .bin under `folder` (recursively). Errors: no .bin files, a file
  // left unfinished by tokenize (its .lock is there), a malformed file, or fewer
  // tokens than one sample.
  Dataset(const std::string& folder, int64_t seq_len, uint64_t seed, Split split = {})
      : Dataset(std::vector<Source>{{folder, 1.0}}, seq_len, seed, split) {}
  // A mixture; the split applies to every corpus. Errors as above, naming the folder.
  Dataset(const std::vector<Source>& sources, int64_t seq_len, uint64_t seed, Split split = {});

  int64_t seq_len() const { return seq_len_; }
  int64_t num_samples() const { return starts_.back(); }
  int64_t num_tokens() const { return num_tokens_; }

  // Fills ids and labels, each [micro_batch, seq_len / cp_size] row-major, with this
  // rank's share of the next dp_size * micro_batch samples and advances the cursor.
  // `ahead`, where given, [A, micro_batch, seq_len / cp_size]: plane j holds the token
  // j + 1 positions after each label (multi-token prediction's; kPastTheEnd past the
  // sample), read with the chunk, so that a cp rank's chunk has the tokens of the next.
  void next_batch(int dp_rank, int dp_size, int cp_rank, int cp_size, int64_t micro_batch, std::span<int32_t> ids,
                  std::span<int32_t> labels, std::span<int32_t> ahead = {});
  static constexpr int32_t kPastTheEnd = -100;  // the cross-entropy's ignored label

  // The sample at `position` of the global order (epoch position / num_samples()); one
  // corpus only (a mixture's order depends on the draws before).
  int64_t sample_at(uint64_t position) const;
  // The corpus a mixture's next position draws from, given the draws so far (the rule above).
  size_t next_corpus(const std::vector<uint64_t>& drawn) const;
  size_t corpora() const { return corpora_.size(); }
  // Each corpus's share of the samples drawn so far (a mixture's; one corpus: {1}).
  std::vector<double> shares() const;
  // Tokens [begin, end) of sample `index` (0 <= begin <= end <= seq_len + 1).
  void read_sample(int64_t index, int64_t begin, int64_t end, int32_t* out) const;
  // The first token id at or past `vocab` in the part read of files f with f % parts ==
  // part, as "FILE: token id V at token I (byte B)"; empty when there is none. A file
  // whose token type cannot hold such an id (u1 under a vocabulary of 256 or more, u2 of
  // 65536) is not read. Ranks split the files, so a corpus is read once at start rather
  // than failing at the step that first meets the id.
  std::string find_id_past(int64_t vocab, int part, int parts) const;
  // Reads the last token of each file's part: a file cut short since it was opened
  // throws, naming it (one pread a file; what a validation checks before it starts).
  void check_whole() const;
  // The sequence positions of cp rank cp_rank's columns, [seq_len / cp_size].
  std::vector<int64_t> positions(int cp_rank, int cp_size) const;

  DataCursor cursor() const { return cursor_; }
  // A mixture's cursor names each corpus's draws (error: another count of corpora).
  void set_cursor(DataCursor c);
  void rewind();  // back to the order's start

 private:
  struct File {
    io::PositionalFile file;  // read with pread: a file cut short under the run is an error, not SIGBUS
    int64_t tokens = 0;  // the byte offset of the first token of the part read (Split)
    int64_t header = 0;  // the byte offset of the file's first token
    size_t width = 0;  // bytes per token: 1, 2 or 4
    int64_t count = 0;  // tokens of that part
  };
  void add_corpus(const std::string& folder, Split split);
  // Corpus k's permuted j-th sample (its epochs of j / its samples).
  int64_t sample_of(size_t k, uint64_t j) const;
  struct Corpus {
    double weight = 1;  // normalized: the weights sum to 1
    int64_t first = 0, samples = 0;  // its samples are [first, first + samples) of all
  };
  std::vector<Corpus> corpora_;
  std::vector<File> files_;
  std::vector<int64_t> starts_;  // starts_[f]: first sample of file f; back() = total
  int64_t seq_len_;
  uint64_t seed_;
  int64_t num_tokens_ = 0;
  DataCursor cursor_;
};

// Multi-token prediction's tokens for A depths. labels_ahead: next_batch's `ahead` planes
// [A, rows, cols] from whole label rows [rows, seq], the columns `cols` of each (a cp
// rank's zigzag ones). mtp_tokens: from n labels and their A planes ahead, depth k's
// embedding inputs (the token k ahead: the labels, then the planes; 0 past the end, where
// its label is ignored) then its labels (the token k + 1 ahead), each [A, n], into `out`.
void labels_ahead(const int32_t* labels, int64_t rows, int64_t seq, const std::vector<int64_t>& cols,
                  std::span<int32_t> ahead);
void mtp_tokens(std::span<const int32_t> labels, std::span<const int32_t> ahead, std::span<int32_t> out);

}  // namespace mt::data
