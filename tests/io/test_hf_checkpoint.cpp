// HF checkpoint directories: sharded write-then-read round trips (bit-identical, byte layout of
// safetensors_serialize), files of io/safetensors.cpp, single-file checkpoints, each error naming file, tensor and
// values, FP8 E4M3 decoding and block dequantisation against hand-computed values, a failed write leaving nothing,
// and peak-RSS growth while streaming synthetic checkpoints of 60 MB and 600 MB.
#include <unistd.h>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "moecore/io/file_util.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/io/safetensors.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed at the end.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("moecore_hf_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& s) const { return (path / s).string(); }
};

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << ::testing::PrintToString(parts);
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

// A safetensors file from a hand-written header (padded to 8) and data.
void write_raw(const std::string& path, std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string n(8, '\0');
  const uint64_t len = header.size();
  std::memcpy(n.data(), &len, 8);
  io::write_file_atomic(path, n + header + data);
}

void write_index(const std::string& dir, const std::string& weight_map_json) {
  io::write_file_atomic(dir + "/model.safetensors.index.json",
                        "{\"metadata\": {\"total_size\": 0}, \"weight_map\": " + weight_map_json + "}");
}

// The OCP E4M3FN decoding written out independently: bias 7, subnormals m * 2^-9, S.1111.111 is NaN.
float e4m3_reference(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

TEST(HfCheckpoint, ShardedRoundTripIsBitIdentical) {
  TempDir tmp("roundtrip");
  const std::string out = tmp / "ckpt";
  std::map<std::string, Tensor> written;  // as they should read back
  std::vector<std::string> order;
  {
    io::HfCheckpointWriter w(out, /*max_shard_bytes=*/3000);
    for (int l = 0; l < 3; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Tensor a = testing::randn({16, 24}, (p + "a").c_str());                 // 1536 B f32
      Tensor b = testing::randn({8, 40}, (p + "b").c_str()).to(DType::bf16);  // 640 B bf16
      Tensor c = testing::randn({7, 9}, (p + "c").c_str());                   // written as bf16: 126 B
      w.add(p + "self_attn.q_proj.weight", a);
      w.add(p + "mlp.experts.3.w1.weight", b);
      w.add(p + "input_layernorm.weight", c, DType::bf16);
      written[p + "self_attn.q_proj.weight"] = a;
      written[p + "mlp.experts.3.w1.weight"] = b;
      written[p + "input_layernorm.weight"] = c.to(DType::bf16);
    }
    Tensor big = testing::randn({40, 30}, "big");  // 4800 B > max_shard_bytes: a shard of its own
    w.add("lm_head.weight", big);
    written["lm_head.weight"] = big;
    w.add("model.norm.weight", Tensor::empty({0}, DType::f32));
    written["model.norm.weight"] = Tensor::empty({0}, DType::f32);
    w.set_config_json("{\"model_type\": \"test\"}\n");
    EXPECT_FALSE(fs::exists(out));
    EXPECT_EQ(w.finish(), 5);
  }
  EXPECT_EQ(io::read_file(out + "/config.json"), "{\"model_type\": \"test\"}\n");
  io::HfCheckpointReader r(out);
  EXPECT_TRUE(r.sharded());
  ASSERT_EQ(r.tensors().size(), written.size());
  uint64_t total = 0;
  std::map<std::string, std::map<std::string, Tensor>> by_shard;
  for (const auto& [name, t] : written) {
    const io::HfTensorInfo& info = r.info(name);
    EXPECT_EQ(info.dtype_name, io::safetensors_dtype_name(t.dtype())) << name;
    EXPECT_TRUE(same_bytes(r.read(name), t)) << name;
    by_shard[info.shard][name] = t;
    total += static_cast<uint64_t>(t.nbytes());
  }
  EXPECT_EQ(r.total_bytes(), total);
  EXPECT_EQ(r.info("lm_head.weight").shard, "model-00004-of-00005.safetensors");  // alone: insertion order kept
  EXPECT_EQ(r.info("model.layers.0.self_attn.q_proj.weight").shard, "model-00001-of-00005.safetensors");
  const auto idx = nlohmann::json::parse(io::read_file(out + "/model.safetensors.index.json"));
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_EQ(idx["weight_map"].size(), written.size());
  // Each shard holds exactly the bytes io/safetensors.cpp's writer produces for its tensors.
  ASSERT_EQ(by_shard.size(), 5u);
  for (const auto& [shard, ts] : by_shard)
    EXPECT_EQ(io::read_file(out + "/" + shard), io::safetensors_serialize(ts)) << shard;
  // No staging directory left beside the output.
  for (const auto& e : fs::directory_iterator(tmp.path)) EXPECT_EQ(e.path().filename(), "ckpt");
}

TEST(HfCheckpoint, OneShardIsModelSafetensorsWithoutIndex) {
  TempDir tmp("oneshard");
  Tensor a = testing::randn({5, 3}, "a");
  {
    io::HfCheckpointWriter w(tmp / "one");
    w.add("a.weight", a);
    EXPECT_EQ(w.finish(), 1);
  }
  EXPECT_FALSE(fs::exists(tmp / "one/model.safetensors.index.json"));
  EXPECT_EQ(io::read_file(tmp / "one/model.safetensors"), io::safetensors_serialize({{"a.weight", a}}));
  io::HfCheckpointReader r(tmp / "one");
  EXPECT_FALSE(r.sharded());
  EXPECT_TRUE(same_bytes(r.read("a.weight"), a));
  {
    io::HfCheckpointWriter w(tmp / "indexed", 1 << 20, /*index_for_one_shard=*/true);
    w.add("a.weight", a);
    w.finish();
  }
  EXPECT_TRUE(fs::exists(tmp / "indexed/model-00001-of-00001.safetensors"));
  EXPECT_TRUE(io::HfCheckpointReader(tmp / "indexed").sharded());
  // No tensors at all: a valid model.safetensors holding only the metadata.
  io::HfCheckpointWriter(tmp / "empty").finish();
  EXPECT_EQ(io::read_file(tmp / "empty/model.safetensors"), io::safetensors_serialize({}));
  EXPECT_TRUE(io::HfCheckpointReader(tmp / "empty").tensors().empty());
}

TEST(HfCheckpoint, ReadsFilesOfTheSafetensorsWriter) {
  TempDir tmp("stwriter");
  std::map<std::string, Tensor> s1, s2;
  s1["model.embed_tokens.weight"] = testing::randn({11, 6}, "e").to(DType::bf16);
  s1["model.layers.0.mlp.gate.e_score_correction_bias"] = testing::randn({4}, "b");
  s2["lm_head.weight"] = testing::randn({11, 6}, "h").to(DType::f16);
  Tensor ids = Tensor::empty({3}, DType::i64);
  for (int i = 0; i < 3; ++i) ids.data<int64_t>()[i] = 1000000007ll * i;
  s2["ids"] = ids;
  io::safetensors_save(tmp / "a.safetensors", s1);
  io::safetensors_save(tmp / "b.safetensors", s2);
  write_index(tmp.path.string(),
              R"({"model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.gate.e_score_correction_bias":
              "a.safetensors", "lm_head.weight": "b.safetensors", "ids": "b.safetensors"})");
  io::HfCheckpointReader r(tmp.path.string());
  ASSERT_EQ(r.tensors().size(), 4u);
  EXPECT_EQ(r.tensors().front().name, "ids");  // sorted by name
  for (const auto* m : {&s1, &s2})
    for (const auto& [name, t] : *m) EXPECT_TRUE(same_bytes(r.read(name), t)) << name;
  // Conversions: exact widenings, and f32 -> bf16 rounding as float_to_bf16 does.
  const Tensor e32 = r.read("model.embed_tokens.weight", DType::f32);
  EXPECT_TRUE(same_bytes(e32, s1["model.embed_tokens.weight"].to(DType::f32)));
  EXPECT_TRUE(same_bytes(r.read("lm_head.weight", DType::f32), s2["lm_head.weight"].to(DType::f32)));
  const Tensor b16 = r.read("model.layers.0.mlp.gate.e_score_correction_bias", DType::bf16);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(b16.data<bf16>()[i].bits,
              float_to_bf16(s1["model.layers.0.mlp.gate.e_score_correction_bias"].data<float>()[i]).bits);
  // A single model.safetensors from the same writer, no index.
  fs::create_directories(tmp / "single");
  io::safetensors_save(tmp / "single/model.safetensors", s1);
  io::HfCheckpointReader single(tmp / "single");
  EXPECT_FALSE(single.sharded());
  EXPECT_EQ(single.tensors().size(), 2u);
  EXPECT_EQ(single.info("model.embed_tokens.weight").shard, "model.safetensors");
  EXPECT_TRUE(same_bytes(single.read("model.embed_tokens.weight"), s1["model.embed_tokens.weight"]));
}

