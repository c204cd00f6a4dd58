// FP8 training (Megatron's --fp8-format / --fp8-recipe; nn/fp8.h) on the synthetic training tests' small model (a
// dense layer, then an MoE layer with a shared expert): every recipe and both formats train and track the bf16 run
// within a stated band while differing from it (the GEMMs really quantise), with grouped and sequential experts, with
// MLA and MTP, and with the output layer under --fp8-output-proj; --first-last-layers-bf16 keeps exactly the layers
// it names out of FP8 (all of them: bitwise the bf16 run); a run resumes bitwise and its checkpoint refuses another
// recipe; a NaN in a weight stops the run naming the layer and GEMM that met it. Delayed scaling (Megatron's default
// recipe): each GEMM of a linear uses the scales of its pass (the step's weight scale, the forward's input scale in
// wgrad and recompute) and records the amaxes Transformer Engine records, histories roll and restore at any length,
// and a linear over two steps matches the PyTorch reference (tools/fp8_delayed_reference.py); recompute is bitwise the
// run without; its state resumes bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "moecore/io/safetensors.h"
#include "moecore/nn/fp8_delayed.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

model::ModelConfig fp8_model(nn::Fp8Recipe recipe, nn::Fp8Format format, bool grouped = true) {
  model::ModelConfig c = testing::small_moe_model(4);
  c.compute_dtype = DType::bf16;
  c.moe.shared_expert_intermediate_size = 16;
  c.moe.grouped_gemm = grouped;
  c.fp8.on = true;
  c.fp8.recipe = recipe;
  c.fp8.format = format;
  return c;
}

struct Fp8Run {
  std::vector<double> losses;
  uint64_t hash = 0;
  std::string error;
};

Fp8Run train_run(const model::ModelConfig& cfg, train::TrainConfig t, const fs::path& save = {},
                 const fs::path& load = {}, const std::function<void(model::GptModel&)>& edit = {}) {
  model::GptModel m(cfg, t.micro_batch_size, 77, {}, testing::test_device());
  if (edit) edit(m);
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  t.save = save.string();
  t.load = load.string();
  Fp8Run r;
  try {
    r.losses = train::train(m, opt, t, testing::synthetic_batch, nullptr).train_loss;
  } catch (const Error& e) {
    r.error = e.what();
  }
  r.hash = train::parameter_hash(m);
  return r;
}

// MLA with q LoRA in place of the standard attention (small widths).
void with_mla(model::ModelConfig& c) {
  c.multi_latent_attention = true;
  c.q_lora_rank = 16;
  c.kv_lora_rank = 16;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 8;
}

model::ModelConfig bf16_of(model::ModelConfig c) {
  c.fp8 = {};
  return c;
}

// The band: FP8's quantisation error moves the loss of this small model by a few thousandths over 30 steps (measured:
// at most 0.0045, tensorwise hybrid; MLA 0.0014) while it falls from 4.15 to 2.35; 0.05 is the stated bound.
constexpr double kBand = 0.05;

TEST(Fp8Training, EveryRecipeTracksBf16AndDiffersFromIt) {
  const Fp8Run bf16 =
      train_run(bf16_of(fp8_model(nn::Fp8Recipe::tensorwise, nn::Fp8Format::e4m3)), testing::small_train_config(30));
  ASSERT_EQ(bf16.error, "");
  for (nn::Fp8Recipe recipe :
       {nn::Fp8Recipe::delayed, nn::Fp8Recipe::tensorwise, nn::Fp8Recipe::blockwise, nn::Fp8Recipe::mxfp8})
    for (nn::Fp8Format format : {nn::Fp8Format::e4m3, nn::Fp8Format::hybrid})
      for (bool grouped : {true, false}) {
        if (!grouped && format == nn::Fp8Format::e4m3) continue;  // sequential experts: one format is enough
        SCOPED_TRACE(std::string(enum_name(recipe)) + " " + enum_name(format) + (grouped ? " grouped" : " sequential"));
        const Fp8Run r = train_run(fp8_model(recipe, format, grouped), testing::small_train_config(30));
        ASSERT_EQ(r.error, "");
        ASSERT_EQ(r.losses.size(), bf16.losses.size());
        EXPECT_LT(r.losses.back(), r.losses.front() - 1.0) << "the loss does not fall";
        double worst = 0;
        for (size_t i = 0; i < r.losses.size(); ++i) worst = std::max(worst, std::fabs(r.losses[i] - bf16.losses[i]));
        EXPECT_LE(worst, kBand);
        EXPECT_GT(worst, 0.0) << "FP8 changed nothing";
        EXPECT_NE(r.hash, bf16.hash);
      }
}

