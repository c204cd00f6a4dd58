// Megatron .bin/.idx: the docs/formats.md §1.5 test vector byte for byte, round trips in every dtype, reader
// errors that name the file and reason, merging; and preprocess_run (JSONL and text input, worker-count
// independence, --append-eod) with the ByteLevel tokenizer.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/preprocess.h"
#include "test_util.h"

namespace moecore::data {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(fs::temp_directory_path() / ("moecore_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) out += d[c >> 4], out += d[c & 15];
  return out;
}

using testing::error_of;

const char* kBinHex = "0a000b0050c4140050c4";
const char* kIdxHex =
    "4d4d49444944580000"
    "0100000000000000"
    "08"
    "0200000000000000"
    "0300000000000000"
    "03000000"
    "02000000"
    "0000000000000000"
    "0600000000000000"
    "0000000000000000"
    "0100000000000000"
    "0200000000000000";

void write_test_vector(const std::string& prefix) {
  IndexedDatasetBuilder b(indexed_bin_path(prefix), TokenDType::u16);
  b.add_document(std::vector<int32_t>{10, 11, 50256});
  b.add_document(std::vector<int32_t>{20, 50256});
  b.finalize(indexed_idx_path(prefix));
}

TEST(IndexedDataset, TestVectorBytes) {
  TempDir dir("idx_vector");
  const std::string prefix = dir / "vec_text_document";
  write_test_vector(prefix);
  EXPECT_EQ(hex(read_bytes(prefix + ".bin")), kBinHex);
  const std::string idx = read_bytes(prefix + ".idx");
  EXPECT_EQ(idx.size(), 82u);
  EXPECT_EQ(hex(idx), kIdxHex);
  const std::vector<int32_t> lengths{3, 2};
  const std::vector<int64_t> docs{0, 1, 2};
  EXPECT_EQ(hex(indexed_idx_serialize(TokenDType::u16, lengths, docs)), kIdxHex);
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp." + std::to_string(::getpid())));
}

TEST(IndexedDataset, TestVectorReadBack) {
  TempDir dir("idx_read");
  const std::string prefix = dir / "vec";
  write_test_vector(prefix);
  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.dtype(), TokenDType::u16);
  EXPECT_EQ(ds.num_sequences(), 2);
  EXPECT_EQ(ds.num_documents(), 2);
  EXPECT_EQ(ds.sequence_length(0), 3);
  EXPECT_EQ(ds.sequence_length(1), 2);
  EXPECT_EQ(ds.sequence_pointer(1), 6);
  EXPECT_EQ(ds.document_index(2), 2);
  EXPECT_EQ(ds.get(0), (std::vector<int32_t>{10, 11, 50256}));
  EXPECT_EQ(ds.get(1), (std::vector<int32_t>{20, 50256}));
  EXPECT_EQ(ds.get(0, 1, 2), (std::vector<int32_t>{11, 50256}));
  EXPECT_EQ(ds.sequence_lengths(0, 2), (std::vector<int32_t>{3, 2}));
  EXPECT_THROW(ds.get(0, 2, 2), Error);
}

TEST(IndexedDataset, DtypeTable) {
  EXPECT_EQ(token_dtype_optimal(50257), TokenDType::u16);
  EXPECT_EQ(token_dtype_optimal(65499), TokenDType::u16);
  EXPECT_EQ(token_dtype_optimal(65500), TokenDType::i32);
  EXPECT_EQ(token_dtype_optimal(151936), TokenDType::i32);
  const int sizes[9] = {0, 1, 1, 2, 4, 8, 8, 4, 2};
  const char* names[9] = {"", "uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"};
  for (int c = 1; c <= 8; ++c) {
    EXPECT_EQ(token_dtype_size(static_cast<TokenDType>(c)), sizes[c]) << c;
    EXPECT_STREQ(token_dtype_name(static_cast<TokenDType>(c)), names[c]);
  }
  EXPECT_FALSE(token_dtype_valid(0));
  EXPECT_FALSE(token_dtype_valid(9));
}

TEST(IndexedDataset, RoundTripEveryDtype) {
  TempDir dir("idx_dtypes");
  const std::vector<int32_t> tokens{0, 1, 2, 100, 127, 5, 7};
  for (int c = 1; c <= 8; ++c) {
    const auto t = static_cast<TokenDType>(c);
    const std::string prefix = dir / ("d" + std::to_string(c));
    IndexedDatasetBuilder b(indexed_bin_path(prefix), t);
    b.add_document(tokens, std::vector<int32_t>{3, 4});  // one document, two sentences
    b.add_item(std::vector<int32_t>{9});
    b.end_document();
    b.add_document(std::vector<int32_t>{});  // empty document: a boundary, no sequence
    b.finalize(indexed_idx_path(prefix));
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), t);
    ASSERT_EQ(ds.num_sequences(), 3);
    ASSERT_EQ(ds.num_documents(), 3);
    EXPECT_EQ(ds.document_index(1), 2);
    EXPECT_EQ(ds.document_index(2), 3);
    EXPECT_EQ(ds.document_index(3), 3);
    EXPECT_EQ(ds.sequence_pointer(2), 7 * token_dtype_size(t));
    EXPECT_EQ(ds.get(0), (std::vector<int32_t>{0, 1, 2}));
    EXPECT_EQ(ds.get(1), (std::vector<int32_t>{100, 127, 5, 7}));
    EXPECT_EQ(ds.get(2), (std::vector<int32_t>{9}));
  }
}

