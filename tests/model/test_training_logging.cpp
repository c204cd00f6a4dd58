// Megatron's logging flags in the training loop (issue 28): --log-params-norm and --log-num-zeros-in-grad against a
// direct computation over the model's parameters, the named timers by --timing-log-level and --timing-log-option,
// --log-memory-to-tensorboard, --log-throughput, and --logging-level's lines; in the log line and in the JSONL
// metrics (the TensorBoard scalars are the same list). Models live on testing::test_device(). No time is compared:
// timers are only present or absent.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "moecore/optim/adamw.h"
#include "moecore/train/timers.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

train::TrainConfig train_config(int64_t iters) {
  train::TrainConfig t;
  t.micro_batch_size = 2;
  t.global_batch_size = 4;
  t.train_iters = iters;
  t.lr = 5e-3f;
  t.log_interval = 1;
  t.has_validation = false;
  t.lr_decay_style = train::LrDecayStyle::cosine;  // (as written against; TrainConfig's default is linear)
  t.exit_signal_handler = true;
  return t;
}

// A run's log text and the JSONL lines of its logged iterations.
struct Logged {
  std::string text;
  std::vector<json> lines;
  train::TrainLog log;
  std::vector<Tensor> grads, values;  // host copies after the last step
  float clip_scale = 1;               // the last step's
};

