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

#include "fuzz_support.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moecore::fuzz::scratch_dir() + "/x.safetensors";
  moecore::fuzz::write_bytes(path, std::string_view(reinterpret_cast<const char*>(data), size));
  try {
    const moecore::io::SafetensorsFile f = moecore::io::safetensors_load(path);
    for (const auto& [name, t] : f.tensors) (void)t.nbytes();
  } catch (const moecore::Error&) {
  }
  try {
    const moecore::io::HfCheckpointReader r(moecore::fuzz::scratch_dir(), "x.safetensors");
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
