// The communication face: process groups, deterministic collectives, point-to-point transfers and the
// nonblocking forms of both (CommHandle), on host memory.
// Backends sit behind it (parallel/mpi/ today, parallel/nccl/ later, parallel/local/ for size-1 builds);
// nothing above parallel/ sees MPI. This header does not build the training layout (process_groups.h does).
// The tensor forms take host tensors and the simulated device's (Device::sim, host memory that only ops and
// collectives address); CUDA tensors need the NCCL backend, which is not built yet.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moecore/core/dtype.h"
#include "moecore/core/tensor.h"

namespace moecore {

// Start-up options; every rank must use the same values.
struct CommOptions {
  bool debug = false;           // MOECORE_COMM_DEBUG=1: before each collective the ranks check they call the
                                // same op with matching dtype and sizes, and throw naming both sides if not
  double timeout_s = 600.0;     // MOECORE_COMM_TIMEOUT_S: seconds a collective waits for its peers (e.g. 600);
                                // 0 waits forever
  bool progress_thread = true;  // MOECORE_COMM_PROGRESS_THREAD=0: no MPI progress thread (see below)
};

// The largest MOECORE_COMM_TIMEOUT_S: --distributed-timeout-minutes' largest value, 10^6 minutes.
inline constexpr double kCommTimeoutMaxS = 6e7;
// Defaults overridden by the environment (core/env.h's rules): MOECORE_COMM_DEBUG and MOECORE_COMM_PROGRESS_THREAD
// are switches, MOECORE_COMM_TIMEOUT_S seconds in [0, kCommTimeoutMaxS] (0: wait forever). A bad value (a negative
// timeout, NaN, junk, "maybe") raises an Error naming the variable and what it accepts.
CommOptions comm_options_from_env();
// MOECORE_COMM_TIMEOUT_S when set (checked as above): it overrides --distributed-timeout-minutes.
std::optional<double> comm_timeout_from_env();
// Starts the world (MPI_Init_thread with MPI_THREAD_FUNNELED under MPI; nothing for the local backend).
// Idempotent; if MPI was already initialized by the caller, comm_finalize() leaves it running.
void comm_init(int& argc, char**& argv);
void comm_init(int& argc, char**& argv, const CommOptions& options);
void comm_finalize();
bool comm_initialized();
bool comm_available();            // true when a multi-process backend (MPI) is built in
const char* comm_backend_name();  // "mpi" or "local"
const CommOptions& comm_options();
void comm_set_options(const CommOptions& options);  // collective in spirit: all ranks set the same values
// Ends every rank of the job. The way out after a timeout: peers are stuck inside the collective.
[[noreturn]] void comm_abort(int code);

// ---- Job-wide safety ----------------------------------------------------------------------------------------
// The way out of a rank that failed (its error already printed). When every rank of the world reaches this
// within `wait_s` seconds (they all failed, e.g. the same bad flag) and no collective was left hanging, the
// ranks finalize together and this returns `code`; otherwise this rank ends the whole job with
// MPI_Abort(code) after printing which rank gave up, so no peer ever waits forever in a collective.
// Not initialized, the local backend, or a world of one: returns `code` at once.
int comm_error_exit(int code, double wait_s = 10.0);
// What this process is doing ("iteration 12"), named by timeouts, comm_error_exit and fatal signals.
void comm_set_phase(const std::string& phase);
std::string comm_phase();

namespace detail {
struct GroupState;  // communicator handle, call counter and workspace; defined in comm.cpp
class AsyncOp;      // one nonblocking operation in flight; defined in async.cpp
}  // namespace detail

// A set of ranks that communicate together. Copies share one communicator. Collectives are called by
// every member, in the same order, from the thread that called comm_init (not thread-safe).
class ProcessGroup {
 public:
  ProcessGroup() = default;
  const std::string& name() const { return name_; }         // "dp", "ep", ... (used in errors)
  const std::vector<int>& ranks() const { return ranks_; }  // world ranks, in group order
  int rank() const { return rank_; }                        // this process's index in ranks()
  int size() const { return static_cast<int>(ranks_.size()); }
  int world_rank() const { return ranks_.empty() ? -1 : ranks_[rank_]; }
  bool valid() const { return state_ != nullptr; }
  // The same communicator under another name (one communicator can serve several identical groups).
  ProcessGroup renamed(std::string name) const;

