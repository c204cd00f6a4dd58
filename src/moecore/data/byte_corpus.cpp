#include "moecore/data/byte_corpus.h"

#include <fstream>
#include <iterator>

#include "moecore/core/rng.h"

namespace moecore::data {

ByteCorpus::ByteCorpus(const std::string& path, double valid_fraction) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MOECORE_FAIL("data: cannot open corpus '", path, "'");
  bytes_.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  if (!(valid_fraction >= 0 && valid_fraction < 1))
    MOECORE_FAIL("data: validation fraction ", valid_fraction, " must lie in [0, 1)");
  split_ = static_cast<int64_t>(static_cast<double>(bytes_.size()) * (1.0 - valid_fraction));
}

void ByteCorpus::batch(Tensor& tokens, Tensor& labels, bool valid, uint64_t seed, int64_t index) const {
  const int64_t B = tokens.size(0), S = tokens.size(1);
  const int64_t begin = valid ? split_ : 0, end = valid ? static_cast<int64_t>(bytes_.size()) : split_;
  if (end - begin < S + 1)
    MOECORE_FAIL("data: the ", valid ? "validation" : "training", " split has ", end - begin,
                 " tokens, fewer than seq_length + 1 = ", S + 1);
  const PhiloxKey key = philox_key(seed, valid ? "data.valid" : "data.train");
  int32_t* tp = tokens.data<int32_t>();
  int32_t* lp = labels.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const double u = philox_uniform(key, static_cast<uint64_t>(index * B + b));
    const int64_t start = begin + static_cast<int64_t>(u * static_cast<double>(end - begin - S - 1));
    for (int64_t s = 0; s < S; ++s) {
      tp[b * S + s] = bytes_[static_cast<size_t>(start + s)];
      lp[b * S + s] = bytes_[static_cast<size_t>(start + s + 1)];
    }
  }
}

std::string ByteCorpus::decode(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s.push_back(static_cast<char>(id));
  return s;
}

}  // namespace moecore::data
