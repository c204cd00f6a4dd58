// Tokenizers: the docs/formats.md §6 test vectors, GPT2BPETokenizer vs HuggingFaceTokenizer parity on
// tinyshakespeare, edge cases with ids from HF tokenizers 0.23 (an independent reference), the PCRE2 pre-tokenizer
// regexes and Split behaviours against HF's pieces, NFC, SentencePiece on a model trained here, and errors that name
// the file. The Qwen3 / DeepSeek-V3 goldens are in test_hf_tokenizers.cpp.
// Tests needing ../shared/data skip with a message when it is absent.
#include <nlohmann/json.hpp>

#include <fstream>
#include <thread>

#include <unistd.h>

#include "moecore/core/error.h"
#include "moecore/data/tokenizer.h"
#include "moecore/data/tokenizer_bpe.h"
#include "moecore/data/unicode_text.h"
#include "test_util.h"

#ifdef MOECORE_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#endif

namespace moecore::data {
namespace {

using Ids = std::vector<int32_t>;

std::string gpt2_dir() {
  const std::string d = testing::shared_data_dir();
  return d.empty() ? d : d + "/gpt2";
}

#define REQUIRE_SHARED_DATA() \
  if (gpt2_dir().empty()) GTEST_SKIP() << "../shared/data (GPT-2 files) not found; skipping"

// Loaded once per process: parsing the 50k-entry vocab is the slow part of these tests.
const Tokenizer& gpt2() {
  static const auto t =
      make_tokenizer({"GPT2BPETokenizer", gpt2_dir() + "/gpt2-vocab.json", gpt2_dir() + "/gpt2-merges.txt", ""});
  return *t;
}
const Tokenizer& hf() {
  static const auto t = make_tokenizer({"HuggingFaceTokenizer", "", "", gpt2_dir() + "/gpt2-tokenizer.json"});
  return *t;
}

// A fresh directory per test process (ctest runs tests in parallel).
std::string temp_dir() {
  static const std::string dir = [] {
    auto p = std::filesystem::temp_directory_path() / ("moecore_tok_" + std::to_string(getpid()));
    std::filesystem::create_directories(p);
    return p.string();
  }();
  return dir;
}
// Removes temp_dir() after the last test.
class TempDirCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(std::filesystem::temp_directory_path() / ("moecore_tok_" + std::to_string(getpid())),
                                ec);
  }
};
[[maybe_unused]] ::testing::Environment* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempDirCleanup);

