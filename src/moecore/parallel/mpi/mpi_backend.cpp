// MPI backend of parallel/comm.h: nonblocking MPI collectives polled with MPI_Test, so a missing peer
// becomes a timeout Error naming op, group and rank instead of a hang. moecore traffic runs on a duplicate
// of MPI_COMM_WORLD with MPI_ERRORS_RETURN, so every MPI failure is checked and reported, never fatal.
// No reductions here (MPI_SUM may reorder floating-point sums); collectives.cpp builds deterministic ones.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/parallel/backend.h"
#include "moecore/parallel/comm.h"

namespace moecore::detail {

struct BackendComm {
  MPI_Comm comm = MPI_COMM_NULL;
  std::vector<int> ints;  // grow-only workspace: MPI's int counts and displacements
  explicit BackendComm(MPI_Comm c) : comm(c) {}
  BackendComm(const BackendComm&) = delete;
  BackendComm& operator=(const BackendComm&) = delete;
  ~BackendComm() {
    const std::lock_guard<std::recursive_mutex> lock(comm_mutex());  // (a group may go while the progress thread polls)
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

namespace {

bool g_we_initialized = false;
int g_tag_limit = 32768;
std::shared_ptr<BackendComm> g_world;
MPI_Comm g_control = MPI_COMM_NULL;  // only comm_error_exit's agreement runs on it: never mixed with collectives

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<size_t>(len));
}

void check(int rc, const char* fn, const CallInfo& call) {
  if (rc != MPI_SUCCESS) throw_backend_error(call, str_cat(fn, " failed: ", mpi_error_string(rc)));
}

void check_setup(int rc, const char* fn) {
  if (rc != MPI_SUCCESS) MOECORE_FAIL("comm (mpi): ", fn, " failed: ", mpi_error_string(rc));
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i64:
      return MPI_INT64_T;
    case DType::i32:
      return MPI_INT32_T;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;
    case DType::f8e4m3:
    case DType::f8e5m2:
    case DType::boolean:
      return MPI_UINT8_T;
  }
  MOECORE_CHECK(false, "no MPI type for dtype ", static_cast<int>(t));
  return MPI_DATATYPE_NULL;
}

int to_int(int64_t v, const CallInfo& call, const char* what) {
  if (v < 0 || v > INT_MAX)
    throw_backend_error(
        call, str_cat(what, " = ", v, " is outside MPI's int range (0 .. ", INT_MAX, " elements); split the message"));
  return static_cast<int>(v);
}

// The first n of v as MPI ints, in the communicator's workspace at slot (slot·n ...).
int* to_ints(BackendComm& c, int slot, const int64_t* v, int n, const CallInfo& call, const char* what) {
  const size_t need = static_cast<size_t>(4 * n);
  if (c.ints.size() < need) c.ints.resize(need);
  int* out = c.ints.data() + static_cast<size_t>(slot) * static_cast<size_t>(n);
  for (int i = 0; i < n; ++i) out[i] = to_int(v[i], call, what);
  return out;
}

int comm_size(MPI_Comm c) {
  int n = 0;
  MPI_Comm_size(c, &n);
  return n;
}

// Polls the request: yields for the first 50 ms, then naps with growing back-off up to 1 ms so that
// oversubscribed ranks leave the cores to the peers they are waiting for. Open MPI moves the data of a
// nonblocking collective only inside MPI_Test, fragment by fragment: a transfer still moving must be
// polled without naps (napping after 100 polls made multi-megabyte all-to-alls crawl: ~1 ms per fragment).
void wait(MPI_Request& req, const CallInfo& call) {
  if (call.timeout_s <= 0 && !progress_async()) {
    check(MPI_Wait(&req, MPI_STATUS_IGNORE), "MPI_Wait", call);
    return;
  }
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(call.timeout_s));
  auto nap = std::chrono::microseconds(10);
  const auto busy_until = clock::now() + std::chrono::milliseconds(50);
  for (;;) {
    int done = 0;
    check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test", call);
    if (done) return;
    progress_async();
    // The request stays pending: peers may still complete it, so it cannot be freed (MPI forbids
    // MPI_Request_free on collectives). The group is marked broken by the caller.
    if (call.timeout_s > 0 && clock::now() >= deadline) throw_timeout(call);
    if (clock::now() < busy_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
}

}  // namespace

const char* backend_name() {
  return "mpi";
}
bool backend_multi_process() {
  return true;
}

void backend_init(int& argc, char**& argv) {
  if (g_world) return;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) MOECORE_FAIL("comm (mpi): comm_init after MPI was finalized; MPI cannot be restarted");
  int provided = 0;
  if (!initialized) {
    // SERIALIZED lets the progress thread call MPI while the calling thread computes (comm_mutex serializes them).
    check_setup(MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    g_we_initialized = true;
    if (provided < MPI_THREAD_FUNNELED)
      MOECORE_FAIL("comm (mpi): MPI provides thread level ", provided, " but moecore needs MPI_THREAD_FUNNELED (",
                   MPI_THREAD_FUNNELED, "): OpenMP threads run beside the communicating thread");
    // Errors of nonblocking collectives surface in MPI_Test, which Open MPI reports on MPI_COMM_WORLD's
    // handler: make it return too, so they become Errors (when MPI is ours to configure).
    check_setup(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_setup(MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }
  MPI_Comm dup = MPI_COMM_NULL;
  check_setup(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup(MPI_COMM_WORLD)");
  check_setup(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  g_world = std::make_shared<BackendComm>(dup);
  check_setup(MPI_Comm_dup(MPI_COMM_WORLD, &g_control), "MPI_Comm_dup(MPI_COMM_WORLD)");
  check_setup(MPI_Comm_set_errhandler(g_control, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  int* tag_ub = nullptr;
  int flag = 0;
  check_setup(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag), "MPI_Comm_get_attr(MPI_TAG_UB)");
  if (flag && tag_ub && *tag_ub >= 32767) g_tag_limit = *tag_ub == INT_MAX ? INT_MAX : *tag_ub + 1;
  if (initialized) MPI_Query_thread(&provided);
  if (comm_options().progress_thread && provided >= MPI_THREAD_SERIALIZED && comm_size(g_world->comm) > 1)
    start_progress_thread();
}

void backend_finalize() {
  stop_progress_thread();  // before MPI goes: it calls MPI
  g_world.reset();         // frees the duplicate unless a ProcessGroup still holds it
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && g_control != MPI_COMM_NULL) MPI_Comm_free(&g_control);
  if (g_we_initialized && !finalized) check_setup(MPI_Finalize(), "MPI_Finalize");
  g_we_initialized = false;
}

bool backend_initialized() {
  return g_world != nullptr;
}

int backend_world_size() {
  MOECORE_CHECK(g_world, "comm: MPI backend used before comm_init");
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  return comm_size(g_world->comm);
}

int backend_world_rank() {
  MOECORE_CHECK(g_world, "comm: MPI backend used before comm_init");
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  int r = 0;
  MPI_Comm_rank(g_world->comm, &r);
  return r;
}

std::shared_ptr<BackendComm> backend_world() {
  return g_world;
}

std::shared_ptr<BackendComm> backend_split(BackendComm& parent, int color, int key, const CallInfo& call) {
  // MPI_Comm_split blocks with no timeout: a timed barrier first makes sure every peer has arrived.
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ibarrier(parent.comm, &req), "MPI_Ibarrier", call);
  wait(req, call);
  MPI_Comm out = MPI_COMM_NULL;
  check(MPI_Comm_split(parent.comm, color, key, &out), "MPI_Comm_split", call);
  return std::make_shared<BackendComm>(out);
}

void backend_all_gather(void* out, const void* in, int64_t n, DType t, BackendComm& c, const CallInfo& call) {
  const int count = to_int(n, call, "element count");
  to_int(n * comm_size(c.comm), call, "gathered element count");
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Iallgather(in, count, mpi_type(t), out, count, mpi_type(t), c.comm, &req), "MPI_Iallgather", call);
  wait(req, call);
}

void backend_all_gather_v(void* out, const int64_t* counts, const int64_t* displs, const void* in, DType t,
                          BackendComm& c, const CallInfo& call) {
  const int p = comm_size(c.comm);
  const int* icounts = to_ints(c, 0, counts, p, call, "count");
  const int* idispls = to_ints(c, 1, displs, p, call, "displacement");
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Iallgatherv(in, icounts[call.rank], mpi_type(t), out, icounts, idispls, mpi_type(t), c.comm, &req),
        "MPI_Iallgatherv", call);
  wait(req, call);
}

void backend_all_to_all_v(void* out, const int64_t* recv_counts, const int64_t* recv_displs, const void* in,
                          const int64_t* send_counts, const int64_t* send_displs, DType t, BackendComm& c,
                          const CallInfo& call) {
  const int p = comm_size(c.comm);
  const int* sc = to_ints(c, 0, send_counts, p, call, "send count");
  const int* sd = to_ints(c, 1, send_displs, p, call, "send displacement");
  const int* rc = to_ints(c, 2, recv_counts, p, call, "receive count");
  const int* rd = to_ints(c, 3, recv_displs, p, call, "receive displacement");
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ialltoallv(in, sc, sd, mpi_type(t), out, rc, rd, mpi_type(t), c.comm, &req), "MPI_Ialltoallv", call);
  wait(req, call);
}

void backend_broadcast(void* buf, int64_t n, DType t, int root, BackendComm& c, const CallInfo& call) {
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ibcast(buf, to_int(n, call, "element count"), mpi_type(t), root, c.comm, &req), "MPI_Ibcast", call);
  wait(req, call);
}

