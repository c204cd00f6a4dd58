// Hugging Face models in and out, run as a user would: `moecore model-step` against goldens made by transformers'
// own modeling code (tools/hf_model_reference.py), `moecore convert` round trips (through EP layouts), bad input,
// and training that starts from an HF checkpoint (`moecore train --load-hf`), resumes and runs under EP 2.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "apps/cli_support.h"
#include "apps/hf_config.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/io/safetensors.h"
#include "moecore/model/gpt.h"
#include "moecore/model/hf_weights.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::run_moecore;
using testing::run_shell;

const char* const kCases[] = {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_tied"};

std::string golden_dir(const std::string& c) {
  return std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/" + c;
}

class HfModels : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moecore_hf_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// Every tensor of `out` within rel_tol * max|golden| of the golden's (the goldens are float64 results; moecore
// computes in f32); the names must be the same.
void expect_matches_golden(const std::string& out_path, const std::string& c, double rel_tol) {
  const io::SafetensorsFile out = io::safetensors_load(out_path);
  const io::SafetensorsFile golden = io::safetensors_load(golden_dir(c) + "/golden.safetensors");
  ASSERT_EQ(out.tensors.size(), golden.tensors.size()) << c;
  for (const auto& [name, g] : golden.tensors) {
    auto it = out.tensors.find(name);
    ASSERT_NE(it, out.tensors.end()) << c << ": no " << name;
    ASSERT_TRUE(it->second.shape() == g.shape()) << c << " " << name << " " << it->second.str() << " vs " << g.str();
    const Tensor a = it->second.to(DType::f64), b = g.to(DType::f64);
    double max_g = 0, max_d = 0;
    for (int64_t i = 0; i < b.numel(); ++i) {
      max_g = std::max(max_g, std::fabs(b.data<double>()[i]));
      max_d = std::max(max_d, std::fabs(a.data<double>()[i] - b.data<double>()[i]));
    }
    EXPECT_LE(max_d, rel_tol * max_g + 1e-12)
        << c << " " << name << ": max |diff| " << max_d << ", max |golden| " << max_g;
  }
}

// The model-step interface against transformers (float64 goldens; measured worst relative error 5e-6).
TEST_F(HfModels, ModelStepMatchesTransformers) {
  for (const char* c : kCases) {
    const std::string d = golden_dir(c);
    const auto r = run_moecore("model-step --hf " + d + " --tokens " + d + "/tokens.safetensors --out " +
                               p(std::string(c) + ".st"));
    ASSERT_EQ(r.status, 0) << r.output;
    expect_matches_golden(p(std::string(c) + ".st"), c, 5e-5);
  }
}

// Same bytes for every tensor of two HF directories, and the same config.json text.
void expect_same_checkpoint(const std::string& a_dir, const std::string& b_dir) {
  const io::HfCheckpointReader a(a_dir), b(b_dir);
  ASSERT_EQ(a.tensors().size(), b.tensors().size()) << a_dir << " vs " << b_dir;
  for (const io::HfTensorInfo& t : a.tensors()) {
    ASSERT_TRUE(b.contains(t.name)) << t.name;
    const Tensor x = a.read(t.name), y = b.read(t.name);
    ASSERT_EQ(x.dtype(), y.dtype()) << t.name;
    ASSERT_TRUE(x.shape() == y.shape()) << t.name;
    EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), static_cast<size_t>(x.nbytes()))) << t.name;
  }
  auto text = [](const std::string& path) {
    std::ifstream f(path);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  EXPECT_EQ(text(a_dir + "/config.json"), text(b_dir + "/config.json"));
}

// HF -> moecore (EP 1, 2, 4 expert layouts) -> HF returns the same bytes; model-step of an export equals the golden.
TEST_F(HfModels, ConvertRoundTripIsBitIdentical) {
  for (const char* c : kCases) {
    const std::string d = golden_dir(c);
    const int64_t experts = std::string(c) == "mixtral" ? 4 : std::string(c) == "qwen2_moe" ? 6 : 8;
    for (int ep : {1, 2, 4}) {
      if (experts % ep) continue;
      const std::string tag = std::string(c) + "_ep" + std::to_string(ep);
      auto r = run_moecore("convert --from-hf " + d + " --save " + p(tag) + " --expert-model-parallel-size " +
                           std::to_string(ep));
      ASSERT_EQ(r.status, 0) << r.output;
      if (ep > 1) {
        EXPECT_TRUE(fs::exists(p(tag) + "/iter_0000000/experts-ep001-of-00" + std::to_string(ep) + ".safetensors"));
      }
      r = run_moecore("convert --load " + p(tag) + " --to-hf " + p(tag + "_hf"));
      ASSERT_EQ(r.status, 0) << r.output;
      expect_same_checkpoint(d, p(tag + "_hf"));
      if (ep == 2) {
        r = run_moecore("model-step --hf " + p(tag + "_hf") + " --tokens " + d + "/tokens.safetensors --out " +
                        p(tag + ".st"));
        ASSERT_EQ(r.status, 0) << r.output;
        expect_matches_golden(p(tag + ".st"), c, 5e-5);
      }
    }
  }
}

