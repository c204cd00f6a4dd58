// Layer-3 tests: the dense GPT against golden tensors written by tools/gpt_reference.py (PyTorch autograd in
// float64): logits, loss, every parameter gradient, and a 10-step AdamW trajectory (clipping included).
#include <cmath>
#include <string>

#include "moecore/io/safetensors.h"
#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::tolerance_ratio;

struct Golden {
  io::SafetensorsFile file;
  model::ModelConfig cfg;
  int64_t batch = 0;
  const Tensor& at(const std::string& name) const {
    auto it = file.tensors.find(name);
    if (it == file.tensors.end()) throw Error("golden file lacks tensor " + name);
    return it->second;
  }
  double meta(const std::string& k) const { return std::stod(file.metadata.at(k)); }
};

Golden load_golden(const std::string& file) {
  Golden g;
  g.file = io::safetensors_load(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/" + file);
  auto i = [&](const char* k) { return static_cast<int64_t>(g.meta(k)); };
  g.cfg.num_layers = i("num_layers");
  g.cfg.hidden_size = i("hidden_size");
  g.cfg.num_attention_heads = i("num_attention_heads");
  g.cfg.num_query_groups = i("num_query_groups");
  g.cfg.kv_channels = i("kv_channels");
  g.cfg.ffn_hidden_size = i("ffn_hidden_size");
  g.cfg.vocab_size = i("vocab_size");
  g.cfg.seq_length = i("seq_length");
  g.cfg.norm_epsilon = static_cast<float>(g.meta("norm_epsilon"));
  g.cfg.rotary_base = static_cast<float>(g.meta("rotary_base"));
  g.cfg.untie_embeddings_and_output_weights = g.file.metadata.at("untie_embeddings_and_output_weights") == "true";
  g.cfg.swiglu = g.file.metadata.at("activation") == "swiglu";
  g.cfg.normalization = g.file.metadata.at("normalization") == "LayerNorm" ? model::Normalization::layernorm
                                                                            : model::Normalization::rmsnorm;
  g.batch = i("micro_batch_size");
  return g;
}

void load_params(model::GptModel& m, const Golden& g, const char* prefix) {
  for (auto& p : m.params()) p.value.copy_from(g.at(prefix + p.name));
  m.refresh_compute_weights();
}

optim::AdamWConfig golden_optimizer(const Golden& g) {
  optim::AdamWConfig o;
  o.beta1 = static_cast<float>(g.meta("adam_beta1"));
  o.beta2 = static_cast<float>(g.meta("adam_beta2"));
  o.eps = static_cast<float>(g.meta("adam_eps"));
  o.weight_decay = static_cast<float>(g.meta("weight_decay"));
  o.clip_grad = static_cast<float>(g.meta("clip_grad"));
  return o;
}

class GptGolden : public ::testing::TestWithParam<const char*> {};

// fp32 against the float64 reference. Tolerances: logits and loss rtol 1e-4 (float32 rounding over two
// layers); gradients rtol 1e-3 with atol 1e-3 * max|reference gradient| of the tensor (tiny entries lose
// relative precision to cancellation).
TEST_P(GptGolden, LogitsLossAndEveryGradientMatchReference) {
  const Golden g = load_golden(GetParam());
  model::GptModel m(g.cfg, g.batch, 1);
  load_params(m, g, "param.");
  Tensor logits = Tensor::empty({g.batch * g.cfg.seq_length, g.cfg.vocab_size}, DType::f32);
  m.forward_logits(logits, g.at("input.tokens"));
  EXPECT_TENSOR_NEAR(logits, g.at("out.logits").view(logits.shape()), 1e-4, 1e-5);

  m.zero_grad();
  const auto r = m.forward_backward(g.at("input.tokens"), g.at("input.labels"), 1.0f);
  const double ref_loss = g.at("out.loss").data<float>()[0];
  EXPECT_NEAR(r.mean(), ref_loss, 1e-5 * std::fabs(ref_loss));
  for (const auto& p : m.params()) {
    const Tensor& ref = g.at("grad." + p.name);
    const double scale = std::sqrt(ops::sum_squares(ref, {}) / static_cast<double>(ref.numel()));
    EXPECT_LE(tolerance_ratio(p.grad, ref, 1e-3, 1e-3 * scale + 1e-9), 1.0) << p.name;
  }
}

// Ten AdamW steps on the same batch: loss and gradient norm before each step (rtol 1e-4), and the final
// parameters (rtol 1e-3, atol 1e-5: Adam's normalised step amplifies float32 noise in tiny gradients).
TEST_P(GptGolden, TenStepAdamWTrajectoryMatchesReference) {
  const Golden g = load_golden(GetParam());
  model::GptModel m(g.cfg, g.batch, 1);
  load_params(m, g, "param.");
  optim::AdamW opt(m.params(), golden_optimizer(g));
  const float lr = static_cast<float>(g.meta("lr"));
  const float* ref_loss = g.at("traj.loss").data<float>();
  const float* ref_norm = g.at("traj.grad_norm").data<float>();
  for (int step = 0; step < 10; ++step) {
    m.zero_grad();
    const double loss = m.forward_backward(g.at("input.tokens"), g.at("input.labels"), 1.0f).mean();
    const auto st = opt.step(lr);
    m.refresh_compute_weights();
    EXPECT_NEAR(loss, ref_loss[step], 1e-4 * std::fabs(ref_loss[step])) << "step " << step;
    EXPECT_NEAR(st.grad_norm, ref_norm[step], 1e-4 * ref_norm[step]) << "step " << step;
  }
  for (const auto& p : m.params()) {
    EXPECT_LE(tolerance_ratio(p.value, g.at("final.param." + p.name), 1e-3, 1e-5), 1.0) << p.name;
  }
}

// bf16 compute (fp32 masters) against the same reference: loss within 1% and every gradient within a
// normalised error of 5% (bf16 keeps 8 mantissa bits, so ~0.4% per rounding, compounded over the layers).
TEST_P(GptGolden, Bf16ComputeTracksReference) {
  Golden g = load_golden(GetParam());
  g.cfg.compute_dtype = DType::bf16;
  model::GptModel m(g.cfg, g.batch, 1);
  load_params(m, g, "param.");
  m.zero_grad();
  const auto r = m.forward_backward(g.at("input.tokens"), g.at("input.labels"), 1.0f);
  const double ref_loss = g.at("out.loss").data<float>()[0];
  EXPECT_NEAR(r.mean(), ref_loss, 1e-2 * std::fabs(ref_loss));
  for (const auto& p : m.params()) {
    const auto a = testing::to_vector(p.grad), b = testing::to_vector(g.at("grad." + p.name));
    double err = 0, ref = 0;
    for (size_t i = 0; i < a.size(); ++i) err += (a[i] - b[i]) * double(a[i] - b[i]), ref += double(b[i]) * b[i];
    EXPECT_LE(std::sqrt(err / ref), 0.05) << p.name;
  }
}

// untied: RMSNorm + SwiGLU + separate output layer; tied: the same with a shared embedding; gelu_ln:
// LayerNorm (with biases) + exact GeLU + tied embeddings.
INSTANTIATE_TEST_SUITE_P(Files, GptGolden,
                         ::testing::Values("gpt_tiny.safetensors", "gpt_tiny_tied.safetensors",
                                           "gpt_tiny_gelu_ln.safetensors"),
                         [](const auto& info) {
                           const std::string f = info.param;
                           return f.find("gelu_ln") != std::string::npos ? std::string("gelu_ln")
                                  : f.find("tied") != std::string::npos  ? std::string("tied")
                                                                         : std::string("untied");
                         });

}  // namespace
}  // namespace moecore
