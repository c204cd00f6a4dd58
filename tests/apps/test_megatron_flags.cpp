// Megatron's flags as a Megatron user meets them: the table of apps/megatron_flags.cpp is Megatron's parser (the
// file ../shared/data/megatron/flags-<commit>.json was produced by Megatron's own argument parser), every flag
// `moecore train` and `moecore generate` share with Megatron has Megatron's default, switches stay switches, accepted
// flags are checked against Megatron's choices, refused ones name what is missing, and the flags of Megatron's own
// MoE example scripts are either honoured or refused by name.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "apps/cli_support.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::CmdResult;
const auto run_cmd = testing::run_moecore;

using testing::list_flags;

// Megatron writes defaults as Python reprs: None, True, 'LayerNorm', 0.999, 1e-05.
bool same_default(const std::string& megatron, const std::string& ours) {
  std::string m = megatron;
  if (m.size() >= 4 && m.starts_with("['") && m.ends_with("']")) m = m.substr(1, m.size() - 2);  // ['x']: x
  if (m.size() >= 2 && m.front() == '\'' && m.back() == '\'') m = m.substr(1, m.size() - 2);
  if (m.starts_with("<") && m.find('.') != std::string::npos && m.find(':') != std::string::npos)  // <Enum.x: 5>: x
    m = m.substr(m.find('.') + 1, m.find(':') - m.find('.') - 1);
  if (m == ours) return true;
  char *e1 = nullptr, *e2 = nullptr;
  const double a = std::strtod(m.c_str(), &e1), b = std::strtod(ours.c_str(), &e2);
  return !m.empty() && !ours.empty() && !*e1 && !*e2 && a == b;
}

nlohmann::json megatron_table() {
  const std::string dir = testing::shared_data_dir();
  if (dir.empty()) return {};
  std::ifstream f(dir + "/megatron/flags-d98e8a64.json");
  if (!f) return {};
  return nlohmann::json::parse(f);
}

TEST(MegatronFlags, EverySharedFlagHasMegatronsDefault) {
  const nlohmann::json table = megatron_table();
  if (table.empty()) GTEST_SKIP() << "../shared/data/megatron/flags-d98e8a64.json not found";
  int checked = 0;
  for (const char* command : {"train", "generate"}) {
    for (const auto& [name, ours] : list_flags(command)) {
      if (!table.contains(name)) continue;  // moecore's own flags (--metrics-jsonl, --prompt, ...)
      ++checked;
      const std::string action = table[name]["action"], def = table[name]["default"];
      if (ours.kind != "switch" && ours.kind != "value" && ours.kind != "list") continue;  // the table's rows
      const bool megatron_switch = action == "_StoreTrueAction" || action == "_StoreFalseAction";
      EXPECT_EQ(megatron_switch, ours.kind == "switch")
          << command << " " << name << ": Megatron " << action << ", moecore " << ours.kind;
      if (megatron_switch) continue;
      if (def == "None") {
        // Megatron's None is "unset"; a convenience default is allowed where Megatron requires the flag.
        EXPECT_TRUE(ours.def.empty() || ours.help.find("(Megatron: required") != std::string::npos ||
                    ours.help.find("(Megatron: unset = " + ours.def + ")") != std::string::npos)
            << command << " " << name << ": Megatron's default is None, moecore's is '" << ours.def
            << "' without saying so in --help";
      } else {
        EXPECT_TRUE(same_default(def, ours.def))
            << command << " " << name << ": Megatron's default is " << def << ", moecore's is '" << ours.def << "'";
      }
    }
  }
  EXPECT_GE(checked, 150) << "too few shared flags checked: is --list-flags complete?";
}

