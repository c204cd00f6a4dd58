// libFuzzer harness for the COMMIT manifest reader (io::checkpoint_parse_manifest): any input is either a
// manifest or an Error; anything else (another exception, a crash, a sanitizer report, a slow input, a big
// allocation) is a finding. Seeds: fuzz/seeds/checkpoint_manifest/ (COMMIT files as checkpoint_save writes them).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "moecore/core/error.h"
#include "moecore/io/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // Both callers' modes: a directory named for its iteration (iter_0000003) and one that is not.
  for (const std::optional<int64_t> expect : {std::optional<int64_t>(3), std::optional<int64_t>()}) {
    try {
      const moecore::io::CheckpointManifest m =
          moecore::io::checkpoint_parse_manifest(text, "fuzz/iter_0000003/COMMIT", expect);
      if (m.iteration < 0 || m.files.count("state.json") != 1) __builtin_trap();  // the reader's guarantees
    } catch (const moecore::Error&) {
    }
  }
  return 0;
}