  // Internal: used by parallel/*.cpp only.
  ProcessGroup(std::string name, std::vector<int> ranks, int rank, std::shared_ptr<detail::GroupState> state);
  detail::GroupState& state() const;

 private:
  std::string name_;
  std::vector<int> ranks_;
  int rank_ = 0;
  std::shared_ptr<detail::GroupState> state_;
};

ProcessGroup comm_world();  // every rank; under MPI it needs comm_init first
// A size-1 group of this process alone; it never touches a backend (unit tests, single-rank runs).
ProcessGroup comm_single(std::string name = "single");
// Collective over `parent`: `partition` lists groups of world ranks (every rank of parent in exactly one
// group, identical on every rank); returns the group holding this rank, ranks in the listed order.
ProcessGroup group_split(const ProcessGroup& parent, std::string name, const std::vector<std::vector<int>>& partition);

// ---------------------------------------------------------------------------------------------------
// Collectives. P = group size, r = this rank's index. Blocks are laid out in rank order.
// Reductions are deterministic: the result is ((x_0 + x_1) + x_2) + ... in group-rank order, computed in
// the element type, bitwise identical on every rank and across runs regardless of timing (MPI's own
// reductions may reorder floating-point sums, so none is used). Reductions take f32, f64, i64 and bf16 (each
// addition computed in f32 and rounded to bf16, as NCCL's reductions of bf16 buffers);
// data movement takes any fixed-size element type. Size-1 groups are identities (plain copies).
// On a size mismatch, a timeout or a backend error the call throws moecore::Error naming the op, the
// group and the rank. After a timeout the group is unusable and peers are stuck: end with comm_abort().
// Input and output buffers must not overlap.
//
//   all_reduce_sum      buf[n] (in place)               buf = Σ_r buf_r
//   all_gather          out[P·n] <- in[n]               out[r·n : (r+1)·n] = in_r
//   all_gather_v        out[Σc] <- in[c_r], counts c[P] blocks of c_r elements, in rank order
//   reduce_scatter_sum  out[n] <- in[P·n]               out_r = Σ_q in_q[r·n : (r+1)·n]
//   reduce_scatter_v_sum out[c_r] <- in[Σc], counts c[P] out_r = Σ_q (block r of in_q), blocks of c_r elements
//   all_to_all_v        out[Σ recv] <- in[Σ send]       block j of in goes to rank j; block j of out came
//                                                       from rank j; send_counts[j] on rank i must equal
//                                                       recv_counts[i] on rank j (zeros allowed)
//   broadcast           buf[n] (in place)               buf = buf_root (root is a group index)
//   barrier             returns once every member has entered it
// ---------------------------------------------------------------------------------------------------
namespace detail {
void all_reduce_sum_raw(void* buf, int64_t n, DType t, const ProcessGroup& g);
void all_gather_raw(void* out, int64_t out_n, const void* in, int64_t in_n, DType t, const ProcessGroup& g);
void all_gather_v_raw(void* out, int64_t out_n, const void* in, int64_t in_n, std::span<const int64_t> counts, DType t,
                      const ProcessGroup& g);
void reduce_scatter_sum_raw(void* out, int64_t out_n, const void* in, int64_t in_n, DType t, const ProcessGroup& g);
void reduce_scatter_v_sum_raw(void* out, int64_t out_n, const void* in, int64_t in_n, std::span<const int64_t> counts,
                              DType t, const ProcessGroup& g);
void all_to_all_v_raw(void* out, int64_t out_n, std::span<const int64_t> recv_counts, const void* in, int64_t in_n,
                      std::span<const int64_t> send_counts, DType t, const ProcessGroup& g);
void broadcast_raw(void* buf, int64_t n, DType t, int root, const ProcessGroup& g);
void send_raw(const void* buf, int64_t n, DType t, int dst, const ProcessGroup& g);
void recv_raw(void* buf, int64_t n, DType t, int src, const ProcessGroup& g);
template <class S>
int64_t ssize(const S& s) {
  return static_cast<int64_t>(s.size());
}
}  // namespace detail

#define MOECORE_COMM_REDUCE_OVERLOADS(T)                                                                            \
  inline void all_reduce_sum(std::span<T> buf, const ProcessGroup& g) {                                             \
    detail::all_reduce_sum_raw(buf.data(), detail::ssize(buf), dtype_of<T>(), g);                                   \
  }                                                                                                                 \
  inline void reduce_scatter_sum(std::span<T> out, std::span<const T> in, const ProcessGroup& g) {                  \
    detail::reduce_scatter_sum_raw(out.data(), detail::ssize(out), in.data(), detail::ssize(in), dtype_of<T>(), g); \
  }                                                                                                                 \
  inline void reduce_scatter_v_sum(std::span<T> out, std::span<const T> in, std::span<const int64_t> counts,        \
                                   const ProcessGroup& g) {                                                         \
    detail::reduce_scatter_v_sum_raw(out.data(), detail::ssize(out), in.data(), detail::ssize(in), counts,          \
                                     dtype_of<T>(), g);                                                             \
  }
#define MOECORE_COMM_MOVE_OVERLOADS(T)                                                                                \
  inline void all_gather(std::span<T> out, std::span<const T> in, const ProcessGroup& g) {                            \
    detail::all_gather_raw(out.data(), detail::ssize(out), in.data(), detail::ssize(in), dtype_of<T>(), g);           \
  }                                                                                                                   \
  inline void all_gather_v(std::span<T> out, std::span<const T> in, std::span<const int64_t> counts,                  \
                           const ProcessGroup& g) {                                                                   \
    detail::all_gather_v_raw(out.data(), detail::ssize(out), in.data(), detail::ssize(in), counts, dtype_of<T>(), g); \
  }                                                                                                                   \
  inline void all_to_all_v(std::span<T> out, std::span<const int64_t> recv_counts, std::span<const T> in,             \
                           std::span<const int64_t> send_counts, const ProcessGroup& g) {                             \
    detail::all_to_all_v_raw(out.data(), detail::ssize(out), recv_counts, in.data(), detail::ssize(in), send_counts,  \
                             dtype_of<T>(), g);                                                                       \
  }                                                                                                                   \
  inline void broadcast(std::span<T> buf, int root, const ProcessGroup& g) {                                          \
    detail::broadcast_raw(buf.data(), detail::ssize(buf), dtype_of<T>(), root, g);                                    \
  }                                                                                                                   \
  inline void send(std::span<const T> buf, int dst, const ProcessGroup& g) {                                          \
    detail::send_raw(buf.data(), detail::ssize(buf), dtype_of<T>(), dst, g);                                          \
  }                                                                                                                   \
  inline void recv(std::span<T> buf, int src, const ProcessGroup& g) {                                                \
    detail::recv_raw(buf.data(), detail::ssize(buf), dtype_of<T>(), src, g);                                          \
  }

MOECORE_COMM_REDUCE_OVERLOADS(float)
MOECORE_COMM_REDUCE_OVERLOADS(double)
MOECORE_COMM_REDUCE_OVERLOADS(int64_t)
MOECORE_COMM_REDUCE_OVERLOADS(bf16)
MOECORE_COMM_MOVE_OVERLOADS(float)
MOECORE_COMM_MOVE_OVERLOADS(double)
MOECORE_COMM_MOVE_OVERLOADS(int64_t)
MOECORE_COMM_MOVE_OVERLOADS(int32_t)
MOECORE_COMM_MOVE_OVERLOADS(bf16)
MOECORE_COMM_MOVE_OVERLOADS(f16)
#undef MOECORE_COMM_REDUCE_OVERLOADS
#undef MOECORE_COMM_MOVE_OVERLOADS

void barrier(const ProcessGroup& g);

// Seconds this process has spent inside communication since it started: blocking collectives, point-to-point
// calls, and the posting, test() and wait() of nonblocking ones (wall-clock; a call built on others counts once).
// The growth over a training step is the step's exposed communication: the time computation waited for peers.
double comm_blocked_seconds();

// Whether the MPI backend's progress thread runs (world > 1, MPI_THREAD_SERIALIZED granted, and
// MOECORE_COMM_PROGRESS_THREAD not 0): it advances pending nonblocking operations every 100 us while the calling
// thread is outside comm calls, so --overlap-grad-reduce and --overlap-param-gather overlap for real.
bool comm_progress_thread_running();

// Every rank of `g` must run the same configuration: checks that all members passed equal `fields` (name,
// value; e.g. every flag with its effective value) by exchanging a hash, and on a mismatch the differing
// fields' values, then throws on every rank naming each differing field and its value on each rank.
// Collective; call it before any other collective of the job, so a disagreement can never reach a dispatcher.
void check_same_config(const std::vector<std::pair<std::string, std::string>>& fields, const ProcessGroup& g);

// Tensor forms: contiguous host or sim tensors; `*_v` counts are rows of dim 0 (a row = the trailing dims).
// Reductions need f32/f64/i64. The tensors are handles: outputs are written through them.
void all_reduce_sum(const Tensor& buf, const ProcessGroup& g);  // in place, any shape
void all_gather(const Tensor& out, const Tensor& in,
                const ProcessGroup& g);  // out [P·n0, ...] <- in [n0, ...]
void all_gather_v(const Tensor& out, const Tensor& in, std::span<const int64_t> rows, const ProcessGroup& g);
void reduce_scatter_sum(const Tensor& out, const Tensor& in,
                        const ProcessGroup& g);  // out [n0, ...] <- in [P·n0, ...]
// out [rows[r], ...] <- in [Σ rows, ...]: block r of every rank's input, summed in rank order.
void reduce_scatter_v_sum(const Tensor& out, const Tensor& in, std::span<const int64_t> rows, const ProcessGroup& g);
void all_to_all_v(const Tensor& out, std::span<const int64_t> recv_rows, const Tensor& in,
                  std::span<const int64_t> send_rows, const ProcessGroup& g);  // [Σ rows, ...] both sides
void broadcast(const Tensor& buf, int root, const ProcessGroup& g);

// ---------------------------------------------------------------------------------------------------
// Along a non-leading dim (sequence- and tensor-parallel regions). Contiguous host or sim tensors of equal
// rank and dtype; `dim` may count from the end; every dim but `dim` equal. Deterministic as above.
//
//   all_gather_into      out [.., P·m, ..] <- in [.., m, ..]    out[.., r·m : (r+1)·m, ..] = in_r
//   reduce_scatter_from  out [.., m, ..] <- in [.., P·m, ..]    out_r = Σ_q in_q[.., r·m : (r+1)·m, ..]
//                        (f32/f64/i64)
// dim 0 moves the data directly; other dims go through a contiguous staging buffer of the group.
// ---------------------------------------------------------------------------------------------------
void all_gather_into(const Tensor& out, const Tensor& in, int dim, const ProcessGroup& g);
void reduce_scatter_from(const Tensor& out, const Tensor& in, int dim, const ProcessGroup& g);

// ---------------------------------------------------------------------------------------------------
// Point-to-point and nonblocking operations. `peer`, `dst` and `src` are group indices. Tensors are contiguous
// host or sim tensors of any fixed-size dtype; spans are the same for the blocking forms.
//
//   send             returns once the receiver has matched the message (a synchronous send: a blocking
//                    send/recv pair in the wrong order always deadlocks — here: times out — whatever the size,
//                    never only for large messages; exchanges with both neighbours use batch_send_recv)
//   recv             returns once the message is in the tensor
//   batch_send_recv  posts every send and recv of `ops` at once, then completes them all (Megatron's
//                    batch_isend_irecv): any order of the ops on either side is deadlock-free
//   isend / irecv    the nonblocking send and recv
// The k-th message from rank i to rank j on a group is received by rank j's k-th recv from rank i, whatever
// other traffic runs (each message carries its own tag). The element count and dtype must agree on both
// sides: a receive of a different count throws on the receiving rank; MOECORE_COMM_DEBUG=1 compares both
// sides' count and dtype before any data moves and throws on both ranks naming each side, the group still
// usable. Point-to-point calls are not collective: the other ranks of the group take no part.
//
//   all_reduce_sum_async      the nonblocking all_reduce_sum (in place)
//   all_gather_async          the nonblocking all_gather (dim 0)
//   reduce_scatter_sum_async  the nonblocking reduce_scatter_sum (dim 0)
// Collective and called in the same order as the blocking collectives on every rank; their results are
// bitwise identical to the blocking forms' (the same rank-order sums, computed here on top of point-to-point
// transfers, never by MPI's reductions). Under MOECORE_COMM_DEBUG=1 the ranks compare the call when it is
// posted (a blocking check, as for the blocking forms).
//
// Each returns a CommHandle. Its buffers must not be read or written until wait(); the handle keeps the
// tensors alive until then. Progress happens inside comm calls (wait, test and any blocking collective's polling
// advance every pending operation, so handles may be waited for in any order, on any rank) and, under MPI, on the
// progress thread while the caller is outside them (comm_progress_thread_running). wait() waits at most the timeout in
// force when the operation was posted, counted from the wait; a timeout throws naming the op, the group, the rank and
// comm_phase(), and leaves the group unusable, as for the blocking forms. Destroying (or assigning over) a handle that
// was never waited for is a bug: it prints an error naming the op and makes the group unusable (every later call on it
// throws saying so); the operation still progresses and its buffers stay allocated until it completes (for good if it
// never does). On a size-1 group every operation is a copy, complete when posted, except a send to itself whose recv is
// not posted yet: waiting for that one throws at once. Only the thread that called comm_init may call these or a
// handle's wait/test.
// ---------------------------------------------------------------------------------------------------
class CommHandle {
 public:
  CommHandle() = default;
  explicit CommHandle(std::shared_ptr<detail::AsyncOp> op) : op_(std::move(op)) {}
  CommHandle(CommHandle&& o) noexcept : op_(std::move(o.op_)) {}
  CommHandle& operator=(CommHandle&& o) noexcept;  // reports this handle first if it was never waited for
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle();
  // Blocks until the operation completes (its outputs are then written); throws what the blocking form would.
  // A no-op on an empty handle (default-constructed, moved from, or already waited for).
  void wait();
  // One round of progress without blocking; true once complete, which counts as wait() (errors throw here).
  bool test();
  // True once the operation has completed, without advancing it: under MPI the progress thread completes operations
  // while the caller computes (comm_progress_thread_running). wait() is still required.
  bool completed() const;
  bool pending() const { return op_ != nullptr; }

