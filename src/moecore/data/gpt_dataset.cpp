// GPTDataset / BlendedDataset index building and sample retrieval, ported from Megatron-Core
// (gpt_dataset.py, helpers.cpp, blended_dataset.py, blended_megatron_dataset_builder.py). Arithmetic keeps
// Megatron's types where they change results: float for the ceil in build_sample_idx, double elsewhere.
#include "moecore/data/gpt_dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>

#include "moecore/core/error.h"
#include "moecore/core/memory.h"

namespace moecore::data {
namespace {

// Python float(): the whole word (surrounding spaces allowed) must be one number.
bool parse_python_float(const std::string& word, double& out) {
  const char* b = word.c_str();
  while (*b == ' ' || *b == '\t') ++b;
  if (*b == '\0') return false;
  char* e = nullptr;
  out = std::strtod(b, &e);
  if (e == b) return false;
  while (*e == ' ' || *e == '\t') ++e;
  return *e == '\0';
}

std::string strip(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

}  // namespace

const char* split_name(Split s) {
  switch (s) {
    case Split::train:
      return "train";
    case Split::valid:
      return "valid";
    case Split::test:
      return "test";
  }
  return "?";
}

double numpy_pairwise_sum(const double* a, int64_t n) {
  if (n < 8) {
    double res = 0.;
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return numpy_pairwise_sum(a, n2) + numpy_pairwise_sum(a + n2, n - n2);
}

std::vector<double> weights_normalize(std::span<const double> w) {
  const double sum = numpy_pairwise_sum(w.data(), static_cast<int64_t>(w.size()));
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] / sum;
  return out;
}

std::array<double, 3> split_parse(const std::string& split) {
  std::vector<double> values;
  for (size_t i = 0; i < split.size();) {
    if (split[i] != '.' && (split[i] < '0' || split[i] > '9')) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < split.size() && (split[j] == '.' || (split[j] >= '0' && split[j] <= '9'))) ++j;
    const std::string run = split.substr(i, j - i);
    double v = 0;
    if (!parse_python_float(run, v)) {
      MOECORE_FAIL("gpt_dataset: --split '", split, "': '", run, "' is not a number; use e.g. \"969,30,1\"");
    }
    values.push_back(v);
    i = j;
  }
  if (values.empty() || values.size() > 3) {
    MOECORE_FAIL("gpt_dataset: --split '", split, "' must hold 1 to 3 numbers (train, valid, test), found ",
                 values.size(), "; e.g. \"969,30,1\"");
  }
  values.resize(3, 0.0);
  if (numpy_pairwise_sum(values.data(), 3) <= 0) {
    MOECORE_FAIL("gpt_dataset: --split '", split, "' sums to zero; give at least one positive share");
  }
  const std::vector<double> n = weights_normalize(values);
  return {n[0], n[1], n[2]};
}

SplitBookends split_matrix(const std::array<double, 3>& weights) {
  SplitBookends out;
  double lo = 0;
  for (int i = 0; i < 3; ++i) {
    const double hi = lo + weights[i];
    if (!(hi <= lo)) out[i] = std::make_pair(lo, hi);
    lo = hi;
  }
  return out;
}

SplitRanges split_ranges(const SplitBookends& matrix, int64_t num_sequences) {
  SplitRanges out;
  const double n = static_cast<double>(num_sequences);
  for (int i = 0; i < 3; ++i) {
    if (!matrix[i]) continue;
    // nearbyint under the default rounding mode = Python round(): half to even.
    out[i] = std::make_pair(static_cast<int64_t>(std::nearbyint(matrix[i]->first * n)),
                            static_cast<int64_t>(std::nearbyint(matrix[i]->second * n)));
  }
  return out;
}

uint64_t NumpyRandomState::next_uint64() {
  const uint64_t hi = next_uint32();
  return hi << 32 | next_uint32();
}

uint64_t NumpyRandomState::random_interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (next_uint32() & mask)) > max) {
    }
  } else {
    while ((value = (next_uint64() & mask)) > max) {
    }
  }
  return value;
}

