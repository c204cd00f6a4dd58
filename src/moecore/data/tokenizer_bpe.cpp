// Byte-level BPE: GPT-2's byte map, the merge loop (lowest rank first, leftmost first, as HF tokenizers'
// heap; equal to OpenAI's merge-all-occurrences loop for merges learned in rank order), the word cache,
// and Megatron's GPT2BPETokenizer built from vocab.json + merges.txt.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>

#include "moecore/core/error.h"
#include "moecore/data/tokenizer_bpe.h"
#include "moecore/data/unicode_text.h"
#include "moecore/io/input_file.h"
#include "moecore/io/json.h"

namespace moecore::data::detail {

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

int char_to_byte(char32_t c) {
  static const std::array<int16_t, 0x144> inverse = [] {
    std::array<int16_t, 0x144> t;
    t.fill(-1);
    for (int b = 0; b < 256; ++b) t[byte_to_char()[b]] = static_cast<int16_t>(b);
    return t;
  }();
  return c < inverse.size() ? inverse[c] : -1;
}

std::string bytes_to_token(std::string_view bytes) {
  std::string s;
  s.reserve(bytes.size() * 2);
  for (char b : bytes) unicode::utf8_append(s, byte_to_char()[static_cast<unsigned char>(b)]);
  return s;
}

std::string token_to_bytes(std::string_view spelling) {
  std::string bytes;
  for (size_t i = 0; i < spelling.size();) {
    char32_t cp;
    i += unicode::utf8_decode(spelling, i, &cp);
    const int b = char_to_byte(cp);
    if (b < 0) return std::string(spelling);
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

int32_t json_token_id(const nlohmann::json& v, const std::string& source, const char* what, std::string_view token) {
  if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t(std::numeric_limits<int32_t>::max()))
    return static_cast<int32_t>(v.get<uint64_t>());
  if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= std::numeric_limits<int32_t>::max())
    return static_cast<int32_t>(v.get<int64_t>());
  MOECORE_FAIL(source, ": ", what, " '", token.substr(0, 200), "' has id ", v.dump().substr(0, 100),
               ", expected an integer in [0, ", std::numeric_limits<int32_t>::max(), "]");
}

std::string read_text_file(const std::string& path, const char* component, const char* what) {
  io::require_regular_file(path, std::string(component) + ": " + what);  // a FIFO would block the read
  std::ifstream f(path, std::ios::binary);
  if (!f) MOECORE_FAIL(component, ": cannot open ", what, " '", path, "'; check the path and permissions");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

BpeModel::BpeModel(std::unordered_map<std::string, int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions opts,
                   const std::string& source)
    : opts_(opts) {
  // The id tables below are sized by the largest id, so the ids are bounded by the entry count first.
  const int64_t limit = static_cast<int64_t>(vocab.size()) + opts.extra_ids + kVocabIdSlack;
  int64_t end = 0;
  for (const auto& [tok, id] : vocab) {
    if (id < 0 || id >= limit) {
      MOECORE_FAIL(source, ": token '", tok.substr(0, 200), "' has id ", id, ", outside [0, ", limit,
                   ") for a vocab of ", vocab.size(), " entries (ids may skip at most ", kVocabIdSlack,
                   " values); the vocabulary file is corrupt");
    }
    end = std::max<int64_t>(end, int64_t{id} + 1);
  }
  id_bytes_.resize(end);
  id_known_.assign(end, 0);
  std::vector<const std::string*> spelling(end, nullptr);
  for (const auto& [tok, id] : vocab) {
    if (spelling[id] != nullptr) {
      const bool first = *spelling[id] < tok;  // name the pair in a stable order
      MOECORE_FAIL(source, ": tokens '", (first ? *spelling[id] : tok).substr(0, 200), "' and '",
                   (first ? tok : *spelling[id]).substr(0, 200), "' both have id ", id,
                   "; ids must be unique (the vocabulary file is corrupt)");
    }
    spelling[id] = &tok;
    id_known_[id] = 1;
    id_bytes_[id] = token_to_bytes(tok);
  }
  vocab_.reserve(vocab.size());
  for (auto& [tok, id] : vocab) vocab_.emplace(tok, id);
  for (int b = 0; b < 256; ++b) byte_id_[b] = token_id(bytes_to_token(std::string(1, static_cast<char>(b))));
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const int32_t ia = token_id(a), ib = token_id(b), ic = token_id(a + b);
    if (ia < 0 || ib < 0 || ic < 0) {
      const std::string missing = ia < 0 ? a : ib < 0 ? b : a + b;
      MOECORE_FAIL(source, ": merge ", rank, " '", a, " ", b, "' uses a token missing from the vocab ('", missing,
                   "'); the vocab and merges do not belong together");
    }
    merges_[(uint64_t(uint32_t(ia)) << 32) | uint32_t(ib)] = Merge{static_cast<int32_t>(rank), ic};
  }
}

int32_t BpeModel::token_id(std::string_view spelling) const {
  const auto it = vocab_.find(spelling);
  return it == vocab_.end() ? -1 : it->second;
}

bool BpeModel::decode_token(int32_t id, std::string& out) const {
  if (id < 0 || id >= id_end() || !id_known_[id]) return false;
  out += id_bytes_[id];
  return true;
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (word.size() == 1 && byte_id_[static_cast<unsigned char>(word[0])] >= 0) {
    out.push_back(byte_id_[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (word.size() > kMaxCachedWordBytes) {
    merge_word(word, out);
    return;
  }
  CacheShard& shard = cache_[std::hash<std::string_view>{}(word) % kShards];
  {
    std::shared_lock lock(shard.mu);
    if (auto it = shard.words.find(word); it != shard.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  merge_word(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  std::unique_lock lock(shard.mu);
  if (shard.words.size() < kMaxCachedWordsPerShard) shard.words.emplace(std::string(word), std::move(ids));
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  if (opts_.ignore_merges) {
    if (const int32_t id = token_id(bytes_to_token(word)); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Sym> syms;
  syms.reserve(word.size());
  for (char ch : word) {
    int32_t id = byte_id_[static_cast<unsigned char>(ch)];
    if (id < 0) {
      if (opts_.unk_id < 0) continue;  // HF drops characters it cannot represent when there is no unk
      if (opts_.fuse_unk && !syms.empty() && syms.back().id == opts_.unk_id) continue;
      id = opts_.unk_id;
    }
    const auto n = static_cast<int32_t>(syms.size());
    syms.push_back({id, n - 1, n + 1, true});
  }
  if (syms.empty()) return;
  syms.back().next = -1;

  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto find = [&](int32_t left, int32_t right) -> const Merge* {
    const auto it = merges_.find((uint64_t(uint32_t(left)) << 32) | uint32_t(right));
    return it == merges_.end() ? nullptr : &it->second;
  };
  auto push = [&](int32_t pos) {
    if (pos < 0 || syms[pos].next < 0) return;
    if (const Merge* m = find(syms[pos].id, syms[syms[pos].next].id)) heap.push({m->rank, pos, m->new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) push(i);
  while (!heap.empty()) {
    const Cand top = heap.top();
    heap.pop();
    Sym& s = syms[top.pos];
    if (!s.alive || s.next < 0) continue;
    const Merge* m = find(s.id, syms[s.next].id);
    if (m == nullptr || m->new_id != top.new_id) continue;  // stale: a neighbour changed since the push
    Sym& right = syms[s.next];
    right.alive = false;
    s.id = top.new_id;
    s.next = right.next;
    if (s.next >= 0) syms[s.next].prev = top.pos;
    push(s.prev);
    push(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

namespace {

// Megatron's GPT2BPETokenizer: the GPT-2 regex, then BPE; special tokens are not recognized in text.
class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  Gpt2BpeTokenizer(std::unique_ptr<BpeModel> model, int32_t eod) : model_(std::move(model)), eod_(eod) {}
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<std::string_view> pieces;
    SplitRegex::gpt2().split(text, SplitBehavior::isolated, false, pieces);
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 1);
    for (std::string_view p : pieces) model_->encode_word(p, ids);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (!model_->decode_token(id, out))
        MOECORE_FAIL("GPT2BPETokenizer: decode: id ", id, " is not in the vocabulary (size ", vocab_size(), ")");
    }
    return out;
  }
  int64_t vocab_size() const override { return model_->id_end(); }
  int32_t eod() const override { return eod_; }
  std::string name() const override { return "GPT2BPETokenizer"; }

 private:
  std::unique_ptr<BpeModel> model_;
  int32_t eod_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file, const std::string& merge_file) {
  if (vocab_file.empty() || merge_file.empty())
    MOECORE_FAIL("GPT2BPETokenizer: needs --vocab-file (vocab.json) and --merge-file (merges.txt); got vocab '",
                 vocab_file, "', merges '", merge_file, "'");
  const std::string vocab_text = read_text_file(vocab_file, "GPT2BPETokenizer", "vocab file (--vocab-file)");
  const std::string vocab_source = "GPT2BPETokenizer: vocab file '" + vocab_file + "'";
  std::unordered_map<std::string, int32_t> vocab;
  {
    const nlohmann::json j = io::parse_json(vocab_text, vocab_source);
    if (!j.is_object() || j.empty())
      MOECORE_FAIL(vocab_source, " is not a JSON object of token -> id (vocab.json); check --vocab-file");
    vocab.reserve(j.size());
    for (const auto& [tok, id] : j.items()) vocab.emplace(tok, json_token_id(id, vocab_source, "token", tok));
  }
  // OpenAI/Megatron read the merges as lines [1:-1] split on whitespace; blank lines are skipped here.
  const std::string text = read_text_file(merge_file, "GPT2BPETokenizer", "merges file (--merge-file)");
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream in(text);
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (lineno == 1 && line.starts_with("#version")) continue;
    std::istringstream ls(line);
    std::string a, b, extra;
    if (!(ls >> a)) continue;
    if (!(ls >> b) || (ls >> extra))
      MOECORE_FAIL("GPT2BPETokenizer: merges file '", merge_file, "' line ", lineno, " is '", line,
                   "', expected two tokens separated by a space");
    merges.emplace_back(std::move(a), std::move(b));
  }
  const std::string source = "GPT2BPETokenizer: vocab '" + vocab_file + "' + merges '" + merge_file + "'";
  auto model = std::make_unique<BpeModel>(std::move(vocab), merges, BpeOptions{}, source);
  const int32_t eod = model->token_id("<|endoftext|>");
  return std::make_unique<Gpt2BpeTokenizer>(std::move(model), eod);
}

}  // namespace moecore::data::detail
