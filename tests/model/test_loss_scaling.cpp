// Loss scaling (train/grad_scaler.h: Megatron's constant and dynamic scalers) and --calculate-per-token-loss, through
// the training loop: the scaler's arithmetic, a power-of-two scale changing no bit of an fp32 run, overflowing steps
// skipped with the scale lowered and the LR schedule held, the scaler's state resumed bitwise, and per-token loss
// weighing every counted token of the global batch alike.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/grad_scaler.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::synthetic_batch;
using Kind = train::GradScalerConfig::Kind;

train::GradScalerConfig dynamic_scaler(float initial, int64_t window, int64_t hysteresis) {
  train::GradScalerConfig g;
  g.kind = Kind::dynamic;
  g.scale = initial;
  g.window = window;
  g.hysteresis = hysteresis;
  return g;
}

// Megatron's DynamicGradScaler.update, step by step: the scale halves once `hysteresis` overflows have been seen since
// the last growth (and again at every later one), never below the minimum; it doubles after `window` clean steps in a
// row, which also refills the hysteresis.
TEST(GradScaler, FollowsMegatronsDynamicRule) {
  train::GradScalerConfig c = dynamic_scaler(8, 3, 2);
  c.min_scale = 1;
  train::GradScaler s(c);
  const auto step = [&](bool inf) {
    s.update(inf);
    return s.scale();
  };
  EXPECT_EQ(step(true), 8);  // hysteresis 2 -> 1: kept
  EXPECT_EQ(step(true), 4);  // -> 0: halved
  EXPECT_EQ(step(true), 2);  // -> -1: halved again (no refill without growth)
  EXPECT_EQ(step(false), 2);
  EXPECT_EQ(step(false), 2);
  EXPECT_EQ(step(false), 4);  // three clean steps: doubled, hysteresis back to 2
  EXPECT_EQ(s.state().hysteresis_tracker, 2);
  EXPECT_EQ(s.state().growth_tracker, 0);
  EXPECT_EQ(step(false), 4);
  EXPECT_EQ(step(true), 4);  // an overflow resets the growth count and spends one hysteresis
  EXPECT_EQ(s.state().growth_tracker, 0);
  for (int i = 0; i < 6; ++i) step(true);
  EXPECT_EQ(s.scale(), 1);  // floored at --min-loss-scale
  // The state goes into a checkpoint and comes back as it was.
  train::GradScaler r(c);
  r.load(s.state(), "test");
  EXPECT_EQ(r.state().scale, s.state().scale);
  EXPECT_EQ(r.state().hysteresis_tracker, s.state().hysteresis_tracker);
  EXPECT_THROW(r.load({0.0f, 0, 1}, "test"), Error);
  // The constant scaler never moves; no scaler is a scale of 1.
  train::GradScalerConfig k;
  k.kind = Kind::constant;
  k.scale = 1024;
  train::GradScaler constant(k);
  constant.update(true);
  EXPECT_EQ(constant.scale(), 1024);
  EXPECT_EQ(train::GradScaler(train::GradScalerConfig{}).scale(), 1);
}

