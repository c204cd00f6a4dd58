// DeepSeek-V3 checkpoints as transformers' save_pretrained writes them: config.json keeps num_nextn_predict_layers but
// the MTP layers' tensors are gone. model-step, convert --from-hf and train --load-hf load them with MTP off and a
// notice (bit-identical to the same weights with num_nextn_predict_layers 0), or with fresh MTP layers under an
// explicit --mtp-num-layers; a checkpoint with some but not all MTP tensors is refused naming the first missing.
#include <cstring>
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

const std::string kGolden = std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/deepseek_v3_mtp";

// The layer of a checkpoint tensor (model.layers.N.*), else -1.
int64_t layer_of(const std::string& name) {
  if (!name.starts_with("model.layers.")) return -1;
  return std::stoll(name.substr(13));
}

// The model of `config` (num_nextn_predict_layers 1) with random weights, as an HF checkpoint.
void write_random_hf(const std::string& dir, const nlohmann::json& config) {
  const model::ModelConfig cfg = apps::hf_model_config(config, "test config", {{"--seq-length", "1"}});
  model::GptModel gpt(cfg, 1, 7);
  const model::HfWeightMap map = apps::hf_config_weight_map(config, cfg);
  io::HfCheckpointWriter w(dir);
  const auto& params = gpt.params();
  for (const model::HfTensorSpec& t : map.tensors)
    w.add(t.name, t.expert_bias_layer >= 0
                      ? gpt.router_state(t.expert_bias_layer)->expert_bias
                      : model::hf_gather(map, t, [&](size_t i, int64_t first, int64_t rows) {
                          const int64_t width = map.params[i].width;
                          return params[i]
                              .value.view({params[i].value.numel() / width, width})
                              .slice(0, first, first + rows)
                              .clone()
                              .view(map.params[i].shape.ndim >= 2 ? Shape{rows, width} : Shape{rows});
                        }));
  w.set_config_json(config.dump(2));
  w.finish();
}

// A copy of the checkpoint at `from` with config.json's num_nextn_predict_layers set to `nextn`, less every MTP
// tensor (layers >= num_hidden_layers; save_pretrained's output) or, when `drop_only` is given, less that one alone.
void copy_checkpoint(const std::string& from, const std::string& to, int nextn, const std::string& drop_only = "") {
  nlohmann::json config = apps::hf_config_load(from, "--hf");
  const int64_t layers = config["num_hidden_layers"].get<int64_t>();
  config["num_nextn_predict_layers"] = nextn;
  const io::HfCheckpointReader in(from);
  io::HfCheckpointWriter w(to);
  for (const io::HfTensorInfo& t : in.tensors())
    if (drop_only.empty() ? layer_of(t.name) < layers : t.name != drop_only) w.add(t.name, in.read(t.name));
  w.set_config_json(config.dump(2));
  w.finish();
}

// Both safetensors files hold the same tensors, byte for byte.
void expect_same_tensors(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, x] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    const Tensor& y = it->second;
    ASSERT_EQ(x.dtype(), y.dtype()) << name;
    ASSERT_TRUE(x.shape() == y.shape()) << name;
    EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), static_cast<size_t>(x.nbytes()))) << name;
  }
}

