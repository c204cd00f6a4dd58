// preprocess_run: read documents in rounds, tokenize a round on worker threads while the next round is
// read, then append the round to the builders in input order (so output bytes never depend on timing).
#include "moecore/data/preprocess.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/io/file_util.h"
#include "moecore/io/json.h"

namespace moecore::data {
namespace {

using Clock = std::chrono::steady_clock;

struct RawDoc {
  std::string text;  // a JSON line, or a text document
  int64_t line = 0;  // 1-based line where it starts
};

struct Encoded {
  std::vector<std::vector<int32_t>> ids;      // [keys][tokens]
  std::vector<std::vector<int32_t>> lengths;  // [keys][sequences]
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_blank(const std::string& s) {
  return s.find_first_not_of(" \t\r\n\f\v") == std::string::npos;
}

class DocReader {
 public:
  DocReader(const std::string& path, bool jsonl, bool by_blank_line)
      : path_(path), in_(path, std::ios::binary), jsonl_(jsonl), by_blank_(by_blank_line) {
    if (!in_) MOECORE_FAIL("preprocess: cannot open --input '", path, "'");
    std::error_code ec;
    total_ = static_cast<int64_t>(std::filesystem::file_size(path, ec));
    if (ec) total_ = 0;
  }
  int64_t bytes_read() const { return bytes_; }
  int64_t total_bytes() const { return total_; }

  bool next(RawDoc& doc) {
    std::string line;
    doc.text.clear();
    bool have = false;
    while (read_line(line)) {
      if (jsonl_) {
        if (is_blank(line)) continue;
        doc = {std::move(line), line_no_};
        return true;
      }
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (!by_blank_) {
        if (is_blank(line)) continue;
        doc = {std::move(line), line_no_};
        return true;
      }
      if (is_blank(line)) {
        if (have) return true;
        continue;
      }
      if (have) {
        doc.text += '\n';
      } else {
        doc.line = line_no_;
        have = true;
      }
      doc.text += line;
    }
    if (in_.bad()) MOECORE_FAIL("preprocess: read error in '", path_, "' after line ", line_no_);
    return have;
  }

 private:
  bool read_line(std::string& line) {
    if (!std::getline(in_, line)) return false;
    ++line_no_;
    bytes_ += static_cast<int64_t>(line.size()) + (in_.eof() ? 0 : 1);
    return true;
  }

  std::string path_;
  std::ifstream in_;
  bool jsonl_, by_blank_;
  int64_t line_no_ = 0, bytes_ = 0, total_ = 0;
};

// Megatron Encoder.encode for one document and key list.
Encoded encode_document(const RawDoc& doc, bool jsonl, const PreprocessOptions& o, const Tokenizer& tok) {
  Encoded out;
  out.ids.resize(o.json_keys.size());
  out.lengths.resize(o.json_keys.size());
  auto add_sequence = [&](size_t k, std::string_view text) {
    std::vector<int32_t> ids = tok.encode(text);
    if (ids.empty()) return;
    // .idx sizes are int32, and --append-eod adds one more token to the last sequence.
    if (ids.size() >= size_t(std::numeric_limits<int32_t>::max())) {
      MOECORE_FAIL("preprocess: '", o.input, "' line ", doc.line, ": a sequence of ", ids.size(),
                   " tokens does not fit the .idx format (at most 2^31 - 2); split the document");
    }
    out.ids[k].insert(out.ids[k].end(), ids.begin(), ids.end());
    out.lengths[k].push_back(static_cast<int32_t>(ids.size()));
  };
  if (!jsonl) {
    add_sequence(0, doc.text);
  } else {
    const nlohmann::json j = io::parse_json(doc.text, detail::str_cat("preprocess: '", o.input, "' line ", doc.line));
    if (!j.is_object()) MOECORE_FAIL("preprocess: '", o.input, "' line ", doc.line, ": expected a JSON object");
    for (size_t k = 0; k < o.json_keys.size(); ++k) {
      auto it = j.find(o.json_keys[k]);
      if (it == j.end()) {
        MOECORE_FAIL("preprocess: '", o.input, "' line ", doc.line, ": no key \"", o.json_keys[k],
                     "\" (set --json-keys to the field holding the text)");
      }
      if (it->is_string()) {
        add_sequence(k, it->get_ref<const std::string&>());
      } else if (it->is_array()) {
        for (const auto& s : *it) {
          if (!s.is_string()) {
            MOECORE_FAIL("preprocess: '", o.input, "' line ", doc.line, ": \"", o.json_keys[k],
                         "\" lists a non-string");
          }
          add_sequence(k, s.get_ref<const std::string&>());
        }
      } else {
        MOECORE_FAIL("preprocess: '", o.input, "' line ", doc.line, ": \"", o.json_keys[k],
                     "\" must be a string or a list of strings");
      }
    }
  }
  if (o.append_eod) {
    for (size_t k = 0; k < out.ids.size(); ++k) {
      if (out.ids[k].empty()) continue;
      out.ids[k].push_back(tok.eod());
      out.lengths[k].back() += 1;
    }
  }
  return out;
}

class Progress {
 public:
  Progress(std::FILE* f, double interval_s)
      : f_(f), tty_(f && ::isatty(::fileno(f))), interval_(interval_s), start_(Clock::now()), last_(start_) {}

