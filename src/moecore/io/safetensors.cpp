// safetensors reader and writer. The reader enforces the reference reader's rules (docs/formats.md §3.4):
// header size bounds, string-only metadata, no duplicate names, offsets that tile the buffer exactly,
// byte sizes that match shapes, and no trailing bytes. io/hf_checkpoint streams files through the same
// header functions, so these rules live only here.
#include "moecore/io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "moecore/io/file_util.h"
#include "moecore/io/input_file.h"
#include "moecore/io/json.h"

namespace moecore::io {
namespace {

using nlohmann::json;

// Every dtype of docs/formats.md §3.2 in the Rust enum order, so that a header with any of them lists.
const SafetensorsDtype kDtypes[] = {
    {"BOOL", 8, 0, DType::boolean},      {"F4", 4, 1, std::nullopt},           {"F6_E2M3", 6, 2, std::nullopt},
    {"F6_E3M2", 6, 3, std::nullopt},     {"U8", 8, 4, std::nullopt},           {"I8", 8, 5, std::nullopt},
    {"F8_E5M2", 8, 6, DType::f8e5m2},    {"F8_E4M3", 8, 7, DType::f8e4m3},     {"F8_E8M0", 8, 8, std::nullopt},
    {"F8_E4M3FNUZ", 8, 9, std::nullopt}, {"F8_E5M2FNUZ", 8, 10, std::nullopt}, {"I16", 16, 11, std::nullopt},
    {"U16", 16, 12, std::nullopt},       {"F16", 16, 13, DType::f16},          {"BF16", 16, 14, DType::bf16},
    {"I32", 32, 15, DType::i32},         {"U32", 32, 16, std::nullopt},        {"F32", 32, 17, DType::f32},
    {"C64", 64, 18, std::nullopt},       {"F64", 64, 19, DType::f64},          {"I64", 64, 20, DType::i64},
    {"U64", 64, 21, std::nullopt},
};

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  MOECORE_FAIL("safetensors: '", path, "' is not a valid safetensors file: ", why);
}

// Whether `s` is well-formed UTF-8 (the reference reader decodes the header with str::from_utf8).
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (int k = 1; k <= n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = cp << 6 | (b & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

// Strict parse: nlohmann keeps the last of duplicate keys, so reject them while parsing. Nesting is bounded
// first (the parser and the DOM's destructor recurse). `fail` throws.
template <class Fail>
json parse_strict(std::string_view text, const char* what, Fail fail) {
  if (json_nesting_depth(text) > kMaxJsonDepth)
    fail(std::string(what) + " nests JSON deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  std::vector<std::set<std::string>> stack;
  std::string dup;
  auto cb = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      stack.emplace_back();
    } else if (ev == json::parse_event_t::object_end) {
      if (!stack.empty()) stack.pop_back();
    } else if (ev == json::parse_event_t::key && !stack.empty()) {
      if (!stack.back().insert(parsed.get<std::string>()).second && dup.empty()) dup = parsed.get<std::string>();
    }
    return true;
  };
  json h;
  try {
    h = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    fail(std::string(what) + " is not valid JSON: " + e.what());
  }
  if (!dup.empty()) fail("duplicate name '" + dup + "' in the " + what + " (duplicate keys are not allowed)");
  if (!h.is_object()) fail(std::string(what) + " is not a JSON object");
  return h;
}

// n * k, or nullopt when it does not fit in 63 bits (Shape holds int64 dims and counts).
std::optional<uint64_t> mul_checked(uint64_t n, uint64_t k) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(n, k, &r) || r > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
  return r;
}

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& v) {
  const std::string where = "tensor '" + name + "'";
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
    bad(path, where + " lacks dtype, shape or data_offsets");
  if (!v["dtype"].is_string()) bad(path, where + " has a dtype that is not a string");
  SafetensorsEntry t;
  t.name = name;
  t.dtype_name = v["dtype"].get<std::string>();
  const SafetensorsDtype* e = safetensors_dtype_find(t.dtype_name);
  if (!e) bad(path, where + " has dtype '" + t.dtype_name + "', which is not a safetensors dtype");
  t.type = e->type;
  if (!v["shape"].is_array()) bad(path, where + " has a shape that is not an array");
  // The reference's checked multiplication, dim by dim in order (ValidationOverflow).
  std::optional<uint64_t> numel = 1;
  for (const auto& d : v["shape"]) {
    if (t.shape.ndim == kMaxDims) bad(path, where + " has more than " + std::to_string(kMaxDims) + " dims");
    if (!d.is_number_unsigned()) bad(path, where + " has a shape entry " + d.dump() + ", not a non-negative integer");
    const uint64_t k = d.get<uint64_t>();
    numel = mul_checked(*numel, k);
    if (!numel) bad(path, where + " has a shape whose element count overflows 64 bits (ValidationOverflow)");
    t.shape[t.shape.ndim++] = static_cast<int64_t>(k);
  }
  const auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    bad(path, where + " data_offsets " + off.dump() + " is not [begin, end] of non-negative integers");
  t.begin = off[0].get<uint64_t>();
  t.end = off[1].get<uint64_t>();
  if (t.end < t.begin)
    bad(path, where + " has data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                  "] that end before they begin (InvalidOffset)");
  const std::optional<uint64_t> bits = mul_checked(*numel, static_cast<uint64_t>(e->bits));
  if (!bits)
    bad(path, where + " has a shape " + t.shape.str() + " of " + t.dtype_name +
                  " whose bit count overflows 64 bits (ValidationOverflow)");
  if (*bits % 8)
    bad(path, where + " has " + std::to_string(*numel) + " elements of " + std::to_string(e->bits) +
                  " bits, not a whole number of bytes");
  const uint64_t expect = *bits / 8;
  if (t.end - t.begin != expect)
    bad(path, where + " spans " + std::to_string(t.end - t.begin) + " bytes but its shape " + t.shape.str() + " of " +
                  t.dtype_name + " needs " + std::to_string(expect));
  return t;
}

}  // namespace

