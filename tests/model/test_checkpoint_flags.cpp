// Megatron's checkpoint switches: --no-load-optim, --no-load-rng, --no-save-optim, --no-save-rng, --finetune,
// and the LR-scheduler check on load with --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler.
// Tiny model, a few steps each; bitwise resume with every switch at its default is Training.ResumeIsBitIdentical.
// Also the checks after the checksum (issue 15): forged dtypes and shapes, state.json against COMMIT.
// Models live on testing::test_device(); optimizer states are read through host copies.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "moecore/io/checkpoint.h"
#include "moecore/io/crc32c.h"
#include "moecore/io/file_util.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::synthetic_batch;

model::ModelConfig moe_model() {
  model::ModelConfig c = testing::small_moe_model(4);
  c.moe.score_function = moe::ScoreFunction::sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 1e-2f;
  c.moe.input_jitter_eps = 1e-2f;  // the router noise stream: the rng state a checkpoint holds
  return c;
}

train::TrainConfig train_config(int64_t iters) {
  train::TrainConfig t = testing::small_train_config(iters);
  t.min_lr = 5e-4f;
  t.has_validation = false;
  t.exit_signal_handler = false;
  return t;
}

struct RunResult {
  train::TrainLog log;
  uint64_t hash = 0;
  int64_t optimizer_steps = 0;
  int64_t router_calls = 0;  // the MoE layer's noise-stream position at the end
};

RunResult run(const train::TrainConfig& t, bool zero = false) {
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{}, /*allocate_state=*/!zero);
  train::TrainConfig c = t;
  c.use_distributed_optimizer = zero;
  RunResult r;
  r.log = train::train(m, opt, c, synthetic_batch, nullptr);
  r.hash = train::parameter_hash(m);
  r.optimizer_steps = opt.steps_taken();
  r.router_calls = m.router_state(1)->calls;
  return r;
}