// MLA's six linears (q down/up, kv down/up, the output projection) in FP8, and an MTP depth (its eh_proj too).
TEST(Fp8Training, MultiLatentAttentionAndMtpTrackBf16) {
  for (nn::Fp8Recipe recipe : {nn::Fp8Recipe::blockwise, nn::Fp8Recipe::delayed}) {
    SCOPED_TRACE(enum_name(recipe));
    model::ModelConfig c = fp8_model(recipe, nn::Fp8Format::hybrid);
    with_mla(c);
    c.qk_layernorm = true;
    c.mtp_num_layers = 1;
    const train::TrainConfig t = testing::small_train_config(20);
    const Fp8Run bf16 = train_run(bf16_of(c), t), fp8 = train_run(c, t);
    ASSERT_EQ(fp8.error, "");
    double worst = 0;
    for (size_t i = 0; i < fp8.losses.size(); ++i) worst = std::max(worst, std::fabs(fp8.losses[i] - bf16.losses[i]));
    EXPECT_LE(worst, kBand);
    EXPECT_GT(worst, 0.0);
    EXPECT_LT(fp8.losses.back(), fp8.losses.front() - 0.5);
  }
}

// --fp8-output-proj (MXFP8): the output layer's GEMMs in FP8 as well -- the run differs from the one without and still
// tracks bf16.
TEST(Fp8Training, OutputProjectionInMxfp8) {
  model::ModelConfig c = fp8_model(nn::Fp8Recipe::mxfp8, nn::Fp8Format::hybrid);
  const train::TrainConfig t = testing::small_train_config(20);
  const Fp8Run bf16 = train_run(bf16_of(c), t), layers = train_run(c, t);
  c.fp8.output_proj = true;
  const Fp8Run head = train_run(c, t);
  ASSERT_EQ(head.error, "");
  EXPECT_NE(head.hash, layers.hash);
  double worst = 0;
  for (size_t i = 0; i < head.losses.size(); ++i) worst = std::max(worst, std::fabs(head.losses[i] - bf16.losses[i]));
  EXPECT_LE(worst, kBand);
  c.fp8.recipe = nn::Fp8Recipe::tensorwise;
  EXPECT_NE(testing::error_of([&] { c.validate(); }).find("--fp8-output-proj needs"), std::string::npos);
}

TEST(Fp8Training, FirstLastLayersBf16KeepsTheLayersItNames) {
  model::ModelConfig c = fp8_model(nn::Fp8Recipe::tensorwise, nn::Fp8Format::hybrid);
  const train::TrainConfig t = testing::small_train_config(6);
  const Fp8Run bf16 = train_run(bf16_of(c), t), fp8 = train_run(c, t);
  c.fp8.first_last_layers_bf16 = true;  // 1 at the start and 1 at the end: both layers
  const Fp8Run none = train_run(c, t);
  EXPECT_EQ(none.losses, bf16.losses);
  EXPECT_EQ(none.hash, bf16.hash);
  c.fp8.num_layers_at_end_in_bf16 = 0;  // layer 1 (the MoE layer) runs FP8
  const Fp8Run last = train_run(c, t);
  EXPECT_NE(last.hash, bf16.hash);
  EXPECT_NE(last.hash, fp8.hash);
  const std::vector<model::LayerSpec> specs = model::layer_specs(c);
  EXPECT_FALSE(specs[0].fp8);
  EXPECT_TRUE(specs[1].fp8);
}

