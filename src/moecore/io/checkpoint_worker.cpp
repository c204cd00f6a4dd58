// The background checkpoint writer: a persistent thread fed one job at a time, or a thread per job. The caller and the
// worker share only the job (read by the worker while the caller leaves it alone) and the result (under the mutex).
#include "moecore/io/checkpoint_worker.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <utility>

#include "moecore/core/error.h"

namespace moecore::io {
namespace {

// A thread that receives none of the process's asynchronous signals (SIGTERM, SIGINT, ...): they reach the training
// thread, whose handlers decide what a stop means; faults the thread itself causes are still delivered to it.
template <class F>
std::thread signal_quiet_thread(F&& body) {
  sigset_t quiet, old;
  sigfillset(&quiet);
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP}) sigdelset(&quiet, s);
  pthread_sigmask(SIG_BLOCK, &quiet, &old);
  std::thread t(std::forward<F>(body));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return t;
}

// The calling thread's nice value raised to `nice` (Linux: a thread's own; failures leave it, as Megatron's warning).
void lower_thread_priority(int nice) {
  if (nice < 0) return;
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int now = ::getpriority(PRIO_PROCESS, tid);
  if (errno == 0 && now < nice) ::setpriority(PRIO_PROCESS, tid, nice);
}

double thread_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

HostBuffer::HostBuffer(std::string_view bytes) {
  if (!bytes.empty()) std::memcpy(resize(bytes.size()), bytes.data(), bytes.size());
}

HostBuffer::HostBuffer(HostBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      capacity_(std::exchange(o.capacity_, 0)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    capacity_ = std::exchange(o.capacity_, 0);
  }
  return *this;
}

HostBuffer::~HostBuffer() {
  std::free(data_);
}

char* HostBuffer::resize(size_t bytes) {
  constexpr size_t kPage = 4096;
  if (bytes > capacity_) {
    const size_t cap = (bytes + kPage - 1) / kPage * kPage;
    char* p = static_cast<char*>(std::aligned_alloc(kPage, cap));
    if (!p) MOECORE_FAIL("checkpoint: cannot allocate ", bytes, " bytes of host memory for a checkpoint's snapshot");
    std::free(data_);
    data_ = p;
    capacity_ = cap;
  }
  size_ = bytes;
  return data_;
}

CheckpointWorker::CheckpointWorker(bool persistent, int cpu_priority)
    : persistent_(persistent), cpu_priority_(cpu_priority > 19 ? 19 : cpu_priority) {}

CheckpointWorker::~CheckpointWorker() {
  if (persistent_ && thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;  // a job not started yet is dropped; the one being written is finished first
    }
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

CheckpointWorkerResult CheckpointWorker::run(const Job& job) {
  const auto t0 = std::chrono::steady_clock::now();
  const double cpu0 = thread_cpu_seconds();
  CheckpointWorkerResult r;
  // Every exception is caught here: one escaping a thread would end the process without a word.
  try {
    for (const CheckpointWorkerFile& f : job.files)
      r.written[f.name] = checkpoint_staging_write_bytes(job.dir, f.name, f.bytes.view());
  } catch (const std::exception& e) {
    r.error = e.what();
  } catch (...) {
    r.error = "checkpoint: the background writer failed with an unknown exception";
  }
  if (!r.error.empty()) r.written.clear();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.cpu_seconds = thread_cpu_seconds() - cpu0;
  return r;
}

void CheckpointWorker::loop() {
  lower_thread_priority(cpu_priority_);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || pending_; });
    if (stop_) return;
    pending_ = false;
    lk.unlock();
    CheckpointWorkerResult r = run(*job_);
    lk.lock();
    result_ = std::move(r);
    cv_.notify_all();
  }
}

void CheckpointWorker::submit(std::string dir, std::vector<CheckpointWorkerFile> files) {
  MOECORE_CHECK(!busy_, "checkpoint worker: a job was submitted while the previous one's result was not taken");
  busy_ = true;
  if (!persistent_) {
    if (thread_.joinable()) thread_.join();
    job_ = Job{std::move(dir), std::move(files)};
    thread_ = signal_quiet_thread([this] {
      lower_thread_priority(cpu_priority_);
      CheckpointWorkerResult r = run(*job_);
      std::lock_guard<std::mutex> lk(mu_);
      result_ = std::move(r);
      cv_.notify_all();
    });
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = Job{std::move(dir), std::move(files)};
    pending_ = true;
  }
  if (!thread_.joinable()) thread_ = signal_quiet_thread([this] { loop(); });
  cv_.notify_all();
}

bool CheckpointWorker::done() const {
  std::lock_guard<std::mutex> lk(mu_);
  return result_.has_value();
}

CheckpointWorkerResult CheckpointWorker::take(std::vector<CheckpointWorkerFile>* files) {
  MOECORE_CHECK(busy_, "checkpoint worker: take() without a job");
  std::optional<Job> job;  // released after the lock: freeing gigabytes need not hold it
  CheckpointWorkerResult r;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return result_.has_value(); });
    r = std::move(*result_);
    result_.reset();
    job = std::move(job_);
    job_.reset();
  }
  if (!persistent_) thread_.join();
  busy_ = false;
  if (files && job) *files = std::move(job->files);
  return r;
}

}  // namespace moecore::io