std::string write_file(const std::string& name, const std::string& content) {
  const std::string path = temp_dir() + "/" + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

// Runs f, expecting an Error whose message contains every one of `parts`.
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no Error thrown";
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

std::string tinyshakespeare(size_t bytes) {
  std::ifstream f(testing::shared_data_dir() + "/tinyshakespeare/input.txt", std::ios::binary);
  std::string s(bytes, '\0');
  f.read(s.data(), static_cast<std::streamsize>(bytes));
  s.resize(static_cast<size_t>(f.gcount()));
  return s;
}

TEST(Gpt2Bpe, FormatsTestVectors) {
  REQUIRE_SHARED_DATA();
  const std::vector<std::pair<std::string, Ids>> cases = {
      {"Hello world", {15496, 995}},
      {"First Citizen:\nBefore we proceed any further, hear me speak.",
       {5962, 22307, 25, 198, 8421, 356, 5120, 597, 2252, 11, 3285, 502, 2740, 13}},
      {"  leading spaces and 12345 digits!", {220, 3756, 9029, 290, 17031, 2231, 19561, 0}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_EQ(gpt2().encode(text), ids) << text;
    EXPECT_EQ(hf().encode(text), ids) << text;
    EXPECT_EQ(gpt2().decode(ids), text);
  }
  EXPECT_EQ(gpt2().vocab_size(), 50257);
  EXPECT_EQ(gpt2().eod(), 50256);
  EXPECT_EQ(gpt2().pad(), -1);
  EXPECT_EQ(gpt2().name(), "GPT2BPETokenizer");
  EXPECT_EQ(hf().vocab_size(), 50257);
  EXPECT_EQ(hf().eod(), 50256);
  EXPECT_EQ(hf().name(), "HuggingFaceTokenizer");
}

TEST(Gpt2Bpe, MatchesHuggingFaceOnTinyShakespeareAndRoundTrips) {
  REQUIRE_SHARED_DATA();
  const std::string text = tinyshakespeare(20000);
  ASSERT_EQ(text.size(), 20000u);
  const Ids a = gpt2().encode(text);
  EXPECT_EQ(a.size(), 6047u);  // HF tokenizers' count for these 20000 bytes
  EXPECT_EQ(hf().encode(text), a);
  EXPECT_EQ(gpt2().decode(a), text);
  EXPECT_EQ(hf().decode(a), text);
}

// Ids from HF tokenizers 0.23 with the shipped gpt2-tokenizer.json.
TEST(Gpt2Bpe, EdgeCasesMatchHuggingFaceReference) {
  REQUIRE_SHARED_DATA();
  const std::vector<std::pair<std::string, Ids>> cases = {
      {"Hello   world", {15496, 220, 220, 995}},
      {"line1\n\nline2\r\n\tindented  \n", {1370, 16, 198, 198, 1370, 17, 201, 198, 197, 521, 4714, 220, 220, 198}},
      {"I'm here, you're there; it's John's. We've, they'll, he'd",
       {40, 1101, 994, 11, 345, 821, 612, 26, 340, 338, 1757, 338, 13, 775, 1053, 11, 484, 1183, 11, 339, 1549}},
      {"'S 'RE 'Ll uppercase", {6, 50, 705, 2200, 705, 43, 75, 334, 39921, 589}},
      {"café naïve résumé Zürich", {66, 1878, 2634, 41492, 40560, 16345, 2634, 1168, 9116, 7527}},
      {"cafe\xcc\x81", {66, 8635, 136, 223}},  // decomposed é: no normalization in GPT-2
      {"数字123 and ١٢٣ and x² 1234567",
       {46763, 108, 27764, 245, 10163, 290, 18923, 94, 149, 95, 149, 96, 290, 2124, 31185, 17031, 2231, 3134}},
      {"emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
       {368,   31370, 30325, 222, 41840, 235, 8582, 237,   121, 1641, 50169, 101, 447, 235,
        41840, 102,   447,   235, 41840, 100, 6056, 12520, 229, 104,  8582,  229, 115}},
      {"trailing spaces   ", {9535, 4386, 9029, 220, 220, 220}},
      {"\xc2\xa0nbsp\xe3\x80\x80ideographic", {1849, 77, 24145, 5099, 222, 485, 6826}},
      {"", {}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_EQ(gpt2().encode(text), ids) << text;
    EXPECT_EQ(hf().encode(text), ids) << text;
    EXPECT_EQ(gpt2().decode(ids), text);
    EXPECT_EQ(hf().decode(ids), text);
  }
}

TEST(Gpt2Bpe, SpecialTokenIsAddedTokenOnlyInHuggingFace) {
  REQUIRE_SHARED_DATA();
  EXPECT_EQ(hf().encode("a<|endoftext|>b"), (Ids{64, 50256, 65}));
  // Megatron's GPT2BPETokenizer sees ordinary text; EOD is appended by id, never parsed.
  const Ids plain = gpt2().encode("a<|endoftext|>b");
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 50256), 0);
  EXPECT_EQ(gpt2().decode(plain), "a<|endoftext|>b");
  EXPECT_EQ(gpt2().decode({64, 50256, 65}), "a<|endoftext|>b");
  EXPECT_EQ(hf().decode({64, 50256, 65}), "a<|endoftext|>b");
}

TEST(Gpt2Bpe, ArbitraryBytesRoundTrip) {
  REQUIRE_SHARED_DATA();
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::string bad = std::string("ok \xff\xfe tail \xc3( \xed\xa0\x80 ") + all;  // invalid UTF-8 throughout
  for (const Tokenizer* t : {&gpt2(), &hf()}) {
    EXPECT_EQ(t->decode(t->encode(bad)), bad);
    EXPECT_EQ(t->decode(t->encode(std::string(5000, 'a'))), std::string(5000, 'a'));  // long uncached word
  }
  EXPECT_EQ(gpt2().encode("\xff"), (Ids{187}));  // the raw byte 0xFF is the vocab character U+00FF "ÿ"
}

TEST(Gpt2Bpe, DecodeRejectsUnknownIds) {
  REQUIRE_SHARED_DATA();
  expect_error([] { (void)gpt2().decode({15496, 50257}); }, {"GPT2BPETokenizer", "50257"});
  expect_error([] { (void)hf().decode({-1}); }, {"HuggingFaceTokenizer", "-1"});
}

TEST(Gpt2Bpe, ConcurrentEncodeMatchesSerial) {
  REQUIRE_SHARED_DATA();
  const std::string text = tinyshakespeare(40000);
  const auto fresh =
      make_tokenizer({"GPT2BPETokenizer", gpt2_dir() + "/gpt2-vocab.json", gpt2_dir() + "/gpt2-merges.txt", ""});
  const Ids expect = gpt2().encode(text);
  std::vector<Ids> got(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) threads.emplace_back([&, i] { got[i] = fresh->encode(text); });
  for (auto& t : threads) t.join();
  for (const Ids& g : got) EXPECT_EQ(g, expect);
}

TEST(ByteMap, MatchesFormatsTable) {
  const auto& m = detail::byte_to_char();
  EXPECT_EQ(m[0x20], 0x120u);
  EXPECT_EQ(m['\n'], 0x10Au);
  EXPECT_EQ(m[0x00], 0x100u);
  EXPECT_EQ(m['A'], static_cast<char32_t>('A'));
  EXPECT_EQ(m[0xAD], 0x143u);  // the last of the 68 remapped bytes
  for (int b = 0; b < 256; ++b) EXPECT_EQ(detail::char_to_byte(m[b]), b);
  EXPECT_EQ(detail::bytes_to_token(" hi\n"), "\xc4\xa0hi\xc4\x8a");  // "Ġhi" + "Ċ"
}

// The Llama-3 and Qwen2/3 Split regexes as their tokenizer.json files spell them.
const std::string kLlama3Regex = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
                                 R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string kQwen2Regex = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|)"
                                R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> pieces(const detail::SplitRegex& re, std::string_view text,
                                detail::SplitBehavior b = detail::SplitBehavior::isolated, bool invert = false) {
  std::vector<std::string_view> v;
  re.split(text, b, invert, v);
  return {v.begin(), v.end()};
}