TEST(Fp8Training, ResumesBitwise) {
  model::ModelConfig delayed = fp8_model(nn::Fp8Recipe::delayed, nn::Fp8Format::hybrid);
  delayed.fp8.amax_history_len = 4;  // (a history that outlives a step, and max over it)
  delayed.fp8.amax_compute_algo = nn::Fp8AmaxAlgo::max;
  for (const model::ModelConfig& c : {fp8_model(nn::Fp8Recipe::blockwise, nn::Fp8Format::hybrid), delayed}) {
    SCOPED_TRACE(enum_name(c.fp8.recipe));
    const fs::path dir = fs::temp_directory_path() / ("moecore_fp8_resume_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const Fp8Run straight = train_run(c, testing::small_train_config(8));
    train::TrainConfig half = testing::small_train_config(8);
    half.exit_interval = 4;
    const Fp8Run first = train_run(c, half, dir);
    const Fp8Run second = train_run(c, testing::small_train_config(8), dir, dir);
    ASSERT_EQ(second.error, "");
    ASSERT_EQ(second.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(first.losses[i], straight.losses[i]) << i;
      EXPECT_EQ(second.losses[i], straight.losses[i + 4]) << i + 4;
    }
    EXPECT_EQ(second.hash, straight.hash);
    // The checkpoint records its recipe: another recipe is refused naming both, bf16 may resume it.
    const Fp8Run other =
        train_run(fp8_model(nn::Fp8Recipe::tensorwise, nn::Fp8Format::hybrid), testing::small_train_config(8), {}, dir);
    EXPECT_NE(
        other.error.find(std::string("was trained with --fp8-format hybrid --fp8-recipe ") + enum_name(c.fp8.recipe) +
                         " but this run uses --fp8-format hybrid --fp8-recipe tensorwise"),
        std::string::npos)
        << other.error;
    const Fp8Run bf16 = train_run(bf16_of(c), testing::small_train_config(8), {}, dir);  // (at its last step: none run)
    EXPECT_EQ(bf16.error, "");
    if (c.fp8.recipe == nn::Fp8Recipe::delayed) {  // another history length resumes too (Transformer Engine's resize)
      model::ModelConfig shorter = c;
      shorter.fp8.amax_history_len = 2;
      train::TrainConfig more = testing::small_train_config(10);
      more.use_checkpoint_opt_param_scheduler = true;
      const Fp8Run resized = train_run(shorter, more, {}, dir);
      EXPECT_EQ(resized.error, "");
      EXPECT_EQ(resized.losses.size(), 2u);
    }
    fs::remove_all(dir);
  }
}

// Recompute (full, and selective of every module) quantises with the scales its forward used and records nothing:
// bitwise the run without, under delayed scaling, with grouped and sequential experts and with MLA.
TEST(Fp8Training, DelayedScalingRecomputeIsBitwiseTheRunWithout) {
  for (int variant = 0; variant < 3; ++variant) {
    model::ModelConfig c = fp8_model(nn::Fp8Recipe::delayed, nn::Fp8Format::hybrid, variant != 1);
    if (variant == 2) with_mla(c);
    SCOPED_TRACE(variant);
    const train::TrainConfig t = testing::small_train_config(4);
    const Fp8Run plain = train_run(c, t);
    ASSERT_EQ(plain.error, "");
    model::ModelConfig full = c;
    full.recompute.granularity = "full";
    full.recompute.method = "uniform";
    full.recompute.num_layers = 1;
    model::ModelConfig selective = c;
    selective.recompute.granularity = "selective";
    selective.recompute.modules = {"core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts"};
    if (variant == 2) selective.recompute.modules.push_back("mla_up_proj");
    for (const model::ModelConfig& r : {full, selective}) {
      const Fp8Run again = train_run(r, t);
      ASSERT_EQ(again.error, "") << r.recompute.granularity;
      EXPECT_EQ(again.losses, plain.losses) << r.recompute.granularity;
      EXPECT_EQ(again.hash, plain.hash) << r.recompute.granularity;
    }
  }
}

// One linear's GEMMs under delayed scaling, pass by pass: the scales each uses (checked bitwise against the FP8 GEMM
// with those scales given) and the amaxes it records.
class Fp8DelayedLinear : public ::testing::Test {
 protected:
  Fp8DelayedLinear() : f_(config()), d_(*f_.delayed()) {}
  static nn::Fp8Config config() {
    nn::Fp8Config c;
    c.on = true;
    c.recipe = nn::Fp8Recipe::delayed;
    c.format = nn::Fp8Format::hybrid;
    c.amax_history_len = 3;
    return c;
  }
  static float max_abs(const Tensor& t) {
    float m = 0;
    for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.data<float>()[i]));
    return m;
  }
  // The GEMM of `pass` with the given scales of its operands a and b.
  static Tensor reference(const char* pass, const Tensor& a, const Tensor& b, float sa, float sb) {
    const bool wgrad = std::string(pass) == "wgrad", dgrad = std::string(pass) == "dgrad";
    const float scales[2] = {sa, sb};
    ops::Fp8Gemm g;
    g.a = {wgrad || dgrad ? DType::f8e5m2 : DType::f8e4m3, ops::Fp8ScaleRule::given, 0, 0, {scales, 1}};
    g.b = {DType::f8e4m3, ops::Fp8ScaleRule::given, 0, 0, {scales + 1, 1}};
    const int64_t M = wgrad ? a.size(1) : a.size(0), N = wgrad ? b.size(1) : dgrad ? b.size(1) : b.size(0);
    Tensor c = Tensor::zeros({M, N}, DType::f32);
    ops::gemm(c, a, wgrad, b, !(wgrad || dgrad), 1.0f, 0.0f, g, ops::Context{Device::cpu});
    return c;
  }
  static bool same(const Tensor& x, const Tensor& y) {
    return x.numel() == y.numel() && std::memcmp(x.raw(), y.raw(), static_cast<size_t>(x.numel()) * 4) == 0;
  }
  nn::Fp8Training f_;
  nn::Fp8Delayed& d_;
  const nn::Linear l_{&f_, "decoder.layers.0.", "mlp.linear_fc1"};
  const ops::Context cpu_{Device::cpu};
};

