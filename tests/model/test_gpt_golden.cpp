// Layer-3 tests: the dense GPT against golden tensors written by tools/gpt_reference.py (PyTorch autograd in
// float64): logits, loss, every parameter gradient, and a 10-step AdamW trajectory (clipping included), for
// eight variants (norms, activations, tied output, linear biases, learned / rotary / no positions, QK-norm).
// The model lives on testing::test_device(): the golden tensors are uploaded, results read through host copies.
#include <algorithm>
#include <cmath>
#include <cstring>
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
  // Keys the first three files predate: absent means the default.
  std::string meta_or(const std::string& k, const std::string& fallback) const {
    auto it = file.metadata.find(k);
    return it == file.metadata.end() ? fallback : it->second;
  }
  int64_t num_params() const {
    int64_t n = 0;
    for (const auto& [name, t] : file.tensors) n += name.rfind("param.", 0) == 0;
    return n;
  }
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
  const std::string pos = g.file.metadata.at("position_embedding");
  g.cfg.position_embedding_type = pos == "rope"               ? model::PositionEmbedding::rope
                                  : pos == "learned_absolute" ? model::PositionEmbedding::learned_absolute
                                  : pos == "none"             ? model::PositionEmbedding::none
                                                              : throw Error("golden: position_embedding " + pos);
  g.cfg.add_bias_linear = g.file.metadata.at("add_bias_linear") == "true";
  g.cfg.add_qkv_bias = g.meta_or("add_qkv_bias", "false") == "true";
  g.cfg.max_position_embeddings = std::stoll(g.meta_or("max_position_embeddings", "0"));
  g.cfg.rotary_percent = std::stof(g.meta_or("rotary_percent", "1.0"));
  g.cfg.hidden_dropout = std::stof(g.meta_or("hidden_dropout", "0"));
  g.cfg.attention_dropout = std::stof(g.meta_or("attention_dropout", "0"));
  g.cfg.qk_layernorm = g.meta_or("qk_layernorm", "false") == "true";
  g.batch = i("micro_batch_size");
  return g;
}

