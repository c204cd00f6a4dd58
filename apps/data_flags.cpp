#include "apps/data_flags.h"

#include "moecore/core/error.h"

namespace moecore::apps {

void add_tokenizer_flags(Args& a) {
  a.option("--tokenizer-type", "",
           "GPT2BPETokenizer | HuggingFaceTokenizer | SentencePieceTokenizer | Llama2Tokenizer | ByteLevel")
      .option("--vocab-file", "", "GPT-2 vocab.json, or a HF tokenizer.json")
      .option("--merge-file", "", "GPT-2 merges.txt")
      .option("--tokenizer-model", "", "SentencePiece .model, or a HF tokenizer.json")
      .option("--make-vocab-size-divisible-by", "128", "pad the vocabulary to a multiple of this")
      .domain("--make-vocab-size-divisible-by", FlagDomain::integer(1, 1e6));
}

std::unique_ptr<data::Tokenizer> tokenizer_from(const Args& a) {
  if (a.str("--tokenizer-type").empty())
    MOECORE_FAIL(
        "--tokenizer-type is required (GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, "
        "Llama2Tokenizer or ByteLevel)");
  data::TokenizerOptions o;
  o.type = a.str("--tokenizer-type");
  o.vocab_file = a.str("--vocab-file");
  o.merge_file = a.str("--merge-file");
  o.tokenizer_model = a.str("--tokenizer-model");
  return data::make_tokenizer(o);
}

int64_t padded_vocab_size(const data::Tokenizer& tok, const Args& a, int64_t tp) {
  const int64_t d = a.i64("--make-vocab-size-divisible-by") * tp;
  if (d <= 0) MOECORE_FAIL("--make-vocab-size-divisible-by (", d, ") must be positive");
  return (tok.vocab_size() + d - 1) / d * d;
}

std::vector<int32_t> prompt_tokens(const data::Tokenizer& tok, const std::string& prompt) {
  std::vector<int32_t> ids = tok.encode(prompt);
  if (ids.empty() && tok.eod() < 0)
    MOECORE_FAIL("--prompt '", prompt, "' encodes to no token and tokenizer ", tok.name(),
                 " has no end-of-document token to start from: give a prompt");
  if (ids.empty()) ids.push_back(tok.eod());
  return ids;
}

}  // namespace moecore::apps
