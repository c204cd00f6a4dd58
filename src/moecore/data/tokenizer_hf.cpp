// HuggingFaceTokenizer: a tokenizer.json whose model is byte-level BPE (GPT-2, Llama-3, Qwen2/3, DeepSeek-V3 styles).
// Supported: added tokens (leftmost-longest, lstrip/rstrip/single_word/normalized), normalizer null/NFC/Sequence,
// pre-tokenizers ByteLevel, Split (any PCRE2-compatible Regex or String pattern, every behaviour, invert) and Digits
// in a Sequence, post-processors ByteLevel/TemplateProcessing. Anything else (WordPiece, Unigram, Metaspace, ...) is
// rejected with an Error naming the component.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <deque>
#include <filesystem>

#include "moecore/core/error.h"
#include "moecore/data/tokenizer_bpe.h"
#include "moecore/data/unicode_text.h"
#include "moecore/io/json.h"

namespace moecore::data::detail {
namespace {

using json = nlohmann::json;

struct AddedToken {
  std::string content;
  int32_t id;
  bool single_word, lstrip, rstrip, normalized;
};

struct PreStep {
  bool byte_level;          // ByteLevel (else Split or Digits)
  bool add_prefix_space;    // ByteLevel only
  const SplitRegex* regex;  // null: no split (ByteLevel with use_regex false)
  SplitBehavior behavior;
  bool invert;
};

struct HfConfig {
  std::vector<AddedToken> added;
  bool nfc = false;
  std::vector<PreStep> steps;
  std::vector<std::unique_ptr<SplitRegex>> regexes;  // owned by the steps above
  std::vector<int32_t> prefix, suffix;               // post-processor template tokens around the sequence
};

// The code point ending at byte `end` (> 0) of s.
char32_t cp_before(std::string_view s, size_t end, size_t* start) {
  size_t i = end - 1;
  while (i > 0 && end - i < 4 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  char32_t cp;
  if (i + unicode::utf8_decode(s, i, &cp) != end) {
    i = end - 1;
    cp = unicode::kInvalidBase + static_cast<unsigned char>(s[i]);
  }
  *start = i;
  return cp;
}

// Finds added tokens in text the way HF's AddedVocabulary does: leftmost-longest matches, then the
// single_word / lstrip / rstrip rules.
struct AddedMatcher {
  std::vector<const AddedToken*> tokens;  // longest content first
  std::vector<std::string> contents;      // as matched (NFC-normalized for normalized tokens)
  std::array<bool, 256> first_byte{};

  void add(const AddedToken& t, std::string content) {
    if (content.empty()) return;
    first_byte[static_cast<unsigned char>(content[0])] = true;
    tokens.push_back(&t);
    contents.push_back(std::move(content));
  }
  void finish() {
    std::vector<size_t> order(tokens.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return contents[a].size() > contents[b].size(); });
    std::vector<const AddedToken*> t;
    std::vector<std::string> c;
    for (size_t i : order) t.push_back(tokens[i]), c.push_back(contents[i]);
    tokens.swap(t);
    contents.swap(c);
  }

  // Calls segment(view) for the text between matches and pushes each match's id, in order.
  template <class Segment>
  void split(std::string_view text, std::vector<int32_t>& ids, const Segment& segment) const {
    size_t seg = 0;
    for (size_t p = 0; p < text.size() && !tokens.empty(); ++p) {
      if (!first_byte[static_cast<unsigned char>(text[p])]) continue;
      size_t k = 0;
      while (k < tokens.size() && !text.substr(p).starts_with(contents[k])) ++k;
      if (k == tokens.size()) continue;
      const AddedToken& hit = *tokens[k];
      size_t start = p, stop = p + contents[k].size();
      p = stop - 1;  // matching resumes after this match, whether or not it is kept
      if (hit.single_word) {
        size_t unused;
        char32_t after = 0;
        if (stop < text.size()) unicode::utf8_decode(text, stop, &after);
        if ((start > 0 && unicode::is_word_char(cp_before(text, start, &unused))) ||
            (stop < text.size() && unicode::is_word_char(after)))
          continue;
      }
      size_t prev = 0;
      while (hit.lstrip && start > seg && unicode::is_whitespace(cp_before(text, start, &prev))) start = prev;
      while (hit.rstrip && stop < text.size()) {
        char32_t cp;
        const int len = unicode::utf8_decode(text, stop, &cp);
        if (!unicode::is_whitespace(cp)) break;
        stop += len;
      }
      segment(text.substr(seg, start - seg));
      ids.push_back(hit.id);
      seg = stop;
      p = stop - 1;
    }
    segment(text.substr(seg));
  }
};

class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(std::unique_ptr<BpeModel> model, HfConfig cfg, int32_t eod, int32_t pad)
      : model_(std::move(model)), cfg_(std::move(cfg)), eod_(eod), pad_(pad) {
    id_end_ = model_->id_end();
    for (const AddedToken& t : cfg_.added) {
      id_end_ = std::max<int64_t>(id_end_, int64_t{t.id} + 1);
      // Non-normalized tokens match the raw text; normalized ones the normalized text, in their normal form.
      if (t.normalized)
        normalized_.add(t, cfg_.nfc ? unicode::nfc(t.content) : t.content);
      else
        raw_.add(t, t.content);
    }
    raw_.finish();
    normalized_.finish();
    added_by_id_.assign(id_end_, -1);
    for (size_t i = 0; i < cfg_.added.size(); ++i) {
      const AddedToken& t = cfg_.added[i];
      added_by_id_[t.id] = static_cast<int32_t>(i);
      // HF decodes an added token from its normalized content, through the ByteLevel decoder like any token.
      added_bytes_.push_back(token_to_bytes(t.normalized && cfg_.nfc ? unicode::nfc(t.content) : t.content));
    }
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(cfg_.prefix);
    raw_.split(text, ids, [&](std::string_view seg) {
      if (seg.empty()) return;
      std::string norm;
      if (cfg_.nfc) seg = norm = unicode::nfc(seg);
      normalized_.split(seg, ids, [&](std::string_view sub) { encode_segment(sub, ids); });
    });
    ids.insert(ids.end(), cfg_.suffix.begin(), cfg_.suffix.end());
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id >= 0 && id < id_end_ && added_by_id_[id] >= 0) {
        out += added_bytes_[added_by_id_[id]];
      } else if (!model_->decode_token(id, out)) {
        MOECORE_FAIL("HuggingFaceTokenizer: decode: id ", id, " is not in the vocabulary (size ", id_end_, ")");
      }
    }
    return out;
  }
  int64_t vocab_size() const override { return id_end_; }
  int32_t eod() const override { return eod_; }
  int32_t pad() const override { return pad_; }
  std::string name() const override { return "HuggingFaceTokenizer"; }

 private:
  // Pre-tokenizer steps, then BPE per piece. `seg` is already normalized.
  void encode_segment(std::string_view seg, std::vector<int32_t>& ids) const {
    if (seg.empty()) return;
    std::deque<std::string> owned;  // prefixed copies the views below point into
    std::vector<std::string_view> pieces{seg}, next;
    for (const PreStep& step : cfg_.steps) {
      next.clear();
      for (std::string_view p : pieces) {
        if (step.add_prefix_space && !p.starts_with(' ')) p = owned.emplace_back(" " + std::string(p));
        if (step.regex != nullptr)
          step.regex->split(p, step.behavior, step.invert, next);
        else
          next.push_back(p);
      }
      pieces.swap(next);
    }
    for (std::string_view p : pieces) model_->encode_word(p, ids);
  }

  std::unique_ptr<BpeModel> model_;
  HfConfig cfg_;
  int32_t eod_, pad_;
  int64_t id_end_ = 0;
  AddedMatcher raw_, normalized_;
  std::vector<int32_t> added_by_id_;
  std::vector<std::string> added_bytes_;  // decoded bytes per added token
};

