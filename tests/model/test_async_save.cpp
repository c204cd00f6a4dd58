// Asynchronous checkpoint saves (--async-save, train/async_save.h) in one process: the files equal the synchronous
// saves' byte for byte and resume bit-identically; retention; the save in flight when the run ends (its last
// iteration, --exit-interval, a signal) is committed before train returns; a write fault in the worker (in a child
// process of this test, MOECORE_FAULT_INJECT_WRITE being read once per process) stops the run, commits nothing and
// keeps the previous checkpoint. No timing is assumed: a save may be committed at the next step boundary or later.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>

#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/train/async_save.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::synthetic_batch;

constexpr const char* kChildDirEnv = "MOECORE_TEST_ASYNC_SAVE_DIR";  // set for the child of the write-fault test

model::ModelConfig moe_model() {
  model::ModelConfig c = testing::small_moe_model(4);
  c.moe.score_function = moe::ScoreFunction::sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 1e-2f;
  c.moe.input_jitter_eps = 1e-2f;  // the router noise stream: rng state in the checkpoint
  return c;
}

train::TrainConfig train_config(int64_t iters, bool async, bool persistent = true) {
  train::TrainConfig t = testing::small_train_config(iters);
  t.has_validation = false;
  t.exit_signal_handler = false;
  t.async_save = async;
  t.use_persistent_ckpt_worker = persistent;
  return t;
}

struct RunResult {
  std::vector<double> losses;
  uint64_t hash = 0;
};

