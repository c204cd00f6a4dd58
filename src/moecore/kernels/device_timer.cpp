// DeviceTimer (device_timer.h): marks are events on cuda, steady-clock readings elsewhere.
#include "moecore/kernels/device_timer.h"

#include <chrono>

namespace moecore::ops {
namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
void check_mark(int i, const char* what) {
  if (i < 0 || i >= DeviceTimer::kMarks)
    MOECORE_FAIL("device timer: ", what, " mark ", i, " is outside [0, ", DeviceTimer::kMarks, ")");
}
}  // namespace

DeviceTimer::DeviceTimer(Device device) : device_(device) {
  if (device_ != Device::cuda) return;
  try {
    for (void*& e : events_) e = timer_seam::cuda_event_create();
  } catch (...) {
    for (void* e : events_)
      if (e) timer_seam::cuda_event_destroy(e);
    throw;
  }
}

DeviceTimer::~DeviceTimer() {
  for (void* e : events_)
    if (e) timer_seam::cuda_event_destroy(e);
}

void DeviceTimer::mark(int i) {
  check_mark(i, "set");
  if (device_ == Device::cuda)
    timer_seam::cuda_event_record(events_[i]);
  else
    host_s_[i] = now_s();
}

double DeviceTimer::elapsed_ms(int from, int to) {
  check_mark(from, "from");
  check_mark(to, "to");
  if (device_ == Device::cuda) return timer_seam::cuda_event_elapsed_ms(events_[from], events_[to]);
  return (host_s_[to] - host_s_[from]) * 1e3;
}

const char* DeviceTimer::clock(Device device) {
  return device == Device::cuda ? "cuda_events" : "wall_clock";
}

void device_synchronize(Device device) {
  if (device == Device::cuda) timer_seam::cuda_device_synchronize();
}

}  // namespace moecore::ops