Logged run(const train::TrainConfig& cfg, const train::BatchFn& batches = testing::synthetic_batch) {
  const fs::path dir = fs::temp_directory_path() / ("moecore_logging_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  train::TrainConfig t = cfg;
  t.metrics_jsonl = (dir / "m.jsonl").string();
  model::GptModel m(testing::small_moe_model(4), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamWConfig oc;
  oc.clip_grad = 0.05f;  // every step clipped: the zeros are counted after clipping
  optim::AdamW opt(m.params(), oc);
  std::FILE* f = std::tmpfile();
  Logged out;
  out.log = train::train(m, opt, t, batches, f);
  std::rewind(f);
  for (int c; (c = std::fgetc(f)) != EOF;) out.text += static_cast<char>(c);
  std::fclose(f);
  std::ifstream in(t.metrics_jsonl);
  for (std::string line; std::getline(in, line);) out.lines.push_back(json::parse(line));
  for (const Param& p : m.params()) {
    out.grads.push_back(testing::host(p.grad).clone());
    out.values.push_back(testing::host(p.value).clone());
  }
  out.clip_scale = optim::clip_scale_for(out.log.grad_norm.back(), opt.config().clip_grad);
  fs::remove_all(dir);
  return out;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The zeros of the last step's gradients after clipping and the parameters' norm, by hand over every parameter (one
// process: each once), against the TrainLog, the log line and the JSONL metrics. Tokens 61..63 never occur in the
// synthetic data: their embedding rows' gradients are exactly zero (3 x 32 elements at least).
TEST(TrainingLogging, ParamsNormAndNumZerosMatchADirectCount) {
  train::TrainConfig t = train_config(3);
  t.log_params_norm = true;
  t.log_num_zeros_in_grad = true;
  const Logged r = run(t);
  int64_t zeros = 0;
  for (const Tensor& g : r.grads)
    for (int64_t i = 0; i < g.numel(); ++i) zeros += g.data<float>()[i] * r.clip_scale == 0.0f ? 1 : 0;
  double sq = 0;
  for (const Tensor& v : r.values)
    for (int64_t i = 0; i < v.numel(); ++i) sq += static_cast<double>(v.data<float>()[i]) * v.data<float>()[i];
  const double norm = std::sqrt(sq);
  EXPECT_GE(zeros, 3 * 32);
  EXPECT_LT(r.clip_scale, 1.0f) << "the test wants a clipped step";
  ASSERT_EQ(r.log.num_zeros.size(), 3u);
  EXPECT_EQ(r.log.num_zeros.back(), static_cast<double>(zeros));
  EXPECT_NEAR(r.log.params_norm.back(), norm, 1e-12 * norm);
  ASSERT_EQ(r.lines.size(), 3u);
  EXPECT_EQ(r.lines.back()["num-zeros"].get<double>(), static_cast<double>(zeros));
  EXPECT_NEAR(r.lines.back()["params-norm"].get<double>(), norm, 1e-12 * norm);
  char line[96];
  std::snprintf(line, sizeof line, " num zeros: %.1f | params norm: %.3f |", static_cast<double>(zeros), norm);
  EXPECT_TRUE(has(r.text, line)) << line << " not in\n" << r.text;
  // Off by default: neither computed nor shown.
  const Logged plain = run(train_config(1));
  EXPECT_TRUE(std::isnan(plain.log.num_zeros[0]));
  EXPECT_TRUE(std::isnan(plain.log.params_norm[0]));
  EXPECT_FALSE(plain.lines[0].contains("num-zeros") || plain.lines[0].contains("params-norm"));
  EXPECT_FALSE(has(plain.text, "num zeros") || has(plain.text, "params norm")) << plain.text;
}

// With log_interval 2 the values come with the logged steps only (NaN in between).
TEST(TrainingLogging, ComputedOnTheLoggedStepsOnly) {
  train::TrainConfig t = train_config(4);
  t.log_interval = 2;
  t.log_params_norm = true;
  t.log_num_zeros_in_grad = true;
  const Logged r = run(t);
  ASSERT_EQ(r.log.params_norm.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(std::isnan(r.log.params_norm[i]), i % 2 == 0) << "step " << i + 1;
    EXPECT_EQ(std::isnan(r.log.num_zeros[i]), i % 2 == 0) << "step " << i + 1;
  }
  ASSERT_EQ(r.lines.size(), 2u);
  EXPECT_EQ(r.lines[1]["params-norm"].get<double>(), r.log.params_norm[3]);
}

std::vector<std::string> time_keys(const json& j) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items())
    if (k.size() > 5 && k.compare(k.size() - 5, 5, "-time") == 0) keys.push_back(k);
  return keys;
}

// Level 0: the iteration time only (no timers block); level 1: the once-per-step timers, in the block and as
// "<name>-time" metrics (max over the ranks, s per step); level 2: the per-micro-batch ones too. Without
// log_timers_to_tensorboard the block is still printed but no time goes to the metrics.
TEST(TrainingLogging, TimersFollowTheLevel) {
  train::TrainConfig t = train_config(2);
  t.log_timers_to_tensorboard = true;
  const Logged l0 = run(t);
  EXPECT_EQ(time_keys(l0.lines.back()), std::vector<std::string>{"iteration-time"});
  EXPECT_GT(l0.lines.back()["iteration-time"].get<double>(), 0.0);
  EXPECT_FALSE(has(l0.text, "time across ranks")) << l0.text;

  t.timing_log_level = 1;
  const Logged l1 = run(t);
  const json& j1 = l1.lines.back();
  for (const char* k : {"forward-backward-time", "optimizer-time", "optimizer-inner-step-time"}) {
    ASSERT_TRUE(j1.contains(k)) << k << " missing in " << j1.dump();
    EXPECT_GT(j1[k].get<double>(), 0.0) << k;
  }
  for (const char* k : {"batch-generator-time", "forward-compute-time", "backward-compute-time"})
    EXPECT_FALSE(j1.contains(k)) << k << " is a level-2 timer";
  EXPECT_TRUE(has(l1.text, "(min, max) time across ranks (ms):\n    forward-backward ....")) << l1.text;
  EXPECT_TRUE(has(l1.text, "\n    optimizer ......")) << l1.text;
  EXPECT_FALSE(has(l1.text, "forward-compute")) << l1.text;

  t.timing_log_level = 2;
  t.timing_log_option = train::TimingLogOption::max;
  const Logged l2 = run(t);
  for (const char* k :
       {"batch-generator-time", "forward-compute-time", "backward-compute-time", "forward-backward-time"})
    EXPECT_TRUE(l2.lines.back().contains(k)) << k << " missing in " << l2.lines.back().dump();
  EXPECT_TRUE(has(l2.text, "max time across ranks (ms):\n")) << l2.text;
  EXPECT_TRUE(has(l2.text, "\n    forward-compute ....")) << l2.text;

  t.timing_log_level = 1;
  t.timing_log_option = train::TimingLogOption::all;
  t.log_timers_to_tensorboard = false;
  const Logged all = run(t);
  EXPECT_TRUE(time_keys(all.lines.back()).empty()) << all.lines.back().dump();
  EXPECT_TRUE(has(all.text, "times across ranks (ms):\n  forward-backward:\n     rank  0: ")) << all.text;
}

// Megatron's formats over several ranks (a report made by hand, 2 steps): the min over the ranks where a timer ran,
// the max, each rank's time, in ms per step; a timer that ran nowhere is left out; the metrics are the maxima in s per
// step.
TEST(TrainingLogging, TimersBlockAndMetricsOverRanks) {
  using train::TimerName;
  train::TimerReport r;
  r.names = {TimerName::forward_backward, TimerName::all_grads_sync, TimerName::optimizer};
  r.world_ranks = {0, 1};
  r.ranks = {{0.02, 0.0, 0.004}, {0.03, 0.0, 0.0}};
  EXPECT_EQ(train::timers_format(r, train::TimingLogOption::minmax, 2),
            "(min, max) time across ranks (ms):"
            "\n    forward-backward ...............................: (10.00, 15.00)"
            "\n    optimizer ......................................: (2.00, 2.00)");
  EXPECT_EQ(train::timers_format(r, train::TimingLogOption::max, 2),
            "max time across ranks (ms):"
            "\n    forward-backward ...............................: 15.00"
            "\n    optimizer ......................................: 2.00");
  EXPECT_EQ(train::timers_format(r, train::TimingLogOption::all, 2),
            "times across ranks (ms):\n  forward-backward:\n     rank  0: 10.00\n     rank  1: 15.00"
            "\n  optimizer:\n     rank  0: 2.00");
  const auto metrics = train::timers_metrics(r, 2);
  ASSERT_EQ(metrics.size(), 2u);
  EXPECT_EQ(metrics[0].first, "forward-backward-time");
  EXPECT_DOUBLE_EQ(metrics[0].second, 0.015);
  EXPECT_EQ(metrics[1].first, "optimizer-time");
  EXPECT_DOUBLE_EQ(metrics[1].second, 0.002);
  EXPECT_EQ(train::timers_format(train::TimerReport{}, train::TimingLogOption::minmax, 2), "");  // level 0: no block
}

// The allocator's counters of the model's device, and its reserved bytes (on the host: the resident set).
TEST(TrainingLogging, MemoryMetricsArePresentAndPositive) {
  train::TrainConfig t = train_config(1);
  t.log_memory_to_tensorboard = true;
  const Logged r = run(t);
  const json& j = r.lines.back();
  for (const char* k :
       {"mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes", "mem-allocated-count"}) {
    ASSERT_TRUE(j.contains(k)) << k << " missing in " << j.dump();
    EXPECT_GT(j[k].get<double>(), 0.0) << k;
  }
  EXPECT_GE(j["mem-max-allocated-bytes"].get<double>(), j["mem-allocated-bytes"].get<double>());
  EXPECT_FALSE(run(train_config(1)).lines.back().contains("mem-allocated-bytes"));
}

// --log-throughput adds Megatron's field to the line (the run's TFLOP/s are still there); its metric "throughput"
// needs log_timers_to_tensorboard too, as in Megatron.
TEST(TrainingLogging, ThroughputPerGpuWithTheFlag) {
  train::TrainConfig t = train_config(1);
  const Logged plain = run(t);
  EXPECT_FALSE(has(plain.text, "throughput per GPU")) << plain.text;
  EXPECT_TRUE(has(plain.text, " TFLOP/s")) << plain.text;
  t.log_throughput = true;
  const Logged line = run(t);
  EXPECT_TRUE(has(line.text, " | throughput per GPU (TFLOP/s/GPU): ")) << line.text;
  EXPECT_FALSE(line.lines.back().contains("throughput"));
  t.log_timers_to_tensorboard = true;
  const Logged both = run(t);
  ASSERT_TRUE(both.lines.back().contains("throughput")) << both.lines.back().dump();
  EXPECT_GT(both.lines.back()["throughput"].get<double>(), 0.0);
}

// --logging-level: the timers block is INFO, a skipped step's line a WARNING; the iteration line is always printed
// (Megatron's print()).
TEST(TrainingLogging, LoggingLevelHidesInfoThenWarnings) {
  train::TrainConfig t = train_config(3);
  t.timing_log_level = 1;
  t.nan_action = train::NanAction::skip;
  // Step 2 sees token 63 (never in the data otherwise) whose embedding row is made NaN by the batch function: a
  // non-finite loss, the step skipped.
  const train::BatchFn batches = [](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    testing::synthetic_batch(tok, lab, valid, i);
    if (!valid && i == 2) tok.data<int32_t>()[5] = 63;
  };
  auto run_nan = [&](std::optional<int> level) {
    train::TrainConfig c = t;
    c.logging_level = level;
    model::GptModel m(testing::small_moe_model(4), c.micro_batch_size, 77, {}, testing::test_device());
    optim::AdamW opt(m.params(), optim::AdamWConfig{});
    Tensor w = testing::host(m.param("embedding.word_embeddings.weight").value).clone();
    w.data<float>()[63 * 32] = NAN;
    m.param("embedding.word_embeddings.weight").value.copy_from(w);
    m.refresh_compute_weights();
    std::FILE* f = std::tmpfile();
    const train::TrainLog log = train::train(m, opt, c, batches, f);
    EXPECT_EQ(log.skipped_steps, 1);
    std::string text;
    std::rewind(f);
    for (int ch; (ch = std::fgetc(f)) != EOF;) text += static_cast<char>(ch);
    std::fclose(f);
    return text;
  };
  for (const std::optional<int> level : {std::optional<int>{}, std::optional<int>{10}, std::optional<int>{20}}) {
    const std::string text = run_nan(level);
    EXPECT_TRUE(has(text, "time across ranks")) << text;
    EXPECT_TRUE(has(text, ": non-finite value in")) << text;
    EXPECT_TRUE(has(text, " iteration      3/     3 |")) << text;
  }
  const std::string warning = run_nan(30);
  EXPECT_FALSE(has(warning, "time across ranks")) << warning;
  EXPECT_TRUE(has(warning, ": non-finite value in")) << warning;
  const std::string error = run_nan(40);
  EXPECT_FALSE(has(error, "time across ranks")) << error;
  EXPECT_FALSE(has(error, ": non-finite value in")) << error;
  EXPECT_TRUE(has(error, " iteration      3/     3 |")) << error;
}

TEST(TrainingLogging, BadFlagsNameTheValue) {
  train::TrainConfig t = train_config(1);
  t.timing_log_level = 3;
  testing::expect_error([&] { t.validate(); }, {"--timing-log-level", "3"});
  testing::expect_error([&] { (void)enum_parse<train::TimingLogOption>("median", "--timing-log-option"); },
                        {"--timing-log-option", "median", "max, minmax, all"});
  t = train_config(1);
  t.logging_level = -5;
  testing::expect_error([&] { t.validate(); }, {"--logging-level", "-5"});
}

}  // namespace
}  // namespace moecore

namespace moecore {
namespace {

// The step's loss list on one process: the per-MoE-layer entries are divided by micro-batches x MoE layers, the others
// kept; a key the list lacks reads 0 (a dense model's MoE losses).
TEST(TrainingLogging, StepMetricsDivideTheMoeLossesPerLayerAndMicroBatch) {
  train::StepMetrics m;
  m.add({"mtp_1 loss", "mtp_1_loss"});
  m.add({"z_loss", "z_loss", train::MetricReduce::mean, train::MetricInterval::last, /*per_moe_layer=*/true});
  m.items()[0].value = 0.5;
  m.items()[1].value = 12.0;
  double loss = 2.0;
  m.reduce(loss, /*moe_layers=*/3, /*micro_batches=*/2, ProcessGroup{}, ProcessGroup{});
  EXPECT_DOUBLE_EQ(loss, 2.0);
  EXPECT_DOUBLE_EQ(m.value("mtp_1_loss"), 0.5);
  EXPECT_DOUBLE_EQ(m.value("z_loss"), 2.0);
  EXPECT_EQ(m.value("load_balancing_loss"), 0.0);
}

}  // namespace
}  // namespace moecore