// Every one of Megatron's flags has exactly one row in the table, with Megatron's arity and default, and the table's
// fate agrees with `moecore train`: an implemented flag is declared by it, an accepted or refused one is not. A flag
// Megatron adds fails here until it is classified.
TEST(MegatronFlags, TheTableIsMegatronsParser) {
  const std::map<std::string, testing::FlagLine> train = list_flags("train");
  int implemented = 0, table_rows = 0;
  for (const auto& [name, line] : train) {
    const bool ours = line.kind == "switch" || line.kind == "value" || line.kind == "list";
    EXPECT_NE(line.kind, "other-command") << name << " is implemented in the table but train does not declare it";
    if (!ours) ++table_rows;
  }
  const nlohmann::json table = megatron_table();
  if (table.empty()) GTEST_SKIP() << "../shared/data/megatron/flags-d98e8a64.json not found (checked the fates only)";
  for (const auto& [name, entry] : table.items()) {
    const auto it = train.find(name);
    if (name == "--help") continue;  // the parser's own
    if (it == train.end()) {
      ADD_FAILURE() << "Megatron's " << name << " has no row in apps/megatron_flags.cpp: classify it";
      continue;
    }
    const std::string action = entry["action"], kind = it->second.kind;
    const bool megatron_switch =
        action == "_StoreTrueAction" || action == "_StoreFalseAction" || action == "BooleanOptionalAction";
    const bool our_switch = kind == "switch" || kind.ends_with("-switch");
    EXPECT_EQ(megatron_switch, our_switch) << name << ": Megatron " << action << ", moecore " << kind;
    if (kind.starts_with("accepted-") || kind.starts_with("refused-")) {
      EXPECT_EQ(it->second.def, entry["default"].get<std::string>()) << name;
      EXPECT_FALSE(it->second.help.empty()) << name << ": an accepted or refused flag says why";
    } else {
      ++implemented;
    }
  }
  for (const auto& [name, line] : train) {
    const bool ours = line.kind == "switch" || line.kind == "value" || line.kind == "list";
    if (!ours) {
      EXPECT_TRUE(table.contains(name)) << name << " is in the table but not a Megatron flag";
    }
  }
  EXPECT_EQ(static_cast<size_t>(implemented + table_rows + 1), table.size());
}

