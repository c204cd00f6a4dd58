// Megatron .bin/.idx writer and memory-mapped reader (docs/formats.md §1). POSIX I/O: the .bin streams through
// a 1 MiB buffer into a temporary file; both files are mapped read-only when reading.
#include "moecore/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <type_traits>

#include "moecore/core/error.h"
#include "moecore/io/file_util.h"
#include "moecore/io/input_file.h"

namespace moecore::data {
namespace {

constexpr size_t kBufferBytes = size_t(1) << 20;

template <class T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(b, sizeof(T));
}

template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Maps a whole file read-only; returns nullptr for an empty file.
const unsigned char* map_file(const std::string& path, int64_t& size, const char* what) {
  const int fd = io::open_regular_file(path, std::string("indexed_dataset: ") + what);  // a FIFO would block
  if (fd < 0) {
    MOECORE_FAIL("indexed_dataset: cannot open ", what, " '", path, "': ", std::strerror(errno),
                 " (a dataset prefix names both <prefix>.bin and <prefix>.idx)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    MOECORE_FAIL("indexed_dataset: cannot stat '", path, "': ", std::strerror(errno));
  }
  size = static_cast<int64_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) MOECORE_FAIL("indexed_dataset: cannot mmap '", path, "': ", std::strerror(errno));
  return static_cast<const unsigned char*>(p);
}

void unmap(const unsigned char* p, int64_t size) {
  if (p) ::munmap(const_cast<unsigned char*>(p), static_cast<size_t>(size));
}

void check_token_range(int32_t v, TokenDType t, const std::string& path) {
  int64_t lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  switch (t) {
    case TokenDType::u8:
      lo = 0, hi = 255;
      break;
    case TokenDType::i8:
      lo = -128, hi = 127;
      break;
    case TokenDType::i16:
      lo = -32768, hi = 32767;
      break;
    case TokenDType::u16:
      lo = 0, hi = 65535;
      break;
    default:
      break;
  }
  if (v < lo || v > hi) {
    MOECORE_FAIL("indexed_dataset: token id ", v, " does not fit dtype ", token_dtype_name(t), " of '", path,
                 "'; choose the dtype with token_dtype_optimal(vocab_size)");
  }
}

template <class T>
void store_as(const int32_t* in, size_t n, char* out) {
  for (size_t i = 0; i < n; ++i) {
    const T v = static_cast<T>(in[i]);
    std::memcpy(out + i * sizeof(T), &v, sizeof(T));
  }
}

template <class T>
void load_as(const unsigned char* in, int64_t n, int32_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(load<T>(in + i * sizeof(T)));
}

// int64 / float32 / float64 tokens: a value that is not an int32 (NaN, a fraction, 2^40) is an Error, not a
// silently wrapped id (or, for floats, undefined behaviour).
template <class T>
void load_checked(const unsigned char* in, int64_t n, int32_t* out, const std::string& prefix, int64_t seq) {
  for (int64_t i = 0; i < n; ++i) {
    const T v = load<T>(in + i * sizeof(T));
    bool ok;
    if constexpr (std::is_floating_point_v<T>)  // NaN fails both comparisons; 2^31 is exact in float and double
      ok = v >= T(-2147483648.0) && v < T(2147483648.0) && v == T(static_cast<int32_t>(v));
    else
      ok = v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
    if (!ok) {
      MOECORE_FAIL("indexed_dataset: '", indexed_bin_path(prefix), "': sequence ", seq, " holds the value ", double(v),
                   ", which is not a token id (an int32); the .bin is corrupt or its .idx names the wrong dtype");
    }
    out[i] = static_cast<int32_t>(v);
  }
}

}  // namespace

int token_dtype_size(TokenDType t) {
  switch (t) {
    case TokenDType::u8:
    case TokenDType::i8:
      return 1;
    case TokenDType::i16:
    case TokenDType::u16:
      return 2;
    case TokenDType::i32:
    case TokenDType::f32:
      return 4;
    case TokenDType::i64:
    case TokenDType::f64:
      return 8;
  }
  MOECORE_FAIL("indexed_dataset: unknown dtype code ", int(t));
}

const char* token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::u8:
      return "uint8";
    case TokenDType::i8:
      return "int8";
    case TokenDType::i16:
      return "int16";
    case TokenDType::i32:
      return "int32";
    case TokenDType::i64:
      return "int64";
    case TokenDType::f64:
      return "float64";
    case TokenDType::f32:
      return "float32";
    case TokenDType::u16:
      return "uint16";
  }
  return "unknown";
}

