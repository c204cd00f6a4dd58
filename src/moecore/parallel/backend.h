// Internal seam between parallel/comm.h and its backends: parallel/mpi/ (MPI), parallel/local/ (one
// process, no library) and later parallel/nccl/. Exactly one backend is linked (a link-time seam, like
// kernels/cuda/no_device.cpp). Only parallel/*.cpp include this; the deterministic algorithms, argument
// checks and debug-mode checks live in comm.cpp/collectives.cpp and use these primitives only.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/core/dtype.h"

namespace moecore::detail {

struct BackendComm;  // one communicator; defined by the backend

// Who calls what: everything a timeout or backend error message must name.
struct CallInfo {
  std::string_view op;       // "all_reduce_sum", "all_to_all_v (debug check)", ...
  const std::string& group;  // group name
  int rank = 0;              // index in the group
  int world_rank = 0;
  uint64_t seq = 0;      // call number on this communicator
  double timeout_s = 0;  // <= 0: wait forever
};

// "comm: <op> on group <name> timed out after N s on rank R (world rank W) ..." (shared wording).
[[noreturn]] void throw_timeout(const CallInfo& call);
// "comm: <op> on group <name> on rank R (world rank W): <what>"
[[noreturn]] void throw_backend_error(const CallInfo& call, const std::string& what);

const char* backend_name();
bool backend_multi_process();
void backend_init(int& argc, char**& argv);
void backend_finalize();
bool backend_initialized();
int backend_world_size();
int backend_world_rank();
std::shared_ptr<BackendComm> backend_world();
// Collective over parent: members with equal color form a communicator, ordered by key.
std::shared_ptr<BackendComm> backend_split(BackendComm& parent, int color, int key, const CallInfo& call);

// Counts and displacements are in elements, one per group rank. All wait with call.timeout_s.
void backend_all_gather(void* out, const void* in, int64_t n, DType t, BackendComm& c, const CallInfo& call);
void backend_all_gather_v(void* out, const int64_t* counts, const int64_t* displs, const void* in, DType t,
                          BackendComm& c, const CallInfo& call);
void backend_all_to_all_v(void* out, const int64_t* recv_counts, const int64_t* recv_displs, const void* in,
                          const int64_t* send_counts, const int64_t* send_displs, DType t, BackendComm& c,
                          const CallInfo& call);
void backend_broadcast(void* buf, int64_t n, DType t, int root, BackendComm& c, const CallInfo& call);
void backend_barrier(BackendComm& c, const CallInfo& call);

// ---- Nonblocking point-to-point: what async.cpp builds comm.h's transfers and nonblocking ops on ----
struct BackendRequest;  // one posted transfer; defined by the backend
// Posts a send or a receive of n elements to/from group index `peer`, matched by `tag` (0 <= tag <
// backend_tag_limit()), in posting order among equal (peer, tag). A synchronous send completes only once the
// receiver has matched it; a plain one may complete as soon as it is buffered. The buffer stays untouched and
// alive until backend_test says complete. Messages of any length (the backend splits what its counts cannot hold).
std::shared_ptr<BackendRequest> backend_isend(const void* buf, int64_t n, DType t, int peer, int tag, bool synchronous,
                                              BackendComm& c, const CallInfo& call);
std::shared_ptr<BackendRequest> backend_irecv(void* buf, int64_t n, DType t, int peer, int tag, BackendComm& c,
                                              const CallInfo& call);
// True once complete. Error on a backend failure, or when a receive got a different element count than posted.
bool backend_test(BackendRequest& r, const CallInfo& call);
int backend_tag_limit();  // tags in [0, limit) are valid (at least 32768)
// Defined in async.cpp: advances every pending nonblocking op one step (tests its transfers, posts its next
// phase, finishes its reduction); false when none is pending. Backends call it while they poll a blocking
// collective, so a rank inside a collective still serves the nonblocking ops its peers wait for.
bool progress_async();
// Serializes every MPI call and every touch of the nonblocking engine's state between the thread that called
// comm_init and the progress thread (MPI_THREAD_SERIALIZED). Recursive: comm calls nest. Never destroyed.
std::recursive_mutex& comm_mutex();
// comm_mutex() for a comm call of the calling thread: the progress thread gives way to it between two operations.
std::unique_lock<std::recursive_mutex> lock_for_call();
// The progress thread (async.cpp): while nonblocking operations are pending and the calling thread is outside comm
// calls (computing), it advances them every kProgressIntervalUs, so their transfers and rank-order sums overlap the
// computation instead of waiting for the next comm call. Started by the MPI backend when MPI grants
// MPI_THREAD_SERIALIZED, the world has more than one rank and comm_options().progress_thread
// (MOECORE_COMM_PROGRESS_THREAD not 0); stopped before MPI_Finalize. Results do not depend on it (the same transfers
// and sums, only earlier).
void start_progress_thread();
void stop_progress_thread();
bool progress_thread_running();
[[noreturn]] void backend_abort(int code);
// Waits up to wait_s for every world rank to call this too (a barrier on a communicator of its own, never used by
// collectives); true when all arrived. Ranks whose collective failed never call it: they abort at once.
bool backend_all_failed_together(double wait_s);
// Records a collective's description for fatal-signal and error-exit messages (async-signal-safe to read).
void note_call(const CallInfo& call);
void mark_broken();  // a collective failed: peers may be stuck in it

// Shared by every copy of a ProcessGroup (comm.cpp and collectives.cpp; backends never see it).
struct GroupState {
  std::shared_ptr<BackendComm> comm;     // null for size-1 groups: their collectives are plain copies
  uint64_t seq = 0;                      // collectives issued on this communicator (debug mode compares it)
  std::string broken;                    // non-empty once a timeout or backend error left peers stuck
  std::vector<std::byte> scratch;        // grow-only workspace of the deterministic reductions
  std::vector<int64_t> counts;           // grow-only workspace for counts and displacements
  std::vector<uint64_t> sent, received;  // point-to-point messages posted to / from each group index so far
  std::shared_ptr<void> mailbox;         // async.cpp's unmatched transfers of a size-1 group to itself
};

}  // namespace moecore::detail
