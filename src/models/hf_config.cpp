#include "models/hf_config.h"

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace mt {

namespace {

const nlohmann::json* find_key(const nlohmann::json& j, HfConfig::Names names) {
  for (const char* n : names) {
    const nlohmann::json* p = &j;
    std::string path(n);
    size_t start = 0;
    while (p != nullptr) {
      size_t dot = path.find('.', start);
      std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      p = p->is_object() && p->contains(part) && !(*p)[part].is_null() ? &(*p)[part] : nullptr;
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    if (p != nullptr) return p;
  }
  return nullptr;
}

}  // namespace

template <typename T>
T HfConfig::read(Names names, const std::optional<T>& fallback) const {
  const nlohmann::json* v = find_key(j_, names);
  std::string list;
  for (const char* n : names) list += list.empty() ? n : std::string(" or ") + n;
  if (v == nullptr) {
    MT_CHECK(fallback.has_value()) << where_ << ": missing key " << list;
    return *fallback;
  }
  try {
    return v->get<T>();
  } catch (const nlohmann::json::exception&) {
    MT_FAIL() << where_ << ": key " << list << " has the wrong type: " << v->dump();
  }
  return T{};
}

int64_t HfConfig::integer(Names n, std::optional<int64_t> f) const { return read(n, f); }
double HfConfig::number(Names n, std::optional<double> f) const { return read(n, f); }
bool HfConfig::flag(Names n, std::optional<bool> f) const { return read(n, f); }
std::string HfConfig::text(Names n, std::optional<std::string> f) const { return read(n, f); }
std::vector<int64_t> HfConfig::integers(Names n, std::optional<std::vector<int64_t>> f) const { return read(n, f); }

}  // namespace mt