[[noreturn]] void unsupported(const std::string& path, const std::string& what, const json& j) {
  MOECORE_FAIL("HuggingFaceTokenizer: '", path, "': unsupported ", what, " ", j.dump().substr(0, 300),
               "; supported: byte-level BPE tokenizer.json files (GPT-2, Llama-3, Qwen2/3, DeepSeek-V3 styles). For "
               "SentencePiece models (Llama-2, Mistral) use --tokenizer-type SentencePieceTokenizer with the .model");
}

void parse_normalizer(const json& n, const std::string& path, HfConfig& cfg) {
  if (n.is_null()) return;
  const std::string type = n.value("type", "");
  if (type == "NFC") {
    cfg.nfc = true;
  } else if (type == "Sequence") {
    for (const json& x : n.at("normalizers")) parse_normalizer(x, path, cfg);
  } else {
    unsupported(path, "normalizer", n);
  }
}

// A Split's "behavior" (HF spells them Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous).
SplitBehavior split_behavior(const json& p, const std::string& path) {
  static const std::pair<const char*, SplitBehavior> kNames[] = {
      {"Isolated", SplitBehavior::isolated},
      {"Removed", SplitBehavior::removed},
      {"MergedWithPrevious", SplitBehavior::merged_with_previous},
      {"MergedWithNext", SplitBehavior::merged_with_next},
      {"Contiguous", SplitBehavior::contiguous}};
  const std::string name = p.value("behavior", "");
  for (const auto& [n, b] : kNames) {
    if (name == n) return b;
  }
  unsupported(path, "Split behavior '" + name + "'", p);
}