TEST_F(Fp8DelayedLinear, EachGemmUsesItsPassesScalesAndRecordsTheAmaxes) {
  using Pass = nn::Fp8Delayed::Pass;
  const Tensor x0 = testing::randn({8, 32}, "delayed x0"), x1 = testing::randn({8, 32}, "delayed x1");
  const Tensor w = testing::randn({16, 32}, "delayed w"), dy = testing::randn({8, 16}, "delayed dy");
  for (int64_t i = 0; i < dy.numel(); ++i) dy.data<float>()[i] *= 1e-3f;  // (gradients: small)
  Tensor y = Tensor::zeros({8, 16}, DType::f32), dx = Tensor::zeros({8, 32}, DType::f32);
  Tensor dw = Tensor::zeros({16, 32}, DType::f32);
  const float ax0 = max_abs(x0), ax1 = max_abs(x1), aw = max_abs(w), ady = max_abs(dy);
  // micro-batch 0's forward: every scale 1 (nothing seen yet), the input and weight amaxes into row 0
  d_.begin(Pass::forward, 0);
  nn::linear_fprop(y, x0, w, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(y, reference("fprop", x0, w, 1.0f, 1.0f)));
  EXPECT_FALSE(same(y, reference("fprop", x0, w, 448.0f / ax0, 1.0f)));  // (the scale matters)
  EXPECT_EQ(d_.amaxes(true), (std::vector<float>{ax0, aw}));
  EXPECT_EQ(d_.amaxes(false), (std::vector<float>{0.0f}));
  d_.update(true, std::vector<float>{2 * ax0, aw});  // as if another rank had seen twice the input
  EXPECT_EQ(d_.amaxes(true), (std::vector<float>{0.0f, 0.0f}));
  // micro-batch 1's forward: the input scale from the reduced amax; the weight keeps the step's scale (1), no amax
  d_.begin(Pass::forward, 1);
  nn::linear_fprop(y, x1, w, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(y, reference("fprop", x1, w, 448.0f / (2 * ax0), 1.0f)));
  EXPECT_EQ(d_.amaxes(true), (std::vector<float>{ax1, 0.0f}));
  d_.update(true, d_.amaxes(true));
  // micro-batch 0's backward: dy with the gradient scale (1, E5M2), W with the step's, x with its forward's (1); a
  // recompute uses the forward's scales and records nothing
  d_.begin(Pass::backward, 0);
  nn::linear_fprop(y, x0, w, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(y, reference("fprop", x0, w, 1.0f, 1.0f)));
  EXPECT_EQ(d_.amaxes(true), (std::vector<float>{0.0f, 0.0f}));
  nn::linear_dgrad(dx, dy, w, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(dx, reference("dgrad", dy, w, 1.0f, 1.0f)));
  nn::linear_wgrad(dw, dy, x0, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(dw, reference("wgrad", dy, x0, 1.0f, 1.0f)));
  EXPECT_EQ(d_.amaxes(false), (std::vector<float>{ady}));
  d_.update(false, d_.amaxes(false));
  // micro-batch 1's backward: the new gradient scale (E5M2's max over the amax), its forward's input scale
  d_.begin(Pass::backward, 1);
  nn::linear_wgrad(dw, dy, x1, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(dw, reference("wgrad", dy, x1, 57344.0f / ady, 448.0f / (2 * ax0))));
  nn::linear_fprop(y, x1, w, 1.0f, 0.0f, l_, cpu_);  // (a recompute)
  EXPECT_TRUE(same(y, reference("fprop", x1, w, 448.0f / (2 * ax0), 1.0f)));
  // the next step quantises the weight again, with the scale its amax gave, and records it
  d_.new_step();
  d_.begin(Pass::forward, 0);
  nn::linear_fprop(y, x0, w, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(y, reference("fprop", x0, w, 448.0f / ax1, 448.0f / aw)));
  EXPECT_EQ(d_.amaxes(true), (std::vector<float>{ax0, aw}));
  // an evaluation: the current scales, amaxes recorded (kept for the next update), nothing saved; no gradients
  d_.begin(Pass::eval);
  nn::linear_fprop(y, x1, w, 1.0f, 0.0f, l_, cpu_);
  EXPECT_TRUE(same(y, reference("fprop", x1, w, 448.0f / ax1, 448.0f / aw)));
  EXPECT_EQ(d_.amaxes(true), (std::vector<float>{std::max(ax0, ax1), aw}));
  EXPECT_NE(testing::error_of([&] { nn::linear_dgrad(dx, dy, w, 1.0f, 0.0f, l_, cpu_); }).find("an evaluation"),
            std::string::npos);
  // a backward without its forward is named
  d_.begin(Pass::backward, 5);
  EXPECT_NE(testing::error_of([&] {
              nn::linear_wgrad(dw, dy, x0, 1.0f, 0.0f, l_, cpu_);
            }).find("decoder.layers.0.mlp.linear_fc1 wgrad in activation slot 5 without its forward's input scales"),
            std::string::npos);
}

