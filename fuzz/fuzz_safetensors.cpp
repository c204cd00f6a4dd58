// libFuzzer harness: one safetensors file, header and payload, through both readers: io::safetensors_load (whole
// file) and io::HfCheckpointReader (headers, then pread of each tensor, as read and converted to f32).
// moecore::Error is the expected outcome of bad input; anything else is a finding to fix in the reader.
// Seeds (fuzz/seeds/safetensors/): small files of io::safetensors_save (one per dtype family, an empty tensor,
// metadata).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "moecore/io/hf_checkpoint.h"
#include "moecore/io/safetensors.h"

namespace {

const std::string& temp_dir() {
  static const std::string dir = [] {
    const auto d = std::filesystem::temp_directory_path() / ("moecore_fuzz_safetensors_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  return dir;
}

void write(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = temp_dir() + "/x.safetensors";
  write(path, data, size);
  try {
    const moecore::io::SafetensorsFile f = moecore::io::safetensors_load(path);
    for (const auto& [name, t] : f.tensors) (void)t.nbytes();
  } catch (const moecore::Error&) {
  }
  try {
    const moecore::io::HfCheckpointReader r(temp_dir(), "x.safetensors");
    for (const auto& t : r.tensors()) {
      try {
        (void)r.read(t.name);
        if (t.type && moecore::dtype_is_float(*t.type)) (void)r.read(t.name, moecore::DType::f32);
        const int64_t width = moecore::io::hf_row_width(t.shape);
        if (width > 0 && t.shape.numel() / width > 0) (void)r.read_rows(t.name, 0, 1);
      } catch (const moecore::Error&) {
      }
    }
  } catch (const moecore::Error&) {
  }
  return 0;
}