TEST(HfCheckpoint, ErrorsNameFileTensorAndValues) {
  TempDir tmp("errors");
  const std::string d = tmp.path.string();
  expect_error([&] { io::HfCheckpointReader r(d); }, {d, "model.safetensors.index.json", "model.safetensors"});

  Tensor w = testing::randn({2, 3}, "w");
  io::safetensors_save(d + "/s1.safetensors", {{"a", w}, {"b", w}});
  // The index names a file that is not there.
  write_index(d, R"({"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {"s2.safetensors", "'c'", "not there"});
  // A tensor listed in the index but absent from its shard.
  write_index(d, R"({"a": "s1.safetensors", "b": "s1.safetensors", "c": "s1.safetensors"})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {d + "/s1.safetensors", "'c'", "holds 2 tensors"});
  // A tensor in a shard that the index does not list.
  write_index(d, R"({"a": "s1.safetensors"})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {"s1.safetensors", "'b'", "does not list"});
  // Duplicate names: twice in the index, and in two shards.
  write_index(d, R"({"a": "s1.safetensors", "b": "s1.safetensors", "a": "s1.safetensors"})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {"model.safetensors.index.json", "duplicate name 'a'"});
  io::safetensors_save(d + "/s2.safetensors", {{"b", w}});
  write_index(d, R"({"a": "s1.safetensors", "b": "s2.safetensors"})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {"'b'", "s1.safetensors", "s2.safetensors"});
  fs::remove(d + "/s2.safetensors");
  // Bad headers: a duplicate key, a truncated file, a size that does not match the shape.
  write_index(d, R"({"a": "s1.safetensors"})");
  write_raw(d + "/s1.safetensors",
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],)"
            R"("data_offsets":[4,8]}})",
            std::string(8, '\0'));
  expect_error([&] { io::HfCheckpointReader r(d); }, {d + "/s1.safetensors", "duplicate name 'a'"});
  write_raw(d + "/s1.safetensors", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 0));
  expect_error([&] { io::HfCheckpointReader r(d); }, {"s1.safetensors", "'a'", "spans 8 bytes", "[3]", "needs 12"});
  write_raw(d + "/s1.safetensors", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", std::string(8, 0));
  expect_error([&] { io::HfCheckpointReader r(d); }, {"s1.safetensors", "cover 12 bytes", "holds 8"});
  write_raw(d + "/s1.safetensors", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]})", std::string(12, 0));
  expect_error([&] { io::HfCheckpointReader r(d); }, {"s1.safetensors", "not valid JSON"});
  // Dtypes that do not convert: an integer read as float, a dtype moecore does not hold.
  write_index(d, R"({"i": "s1.safetensors", "e": "s1.safetensors"})");
  write_raw(d + "/s1.safetensors",
            R"({"i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"e":{"dtype":"F8_E8M0","shape":[2],)"
            R"("data_offsets":[8,10]}})",
            std::string(10, 0));
  io::HfCheckpointReader r(d);
  EXPECT_EQ(r.info("e").dtype_name, "F8_E8M0");
  EXPECT_FALSE(r.info("e").type.has_value());
  expect_error([&] { r.read("i", DType::f32); }, {"s1.safetensors", "'i'", "I64", "f32"});
  expect_error([&] { r.read("e"); }, {"s1.safetensors", "'e'", "F8_E8M0"});
  expect_error([&] { r.read("nope"); }, {"'nope'", d});
  // Scale shape mismatch: [130, 200] with 128x128 blocks needs [2, 2].
  const std::string q = tmp / "fp8";
  {
    io::HfCheckpointWriter wr(q);
    wr.add("x.weight", Tensor::zeros({130, 200}, DType::f8e4m3));
    wr.add("x.weight_scale_inv", Tensor::zeros({1, 2}, DType::f32));
    wr.add("y.weight", Tensor::zeros({4, 4}, DType::bf16));
    wr.add("y.weight_scale_inv", Tensor::zeros({1, 1}, DType::f32));
    wr.finish();
  }
  io::HfCheckpointReader rq(q);
  expect_error([&] { rq.read_dequantized("x.weight"); }, {"x.weight_scale_inv", "[1, 2]", "[130, 200]", "[2, 2]"});
  expect_error([&] { rq.read_dequantized("y.weight"); }, {"'y.weight'", "F8_E4M3", "BF16"});
  // Writer: duplicate names and an output that exists.
  expect_error(
      [&] {
        io::HfCheckpointWriter wr(tmp / "dup");
        wr.add("a", w);
        wr.add("a", w);
      },
      {"'a'", "twice", tmp / "dup"});
  expect_error([&] { io::HfCheckpointWriter wr(q); }, {q, "already exists"});
  expect_error([&] { io::HfCheckpointWriter(tmp / "i2f").add("i", Tensor::zeros({1}, DType::i64), DType::f32); },
               {"'i'", "i64", "f32"});
}