model::GptModel make_model(const model::ModelConfig& c, int64_t micro_batch) {
  return model::GptModel(c, micro_batch, 1, {}, testing::test_device());
}
Tensor dev_empty(const Shape& shape) {
  return Tensor::empty(shape, DType::f32, MemCategory::other, testing::test_device());
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

// Entry k of linear_qkv.bias [G*(R+2)*D] lies in a key slot and in a channel RoPE leaves alone (every channel
// without RoPE): it shifts all scores of a query by the same amount, which softmax cancels, so its gradient is
// identically zero. With QK-norm the key passes through a norm first, so no entry is dead.
bool dead_key_bias(const model::ModelConfig& c, int64_t k) {
  if (c.qk_layernorm) return false;
  const int64_t D = c.head_dim(), R = c.num_attention_heads / c.query_groups();
  const int64_t Dr = c.rope() ? c.rotary_dim() : 0;
  return (k / D) % (R + 2) == R && k % D >= Dr;
}

// A gradient against its reference: tolerance_ratio with rtol 1e-3 and atol 1e-3 x the reference's rms (tiny entries
// lose relative precision to cancellation).
double gradient_ratio(const Tensor& got, const Tensor& ref) {
  const double rms = std::sqrt(testing::sum_squares(ref) / static_cast<double>(ref.numel()));
  return tolerance_ratio(got, ref, 1e-3, 1e-3 * rms + 1e-9);
}

class GptGolden : public ::testing::TestWithParam<const char*> {};

// fp32 against the float64 reference. Tolerances: logits and loss rtol 1e-4 (float32 rounding over two
// layers); gradients rtol 1e-3 with atol 1e-3 * max|reference gradient| of the tensor (tiny entries lose
// relative precision to cancellation).
TEST_P(GptGolden, LogitsLossAndEveryGradientMatchReference) {
  const Golden g = load_golden(GetParam());
  model::GptModel m = make_model(g.cfg, g.batch);
  ASSERT_EQ(static_cast<int64_t>(m.params().size()), g.num_params()) << "parameter tables differ";
  load_params(m, g, "param.");
  Tensor logits = dev_empty({g.batch * g.cfg.seq_length, g.cfg.vocab_size});
  m.forward_logits(logits, g.at("input.tokens"));
  EXPECT_TENSOR_NEAR(logits, g.at("out.logits").view(logits.shape()), 1e-4, 1e-5);

  m.zero_grad();
  const auto r = m.forward_backward(g.at("input.tokens"), g.at("input.labels"), 1.0f);
  const double ref_loss = g.at("out.loss").data<float>()[0];
  EXPECT_NEAR(r.mean(), ref_loss, 1e-5 * std::fabs(ref_loss));
  for (const auto& p : m.params()) {
    const Tensor& ref = g.at("grad." + p.name);
    EXPECT_LE(gradient_ratio(p.grad, ref), 1.0) << p.name;
  }
  // Learned positions: rows S..P-1 of the table are never read, so their gradient is exactly zero.
  if (g.cfg.position_embedding_type == model::PositionEmbedding::learned_absolute) {
    const Tensor& dpos = m.param("embedding.position_embeddings.weight").grad;
    ASSERT_GT(dpos.size(0), g.cfg.seq_length);
    const auto v = testing::to_vector(dpos);
    for (size_t k = static_cast<size_t>(g.cfg.seq_length * g.cfg.hidden_size); k < v.size(); ++k)
      ASSERT_EQ(v[k], 0.0f) << "position row " << k / static_cast<size_t>(g.cfg.hidden_size);
  }
}

// Ten AdamW steps on the same batch: loss and gradient norm before each step (rtol 1e-4), and the final
// parameters (rtol 1e-3 of the larger of the final value and the distance travelled, atol 1e-5: Adam's normalised
// step amplifies float32 noise in tiny gradients). The
// softmax-cancelled key-bias entries (dead_key_bias) get atol 10 * lr: the float64 reference's gradient there
// is ~1e-21 and leaves them unmoved, fp32 rounding noise (~1e-10, near adam_eps) moves them by up to lr a step
// (PyTorch in float32 does the same); they cannot change the output, which the loss trajectory checks.
TEST_P(GptGolden, TenStepAdamWTrajectoryMatchesReference) {
  const Golden g = load_golden(GetParam());
  model::GptModel m = make_model(g.cfg, g.batch);
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
  // The relative tolerance scales with how far the element moved (or its final size, if larger): float noise in
  // a trajectory grows with the path, so an element that travelled from -0.0166 to -0.0022 carries the error of
  // its 0.0144 path, not of its small end point (clang's and GCC's float32 roundings differ there by 1.5e-5).
  const bool qkv_bias = g.cfg.qkv_bias();
  for (const auto& p : m.params()) {
    const auto a = testing::to_vector(p.value), b = testing::to_vector(g.at("final.param." + p.name)),
               start = testing::to_vector(g.at("param." + p.name));
    const bool bias = qkv_bias && p.name.find("linear_qkv.bias") != std::string::npos;
    double worst = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      const double scale = std::max(std::fabs(double(b[k])), std::fabs(double(b[k]) - start[k]));
      const double tol = bias && dead_key_bias(g.cfg, static_cast<int64_t>(k)) ? 10.0 * lr : 1e-5 + 1e-3 * scale;
      worst = std::max(worst, std::fabs(double(a[k]) - b[k]) / tol);
    }
    EXPECT_LE(worst, 1.0) << p.name;
  }
}

