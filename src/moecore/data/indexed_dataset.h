// Megatron-LM indexed datasets: `<prefix>.bin` (raw token ids of one dtype) + `<prefix>.idx` (version 1:
// magic, dtype code, sequence lengths, byte pointers, document boundaries). Byte layout and test vector:
// docs/formats.md §1. The writer streams .bin and commits .idx last (the commit marker); the reader
// memory-maps both and validates them. Not here: GPT sample building (gpt_dataset.h), tokenization.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moecore::data {

// Token dtype codes written at .idx offset 17 (docs/formats.md §1.3; numpy dtype in the comment).
enum class TokenDType : uint8_t {
  u8 = 1,   // uint8
  i8 = 2,   // int8
  i16 = 3,  // int16
  i32 = 4,  // int32
  i64 = 5,  // int64
  f64 = 6,  // float64
  f32 = 7,  // float32
  u16 = 8,  // uint16
};

int token_dtype_size(TokenDType t);          // bytes per token: 1, 2, 4 or 8
const char* token_dtype_name(TokenDType t);  // numpy spelling: "uint16", "int32", ...
bool token_dtype_valid(uint8_t code);        // code in 1..8
// Megatron's DType.optimal_dtype: uint16 when vocab_size < 65500, otherwise int32.
TokenDType token_dtype_optimal(int64_t vocab_size);

inline constexpr char kIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kIdxVersion = 1;
inline constexpr int64_t kIdxHeaderBytes = 34;  // magic 9 + version 8 + dtype 1 + S 8 + D 8

// "<prefix>.bin" / "<prefix>.idx".
std::string indexed_bin_path(const std::string& prefix);
std::string indexed_idx_path(const std::string& prefix);

// Writes one dataset. Tokens stream into a temporary file beside `bin_path`; finalize() fsyncs and renames
// it into place, then writes the .idx atomically (the .idx is the commit marker: a crash before it leaves
// no .idx, and an old .idx is removed before the new .bin lands). Not thread-safe; one writer per dataset.
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(std::string bin_path, TokenDType dtype);
  ~IndexedDatasetBuilder();  // discards the temporary .bin when finalize() was not reached
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  // Megatron add_document(tokens, lengths): the tokens of all sequences of one document, then the length
  // of each sequence (sum(lengths) == tokens.size()). Empty lengths add an empty document (no sequence).
  void add_document(std::span<const int32_t> tokens, std::span<const int32_t> lengths);
  // Document-level convenience: one sequence holding all tokens (none when tokens is empty).
  void add_document(std::span<const int32_t> tokens);
  // Sentence-level: add_item() appends one sequence; end_document() closes the current document.
  void add_item(std::span<const int32_t> tokens);
  void end_document();
  // Megatron add_index: appends every sequence and document of another dataset of the same dtype.
  void add_index(const std::string& prefix);
  // Writes .bin then .idx (idx_path, usually "<prefix>.idx"). The builder is unusable afterwards.
  void finalize(const std::string& idx_path);

  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }

 private:
  void write_tokens(std::span<const int32_t> tokens);
  void write_bytes(const char* p, size_t n);
  void flush();

  std::string bin_path_, tmp_path_;
  TokenDType dtype_;
  int fd_ = -1;
  std::vector<char> buffer_;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> document_indices_{0};
  bool finalized_ = false;
};

// The .idx bytes for the given arrays (pointers are derived from the lengths); used by finalize().
std::string indexed_idx_serialize(TokenDType dtype, std::span<const int32_t> sequence_lengths,
                                  std::span<const int64_t> document_indices);

// Read-only view of a dataset, both files memory-mapped. The constructor checks the whole index in one
// sequential pass (docs/reliability-practices.md §5): magic, version, dtype code; 34 + 12 S + 8 D == the .idx size;
// sizes >= 0; pointers[0] == 0 and pointers[i] == pointers[i-1] + sizes[i-1] * itemsize (so a wrong dtype code is
// caught); the bytes they cover == the .bin size; document_indices start at 0, never decrease and end at S. A failure
// throws Error naming the file, the field, the expected and the actual value. int64/float tokens that are not
// int32 values raise Error when read. The .idx arrays are unaligned (offset 34), so accessors copy with memcpy.
// All methods are const and thread-safe.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }                  // S
  int64_t num_documents() const { return num_documents_; }                  // D - 1
  int32_t sequence_length(int64_t i) const;                                 // tokens of sequence i
  int64_t sequence_pointer(int64_t i) const;                                // byte offset of sequence i in .bin
  int64_t document_index(int64_t d) const;                                  // boundary d in [0, D]
  std::vector<int32_t> sequence_lengths(int64_t begin, int64_t end) const;  // lengths of [begin, end)
  int64_t bin_bytes() const { return bin_size_; }

  // Tokens [offset, offset + length) of sequence i, converted to int32, into out[length].
  void read(int64_t i, int64_t offset, int64_t length, int32_t* out) const;
  // Megatron get(idx, offset, length): length < 0 means "to the end of the sequence".
  std::vector<int32_t> get(int64_t i, int64_t offset = 0, int64_t length = -1) const;

 private:
  friend class IndexedDatasetBuilder;  // add_index copies straight from the mapping
  std::string prefix_;
  TokenDType dtype_ = TokenDType::u16;
  int64_t num_sequences_ = 0, num_documents_ = 0;
  const unsigned char* idx_ = nullptr;
  int64_t idx_size_ = 0;
  const unsigned char* bin_ = nullptr;
  int64_t bin_size_ = 0;
};

}  // namespace moecore::data
