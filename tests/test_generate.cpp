// The generate command: greedy continuations equal transformers' greedy generate on
// the fixtures (tests/fixtures/*/generate.json, by make_generate_fixtures.py, whose
// prompts keep every step's top-2 logit gap far above fp32 noise), seeded sampling
// repeats, a vanishing top-p is greedy, and bad arguments are errors naming them.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "io/file.h"
#include "test_util.h"

namespace mt {
namespace {

const auto run = test::run_command;

std::string fixture(const std::string& name) { return std::string(MOETRAIN_FIXTURES) + "/" + name; }

// The ids on the last line of a generate run's output.
std::vector<int64_t> new_ids(const std::string& out) {
  std::string s = out.substr(0, out.find_last_not_of('\n') + 1);
  nlohmann::json j = nlohmann::json::parse(s.substr(s.rfind('\n') + 1), nullptr, false);
  EXPECT_TRUE(j.is_array()) << out;
  return j.is_array() ? j.get<std::vector<int64_t>>() : std::vector<int64_t>{};
}

std::string generate(const std::string& model, const std::string& flags) {
  return std::string(MOETRAIN_BIN) + " generate --model " + model + " " + flags;
}

std::string ids_flag(const std::vector<int64_t>& ids) {
  std::string s = "--prompt-ids ";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

TEST(GenerateCommand, GreedyMatchesTransformers) {
  for (const char* name : {"qwen3_moe_a", "deepseek_v2_a", "gpt_oss_a", "qwen3_5_moe_a", "qwen3_5_moe_b"}) {
    std::vector<uint8_t> b = io::read_file(fixture(std::string(name) + "/generate.json"));
    nlohmann::json want = nlohmann::json::parse(b.begin(), b.end());
    ASSERT_GE(want["min_top2_margin"].get<double>(), 1e-2) << name;
    auto [rc, out] = run(generate(fixture(name), ids_flag(want["prompt_ids"].get<std::vector<int64_t>>()) +
                                                     " --temperature 0 --max-new-tokens 8"));
    ASSERT_EQ(rc, 0) << name << ": " << out;
    EXPECT_EQ(new_ids(out), want["new_ids"].get<std::vector<int64_t>>()) << name;
  }
}

// A number that follows `key` in the output.
int64_t after(const std::string& out, const std::string& key) {
  const size_t at = out.find(key);
  EXPECT_NE(at, std::string::npos) << key << " not in: " << out;
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + key.size()));
}

// The experts in host memory, a few on the device in lines of one expert: the same
// tokens as transformers. One slot finds nothing on the device (each use loads its
// expert); slots for every expert load each at most once, whatever the uses.
TEST(GenerateCommand, OffloadedExpertsGiveTheSameTokens) {
  for (const char* name : {"qwen3_moe_a", "deepseek_v2_a", "gpt_oss_a"}) {
    std::vector<uint8_t> b = io::read_file(fixture(std::string(name) + "/generate.json"));
    nlohmann::json want = nlohmann::json::parse(b.begin(), b.end());
    std::vector<uint8_t> cb = io::read_file(fixture(std::string(name) + "/config.json"));
    nlohmann::json c = nlohmann::json::parse(cb.begin(), cb.end());
    const int64_t experts = c.contains("n_routed_experts") ? c["n_routed_experts"].get<int64_t>()
                                                           : c["num_local_experts"].get<int64_t>();
    const int64_t all = experts * c["num_hidden_layers"].get<int64_t>();
    for (int64_t slots : {int64_t{1}, int64_t{3}, all}) {
      auto [rc, out] = run(generate(fixture(name), ids_flag(want["prompt_ids"].get<std::vector<int64_t>>()) +
                                                       " --temperature 0 --max-new-tokens 8 --offload-experts " +
                                                       std::to_string(slots)));
      ASSERT_EQ(rc, 0) << name << ": " << out;
      EXPECT_EQ(new_ids(out), want["new_ids"].get<std::vector<int64_t>>()) << name << " " << slots;
      const int64_t uses = after(out, "slots: "), hits = after(out, "experts used, "), loads = after(out, "on the device; ");
      EXPECT_GT(uses, all) << name << ": " << out;  // 8 forwards, each over most experts
      if (slots == 1) {
        EXPECT_EQ(hits, 0) << name << ": " << out;
        EXPECT_EQ(loads, uses) << name << ": " << out;
      } else if (slots == all) {
        EXPECT_LE(loads, all) << name << ": " << out;
        EXPECT_GE(hits, uses - loads) << name << ": " << out;
      }
    }
  }
}

TEST(GenerateCommand, SamplingRepeatsForASeed) {
  const std::string model = fixture("qwen3_moe_a"), prompt = ids_flag({77, 9, 29, 30, 78, 3});
  auto ids = [&](const std::string& flags) {
    auto [rc, out] = run(generate(model, prompt + " --max-new-tokens 8 " + flags));
    EXPECT_EQ(rc, 0) << out;
    std::vector<int64_t> got = new_ids(out);
    EXPECT_EQ(got.size(), 8u) << out;
    for (int64_t id : got) EXPECT_TRUE(id >= 0 && id < 96) << out;
    return got;
  };
  const std::vector<int64_t> greedy = ids("--temperature 0");
  const std::vector<int64_t> a = ids("--temperature 1 --seed 5"), b = ids("--temperature 1 --seed 5");
  EXPECT_EQ(a, b);
  EXPECT_NE(a, greedy);  // at temperature 1 over 96 ids, 8 draws are not all the argmax
  EXPECT_NE(ids("--temperature 1 --seed 6"), a);
  // Only the most likely id is left in the nucleus: greedy, whatever the temperature.
  EXPECT_EQ(ids("--temperature 1.5 --top-p 1e-6 --seed 5"), greedy);
  EXPECT_EQ(ids("--temperature 0.7 --top-p 0.9 --seed 3"), ids("--temperature 0.7 --top-p 0.9 --seed 3"));
}

TEST(GenerateCommand, BadArgumentsAreNamed) {
  const std::string model = fixture("qwen3_moe_a");
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--prompt hello", "has no tokenizer.json to encode --prompt with"},
           {"--prompt-ids 1,x,3", "--prompt-ids expects ids in [0, 96)"},
           {"--prompt-ids 1,96", "got '96'"},
           {"--prompt-ids 1 --top-p 0", "--top-p should be a number in [1e-09, 1], got '0'"},
           {"--prompt-ids 1 --temperature -1", "--temperature should be a number in [0, 1e+06], got '-1'"},
           {"--prompt-ids 1 --max-new-tokens two", "--max-new-tokens should be an integer in [0, 16777216], got 'two'"},
           {"", "give one of --prompt TEXT and --prompt-ids"},
       }) {
    auto [rc, out] = run(generate(model, flags));
    EXPECT_EQ(rc, 1) << flags;
    EXPECT_NE(out.find(message), std::string::npos) << flags << ": " << out;
  }
  auto [rc, out] = run(generate(fixture("no_such_model"), "--prompt-ids 1"));
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("no_such_model is not a folder"), std::string::npos) << out;
}

}  // namespace
}  // namespace mt