bool token_dtype_valid(uint8_t code) {
  return code >= 1 && code <= 8;
}

TokenDType token_dtype_optimal(int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDType::u16 : TokenDType::i32;
}

std::string indexed_bin_path(const std::string& prefix) {
  return prefix + ".bin";
}
std::string indexed_idx_path(const std::string& prefix) {
  return prefix + ".idx";
}

std::string indexed_idx_serialize(TokenDType dtype, std::span<const int32_t> sequence_lengths,
                                  std::span<const int64_t> document_indices) {
  const uint64_t s = sequence_lengths.size(), d = document_indices.size();
  std::string out;
  out.reserve(kIdxHeaderBytes + 12 * s + 8 * d);
  out.append(kIdxMagic, sizeof(kIdxMagic));
  put<uint64_t>(out, kIdxVersion);
  put<uint8_t>(out, static_cast<uint8_t>(dtype));
  put<uint64_t>(out, s);
  put<uint64_t>(out, d);
  for (int32_t len : sequence_lengths) put<int32_t>(out, len);
  int64_t pointer = 0;
  const int64_t item = token_dtype_size(dtype);
  for (int32_t len : sequence_lengths) {
    put<int64_t>(out, pointer);
    pointer += int64_t(len) * item;
  }
  for (int64_t di : document_indices) put<int64_t>(out, di);
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Writer

namespace {
// A dataset is a pair of files written together: each is a new or replaced regular file (io::output_target),
// never written into a device or FIFO.
std::string replaceable_output(const std::string& path) {
  const io::OutputTarget t = io::output_target(path);
  if (t.kind != io::OutputKind::replace)
    MOECORE_FAIL("indexed_dataset: output '", path, "' is a device or FIFO; a dataset is a .bin/.idx file pair; ",
                 "hint: give a new --output-prefix");
  return t.path;
}
}  // namespace

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string bin_path, TokenDType dtype)
    : bin_path_(std::move(bin_path)), dtype_(dtype) {
  if (!token_dtype_valid(static_cast<uint8_t>(dtype))) MOECORE_FAIL("indexed_dataset: bad dtype ", int(dtype));
  bin_path_ = replaceable_output(bin_path_);
  tmp_path_ = bin_path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    MOECORE_FAIL("indexed_dataset: cannot create '", tmp_path_, "': ", std::strerror(errno),
                 " (does the output directory exist and is it writable?)");
  }
  buffer_.reserve(kBufferBytes);
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  if (fd_ >= 0) ::close(fd_);
  if (!finalized_) ::unlink(tmp_path_.c_str());
}

void IndexedDatasetBuilder::flush() {
  size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      MOECORE_FAIL("indexed_dataset: cannot write '", tmp_path_, "': ", std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
  buffer_.clear();
}

void IndexedDatasetBuilder::write_bytes(const char* p, size_t n) {
  while (n > 0) {
    const size_t k = std::min(n, kBufferBytes - buffer_.size());
    buffer_.insert(buffer_.end(), p, p + k);
    p += k;
    n -= k;
    if (buffer_.size() == kBufferBytes) flush();
  }
}

void IndexedDatasetBuilder::write_tokens(std::span<const int32_t> tokens) {
  MOECORE_CHECK(!finalized_, "indexed_dataset: builder for '", bin_path_, "' already finalized");
  if (dtype_ != TokenDType::i32 && dtype_ != TokenDType::i64 && dtype_ != TokenDType::f64 &&
      dtype_ != TokenDType::f32) {
    for (int32_t v : tokens) check_token_range(v, dtype_, bin_path_);
  }
  const size_t item = static_cast<size_t>(token_dtype_size(dtype_));
  char chunk[4096];
  const size_t per = sizeof(chunk) / item;
  for (size_t at = 0; at < tokens.size(); at += per) {
    const size_t n = std::min(per, tokens.size() - at);
    const int32_t* in = tokens.data() + at;
    switch (dtype_) {
      case TokenDType::u8:
        store_as<uint8_t>(in, n, chunk);
        break;
      case TokenDType::i8:
        store_as<int8_t>(in, n, chunk);
        break;
      case TokenDType::i16:
        store_as<int16_t>(in, n, chunk);
        break;
      case TokenDType::u16:
        store_as<uint16_t>(in, n, chunk);
        break;
      case TokenDType::i32:
        store_as<int32_t>(in, n, chunk);
        break;
      case TokenDType::i64:
        store_as<int64_t>(in, n, chunk);
        break;
      case TokenDType::f32:
        store_as<float>(in, n, chunk);
        break;
      case TokenDType::f64:
        store_as<double>(in, n, chunk);
        break;
    }
    write_bytes(chunk, n * item);
  }
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens, std::span<const int32_t> lengths) {
  int64_t total = 0;
  for (int32_t len : lengths) {
    if (len < 0) MOECORE_FAIL("indexed_dataset: negative sequence length ", len, " for '", bin_path_, "'");
    total += len;
  }
  if (total != static_cast<int64_t>(tokens.size())) {
    MOECORE_FAIL("indexed_dataset: add_document lengths sum to ", total, " but ", tokens.size(),
                 " tokens were given for '", bin_path_, "'");
  }
  write_tokens(tokens);
  sequence_lengths_.insert(sequence_lengths_.end(), lengths.begin(), lengths.end());
  document_indices_.push_back(num_sequences());
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens) {
  const int32_t len = static_cast<int32_t>(tokens.size());
  MOECORE_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()), "document too long: ", tokens.size());
  add_document(tokens, tokens.empty() ? std::span<const int32_t>() : std::span<const int32_t>(&len, 1));
}

