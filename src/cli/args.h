// Command-line options for one subcommand: `--key value`, `--key=value`, bare flags
// and repeated values (`--input a b c`). Unknown options are an error naming them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mt::cli {

using Args = std::vector<std::string_view>;

class Options {
 public:
  // `known` lists the accepted option names without dashes; a name ending in '*'
  // takes every value up to the next option (--input a b c), a name ending in '?'
  // is a flag with no value.
  Options(const char* command, const Args& args, std::vector<std::string> known);

  bool has(std::string_view name) const;
  // The value of a single-valued option; `fallback` when absent. required() throws
  // an error naming the command and the option when it is missing.
  std::string get(std::string_view name, std::string_view fallback = {}) const;
  std::string required(std::string_view name) const;
  // Numbers: `fallback` when absent; an error naming the option and the range when the
  // value is not an integer (a finite number) within [lo, hi].
  int64_t integer(std::string_view name, int64_t fallback, int64_t lo = INT64_MIN, int64_t hi = INT64_MAX) const;
  double number(std::string_view name, double fallback, double lo, double hi) const;
  std::vector<std::string> list(std::string_view name) const;
  // Options of the form --section.key=value (or --section.key value), in order:
  // the train and plan commands pass them on as config overrides.
  const std::vector<std::pair<std::string, std::string>>& dotted() const { return dotted_; }

 private:
  std::string command_;
  std::vector<std::pair<std::string, std::vector<std::string>>> values_;
  std::vector<std::pair<std::string, std::string>> dotted_;
};

}  // namespace mt::cli
