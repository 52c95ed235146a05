// Reading a Hugging Face config.json, for every model's parse function: each field
// under any of its spellings (the hub's and transformers 5's; "a.b" names a nested key,
// and null counts as absent), with errors that name the file and every spelling.
//
//   HfConfig hf(j, "path/config.json");
//   c.rope_theta = hf.number({"rope_theta", "rope_parameters.rope_theta"}, 10000.0);
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kernels/rope.h"

namespace mt {

constexpr int64_t kMaxConfigInteger = int64_t{1} << 24;

class HfConfig {
 public:
  HfConfig(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

  // The first spelling present; without a fallback, an error when none is. Integers
  // are sizes, counts or layer indices: outside [0, kMaxConfigInteger] an error.
  using Names = std::initializer_list<const char*>;
  int64_t integer(Names names, std::optional<int64_t> fallback = {}) const;
  double number(Names names, std::optional<double> fallback = {}) const;
  bool flag(Names names, std::optional<bool> fallback = {}) const;
  std::string text(Names names, std::optional<std::string> fallback = {}) const;
  std::vector<int64_t> integers(Names names, std::optional<std::vector<int64_t>> fallback = {}) const;

 private:
  template <typename T>
  T read(Names names, const std::optional<T>& fallback) const;

  const nlohmann::json& j_;
  std::string where_;
};

// The JSON object in the file at `path` (an error naming the file where it holds none).
nlohmann::json read_json_object(const std::string& path);

// The rope of `rotary_dim` dims: rope_theta, and rope_parameters / rope_scaling of type
// default or yarn (factor, beta_fast, beta_slow, original_max_position_embeddings,
// attention_factor, mscale, mscale_all_dim, truncate); another type is an error.
cpu::RopeConfig read_rope(const HfConfig& hf, int64_t rotary_dim);

// config.json's max_position_embeddings, the positions the model was made for (0 when
// it gives none): train, eval and generate hold sequences to it.
int64_t max_position_embeddings(const std::string& config_json);

// DeepSeek-V2's config.json asking for its sequence-level balance loss: seq_aux and the
// weight aux_loss_alpha (false and 0 where absent).
struct SequenceBalance {
  bool seq_aux = false;
  double alpha = 0;
};
SequenceBalance sequence_balance(const std::string& config_json);

}  // namespace mt
