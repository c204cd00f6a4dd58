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
  expect_error("--ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP");
  expect_error("--ckpt-format torch_dcp", "--ckpt-format torch_dcp is only tested with FSDP");
  expect_error("--ckpt-format zarr", "--ckpt-format");
  expect_error("--dist-ckpt-strictness strict", "--dist-ckpt-strictness");
}

// Megatron-FSDP from the command line: --use-megatron-fsdp (default strategy optim_grads_params) trains and saves in
// the format it requires, and loads where the distributed optimizer resumes; Megatron's rules refuse what it refuses.
TEST_F(MegatronSemantics, MegatronFsdpFlags) {
  byte_corpus();
  const std::string fsdp = "--use-megatron-fsdp --ckpt-format fsdp_dtensor ";
  for (const char* s : {"optim_grads_params", "optim_grads", "optim", "no_shard"}) {
    const CmdResult r = run_moecore(train_args() + fsdp + "--data-parallel-sharding-strategy " + s + " --save " + p(s));
    EXPECT_EQ(r.status, 0) << s << "\n" << r.output;
    EXPECT_TRUE(std::filesystem::exists(p(std::string(s) + "/iter_0000002/COMMIT"))) << s;
  }
  expect_error("--use-megatron-fsdp", "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format");
  expect_error(fsdp + "--optimizer muon", "Megatron-FSDP does not support the muon optimizer yet");
  {  // bf16 gradients (auto under --bf16), reduced and accumulated in bf16
    const CmdResult r = run_moecore(train_args() + fsdp + "--bf16");
    EXPECT_EQ(r.status, 0) << r.output;
  }
  expect_error(fsdp + "--bf16 --data-parallel-sharding-strategy optim",
               "pass --megatron-fsdp-main-grads-dtype fp32 --megatron-fsdp-grad-comm-dtype fp32");
  expect_error(fsdp + "--megatron-fsdp-main-grads-dtype fp16",
               "--megatron-fsdp-main-grads-dtype fp16 is not supported");
  {  // bf16 main parameters too (auto under --bf16), in the shards of optim_grads
    const CmdResult r = run_moecore(train_args() + fsdp +
                                    "--bf16 --megatron-fsdp-main-params-dtype auto --data-parallel-sharding-strategy "
                                    "optim_grads --save " +
                                    p("bf16_main"));
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(std::filesystem::exists(p("bf16_main/iter_0000002/COMMIT")));
  }
  expect_error(fsdp + "--megatron-fsdp-main-params-dtype bf16 --data-parallel-sharding-strategy optim",
               "pass --megatron-fsdp-main-params-dtype fp32");
  expect_error(fsdp + "--megatron-fsdp-version 2", "--megatron-fsdp-version 2");
#ifdef MOECORE_HAVE_MPI
  {  // HFSDP at 4 ranks (2 instances of 2): the optimizer state of a rank is half HSDP's
    const auto state = [&](const char* outer) {
      const std::string cmd = testing::mpirun_command(4) + MOECORE_BINARY + " " + train_args() + fsdp +
                              "--global-batch-size 8 --num-distributed-optimizer-instances 2 "
                              "--outer-dp-sharding-strategy " +
                              outer;
      const CmdResult r = testing::run_shell(cmd);
      EXPECT_EQ(r.status, 0) << outer << "\n" << r.output;
      const size_t at = r.output.find("distributed optimizer: ");
      return at == std::string::npos ? -1.0 : std::stod(r.output.substr(at + 23));
    };
    const double hsdp = state("no_shard"), hfsdp = state("optim");
    EXPECT_GT(hsdp, 0);
    EXPECT_NEAR(hfsdp, hsdp / 2, 0.05 * hsdp) << hfsdp << " vs HSDP's " << hsdp;
  }
#endif
  expect_error(fsdp + "--outer-dp-sharding-strategy optim --data-parallel-sharding-strategy optim",
               "--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy optim_grads_params");
  expect_error("--data-parallel-sharding-strategy optim", "sets Megatron-FSDP: add --use-megatron-fsdp");
  expect_error(fsdp + "--use-torch-fsdp2", "--use-megatron-fsdp and --use-torch-fsdp2 exclude each other");
  expect_error("--use-torch-fsdp2", "--use-torch-fsdp2 needs --no-gradient-accumulation-fusion");
  {  // torch FSDP2 under its restrictions: the optim_grads_params algorithm
    const CmdResult r = run_moecore(train_args() +
                                    "--use-torch-fsdp2 --no-gradient-accumulation-fusion "
                                    "--untie-embeddings-and-output-weights --ckpt-format torch_dcp --save " +
                                    p("fsdp2"));
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(std::filesystem::exists(p("fsdp2/iter_0000002/COMMIT")));
  }
  {  // what moecore does under FSDP anyway: the layers born in their shards
    const CmdResult r = run_moecore(train_args() + fsdp + "--init-model-with-meta-device");
    EXPECT_EQ(r.status, 0) << r.output;
  }
  expect_error(fsdp + "--init-model-with-meta-device --data-parallel-sharding-strategy no_shard",
               "--init-model-with-meta-device is not supported with --data-parallel-sharding-strategy no_shard");
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

// Loss scaling as Megatron's get_megatron_optimizer builds it: --loss-scale is a constant scale for --fp16 or --bf16
// (a power of two changes no bit of a bf16 run, whose exponent range is fp32's), logged on the line and as loss-scale
// (1 without scaling; none with --no-log-loss-scale-to-tensorboard); the dynamic scaler's settings need --fp16 without
// --loss-scale; Megatron's exclusions are refused naming the flags.
TEST_F(MegatronSemantics, LossScalingAsMegatron) {
  byte_corpus();
  const auto plain = metrics("--bf16", "bf16");
  const auto scaled = metrics("--bf16 --loss-scale 1024", "scaled");
  EXPECT_EQ(field(plain, "loss-scale"), std::vector<double>(2, 1.0));
  EXPECT_EQ(field(scaled, "loss-scale"), std::vector<double>(2, 1024.0));
  ASSERT_EQ(field(plain, "lm_loss").size(), 2u);
  EXPECT_EQ(field(scaled, "lm_loss"), field(plain, "lm_loss"));
  EXPECT_EQ(field(scaled, "grad_norm"), field(plain, "grad_norm"));
  EXPECT_TRUE(field(metrics("--no-log-loss-scale-to-tensorboard", "off"), "loss-scale").empty());
  EXPECT_TRUE(field(metrics("--disable-log-loss-scale-to-tensorboard", "off2"), "loss-scale").empty());
  const CmdResult line = run_moecore(train_args() + "--bf16 --loss-scale 1024");
  EXPECT_NE(line.output.find("loss scale 1024.0 | grad norm"), std::string::npos) << line.output;
  expect_error("--loss-scale 1024", "--loss-scale scales the loss of --fp16 or --bf16 training");
  expect_error("--bf16 --hysteresis 3", "--hysteresis sets the dynamic loss scaler, which only --fp16 without");
  expect_error("--bf16 --loss-scale 8 --initial-loss-scale 65536", "--initial-loss-scale sets the dynamic loss scaler");
  expect_error("--fp16 --bf16", "--fp16 and --bf16 exclude each other");
  expect_error("--fp16 --loss-scale-window 10.5", "--loss-scale-window (10.5) must be a whole number of steps");
  expect_error("--bf16 --loss-scale 0", "--loss-scale");
  // Megatron's own defaults pass whatever the precision.
  EXPECT_EQ(run_moecore(train_args() + "--hysteresis 2 --min-loss-scale 1.0").status, 0);
}

// --fp16: f16 compute with Megatron's dynamic loss scaler (check_for_nan switched off with Megatron's warning). From
// Megatron's initial scale 2^32 the first steps overflow and are skipped (no loss, no grad norm, the LR held), the
// scale halving from the second overflow on, until the gradients fit; then it trains. A constant --loss-scale that
// never overflows tracks the fp32 run.
TEST_F(MegatronSemantics, Fp16TrainsWithDynamicLossScaling) {
  byte_corpus();
  const CmdResult line = run_moecore(train_args() + "--fp16 --train-iters 3");
  EXPECT_EQ(line.status, 0) << line.output;
  EXPECT_NE(line.output.find("warning: Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss "
                             "scaling is being used"),
            std::string::npos)
      << line.output;
  EXPECT_NE(line.output.find("loss scale 4294967296.0 | grad norm - (step skipped)"), std::string::npos) << line.output;
  const auto m = metrics("--fp16 --train-iters 24", "fp16");
  ASSERT_EQ(m.size(), 25u);  // 24 steps and the validation
  std::vector<double> scale, loss;
  int skipped = 0;
  for (const auto& j : m) {
    if (!j.contains("loss-scale")) continue;
    scale.push_back(j["loss-scale"].get<double>());
    if (j["lm_loss"].is_null()) {
      ++skipped;
      EXPECT_TRUE(loss.empty()) << "a skipped step after training began, iteration " << j["iteration"];
      EXPECT_TRUE(j["grad_norm"].is_null());
      EXPECT_EQ(j["lr"].get<double>(), m[0]["lr"].get<double>());  // (the schedule waits)
    } else {
      loss.push_back(j["lm_loss"].get<double>());
    }
  }
  EXPECT_EQ(scale[0], 4294967296.0);
  EXPECT_EQ(scale[1], 4294967296.0);  // (hysteresis 2: the first overflow keeps it)
  for (size_t i = 2; i < static_cast<size_t>(skipped); ++i) EXPECT_EQ(scale[i], scale[i - 1] / 2) << i;
  EXPECT_GE(skipped, 3);
  ASSERT_GE(loss.size(), 6u);
  EXPECT_LT(loss.back(), loss.front());
  for (size_t i = static_cast<size_t>(skipped) + 1; i < scale.size(); ++i) EXPECT_EQ(scale[i], scale[skipped]) << i;
  const auto f32 = field(metrics("--train-iters 4", "f32"), "lm_loss");
  const auto f16 = field(metrics("--fp16 --loss-scale 256 --train-iters 4", "f16_constant"), "lm_loss");
  ASSERT_EQ(f16.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(f16[i], f32[i], 2e-3 * f32[i]) << i;
}

// --calculate-per-token-loss: with every token counted it is the default run to rounding (the global batch's tokens
// weigh as its micro-batches' means do).
TEST_F(MegatronSemantics, PerTokenLoss) {
  byte_corpus();
  const std::string flags = "--global-batch-size 4 --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 ";
  const auto mean = metrics(flags, "mean");
  const auto per_token = metrics(flags + "--calculate-per-token-loss", "per_token");
  const auto a = field(mean, "lm_loss"), b = field(per_token, "lm_loss");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << i;
}

}  // namespace
}  // namespace moecore
