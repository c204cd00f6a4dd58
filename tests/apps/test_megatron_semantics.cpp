// The Megatron flags `moecore train` implements beyond the model's, each with Megatron's semantics: what it changes is
// checked against the run it must equal (or the metric it must write), and the combinations Megatron refuses are
// refused with Megatron's words. (Logging, async save, the partial distributed optimizer and the rank order have their
// own tests beside their code.)
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/cli_support.h"

namespace moecore {
namespace {

using testing::CmdResult;
using testing::run_moecore;

class MegatronSemantics : public testing::CliScratch {
 protected:
  MegatronSemantics() : CliScratch("megatron_semantics") {}
  // The --metrics-jsonl records of a run (one per logged iteration or validation).
  std::vector<nlohmann::json> metrics(const std::string& flags, const std::string& name) {
    const std::string file = p(name + ".jsonl");
    const CmdResult r = run_moecore(train_args() + flags + " --metrics-jsonl " + file);
    EXPECT_EQ(r.status, 0) << flags << "\n" << r.output;
    std::vector<nlohmann::json> out;
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  static std::vector<double> field(const std::vector<nlohmann::json>& m, const char* key) {
    std::vector<double> v;
    for (const auto& j : m)
      if (j.contains(key)) v.push_back(j[key].get<double>());
    return v;
  }
  void expect_error(const std::string& flags, const std::string& message) {
    const CmdResult r = run_moecore(train_args() + flags);
    EXPECT_EQ(r.status, 1) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << flags << "\n" << r.output;
  }
};

// Megatron: warm-up steps = fraction x decay steps; the schedule equals the one with those warm-up iterations.
TEST_F(MegatronSemantics, LrWarmupFractionIsAFractionOfTheDecay) {
  byte_corpus();
  const std::string common = "--train-iters 4 --lr-decay-iters 8 --lr 1e-3 ";
  const auto by_fraction = field(metrics(common + "--lr-warmup-fraction 0.25", "fraction"), "lr");
  const auto by_iters = field(metrics(common + "--lr-warmup-iters 2", "iters"), "lr");
  ASSERT_EQ(by_fraction.size(), 4u);
  EXPECT_EQ(by_fraction, by_iters);
  EXPECT_LT(by_fraction[0], by_fraction[1]);  // warming up
  expect_error(common + "--lr-warmup-fraction 0.25 --lr-warmup-iters 2",
               "--lr-warmup-fraction and --lr-warmup-iters exclude each other");
  // A fraction of the decay that is not a whole number of iterations warms up over 2.4 iterations, as Megatron.
  const auto fractional = field(metrics(common + "--lr-warmup-fraction 0.3", "fractional"), "lr");
  ASSERT_EQ(fractional.size(), 4u);
  EXPECT_NEAR(fractional[0], 1e-3 / 2.4, 1e-9);
  EXPECT_NEAR(fractional[1], 2e-3 / 2.4, 1e-9);
  EXPECT_LE(fractional[2], 1e-3 * (1 + 1e-6));  // (--lr in f32)
  expect_error(common + "--lr-warmup-fraction 1.5", "--lr-warmup-fraction");
}

// --save-interval without --save is accepted (Megatron asserts only the other way round); --persistent-save-interval
// is its other name.
TEST_F(MegatronSemantics, SaveIntervalsAsMegatron) {
  byte_corpus();
  CmdResult r = run_moecore(train_args() + "--save-interval 1");
  EXPECT_EQ(r.status, 0) << r.output;
  r = run_moecore(train_args() + "--persistent-save-interval 1 --save " + p("ckpt"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(p("ckpt/iter_0000001/COMMIT"))) << r.output;
  expect_error("--save-interval 1 --persistent-save-interval 2", "name one setting");
}

// torch_dist and torch are moecore's own resharding format; the FSDP formats are refused naming what they need.
TEST_F(MegatronSemantics, CkptFormats) {
  byte_corpus();
  for (const char* format : {"torch_dist", "torch"}) {
    const CmdResult r = run_moecore(train_args() + "--ckpt-format " + format + " --save " + p(format));
    EXPECT_EQ(r.status, 0) << format << "\n" << r.output;
    EXPECT_TRUE(std::filesystem::exists(p(std::string(format) + "/iter_0000002/COMMIT")));
  }
  expect_error("--ckpt-format fsdp_dtensor", "Megatron-FSDP is not supported yet; use --ckpt-format torch_dist");
  expect_error("--ckpt-format torch_dcp", "--ckpt-format torch_dcp is only tested with FSDP");
  expect_error("--ckpt-format zarr", "--ckpt-format");
  expect_error("--dist-ckpt-strictness strict", "--dist-ckpt-strictness");
}

TEST_F(MegatronSemantics, ValidationPerplexityToTensorBoard) {
  byte_corpus();
  const auto m = metrics("--log-validation-ppl-to-tensorboard --eval-interval 1", "ppl");
  const auto loss = field(m, "valid_lm_loss"), ppl = field(m, "valid_lm_loss_ppl");
  ASSERT_EQ(loss.size(), 2u);
  ASSERT_EQ(ppl.size(), 2u);
  for (size_t i = 0; i < loss.size(); ++i) EXPECT_NEAR(ppl[i], std::exp(loss[i]), 1e-9 * ppl[i]);
  EXPECT_TRUE(field(metrics("--eval-interval 1", "no_ppl"), "valid_lm_loss_ppl").empty());
}

// --deterministic-mode refuses what Megatron's refuses; two runs are bitwise equal.
TEST_F(MegatronSemantics, DeterministicMode) {
  byte_corpus();
  expect_error("--deterministic-mode --cross-entropy-loss-fusion",
               "--deterministic-mode requires: cross_entropy_loss_fusion=False (got True)");
  const auto a = field(metrics("--deterministic-mode", "det_a"), "lm_loss");
  const auto b = field(metrics("--deterministic-mode", "det_b"), "lm_loss");
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a, b);
}

// Attention's backend and softmax switches select what moecore always computes: the same losses, bit for bit.
TEST_F(MegatronSemantics, AttentionSwitchesKeepTheAttention) {
  byte_corpus();
  const auto base = field(metrics("--position-embedding-type rope", "base"), "lm_loss");
  const auto switched =
      field(metrics("--use-rotary-position-embeddings --attention-backend flash --attention-softmax-in-fp32 "
                    "--apply-query-key-layer-scaling",
                    "switched"),
            "lm_loss");
  ASSERT_EQ(base.size(), 2u);
  EXPECT_EQ(base, switched);
  expect_error("--attention-backend local", "--attention-backend local selects Megatron's local layer spec");
  expect_error("--attention-backend cudnn", "--attention-backend");
}

// Megatron's validate_args: --async-save without the persistent worker is switched off with a warning (the saves are
// synchronous); with it the checkpoint is written in the background and committed.
TEST_F(MegatronSemantics, AsyncSaveNeedsThePersistentWorker) {
  byte_corpus();
  CmdResult r = run_moecore(train_args() + "--async-save --save " + p("sync"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(
      r.output.find("--async-save is not supported without --use-persistent-ckpt-worker. Disabling --async-save."),
      std::string::npos)
      << r.output;
  EXPECT_TRUE(std::filesystem::exists(p("sync/iter_0000002/COMMIT")));
  r = run_moecore(train_args() + "--async-save --use-persistent-ckpt-worker --save-interval 1 --save " + p("async"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(p("async/iter_0000001/COMMIT")));
  EXPECT_TRUE(std::filesystem::exists(p("async/iter_0000002/COMMIT")));
  expect_error("--async-strategy torch", "--async-strategy");
}

// Accepted without effect, --overlap-moe-expert-parallel-comm still meets Megatron's preconditions.
TEST_F(MegatronSemantics, OverlapMoeExpertParallelCommKeepsMegatronsPreconditions) {
  byte_corpus();
  expect_error("--num-experts 2 --overlap-moe-expert-parallel-comm",
               "overlap_moe_expert_parallel_comm is only supported with expert model parallelism");
}

}  // namespace
}  // namespace moecore