TEST(IndexedDataset, WriterRejectsOutOfRangeAndMismatchedLengths) {
  TempDir dir("idx_range");
  IndexedDatasetBuilder b(dir / "r.bin", TokenDType::u16);
  const std::string msg = error_of([&] { b.add_document(std::vector<int32_t>{70000}); });
  EXPECT_NE(msg.find("70000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("uint16"), std::string::npos) << msg;
  EXPECT_THROW(b.add_document(std::vector<int32_t>{1, 2}, std::vector<int32_t>{3}), Error);
}

TEST(IndexedDataset, UnfinalizedBuilderLeavesNothing) {
  TempDir dir("idx_abort");
  {
    IndexedDatasetBuilder b(dir / "x.bin", TokenDType::u16);
    b.add_document(std::vector<int32_t>{1, 2, 3});
  }
  EXPECT_TRUE(fs::is_empty(dir / ""));
}

TEST(IndexedDataset, ReaderErrorsNameFileAndReason) {
  TempDir dir("idx_errors");
  const std::string good = dir / "good";
  write_test_vector(good);
  const std::string idx = read_bytes(good + ".idx"), bin = read_bytes(good + ".bin");
  struct Case {
    const char* name;
    std::string idx, bin, reason;
  };
  std::string bad_magic = idx, bad_version = idx, bad_dtype = idx;
  bad_magic[0] = 'X';
  bad_version[9] = 2;
  bad_dtype[17] = 9;
  const std::vector<Case> cases = {
      {"magic", bad_magic, bin, "bad magic"},
      {"version", bad_version, bin, "unsupported version 2"},
      {"dtype", bad_dtype, bin, "unknown dtype code 9"},
      {"header", idx.substr(0, 20), bin, "truncated index"},
      {"arrays", idx.substr(0, 60), bin, "truncated index"},
      {"bin", idx, bin.substr(0, 8), "truncated"},
  };
  for (const auto& c : cases) {
    const std::string prefix = dir / c.name;
    write_bytes(prefix + ".idx", c.idx);
    write_bytes(prefix + ".bin", c.bin);
    const std::string msg = error_of([&] { IndexedDataset ds(prefix); });
    EXPECT_NE(msg.find(prefix), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.reason), std::string::npos) << c.name << ": " << msg;
  }
  const std::string missing = error_of([&] { IndexedDataset ds(dir / "nope"); });
  EXPECT_NE(missing.find("nope.idx"), std::string::npos) << missing;
}

// Issue 15 reproducers: corrupt .idx files fail at open with the path, the field, the expected and actual values.
// Test vector layout (S = 2, D = 3): sizes at 34, pointers at 42, document_indices at 58, 82 bytes in all.
template <class T>
std::string with(std::string bytes, size_t at, T v) {
  std::memcpy(bytes.data() + at, &v, sizeof(T));
  return bytes;
}

std::string open_error(const std::string& prefix, const std::string& idx, const std::string& bin) {
  write_bytes(prefix + ".idx", idx);
  write_bytes(prefix + ".bin", bin);
  return error_of([&] { IndexedDataset ds(prefix); });
}

TEST(IndexedDataset, LastPointerNear2Pow63FailsAtOpen) {
  // The outside tester's file: the last pointer 2^63 - 4 made pointer + size * 2 wrap below the .bin size.
  TempDir dir("idx_overflow");
  write_test_vector(dir / "good");
  const std::string idx = read_bytes(dir / "good.idx"), bin = read_bytes(dir / "good.bin");
  const std::string prefix = dir / "bad";
  const std::string msg = open_error(prefix, with<int64_t>(idx, 50, INT64_MAX - 3), bin);
  for (const std::string& part : {prefix + ".idx", std::string("pointers[1]"), std::string("expected 6"),
                                  std::string("found 9223372036854775804")})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
}

TEST(IndexedDataset, WrongDtypeCodeFailsAtOpen) {
  // dtype 8 (uint16) changed to 1 (uint8): the pointers no longer follow sizes * itemsize.
  TempDir dir("idx_dtype");
  write_test_vector(dir / "good");
  const std::string idx = read_bytes(dir / "good.idx"), bin = read_bytes(dir / "good.bin");
  const std::string msg = open_error(dir / "bad", with<uint8_t>(idx, 17, 1), bin);
  for (const char* part : {"bad.idx", "pointers[1]", "expected 3", "uint8", "found 6"})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  // With one sequence there is no second pointer: the .bin size catches it.
  {
    IndexedDatasetBuilder b(indexed_bin_path(dir / "one"), TokenDType::u16);
    b.add_document(std::vector<int32_t>{1, 2, 3});
    b.finalize(indexed_idx_path(dir / "one"));
  }
  const std::string one =
      open_error(dir / "one8", with<uint8_t>(read_bytes(dir / "one.idx"), 17, 1), read_bytes(dir / "one.bin"));
  for (const char* part : {"one8.bin", "size", "expected 3 bytes", "found 6"})
    EXPECT_NE(one.find(part), std::string::npos) << one;
}

TEST(IndexedDataset, EveryFieldIsCheckedAtOpen) {
  TempDir dir("idx_fields");
  write_test_vector(dir / "good");
  const std::string idx = read_bytes(dir / "good.idx"), bin = read_bytes(dir / "good.bin");
  ASSERT_EQ(idx.size(), 82u);
  struct Case {
    const char* name;
    std::string idx, bin;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"negative_size", with<int32_t>(idx, 38, -1), bin, {"sizes[1]", "expected >= 0", "found -1"}},
      {"pointer0", with<int64_t>(idx, 42, 2), bin, {"pointers[0]", "expected 0", "found 2"}},
      {"pointer1_low", with<int64_t>(idx, 50, 4), bin, {"pointers[1]", "expected 6", "found 4"}},
      {"pointer1_negative", with<int64_t>(idx, 50, -6), bin, {"pointers[1]", "expected 6", "found -6"}},
      {"doc0", with<int64_t>(idx, 58, 1), bin, {"document_indices[0]", "expected 0", "found 1"}},
      {"doc_decreasing",
       with<int64_t>(with<int64_t>(idx, 66, 2), 74, 1),
       bin,
       {"document_indices[2]", "[2, 2]", "found 1"}},
      {"doc_past_s", with<int64_t>(idx, 66, 7), bin, {"document_indices[1]", "found 7"}},
      {"doc_last", with<int64_t>(idx, 74, 1), bin, {"document_indices[2]", "expected sequence_count 2", "found 1"}},
      {"doc_count_0", with<uint64_t>(idx, 26, 0), bin, {"document_count", "found 0"}},
      {"seq_count_huge",
       with<uint64_t>(idx, 18, uint64_t(1) << 62),
       bin,
       {"size", "sequence_count 4611686018427387904"}},
      {"doc_count_huge", with<uint64_t>(idx, 26, ~uint64_t(0)), bin, {"size", "document_count 18446744073709551615"}},
      {"trailing_idx", idx + std::string(8, '\0'), bin, {"size", "need 82 bytes", "the file has 90"}},
      {"truncated_idx", idx.substr(0, 81), bin, {"truncated index", "the file has 81"}},
      {"empty_idx", "", bin, {"truncated index: 0 bytes"}},
      {"long_bin", idx, bin + "xx", {".bin", "expected 10 bytes", "found 12"}},
      {"short_bin", idx, bin.substr(0, 9), {".bin", "expected 10 bytes", "found 9 (truncated)"}},
      {"empty_bin", idx, "", {".bin", "expected 10 bytes", "found 0"}},
  };
  for (const auto& c : cases) {
    const std::string prefix = dir / c.name;
    const std::string msg = open_error(prefix, c.idx, c.bin);
    EXPECT_NE(msg.find(prefix), std::string::npos) << c.name << ": " << msg;
    for (const std::string& p : c.parts) EXPECT_NE(msg.find(p), std::string::npos) << c.name << ": " << msg;
  }
  // An empty dataset (no sequences, one boundary) with an empty .bin is valid.
  {
    IndexedDatasetBuilder b(indexed_bin_path(dir / "empty"), TokenDType::u16);
    b.finalize(indexed_idx_path(dir / "empty"));
  }
  IndexedDataset empty(dir / "empty");
  EXPECT_EQ(empty.num_sequences(), 0);
  EXPECT_EQ(empty.num_documents(), 0);
}

