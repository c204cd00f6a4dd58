// HF checkpoint directories, streamed. Files are read with pread (not mmap: mapped pages would count as resident
// memory) and written through a per-shard spill file, so no step holds more than one tensor. Header validation,
// the dtype table, header serialization and the index parse are io/safetensors.h's, applied to headers alone.
#include "moecore/io/hf_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "moecore/io/file_util.h"
#include "moecore/io/safetensors.h"

namespace moecore::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kChunkBytes = 8ull << 20;  // conversion and copy buffer

bool convertible(DType from, DType to) {
  if (from == to) return true;
  return dtype_is_float(from) && dtype_is_float(to);
}

[[noreturn]] void sys_fail(const std::string& what, const std::string& path) {
  MOECORE_FAIL("hf checkpoint: ", what, " '", path, "': ", std::strerror(errno));
}

void pread_full(int fd, void* dst, uint64_t n, uint64_t off, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) sys_fail("cannot read", path);
    if (r == 0) MOECORE_FAIL("hf checkpoint: '", path, "' ends at byte ", off, " but ", n, " more bytes were expected");
    p += r, n -= static_cast<uint64_t>(r), off += static_cast<uint64_t>(r);
  }
}

void write_full(int fd, const void* src, uint64_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t r = ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) sys_fail("cannot write", path);
    p += r, n -= static_cast<uint64_t>(r);
  }
}

// Copies [off, off + n) of `in` to the current position of `out`, in the kernel when it can.
void copy_range(int in, uint64_t off, int out, uint64_t n, const std::string& path) {
  auto pos = static_cast<loff_t>(off);
  while (n > 0) {
    const ssize_t r = ::copy_file_range(in, &pos, out, nullptr, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;  // unsupported here (EXDEV, ENOSYS, ...): fall back to pread/write
    n -= static_cast<uint64_t>(r);
  }
  std::vector<char> buf(n ? std::min(n, kChunkBytes) : 0);
  while (n > 0) {
    const uint64_t k = std::min<uint64_t>(n, buf.size());
    pread_full(in, buf.data(), k, static_cast<uint64_t>(pos), path);
    write_full(out, buf.data(), k, path);
    pos += static_cast<loff_t>(k), n -= k;
  }
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// The header of one shard, validated as the reference reader does (docs/formats.md §3.4) from the header and the
// file size alone.
std::vector<HfTensorInfo> read_shard_header(int fd, const std::string& path, const std::string& shard) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) sys_fail("cannot stat", path);
  const auto size = static_cast<uint64_t>(st.st_size);
  char head[8] = {};
  if (size >= 8) pread_full(fd, head, 8, 0, path);
  const uint64_t n = safetensors_header_size(path, std::string_view(head, size >= 8 ? 8 : 0), size);
  std::string text(n, '\0');
  pread_full(fd, text.data(), n, 8, path);
  const SafetensorsHeader h = safetensors_parse_header(path, text, size - 8 - n);
  std::vector<HfTensorInfo> out;
  out.reserve(h.tensors.size());
  for (const SafetensorsEntry& e : h.tensors)
    out.push_back({e.name, e.dtype_name, e.type, e.shape, shard, 8 + n + e.begin, e.end - e.begin});
  return out;
}

std::string shard_file_name(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i, n);
  return buf;
}

// A regular file at `p`; a path the filesystem refuses (too long, a loop, no permission) is not one, never an
// exception (fuzz_hf_index found a 300-byte shard name from an index throwing filesystem_error here).
bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Reader

