// Hugging Face models in and out, run as a user would: `moecore model-step` against goldens made by transformers'
// own modeling code (tools/hf_model_reference.py), `moecore convert` round trips (through EP layouts), bad input,
// and training that starts from an HF checkpoint (`moecore train --load-hf`), resumes and runs under EP 2.
#include <sys/statvfs.h>
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

const char* const kCases[] = {"mixtral",     "qwen2_moe",          "qwen3_moe",       "qwen3_moe_tied",
                              "deepseek_v3", "deepseek_v2lite",    "deepseek_v3_mtp", "deepseek_v3_group_top2",
                              "deepseek_v2", "deepseek_v2_greedy", "glm4_moe",        "olmoe",
                              "gpt_oss"};

std::string golden_dir(const std::string& c) {
  return std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/" + c;
}

class HfModels : public ::testing::Test {
 public:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moecore_hf_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {  // MOECORE_KEEP_TEST_DIR=1 keeps the files for a look
    if (!std::getenv("MOECORE_KEEP_TEST_DIR")) fs::remove_all(dir_);
  }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// Every tensor of `out` within rel_tol * max|golden| of the golden's (the goldens are float64 results; moecore
// computes in f32); the names must be the same.
void expect_matches_golden(const std::string& out_path, const std::string& c, double rel_tol) {
  const io::SafetensorsFile out = io::safetensors_load(out_path);
  const io::SafetensorsFile golden = io::safetensors_load(golden_dir(c) + "/golden.safetensors");
  // mtp_logits is a debugging aid of tools/mtp_reference.py, not part of the model-step interface.
  ASSERT_EQ(out.tensors.size(), golden.tensors.size() - golden.tensors.count("mtp_logits")) << c;
  for (const auto& [name, g] : golden.tensors) {
    if (name == "mtp_logits") continue;
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
    const nlohmann::json cfg = apps::hf_config_load(d, "--hf-config");
    const int64_t experts = cfg.value("num_local_experts", cfg.value("num_experts", cfg.value("n_routed_experts", 0)));
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
  // A failure in the middle of the stream (an FP8 weight whose block scale has the wrong shape, found when it is
  // read) leaves no checkpoint and no staging directory behind.
  expect_fails(run_moecore("convert --from-hf " +
                           with("scale",
                                [&](auto& t) {
                                  t[q + "_scale_inv"] = Tensor::zeros({2, 2}, DType::f32);
                                  t[q] = t[q].to(DType::f8e4m3);
                                }) +
                           " --save " + p("out7")),
               {q + "_scale_inv", "[2, 2]"});
  EXPECT_TRUE(io::checkpoint_list_committed(p("out7")).empty());
  if (fs::exists(p("out7")))
    for (const auto& e : fs::directory_iterator(p("out7"))) ADD_FAILURE() << "left behind: " << e.path();
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
      {"records (trained) and --hf-config", "num_experts 8 (trained) vs 4 (--hf-config"});
  EXPECT_FALSE(fs::exists(p("hf_out")));
  // And an export into a non-empty directory is refused before anything is written.
  fs::create_directories(p("full"));
  std::ofstream(p("full/keep.txt")) << "x";
  expect_fails(run_moecore("convert --load " + p("ok") + " --to-hf " + p("full")), {"not an empty directory"});
  EXPECT_TRUE(fs::exists(p("full/keep.txt")));
}

// A random Hugging Face checkpoint of `config` (bf16, HF names): a freshly initialised moecore model exported.
void write_random_hf(const std::string& dir, const nlohmann::json& config, uint64_t seed) {
  const model::ModelConfig cfg = apps::hf_model_config(config, "test config", {{"--seq-length", "1"}});
  model::GptModel gpt(cfg, 1, seed);
  const model::HfWeightMap map = apps::hf_config_weight_map(config, cfg);
  io::HfCheckpointWriter w(dir);
  const auto& params = gpt.params();
  for (const model::HfTensorSpec& t : map.tensors)
    if (t.expert_bias_layer >= 0)
      w.add(t.name, gpt.router_state(t.expert_bias_layer)->expert_bias);
    else
      w.add(t.name,
            model::hf_gather(map, t,
                             [&](size_t i, int64_t first, int64_t rows) {
                               const int64_t width = map.params[i].width;
                               const Tensor v = params[i].value.view({params[i].value.numel() / width, width});
                               return v.slice(0, first, first + rows)
                                   .clone()
                                   .view(map.params[i].shape.ndim >= 2 ? Shape{rows, width} : Shape{rows});
                             }),
            DType::bf16);
  w.set_config_json(config.dump(2));
  w.finish();
}

// A tiny Qwen3-MoE with a byte-level vocabulary (ByteLevel: 257 ids).
nlohmann::json tiny_qwen3_config() {
  return {{"model_type", "qwen3_moe"},
          {"vocab_size", 384},
          {"hidden_size", 64},
          {"intermediate_size", 128},
          {"moe_intermediate_size", 64},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"num_experts", 8},
          {"num_experts_per_tok", 2},
          {"norm_topk_prob", true},
          {"max_position_embeddings", 128},
          {"rope_theta", 10000.0},
          {"rms_norm_eps", 1e-6},
          {"tie_word_embeddings", false},
          {"router_aux_loss_coef", 0.001},
          {"hidden_act", "silu"},
          {"torch_dtype", "bfloat16"}};
}