// A copy of a golden model directory to damage.
void copy_dir(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from)) fs::copy_file(e.path(), fs::path(to) / e.path().filename());
}

void expect_fails(const testing::CmdResult& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.status, 0) << r.output;
  for (const auto& n : needles)
    EXPECT_NE(r.output.find(n), std::string::npos) << "expected '" << n << "' in:\n" << r.output;
}

TEST_F(HfModels, ConvertRefusesBadInputAndLeavesNothingHalfWritten) {
  const std::string d = golden_dir("qwen3_moe");
  // Unsupported model_type.
  copy_dir(d, p("llama"));
  {
    std::ifstream f(p("llama/config.json"));
    nlohmann::json cfg = nlohmann::json::parse(f);
    cfg["model_type"] = "llama";
    std::ofstream(p("llama/config.json")) << cfg.dump(2);
  }
  expect_fails(run_moecore("convert --from-hf " + p("llama") + " --save " + p("out1")), {"model_type 'llama'"});
  EXPECT_TRUE(io::checkpoint_list_committed(p("out1")).empty());
  // A tensor of the wrong shape, an extra tensor, a wrong dtype: rewrite model.safetensors.
  const io::SafetensorsFile orig = io::safetensors_load(d + "/model.safetensors");
  auto with = [&](const std::string& name, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    copy_dir(d, p(name));
    std::map<std::string, Tensor> t = orig.tensors;
    edit(t);
    io::safetensors_save(p(name + "/model.safetensors"), t);
    return p(name);
  };
  const std::string q = "model.layers.1.self_attn.q_proj.weight";
  expect_fails(run_moecore("convert --from-hf " + with("shape", [&](auto& t) { t[q] = t[q].slice(0, 0, 8).clone(); }) +
                           " --save " + p("out2")),
               {q, "[8, 32]", "[64, 32]"});
  expect_fails(
      run_moecore("convert --from-hf " + with("extra", [&](auto& t) { t["model.layers.9.mlp.gate.weight"] = t[q]; }) +
                  " --save " + p("out3")),
      {"model.layers.9.mlp.gate.weight", "not part of"});
  expect_fails(
      run_moecore("convert --from-hf " + with("missing", [&](auto& t) { t.erase(q); }) + " --save " + p("out4")),
      {"lacks tensor", q});
  expect_fails(run_moecore("convert --from-hf " +
                           with("dtype", [&](auto& t) { t[q] = Tensor::zeros(t[q].shape(), DType::i32); }) +
                           " --save " + p("out5")),
               {q, "I32", "float dtype"});
  for (const char* o : {"out2", "out3", "out4", "out5"}) EXPECT_TRUE(io::checkpoint_list_committed(p(o)).empty()) << o;
  // A sharded checkpoint whose index names a shard that is not there.
  copy_dir(d, p("sharded"));
  fs::rename(p("sharded/model.safetensors"), p("sharded/model-00001-of-00002.safetensors"));
  {
    nlohmann::json idx;
    idx["metadata"] = {{"total_size", 0}};
    for (const auto& [name, t] : orig.tensors) idx["weight_map"][name] = "model-00001-of-00002.safetensors";
    idx["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors";
    std::ofstream(p("sharded/model.safetensors.index.json")) << idx.dump(2);
  }
  expect_fails(run_moecore("convert --from-hf " + p("sharded") + " --save " + p("out6")),
               {"model-00002-of-00002.safetensors", "model.norm.weight", "not there"});
  // An export that fails (a model config that does not match the checkpoint) leaves no output directory.
  ASSERT_EQ(run_moecore("convert --from-hf " + d + " --save " + p("ok")).status, 0);
  expect_fails(
      run_moecore("convert --load " + p("ok") + " --to-hf " + p("hf_out") + " --hf-config " + golden_dir("mixtral")),
      {"was saved with"});
  EXPECT_FALSE(fs::exists(p("hf_out")));
  // And an export into a non-empty directory is refused before anything is written.
  fs::create_directories(p("full"));
  std::ofstream(p("full/keep.txt")) << "x";
  expect_fails(run_moecore("convert --load " + p("ok") + " --to-hf " + p("full")), {"not an empty directory"});
  EXPECT_TRUE(fs::exists(p("full/keep.txt")));
}

}  // namespace
}  // namespace moecore
