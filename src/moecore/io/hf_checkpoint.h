// Hugging Face checkpoint directories, streamed one tensor at a time: a reader of `model.safetensors.index.json`
// (or a single `model.safetensors`) that lists tensors from the shard headers alone and preads one tensor's byte
// range, with FP8 block-scale dequantisation (DeepSeek-V3's `weight_scale_inv`); and a sharding writer whose
// output appears only when finish() renames a staging directory into place. Not here: HF <-> moecore parameter
// names and config.json keys (model/), whole-file safetensors (io/safetensors.h). Format: docs/formats.md §3.
//
// Memory bound. Reader: the tensor returned, plus one 8 MiB conversion chunk, plus the parsed headers of all
// shards (O(number of tensors)); read_dequantized adds its scale tensor (1/16384 of the weight for 128x128 blocks).
// Writer: one 8 MiB conversion chunk plus the header entries of the open shard and the index (O(number of
// tensors)); the caller's tensor is not copied unless it is non-contiguous. Files are read with pread, never
// mapped, so the page cache does not count as resident memory of the process.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::io {

// One tensor of a checkpoint as its shard header describes it.
struct HfTensorInfo {
  std::string name;
  std::string dtype_name;     // safetensors spelling: "BF16", "F8_E4M3", "F8_E8M0", ...
  std::optional<DType> type;  // empty for dtypes moecore cannot hold (listed, but read() refuses them)
  Shape shape;
  std::string shard;    // file name inside the directory, as the index names it
  uint64_t offset = 0;  // absolute byte offset of the data in the shard file
  uint64_t nbytes = 0;  // byte length of the data
};

// The row width of a tensor in the [rows, width] view of read_rows and of the HF weight map: the last dim
// (1 for 1-D tensors).
int64_t hf_row_width(const Shape& shape);

// Reads an HF model directory. Construction opens every shard and validates every header as the reference
// reader does (docs/formats.md §3.4: tiling offsets, byte sizes, no trailing bytes, no duplicate names) and checks
// the index against the headers: a shard the index names must exist, every tensor the index lists must be in
// its shard, no tensor may be missing from the index or appear twice. Errors name the file, the tensor and the
// expected vs found values. Reads are const and use pread only, so one reader may serve several threads.
class HfCheckpointReader {
 public:
  // `file` set: read that one safetensors file of `dir` (e.g. one file of a moecore checkpoint), no index.
  explicit HfCheckpointReader(const std::string& dir, const std::string& file = "");
  ~HfCheckpointReader();
  HfCheckpointReader(const HfCheckpointReader&) = delete;
  HfCheckpointReader& operator=(const HfCheckpointReader&) = delete;

  const std::string& dir() const { return dir_; }
  bool sharded() const { return sharded_; }  // true when read through model.safetensors.index.json
  const std::vector<HfTensorInfo>& tensors() const { return tensors_; }  // sorted by name
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const HfTensorInfo& info(const std::string& name) const;  // throws naming the tensor and the directory
  uint64_t total_bytes() const;                             // sum of every tensor's nbytes
  std::vector<std::string> files() const;  // the paths of every file read: the index (when sharded) and the shards

  // One tensor as a contiguous CPU tensor of `dtype` (its stored dtype when omitted). Float dtypes convert to
  // float dtypes (round to nearest even; fp8 saturates); integer dtypes only to themselves.
  Tensor read(const std::string& name, std::optional<DType> dtype = std::nullopt) const;
  // Rows [first_row, first_row + rows) of the tensor viewed as [rows, width] (hf_row_width: the last dim; 1-D
  // tensors are rows of one element): a [rows, width] tensor (1-D: [rows]). Reads only those bytes.
  Tensor read_rows(const std::string& name, int64_t first_row, int64_t rows,
                   std::optional<DType> dtype = std::nullopt) const;

  // DeepSeek-V3 block-scaled FP8: when `<name>_scale_inv` exists, `name` must be a 2-D F8_E4M3 [R, C] weight and
  // the scale a float [ceil(R/block_rows), ceil(C/block_cols)] tensor; returns f32 w[r, c] =
  // fp8(w[r, c]) * scale_inv[r / block_rows, c / block_cols] (the stored scale_inv multiplies). Without a scale
  // tensor it returns read(name, f32).
  Tensor read_dequantized(const std::string& name, int64_t block_rows = 128, int64_t block_cols = 128) const;
  bool block_scaled(const std::string& name) const { return contains(name + "_scale_inv"); }

  // Bytes [first, first + n) of a U8 tensor (e.g. MXFP4's packed blocks and scales), which has no moecore dtype.
  std::vector<uint8_t> read_u8(const std::string& name, uint64_t first, uint64_t n) const;
  // GPT-OSS's MXFP4 experts: `<name>_blocks` U8 [lead, C, R / 32, 16] (two FP4 e2m1 values a byte, low nibble first)
  // and `<name>_scales` U8 [lead, C, R / 32] (exponents, bias 127) stand for the tensor `name` [lead, R, C] (stored
  // transposed, as transformers' convert_moe_packed_tensors reads them).
  bool mxfp4(const std::string& name) const {
    return !contains(name) && contains(name + "_blocks") && contains(name + "_scales");
  }
  // Matrix `lead` of an MXFP4 tensor, dequantised: f32 [R, C].
  Tensor read_mxfp4_matrix(const std::string& name, int64_t lead) const;

