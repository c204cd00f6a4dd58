// Internal to the data floor: the pieces shared by the byte-level BPE tokenizers (GPT-2 files and HF
// tokenizer.json) and the per-format constructors that make_tokenizer dispatches to. Not a public API;
// tests include it to check the pre-tokenizers and the byte map directly.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "moecore/data/tokenizer.h"

namespace moecore::data::detail {

// GPT-2's byte -> character map (docs/formats.md §6.1): printable Latin-1 bytes map to themselves, the other 68
// bytes to U+0100.. in byte order.
const std::array<char32_t, 256>& byte_to_char();
// The byte a character stands for, or -1 when it is not in the 256-character alphabet.
int char_to_byte(char32_t c);
// The vocab spelling of raw bytes: each byte mapped through byte_to_char, UTF-8 encoded.
std::string bytes_to_token(std::string_view bytes);
// The bytes a token spelling decodes to, as HF's ByteLevel decoder does it: each character through char_to_byte,
// or the spelling's own UTF-8 when one of its characters is outside the 256-character alphabet.
std::string token_to_bytes(std::string_view spelling);

// How a Split pre-tokenizer turns matches into pieces (HF tokenizers' SplitDelimiterBehavior): isolated keeps
// matches and the text between them as separate pieces; removed drops the matches; merged_with_previous /
// merged_with_next glue each match to the piece before / after it; contiguous joins runs of matches.
enum class SplitBehavior { isolated, removed, merged_with_previous, merged_with_next, contiguous };

// The GPT-2 pre-tokenizer regex (ByteLevel's use_regex): 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|...
extern const std::string_view kGpt2Regex;

// A compiled pre-tokenizer pattern: PCRE2 (8-bit, UTF + UCP, JIT when the library has it), so the pieces equal
// the Oniguruma engine's in HF tokenizers. \s means Unicode White_Space as in Oniguruma (PCRE2 10.42's \s also
// takes U+180E). Invalid UTF-8 bytes match no pattern item, so they end up in the gaps between matches.
// split is const and thread-safe.
class SplitRegex {
 public:
  // `source` (the file and component) starts the Error raised when the pattern does not compile.
  // `literal`: the pattern is a plain string (HF's {"String": ...} pattern), not a regex.
  SplitRegex(std::string_view pattern, bool literal, const std::string& source);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;
  // Appends the pieces of `text` (views into it) to `out`; `invert` swaps matches and gaps first (HF's invert).
  // Empty pieces are dropped.
  void split(std::string_view text, SplitBehavior behavior, bool invert, std::vector<std::string_view>& out) const;
  // The compiled GPT-2 regex, shared.
  static const SplitRegex& gpt2();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Ids a vocabulary file may skip: every id must be below (number of entries + kVocabIdSlack), so a hostile id
// (2^28 in a 1 MB vocab.json) cannot size the id tables. Real files are dense (GPT-2, Llama-3, Qwen: no holes).
inline constexpr int64_t kVocabIdSlack = 1024;

// A token id read from a JSON file: an integer in [0, 2^31 - 1]. Anything else (a string, 1.5, -3, 2^40) is an
// Error "<source>: <what> '<token>' has id <value>, expected an integer in [0, 2147483647]".
int32_t json_token_id(const nlohmann::json& v, const std::string& source, const char* what, std::string_view token);

struct BpeOptions {
  bool ignore_merges = false;  // a whole pre-token found in the vocab is emitted as is (Llama-3)
  int32_t unk_id = -1;         // id for a byte whose character is not in the vocab; -1 drops it (HF)
  bool fuse_unk = false;       // consecutive unknown bytes give one unk id
  int64_t extra_ids = 0;       // ids that another table fills between vocab ids (HF added tokens)
};

// A byte-level BPE model: vocab (token spelling -> id) and merges in rank order. encode_word is const and
// thread-safe; results for short words are cached in a sharded, locked map.
class BpeModel {
 public:
  // `source` (type and file names) starts error messages. Ids must be unique and below vocab.size() +
  // opts.extra_ids + kVocabIdSlack. A merge whose parts or result are not in the vocab is an error (as in HF
  // tokenizers); a repeated merge keeps its last rank (as in both references).
  BpeModel(std::unordered_map<std::string, int32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions opts, const std::string& source);
  // Appends the ids of one pre-token given as raw bytes.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  // Appends the bytes token `id` stands for; false when `id` is not in the vocab.
  bool decode_token(int32_t id, std::string& out) const;
  int32_t token_id(std::string_view spelling) const;                         // -1 when absent
  int64_t id_end() const { return static_cast<int64_t>(id_bytes_.size()); }  // 1 + the largest id

 private:
  struct Merge {
    int32_t rank, new_id;
  };
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using WordMap = std::unordered_map<std::string, std::vector<int32_t>, Hash, std::equal_to<>>;
  struct CacheShard {
    mutable std::shared_mutex mu;
    WordMap words;
  };
  static constexpr int kShards = 64;
  static constexpr size_t kMaxCachedWordBytes = 256, kMaxCachedWordsPerShard = 4096;

  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: (left id << 32) | right id
  std::array<int32_t, 256> byte_id_{};          // vocab id of each single-byte token, -1 if absent
  std::vector<std::string> id_bytes_;           // decoded bytes per id
  std::vector<uint8_t> id_known_;               // 1 where the id is in the vocab
  BpeOptions opts_;
  mutable std::array<CacheShard, kShards> cache_;
};

// make_tokenizer's per-format constructors.
std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file, const std::string& merge_file);
std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path);
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_file, bool llama2);

// Reads a whole file; Error naming the component (tokenizer type), `what` and the path when it cannot.
std::string read_text_file(const std::string& path, const char* component, const char* what);

}  // namespace moecore::data::detail