void backend_barrier(BackendComm& c, const CallInfo& call) {
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ibarrier(c.comm, &req), "MPI_Ibarrier", call);
  wait(req, call);
}

// One logical message: pieces of at most kPiece elements (MPI counts are ints), posted in order under one tag.
struct BackendRequest {
  std::vector<MPI_Request> reqs;
  std::vector<int64_t> expect;  // receives: elements each piece must bring
  size_t next = 0;              // pieces before this one are complete
  int peer = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
};

namespace {
constexpr int64_t kPiece = int64_t{1} << 30;

std::shared_ptr<BackendRequest> post(void* buf, int64_t n, DType t, int peer, int tag, int mode, BackendComm& c,
                                     const CallInfo& call) {
  auto r = std::make_shared<BackendRequest>();
  r->peer = peer;
  r->type = mpi_type(t);
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  int64_t at = 0;
  do {
    const int len = static_cast<int>(std::min(kPiece, n - at));
    void* p = static_cast<char*>(buf) + at * es;
    MPI_Request req = MPI_REQUEST_NULL;
    if (mode == 0) check(MPI_Irecv(p, len, mpi_type(t), peer, tag, c.comm, &req), "MPI_Irecv", call);
    if (mode == 1) check(MPI_Isend(p, len, mpi_type(t), peer, tag, c.comm, &req), "MPI_Isend", call);
    if (mode == 2) check(MPI_Issend(p, len, mpi_type(t), peer, tag, c.comm, &req), "MPI_Issend", call);
    r->reqs.push_back(req);
    if (mode == 0) r->expect.push_back(len);
    at += len;
  } while (at < n);
  return r;
}
}  // namespace

