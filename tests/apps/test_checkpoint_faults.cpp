// Hostile checkpoints and write faults through the `moecore` program (issue 15): a damaged newest checkpoint is
// refused with the file, the reason and the older ones listed, and `--ckpt-step` resumes an older one
// bit-identically; a save failing with ENOSPC/EIO (MOECORE_FAULT_INJECT_WRITE) stops the run with a nonzero exit
// naming the file, and the previous checkpoint stays the newest valid one. The same refusal under mpirun with EP 2.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "apps/cli_support.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;
const auto run = testing::run_moecore;

// iteration -> the raw text of its "lm_loss" and "grad_norm" values in a --metrics-jsonl file (bitwise compare).
std::map<int64_t, std::string> metrics_by_iteration(const std::string& path) {
  std::map<int64_t, std::string> out;
  std::ifstream in(path);
  std::string line;
  auto field = [&](const std::string& key) {
    const size_t k = line.find("\"" + key + "\":");
    if (k == std::string::npos) return std::string();
    const size_t b = k + key.size() + 3, e = line.find_first_of(",}", b);
    return line.substr(b, e - b);
  };
  while (std::getline(in, line)) {
    const std::string loss = field("lm_loss");
    if (!loss.empty()) out[std::stoll(field("iteration"))] = loss + " " + field("grad_norm");
  }
  return out;
}