HfCheckpointReader::HfCheckpointReader(const std::string& dir, const std::string& file) : dir_(dir) {
  const fs::path d(dir);
  const fs::path index_path = d / "model.safetensors.index.json", single = d / "model.safetensors";
  std::map<std::string, std::string> weight_map;  // tensor -> shard
  std::vector<std::string> shards;
  if (!file.empty()) {
    if (!is_file(d / file)) MOECORE_FAIL("hf checkpoint: no file '", (d / file).string(), "'");
    shards.push_back(file);
  } else if (is_file(index_path)) {
    sharded_ = true;
    const std::string ip = index_path.string();
    weight_map = safetensors_index_parse(ip, read_file(ip));
    std::map<std::string, std::string> first_tensor;  // shard -> a tensor naming it, for the error message
    for (const auto& [name, f] : weight_map) first_tensor.emplace(f, name);
    for (const auto& [f, name] : first_tensor) {
      if (!is_file(d / f))
        MOECORE_FAIL("hf checkpoint: index '", ip, "' names shard '", f, "' (for tensor '", name, "'), but the file '",
                     (d / f).string(), "' is not there; hint: copy every shard the index lists");
      shards.push_back(f);
    }
  } else if (is_file(single)) {
    shards.push_back("model.safetensors");
  } else {
    MOECORE_FAIL("hf checkpoint: directory '", dir,
                 "' has neither model.safetensors.index.json nor model.safetensors; hint: pass the directory that "
                 "holds the Hugging Face model files");
  }
  std::map<std::string, std::string> found;  // tensor -> shard whose header holds it
  try {
    for (const auto& f : shards) {
      const std::string path = (d / f).string();
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) sys_fail("cannot open shard", path);
      shard_fds_[f] = fd;
      std::vector<HfTensorInfo> ts = read_shard_header(fd, path, f);
      for (auto& t : ts) {
        if (auto it = found.find(t.name); it != found.end())
          MOECORE_FAIL("hf checkpoint: tensor '", t.name, "' appears twice: in '", (d / it->second).string(),
                       "' and in '", path, "'");
        if (sharded_) {
          auto w = weight_map.find(t.name);
          if (w == weight_map.end())
            MOECORE_FAIL("hf checkpoint: shard '", path, "' holds tensor '", t.name,
                         "', which the index model.safetensors.index.json does not list");
          if (w->second != f)
            MOECORE_FAIL("hf checkpoint: tensor '", t.name, "' is in shard '", path, "' but the index expects it in '",
                         w->second, "'");
        }
        found[t.name] = f;
        tensors_.push_back(std::move(t));
      }
    }
    for (const auto& [name, f] : weight_map)
      if (!found.count(name)) {
        size_t held = 0;
        for (const auto& t : tensors_) held += t.shard == f;
        MOECORE_FAIL("hf checkpoint: the index lists tensor '", name, "' in shard '", (d / f).string(),
                     "', but that shard's header does not have it (it holds ", held, " tensors)");
      }
  } catch (...) {
    for (const auto& [f, fd] : shard_fds_) ::close(fd);
    throw;
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

std::vector<std::string> HfCheckpointReader::files() const {
  std::vector<std::string> out;
  if (sharded_) out.push_back((fs::path(dir_) / "model.safetensors.index.json").string());
  for (const auto& [name, fd] : shard_fds_) out.push_back((fs::path(dir_) / name).string());
  return out;
}

HfCheckpointReader::~HfCheckpointReader() {
  for (const auto& [f, fd] : shard_fds_) ::close(fd);
}

const HfTensorInfo& HfCheckpointReader::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end())
    MOECORE_FAIL("hf checkpoint: no tensor '", name, "' in '", dir_, "' (", tensors_.size(), " tensors)");
  return tensors_[it->second];
}

uint64_t HfCheckpointReader::total_bytes() const {
  uint64_t s = 0;
  for (const auto& t : tensors_) s += t.nbytes;
  return s;
}

// Elements [first, first + n) of tensor t, converted to `to`, into dst.
void HfCheckpointReader::read_range(const HfTensorInfo& t, uint64_t first, uint64_t n, DType to, void* dst) const {
  const std::string path = (fs::path(dir_) / t.shard).string();
  if (!t.type)
    MOECORE_FAIL("hf checkpoint: tensor '", t.name, "' in '", path, "' has dtype ", t.dtype_name,
                 ", which moecore cannot read");
  const DType from = *t.type;
  if (!convertible(from, to))
    MOECORE_FAIL("hf checkpoint: tensor '", t.name, "' in '", path, "' is ", t.dtype_name,
                 " and cannot be converted to ", dtype_name(to),
                 " (float dtypes convert among themselves, integers only to themselves)");
  const int fd = shard_fds_.at(t.shard);
  const size_t in_size = dtype_size(from), out_size = dtype_size(to);
  const uint64_t offset = t.offset + first * in_size;
  if (from == to) {
    pread_full(fd, dst, n * in_size, offset, path);
    return;
  }
  const uint64_t per_chunk = kChunkBytes / in_size;
  std::vector<char> buf(std::min(n, per_chunk) * in_size);
  for (uint64_t i = 0; i < n; i += per_chunk) {
    const uint64_t k = std::min(per_chunk, n - i);
    pread_full(fd, buf.data(), k * in_size, offset + i * in_size, path);
    convert(static_cast<char*>(dst) + i * out_size, to, buf.data(), from, k);
  }
}

