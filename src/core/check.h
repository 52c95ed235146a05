// Checks that fail with a message a person can act on.
//
//   MT_CHECK(x.dim(1) == w.dim(0)) << "x " << x.str() << " vs w " << w.str();
//
// A failing check throws mt::Error whose text names the statement, file, line and
// rank, followed by whatever the caller streamed (shapes, keys, file names). The CLI
// catches it, prints it to stderr and exits non-zero; tests can expect it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mt {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The rank printed in check messages; set once when the communicator starts.
void set_check_rank(int rank);
int check_rank();

class CheckFailure {
 public:
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
#define MT_FAIL() ::mt::CheckFailure("failed", __FILE__, __LINE__)
