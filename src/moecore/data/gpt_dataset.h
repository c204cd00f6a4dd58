// Megatron-Core GPTDataset and BlendedDataset, index for index: split strings, per-split epochs,
// document/sample/shuffle indices built with numpy RandomState-compatible shuffles, sample retrieval
// with the seq_length+1 convention, and the greedy blending of several datasets (docs/formats.md §2).
// Indices are rebuilt in memory on every start (cheap); Megatron's .npy index cache is not written.
// Not here: attention masks and position ids (reset flags), which the trainer derives from the tokens.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moecore/data/indexed_dataset.h"

namespace moecore::data {

enum class Split : int { train = 0, valid = 1, test = 2 };
const char* split_name(Split s);  // "train", "valid", "test"

inline constexpr const char* kLegacySplit = "969, 30, 1";  // Megatron's default when --split is absent

// numpy.sum over float64 (pairwise, blocks of 8 up to 128; checked against numpy 1.24), so normalized
// weights match Megatron bit for bit.
double numpy_pairwise_sum(const double* a, int64_t n);
// Megatron utils.normalize: w / numpy.sum(w).
std::vector<double> weights_normalize(std::span<const double> w);

// parse_and_normalize_split: every run of [.0-9]+ parsed as a float, zero-padded to 3, normalized.
// Throws Error for no numbers, more than 3, a negative/unparsable run, or an all-zero split.
std::array<double, 3> split_parse(const std::string& split);
// convert_split_vector_to_split_matrix: cumulative bookends (lo, hi); nullopt where hi <= lo.
using SplitBookends = std::array<std::optional<std::pair<double, double>>, 3>;
SplitBookends split_matrix(const std::array<double, 3>& weights);
// Sequence range [begin, end) of each split over num_sequences: int(round(x * N)), ties to even.
using SplitRanges = std::array<std::optional<std::pair<int64_t, int64_t>>, 3>;
SplitRanges split_ranges(const SplitBookends& matrix, int64_t num_sequences);

// numpy.random.RandomState(seed) restricted to what GPTDataset consumes: MT19937 with init_genrand
// seeding, and the legacy shuffle (Fisher-Yates from the end, bounded draws by mask rejection).
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}
  uint32_t next_uint32() { return static_cast<uint32_t>(mt_()); }
  uint64_t next_uint64();                  // high word drawn first
  uint64_t random_interval(uint64_t max);  // uniform in [0, max]
  template <class T>
  void shuffle(std::span<T> x) {
    for (int64_t i = static_cast<int64_t>(x.size()) - 1; i >= 1; --i) {
      const uint64_t j = random_interval(static_cast<uint64_t>(i));
      std::swap(x[static_cast<size_t>(i)], x[static_cast<size_t>(j)]);
    }
  }

 private:
  std::mt19937 mt_;
};

struct GptDatasetConfig {
  int64_t seq_length = 0;                    // L, tokens per sample (--seq-length), e.g. 4096; must be > 1
  uint32_t seed = 1234;                      // --seed; each split's RandomState starts from it
  bool add_extra_token = true;               // x = 1: a sample reads L+1 tokens (inputs and shifted labels)
  bool drop_last_partial_validation = true;  // false: the valid split keeps a padded final sample
  int32_t pad_id = -1;                       // pad token id; -1 when the tokenizer has none (docs/formats.md §2.8)
  int32_t eod_id = -1;                       // end-of-document id, used by eod_mask_loss
  bool eod_mask_loss = false;                // --eod-mask-loss: loss_mask = 0 where tokens == eod_id
  int64_t vocab_size = 0;  // token ids read from .bin must lie in [0, vocab_size) (Error otherwise); 0: only >= 0
};

// The three Megatron index arrays of one split (docs/formats.md §2.5-§2.7).
struct GptIndices {
  int64_t tokens_per_epoch = 0;  // T: tokens in the exposed sequences
  int32_t num_epochs = 0;
  bool separate_final_epoch = false;
  int64_t num_samples_sans_final_epoch = 0;  // size of the first shuffle range
  std::vector<int32_t> document_index;       // [num_epochs * D] sequence ids (absolute), shuffled
  std::vector<int64_t> sample_index;         // [(n + 1) * 2] row k = (position in document_index, offset)
  std::vector<int64_t> shuffle_index;        // [n] sample ids
  int64_t num_samples() const { return static_cast<int64_t>(sample_index.size() / 2) - 1; }
};

// Builds the indices for exposed sequences first_sequence + [0, sizes.size()) with lengths `sizes`.
// num_samples = nullopt means one epoch (Megatron None). Throws Error when the split holds too few tokens.
GptIndices gpt_build_indices(std::span<const int32_t> sizes, int64_t first_sequence, std::optional<int64_t> num_samples,
                             int64_t seq_length, uint32_t seed, bool add_extra_token, bool drop_last_partial);

// helpers.cpp::build_sample_idx: rows [(n + 1) * 2] over a given document_index; sizes are the lengths of
// sequences first_sequence + [0, sizes.size()). n = (E*T - x) / L, or the float ceil when !drop_last_partial.
std::vector<int64_t> gpt_build_sample_index(std::span<const int32_t> sizes, int64_t first_sequence,
                                            std::span<const int32_t> document_index, int64_t seq_length,
                                            int32_t num_epochs, int64_t tokens_per_epoch, bool drop_last_partial,
                                            bool add_extra_token);