// Expected pieces from HF tokenizers' Split(Regex(...), "isolated") (Oniguruma).
TEST(PreTokenizer, MatchesRegexEngine) {
  const detail::SplitRegex& gpt2 = detail::SplitRegex::gpt2();
  const detail::SplitRegex llama3(kLlama3Regex, false, "test"), qwen2(kQwen2Regex, false, "test");
  const std::string s = "Hello  world's 'RE 12345!!\n\n  (x)\tgo  \r\n";
  EXPECT_EQ(pieces(gpt2, s), (std::vector<std::string>{"Hello", " ", " world", "'s", " '", "RE", " 12345", "!!",
                                                       "\n\n ", " (", "x", ")", "\t", "go", "  \r\n"}));
  EXPECT_EQ(pieces(llama3, s), (std::vector<std::string>{"Hello", " ", " world", "'s", " '", "RE", " ", "123", "45",
                                                         "!!\n\n", " ", " (", "x", ")", "\tgo", "  \r\n"}));
  EXPECT_EQ(pieces(qwen2, s), (std::vector<std::string>{"Hello", " ", " world", "'s", " '", "RE", " ", "1", "2", "3",
                                                        "4", "5", "!!\n\n", " ", " (", "x", ")", "\tgo", "  \r\n"}));
  // Case-insensitive contractions only in the Llama-3/Qwen regex; "don" + "'T" vs "don" + "'" + "T".
  EXPECT_EQ(pieces(llama3, "DON'T"), (std::vector<std::string>{"DON", "'T"}));
  EXPECT_EQ(pieces(llama3, "it'\xc5\xbf"), (std::vector<std::string>{"it", "'\xc5\xbf"}));  // ſ case-folds to s
  EXPECT_EQ(pieces(gpt2, "DON'T"), (std::vector<std::string>{"DON", "'", "T"}));
  EXPECT_EQ(pieces(gpt2, "a\xff\xfe b"), (std::vector<std::string>{"a", "\xff\xfe", " b"}));
  EXPECT_TRUE(pieces(gpt2, "").empty());
  // U+180E (Mongolian vowel separator) is no White_Space: PCRE2's own \s would take it, Oniguruma's does not.
  EXPECT_EQ(pieces(gpt2, "x!\xe1\xa0\x8e!"), (std::vector<std::string>{"x", "!\xe1\xa0\x8e!"}));
  EXPECT_EQ(pieces(gpt2, "a \xc2\x85 b"), (std::vector<std::string>{"a", " \xc2\x85", " b"}));  // NEL is
  // Long runs neither overflow the JIT stack nor go quadratic.
  const std::string spaces(200000, ' ');
  EXPECT_EQ(pieces(gpt2, spaces + "x"), (std::vector<std::string>{std::string(199999, ' '), " x"}));
  EXPECT_EQ(pieces(gpt2, std::string(200000, 'a')).size(), 1u);
}

