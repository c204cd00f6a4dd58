// System tests of the training loop: bitwise resume (also with gradient accumulation and the expert-bias
// router), SIGTERM leaving a loadable checkpoint, NaN/Inf skip leaving every state bit-identical, LR schedules,
// corrupted checkpoints, and the metrics files. Models live on testing::test_device(); parameters and optimizer
// states are written and read through host copies.
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moecore/io/checkpoint.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

model::ModelConfig moe_model() {
  model::ModelConfig c = testing::small_moe_model(4);
  c.moe.score_function = moe::ScoreFunction::sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 1e-2f;
  c.moe.input_jitter_eps = 1e-2f;  // exercises the noise-stream position in the checkpoint
  return c;
}

using testing::synthetic_batch;

// Element i of the f32 tensor t (any device) set to v through a host copy.
void set_element(Tensor& t, int64_t i, float v) {
  Tensor h = testing::host(t).clone();
  h.data<float>()[i] = v;
  t.copy_from(h);
}

train::TrainConfig train_config(int64_t iters) {
  return testing::small_train_config(iters);
}

struct RunResult {
  std::vector<double> losses;
  uint64_t hash = 0;
};

RunResult run(train::TrainConfig t, const fs::path& save = {}, const fs::path& load = {}) {
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  t.save = save.string();
  t.load = load.string();
  RunResult r;
  const auto log = train::train(m, opt, t, synthetic_batch, nullptr);
  r.losses = log.train_loss;
  r.hash = train::parameter_hash(m);
  return r;
}