  double elapsed() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

  void update(int64_t docs, int64_t bytes, int64_t total, bool final) {
    if (!f_) return;
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (!final && since < (tty_ ? 0.2 : interval_)) return;
    last_ = now;
    const double t = std::max(elapsed(), 1e-9);
    const double docs_s = double(docs) / t, mb_s = double(bytes) / t / 1024.0 / 1024.0;
    if (tty_) {
      const double frac = total > 0 ? std::min(1.0, double(bytes) / double(total)) : 0.0;
      constexpr int kWidth = 30;
      char bar[kWidth + 1];
      const int full = static_cast<int>(frac * kWidth);
      for (int i = 0; i < kWidth; ++i) bar[i] = i < full ? '#' : '.';
      bar[kWidth] = '\0';
      std::fprintf(f_, "\rpreprocess [%s] %5.1f%%  %lld docs  %.0f docs/s  %.2f MB/s%s", bar, 100.0 * frac,
                   static_cast<long long>(docs), docs_s, mb_s, final ? "\n" : "");
    } else {
      std::fprintf(f_, "preprocess: %lld documents (%.1f docs/s, %.2f MB/s)%s\n", static_cast<long long>(docs), docs_s,
                   mb_s, final ? ", done" : "");
    }
    std::fflush(f_);
  }

