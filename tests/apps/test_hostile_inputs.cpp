// Hostile command lines and rank faults, as an outside tester tries them (issue 15): every numeric flag is
// range-checked at start-up whether or not the run uses it, parse errors name the flag, output paths are checked
// before the first step, a model too large for the machine is refused before allocating, and in a multi-rank job
// a mismatched flag, a rank that fails alone, a stalled rank and a killed rank all end the whole job with a
// message naming the rank (no state in which a job runs forever).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "apps/cli_support.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;
using testing::run_moecore;
using testing::run_shell;

using testing::list_flags;

// Value flags that are free text with their own parsers or checks (paths, names, prompts, tokenizer kinds, the
// enumerations their readers check on every run, --moe-layer-freq's expression); every other value flag of every
// command must declare a domain, so a new numeric flag cannot go unchecked.
const std::set<std::string> kFreeText = {
    // paths and names
    "--data-path", "--save", "--load", "--load-hf", "--hf-config", "--metrics-jsonl", "--tensorboard-dir",
    "--vocab-file", "--merge-file", "--tokenizer-model", "--input", "--output-prefix", "--json-keys", "--from-hf",
    "--to-hf", "--prompt", "--tokenizer-type", "--hf-model-type", "--out", "--tokens", "--case", "--golden", "--output",
    "--checkpoint", "--dir", "--hf", "--inputs", "--config",
    // words with their own parsers (convert: dtype names and aliases, HF size units like 5GB, model types)
    "--hf-dtype", "--max-shard-size",
    // enumerations checked by their readers on every run (model_flags.cpp)
    "--position-embedding-type", "--normalization", "--transformer-impl", "--rope-type",
    "--moe-router-load-balancing-type", "--moe-router-score-function", "--moe-router-dtype", "--moe-token-drop-policy",
    // expressions with their own parsers, checked on every run
    "--moe-layer-freq", "--pipeline-model-parallel-layout", "--window-size", "--window-attn-skip-freq"};

TEST(HostileFlags, EveryValueFlagHasADomainOrIsFreeText) {
  for (const char* command : {"train", "generate", "convert", "model-step", "preprocess", "moe-layer"}) {
    for (const auto& [name, f] : list_flags(command)) {
      if (f.kind != "value" || !f.domain.empty()) continue;
      EXPECT_TRUE(kFreeText.count(name)) << "moecore " << command << " " << name
                                         << " has no domain: declare one with Args::domain (or list it here as text)";
    }
  }
}

// A value just outside "[lo, hi]" / "(lo, hi)" of a numeric domain's description, or "" when unbounded below.
std::string below_range(const std::string& domain) {
  static const std::regex re(R"(([\[(])(-?[0-9.e+]+|-inf), )");
  std::smatch m;
  if (!std::regex_search(domain, m, re) || m[2] == "-inf") return "";
  const double lo = std::stod(m[2]);
  std::ostringstream o;
  o << (m[1] == "(" ? lo : lo - 1);
  return o.str();
}

// Every numeric flag of `moecore train` refuses NaN, infinities, junk, overflowing integers and a value below its
// range at start-up, naming the flag, whether or not the run uses the flag (no MoE, no MLA here).
TEST(HostileFlags, EveryNumericFlagIsRangeCheckedAtStartUp) {
  int checked = 0;
  for (const auto& [name, f] : list_flags("train")) {
    if (f.kind != "value" || f.domain.empty() || f.domain.rfind("one of", 0) == 0) continue;
    std::vector<std::string> bad = {"nan", "inf", "-inf", "abc", "1e999", "1x"};
    if (f.domain.find("integer") != std::string::npos)
      bad.insert(bad.end(), {"1.5", "99999999999999999999"});  // 2^66: no silent saturation at 2^63 - 1
    else
      bad.push_back("1e39");  // beyond float, which the configurations keep
    if (const std::string b = below_range(f.domain); !b.empty()) bad.push_back(b);
    for (const auto& v : bad) {
      const CmdResult r = run_moecore("train --data-path /nonexistent " + name + " " + v);
      EXPECT_EQ(r.status, 1) << name << " " << v << ": " << r.output;
      EXPECT_NE(r.output.find(name), std::string::npos) << name << " " << v << ": " << r.output;
      EXPECT_EQ(r.output.find("internal error"), std::string::npos) << name << " " << v << ": " << r.output;
      ++checked;
    }
  }
  EXPECT_GE(checked, 400);
}

