// The command-line parser: Megatron-style flags, list options, unknown flags with a suggestion, and
// --config files (YAML or JSON) that fill what the command line leaves unset.
#include <filesystem>
#include <fstream>

#include "apps/args.h"
#include "test_util.h"

namespace moecore {
namespace {

apps::Args make() {
  apps::Args a("train");
  a.option("--num-experts", "0", "experts").option("--lr", "1e-3", "lr").flag("--bf16", "bf16");
  a.list_option("--data-path", "prefixes").option("--moe-router-load-balancing-type", "aux_loss", "types");
  return a;
}

std::vector<char*> argv_of(std::vector<std::string>& words) {
  std::vector<char*> v;
  for (auto& w : words) v.push_back(w.data());
  return v;
}

TEST(Args, ParsesValuesFlagsAndLists) {
  std::vector<std::string> w = {"train", "--num-experts", "8", "--bf16",   "--data-path", "0.3",
                                "a",     "0.7",           "b", "--lr=2e-3"};
  auto argv = argv_of(w);
  apps::Args a = make();
  ASSERT_TRUE(a.parse(static_cast<int>(argv.size()), argv.data()));
  EXPECT_EQ(a.i64("--num-experts"), 8);
  EXPECT_TRUE(a.on("--bf16"));
  EXPECT_DOUBLE_EQ(a.f64("--lr"), 2e-3);
  EXPECT_EQ(a.list("--data-path"), (std::vector<std::string>{"0.3", "a", "0.7", "b"}));
}

TEST(Args, UnknownFlagSuggestsTheNearestOne) {
  std::vector<std::string> w = {"train", "--num-expert", "8"};
  auto argv = argv_of(w);
  apps::Args a = make();
  try {
    a.parse(static_cast<int>(argv.size()), argv.data());
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean '--num-experts'"), std::string::npos) << e.what();
  }
}

TEST(Args, ConfigFileFillsUnsetFlagsAndCommandLineWins) {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string yaml = (dir / "moecore_args_test.yaml").string();
  std::ofstream(yaml) << "num_experts: 16\nlr: 5e-4\nbf16: true\ndata-path: [x, y]\n"
                         "moe_router_load_balancing_type: [aux_loss, seq_aux_loss]\n";
  std::vector<std::string> w = {"train", "--config", yaml, "--lr", "1e-2"};
  auto argv = argv_of(w);
  apps::Args a = make();
  ASSERT_TRUE(a.parse(static_cast<int>(argv.size()), argv.data()));
  EXPECT_EQ(a.i64("--num-experts"), 16);
  EXPECT_DOUBLE_EQ(a.f64("--lr"), 1e-2);  // the command line wins
  EXPECT_TRUE(a.on("--bf16"));
  EXPECT_EQ(a.list("--data-path"), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(a.str("--moe-router-load-balancing-type"), "aux_loss,seq_aux_loss");
  const std::string json = (dir / "moecore_args_test.json").string();
  std::ofstream(json) << "{\"num_expertz\": 4}";
  std::vector<std::string> w2 = {"train", "--config", json};
  auto argv2 = argv_of(w2);
  apps::Args b = make();
  try {
    b.parse(static_cast<int>(argv2.size()), argv2.data());
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--num-expertz"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("did you mean '--num-experts'"), std::string::npos) << e.what();
  }
  std::filesystem::remove(yaml);
  std::filesystem::remove(json);
}

}  // namespace
}  // namespace moecore