 private:
  std::FILE* f_;
  bool tty_;
  double interval_;
  Clock::time_point start_, last_;
};

bool resolve_jsonl(const PreprocessOptions& o) {
  if (o.input_format == "jsonl") return true;
  if (o.input_format == "text") return false;
  if (o.input_format == "auto") return ends_with(o.input, ".jsonl") || ends_with(o.input, ".json");
  MOECORE_FAIL("preprocess: --input-format '", o.input_format, "' must be auto, jsonl or text");
}

}  // namespace

PreprocessStats preprocess_run(const PreprocessOptions& o, std::FILE* progress_file) {
  if (o.input.empty()) MOECORE_FAIL("preprocess: --input is required");
  if (o.output_prefix.empty()) MOECORE_FAIL("preprocess: --output-prefix is required");
  if (o.workers < 1) MOECORE_FAIL("preprocess: --workers (", o.workers, ") must be >= 1");
  if (o.json_keys.empty()) MOECORE_FAIL("preprocess: --json-keys needs at least one key");
  // Each key writes {prefix}_{key}_document.bin/.idx: a key given twice would write the same files twice over.
  for (size_t k = 0; k < o.json_keys.size(); ++k)
    for (size_t j = 0; j < k; ++j)
      if (o.json_keys[j] == o.json_keys[k])
        MOECORE_FAIL("preprocess: --json-keys names '", o.json_keys[k], "' twice (", j + 1, ". and ", k + 1,
                     ". key); each key writes its own .bin/.idx, so give each once");
  if (o.batch_documents < 1) MOECORE_FAIL("preprocess: batch_documents (", o.batch_documents, ") must be >= 1");
  const bool jsonl = resolve_jsonl(o);
  if (!jsonl && o.json_keys.size() != 1) {
    MOECORE_FAIL("preprocess: text input has one field; got ", o.json_keys.size(), " --json-keys");
  }
  if (jsonl && o.documents_by_blank_line) {
    MOECORE_FAIL("preprocess: --documents-by-blank-line applies to text input, not JSONL '", o.input, "'");
  }
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(o.tokenizer);  // thread-safe: shared by all workers
  if (o.append_eod && tok->eod() < 0) {
    MOECORE_FAIL("preprocess: --append-eod but tokenizer ", tok->name(), " has no end-of-document token");
  }
  const TokenDType dtype = token_dtype_optimal(tok->vocab_size());

  PreprocessStats stats;
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  for (const auto& key : o.json_keys) {
    const std::string prefix = o.output_prefix + "_" + key + "_document";
    const std::vector<io::FlagPath> inputs = {{"--input", o.input},
                                              {"--vocab-file", o.tokenizer.vocab_file},
                                              {"--merge-file", o.tokenizer.merge_file},
                                              {"--tokenizer-model", o.tokenizer.tokenizer_model}};
    for (const std::string& out : {indexed_bin_path(prefix), indexed_idx_path(prefix)})
      io::check_output_file({"--output-prefix", out}, inputs);
    stats.output_prefixes.push_back(prefix);
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(indexed_bin_path(prefix), dtype));
  }

  DocReader reader(o.input, jsonl, o.documents_by_blank_line);
  Progress progress(progress_file, o.log_interval_s);
  const size_t round = static_cast<size_t>(o.batch_documents) * static_cast<size_t>(o.workers);
  auto read_round = [&] {
    std::vector<RawDoc> docs;
    RawDoc d;
    while (docs.size() < round && reader.next(d)) docs.push_back(std::move(d));
    return docs;
  };

  std::vector<RawDoc> cur = read_round();
  while (!cur.empty()) {
    std::vector<Encoded> enc(cur.size());
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex error_mutex;
    auto work = [&] {
      for (size_t i; !failed && (i = next.fetch_add(1)) < cur.size();) {
        try {
          enc[i] = encode_document(cur[i], jsonl, o, *tok);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
          failed = true;
        }
      }
    };
    std::vector<std::thread> threads;
    for (int w = 0; w < o.workers; ++w) threads.emplace_back(work);
    std::vector<RawDoc> following;
    std::exception_ptr read_error;
    try {
      following = read_round();  // overlaps with tokenization
    } catch (...) {
      read_error = std::current_exception();
    }
    for (auto& t : threads) t.join();
    if (error) std::rethrow_exception(error);
    if (read_error) std::rethrow_exception(read_error);
    for (size_t i = 0; i < enc.size(); ++i) {
      for (size_t k = 0; k < builders.size(); ++k) {
        builders[k]->add_document(enc[i].ids[k], enc[i].lengths[k]);
        stats.tokens += static_cast<int64_t>(enc[i].ids[k].size());
      }
    }
    stats.documents += static_cast<int64_t>(cur.size());
    stats.input_bytes = reader.bytes_read();
    progress.update(stats.documents, stats.input_bytes, reader.total_bytes(), false);
    cur = std::move(following);
  }
  for (size_t k = 0; k < builders.size(); ++k) builders[k]->finalize(indexed_idx_path(stats.output_prefixes[k]));
  stats.input_bytes = reader.bytes_read();
  stats.seconds = progress.elapsed();
  progress.update(stats.documents, stats.input_bytes, reader.total_bytes(), true);
  return stats;
}

}  // namespace moecore::data