const SafetensorsDtype* safetensors_dtype_find(std::string_view name) {
  for (const auto& e : kDtypes)
    if (name == e.name) return &e;
  return nullptr;
}

const SafetensorsDtype& safetensors_dtype_of(DType t) {
  for (const auto& e : kDtypes)
    if (e.type == t) return e;
  MOECORE_FAIL("safetensors: dtype ", dtype_name(t), " has no safetensors name");
}

const char* safetensors_dtype_name(DType t) {
  return safetensors_dtype_of(t).name;
}

uint64_t safetensors_header_size(const std::string& path, std::string_view head, uint64_t file_size) {
  if (file_size < 8) bad(path, "file is shorter than 8 bytes (" + std::to_string(file_size) + ")");
  MOECORE_CHECK(head.size() >= 8, "safetensors: ", head.size(), " head bytes of '", path, "'");
  uint64_t n = 0;
  std::memcpy(&n, head.data(), 8);
  if (n < 2) bad(path, "header length " + std::to_string(n) + " is below 2 (the smallest header is {})");
  if (n > 100000000ull) bad(path, "header length " + std::to_string(n) + " exceeds 100000000");
  if (8 + n > file_size)
    bad(path, "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(file_size) +
                  " bytes)");
  return n;
}

SafetensorsHeader safetensors_parse_header(const std::string& path, std::string_view header_json, uint64_t data_bytes) {
  if (header_json.empty() || header_json[0] != '{')
    bad(path, "the header does not start with '{' (InvalidHeaderStart)");
  if (!valid_utf8(header_json)) bad(path, "the header is not valid UTF-8");
  const json h = parse_strict(header_json, "header", [&](const std::string& why) { bad(path, why); });
  SafetensorsHeader out;
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (v.is_null()) continue;  // the reference's Option<HashMap<String, String>>
      if (!v.is_object()) bad(path, "__metadata__ is not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) bad(path, "__metadata__['" + k + "'] is not a string");
        out.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    out.tensors.push_back(parse_entry(path, name, v));
  }
  std::vector<const SafetensorsEntry*> spans;
  for (const auto& t : out.tensors) spans.push_back(&t);
  // By (begin, end), as the reference does: empty tensors at an offset come before the one that starts there.
  std::sort(spans.begin(), spans.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end != b->end ? a->end < b->end : a->name < b->name;
  });
  uint64_t pos = 0;
  for (const auto* t : spans) {
    if (t->begin != pos)
      bad(path, "tensor '" + t->name + "' starts at " + std::to_string(t->begin) + " but the previous one ends at " +
                    std::to_string(pos) + " (InvalidOffset)");
    pos = t->end;
  }
  if (pos != data_bytes)
    bad(path, "tensors cover " + std::to_string(pos) + " bytes but the buffer holds " + std::to_string(data_bytes) +
                  " (truncated file or trailing bytes; MetadataIncompleteBuffer)");
  std::sort(out.tensors.begin(), out.tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

SafetensorsLayout safetensors_serialize_header(const std::vector<SafetensorsTensorSpec>& tensors,
                                               std::map<std::string, std::string> metadata) {
  if (!metadata.count("format")) metadata["format"] = "pt";
  SafetensorsLayout out;
  for (size_t i = 0; i < tensors.size(); ++i) out.order.push_back(i);
  std::stable_sort(out.order.begin(), out.order.end(), [&](size_t a, size_t b) {
    const int ra = safetensors_dtype_of(tensors[a].type).rank, rb = safetensors_dtype_of(tensors[b].type).rank;
    return ra != rb ? ra > rb : tensors[a].name < tensors[b].name;
  });
  // Compact JSON with __metadata__ first and tensors in offset order (nlohmann's ordered_json keeps order).
  nlohmann::ordered_json h;
  h["__metadata__"] = metadata;
  for (size_t i : out.order) {
    const SafetensorsTensorSpec& t = tensors[i];
    std::vector<int64_t> shape(t.shape.d, t.shape.d + t.shape.ndim);
    const uint64_t nb = static_cast<uint64_t>(t.shape.numel()) * dtype_size(t.type);
    out.begin.push_back(out.data_bytes);
    h[t.name] = {{"dtype", safetensors_dtype_of(t.type).name},
                 {"shape", shape},
                 {"data_offsets", {out.data_bytes, out.data_bytes + nb}}};
    out.data_bytes += nb;
  }
  std::string json_text = h.dump();
  json_text.append((8 - json_text.size() % 8) % 8, ' ');
  out.header.assign(8, '\0');
  const uint64_t n = json_text.size();
  std::memcpy(out.header.data(), &n, 8);
  out.header += json_text;
  return out;
}

std::map<std::string, std::string> safetensors_index_parse(const std::string& path, std::string_view text) {
  const json idx = parse_strict(text, "index", [&](const std::string& why) {
    MOECORE_FAIL("safetensors: '", path, "' is not a valid safetensors index: ", why);
  });
  if (!idx.contains("weight_map") || !idx["weight_map"].is_object())
    MOECORE_FAIL("safetensors: index '", path, "' has no \"weight_map\" object");
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, f] : idx["weight_map"].items()) {
    if (!f.is_string())
      MOECORE_FAIL("safetensors: index '", path, "' maps tensor '", name, "' to ", f.dump(), ", not a file name");
    const std::string file = f.get<std::string>();
    // A shard is a file beside the index: a path could read any file the process can open.
    const bool plain =
        !file.empty() && file != "." && file != ".." && file.find('/') == std::string::npos &&
        std::none_of(file.begin(), file.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; });
    if (!plain)
      MOECORE_FAIL("safetensors: index '", path, "' maps tensor '", name, "' to ", f.dump(),
                   ", which is not a plain file name in the index's directory; hint: shards must sit beside the index");
    weight_map[name] = file;
  }
  return weight_map;
}

