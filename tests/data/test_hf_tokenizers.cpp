// HuggingFaceTokenizer on the Qwen3 and DeepSeek-V3 tokenizer.json structures: ids and decodes identical to HF
// tokenizers' on tests/golden/hf_tokenizers/* (written by tools/hf_tokenizer_reference.py from tiny BPE models
// trained by HF itself), HF's Split pieces, round trips, eod/pad from tokenizer_config.json, and the Split options.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "moecore/core/error.h"
#include "moecore/data/tokenizer.h"
#include "moecore/data/tokenizer_bpe.h"
#include "moecore/data/unicode_text.h"
#include "test_util.h"

namespace moecore::data {
namespace {

using json = nlohmann::json;
using Ids = std::vector<int32_t>;

std::string golden_dir(const std::string& name) {
  return std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_tokenizers/" + name;
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return json::parse(f);
}

// Every golden case: HF's ids, HF's decode of them, and the round trip.
void expect_matches_hf(const std::string& name, const std::string& prefix) {
  const std::string dir = golden_dir(name);
  const auto t = make_tokenizer({"HuggingFaceTokenizer", "", "", dir});
  const json expected = read_json(dir + "/expected.json");
  EXPECT_EQ(t->vocab_size(), expected["vocab_size"].get<int64_t>());
  int round_trips = 0;
  for (const json& c : expected["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const Ids ids = c["ids"].get<Ids>();
    EXPECT_EQ(t->encode(text), ids) << name << ": " << text;
    EXPECT_EQ(t->decode(ids), c["decoded"].get<std::string>()) << name << ": " << text;
    // Where no normalization or stripping changes the text, decode gives it back (after the template's BOS).
    if (name != "flags" && unicode::nfc(text) == text) {
      EXPECT_EQ(t->decode(t->encode(text)), prefix + text) << name;
      ++round_trips;
    }
  }
  if (name != "flags") {
    EXPECT_GE(round_trips, 14) << name;
  }
}

// The Split steps of the golden's pre_tokenizer run through detail::SplitRegex on HF's normalized text give HF's
// pieces: the regex engines agree on every boundary, not only where the 400 merges make it visible in the ids.
void expect_split_pieces_match_hf(const std::string& name) {
  const json tok = read_json(golden_dir(name) + "/tokenizer.json");
  std::vector<std::unique_ptr<detail::SplitRegex>> steps;
  for (const json& p : tok["pre_tokenizer"]["pretokenizers"]) {
    if (p["type"] == "Split") {
      ASSERT_EQ(p["behavior"], "Isolated");
      steps.push_back(std::make_unique<detail::SplitRegex>(p["pattern"]["Regex"].get<std::string>(), false, name));
    }
  }
  ASSERT_FALSE(steps.empty());
  size_t total = 0;
  const json expected = read_json(golden_dir(name) + "/expected.json");
  for (const json& c : expected["cases"]) {
    const std::string norm = c["normalized"].get<std::string>();
    std::vector<std::string_view> pieces{norm}, next;
    for (const auto& re : steps) {
      next.clear();
      for (std::string_view p : pieces) re->split(p, detail::SplitBehavior::isolated, false, next);
      pieces.swap(next);
    }
    EXPECT_EQ(std::vector<std::string>(pieces.begin(), pieces.end()), c["split_pieces"].get<std::vector<std::string>>())
        << name << ": " << norm;
    total += pieces.size();
  }
  EXPECT_GT(total, 1000u);
}

TEST(HfGolden, SplitPiecesMatchHuggingFace) {
  expect_split_pieces_match_hf("qwen3");
  expect_split_pieces_match_hf("deepseek_v3");
}

TEST(HfGolden, Qwen3MatchesHuggingFace) {
  expect_matches_hf("qwen3", "");
}

TEST(HfGolden, DeepSeekV3MatchesHuggingFace) {
  expect_matches_hf("deepseek_v3", "<｜begin▁of▁sentence｜>");
}

// lstrip / rstrip / single_word / normalized added tokens over the Qwen3 pipeline.
TEST(HfGolden, AddedTokenFlagsMatchHuggingFace) {
  expect_matches_hf("flags", "");
}

TEST(HfGolden, EodAndPadFromTokenizerConfig) {
  const auto q = make_tokenizer({"HuggingFaceTokenizer", "", "", golden_dir("qwen3")});
  EXPECT_EQ(q->eod(), q->encode("<|im_end|>").at(0));
  EXPECT_EQ(q->pad(), q->encode("<|endoftext|>").at(0));
  const auto d = make_tokenizer({"HuggingFaceTokenizer", "", "", golden_dir("deepseek_v3") + "/tokenizer.json"});
  EXPECT_EQ(d->eod(), 1);
  EXPECT_EQ(d->pad(), 1);
  EXPECT_EQ(d->encode("<｜end▁of▁sentence｜>"), (Ids{0, 1}));  // BOS from the template, then EOS
}

TEST(HfGolden, ArbitraryBytesRoundTrip) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::string bad = std::string("ok \xff\xfe 12345 \xc3( \xed\xa0\x80 ") + all;  // invalid UTF-8 throughout
  const auto d = make_tokenizer({"HuggingFaceTokenizer", "", "", golden_dir("deepseek_v3")});
  const Ids ids = d->encode(bad);
  EXPECT_EQ(d->decode(Ids(ids.begin() + 1, ids.end())), bad);
  const std::string long_text = std::string(100000, ' ') + std::string(100000, '7') + "\n";
  EXPECT_EQ(d->decode(d->encode(long_text)), "<｜begin▁of▁sentence｜>" + long_text);
}

// A tokenizer.json from the Qwen3 golden with its pre_tokenizer replaced, written beside the test binary's cwd.
std::string variant(const std::string& file, const json& pre_tokenizer) {
  json j = read_json(golden_dir("qwen3") + "/tokenizer.json");
  j["pre_tokenizer"] = pre_tokenizer;
  const std::string path = (std::filesystem::temp_directory_path() / file).string();
  std::ofstream(path) << j.dump();
  return path;
}

json seq(const json& first) {
  return {{"type", "Sequence"},
          {"pretokenizers", {first, {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
}

TEST(HfGolden, SplitOptionsAndErrors) {
  // Removed drops the matches: the spaces vanish from the ids.
  const std::string removed =
      variant("moecore_removed_" + std::to_string(getpid()) + ".json",
              seq({{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}, {"invert", false}}));
  const auto r = make_tokenizer({"HuggingFaceTokenizer", "", "", removed});
  EXPECT_EQ(r->decode(r->encode("a b  c")), "abc");
  const std::string digits = variant("moecore_digits_" + std::to_string(getpid()) + ".json",
                                     seq({{"type", "Digits"}, {"individual_digits", true}}));
  EXPECT_EQ(make_tokenizer({"HuggingFaceTokenizer", "", "", digits})->encode("123").size(), 3u);
  const std::string bad_behavior =
      variant("moecore_badb_" + std::to_string(getpid()) + ".json",
              seq({{"type", "Split"}, {"pattern", {{"Regex", "x"}}}, {"behavior", "Sideways"}, {"invert", false}}));
  try {
    make_tokenizer({"HuggingFaceTokenizer", "", "", bad_behavior});
    ADD_FAILURE() << "no Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Sideways"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(bad_behavior), std::string::npos) << e.what();
  }
  const std::string bad_regex =
      variant("moecore_badr_" + std::to_string(getpid()) + ".json",
              seq({{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}}));
  try {
    make_tokenizer({"HuggingFaceTokenizer", "", "", bad_regex});
    ADD_FAILURE() << "no Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(unclosed"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(bad_regex), std::string::npos) << e.what();
  }
  for (const std::string& p : {removed, digits, bad_behavior, bad_regex}) std::filesystem::remove(p);
}

}  // namespace
}  // namespace moecore::data
