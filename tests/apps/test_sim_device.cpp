// The simulated device against the CPU, path by path, run as a user runs moecore: each row trains on --device cpu and
// on --device sim and every logged number (losses, gradient norm, MoE statistics, validation loss) and the generated
// sample must be bit for bit the same. The sim device runs the CPU kernels on memory that host code may not address
// (core/tensor.cpp states the rule, the same as cuda's), so a row that fails on sim names a host access that would
// fail on a GPU; a row that differs names host code computing behind the ops' back.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "apps/cli_support.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;

// Every "key": number pair of every line of a --metrics-jsonl file, but timings (throughput, communication shares),
// in file order: ["iteration=1 lm_loss=... ...", ...].
std::vector<std::string> metric_lines(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::string kept;
    size_t k = 0;
    while ((k = line.find('"', k)) != std::string::npos) {
      const size_t end = line.find('"', k + 1);
      const std::string key = line.substr(k + 1, end - k - 1);
      const size_t v0 = line.find(':', end) + 1;
      size_t v1 = line.find_first_of(",}", v0);
      const std::string value = line.substr(v0, v1 - v0);
      const bool timing = key.find("tokens_per_s") != std::string::npos || key.find("tflops") != std::string::npos ||
                          key.find("share") != std::string::npos;
      if (!timing) kept += key + "=" + value + " ";
      k = v1;
    }
    lines.push_back(kept);
  }
  return lines;
}

// The generated sample a run prints after training ("---- sample ----" to the closing rule), or "" without one.
std::string sample_of(const std::string& output) {
  const size_t k = output.find("---- sample ----");
  return k == std::string::npos ? "" : output.substr(k, output.find("\n----------------\n", k) - k);
}

class SimDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moecore_sim_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    testing::write_byte_corpus(dir_, 300, "the quick brown fox jumps over the lazy dog");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }

  // `moecore train` with the row's flags on np processes (np 1: no mpirun), on `device`, logging to `tag`.jsonl.
  CmdResult train(const std::string& device, const std::string& tag, int np, const std::string& flags) const {
    const std::string args = "train --data-path " + p("c_text_document") +
                             " --tokenizer-type ByteLevel --seq-length 32 --max-position-embeddings 32 "
                             "--micro-batch-size 2 --log-interval 1 --eval-interval 2 --eval-iters 1 "
                             "--moe-per-layer-logging --seed 7 --metrics-jsonl " +
                             p(tag + ".jsonl") + " --device " + device + " " + flags;
    fs::remove(p(tag + ".jsonl"));
    if (np == 1) return testing::run_moecore(args);
    return testing::run_shell(testing::mpirun_command(np) + MOECORE_BINARY + " " + args);
  }

  // One row: the run on cpu and on sim log the same numbers, step by step, and print the same sample.
  void expect_row(const std::string& name, int np, const std::string& flags) const {
    SCOPED_TRACE(name + " (np " + std::to_string(np) + "): " + flags);
#ifndef MOECORE_HAVE_MPI
    if (np > 1) return;
#endif
    const CmdResult cpu = train("cpu", name + "_cpu", np, flags);
    ASSERT_EQ(cpu.status, 0) << cpu.output;
    const CmdResult sim = train("sim", name + "_sim", np, flags);
    ASSERT_EQ(sim.status, 0) << sim.output;
    const auto a = metric_lines(p(name + "_cpu.jsonl")), b = metric_lines(p(name + "_sim.jsonl"));
    ASSERT_GE(a.size(), 4u) << cpu.output;
    EXPECT_EQ(b, a);
    EXPECT_EQ(sample_of(sim.output), sample_of(cpu.output));
  }
  fs::path dir_;
};

// The model flags every row starts from: a small MoE GPT with Megatron's defaults (LayerNorm, learned positions,
// biases, dropout 0.1), so model construction runs every initialiser.
const std::string kMoe =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-experts 4 --moe-router-topk 2 "
    "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --global-batch-size 4 --train-iters 4 --generate-tokens 4 ";
const std::string kSwiglu =
    kMoe + "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear ";

TEST_F(SimDevice, OneProcessPathsMatchTheCpu) {
  expect_row("defaults", 1, kMoe);
  expect_row("bf16", 1, kSwiglu + "--bf16");
  expect_row("mla_yarn", 1,
             kSwiglu +
                 "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 "
                 "--qk-pos-emb-head-dim 4 --v-head-dim 8 --rope-type yarn --bf16");
  expect_row("mtp", 1, kSwiglu + "--mtp-num-layers 1");
  expect_row("deepseek_routing", 1,
             kSwiglu +
                 "--moe-router-score-function sigmoid --moe-router-num-groups 2 --moe-router-group-topk 1 "
                 "--moe-router-enable-expert-bias --moe-shared-expert-intermediate-size 16 "
                 "--moe-router-topk-scaling-factor 2.5");
  expect_row("capacity", 1,
             kSwiglu +
                 "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity "
                 "--moe-token-drop-policy probs");
  expect_row("recompute_full", 1,
             kSwiglu + "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1");
  expect_row("recompute_selective", 1,
             kSwiglu + "--recompute-granularity selective --recompute-modules core_attn moe layernorm");
}