Tensor HfCheckpointReader::read(const std::string& name, std::optional<DType> dtype) const {
  const HfTensorInfo& t = info(name);
  const DType to = dtype.value_or(t.type.value_or(DType::f32));
  Tensor out = Tensor::empty(t.shape, to, MemCategory::other);
  read_range(t, 0, static_cast<uint64_t>(t.shape.numel()), to, out.raw());
  return out;
}

std::vector<uint8_t> HfCheckpointReader::read_u8(const std::string& name, uint64_t first, uint64_t n) const {
  const HfTensorInfo& t = info(name);
  const std::string path = (fs::path(dir_) / t.shard).string();
  if (t.dtype_name != "U8")
    MOECORE_FAIL("hf checkpoint: tensor '", name, "' in '", path, "' is ", t.dtype_name, ", expected U8");
  if (first > t.nbytes || n > t.nbytes - first)
    MOECORE_FAIL("hf checkpoint: bytes [", first, ", ", first + n, ") of tensor '", name, "' in '", path,
                 "' are out of range (", t.nbytes, " bytes)");
  std::vector<uint8_t> out(n);
  if (n) pread_full(shard_fds_.at(t.shard), out.data(), n, t.offset + first, path);
  return out;
}

Tensor HfCheckpointReader::read_mxfp4_matrix(const std::string& name, int64_t lead) const {
  const HfTensorInfo &b = info(name + "_blocks"), &s = info(name + "_scales");
  const bool ok = b.shape.ndim == 4 && s.shape.ndim == 3 && b.shape[3] == 16 && b.shape[0] == s.shape[0] &&
                  b.shape[1] == s.shape[1] && b.shape[2] == s.shape[2];
  if (!ok)
    MOECORE_FAIL("hf checkpoint '", dir_, "': MXFP4 tensor '", name,
                 "' needs blocks [lead, C, G, 16] and scales [lead, C, G]; found ", b.shape.str(), " and ",
                 s.shape.str());
  const int64_t L = b.shape[0], C = b.shape[1], G = b.shape[2], R = G * 32;
  if (lead < 0 || lead >= L) MOECORE_FAIL("hf checkpoint: matrix ", lead, " of MXFP4 tensor '", name, "' (", L, ")");
  static constexpr float kFp4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const std::vector<uint8_t> blocks =
      read_u8(name + "_blocks", static_cast<uint64_t>(lead * C * G * 16), static_cast<uint64_t>(C * G * 16));
  const std::vector<uint8_t> scales =
      read_u8(name + "_scales", static_cast<uint64_t>(lead * C * G), static_cast<uint64_t>(C * G));
  Tensor out = Tensor::empty({R, C}, DType::f32, MemCategory::workspace);
  float* o = out.data<float>();
  for (int64_t c = 0; c < C; ++c)
    for (int64_t g = 0; g < G; ++g) {
      const int exponent = static_cast<int>(scales[static_cast<size_t>(c * G + g)]) - 127;
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = blocks[static_cast<size_t>((c * G + g) * 16 + j)];
        const int64_t k = g * 32 + 2 * j;  // the stored row's element, the logical matrix's row
        o[k * C + c] = std::ldexp(kFp4[byte & 0x0F], exponent);
        o[(k + 1) * C + c] = std::ldexp(kFp4[byte >> 4], exponent);
      }
    }
  return out;
}

int64_t hf_row_width(const Shape& shape) {
  return shape.ndim >= 2 ? shape[shape.ndim - 1] : 1;
}