RunResult run(train::TrainConfig t, const fs::path& save = {}, const fs::path& load = {},
              const train::BatchFn& batches = synthetic_batch) {
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  t.save = save.string();
  t.load = load.string();
  RunResult r;
  r.losses = train::train(m, opt, t, batches, nullptr).train_loss;
  r.hash = train::parameter_hash(m);
  return r;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("moecore_async_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

// Every entry of a checkpoint root, and every file of an iteration directory with its bytes.
std::vector<std::string> entries(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& de : fs::directory_iterator(root)) out.push_back(de.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}
std::map<std::string, std::string> files_of(const fs::path& iter_dir) {
  std::map<std::string, std::string> out;
  for (const auto& de : fs::directory_iterator(iter_dir)) out[de.path().filename().string()] = io::read_file(de.path());
  return out;
}

void expect_same_checkpoints(const fs::path& sync, const fs::path& async, std::initializer_list<int64_t> iterations) {
  EXPECT_EQ(entries(async), entries(sync));
  EXPECT_EQ(io::checkpoint_read_tracker(async.string()), io::checkpoint_read_tracker(sync.string()));
  for (int64_t it : iterations) {
    const auto a = files_of(io::checkpoint_iteration_dir(async.string(), it));
    const auto s = files_of(io::checkpoint_iteration_dir(sync.string(), it));
    ASSERT_EQ(a.size(), s.size()) << "iteration " << it;
    for (const auto& [name, bytes] : s) EXPECT_TRUE(a.count(name) && a.at(name) == bytes) << it << ": " << name;
  }
}

TEST(AsyncSave, FilesEqualTheSynchronousSavesAndResumeIsBitIdentical) {
  const fs::path sync = fresh_dir("sync"), async = fresh_dir("async");
  const RunResult straight = run(train_config(8, false));
  for (const bool a : {false, true}) {
    train::TrainConfig t = train_config(8, a);
    t.save_interval = 2;
    t.exit_interval = 6;  // saves at 2, 4 (committed while training goes on) and 6 (the exit: finished before return)
    const RunResult first = run(t, a ? async : sync);
    ASSERT_EQ(first.losses.size(), 6u);
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(first.losses[i], straight.losses[i]) << i;
  }
  expect_same_checkpoints(sync, async, {2, 4, 6});
  const RunResult second = run(train_config(8, true), async, async);
  ASSERT_EQ(second.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(second.losses[i], straight.losses[6 + i]) << i + 6;
  EXPECT_EQ(second.hash, straight.hash);
  fs::remove_all(sync);
  fs::remove_all(async);
}

// The save of iteration 4 is in flight while iteration 5 runs; the run's last save (5) first finishes it. Both are
// committed when train returns, whatever the worker's speed; with a thread per save (no persistent worker) as well.
TEST(AsyncSave, SaveInFlightAtTheLastIterationIsCommittedBeforeTrainReturns) {
  for (const bool persistent : {true, false}) {
    SCOPED_TRACE(persistent ? "persistent worker" : "a worker per save");
    const fs::path dir = fresh_dir(persistent ? "last_p" : "last_t");
    train::TrainConfig t = train_config(5, true, persistent);
    t.save_interval = 4;
    model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
    optim::AdamW opt(m.params(), optim::AdamWConfig{});
    t.save = dir.string();
    train::train(m, opt, t, synthetic_batch, nullptr);
    EXPECT_EQ(io::checkpoint_list_committed(dir.string()), (std::vector<int64_t>{4, 5}));
    EXPECT_EQ(io::checkpoint_read_tracker(dir.string()), 5);
    EXPECT_EQ(entries(dir), (std::vector<std::string>{"iter_0000004", "iter_0000005", io::kCheckpointTrackerFile}));
    model::GptModel m2(moe_model(), t.micro_batch_size, 1, {}, testing::test_device());
    optim::AdamW opt2(m2.params(), optim::AdamWConfig{});
    EXPECT_EQ(
        train::load_training_checkpoint(io::checkpoint_iteration_dir(dir.string(), 5), m2, opt2, t.seed).iteration, 5);
    EXPECT_EQ(train::parameter_hash(m2), train::parameter_hash(m));
    fs::remove_all(dir);
  }
}

TEST(AsyncSave, RetentionKeepsTheNewestAsSynchronousSavesDo) {
  const fs::path sync = fresh_dir("keep_sync"), async = fresh_dir("keep_async");
  for (const bool a : {false, true}) {
    train::TrainConfig t = train_config(5, a);
    t.save_interval = 1;
    t.keep_last = 2;
    run(t, a ? async : sync);
  }
  EXPECT_EQ(io::checkpoint_list_committed(async.string()), (std::vector<int64_t>{4, 5}));
  expect_same_checkpoints(sync, async, {4, 5});
  fs::remove_all(sync);
  fs::remove_all(async);
}

// SIGTERM during iteration 4 with the save of iteration 3 possibly still in flight: the stop's save follows it and is
// committed before train returns, and it holds the model as it was at the stop.
TEST(AsyncSave, SignalStopCommitsTheSavesInFlight) {
  const fs::path dir = fresh_dir("sigterm");
  train::TrainConfig t = train_config(10, true);
  t.exit_signal_handler = true;
  t.save_interval = 3;
  t.save = dir.string();
  model::GptModel m(moe_model(), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{});
  const train::BatchFn batches = [&](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    if (!valid && i == 2 * 3) std::raise(SIGTERM);  // during iteration 4 (1-based)
    synthetic_batch(tok, lab, valid, i);
  };
  EXPECT_TRUE(train::train(m, opt, t, batches, nullptr).stopped_by_signal);
  EXPECT_EQ(io::checkpoint_list_committed(dir.string()), (std::vector<int64_t>{3, 4}));
  model::GptModel m2(moe_model(), t.micro_batch_size, 1, {}, testing::test_device());
  optim::AdamW opt2(m2.params(), optim::AdamWConfig{});
  EXPECT_EQ(train::load_training_checkpoint(*io::checkpoint_find_latest(dir.string()), m2, opt2, t.seed).iteration, 4);
  EXPECT_EQ(train::parameter_hash(m2), train::parameter_hash(m));
  fs::remove_all(dir);
}

// The write fault: this test commits iteration 2, then runs the child below in a process of its own with the fault
// injected into every optimizer.safetensors write (the hook reads its variable once per process). The child resumes and
// saves iteration 4 in the background; the worker's write fails; the run stops with the file, the offset and the
// errno; nothing of iteration 4 is left and iteration 2 stays the newest. Then the run resumes bit-identically.
TEST(AsyncSave, WriteFaultInTheWorkerStopsTheRunAndCommitsNothing) {
  const fs::path dir = fresh_dir("fault");
  const RunResult straight = run(train_config(8, false));
  train::TrainConfig t = train_config(8, true);
  t.exit_interval = 2;
  run(t, dir);
  ASSERT_EQ(io::checkpoint_read_tracker(dir.string()), 2);

  char self[4096] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
  const std::string cmd = std::string(io::kWriteFaultEnv) + "=optimizer.safetensors:100:ENOSPC " + kChildDirEnv + "=" +
                          dir.string() + " " + self + " --gtest_filter=AsyncSaveChild.ResumesWithAWriteFault 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) output.append(buf, n);
  const int status = ::pclose(p);
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;

  EXPECT_EQ(io::checkpoint_read_tracker(dir.string()), 2);
  EXPECT_EQ(io::checkpoint_find_latest(dir.string()), io::checkpoint_iteration_dir(dir.string(), 2));
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"iter_0000002", io::kCheckpointTrackerFile}));  // no staging
  const RunResult resumed = run(train_config(8, true), dir, dir);
  ASSERT_EQ(resumed.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[2 + i]) << i + 2;
  EXPECT_EQ(resumed.hash, straight.hash);
  fs::remove_all(dir);
}

// The child of the test above (skipped when run on its own).
TEST(AsyncSaveChild, ResumesWithAWriteFault) {
  const char* dir = std::getenv(kChildDirEnv);
  if (!dir) GTEST_SKIP() << "run by AsyncSave.WriteFaultInTheWorkerStopsTheRunAndCommitsNothing";
  ASSERT_TRUE(io::write_fault_injected().has_value());
  train::TrainConfig t = train_config(8, true);
  t.save_interval = 4;  // in the background at 4: the fault is met by the worker
  const std::string error = testing::error_of([&] { run(t, dir, dir); });
  std::printf("the child's error: %s\n", error.c_str());
  const std::string file = io::checkpoint_iteration_dir(dir, 4) + ".tmp-";
  EXPECT_NE(error.find(file), std::string::npos) << error;
  EXPECT_NE(error.find("/optimizer.safetensors"), std::string::npos) << error;
  EXPECT_NE(error.find("byte 100 "), std::string::npos) << error;
  EXPECT_NE(error.find(std::strerror(ENOSPC)), std::string::npos) << error;
  EXPECT_NE(error.find("the newest valid checkpoint is still iteration 2"), std::string::npos) << error;
}

}  // namespace
}  // namespace moecore