std::vector<int64_t> gpt_build_sample_index(std::span<const int32_t> sizes, int64_t first_sequence,
                                            std::span<const int32_t> document_index, int64_t seq_length,
                                            int32_t num_epochs, int64_t tokens_per_epoch, bool drop_last_partial,
                                            bool add_extra_token) {
  const int64_t x = add_extra_token ? 1 : 0;
  MOECORE_CHECK(!document_index.empty() && seq_length > 1, "build_sample_index: ", document_index.size(),
                " documents, seq_length ", seq_length);
  int64_t num_samples = 0;
  if (drop_last_partial) {
    num_samples = (num_epochs * tokens_per_epoch - x) / seq_length;
  } else {
    num_samples = static_cast<int64_t>(
        std::ceil(static_cast<float>(num_epochs * tokens_per_epoch - x) / static_cast<float>(seq_length)));
  }
  auto size_of = [&](int64_t pos) {
    const int64_t seq = document_index[static_cast<size_t>(pos)] - first_sequence;
    MOECORE_CHECK(seq >= 0 && seq < int64_t(sizes.size()), "document_index entry ", seq + first_sequence, " outside [",
                  first_sequence, ", ", first_sequence + int64_t(sizes.size()), ")");
    return int64_t(sizes[static_cast<size_t>(seq)]);
  };
  std::vector<int64_t> out(static_cast<size_t>(2 * (num_samples + 1)));
  const int64_t last = static_cast<int64_t>(document_index.size()) - 1;
  int64_t di = 0, offset = 0;
  out[0] = 0;
  out[1] = 0;
  for (int64_t k = 1; k <= num_samples; ++k) {
    int64_t remaining = seq_length + x;
    while (remaining != 0) {
      const int64_t len = size_of(di) - offset;
      remaining -= len;
      if (remaining <= 0) {
        offset += remaining + len - x;
        remaining = 0;
      } else {
        if (di == last) {
          MOECORE_CHECK(k == num_samples, "gpt_dataset: documents ran out at sample ", k, " of ", num_samples);
          offset = size_of(di) - x;
          break;
        }
        ++di;
        offset = 0;
      }
    }
    out[static_cast<size_t>(2 * k)] = di;
    out[static_cast<size_t>(2 * k + 1)] = offset;
  }
  return out;
}