Tensor HfCheckpointReader::read_rows(const std::string& name, int64_t first_row, int64_t rows,
                                     std::optional<DType> dtype) const {
  const HfTensorInfo& t = info(name);
  const int64_t width = hf_row_width(t.shape), total = width ? t.shape.numel() / width : 0;
  if (first_row < 0 || rows < 0 || first_row + rows > total)
    MOECORE_FAIL("hf checkpoint: rows [", first_row, ", ", first_row + rows, ") of tensor '", name, "' ", t.shape.str(),
                 " in '", (fs::path(dir_) / t.shard).string(), "' are out of range (", total, " rows)");
  const DType to = dtype.value_or(t.type.value_or(DType::f32));
  Tensor out = t.shape.ndim >= 2 ? Tensor::empty({rows, width}, to, MemCategory::other)
                                 : Tensor::empty({rows}, to, MemCategory::other);
  read_range(t, static_cast<uint64_t>(first_row * width), static_cast<uint64_t>(rows * width), to, out.raw());
  return out;
}

Tensor HfCheckpointReader::read_dequantized(const std::string& name, int64_t block_rows, int64_t block_cols) const {
  if (!block_scaled(name)) return read(name, DType::f32);
  MOECORE_CHECK(block_rows > 0 && block_cols > 0, "block sizes ", block_rows, "x", block_cols);
  const std::string sname = name + "_scale_inv";
  const HfTensorInfo& w = info(name);
  const HfTensorInfo& s = info(sname);
  const std::string path = (fs::path(dir_) / w.shard).string();
  if (w.dtype_name != "F8_E4M3" || w.shape.ndim != 2)
    MOECORE_FAIL("hf checkpoint: tensor '", name, "' in '", path, "' has a block scale '", sname,
                 "' so it must be a 2-D F8_E4M3 weight, but it is ", w.dtype_name, " ", w.shape.str());
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const Shape expect{(rows + block_rows - 1) / block_rows, (cols + block_cols - 1) / block_cols};
  if (!(s.shape == expect) || !s.type || !dtype_is_float(*s.type))
    MOECORE_FAIL("hf checkpoint: scale '", sname, "' in '", (fs::path(dir_) / s.shard).string(), "' is ", s.dtype_name,
                 " ", s.shape.str(), " but weight '", name, "' ", w.shape.str(), " with ", block_rows, "x", block_cols,
                 " blocks needs a float scale of shape ", expect.str());
  const Tensor scale = read(sname, DType::f32);
  Tensor out = read(name, DType::f32);
  const float* sc = scale.data<float>();
  float* o = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = sc + (r / block_rows) * expect[1];
    float* orow = o + r * cols;
    for (int64_t c = 0; c < cols; ++c) orow[c] *= srow[c / block_cols];
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Writer

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path) : path_(std::move(path)) {
  spill_path_ = path_ + ".spill";
  spill_fd_ = ::open(spill_path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (spill_fd_ < 0) sys_fail("cannot create", spill_path_);
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (spill_fd_ >= 0) ::close(spill_fd_);
  std::error_code ec;
  fs::remove(spill_path_, ec);
  if (!finished_) fs::remove(path_, ec);
}

void SafetensorsStreamWriter::begin(const std::string& name, DType dtype, const Shape& shape) {
  MOECORE_CHECK(!finished_, "safetensors: begin('", name, "') after finish()");
  if (pending_ > 0)
    MOECORE_FAIL("safetensors: tensor '", entries_.back().name, "' of '", path_, "' lacks ", pending_,
                 " elements before '", name, "' begins");
  if (name.empty() || name == "__metadata__")
    MOECORE_FAIL("safetensors: tensor name '", name, "' is not allowed in '", path_, "'");
  if (!names_.insert(name).second) MOECORE_FAIL("safetensors: tensor '", name, "' added twice to '", path_, "'");
  safetensors_dtype_of(dtype);  // throws for a dtype safetensors cannot name
  const uint64_t nbytes = static_cast<uint64_t>(shape.numel()) * dtype_size(dtype);
  entries_.push_back({name, dtype, shape, bytes_, nbytes});
  bytes_ += nbytes;
  pending_ = static_cast<uint64_t>(shape.numel());
}

void SafetensorsStreamWriter::append(const Tensor& part) {
  MOECORE_CHECK(!entries_.empty() && !finished_, "safetensors: append() without begin()");
  const Entry& e = entries_.back();
  if (part.device() != Device::cpu) MOECORE_FAIL("safetensors: tensor '", e.name, "' is not on the CPU");
  const auto n = static_cast<uint64_t>(part.numel());
  if (n > pending_)
    MOECORE_FAIL("safetensors: tensor '", e.name, "' ", e.shape.str(), " of '", path_, "' receives ", n,
                 " more elements but lacks only ", pending_);
  if (!convertible(part.dtype(), e.type))
    MOECORE_FAIL("safetensors: tensor '", e.name, "' is ", dtype_name(part.dtype()), " and cannot be written as ",
                 dtype_name(e.type));
  const Tensor src = part.is_contiguous() ? part : part.clone();
  if (part.dtype() == e.type) {
    if (n) write_full(spill_fd_, src.raw(), n * dtype_size(e.type), spill_path_);
  } else {
    const uint64_t per_chunk = kChunkBytes / dtype_size(e.type);
    std::vector<char> buf(std::min(n, per_chunk) * dtype_size(e.type));
    for (uint64_t i = 0; i < n; i += per_chunk) {
      const uint64_t k = std::min(per_chunk, n - i);
      convert(buf.data(), e.type, static_cast<const char*>(src.raw()) + i * dtype_size(part.dtype()), part.dtype(), k);
      write_full(spill_fd_, buf.data(), k * dtype_size(e.type), spill_path_);
    }
  }
  pending_ -= n;
}

void SafetensorsStreamWriter::add(const std::string& name, const Tensor& t, std::optional<DType> dtype) {
  begin(name, dtype.value_or(t.dtype()), t.shape());
  append(t);
}

void SafetensorsStreamWriter::finish() {
  MOECORE_CHECK(!finished_, "safetensors: finish() called twice for '", path_, "'");
  if (pending_ > 0)
    MOECORE_FAIL("safetensors: tensor '", entries_.back().name, "' of '", path_, "' lacks ", pending_, " elements");
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& e : entries_) specs.push_back({e.name, e.type, e.shape});
  const SafetensorsLayout layout = safetensors_serialize_header(specs);  // safetensors_serialize's bytes
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) sys_fail("cannot create", path_);
  try {
    write_full(fd, layout.header.data(), layout.header.size(), path_);
    for (size_t i : layout.order) copy_range(spill_fd_, entries_[i].spill_offset, fd, entries_[i].nbytes, path_);
    if (::fsync(fd) != 0) sys_fail("cannot fsync", path_);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) sys_fail("cannot close", path_);
  ::close(spill_fd_);
  spill_fd_ = -1;
  std::error_code ec;
  fs::remove(spill_path_, ec);
  finished_ = true;
}