// bf16 compute (fp32 masters) against the same reference: loss within 1% and every gradient within a
// normalised error of 5% (bf16 keeps 8 mantissa bits, so ~0.4% per rounding, compounded over the layers).
TEST_P(GptGolden, Bf16ComputeTracksReference) {
  Golden g = load_golden(GetParam());
  g.cfg.compute_dtype = DType::bf16;
  model::GptModel m = make_model(g.cfg, g.batch);
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

// FP8 training (--fp8-format hybrid --fp8-recipe tensorwise) against tools/gpt_reference.py's [fp8_tensorwise]
// reference: the same per-tensor FP8 linears (E4M3 inputs and weights, E5M2 output gradients, TE's current scales,
// PyTorch's float8 rounding) with float64 products. One step, with the fp32 test's tolerances: logits rtol 1e-4, the
// loss 1e-6 relative, every gradient rtol 1e-3 with atol 1e-3 x its rms (measured: at most 0.0034 of the logits'
// tolerance, 3.3e-8 on the loss, 0.0011 of the gradients'). Both sides round to FP8 from float32 values, so they agree
// to float32 rounding unless an activation lies that close to an FP8 rounding boundary (a one-ulp flip). The test
// tells FP8 from no FP8: the plain float64 reference's gradients miss these tolerances 95 to 450 times over in every
// linear weight (and its loss by 3.6e-6).
TEST(GptGoldenFp8, TensorwiseStepMatchesTheReference) {
  Golden g = load_golden("gpt_tiny_fp8_tensorwise.safetensors");
  ASSERT_EQ(g.file.metadata.at("fp8_recipe"), "tensorwise");
  ASSERT_EQ(g.file.metadata.at("fp8_format"), "hybrid");
  g.cfg.fp8.on = true;
  g.cfg.fp8.format = nn::Fp8Format::hybrid;
  g.cfg.fp8.recipe = nn::Fp8Recipe::tensorwise;
  model::GptModel m = make_model(g.cfg, g.batch);
  load_params(m, g, "param.");
  Tensor logits = dev_empty({g.batch * g.cfg.seq_length, g.cfg.vocab_size});
  m.forward_logits(logits, g.at("input.tokens"));
  EXPECT_TENSOR_NEAR(logits, g.at("out.logits").view(logits.shape()), 1e-4, 1e-5);
  m.zero_grad();
  const auto r = m.forward_backward(g.at("input.tokens"), g.at("input.labels"), 1.0f);
  const double ref_loss = g.at("out.loss").data<float>()[0];
  EXPECT_NEAR(r.mean(), ref_loss, 1e-6 * std::fabs(ref_loss));
  const Golden plain = load_golden("gpt_tiny.safetensors");  // (the same parameters, float64 GEMMs)
  EXPECT_GT(std::fabs(plain.at("out.loss").data<float>()[0] - ref_loss), 1e-6 * std::fabs(ref_loss));
  for (const auto& p : m.params()) {
    const Tensor& ref = g.at("grad." + p.name);
    EXPECT_LE(gradient_ratio(p.grad, ref), 1.0) << p.name;
    if (p.name.find("linear_") != std::string::npos) {
      EXPECT_GT(gradient_ratio(plain.at("grad." + p.name), ref), 10.0) << p.name;
    }
  }
}

// f16 compute (fp32 masters) against the same reference. f16 keeps 11 significant bits, 8x finer than bf16 (~0.05%
// per rounding): logits within 1% of their scale, the loss within 0.2%, every gradient within a normalised error of
// 0.5%. The backward runs with a static loss scale of 1024 (grad_scale, divided out after), as --fp16 training
// does: unscaled, the attention input gradients sit in f16's subnormal range (below 6.1e-5) and keep fewer bits,
// which puts QK-norm's gradients 1.4% off (measured; 0.19% with the scale).
TEST_P(GptGolden, F16ComputeTracksReference) {
  Golden g = load_golden(GetParam());
  g.cfg.compute_dtype = DType::f16;
  model::GptModel m = make_model(g.cfg, g.batch);
  load_params(m, g, "param.");
  Tensor logits = dev_empty({g.batch * g.cfg.seq_length, g.cfg.vocab_size});
  m.forward_logits(logits, g.at("input.tokens"));
  EXPECT_TRUE(testing::all_finite(logits));
  const Tensor& ref_logits = g.at("out.logits");
  const double logit_scale = std::sqrt(testing::sum_squares(ref_logits) / static_cast<double>(ref_logits.numel()));
  EXPECT_TENSOR_NEAR(logits, ref_logits.view(logits.shape()), 1e-2, 1e-2 * logit_scale);
  constexpr float kLossScale = 1024.0f;
  m.zero_grad();
  const auto r = m.forward_backward(g.at("input.tokens"), g.at("input.labels"), kLossScale);
  const double ref_loss = g.at("out.loss").data<float>()[0];
  EXPECT_NEAR(r.mean(), ref_loss, 2e-3 * std::fabs(ref_loss));
  for (const auto& p : m.params()) {
    const auto a = testing::to_vector(p.grad), b = testing::to_vector(g.at("grad." + p.name));
    double err = 0, ref = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = a[i] / double(kLossScale) - b[i];
      err += d * d, ref += double(b[i]) * b[i];
    }
    EXPECT_LE(std::sqrt(err / ref), 5e-3) << p.name;
  }
}