TEST(IndexedDataset, FloatAndWideTokensThatAreNotIdsFail) {
  // float32 / int64 .bin values that no int32 id equals (NaN, 1e10, 2^40) are Errors, not undefined casts.
  TempDir dir("idx_float");
  for (TokenDType t : {TokenDType::f32, TokenDType::f64, TokenDType::i64}) {
    const std::string prefix = dir / token_dtype_name(t);
    {
      IndexedDatasetBuilder b(indexed_bin_path(prefix), t);
      b.add_document(std::vector<int32_t>{1, 2, 3});
      b.finalize(indexed_idx_path(prefix));
    }
    std::string bin = read_bytes(prefix + ".bin");
    if (t == TokenDType::f32) bin = with<float>(bin, 4, std::numeric_limits<float>::quiet_NaN());
    if (t == TokenDType::f64) bin = with<double>(bin, 8, 1e10);
    if (t == TokenDType::i64) bin = with<int64_t>(bin, 8, int64_t(1) << 40);
    write_bytes(prefix + ".bin", bin);
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.get(0, 0, 1), std::vector<int32_t>{1});
    const std::string msg = error_of([&] { (void)ds.get(0); });
    EXPECT_NE(msg.find(prefix + ".bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not a token id"), std::string::npos) << msg;
  }
}