// Regression (issue 15): the index's weight_map joined its values to the directory as given, so "../x" or an absolute
// path made the reader open a file outside the checkpoint. Shards must be plain file names beside the index; wrong
// JSON types and over-deep nesting are Errors naming the index.
TEST(HfCheckpoint, IndexRefusesShardsOutsideTheDirectoryAndWrongTypes) {
  TempDir tmp("hostile_index");
  const std::string d = tmp / "ckpt";
  fs::create_directories(d);
  Tensor w = testing::randn({2, 3}, "w");
  io::safetensors_save(tmp / "outside.safetensors", {{"a", w}});  // a valid shard, but beside the directory
  io::safetensors_save(d + "/s1.safetensors", {{"a", w}});
  const std::string idx = d + "/model.safetensors.index.json";
  for (const std::string& target : {std::string("../outside.safetensors"), tmp / "outside.safetensors",
                                    std::string("sub/s1.safetensors"), std::string(".."), std::string("")}) {
    write_index(d, "{\"a\": " + nlohmann::json(target).dump() + "}");
    expect_error([&] { io::HfCheckpointReader r(d); }, {idx, "'a'", "not a plain file name"});
  }
  write_index(d, R"({"a": "s1.safetensors\u0000x"})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {idx, "not a plain file name"});
  write_index(d, R"({"a": "missing.safetensors"})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {"missing.safetensors", "'a'", "not there"});
  // A name longer than the filesystem allows (fuzz_hf_index's finding: std::filesystem threw, not an Error).
  const std::string too_long(300, 'x');
  write_index(d, "{\"a\": \"" + too_long + "\"}");
  expect_error([&] { io::HfCheckpointReader r(d); }, {too_long, "'a'", "not there"});
  write_index(d, R"({"a": 7})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {idx, "'a'", "not a file name"});
  io::write_file_atomic(idx, R"({"weight_map": ["s1.safetensors"]})");
  expect_error([&] { io::HfCheckpointReader r(d); }, {idx, "weight_map"});
  io::write_file_atomic(idx, "[1, 2]");
  expect_error([&] { io::HfCheckpointReader r(d); }, {idx, "not a JSON object"});
  io::write_file_atomic(idx, "{\"metadata\": " + std::string(100000, '[') + "}");
  expect_error([&] { io::HfCheckpointReader r(d); }, {idx, "deeper than 128"});
  write_index(d, R"({"a": "s1.safetensors"})");
  EXPECT_TRUE(same_bytes(io::HfCheckpointReader(d).read("a"), w));
}

TEST(HfCheckpoint, FailureMidWayLeavesNoOutput) {
  TempDir tmp("failure");
  const std::string out = tmp / "out";
  try {
    io::HfCheckpointWriter w(out, 1000);
    for (int i = 0; i < 5; ++i)
      w.add("t" + std::to_string(i), testing::randn({20, 20}, "t"));  // 4 shards closed, 1 open
    w.set_config_json("{}");
    throw std::runtime_error("the conversion failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(fs::exists(out));
  EXPECT_TRUE(fs::is_empty(tmp.path));  // no staging directory either
  // finish() is what makes it appear.
  {
    io::HfCheckpointWriter w(out, 1000);
    w.add("t", testing::randn({20, 20}, "t"));
    EXPECT_FALSE(fs::exists(out));
    w.finish();
  }
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
}

TEST(HfCheckpoint, DecodesE4M3IncludingSubnormalsAndMax) {
  TempDir tmp("e4m3");
  Tensor all = Tensor::empty({256}, DType::f8e4m3);
  for (int b = 0; b < 256; ++b) static_cast<uint8_t*>(all.raw())[b] = static_cast<uint8_t>(b);
  {
    io::HfCheckpointWriter w(tmp / "c");
    w.add("all", all);
    w.finish();
  }
  const Tensor f = io::HfCheckpointReader(tmp / "c").read("all", DType::f32);
  const float* v = f.data<float>();
  for (int b = 0; b < 256; ++b) {
    const float ref = e4m3_reference(static_cast<uint8_t>(b));
    if (std::isnan(ref))
      EXPECT_TRUE(std::isnan(v[b])) << b;
    else
      EXPECT_EQ(v[b], ref) << "bits 0x" << std::hex << b;
  }
  EXPECT_EQ(v[0x01], 0.001953125f);  // smallest subnormal 2^-9
  EXPECT_EQ(v[0x07], 0.013671875f);  // largest subnormal 7 * 2^-9
  EXPECT_EQ(v[0x08], 0.015625f);     // smallest normal 2^-6
  EXPECT_EQ(v[0x38], 1.0f);
  EXPECT_EQ(v[0x7e], 448.0f);
  EXPECT_EQ(v[0xfe], -448.0f);
  EXPECT_TRUE(std::signbit(v[0x80]) && v[0x80] == 0.0f);
  EXPECT_TRUE(std::isnan(v[0x7f]) && std::isnan(v[0xff]));
}

TEST(HfCheckpoint, DequantizesBlockScaledFp8) {
  TempDir tmp("fp8");
  const int64_t R = 130, C = 200;  // not multiples of 128: edge blocks of 2 rows and 72 columns
  Tensor wq = Tensor::empty({R, C}, DType::f8e4m3);
  auto* bits = static_cast<uint8_t*>(wq.raw());
  for (int64_t i = 0; i < R * C; ++i) {
    const auto b = static_cast<uint8_t>((i * 37 + i / C) % 256);
    bits[i] = (b & 0x7f) == 0x7f ? 0x7e : b;  // no NaNs
  }
  Tensor s = Tensor::empty({2, 2}, DType::f32);
  const float scales[4] = {0.5f, 3.0f, 1.0f / 1024.0f, 7.25f};
  std::memcpy(s.raw(), scales, sizeof scales);
  {
    io::HfCheckpointWriter w(tmp / "c");
    w.add("model.layers.3.mlp.down_proj.weight", wq);
    w.add("model.layers.3.mlp.down_proj.weight_scale_inv", s);
    w.add("model.norm.weight", testing::randn({8}, "n").to(DType::bf16));
    w.finish();
  }
  io::HfCheckpointReader r(tmp / "c");
  EXPECT_TRUE(r.block_scaled("model.layers.3.mlp.down_proj.weight"));
  const Tensor deq = r.read_dequantized("model.layers.3.mlp.down_proj.weight");
  ASSERT_EQ(deq.dtype(), DType::f32);
  ASSERT_EQ(deq.shape(), (Shape{R, C}));
  int64_t mismatches = 0;
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) {
      const float ref = e4m3_reference(bits[i * C + j]) * scales[(i / 128) * 2 + j / 128];
      mismatches += deq.data<float>()[i * C + j] != ref;
    }
  EXPECT_EQ(mismatches, 0);
  // Spot values: element (129, 199) sits in block (1, 1), scale 7.25.
  EXPECT_EQ(deq.data<float>()[129 * C + 199], e4m3_reference(bits[129 * C + 199]) * 7.25f);
  // Tensors without a scale read as plain f32.
  EXPECT_TRUE(same_bytes(r.read_dequantized("model.norm.weight"), r.read("model.norm.weight", DType::f32)));
}

// Peak resident memory: VmHWM reset through /proc/self/clear_refs (Linux >= 4.0) so earlier tests do not count.
int64_t status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::strlen(key)));
  return -1;
}

float synthetic(int64_t t, int64_t i) {
  uint32_t x = static_cast<uint32_t>(t * 0x9E3779B1u + static_cast<uint64_t>(i) * 0x85EBCA77u);
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return static_cast<float>(x & 0xffff) / 65536.0f - 0.5f;
}

// Writes `count` f32 tensors of [1024, cols] (every third stored as bf16) into `dir` in shards of `per_shard`
// tensors, each generated only when added.
uint64_t write_synthetic(const std::string& dir, int count, int64_t cols, int per_shard) {
  const int64_t rows = 1024;
  io::HfCheckpointWriter w(dir, static_cast<uint64_t>(per_shard * rows * cols * 4));
  for (int t = 0; t < count; ++t) {
    Tensor x = Tensor::empty({rows, cols}, DType::f32);
    float* p = x.data<float>();
    for (int64_t i = 0; i < rows * cols; ++i) p[i] = synthetic(t, i);
    w.add("model.layers." + std::to_string(t) + ".mlp.experts.w", x, t % 3 == 2 ? DType::bf16 : DType::f32);
  }
  w.finish();
  return w.total_bytes();
}

// Reads every tensor back one at a time, checking each element against the generator.
void check_synthetic(const std::string& dir, int count, int64_t cols) {
  io::HfCheckpointReader r(dir);
  for (int t = 0; t < count; ++t) {
    const Tensor x = r.read("model.layers." + std::to_string(t) + ".mlp.experts.w", DType::f32);
    const float* p = x.data<float>();
    int64_t bad = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float v = synthetic(t, i);
      bad += p[i] != (t % 3 == 2 ? bf16_to_float(float_to_bf16(v)) : v);
    }
    ASSERT_EQ(bad, 0) << "tensor " << t << " of " << dir;
  }
}

