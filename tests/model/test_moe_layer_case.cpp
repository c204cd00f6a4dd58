// The `moecore moe-layer` case reader against hostile cases (issue 15): every key of layer.json checked for its JSON
// type and range with an Error naming the key, and the input tensors checked against the declared shapes, so a bad
// case fails with a message instead of a SIGFPE, a nlohmann exception or a huge allocation.
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "moecore/model/moe_layer_case.h"
#include "test_util.h"

namespace moecore {
namespace {

const char* kBase = R"("hidden_size": 8, "num_moe_experts": 4, "moe_ffn_hidden_size": 6, "moe_router_topk": 2)";

std::string with(const std::string& extra) {
  return std::string("{") + kBase + (extra.empty() ? "" : ", " + extra) + "}";
}

// The Error message of parsing `text` ("(no error)" when it parses).
std::string parse_error(const std::string& text) {
  try {
    model::moe_layer_case_parse(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_refused(const std::string& text, const std::vector<std::string>& parts) {
  const std::string msg = parse_error(text);
  for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

// Every input tensor the case needs, for T tokens.
std::map<std::string, Tensor> inputs_for(const model::MoeLayerCase& c, int64_t T) {
  const int64_t E = c.cfg.num_experts, fc1 = c.cfg.swiglu ? 2 * c.F : c.F;
  return {{"input.hidden", testing::randn({T, c.H}, "x")},
          {"input.output_grad", testing::randn({T, c.H}, "dy")},
          {"param.router.weight", testing::randn({E, c.H}, "r", 0.1f)},
          {"param.experts.linear_fc1.weight", testing::randn({E, fc1, c.H}, "fc1", 0.1f)},
          {"param.experts.linear_fc2.weight", testing::randn({E, c.H, c.F}, "fc2", 0.1f)}};
}

// Regression (issue 15): "micro_batch_size": 0 reached `T % B` and died of SIGFPE.
TEST(MoeLayerCase, MicroBatchSizeZeroIsAnError) {
  expect_refused(with(R"("micro_batch_size": 0)"), {"'micro_batch_size'", "0", "[1, "});
  expect_refused(with(R"("micro_batch_size": -3)"), {"'micro_batch_size'", "-3"});
  // A case built by hand (not through the parser) is checked again before the division.
  model::MoeLayerCase c = model::moe_layer_case_parse(with(""));
  const auto in = inputs_for(c, 4);
  c.B = 0;
  try {
    model::moe_layer_case_run(c, in, testing::test_device());
    ADD_FAILURE() << "no error for micro_batch_size 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("micro_batch_size (0)"), std::string::npos) << e.what();
  }
}

// params_dtype picks the compute dtype (fp32 masters): fp32, bf16 or fp16; anything else names the value. An fp16
// case runs and gives finite outputs.
TEST(MoeLayerCase, ParamsDtypeSelectsTheComputeDtype) {
  EXPECT_EQ(model::moe_layer_case_parse(with("")).compute, DType::f32);
  EXPECT_EQ(model::moe_layer_case_parse(with(R"("params_dtype": "bf16")")).compute, DType::bf16);
  const model::MoeLayerCase c = model::moe_layer_case_parse(with(R"("params_dtype": "fp16")"));
  EXPECT_EQ(c.compute, DType::f16);
  expect_refused(with(R"("params_dtype": "fp8")"), {"params_dtype 'fp8'", "fp32, bf16 or fp16"});
  const auto out = model::moe_layer_case_run(c, inputs_for(c, 6), testing::test_device());
  ASSERT_FALSE(out.empty());
  for (const auto& [name, t] : out) {
    if (t.dtype() == DType::f32) {
      EXPECT_TRUE(testing::all_finite(t)) << name;
    }
  }
}

TEST(MoeLayerCase, EveryKeyIsCheckedForTypeAndRange) {
  expect_refused(R"({"hidden_size": "8", "num_moe_experts": 4, "moe_ffn_hidden_size": 6})",
                 {"'hidden_size'", "expected an integer"});
  expect_refused(R"({"hidden_size": 8.5, "num_moe_experts": 4, "moe_ffn_hidden_size": 6})", {"'hidden_size'"});
  expect_refused(R"({"hidden_size": 4611686018427387904, "num_moe_experts": 4, "moe_ffn_hidden_size": 6})",
                 {"'hidden_size'", "4611686018427387904"});
  expect_refused(R"({"hidden_size": 18446744073709551615, "num_moe_experts": 4, "moe_ffn_hidden_size": 6})",
                 {"'hidden_size'"});
  expect_refused(R"({"hidden_size": 8, "num_moe_experts": -4, "moe_ffn_hidden_size": 6})", {"'num_moe_experts'"});
  expect_refused(R"({"hidden_size": 8, "moe_ffn_hidden_size": 6})", {"num_moe_experts", "must be set"});
  expect_refused(with(R"("moe_router_topk": 5)"), {"moe-router-topk", "5"});
  expect_refused(with(R"("moe_router_topk": [2])"), {"'moe_router_topk'", "expected an integer"});
  expect_refused(with(R"("gated_linear_unit": 1)"), {"'gated_linear_unit'", "true or false"});
  expect_refused(with(R"("params_dtype": 16)"), {"'params_dtype'", "expected a string"});
  expect_refused(with(R"("moe_router_load_balancing_type": 3)"), {"'moe_router_load_balancing_type'"});
  expect_refused(with(R"("moe_router_load_balancing_type": [])"), {"'moe_router_load_balancing_type'"});
  expect_refused(with(R"("moe_router_load_balancing_type": ["aux_loss", 1])"), {"'moe_router_load_balancing_type'"});
  expect_refused(with(R"("moe_aux_loss_coeff": "0.01")"), {"'moe_aux_loss_coeff'", "expected a number"});
  expect_refused(with(R"("moe_aux_loss_coeff": [1e300])"), {"'moe_aux_loss_coeff'", "finite"});
  expect_refused(with(R"("moe_z_loss_coeff": -1)"), {"'moe_z_loss_coeff'"});
  expect_refused(with(R"("aux_grad_scale": 1e39)"), {"'aux_grad_scale'"});
  expect_refused(with(R"("moe_expert_capacity_factor": 1e30)"), {"'moe_expert_capacity_factor'"});
  expect_refused(with(R"("moe_input_jitter_eps": 2)"), {"moe_input_jitter_eps"});
  expect_refused(with(R"("moe_router_num_groups": 3, "moe_router_group_topk": 1)"), {"num-groups", "3"});
  expect_refused(with(R"("moe_token_drop_policy": "random")"), {"moe_token_drop_policy", "random"});
  expect_refused(with(R"("typo_key": 1)"), {"unknown config key 'typo_key'"});
  expect_refused("[1, 2]", {"not a JSON object"});
  expect_refused("{\"hidden_size\": 8,", {"not valid JSON"});
  expect_refused(std::string(100000, '['), {"deeper than 128"});
  // null keeps the default, as before.
  EXPECT_EQ(model::moe_layer_case_parse(with(R"("micro_batch_size": null)")).B, 1);
}

TEST(MoeLayerCase, InputTensorsMustHaveTheDeclaredShapes) {
  const model::MoeLayerCase c = model::moe_layer_case_parse(with(R"("micro_batch_size": 2)"));
  auto in = inputs_for(c, 6);
  EXPECT_EQ(model::moe_layer_case_run(c, in, testing::test_device()).at("out.output").shape(), Shape({6, 8}));
  auto run_error = [&](std::map<std::string, Tensor> bad) -> std::string {
    try {
      model::moe_layer_case_run(c, bad, testing::test_device());
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  auto missing = in;
  missing.erase("param.experts.linear_fc2.weight");
  EXPECT_NE(run_error(missing).find("'param.experts.linear_fc2.weight' is missing"), std::string::npos);
  auto wrong = in;
  wrong["param.router.weight"] = Tensor::zeros({4, 9}, DType::f32);
  EXPECT_NE(run_error(wrong).find("'param.router.weight' has shape [4, 9], expected [4, 8]"), std::string::npos);
  auto flat = in;
  flat["input.hidden"] = Tensor::zeros({48}, DType::f32);
  EXPECT_NE(run_error(flat).find("'input.hidden' has shape [48]"), std::string::npos);
  auto odd = in;
  odd["input.hidden"] = testing::randn({5, 8}, "x5");
  EXPECT_NE(run_error(odd).find("not divisible by micro_batch_size 2"), std::string::npos);
}

// The fuzzer's seeds (fuzz/seeds/moe_layer_case/: a control byte, then layer.json) must stay valid cases.
TEST(MoeLayerCase, FuzzSeedsAreValidCases) {
  int seen = 0;
  const std::string dir = std::string(MOECORE_SOURCE_DIR) + "/fuzz/seeds/moe_layer_case";
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream f(e.path(), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), {});
    ASSERT_FALSE(bytes.empty()) << e.path();
    EXPECT_NO_THROW(model::moe_layer_case_parse(bytes.substr(1))) << e.path();
    ++seen;
  }
  EXPECT_GE(seen, 3);
}

}  // namespace
}  // namespace moecore