void expect_mtp_off_notice(const testing::CmdResult& r) {
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* needle : {"config.json has num_nextn_predict_layers 1 but the checkpoint holds none of those MTP "
                             "layers (model.layers.2.*; transformers' save_pretrained drops them): loading it with "
                             "MTP off",
                             "--mtp-num-layers N"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
}

class HfMtpDropped : public testing::CliScratch {
 public:
  HfMtpDropped() : CliScratch("hf_mtp_dropped") {}
};

// model-step and convert of the golden DeepSeek-V3 with MTP, less its MTP tensors: MTP off with the notice, every
// output and every written parameter bit-identical to the same weights under num_nextn_predict_layers 0, the main
// head still transformers' (golden); the export writes num_nextn_predict_layers 0.
// GLM-4.5's transformers model drops its MTP layers too (and num_nextn_predict_layers defaults to 1 there): the
// glm4_moe golden with num_nextn_predict_layers 1 loads with MTP off and the notice, and matches its golden.
TEST_F(HfMtpDropped, Glm4MoeCheckpointWithoutMtpLayersLoadsWithMtpOff) {
  const std::string golden = std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/glm4_moe";
  copy_checkpoint(golden, p("glm"), 1);
  const auto r =
      run_moecore("model-step --hf " + p("glm") + " --tokens " + golden + "/tokens.safetensors --out " + p("glm.st"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("config.json has num_nextn_predict_layers 1 but the checkpoint holds none of those MTP "
                          "layers (model.layers.3.*"),
            std::string::npos)
      << r.output;
  const io::SafetensorsFile out = io::safetensors_load(p("glm.st"));
  const io::SafetensorsFile want = io::safetensors_load(golden + "/golden.safetensors");
  EXPECT_NEAR(out.tensors.at("loss").to(DType::f64).data<double>()[0],
              want.tensors.at("loss").to(DType::f64).data<double>()[0], 5e-5);
}

TEST_F(HfMtpDropped, ModelStepAndConvertLoadItWithMtpOff) {
  copy_checkpoint(kGolden, p("dropped"), 1);
  copy_checkpoint(kGolden, p("plain"), 0);
  const std::string tokens = " --tokens " + kGolden + "/tokens.safetensors";
  auto r = run_moecore("model-step --hf " + p("dropped") + tokens + " --out " + p("dropped.st"));
  expect_mtp_off_notice(r);
  r = run_moecore("model-step --hf " + p("plain") + tokens + " --out " + p("plain.st"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("num_nextn_predict_layers"), std::string::npos) << r.output;
  const io::SafetensorsFile dropped = io::safetensors_load(p("dropped.st"));
  expect_same_tensors(dropped.tensors, io::safetensors_load(p("plain.st")).tensors);
  EXPECT_EQ(dropped.tensors.count("mtp_loss"), 0u);
  const io::SafetensorsFile golden = io::safetensors_load(kGolden + "/golden.safetensors");
  for (const char* name : {"logits", "loss"}) {
    const Tensor a = dropped.tensors.at(name).to(DType::f64), g = golden.tensors.at(name).to(DType::f64);
    for (int64_t i = 0; i < g.numel(); ++i)
      EXPECT_NEAR(a.data<double>()[i], g.data<double>()[i], 5e-5) << name << "[" << i << "]";
  }

  r = run_moecore("convert --from-hf " + p("dropped") + " --save " + p("ck_dropped"));
  expect_mtp_off_notice(r);
  r = run_moecore("convert --from-hf " + p("plain") + " --save " + p("ck_plain"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string model_file = "/iter_0000000/model.safetensors";
  expect_same_tensors(io::safetensors_load(p("ck_dropped") + model_file).tensors,
                      io::safetensors_load(p("ck_plain") + model_file).tensors);
  r = run_moecore("convert --load " + p("ck_dropped") + " --to-hf " + p("out"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(apps::hf_config_load(p("out"), "--hf")["num_nextn_predict_layers"], 0);
  const io::HfCheckpointReader in(p("dropped")), out(p("out"));
  ASSERT_EQ(in.tensors().size(), out.tensors().size());
  for (const io::HfTensorInfo& t : in.tensors()) {
    const Tensor x = in.read(t.name), y = out.read(t.name);
    EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), static_cast<size_t>(x.nbytes()))) << t.name;
  }
}

// Some MTP tensors but not all is a damaged checkpoint, not save_pretrained's output: refused naming the first one
// missing, by every command that reads the weights.
TEST_F(HfMtpDropped, PartialMtpIsRefusedNamingTheMissingTensor) {
  copy_checkpoint(kGolden, p("partial"), 1, "model.layers.2.eh_proj.weight");
  const std::string missing = "lacks tensor 'model.layers.2.eh_proj.weight'";
  auto r = run_moecore("model-step --hf " + p("partial") + " --tokens " + kGolden + "/tokens.safetensors --out " +
                       p("x.st"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("MTP off"), std::string::npos) << r.output;
  r = run_moecore("convert --from-hf " + p("partial") + " --save " + p("ck"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("ck") + "/iter_0000000"));
}

// --mtp-num-layers on a checkpoint without MTP tensors: the MTP layer is initialised fresh (Megatron's init) and the
// rest read. model-step's main head is bit-identical to MTP off and it reports an MTP loss; convert writes the fresh
// parameters (norms ones, projections N(0, std)).
TEST_F(HfMtpDropped, ExplicitMtpLayersAreInitialisedFresh) {
  copy_checkpoint(kGolden, p("dropped"), 1);
  const std::string tokens = " --tokens " + kGolden + "/tokens.safetensors";
  auto r = run_moecore("model-step --hf " + p("dropped") + tokens + " --out " + p("off.st"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore("model-step --hf " + p("dropped") + tokens + " --out " + p("fresh.st") + " --mtp-num-layers 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--mtp-num-layers 1, so 1 MTP layer is initialised fresh (Megatron's init)"),
            std::string::npos)
      << r.output;
  const io::SafetensorsFile off = io::safetensors_load(p("off.st")), fresh = io::safetensors_load(p("fresh.st"));
  ASSERT_EQ(fresh.tensors.count("mtp_loss"), 1u);
  EXPECT_GT(*fresh.tensors.at("mtp_loss").data<double>(), 0.0);
  for (const char* name : {"logits", "loss"}) {
    const Tensor &a = off.tensors.at(name), &b = fresh.tensors.at(name);
    EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes()))) << name;
  }

  r = run_moecore("convert --from-hf " + p("dropped") + " --save " + p("ck") + " --mtp-num-layers 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("initialised fresh"), std::string::npos) << r.output;
  const io::SafetensorsFile ck = io::safetensors_load(p("ck") + "/iter_0000000/model.safetensors");
  const Tensor& enorm = ck.tensors.at("mtp.layers.0.enorm.weight");
  for (int64_t i = 0; i < enorm.numel(); ++i) EXPECT_EQ(enorm.data<float>()[i], 1.0f);
  const Tensor& eh = ck.tensors.at("mtp.layers.0.eh_proj.weight");
  double sq = 0;
  for (int64_t i = 0; i < eh.numel(); ++i) sq += double(eh.data<float>()[i]) * eh.data<float>()[i];
  EXPECT_NEAR(std::sqrt(sq / double(eh.numel())), 0.02, 0.005);  // initializer_range
}

nlohmann::json tiny_deepseek_config() {
  return {{"model_type", "deepseek_v3"},
          {"vocab_size", 384},
          {"hidden_size", 32},
          {"intermediate_size", 64},
          {"moe_intermediate_size", 16},
          {"num_hidden_layers", 2},
          {"first_k_dense_replace", 1},
          {"num_attention_heads", 2},
          {"q_lora_rank", 24},
          {"kv_lora_rank", 16},
          {"qk_nope_head_dim", 8},
          {"qk_rope_head_dim", 4},
          {"v_head_dim", 8},
          {"n_routed_experts", 4},
          {"num_experts_per_tok", 2},
          {"n_shared_experts", 1},
          {"max_position_embeddings", 64},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", false},
          {"num_nextn_predict_layers", 1}};
}

// lm_loss and mtp_1_loss by iteration, from a metrics JSONL.
std::vector<std::pair<double, double>> losses(const std::string& path) {
  std::vector<std::pair<double, double>> v;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("lm_loss")) v.emplace_back(j["lm_loss"].get<double>(), j.value("mtp_1_loss", -1.0));
  }
  return v;
}

// train --load-hf: MTP off with the notice, the same losses as num_nextn_predict_layers 0; with --mtp-num-layers 1
// the MTP layer is fresh and trains (its loss logged), the first step's lm_loss unchanged; partial MTP refused.
TEST_F(HfMtpDropped, TrainLoadHfTrainsWithMtpOffOrFresh) {
  byte_corpus();
  write_random_hf(p("full"), tiny_deepseek_config());
  copy_checkpoint(p("full"), p("dropped"), 1);
  copy_checkpoint(p("full"), p("plain"), 0);
  copy_checkpoint(p("full"), p("partial"), 1, "model.layers.2.hnorm.weight");
  const std::string args = " --data-path " + p("c_text_document") +
                           " --tokenizer-type ByteLevel --seq-length 16 --micro-batch-size 2 --global-batch-size 2 "
                           "--train-iters 2 --lr 1e-3 --log-interval 1 --eval-iters 1 --generate-tokens 0 ";
  auto r = run_moecore("train --load-hf " + p("dropped") + args + "--metrics-jsonl " + p("dropped.jsonl"));
  expect_mtp_off_notice(r);
  EXPECT_NE(r.output.find("loaded (--load-hf)"), std::string::npos) << r.output;
  r = run_moecore("train --load-hf " + p("plain") + args + "--metrics-jsonl " + p("plain.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto dropped = losses(p("dropped.jsonl")), plain = losses(p("plain.jsonl"));
  ASSERT_EQ(dropped.size(), 2u);
  EXPECT_EQ(dropped, plain);
  EXPECT_EQ(dropped[0].second, -1.0) << "no MTP loss with MTP off";

  r = run_moecore("train --load-hf " + p("dropped") + args + "--metrics-jsonl " + p("fresh.jsonl") +
                  " --mtp-num-layers 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("1 MTP layer is initialised fresh"), std::string::npos) << r.output;
  const auto fresh = losses(p("fresh.jsonl"));
  ASSERT_EQ(fresh.size(), 2u);
  EXPECT_EQ(fresh[0].first, plain[0].first) << "the main head's first loss is the checkpoint's";
  EXPECT_GT(fresh[0].second, 5.0);  // about ln(384): a freshly initialised MTP head
  EXPECT_TRUE(std::isfinite(fresh[1].second));

  r = run_moecore("train --load-hf " + p("partial") + args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("lacks tensor 'model.layers.2.hnorm.weight'"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace moecore