TEST_F(SimDevice, TensorSequenceAndContextParallelMatchTheCpu) {
  expect_row("tp_sp", 2, kSwiglu + "--tensor-model-parallel-size 2 --sequence-parallel");
  expect_row("cp", 2, kSwiglu + "--context-parallel-size 2");
  expect_row("etp", 2, kSwiglu + "--expert-tensor-parallel-size 2");
  expect_row("folding", 2,
             kSwiglu +
                 "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 "
                 "--expert-model-parallel-size 2");
}

TEST_F(SimDevice, PipelineParallelMatchesTheCpu) {
  expect_row("pp_1f1b", 2, kSwiglu + "--pipeline-model-parallel-size 2 --global-batch-size 8");
  expect_row("pp_interleaved", 2,
             kSwiglu +
                 "--num-layers 4 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                 "--global-batch-size 8");
}

TEST_F(SimDevice, ExpertParallelAndTheDistributedOptimizerMatchTheCpu) {
  expect_row("ep_alltoall", 2,
             kSwiglu +
                 "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                 "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather");
  expect_row("ep_allgather", 2, kSwiglu + "--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather");
  expect_row("capacity_retries", 2,
             kSwiglu +
                 "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                 "--moe-received-token-capacity 1.0");
  int retried = 0;  // the row above exercises the retry: at 1.0 x the average some step overflows
  for (const std::string& l : metric_lines(p("capacity_retries_cpu.jsonl"))) {
    const size_t k = l.find("moe/capacity_retries=");
    retried += k != std::string::npos && l[k + 21] != '0';
  }
#ifdef MOECORE_HAVE_MPI
  EXPECT_GT(retried, 0);
#endif
  expect_row("echo_capacity", 2,
             kSwiglu +
                 "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-enable-echo "
                 "--moe-num-echo-experts 2 --moe-received-token-capacity 1.0");
}

// Checkpoints: saved on EP 2 with the distributed optimizer, resumed on one process (a reshard); both the saving and
// the resumed run log the same numbers on sim as on the cpu.
TEST_F(SimDevice, CheckpointSaveReshardAndResumeMatchTheCpu) {
#ifdef MOECORE_HAVE_MPI
  const std::string flags = kSwiglu + "--train-iters 6 --exit-interval 3 --use-distributed-optimizer ";
  for (const char* device : {"cpu", "sim"}) {
    const std::string dev = device, ck = p("ck_" + dev);
    CmdResult r = train(dev, "save_" + dev, 2, flags + "--expert-model-parallel-size 2 --save " + ck);
    ASSERT_EQ(r.status, 0) << r.output;
    r = train(dev, "resume_" + dev, 1, kSwiglu + "--train-iters 6 --load " + ck);
    ASSERT_EQ(r.status, 0) << r.output;
  }
  EXPECT_EQ(metric_lines(p("save_sim.jsonl")), metric_lines(p("save_cpu.jsonl")));
  const auto resumed = metric_lines(p("resume_cpu.jsonl"));
  EXPECT_GE(resumed.size(), 3u);
  EXPECT_EQ(metric_lines(p("resume_sim.jsonl")), resumed);
#endif
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A Hugging Face model imported onto the device (the import --load-hf runs) and stepped forward and backward: the
// logits, the loss and every gradient that `moecore model-step` writes are the same bytes on sim as on the cpu.
TEST_F(SimDevice, HuggingFaceImportAndModelStepMatchTheCpu) {
  for (const char* model : {"qwen3_moe", "deepseek_v3_mtp", "mixtral"}) {
    SCOPED_TRACE(model);
    const std::string d = std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/" + model;
    for (const char* device : {"cpu", "sim"}) {
      const CmdResult r =
          testing::run_moecore("model-step --hf " + d + " --tokens " + d + "/tokens.safetensors --out " +
                               p(std::string(model) + "_" + device + ".safetensors") + " --device " + device);
      ASSERT_EQ(r.status, 0) << r.output;
    }
    const std::string cpu = file_bytes(p(std::string(model) + "_cpu.safetensors"));
    EXPECT_GT(cpu.size(), 1000u);
    EXPECT_TRUE(file_bytes(p(std::string(model) + "_sim.safetensors")) == cpu) << "model-step outputs differ";
  }
}

}  // namespace
}  // namespace moecore