HfCheckpointWriter::HfCheckpointWriter(std::string out_dir, uint64_t max_shard_bytes, bool index_for_one_shard)
    : out_dir_(std::move(out_dir)), max_shard_bytes_(max_shard_bytes), index_for_one_shard_(index_for_one_shard) {
  while (out_dir_.size() > 1 && out_dir_.back() == '/') out_dir_.pop_back();
  MOECORE_CHECK(!out_dir_.empty() && max_shard_bytes_ > 0, "out_dir '", out_dir_, "', max_shard_bytes ",
                max_shard_bytes_);
  std::error_code ec;
  if (fs::is_symlink(out_dir_, ec))
    MOECORE_FAIL("hf checkpoint: output '", out_dir_, "' is a symbolic link; the directory is written by renaming a ",
                 "staging directory into place, which would replace the link; hint: give the directory itself");
  if (fs::exists(out_dir_, ec) && !(fs::is_directory(out_dir_, ec) && fs::is_empty(out_dir_, ec)))
    MOECORE_FAIL("hf checkpoint: output '", out_dir_,
                 "' already exists and is not an empty directory; hint: choose a new directory or remove it");
  const fs::path parent = fs::absolute(out_dir_).parent_path();
  fs::create_directories(parent, ec);
  static std::atomic<int> counter{0};
  stage_dir_ = out_dir_ + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  fs::remove_all(stage_dir_, ec);
  if (!fs::create_directory(stage_dir_, ec))
    MOECORE_FAIL("hf checkpoint: cannot create staging directory '", stage_dir_, "': ", ec.message());
}

