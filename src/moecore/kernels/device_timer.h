// Timing of the work queued on a device, for the lab bench (bench/, `moecore bench --device`): CUDA events on the
// legacy default stream on cuda (every op runs there: ops::Context's stream is null), the host's steady clock on cpu
// and sim, whose ops run synchronously on the calling thread. No CUDA type appears here: the CUDA calls sit behind a
// link-time seam (timer_seam below), kernels/cuda/device_timer.cu in builds with the CUDA kernels and
// kernels/cpu/device_timer_host.cpp (raising "built without the CUDA kernels") otherwise. Not a profiler.
#pragma once
#include "moecore/core/tensor.h"

namespace moecore::ops {

// Up to kMarks points in the stream of work of one device; intervals between them in milliseconds.
// Single-threaded: one timer belongs to the thread that queues the work it times.
class DeviceTimer {
 public:
  static constexpr int kMarks = 8;
  // cuda: creates kMarks events (raises naming the call when the runtime refuses); cpu | sim: a wall clock.
  explicit DeviceTimer(Device device);
  ~DeviceTimer();
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;

  // Sets mark i (0 <= i < kMarks) after all the work queued so far. Does not wait.
  void mark(int i);
  // Milliseconds from mark `from` to mark `to` (set in that order), after waiting until the device reaches `to`.
  double elapsed_ms(int from, int to);
  // "cuda_events" (cuda) or "wall_clock" (cpu, sim): what a timer on `device` measures.
  static const char* clock(Device device);

 private:
  Device device_;
  void* events_[kMarks] = {};   // cudaEvent_t on cuda
  double host_s_[kMarks] = {};  // steady-clock seconds on cpu and sim
};

// Waits until the device has finished all the work queued on it (cudaDeviceSynchronize on cuda; cpu and sim queue
// nothing).
void device_synchronize(Device device);

// The CUDA side of the timer. Every call is checked and raises moecore::Error naming the call and the runtime's
// error; builds without the CUDA kernels raise naming the missing build option instead.
namespace timer_seam {
void* cuda_event_create();
void cuda_event_destroy(void* event);               // never raises (destructors call it)
void cuda_event_record(void* event);                // on the legacy default stream
float cuda_event_elapsed_ms(void* from, void* to);  // waits for `to` first
void cuda_device_synchronize();
}  // namespace timer_seam

}  // namespace moecore::ops