// The reproducers of the issue, one by one.
TEST(HostileFlags, ReportedCasesFailAtStartUpNamingTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--moe-expert-capacity-factor -1", "--moe-expert-capacity-factor"},
      {"--moe-expert-capacity-factor nan", "--moe-expert-capacity-factor"},
      {"--split -1,2,3", "--split"},
      {"--moe-aux-loss-coeff abc", "--moe-aux-loss-coeff"},
      {"--num-layers 99999999999999999999", "--num-layers"},
      {"--generate-tokens 99999999999999999999", "--generate-tokens"},
      {"--lr-wsd-decay-style abc", "--lr-wsd-decay-style"},  // checked although --lr-decay-style is not WSD
      {"--moe-layer-freq abc", "--moe-layer-freq"},          // checked although the model is dense
      {"--seed -1", "--seed"},
  };
  for (const auto& [flags, name] : cases) {
    const CmdResult r = run_moecore("train --data-path /nonexistent --tokenizer-type ByteLevel " + flags);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    EXPECT_NE(r.output.find(name), std::string::npos) << flags << ": " << r.output;
    EXPECT_EQ(r.output.find("internal error"), std::string::npos) << flags << ": " << r.output;
  }
}

class HostileRun : public testing::CliScratch {
 protected:
  HostileRun() : CliScratch("hostile") {}
  void SetUp() override {
    CliScratch::SetUp();
    byte_corpus();
  }
};

// An unwritable --save fails before the first step (not at the first save, after training), naming the flag.
TEST_F(HostileRun, UnwritableOutputPathsFailBeforeTraining) {
  for (const std::string& flag : {std::string("--save /proc/moecore-x"), std::string("--tensorboard-dir /proc/x/tb"),
                                  std::string("--metrics-jsonl /proc/x/m.jsonl")}) {
    const CmdResult r = run_moecore(train_args() + flag);
    EXPECT_EQ(r.status, 1) << flag << ": " << r.output;
    EXPECT_NE(r.output.find(flag.substr(0, flag.find(' '))), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("iteration"), std::string::npos) << "trained before failing: " << r.output;
  }
}

// A model whose parameters, gradients and optimizer state alone exceed the memory available is refused before it is
// built (test_memory_limits.cpp: the whole plan, and inside a memory cgroup).
TEST_F(HostileRun, ModelLargerThanMemoryIsRefusedBeforeAllocating) {
  const CmdResult r = run_moecore(train_args() + "--num-layers 100000 --hidden-size 8192 --num-attention-heads 64");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("parameters per rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("free of the"), std::string::npos) << r.output;
}

#ifdef MOECORE_HAVE_MPI
bool have_mpirun() {
  return std::system("command -v mpirun > /dev/null 2>&1") == 0;
}

// Runs `sh -c SCRIPT` on np ranks (the script sees $OMPI_COMM_WORLD_RANK and ends in `exec moecore ...`). The
// outer `timeout 300` only keeps a broken build from hanging the suite: every case below sets a collective timeout
// or ends by MPI_Abort, and asserts the message of the mechanism that ended it, not a duration.
CmdResult run_ranks(int np, const std::string& script, const std::string& env) {
  return run_shell(env + " timeout 300 env " + testing::mpirun_command(np) + "sh -c '" + script + "'");
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t k = s.find(what); k != std::string::npos; k = s.find(what, k + 1)) ++n;
  return n;
}

