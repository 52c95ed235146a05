#include "train/config.h"

#include <toml++/toml.h>

#include <cmath>
#include <sstream>

#include "core/check.h"

namespace mt {

namespace {

// Calls f(section, key, field) for every key: the one list that parsing, overrides
// and printing share.
template <typename F>
void visit(Config& c, F&& f) {
  f("job", "dump_folder", c.job.dump_folder);
  f("model", "init", c.model.init);
  f("model", "config", c.model.config);
  f("model", "init_std", c.model.init_std);
  f("data", "tokens", c.data.tokens);
  f("data", "corpus", c.data.corpus);
  f("data", "seq_len", c.data.seq_len);
  f("training", "steps", c.training.steps);
  f("training", "global_batch_size", c.training.global_batch_size);
  f("training", "micro_batch_size", c.training.micro_batch_size);
  f("training", "clip_grad_norm", c.training.clip_grad_norm);
  f("training", "seed", c.training.seed);
  f("training", "device", c.training.device);
  f("training", "fp8", c.training.fp8);
  f("training", "fp8_scale", c.training.fp8_scale);
  f("training", "load_balance_coef", c.training.load_balance_coef);
  f("training", "load_balance_type", c.training.load_balance_type);
  f("training", "capacity_factor", c.training.capacity_factor);
  f("training", "force_balanced_routing", c.training.force_balanced_routing);
  f("optimizer", "name", c.optimizer.name);
  f("optimizer", "lr", c.optimizer.lr);
  f("optimizer", "beta1", c.optimizer.beta1);
  f("optimizer", "beta2", c.optimizer.beta2);
  f("optimizer", "eps", c.optimizer.eps);
  f("optimizer", "weight_decay", c.optimizer.weight_decay);
  f("optimizer", "decay", c.optimizer.decay);
  f("optimizer", "state_dtype", c.optimizer.state_dtype);
  f("lr_scheduler", "warmup_steps", c.lr_scheduler.warmup_steps);
  f("lr_scheduler", "decay", c.lr_scheduler.decay);
  f("lr_scheduler", "min_lr_ratio", c.lr_scheduler.min_lr_ratio);
  f("lr_scheduler", "decay_ratio", c.lr_scheduler.decay_ratio);
  f("parallelism", "pp", c.parallelism.pp);
  f("parallelism", "cp", c.parallelism.cp);
  f("parallelism", "ep", c.parallelism.ep);
  f("parallelism", "zero3", c.parallelism.zero3);
  f("parallelism", "pipeline_schedule", c.parallelism.pipeline_schedule);
  f("checkpoint", "interval", c.checkpoint.interval);
  f("checkpoint", "save_final", c.checkpoint.save_final);
  f("checkpoint", "keep", c.checkpoint.keep);
  f("checkpoint", "load", c.checkpoint.load);
  f("metrics", "log_interval", c.metrics.log_interval);
  f("metrics", "profile", c.metrics.profile);
  f("metrics", "tensorboard", c.metrics.tensorboard);
}

template <typename T>
const char* type_name() {
  if constexpr (std::is_same_v<T, std::string>) return "a string";
  else if constexpr (std::is_same_v<T, bool>) return "true or false";
  else if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  else return "a number";
}

// One TOML value into a field; `where` is "FILE: [section] key" for messages.
template <typename T>
void set_from_toml(const toml::node& n, T& field, const std::string& where) {
  if constexpr (std::is_same_v<T, std::string>) {
    auto v = n.value<std::string>();
    MT_CHECK(v && n.is_string()) << where << " should be " << type_name<T>();
    field = *v;
  } else if constexpr (std::is_same_v<T, bool>) {
    MT_CHECK(n.is_boolean()) << where << " should be " << type_name<T>();
    field = *n.value<bool>();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    MT_CHECK(n.is_integer()) << where << " should be " << type_name<T>();
    field = *n.value<int64_t>();
  } else {
    MT_CHECK(n.is_number()) << where << " should be " << type_name<T>();
    field = *n.value<double>();
  }
}

// A command-line value: strings are taken as written, the rest parsed strictly.
template <typename T>
void set_from_text(const std::string& text, T& field, const std::string& where) {
  if constexpr (std::is_same_v<T, std::string>) {
    field = text;
  } else if constexpr (std::is_same_v<T, bool>) {
    MT_CHECK(text == "true" || text == "false") << where << " should be " << type_name<T>() << ", got '" << text << "'";
    field = text == "true";
  } else {
    std::istringstream s(text);
    T v{};
    s >> v;
    MT_CHECK(!text.empty() && !s.fail() && s.eof()) << where << " should be " << type_name<T>() << ", got '" << text << "'";
    field = v;
  }
}

void check_one_of(const std::string& value, std::initializer_list<const char*> allowed, const char* key) {
  std::string list;
  for (const char* a : allowed) {
    if (value == a) return;
    list += list.empty() ? a : std::string(", ") + a;
  }
  MT_FAIL() << key << " should be one of " << list << ", got '" << value << "'";
}

void validate(const Config& c) {
  MT_CHECK(c.model.init == "random" || c.model.init.starts_with("hf:"))
      << "model.init should be 'random' or 'hf:DIR', got '" << c.model.init << "'";
  check_one_of(c.training.device, {"cpu", "cuda"}, "training.device");
  check_one_of(c.training.fp8, {"none", "blockwise"}, "training.fp8");
  check_one_of(c.training.fp8_scale, {"pow2", "fp32"}, "training.fp8_scale");
  check_one_of(c.training.load_balance_type, {"micro_batch", "global_batch"}, "training.load_balance_type");
  check_one_of(c.parallelism.pipeline_schedule, {"auto", "dualpipev", "1f1b"}, "parallelism.pipeline_schedule");
  check_one_of(c.optimizer.name, {"adamw"}, "optimizer.name");
  check_one_of(c.optimizer.decay, {"matrices", "all"}, "optimizer.decay");
  check_one_of(c.optimizer.state_dtype, {"fp32", "bf16"}, "optimizer.state_dtype");
  check_one_of(c.lr_scheduler.decay, {"constant", "linear", "cosine", "wsd"}, "lr_scheduler.decay");
  MT_CHECK(c.training.steps >= 0) << "training.steps should be >= 0, got " << c.training.steps;
  MT_CHECK(c.training.global_batch_size >= 0 && c.training.micro_batch_size >= 0)
      << "training.global_batch_size and micro_batch_size should be >= 0, got " << c.training.global_batch_size
      << " and " << c.training.micro_batch_size;
  MT_CHECK(c.optimizer.lr >= 0) << "optimizer.lr should be >= 0, got " << c.optimizer.lr;
  MT_CHECK(c.optimizer.beta1 >= 0 && c.optimizer.beta1 < 1 && c.optimizer.beta2 >= 0 && c.optimizer.beta2 < 1)
      << "optimizer.beta1 and beta2 should be in [0, 1), got " << c.optimizer.beta1 << " and " << c.optimizer.beta2;
  MT_CHECK(c.training.clip_grad_norm >= 0) << "training.clip_grad_norm should be >= 0, got " << c.training.clip_grad_norm;
  MT_CHECK(c.lr_scheduler.warmup_steps >= 0) << "lr_scheduler.warmup_steps should be >= 0";
  MT_CHECK(c.lr_scheduler.min_lr_ratio >= 0 && c.lr_scheduler.min_lr_ratio <= 1)
      << "lr_scheduler.min_lr_ratio should be in [0, 1], got " << c.lr_scheduler.min_lr_ratio;
  MT_CHECK(c.lr_scheduler.decay_ratio > 0 && c.lr_scheduler.decay_ratio <= 1)
      << "lr_scheduler.decay_ratio should be in (0, 1], got " << c.lr_scheduler.decay_ratio;
  MT_CHECK(c.parallelism.pp >= 1 && c.parallelism.cp >= 1 && c.parallelism.ep >= 1)
      << "parallelism.pp, cp and ep should be >= 1, got " << c.parallelism.pp << ", " << c.parallelism.cp << ", "
      << c.parallelism.ep;
  MT_CHECK(!c.parallelism.zero3 || c.parallelism.pp == 1)
      << "parallelism.zero3 with parallelism.pp > 1 is not supported (pipeline stages would gather other ranks' layers)";
  MT_CHECK(c.data.tokens.empty() || c.data.corpus.empty())
      << "data.tokens and data.corpus are both set; choose one";
  MT_CHECK(c.metrics.log_interval >= 1) << "metrics.log_interval should be >= 1";
  MT_CHECK(c.checkpoint.interval >= 0 && c.checkpoint.keep >= 1)
      << "checkpoint.interval should be >= 0 and checkpoint.keep >= 1";
}

}  // namespace

Config load_config(const std::string& toml_path, const std::vector<std::pair<std::string, std::string>>& overrides) {
  Config c;
  if (!toml_path.empty()) {
    toml::table t;
    try {
      t = toml::parse_file(toml_path);
    } catch (const toml::parse_error& e) {
      MT_FAIL() << toml_path << ":" << e.source().begin.line << ":" << e.source().begin.column << ": "
                << e.description();
    }
    for (auto&& [section, node] : t) {
      std::string sec(section.str());
      MT_CHECK(node.is_table()) << toml_path << ": '" << sec << "' should be a [section]";
      for (auto&& [key, value] : *node.as_table()) {
        std::string k(key.str());
        bool found = false;
        visit(c, [&](const char* s, const char* name, auto& field) {
          if (sec == s && k == name) {
            set_from_toml(value, field, toml_path + ": [" + sec + "] " + k);
            found = true;
          }
        });
        MT_CHECK(found) << toml_path << ": unknown key [" << sec << "] " << k;
      }
    }
  }
  for (const auto& [dotted, text] : overrides) {
    bool found = false;
    visit(c, [&](const char* s, const char* name, auto& field) {
      if (dotted == std::string(s) + "." + name) {
        set_from_text(text, field, "--" + dotted);
        found = true;
      }
    });
    MT_CHECK(found) << "unknown option --" << dotted << " (no key '" << dotted << "' in any config section)";
  }
  validate(c);
  return c;
}

std::string config_to_toml(const Config& c) {
  std::ostringstream s;
  std::string current;
  Config copy = c;
  visit(copy, [&](const char* sec, const char* name, auto& field) {
    if (current != sec) {
      s << (current.empty() ? "" : "\n") << "[" << sec << "]\n";
      current = sec;
    }
    using T = std::decay_t<decltype(field)>;
    s << name << " = ";
    if constexpr (std::is_same_v<T, std::string>) s << toml::value<std::string>(field);
    else if constexpr (std::is_same_v<T, bool>) s << (field ? "true" : "false");
    else if constexpr (std::is_same_v<T, int64_t>) s << field;
    else s << toml::value<double>(field);
    s << "\n";
  });
  return s.str();
}

double lr_at(const Config& c, int64_t step) {
  const SchedulerConfig& s = c.lr_scheduler;
  double lr = c.optimizer.lr, floor = lr * s.min_lr_ratio;
  if (step < s.warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  int64_t total = c.training.steps;
  if (s.decay == "constant") return lr;
  if (s.decay == "wsd") {
    // Warmup, a stable plateau, then linear decay over the last decay_ratio of steps.
    int64_t decay_steps = std::max<int64_t>(1, static_cast<int64_t>(std::llround(s.decay_ratio * total)));
    int64_t start = std::max(s.warmup_steps, total - decay_steps);
    if (step < start) return lr;
    double p = static_cast<double>(step - start + 1) / static_cast<double>(total - start);
    return lr + (floor - lr) * std::min(1.0, p);
  }
  int64_t span = total - s.warmup_steps;
  double p = span <= 1 ? 1.0 : static_cast<double>(step - s.warmup_steps) / static_cast<double>(span - 1);
  p = std::min(1.0, std::max(0.0, p));
  if (s.decay == "linear") return lr + (floor - lr) * p;
  return floor + (lr - floor) * 0.5 * (1.0 + std::cos(3.141592653589793 * p));  // cosine
}

}  // namespace mt
