#include "core/check.h"

#include <cstring>

namespace mt {

static int g_check_rank = -1;

void set_check_rank(int rank) { g_check_rank = rank; }
int check_rank() { return g_check_rank; }

CheckFailure::CheckFailure(const char* statement, const char* file, int line) {
  const char* base = std::strstr(file, "src/");
  if (base == nullptr) base = std::strstr(file, "tests/");
  std::ostringstream s;
  s << "check `" << statement << "` failed at " << (base ? base : file) << ":" << line;
  if (g_check_rank >= 0) s << " on rank " << g_check_rank;
  head_ = s.str();
}

CheckFailure::~CheckFailure() noexcept(false) {
  std::string d = detail_.str();
  throw Error(d.empty() ? head_ : head_ + ": " + d);
}

}  // namespace mt
