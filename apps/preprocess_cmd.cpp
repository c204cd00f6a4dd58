// `moecore preprocess`: text or JSONL -> Megatron .bin/.idx, with the flags of Megatron's
// tools/preprocess_data.py.
#include <cstdio>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/data_flags.h"
#include "moecore/core/error.h"
#include "moecore/data/preprocess.h"

namespace moecore::apps {

int preprocess_main(int argc, char** argv) {
  Args a("preprocess");
  a.option("--input", "", "input file: JSONL (one object per line) or plain text")
      .option("--input-format", "auto", "auto | jsonl | text (auto: by file extension)")
      .list_option("--json-keys", "JSON keys to tokenize (default: text)")
      .flag("--documents-by-blank-line", "text input: documents are paragraphs between blank lines")
      .option("--output-prefix", "", "output prefix: writes {prefix}_{key}_document.bin/.idx")
      .option("--workers", "1", "tokenizer threads")
      .flag("--append-eod", "append the end-of-document token to every document")
      .option("--log-interval-s", "10", "seconds between progress lines when stderr is not a terminal")
      .domain("--input-format", FlagDomain::one_of({"auto", "jsonl", "text"}))
      .domain("--workers", FlagDomain::integer(1, 1024))
      .domain("--log-interval-s", FlagDomain::number(0.0));
  add_tokenizer_flags(a);
  if (!a.parse(argc, argv)) return 0;
  data::PreprocessOptions o;
  o.input = a.str("--input");
  o.output_prefix = a.str("--output-prefix");
  if (o.input.empty() || o.output_prefix.empty())
    MOECORE_FAIL("preprocess: --input and --output-prefix are required (see moecore preprocess --help)");
  o.input_format = a.str("--input-format");
  if (!a.list("--json-keys").empty()) o.json_keys = a.list("--json-keys");
  o.documents_by_blank_line = a.on("--documents-by-blank-line");
  o.workers = static_cast<int>(a.i64("--workers"));
  o.append_eod = a.on("--append-eod");
  o.log_interval_s = a.f64("--log-interval-s");
  o.tokenizer.type = a.str("--tokenizer-type");
  o.tokenizer.vocab_file = a.str("--vocab-file");
  o.tokenizer.merge_file = a.str("--merge-file");
  o.tokenizer.tokenizer_model = a.str("--tokenizer-model");
  if (o.tokenizer.type.empty()) MOECORE_FAIL("preprocess: --tokenizer-type is required");
  const data::PreprocessStats st = data::preprocess_run(o, stderr);
  for (const auto& p : st.output_prefixes) std::printf("%s\n", p.c_str());
  return 0;
}

}  // namespace moecore::apps
