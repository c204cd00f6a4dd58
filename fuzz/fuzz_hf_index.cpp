// libFuzzer harness: a Hugging Face model directory read through io::HfCheckpointReader: the input is split at each
// "\n@@@@\n" into model.safetensors.index.json, model-00001-of-00002.safetensors and model-00002-of-00002.safetensors
// (a missing part: no such file), then every tensor is listed and read (as stored, as f32, its first row, and
// block-dequantised when it has a *_scale_inv). moecore::Error is the expected outcome of bad input; anything else is
// a finding to fix in the reader. Seeds (fuzz/seeds/hf_index/): two-shard checkpoints of io::HfCheckpointWriter,
// one with an FP8 weight and its scale.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "moecore/io/hf_checkpoint.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* const kFiles[] = {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors"};
  constexpr std::string_view kSep = "\n@@@@\n";
  std::string_view in(reinterpret_cast<const char*>(data), size);
  for (const char* name : kFiles) {
    const std::string path = moecore::fuzz::scratch_dir() + "/" + name;
    if (in.data() == nullptr) {
      std::error_code ec;
      fs::remove(path, ec);
      continue;
    }
    const size_t cut = in.find(kSep);
    moecore::fuzz::write_bytes(path, in.substr(0, cut));
    in = cut == std::string_view::npos ? std::string_view() : in.substr(cut + kSep.size());
  }
  try {
    const moecore::io::HfCheckpointReader r(moecore::fuzz::scratch_dir());
    (void)r.total_bytes();
    for (const auto& t : r.tensors()) {
      try {
        (void)r.read(t.name);
        if (t.type && moecore::dtype_is_float(*t.type)) (void)r.read(t.name, moecore::DType::f32);
        const int64_t width = moecore::io::hf_row_width(t.shape);
        if (width > 0 && t.shape.numel() / width > 0) (void)r.read_rows(t.name, 0, 1);
        if (r.block_scaled(t.name)) (void)r.read_dequantized(t.name);
      } catch (const moecore::Error&) {
      }
    }
  } catch (const moecore::Error&) {
  }
  return 0;
}
