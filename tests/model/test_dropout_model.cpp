// Dropout in the GPT model (Megatron's hidden dropout on the embedding and both residual branches, attention
// dropout on the probabilities): counter-based masks, so evaluation is dropout-free, a run repeats bitwise, a
// resumed run draws the masks of the uninterrupted one, and the masks change with the step and micro-batch.
// Models live on testing::test_device(); the batches are host tensors, as the data loader hands them over.
#include <filesystem>

#include "moecore/train/checkpointing.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

model::ModelConfig dropout_model(float hidden, float attention) {
  model::ModelConfig c = testing::small_moe_model(4);
  c.hidden_dropout = hidden;
  c.attention_dropout = attention;
  c.add_bias_linear = true;
  c.position_embedding_type = model::PositionEmbedding::learned_absolute;
  return c;
}

model::GptModel make_model(const model::ModelConfig& c, uint64_t seed) {
  return model::GptModel(c, 2, seed, {}, testing::test_device());
}

struct Batch {
  Tensor tokens = Tensor::empty({2, 16}, DType::i32, MemCategory::other);
  Tensor labels = Tensor::empty({2, 16}, DType::i32, MemCategory::other);
  Batch() { testing::synthetic_batch(tokens, labels, false, 3); }
};

TEST(DropoutModel, EvaluationIsDropoutFreeAndTrainingIsNot) {
  const Batch b;
  model::GptModel plain = make_model(dropout_model(0.0f, 0.0f), 5);
  model::GptModel drop = make_model(dropout_model(0.3f, 0.2f), 5);
  EXPECT_EQ(plain.evaluate(b.tokens, b.labels).loss_sum, drop.evaluate(b.tokens, b.labels).loss_sum);
  const double p = plain.forward_backward(b.tokens, b.labels, 1.0f).loss_sum;
  const double d = drop.forward_backward(b.tokens, b.labels, 1.0f).loss_sum;
  EXPECT_NE(p, d);
  // Without dropout the training forward is the evaluation forward.
  EXPECT_EQ(p, plain.evaluate(b.tokens, b.labels).loss_sum);
}

TEST(DropoutModel, MasksRepeatForTheSameStepAndChangeWithStepAndMicroBatch) {
  const Batch b;
  model::GptModel m = make_model(dropout_model(0.3f, 0.2f), 5);
  auto loss_at = [&](int64_t it, int64_t mb) {
    m.zero_grad();
    m.set_dropout_step(it, mb);
    return m.forward_backward(b.tokens, b.labels, 1.0f).loss_sum;
  };
  const double a = loss_at(3, 1);
  EXPECT_EQ(loss_at(3, 1), a);
  EXPECT_NE(loss_at(4, 1), a);
  EXPECT_NE(loss_at(3, 0), a);
}

TEST(DropoutModel, EachSiteChangesTheLossAndATinyPIsNearlyTheIdentity) {
  // Attention dropout alone, then hidden dropout alone, each changes the loss; both at p -> 0 approach the
  // dropout-free loss (the masks keep ~all elements).
  const Batch b;
  model::GptModel plain = make_model(dropout_model(0.0f, 0.0f), 5);
  const double base = plain.forward_backward(b.tokens, b.labels, 1.0f).loss_sum;
  for (auto [h, a] : {std::pair{0.0f, 0.5f}, std::pair{0.5f, 0.0f}}) {
    model::GptModel m = make_model(dropout_model(h, a), 5);
    EXPECT_NE(m.forward_backward(b.tokens, b.labels, 1.0f).loss_sum, base) << h << " " << a;
  }
  model::GptModel tiny = make_model(dropout_model(1e-6f, 1e-6f), 5);
  EXPECT_NEAR(tiny.forward_backward(b.tokens, b.labels, 1.0f).loss_sum, base, 1e-3 * std::abs(base));
}

TEST(DropoutModel, ResumeIsBitIdenticalWithDropout) {
  const fs::path dir = fs::temp_directory_path() / ("moecore_dropout_resume_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto run = [&](int64_t exit_interval, bool save, bool load) {
    model::GptModel m = make_model(dropout_model(0.2f, 0.1f), 77);
    optim::AdamW opt(m.params(), optim::AdamWConfig{});
    train::TrainConfig t;
    t.micro_batch_size = 2;
    t.global_batch_size = 4;
    t.train_iters = 6;
    t.lr = 5e-3f;
    t.eval_iters = 1;
    t.lr_decay_style = train::LrDecayStyle::cosine;  // (as written against; TrainConfig's default is linear)
    t.log_interval = 10;
    t.exit_signal_handler = true;
    t.exit_interval = exit_interval;
    if (save) t.save = dir.string();
    if (load) t.load = dir.string();
    const auto log = train::train(m, opt, t, testing::synthetic_batch, nullptr);
    return std::pair{log.train_loss, train::parameter_hash(m)};
  };
  const auto straight = run(0, false, false);
  const auto first = run(3, true, false);
  const auto second = run(0, true, true);
  ASSERT_EQ(first.first.size(), 3u);
  ASSERT_EQ(second.first.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(first.first[i], straight.first[i]) << i;
    EXPECT_EQ(second.first[i], straight.first[i + 3]) << i + 3;
  }
  EXPECT_EQ(second.second, straight.second);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moecore
