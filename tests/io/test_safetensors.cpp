// safetensors: the byte-exact test vector of docs/formats.md §3.6, round trips of every dtype, and rejection of
// malformed files with errors that name the file and the reason.
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "moecore/io/file_util.h"
#include "moecore/io/safetensors.h"
#include "test_util.h"

namespace moecore {
namespace {

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// Per process: ctest runs every test case as its own process, in parallel.
std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() /
          (std::string("moecore_test_") + std::to_string(::getpid()) + "_" + name))
      .string();
}

TEST(Safetensors, MatchesTheReferenceWriterByteForByte) {
  Tensor w = Tensor::empty({2}, DType::f32);
  w.data<float>()[0] = 1.0f;
  w.data<float>()[1] = 2.0f;
  const std::string expect = from_hex(
      "5800000000000000"
      "7b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074227d2c2277223a7b226474797065223a22463332222c"
      "227368617065223a5b325d2c22646174615f6f666673657473223a5b302c385d7d7d202020"
      "0000803f00000040");
  EXPECT_EQ(io::safetensors_serialize({{"w", w}}), expect);
}

TEST(Safetensors, RoundTripsEveryDtype) {
  std::map<std::string, Tensor> ts;
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f8e4m3, DType::f8e5m2, DType::i32, DType::i64}) {
    Tensor t = Tensor::empty({3, 2}, dt);
    for (int i = 0; i < 6; ++i) {
      const float v = static_cast<float>(i) - 2.5f;
      convert(static_cast<char*>(t.raw()) + i * dtype_size(dt), dt, &v, DType::f32, 1);
    }
    ts[std::string(dtype_name(dt))] = t;
  }
  ts["empty"] = Tensor::empty({0, 4}, DType::f32);
  const std::string path = temp_path("roundtrip.safetensors");
  io::safetensors_save(path, ts, {{"note", "x"}});
  const io::SafetensorsFile f = io::safetensors_load(path);
  EXPECT_EQ(f.metadata.at("format"), "pt");
  EXPECT_EQ(f.metadata.at("note"), "x");
  ASSERT_EQ(f.tensors.size(), ts.size());
  for (const auto& [name, t] : ts) {
    const Tensor& g = f.tensors.at(name);
    ASSERT_EQ(g.dtype(), t.dtype()) << name;
    ASSERT_EQ(g.shape(), t.shape()) << name;
    EXPECT_EQ(std::memcmp(g.raw(), t.raw(), static_cast<size_t>(t.nbytes())), 0) << name;
  }
  std::filesystem::remove(path);
}

void expect_rejected(const std::string& bytes, const char* reason) {
  const std::string path = temp_path("bad.safetensors");
  io::write_file_atomic(path, bytes);
  try {
    io::safetensors_load(path);
    ADD_FAILURE() << "accepted a file with " << reason;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(reason), std::string::npos) << msg;
  }
  std::filesystem::remove(path);
}

TEST(Safetensors, RejectsMalformedFiles) {
  Tensor w = Tensor::zeros({2}, DType::f32);
  const std::string good = io::safetensors_serialize({{"w", w}});
  expect_rejected(good.substr(0, 5), "shorter than 8 bytes");
  expect_rejected(good.substr(0, good.size() - 1), "truncated");
  expect_rejected(good + "x", "trailing");
  std::string dup = good;
  const std::string hdr =
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}";
  std::string n(8, '\0');
  const uint64_t len = hdr.size();
  std::memcpy(n.data(), &len, 8);
  expect_rejected(n + hdr + std::string(8, '\0'), "duplicate key");
  const std::string bad_size = "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}";
  const uint64_t len2 = bad_size.size();
  std::memcpy(n.data(), &len2, 8);
  expect_rejected(n + bad_size + std::string(8, '\0'), "needs 12");
}

// A file from a raw header (not padded) and data: the length prefix says header.size() unless `n` is given.
std::string raw_file(const std::string& header, const std::string& data = "", int64_t n = -1) {
  std::string len(8, '\0');
  const uint64_t v = n >= 0 ? static_cast<uint64_t>(n) : header.size();
  std::memcpy(len.data(), &v, 8);
  return len + header + data;
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t b, uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(b) + "," + std::to_string(e) + "]}";
}