// Ranks started with different flags (the issue's reproducer: one alltoall, the other allgather) are caught
// before any other collective: a clear error on every rank naming the flag and both values, no memory error.
TEST_F(HostileRun, MismatchedFlagFailsOnEveryRankNamingIt) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found";
  const std::string script = "d=allgather; [ $OMPI_COMM_WORLD_RANK = 1 ] && d=alltoall; exec " +
                             std::string(MOECORE_BINARY) + " " + train_args() +
                             "--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type $d";
  const CmdResult r = run_ranks(2, script, "MOECORE_COMM_TIMEOUT_S=120");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(count(r.output, "ranks disagree on the configuration"), 2u) << r.output;
  EXPECT_EQ(count(r.output, "--moe-token-dispatcher-type: rank 0 'allgather', rank 1 'alltoall'"), 2u) << r.output;
  EXPECT_EQ(r.output.find("AddressSanitizer"), std::string::npos) << r.output;
}

// One rank fails alone (its --data-path, relative to its own working directory, does not exist: as on a node
// that lacks the files) while the other is healthy: the job ends by MPI_Abort, naming the failing rank, instead of the
// healthy rank waiting forever and the failed one hanging in MPI_Finalize.
TEST_F(HostileRun, RankThatFailsAloneEndsTheJob) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found";
  fs::create_directories(dir_ / "r0");
  fs::create_directories(dir_ / "r1");  // empty: rank 1 has no data
  for (const char* ext : {".bin", ".idx"})
    fs::copy_file(p(std::string("c_text_document") + ext), dir_ / "r0" / (std::string("c_text_document") + ext));
  std::string args = train_args();
  args.replace(args.find(p("c_text_document")), p("c_text_document").size(), "c_text_document");
  const std::string script =
      "cd " + dir_.string() + "/r$OMPI_COMM_WORLD_RANK && exec " + std::string(MOECORE_BINARY) + " " + args;
  // The healthy rank's collective would wait 3600 s: only comm_error_exit's abort ends the job.
  const CmdResult r = run_ranks(2, script, "MOECORE_COMM_TIMEOUT_S=3600");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("error (rank 1 of 2)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("moecore: rank 1 of 2 ends the job (MPI_Abort"), std::string::npos) << r.output;
}

// A rank stopped with SIGSTOP mid-training: its peer's collective times out (MOECORE_COMM_TIMEOUT_S), the error
// names the operation, the group and the iteration, and the job is aborted (the stopped rank included).
TEST_F(HostileRun, StalledRankIsDetectedByTheTimeout) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found";
  std::string args = train_args();
  args.replace(args.find("--train-iters 2"), 15, "--train-iters 1000000");
  const std::string script =
      "[ $OMPI_COMM_WORLD_RANK = 1 ] && (sleep 4; kill -STOP $$) & exec " + std::string(MOECORE_BINARY) + " " + args;
  const CmdResult r = run_ranks(2, script, "MOECORE_COMM_TIMEOUT_S=6");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("timed out after 6 s on rank 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", iteration "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("moecore: rank 0 of 2 ends the job (MPI_Abort"), std::string::npos) << r.output;
}

// A rank killed with SIGKILL mid-training: mpirun ends the job, and the surviving rank says what it was doing.
TEST_F(HostileRun, KilledRankEndsTheJobAndTheSurvivorSaysWhere) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found";
  std::string args = train_args();
  args.replace(args.find("--train-iters 2"), 15, "--train-iters 1000000");
  const std::string script =
      "[ $OMPI_COMM_WORLD_RANK = 1 ] && (sleep 4; kill -KILL $$) & exec " + std::string(MOECORE_BINARY) + " " + args;
  const CmdResult r = run_ranks(2, script, "MOECORE_COMM_TIMEOUT_S=120");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("process rank 1"), std::string::npos) << r.output;  // mpirun names the dead rank
  EXPECT_NE(r.output.find("moecore: rank 0 of 2: SIGTERM after entering "), std::string::npos) << r.output;
}
#endif

}  // namespace
}  // namespace moecore
