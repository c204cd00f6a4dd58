// A text corpus tokenized at the byte level (vocabulary 256, no files needed), split into train and
// validation parts, sampled as [B, S+1] windows from a counter-based stream so that batch i is the same on
// every run and after a resume. Megatron's .bin/.idx datasets and BPE tokenizers live beside it (data/).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::data {

class ByteCorpus {
 public:
  // Reads the whole file; the last valid_fraction of it is the validation split.
  ByteCorpus(const std::string& path, double valid_fraction);
  int64_t train_tokens() const { return split_; }
  int64_t valid_tokens() const { return static_cast<int64_t>(bytes_.size()) - split_; }
  // Fills tokens and labels [B, S] i32 with batch number `index` of the split (labels = tokens shifted).
  void batch(Tensor& tokens, Tensor& labels, bool valid, uint64_t seed, int64_t index) const;
  static std::string decode(const std::vector<int32_t>& ids);

 private:
  std::vector<uint8_t> bytes_;
  int64_t split_ = 0;
};

}  // namespace moecore::data
