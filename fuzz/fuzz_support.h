// Shared by the libFuzzer harnesses of fuzz/: a scratch folder of this process for readers that take paths, and a
// byte-exact file writer.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace moecore::fuzz {

// <tmp>/moecore_fuzz_<pid>/, made once; the harness reuses it for every input.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const auto d = std::filesystem::temp_directory_path() / ("moecore_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  return dir;
}

// Replaces `path` with exactly `bytes`; a failure here is the harness's, not the reader's: abort.
inline void write_bytes(const std::string& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

}  // namespace moecore::fuzz