void parse_pre_tokenizer(const json& p, const std::string& path, HfConfig& cfg) {
  const std::string type = p.is_null() ? "" : p.value("type", "");
  if (type == "Sequence") {
    for (const json& x : p.at("pretokenizers")) parse_pre_tokenizer(x, path, cfg);
  } else if (type == "ByteLevel") {
    const SplitRegex* gpt2 = p.value("use_regex", true) ? &SplitRegex::gpt2() : nullptr;
    cfg.steps.push_back({true, p.value("add_prefix_space", false), gpt2, SplitBehavior::isolated, false});
  } else if (type == "Split") {
    const json& pat = p.at("pattern");
    const bool literal = pat.contains("String");
    if (!literal && !pat.contains("Regex")) unsupported(path, "Split pattern (expected Regex or String)", p);
    const std::string source = "HuggingFaceTokenizer: '" + path + "'";
    cfg.regexes.push_back(
        std::make_unique<SplitRegex>(pat[literal ? "String" : "Regex"].get<std::string>(), literal, source));
    cfg.steps.push_back({false, false, cfg.regexes.back().get(), split_behavior(p, path), p.value("invert", false)});
  } else if (type == "Digits") {  // HF splits on char::is_numeric, i.e. \p{N}: each digit, or runs of them
    const bool each = p.value("individual_digits", false);
    cfg.regexes.push_back(std::make_unique<SplitRegex>(each ? "\\p{N}" : "\\p{N}+", false, "Digits pre-tokenizer"));
    cfg.steps.push_back({false, false, cfg.regexes.back().get(), SplitBehavior::isolated, false});
  } else {
    unsupported(path, "pre_tokenizer", p);
  }
}

// The id of an added token or vocab entry spelled `content`, or -1.
int32_t lookup(const HfConfig& cfg, const BpeModel& model, const std::string& content) {
  for (const AddedToken& t : cfg.added) {
    if (t.content == content) return t.id;
  }
  return model.token_id(content);
}

