// Megatron's MoE CI as a Megatron user runs it against `moecore train`: flag sets written here in the style of
// Megatron's tests/functional_tests/test_cases/moe/*/model_config.yaml (their mix of model, parallel, logging and
// checkpoint flags; not copies of Megatron's files), shrunk to toy sizes, launched under mpirun. The ckpt-resume case
// follows Megatron's runner: the first run saves, the last checkpoint is deleted and the tracker rewound to the middle,
// the second run resumes there, and its losses must equal the first run's bit for bit. (tools/megatron_ci_configs.py
// runs Megatron's own 51 configurations the same way; docs/megatron-ci.md.)
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/cli_support.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;

class MegatronCi : public testing::CliScratch {
 protected:
  MegatronCi() : CliScratch("megatron_ci") {}
  // iteration -> lm loss of a --metrics-jsonl file
  std::map<int64_t, double> losses(const std::string& file) const {
    std::map<int64_t, double> out;
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("lm_loss") && !j["lm_loss"].is_null())  // (null: a skipped step)
        out[j["iteration"].get<int64_t>()] = j["lm_loss"].get<double>();
    }
    return out;
  }
  CmdResult train(int np, const std::string& flags) const {
    return testing::run_shell(testing::mpirun_command(np) + MOECORE_BINARY + " train --data-path " +
                              p("c_text_document") + " --tokenizer-type ByteLevel --generate-tokens 0 " + flags);
  }
};

