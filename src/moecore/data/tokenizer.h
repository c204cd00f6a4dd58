// Text tokenizers under Megatron's --tokenizer-type names: GPT2BPETokenizer (vocab.json + merges.txt),
// HuggingFaceTokenizer (tokenizer.json with a byte-level BPE model; pre-tokenizer regexes such as GPT-2's,
// Llama-3's, Qwen's and DeepSeek-V3's run on PCRE2),
// SentencePieceTokenizer / Llama2Tokenizer (a .model file, through libsentencepiece) and ByteLevel
// (moecore's file-free tokenizer). Encoding matches the reference implementations id for id; there is no
// training, no truncation/padding and no chat templates here.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moecore::data {

// Threading: every method is const and safe to call from many threads at once on one instance (the BPE
// word cache is internally locked).
class Tokenizer {
 public:
  virtual ~Tokenizer();
  // Token ids of `text` (raw bytes; invalid UTF-8 is tokenized byte by byte, never rejected). No EOD is
  // appended: callers add eod() per document, as Megatron's preprocessing does.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The bytes of `ids`. Byte-level tokenizers return the exact bytes (no UTF-8 replacement), so
  // decode(encode(x)) == x for any x; ids outside [0, vocab_size()) raise Error.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // Number of token ids (the embedding needs at least this many rows, before Megatron-style padding).
  virtual int64_t vocab_size() const = 0;
  // End-of-document id appended after each document (GPT-2: 50256 "<|endoftext|>"), -1 if none.
  virtual int32_t eod() const = 0;
  virtual int32_t pad() const { return -1; }
  // The --tokenizer-type name, e.g. "GPT2BPETokenizer".
  virtual std::string name() const = 0;
};

// Megatron's tokenizer flags: --tokenizer-type, --vocab-file, --merge-file, --tokenizer-model.
struct TokenizerOptions {
  std::string type;             // GPT2BPETokenizer | HuggingFaceTokenizer | SentencePieceTokenizer |
                                // Llama2Tokenizer | ByteLevel
  std::string vocab_file;       // GPT-2 vocab.json; or a tokenizer.json for HuggingFaceTokenizer
  std::string merge_file;       // GPT-2 merges.txt
  std::string tokenizer_model;  // SentencePiece .model; or a tokenizer.json (or its folder) for HF
};

// Builds the tokenizer `opts.type` names. Raises Error naming the type and file on a bad or missing file,
// an unsupported tokenizer.json component, or an unknown type (the message lists the valid types).
//  - GPT2BPETokenizer: Megatron's GPT-2 BPE; "<|endoftext|>" in text is ordinary text, eod = its id.
//  - HuggingFaceTokenizer: added tokens (e.g. "<|endoftext|>") are matched in the text first; the
//    post-processor's template tokens (Llama-3's BOS) are added; eod/pad come from tokenizer_config.json
//    beside the file when present, otherwise from a well-known end token.
//  - SentencePieceTokenizer: Megatron's wrapper: <CLS> <SEP> <EOD> <MASK> and pad/bos/eos pieces are
//    special tokens (appended to the vocabulary when the model lacks them), matched in text; eod = <EOD>.
//  - Llama2Tokenizer: the plain .model with bos prepended to every encode; eod = eos.
//  - ByteLevel: ids are the bytes 0..255, eod = 256, vocab 257.
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& opts);

}  // namespace moecore::data