// Split behaviours and invert, as HF's SplitDelimiterBehavior defines them (pieces from HF tokenizers 0.23).
TEST(PreTokenizer, SplitBehaviours) {
  const detail::SplitRegex dash("-", false, "test"), lit("a.", true, "test"), empty("x*", false, "test");
  using B = detail::SplitBehavior;
  const std::string s = "the-final--countdown-";
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces(dash, s, B::isolated), (V{"the", "-", "final", "-", "-", "countdown", "-"}));
  EXPECT_EQ(pieces(dash, s, B::removed), (V{"the", "final", "countdown"}));
  EXPECT_EQ(pieces(dash, s, B::merged_with_previous), (V{"the-", "final-", "-", "countdown-"}));
  EXPECT_EQ(pieces(dash, s, B::merged_with_next), (V{"the", "-final", "-", "-countdown", "-"}));
  EXPECT_EQ(pieces(dash, s, B::contiguous), (V{"the", "-", "final", "--", "countdown", "-"}));
  EXPECT_EQ(pieces(dash, s, B::removed, true), (V{"-", "-", "-", "-"}));
  EXPECT_EQ(pieces(lit, "ba.a.ab", B::isolated), (V{"b", "a.", "a.", "ab"}));  // a String pattern is literal
  EXPECT_EQ(pieces(empty, "axxb", B::isolated), (V{"a", "xx", "b"}));
  EXPECT_EQ(pieces(dash, s, B::merged_with_previous, true), (V{"the", "-final", "-", "-countdown", "-"}));
  EXPECT_EQ(pieces(empty, "axxbc", B::contiguous), (V{"a", "xx", "b", "c"}));  // empty matches between b and c
  EXPECT_EQ(pieces(empty, "axxbc", B::merged_with_next), (V{"a", "xxb", "c"}));
  expect_error([] { detail::SplitRegex bad("(?<", false, "my.json"); }, {"my.json", "(?<", "does not compile"});
}

TEST(Unicode, ClassesAndNfc) {
  using unicode::CharClass;
  EXPECT_EQ(unicode::char_class(U'é'), CharClass::letter);
  EXPECT_EQ(unicode::char_class(U'中'), CharClass::letter);
  EXPECT_EQ(unicode::char_class(U'²'), CharClass::number);
  EXPECT_EQ(unicode::char_class(U'Ⅻ'), CharClass::number);
  EXPECT_EQ(unicode::char_class(U'😀'), CharClass::other);
  EXPECT_TRUE(unicode::is_whitespace(0x3000));
  EXPECT_TRUE(unicode::is_whitespace(0x85));
  EXPECT_FALSE(unicode::is_whitespace(0x1C));  // Python's str.isspace says yes; the regex engines say no
  EXPECT_FALSE(unicode::is_whitespace(0x200B));
  EXPECT_EQ(unicode::nfc("cafe\xcc\x81"), "café");
  EXPECT_EQ(unicode::nfc("\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8"), "각");  // Hangul L V T
  EXPECT_EQ(unicode::nfc("a\xcc\x82\xcc\xa3"), "\xe1\xba\xad");           // a + ^ + dot below -> ậ
  EXPECT_EQ(unicode::nfc("\xe2\x84\xab"), "\xc3\x85");                    // Angstrom sign -> Å
  EXPECT_EQ(unicode::nfc("\xef\xac\x81"), "\xef\xac\x81");                // ﬁ is compatibility only
  EXPECT_EQ(unicode::nfc("ok \xff\xcc\x81"), "ok \xff\xcc\x81");          // invalid byte blocks nothing
  EXPECT_STREQ(unicode::version(), "14.0.0");
}

// A tokenizer.json derived from the shipped GPT-2 one, edited by `edit` and written to a temp file.
template <class F>
std::string gpt2_json_variant(const std::string& name, F&& edit) {
  std::ifstream f(gpt2_dir() + "/gpt2-tokenizer.json");
  nlohmann::json j = nlohmann::json::parse(f);
  edit(j);
  return write_file(name, j.dump());
}

