// Hugging Face safetensors files: read (validated as the reference reader does) and write (byte layout of
// the reference writer: tensors sorted by dtype alignment then name, compact JSON, header padded to 8).
// The header-level pieces (dtype table, header validation, header serialization, index.json parse) are public
// so that streaming readers and writers (io/hf_checkpoint) share them. Format details and test vectors:
// docs/formats.md §3. Not here: HF name mapping (io/hf_*), file I/O beyond whole files.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
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
// The same bytes written into memory the caller provides: destination(n) returns where the n bytes go (e.g. a buffer
// reused from one checkpoint to the next).
void safetensors_serialize_to(const std::map<std::string, Tensor>& tensors,
                              const std::function<char*(size_t bytes)>& destination,
                              std::map<std::string, std::string> metadata = {});

// ---- Header level ------------------------------------------------------------------------------------------

// One dtype of docs/formats.md §3.2. The table lists every safetensors dtype, also those moecore cannot hold.
struct SafetensorsDtype {
  const char* name;           // exact spelling: "BF16", "F8_E4M3", "F8_E8M0", ...
  int bits;                   // element size in bits (4 for F4, 6 for F6_*)
  int rank;                   // the reference writer's alignment order (§3.3): larger is written first
  std::optional<DType> type;  // empty for dtypes moecore cannot hold
};
const SafetensorsDtype* safetensors_dtype_find(std::string_view name);  // nullptr when not a safetensors dtype
const SafetensorsDtype& safetensors_dtype_of(DType t);                  // throws when t has no safetensors name
const char* safetensors_dtype_name(DType t);                            // "F32", "BF16", ...

// One tensor as a validated header describes it.
struct SafetensorsEntry {
  std::string name;
  std::string dtype_name;     // safetensors spelling, possibly one moecore cannot hold
  std::optional<DType> type;  // empty for such dtypes
  Shape shape;
  uint64_t begin = 0, end = 0;  // data_offsets: [begin, end) relative to the byte buffer (file offset 8 + N)
};
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;        // sorted by name
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// N, the header length, from the file's first min(8, file_size) bytes `head` and the file size. Checks the
// size bounds of docs/formats.md §3.4 (at least 8 bytes, 2 <= N <= 100000000, 8 + N <= file size).
uint64_t safetensors_header_size(const std::string& path, std::string_view head, uint64_t file_size);
// Parses and validates the JSON header (the N bytes after the length) against a byte buffer of `data_bytes`
// (file size - 8 - N) with every rule of docs/formats.md §3.4: UTF-8 text starting with '{', strict JSON (nesting at
// most 128 deep) without duplicate keys, string-only __metadata__ (or null), known dtypes, shapes whose element and
// byte counts fit in 63 bits (checked multiplication) and agree with begin <= end, offsets that tile the buffer
// exactly (sorted by (begin, end)). Errors name `path` ("safetensors: '<path>' is not a valid safetensors file:
// <reason>").
SafetensorsHeader safetensors_parse_header(const std::string& path, std::string_view header_json, uint64_t data_bytes);

// What a writer needs to lay out one file: name, dtype and shape of each tensor.
struct SafetensorsTensorSpec {
  std::string name;
  DType type;
  Shape shape;
};
struct SafetensorsLayout {
  std::string header;           // the file's first bytes: u64 LE N, compact JSON, spaces up to a multiple of 8
  std::vector<size_t> order;    // positions in the input, in the order their data must follow the header
  std::vector<uint64_t> begin;  // data offset of each tensor of `order` (parallel to it)
  uint64_t data_bytes = 0;      // length of the byte buffer
};
// The reference writer's layout (§3.3): tensors sorted by dtype alignment (larger first) then name, contiguous
// offsets from 0, __metadata__ first. metadata gets {"format": "pt"} unless given.
SafetensorsLayout safetensors_serialize_header(const std::vector<SafetensorsTensorSpec>& tensors,
                                               std::map<std::string, std::string> metadata = {});

// The weight_map of a sharded checkpoint's model.safetensors.index.json (§3.5): tensor name -> shard file name.
// Strict JSON as for headers; each shard must be a plain file name beside the index (no '/', "." or "..", no
// control characters), so an index cannot point outside its directory. Errors name `path`.
std::map<std::string, std::string> safetensors_index_parse(const std::string& path, std::string_view text);

}  // namespace moecore::io
