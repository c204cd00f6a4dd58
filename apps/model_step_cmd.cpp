// `moecore model-step`: forward and backward of a whole Hugging Face model on given tokens, with the logits, the
// loss and every parameter's gradient written under the Hugging Face names (docs/hf-models.md). This is how
// moecore is compared with transformers.
#include <cstdio>
#include <map>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/device_flag.h"
#include "apps/hf_config.h"
#include "apps/hf_load.h"
#include "moecore/io/file_util.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/io/safetensors.h"
#include "moecore/model/gpt.h"
#include "moecore/model/hf_weights.h"

namespace moecore::apps {

namespace {

void add_model_step_flags(Args& a) {
  a.option("--hf", "", "Hugging Face model directory (config.json and safetensors weights)")
      .option("--tokens", "", "safetensors file with 'tokens' I32 [B, S]")
      .option("--out", "", "safetensors file to write logits, loss and grad.<HF name> to")
      .option("--device", "cpu",
              "where the model runs: cpu, cuda, or sim (the simulated device of the test suite: host memory that "
              "only ops touch)")
      .option("--mtp-num-layers", "",
              "DeepSeek-V3: MTP layers to build (unset: config.json's num_nextn_predict_layers, or none when the "
              "checkpoint holds no MTP layer); given, and the checkpoint holds none, they are initialised fresh "
              "(Megatron's init, seed 0)")
      .domain("--device", FlagDomain::one_of({"cpu", "cuda", "sim"}))
      .domain("--mtp-num-layers", FlagDomain::integer(1, 1e6));
}

// The labels of tokens [B, S]: each position's next token, -1 after the last; a token outside [0, vocab_size) is
// refused naming its position.
Tensor model_step_labels(const Tensor& tokens, int64_t vocab_size) {
  const int64_t B = tokens.size(0), S = tokens.size(1);
  const int32_t* tp = tokens.data<int32_t>();
  for (int64_t i = 0; i < B * S; ++i)
    if (tp[i] < 0 || tp[i] >= vocab_size)
      MOECORE_FAIL("model-step: token ", tp[i], " at [", i / S, ", ", i % S, "] is outside the vocabulary [0, ",
                   vocab_size, ")");
  Tensor labels = Tensor::empty({B, S}, DType::i32);
  int32_t* lp = labels.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) lp[b * S + s] = s + 1 < S ? tp[b * S + s + 1] : -1;
  return labels;
}

// One forward and backward pass: the logits [B, S, V], the loss (and MTP's) and the gradient of every tensor of the
// map under its Hugging Face name. `loss_mean` gets the mean loss.
std::map<std::string, Tensor> model_step_outputs(model::GptModel& gpt, const model::HfWeightMap& map,
                                                 const model::ModelConfig& cfg, const Tensor& tokens,
                                                 const Tensor& labels, Device device, double& loss_mean) {
  const int64_t B = tokens.size(0), S = tokens.size(1);
  gpt.zero_grad();
  const model::LossResult r = gpt.forward_backward(tokens, labels, 1.0f);
  std::map<std::string, Tensor> out;
  Tensor logits = Tensor::empty({B * S, cfg.vocab_size}, DType::f32, MemCategory::activations, device);
  gpt.forward_logits(logits, tokens);
  out["logits"] = logits.to_device(Device::cpu).view({B, S, cfg.vocab_size});
  Tensor loss = Tensor::empty({}, DType::f64);
  *loss.data<double>() = r.mean();
  out["loss"] = loss;
  if (cfg.mtp_num_layers > 0) {  // Megatron's mtp loss, averaged over the depths
    Tensor mtp = Tensor::empty({}, DType::f64);
    double sum = 0;
    for (int64_t k = 0; k < cfg.mtp_num_layers; ++k) sum += r.mtp_mean(static_cast<size_t>(k));
    *mtp.data<double>() = sum / static_cast<double>(cfg.mtp_num_layers);
    out["mtp_loss"] = mtp;
  }
  std::map<std::string, const Param*> params;  // (by name: fresh MTP layers are in the model, not in the map)
  for (const Param& p : gpt.params()) params[p.name] = &p;
  for (const model::HfTensorSpec& t : map.tensors)
    if (t.expert_bias_layer < 0 && t.copy_of.empty())  // no gradients: expert biases, MTP's copies of shared ones
      out["grad." + t.name] = model::hf_gather(map, t, [&](size_t p, int64_t first, int64_t rows) {
        const int64_t w = map.params[p].width;
        const Tensor& grad = params.at(map.params[p].param)->grad;
        return grad.to_device(Device::cpu)
            .view({grad.numel() / w, w})
            .slice(0, first, first + rows)
            .view(map.params[p].shape.ndim >= 2 ? Shape{rows, w} : Shape{rows});
      });
  loss_mean = r.mean();
  return out;
}

}  // namespace