GptIndices gpt_build_indices(std::span<const int32_t> sizes, int64_t first_sequence, std::optional<int64_t> num_samples,
                             int64_t seq_length, uint32_t seed, bool add_extra_token, bool drop_last_partial) {
  const int64_t x = add_extra_token ? 1 : 0;
  if (seq_length <= 1) MOECORE_FAIL("gpt_dataset: seq_length (", seq_length, ") must be > 1");
  if (num_samples && *num_samples < 0) MOECORE_FAIL("gpt_dataset: num_samples (", *num_samples, ") must be >= 0");
  MOECORE_CHECK(first_sequence >= 0 && first_sequence + int64_t(sizes.size()) <= std::numeric_limits<int32_t>::max(),
                "sequence ids must fit int32: ", first_sequence, " + ", sizes.size());
  GptIndices g;
  for (int32_t s : sizes) g.tokens_per_epoch += s;
  const int64_t t = g.tokens_per_epoch;
  if (t <= 1) {
    MOECORE_FAIL("gpt_dataset: the split holds ", sizes.size(), " sequences with ", t,
                 " tokens; at least 2 are needed (use a larger dataset or a different --split)");
  }
  // Epochs: the fewest whole passes over the split that hold num_samples samples (+ the extra token). The indices
  // are sized by them, so a count no memory holds is refused here, before anything is allocated.
  const int64_t d = static_cast<int64_t>(sizes.size());
  int64_t epochs = 1, need = 0, index_bytes = 0;
  const int64_t ram = memory_physical_bytes();
  const auto too_many = [&](const char* why) {
    MOECORE_FAIL("gpt_dataset: ", *num_samples, " samples of ", seq_length, " tokens from a split of ", d,
                 " sequences (", t, " tokens) ", why,
                 "; hint: lower the number of samples (--train-iters, --global-batch-size, --eval-iters)");
  };
  if (num_samples) {
    if (__builtin_mul_overflow(*num_samples, seq_length, &need) || __builtin_add_overflow(need, x, &need))
      too_many("are more tokens than a 64-bit count holds");
    epochs = need <= t ? 1 : need / t + (need % t != 0);
    if (epochs > std::numeric_limits<int32_t>::max())
      too_many(("need " + std::to_string(epochs) + " epochs, more than Megatron's 32-bit count").c_str());
    // document_index (int32 per sequence and epoch), sample_index (2 x int64) and shuffle_index (int64 per sample)
    int64_t sample_bytes = 0;
    if (__builtin_mul_overflow(epochs, d * 4, &index_bytes) ||
        __builtin_mul_overflow(*num_samples + 1, int64_t{24}, &sample_bytes) ||
        __builtin_add_overflow(index_bytes, sample_bytes, &index_bytes))
      too_many(("need " + std::to_string(epochs) + " epochs and an index beyond 2^63 bytes").c_str());
    if (ram > 0 && index_bytes > ram)
      too_many(("need " + std::to_string(epochs) + " epochs and an index of " + memory_format_bytes(index_bytes) +
                ", more than this machine's " + memory_format_bytes(ram) + " of memory")
                   .c_str());
  }
  g.num_epochs = static_cast<int32_t>(epochs);
  if (epochs > 1) {
    const int64_t sans = ((epochs - 1) * t - x) / seq_length;
    const int64_t final_n = *num_samples - sans;
    const int64_t per = (t - x) / seq_length;
    MOECORE_CHECK(final_n >= 0 && final_n <= per + 1, "final epoch samples ", final_n, " vs per epoch ", per);
    g.separate_final_epoch = final_n < static_cast<int64_t>(0.80 * static_cast<double>(per));
    g.num_samples_sans_final_epoch = sans;
  }

  NumpyRandomState rs(seed);
  auto append_epochs = [&](int64_t n) {
    const size_t at = g.document_index.size();
    for (int64_t e = 0; e < n; ++e) {
      for (int64_t k = 0; k < d; ++k) g.document_index.push_back(static_cast<int32_t>(first_sequence + k));
    }
    rs.shuffle(std::span<int32_t>(g.document_index.data() + at, static_cast<size_t>(n * d)));
  };
  g.document_index.reserve(static_cast<size_t>(epochs * d));
  if (!g.separate_final_epoch) {
    append_epochs(epochs);
  } else {
    append_epochs(epochs - 1);
    append_epochs(1);
  }

  g.sample_index = gpt_build_sample_index(sizes, first_sequence, g.document_index, seq_length, g.num_epochs, t,
                                          drop_last_partial, add_extra_token);
  const int64_t total = g.num_samples();
  const int64_t first = g.separate_final_epoch ? g.num_samples_sans_final_epoch : total;
  if (!g.separate_final_epoch) g.num_samples_sans_final_epoch = total;
  g.shuffle_index.resize(static_cast<size_t>(total));
  for (int64_t k = 0; k < total; ++k) g.shuffle_index[static_cast<size_t>(k)] = k;
  rs.shuffle(std::span<int64_t>(g.shuffle_index.data(), static_cast<size_t>(first)));
  if (first != total) {
    rs.shuffle(std::span<int64_t>(g.shuffle_index.data() + first, static_cast<size_t>(total - first)));
  }
  return g;
}

// ---------------------------------------------------------------------------------------------------
// GptDataset

GptDataset::GptDataset(std::shared_ptr<const IndexedDataset> data, Split split, int64_t begin, int64_t end,
                       std::optional<int64_t> num_samples, const GptDatasetConfig& config)
    : data_(std::move(data)), split_(split), num_samples_(num_samples), config_(config) {
  MOECORE_CHECK(data_ && begin >= 0 && begin <= end && end <= data_->num_sequences(), "split range [", begin, ", ", end,
                ")");
  const std::vector<int32_t> sizes = data_->sequence_lengths(begin, end);
  int64_t tokens = 0;
  for (int32_t s : sizes) tokens += s;
  if (tokens <= 1) {
    MOECORE_FAIL("gpt_dataset: the ", split_name(split), " split of '", data_->prefix(), "' (sequences [", begin, ", ",
                 end, ") of ", data_->num_sequences(), ") holds ", tokens,
                 " tokens; at least 2 are needed. Change --split or use more data");
  }
  const bool drop_last = split != Split::valid || config.drop_last_partial_validation;
  indices_ =
      gpt_build_indices(sizes, begin, num_samples, config.seq_length, config.seed, config.add_extra_token, drop_last);
}