// The golden parameters (non-zero biases, learned positions, partial RoPE) with dropout configured: the
// training forward draws masks and so differs, evaluation and forward_logits do not and match p = 0 bitwise.
TEST_P(GptGolden, DropoutChangesTrainingButNotEvaluation) {
  const Golden g = load_golden(GetParam());
  model::ModelConfig with_drop = g.cfg;
  with_drop.hidden_dropout = 0.1f;
  with_drop.attention_dropout = 0.1f;
  model::GptModel plain = make_model(g.cfg, g.batch), drop = make_model(with_drop, g.batch);
  load_params(plain, g, "param.");
  load_params(drop, g, "param.");
  const Tensor &tokens = g.at("input.tokens"), &labels = g.at("input.labels");
  EXPECT_NE(drop.forward_backward(tokens, labels, 1.0f).loss_sum,
            plain.forward_backward(tokens, labels, 1.0f).loss_sum);
  EXPECT_EQ(drop.evaluate(tokens, labels).loss_sum, plain.evaluate(tokens, labels).loss_sum);
  const Shape shape{g.batch * g.cfg.seq_length, g.cfg.vocab_size};
  Tensor a = dev_empty(shape), b = dev_empty(shape);
  plain.forward_logits(a, tokens);
  drop.forward_logits(b, tokens);
  const Tensor ha = testing::host(a), hb = testing::host(b);
  EXPECT_EQ(std::memcmp(ha.data<float>(), hb.data<float>(), static_cast<size_t>(a.nbytes())), 0);
}

// untied: RMSNorm + SwiGLU + separate output layer; tied: the same with a shared embedding; gelu_ln:
// LayerNorm (with biases) + exact GeLU + tied embeddings; bias_learned: LayerNorm + GeLU + untied, biases on
// every linear layer, learned absolute positions (table longer than S); qkvbias_partial_rope: RMSNorm +
// SwiGLU + untied, qkv bias only, RoPE on half of each head; bias_swiglu_nopos: RMSNorm + SwiGLU + tied,
// biases on every linear layer (fc1's as [gate; up]), no position embedding; qknorm: RMSNorm + SwiGLU + untied,
// RoPE, QK-norm (Qwen3-MoE's attention); qknorm_ln: LayerNorm + GeLU + untied, qkv bias, RoPE, QK-norm with
// biases (the qkv bias precedes the norm).
INSTANTIATE_TEST_SUITE_P(Files, GptGolden,
                         ::testing::Values("gpt_tiny.safetensors", "gpt_tiny_tied.safetensors",
                                           "gpt_tiny_gelu_ln.safetensors", "gpt_tiny_bias_learned.safetensors",
                                           "gpt_tiny_qkvbias_partial_rope.safetensors",
                                           "gpt_tiny_bias_swiglu_nopos.safetensors", "gpt_tiny_qknorm.safetensors",
                                           "gpt_tiny_qknorm_ln.safetensors"),
                         [](const auto& info) {
                           std::string f = info.param;  // gpt_tiny[_<variant>].safetensors -> <variant>
                           f = f.substr(0, f.find('.'));
                           return f == "gpt_tiny" ? std::string("untied") : f.substr(std::strlen("gpt_tiny_"));
                         });

}  // namespace
}  // namespace moecore
