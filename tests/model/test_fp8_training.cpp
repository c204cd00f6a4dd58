// FP8 training (Megatron's --fp8-format / --fp8-recipe; nn/fp8.h) on the synthetic training tests' small model (a
// dense layer, then an MoE layer with a shared expert): every recipe and both formats train and track the bf16 run
// within a stated band while differing from it (the GEMMs really quantise), with grouped and sequential experts, with
// MLA and MTP, and with the output layer under --fp8-output-proj; --first-last-layers-bf16 keeps exactly the layers
// it names out of FP8 (all of them: bitwise the bf16 run); a run resumes bitwise and its checkpoint refuses another
// recipe; a NaN in a weight stops the run naming the layer and GEMM that met it.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

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
  for (nn::Fp8Recipe recipe : {nn::Fp8Recipe::tensorwise, nn::Fp8Recipe::blockwise, nn::Fp8Recipe::mxfp8})
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
  model::ModelConfig c = fp8_model(nn::Fp8Recipe::blockwise, nn::Fp8Format::hybrid);
  c.multi_latent_attention = true;
  c.q_lora_rank = 16;
  c.kv_lora_rank = 16;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 8;
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
  const model::ModelConfig c = fp8_model(nn::Fp8Recipe::blockwise, nn::Fp8Format::hybrid);
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
  EXPECT_NE(other.error.find("was trained with --fp8-format hybrid --fp8-recipe blockwise but this run uses "
                             "--fp8-format hybrid --fp8-recipe tensorwise"),
            std::string::npos)
      << other.error;
  const Fp8Run bf16 = train_run(bf16_of(c), testing::small_train_config(8), {}, dir);  // (at its last step: none run)
  EXPECT_EQ(bf16.error, "");
  fs::remove_all(dir);
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

}  // namespace
}  // namespace moecore