void GptDataset::get_text(int64_t i, int32_t* text) const {
  MOECORE_CHECK(i >= 0 && i < static_cast<int64_t>(size()), "gpt_dataset: sample ", i, " out of [0, ", size(), ")");
  const int64_t x = config_.add_extra_token ? 1 : 0, n = config_.seq_length + x;
  const int64_t j = indices_.shuffle_index[static_cast<size_t>(i)];
  const int64_t* row = indices_.sample_index.data() + 2 * j;
  const int64_t b = row[0], ob = row[1], e = row[2], oe = row[3];
  int64_t filled = 0;
  for (int64_t k = b; k <= e; ++k) {
    const int32_t seq = indices_.document_index[static_cast<size_t>(k)];
    const int64_t off = k == b ? ob : 0;
    const int64_t len = k < e ? data_->sequence_length(seq) - off : oe + x - off;
    MOECORE_CHECK(len >= 0 && filled + len <= n, "gpt_dataset: sample ", j, " spans ", filled + len, " > ", n);
    data_->read(seq, off, len, text + filled);
    for (int64_t t = filled; t < filled + len; ++t) {
      if (text[t] < 0 || (config_.vocab_size > 0 && text[t] >= config_.vocab_size)) [[unlikely]] {
        const std::string range = config_.vocab_size > 0
                                      ? detail::str_cat("outside the vocabulary [0, ", config_.vocab_size, ")")
                                      : std::string("negative");
        MOECORE_FAIL("gpt_dataset: '", indexed_bin_path(data_->prefix()), "': token ", off + (t - filled),
                     " of sequence ", seq, " is ", text[t], ", ", range,
                     "; the data was tokenized with another "
                     "tokenizer, or the .bin is corrupt");
      }
    }
    filled += len;
  }
  std::fill(text + filled, text + n, config_.pad_id);
}

void GptDataset::get(int64_t i, int32_t* tokens, int32_t* labels, float* loss_mask) const {
  const int64_t l = config_.seq_length, pad = config_.pad_id;
  thread_local std::vector<int32_t> text;
  text.resize(static_cast<size_t>(l + 1));
  get_text(i, text.data());
  if (!config_.add_extra_token) text[static_cast<size_t>(l)] = config_.pad_id;  // torch.roll then labels[-1]=pad
  for (int64_t k = 0; k < l; ++k) {
    const int32_t tk = text[static_cast<size_t>(k)], lb = text[static_cast<size_t>(k + 1)];
    if (loss_mask) {
      const bool masked = lb == pad || (config_.eod_mask_loss && tk == config_.eod_id);
      loss_mask[k] = masked ? 0.0f : 1.0f;
    }
    tokens[k] = tk == pad ? 0 : tk;
    labels[k] = lb == pad ? 0 : lb;
  }
}

// ---------------------------------------------------------------------------------------------------
// Blending

BlendIndices blend_build_indices(std::span<const double> weights, int64_t size) {
  MOECORE_CHECK(!weights.empty() && size >= 0, "blend: ", weights.size(), " weights, size ", size);
  BlendIndices out;
  out.dataset_index.resize(static_cast<size_t>(size));
  out.dataset_sample_index.resize(static_cast<size_t>(size));
  std::vector<int64_t> count(weights.size(), 0);
  for (int64_t s = 0; s < size; ++s) {
    const double sd = std::max(static_cast<double>(s), 1.0);
    size_t best = 0;
    double best_err = weights[0] * sd - static_cast<double>(count[0]);
    for (size_t d = 1; d < weights.size(); ++d) {
      const double err = weights[d] * sd - static_cast<double>(count[d]);
      if (err > best_err) best_err = err, best = d;
    }
    out.dataset_index[static_cast<size_t>(s)] = static_cast<int16_t>(best);
    out.dataset_sample_index[static_cast<size_t>(s)] = count[best]++;
  }
  return out;
}