HfCheckpointWriter::~HfCheckpointWriter() {
  shard_.reset();
  if (!finished_) {
    std::error_code ec;
    fs::remove_all(stage_dir_, ec);
  }
}

void HfCheckpointWriter::begin(const std::string& name, DType dtype, const Shape& shape) {
  MOECORE_CHECK(!finished_, "hf checkpoint: begin('", name, "') after finish()");
  if (weight_map_.count(name)) MOECORE_FAIL("hf checkpoint: tensor '", name, "' added twice to '", out_dir_, "'");
  const uint64_t nbytes = static_cast<uint64_t>(shape.numel()) * dtype_size(dtype);
  if (shard_ && !shard_->empty() && shard_->bytes() + nbytes > max_shard_bytes_) close_shard();
  if (!shard_)
    shard_ = std::make_unique<SafetensorsStreamWriter>(stage_dir_ + "/shard-" + std::to_string(shards_ + 1) +
                                                       ".safetensors");
  shard_->begin(name, dtype, shape);
  total_bytes_ += nbytes;
  weight_map_[name] = shards_ + 1;
}

void HfCheckpointWriter::append(const Tensor& part) {
  MOECORE_CHECK(shard_ != nullptr, "hf checkpoint: append() without begin()");
  shard_->append(part);
}

void HfCheckpointWriter::add(const std::string& name, const Tensor& t, std::optional<DType> out_dtype) {
  const DType to = out_dtype.value_or(t.dtype());
  if (!convertible(t.dtype(), to))  // checked before the tensor is listed
    MOECORE_FAIL("hf checkpoint: tensor '", name, "' is ", dtype_name(t.dtype()), " and cannot be written as ",
                 dtype_name(to));
  begin(name, to, t.shape());
  append(t);
}

void HfCheckpointWriter::close_shard() {
  if (!shard_)
    shard_ = std::make_unique<SafetensorsStreamWriter>(stage_dir_ + "/shard-" + std::to_string(shards_ + 1) +
                                                       ".safetensors");
  shard_->finish();
  shard_.reset();
  ++shards_;
}

void HfCheckpointWriter::add_text_file(const std::string& file_name, std::string text) {
  MOECORE_CHECK(!finished_, "hf checkpoint: add_text_file('", file_name, "') after finish()");
  if (file_name.empty() || file_name.find('/') != std::string::npos || file_name.ends_with(".safetensors") ||
      file_name == "model.safetensors.index.json")
    MOECORE_FAIL("hf checkpoint: '", file_name, "' is not allowed as an extra file of '", out_dir_,
                 "' (a plain file name, not a shard or the index)");
  write_file_atomic(stage_dir_ + "/" + file_name, text);
}

int HfCheckpointWriter::finish() {
  MOECORE_CHECK(!finished_, "hf checkpoint: finish() called twice for '", out_dir_, "'");
  if (shard_ || shards_ == 0) close_shard();
  const int n = shards_;
  if (n == 1 && !index_for_one_shard_) {
    fs::rename(stage_dir_ + "/shard-1.safetensors", stage_dir_ + "/model.safetensors");
  } else {
    for (int i = 1; i <= n; ++i)
      fs::rename(stage_dir_ + "/shard-" + std::to_string(i) + ".safetensors", stage_dir_ + "/" + shard_file_name(i, n));
    json idx;
    idx["metadata"] = {{"total_size", total_bytes_}};
    json wm = json::object();
    for (const auto& [name, i] : weight_map_) wm[name] = shard_file_name(i, n);
    idx["weight_map"] = std::move(wm);
    write_file_atomic(stage_dir_ + "/model.safetensors.index.json", idx.dump(2) + "\n");
  }
  fsync_dir(stage_dir_);
  std::error_code ec;
  if (fs::exists(out_dir_)) fs::remove(out_dir_, ec);  // an empty directory (checked at construction)
  if (std::rename(stage_dir_.c_str(), out_dir_.c_str()) != 0)
    sys_fail("cannot rename the staging directory to", out_dir_);
  fsync_dir(fs::absolute(out_dir_).parent_path().string());
  finished_ = true;
  return n;
}

}  // namespace moecore::io
