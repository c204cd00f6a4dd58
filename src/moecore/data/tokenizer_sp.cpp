// SentencePieceTokenizer and Llama2Tokenizer: Megatron's two wrappers around a SentencePiece .model, on
// libsentencepiece's C++ processor (encoding is the library's own). Built only when CMake finds the
// library (MOECORE_HAVE_SENTENCEPIECE); otherwise both types raise "built without SentencePiece".
#include "moecore/core/error.h"
#include "moecore/data/tokenizer_bpe.h"

#ifdef MOECORE_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>

#include <filesystem>
#include <unordered_map>

namespace moecore::data::detail {
namespace {

class SpTokenizer final : public Tokenizer {
 public:
  SpTokenizer(const std::string& path, bool llama2) : llama2_(llama2) {
    if (!std::filesystem::is_regular_file(path))
      MOECORE_FAIL(type(), ": cannot open tokenizer model '", path, "' (--tokenizer-model); check the path");
    if (const auto st = sp_.Load(path); !st.ok())
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
