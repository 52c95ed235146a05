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
  // An integer option: `fallback` when absent, an error naming it when not an integer.
  int64_t integer(std::string_view name, int64_t fallback) const;
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
