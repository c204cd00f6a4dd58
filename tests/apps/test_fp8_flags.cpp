// FP8 training's flags as a user meets them (Megatron's names, defaults and rules; docs/fp8-spec.md §1-2): every
// recipe trains from the command line (delayed, Megatron's default, with its margin, history and algorithm, under full
// recompute), router padding with them; flags that need --fp8-format, the delayed-only flags with another recipe,
// --first-last-layers-bf16 with delayed, --fp16 and out-of-range values are refused naming the flag; MLA and MTP train
// in FP8.
#include <gtest/gtest.h>

#include "cli_support.h"

namespace moecore {
namespace {

using testing::CmdResult;
using testing::run_moecore;

class Fp8Flags : public testing::CliScratch {
 protected:
  Fp8Flags() : CliScratch("fp8_flags") {}
};

TEST_F(Fp8Flags, RecipesTrainAndBadCombinationsAreNamed) {
  byte_corpus();
  const std::string moe = train_args() + "--bf16 --num-experts 4 --moe-router-topk 2 ";
  for (const char* ok :
       {"--fp8-format hybrid --fp8-recipe tensorwise --moe-router-padding-for-fp8 "
        "--moe-token-dispatcher-type alltoall",
        "--fp8-format e4m3 --fp8-recipe blockwise --first-last-layers-bf16 "
        "--num-layers-at-start-in-bf16 0 --fp8-interval 4 --no-fp8-wgrad",
        "--fp8-format hybrid --fp8-recipe mxfp8 --moe-router-padding-for-quantization "
        "--moe-token-dispatcher-type alltoall --fp8-output-proj",
        "--fp8-format e4m3",  // Megatron's default recipe, delayed
        "--fp8-format hybrid --fp8-recipe delayed --fp8-margin 1 --fp8-amax-history-len 4 "
        "--fp8-amax-compute-algo max --moe-router-padding-for-fp8 --moe-token-dispatcher-type alltoall "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"}) {
    const CmdResult r = run_moecore(moe + ok);
    EXPECT_EQ(r.status, 0) << ok << ":\n" << r.output;
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"--fp8-format e4m3 --first-last-layers-bf16", "not supported with --fp8-recipe delayed"},
      {"--fp8-margin 2", "--fp8-margin applies to --fp8-format with --fp8-recipe delayed"},
      {"--fp8-format e4m3 --fp8-amax-compute-algo mean", "--fp8-amax-compute-algo"},
      {"--fp8-format e4m3 --fp8-amax-history-len 0", "--fp8-amax-history-len"},
      {"--fp8-format e4m3 --fp8-margin 65", "--fp8-margin"},
      {"--fp8-recipe blockwise", "needs --fp8-format"},
      {"--fp8-format e4m3 --fp8-recipe custom", "--fp8-recipe custom"},
      {"--first-last-layers-bf16", "--first-last-layers-bf16 needs --fp8-format"},
      {"--fp8-format e4m3 --fp8-recipe tensorwise --num-layers-at-start-in-bf16 0", "needs --first-last-layers-bf16"},
      {"--fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-end-in-bf16 2",
       "--num-layers-at-end-in-bf16"},
      {"--fp8-format e4m3 --fp8-recipe tensorwise --fp8-margin 1", "--fp8-margin"},
      {"--fp8-format e4m3 --fp8-recipe tensorwise --fp8-amax-history-len 16", "--fp8-amax-history-len"},
      {"--fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather", "--fp8-param-gather"},
      {"--fp8-format e4m3 --fp8-recipe tensorwise --fp8-output-proj", "--fp8-output-proj needs"},
      {"--fp8-output-proj", "--fp8-output-proj needs"},
      {"--fp8-format e5m2 --fp8-recipe tensorwise", "--fp8-format"},
      {"--moe-router-padding-for-fp8", "--moe-router-padding-for-fp8"},
      {"--fp8-format e4m3 --fp8-recipe tensorwise --moe-router-padding-for-fp8 --moe-token-dispatcher-type allgather",
       "allgather"},
  };
  for (const auto& [flags, needle] : bad) {
    const CmdResult r = run_moecore(moe + flags);
    EXPECT_EQ(r.status, 1) << flags << ":\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << flags << ": missing '" << needle << "' in:\n" << r.output;
  }
  const CmdResult fp16 = run_moecore(train_args() + "--fp16 --fp8-format e4m3 --fp8-recipe tensorwise");
  EXPECT_EQ(fp16.status, 1);
  EXPECT_NE(fp16.output.find("--fp16"), std::string::npos) << fp16.output;
  const CmdResult mla = run_moecore(train_args() +
                                    "--multi-latent-attention --position-embedding-type rope --disable-bias-linear "
                                    "--q-lora-rank 8 --kv-lora-rank 8 --qk-head-dim 8 "
                                    "--qk-pos-emb-head-dim 4 --v-head-dim 8 --fp8-format e4m3 --fp8-recipe tensorwise");
  EXPECT_EQ(mla.status, 0) << mla.output;
  const CmdResult mtp =
      run_moecore(train_args() + "--position-embedding-type rope --mtp-num-layers 1 --fp8-format e4m3");  // (delayed)
  EXPECT_EQ(mtp.status, 0) << mtp.output;
}

}  // namespace
}  // namespace moecore
