// libFuzzer harness for the SentencePiece readers (SentencePieceTokenizer and Llama2Tokenizer over
// libsentencepiece): the input is the .model protobuf; a model that loads then encodes and decodes a short
// fixed text with Megatron's special tokens. Seeds: fuzz/seeds/sentencepiece/, tiny models from spm_train on four
// pangram lines (--vocab_size 60..320; bpe, unigram, byte_fallback, a --normalization_rule_tsv charsmap).
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "moecore/core/error.h"
#include "moecore/data/tokenizer.h"

namespace {

const std::string kText =
    std::string("Hello world's 2024 <EOD> </s> caf\xc3\xa9\n\t x\xff\xfe ") + std::string(1, '\0') + "\xe2\x82 end";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::data;
  const std::string path = moecore::fuzz::scratch_dir() + "/t.model";
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  for (const char* type : {"SentencePieceTokenizer", "Llama2Tokenizer"}) {
    try {
      const auto tok = make_tokenizer({type, "", "", path});
      const std::vector<int32_t> ids = tok->encode(kText);
      for (int32_t id : ids) {
        if (id < 0 || id >= tok->vocab_size()) __builtin_trap();  // an id the embedding has no row for
      }
      (void)tok->decode(ids);
    } catch (const moecore::Error&) {
    }
  }
  return 0;
}
