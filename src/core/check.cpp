#include "core/check.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace mt {

static int g_check_rank = -1;

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = SIZE_MAX;
  for (const std::string& c : candidates) {
    // Levenshtein distance, one row at a time.
    std::vector<size_t> row(c.size() + 1);
    for (size_t j = 0; j <= c.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= word.size(); ++i) {
      size_t diagonal = row[0]++;
      for (size_t j = 1; j <= c.size(); ++j)
        diagonal = std::exchange(row[j], std::min({row[j] + 1, row[j - 1] + 1, diagonal + (word[i - 1] != c[j - 1])}));
    }
    if (row[c.size()] < best_distance) best_distance = row[c.size()], best = c;
  }
  return best;
}

void set_check_rank(int rank) { g_check_rank = rank; }

CheckFailure::CheckFailure(const char* statement, const char* file, int line) {
  const char* base = std::strstr(file, "src/");
  if (base == nullptr) base = std::strstr(file, "tests/");
  std::ostringstream s;
  if (statement != nullptr) s << "check `" << statement << "` failed ";
  s << "at " << (base ? base : file) << ":" << line;
  if (g_check_rank >= 0) s << " on rank " << g_check_rank;
  head_ = s.str();
}

CheckFailure::~CheckFailure() noexcept(false) {
  std::string d = detail_.str();
  if (d.empty()) throw Error("internal error: " + head_, "");
  throw Error(d, head_);
}

}  // namespace mt