nlohmann::json added(int id, const std::string& content, bool lstrip = false, bool rstrip = false,
                     bool normalized = false) {
  return {{"id", id},         {"content", content},       {"single_word", false}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", normalized}, {"special", true}};
}

// Llama-3 / Qwen2 style pipelines on GPT-2's vocab; ids from HF tokenizers 0.23 on the same edited files.
TEST(HuggingFace, Llama3AndQwenStylePipelines) {
  REQUIRE_SHARED_DATA();
  const std::string l3 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
                         R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string llama = gpt2_json_variant("llama3.json", [&](nlohmann::json& j) {
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", l3}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    j["model"]["ignore_merges"] = true;
    nlohmann::json pairs = nlohmann::json::array();  // the newer [["A", "B"], ...] merges form
    for (const auto& m : j["model"]["merges"]) {
      const std::string s = m.get<std::string>();
      pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
    }
    j["model"]["merges"] = pairs;
    j["added_tokens"].push_back(added(50257, "<|begin_of_text|>"));
    j["added_tokens"].push_back(added(50258, "<|eot|>", true, true));
    j["post_processor"] = nlohmann::json::parse(R"({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [50257]}}})");
  });
  const auto t = make_tokenizer({"HuggingFaceTokenizer", llama, "", ""});
  EXPECT_EQ(t->encode("Hello world's 12345 DON'T  \n\nx"),
            (Ids{50257, 15496, 995, 338, 220, 10163, 2231, 23917, 6, 51, 220, 220, 628, 87}));
  EXPECT_EQ(t->encode("a <|eot|>  b"), (Ids{50257, 64, 50258, 65}));  // lstrip + rstrip eat the spaces
  EXPECT_EQ(t->decode(t->encode("x<|eot|>y")), "<|begin_of_text|>x<|eot|>y");
  EXPECT_EQ(t->vocab_size(), 50259);

  std::string rq = l3;
  rq.replace(rq.find("\\p{N}{1,3}"), 10, "\\p{N}");
  const std::string qwen = gpt2_json_variant("qwen.json", [&](nlohmann::json& j) {
    j["normalizer"] = {{"type", "NFC"}};
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", rq}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  });
  const auto q = make_tokenizer({"HuggingFaceTokenizer", "", "", qwen});
  EXPECT_EQ(q->encode("cafe\xcc\x81 2024!"),
            (Ids{66, 1878, 2634, 220, 17, 15, 17, 19, 0}));  // NFC, then one digit each
  EXPECT_EQ(q->encode("x<|endoftext|>"), (Ids{87, 50256}));
}

TEST(HuggingFace, ConfigBesideTheFileSetsEodAndPad) {
  REQUIRE_SHARED_DATA();
  std::filesystem::create_directories(temp_dir() + "/hfdir");
  std::filesystem::copy_file(gpt2_dir() + "/gpt2-tokenizer.json", temp_dir() + "/hfdir/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  write_file("hfdir/tokenizer_config.json", R"({"eos_token": {"content": "!"}, "pad_token": "\""})");
  const auto t = make_tokenizer({"HuggingFaceTokenizer", "", "", temp_dir() + "/hfdir"});  // a folder works too
  EXPECT_EQ(t->eod(), 0);
  EXPECT_EQ(t->pad(), 1);
}

TEST(ByteLevel, IdsAreBytes) {
  const auto t = make_tokenizer({"ByteLevel", "", "", ""});
  EXPECT_EQ(t->encode("A\xff"), (Ids{65, 255}));
  EXPECT_EQ(t->decode({65, 255, 256}), "A\xff");  // eod decodes to nothing
  EXPECT_EQ(t->vocab_size(), 257);
  EXPECT_EQ(t->eod(), 256);
  EXPECT_EQ(t->name(), "ByteLevel");
  expect_error([&] { (void)t->decode({257}); }, {"ByteLevel", "257"});
}

TEST(Errors, NameTheTypeAndFile) {
  expect_error(
      [] {
        make_tokenizer({"BertTokenizer", "", "", ""});
      },
      {"BertTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "ByteLevel"});
  const std::string missing = temp_dir() + "/no-such-vocab.json";
  expect_error([&] { make_tokenizer({"GPT2BPETokenizer", missing, missing, ""}); }, {missing});
  const std::string bad_json = write_file("bad-vocab.json", "{\"a\": 0, \"b\": ");
  const std::string merges = write_file("merges.txt", "#version: 0.2\na b\n");
  expect_error([&] { make_tokenizer({"GPT2BPETokenizer", bad_json, merges, ""}); }, {bad_json, "vocab"});
  const std::string vocab = write_file("vocab.json", R"({"a": 0, "b": 1, "ab": 2})");
  expect_error(
      [&] {
        make_tokenizer({"GPT2BPETokenizer", vocab, write_file("m2.txt", "#version: 0.2\na b c\n"), ""});
      },
      {"m2.txt", "line 2"});
  expect_error(
      [&] {
        make_tokenizer({"GPT2BPETokenizer", vocab, write_file("m3.txt", "#version: 0.2\na x\n"), ""});
      },
      {"m3.txt", "'x'"});
  expect_error([&] { make_tokenizer({"GPT2BPETokenizer", vocab, "", ""}); }, {"--merge-file"});
  // A tiny valid pair still works (and "ab" merges).
  const auto tiny = make_tokenizer({"GPT2BPETokenizer", vocab, merges, ""});
  EXPECT_EQ(tiny->encode("abba"), (Ids{2, 1, 0}));
  EXPECT_EQ(tiny->eod(), -1);

  const std::string bad_tok = write_file("tokenizer.json", "{\"model\": ");
  expect_error([&] { make_tokenizer({"HuggingFaceTokenizer", "", "", bad_tok}); }, {bad_tok});
  const std::string wordpiece = write_file("wp.json", R"({"model": {"type": "WordPiece", "vocab": {}}})");
  expect_error(
      [&] {
        make_tokenizer({"HuggingFaceTokenizer", "", "", wordpiece});
      },
      {wordpiece, "model type", "WordPiece"});
  expect_error([&] { make_tokenizer({"HuggingFaceTokenizer", "", "", temp_dir() + "/none.json"}); }, {"none.json"});
  expect_error([&] { make_tokenizer({"SentencePieceTokenizer", "", "", temp_dir() + "/none.model"}); }, {"none.model"});
  expect_error([&] { make_tokenizer({"SentencePieceTokenizer", "", "", ""}); }, {"--tokenizer-model"});
}

// Issue 15 reproducers: ids and nesting from a hostile file must not size allocations or the stack.
TEST(Errors, Gpt2VocabIdsAreBounded) {
  const std::string merges = write_file("ids-merges.txt", "#version: 0.2\na b\n");
  // The outside tester's vocab.json: one id of 2^28 (8.7 GB of id tables); 2^31 - 1 gave std::bad_alloc.
  for (const std::string id : {"268435456", "2147483647", "1028"}) {
    const std::string vocab = write_file("ids-vocab.json", R"({"a": 0, "b": 1, "ab": 2, "zz": )" + id + "}");
    expect_error(
        [&] {
          make_tokenizer({"GPT2BPETokenizer", vocab, merges, ""});
        },
        {"GPT2BPETokenizer", vocab, "'zz'", "id " + id, "outside [0, 1028)"});
  }
  // Not an int32: an Error naming the token, never a wrapped, truncated or undefined conversion.
  for (const std::string id : {"-1", "4294967296", "1e20", "2.5", "\"7\"", "null"}) {
    const std::string vocab = write_file("ids-vocab.json", R"({"a": 0, "b": 1, "ab": 2, "zz": )" + id + "}");
    expect_error(
        [&] {
          make_tokenizer({"GPT2BPETokenizer", vocab, merges, ""});
        },
        {"GPT2BPETokenizer", vocab, "'zz'", "expected an integer in [0, 2147483647]"});
  }
  const std::string dup = write_file("ids-vocab.json", R"({"a": 0, "b": 1, "ab": 2, "ba": 1})");
  expect_error(
      [&] {
        make_tokenizer({"GPT2BPETokenizer", dup, merges, ""});
      },
      {dup, "tokens 'b' and 'ba' both have id 1"});
  // A few holes are fine (ids up to entries + 1024).
  const std::string holes = write_file("ids-vocab.json", R"({"a": 0, "b": 1, "ab": 2, "zz": 1026})");
  EXPECT_EQ(make_tokenizer({"GPT2BPETokenizer", holes, merges, ""})->vocab_size(), 1027);
  for (const char* empty : {"", "{}", "[]", "\"x\""}) {
    const std::string vocab = write_file("ids-vocab.json", empty);
    expect_error([&] { make_tokenizer({"GPT2BPETokenizer", vocab, merges, ""}); }, {vocab});
  }
}

std::string tiny_hf_json(const std::string& vocab, const std::string& added, const std::string& post = "null") {
  return R"({"model": {"type": "BPE", "vocab": )" + vocab + R"(, "merges": ["a b"]}, "added_tokens": )" + added +
         R"(, "pre_tokenizer": {"type": "ByteLevel"}, "post_processor": )" + post + "}";
}

TEST(Errors, HfIdsAreBounded) {
  const std::string ok_vocab = R"({"a": 0, "b": 1, "ab": 2})";
  struct Case {
    std::string vocab, added, post;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {R"({"a": 0, "b": 1, "ab": 2, "zz": 268435456})", "[]", "null", {"'zz'", "id 268435456"}},
      {R"({"a": 0, "b": 1, "ab": 2, "zz": 2.5e9})", "[]", "null", {"'zz'", "expected an integer"}},
      {ok_vocab, R"([{"id": 268435456, "content": "<x>"}])", "null", {"added token '<x>'", "id 268435456"}},
      {ok_vocab, R"([{"id": -5, "content": "<x>"}])", "null", {"added token '<x>'", "expected an integer"}},
      {ok_vocab,
       R"([{"id": 3, "content": "<x>"}])",
       R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>"}}, {"Sequence": {"id": "A"}}],
           "special_tokens": {"<x>": {"ids": [99999999]}}})",
       {"template token id 99999999", "outside the vocabulary (size 4)"}},
      {ok_vocab, R"({"id": 3})", "null", {"added_tokens is not a list"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    const std::string path = write_file("ids-tokenizer.json", tiny_hf_json(c.vocab, c.added, c.post));
    std::vector<std::string> parts = c.parts;
    expect_error(
        [&] {
          make_tokenizer({"HuggingFaceTokenizer", "", "", path});
        },
        {"HuggingFaceTokenizer", path, parts.at(0), parts.size() > 1 ? parts[1] : parts[0]});
  }
  // Added tokens may fill ids beyond the vocab.
  const std::string path =
      write_file("ids-tokenizer.json", tiny_hf_json(ok_vocab, R"([{"id": 3, "content": "<x>", "special": true}])"));
  const auto t = make_tokenizer({"HuggingFaceTokenizer", "", "", path});
  EXPECT_EQ(t->encode("ab<x>"), (Ids{2, 3}));
  EXPECT_EQ(t->vocab_size(), 4);
}

TEST(Errors, DeeplyNestedJsonIsRefused) {
  // The outside tester's tokenizer.json nested 200,000 levels deep overflowed the stack.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const std::string tok = write_file("deep-tokenizer.json", R"({"model": )" + deep + "}");
  expect_error([&] { make_tokenizer({"HuggingFaceTokenizer", "", "", tok}); }, {tok, "nested deeper than 128"});
  const std::string vocab = write_file("deep-vocab.json", deep);
  const std::string merges = write_file("deep-merges.txt", "a b\n");
  expect_error([&] { make_tokenizer({"GPT2BPETokenizer", vocab, merges, ""}); }, {vocab, "nested deeper than 128"});
  std::filesystem::create_directories(temp_dir() + "/deepcfg");
  write_file("deepcfg/tokenizer.json", tiny_hf_json(R"({"a": 0, "b": 1, "ab": 2})", "[]"));
  write_file("deepcfg/tokenizer_config.json", R"({"eos_token": )" + deep + "}");
  expect_error(
      [&] {
        make_tokenizer({"HuggingFaceTokenizer", "", "", temp_dir() + "/deepcfg"});
      },
      {"tokenizer_config.json", "nested deeper than 128"});
  // A non-string eos_token content is ignored, not a nlohmann exception.
  write_file("deepcfg/tokenizer_config.json", R"({"eos_token": {"content": 5}, "pad_token": [1]})");
  EXPECT_EQ(make_tokenizer({"HuggingFaceTokenizer", "", "", temp_dir() + "/deepcfg"})->pad(), -1);
}

TEST(Errors, HostileTextFilesAreErrorsOrTokenized) {
  // Empty files, NUL bytes and invalid UTF-8 in the vocab/merges: an Error naming the file, or a working tokenizer.
  const std::string vocab =
      write_file("nul-vocab.json", std::string(R"({"a": 0, "b": 1, "ab": 2, "\u0000": 3, "\u0100": 4})"));
  const std::string merges = write_file("nul-merges.txt", std::string("#version: 0.2\na b\n\0 \xff\n", 22));
  expect_error([&] { make_tokenizer({"GPT2BPETokenizer", vocab, merges, ""}); }, {merges});
  const std::string bad_utf8 = write_file("utf8-vocab.json", "{\"a\xff\": 0}");
  expect_error([&] { make_tokenizer({"GPT2BPETokenizer", bad_utf8, merges, ""}); }, {bad_utf8, "not valid JSON"});
  const std::string empty = write_file("empty-merges.txt", "");
  const auto t = make_tokenizer({"GPT2BPETokenizer", vocab, empty, ""});
  EXPECT_EQ(t->encode(std::string("ab\0\xff", 4)), (Ids{0, 1, 4}));  // NUL is U+0100; \xff has no token: dropped
  EXPECT_EQ(t->decode({3, 4}), std::string("\0\0", 2));
  const std::string empty_tok = write_file("empty-tokenizer.json", "");
  expect_error([&] { make_tokenizer({"HuggingFaceTokenizer", "", "", empty_tok}); }, {empty_tok});
}

#ifdef MOECORE_HAVE_SENTENCEPIECE

// Trains a small BPE model with byte fallback once per process; returns the .model path.
std::string tiny_sp_model() {
  static const std::string path = [] {
    std::string text;
    const char* lines[] = {
        "The quick brown fox jumps over the lazy dog.",      "Pack my box with five dozen liquor jugs!",
        "How vexingly quick daft zebras jump; 12345 67890.", "Sphinx of black quartz, judge my vow?",
        "Café, naïve, résumé: accents are letters too.",     "数字 and 中文 text, Ελληνικά, русский."};
    for (int rep = 0; rep < 40; ++rep) {
      for (const char* l : lines) text += std::string(l) + (rep % 2 ? " again\n" : "\n");
    }
    const std::string input = write_file("sp_train.txt", text);
    const std::string prefix = temp_dir() + "/sp";
    const auto st = sentencepiece::SentencePieceTrainer::Train(
        "--input=" + input + " --model_prefix=" + prefix +
        " --vocab_size=400 --model_type=bpe --byte_fallback=true --character_coverage=1.0"
        " --hard_vocab_limit=false --normalization_rule_name=identity --remove_extra_whitespaces=false"
        " --minloglevel=2");
    if (!st.ok()) ADD_FAILURE() << st.ToString();
    return prefix + ".model";
  }();
  return path;
}

TEST(SentencePiece, Llama2TokenizerIsTheLibraryPlusBos) {
  const std::string model = tiny_sp_model();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(model).ok());
  const auto t = make_tokenizer({"Llama2Tokenizer", "", "", model});
  EXPECT_EQ(t->vocab_size(), sp.GetPieceSize());
  EXPECT_EQ(t->eod(), sp.eos_id());
  for (const std::string text : {"The lazy fox.", "  two  spaces\nand a newline", "emoji 😀 unseen ☃", "12345"}) {
    std::vector<int> ref;
    ASSERT_TRUE(sp.Encode(text, &ref).ok());
    Ids expect{sp.bos_id()};
    expect.insert(expect.end(), ref.begin(), ref.end());
    EXPECT_EQ(t->encode(text), expect) << text;
    EXPECT_EQ(t->decode(t->encode(text)), text);
  }
}

TEST(SentencePiece, MegatronSpecialTokens) {
  const std::string model = tiny_sp_model();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(model).ok());
  const int n = sp.GetPieceSize();
  const auto t = make_tokenizer({"SentencePieceTokenizer", "", "", model});
  // <CLS> <SEP> <EOD> <MASK> <PAD> are appended (the model has no pad); <s> and </s> are the model's own.
  EXPECT_EQ(t->vocab_size(), n + 5);
  EXPECT_EQ(t->eod(), n + 2);
  EXPECT_EQ(t->pad(), n + 4);
  std::vector<int> a, b;
  ASSERT_TRUE(sp.Encode("quick fox", &a).ok());
  ASSERT_TRUE(sp.Encode(" jumps", &b).ok());
  Ids expect(a.begin(), a.end());
  expect.push_back(n + 2);
  expect.insert(expect.end(), b.begin(), b.end());
  expect.push_back(sp.eos_id());
  EXPECT_EQ(t->encode("quick fox<EOD> jumps</s>"), expect);
  EXPECT_EQ(t->decode(Ids(a.begin(), a.end())), "quick fox");
  EXPECT_EQ(t->decode({n + 2}), " <EOD> ");  // Megatron's detokenize pads special tokens with spaces
  const std::string text = "Sphinx of black quartz: ok 😀";
  EXPECT_EQ(t->decode(t->encode(text)), text);
}

TEST(SentencePiece, BadModelFileNamesIt) {
  const std::string junk = write_file("junk.model", "this is not a protobuf");
  expect_error([&] { make_tokenizer({"SentencePieceTokenizer", "", "", junk}); }, {"junk.model"});
}

// Issue 15 (fuzz_sentencepiece): libsentencepiece 0.1.97 calls std::terminate on a piece holding NUL and reads out
// of bounds on a corrupt precompiled_charsmap; such models are refused before the library sees them.
std::string protobuf_bytes_field(int field, const std::string& bytes) {
  std::string out(1, static_cast<char>(field << 3 | 2));
  for (size_t n = bytes.size();; n >>= 7) {
    out += static_cast<char>((n & 0x7F) | (n > 0x7F ? 0x80 : 0));
    if (n <= 0x7F) break;
  }
  return out + bytes;
}

TEST(SentencePiece, CorruptModelsAreErrorsNotCrashes) {
  std::ifstream f(tiny_sp_model(), std::ios::binary);
  const std::string model((std::istreambuf_iterator<char>(f)), {});
  std::string nul_piece = model;
  const size_t at = nul_piece.find("<unk>");
  ASSERT_NE(at, std::string::npos);
  nul_piece[at] = '\0';
  const std::string p1 = write_file("nul-piece.model", nul_piece);
  expect_error(
      [&] {
        make_tokenizer({"SentencePieceTokenizer", "", "", p1});
      },
      {"SentencePieceTokenizer", p1, "piece 0 is empty or holds a NUL byte"});
  // A later normalizer_spec merges into the first: its precompiled_charsmap replaces the model's.
  auto with_charsmap = [&](const std::string& blob) {
    return model + protobuf_bytes_field(3, protobuf_bytes_field(2, blob));
  };
  const std::string p2 = write_file("charsmap-size.model", with_charsmap(std::string("\xff\xff\x00\x00xyz\0", 8)));
  expect_error(
      [&] {
        make_tokenizer({"Llama2Tokenizer", "", "", p2});
      },
      {"Llama2Tokenizer", p2, "normalizer_spec.precompiled_charsmap: trie size 65535 exceeds"});
  const std::string p3 =
      write_file("charsmap-state.model", with_charsmap(std::string("\x04\0\0\0\0\xfc\xff\xff\0", 9)));
  expect_error([&] { make_tokenizer({"SentencePieceTokenizer", "", "", p3}); }, {p3, "lies outside its 1 units"});
  const std::string p4 = write_file("truncated.model", model.substr(0, model.size() / 2));
  expect_error([&] { make_tokenizer({"SentencePieceTokenizer", "", "", p4}); }, {p4});
  const std::string p5 = write_file("empty.model", "");
  expect_error([&] { make_tokenizer({"SentencePieceTokenizer", "", "", p5}); }, {p5});
}

#endif  // MOECORE_HAVE_SENTENCEPIECE

}  // namespace
}  // namespace moecore::data