TEST(GradScaler, RefusesWhatMegatronAsserts) {
  const auto fails = [](train::GradScalerConfig c, const char* flag) {
    try {
      train::GradScaler s(c);
      ADD_FAILURE() << "expected an Error naming " << flag;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  train::GradScalerConfig c = dynamic_scaler(4, 10, 2);
  c.min_scale = 8;
  fails(c, "--min-loss-scale");
  fails(dynamic_scaler(4, 0, 2), "--loss-scale-window");
  fails(dynamic_scaler(4, 10, 0), "--hysteresis");
  fails(dynamic_scaler(0, 10, 2), "--initial-loss-scale");
  train::GradScalerConfig k;
  k.kind = Kind::constant;
  k.scale = NAN;
  fails(k, "--loss-scale");
}

model::ModelConfig moe_model() {
  return testing::small_moe_model(4);
}

train::TrainConfig train_config(int64_t iters) {
  train::TrainConfig t = testing::small_train_config(iters);
  t.has_validation = false;
  return t;
}

struct RunResult {
  train::TrainLog log;
  uint64_t hash = 0;
};

RunResult run(const model::ModelConfig& mc, train::TrainConfig t, const train::BatchFn& batches = synthetic_batch) {
  model::GptModel m(mc, t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  RunResult r;
  r.log = train::train(m, opt, t, batches, nullptr);
  r.hash = train::parameter_hash(m);
  return r;
}

// In fp32 a power-of-two loss scale is exact: every gradient is the unscaled one times 2^k until the unscaling
// multiplies it back, so the run is bit for bit the unscaled one.
TEST(LossScaling, PowerOfTwoScaleChangesNoBitOfAnFp32Run) {
  const RunResult plain = run(moe_model(), train_config(4));
  train::TrainConfig t = train_config(4);
  t.grad_scaler = dynamic_scaler(65536, 1000, 2);
  const RunResult scaled = run(moe_model(), t);
  EXPECT_EQ(scaled.log.train_loss, plain.log.train_loss);
  EXPECT_EQ(scaled.log.grad_norm, plain.log.grad_norm);
  EXPECT_EQ(scaled.hash, plain.hash);
  EXPECT_EQ(scaled.log.loss_scale, std::vector<float>(4, 65536.0f));
  EXPECT_EQ(plain.log.loss_scale, std::vector<float>(4, 1.0f));
}

// Batches of iterations `bad` (0-based) carry token 63, whose embedding row the test sets to NaN: their loss and
// gradients are not finite, as an fp16 overflow would make them.
train::BatchFn poisoned_at(std::vector<int64_t> bad, int64_t micro_per_step) {
  return [bad, micro_per_step](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    synthetic_batch(tok, lab, valid, i);
    for (const int64_t it : bad)
      if (!valid && i == it * micro_per_step) tok.data<int32_t>()[3] = 63;
  };
}

RunResult run_poisoned(train::TrainConfig t, const std::vector<int64_t>& bad, const fs::path& save = {},
                       const fs::path& load = {}) {
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  Tensor emb = testing::host(m.param("embedding.word_embeddings.weight").value).clone();
  for (int64_t h = 0; h < 32; ++h) emb.data<float>()[63 * 32 + h] = NAN;
  m.param("embedding.word_embeddings.weight").value.copy_from(emb);
  m.refresh_compute_weights();
  t.save = save.string();
  t.load = load.string();
  RunResult r;
  r.log = train::train(m, opt, t, poisoned_at(bad, t.micro_batches()), nullptr);
  r.hash = train::parameter_hash(m);
  return r;
}

// Dynamic scaling as Megatron runs it (check_for_nan off): overflowing steps are skipped whatever --nan-action says,
// the second one in a row halves the scale, three clean steps double it again, and the LR schedule does not advance
// on a skipped step.
TEST(LossScaling, OverflowsAreSkippedLowerTheScaleAndHoldTheSchedule) {
  train::TrainConfig t = train_config(8);
  t.grad_scaler = dynamic_scaler(1024, 3, 2);
  t.check_for_nan = false;
  const RunResult r = run_poisoned(t, {2, 3});
  EXPECT_EQ(r.log.skipped_steps, 2);
  const std::vector<float> scales = {1024, 1024, 1024, 1024, 512, 512, 512, 1024};
  EXPECT_EQ(r.log.loss_scale, scales);
  // The schedule's step: the iteration less the skipped steps before it.
  const int64_t schedule_step[8] = {0, 1, 2, 2, 2, 3, 4, 5};
  for (int64_t it = 0; it < 8; ++it) EXPECT_EQ(r.log.lr[it], train::lr_at(t, schedule_step[it])) << it;
  for (const double loss : {r.log.train_loss[4], r.log.train_loss[7]}) EXPECT_TRUE(std::isfinite(loss));
}

// Overflows the scaler can no longer answer (at --min-loss-scale) stop the run after 10 in a row, naming the scale;
// those it answers by lowering the scale never count.
TEST(LossScaling, OverflowsAtTheMinimumScaleStopTheRun) {
  train::TrainConfig t = train_config(24);
  t.grad_scaler = dynamic_scaler(8, 1000, 1);
  t.grad_scaler.min_scale = 2;
  t.check_for_nan = false;
  std::vector<int64_t> bad(24);
  for (int64_t i = 0; i < 24; ++i) bad[static_cast<size_t>(i)] = i;
  try {
    run_poisoned(t, bad);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    // 8 -> 4 -> 2 (two overflows answered), then 10 at the minimum: iterations 3 to 12.
    EXPECT_NE(what.find("10 consecutive steps skipped for gradient overflow at the minimum loss scale "
                        "(--min-loss-scale 2) (iterations 3 to 12"),
              std::string::npos)
        << what;
  }
}

// The scaler's state goes into the checkpoint (state.json "grad_scaler"): a run stopped and resumed mid-way continues
// with the scale, growth and hysteresis counts of the uninterrupted one, bit for bit.
TEST(LossScaling, ResumeRestoresTheScalerBitwise) {
  const fs::path dir = fs::temp_directory_path() / ("moecore_loss_scale_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  train::TrainConfig t = train_config(8);
  t.grad_scaler = dynamic_scaler(1024, 3, 1);
  t.check_for_nan = false;
  const std::vector<int64_t> bad = {1};
  const RunResult straight = run_poisoned(t, bad);
  train::TrainConfig half = t;
  half.exit_interval = 3;  // stops after iteration 3: scale 512, growth tracker 1
  const RunResult first = run_poisoned(half, bad, dir);
  const RunResult second = run_poisoned(t, bad, dir, dir);
  ASSERT_EQ(second.log.train_loss.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(second.log.train_loss[i], straight.log.train_loss[i + 3]) << i;
    EXPECT_EQ(second.log.loss_scale[i], straight.log.loss_scale[i + 3]) << i;
    EXPECT_EQ(second.log.lr[i], straight.log.lr[i + 3]) << i;
  }
  EXPECT_EQ(second.hash, straight.hash);
  EXPECT_EQ(straight.log.loss_scale.back(), 1024.0f);  // (grew back after three clean steps, across the resume)
  const auto latest = io::checkpoint_find_latest(dir.string());
  ASSERT_TRUE(latest.has_value());
  const train::TrainStateJson saved = train::train_state_parse(io::read_file(*latest + "/state.json"), *latest);
  ASSERT_TRUE(saved.grad_scaler.has_value());
  EXPECT_EQ(saved.grad_scaler->scale, 2048.0f);  // (after the last step: its third clean one since 1024)
  fs::remove_all(dir);
}

// A batch whose sequences count very different numbers of tokens: micro-batch 0 of each step keeps 4 labels of 64,
// the rest keep all.
void uneven_batch(Tensor& tok, Tensor& lab, bool valid, int64_t i) {
  synthetic_batch(tok, lab, valid, i);
  if (i % 2 != 0) return;
  for (int64_t k = 4; k < lab.numel(); ++k) lab.data<int32_t>()[k] = -1;
}

// Per-token loss: every counted token of the global batch weighs alike however the batch is cut into micro-batches,
// so two micro-batches give the run of one micro-batch holding them both (to rounding), while the default weighs each
// micro-batch's mean alike and moves elsewhere. (No auxiliary loss here: its value depends on how tokens are grouped.)
TEST(PerTokenLoss, WeighsEveryTokenOfTheGlobalBatchAlike) {
  model::ModelConfig mc = moe_model();
  mc.moe.aux_loss_coeff = {0.0f};
  train::TrainConfig two = train_config(4);
  two.calculate_per_token_loss = true;
  // One micro-batch of 4 sequences: batch i of the 2-sequence runs is its half 2i .. 2i + 1.
  train::TrainConfig one = train_config(4);
  one.micro_batch_size = 4;
  const train::BatchFn joined = [](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    Tensor t2 = Tensor::empty({2, tok.shape()[1]}, DType::i32), l2 = Tensor::empty({2, tok.shape()[1]}, DType::i32);
    const int64_t half = t2.numel();
    for (int64_t h = 0; h < 2; ++h) {
      uneven_batch(t2, l2, valid, 2 * i + h);
      std::copy_n(t2.data<int32_t>(), half, tok.data<int32_t>() + h * half);
      std::copy_n(l2.data<int32_t>(), half, lab.data<int32_t>() + h * half);
    }
  };
  const RunResult per_token = run(mc, two, uneven_batch);
  const RunResult joined_run = run(mc, one, joined);
  train::TrainConfig mean = train_config(4);
  const RunResult per_micro_batch = run(mc, mean, uneven_batch);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(per_token.log.train_loss[i], joined_run.log.train_loss[i], 1e-5) << i;
    EXPECT_NEAR(per_token.log.grad_norm[i], joined_run.log.grad_norm[i], 1e-5 * joined_run.log.grad_norm[i]) << i;
  }
  EXPECT_GT(std::fabs(per_micro_batch.log.grad_norm[0] - per_token.log.grad_norm[0]),
            1e-2 * per_token.log.grad_norm[0]);
}

// Without masked tokens per-token loss is the default run to rounding, the MoE auxiliary loss included (Megatron's
// router rule keeps its weight).
TEST(PerTokenLoss, EqualsTheDefaultWhenEveryTokenCounts) {
  train::TrainConfig t = train_config(4);
  const RunResult mean = run(moe_model(), t);
  t.calculate_per_token_loss = true;
  const RunResult per_token = run(moe_model(), t);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(per_token.log.train_loss[i], mean.log.train_loss[i], 1e-5) << i;
    EXPECT_NEAR(per_token.log.grad_norm[i], mean.log.grad_norm[i], 1e-5 * mean.log.grad_norm[i]) << i;
    EXPECT_NEAR(per_token.log.metrics[i].value("load_balancing_loss"), mean.log.metrics[i].value("load_balancing_loss"),
                1e-5)
        << i;
  }
}

}  // namespace
}  // namespace moecore
