// The "local" backend of parallel/comm.h, linked when moecore is built without MPI: a world of one
// process, whose collectives are identities (copies) on size-1 groups. Every entry point exists, so code
// above parallel/ builds and runs unchanged; only world sizes above 1 are out of reach.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "moecore/core/error.h"
#include "moecore/parallel/backend.h"

namespace moecore::detail {

struct BackendComm {};

namespace {
void copy(void* out, const void* in, int64_t n, DType t) {
  if (n > 0 && out != in) std::memcpy(out, in, static_cast<size_t>(n) * dtype_size(t));
}
}  // namespace

const char* backend_name() {
  return "local";
}
bool backend_multi_process() {
  return false;
}
void backend_init(int&, char**&) {}
void backend_finalize() {}
bool backend_initialized() {
  return true;
}
int backend_world_size() {
  return 1;
}
int backend_world_rank() {
  return 0;
}
std::shared_ptr<BackendComm> backend_world() {
  return std::make_shared<BackendComm>();
}

std::shared_ptr<BackendComm> backend_split(BackendComm&, int, int, const CallInfo&) {
  return std::make_shared<BackendComm>();
}

void backend_all_gather(void* out, const void* in, int64_t n, DType t, BackendComm&, const CallInfo&) {
  copy(out, in, n, t);
}

void backend_all_gather_v(void* out, const int64_t* counts, const int64_t* displs, const void* in, DType t,
                          BackendComm&, const CallInfo&) {
  copy(static_cast<char*>(out) + displs[0] * static_cast<int64_t>(dtype_size(t)), in, counts[0], t);
}

void backend_all_to_all_v(void* out, const int64_t* recv_counts, const int64_t* recv_displs, const void* in,
                          const int64_t* send_counts, const int64_t* send_displs, DType t, BackendComm&,
                          const CallInfo& call) {
  if (send_counts[0] != recv_counts[0])
    throw_backend_error(call, str_cat("sends ", send_counts[0], " elements to itself but expects ", recv_counts[0]));
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  copy(static_cast<char*>(out) + recv_displs[0] * es, static_cast<const char*>(in) + send_displs[0] * es,
       send_counts[0], t);
}

void backend_broadcast(void*, int64_t, DType, int, BackendComm&, const CallInfo&) {}
void backend_barrier(BackendComm&, const CallInfo&) {}

// comm.h serves size-1 groups itself (their transfers to themselves are matched in async.cpp), and the
// local world has no other kind: nothing ever posts a transfer here.
struct BackendRequest {};

std::shared_ptr<BackendRequest> backend_isend(const void*, int64_t, DType, int, int, bool, BackendComm&,
                                              const CallInfo& call) {
  throw_backend_error(call, "the local backend has no peers to send to (built without MPI)");
}

std::shared_ptr<BackendRequest> backend_irecv(void*, int64_t, DType, int, int, BackendComm&, const CallInfo& call) {
  throw_backend_error(call, "the local backend has no peers to receive from (built without MPI)");
}

bool backend_test(BackendRequest&, const CallInfo&) {
  return true;
}

int backend_tag_limit() {
  return 32768;
}

bool backend_all_failed_together(double) {
  return true;  // one process: it is all of them
}

void backend_abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

}  // namespace moecore::detail
