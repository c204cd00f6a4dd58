// The host side of cuda_util.cuh: error messages naming the call, the op and its arguments, the MOECORE_CUDA_SYNC
// switch, the per-device, per-stream workspaces, and the dropout threshold.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "moecore/kernels/cuda/cuda_util.cuh"

#include "moecore/core/backend_hooks.h"
#include "moecore/kernels/common/dropout_mask.h"

namespace moecore::ops::cuda {

Launch::Launch(const char* op, const Context& ctx, std::initializer_list<Arg> args)
    : op_(op), stream_(static_cast<cudaStream_t>(ctx.stream)) {
  for (const Arg& a : args)
    if (nargs_ < 8) args_[nargs_++] = a;
}

void Launch::fail(const char* call, const char* error, const char* detail) const {
  std::string all;
  for (int i = 0; i < nargs_; ++i) {
    all += i ? ", " : "";
    all += std::string(args_[i].first) + " " + (args_[i].second->defined() ? args_[i].second->str() : "undefined");
  }
  MOECORE_FAIL(op_, " (cuda): ", call, " failed: ", error, ": ", detail, "; arguments: ", all);
}

bool Launch::sync_each_launch() {
  return device_sync_each_launch();
}

void Launch::synchronise(const char* after) const {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) [[unlikely]] {
    const std::string call = std::string(after) + " (the device synchronised after it: MOECORE_CUDA_SYNC=1)";
    fail(call.c_str(), cudaGetErrorName(e), cudaGetErrorString(e));
  }
}

namespace {
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};
std::mutex g_workspace_mu;
std::map<std::pair<int, cudaStream_t>, Workspace> g_workspaces;  // (device, stream); never freed (process lifetime)
}  // namespace

void* Launch::workspace(size_t bytes) const {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(g_workspace_mu);
  Workspace& w = g_workspaces[{device, stream_}];
  if (w.bytes >= bytes) return w.data;
  if (w.data) {  // earlier kernels on this stream may still read the old buffer
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (workspace growth)");
    device_free(w.data);
    w = {};
  }
  // From the device-memory pool (core/backend_hooks.h), which keeps what tensors freed: a cudaMalloc here could fail
  // while the pool holds the memory.
  const size_t grown = std::max(bytes, size_t{1} << 20);
  w.data = device_alloc(static_cast<int64_t>(grown));
  if (!w.data) {
    const std::string what = "device_alloc (a workspace of " + std::to_string(grown) + " bytes)";
    fail(what.c_str(), "out of memory", "the device has no room left for this op's workspace");
  }
  w.bytes = grown;
  return w.data;
}

__global__ void segment_plan_kernel(int64_t* offsets, int64_t* tiles, const int64_t* group_rows, int64_t G, int64_t R,
                                    int64_t tile_rows) {
  int64_t o = 0, t = 0;
  offsets[0] = 0;
  tiles[0] = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t n = group_rows ? group_rows[g] : R;
    n = n < 0 ? 0 : (n > R - o ? R - o : n);
    o += n;
    t += (n + tile_rows - 1) / tile_rows;
    offsets[g + 1] = o;
    tiles[g + 1] = t;
  }
}

void segment_plan(const Launch& l, int64_t* offsets, int64_t* tiles, const int64_t* group_rows, int64_t G, int64_t R,
                  int64_t tile_rows) {
  segment_plan_kernel<<<1, 1, 0, l.stream()>>>(offsets, tiles, group_rows, G, R, tile_rows);
  l.launched("segment_plan_kernel");
}

// cpu::DropoutMask's threshold and scale (kernels/common/dropout_mask.h).
DeviceMask device_mask(const Dropout& d) {
  DeviceMask m;
  if (!d.active()) return m;
  m.key0 = d.key[0];
  m.key1 = d.key[1];
  m.threshold = dropout::keep_threshold(d.p);
  m.scale = dropout::keep_scale(d.p);
  m.active = true;
  return m;
}

}  // namespace moecore::ops::cuda