TEST(MegatronFlags, RefusedFlagsNameWhatIsMissing) {
  for (const std::string& f : {std::string("--moe-shared-expert-overlap"), std::string("--qk-l2-norm"),
                               std::string("--tp-comm-overlap"), std::string("--fp8-param-gather"),
                               std::string("--optimizer-cpu-offload"), std::string("--fsdp-double-buffer")}) {
    const CmdResult r = run_cmd("train --data-path x " + f);
    EXPECT_NE(r.status, 0) << f;
    EXPECT_NE(r.output.find(f + " is not supported"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("unknown flag"), std::string::npos) << r.output;
  }
  // Values of implemented flags that name a feature moecore lacks.
  for (const auto& [f, what] : {std::pair<std::string, std::string>{"--optimizer lion", "use adam (AdamW) or muon"},
                                {"--optimizer sgd", "use adam (AdamW) or muon"},
                                {"--moe-token-dispatcher-type flex", "Megatron's flex dispatcher"}}) {
    const CmdResult v = run_cmd("train --data-path x --num-experts 2 --tokenizer-type ByteLevel " + f);
    EXPECT_NE(v.output.find(f + " is not supported yet: "), std::string::npos) << v.output;
    EXPECT_NE(v.output.find(what), std::string::npos) << v.output;
  }
  // In a --config file too.
  const std::string cfg = ::testing::TempDir() + "/refused_" + std::to_string(::getpid()) + ".yaml";
  std::ofstream(cfg) << "qk_l2_norm: true\n";
  const CmdResult r = run_cmd("train --data-path x --config " + cfg);
  EXPECT_NE(r.output.find("--qk-l2-norm in --config " + cfg + " is not supported"), std::string::npos) << r.output;
  std::remove(cfg.c_str());
  // A refused value flag given Megatron's own default asks for nothing missing; another value is refused.
  const CmdResult at_default = run_cmd("train --lr-warmup-samples 0 --data-path /nonexistent");
  EXPECT_EQ(at_default.output.find("--lr-warmup-samples"), std::string::npos) << at_default.output;
  const CmdResult other = run_cmd("train --lr-warmup-samples 5");
  EXPECT_NE(other.output.find("--lr-warmup-samples 5 is not supported"), std::string::npos) << other.output;
}

// Accepted flags take Megatron's values and give Megatron's (argparse's) error for others; Megatron's negated
// spellings are names of their own, and a positive spelling Megatron does not have stays unknown.
TEST(MegatronFlags, AcceptedFlagsAreCheckedAgainstMegatronsChoices) {
  const CmdResult choice = run_cmd("train --distributed-backend mpi");
  EXPECT_NE(choice.output.find("argument --distributed-backend: invalid choice: 'mpi' (choose from 'nccl', 'gloo')"),
            std::string::npos)
      << choice.output;
  const CmdResult integer = run_cmd("train --manual-gc-interval often");
  EXPECT_NE(integer.output.find("argument --manual-gc-interval: invalid int value: 'often'"), std::string::npos)
      << integer.output;
  const CmdResult negated = run_cmd(
      "train --no-gradient-accumulation-fusion --disable-gloo-process-groups "
      "--data-path /nonexistent");
  EXPECT_EQ(negated.output.find("flag"), std::string::npos) << negated.output;  // fails later, on the data
  const CmdResult positive = run_cmd("train --gradient-accumulation-fusion");
  EXPECT_NE(positive.output.find("unknown flag '--gradient-accumulation-fusion'"), std::string::npos)
      << positive.output;
  const CmdResult other = run_cmd("generate --train-iters 3");
  EXPECT_NE(other.output.find("'--train-iters' is a Megatron flag that moecore generate does not take"),
            std::string::npos)
      << other.output;
}

// docs/megatron-flags.md is the table as `moecore train --list-flags=markdown` prints it.
TEST(MegatronFlags, TheDocumentIsGeneratedFromTheTable) {
  const CmdResult r = run_cmd("train --list-flags=markdown");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream f(std::string(MOECORE_SOURCE_DIR) + "/docs/megatron-flags.md");
  std::stringstream doc;
  doc << f.rdbuf();
  EXPECT_TRUE(doc.str() == r.output)
      << "docs/megatron-flags.md is stale: regenerate it with build/apps/moecore train --list-flags=markdown > "
         "docs/megatron-flags.md";
}

TEST(MegatronFlags, BadValuesFailNamingTheFlag) {
  const std::string base = "train --data-path /nonexistent --tokenizer-type ByteLevel ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--moe-layer-freq '[0]*3+[1]*5' --num-experts 4 --num-layers 4", "--moe-layer-freq"},
      {"--moe-layer-freq 'import os' --num-experts 4", "--moe-layer-freq"},
      {"--hidden-dropout 1.0", "--hidden-dropout"},
      {"--attention-dropout -0.1", "--attention-dropout"},
      {"--rotary-percent 0", "--rotary-percent"},
      {"--rotary-percent 1.5", "--rotary-percent"},
      {"--max-position-embeddings 64 --seq-length 128", "--max-position-embeddings"},
      {"--position-embedding-type learned_absolute --no-position-embedding", "--no-position-embedding"},
      {"--position-embedding-type alibi", "--position-embedding-type"},
  };
  for (const auto& [flags, name] : cases) {
    const CmdResult r = run_cmd(base + flags);
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.output.find(name), std::string::npos) << flags << "\n" << r.output;
  }
}

TEST(MegatronFlags, FarFetchedSuggestionsAreNotMade) {
  const CmdResult typo = run_cmd("train --num-layer 2");
  EXPECT_NE(typo.output.find("did you mean '--num-layers'"), std::string::npos) << typo.output;
  const CmdResult far = run_cmd("train --completely-unrelated-option 1");
  EXPECT_NE(far.output.find("unknown flag '--completely-unrelated-option'"), std::string::npos) << far.output;
  EXPECT_EQ(far.output.find("did you mean"), std::string::npos) << far.output;
}

// The model and training flags of Megatron-LM's own MoE examples (examples/mixtral/train_mixtral_8x7b_distributed.sh
// and the Qwen3-30B-A3B and DeepSeek-R1 configs under examples/post_training/modelopt/conf/), verbatim except for
// sizes shrunk to a toy model, the tokenizer (ByteLevel on a small corpus, so Mixtral's --split 99990,8,2 becomes
// 90,8,2) and parallel sizes for one process.
// Every flag must be honoured (the run trains) or, for `refused`, fail naming the flag as "not supported".
struct MegatronExample {
  const char* name;
  std::string flags;
  std::vector<std::string> refused;
};

