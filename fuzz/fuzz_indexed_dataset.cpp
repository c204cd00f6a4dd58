// libFuzzer harness for the Megatron .bin/.idx reader (IndexedDataset) and what reads through it: every
// sequence, sub-ranges, add_index, and a GptDataset's first samples. Input layout: a little-endian uint32 n,
// then the .idx bytes (n of them, or all that remain), then the .bin bytes, so mutations reach both files.
// Seeds: fuzz/seeds/indexed_dataset/, valid datasets (u8, u16, i32, i64, f32, empty) in this layout, written by a
// few lines of Python following docs/formats.md §1.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "fuzz_support.h"
#include "moecore/core/error.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/data/indexed_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::data;
  if (size < 4) return 0;
  uint32_t n;
  std::memcpy(&n, data, 4);
  const size_t idx_bytes = std::min<size_t>(n, size - 4);
  const std::string prefix = moecore::fuzz::scratch_dir() + "/d";
  moecore::fuzz::write_bytes(indexed_idx_path(prefix),
                             std::string_view(reinterpret_cast<const char*>(data) + 4, idx_bytes));
  moecore::fuzz::write_bytes(
      indexed_bin_path(prefix),
      std::string_view(reinterpret_cast<const char*>(data) + 4 + idx_bytes, size - 4 - idx_bytes));
  try {
    auto ds = std::make_shared<const IndexedDataset>(prefix);
    int64_t sum = 0;
    for (int64_t i = 0; i < ds->num_sequences(); ++i) {
      const std::vector<int32_t> t = ds->get(i);
      for (int32_t v : t) sum += v;
      if (t.size() > 2) sum += ds->get(i, 1, static_cast<int64_t>(t.size()) - 2).size();
    }
    for (int64_t d = 0; d <= ds->num_documents(); ++d) sum += ds->document_index(d);
    sum += static_cast<int64_t>(ds->sequence_lengths(0, ds->num_sequences()).size());
    {
      IndexedDatasetBuilder merged(moecore::fuzz::scratch_dir() + "/m.bin", ds->dtype());
      merged.add_index(prefix);
    }  // not finalized: the temporary .bin is removed
    GptDatasetConfig cfg;
    cfg.seq_length = 4;
    cfg.vocab_size = 50257;
    GptDataset gpt(ds, Split::train, 0, ds->num_sequences(), std::nullopt, cfg);
    int32_t tokens[4], labels[4];
    float mask[4];
    for (int64_t i = 0; i < std::min<int64_t>(static_cast<int64_t>(gpt.size()), 16); ++i) {
      gpt.get(i, tokens, labels, mask);
      sum += tokens[0] + labels[3];
    }
    if (sum == 42) std::memset(tokens, 0, sizeof tokens);  // keeps the reads observable
  } catch (const moecore::Error&) {
    // The expected outcome of a corrupt file.
  }
  return 0;
}