// Regression (issue 15): the element count of [2^31, 2^31] F64 times 64 bits wrapped to 0, so a header declaring
// 2^62 doubles with data_offsets [0, 0] and no data was accepted; [2^32, 2^32] F32 must fail the same way.
TEST(Safetensors, RejectsShapesWhoseSizeOverflows) {
  expect_rejected(raw_file("{" + entry("w", "F64", "[2147483648,2147483648]", 0, 0) + "}"), "overflows");
  expect_rejected(raw_file("{" + entry("w", "F32", "[4294967296,4294967296]", 0, 0) + "}"), "overflows");
  expect_rejected(raw_file("{" + entry("w", "F32", "[18446744073709551615]", 0, 0) + "}"), "overflows");
  expect_rejected(raw_file("{" + entry("w", "F32", "[4611686018427387904,2,0]", 0, 0) + "}"), "overflows");
}

// The reference reader's rules (docs/reliability-practices.md §5), each from a mutated file.
TEST(Safetensors, FollowsTheReferenceReadersRules) {
  const std::string w = entry("w", "F32", "[2]", 0, 8), data(8, '\0');
  expect_rejected(raw_file("{}", "", 1) + "{}", "below 2");
  expect_rejected(raw_file("{" + w + "}", data, 100000001), "exceeds 100000000");
  expect_rejected(raw_file("{" + w + "}", data, 1000), "runs past the end");
  expect_rejected(raw_file(" {" + w + "}", data), "does not start with '{'");
  expect_rejected(raw_file("[" + w + "]", data), "does not start with '{'");
  expect_rejected(raw_file("{\"__metadata__\":{\"a\":\"\xff\xfe\"}," + w + "}", data), "not valid UTF-8");
  expect_rejected(raw_file("{\"__metadata__\":{\"a\":\"\xed\xa0\x80\"}," + w + "}", data), "not valid UTF-8");
  expect_rejected(raw_file("{" + w + ",}", data), "not valid JSON");
  expect_rejected(raw_file("{" + entry("w", "F31", "[2]", 0, 8) + "}", data), "not a safetensors dtype");
  expect_rejected(raw_file("{" + entry("w", "F32", "[-2]", 0, 8) + "}", data), "not a non-negative integer");
  expect_rejected(raw_file("{" + entry("w", "F32", "[2.0]", 0, 8) + "}", data), "not a non-negative integer");
  expect_rejected(raw_file("{" + entry("w", "F32", "[1,1,1,1,1,1,1]", 0, 4) + "}", data), "more than 6 dims");
  expect_rejected(raw_file("{" + entry("w", "F32", "[0]", 8, 0) + "}", data), "end before they begin");
  expect_rejected(raw_file("{" + entry("w", "F32", "[4]", 0, 16) + "}", data),
                  "MetadataIncompleteBuffer");                                                   // past the buffer
  expect_rejected(raw_file("{" + entry("w", "F32", "[1]", 4, 8) + "}", data), "InvalidOffset");  // a gap first
  expect_rejected(raw_file("{" + entry("w", "F32", "[1]", 0, 4) + "}", data), "MetadataIncompleteBuffer");
  expect_rejected(raw_file("{" + w + "," + entry("v", "F32", "[1]", 4, 8) + "}", data), "InvalidOffset");  // overlap
  expect_rejected(raw_file("{" + entry("w", "F4", "[3]", 0, 1) + "}", std::string(1, '\0')), "whole number");
  expect_rejected(raw_file("{\"__metadata__\":{\"a\":1}," + w + "}", data), "is not a string");
  expect_rejected(raw_file("{\"__metadata__\":[]," + w + "}", data), "__metadata__ is not an object");
  expect_rejected(raw_file("{" + w + ",\"v\":[]}", data), "lacks dtype");
  std::string deep = "{\"__metadata__\":{\"a\":\"b\"},\"x\":";
  for (int i = 0; i < 200; ++i) deep += "[";
  expect_rejected(raw_file(deep + "}", data), "deeper than 128");
}

// Empty tensors may share an offset with the tensor that starts there, whatever their names (the reference
// sorts by (begin, end)); a null __metadata__ is the reference's None.
TEST(Safetensors, AcceptsEmptyTensorsAtAnyBoundary) {
  const std::string path = temp_path("empty_at_boundary.safetensors");
  io::write_file_atomic(path,
                        raw_file("{\"__metadata__\":null," + entry("a", "F32", "[2]", 0, 8) + "," +
                                     entry("b", "F32", "[0,3]", 0, 0) + "," + entry("c", "I64", "[0]", 8, 8) + "}",
                                 std::string(8, '\0')));
  const io::SafetensorsFile f = io::safetensors_load(path);
  EXPECT_EQ(f.tensors.size(), 3u);
  EXPECT_TRUE(f.metadata.empty());
  EXPECT_EQ(f.tensors.at("b").shape(), Shape({0, 3}));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moecore