fs::path fresh_dir(const char* name) {
  const fs::path p =
      fs::temp_directory_path() / (std::string("moecore_train_") + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

TEST(Training, ResumeIsBitIdentical) {
  const fs::path dir = fresh_dir("resume");
  const RunResult straight = run(train_config(8));
  train::TrainConfig half = train_config(8);
  half.exit_interval = 4;  // same schedule, stop after 4 steps (saving)
  const RunResult first = run(half, dir);
  const RunResult second = run(train_config(8), dir, dir);
  ASSERT_EQ(first.losses.size(), 4u);
  ASSERT_EQ(second.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(first.losses[i], straight.losses[i]) << i;
    EXPECT_EQ(second.losses[i], straight.losses[i + 4]) << i + 4;
  }
  EXPECT_EQ(second.hash, straight.hash);
  fs::remove_all(dir);
}

TEST(Training, EmptyLoadDirectoryStartsFromScratch) {
  const fs::path dir = fresh_dir("empty_load");
  const RunResult fresh = run(train_config(3));
  const RunResult with_load = run(train_config(3), dir, dir);  // first launch of an auto-resuming command
  EXPECT_EQ(with_load.losses, fresh.losses);
  EXPECT_TRUE(io::checkpoint_find_latest(dir.string()).has_value());
  fs::remove_all(dir);
}

TEST(Training, SigtermSavesALoadableCheckpointAndStops) {
  const fs::path dir = fresh_dir("sigterm");
  train::TrainConfig t = train_config(10);
  t.save = dir.string();
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  const train::BatchFn batches = [&](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    if (!valid && i == 2 * 3) std::raise(SIGTERM);  // during iteration 4 (1-based)
    synthetic_batch(tok, lab, valid, i);
  };
  const auto log = train::train(m, opt, t, batches, nullptr);
  EXPECT_TRUE(log.stopped_by_signal);
  EXPECT_EQ(log.train_loss.size(), 4u);
  const auto latest = io::checkpoint_find_latest(dir.string());
  ASSERT_TRUE(latest.has_value());
  model::GptModel m2(moe_model(), t.micro_batch_size, 1, {}, testing::test_device());
  optim::AdamW opt2(m2.params(), optim::AdamWConfig{});
  const auto progress = train::load_training_checkpoint(*latest, m2, opt2, t.seed);
  EXPECT_EQ(progress.iteration, 4);
  EXPECT_EQ(train::parameter_hash(m2), train::parameter_hash(m));
  fs::remove_all(dir);
}

// --exit-duration-in-mins: once the run has trained longer than the limit it saves and stops at that step (here a
// limit no step fits in: after the first), and the checkpoint resumes.
TEST(Training, ExitDurationSavesAndStops) {
  const fs::path dir = fresh_dir("exit_duration");
  train::TrainConfig t = train_config(6);
  t.save = dir.string();
  t.exit_duration_mins = 1e-12;
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  const auto log = train::train(m, opt, t, synthetic_batch, nullptr);
  EXPECT_TRUE(log.stopped_by_time);
  EXPECT_FALSE(log.stopped_by_signal);
  EXPECT_EQ(log.train_loss.size(), 1u);
  const auto latest = io::checkpoint_find_latest(dir.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(io::checkpoint_iteration_of(*latest), 1);
  const RunResult straight = run(train_config(6));
  const RunResult rest = run(train_config(6), dir, dir);
  ASSERT_EQ(rest.losses.size(), 5u);
  EXPECT_EQ(rest.losses.back(), straight.losses.back());
  EXPECT_EQ(rest.hash, straight.hash);
  fs::remove_all(dir);
}

TEST(Training, NonFiniteStepIsSkippedWithEveryStateBitIdentical) {
  train::TrainConfig t = train_config(4);
  t.nan_action = train::NanAction::skip;
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  // Token 63 never occurs in the synthetic data; poisoning its embedding row only affects batches that use it.
  set_element(m.param("embedding.word_embeddings.weight").value, 63 * 32, NAN);
  m.refresh_compute_weights();
  uint64_t hash_before = 0, bias_hash_before = 0;
  auto bias_hash = [&] {
    const auto b = testing::to_vector(m.router_state(1)->expert_bias);
    uint64_t h = 0;
    for (int e = 0; e < 4; ++e) h = h * 31 + std::hash<float>()(b[e]);
    return h;
  };
  std::vector<Tensor> m_before;
  const train::BatchFn batches = [&](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    synthetic_batch(tok, lab, valid, i);
    if (!valid && i == 4) {  // iteration 3 (micro-batch 0)
      tok.data<int32_t>()[5] = 63;
      hash_before = train::parameter_hash(m);
      bias_hash_before = bias_hash();
      m_before.clear();
      for (const Tensor& s : opt.exp_avg()) m_before.push_back(testing::host(s).clone());
    }
  };
  bool saw_skip = false;
  train::train(m, opt, t, batches, nullptr, [&](int64_t it, double loss, bool skipped) {
    if (it != 2) return;
    saw_skip = skipped;
    EXPECT_TRUE(std::isnan(loss));
    EXPECT_EQ(train::parameter_hash(m), hash_before);
    EXPECT_EQ(bias_hash(), bias_hash_before);
    EXPECT_EQ(opt.steps_taken(), 2);
    for (size_t k = 0; k < m_before.size(); ++k) {
      const Tensor now = testing::host(opt.exp_avg()[k]);
      EXPECT_EQ(std::memcmp(m_before[k].raw(), now.raw(), static_cast<size_t>(m_before[k].nbytes())), 0);
    }
  });
  EXPECT_TRUE(saw_skip);
  EXPECT_EQ(opt.steps_taken(), 3);  // the other three steps ran
}

TEST(Training, NonFiniteStepStopsWithTheTensorNamed) {
  train::TrainConfig t = train_config(2);
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  set_element(m.param("decoder.layers.0.mlp.linear_fc2.weight").value, 3, INFINITY);
  m.refresh_compute_weights();
  try {
    train::train(m, opt, t, synthetic_batch, nullptr);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--nan-action skip"), std::string::npos) << e.what();
  }
}

TEST(Training, CorruptedCheckpointsFailNamingTheFileAndReason) {
  const fs::path dir = fresh_dir("corrupt");
  run(train_config(2), dir);
  const fs::path it = dir / "iter_0000002";
  const fs::path model = it / "model.safetensors";
  ASSERT_TRUE(fs::exists(model));
  auto expect_load_error = [&](const char* what) {
    model::GptModel m(moe_model(), 2, 1, {}, testing::test_device());
    optim::AdamW opt(m.params(), optim::AdamWConfig{});
    try {
      train::load_training_checkpoint(it.string(), m, opt, 1234);
      ADD_FAILURE() << "loaded a checkpoint with " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  std::string bytes;
  {
    std::ifstream f(model, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  {  // flipped byte
    std::string b = bytes;
    b[b.size() / 2] ^= 0x10;
    std::ofstream(model, std::ios::binary) << b;
    expect_load_error("model.safetensors");
  }
  {  // truncated shard
    std::ofstream(model, std::ios::binary) << bytes.substr(0, bytes.size() - 100);
    expect_load_error("model.safetensors");
  }
  std::ofstream(model, std::ios::binary) << bytes;
  fs::remove(it / "COMMIT");  // missing marker
  expect_load_error("COMMIT");
  fs::remove_all(dir);
}

TEST(Training, CheckpointOfAnotherModelIsRejectedNamingTheField) {
  const fs::path dir = fresh_dir("mismatch");
  run(train_config(1), dir);
  model::ModelConfig other = moe_model();
  other.moe.num_experts = 8;
  model::GptModel m(other, 2, 1, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  try {
    train::load_training_checkpoint((dir / "iter_0000001").string(), m, opt, 1234);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Training, LrSchedulesFollowMegatronFormulas) {
  train::TrainConfig t;
  t.train_iters = 100;
  t.lr = 1.0f;
  t.min_lr = 0.1f;
  t.lr_warmup_iters = 10;
  EXPECT_FLOAT_EQ(train::lr_at(t, 0), 0.1f);
  EXPECT_FLOAT_EQ(train::lr_at(t, 9), 1.0f);
  t.lr_decay_style = train::LrDecayStyle::cosine;
  EXPECT_NEAR(train::lr_at(t, 55), 0.1 + 0.9 * 0.5, 1e-6);  // halfway through the decay
  t.lr_decay_style = train::LrDecayStyle::linear;
  EXPECT_NEAR(train::lr_at(t, 55), 0.55, 1e-6);
  t.lr_decay_style = train::LrDecayStyle::constant;
  EXPECT_FLOAT_EQ(train::lr_at(t, 80), 1.0f);
  t.lr_decay_style = train::LrDecayStyle::wsd;
  t.lr_wsd_decay_iters = 20;
  t.lr_wsd_decay_style = train::WsdDecayStyle::linear;
  EXPECT_FLOAT_EQ(train::lr_at(t, 79), 1.0f);  // stable phase
  EXPECT_NEAR(train::lr_at(t, 90), 0.1 + 0.9 * 0.5, 1e-6);
  t.lr_wsd_decay_style = train::WsdDecayStyle::exponential;
  EXPECT_NEAR(train::lr_at(t, 90), 0.1 + 0.9 * (2 * std::pow(0.5, 0.5) - 1), 1e-6);
  EXPECT_FLOAT_EQ(train::lr_at(t, 100), 0.1f);
}

TEST(Training, MetricsJsonlAndTensorBoardAreWritten) {
  const fs::path dir = fresh_dir("metrics");
  train::TrainConfig t = train_config(4);
  t.log_interval = 2;
  t.metrics_jsonl = (dir / "m.jsonl").string();
  t.tensorboard_dir = (dir / "tb").string();
  t.moe_per_layer_logging = true;
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  train::train(m, opt, t, synthetic_batch, nullptr);
  std::ifstream f(t.metrics_jsonl);
  std::string line;
  int logged = 0;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("lm_loss")) continue;
    ++logged;
    for (const char* k : {"iteration", "lm_loss", "grad_norm", "lr", "tokens_per_s", "load_balancing_loss",
                          "moe/max_over_mean_load_layer_1"})
      EXPECT_TRUE(j.contains(k)) << k << " missing in " << line;
  }
  EXPECT_EQ(logged, 2);
  int event_files = 0;
  for (const auto& e : fs::directory_iterator(t.tensorboard_dir))
    event_files += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  EXPECT_EQ(event_files, 1);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moecore
