#include "models/hf_config.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "core/check.h"
#include "io/file.h"

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

// An integer of config.json: one written with a fraction part or an exponent (4096.0,
// 1e6) is taken when it is whole. nlohmann would convert any number, and one past int64's
// range is undefined behaviour (fuzz_hf_config found 2.5e95).
int64_t whole_number(const nlohmann::json& v, const std::string& where, const std::string& list) {
  if (!v.is_number_float()) return v.get<int64_t>();  // a type_error for what is not a number
  const double d = v.get<double>();
  MT_CHECK(std::isfinite(d) && d == std::floor(d) && std::fabs(d) <= 9.0e15)
      << where << ": key " << list << " = " << v.dump() << " should be a whole number";
  return static_cast<int64_t>(d);
}

}  // namespace

template <typename T>
T HfConfig::read(Names names, const std::optional<T>& fallback) const {
  const nlohmann::json* v = find_key(j_, names);
  std::string list;
  for (const char* n : names) list += list.empty() ? n : std::string(" or ") + n;
  if (v == nullptr) {
    MT_CHECK(fallback.has_value()) << where_ << ": missing key " << list << " (absent or null)";
    return *fallback;
  }
  try {
    if constexpr (std::is_same_v<T, int64_t>) {
      return whole_number(*v, where_, list);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      MT_CHECK(v->is_array()) << where_ << ": key " << list << " has the wrong type: " << v->dump();
      T out;
      for (const nlohmann::json& e : *v) out.push_back(whole_number(e, where_, list));
      return out;
    } else {
      return v->get<T>();
    }
  } catch (const nlohmann::json::exception&) {
    MT_FAIL() << where_ << ": key " << list << " has the wrong type: " << v->dump();
  }
  return T{};
}

// Every integer a model reads is a size, a count or a layer index: bounded, so that the
// sizes' products fit in 64 bits and no loop over layers runs for ever.
static int64_t bounded(int64_t v, HfConfig::Names names, const std::string& where) {
  if (v >= 0 && v <= kMaxConfigInteger) return v;
  std::string list;
  for (const char* n : names) list += list.empty() ? n : std::string(" or ") + n;
  MT_FAIL() << where << ": key " << list << " = " << v << " is out of range (expected a size or count in [0, 2^24])";
  return 0;
}

int64_t HfConfig::integer(Names n, std::optional<int64_t> f) const { return bounded(read(n, f), n, where_); }
double HfConfig::number(Names n, std::optional<double> f) const { return read(n, f); }
bool HfConfig::flag(Names n, std::optional<bool> f) const { return read(n, f); }
std::string HfConfig::text(Names n, std::optional<std::string> f) const { return read(n, f); }
std::vector<int64_t> HfConfig::integers(Names n, std::optional<std::vector<int64_t>> f) const {
  std::vector<int64_t> v = read(n, f);
  for (int64_t& x : v) x = bounded(x, n, where_);
  return v;
}

cpu::RopeConfig read_rope(const HfConfig& hf, int64_t rotary_dim) {
  cpu::RopeConfig r;
  r.rotary_dim = rotary_dim;
  r.theta = hf.number({"rope_parameters.rope_theta", "rope_theta"}, 10000.0);
  const std::string type =
      hf.text({"rope_parameters.rope_type", "rope_scaling.rope_type", "rope_scaling.type"}, "default");
  if (type == "default") return r;
  MT_CHECK(type == "yarn") << hf.where() << ": rope type '" << type << "' is not supported (default or yarn)";
  r.yarn = true;
  const double max_position = hf.number({"max_position_embeddings"}, 0.0);
  r.original_max_position = hf.number(
      {"rope_parameters.original_max_position_embeddings", "rope_scaling.original_max_position_embeddings"},
      max_position);
  // transformers: a missing factor stretches the original context to max_position_embeddings
  r.factor = hf.number({"rope_parameters.factor", "rope_scaling.factor"},
                       r.original_max_position > 0 ? max_position / r.original_max_position : 0.0);
  r.beta_fast = hf.number({"rope_parameters.beta_fast", "rope_scaling.beta_fast"}, 32.0);
  r.beta_slow = hf.number({"rope_parameters.beta_slow", "rope_scaling.beta_slow"}, 1.0);
  r.attention_factor = hf.number({"rope_parameters.attention_factor", "rope_scaling.attention_factor"}, 0.0);
  r.mscale = hf.number({"rope_parameters.mscale", "rope_scaling.mscale"}, 0.0);
  r.mscale_all_dim = hf.number({"rope_parameters.mscale_all_dim", "rope_scaling.mscale_all_dim"}, 0.0);
  r.truncate = hf.flag({"rope_parameters.truncate", "rope_scaling.truncate"}, true);
  return r;
}

nlohmann::json read_json_object(const std::string& path) {
  const std::vector<uint8_t> b = io::read_file(path);
  nlohmann::json j = nlohmann::json::parse(b.begin(), b.end(), nullptr, false);
  MT_CHECK(j.is_object()) << path << ": not a JSON object";
  return j;
}

int64_t max_position_embeddings(const std::string& config_json) {
  const nlohmann::json j = read_json_object(config_json);
  return HfConfig(j, config_json).integer({"max_position_embeddings"}, 0);
}

SequenceBalance sequence_balance(const std::string& config_json) {
  const nlohmann::json j = read_json_object(config_json);
  const HfConfig hf(j, config_json);
  return {hf.flag({"seq_aux"}, false), hf.number({"aux_loss_alpha"}, 0.0)};
}

}  // namespace mt