TEST(IndexedDataset, ReadRangeOverflowIsAnError) {
  TempDir dir("idx_range");
  write_test_vector(dir / "v");
  IndexedDataset ds(dir / "v");
  std::vector<int32_t> out(4);
  EXPECT_THROW(ds.read(0, INT64_MAX - 1, 2, out.data()), Error);
  EXPECT_THROW(ds.read(0, 2, INT64_MAX, out.data()), Error);
  EXPECT_THROW((void)ds.get(0, 5), Error);
  EXPECT_THROW((void)ds.get(2), Error);
}

TEST(IndexedDataset, MergeWithAddIndex) {
  TempDir dir("idx_merge");
  const std::string a = dir / "a", b = dir / "b", m = dir / "m";
  write_test_vector(a);
  {
    IndexedDatasetBuilder w(indexed_bin_path(b), TokenDType::u16);
    w.add_document(std::vector<int32_t>{1, 2}, std::vector<int32_t>{1, 1});
    w.finalize(indexed_idx_path(b));
  }
  IndexedDatasetBuilder w(indexed_bin_path(m), TokenDType::u16);
  w.add_index(a);
  w.add_index(b);
  w.finalize(indexed_idx_path(m));
  IndexedDataset ds(m);
  ASSERT_EQ(ds.num_sequences(), 4);
  ASSERT_EQ(ds.num_documents(), 3);
  EXPECT_EQ(ds.document_index(3), 4);
  EXPECT_EQ(ds.get(1), (std::vector<int32_t>{20, 50256}));
  EXPECT_EQ(ds.get(3), (std::vector<int32_t>{2}));
  IndexedDatasetBuilder wrong(dir / "w.bin", TokenDType::i32);
  EXPECT_THROW(wrong.add_index(a), Error);
}

