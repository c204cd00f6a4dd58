// Layer-3 GPU tests (label "gpu"): two small MoE GPTs train 5 steps of two micro-batches on the device under test and
// on the CPU, in f32 and in bf16 compute (the GQA one also in f16), and each step's losses, every parameter's gradient
// after step 1 and every parameter after step 5 are compared tensor by tensor. The device under test is cuda; the
// ".sim" twin (MOECORE_TEST_DEVICE=sim, label "sim") runs the same tests on the simulated device, whose kernels are the
// CPU's, and there requires equality bit for bit -- which proves the tests' own logic on machines without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gpu/gpu_test.h"
#include "model/synthetic_training.h"
#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "test_util.h"

namespace moecore {
namespace {

constexpr int64_t kSteps = 5, kMicroBatches = 2, kMicroBatchSize = 2;
constexpr float kLr = 1e-3f;
// AdamW's eps, above Megatron's 1e-8: with 1e-8 Adam's first steps move every weight by about +-lr whatever its
// gradient's size, so a gradient that is only rounding noise (the key bias's, which softmax ignores) takes a full
// step in a direction the rounding picks, on each backend its own; 1e-5 leaves such weights (gradients <~ 1e-6) still.
constexpr float kAdamEps = 1e-5f;

// GQA attention with LayerNorm, biases on every linear, hidden and attention dropout; a dense layer, then MoE (top-2
// of 4 experts, aux loss, z-loss, router input jitter).
model::ModelConfig gqa_moe() {
  model::ModelConfig c = testing::small_moe_model(4);
  c.normalization = model::Normalization::layernorm;
  c.add_bias_linear = true;
  c.hidden_dropout = c.attention_dropout = 0.1f;
  c.moe.z_loss_coeff = 1e-3f;
  c.moe.input_jitter_eps = 1e-2f;
  return c;
}

// DeepSeek-style: MLA with q LoRA, latent norms and YaRN; sigmoid routing with the expert bias, a shared expert; one
// multi-token-prediction depth.
model::ModelConfig mla_mtp_moe() {
  model::ModelConfig c = testing::small_moe_model(4);
  c.num_query_groups = 0;
  c.multi_latent_attention = c.qk_layernorm = c.yarn = true;
  c.q_lora_rank = 12;
  c.kv_lora_rank = 8;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;
  c.yarn_config.scaling_factor = 4.0f;
  c.yarn_config.original_max_position_embeddings = 8;
  c.yarn_config.mscale_all_dim = 1.0f;
  c.moe.score_function = moe::ScoreFunction::sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 1e-2f;
  c.moe.shared_expert_intermediate_size = 16;
  c.mtp_num_layers = 1;
  return c;
}

// A host copy that later steps do not change (to_device returns a host tensor itself).
Tensor snapshot(const Tensor& t) {
  return t.device() == Device::cpu ? t.clone() : t.to_device(Device::cpu);
}

struct Run {
  std::vector<double> loss;        // per step: the mean over its micro-batches
  std::vector<double> mtp_loss;    // per step and MTP depth (depth fastest)
  std::vector<std::string> names;  // the parameters, in params() order
  std::vector<Tensor> grads;       // after step 1 (host copies)
  std::vector<Tensor> values;      // after the last step (host copies)
};

// The training step of train/step.cpp on one process: gradients summed over the micro-batches (each weighted
// 1 / micro-batches), AdamW, the compute copies refreshed, the router's per-step updates.
Run train(const model::ModelConfig& c, Device device) {
  model::GptModel m(c, kMicroBatchSize, 31, {}, device);
  optim::AdamWConfig oc;
  oc.eps = kAdamEps;
  optim::AdamW opt(m.params(), oc);
  Tensor tok = Tensor::empty({kMicroBatchSize, c.seq_length}, DType::i32, MemCategory::other);
  Tensor lab = Tensor::empty({kMicroBatchSize, c.seq_length}, DType::i32, MemCategory::other);
  Run r;
  for (int64_t it = 0; it < kSteps; ++it) {
    m.zero_grad();
    double loss = 0;
    std::vector<double> mtp(static_cast<size_t>(c.mtp_num_layers), 0.0);
    for (int64_t mb = 0; mb < kMicroBatches; ++mb) {
      testing::synthetic_batch(tok, lab, false, it * kMicroBatches + mb);
      m.set_dropout_step(it, mb);
      const model::LossResult l = m.forward_backward(tok, lab, 1.0f / kMicroBatches);
      loss += l.mean() / kMicroBatches;
      for (size_t k = 0; k < mtp.size(); ++k) mtp[k] += l.mtp_mean(k) / kMicroBatches;
    }
    r.loss.push_back(loss);
    r.mtp_loss.insert(r.mtp_loss.end(), mtp.begin(), mtp.end());
    if (it == 0)
      for (const Param& p : m.params()) {
        r.names.push_back(p.name);
        r.grads.push_back(snapshot(p.grad));
      }
    opt.step(kLr);
    m.refresh_compute_weights();
    m.finish_step();
  }
  for (const Param& p : m.params()) r.values.push_back(snapshot(p.value));
  return r;
}

// How close the device's run must come to the CPU's. loss: each loss, relatively. grad_norm, grad_max: a gradient
// after step 1, by the norm of the difference over the norm of the CPU's gradient, and by its largest elementwise
// difference over the CPU gradient's largest magnitude (no single element far off). value_rms, value_max: a parameter
// after the last step, by the RMS and the largest elementwise difference over kSteps * kLr, how far AdamW moves a
// weight in those steps (relative to the weights themselves, zero-initialised biases would compare mere rounding).
// bitwise: equal bits instead.
struct Tolerance {
  double loss = 0, grad_norm = 0, grad_max = 0, value_rms = 0, value_max = 0;
  bool bitwise = false;
};
// f32: cuBLAS, the attention kernel and the device's reductions sum in other orders than the CPU, so results differ by
// rounding, ~1e-6 relative. Measured here with the CPU against itself from initial weights perturbed by 1e-6
// relative (a stand-in for that rounding): gradients within 1e-5, losses within 1e-6, weights within 1e-3 of their
// movement (the perturbation itself).
constexpr Tolerance kF32{1e-5, 1e-4, 1e-3, 1e-3, 1e-2, false};
// bf16 compute: GEMM operands and activations are rounded to bf16 (8 significant bits); where the two backends' f32
// accumulations differ in their last bits, a value rounds to the other bf16 neighbour (one ulp, ~4e-3 relative), and
// such flips spread through the layers and the steps (and can move a token to another expert). The same measurement
// (perturbations of 1e-6 to 1e-4) gives gradients within 1.2e-2 by norm and max, losses within 4e-5, weights within
// 3e-2 (RMS) and 0.25 (max) of their movement.
constexpr Tolerance kBf16{2e-3, 3e-2, 5e-2, 0.1, 0.5, false};
constexpr Tolerance kBitwise{0, 0, 0, 0, 0, true};

// Equal bits; else false, with a failure naming the first differing element.
bool expect_bitwise(const std::string& what, const Tensor& got, const Tensor& cpu) {
  if (std::memcmp(got.raw(), cpu.raw(), static_cast<size_t>(cpu.nbytes())) == 0) return true;
  const auto a = testing::to_vector(got), b = testing::to_vector(cpu);
  size_t i = 0;
  while (i < a.size() && std::memcmp(&a[i], &b[i], sizeof(float)) == 0) ++i;
  ADD_FAILURE() << what << " differs from the CPU's bits, first at element " << i << ": "
                << (i < a.size() ? a[i] : 0.0f) << " vs " << (i < b.size() ? b[i] : 0.0f);
  return false;
}

// The norm and the largest element of got - cpu, the norm and the largest magnitude of cpu, and where the largest
// difference is (NaN counts as infinitely far).
struct Diff {
  double norm = 0, max = 0, cpu_norm = 0, cpu_max = 0;
  size_t worst = 0;
  float got_worst = 0, cpu_worst = 0;
};
Diff diff(const Tensor& got, const Tensor& cpu) {
  const auto a = testing::to_vector(got), b = testing::to_vector(cpu);
  Diff d;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(double(a[i]) - double(b[i]));
    d.norm += e * e;
    d.cpu_norm += double(b[i]) * double(b[i]);
    d.cpu_max = std::max(d.cpu_max, std::fabs(double(b[i])));
    if (!(e <= d.max)) {
      d.max = std::isnan(e) ? INFINITY : e;
      d.worst = i;
    }
  }
  d.norm = std::sqrt(d.norm);
  d.cpu_norm = std::sqrt(d.cpu_norm);
  if (!a.empty()) {
    d.got_worst = a[d.worst];
    d.cpu_worst = b[d.worst];
  }
  return d;
}

void expect_gradient(const std::string& what, const Tensor& got, const Tensor& cpu, const Tolerance& tol) {
  ASSERT_EQ(got.shape(), cpu.shape()) << what;
  if (tol.bitwise) {
    expect_bitwise(what, got, cpu);
    return;
  }
  const Diff d = diff(got, cpu);
  EXPECT_LE(d.norm, tol.grad_norm * d.cpu_norm) << what << ": |device - cpu| / |cpu| = " << d.norm / d.cpu_norm;
  EXPECT_LE(d.max, tol.grad_max * d.cpu_max)
      << what << ": element " << d.worst << " is " << d.got_worst << " on the device, " << d.cpu_worst
      << " on the CPU (largest |cpu| " << d.cpu_max << ")";
}

void expect_value(const std::string& what, const Tensor& got, const Tensor& cpu, const Tolerance& tol) {
  ASSERT_EQ(got.shape(), cpu.shape()) << what;
  if (tol.bitwise) {
    expect_bitwise(what, got, cpu);
    return;
  }
  const Diff d = diff(got, cpu);
  // Tolerances in units of the parameters' change over the run (AdamW moves a weight by about lr a step, so kSteps x
  // kLr in all): the device-vs-cpu difference of a parameter is measured against that movement. No time is measured.
  const double movement = kSteps * double(kLr);
  const double rms = d.norm / std::sqrt(double(std::max<int64_t>(cpu.numel(), 1)));
  const double rms_limit = tol.value_rms * movement, max_limit = tol.value_max * movement;
  EXPECT_LE(rms, rms_limit) << what << ": RMS of device - cpu = " << rms / movement << " of AdamW's " << kSteps
                            << "-step movement";
  EXPECT_LE(d.max, max_limit) << what << ": element " << d.worst << " is " << d.got_worst << " on the device, "
                              << d.cpu_worst << " on the CPU (" << d.max / movement << " of AdamW's " << kSteps
                              << "-step movement)";
}

void expect_loss(const std::string& what, double got, double cpu, const Tolerance& tol) {
  if (tol.bitwise)
    EXPECT_EQ(got, cpu) << what;
  else
    EXPECT_LE(std::fabs(got - cpu), tol.loss * std::fabs(cpu)) << what << ": " << got << " vs " << cpu << " on the CPU";
}

void expect_trains_like_the_cpu(model::ModelConfig c, DType compute) {
  c.compute_dtype = compute;
  const Device device = testing::gpu_test_device();
  // f16 compute is held to the bf16 bounds (not yet measured on a GPU): its rounding is 8x finer, but a flip still
  // moves a value by an ulp and can move a token to another expert.
  const Tolerance tol = device == Device::sim ? kBitwise : compute == DType::f32 ? kF32 : kBf16;
  const Run ref = train(c, Device::cpu), got = train(c, device);
  const std::string on = std::string(" on ") + device_name(device);
  ASSERT_EQ(got.loss.size(), ref.loss.size());
  for (size_t s = 0; s < ref.loss.size(); ++s) {
    expect_loss("loss of step " + std::to_string(s + 1) + on, got.loss[s], ref.loss[s], tol);
    for (int64_t k = 0; k < c.mtp_num_layers; ++k) {
      const size_t i = s * static_cast<size_t>(c.mtp_num_layers) + static_cast<size_t>(k);
      expect_loss("MTP depth " + std::to_string(k) + " loss of step " + std::to_string(s + 1) + on, got.mtp_loss[i],
                  ref.mtp_loss[i], tol);
    }
  }
  ASSERT_EQ(got.names, ref.names);
  for (size_t i = 0; i < ref.names.size(); ++i) {
    expect_gradient(ref.names[i] + " gradient after step 1" + on, got.grads[i], ref.grads[i], tol);
    expect_value(ref.names[i] + " after step " + std::to_string(kSteps) + on, got.values[i], ref.values[i], tol);
  }
}

TEST(GpuModel, MoeGptTrainsLikeTheCpuInF32) {
  SKIP_WITHOUT_GPU_TEST_DEVICE();
  expect_trains_like_the_cpu(gqa_moe(), DType::f32);
}

TEST(GpuModel, MoeGptTrainsLikeTheCpuInBf16) {
  SKIP_WITHOUT_GPU_TEST_DEVICE();
  expect_trains_like_the_cpu(gqa_moe(), DType::bf16);
}

TEST(GpuModel, MoeGptTrainsLikeTheCpuInF16) {
  SKIP_WITHOUT_GPU_TEST_DEVICE();
  expect_trains_like_the_cpu(gqa_moe(), DType::f16);
}

TEST(GpuModel, MlaMtpMoeGptTrainsLikeTheCpuInF32) {
  SKIP_WITHOUT_GPU_TEST_DEVICE();
  expect_trains_like_the_cpu(mla_mtp_moe(), DType::f32);
}

TEST(GpuModel, MlaMtpMoeGptTrainsLikeTheCpuInBf16) {
  SKIP_WITHOUT_GPU_TEST_DEVICE();
  expect_trains_like_the_cpu(mla_mtp_moe(), DType::bf16);
}

}  // namespace
}  // namespace moecore
