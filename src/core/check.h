// Checks that fail with a message a person can act on.
//
//   MT_CHECK(x.dim(1) == w.dim(0)) << "x " << x.str() << " vs w " << w.str();
//
// A failing check throws mt::Error: its `message` is whatever the caller streamed (what
// was expected, what was found, where: shapes, keys, file names), and `where` names the
// statement, file, line and rank. what() is the message first, then [where]. The CLI
// prints the message (and where with --verbose) to stderr and exits non-zero. A check
// with nothing streamed is an internal invariant: its message is "internal error: "
// and where, so the place is printed in any case.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace mt {

struct Error : std::runtime_error {
  Error(const std::string& message, const std::string& where)
      : std::runtime_error(where.empty() ? message : message + " [" + where + "]"), message(message), where(where) {}
  std::string message, where;
};

// The candidate nearest to `word` by edit distance, for "did you mean" in messages.
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

// The rank printed in check messages; set once when the communicator starts.
void set_check_rank(int rank);

class CheckFailure {
 public:
  // `statement` is null for MT_FAIL.
  CheckFailure(const char* statement, const char* file, int line);
  // Throws: the message is complete once the full streaming expression has run.
  ~CheckFailure() noexcept(false);
  template <typename T>
  CheckFailure& operator<<(const T& v) {
    detail_ << v;
    return *this;
  }

 private:
  std::string head_;
  std::ostringstream detail_;
};

}  // namespace mt

#define MT_CHECK(cond) \
  if (cond) {          \
  } else               \
    ::mt::CheckFailure(#cond, __FILE__, __LINE__)

// For errors that are not a failed condition (bad input found while parsing).
#define MT_FAIL() ::mt::CheckFailure(nullptr, __FILE__, __LINE__)
