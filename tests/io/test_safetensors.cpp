// safetensors: the byte-exact test vector of formats.md §3.6, round trips of every dtype, and rejection of
// malformed files with errors that name the file and the reason.
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

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string("moecore_test_") + name)).string();
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

}  // namespace
}  // namespace moecore
