// The MoE layer against golden cases written by tools/moe_reference.py (PyTorch autograd, float64): for each
// tests/golden/moe_*.safetensors, the output, routing map and probabilities, every loss and every gradient.
// The layer runs on testing::test_device(); moe_layer_case_run returns host copies.
#include <filesystem>
#include <string>

#include "moecore/io/safetensors.h"
#include "moecore/model/moe_layer_case.h"
#include "test_util.h"

namespace moecore {
namespace {

std::vector<std::string> golden_cases() {
  std::vector<std::string> out;
  const std::filesystem::path dir = std::filesystem::path(MOECORE_SOURCE_DIR) / "tests" / "golden";
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("moe_", 0) == 0 && e.path().extension() == ".safetensors") out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

class MoeLayerGolden : public ::testing::TestWithParam<std::string> {};

// fp32 layer against the float64 reference. Tolerances: outputs and probabilities rtol 1e-4 / atol 1e-5;
// gradients rtol 1e-3 with atol 1e-4 * rms(reference) (float32 sums over tokens and experts); losses 1e-5
// relative; the routing map must match exactly.
TEST_P(MoeLayerGolden, MatchesReference) {
  const io::SafetensorsFile f = io::safetensors_load(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/" + GetParam());
  const model::MoeLayerCase c = model::moe_layer_case_parse(f.metadata.at("config"));
  std::map<std::string, Tensor> inputs;
  for (const auto& [name, t] : f.tensors)
    if (name.rfind("input.", 0) == 0 || name.rfind("param.", 0) == 0) inputs[name] = t;
  const auto out = model::moe_layer_case_run(c, inputs, testing::test_device());
  int compared = 0;
  for (const auto& [name, ref] : f.tensors) {
    if (name.rfind("input.", 0) == 0 || name.rfind("param.", 0) == 0) continue;
    auto it = out.find(name);
    ASSERT_NE(it, out.end()) << "moecore did not produce " << name;
    const Tensor& got = it->second;
    ASSERT_EQ(got.shape(), ref.shape()) << name;
    ++compared;
    if (ref.dtype() == DType::boolean || ref.dtype() == DType::i64) {
      const Tensor a = got.to(DType::i64), b = ref.to(DType::i64);
      int64_t diff = 0;
      for (int64_t i = 0; i < a.numel(); ++i) diff += a.data<int64_t>()[i] != b.data<int64_t>()[i];
      EXPECT_EQ(diff, 0) << name << ": " << diff << " entries differ";
    } else if (name.rfind("loss.", 0) == 0) {
      const double a = got.to(DType::f64).data<double>()[0], b = ref.to(DType::f64).data<double>()[0];
      EXPECT_NEAR(a, b, 1e-5 * std::fabs(b) + 1e-9) << name;
    } else if (name.rfind("grad.", 0) == 0) {
      const double ref_scale = std::sqrt(testing::sum_squares(ref.to(DType::f32)) / std::max<int64_t>(ref.numel(), 1));
      EXPECT_LE(testing::tolerance_ratio(got, ref, 1e-3, 1e-4 * ref_scale + 1e-9), 1.0) << name;
    } else {
      EXPECT_LE(testing::tolerance_ratio(got, ref, 1e-4, 1e-5), 1.0) << name;
    }
  }
  EXPECT_GT(compared, 5);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeLayerGolden, ::testing::ValuesIn(golden_cases()), [](const auto& info) {
  std::string n = info.param.substr(4, info.param.size() - 4 - 12);
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

}  // namespace
}  // namespace moecore