 private:
  std::shared_ptr<detail::AsyncOp> op_;
};

enum class P2PKind : uint8_t { send, recv };
struct P2POp {  // one transfer of a batch_send_recv: e.g. {P2PKind::send, activations, next_stage}
  P2PKind kind = P2PKind::send;
  Tensor tensor;  // contiguous; read by a send, written by a recv
  int peer = 0;   // group index of the destination (send) or the source (recv)
};

void send(const Tensor& t, int dst, const ProcessGroup& g);
void recv(const Tensor& t, int src, const ProcessGroup& g);
void batch_send_recv(std::span<const P2POp> ops, const ProcessGroup& g);
CommHandle batch_send_recv_async(std::span<const P2POp> ops, const ProcessGroup& g);
CommHandle isend(const Tensor& t, int dst, const ProcessGroup& g);
CommHandle irecv(const Tensor& t, int src, const ProcessGroup& g);
CommHandle all_reduce_sum_async(const Tensor& buf, const ProcessGroup& g);                // in place, any shape
CommHandle all_gather_async(const Tensor& out, const Tensor& in, const ProcessGroup& g);  // as all_gather
CommHandle reduce_scatter_sum_async(const Tensor& out, const Tensor& in,
                                    const ProcessGroup& g);  // as reduce_scatter_sum

}  // namespace moecore
