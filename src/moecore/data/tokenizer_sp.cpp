// SentencePieceTokenizer and Llama2Tokenizer: Megatron's two wrappers around a SentencePiece .model, on
// libsentencepiece's C++ processor (encoding is the library's own). Built only when CMake finds the
// library (MOECORE_HAVE_SENTENCEPIECE); otherwise both types raise "built without SentencePiece".
#include "moecore/core/error.h"
#include "moecore/data/tokenizer_bpe.h"

#ifdef MOECORE_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>

#include <cstring>
#include <filesystem>
#include <string_view>
#include <unordered_map>

#include "moecore/io/input_file.h"

namespace moecore::data::detail {
namespace {

// libsentencepiece (0.1.97) trusts parts of a .model that a corrupt file controls: it builds its tries with
// strlen() (a piece holding NUL throws from a noexcept path: std::terminate), and walks the precompiled_charsmap
// double-array trie and its string offsets without bounds checks. The protobuf is walked here first, and only a
// model passing these checks reaches the library.
class ProtoReader {
 public:
  explicit ProtoReader(std::string_view s) : p_(s.data()), end_(s.data() + s.size()) {}
  bool done() const { return p_ == end_; }
  // The next field: its number, and for wire type 2 its bytes. False on malformed input.
  bool next(uint32_t& field, std::string_view& bytes, bool& is_bytes) {
    uint64_t key, v;
    if (!varint(key)) return false;
    field = static_cast<uint32_t>(key >> 3);
    is_bytes = false;
    switch (key & 7) {
      case 0:
        return varint(v);
      case 1:
        return skip(8);
      case 5:
        return skip(4);
      case 2:
        if (!varint(v) || v > static_cast<uint64_t>(end_ - p_)) return false;
        bytes = std::string_view(p_, static_cast<size_t>(v));
        p_ += v;
        is_bytes = true;
        return true;
      default:  // groups (3, 4) are not used by sentencepiece_model.proto
        return false;
    }
  }