void parse_post_processor(const json& p, const std::string& path, HfConfig& cfg) {
  const std::string type = p.is_null() ? "" : p.value("type", "");
  if (type.empty() || type == "ByteLevel") return;
  if (type == "Sequence") {
    for (const json& x : p.at("processors")) parse_post_processor(x, path, cfg);
    return;
  }
  if (type != "TemplateProcessing") unsupported(path, "post_processor", p);
  bool seen_sequence = false;
  for (const json& item : p.at("single")) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
    } else if (item.contains("SpecialToken")) {
      const std::string name = item["SpecialToken"].at("id").get<std::string>();
      const json& ids = p.at("special_tokens").at(name).at("ids");
      auto& dst = seen_sequence ? cfg.suffix : cfg.prefix;
      for (const json& id : ids)
        dst.push_back(json_token_id(id, "HuggingFaceTokenizer: '" + path + "'", "special token", name));
    }
  }
}

// eos_token / pad_token of a tokenizer_config.json beside the file: a string or {"content": ...}.
std::string config_token(const json& cfg, const char* key) {
  if (!cfg.is_object() || !cfg.contains(key)) return "";
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

std::vector<std::pair<std::string, std::string>> parse_merges(const json& merges, const std::string& path) {
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (const json& m : merges) {
    if (m.is_string()) {  // "A B" (tokenizers < 0.20)
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 == s.size())
        MOECORE_FAIL("HuggingFaceTokenizer: '", path, "': merge ", out.size(), " is '", s, "', expected \"A B\"");
      out.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (m.is_array() && m.size() == 2) {  // ["A", "B"]
      out.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      MOECORE_FAIL("HuggingFaceTokenizer: '", path, "': merge ", out.size(), " is ", m.dump(),
                   ", expected \"A B\" or [A, B]");
    }
  }
  return out;
}

std::unique_ptr<BpeModel> parse_model(const json& m, const std::string& path, int64_t added_count) {
  if (m.value("type", "BPE") != "BPE") unsupported(path, "model type", m["type"]);
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
    unsupported(path, "BPE dropout", m["dropout"]);
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty()) unsupported(path, k, m[k]);
  }
  const std::string source = "HuggingFaceTokenizer: '" + path + "'";
  const json& v = m.at("vocab");
  if (!v.is_object()) MOECORE_FAIL(source, ": model.vocab is not an object of token -> id");
  std::unordered_map<std::string, int32_t> vocab;
  vocab.reserve(v.size());
  for (const auto& [tok, id] : v.items()) vocab.emplace(tok, json_token_id(id, source, "model.vocab token", tok));
  BpeOptions opts;
  opts.extra_ids = added_count;
  opts.ignore_merges = m.value("ignore_merges", false);
  opts.fuse_unk = m.value("fuse_unk", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    if (const auto it = vocab.find(m["unk_token"].get<std::string>()); it != vocab.end()) opts.unk_id = it->second;
  }
  return std::make_unique<BpeModel>(std::move(vocab), parse_merges(m.at("merges"), path), opts, source);
}

// HF re-adds these on load: a content already in the model vocab takes the vocab's id.
void parse_added_tokens(const json& list, const BpeModel& model, const std::string& path, HfConfig& cfg) {
  const std::string source = "HuggingFaceTokenizer: '" + path + "'";
  // Added tokens and the model vocab share one id space; both size tables by the largest id.
  const int64_t limit = model.id_end() + static_cast<int64_t>(list.size()) + kVocabIdSlack;
  for (const json& t : list) {
    const std::string content = t.at("content").get<std::string>();
    AddedToken a{content,
                 json_token_id(t.at("id"), source, "added token", content),
                 t.value("single_word", false),
                 t.value("lstrip", false),
                 t.value("rstrip", false),
                 t.value("normalized", !t.value("special", false))};
    if (const int32_t vid = model.token_id(a.content); vid >= 0) a.id = vid;
    if (a.id >= limit) {
      MOECORE_FAIL(source, ": added token '", a.content.substr(0, 200), "' has id ", a.id, ", beyond ", limit - 1,
                   " (the model vocab ends at ", model.id_end(), ", and ids may skip at most ", kVocabIdSlack,
                   " values); the tokenizer.json is corrupt");
    }
    cfg.added.push_back(std::move(a));
  }
}