fs::path fresh_dir(const char* name) {
  const fs::path p =
      fs::temp_directory_path() / (std::string("moecore_ckflags_") + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

nlohmann::json state_of(const fs::path& iter_dir) {
  std::ifstream f(iter_dir / "state.json");
  return nlohmann::json::parse(f);
}

// Runs `iters` steps of an 8-step schedule from scratch and saves them into dir (--exit-interval).
RunResult save_after(const fs::path& dir, int64_t iters, bool save_optim = true, bool save_rng = true) {
  train::TrainConfig t = train_config(8);
  t.exit_interval = iters;
  t.save = dir.string();
  t.save_optim = save_optim;
  t.save_rng = save_rng;
  return run(t);
}

std::string load_error(const fs::path& iter_dir, const train::CheckpointLoadOptions& o) {
  model::GptModel m(moe_model(), 2, 1, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  try {
    train::load_training_state(iter_dir.string(), m, opt, 1234, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool all_zero(const std::vector<Tensor>& ts) {
  for (const Tensor& t : ts)
    for (float v : testing::to_vector(t))
      if (v != 0.0f) return false;
  return true;
}

TEST(CheckpointFlags, NoLoadOptimKeepsWeightsAndProgressWithAFreshOptimizer) {
  const fs::path dir = fresh_dir("no_load_optim");
  const RunResult saved = save_after(dir, 4);
  model::GptModel m(moe_model(), 2, 1, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  for (Tensor& t : opt.exp_avg()) t.fill_(1.0f);  // whatever the optimizer held is dropped
  opt.set_steps_taken(9);
  train::CheckpointLoadOptions o;
  o.load_optim = false;
  const auto loaded = train::load_training_state((dir / "iter_0000004").string(), m, opt, 1234, o);
  EXPECT_EQ(train::parameter_hash(m), saved.hash);
  EXPECT_EQ(loaded.progress.iteration, 4);
  EXPECT_EQ(loaded.progress.consumed_samples, 16);
  EXPECT_FALSE(loaded.optimizer_loaded);
  EXPECT_TRUE(loaded.rng_loaded);
  EXPECT_FALSE(loaded.scheduler.has_value());
  EXPECT_EQ(m.router_state(1)->calls, saved.router_calls);
  EXPECT_TRUE(all_zero(opt.exp_avg()));
  EXPECT_TRUE(all_zero(opt.exp_avg_sq()));
  EXPECT_EQ(opt.steps_taken(), 0);

  // Through train(): the same first loss as the straight run (same weights, data position and noise stream), a
  // fresh step count, and (Megatron: the scheduler lives with the optimizer) the LR schedule restarting.
  const RunResult straight = run(train_config(8));
  for (bool zero : {false, true}) {
    train::TrainConfig t = train_config(8);
    t.load = dir.string();
    t.load_optim = false;
    const RunResult resumed = run(t, zero);
    ASSERT_EQ(resumed.log.train_loss.size(), 4u);
    EXPECT_EQ(resumed.log.first_iteration, 4);
    EXPECT_EQ(resumed.log.train_loss[0], straight.log.train_loss[4]) << zero;
    EXPECT_FLOAT_EQ(resumed.log.lr[0], train::lr_at(t, 0));
    EXPECT_FLOAT_EQ(resumed.log.lr[1], train::lr_at(t, 1));
    EXPECT_EQ(resumed.optimizer_steps, zero ? 0 : 4);  // ZeRO keeps its steps in its shards
    EXPECT_NE(resumed.hash, straight.hash);            // fresh moments: a different update
  }
  fs::remove_all(dir);
}

TEST(CheckpointFlags, NoLoadRngRestartsTheRouterNoiseStreams) {
  const fs::path dir = fresh_dir("no_load_rng");
  const RunResult saved = save_after(dir, 4);
  ASSERT_GT(saved.router_calls, 0);
  model::GptModel m(moe_model(), 2, 1, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  train::CheckpointLoadOptions o;
  o.load_rng = false;
  const auto loaded = train::load_training_state((dir / "iter_0000004").string(), m, opt, 1234, o);
  EXPECT_EQ(m.router_state(1)->calls, 0);
  EXPECT_TRUE(loaded.optimizer_loaded);
  EXPECT_FALSE(loaded.rng_loaded);
  EXPECT_EQ(opt.steps_taken(), 4);
  EXPECT_EQ(train::parameter_hash(m), saved.hash);

  const RunResult straight = run(train_config(8));
  train::TrainConfig t = train_config(8);
  t.load = dir.string();
  t.load_rng = false;
  const RunResult resumed = run(t);
  ASSERT_EQ(resumed.log.train_loss.size(), 4u);
  EXPECT_NE(resumed.log.train_loss[0], straight.log.train_loss[4]);  // other jitter noise
  EXPECT_EQ(resumed.log.lr, std::vector<float>(straight.log.lr.begin() + 4, straight.log.lr.end()));
  EXPECT_EQ(resumed.router_calls, straight.router_calls - saved.router_calls);
  fs::remove_all(dir);
}

TEST(CheckpointFlags, FinetuneStartsAtIterationZeroWithTheLoadedWeights) {
  const fs::path dir = fresh_dir("finetune");
  const RunResult saved = save_after(dir, 4);
  model::GptModel m(moe_model(), 2, 1, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  train::CheckpointLoadOptions o;
  o.finetune = true;  // load_optim / load_rng left true: finetune wins
  const auto loaded = train::load_training_state((dir / "iter_0000004").string(), m, opt, 1234, o);
  EXPECT_EQ(loaded.progress.iteration, 0);
  EXPECT_EQ(loaded.progress.consumed_samples, 0);
  EXPECT_FALSE(loaded.optimizer_loaded);
  EXPECT_FALSE(loaded.rng_loaded);
  EXPECT_EQ(train::parameter_hash(m), saved.hash);
  EXPECT_EQ(opt.steps_taken(), 0);
  EXPECT_TRUE(all_zero(opt.exp_avg()));
  EXPECT_EQ(m.router_state(1)->calls, 0);

  const fs::path out = fresh_dir("finetune_out");
  train::TrainConfig t = train_config(3);
  t.load = dir.string();
  t.save = out.string();
  t.finetune = true;
  t.lr = 1e-3f;  // a finetune's own schedule: no check against the checkpoint's
  t.min_lr = 1e-4f;
  const RunResult ft = run(t);
  const RunResult scratch = run(train_config(3));
  EXPECT_EQ(ft.log.first_iteration, 0);
  ASSERT_EQ(ft.log.train_loss.size(), 3u);
  EXPECT_NE(ft.log.train_loss[0], scratch.log.train_loss[0]);  // started from the loaded weights
  EXPECT_EQ(ft.optimizer_steps, 3);
  EXPECT_FLOAT_EQ(ft.log.lr[0], train::lr_at(t, 0));
  const nlohmann::json st = state_of(out / "iter_0000003");
  EXPECT_EQ(st["iteration"], 3);
  EXPECT_EQ(st["consumed_samples"], 12);
  fs::remove_all(dir);
  fs::remove_all(out);
}

TEST(CheckpointFlags, NoSaveOptimCheckpointNeedsNoLoadOptim) {
  const fs::path dir = fresh_dir("no_save_optim");
  const RunResult saved = save_after(dir, 2, /*save_optim=*/false);
  const fs::path it = dir / "iter_0000002";
  EXPECT_FALSE(fs::exists(it / "optimizer.safetensors"));
  const nlohmann::json st = state_of(it);
  EXPECT_FALSE(st.contains("optimizer_steps"));
  EXPECT_FALSE(st.contains("opt_param_scheduler"));
  EXPECT_TRUE(st.contains("router_calls"));

  const std::string e = load_error(it, {});
  EXPECT_NE(e.find("optimizer state"), std::string::npos) << e;
  EXPECT_NE(e.find("--no-save-optim"), std::string::npos) << e;
  EXPECT_NE(e.find("--no-load-optim"), std::string::npos) << e;
  EXPECT_NE(e.find(it.string()), std::string::npos) << e;
  train::CheckpointLoadOptions no_optim;
  no_optim.load_optim = false;
  EXPECT_EQ(load_error(it, no_optim), "");
  train::CheckpointLoadOptions finetune;
  finetune.finetune = true;
  EXPECT_EQ(load_error(it, finetune), "");

  train::TrainConfig t = train_config(3);  // train() fails the same way, and resumes with the flag
  t.load = dir.string();
  EXPECT_THROW(run(t), Error);
  t.load_optim = false;  // the schedule restarts: no scheduler state to check against (train_iters differs)
  EXPECT_EQ(run(t).log.train_loss.size(), 1u);
  (void)saved;
  fs::remove_all(dir);
}

TEST(CheckpointFlags, NoSaveRngCheckpointNeedsNoLoadRng) {
  const fs::path dir = fresh_dir("no_save_rng");
  save_after(dir, 2, /*save_optim=*/true, /*save_rng=*/false);
  const fs::path it = dir / "iter_0000002";
  const nlohmann::json st = state_of(it);
  EXPECT_FALSE(st.contains("router_calls"));
  EXPECT_TRUE(st.contains("optimizer_steps"));
  const std::string e = load_error(it, {});
  EXPECT_NE(e.find("rng state"), std::string::npos) << e;
  EXPECT_NE(e.find("--no-save-rng"), std::string::npos) << e;
  EXPECT_NE(e.find("--no-load-rng"), std::string::npos) << e;
  train::CheckpointLoadOptions no_rng;
  no_rng.load_rng = false;
  EXPECT_EQ(load_error(it, no_rng), "");
  train::CheckpointLoadOptions finetune;
  finetune.finetune = true;
  EXPECT_EQ(load_error(it, finetune), "");
  fs::remove_all(dir);
}

TEST(CheckpointFlags, SchedulerStateIsSavedWithTheOptimizer) {
  const fs::path dir = fresh_dir("sched_saved");
  save_after(dir, 3);
  const nlohmann::json s = state_of(dir / "iter_0000003")["opt_param_scheduler"];
  EXPECT_FLOAT_EQ(s["max_lr"].get<float>(), 5e-3f);
  EXPECT_FLOAT_EQ(s["min_lr"].get<float>(), 5e-4f);
  EXPECT_EQ(s["lr_warmup_steps"], 2);
  EXPECT_EQ(s["lr_decay_steps"], 8);  // --lr-decay-iters 0: --train-iters
  EXPECT_EQ(s["lr_decay_style"], "cosine");
  EXPECT_EQ(s["num_steps"], 3);
  fs::remove_all(dir);
}

TEST(CheckpointFlags, SchedulerMismatchFailsNamingTheFieldUnlessOverridden) {
  const fs::path dir = fresh_dir("sched_mismatch");
  save_after(dir, 3);
  auto resume_error = [&](const train::TrainConfig& t) -> std::string {
    try {
      run(t);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  train::TrainConfig t = train_config(8);
  t.load = dir.string();
  t.lr = 4e-3f;
  std::string e = resume_error(t);
  EXPECT_NE(e.find("OptimizerParamScheduler: class input value 0.004 and checkpoint value 0.005 for learning rate"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("--lr"), std::string::npos) << e;
  EXPECT_NE(e.find("--override-opt_param-scheduler"), std::string::npos) << e;
  EXPECT_NE(e.find("--use-checkpoint-opt_param-scheduler"), std::string::npos) << e;

  train::TrainConfig longer = train_config(10);  // a longer run moves the decay's end (Megatron fails too)
  longer.load = dir.string();
  e = resume_error(longer);
  EXPECT_NE(e.find("class input value 10 and checkpoint value 8 for total number of iterations"), std::string::npos)
      << e;
  EXPECT_NE(e.find("--train-iters"), std::string::npos) << e;

  t.override_opt_param_scheduler = true;  // the command line wins, unchecked
  const RunResult overridden = run(t);
  ASSERT_EQ(overridden.log.lr.size(), 5u);
  for (int64_t i = 0; i < 5; ++i) EXPECT_FLOAT_EQ(overridden.log.lr[i], train::lr_at(t, i + 3)) << i;
  fs::remove_all(dir);
}

TEST(CheckpointFlags, UseCheckpointSchedulerReplacesTheConfigsSchedule) {
  const fs::path dir = fresh_dir("sched_use_ckpt");
  save_after(dir, 3);
  train::TrainConfig t = train_config(10);  // other lr, min_lr, warmup, style and end: all from the checkpoint
  t.lr = 1e-3f;
  t.min_lr = 0.0f;
  t.lr_warmup_iters = 0;
  t.lr_decay_style = train::LrDecayStyle::linear;
  t.load = dir.string();
  t.save = dir.string();
  t.use_checkpoint_opt_param_scheduler = true;
  const RunResult r = run(t);
  ASSERT_EQ(r.log.lr.size(), 7u);
  const train::TrainConfig saved = train_config(8);
  for (int64_t i = 0; i < 7; ++i) EXPECT_FLOAT_EQ(r.log.lr[i], train::lr_at(saved, i + 3)) << i;
  EXPECT_FLOAT_EQ(r.log.lr[6], 5e-4f);  // past the checkpoint's decay end (8): its min_lr
  const nlohmann::json s = state_of(dir / "iter_0000010")["opt_param_scheduler"];  // and it is saved onwards
  EXPECT_FLOAT_EQ(s["max_lr"].get<float>(), 5e-3f);
  EXPECT_EQ(s["lr_decay_steps"], 8);
  EXPECT_EQ(s["lr_decay_style"], "cosine");
  EXPECT_EQ(s["num_steps"], 10);
  fs::remove_all(dir);
}

TEST(CheckpointFlags, CheckpointWithoutSchedulerStateLoadsUnchecked) {
  const fs::path dir = fresh_dir("sched_old");
  model::GptModel m(moe_model(), 2, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  // As written before the scheduler state existed: default save options carry no scheduler.
  train::save_training_checkpoint(dir.string(), m, opt, {3, 12}, 1234, 0);
  ASSERT_FALSE(state_of(dir / "iter_0000003").contains("opt_param_scheduler"));
  train::TrainConfig t = train_config(5);
  t.lr = 2e-3f;
  t.load = dir.string();
  const RunResult r = run(t);
  ASSERT_EQ(r.log.lr.size(), 2u);
  EXPECT_FLOAT_EQ(r.log.lr[0], train::lr_at(t, 3));  // the schedule follows the iteration
  fs::remove_all(dir);
}

TEST(CheckpointFlags, SchedulerResolveChecksEachFieldInMegatronsOrder) {
  train::OptParamSchedulerState cur{1e-3f, 1e-4f, 10, 100, "WSD", 20, "linear", 0};
  auto fails_on = [&](train::OptParamSchedulerState saved, const char* what) {
    try {
      train::opt_param_scheduler_resolve(cur, saved, 40, false, false, "ck");
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  train::OptParamSchedulerState s = cur;
  s.num_steps = 40;
  EXPECT_EQ(train::opt_param_scheduler_resolve(cur, s, 40, false, false, "ck").num_steps, 40);
  s.min_lr = 2e-4f;
  fails_on(s, "class input value 1e-04 and checkpoint value 2e-04 for minimum learning rate (--min-lr)");
  s = cur;
  s.lr_warmup_steps = 5;
  fails_on(s, "for warmup iterations (--lr-warmup-iters)");
  s = cur;
  s.lr_decay_style = "cosine";
  fails_on(s, "class input value WSD and checkpoint value cosine for learning rate decay style (--lr-decay-style)");
  s = cur;
  s.wsd_decay_steps = 30;
  fails_on(s, "for WSD decay iterations (--lr-wsd-decay-iters)");
  s = cur;
  s.lr_wsd_decay_style = "cosine";
  fails_on(s, "for WSD decay style (--lr-wsd-decay-style)");
  // Override: the run's values, the schedule position at the iteration; use-checkpoint: the saved values.
  s.num_steps = 30;
  const auto o = train::opt_param_scheduler_resolve(cur, s, 40, true, false, "ck");
  EXPECT_EQ(o.lr_wsd_decay_style, "linear");
  EXPECT_EQ(o.num_steps, 40);
  const auto u = train::opt_param_scheduler_resolve(cur, s, 40, false, true, "ck");
  EXPECT_EQ(u.lr_wsd_decay_style, "cosine");
  EXPECT_EQ(u.num_steps, 30);
  EXPECT_THROW(train::opt_param_scheduler_resolve(cur, s, 40, true, true, "ck"), Error);
}

TEST(CheckpointFlags, OverrideAndUseCheckpointExcludeEachOther) {
  train::TrainConfig t = train_config(2);
  t.override_opt_param_scheduler = true;
  t.use_checkpoint_opt_param_scheduler = true;
  try {
    t.validate();
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--override-opt_param-scheduler"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--use-checkpoint-opt_param-scheduler"), std::string::npos) << e.what();
  }
}

TEST(CheckpointFlags, ScheduleRestartSurvivesTheNextResume) {
  // 4 steps; resume without the optimizer (the schedule restarts at 4) and stop at 6; resume normally to 8: the LR
  // continues the restarted schedule (num_steps 2 saved at 6), as one uninterrupted run from 4 would.
  const fs::path dir = fresh_dir("sched_chain");
  save_after(dir, 4);
  train::TrainConfig a = train_config(8);
  a.load = dir.string();
  a.save = dir.string();
  a.load_optim = false;
  a.exit_interval = 6;
  const RunResult first = run(a);
  EXPECT_EQ(state_of(dir / "iter_0000006")["opt_param_scheduler"]["num_steps"], 2);
  train::TrainConfig b = train_config(8);
  b.load = dir.string();
  const RunResult second = run(b);
  ASSERT_EQ(second.log.lr.size(), 2u);
  EXPECT_FLOAT_EQ(second.log.lr[0], train::lr_at(b, 2));
  EXPECT_FLOAT_EQ(second.log.lr[1], train::lr_at(b, 3));
  (void)first;
  fs::remove_all(dir);
}

// ---- Checkpoints that pass their checksums but disagree with COMMIT or the model (issue 15) -----------------

// Rewrites <dir>/COMMIT so that `file`'s size and CRC match its bytes again: a forgery the checksum cannot see.
void recommit(const fs::path& dir, const std::string& file) {
  auto j = nlohmann::json::parse(io::read_file((dir / "COMMIT").string()));
  const std::string bytes = io::read_file((dir / file).string());
  char crc[9];
  std::snprintf(crc, sizeof crc, "%08x", io::crc32c(bytes));
  j["files"][file] = {{"bytes", bytes.size()}, {"crc32c", crc}};
  std::ofstream((dir / "COMMIT").string(), std::ios::trunc) << j.dump(1);
}

// Edits the safetensors header of dir/file in place (the edit must keep the header's length: a dtype of the
// same width, a permuted shape), then fixes COMMIT. `pick` chooses the tensor; returns its name.
std::string forge_header(const fs::path& dir, const std::string& file,
                         const std::function<bool(const std::string&, const nlohmann::json&)>& pick,
                         const std::function<void(nlohmann::json&)>& edit) {
  std::string bytes = io::read_file((dir / file).string());
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  auto h = nlohmann::ordered_json::parse(bytes.substr(8, n));
  std::string name;
  for (auto& [k, v] : h.items())
    if (k != "__metadata__" && name.empty() && pick(k, nlohmann::json(v))) name = k;
  EXPECT_FALSE(name.empty()) << file;
  nlohmann::json entry = h[name];
  edit(entry);
  h[name] = entry;
  std::string text = h.dump();
  EXPECT_LE(text.size(), n);
  text.resize(n, ' ');
  bytes.replace(8, n, text);
  std::ofstream((dir / file).string(), std::ios::binary | std::ios::trunc) << bytes;
  recommit(dir, file);
  return name;
}

// The load error of dir, checking that the failed load left the model untouched.
std::string load_error_untouched(const fs::path& iter_dir) {
  model::GptModel m(moe_model(), 2, 1, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  const uint64_t before = train::parameter_hash(m);
  std::string msg;
  try {
    train::load_training_state(iter_dir.string(), m, opt, 1234, train::CheckpointLoadOptions{});
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(train::parameter_hash(m), before) << "a failed load changed the model";
  EXPECT_TRUE(all_zero(opt.exp_avg()));
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  return msg;
}

void expect_has(const std::string& msg, std::initializer_list<std::string> parts) {
  EXPECT_FALSE(msg.empty()) << "no error";
  for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

class ForgedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fresh_dir(info->name());
    train::TrainConfig t = train_config(8);
    t.save = root_.string();
    t.save_interval = 2;
    t.exit_interval = 4;
    run(t);  // checkpoints at 2 and 4
    it4_ = root_ / "iter_0000004";
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_, it4_;
};

bool is_expert(const std::string& name, const nlohmann::json&) {
  return name.find("experts") != std::string::npos;
}
bool is_dense_matrix(const std::string& name, const nlohmann::json& e) {
  return name.find("experts") == std::string::npos && e["shape"].size() == 2 && e["shape"][0] != e["shape"][1] &&
         e["dtype"] == "F32";
}

TEST_F(ForgedCheckpoint, DtypeChangedWithAMatchingChecksumIsRefused) {
  const std::string name =
      forge_header(it4_, "model.safetensors", is_dense_matrix, [](nlohmann::json& e) { e["dtype"] = "I32"; });
  expect_has(load_error_untouched(it4_),
             {(it4_ / "model.safetensors").string(), name, "i32", "f32", "iteration 2", "--ckpt-step 2"});
}

TEST_F(ForgedCheckpoint, DenseShapeChangedWithAMatchingChecksumIsRefused) {
  const std::string name = forge_header(it4_, "model.safetensors", is_dense_matrix, [](nlohmann::json& e) {
    e["shape"] = {e["shape"][1], e["shape"][0]};
  });
  expect_has(load_error_untouched(it4_), {(it4_ / "model.safetensors").string(), name, "--ckpt-step 2"});
}

TEST_F(ForgedCheckpoint, ExpertShapeChangedWithAMatchingChecksumIsRefused) {
  // [E, a, b] -> [E, b, a]: the same rows of the same size, which a size-only check lets through.
  const std::string name = forge_header(
      it4_, "model.safetensors",
      [](const std::string& n, const nlohmann::json& e) {
        return is_expert(n, e) && e["shape"].size() == 3 && e["shape"][1] != e["shape"][2];
      },
      [](nlohmann::json& e) {
        e["shape"] = {e["shape"][0], e["shape"][2], e["shape"][1]};
      });
  expect_has(load_error_untouched(it4_), {(it4_ / "model.safetensors").string(), name, "experts", "--ckpt-step 2"});
}

TEST_F(ForgedCheckpoint, OptimizerMomentDtypeChangedWithAMatchingChecksumIsRefused) {
  const std::string name = forge_header(
      it4_, "optimizer.safetensors",
      [](const std::string& n, const nlohmann::json& e) {
        return n.rfind("exp_avg_sq.", 0) == 0 && n.find("experts") != std::string::npos && e["dtype"] == "F32";
      },
      [](nlohmann::json& e) { e["dtype"] = "I32"; });
  expect_has(load_error_untouched(it4_), {(it4_ / "optimizer.safetensors").string(), name, "i32"});
}

TEST_F(ForgedCheckpoint, StateJsonIterationMustEqualCommits) {
  auto state = state_of(it4_);
  state["iteration"] = 3;
  std::ofstream((it4_ / "state.json").string(), std::ios::trunc) << state.dump(1);
  recommit(it4_, "state.json");
  expect_has(load_error_untouched(it4_),
             {(it4_ / "state.json").string(), "iteration 3", "COMMIT", "4", "--ckpt-step 2"});
  // Through train(): the run fails instead of resuming from a mixed-up position.
  train::TrainConfig t = train_config(8);
  t.load = root_.string();
  EXPECT_THROW(run(t), Error);
  t.ckpt_step = 2;  // the older checkpoint, picked explicitly, resumes
  EXPECT_EQ(run(t).log.first_iteration, 2);
}

TEST_F(ForgedCheckpoint, HostileStateJsonFieldsAreErrorsNotCrashes) {
  const std::string dir = it4_.string();
  const auto good = state_of(it4_);
  const std::vector<std::pair<std::string, nlohmann::json>> edits = {{"iteration", -4},
                                                                     {"iteration", 4.5},
                                                                     {"iteration", "4"},
                                                                     {"consumed_samples", -1},
                                                                     {"seed", -1},
                                                                     {"seed", "x"},
                                                                     {"router_calls", 3},
                                                                     {"router_calls", {1, -2}},
                                                                     {"optimizer_steps", 1e300},
                                                                     {"expert_model_parallel_size", 0},
                                                                     {"model", "mixtral"},
                                                                     {"opt_param_scheduler", {{"max_lr", 1e300}}},
                                                                     {"iteration", 18446744073709551615ull}};
  for (const auto& [key, value] : edits) {
    auto s = good;
    s[key] = value;
    EXPECT_THROW(train::train_state_parse(s.dump(), dir), Error) << key << " = " << value.dump();
  }
  const auto t = train::train_state_parse(good.dump(), dir);
  EXPECT_EQ(t.iteration, 4);
  EXPECT_EQ(t.consumed_samples, 16);
  EXPECT_TRUE(t.optimizer_steps.has_value());
  EXPECT_TRUE(t.scheduler.has_value());
  EXPECT_EQ(t.router_calls->size(), 2u);
}

}  // namespace
}  // namespace moecore
