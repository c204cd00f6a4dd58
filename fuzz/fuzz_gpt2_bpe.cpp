// libFuzzer harness for GPT2BPETokenizer's readers (vocab.json + merges.txt): the input is both files, the
// vocab first, split at the first line "#merges" (absent: everything is the vocab, merges empty). A tokenizer
// that loads then encodes and decodes a short fixed text. Seeds: fuzz/seeds/gpt2_bpe/.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
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
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t cut = in.find("\n#merges\n");
  const std::string vocab = moecore::fuzz::scratch_dir() + "/vocab.json",
                    merges = moecore::fuzz::scratch_dir() + "/merges.txt";
  moecore::fuzz::write_bytes(vocab, in.substr(0, cut));
  moecore::fuzz::write_bytes(merges, cut == std::string_view::npos ? std::string_view() : in.substr(cut + 9));
  try {
    const auto tok = make_tokenizer({"GPT2BPETokenizer", vocab, merges, ""});
    const std::vector<int32_t> ids = tok->encode(kText);
    for (int32_t id : ids) {
      if (id < 0 || id >= tok->vocab_size()) __builtin_trap();  // an id the embedding has no row for
    }
    (void)tok->decode(ids);
  } catch (const moecore::Error&) {
  }
  return 0;
}
