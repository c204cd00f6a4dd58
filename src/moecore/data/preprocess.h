// Corpus preprocessing with Megatron tools/preprocess_data.py semantics: documents in, tokenized by N
// worker threads (output order = input order, byte-identical for any worker count), optionally closed by
// EOD, written as {output_prefix}_{key}_document.bin/.idx with the vocabulary's optimal dtype.
// Not here: NLTK sentence splitting (--split-sentences), input partitions, gzip input.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "moecore/data/tokenizer.h"

namespace moecore::data {

// Input formats:
//  - jsonl: one JSON object per line (Megatron's only format). For each --json-keys key the value is a
//    string (one sequence) or a list of strings (one sequence each, Megatron's pre-split sentences;
//    empty ones are dropped). Blank lines are skipped; a line that is not an object holding every key
//    is an Error naming the file and line.
//  - text: every line that is not blank (whitespace-only) is a document: its bytes without the line break
//    and a trailing '\r'. With documents_by_blank_line, documents are instead the paragraphs between
//    blank lines, their lines joined by '\n'. The output key is json_keys[0] ("text").
//  - auto: jsonl when the input name ends in .jsonl or .json, otherwise text.
struct PreprocessOptions {
  std::string input;                           // --input, e.g. "corpus.jsonl"
  std::string input_format = "auto";           // --input-format: auto | jsonl | text
  std::vector<std::string> json_keys{"text"};  // --json-keys
  bool documents_by_blank_line = false;        // --documents-by-blank-line (text input only)
  std::string output_prefix;                   // --output-prefix, e.g. "data/corpus"
  TokenizerOptions tokenizer;                  // --tokenizer-type, --vocab-file, --merge-file, ...
  int workers = 1;                             // --workers: tokenizer threads (>= 1)
  bool append_eod = false;                     // --append-eod: eod() after each non-empty document
  double log_interval_s = 10.0;                // --log-interval-s: progress line period off a terminal
  int64_t batch_documents = 1024;              // documents handed to the workers per round, per worker
};

struct PreprocessStats {
  int64_t documents = 0;                     // input documents (JSONL objects or text documents)
  int64_t tokens = 0;                        // tokens written, all keys, EOD included
  int64_t input_bytes = 0;                   // bytes of input consumed
  double seconds = 0;                        // wall time
  std::vector<std::string> output_prefixes;  // one "{output_prefix}_{key}_document" per key
};

// Runs the whole job. Progress goes to `progress` (nullptr: silent): a redrawn bar with docs/s and MB/s
// when it is a terminal, otherwise one line every log_interval_s seconds, and a final summary line.
// Throws Error for bad options, unreadable input, malformed JSON, or a tokenizer without EOD when
// append_eod is set. Partial outputs are never committed: the .idx files are written last.
PreprocessStats preprocess_run(const PreprocessOptions& options, std::FILE* progress = stderr);

}  // namespace moecore::data
