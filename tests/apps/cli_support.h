// Shared by the tests that run the built `moecore` binary as a user would: a shell runner that captures the
// exit status and output, and a small byte-level corpus preprocessed into Megatron .bin/.idx.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"

namespace moecore::testing {

struct CmdResult {
  int status;
  std::string output;  // stdout and stderr together
};

inline CmdResult run_shell(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

// `moecore ARGS`.
inline CmdResult run_moecore(const std::string& args) {
  return run_shell(std::string(MOECORE_BINARY) + " " + args);
}

// The start of a command line that runs np ranks of the built program under mpirun, one OpenMP thread each (the
// ranks share the machine's cores), as every multi-rank CLI test launches them. In the AddressSanitizer build the
// ranks run without LeakSanitizer: Open MPI keeps allocations in plugins it unloads at MPI_Finalize, which LSan
// reports without symbols that a suppression could name; moecore's own leaks are caught by the one-process tests.
inline std::string mpirun_command(int np) {
  std::string env = "OMP_NUM_THREADS=1 ";
  if (kAddressSanitizer) env += "ASAN_OPTIONS=\"${ASAN_OPTIONS}:detect_leaks=0\" ";
  return env + "mpirun --oversubscribe --allow-run-as-root -np " + std::to_string(np) + " ";
}

// One line of `moecore <command> --list-flags`: kind, default, help, domain (empty for free text and switches).
struct FlagLine {
  std::string kind, def, help, domain;
};

inline std::map<std::string, FlagLine> list_flags(const std::string& command) {
  const CmdResult r = run_moecore(command + " --list-flags");
  EXPECT_EQ(r.status, 0) << r.output;
  std::map<std::string, FlagLine> flags;
  std::istringstream in(r.output);
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::stringstream ls(line);
    std::string cell;
    while (std::getline(ls, cell, '\t')) f.push_back(cell);
    EXPECT_GE(f.size(), 3u) << line;
    f.resize(5);  // an empty help or domain leaves no trailing cell
    flags[f[0]] = {f[1], f[2], f[3], f[4]};
  }
  return flags;
}

// Writes `docs` one-line JSONL documents "<text> <i>" under dir and preprocesses them with the ByteLevel
// tokenizer into the prefix dir/c: the data path is dir/c_text_document. A failure is a fatal test failure.
inline void write_byte_corpus(const std::filesystem::path& dir, int docs, const std::string& text) {
  {
    std::ofstream corpus(dir / "corpus.jsonl");
    for (int i = 0; i < docs; ++i) corpus << "{\"text\": \"" << text << " " << i << "\"}\n";
  }
  const CmdResult r = run_moecore("preprocess --input " + (dir / "corpus.jsonl").string() + " --output-prefix " +
                                  (dir / "c").string() + " --tokenizer-type ByteLevel --append-eod --workers 1");
  ASSERT_EQ(r.status, 0) << r.output;
}

// A command-line test's own scratch directory (under the temp directory, named by `tag` and the pid, removed after
// the test), and the small training run most of them start from.
class CliScratch : public ::testing::Test {
 protected:
  explicit CliScratch(const std::string& tag)
      : dir_(std::filesystem::temp_directory_path() / ("moecore_" + tag + "_" + std::to_string(::getpid()))) {}
  void SetUp() override {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  // The dataset c_text_document: 200 short documents, byte-level tokens.
  void byte_corpus() const { write_byte_corpus(dir_, 200, "the quick brown fox jumps over the lazy dog"); }
  // `moecore train` of a 1-layer model for 2 steps on byte_corpus()'s dataset (more flags may follow).
  std::string train_args() const {
    return "train --data-path " + p("c_text_document") +
           " --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
           "--micro-batch-size 2 --train-iters 2 --log-interval 1 --eval-iters 1 --generate-tokens 0 ";
  }
  std::filesystem::path dir_;
};

}  // namespace moecore::testing