// Streams a checkpoint of `count` tensors of `tensor_mb` MB out and back in, and asserts the peak RSS grew by less
// than a quarter of the checkpoint's size (shards of six tensors: loading a whole shard would exceed it). A warm-up
// round trip of three tensors first pays the one-time costs (OpenMP threads, first-touched code pages, malloc's
// adaptive mmap threshold), which do not scale with the size.
void streaming_check(const std::string& label, int count, int64_t tensor_mb) {
  TempDir tmp(label);
  const int64_t cols = tensor_mb * 1024 * 1024 / 4 / 1024;
  write_synthetic(tmp / "warmup", 3, cols, 1);
  check_synthetic(tmp / "warmup", 3, cols);
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  const int64_t rss0 = status_kb("VmRSS:");
  const uint64_t total = write_synthetic(tmp / "c", count, cols, 6);
  check_synthetic(tmp / "c", count, cols);
  const int64_t hwm = status_kb("VmHWM:");
  if (rss0 < 0 || hwm < 0) GTEST_SKIP() << "no /proc/self/status";
  const double growth_mb = double(hwm - rss0) / 1024.0, total_mb = double(total) / (1 << 20);
  std::printf("[ streaming ] %s: %d tensors, %.0f MB on disk, peak RSS growth %.1f MB (%.1f%%)\n", label.c_str(), count,
              total_mb, growth_mb, 100.0 * growth_mb / total_mb);
  EXPECT_LT(growth_mb, 0.25 * total_mb);
}

// ~600 MB in tensors of 50 MB: about 2.5 s here, so it stays in the default suite (no "long" label). A smaller
// checkpoint (60 MB in 5 MB tensors) proved too close to malloc's own noise: it failed once in a loaded full run.
TEST(HfCheckpoint, StreamsSixHundredMegabytesInBoundedMemory) {
  streaming_check("stream600", 14, 50);
}

}  // namespace
}  // namespace moecore
