// make_tokenizer's dispatch on Megatron's --tokenizer-type names, and the file-free ByteLevel tokenizer.
// The formats themselves live in tokenizer_bpe.cpp (GPT-2), tokenizer_hf.cpp (tokenizer.json) and
// tokenizer_sp.cpp (SentencePiece).
#include "moecore/data/tokenizer.h"

#include "moecore/core/error.h"
#include "moecore/data/tokenizer_bpe.h"

namespace moecore::data {

Tokenizer::~Tokenizer() = default;

namespace {

// ids are the bytes 0..255; 256 is the end of document.
class ByteLevelTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (int32_t id : ids) {
      if (id < 0 || id > 256) MOECORE_FAIL("ByteLevel: decode: id ", id, " is outside 0..256");
      if (id < 256) out.push_back(static_cast<char>(id));
    }
    return out;
  }
  int64_t vocab_size() const override { return 257; }
  int32_t eod() const override { return 256; }
  std::string name() const override { return "ByteLevel"; }
};

}  // namespace

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& o) {
  if (o.type == "GPT2BPETokenizer") return detail::make_gpt2_bpe_tokenizer(o.vocab_file, o.merge_file);
  if (o.type == "HuggingFaceTokenizer")
    return detail::make_hf_tokenizer(o.tokenizer_model.empty() ? o.vocab_file : o.tokenizer_model);
  if (o.type == "SentencePieceTokenizer" || o.type == "Llama2Tokenizer") {
    if (o.tokenizer_model.empty()) MOECORE_FAIL(o.type, ": needs --tokenizer-model (a SentencePiece .model file)");
    return detail::make_sentencepiece_tokenizer(o.tokenizer_model, o.type == "Llama2Tokenizer");
  }
  if (o.type == "ByteLevel") return std::make_unique<ByteLevelTokenizer>();
  MOECORE_FAIL("tokenizer: unknown --tokenizer-type '", o.type,
               "'; valid types: GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, Llama2Tokenizer, "
               "ByteLevel");
}

}  // namespace moecore::data
