// The background writer of asynchronous checkpoint saves (Megatron's async checkpoint worker, --async-save): a thread
// that writes files already serialized into host memory at the save point into a checkpoint's staging directory
// (checkpoint_staging_write_bytes: fsync'd, CRC32C computed) while the caller trains on. One job at a time.
// It only writes: publishing and committing stay with the caller, after every rank's files are durable (so a crash at
// any point leaves the previous committed checkpoint the newest); it runs no collective and touches no tensor.
#pragma once
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "moecore/io/checkpoint.h"

namespace moecore::io {

// Bytes in host memory at a page-aligned address, so that direct I/O writes them without a copy
// (checkpoint_staging_write_bytes); resize() keeps the allocation when it is large enough, so a buffer reused from one
// checkpoint to the next costs no page faults. Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::string_view bytes);
  HostBuffer(HostBuffer&& o) noexcept;
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();
  char* resize(size_t bytes);  // the contents are unspecified after a resize that reallocates
  char* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  std::string_view view() const { return {data_, size_}; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0, capacity_ = 0;
};

// One file of a job: its name in the staging directory and its bytes (e.g. safetensors_serialize_to's).
struct CheckpointWorkerFile {
  std::string name;
  HostBuffer bytes;
};

// What a job did: every file's size and CRC32C when all were written, else the first failure.
struct CheckpointWorkerResult {
  std::map<std::string, CheckpointFileInfo> written;
  std::string error;       // "" on success; else the Error's message (the file, the byte offset, the errno's text)
  double seconds = 0;      // the job's wall time
  double cpu_seconds = 0;  // the writing thread's CPU time for it (the CRC32C, the write system calls)
};

// Threading: every method is called from one thread (the training loop); the writing runs on the worker's.
class CheckpointWorker {
 public:
  // persistent (--use-persistent-ckpt-worker): one thread for the worker's life, started by the first job; else a
  // thread per job, joined when its result is taken (Megatron's temporal worker). cpu_priority
  // (--async-ckpt-cpu-priority, Megatron's default 10): the nice value the writing thread runs at, so that the CRC32C
  // and the writes yield the cores to training; only raised (a thread at a higher nice value stays there), above 19
  // is 19, below 0 leaves it as the training thread's.
  explicit CheckpointWorker(bool persistent, int cpu_priority = kDefaultCpuPriority);
  static constexpr int kDefaultCpuPriority = 10;
  // Waits for the job in flight (its result is dropped: nothing is committed), then ends the thread.
  ~CheckpointWorker();
  CheckpointWorker(const CheckpointWorker&) = delete;
  CheckpointWorker& operator=(const CheckpointWorker&) = delete;

  // Starts writing `files` into the existing directory `dir`, in order. Precondition: !busy().
  void submit(std::string dir, std::vector<CheckpointWorkerFile> files);
  bool busy() const { return busy_; }  // a job was submitted and its result not taken yet
  bool done() const;                   // the job submitted has finished (never blocks); false when !busy()
  // Waits for the job to finish and returns its result; the worker is idle again. The job's files are handed back in
  // `files` when given (their buffers for the next job), else released.
  CheckpointWorkerResult take(std::vector<CheckpointWorkerFile>* files = nullptr);

 private:
  struct Job {
    std::string dir;
    std::vector<CheckpointWorkerFile> files;
  };
  static CheckpointWorkerResult run(const Job& job);
  void loop();  // the persistent thread

  const bool persistent_;
  const int cpu_priority_;
  bool busy_ = false;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Job> job_;  // from submit() to take(): the worker reads it while the caller does not touch it
  bool pending_ = false;    // submitted, not yet started (persistent)
  bool stop_ = false;       // the destructor ends the persistent thread
  std::optional<CheckpointWorkerResult> result_;  // set by the worker when the job is finished
  std::thread thread_;
};

}  // namespace moecore::io