// ---------------------------------------------------------------------------------------------------
// preprocess_run

PreprocessOptions byte_level(const std::string& input, const std::string& out, int workers) {
  PreprocessOptions o;
  o.input = input;
  o.output_prefix = out;
  o.tokenizer.type = "ByteLevel";
  o.workers = workers;
  o.batch_documents = 2;  // several rounds even on a small file
  return o;
}

TEST(Preprocess, JsonlWorkersGiveIdenticalBytes) {
  TempDir dir("pre_jsonl");
  const std::string input = dir / "in.jsonl";
  std::string text;
  for (int i = 0; i < 23; ++i) {
    text += "{\"id\": " + std::to_string(i) + ", \"text\": \"doc " + std::to_string(i) + " \\u00e9\\n" +
            std::string(static_cast<size_t>(i % 5), 'x') + "\"}\n";
    if (i == 7) text += "{\"text\": \"\"}\n\n";  // an empty document, then a blank line (skipped)
  }
  write_bytes(input, text);
  auto o1 = byte_level(input, dir / "one", 1);
  o1.append_eod = true;
  auto o2 = o1;
  o2.output_prefix = dir / "two";
  o2.workers = 2;
  const PreprocessStats s1 = preprocess_run(o1, nullptr);
  const PreprocessStats s2 = preprocess_run(o2, nullptr);
  ASSERT_EQ(s1.output_prefixes, std::vector<std::string>{dir / "one_text_document"});
  EXPECT_EQ(s1.documents, 24);
  EXPECT_EQ(s1.tokens, s2.tokens);
  EXPECT_EQ(s1.input_bytes, static_cast<int64_t>(text.size()));
  for (const char* ext : {".bin", ".idx"}) {
    EXPECT_EQ(read_bytes(dir / (std::string("one_text_document") + ext)),
              read_bytes(dir / (std::string("two_text_document") + ext)))
        << ext;
  }
  IndexedDataset ds(dir / "one_text_document");
  EXPECT_EQ(ds.dtype(), TokenDType::u16);  // ByteLevel vocab 257 < 65500
  EXPECT_EQ(ds.num_documents(), 24);
  EXPECT_EQ(ds.num_sequences(), 23);  // the empty document has no sequence (and no EOD)
  const std::string doc3 = "doc 3 \xc3\xa9\nxxx";
  std::vector<int32_t> want(doc3.begin(), doc3.end());
  for (auto& v : want) v &= 0xff;
  want.push_back(256);  // EOD
  EXPECT_EQ(ds.get(3), want);
  EXPECT_EQ(ds.document_index(8), 8);
  EXPECT_EQ(ds.document_index(9), 8);  // document 8 is the empty one
}