 private:
  void read_range(const HfTensorInfo& t, uint64_t first, uint64_t n, DType to, void* dst) const;

  std::string dir_;
  bool sharded_ = false;
  std::vector<HfTensorInfo> tensors_;
  std::map<std::string, size_t> index_;   // name -> position in tensors_
  std::map<std::string, int> shard_fds_;  // shard file name -> open descriptor
};

// Writes one safetensors file tensor by tensor, each tensor in one piece (add) or in parts (begin, then append
// until its elements are all there). The data goes to `<path>.spill` as it arrives; finish() writes the header and
// copies the data behind it in sorted order (copy_file_range, no user-space buffer), so the bytes are exactly
// safetensors_serialize()'s of the same tensors. Memory: one 8 MiB conversion chunk plus the header entries.
// The destructor removes the spill file, and the output when finish() was not reached. Not thread-safe.
class SafetensorsStreamWriter {
 public:
  explicit SafetensorsStreamWriter(std::string path);
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  void begin(const std::string& name, DType dtype, const Shape& shape);
  void append(const Tensor& part);  // the open tensor's next part.numel() elements, converted (float <-> float)
  void add(const std::string& name, const Tensor& t, std::optional<DType> dtype = std::nullopt);
  void finish();
  uint64_t bytes() const { return bytes_; }  // data bytes of the tensors begun so far
  bool empty() const { return entries_.empty(); }
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    std::string name;
    DType type;
    Shape shape;
    uint64_t spill_offset, nbytes;
  };
  std::string path_, spill_path_;
  int spill_fd_ = -1;
  std::vector<Entry> entries_;  // in arrival order
  std::set<std::string> names_;
  uint64_t bytes_ = 0;
  uint64_t pending_ = 0;  // elements the open tensor still lacks
  bool finished_ = false;
};

// Writes an HF model directory tensor by tensor. Tensors go to shards in the order they are added: a new shard
// starts when the next tensor would take the open one past max_shard_bytes (a tensor larger than the limit gets a
// shard of its own). Inside a shard the bytes are exactly those of safetensors_serialize() of the shard's
// tensors (sorted by dtype alignment, then name; {"format":"pt"} metadata), so file names, offsets and bytes
// match Hugging Face's own writer for the same shard assignment. Each tensor's data is appended to a spill file
// of the open shard as it arrives; when the shard closes, its header is written and the data copied behind it
// in sorted order (copy_file_range, no user-space buffer). Shards are named model-0000i-of-0000N.safetensors and
// listed in model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}, sorted keys, indent 2);
// a checkpoint of one shard is written as model.safetensors without an index, as save_pretrained does, unless
// index_for_one_shard is set. Everything is staged in `<out_dir>.tmp-<pid>-<n>` beside out_dir and renamed into
// place by finish(); the destructor of an unfinished writer (an exception) removes the staging directory, so
// out_dir never exists half-written. out_dir must not exist, or be an empty directory. Not thread-safe.
class HfCheckpointWriter {
 public:
  explicit HfCheckpointWriter(std::string out_dir, uint64_t max_shard_bytes = 5ull << 30,
                              bool index_for_one_shard = false);
  ~HfCheckpointWriter();
  HfCheckpointWriter(const HfCheckpointWriter&) = delete;
  HfCheckpointWriter& operator=(const HfCheckpointWriter&) = delete;

  // Appends one CPU tensor, converted to out_dtype (its own dtype when omitted; float <-> float only).
  void add(const std::string& name, const Tensor& t, std::optional<DType> out_dtype = std::nullopt);
  // The same in parts: begin(), then append() parts (converted to dtype) until the tensor is complete.
  void begin(const std::string& name, DType dtype, const Shape& shape);
  void append(const Tensor& part);
  void set_config_json(std::string text) { add_text_file("config.json", std::move(text)); }
  void add_text_file(const std::string& file_name, std::string text);  // e.g. generation_config.json
  // Closes the last shard, renames shards to their final names, writes the index, fsyncs, and renames the
  // staging directory to out_dir. Returns the number of shards.
  int finish();
  uint64_t total_bytes() const { return total_bytes_; }

 private:
  void close_shard();

  std::string out_dir_, stage_dir_;
  uint64_t max_shard_bytes_;
  bool index_for_one_shard_;
  bool finished_ = false;
  std::unique_ptr<SafetensorsStreamWriter> shard_;  // the open shard
  int shards_ = 0;                                  // closed shards
  std::map<std::string, int> weight_map_;           // name -> shard number (1-based)
  uint64_t total_bytes_ = 0;
};

}  // namespace moecore::io