std::shared_ptr<BackendRequest> backend_isend(const void* buf, int64_t n, DType t, int peer, int tag, bool synchronous,
                                              BackendComm& c, const CallInfo& call) {
  return post(const_cast<void*>(buf), n, t, peer, tag, synchronous ? 2 : 1, c, call);
}

std::shared_ptr<BackendRequest> backend_irecv(void* buf, int64_t n, DType t, int peer, int tag, BackendComm& c,
                                              const CallInfo& call) {
  return post(buf, n, t, peer, tag, 0, c, call);
}

bool backend_test(BackendRequest& r, const CallInfo& call) {
  while (r.next < r.reqs.size()) {
    int done = 0;
    MPI_Status status;
    check(MPI_Test(&r.reqs[r.next], &done, &status), "MPI_Test", call);
    if (!done) return false;
    if (!r.expect.empty()) {  // a shorter message is legal MPI but always a bug here
      int got = 0;
      check(MPI_Get_count(&status, r.type, &got), "MPI_Get_count", call);
      if (got != r.expect[r.next])
        throw_backend_error(
            call, str_cat("the message from rank ", r.peer, " has ", got, " elements but the receive expects ",
                          r.expect[r.next], " (piece ", r.next, ")"));
    }
    ++r.next;
  }
  return true;
}

int backend_tag_limit() {
  return g_tag_limit;
}

bool backend_all_failed_together(double wait_s) {
  if (g_control == MPI_COMM_NULL) return false;
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  MPI_Request req = MPI_REQUEST_NULL;
  if (MPI_Ibarrier(g_control, &req) != MPI_SUCCESS) return false;
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(wait_s));
  for (;;) {
    int done = 0;
    if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    if (clock::now() >= deadline) return false;  // the request stays pending: the caller aborts
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void backend_abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace moecore::detail