// The history (3 rows: row 0 the accumulator, then the past amaxes oldest first) rolls on each update with a non-zero
// amax; most_recent takes the newest, max the largest, margin divides by 2^margin; checkpoints restore it at any
// length.
TEST_F(Fp8DelayedLinear, HistoriesRollAndRestoreAtAnyLength) {
  using Pass = nn::Fp8Delayed::Pass;
  const Tensor x = testing::randn({4, 32}, "history x"), w = testing::randn({16, 32}, "history w");
  Tensor y = Tensor::zeros({4, 16}, DType::f32);
  d_.begin(Pass::forward, 0);
  nn::linear_fprop(y, x, w, 1.0f, 0.0f, l_, cpu_);  // (registers the linear)
  for (float a : {4.0f, 8.0f, 0.0f, 2.0f}) d_.update(true, std::vector<float>{a, 1.0f});
  const auto rec = d_.records();
  ASSERT_EQ(rec.size(), 1u);
  const nn::Fp8Delayed::Record& t = rec.at("decoder.layers.0.mlp.linear_fc1");  // [1, 3, 1 + 3]
  ASSERT_EQ(t.gemms, 1);
  ASSERT_EQ(t.history, 3);
  ASSERT_EQ(t.slots.size(), 12u);
  EXPECT_EQ(std::vector<float>(t.slots.begin(), t.slots.begin() + 4),
            (std::vector<float>{448.0f / 2, 0.0f, 8.0f, 2.0f}));  // (0: no roll)
  // max with a margin: the largest of the history and the new amax, times 2^-margin
  nn::Fp8Config mc = config();
  mc.amax_compute_algo = nn::Fp8AmaxAlgo::max;
  mc.margin = 2;
  nn::Fp8Training g(mc);
  nn::Fp8Delayed& gd = *g.delayed();
  const nn::Linear gl{&g, "decoder.layers.0.", "mlp.linear_fc1"};
  gd.begin(Pass::forward, 0);
  nn::linear_fprop(y, x, w, 1.0f, 0.0f, gl, cpu_);
  for (float a : {4.0f, 8.0f, 2.0f}) gd.update(true, std::vector<float>{a, 1.0f});
  EXPECT_EQ(gd.records().at("decoder.layers.0.mlp.linear_fc1").slots[0], 448.0f / 4 / 8);
  // restore at a shorter history keeps rows [0, 2), at a longer one pads zeros; the scale comes along
  for (int64_t L : {2, 5}) {
    nn::Fp8Config rc = config();
    rc.amax_history_len = L;
    nn::Fp8Training r(rc);
    r.delayed()->restore(d_.records());
    const nn::Linear rl{&r, "decoder.layers.0.", "mlp.linear_fc1"};
    r.delayed()->begin(Pass::eval);
    nn::linear_fprop(y, x, w, 1.0f, 0.0f, rl, cpu_);
    EXPECT_TRUE(same(y, reference("fprop", x, w, 448.0f / 2, 448.0f)));
    const std::vector<float> got = r.delayed()->records().at("decoder.layers.0.mlp.linear_fc1").slots;
    ASSERT_EQ(got.size(), static_cast<size_t>(3 * (1 + L)));
    // (row 0: the evaluation's amax)
    const std::vector<float> want = L == 2 ? std::vector<float>{448.0f / 2, max_abs(x), 8.0f}
                                           : std::vector<float>{448.0f / 2, max_abs(x), 8.0f, 2.0f, 0.0f, 0.0f};
    EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 1 + L), want) << L;
  }
}