 private:
  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64 && p_ < end_; shift += 7) {
      const auto b = static_cast<unsigned char>(*p_++);
      v |= uint64_t(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  bool skip(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) return false;
    p_ += n;
    return true;
  }
  const char* p_;
  const char* end_;
};

// The library's reading of a precompiled_charsmap (normalizer.cc, darts.h): <uint32 n><n bytes of double-array
// units><NUL-terminated replacement strings>; commonPrefixSearch reads unit[s ^ c] for every state s and byte c,
// and a leaf's value is an offset into the strings. Every state reachable from the root is checked.
std::string charsmap_problem(std::string_view blob) {
  if (blob.empty()) return "";
  uint32_t n = 0;
  if (blob.size() < 4) return "shorter than its 4-byte header";
  std::memcpy(&n, blob.data(), 4);
  if (n > blob.size() - 4)
    return ::moecore::detail::str_cat("trie size ", n, " exceeds the ", blob.size() - 4, " bytes left");
  const uint32_t units = n / 4;
  const std::string_view strings = blob.substr(4 + n);
  const size_t last_nul = strings.rfind('\0');
  auto unit = [&](uint32_t i) {
    uint32_t u;
    std::memcpy(&u, blob.data() + 4 + 4 * size_t(i), 4);
    return u;
  };
  auto offset = [](uint32_t u) { return (u >> 10) << ((u & (1U << 9)) >> 6); };
  if (units == 0) return "empty trie";
  std::vector<uint8_t> seen(units, 0);
  std::vector<uint32_t> pending{offset(unit(0))};
  while (!pending.empty()) {
    const uint32_t s = pending.back();
    pending.pop_back();
    if ((s | 0xFFu) >= units)
      return ::moecore::detail::str_cat("trie state ", s, " lies outside its ", units, " units");
    if (seen[s]) continue;
    seen[s] = 1;
    for (uint32_t c = 0; c < 256; ++c) {
      const uint32_t u = unit(s ^ c);
      if ((u & ((1U << 31) | 0xFF)) != c) continue;  // label
      const uint32_t next = (s ^ c) ^ offset(u);
      if ((next | 0xFFu) >= units)
        return ::moecore::detail::str_cat("trie state ", next, " lies outside its ", units, " units");
      if ((u >> 8) & 1) {  // has_leaf: the value is an offset into the strings
        const uint32_t value = unit(next) & ((1U << 31) - 1);
        if (last_nul == std::string_view::npos || value > last_nul)
          return ::moecore::detail::str_cat("replacement offset ", value, " lies outside its ", strings.size(),
                                            " bytes");
      }
      pending.push_back(next);
    }
  }
  return "";
}

// Why the library must not load `model` (empty when it may).
std::string model_problem(std::string_view model) {
  ProtoReader top(model);
  uint32_t field;
  std::string_view bytes;
  bool is_bytes;
  int64_t piece_index = 0;
  std::string_view charsmap[2];  // normalizer_spec (3), denormalizer_spec (5); the last value wins, as in protobuf
  while (!top.done()) {
    if (!top.next(field, bytes, is_bytes)) return "not a valid protobuf";
    if (field == 1 && is_bytes) {  // ModelProto.pieces
      ProtoReader pr(bytes);
      std::string_view piece;
      while (!pr.done()) {
        std::string_view b;
        bool ib;
        uint32_t f;
        if (!pr.next(f, b, ib)) return ::moecore::detail::str_cat("piece ", piece_index, " is not a valid protobuf");
        if (f == 1 && ib) piece = b;
      }
      if (piece.empty() || piece.find('\0') != std::string_view::npos)
        return ::moecore::detail::str_cat("piece ", piece_index, " is empty or holds a NUL byte");
      ++piece_index;
    } else if ((field == 3 || field == 5) && is_bytes) {
      ProtoReader nr(bytes);
      while (!nr.done()) {
        std::string_view b;
        bool ib;
        uint32_t f;
        if (!nr.next(f, b, ib)) return "normalizer_spec is not a valid protobuf";
        if (f == 2 && ib) charsmap[field == 3 ? 0 : 1] = b;
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    if (const std::string why = charsmap_problem(charsmap[k]); !why.empty())
      return ::moecore::detail::str_cat(k == 0 ? "normalizer_spec" : "denormalizer_spec",
                                        ".precompiled_charsmap: ", why);
  }
  return "";
}

class SpTokenizer final : public Tokenizer {
 public:
  SpTokenizer(const std::string& path, bool llama2) : llama2_(llama2) {
    io::require_regular_file(
        path, std::string(type()) + ": tokenizer model (--tokenizer-model)");  // a FIFO would block the read
    if (!std::filesystem::is_regular_file(path))
      MOECORE_FAIL(type(), ": cannot open tokenizer model '", path, "' (--tokenizer-model); check the path");
    const std::string bytes = read_text_file(path, type(), "tokenizer model");
    if (const std::string why = model_problem(bytes); !why.empty()) {
      MOECORE_FAIL(type(), ": '", path, "' is not a usable SentencePiece model: ", why,
                   "; the file is corrupt (check --tokenizer-model)");
    }
    if (const auto st = sp_.LoadFromSerializedProto(bytes); !st.ok())
      MOECORE_FAIL(type(), ": cannot load SentencePiece model '", path, "': ", st.ToString());
    pieces_ = sp_.GetPieceSize();
    vocab_ = pieces_;
    if (llama2_) {  // Megatron's _Llama2Tokenizer
      eod_ = sp_.eos_id();
      pad_ = sp_.pad_id();
      return;
    }
    // Megatron's _SentencePieceTokenizer._initalize: special tokens, appended when the model lacks them.
    auto piece_or = [&](int id, const char* fallback) {
      return (id >= 0 && id < pieces_) ? sp_.IdToPiece(id) : std::string(fallback);
    };
    for (const std::string& t :
         {std::string("<CLS>"), std::string("<SEP>"), std::string("<EOD>"), std::string("<MASK>"),
          piece_or(sp_.pad_id(), "<PAD>"), piece_or(sp_.bos_id(), "<BOS>"), piece_or(sp_.eos_id(), "<EOS>")})
      add_special(t);
    eod_ = special_id("<EOD>");
    pad_ = special_id(piece_or(sp_.pad_id(), "<PAD>"));
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    if (llama2_ && sp_.bos_id() >= 0) ids.push_back(sp_.bos_id());
    size_t idx = 0;
    while (!llama2_) {  // the earliest special token in the rest of the text; ties go to the first added
      size_t best = std::string_view::npos;
      const std::pair<std::string, int32_t>* tok = nullptr;
      for (const auto& s : specials_) {
        const size_t at = text.find(s.first, idx);
        if (at < best) best = at, tok = &s;
      }
      if (tok == nullptr) break;
      sp_encode(text.substr(idx, best - idx), ids);
      ids.push_back(tok->second);
      idx = best + tok->first.size();
    }
    sp_encode(text.substr(idx), ids);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    std::vector<int> run;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_)
        MOECORE_FAIL(type(), ": decode: id ", id, " is not in the vocabulary (size ", vocab_, ")");
      if (const auto it = inv_specials_.find(id); it != inv_specials_.end()) {
        text += sp_decode(run) + " " + it->second + " ";  // Megatron's detokenize spacing
        run.clear();
      } else {
        run.push_back(id);
      }
    }
    return text + sp_decode(run);
  }

  int64_t vocab_size() const override { return vocab_; }
  int32_t eod() const override { return eod_; }
  int32_t pad() const override { return pad_; }
  std::string name() const override { return type(); }

 private:
  const char* type() const { return llama2_ ? "Llama2Tokenizer" : "SentencePieceTokenizer"; }

  void add_special(const std::string& t) {
    for (const auto& s : specials_) {
      if (s.first == t) return;
    }
    int32_t id = sp_.PieceToId(t);
    if (id == sp_.unk_id() && sp_.IdToPiece(id) != t) id = static_cast<int32_t>(vocab_++);
    specials_.emplace_back(t, id);
    inv_specials_.emplace(id, t);
  }
  int32_t special_id(const std::string& t) const {
    for (const auto& s : specials_) {
      if (s.first == t) return s.second;
    }
    return -1;
  }

  void sp_encode(std::string_view text, std::vector<int32_t>& ids) const {
    if (text.empty()) return;
    std::vector<int> out;
    if (const auto st = sp_.Encode(text, &out); !st.ok()) MOECORE_FAIL(type(), ": encode failed: ", st.ToString());
    ids.insert(ids.end(), out.begin(), out.end());
  }
  std::string sp_decode(const std::vector<int>& ids) const {
    std::string out;
    if (ids.empty()) return out;
    for (int id : ids) {
      if (id >= pieces_)
        MOECORE_FAIL(type(), ": decode: id ", id, " is not a piece of the model (", pieces_, " pieces)");
    }
    if (const auto st = sp_.Decode(ids, &out); !st.ok()) MOECORE_FAIL(type(), ": decode failed: ", st.ToString());
    return out;
  }

  sentencepiece::SentencePieceProcessor sp_;
  bool llama2_;
  int pieces_ = 0;
  int64_t vocab_ = 0;
  int32_t eod_ = -1, pad_ = -1;
  std::vector<std::pair<std::string, int32_t>> specials_;  // in Megatron's insertion order
  std::unordered_map<int32_t, std::string> inv_specials_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_file, bool llama2) {
  return std::make_unique<SpTokenizer>(model_file, llama2);
}

}  // namespace moecore::data::detail

#else

namespace moecore::data::detail {
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_file, bool llama2) {
  MOECORE_FAIL(llama2 ? "Llama2Tokenizer" : "SentencePieceTokenizer",
               ": moecore was built without SentencePiece (model '", model_file,
               "'); install libsentencepiece-dev (scripts/install-deps.sh) and reconfigure");
}
}  // namespace moecore::data::detail

#endif