// tokenizer_config.json beside the tokenizer.json (eos/pad names), or null.
json read_tokenizer_config(const std::string& path) {
  const auto cfg_path = (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  if (!std::filesystem::exists(cfg_path)) return json();
  return io::parse_json(read_text_file(cfg_path, "HuggingFaceTokenizer", "tokenizer_config.json"),
                        "HuggingFaceTokenizer: '" + cfg_path + "'");
}

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& given) {
  if (given.empty())
    MOECORE_FAIL("HuggingFaceTokenizer: needs a tokenizer.json (or its folder) in --tokenizer-model or --vocab-file");
  std::string path = given;
  if (std::filesystem::is_directory(path)) path = (std::filesystem::path(path) / "tokenizer.json").string();
  const std::string text = read_text_file(path, "HuggingFaceTokenizer", "tokenizer.json");
  HfConfig cfg;
  std::unique_ptr<BpeModel> model;
  try {
    const json j = io::parse_json(text, "HuggingFaceTokenizer: '" + path + "'");
    if (!j.is_object() || !j.contains("model"))
      MOECORE_FAIL("HuggingFaceTokenizer: '", path, "' has no \"model\"; is it a tokenizer.json?");
    const json added = j.value("added_tokens", json::array());
    if (!added.is_array()) MOECORE_FAIL("HuggingFaceTokenizer: '", path, "': added_tokens is not a list");
    model = parse_model(j["model"], path, static_cast<int64_t>(added.size()));
    parse_normalizer(j.value("normalizer", json()), path, cfg);
    parse_pre_tokenizer(j.value("pre_tokenizer", json()), path, cfg);
    if (std::none_of(cfg.steps.begin(), cfg.steps.end(), [](const PreStep& s) { return s.byte_level; }))
      unsupported(path, "pre_tokenizer without ByteLevel", j.value("pre_tokenizer", json()));
    for (size_t i = 1; i < cfg.steps.size(); ++i) {
      if (cfg.steps[i].add_prefix_space)
        unsupported(path, "ByteLevel add_prefix_space after a Split", j["pre_tokenizer"]);
    }
    parse_added_tokens(added, *model, path, cfg);
    parse_post_processor(j.value("post_processor", json()), path, cfg);
    // Template tokens are emitted by encode, so each must have an embedding row.
    int64_t id_end = model->id_end();
    for (const AddedToken& t : cfg.added) id_end = std::max<int64_t>(id_end, int64_t{t.id} + 1);
    for (const auto* ids : {&cfg.prefix, &cfg.suffix}) {
      for (int32_t id : *ids) {
        if (id >= id_end) {
          MOECORE_FAIL("HuggingFaceTokenizer: '", path, "': post_processor template token id ", id,
                       " is outside the vocabulary (size ", id_end, "); the tokenizer.json is corrupt");
        }
      }
    }
  } catch (const json::exception& e) {
    MOECORE_FAIL("HuggingFaceTokenizer: '", path, "' is not a valid tokenizer.json: ", e.what());
  }
  const json tokcfg = read_tokenizer_config(path);
  int32_t eod = -1, pad = -1;
  if (const std::string eos = config_token(tokcfg, "eos_token"); !eos.empty()) eod = lookup(cfg, *model, eos);
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    if (eod < 0) eod = lookup(cfg, *model, name);
  }
  if (const std::string p = config_token(tokcfg, "pad_token"); !p.empty()) pad = lookup(cfg, *model, p);
  return std::make_unique<HfTokenizer>(std::move(model), std::move(cfg), eod, pad);
}

}  // namespace moecore::data::detail