int model_step_main(int argc, char** argv) {
  Args a("model-step");
  add_model_step_flags(a);
  if (!a.parse(argc, argv)) return 0;
  const Device device = device_from_flag(a);
  for (const char* f : {"--hf", "--tokens", "--out"})
    if (a.str(f).empty()) MOECORE_FAIL("model-step: ", f, " is required (see moecore model-step --help)");
  const io::SafetensorsFile in = io::safetensors_load(a.str("--tokens"));
  auto it = in.tensors.find("tokens");
  if (it == in.tensors.end() || it->second.dtype() != DType::i32 || it->second.shape().ndim != 2)
    MOECORE_FAIL("model-step: ", a.str("--tokens"), " must hold 'tokens' I32 [B, S]",
                 it == in.tensors.end() ? std::string(" (absent)") : ", found " + it->second.str());
  const Tensor& tokens = it->second;
  const int64_t B = tokens.size(0), S = tokens.size(1);
  // Dropout off and no auxiliary losses: the gradient is that of the mean next-token cross-entropy alone, as
  // transformers computes it with output_router_logits false.
  nlohmann::json config = hf_config_load(a.str("--hf"), "--hf");
  const io::HfCheckpointReader hf(a.str("--hf"));
  std::vector<std::pair<std::string, std::string>> flags = {{"--seq-length", std::to_string(S)},
                                                            {"--attention-dropout", "0"},
                                                            {"--hidden-dropout", "0"},
                                                            {"--moe-router-load-balancing-type", "none"},
                                                            {"--moe-aux-loss-coeff", "0"}};
  const bool given_mtp = a.given("--mtp-num-layers");
  if (given_mtp) flags.emplace_back("--mtp-num-layers", a.str("--mtp-num-layers"));
  const bool mtp_fresh = hf_mtp_adjust(
      config, hf, given_mtp ? std::optional<int64_t>(a.i64("--mtp-num-layers")) : std::nullopt, "model-step", stdout);
  const model::ModelConfig cfg = hf_model_config(config, "--hf " + a.str("--hf"), flags);
  const model::HfWeightMap map = hf_load_weight_map(config, cfg, mtp_fresh);
  const model::HfFamily family = map.family;
  std::vector<io::FlagPath> inputs = {{"--tokens", a.str("--tokens")}, {"--hf", hf_config_path(a.str("--hf"), "--hf")}};
  for (const std::string& f : hf.files()) inputs.push_back({"--hf", f});
  io::check_output_file({"--out", a.str("--out")}, inputs);
  model::hf_check_tensors(map, hf);
  model::GptModel gpt(cfg, B, /*seed=*/0, {}, device);
  model::hf_import(map, hf, gpt);
  const Tensor labels = model_step_labels(tokens, cfg.vocab_size);
  double loss = 0;
  const std::map<std::string, Tensor> out = model_step_outputs(gpt, map, cfg, tokens, labels, device, loss);
  io::safetensors_save(a.str("--out"), out, {{"producer", "moecore model-step"}});
  std::printf("model-step: %s (%s), tokens [%lld, %lld], loss %.6f; wrote %zu tensors to %s\n", a.str("--hf").c_str(),
              model::hf_family_name(family), static_cast<long long>(B), static_cast<long long>(S), loss, out.size(),
              a.str("--out").c_str());
  return 0;
}

}  // namespace moecore::apps