void flip_last_byte(const std::string& path) {
  std::string bytes = io::read_file(path);
  bytes.back() ^= 0x01;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

class CheckpointFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::temp_directory_path() / ("moecore_ckfault_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    testing::write_byte_corpus(dir_, 200, "the quick brown fox jumps over the lazy dog");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  std::string train_args(int iters, const std::string& extra = "") const {
    return "train --data-path " + p("c_text_document") +
           " --tokenizer-type ByteLevel --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 "
           "--swiglu --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --micro-batch-size 2 "
           "--global-batch-size 4 --log-interval 1 --eval-iters 1 --generate-tokens 0 --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  fs::path dir_;
};

TEST_F(CheckpointFaults, CorruptNewestIsRefusedAndCkptStepResumesBitIdentically) {
  CmdResult r = run(train_args(6, "--metrics-jsonl " + p("straight.jsonl")));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto straight = metrics_by_iteration(p("straight.jsonl"));
  ASSERT_EQ(straight.size(), 6u) << r.output;

  r = run(train_args(6, "--save " + p("ck") + " --save-interval 2 --exit-interval 4"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string shard = io::checkpoint_iteration_dir(p("ck"), 4) + "/model.safetensors";
  flip_last_byte(shard);

  r = run(train_args(6, "--load " + p("ck") + " --save " + p("ck")));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(shard), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("iteration 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--ckpt-step 2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(" | lm loss "), std::string::npos) << "trained after a refused load:\n" << r.output;

  // A damaged COMMIT of the newest is refused the same way (never a silent fall back to iteration 2).
  const std::string commit = io::checkpoint_iteration_dir(p("ck"), 4) + "/COMMIT";
  const std::string good_commit = io::read_file(commit);
  std::ofstream(commit, std::ios::trunc) << good_commit.substr(0, good_commit.size() / 2);
  r = run(train_args(6, "--load " + p("ck")));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(commit), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--ckpt-step 2"), std::string::npos) << r.output;

  r = run(train_args(6, "--load " + p("ck") + " --ckpt-step 2 --save " + p("ck") +
                            " --save-interval 2 --metrics-jsonl " + p("resumed.jsonl")));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  const auto resumed = metrics_by_iteration(p("resumed.jsonl"));
  ASSERT_EQ(resumed.size(), 4u) << r.output;
  for (const auto& [it, text] : resumed) EXPECT_EQ(text, straight.at(it)) << "iteration " << it;
  // The resumed run's saves replaced the damaged iteration 4 and went on to 6.
  EXPECT_EQ(io::checkpoint_find_latest(p("ck")), io::checkpoint_iteration_dir(p("ck"), 6));
  EXPECT_NO_THROW(io::checkpoint_load(io::checkpoint_iteration_dir(p("ck"), 4)));
}

TEST_F(CheckpointFaults, LoadDirectoryWithoutAValidCheckpointIsAnError) {
  fs::create_directories(p("ck/iter_0000004"));  // an unfinished save only: not a fresh start
  std::ofstream(p("ck/iter_0000004/COMMIT.tmp.12")) << "{";
  const CmdResult r = run(train_args(2, "--load " + p("ck")));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("COMMIT.tmp.12"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("No other committed checkpoint"), std::string::npos) << r.output;
}

TEST_F(CheckpointFaults, EnospcDuringASaveStopsTheRunAndKeepsThePreviousCheckpoint) {
  CmdResult r = run(train_args(4, "--metrics-jsonl " + p("straight.jsonl")));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto straight = metrics_by_iteration(p("straight.jsonl"));
  r = run(train_args(4, "--save " + p("ck") + " --exit-interval 2"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string it2 = io::checkpoint_iteration_dir(p("ck"), 2), it4 = io::checkpoint_iteration_dir(p("ck"), 4);

  // A full disk while writing a data file, and EIO while writing COMMIT: both stop the run, name the file, the
  // offset and the errno, and leave iteration 2 the newest valid checkpoint with no trace of iteration 4.
  for (const std::string fault : {"model.safetensors:100:ENOSPC", "COMMIT:10:EIO"}) {
    r = testing::run_shell(std::string(io::kWriteFaultEnv) + "=" + fault + " " + MOECORE_BINARY + " " +
                           train_args(4, "--load " + p("ck") + " --save " + p("ck")));
    EXPECT_NE(r.status, 0) << fault << "\n" << r.output;
    const std::string file = fault.substr(0, fault.find(':'));
    EXPECT_NE(r.output.find(file), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(file == "COMMIT" ? "byte 10 " : "byte 100 "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(file == "COMMIT" ? "Input/output error" : "No space left on device"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("newest valid checkpoint is still iteration 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(" iteration      4/     4"), std::string::npos) << "the steps ran:\n" << r.output;
    EXPECT_FALSE(fs::exists(it4)) << fault;
    EXPECT_EQ(io::checkpoint_read_tracker(p("ck")), 2);
    EXPECT_EQ(io::checkpoint_find_latest(p("ck")), it2);
    EXPECT_NO_THROW(io::checkpoint_load(it2));
    for (const auto& de : fs::directory_iterator(p("ck")))  // no staging directory or temporary file left
      EXPECT_TRUE(de.path().filename() == "iter_0000002" || de.path().filename() == "latest_checkpointed_iteration.txt")
          << de.path();
  }

  // The resumed run continues bit-identically.
  r = run(train_args(4, "--load " + p("ck") + " --save " + p("ck") + " --metrics-jsonl " + p("resumed.jsonl")));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto resumed = metrics_by_iteration(p("resumed.jsonl"));
  ASSERT_EQ(resumed.size(), 2u) << r.output;
  for (const auto& [it, text] : resumed) EXPECT_EQ(text, straight.at(it)) << "iteration " << it;
  EXPECT_EQ(io::checkpoint_find_latest(p("ck")), it4);
}

TEST_F(CheckpointFaults, MalformedFaultSpecIsAnError) {
  const CmdResult r = testing::run_shell(std::string(io::kWriteFaultEnv) + "=model.safetensors:x:ENOSPC " +
                                         MOECORE_BINARY + " " + train_args(1, "--save " + p("ck")));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(io::kWriteFaultEnv), std::string::npos) << r.output;
}

// The refusal under mpirun with expert parallelism: every rank verifies the files, so every rank fails.
TEST_F(CheckpointFaults, CorruptNewestIsRefusedUnderMpirunWithExpertParallelism) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "built without MPI";
#else
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  auto mpirun = [&](const std::string& args) {
    return testing::run_shell("MOECORE_COMM_TIMEOUT_S=30 " + testing::mpirun_command(2) + std::string(MOECORE_BINARY) +
                              " " + args + " --expert-model-parallel-size 2");
  };
  CmdResult r = mpirun(train_args(6, "--save " + p("ck") + " --save-interval 2 --exit-interval 4"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string shard = io::checkpoint_iteration_dir(p("ck"), 4) + "/experts-ep001-of-002.safetensors";
  ASSERT_TRUE(fs::exists(shard)) << r.output;
  flip_last_byte(shard);
  r = mpirun(train_args(6, "--load " + p("ck")));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(shard), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--ckpt-step 2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  r = mpirun(train_args(6, "--load " + p("ck") + " --ckpt-step 2"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
#endif
}

// ENOSPC on one rank's expert shard during a multi-rank save (EP 2): the job fails naming the file, nothing of
// the failed iteration is committed, and the previous checkpoint stays the newest and loads.
TEST_F(CheckpointFaults, EnospcOnOneRankDuringAMultiRankSaveKeepsThePreviousCheckpoint) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "built without MPI";
#else
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  auto mpirun = [&](const std::string& env, const std::string& args) {
    return testing::run_shell("MOECORE_COMM_TIMEOUT_S=60 " + env + " timeout 300 env " + testing::mpirun_command(2) +
                              std::string(MOECORE_BINARY) + " " + args + " --expert-model-parallel-size 2");
  };
  CmdResult r = mpirun("", train_args(4, "--save " + p("ck") + " --exit-interval 2"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string shard = "experts-ep001-of-002.safetensors";  // written by rank 1
  r = mpirun(std::string(io::kWriteFaultEnv) + "=" + shard + ":100:ENOSPC",
             train_args(4, "--load " + p("ck") + " --save " + p("ck")));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(shard), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("No space left on device"), std::string::npos) << r.output;
  EXPECT_EQ(io::checkpoint_read_tracker(p("ck")), 2);
  EXPECT_FALSE(fs::exists(io::checkpoint_iteration_dir(p("ck"), 4)));
  EXPECT_EQ(io::checkpoint_find_latest(p("ck")), io::checkpoint_iteration_dir(p("ck"), 2));
  r = mpirun("", train_args(4, "--load " + p("ck") + " --save " + p("ck")));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  EXPECT_EQ(io::checkpoint_find_latest(p("ck")), io::checkpoint_iteration_dir(p("ck"), 4));
#endif
}

}  // namespace
}  // namespace moecore