BlendIndices blend_build_exhaustive_indices(std::span<const int64_t> sizes) {
  int64_t total = 0;
  std::set<size_t> unspent;
  for (size_t d = 0; d < sizes.size(); ++d) {
    MOECORE_CHECK(sizes[d] > 0, "blend: dataset ", d, " has size ", sizes[d]);
    total += sizes[d];
    unspent.insert(d);
  }
  std::vector<double> w(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) w[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
  std::vector<int64_t> count(sizes.size(), 0);
  BlendIndices out;
  out.dataset_index.reserve(static_cast<size_t>(total));
  out.dataset_sample_index.reserve(static_cast<size_t>(total));
  for (int64_t s = 0; !unspent.empty(); ++s) {
    const double sd = std::max(static_cast<double>(s), 1.0);
    size_t best = 0;
    double best_err = std::numeric_limits<double>::lowest();
    bool found = false;
    for (size_t d : unspent) {
      const double err = w[d] * sd - static_cast<double>(count[d]);
      if (!found || err > best_err) best_err = err, best = d, found = true;
    }
    out.dataset_index.push_back(static_cast<int16_t>(best));
    out.dataset_sample_index.push_back(count[best]++);
    if (count[best] == sizes[best]) unspent.erase(best);
  }
  return out;
}

DataPathBlend blend_parse(std::span<const std::string> data_path) {
  if (data_path.empty()) MOECORE_FAIL("gpt_dataset: --data-path is empty; give prefixes or \"w1 p1 w2 p2\"");
  DataPathBlend out;
  std::vector<double> weights;
  size_t parsed = 0;
  if (data_path.size() % 2 == 0) {
    for (size_t i = 0; i < data_path.size(); i += 2) {
      double w = 0;
      if (parse_python_float(data_path[i], w)) ++parsed, weights.push_back(w);
    }
  }
  if (parsed > 0 && parsed == data_path.size() / 2) {
    out.weights = weights;
    for (size_t i = 1; i < data_path.size(); i += 2) out.prefixes.push_back(strip(data_path[i]));
  } else if (parsed == 0) {
    for (const auto& p : data_path) out.prefixes.push_back(strip(p));
  } else {
    MOECORE_FAIL("gpt_dataset: --data-path mixes weights and prefixes (", parsed, " of ", data_path.size() / 2,
                 " weight positions are numbers); use \"p1 p2 ...\" or \"w1 p1 w2 p2 ...\"");
  }
  for (double w : out.weights) {
    if (!(w > 0) || !std::isfinite(w)) MOECORE_FAIL("gpt_dataset: --data-path weight ", w, " must be > 0");
  }
  return out;
}

BlendedGptDataset::BlendedGptDataset(std::vector<std::shared_ptr<const GptSampleSource>> datasets,
                                     std::vector<double> weights, std::optional<int64_t> size)
    : datasets_(std::move(datasets)) {
  if (datasets_.empty() || datasets_.size() != weights.size() || datasets_.size() >= 32767) {
    MOECORE_FAIL("blend: ", datasets_.size(), " datasets with ", weights.size(), " weights (need 1..32766, equal)");
  }
  for (size_t d = 0; d < weights.size(); ++d) {
    if (!(weights[d] > 0)) MOECORE_FAIL("blend: weight ", d, " is ", weights[d], "; every weight must be > 0");
    if (datasets_[d]->seq_length() != datasets_[0]->seq_length()) {
      MOECORE_FAIL("blend: dataset ", d, " has seq_length ", datasets_[d]->seq_length(), " vs ",
                   datasets_[0]->seq_length());
    }
  }
  if (size) {
    weights_ = weights_normalize(weights);
    indices_ = blend_build_indices(weights_, *size);
  } else {
    weights_ = weights;
    std::vector<int64_t> counts;
    for (double w : weights) {
      if (w != std::floor(w)) MOECORE_FAIL("blend: without a size, weights are sample counts; got ", w);
      counts.push_back(static_cast<int64_t>(w));
    }
    indices_ = blend_build_exhaustive_indices(counts);
  }
  std::vector<int64_t> drawn(datasets_.size(), 0);
  for (int16_t d : indices_.dataset_index) ++drawn[static_cast<size_t>(d)];
  for (size_t d = 0; d < datasets_.size(); ++d) {
    if (drawn[d] > static_cast<int64_t>(datasets_[d]->size())) {
      MOECORE_FAIL("blend: the blend draws ", drawn[d], " samples from dataset ", d, " which holds ",
                   datasets_[d]->size(), "; raise --mid-level-dataset-surplus (e.g. 0.05)");
    }
  }
}

void BlendedGptDataset::get(int64_t i, int32_t* tokens, int32_t* labels, float* loss_mask) const {
  MOECORE_CHECK(i >= 0 && i < static_cast<int64_t>(size()), "blend: sample ", i, " out of [0, ", size(), ")");
  const auto d = static_cast<size_t>(indices_.dataset_index[static_cast<size_t>(i)]);
  datasets_[d]->get(indices_.dataset_sample_index[static_cast<size_t>(i)], tokens, labels, loss_mask);
}

// ---------------------------------------------------------------------------------------------------
// Data source

std::array<int64_t, 3> gpt_split_num_samples(int64_t train_iters, int64_t global_batch_size, int64_t eval_interval,
                                             int64_t eval_iters) {
  MOECORE_CHECK(eval_interval >= 0, "eval_interval (", eval_interval, ") must not be negative");
  const int64_t evaluations = eval_interval > 0 ? train_iters / eval_interval + 1 : 1;  // 0: only at the end
  int64_t train = 0, test = 0, valid = 0;
  if (__builtin_mul_overflow(train_iters, global_batch_size, &train) ||
      __builtin_mul_overflow(eval_iters, global_batch_size, &test) || __builtin_mul_overflow(evaluations, test, &valid))
    MOECORE_FAIL("gpt_dataset: the sample counts of train_iters ", train_iters, ", global_batch_size ",
                 global_batch_size, ", eval_iters ", eval_iters, " and eval_interval ", eval_interval,
                 " overflow 64 bits; hint: lower --train-iters, --global-batch-size or --eval-iters");
  return {train, valid, test};
}

GptDataSource::GptDataSource(const GptDataSourceConfig& config) {
  if (config.dataset.seq_length <= 1) {
    MOECORE_FAIL("gpt_dataset: seq_length (", config.dataset.seq_length, ") must be > 1");
  }
  const DataPathBlend blend = blend_parse(config.data_path);
  const SplitBookends matrix = split_matrix(split_parse(config.split));
  const bool weighted = !blend.weights.empty();
  const std::vector<double> weights = weighted ? weights_normalize(blend.weights) : std::vector<double>{};

  std::vector<std::shared_ptr<const IndexedDataset>> data;
  std::vector<SplitRanges> ranges;
  for (const auto& prefix : blend.prefixes) {
    data.push_back(std::make_shared<const IndexedDataset>(prefix));
    ranges.push_back(split_ranges(matrix, data.back()->num_sequences()));
  }
  std::ostringstream os;
  os << "gpt_dataset: " << blend.prefixes.size() << " prefix(es), split \"" << config.split << "\"\n";
  for (size_t p = 0; p < blend.prefixes.size(); ++p) {
    os << "  " << blend.prefixes[p] << ": " << data[p]->num_sequences() << " sequences";
    if (weighted) os << ", weight " << weights[p];
    os << "\n";
  }

  for (int si = 0; si < 3; ++si) {
    const auto split = static_cast<Split>(si);
    const std::optional<int64_t> want = config.num_samples[static_cast<size_t>(si)];
    if (!matrix[static_cast<size_t>(si)] || (want && *want == 0)) continue;
    auto mid = [&](size_t p, std::optional<int64_t> n) {
      const auto& r = *ranges[p][static_cast<size_t>(si)];
      return std::make_shared<const GptDataset>(data[p], split, r.first, r.second, n, config.dataset);
    };
    if (blend.prefixes.size() == 1 && !weighted) {
      auto ds = mid(0, want);
      os << "  " << split_name(split) << ": " << ds->size() << " samples, " << ds->indices().num_epochs
         << " epoch(s)\n";
      splits_[static_cast<size_t>(si)] = ds;
      continue;
    }
    if (weighted && !want) {
      MOECORE_FAIL("gpt_dataset: weighted --data-path needs a sample count for the ", split_name(split), " split");
    }
    std::vector<std::shared_ptr<const GptSampleSource>> mids;
    std::vector<double> blend_weights;
    int64_t target_total = 0, lengths_total = 0;
    for (size_t p = 0; p < blend.prefixes.size(); ++p) {
      std::optional<int64_t> n;
      if (weighted) {
        const double target = std::ceil(static_cast<double>(*want) * weights[p]);
        target_total += static_cast<int64_t>(target);
        n = static_cast<int64_t>(std::ceil(target * (1.0 + config.mid_level_dataset_surplus)));
      }
      auto ds = mid(p, n);
      lengths_total += static_cast<int64_t>(ds->size());
      blend_weights.push_back(weighted ? weights[p] : static_cast<double>(ds->size()));
      mids.push_back(std::move(ds));
    }
    std::optional<int64_t> size;
    if (weighted) {
      size = target_total;
    } else if (want) {
      size = std::min(*want, lengths_total);
    }
    auto ds = std::make_shared<const BlendedGptDataset>(std::move(mids), std::move(blend_weights), size);
    os << "  " << split_name(split) << ": " << ds->size() << " blended samples\n";
    splits_[static_cast<size_t>(si)] = ds;
  }
  summary_ = os.str();
}

}  // namespace moecore::data