void IndexedDatasetBuilder::add_item(std::span<const int32_t> tokens) {
  MOECORE_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()), "sequence too long: ", tokens.size());
  write_tokens(tokens);
  sequence_lengths_.push_back(static_cast<int32_t>(tokens.size()));
}

void IndexedDatasetBuilder::end_document() {
  document_indices_.push_back(num_sequences());
}

void IndexedDatasetBuilder::add_index(const std::string& prefix) {
  IndexedDataset other(prefix);
  if (other.dtype() != dtype_) {
    MOECORE_FAIL("indexed_dataset: cannot merge '", prefix, "' (dtype ", token_dtype_name(other.dtype()), ") into '",
                 bin_path_, "' (dtype ", token_dtype_name(dtype_), ")");
  }
  MOECORE_CHECK(!finalized_, "indexed_dataset: builder for '", bin_path_, "' already finalized");
  const int64_t base = num_sequences();
  int64_t bytes = 0;
  for (int64_t i = 0; i < other.num_sequences(); ++i) {
    sequence_lengths_.push_back(other.sequence_length(i));
    bytes += int64_t(other.sequence_length(i)) * token_dtype_size(dtype_);
  }
  for (int64_t d = 1; d <= other.num_documents(); ++d) document_indices_.push_back(base + other.document_index(d));
  // Only the bytes the sequences cover, so trailing bytes in the other .bin cannot shift later pointers.
  if (bytes > other.bin_size_) {
    MOECORE_FAIL("indexed_dataset: '", indexed_bin_path(prefix), "' is shorter than its index says");
  }
  write_bytes(reinterpret_cast<const char*>(other.bin_), static_cast<size_t>(bytes));
}

void IndexedDatasetBuilder::finalize(const std::string& idx_request) {
  MOECORE_CHECK(!finalized_, "indexed_dataset: builder for '", bin_path_, "' already finalized");
  const std::string idx_path = replaceable_output(idx_request);
  flush();
  if (::fsync(fd_) != 0) MOECORE_FAIL("indexed_dataset: cannot fsync '", tmp_path_, "': ", std::strerror(errno));
  if (::close(fd_) != 0) MOECORE_FAIL("indexed_dataset: cannot close '", tmp_path_, "': ", std::strerror(errno));
  fd_ = -1;
  // An old .idx must not outlive the .bin it described.
  if (::unlink(idx_path.c_str()) != 0 && errno != ENOENT) {
    MOECORE_FAIL("indexed_dataset: cannot remove old index '", idx_path, "': ", std::strerror(errno));
  }
  if (std::rename(tmp_path_.c_str(), bin_path_.c_str()) != 0) {
    MOECORE_FAIL("indexed_dataset: cannot rename '", tmp_path_, "' to '", bin_path_, "': ", std::strerror(errno));
  }
  finalized_ = true;
  io::write_file_atomic(idx_path, indexed_idx_serialize(dtype_, sequence_lengths_, document_indices_));
}