std::vector<MegatronExample> megatron_examples() {
  return {
      {"mixtral",
       "--use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 64 --num-layers 2 "
       "--hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --init-method-std 0.01 --attention-dropout 0.0 "
       "--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu "
       "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion "
       "--no-position-embedding --rotary-base 1000000 "
       "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
       "--moe-grouped-gemm --moe-token-dispatcher-type alltoall "
       "--split 90,8,2 "
       "--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 2 --lr-decay-iters 2 --lr-decay-style "
       "cosine "
       "--min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 --bf16 "
       "--tensor-model-parallel-size 1 --expert-model-parallel-size 1 --use-distributed-optimizer "
       "--overlap-grad-reduce --overlap-param-gather "
       "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --no-load-optim --no-load-rng "
       "--recompute-activations --moe-layer-recompute",
       {}},
      {"qwen3-30b-a3b",
       "--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear "
       "--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm "
       "--swiglu --num-layers 2 --hidden-size 32 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention "
       "--num-query-groups 2 --kv-channels 16 --qk-layernorm --num-experts 8 --moe-ffn-hidden-size 16 "
       "--moe-router-topk 4 --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall "
       "--moe-router-load-balancing-type aux_loss --seq-length 32 --max-position-embeddings 64 "
       "--make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0 --rotary-base 1000000 "
       "--no-bias-swiglu-fusion --global-batch-size 2 --lr 1e-4 --train-iters 2 --sequence-parallel "
       "--recompute-granularity selective --recompute-modules moe_act layernorm",
       {}},
      {"deepseek-r1",
       "--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear "
       "--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm "
       "--swiglu --num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --kv-channels 16 "
       "--num-experts 8 --moe-layer-freq [0]*1+[1]*3 --moe-ffn-hidden-size 16 --moe-router-dtype fp32 "
       "--moe-router-score-function sigmoid --moe-router-bias-update-rate 1e-3 --moe-router-enable-expert-bias "
       "--moe-router-topk 4 --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-pre-softmax "
       "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2 "
       "--moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 16 --moe-aux-loss-coeff 1e-4 "
       "--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall --moe-token-drop-policy "
       "probs "
       "--seq-length 32 --max-position-embeddings 64 --make-vocab-size-divisible-by 1280 --use-mcore-models "
       "--rotary-base 10000 --rotary-percent 1.0 --mscale 1.0 --global-batch-size 2 --lr 1e-4 --train-iters 2 "
       "--multi-latent-attention --kv-lora-rank 16 --v-head-dim 16 --q-lora-rank 24 --qk-head-dim 16 "
       "--qk-pos-emb-head-dim 8 --qk-layernorm --rotary-scaling-factor 40 --mscale-all-dim 1.0",
       {"--moe-shared-expert-overlap"}},
  };
}

TEST(MegatronFlags, MegatronsMoeExamplesRunOrRefuseByName) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moecore_megatron_examples_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  testing::write_byte_corpus(dir, 300, "Example document: the quick brown fox jumps over the lazy dog.");
  if (HasFatalFailure()) return;
  const std::string data =
      " --data-path " + (dir / "c_text_document").string() + " --tokenizer-type ByteLevel --generate-tokens 0 ";
  for (const MegatronExample& ex : megatron_examples()) {
    const std::string ckpt = (dir / ex.name).string();
    const CmdResult ok = run_cmd("train" + data + ex.flags + " --save " + ckpt + " --load " + ckpt);
    ASSERT_EQ(ok.status, 0) << ex.name << "\n" << ok.output;
    EXPECT_NE(ok.output.find("trained 2 steps (iterations 0 -> 2)"), std::string::npos) << ex.name << "\n" << ok.output;
    EXPECT_TRUE(fs::exists(fs::path(ckpt) / "iter_0000002")) << ex.name;
    for (const std::string& f : ex.refused) {
      const CmdResult r = run_cmd("train" + data + ex.flags + " " + f);
      const std::string name = f.substr(0, f.find(' '));
      EXPECT_NE(r.status, 0) << ex.name << " " << f;
      EXPECT_NE(
          r.output.find(name + (f.find(' ') == std::string::npos ? "" : f.substr(f.find(' '))) + " is not supported"),
          std::string::npos)
          << ex.name << " " << f << "\n"
          << r.output;
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moecore
