// Shared by the tests that run the built `moecore` binary as a user would: a shell runner that captures the
// exit status and output, and a small byte-level corpus preprocessed into Megatron .bin/.idx.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

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

}  // namespace moecore::testing