// tinyshakespeare as JSONL documents of 40 lines, preprocessed with the ByteLevel tokenizer under prefix dir/c.
void preprocess_shakespeare(const fs::path& dir, const std::string& data) {
  std::ifstream in(data + "/tinyshakespeare/input.txt");
  std::ofstream out(dir / "shakespeare.jsonl");
  std::string line, doc;
  int n = 0;
  while (std::getline(in, line)) {
    doc += line + "\n";
    if (++n % 40 == 0) {
      out << nlohmann::json{{"text", doc}}.dump() << "\n";
      doc.clear();
    }
  }
  if (!doc.empty()) out << nlohmann::json{{"text", doc}}.dump() << "\n";
  out.close();
  const auto r = run_moecore("preprocess --input " + (dir / "shakespeare.jsonl").string() + " --output-prefix " +
                             (dir / "c").string() + " --tokenizer-type ByteLevel --append-eod --workers 1");
  ASSERT_EQ(r.status, 0) << r.output;
}

std::vector<std::pair<int64_t, double>> jsonl_losses(const std::string& path) {
  std::vector<std::pair<int64_t, double>> v;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("lm_loss")) v.emplace_back(j["iteration"].get<int64_t>(), j["lm_loss"].get<double>());
  }
  return v;
}

// Five training steps from the HF import (`base`: a train command with --load-hf) under EP 2, PP 2 (each stage
// imports its own layers) and TP 2 + SP over two ranks match one process.
void layouts_match_one_process(HfModels& t, const std::string& base) {
#ifdef MOECORE_HAVE_MPI
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) return;
  // EP 2 over two ranks (global batch 8 = 2 x micro 4) against one process with the same global batch.
  const std::string five = base + "--train-iters 5 --metrics-jsonl ";
  auto r = run_moecore(five + t.p("one.jsonl") + " --micro-batch-size 4");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_shell(testing::mpirun_command(2) + std::string(MOECORE_BINARY) + " " + five + t.p("two.jsonl") +
                " --micro-batch-size 4 --expert-model-parallel-size 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto one = jsonl_losses(t.p("one.jsonl")), two = jsonl_losses(t.p("two.jsonl"));
  ASSERT_EQ(one.size(), 5u);
  ASSERT_EQ(two.size(), 5u) << r.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(two[i].second, one[i].second, 1e-5 * one[i].second) << i;
  // PP 2 over two ranks: each stage imports its own layers (the last also the heads, the MTP depth and the expert
  // biases of its layers).
  r = run_shell(testing::mpirun_command(2) + std::string(MOECORE_BINARY) + " " + five + t.p("pp.jsonl") +
                " --micro-batch-size 4 --pipeline-model-parallel-size 2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded (--load-hf)"), std::string::npos) << r.output;
  const auto pp = jsonl_losses(t.p("pp.jsonl"));
  ASSERT_EQ(pp.size(), 5u) << r.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(pp[i].second, one[i].second, 1e-5 * one[i].second) << "PP 2, " << i;
  // TP 2 + SP over two ranks: the imported weights split into tensor-parallel shards (the experts into ETP 2 slices,
  // ETP defaulting to TP), the MoE layers under SP.
  r = run_shell(testing::mpirun_command(2) + std::string(MOECORE_BINARY) + " " + five + t.p("tp.jsonl") +
                " --micro-batch-size 4 --tensor-model-parallel-size 2 --sequence-parallel");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto tp = jsonl_losses(t.p("tp.jsonl"));
  ASSERT_EQ(tp.size(), 5u) << r.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(tp[i].second, one[i].second, 1e-5 * one[i].second) << "TP 2, " << i;
#else
  (void)t, (void)base;
#endif
}