// ---------------------------------------------------------------------------------------------------
// Reader

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = indexed_idx_path(prefix), bin_path = indexed_bin_path(prefix);
  idx_ = map_file(idx_path, idx_size_, "index");
  try {
    // Every failure names the file, the field, what was expected and what was found.
    auto fail = [](const std::string& path, const std::string& field, const std::string& why) {
      MOECORE_FAIL("indexed_dataset: '", path, "': ", field, ": ", why,
                   "; the file is corrupt, truncated, or the .bin and .idx do not belong together (rebuild them with "
                   "moecore preprocess)");
    };
    if (idx_size_ < kIdxHeaderBytes) {
      fail(idx_path, "header",
           detail::str_cat("truncated index: ", idx_size_, " bytes, the header alone needs ", kIdxHeaderBytes));
    }
    if (std::memcmp(idx_, kIdxMagic, sizeof(kIdxMagic)) != 0)
      fail(idx_path, "magic", "bad magic (expected \"MMIDIDX\\0\\0\"); not a Megatron indexed-dataset index");
    const uint64_t version = load<uint64_t>(idx_ + 9);
    if (version != kIdxVersion)
      fail(idx_path, "version", detail::str_cat("unsupported version ", version, " (expected 1, the only one read)"));
    const uint8_t code = idx_[17];
    if (!token_dtype_valid(code))
      fail(idx_path, "dtype", detail::str_cat("unknown dtype code ", int(code), " (valid: 1..8)"));
    dtype_ = static_cast<TokenDType>(code);
    const uint64_t s = load<uint64_t>(idx_ + 18), d = load<uint64_t>(idx_ + 26);
    if (d < 1) fail(idx_path, "document_count", "expected at least 1 (it is num_documents + 1), found 0");
    // Both counts are bounded by the file size before any product is formed, so nothing below overflows.
    const uint64_t room = uint64_t(idx_size_ - kIdxHeaderBytes);
    if (s > room / 12 || d > room / 8 || 12 * s + 8 * d != room) {
      const bool small = s <= room / 12 && d <= room / 8;
      fail(idx_path, "size",
           detail::str_cat(
               small && 12 * s + 8 * d > room ? "truncated index: " : "", "sequence_count ", s, " and document_count ",
               d, " need ",
               small ? detail::str_cat(kIdxHeaderBytes + 12 * s + 8 * d) : detail::str_cat("more than ", idx_size_),
               " bytes (34 + 12 * sequence_count + 8 * document_count), the file has ", idx_size_));
    }
    num_sequences_ = static_cast<int64_t>(s);
    num_documents_ = static_cast<int64_t>(d) - 1;

    // Megatron's layout: pointer[0] = 0 and pointer[i] = pointer[i-1] + size[i-1] * itemsize, so a wrong dtype
    // code, a negative size or a stray pointer shows here rather than as a wild read in the middle of training.
    const int64_t item = token_dtype_size(dtype_);
    const unsigned char* sizes = idx_ + kIdxHeaderBytes;
    const unsigned char* pointers = sizes + 4 * num_sequences_;
    int64_t expected = 0;
    for (int64_t i = 0; i < num_sequences_; ++i) {
      const int32_t len = load<int32_t>(sizes + 4 * i);
      if (len < 0) fail(idx_path, detail::str_cat("sizes[", i, "]"), detail::str_cat("expected >= 0, found ", len));
      const int64_t ptr = load<int64_t>(pointers + 8 * i);
      if (ptr != expected) {
        fail(idx_path, detail::str_cat("pointers[", i, "]"),
             detail::str_cat("expected ", expected, " (pointers[i-1] + sizes[i-1] * ", item, " bytes for dtype ",
                             token_dtype_name(dtype_), "), found ", ptr));
      }
      if (__builtin_add_overflow(expected, int64_t{len} * item, &expected))
        fail(idx_path, detail::str_cat("sizes[", i, "]"), "the sequence ends past 2^63 bytes");
    }
    const unsigned char* docs = pointers + 8 * num_sequences_;
    int64_t prev = 0;
    for (int64_t k = 0; k <= num_documents_; ++k) {
      const int64_t v = load<int64_t>(docs + 8 * k);
      if (k == 0 && v != 0) fail(idx_path, "document_indices[0]", detail::str_cat("expected 0, found ", v));
      if (v < prev || v > num_sequences_) {
        fail(idx_path, detail::str_cat("document_indices[", k, "]"),
             detail::str_cat("expected a value in [", prev, ", ", num_sequences_,
                             "] (non-decreasing, at most sequence_count), found ", v));
      }
      prev = v;
    }
    if (prev != num_sequences_) {
      fail(idx_path, detail::str_cat("document_indices[", num_documents_, "]"),
           detail::str_cat("expected sequence_count ", num_sequences_, ", found ", prev));
    }

    bin_ = map_file(bin_path, bin_size_, "data file");
    if (bin_size_ != expected) {
      fail(bin_path, "size",
           detail::str_cat("expected ", expected, " bytes (the sequences of '", idx_path, "' in dtype ",
                           token_dtype_name(dtype_), "), found ", bin_size_,
                           bin_size_ < expected ? " (truncated)" : ""));
    }
  } catch (...) {
    unmap(idx_, idx_size_);
    unmap(bin_, bin_size_);
    throw;
  }
}