SafetensorsFile safetensors_load(const std::string& path) {
  require_regular_file(path, "safetensors: file");  // a FIFO would block the read
  const std::string bytes = read_file(path);
  const uint64_t n = safetensors_header_size(path, bytes, bytes.size());
  const uint64_t buffer_len = bytes.size() - 8 - n;
  SafetensorsHeader h = safetensors_parse_header(path, std::string_view(bytes).substr(8, n), buffer_len);
  const char* buffer = bytes.data() + 8 + n;
  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  for (const auto& e : h.tensors)
    if (!e.type) bad(path, "tensor '" + e.name + "' has dtype " + e.dtype_name + ", which moecore does not read");
  for (const auto& e : h.tensors) {
    Tensor t = Tensor::empty(e.shape, *e.type, MemCategory::other);
    std::memcpy(t.raw(), buffer + e.begin, e.end - e.begin);
    out.tensors[e.name] = t;
  }
  return out;
}

namespace {
// The header of a file of these tensors and the tensors in the file's order.
std::pair<SafetensorsLayout, std::vector<const Tensor*>> serialize_plan(const std::map<std::string, Tensor>& tensors,
                                                                        std::map<std::string, std::string> metadata) {
  std::vector<SafetensorsTensorSpec> specs;
  std::vector<const Tensor*> ts;
  for (const auto& [name, t] : tensors) {
    MOECORE_CHECK(t.device() == Device::cpu, "safetensors: tensor '", name, "' is not on the CPU");
    specs.push_back({name, t.dtype(), t.shape()});
    ts.push_back(&t);
  }
  SafetensorsLayout layout = safetensors_serialize_header(specs, std::move(metadata));
  std::vector<const Tensor*> ordered;
  for (size_t i : layout.order) ordered.push_back(ts[i]);
  return {std::move(layout), ordered};
}
}  // namespace

std::string safetensors_serialize(const std::map<std::string, Tensor>& tensors,
                                  std::map<std::string, std::string> metadata) {
  const auto [layout, ordered] = serialize_plan(tensors, std::move(metadata));
  std::string out = layout.header;
  out.reserve(out.size() + layout.data_bytes);
  for (const Tensor* t : ordered) {
    Tensor c = t->is_contiguous() ? *t : t->clone();
    out.append(static_cast<const char*>(c.raw()), static_cast<size_t>(c.nbytes()));
  }
  return out;
}

void safetensors_serialize_to(const std::map<std::string, Tensor>& tensors,
                              const std::function<char*(size_t bytes)>& destination,
                              std::map<std::string, std::string> metadata) {
  const auto [layout, ordered] = serialize_plan(tensors, std::move(metadata));
  char* out = destination(layout.header.size() + static_cast<size_t>(layout.data_bytes));
  std::memcpy(out, layout.header.data(), layout.header.size());
  out += layout.header.size();
  for (const Tensor* t : ordered) {
    Tensor c = t->is_contiguous() ? *t : t->clone();
    std::memcpy(out, c.raw(), static_cast<size_t>(c.nbytes()));
    out += c.nbytes();
  }
}

void safetensors_save(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      std::map<std::string, std::string> metadata) {
  write_file_atomic(path, safetensors_serialize(tensors, std::move(metadata)));
}

}  // namespace moecore::io
