// System tests of the `moecore` program as a user runs it: preprocess -> train with checkpoints -> generate,
// resume after SIGTERM in a real child process, and bad flags failing with a clear message.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "apps/cli_support.h"
#include "moecore/core/backend_hooks.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/safetensors.h"
#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

using Result = testing::CmdResult;
using testing::run_shell;
const auto run = testing::run_moecore;

// `moecore ARGS` on np ranks, one OpenMP thread each (the ranks share the machine's cores). Unused without MPI.
[[maybe_unused]] Result run_mpi(int np, const std::string& args, const std::string& env = "") {
  return run_shell(env + " " + testing::mpirun_command(np) + std::string(MOECORE_BINARY) + " " + args);
}

// One field (e.g. "lm_loss") of every line of a --metrics-jsonl file that has it.
[[maybe_unused]] std::vector<double> jsonl_field(const std::string& path, const std::string& field) {
  std::vector<double> v;
  std::ifstream in(path);
  std::string line;
  const std::string key = "\"" + field + "\":";
  while (std::getline(in, line)) {
    const auto k = line.find(key);
    if (k != std::string::npos) v.push_back(std::stod(line.substr(k + key.size())));
  }
  return v;
}
[[maybe_unused]] std::vector<double> jsonl_losses(const std::string& path) {
  return jsonl_field(path, "lm_loss");
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moecore_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream f(dir_ / "corpus.jsonl");
    for (int i = 0; i < 400; ++i)
      f << "{\"text\": \"document " << i << ": the quick brown fox jumps over the lazy dog " << i % 7 << "\"}\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const char* name) const { return (dir_ / name).string(); }
  // `moecore <args>` (ending in --metrics-jsonl) on one process with `one_extra`, then on two ranks with each of
  // `layouts`: every two-rank run logs the single process's 5 losses within 1e-5 relative (summation orders differ),
  // and the share of step time blocked in communication on every logged step.
  void expect_two_ranks_match(const std::string& args, const std::string& one_extra,
                              const std::vector<std::string>& layouts) const {
    std::filesystem::remove(p("one.jsonl"));
    ASSERT_EQ(testing::run_moecore(args + p("one.jsonl") + one_extra).status, 0);
    const auto one = jsonl_losses(p("one.jsonl"));
    ASSERT_EQ(one.size(), 5u);
    for (const std::string& extra : layouts) {
      std::filesystem::remove(p("two.jsonl"));
      const Result r = run_mpi(2, args + p("two.jsonl") + extra);
      ASSERT_EQ(r.status, 0) << r.output;
      const auto two = jsonl_losses(p("two.jsonl"));
      ASSERT_EQ(two.size(), 5u) << extra << "\n" << r.output;
      for (size_t i = 0; i < one.size(); ++i)
        EXPECT_NEAR(two[i], one[i], 1e-5 * std::fabs(one[i])) << extra << " " << i;
      const auto share = jsonl_field(p("two.jsonl"), "comm/exposed_share");
      ASSERT_EQ(share.size(), 5u) << extra;
      for (double v : share) EXPECT_TRUE(v > 0.0 && v < 1.0) << extra << ": " << v;
      // The gradient reduction's part of it.
      const auto grads = jsonl_field(p("two.jsonl"), "comm/grad_reduce_share");
      ASSERT_EQ(grads.size(), 5u) << extra;
      for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(grads[i] >= 0.0 && grads[i] <= share[i]) << extra << ": " << grads[i];
      // MoE ECHO: the worst layer's max/mean received load per EP rank before and after the plan (not above it but
      // with the debug mode's random clones). A static received-token capacity: each interval's retried steps.
      if (extra.find("--moe-enable-echo") != std::string::npos) {
        const auto before = jsonl_field(p("two.jsonl"), "moe/echo_max_over_mean_before");
        const auto after = jsonl_field(p("two.jsonl"), "moe/echo_max_over_mean_after");
        ASSERT_EQ(before.size(), 5u) << extra;
        ASSERT_EQ(after.size(), 5u) << extra;
        for (size_t i = 0; i < 5; ++i) {
          EXPECT_GE(before[i], 1.0) << extra;
          if (extra.find("random") == std::string::npos) {
            EXPECT_LE(after[i], before[i]) << extra;
          }
        }
        EXPECT_EQ(jsonl_field(p("two.jsonl"), "moe/echo_clones").size(), 5u) << extra;
      }
      if (extra.find("--moe-received-token-capacity") != std::string::npos) {
        const auto retries = jsonl_field(p("two.jsonl"), "moe/capacity_retries");
        ASSERT_EQ(retries.size(), 5u) << extra;
        double sum = 0;
        for (double v : retries) {
          EXPECT_TRUE(v == 0.0 || v == 1.0) << extra << ": " << v;
          sum += v;
        }
        EXPECT_GT(sum, 0.0) << extra << ": at 1.0 x the average some step overflows";
      }
      // Under a pipeline: the share of time the stages waited for each other (averaged over them).
      const auto wait = jsonl_field(p("two.jsonl"), "comm/pipeline_wait_share");
      if (extra.find("--pipeline-model-parallel-size") == std::string::npos) {
        EXPECT_TRUE(wait.empty()) << extra;
        continue;
      }
      ASSERT_EQ(wait.size(), 5u) << extra;
      for (double v : wait) EXPECT_TRUE(v > 0.0 && v < 1.0) << extra << ": " << v;
    }
  }
  // The corpus as byte-level .bin/.idx under the prefix p("c") (data path p("c_text_document")).
  void preprocess_corpus() const {
    const Result r = run("preprocess --input " + p("corpus.jsonl") + " --output-prefix " + p("c") +
                         " --tokenizer-type ByteLevel --append-eod");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  std::string train_args(int iters) const {
    return "train --data-path " + p("c_text_document") +
           " --tokenizer-type ByteLevel --num-layers 2 --hidden-size 32 "
           "--num-attention-heads 2 --seq-length 32 --swiglu --num-experts 4 --moe-router-topk 2 "
           "--moe-aux-loss-coeff 1e-2 --micro-batch-size 2 --global-batch-size 4 --log-interval 5 --eval-interval 5 "
           "--eval-iters 2 --generate-tokens 0 --save " +
           p("ckpt") + " --train-iters " + std::to_string(iters);
  }
  fs::path dir_;
};

TEST_F(Cli, PreprocessTrainResumeGenerate) {
  Result r = run("preprocess --input " + p("corpus.jsonl") + " --output-prefix " + p("c") +
                 " --tokenizer-type ByteLevel --append-eod --workers 2");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run(train_args(10) + " --exit-interval 5");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("saved checkpoint at iteration 5"), std::string::npos) << r.output;
  r = run(train_args(10) + " --load " + p("ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("iteration     10/    10"), std::string::npos) << r.output;
  r = run("generate --load " + p("ckpt") +
          " --tokenizer-type ByteLevel --num-layers 2 --hidden-size 32 "
          "--num-attention-heads 2 --seq-length 32 --swiglu --num-experts 4 --moe-router-topk 2 --prompt doc "
          "--max-new-tokens 8");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("doc", 0), 0u) << r.output;
}

TEST_F(Cli, SigtermLeavesALoadableCheckpoint) {
  preprocess_corpus();
  if (HasFatalFailure()) return;
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd =
        std::string(MOECORE_BINARY) + " " + train_args(100000) + " --exit-signal-handler > " + p("log.txt") + " 2>&1";
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait until training is under way (the handler is installed before the first log line), then ask it to stop. A
  // loaded machine may take long to get there: up to 5 minutes, and a signal sent earlier would only kill the run.
  bool started = false;
  for (int i = 0; i < 3000 && !started; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream f(p("log.txt"));
    std::string s((std::istreambuf_iterator<char>(f)), {});
    started = s.find("iteration") != std::string::npos;
  }
  EXPECT_TRUE(started) << "no iteration line within 5 minutes";
  kill(pid, SIGTERM);
  int st = 0;
  waitpid(pid, &st, 0);
  std::ifstream f(p("log.txt"));
  const std::string log((std::istreambuf_iterator<char>(f)), {});
  ASSERT_TRUE(WIFEXITED(st)) << log;
  EXPECT_EQ(WEXITSTATUS(st), 0) << log;
  EXPECT_NE(log.find("received signal"), std::string::npos) << log;
  const auto latest = io::checkpoint_find_latest(p("ckpt"));
  ASSERT_TRUE(latest.has_value());
  EXPECT_NO_THROW(io::checkpoint_load(*latest));
}

TEST_F(Cli, UpcyclesADenseCheckpointIntoAnMoe) {
  preprocess_corpus();
  if (HasFatalFailure()) return;
  const std::string model =
      " --data-path " + p("c_text_document") +
      " --tokenizer-type ByteLevel --num-layers 2 "
      "--hidden-size 32 --num-attention-heads 2 --seq-length 32 --swiglu --ffn-hidden-size 64 --disable-bias-linear "
      "--micro-batch-size 2 --global-batch-size 2 --log-interval 2 --eval-iters 1 "
      "--generate-tokens 0 --train-iters 2";
  Result r = run("train" + model + " --save " + p("dense"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("train" + model +
          " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-use-upcycling "
          "--moe-upcycling-granularity 2 --load " +
          p("dense") + " --save " + p("moe"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("upcycled the dense checkpoint"), std::string::npos) << r.output;
  r = run("train" + model +
          " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-use-upcycling "
          "--moe-upcycling-granularity 3 --load " +
          p("dense"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--moe-upcycling-granularity (3)"), std::string::npos) << r.output;
}

// `moecore moe-layer` on one golden case: the documented command reproduces the reference output.
TEST_F(Cli, MoeLayerCommandReproducesAGoldenCase) {
  const io::SafetensorsFile g =
      io::safetensors_load(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/moe_shared_gate.safetensors");
  std::map<std::string, Tensor> inputs;
  for (const auto& [name, t] : g.tensors)
    if (name.rfind("input.", 0) == 0 || name.rfind("param.", 0) == 0) inputs[name] = t;
  io::safetensors_save(p("in.safetensors"), inputs);
  std::ofstream(p("layer.json")) << g.metadata.at("config");
  const Result r = run("moe-layer --config " + p("layer.json") + " --inputs " + p("in.safetensors") + " --out " +
                       p("out.safetensors"));
  ASSERT_EQ(r.status, 0) << r.output;
  const io::SafetensorsFile out = io::safetensors_load(p("out.safetensors"));
  for (const char* name : {"out.output", "grad.input.hidden", "grad.param.shared_experts.gate_weight"}) {
    ASSERT_TRUE(out.tensors.count(name)) << name;
    EXPECT_LE(testing::tolerance_ratio(out.tensors.at(name), g.tensors.at(name), 1e-3, 1e-5), 1.0) << name;
  }
  EXPECT_EQ(out.tensors.at("routing.map").nbytes(), g.tensors.at("routing.map").nbytes());
}

// Bad parallel layouts fail on every rank, before any collective (so quickly, without a timeout), with a
// message naming the values.
TEST_F(Cli, BadParallelLayoutsFailOnEveryRank) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "built without MPI";
#else
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  preprocess_corpus();
  if (HasFatalFailure()) return;
  // Megatron's defaults (LayerNorm, learned positions, linear biases in every layer and expert, dropout 0.1):
  // the counter-based dropout masks make each layout draw the single-process masks.
  const std::string args = " train --data-path " + p("c_text_document") +
                           " --tokenizer-type ByteLevel "
                           "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                           "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --generate-tokens 0 ";
  auto mpirun = [&](int np, const std::string& extra) {
    const Result r = run_mpi(np, args.substr(1) + extra, "MOECORE_COMM_TIMEOUT_S=30");
    return std::make_pair(r.status, r.output);
  };
  auto count = [](const std::string& s, const std::string& what) {
    size_t n = 0;
    for (size_t k = s.find(what); k != std::string::npos; k = s.find(what, k + 1)) ++n;
    return n;
  };
  auto [st1, out1] = mpirun(2, "--num-experts 3 --expert-model-parallel-size 2");
  EXPECT_NE(st1, 0);
  EXPECT_EQ(count(out1, "num_experts (3) must be divisible by expert_model_parallel_size (2)"), 2u) << out1;
  auto [st2, out2] = mpirun(3, "--num-experts 4 --expert-model-parallel-size 2");
  EXPECT_NE(st2, 0);
  EXPECT_EQ(count(out2, "world_size (3) must be divisible by"), 3u) << out2;
  auto [st3, out3] = mpirun(2, "--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type ring");
  EXPECT_NE(st3, 0);
  EXPECT_EQ(count(out3, "--moe-token-dispatcher-type': 'ring' is not one of allgather, alltoall"), 2u) << out3;
  auto [st4, out4] = mpirun(2, "--tensor-model-parallel-size 2 --num-experts 4");
  EXPECT_NE(st4, 0);
  EXPECT_EQ(count(out4, "MoE layers (--num-experts) with --tensor-model-parallel-size 2 need --sequence-parallel"), 2u)
      << out4;
  auto [st5, out5] = mpirun(3, "--tensor-model-parallel-size 2");
  EXPECT_NE(st5, 0);
  EXPECT_EQ(count(out5, "world_size (3) must be divisible by"), 3u) << out5;
  auto [st6, out6] = mpirun(2, "--context-parallel-size 4");
  EXPECT_NE(st6, 0);
  EXPECT_EQ(
      count(out6, "world_size (2) must be divisible by tensor_model_parallel_size (1) x context_parallel_size (4)"), 2u)
      << out6;
  // ETP defaults to TP (Megatron): TP 2 with EP 2 needs 4 ranks; a slice of the expert ffn per ETP rank.
  auto [st7, out7] = mpirun(2,
                            "--tensor-model-parallel-size 2 --sequence-parallel --num-experts 4 "
                            "--expert-model-parallel-size 2");
  EXPECT_NE(st7, 0);
  EXPECT_EQ(count(out7,
                  "expert_tensor_parallel_size (2, from tensor_model_parallel_size) x "
                  "expert_model_parallel_size (2)"),
            2u)
      << out7;
  auto [st9, out9] = mpirun(2, "--pipeline-model-parallel-size 2");  // (one layer)
  EXPECT_NE(st9, 0);
  EXPECT_EQ(count(out9, "--num-layers (1) must be divisible by --pipeline-model-parallel-size (2)"), 2u) << out9;
  // Virtual pipelines: without PP, a layout whose stages are not a multiple of PP, a micro-batch group without a
  // virtual pipeline or out of Megatron's range [PP, micro-batches per rank].
  const std::vector<std::pair<std::string, std::string> > vpp = {
      {"--num-virtual-stages-per-pipeline-rank 2", "needs --pipeline-model-parallel-size > 1"},
      {"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'E|t|L'",
       "3 stages for --pipeline-model-parallel-size 2"},
      {"--microbatch-group-size-per-virtual-pipeline-stage 2", "needs a virtual pipeline"},
      {"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'E|t||L' "
       "--microbatch-group-size-per-virtual-pipeline-stage 3",
       "(--microbatch-group-size-per-virtual-pipeline-stage, default the pipeline size: 3) must lie in [pipeline size "
       "2, micro-batches per data-parallel rank 2]"}};
  // MoE ECHO: slots not a multiple of EP, ECHO without EP > 1 or with the allgather dispatcher, a received-token
  // capacity below the average without ECHO or not positive, ECHO without slots, the GPU-only weight dispatcher.
  const std::string ep2 = "--num-experts 4 --expert-model-parallel-size 2 ";
  const std::vector<std::pair<std::string, std::string> > echo = {
      {ep2 + "--moe-token-dispatcher-type alltoall --moe-enable-echo --moe-num-echo-experts 3",
       "--moe-num-echo-experts (3) must be divisible by --expert-model-parallel-size (2)"},
      {"--num-experts 4 --moe-enable-echo --moe-num-echo-experts 2", "needs --expert-model-parallel-size > 1, got 1"},
      {ep2 + "--moe-enable-echo --moe-num-echo-experts 2", "needs --moe-token-dispatcher-type alltoall, got allgather"},
      {"--num-experts 4 --moe-received-token-capacity 0.5",
       "--moe-received-token-capacity / --moe-expert-rank-capacity-factor (0.5) must be > 0, and >= 1 without "
       "--moe-enable-echo"},
      {"--num-experts 4 --moe-expert-rank-capacity-factor 0", "--moe-expert-rank-capacity-factor"},
      {"--num-experts 4 --moe-enable-echo", "--moe-enable-echo needs --moe-num-echo-experts"},
      {"--num-experts 4 --moe-received-token-capacity 1.5", "it needs --expert-model-parallel-size > 1"},
      {ep2 + "--moe-token-dispatcher-type alltoall --moe-enable-echo --moe-num-echo-experts 2 "
             "--moe-echo-expert-dispatcher-type hybridep",
       "hybridep: Megatron's device-side (sync-free) dispatcher needs the GPU backend"}};
  for (const auto& [flags, error] : echo) {
    auto [st, out] = mpirun(2, flags);
    EXPECT_NE(st, 0) << flags;
    EXPECT_EQ(count(out, error), 2u) << flags << "\n" << out;
  }
  for (const auto& [flags, error] : vpp) {
    auto [st, out] = mpirun(2, flags);
    EXPECT_NE(st, 0) << flags;
    EXPECT_EQ(count(out, error), 2u) << flags << "\n" << out;
  }
  auto [st8, out8] = mpirun(2, "--num-experts 4 --ffn-hidden-size 33 --expert-tensor-parallel-size 2");
  EXPECT_NE(st8, 0);
  EXPECT_EQ(count(out8,
                  "(--moe-ffn-hidden-size, else --ffn-hidden-size: 33) must be divisible by "
                  "--expert-tensor-parallel-size (2)"),
            2u)
      << out8;
#endif
}

// Tensor, context and pipeline parallelism from Megatron's flags: two ranks with --tensor-model-parallel-size 2, with
// and without --sequence-parallel (an MoE model with it, also with --expert-model-parallel-size 2, and the experts
// split by --expert-tensor-parallel-size), and with
// --context-parallel-size 2 (each rank holding two chunks of every sequence; the MoE model also with EP 2) reproduce
// the single-process run, and so does --pipeline-model-parallel-size 2 (a layer per stage; and interleaved, by a layout
// of four virtual stages) (Megatron's defaults but
// dropout 0: under TP and CP the masks are drawn per rank). The
// vocabulary is padded to 128 x TP, as Megatron: the single-process and CP runs pad to the same 256.
TEST_F(Cli, TensorAndContextParallelMatchOneProcess) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "built without MPI";
#else
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  preprocess_corpus();
  if (HasFatalFailure()) return;
  const std::string args = "train --data-path " + p("c_text_document") +
                           " --tokenizer-type ByteLevel "
                           "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
                           "--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 4 "
                           "--train-iters 5 --log-interval 1 --eval-iters 1 --generate-tokens 0 --metrics-jsonl ";
  // A dense model under TP, TP + SP and CP; an MoE model (which needs SP under TP) under TP + SP (the experts split
  // over ETP = TP by default, as Megatron), with the experts whole over EP 2 (ETP 1), split over ETP 2 under data
  // parallelism, and under CP, alone and with EP 2.
  const std::string moe = " --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3";
  const std::string cp = " --context-parallel-size 2 --make-vocab-size-divisible-by 256";
  const std::vector<std::pair<std::string, std::vector<std::string> > > cases = {
      {"",
       {" --tensor-model-parallel-size 2", " --tensor-model-parallel-size 2 --sequence-parallel", cp,
        " --pipeline-model-parallel-size 2 --make-vocab-size-divisible-by 256",
        // interleaved: chunk 0 of stage 0 holds the embedding alone, chunk 1 of stage 1 the loss alone
        " --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'E|t|t|L' --make-vocab-size-divisible-by "
        "256",
        // the same split from Megatron's flags: two chunks per stage, the embedding and the loss counted as layers
        " --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --make-vocab-size-divisible-by "
        "256"}},
      {moe,
       {" --tensor-model-parallel-size 2 --sequence-parallel",
        " --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
        "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall",
        " --expert-tensor-parallel-size 2 --moe-token-dispatcher-type allgather --make-vocab-size-divisible-by 256", cp,
        cp + " --expert-model-parallel-size 2",
        " --pipeline-model-parallel-size 2 --make-vocab-size-divisible-by 256"}}};
  for (const auto& [model, layouts] : cases) {
    std::vector<std::string> flags;
    for (const std::string& l : layouts) flags.push_back(model + l);
    expect_two_ranks_match(args, model + " --make-vocab-size-divisible-by 256", flags);
  }
#endif
}

// gpt-oss's attention (Megatron's --softmax-type, --window-size, --window-attn-skip-freq): a dense and an MoE model
// train with learnable sinks and a window of 3 on every other layer (and with off-by-one), TP 2, TP 2 + SP and CP 2
// reproduce the single-process run (each CP chunk is one exact softmax: the sink counts once), a checkpoint resumes
// with its sinks (and refuses another softmax type), and bad values fail naming the flag.
TEST_F(Cli, AttentionSinksAndWindowTrainAndMatchOneProcess) {
  preprocess_corpus();
  if (HasFatalFailure()) return;
  const std::string base = "train --data-path " + p("c_text_document") +
                           " --tokenizer-type ByteLevel "
                           "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
                           "--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 4 "
                           "--log-interval 1 --eval-iters 1 --generate-tokens 0 --make-vocab-size-divisible-by 256 ";
  const std::string sinks = " --softmax-type learnable --window-size '(3, 0)' --window-attn-skip-freq 2";
  Result r = run(base + "--train-iters 5 --metrics-jsonl " + p("vanilla.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run(base + "--train-iters 5 --metrics-jsonl " + p("sinks.jsonl") + sinks);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(jsonl_losses(p("sinks.jsonl")), jsonl_losses(p("vanilla.jsonl")));  // the flags change the model
  EXPECT_NE(r.output.find("softmax learnable, window 3 skip-freq 2"), std::string::npos) << r.output;
  // Checkpoint: the sinks are saved and loaded; a resume with another softmax type is refused by name.
  r = run(base + "--train-iters 4 --save " + p("sink_ckpt") + " --save-interval 2 --exit-interval 2" + sinks);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run(base + "--train-iters 4 --load " + p("sink_ckpt") + sinks);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  r = run(base + "--train-iters 4 --load " + p("sink_ckpt") + " --softmax-type off-by-one --window-size '(3,0)'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("softmax_type"), std::string::npos) << r.output;
  // Bad values.
  const std::pair<std::string, std::string> bad[] = {
      {" --window-size '(5,3)'", "--window-size ((5,3)): right (3) must be 0"},
      {" --window-size 5", "--window-size (5) must be a pair"},
      {" --window-size '(3,0)' --window-attn-skip-freq 0", "--window-attn-skip-freq (0) must be a positive integer"},
      {" --window-size '(3,0)' --window-attn-skip-freq '[1]*3'", "--window-attn-skip-freq"},
      {" --softmax-type foo", "'--softmax-type': 'foo' is not one of vanilla, off-by-one, learnable"},
      {" --softmax-type learnable --multi-latent-attention --position-embedding-type rope",
       "--softmax-type (learnable) and --window-size (-1) need standard attention"},
      {" --window-size '(3,0)' --multi-latent-attention --position-embedding-type rope",
       "Megatron asserts window_size None for MLA"}};
  for (const auto& [flags, error] : bad) {
    r = run(base + "--train-iters 1" + flags);
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.output.find(error), std::string::npos) << flags << "\n" << r.output;
  }
#ifdef MOECORE_HAVE_MPI
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  const std::string args = base + "--train-iters 5 --metrics-jsonl ";
  const std::string layouts[] = {" --tensor-model-parallel-size 2",
                                 " --tensor-model-parallel-size 2 --sequence-parallel", " --context-parallel-size 2"};
  const std::string moe = " --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2";
  for (const std::string& model :
       std::vector<std::string>{sinks, " --softmax-type off-by-one --window-size '(3,0)'", sinks + moe}) {
    std::vector<std::string> flags;
    for (const std::string& l : layouts)
      if (model.find("--num-experts") == std::string::npos || l != layouts[0]) flags.push_back(model + l);
    expect_two_ranks_match(args, model, flags);
  }
#endif
}

// Two ranks under mpirun reproduce the single-process run (same global batch): data parallel, EP 2 with both
// dispatchers, and EP 2 with the distributed optimizer. Summation orders differ, so losses agree to 1e-5
// relative, not bitwise.
TEST_F(Cli, TwoRanksMatchOneProcess) {
#ifndef MOECORE_HAVE_MPI
  GTEST_SKIP() << "built without MPI";
#else
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  preprocess_corpus();
  if (HasFatalFailure()) return;
  // Megatron's defaults (LayerNorm, learned positions, linear biases in every layer and expert, dropout 0.1):
  // the counter-based dropout masks make each layout draw the single-process masks.
  const std::string args = " train --data-path " + p("c_text_document") +
                           " --tokenizer-type ByteLevel "
                           "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --swiglu "
                           "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --micro-batch-size 2 "
                           "--global-batch-size 8 --train-iters 5 --log-interval 1 --eval-iters 1 "
                           "--generate-tokens 0 --metrics-jsonl ";
  expect_two_ranks_match(args.substr(1), "",
                         {"",  // data parallel
                          " --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
                          " --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather",
                          " --expert-model-parallel-size 2 --use-distributed-optimizer",
                          // MoE ECHO: the planner's clones, and random clones fetched again in backward
                          " --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-enable-echo "
                          "--moe-num-echo-experts 2",
                          " --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-enable-echo "
                          "--moe-num-echo-experts 4 --moe-echo-enable-random-offloading "
                          "--moe-echo-recompute-expert-dispatch",
                          // a static received-token capacity every step overflows: each runs again, synced
                          " --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                          "--moe-received-token-capacity 1.0"});
#endif
}

// The simulated device (host memory that only ops, collectives and explicit transfers may touch) trains exactly
// like the CPU: Megatron's defaults (LayerNorm, learned positions, biases, dropout) with MoE, MTP, a checkpoint
// and its resume, and (with MPI) expert parallelism with the distributed optimizer. Bit-for-bit: the same kernels
// run on the same memory, so any difference is host code reading or writing device data behind the ops' back.
TEST_F(Cli, SimulatedDeviceTrainsBitForBitLikeTheCpu) {
  preprocess_corpus();
  if (HasFatalFailure()) return;
  const std::string args = "train --data-path " + p("c_text_document") +
                           " --tokenizer-type ByteLevel "
                           "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --swiglu "
                           "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
                           "--micro-batch-size 2 --global-batch-size 4 --train-iters 6 "
                           "--log-interval 1 --eval-interval 3 --eval-iters 1 --generate-tokens 4 --metrics-jsonl ";
  // Megatron's defaults (learned positions), then RoPE with a multi-token-prediction depth.
  for (const std::string variant : {"", " --position-embedding-type rope --mtp-num-layers 1"}) {
    SCOPED_TRACE(variant);
    for (const char* device : {"cpu", "sim"}) {
      const std::string dev = device, jsonl = p(("a_" + dev + ".jsonl").c_str()), ck = p(("ck_" + dev).c_str());
      std::filesystem::remove(jsonl);
      std::filesystem::remove_all(ck);
      Result r = run(args + jsonl + variant + " --device " + dev + " --save " + ck + " --exit-interval 3");
      ASSERT_EQ(r.status, 0) << r.output;
      r = run(args + jsonl + variant + " --device " + dev + " --load " + ck);
      ASSERT_EQ(r.status, 0) << r.output;
    }
    for (const char* field : {"lm_loss", "grad_norm", "load_balancing_loss", "z_loss"}) {
      const auto cpu = jsonl_field(p("a_cpu.jsonl"), field), sim = jsonl_field(p("a_sim.jsonl"), field);
      EXPECT_EQ(cpu.size(), 6u) << field;
      EXPECT_EQ(sim, cpu) << field;
    }
  }
#ifdef MOECORE_HAVE_MPI
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) return;
  const std::string ep = " --expert-model-parallel-size 2 --use-distributed-optimizer --exit-interval 3 --save ";
  for (const char* device : {"cpu", "sim"}) {
    const std::string dev = device;
    const Result r =
        run_mpi(2, args + p(("e_" + dev + ".jsonl").c_str()) + " --device " + dev + ep + p(("ep_" + dev).c_str()));
    ASSERT_EQ(r.status, 0) << r.output;
  }
  for (const char* field : {"lm_loss", "grad_norm"}) {
    const auto cpu = jsonl_field(p("e_cpu.jsonl"), field), sim = jsonl_field(p("e_sim.jsonl"), field);
    EXPECT_EQ(cpu.size(), 3u) << field;
    EXPECT_EQ(sim, cpu) << field;
  }
#endif
}

// --device cuda on a build or a machine without what it needs fails at start-up, naming the reason.
// Without a visible GPU (or in a build without the CUDA kernels) --device cuda fails before anything else.
TEST_F(Cli, DeviceCudaWithoutItsKernelsFailsAtStartUp) {
  if (device_available() && ops::cuda_kernels_built()) GTEST_SKIP() << "this machine can run --device cuda";
  const Result r = run("train --data-path " + p("none") + " --tokenizer-type ByteLevel --device cuda");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--device cuda"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("use --device cpu"), std::string::npos) << r.output;
}

TEST_F(Cli, BadFlagsFailWithAClearMessage) {
  Result r = run("train --num-expert 4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("did you mean '--num-experts'"), std::string::npos) << r.output;
  r = run("train --data-path x --tokenizer-type ByteLevel --num-experts 6 --moe-router-topk 8");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--moe-router-topk (8)"), std::string::npos) << r.output;
}

// `moecore bench train-step` builds its model from the model flags (GPT-2 small's sizes by default, Megatron's
// defaults for the rest) and reports against the GEMM peak of the same run.
TEST_F(Cli, BenchTrainStepRunsWithMegatronsDefaults) {
  const Result r =
      run("bench train-step --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
          "--steps 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("LayerNorm, learned positions, biases, dropout 0.1/0.1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"ratio\":"), std::string::npos) << r.output;
}

// ---- moecore bench --device: the GPU benchmarks' path, proven on the simulated device ----------------------------
// On sim each bench runs the same code as on cuda (tensors on the device, ops with its context, the peaks measured in
// the same run), timed by a wall clock instead of CUDA events. The tests check the lines and their fields, never a
// speed.

// The JSON object lines of a command's output, in order.
std::vector<std::string> bench_json_lines(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("{\"", 0) == 0) lines.push_back(line);
  return lines;
}

// The raw value of "key" in one JSON line ("" when absent): a number, null, or a string without its quotes.
std::string bench_field(const std::string& line, const std::string& key) {
  const std::string k = "\"" + key + "\":";
  const size_t at = line.find(k);
  if (at == std::string::npos) return "";
  const size_t start = at + k.size();
  if (line[start] == '"') return line.substr(start + 1, line.find('"', start + 1) - start - 1);
  return line.substr(start, line.find_first_of(",}", start) - start);
}

// A field that must be a positive finite number (not null, inf or text).
double bench_positive(const std::string& line, const std::string& key) {
  const std::string v = bench_field(line, key);
  double x = 0;
  EXPECT_TRUE(!v.empty() && std::isdigit(static_cast<unsigned char>(v[0])) && (x = std::stod(v)) > 0 &&
              std::isfinite(x))
      << key << " = '" << v << "' in " << line;
  return x;
}

// Tiny shapes and peaks, so each bench's device path runs in a moment on 2 cores.
const std::string kBenchSim = " --device sim --warmup 1 --peak-gemm-size 32 --peak-copy-mib 1";

TEST_F(Cli, BenchDeviceSimRunsEveryBenchAgainstItsInRunPeaks) {
  struct Case {
    std::string args;
    std::vector<std::string> names;  // the lines after device_peaks
    bool bytes;                      // the lines count bytes (gbps against the copy peak)
  };
  const std::string moe = " --tokens 16 --hidden-size 16 --moe-ffn-hidden-size 8 --num-experts 4 --moe-router-topk 2";
  const std::vector<Case> cases = {
      {"gemm --iters 3 --shapes 24x40x16,8x8x8", {"gemm", "gemm", "gemm", "gemm"}, true},
      {"experts --iters 3" + moe, {"experts"}, true},
      {"experts --iters 3 --bf16" + moe, {"experts"}, true},
      {"attention --iters 3 --seq-length 16 --num-attention-heads 2 --num-query-groups 1 --kv-channels 8",
       {"attention_fwd", "attention_bwd", "attention_fwd_bwd"},
       true},
      {"moe-layer --iters 3" + moe, {"moe_layer_fwd", "moe_layer_fwd_bwd"}, true},
      {"train-step --steps 3 --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16",
       {"train_step"},
       false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const Result r = run("bench " + c.args + kBenchSim);
    ASSERT_EQ(r.status, 0) << r.output;
    const auto lines = bench_json_lines(r.output);
    ASSERT_EQ(lines.size(), c.names.size() + 1) << r.output;
    const std::string& peaks = lines[0];
    EXPECT_EQ(bench_field(peaks, "name"), "device_peaks") << peaks;
    EXPECT_EQ(bench_field(peaks, "device"), "sim") << peaks;
    EXPECT_EQ(bench_field(peaks, "timer"), "wall_clock") << peaks;
    EXPECT_EQ(bench_field(peaks, "peak_gemm_mnk"), "32") << peaks;
    EXPECT_EQ(bench_field(peaks, "peak_dtype"), "bf16") << peaks;
    EXPECT_EQ(bench_field(peaks, "peak_copy_bytes"), "1048576") << peaks;
    bench_positive(peaks, "peak_gemm_ms");
    bench_positive(peaks, "peak_copy_ms");
    const double peak_tflops = bench_positive(peaks, "peak_tflops"), peak_gbps = bench_positive(peaks, "peak_gbps");
    for (size_t i = 0; i < c.names.size(); ++i) {
      const std::string& l = lines[i + 1];
      EXPECT_EQ(bench_field(l, "name"), c.names[i]) << l;
      EXPECT_EQ(bench_field(l, "device"), "sim") << l;
      EXPECT_EQ(bench_field(l, "timer"), "wall_clock") << l;
      EXPECT_EQ(bench_field(l, "iters"), "3") << l;
      bench_positive(l, "median_ms");
      const double tflops = bench_positive(l, "tflops");
      // The same peaks as the device_peaks line (printed with 4 significant digits), and the ratios to them.
      EXPECT_NEAR(bench_positive(l, "peak_tflops"), peak_tflops, 1e-3 * peak_tflops) << l;
      EXPECT_NEAR(bench_positive(l, "ratio"), tflops / peak_tflops, 2e-3 * tflops / peak_tflops) << l;
      if (c.bytes) {
        bench_positive(l, "bytes");
        const double gbps = bench_positive(l, "gbps");
        EXPECT_NEAR(bench_positive(l, "peak_gbps"), peak_gbps, 1e-3 * peak_gbps) << l;
        EXPECT_NEAR(bench_positive(l, "gbps_ratio"), gbps / peak_gbps, 2e-3 * gbps / peak_gbps) << l;
      } else {
        EXPECT_EQ(bench_field(l, "gbps"), "") << l;
      }
    }
    if (c.names[0] == "gemm") {  // f32 then bf16, each over the given shapes, into f32
      EXPECT_EQ(bench_field(lines[1], "dtype"), "f32");
      EXPECT_EQ(bench_field(lines[4], "dtype"), "bf16");
      EXPECT_EQ(bench_field(lines[2], "M") + bench_field(lines[2], "N") + bench_field(lines[2], "K"), "888");
      EXPECT_EQ(bench_field(lines[1], "bytes"), std::to_string((24 * 16 + 40 * 16) * 4 + 24 * 40 * 4));
    }
    if (c.names[0] == "train_step") {  // a real step ran on the device: a finite loss near ln(vocab)
      EXPECT_GT(bench_positive(lines[1], "loss"), 1.0) << lines[1];
      EXPECT_NE(r.output.find("on sim"), std::string::npos) << r.output;
    }
    if (c.names[0] == "experts") {
      EXPECT_EQ(bench_field(lines[1], "dtype"), c.args.find("--bf16") == std::string::npos ? "f32" : "bf16");
      EXPECT_EQ(bench_field(lines[1], "rows"), "32");
      bench_positive(lines[1], "fwd_ms");
      bench_positive(lines[1], "bwd_ms");
    }
  }
}

// --device cuda without a GPU (this machine) or without the CUDA kernels fails at start-up, before any work, naming
// what is missing and where it was looked for; the check is train's (apps/device_flag.h).
TEST_F(Cli, BenchDeviceCudaWithoutAGpuFailsAtStartUpNamingWhatIsMissing) {
  if (device_available() && ops::cuda_kernels_built()) GTEST_SKIP() << "this machine can run --device cuda";
  for (const char* what : {"gemm", "experts", "attention", "moe-layer", "train-step"}) {
    SCOPED_TRACE(what);
    const Result r = run(std::string("bench ") + what + " --device cuda");
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("moecore bench: error: --device cuda: "), std::string::npos) << r.output;
    if (ops::cuda_kernels_built()) {
      EXPECT_NE(r.output.find("no CUDA device is visible to this process: "), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("cudaGetDeviceCount"), std::string::npos) << r.output;
    } else {
      EXPECT_NE(r.output.find("this build has no CUDA kernels (configure with -DMOECORE_CUDA=ON"), std::string::npos)
          << r.output;
    }
    EXPECT_NE(r.output.find("use --device cpu"), std::string::npos) << r.output;
    EXPECT_TRUE(bench_json_lines(r.output).empty()) << r.output;             // nothing measured
    EXPECT_EQ(r.output.find("train-step:"), std::string::npos) << r.output;  // no model built
  }
}

// The bench's device flags are checked at start-up: a device-only flag on the CPU path is refused, not ignored; a
// bad --shapes or --device names the flag.
TEST_F(Cli, BenchDeviceFlagsAreCheckedAtStartUp) {
  const std::vector<std::pair<std::string, std::string> > cases = {
      {"gemm --warmup 2", "bench gemm: --warmup applies to --device cuda | sim only"},
      {"gemm --iters 5", "bench gemm: --iters applies to --device cuda | sim only"},
      {"experts --peak-gemm-size 64", "bench experts: --peak-gemm-size applies to --device cuda | sim only"},
      {"moe-layer --peak-copy-mib 4", "bench moe-layer: --peak-copy-mib applies to --device cuda | sim only"},
      {"gemm --shapes 8x8 --device sim", "--shapes '8x8': item '8x8' is not MxNxK"},
      {"gemm --shapes 8x8x8,,4x4x4 --device sim", "item '' is not MxNxK"},
      {"attention --device gpu", "flag '--device': 'gpu' is not one of cpu, cuda, sim"},
      {"train-step --device sim --steps 0", "flag '--steps': '0' is not an integer in [1, "},
  };
  for (const auto& [args, message] : cases) {
    const Result r = run("bench " + args);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << ": " << r.output;
    EXPECT_TRUE(bench_json_lines(r.output).empty()) << args << ": " << r.output;
  }
}

}  // namespace
}  // namespace moecore