// A source of [S] training samples (S = seq_length()): tokens, labels (tokens shifted by one) and the loss mask, with
// pads already replaced by 0 and masked. get() is const and thread-safe.
class GptSampleSource {
 public:
  virtual ~GptSampleSource() = default;
  virtual size_t size() const = 0;
  virtual int64_t seq_length() const = 0;
  // tokens, labels [S] i32; loss_mask [S] f32 or nullptr. i in [0, size()). A token id outside the vocabulary
  // (GptDatasetConfig::vocab_size) raises Error naming the dataset and sequence.
  virtual void get(int64_t i, int32_t* tokens, int32_t* labels, float* loss_mask) const = 0;
  void get(int64_t i, int32_t* tokens, int32_t* labels) const { get(i, tokens, labels, nullptr); }
};

// GPTDataset over one split of one indexed dataset.
class GptDataset : public GptSampleSource {
 public:
  GptDataset(std::shared_ptr<const IndexedDataset> data, Split split, int64_t begin, int64_t end,
             std::optional<int64_t> num_samples, const GptDatasetConfig& config);
  using GptSampleSource::get;
  size_t size() const override { return indices_.shuffle_index.size(); }
  int64_t seq_length() const override { return config_.seq_length; }
  void get(int64_t i, int32_t* tokens, int32_t* labels, float* loss_mask) const override;
  // The raw L+x token window of sample i (shuffled order), pad_id where the sample ran short.
  void get_text(int64_t i, int32_t* text) const;
  const GptIndices& indices() const { return indices_; }
  Split split() const { return split_; }
  std::optional<int64_t> num_samples_requested() const { return num_samples_; }

 private:
  std::shared_ptr<const IndexedDataset> data_;
  Split split_;
  std::optional<int64_t> num_samples_;
  GptDatasetConfig config_;
  GptIndices indices_;
};

// build_blending_indices: sample s goes to argmax_d(w_d * max(s, 1) - count_d), first index on ties.
struct BlendIndices {
  std::vector<int16_t> dataset_index;         // [size] which dataset
  std::vector<int64_t> dataset_sample_index;  // [size] which sample of it
};
BlendIndices blend_build_indices(std::span<const double> weights, int64_t size);
// build_exhaustive_blending_indices: exactly sizes[d] samples from dataset d, interleaved greedily.
BlendIndices blend_build_exhaustive_indices(std::span<const int64_t> sizes);

// --data-path: prefixes, or "w1 p1 w2 p2 ..." when the list has even length and every odd word
// (1st, 3rd, ...) parses as a float. Weights are returned as given (not normalized); empty = none.
struct DataPathBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;
};
DataPathBlend blend_parse(std::span<const std::string> data_path);

// BlendedDataset: with size, weights are normalized and blend_build_indices(weights, size) is used;
// without size, weights are integer sample counts per dataset (exhaustive). Throws Error when a
// constituent is asked for more samples than it holds.
class BlendedGptDataset : public GptSampleSource {
 public:
  BlendedGptDataset(std::vector<std::shared_ptr<const GptSampleSource>> datasets, std::vector<double> weights,
                    std::optional<int64_t> size);
  using GptSampleSource::get;
  size_t size() const override { return indices_.dataset_index.size(); }
  int64_t seq_length() const override { return datasets_.front()->seq_length(); }
  void get(int64_t i, int32_t* tokens, int32_t* labels, float* loss_mask) const override;
  const BlendIndices& indices() const { return indices_; }
  const std::vector<double>& weights() const { return weights_; }

 private:
  std::vector<std::shared_ptr<const GptSampleSource>> datasets_;
  std::vector<double> weights_;
  BlendIndices indices_;
};

// Megatron training.py sample counts per split (docs/formats.md §2.2): train = train_iters * gbs,
// valid = (train_iters / eval_interval + 1) * eval_iters * gbs, test = eval_iters * gbs. eval_interval 0 (no
// --eval-interval: one validation, at the end) sizes the valid split for one evaluation.
std::array<int64_t, 3> gpt_split_num_samples(int64_t train_iters, int64_t global_batch_size, int64_t eval_interval,
                                             int64_t eval_iters);

struct GptDataSourceConfig {
  std::vector<std::string> data_path;                 // --data-path words: "p1 p2 ..." or "w1 p1 w2 p2 ..."
  std::string split = kLegacySplit;                   // --split, e.g. "99990,8,2"
  std::array<std::optional<int64_t>, 3> num_samples;  // train/valid/test; nullopt = one epoch
  GptDatasetConfig dataset;                           // sequence length, seed, pad/eod handling
  double mid_level_dataset_surplus = 0.005;           // --mid-level-dataset-surplus: extra samples built per prefix
};

// BlendedMegatronDatasetBuilder for one blend shared by all splits: builds train/valid/test from the
// prefixes (each split independently per prefix), blending when there are several prefixes or weights.
// A split is absent (nullptr) when its share of the split string is zero or 0 samples were requested.
class GptDataSource {
 public:
  explicit GptDataSource(const GptDataSourceConfig& config);
  const GptSampleSource* get(Split s) const { return splits_[static_cast<int>(s)].get(); }
  const GptSampleSource* train() const { return get(Split::train); }
  const GptSampleSource* valid() const { return get(Split::valid); }
  const GptSampleSource* test() const { return get(Split::test); }
  // Human-readable lines: prefixes, weights, split ranges, samples and epochs per split.
  const std::string& summary() const { return summary_; }

 private:
  std::array<std::shared_ptr<const GptSampleSource>, 3> splits_;
  std::string summary_;
};

}  // namespace moecore::data
