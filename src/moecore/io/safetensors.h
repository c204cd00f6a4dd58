// Hugging Face safetensors files: read (validated as the reference reader does) and write (byte layout of
// the reference writer: tensors sorted by dtype alignment then name, compact JSON, header padded to 8).
// Format details and test vectors: ../shared/docs/formats.md §3. Not here: HF name mapping (io/hf_*).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::io {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;        // CPU tensors, contiguous
  std::map<std::string, std::string> metadata;  // "__metadata__" (string -> string)
};

// Throws Error naming the file and the reason (bad header, offsets that do not tile, unsupported dtype...).
SafetensorsFile safetensors_load(const std::string& path);
// Writes atomically (temporary file, fsync, rename). metadata gets {"format": "pt"} unless given.
void safetensors_save(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      std::map<std::string, std::string> metadata = {});
// The serialized bytes (for tests and for writers that frame the file themselves).
std::string safetensors_serialize(const std::map<std::string, Tensor>& tensors,
                                  std::map<std::string, std::string> metadata = {});

const char* safetensors_dtype_name(DType t);  // "F32", "BF16", ...

}  // namespace moecore::io
