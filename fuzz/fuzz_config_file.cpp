// libFuzzer harness: a `--config FILE` (YAML or JSON mapping of flag names to values) through apps::Args, as every
// subcommand reads it: a few flags of each kind are declared, argv is {"prog", "--config", FILE} (plus one command-
// line flag, which must win), and the parsed values are read back as strings, integers, floats and lists. The first
// input byte picks the file extension (.yaml or .json); the rest is the file. moecore::Error is the expected outcome
// of bad input; anything else is a finding to fix in apps/args.cpp. Seeds (fuzz/seeds/config_file/): small YAML and
// JSON configs written by hand.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/args.h"
#include "fuzz_support.h"
#include "moecore/core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string path = moecore::fuzz::scratch_dir() + ((data[0] & 1) ? "/config.json" : "/config.yaml");
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 1) std::fwrite(data + 1, 1, size - 1, f);
  std::fclose(f);
  try {
    moecore::apps::Args a("fuzz");
    a.option("--num-layers", "", "layers")
        .option("--hidden-size", "", "hidden")
        .option("--lr", "", "learning rate")
        .option("--seq-length", "8", "sequence")
        .option("--tokenizer-type", "", "tokenizer")
        .flag("--swiglu", "gated MLP")
        .flag("--bf16", "bf16")
        .list_option("--data-path", "data")
        .list_option("--moe-aux-loss-coeff", "coefficients");  // Megatron's other flags: the table's fates
    std::string w0 = "fuzz", w1 = "--config", w2 = path, w3 = "--seq-length", w4 = "16";
    std::vector<char*> argv = {w0.data(), w1.data(), w2.data(), w3.data(), w4.data()};
    if (!a.parse(static_cast<int>(argv.size()), argv.data())) return 0;
    if (a.str("--seq-length") != "16") std::abort();  // the command line wins over the file
    for (const char* name : {"--num-layers", "--hidden-size", "--seq-length"}) {
      try {
        (void)a.i64_or(name, -1);
      } catch (const moecore::Error&) {
      }
    }
    try {
      (void)a.f64_or("--lr", -1.0);
    } catch (const moecore::Error&) {
    }
    (void)a.str("--tokenizer-type");
    (void)a.on("--swiglu");
    (void)a.on("--bf16");
    (void)a.list("--data-path");
    (void)a.list("--moe-aux-loss-coeff");
    a.fill_unset("--hidden-size", "64", " in the harness");
  } catch (const moecore::Error&) {
  }
  return 0;
}
