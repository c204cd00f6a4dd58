// safetensors reader and writer. The reader enforces the reference reader's rules (formats.md §3.4):
// header size bounds, string-only metadata, no duplicate names, offsets that tile the buffer exactly,
// byte sizes that match shapes, and no trailing bytes.
#include "moecore/io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "moecore/io/file_util.h"

namespace moecore::io {
namespace {

using nlohmann::json;

struct DtypeEntry {
  const char* name;
  DType type;
  int rank;  // the reference writer's alignment order: larger first
};
constexpr DtypeEntry kDtypes[] = {
    {"BOOL", DType::boolean, 0}, {"F8_E5M2", DType::f8e5m2, 6}, {"F8_E4M3", DType::f8e4m3, 7},
    {"F16", DType::f16, 13},     {"BF16", DType::bf16, 14},     {"I32", DType::i32, 15},
    {"F32", DType::f32, 17},     {"F64", DType::f64, 19},       {"I64", DType::i64, 20},
};

const DtypeEntry& entry_of(DType t) {
  for (const auto& e : kDtypes)
    if (e.type == t) return e;
  MOECORE_FAIL("safetensors: dtype ", dtype_name(t), " has no safetensors name");
}

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  MOECORE_FAIL("safetensors: '", path, "' is not a valid safetensors file: ", why);
}

// Strict parse: nlohmann keeps the last of duplicate keys, so reject them while parsing.
json parse_header(const std::string& path, std::string_view text) {
  std::vector<std::vector<std::string>> stack;
  std::string dup;
  auto cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start)
      stack.emplace_back();
    else if (ev == json::parse_event_t::object_end)
      stack.pop_back();
    else if (ev == json::parse_event_t::key && !stack.empty()) {
      auto& keys = stack.back();
      const std::string k = parsed.get<std::string>();
      if (std::find(keys.begin(), keys.end(), k) != keys.end()) dup = k;
      keys.push_back(k);
    }
    (void)depth;
    return true;
  };
  json h;
  try {
    h = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    bad(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!dup.empty()) bad(path, "duplicate key '" + dup + "' in the header");
  if (!h.is_object()) bad(path, "header is not a JSON object");
  return h;
}

}  // namespace

const char* safetensors_dtype_name(DType t) {
  return entry_of(t).name;
}

SafetensorsFile safetensors_load(const std::string& path) {
  const std::string bytes = read_file(path);
  if (bytes.size() < 8) bad(path, "file is shorter than 8 bytes (" + std::to_string(bytes.size()) + ")");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > 100000000ull) bad(path, "header length " + std::to_string(n) + " exceeds 100000000");
  if (8 + n > bytes.size()) bad(path, "header length " + std::to_string(n) + " runs past the end of the file");
  const json h = parse_header(path, std::string_view(bytes).substr(8, n));
  const uint64_t buffer_len = bytes.size() - 8 - n;
  const char* buffer = bytes.data() + 8 + n;

  SafetensorsFile out;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) bad(path, "__metadata__ is not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) bad(path, "__metadata__['" + k + "'] is not a string");
        out.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      bad(path, "tensor '" + name + "' lacks dtype, shape or data_offsets");
    const std::string dt = v["dtype"].get<std::string>();
    const DtypeEntry* e = nullptr;
    for (const auto& cand : kDtypes)
      if (dt == cand.name) e = &cand;
    if (!e) bad(path, "tensor '" + name + "' has dtype " + dt + ", which moecore does not read");
    Shape shape;
    for (const auto& d : v["shape"]) {
      if (shape.ndim == kMaxDims) bad(path, "tensor '" + name + "' has more than 6 dims");
      shape[shape.ndim++] = d.get<int64_t>();
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) bad(path, "tensor '" + name + "' data_offsets is not [begin, end]");
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    const uint64_t expect = static_cast<uint64_t>(shape.numel()) * dtype_size(e->type);
    if (en < b || en - b != expect)
      bad(path, "tensor '" + name + "' spans " + std::to_string(en - b) + " bytes but its shape " + shape.str() +
                    " needs " + std::to_string(expect));
    spans.push_back({b, en, name});
    Tensor t = Tensor::empty(shape, e->type, MemCategory::other);
    out.tensors[name] = t;
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  uint64_t pos = 0;
  for (const auto& s : spans) {
    if (s.begin != pos) bad(path, "tensor '" + s.name + "' does not start where the previous one ends (InvalidOffset)");
    pos = s.end;
  }
  if (pos != buffer_len)
    bad(path, "tensors cover " + std::to_string(pos) + " bytes but the buffer holds " + std::to_string(buffer_len) +
                  " (truncated file or trailing bytes)");
  for (const auto& s : spans) std::memcpy(out.tensors[s.name].raw(), buffer + s.begin, s.end - s.begin);
  return out;
}

std::string safetensors_serialize(const std::map<std::string, Tensor>& tensors,
                                  std::map<std::string, std::string> metadata) {
  if (!metadata.count("format")) metadata["format"] = "pt";
  std::vector<std::pair<std::string, const Tensor*>> order;
  for (const auto& [name, t] : tensors) order.emplace_back(name, &t);
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    const int ra = entry_of(a.second->dtype()).rank, rb = entry_of(b.second->dtype()).rank;
    return ra != rb ? ra > rb : a.first < b.first;
  });
  // Compact JSON with __metadata__ first and tensors in offset order (nlohmann's ordered_json keeps order).
  nlohmann::ordered_json h;
  h["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : order) {
    MOECORE_CHECK(t->device() == Device::cpu, "safetensors: tensor '", name, "' is not on the CPU");
    std::vector<int64_t> shape(t->shape().d, t->shape().d + t->dim());
    const uint64_t nb = static_cast<uint64_t>(t->nbytes());
    h[name] = {{"dtype", entry_of(t->dtype()).name}, {"shape", shape}, {"data_offsets", {offset, offset + nb}}};
    offset += nb;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out += header;
  out.reserve(out.size() + offset);
  for (const auto& [name, t] : order) {
    Tensor c = t->is_contiguous() ? *t : t->clone();
    out.append(static_cast<const char*>(c.raw()), static_cast<size_t>(c.nbytes()));
  }
  return out;
}

void safetensors_save(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      std::map<std::string, std::string> metadata) {
  write_file_atomic(path, safetensors_serialize(tensors, std::move(metadata)));
}

}  // namespace moecore::io