IndexedDataset::~IndexedDataset() {
  unmap(idx_, idx_size_);
  unmap(bin_, bin_size_);
}

int32_t IndexedDataset::sequence_length(int64_t i) const {
  MOECORE_CHECK(i >= 0 && i < num_sequences_, "sequence ", i, " out of [0, ", num_sequences_, ")");
  return load<int32_t>(idx_ + kIdxHeaderBytes + 4 * i);
}

int64_t IndexedDataset::sequence_pointer(int64_t i) const {
  MOECORE_CHECK(i >= 0 && i < num_sequences_, "sequence ", i, " out of [0, ", num_sequences_, ")");
  return load<int64_t>(idx_ + kIdxHeaderBytes + 4 * num_sequences_ + 8 * i);
}

int64_t IndexedDataset::document_index(int64_t d) const {
  MOECORE_CHECK(d >= 0 && d <= num_documents_, "document boundary ", d, " out of [0, ", num_documents_, "]");
  return load<int64_t>(idx_ + kIdxHeaderBytes + 12 * num_sequences_ + 8 * d);
}

std::vector<int32_t> IndexedDataset::sequence_lengths(int64_t begin, int64_t end) const {
  MOECORE_CHECK(begin >= 0 && begin <= end && end <= num_sequences_, "range [", begin, ", ", end, ") of ",
                num_sequences_);
  std::vector<int32_t> out(static_cast<size_t>(end - begin));
  if (!out.empty()) std::memcpy(out.data(), idx_ + kIdxHeaderBytes + 4 * begin, 4 * out.size());
  return out;
}

void IndexedDataset::read(int64_t i, int64_t offset, int64_t length, int32_t* out) const {
  const int64_t len = sequence_length(i);
  MOECORE_CHECK(offset >= 0 && length >= 0 && offset <= len && length <= len - offset, "read [", offset, ", +", length,
                ") of sequence ", i, " with ", len, " tokens in '", prefix_, "'");
  const int64_t item = token_dtype_size(dtype_);
  // The constructor checked that every sequence lies inside .bin; this guards the arithmetic all the same.
  const int64_t at = sequence_pointer(i) + offset * item;
  MOECORE_CHECK(at >= 0 && at <= bin_size_ && length * item <= bin_size_ - at, "indexed_dataset: sequence ", i, " of '",
                prefix_, "' points past the end of its .bin (", bin_size_, " bytes)");
  const unsigned char* p = bin_ + at;
  switch (dtype_) {
    case TokenDType::u8:
      load_as<uint8_t>(p, length, out);
      break;
    case TokenDType::i8:
      load_as<int8_t>(p, length, out);
      break;
    case TokenDType::i16:
      load_as<int16_t>(p, length, out);
      break;
    case TokenDType::u16:
      load_as<uint16_t>(p, length, out);
      break;
    case TokenDType::i32:
      load_as<int32_t>(p, length, out);
      break;
    case TokenDType::i64:
      load_checked<int64_t>(p, length, out, prefix_, i);
      break;
    case TokenDType::f32:
      load_checked<float>(p, length, out, prefix_, i);
      break;
    case TokenDType::f64:
      load_checked<double>(p, length, out, prefix_, i);
      break;
  }
}

std::vector<int32_t> IndexedDataset::get(int64_t i, int64_t offset, int64_t length) const {
  if (length < 0) length = sequence_length(i) - offset;
  std::vector<int32_t> out(static_cast<size_t>(std::max<int64_t>(length, 0)));
  read(i, offset, length, out.data());
  return out;
}

}  // namespace moecore::data
