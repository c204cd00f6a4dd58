// libFuzzer harness for the HuggingFace tokenizer.json reader (make_tokenizer "HuggingFaceTokenizer"): the input
// is the tokenizer.json; a tokenizer that loads then encodes and decodes a short fixed text (added tokens,
// whitespace, digits, NUL, invalid UTF-8) and decodes the first ids. Seeds: fuzz/seeds/hf_tokenizer/, GPT-2,
// Llama-3 and Qwen style pipelines over a 280-token byte-level vocab.
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
    std::string("Hello world's 2024 <|endoftext|>  caf\xc3\xa9\n\t x\xff\xfe ") + std::string(1, '\0') + "\xe2\x82 end";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::data;
  const std::string path = moecore::fuzz::scratch_dir() + "/tokenizer.json";
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  try {
    const auto tok = make_tokenizer({"HuggingFaceTokenizer", "", "", path});
    const std::vector<int32_t> ids = tok->encode(kText);
    for (int32_t id : ids) {
      if (id < 0 || id >= tok->vocab_size()) __builtin_trap();  // an id the embedding has no row for
    }
    (void)tok->decode(ids);
    std::vector<int32_t> first;
    for (int32_t id = 0; id < tok->vocab_size() && id < 64; ++id) first.push_back(id);
    try {
      (void)tok->decode(first);
    } catch (const moecore::Error&) {  // holes in the id space are allowed
    }
  } catch (const moecore::Error&) {
  }
  return 0;
}