// An EP 2 x DP 2 alltoall MoE with the distributed optimizer in two instances and both overlaps, Megatron's logging,
// checkpoint and determinism switches, async save: run, then resume from the middle as Megatron's runner does.
TEST_F(MegatronCi, ExpertParallelDistributedOptimizerResumeIsBitwise) {
  byte_corpus();
  const std::string flags =
      // model (shrunk)
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
      "--position-embedding-type rope --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
      "--disable-bias-linear --init-method-std 0.014 --attention-dropout 0.0 --hidden-dropout 0.0 "
      "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
      "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-router-dtype fp32 "
      // parallelism and optimizer
      "--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
      "--num-distributed-optimizer-instances 2 --bf16 --attention-softmax-in-fp32 --attention-backend unfused "
      "--deterministic-mode --distributed-backend nccl --no-gradient-accumulation-fusion --no-rope-fusion "
      "--use-mcore-models --transformer-impl transformer_engine --manual-gc --manual-gc-interval 100 "
      // schedule
      "--micro-batch-size 1 --global-batch-size 8 --train-iters 4 --exit-interval 4 --lr 1e-4 --min-lr 1e-5 "
      "--lr-decay-style cosine --lr-decay-iters 320 --lr-warmup-fraction .025 --weight-decay 0.1 --clip-grad 1.0 "
      "--adam-beta1 0.9 --adam-beta2 0.95 "
      // logging
      "--log-interval 1 --eval-interval 2 --eval-iters 1 --log-params-norm --log-num-zeros-in-grad "
      "--log-memory-to-tensorboard --log-timers-to-tensorboard --timing-log-level 0 --log-throughput "
      "--log-validation-ppl-to-tensorboard --logging-level 40 --check-weight-hash-across-dp-replicas-interval 2 "
      // checkpoints
      "--save-interval 2 --ckpt-format torch_dist --dist-ckpt-strictness log_all --async-save "
      "--use-persistent-ckpt-worker --ckpt-fully-parallel-load --ckpt-assume-constant-structure "
      "--dist-ckpt-optim-fully-reshardable --data-cache-path " +
      p("cache") + " --tensorboard-dir " + p("tb") + " --save " + p("ckpt") + " ";
  CmdResult r = train(4, flags + "--metrics-jsonl " + p("run1.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("trained 4 steps"), std::string::npos) << r.output;
  const std::map<int64_t, double> first = losses(p("run1.jsonl"));
  ASSERT_EQ(first.size(), 4u);
  // Megatron's runner: the last checkpoint removed, the tracker at the middle.
  fs::remove_all(p("ckpt/iter_0000004"));
  std::ofstream(p("ckpt/latest_checkpointed_iteration.txt")) << "2";
  r = train(4, flags + "--load " + p("ckpt") + " --metrics-jsonl " + p("run2.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("trained 2 steps (iterations 2 -> 4)"), std::string::npos) << r.output;
  const std::map<int64_t, double> second = losses(p("run2.jsonl"));
  ASSERT_EQ(second.size(), 2u);
  for (const int64_t it : {3, 4}) EXPECT_EQ(second.at(it), first.at(it)) << "iteration " << it;
  EXPECT_TRUE(fs::exists(p("ckpt/iter_0000004/COMMIT")));
}

// fp16 with Megatron's dynamic loss scaling under TP 2 (sequence parallel) x PP 2, sinkhorn top-1 routing, per-token
// loss and async saves: the first steps overflow and are skipped, and a resume from the middle continues the scaler's
// state (scale, growth and hysteresis counts) with the uninterrupted run's losses bit for bit.
TEST_F(MegatronCi, Fp16TensorPipelineResumeIsBitwise) {
  byte_corpus();
  const std::string flags =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
      "--disable-bias-linear --num-experts 2 --moe-router-load-balancing-type sinkhorn --moe-router-topk 1 "
      "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --fp16 "
      "--initial-loss-scale 16384 --loss-scale-window 3 --calculate-per-token-loss --apply-query-key-layer-scaling "
      "--micro-batch-size 2 --global-batch-size 8 --train-iters 8 --lr 1e-3 --lr-decay-style cosine "
      "--lr-warmup-fraction .125 --clip-grad 1.0 --log-interval 1 --eval-iters 1 --eval-interval 1000 "
      "--log-params-norm --log-num-zeros-in-grad --deterministic-mode --no-gradient-accumulation-fusion "
      "--use-checkpoint-opt_param-scheduler --ckpt-format torch_dist --dist-ckpt-strictness log_all --async-save "
      "--use-persistent-ckpt-worker --save-interval 4 --transformer-impl local --save " +
      p("ckpt16") + " ";
  CmdResult r = train(4, flags + "--metrics-jsonl " + p("fp16_1.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("skipped iterations"), std::string::npos) << r.output;
  const std::map<int64_t, double> first = losses(p("fp16_1.jsonl"));
  ASSERT_GE(first.size(), 4u);  // (the skipped steps log no loss)
  ASSERT_LT(first.size(), 8u);
  fs::remove_all(p("ckpt16/iter_0000008"));
  std::ofstream(p("ckpt16/latest_checkpointed_iteration.txt")) << "4";
  r = train(4, flags + "--load " + p("ckpt16") + " --metrics-jsonl " + p("fp16_2.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  // The same steps skipped (the scale grows every 3 clean steps and may overflow again), the same losses bit for bit.
  std::map<int64_t, double> rest(first.upper_bound(4), first.end());
  EXPECT_EQ(losses(p("fp16_2.jsonl")), rest);
  EXPECT_GE(rest.size(), 2u);
}

// Tensor and pipeline parallelism with sequence parallelism, a virtual pipeline, MTP and Megatron's other rank order.
TEST_F(MegatronCi, TensorPipelineParallelWithTheTpPpDpOrderTrains) {
  byte_corpus();
  const CmdResult r = train(
      4,
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
      "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear --num-experts 4 "
      "--moe-router-topk 2 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
      "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall "
      "--mtp-num-layers 1 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
      "--num-virtual-stages-per-pipeline-rank 2 --use-tp-pp-dp-mapping --expert-model-parallel-size 2 "
      "--expert-tensor-parallel-size 1 --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-4 "
      "--lr-warmup-iters 1 --log-interval 1 --eval-iters 1 --log-params-norm --log-num-zeros-in-grad "
      "--timing-log-level 1 --log-timers-to-tensorboard --tensorboard-dir " +
          p("tb2") +
          " --ckpt-format torch_dist --dist-ckpt-strictness log_all --exit-duration-in-mins 60 "
          "--cross-entropy-fusion-impl native --no-ckpt-fully-parallel-save --overlap-moe-expert-parallel-comm");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("trained 2 steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("params norm"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace moecore
