// --moe-layer-freq as Megatron reads it: an integer N or a Python list expression, parsed without eval.
#include "moecore/model/layer_pattern.h"

#include <functional>

#include "moecore/core/error.h"
#include "test_util.h"

namespace moecore {
namespace {

std::vector<bool> bits(std::initializer_list<int> v) {
  std::vector<bool> out;
  for (int x : v) out.push_back(x == 1);
  return out;
}

void test_expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

std::vector<bool> parse(const std::string& e, int64_t L) {
  return model::parse_layer_pattern(e, L, "--moe-layer-freq");
}

TEST(LayerPattern, IntegerEveryNthLayerFromZero) {
  EXPECT_EQ(parse("1", 3), bits({1, 1, 1}));
  EXPECT_EQ(parse("2", 5), bits({1, 0, 1, 0, 1}));
  EXPECT_EQ(parse(" 3 ", 4), bits({1, 0, 0, 1}));
}

TEST(LayerPattern, MegatronListExpressions) {
  const std::vector<bool> ds = parse("[0]*3+[1]*58", 61);  // DeepSeek-V3 / R1
  ASSERT_EQ(ds.size(), 61u);
  for (size_t i = 0; i < ds.size(); ++i) EXPECT_EQ(ds[i], i >= 3) << i;
  EXPECT_EQ(parse("([1]*3+[0]*1)*3", 12), bits({1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0}));
  EXPECT_EQ(parse("[0, 1, 1]", 3), bits({0, 1, 1}));
  EXPECT_EQ(parse("'[1]*2+[0]'", 3), bits({1, 1, 0}));  // quotes left in by a YAML file or a shell
  EXPECT_EQ(parse("2*[1,0]", 4), bits({1, 0, 1, 0}));
  EXPECT_EQ(parse("[1]*2*2", 4), bits({1, 1, 1, 1}));
  EXPECT_EQ(parse("0,1", 2), bits({0, 1}));  // a YAML list joined by commas
  EXPECT_EQ(parse("[]+[1]", 1), bits({1}));
}

TEST(LayerPattern, WrongLengthNamesBothLengths) {
  test_expect_error([] { parse("[0]*3+[1]*5", 61); }, {"--moe-layer-freq", "8 layers", "--num-layers is 61"});
}

TEST(LayerPattern, JunkIsRefusedWithoutEvaluation) {
  for (const char* junk : {"import os", "[0]*3+", "[2]", "[0,1", "(([1])", "__import__('os')", "[1]*x", "0", "-1",
                           "[1]**2", "[1]*3)", ""}) {
    test_expect_error([&] { parse(junk, 3); }, {"--moe-layer-freq"});
  }
}

}  // namespace
}  // namespace moecore
