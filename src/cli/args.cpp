#include "cli/args.h"

#include <algorithm>
#include <charconv>

#include "core/check.h"

namespace mt::cli {

Options::Options(const char* command, const Args& args, std::vector<std::string> known) : command_(command) {
  auto base = [](const std::string& k) { return k.substr(0, k.find_first_of("*?")); };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    MT_CHECK(a.starts_with("--")) << "unexpected argument '" << a << "': options start with -- (moetrain "
                                  << command_ << " --help lists them)";
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
      MT_CHECK(i + 1 < args.size()) << "--" << name << " needs a value (--" << name << "=VALUE)";
      return std::string(args[++i]);
    };
    if (name.find('.') != std::string::npos) {
      dotted_.emplace_back(name, one_value());
      continue;
    }
    const auto s = std::find_if(known.begin(), known.end(), [&](const std::string& k) { return base(k) == name; });
    if (s == known.end()) {
      std::vector<std::string> names;
      for (const std::string& k : known) names.push_back(base(k));
      MT_FAIL() << "unknown option --" << name << "; did you mean --" << closest(name, names) << "? (moetrain "
                << command_ << " --help lists the options)";
    }
    std::vector<std::string> vals;
    if (s->ends_with('?')) {
      MT_CHECK(!inline_value) << "--" << name << " is a flag and takes no value; write --" << name << " alone";
    } else if (s->ends_with('*') && !inline_value) {
      while (i + 1 < args.size() && !args[i + 1].starts_with("--")) vals.emplace_back(args[++i]);
      MT_CHECK(!vals.empty()) << "--" << name << " needs at least one value";
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
  MT_CHECK(has(name)) << "--" << name << " is required (moetrain " << command_ << " --help describes it)";
  return get(name);
}

namespace {

// from_chars, unlike stoll and stod, neither throws nor accepts "3x"; out-of-range
// values come back as errors too.
template <typename T>
T parse_number(const Options& o, std::string_view name, T fallback, T lo, T hi) {
  if (!o.has(name)) return fallback;
  const std::string text = o.get(name);
  T v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  MT_CHECK(ec == std::errc() && end == text.data() + text.size() && !text.empty() && v >= lo && v <= hi)
      << "--" << name << " should be " << (std::is_integral_v<T> ? "an integer" : "a number") << " in [" << lo << ", "
      << hi << "], got '" << text << "'";
  return v;
}

}  // namespace

int64_t Options::integer(std::string_view name, int64_t fallback, int64_t lo, int64_t hi) const {
  return parse_number(*this, name, fallback, lo, hi);
}

double Options::number(std::string_view name, double fallback, double lo, double hi) const {
  return parse_number(*this, name, fallback, lo, hi);
}

std::vector<std::string> Options::list(std::string_view name) const {
  std::vector<std::string> out;
  for (const auto& v : values_)
    if (v.first == name) out.insert(out.end(), v.second.begin(), v.second.end());
  return out;
}

}  // namespace mt::cli
