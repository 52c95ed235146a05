#include "cli/args.h"

#include <algorithm>

#include "core/check.h"

namespace mt::cli {

Options::Options(const char* command, const Args& args, std::vector<std::string> known) : command_(command) {
  auto spec = [&](std::string_view name) -> const std::string* {
    for (const std::string& k : known) {
      std::string_view base(k);
      if (base.ends_with('*') || base.ends_with('?')) base.remove_suffix(1);
      if (base == name) return &k;
    }
    return nullptr;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    MT_CHECK(a.starts_with("--")) << "moetrain " << command_ << ": unexpected argument '" << a
                                  << "' (options start with --; see --help)";
    a.remove_prefix(2);
    std::string value;
    bool inline_value = false;
    if (size_t eq = a.find('='); eq != std::string_view::npos) {
      value = std::string(a.substr(eq + 1));
      a = a.substr(0, eq);
      inline_value = true;
    }
    std::string name(a);
    // The value after '=', else the next argument.
    auto one_value = [&] {
      if (inline_value) return value;
      MT_CHECK(i + 1 < args.size()) << "moetrain " << command_ << ": --" << name << " needs a value";
      return std::string(args[++i]);
    };
    if (name.find('.') != std::string::npos) {
      dotted_.emplace_back(name, one_value());
      continue;
    }
    const std::string* s = spec(name);
    MT_CHECK(s != nullptr) << "moetrain " << command_ << ": unknown option --" << name << " (see --help)";
    std::vector<std::string> vals;
    if (s->ends_with('?')) {
      MT_CHECK(!inline_value) << "moetrain " << command_ << ": --" << name << " takes no value";
    } else if (s->ends_with('*') && !inline_value) {
      while (i + 1 < args.size() && !args[i + 1].starts_with("--")) vals.emplace_back(args[++i]);
      MT_CHECK(!vals.empty()) << "moetrain " << command_ << ": --" << name << " needs at least one value";
    } else {
      vals.push_back(one_value());
    }
    values_.emplace_back(name, std::move(vals));
  }
}

bool Options::has(std::string_view name) const {
  return std::any_of(values_.begin(), values_.end(), [&](const auto& v) { return v.first == name; });
}

std::string Options::get(std::string_view name, std::string_view fallback) const {
  for (auto it = values_.rbegin(); it != values_.rend(); ++it)
    if (it->first == name) return it->second.empty() ? std::string() : it->second.back();
  return std::string(fallback);
}

std::string Options::required(std::string_view name) const {
  MT_CHECK(has(name)) << "moetrain " << command_ << ": --" << name << " is required (see --help)";
  return get(name);
}

std::vector<std::string> Options::list(std::string_view name) const {
  std::vector<std::string> out;
  for (const auto& v : values_)
    if (v.first == name) out.insert(out.end(), v.second.begin(), v.second.end());
  return out;
}

}  // namespace mt::cli