// A model from a random HF checkpoint of `config` learns tinyshakespeare (mean training loss of steps 141-150 below
// `below`), a resumed run continues bit-identically, EP 2, PP 2 and TP 2 + SP under mpirun match one
// process, and the trained checkpoint exports to HF with the config it came from.
void learn_resume_export(HfModels& t, const std::string& data, const nlohmann::json& config, double below) {
  write_random_hf(t.p("hf"), config, 5);
  preprocess_shakespeare(t.dir_, data);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string base = "train --load-hf " + t.p("hf") + " --data-path " + t.p("c_text_document") +
                           " --tokenizer-type ByteLevel --seq-length 64 --micro-batch-size 8 --global-batch-size 8 "
                           "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --log-interval 1 "
                           "--eval-iters 4 --generate-tokens 0 ";
  // Learns: 150 steps.
  auto r = run_moecore(base + "--train-iters 150 --save " + t.p("ck") + " --metrics-jsonl " + t.p("learn.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded (--load-hf)"), std::string::npos) << r.output;
  const auto learn = jsonl_losses(t.p("learn.jsonl"));
  ASSERT_EQ(learn.size(), 150u);
  double last10 = 0;
  for (size_t i = 140; i < 150; ++i) last10 += learn[i].second / 10;
  EXPECT_GT(learn.front().second, 5.0);  // ln(384) = 5.95 at random init
  EXPECT_LT(last10, below) << "mean training loss of steps 141-150";
  std::printf("%s: training loss %.3f -> %.3f (mean of steps 141-150)\n",
              config["model_type"].get<std::string>().c_str(), learn.front().second, last10);
  if (config.value("num_nextn_predict_layers", 0) > 0) {  // the MTP depth learns too (it predicts 2 tokens ahead)
    std::vector<double> mtp;
    std::ifstream in(t.p("learn.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("mtp_1_loss")) mtp.push_back(j["mtp_1_loss"].get<double>());
    }
    ASSERT_EQ(mtp.size(), 150u);
    double mtp10 = 0;
    for (size_t i = 140; i < 150; ++i) mtp10 += mtp[i] / 10;
    std::printf("  mtp_1 loss %.3f -> %.3f\n", mtp.front(), mtp10);
    EXPECT_GT(mtp.front(), 5.0);
    EXPECT_LT(mtp10, below + 0.4) << "mean MTP loss of steps 141-150";
  }
  // Exports with the config.json it was trained from.
  r = run_moecore("convert --load " + t.p("ck") + " --to-hf " + t.p("ck_hf"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("bf16"), std::string::npos) << r.output;  // torch_dtype bfloat16
  EXPECT_EQ(io::HfCheckpointReader(t.p("ck_hf")).tensors().size(), io::HfCheckpointReader(t.p("hf")).tensors().size());
  // Resumes bit-identically: 20 steps, stop at 10 and restart, against 20 uninterrupted.
  r = run_moecore(base + "--train-iters 20 --metrics-jsonl " + t.p("full.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string split = base + "--train-iters 20 --save " + t.p("ck2") + " --load " + t.p("ck2") +
                            " --metrics-jsonl " + t.p("split.jsonl");
  r = run_moecore(split + " --exit-interval 10");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore(split);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("loaded (--load-hf)"), std::string::npos) << "the restart must resume from --load";
  EXPECT_EQ(jsonl_losses(t.p("split.jsonl")), jsonl_losses(t.p("full.jsonl")));
  layouts_match_one_process(t, base);
}

// Qwen3-MoE (measured: 5.99 -> 2.45).
TEST_F(HfModels, Qwen3MoeFromAnHfCheckpointLearnsResumesAndExports) {
  const std::string data = testing::shared_data_dir();
  if (data.empty()) GTEST_SKIP() << "../shared/data not found";
  learn_resume_export(*this, data, tiny_qwen3_config(), 2.7);
}

// DeepSeek-V3: MLA with q LoRA and YaRN, a dense first layer, sigmoid group-limited routing with the expert bias
// (updated by Megatron's aux-loss-free rule), a shared expert, and one multi-token-prediction depth.
TEST_F(HfModels, DeepSeekV3FromAnHfCheckpointLearnsResumesAndExports) {
  const std::string data = testing::shared_data_dir();
  if (data.empty()) GTEST_SKIP() << "../shared/data not found";
  const nlohmann::json config = {{"model_type", "deepseek_v3"},
                                 {"vocab_size", 384},
                                 {"hidden_size", 64},
                                 {"intermediate_size", 128},
                                 {"moe_intermediate_size", 32},
                                 {"num_hidden_layers", 2},
                                 {"first_k_dense_replace", 1},
                                 {"num_attention_heads", 4},
                                 {"q_lora_rank", 48},
                                 {"kv_lora_rank", 32},
                                 {"qk_nope_head_dim", 16},
                                 {"qk_rope_head_dim", 8},
                                 {"v_head_dim", 16},
                                 {"n_routed_experts", 8},
                                 {"num_experts_per_tok", 4},
                                 {"n_group", 4},
                                 {"topk_group", 2},
                                 {"n_shared_experts", 1},
                                 {"routed_scaling_factor", 2.5},
                                 {"norm_topk_prob", true},
                                 {"max_position_embeddings", 128},
                                 {"rope_theta", 10000.0},
                                 {"rms_norm_eps", 1e-6},
                                 {"tie_word_embeddings", false},
                                 {"hidden_act", "silu"},
                                 {"torch_dtype", "bfloat16"},
                                 {"num_nextn_predict_layers", 1},
                                 {"rope_scaling",
                                  {{"type", "yarn"},
                                   {"factor", 4.0},
                                   {"original_max_position_embeddings", 32},
                                   {"mscale", 1.0},
                                   {"mscale_all_dim", 1.0}}}};
  learn_resume_export(*this, data, config, 2.8);
}

// Streaming: importing a synthetic Mixtral checkpoint of 2.4 GB (F32 tensors up to 33 MB each, more than the 32 MiB
// part) keeps the converter's peak RSS under 1/16 of the checkpoint's bytes (the bound: one part of
// kHfPartElements f32 elements = 32 MiB, one 8 MiB conversion chunk and the headers, over the program's own
// memory; measured 65 MB = 0.027 of it).
// A family from a random HF checkpoint of `config`: one process trains from the import (the loss falls over 20
// steps), and EP 2, PP 2 and TP 2 + SP match one process.
void trains_under_every_layout(HfModels& t, const std::string& data, const nlohmann::json& config) {
  write_random_hf(t.p("hf"), config, 7);
  preprocess_shakespeare(t.dir_, data);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string base = "train --load-hf " + t.p("hf") + " --data-path " + t.p("c_text_document") +
                           " --tokenizer-type ByteLevel --seq-length 32 --micro-batch-size 8 --global-batch-size 8 "
                           "--lr 3e-3 --log-interval 1 --eval-iters 2 --generate-tokens 0 ";
  const auto r = run_moecore(base + "--train-iters 20 --metrics-jsonl " + t.p("learn.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded (--load-hf)"), std::string::npos) << r.output;
  const auto learn = jsonl_losses(t.p("learn.jsonl"));
  ASSERT_EQ(learn.size(), 20u);
  EXPECT_LT(learn.back().second, learn.front().second - 0.5) << "training from the import lowers the loss";
  layouts_match_one_process(t, base);
}

// GLM-4.5: standard attention with q/k/v biases, per-head QK-norm and partial RoPE (half of each head), a dense first
// layer, sigmoid group-limited routing with the expert bias, a shared expert, one MTP layer.
TEST_F(HfModels, Glm4MoeFromAnHfCheckpointTrainsUnderEveryLayout) {
  const std::string data = testing::shared_data_dir();
  if (data.empty()) GTEST_SKIP() << "../shared/data not found";
  trains_under_every_layout(*this, data,
                            {{"model_type", "glm4_moe"},
                             {"vocab_size", 384},
                             {"hidden_size", 64},
                             {"intermediate_size", 128},
                             {"moe_intermediate_size", 32},
                             {"num_hidden_layers", 2},
                             {"first_k_dense_replace", 1},
                             {"num_attention_heads", 4},
                             {"num_key_value_heads", 2},
                             {"head_dim", 32},
                             {"attention_bias", true},
                             {"use_qk_norm", true},
                             {"partial_rotary_factor", 0.5},
                             {"n_routed_experts", 8},
                             {"num_experts_per_tok", 4},
                             {"n_group", 4},
                             {"topk_group", 2},
                             {"n_shared_experts", 1},
                             {"routed_scaling_factor", 2.5},
                             {"norm_topk_prob", true},
                             {"num_nextn_predict_layers", 1},
                             {"max_position_embeddings", 128},
                             {"rope_theta", 10000.0},
                             {"rms_norm_eps", 1e-5},
                             {"tie_word_embeddings", false},
                             {"hidden_act", "silu"},
                             {"torch_dtype", "bfloat16"}});
}

// OLMoE: q_norm / k_norm over each token's whole q and k projections (under TP the heads are gathered), softmax top-k
// without renormalisation, every layer MoE.
TEST_F(HfModels, OlmoeFromAnHfCheckpointTrainsUnderEveryLayout) {
  const std::string data = testing::shared_data_dir();
  if (data.empty()) GTEST_SKIP() << "../shared/data not found";
  trains_under_every_layout(*this, data,
                            {{"model_type", "olmoe"},
                             {"vocab_size", 384},
                             {"hidden_size", 64},
                             {"intermediate_size", 64},
                             {"num_hidden_layers", 2},
                             {"num_attention_heads", 4},
                             {"num_key_value_heads", 2},
                             {"num_experts", 8},
                             {"num_experts_per_tok", 2},
                             {"norm_topk_prob", false},
                             {"router_aux_loss_coef", 0.01},
                             {"clip_qkv", nullptr},
                             {"max_position_embeddings", 128},
                             {"rope_theta", 10000.0},
                             {"rms_norm_eps", 1e-5},
                             {"tie_word_embeddings", false},
                             {"hidden_act", "silu"},
                             {"torch_dtype", "bfloat16"}});
}

// GPT-OSS: attention sinks, sliding-window layers alternating with full ones, YaRN, biases on q/k/v/o, the router and
// the experts, the clamped quick-GEGLU, fused experts (written and read through column runs).
TEST_F(HfModels, GptOssFromAnHfCheckpointTrainsUnderEveryLayout) {
  const std::string data = testing::shared_data_dir();
  if (data.empty()) GTEST_SKIP() << "../shared/data not found";
  trains_under_every_layout(*this, data,
                            {{"model_type", "gpt_oss"},
                             {"vocab_size", 384},
                             {"hidden_size", 64},
                             {"intermediate_size", 64},
                             {"num_hidden_layers", 2},
                             {"num_attention_heads", 4},
                             {"num_key_value_heads", 2},
                             {"head_dim", 32},
                             {"num_local_experts", 8},
                             {"num_experts_per_tok", 2},
                             {"sliding_window", 8},
                             {"layer_types", {"sliding_attention", "full_attention"}},
                             {"attention_bias", true},
                             {"swiglu_limit", 7.0},
                             {"router_aux_loss_coef", 0.9},
                             {"max_position_embeddings", 128},
                             {"rope_theta", 150000.0},
                             {"rope_scaling",
                              {{"rope_type", "yarn"},
                               {"factor", 4.0},
                               {"original_max_position_embeddings", 32},
                               {"beta_fast", 32.0},
                               {"beta_slow", 1.0},
                               {"truncate", false}}},
                             {"rms_norm_eps", 1e-5},
                             {"tie_word_embeddings", false},
                             {"hidden_act", "silu"},
                             {"torch_dtype", "bfloat16"}});
}

// DeepSeek-V2: MLA with q LoRA and YaRN (mscale 0.707), softmax routing with group-limited greedy top-k (the group
// max), the hub's sequence-wise aux loss, two shared experts.
TEST_F(HfModels, DeepSeekV2FromAnHfCheckpointTrainsUnderEveryLayout) {
  const std::string data = testing::shared_data_dir();
  if (data.empty()) GTEST_SKIP() << "../shared/data not found";
  trains_under_every_layout(*this, data,
                            {{"model_type", "deepseek_v2"},
                             {"vocab_size", 384},
                             {"hidden_size", 64},
                             {"intermediate_size", 128},
                             {"moe_intermediate_size", 32},
                             {"num_hidden_layers", 2},
                             {"first_k_dense_replace", 1},
                             {"num_attention_heads", 4},
                             {"q_lora_rank", 48},
                             {"kv_lora_rank", 32},
                             {"qk_nope_head_dim", 16},
                             {"qk_rope_head_dim", 8},
                             {"v_head_dim", 16},
                             {"n_routed_experts", 8},
                             {"num_experts_per_tok", 4},
                             {"topk_method", "group_limited_greedy"},
                             {"n_group", 4},
                             {"topk_group", 2},
                             {"n_shared_experts", 2},
                             {"routed_scaling_factor", 16.0},
                             {"norm_topk_prob", false},
                             {"scoring_func", "softmax"},
                             {"aux_loss_alpha", 0.001},
                             {"seq_aux", true},
                             {"max_position_embeddings", 128},
                             {"rope_theta", 10000.0},
                             {"rope_scaling",
                              {{"type", "yarn"},
                               {"factor", 4.0},
                               {"original_max_position_embeddings", 32},
                               {"mscale", 0.707},
                               {"mscale_all_dim", 0.707}}},
                             {"rms_norm_eps", 1e-6},
                             {"tie_word_embeddings", false},
                             {"hidden_act", "silu"},
                             {"torch_dtype", "bfloat16"}});
}

TEST_F(HfModels, ImportStreamsAMultiGigabyteCheckpoint) {
  struct statvfs fsinfo {};
  if (::statvfs(dir_.c_str(), &fsinfo) == 0 &&
      static_cast<double>(fsinfo.f_bavail) * static_cast<double>(fsinfo.f_frsize) < 6e9)
    GTEST_SKIP() << "needs 6 GB free under " << dir_;
  const nlohmann::json config = {
      {"model_type", "mixtral"},         {"vocab_size", 32000},     {"hidden_size", 2048},
      {"intermediate_size", 4096},       {"num_hidden_layers", 1},  {"num_attention_heads", 16},
      {"num_key_value_heads", 8},        {"num_local_experts", 18}, {"num_experts_per_tok", 2},
      {"max_position_embeddings", 4096}, {"rope_theta", 1e6},       {"rms_norm_eps", 1e-5},
      {"tie_word_embeddings", false},    {"torch_dtype", "float32"}};
  const model::ModelConfig cfg = apps::hf_model_config(config, "test config", {{"--seq-length", "1"}});
  const model::HfWeightMap map = model::hf_weight_map(cfg, model::HfFamily::mixtral);
  uint64_t total = 0;
  {
    io::HfCheckpointWriter w(p("big"), /*max_shard_bytes=*/1000000000);
    for (size_t k = 0; k < map.tensors.size(); ++k) {
      Tensor t = Tensor::empty(map.tensors[k].shape, DType::f32);
      float* d = t.data<float>();
      for (int64_t i = 0; i < t.numel(); ++i) d[i] = static_cast<float>(k) + static_cast<float>(i % 1021) * 1e-3f;
      w.add(map.tensors[k].name, t);
      total += static_cast<uint64_t>(t.nbytes());
    }
    w.set_config_json(config.dump(2));
    EXPECT_GE(w.finish(), 3);
  }
  ASSERT_GE(total, uint64_t{2} << 30);
  const auto r = run_moecore("convert --from-hf " + p("big") + " --save " + p("big_ck"));
  ASSERT_EQ(r.status, 0) << r.output;
  // The converter's own high-water mark (VmHWM: a fork's inherited pages would inflate a child rusage).
  const auto at = r.output.find("peak resident memory ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const double peak = std::stod(r.output.substr(at + 21)) * 1e6;
  std::printf("checkpoint %.2f GB, converter peak RSS %.1f MB (%.4f of it)\n", static_cast<double>(total) / 1e9,
              peak / 1e6, peak / static_cast<double>(total));
  if (!testing::kAddressSanitizer) {  // ASan's quarantine and shadow inflate the resident set; Release proves it
    EXPECT_LT(peak, static_cast<double>(total) / 16);
  }
  // A sample of the stacked experts is where the HF tensors put it: expert 17's up projection (w3) row 5.
  const io::HfCheckpointReader ck(p("big_ck") + "/iter_0000000", "model.safetensors");
  const Tensor got = ck.read_rows("decoder.layers.0.mlp.experts.linear_fc1.weight", 17 * 2 * 4096 + 4096 + 5, 1);
  const io::HfCheckpointReader hf(p("big"));
  const Tensor want = hf.read_rows("model.layers.0.block_sparse_moe.experts.17.w3.weight", 5, 1);
  EXPECT_EQ(0, std::memcmp(got.raw(), want.raw(), static_cast<size_t>(got.nbytes())));
}

// DeepSeek-V3's FP8 checkpoints: F8_E4M3 weights with 128x128 block scales (weight_scale_inv) are dequantised on
// import, exactly as the reader's dequantisation; the export is bf16 and drops quantization_config.
// GPT-OSS as the hub ships it: MXFP4 experts (U8 blocks and scales, tools/hf_model_reference.py --case gpt_oss_mxfp4)
// are dequantised on import exactly as transformers' convert_moe_packed_tensors does (expected.safetensors, written by
// it): an f32 export holds those values bit for bit, every other tensor as it was, and no quantization_config.
TEST_F(HfModels, GptOssMxfp4ExpertsAreDequantisedOnImport) {
  const std::string d = golden_dir("gpt_oss_mxfp4");
  auto r = run_moecore("convert --from-hf " + d + " --save " + p("ck") + " --expert-model-parallel-size 2");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore("convert --load " + p("ck") + " --to-hf " + p("out") + " --hf-dtype fp32");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loses its quantization_config"), std::string::npos) << r.output;
  const io::HfCheckpointReader in(d), out(p("out"));
  const io::SafetensorsFile expected = io::safetensors_load(d + "/expected.safetensors");
  ASSERT_EQ(expected.tensors.size(), 2u);
  for (const auto& [name, want] : expected.tensors) {
    ASSERT_TRUE(in.mxfp4(name)) << name;
    const Tensor got = out.read(name);
    ASSERT_TRUE(got.shape() == want.shape()) << name << " " << got.str();
    EXPECT_EQ(0, std::memcmp(got.raw(), want.raw(), static_cast<size_t>(want.nbytes()))) << name;
  }
  for (const io::HfTensorInfo& t : in.tensors()) {
    if (t.dtype_name == "U8") continue;
    const Tensor a = in.read(t.name), b = out.read(t.name);
    EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes()))) << t.name;
  }
  EXPECT_EQ(out.tensors().size(), in.tensors().size() - 2);  // 4 blocks / scales tensors for 2 weights
  EXPECT_FALSE(apps::hf_config_load(p("out"), "--hf").contains("quantization_config"));
  // Blocks that do not fit the config (another intermediate size) are refused naming the tensor.
  copy_dir(d, p("bad"));
  nlohmann::json cfg = apps::hf_config_load(d, "--hf");
  cfg["intermediate_size"] = 64;
  std::ofstream(p("bad") + "/config.json") << cfg.dump(2);
  r = run_moecore("convert --from-hf " + p("bad") + " --save " + p("ck2"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("experts.gate_up_proj"), std::string::npos) << r.output;
}

TEST_F(HfModels, DeepSeekV3Fp8WeightsAreDequantisedOnImport) {
  const std::string d = golden_dir("deepseek_v3");
  const io::SafetensorsFile orig = io::safetensors_load(d + "/model.safetensors");
  io::HfCheckpointWriter w(p("fp8"));
  int quantised = 0;
  for (const auto& [name, t] : orig.tensors) {
    const bool fp8 = t.shape().ndim == 2 && name.find("proj") != std::string::npos;  // linear weights, as V3
    if (!fp8) {
      w.add(name, t);
      continue;
    }
    // One block (the tiny tensors are < 128 x 128): scale_inv = max|w| / 448, stored fp8(w / scale_inv).
    float amax = 0;
    for (int64_t i = 0; i < t.numel(); ++i) amax = std::max(amax, std::fabs(t.data<float>()[i]));
    Tensor scale = Tensor::empty({1, 1}, DType::f32), q = t.clone();
    scale.data<float>()[0] = amax / 448.0f;
    for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] /= scale.data<float>()[0];
    w.add(name, q, DType::f8e4m3);
    w.add(name + "_scale_inv", scale);
    ++quantised;
  }
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(d + "/config.json"));
  cfg["quantization_config"] = {
      {"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {128, 128}}};
  w.set_config_json(cfg.dump(2));
  w.finish();
  ASSERT_GT(quantised, 20);
  auto r = run_moecore("convert --from-hf " + p("fp8") + " --save " + p("ck"));
  ASSERT_EQ(r.status, 0) << r.output;
  // The checkpoint holds the dequantised values (q_b_proj's RoPE rows de-interleaved: compare a no-RoPE row).
  const io::HfCheckpointReader fp8(p("fp8")), ck(p("ck") + "/iter_0000000", "model.safetensors");
  const Tensor want = fp8.read_dequantized("model.layers.1.self_attn.kv_b_proj.weight");
  const Tensor got = ck.read("decoder.layers.1.self_attention.linear_kv_up_proj.weight");
  ASSERT_EQ(want.numel(), got.numel());
  EXPECT_EQ(0, std::memcmp(want.raw(), got.raw(), static_cast<size_t>(got.nbytes())));
  r = run_moecore("convert --load " + p("ck") + " --to-hf " + p("bf16") + " --hf-dtype bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json out_cfg = nlohmann::json::parse(std::ifstream(p("bf16") + "/config.json"));
  EXPECT_FALSE(out_cfg.contains("quantization_config"));
  const io::HfCheckpointReader bf16(p("bf16"));
  EXPECT_EQ(bf16.info("model.layers.1.self_attn.kv_b_proj.weight").dtype_name, "BF16");
  EXPECT_FALSE(bf16.contains("model.layers.1.self_attn.kv_b_proj.weight_scale_inv"));
  // The dequantised model still runs and stays close to the float golden.
  r = run_moecore("model-step --hf " + p("fp8") + " --tokens " + d + "/tokens.safetensors --out " + p("fp8.st"));
  ASSERT_EQ(r.status, 0) << r.output;
  const double loss = io::safetensors_load(p("fp8.st")).tensors.at("loss").data<double>()[0];
  const double golden = io::safetensors_load(d + "/golden.safetensors").tensors.at("loss").data<double>()[0];
  EXPECT_NEAR(loss, golden, 0.05 * golden);
}

// A checkpoint trained from Megatron flags alone (no config.json recorded) exports with a config.json the table
// writes for those flags: read back it gives the same model (imports, re-exports bit-identically, runs model-step).
TEST_F(HfModels, ExportsAModelTrainedFromMegatronFlags) {
  testing::write_byte_corpus(dir_, 40, "Example document: the quick brown fox jumps over the lazy dog.");
  if (HasFatalFailure()) return;
  const std::string common =
      " --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --swiglu "
      "--untie-embeddings-and-output-weights --num-layers 2 --hidden-size 64 "
      "--num-attention-heads 4 --ffn-hidden-size 128 --seq-length 32 --vocab-size 384 "
      "--num-experts 8 --moe-ffn-hidden-size 32 ";
  const std::vector<std::pair<std::string, std::string>> models = {
      {"qwen3_moe", common + "--group-query-attention --num-query-groups 2 --kv-channels 16 --qk-layernorm "
                             "--moe-router-topk 2 --rotary-base 1000000"},
      {"deepseek_v3", common + "--multi-latent-attention --qk-layernorm --q-lora-rank 24 --kv-lora-rank 16 "
                               "--qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 8 --rotary-scaling-factor 4 "
                               "--yarn-original-max-position-embeddings 8 --mscale-all-dim 1 --moe-router-topk 4 "
                               "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                               "--moe-router-num-groups 4 --moe-router-group-topk 2 "
                               "--moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 32 "
                               "--moe-layer-freq [0]+[1] --mtp-num-layers 1"}};
  for (const auto& [family, flags] : models) {
    auto r = run_moecore("train --data-path " + p("c_text_document") +
                         " --tokenizer-type ByteLevel --micro-batch-size 2 --train-iters 3 --generate-tokens 0 "
                         "--save " +
                         p(family + "_ck") + flags);
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_moecore("convert --load " + p(family + "_ck") + " --to-hf " + p(family + "_hf"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("writing one for the trained model (model_type " + family + ")"), std::string::npos)
        << r.output;
    EXPECT_EQ(apps::hf_config_load(p(family + "_hf"), "--hf-config").value("model_type", ""), family);
    r = run_moecore("convert --from-hf " + p(family + "_hf") + " --save " + p(family + "_ck2"));
    ASSERT_EQ(r.status, 0) << r.output;
    r = run_moecore("convert --load " + p(family + "_ck2") + " --to-hf " + p(family + "_hf2"));
    ASSERT_EQ(r.status, 0) << r.output;
    expect_same_checkpoint(p(family + "_hf"), p(family + "_hf2"));
    const Tensor tokens = Tensor::zeros({1, 8}, DType::i32);
    io::safetensors_save(p("tokens.st"), {{"tokens", tokens}});
    r = run_moecore("model-step --hf " + p(family + "_hf") + " --tokens " + p("tokens.st") + " --out " + p("o.st"));
    ASSERT_EQ(r.status, 0) << r.output;
  }
  // Model flags given to the export must be the trained model's (the checkpoint records it).
  auto r = run_moecore("convert --load " + p("qwen3_moe_ck") + " --to-hf " + p("bad_hf") + models[0].second +
                       " --moe-router-topk 3");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("records (trained) and the model flags differ"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("moe_router_topk 2 (trained) vs 3 (the model flags)"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("bad_hf")));
  // A model no family can hold is refused by name, and nothing is written.
  r = run_moecore("train --data-path " + p("c_text_document") +
                  " --tokenizer-type ByteLevel --micro-batch-size 2 --train-iters 1 --generate-tokens 0 --save " +
                  p("ln_ck") + common + "--group-query-attention --num-query-groups 2 --normalization LayerNorm");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore("convert --load " + p("ln_ck") + " --to-hf " + p("bad_hf"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("LayerNorm"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("bad_hf")));
}

// Issue 27.5: a model trained from an HF checkpoint with flags that change its math (top-k, RoPE base) exports the
// config.json of what was trained (the checkpoint records the model), not the one it was imported with; keys the
// conversion table does not write (token ids, dtype) are kept. A --hf-config that contradicts the record is refused.
TEST_F(HfModels, ExportWritesTheTrainedModelsConfig) {
  write_random_hf(p("hf"), tiny_qwen3_config(), 5);
  testing::write_byte_corpus(dir_, 40, "Example document: the quick brown fox jumps over the lazy dog.");
  if (HasFatalFailure()) return;
  auto r = run_moecore("train --load-hf " + p("hf") + " --data-path " + p("c_text_document") +
                       " --tokenizer-type ByteLevel --seq-length 32 --micro-batch-size 2 --train-iters 2 "
                       "--generate-tokens 0 --moe-router-topk 3 --rotary-base 500 --save " +
                       p("ck"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore("convert --load " + p("ck") + " --to-hf " + p("out"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("differ from the config.json it came from; writing the trained model's"), std::string::npos)
      << r.output;
  const nlohmann::json out = apps::hf_config_load(p("out"), "--hf-config");
  EXPECT_EQ(out.value("num_experts_per_tok", 0), 3) << out.dump();
  EXPECT_EQ(apps::hf_model_config(out, "export").rotary_base, 500.0f) << out.dump();
  EXPECT_EQ(out.value("torch_dtype", ""), "bfloat16") << out.dump();
  EXPECT_EQ(out.value("router_aux_loss_coef", 0.0), 0.001) << out.dump();
  // Read back, the export is the trained model: it resumes as a fine-tune with the flags it was trained with.
  r = run_moecore("convert --load " + p("ck") + " --to-hf " + p("wrong") + " --hf-config " + p("hf"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("moe_router_topk 3 (trained) vs 2 (--hf-config"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rotary_base 500.0 (trained) vs 10000.0 (--hf-config"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("wrong")));
}

}  // namespace
}  // namespace moecore