TEST(Preprocess, ListValuesAreSentencesAndEodClosesTheLast) {
  TempDir dir("pre_list");
  const std::string input = dir / "in.jsonl";
  write_bytes(input, "{\"text\": [\"ab\", \"\", \"c\"], \"title\": \"T\"}\n");
  auto o = byte_level(input, dir / "out", 1);
  o.append_eod = true;
  o.json_keys = {"text", "title"};
  const auto stats = preprocess_run(o, nullptr);
  ASSERT_EQ(stats.output_prefixes.size(), 2u);
  IndexedDataset text(stats.output_prefixes[0]), title(stats.output_prefixes[1]);
  ASSERT_EQ(text.num_sequences(), 2);
  EXPECT_EQ(text.get(0), (std::vector<int32_t>{'a', 'b'}));
  EXPECT_EQ(text.get(1), (std::vector<int32_t>{'c', 256}));
  EXPECT_EQ(text.num_documents(), 1);
  EXPECT_EQ(title.get(0), (std::vector<int32_t>{'T', 256}));
}

TEST(Preprocess, TextInputLinesAndParagraphs) {
  TempDir dir("pre_text");
  const std::string input = dir / "in.txt";
  write_bytes(input, "first line\r\n\nsecond\nthird\n  \nlast");
  auto lines = byte_level(input, dir / "lines", 2);
  preprocess_run(lines, nullptr);
  IndexedDataset a(dir / "lines_text_document");
  ASSERT_EQ(a.num_documents(), 4);
  EXPECT_EQ(a.get(0).size(), 10u);  // "first line" without "\r\n"
  EXPECT_EQ(a.get(2).size(), 5u);   // "third"
  auto paragraphs = byte_level(input, dir / "paras", 2);
  paragraphs.documents_by_blank_line = true;
  preprocess_run(paragraphs, nullptr);
  IndexedDataset b(dir / "paras_text_document");
  ASSERT_EQ(b.num_documents(), 3);
  const auto mid = b.get(1);
  EXPECT_EQ(std::string(mid.begin(), mid.end()), "second\nthird");
}

TEST(Preprocess, ErrorsNameTheInput) {
  TempDir dir("pre_err");
  const std::string input = dir / "bad.jsonl";
  write_bytes(input, "{\"text\": \"ok\"}\n{\"body\": \"no text key\"}\n");
  const std::string missing = error_of([&] { preprocess_run(byte_level(input, dir / "o", 2), nullptr); });
  EXPECT_NE(missing.find("line 2"), std::string::npos) << missing;
  EXPECT_NE(missing.find("\"text\""), std::string::npos) << missing;
  EXPECT_FALSE(fs::exists(dir / "o_text_document.idx"));
  write_bytes(input, "{\"text\": \"ok\"\n");
  const std::string broken = error_of([&] { preprocess_run(byte_level(input, dir / "o", 1), nullptr); });
  EXPECT_NE(broken.find("not valid JSON"), std::string::npos) << broken;
  const std::string absent = error_of([&] { preprocess_run(byte_level(dir / "none.jsonl", dir / "o", 1), nullptr); });
  EXPECT_NE(absent.find("none.jsonl"), std::string::npos) << absent;
  write_bytes(input, "{\"text\": \"ok\"}\n" + std::string(200000, '[') + "\n");  // issue 15: no stack overflow
  const std::string deep = error_of([&] { preprocess_run(byte_level(input, dir / "o", 1), nullptr); });
  EXPECT_NE(deep.find("line 2"), std::string::npos) << deep;
  EXPECT_NE(deep.find("nested deeper"), std::string::npos) << deep;
  auto zero = byte_level(input, dir / "o", 0);
  EXPECT_THROW(preprocess_run(zero, nullptr), Error);
}

}  // namespace
}  // namespace moecore::data
