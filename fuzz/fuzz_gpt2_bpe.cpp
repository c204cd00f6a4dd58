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

#include "moecore/core/error.h"
#include "moecore/data/tokenizer.h"

namespace {

const std::string& work_dir() {
  static const std::string dir = [] {
    const auto p = std::filesystem::temp_directory_path() / ("moecore_fuzz_gpt2_" + std::to_string(::getpid()));
    std::filesystem::create_directories(p);
    return p.string();
  }();
  return dir;
}

void write(const std::string& path, std::string_view s) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(s.data(), static_cast<std::streamsize>(s.size()));
}

const std::string kText =
    std::string("Hello world's 2024 <|endoftext|>  caf\xc3\xa9\n\t x\xff\xfe ") + std::string(1, '\0') + "\xe2\x82 end";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::data;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t cut = in.find("\n#merges\n");
  const std::string vocab = work_dir() + "/vocab.json", merges = work_dir() + "/merges.txt";
  write(vocab, in.substr(0, cut));
  write(merges, cut == std::string_view::npos ? std::string_view() : in.substr(cut + 9));
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