TEST(Fp8Training, ANanStopsTheRunNamingTheLayer) {
  const model::ModelConfig c = fp8_model(nn::Fp8Recipe::tensorwise, nn::Fp8Format::hybrid);
  const Fp8Run r = train_run(c, testing::small_train_config(2), {}, {}, [](model::GptModel& m) {
    for (Param& p : m.params())
      if (p.name == "decoder.layers.1.mlp.shared_experts.linear_fc2.weight") {
        Tensor v = testing::host(p.value).clone(), target = p.value;  // (a handle on the same storage)
        v.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
        target.copy_from(v);
      }
    m.refresh_compute_weights();
  });
  EXPECT_NE(r.error.find("FP8 training stops: decoder.layers.1.mlp.shared_experts.linear_fc2 fprop"), std::string::npos)
      << r.error;
}

// The same linear against tools/fp8_delayed_reference.py's PyTorch golden (Transformer Engine's DelayedScaling from its
// published definition): two steps of two micro-batches, both forwards of a step before their backwards, an evaluation
// between the steps, W changed between them; hybrid, a history of 3, max, margin 1. Every slot's scale and history
// bitwise after each step and after the evaluation; y, dx and dw within 1e-5 of the sizes of their terms (the
// reference multiplies the dequantised operands in float64).
TEST(Fp8DelayedGolden, ALinearOverTwoStepsMatchesThePyTorchReference) {
  using Pass = nn::Fp8Delayed::Pass;
  const io::SafetensorsFile g =
      io::safetensors_load(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/fp8_delayed_linear.safetensors");
  auto at = [&](const std::string& name) -> const Tensor& { return g.tensors.at(name); };
  nn::Fp8Config c;
  c.on = true;
  c.recipe = nn::Fp8Recipe::delayed;
  c.format = nn::Fp8Format::hybrid;
  c.amax_history_len = 3;
  c.amax_compute_algo = nn::Fp8AmaxAlgo::max;
  c.margin = 1;
  nn::Fp8Training f(c);
  nn::Fp8Delayed& d = *f.delayed();
  const nn::Linear l{&f, "decoder.layers.0.", "mlp.linear_fc1"};
  const ops::Context cpu{Device::cpu};
  // |got - want| <= 1e-5 * sum_k |a_ik| |b_kj| (op(a) [M, R], op(b) [R, N], given as [M, R] and [N, R])
  auto expect_close = [](const Tensor& got, const Tensor& want, const Tensor& a, const Tensor& b, const char* what) {
    const int64_t M = a.size(0), R = a.size(1), Nn = b.size(0);
    ASSERT_EQ(got.shape(), (Shape{M, Nn})) << what;
    double worst = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < Nn; ++j) {
        double size = 0;
        for (int64_t k = 0; k < R; ++k)
          size += std::fabs(a.data<float>()[i * R + k]) * std::fabs(b.data<float>()[j * R + k]);
        const double diff =
            std::fabs(static_cast<double>(got.data<float>()[i * Nn + j]) - want.data<float>()[i * Nn + j]);
        worst = std::max(worst, diff / std::max(size, 1e-30));
      }
    EXPECT_LE(worst, 1e-5) << what;
  };
  auto transposed = [](const Tensor& t) {
    Tensor o = Tensor::empty({t.size(1), t.size(0)}, DType::f32);
    for (int64_t i = 0; i < t.size(0); ++i)
      for (int64_t j = 0; j < t.size(1); ++j) o.data<float>()[j * t.size(0) + i] = t.data<float>()[i * t.size(1) + j];
    return o;
  };
  auto expect_state = [&](const std::string& name) {
    const std::vector<float> got = d.records().at("decoder.layers.0.mlp.linear_fc1").slots;  // [1, 3, 4]
    const Tensor& want = at(name);                                                           // [3, 4]
    ASSERT_EQ(static_cast<int64_t>(got.size()), want.numel()) << name;
    EXPECT_EQ(std::memcmp(got.data(), want.data<float>(), 12 * sizeof(float)), 0)
        << name << ": scale and history differ (input scale " << got[0] << " vs " << want.data<float>()[0] << ")";
  };
  const int64_t T = at("x.s0.m0").size(0), K = at("x.s0.m0").size(1), N = at("w.s0").size(0);
  Tensor y = Tensor::zeros({T, N}, DType::f32), dx = Tensor::zeros({T, K}, DType::f32);
  Tensor dw = Tensor::zeros({N, K}, DType::f32);
  for (int s = 0; s < 2; ++s) {
    const std::string st = ".s" + std::to_string(s);
    const Tensor& w = at("w" + st);
    for (int m = 0; m < 2; ++m) {
      const std::string sm = st + ".m" + std::to_string(m);
      d.begin(Pass::forward, m);
      nn::linear_fprop(y, at("x" + sm), w, 1.0f, 0.0f, l, cpu);
      expect_close(y, at("y" + sm), at("x" + sm), w, ("y" + sm).c_str());
      d.update(true, d.amaxes(true));
    }
    for (int m = 0; m < 2; ++m) {
      const std::string sm = st + ".m" + std::to_string(m);
      const Tensor &x = at("x" + sm), &dy = at("dy" + sm);
      d.begin(Pass::backward, m);
      nn::linear_dgrad(dx, dy, w, 1.0f, 0.0f, l, cpu);
      nn::linear_wgrad(dw, dy, x, 1.0f, 0.0f, l, cpu);
      expect_close(dx, at("dx" + sm), dy, transposed(w), ("dx" + sm).c_str());
      expect_close(dw, at("dw" + sm), transposed(dy), transposed(x), ("dw" + sm).c_str());
      d.update(false, d.amaxes(false));
    }
    expect_state("state" + st);
    d.new_step();
    if (s == 0) {
      d.begin(Pass::eval);
      nn::linear_fprop(y, at("x.eval"), w, 1.0f, 0.0f, l, cpu);
      expect_close(y, at("y.eval"), at("x.eval"), w, "y.eval");
      expect_state("state.eval");
    }
  }
}

}  // namespace
}  // namespace moecore
