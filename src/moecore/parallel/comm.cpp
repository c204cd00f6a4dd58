// comm.h, part 1: options, world start-up, process-group construction and splitting, the Tensor forms of
// the collectives, and the shared error wording. The collectives themselves live in collectives.cpp;
// nothing here knows which backend is linked.
#include "moecore/parallel/comm.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "moecore/core/env.h"
#include "moecore/core/error.h"
#include "moecore/parallel/call.h"

namespace moecore {
namespace detail {

void debug_check_split(const ProcessGroup& parent, GroupState& st, const CallInfo& call,
                       const std::vector<std::vector<int>>& partition);  // collectives.cpp

[[noreturn]] void throw_timeout(const CallInfo& call) {
  const std::string phase = comm_phase();
  MOECORE_FAIL("comm: ", call.op, " on group ", call.group, " timed out after ", call.timeout_s, " s on rank ",
               call.rank, " (world rank ", call.world_rank, "): call #", call.seq, " on this group",
               phase.empty() ? "" : ", " + phase,
               "; a peer never reached it (a rank skipped or reordered a collective, or is stuck "
               "or dead). The group is unusable now: end the job with comm_abort(). MOECORE_COMM_DEBUG=1 checks "
               "that ranks call matching collectives; MOECORE_COMM_TIMEOUT_S sets the limit.");
}

[[noreturn]] void throw_backend_error(const CallInfo& call, const std::string& what) {
  MOECORE_FAIL("comm: ", call.op, " on group ", call.group, " on rank ", call.rank, " (world rank ", call.world_rank,
               "), call #", call.seq, ": ", what, " (if ranks may disagree on sizes, rerun with MOECORE_COMM_DEBUG=1)");
}

// ---- What this rank is doing: fixed buffers, so a signal handler can read them ----
namespace {
char g_last_call[160];
char g_phase[96];
std::atomic<bool> g_broken{false};
int g_world_rank = -1, g_world_size = 0;
char g_rank_text[48];  // "R of N", formatted at comm_init: the signal handler only writes it

void copy_text(char* dst, size_t cap, const std::string& s) {
  const size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}
}  // namespace

void note_call(const CallInfo& call) {
  std::snprintf(g_last_call, sizeof g_last_call, "%.*s on group %s, call #%llu", static_cast<int>(call.op.size()),
                call.op.data(), call.group.c_str(), static_cast<unsigned long long>(call.seq));
}

void mark_broken() {
  g_broken = true;
}

void check_tensor(const Tensor& t, const char* op, const ProcessGroup& g, const char* which) {
  if (!t.defined()) MOECORE_FAIL("comm: ", op, " on group ", g.name(), ": the ", which, " tensor is undefined");
  // A one-rank group moves nothing between processes: its copies (out := in) go through local_copy, which addresses
  // device memory too. Between processes the host backends move host memory only.
  if (t.device() == Device::cuda && g.size() > 1)
    MOECORE_FAIL("comm: ", op, " on group ", g.name(), " (size ", g.size(), "): the ", which, " tensor ", t.str(),
                 " lives on the GPU; the ", comm_backend_name(),
                 " backend moves host memory only (device tensors need the NCCL backend, not built yet)");
  if (!t.is_contiguous())
    MOECORE_FAIL("comm: ", op, " on group ", g.name(), ": the ", which, " tensor ", t.str(),
                 " is not contiguous; pass a contiguous tensor (e.g. clone())");
}

void check_same_dtype(const Tensor& out, const Tensor& in, const char* op, const ProcessGroup& g) {
  if (out.dtype() != in.dtype())
    MOECORE_FAIL("comm: ", op, " on group ", g.name(), ": output ", out.str(), " and input ", in.str(),
                 " differ in dtype");
}

}  // namespace detail

void comm_set_phase(const std::string& phase) {
  detail::copy_text(detail::g_phase, sizeof detail::g_phase, phase);
}
std::string comm_phase() {
  return detail::g_phase;
}
namespace {

using detail::check_same_dtype;
using detail::check_tensor;
using detail::GroupState;

// ---- Fatal signals of a multi-process job: say which rank died doing what, then die as the signal says ----
void write_err(const char* s) {
  ssize_t r = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)r;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
    default:
      return "a signal";
  }
}

extern "C" void on_fatal_signal(int sig) {
  write_err("moecore: rank ");
  write_err(detail::g_rank_text);
  write_err(": ");
  write_err(signal_name(sig));
  write_err(detail::g_last_call[0] ? " after entering " : " before any collective");
  write_err(detail::g_last_call);
  if (detail::g_phase[0]) {
    write_err(" (");
    write_err(detail::g_phase);
    write_err(")");
  }
  write_err(sig == SIGTERM || sig == SIGINT ? "; mpirun sends SIGTERM to every rank when one rank fails or dies\n"
                                            : "\n");
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install_fatal_signal_handlers() {
  std::vector<int> sigs = {SIGTERM, SIGINT};
#if !defined(__SANITIZE_ADDRESS__) && !defined(__has_feature)
  sigs.insert(sigs.end(), {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT});
#elif defined(__has_feature)
#if !__has_feature(address_sanitizer)
  sigs.insert(sigs.end(), {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT});  // the sanitizers report these themselves
#endif
#endif
  for (const int sig : sigs) {
    struct sigaction old = {};
    sigaction(sig, nullptr, &old);
    if (old.sa_handler != SIG_DFL) continue;  // someone else (a debugger, a sanitizer) handles it
    struct sigaction sa = {};
    sa.sa_handler = on_fatal_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(sig, &sa, nullptr);
  }
}

// Read from the environment on first use unless comm_init or comm_set_options set them first.
std::optional<CommOptions>& options_slot() {
  static std::optional<CommOptions> options;
  return options;
}

std::shared_ptr<GroupState>& world_state() {
  static std::shared_ptr<GroupState> state;
  return state;
}

int64_t row_elems(const Tensor& t, const char* op, const ProcessGroup& g) {
  if (t.dim() == 0)
    MOECORE_FAIL("comm: ", op, " on group ", g.name(), ": counts are rows of dim 0 but the tensor is a scalar");
  int64_t e = 1;
  for (int i = 1; i < t.dim(); ++i) e *= t.size(i);
  return e;
}

std::vector<int64_t> rows_to_elems(std::span<const int64_t> rows, int64_t row) {
  std::vector<int64_t> out(rows.begin(), rows.end());
  for (int64_t& v : out) v *= row;
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Options and world
// ---------------------------------------------------------------------------------------------------

std::optional<double> comm_timeout_from_env() {
  return env_number("MOECORE_COMM_TIMEOUT_S", 0, kCommTimeoutMaxS,
                    "seconds a collective waits for its peers, e.g. 600; 0 waits forever");
}

CommOptions comm_options_from_env() {
  CommOptions o;
  o.debug = env_switch("MOECORE_COMM_DEBUG", false, "the ranks check that they call matching collectives");
  if (const auto t = comm_timeout_from_env()) o.timeout_s = *t;
  o.progress_thread =
      env_switch("MOECORE_COMM_PROGRESS_THREAD", true, "a thread advances nonblocking transfers; 0 turns it off");
  return o;
}

void comm_init(int& argc, char**& argv) {
  comm_init(argc, argv, comm_options_from_env());
}

void comm_init(int& argc, char**& argv, const CommOptions& options) {
  options_slot() = options;  // before the backend starts: it reads progress_thread
  detail::backend_init(argc, argv);
  detail::g_world_rank = detail::backend_world_rank();
  detail::g_world_size = detail::backend_world_size();
  std::snprintf(detail::g_rank_text, sizeof detail::g_rank_text, "%d of %d", detail::g_world_rank,
                detail::g_world_size);
  if (detail::g_world_size > 1) install_fatal_signal_handlers();
}

void comm_finalize() {
  world_state().reset();
  detail::backend_finalize();
}

bool comm_initialized() {
  return detail::backend_initialized();
}
bool comm_available() {
  return detail::backend_multi_process();
}
const char* comm_backend_name() {
  return detail::backend_name();
}
const CommOptions& comm_options() {
  auto& slot = options_slot();
  if (!slot) slot = comm_options_from_env();
  return *slot;
}
void comm_set_options(const CommOptions& options) {
  options_slot() = options;
}
void comm_abort(int code) {
  detail::backend_abort(code);
}

int comm_error_exit(int code, double wait_s) {
  if (!comm_initialized() || detail::backend_world_size() == 1) return code;
  const bool broken = detail::g_broken;
  const double wait = comm_options().timeout_s > 0 ? std::min(wait_s, comm_options().timeout_s) : wait_s;
  if (!broken && detail::backend_all_failed_together(wait)) return code;
  std::fprintf(stderr, "moecore: rank %d of %d ends the job (MPI_Abort, exit code %d): %s; last collective: %s%s%s\n",
               detail::g_world_rank, detail::g_world_size, code,
               broken ? "a collective failed, so peers may be stuck in it"
                      : "the other ranks did not fail with it, so they would wait for it forever",
               detail::g_last_call[0] ? detail::g_last_call : "none", detail::g_phase[0] ? "; " : "", detail::g_phase);
  comm_abort(code);
}

// ---------------------------------------------------------------------------------------------------
// Process groups
// ---------------------------------------------------------------------------------------------------

ProcessGroup::ProcessGroup(std::string name, std::vector<int> ranks, int rank, std::shared_ptr<GroupState> state)
    : name_(std::move(name)), ranks_(std::move(ranks)), rank_(rank), state_(std::move(state)) {
  MOECORE_CHECK(rank_ >= 0 && rank_ < static_cast<int>(ranks_.size()), "group ", name_, ": index ", rank_, " outside ",
                ranks_.size(), " ranks");
}

GroupState& ProcessGroup::state() const {
  MOECORE_CHECK(state_ != nullptr, "use of a default-constructed ProcessGroup");
  return *state_;
}

ProcessGroup ProcessGroup::renamed(std::string name) const {
  ProcessGroup g = *this;
  g.name_ = std::move(name);
  return g;
}

ProcessGroup comm_world() {
  if (!detail::backend_initialized())
    MOECORE_FAIL("comm: comm_world() called before comm_init(argc, argv) (backend ", comm_backend_name(),
                 "); call comm_init first, or use comm_single() for a one-process group");
  auto& st = world_state();
  if (!st) {
    st = std::make_shared<GroupState>();
    st->comm = detail::backend_world();
  }
  const int n = detail::backend_world_size();
  std::vector<int> ranks(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ranks[static_cast<size_t>(i)] = i;
  return ProcessGroup("world", std::move(ranks), detail::backend_world_rank(), st);
}

ProcessGroup comm_single(std::string name) {
  const int me = detail::backend_initialized() ? detail::backend_world_rank() : 0;
  return ProcessGroup(std::move(name), {me}, 0, std::make_shared<GroupState>());
}

ProcessGroup group_split(const ProcessGroup& parent, std::string name, const std::vector<std::vector<int>>& partition) {
  if (!parent.valid())
    MOECORE_FAIL("comm: group_split(", name, ") of a default-constructed ProcessGroup; split comm_world()");
  GroupState& pst = parent.state();
  if (!pst.broken.empty())
    MOECORE_FAIL("comm: group_split(", name, ") of group ", parent.name(),
                 ", which is unusable after an earlier failure (", pst.broken, ")");
  // Every rank of the parent in exactly one group, and nothing else: identical checks on every rank.
  std::vector<int> seen(parent.ranks());
  std::sort(seen.begin(), seen.end());
  std::vector<int> count(seen.size(), 0);
  int color = -1, key = -1;
  bool all_single = true;
  for (size_t gi = 0; gi < partition.size(); ++gi) {
    if (partition[gi].empty()) MOECORE_FAIL("comm: group_split(", name, "): group ", gi, " of the partition is empty");
    all_single = all_single && partition[gi].size() == 1;
    for (size_t k = 0; k < partition[gi].size(); ++k) {
      const int r = partition[gi][k];
      auto it = std::lower_bound(seen.begin(), seen.end(), r);
      if (it == seen.end() || *it != r)
        MOECORE_FAIL("comm: group_split(", name, "): world rank ", r, " in group ", gi, " is not a member of group ",
                     parent.name(), " (size ", parent.size(), ")");
      if (++count[static_cast<size_t>(it - seen.begin())] > 1)
        MOECORE_FAIL("comm: group_split(", name, "): world rank ", r, " appears in more than one group");
      if (r == parent.world_rank()) {
        color = static_cast<int>(gi);
        key = static_cast<int>(k);
      }
    }
  }
  for (size_t i = 0; i < seen.size(); ++i)
    if (count[i] == 0)
      MOECORE_FAIL("comm: group_split(", name, "): world rank ", seen[i], " of group ", parent.name(),
                   " is in no group of the partition");
  const std::vector<int>& mine = partition[static_cast<size_t>(color)];
  auto st = std::make_shared<GroupState>();
  if (parent.size() > 1 && !all_single) {
    const detail::BlockedScope blocked;
    ++pst.seq;
    const std::string op = "group_split(" + name + ")";
    const detail::CallInfo call{op,      parent.name(),           parent.rank(), parent.world_rank(),
                                pst.seq, comm_options().timeout_s};
    detail::note_call(call);
    detail::debug_check_split(parent, pst, call, partition);
    try {
      auto comm = detail::backend_split(*pst.comm, color, key, call);
      if (mine.size() > 1) st->comm = std::move(comm);
    } catch (const Error& e) {
      pst.broken = e.what();
      detail::mark_broken();
      throw;
    }
  }
  return ProcessGroup(std::move(name), mine, key, std::move(st));
}

// ---------------------------------------------------------------------------------------------------
// Tensor forms. Host tensors and the simulated device's (whose memory is the host's) take the same path.
// ---------------------------------------------------------------------------------------------------

void all_reduce_sum(const Tensor& buf, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  check_tensor(buf, "all_reduce_sum", g, "buffer");
  detail::all_reduce_sum_raw(buf.raw(), buf.numel(), buf.dtype(), g);
}

void all_gather(const Tensor& out, const Tensor& in, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  check_tensor(out, "all_gather", g, "output");
  check_tensor(in, "all_gather", g, "input");
  check_same_dtype(out, in, "all_gather", g);
  detail::all_gather_raw(out.raw(), out.numel(), in.raw(), in.numel(), in.dtype(), g);
}

void all_gather_v(const Tensor& out, const Tensor& in, std::span<const int64_t> rows, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  check_tensor(out, "all_gather_v", g, "output");
  check_tensor(in, "all_gather_v", g, "input");
  check_same_dtype(out, in, "all_gather_v", g);
  const int64_t row = row_elems(in, "all_gather_v", g);
  if (row_elems(out, "all_gather_v", g) != row)
    MOECORE_FAIL("comm: all_gather_v on group ", g.name(), ": output ", out.str(), " and input ", in.str(),
                 " differ in their trailing dims");
  const auto counts = rows_to_elems(rows, row);
  detail::all_gather_v_raw(out.raw(), out.numel(), in.raw(), in.numel(), counts, in.dtype(), g);
}

void reduce_scatter_sum(const Tensor& out, const Tensor& in, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  check_tensor(out, "reduce_scatter_sum", g, "output");
  check_tensor(in, "reduce_scatter_sum", g, "input");
  check_same_dtype(out, in, "reduce_scatter_sum", g);
  detail::reduce_scatter_sum_raw(out.raw(), out.numel(), in.raw(), in.numel(), in.dtype(), g);
}

void reduce_scatter_v_sum(const Tensor& out, const Tensor& in, std::span<const int64_t> rows, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  check_tensor(out, "reduce_scatter_v_sum", g, "output");
  check_tensor(in, "reduce_scatter_v_sum", g, "input");
  check_same_dtype(out, in, "reduce_scatter_v_sum", g);
  const int64_t row = row_elems(in, "reduce_scatter_v_sum", g);
  if (row_elems(out, "reduce_scatter_v_sum", g) != row)
    MOECORE_FAIL("comm: reduce_scatter_v_sum on group ", g.name(), ": output ", out.str(), " and input ", in.str(),
                 " differ in their trailing dims");
  const auto counts = rows_to_elems(rows, row);
  detail::reduce_scatter_v_sum_raw(out.raw(), out.numel(), in.raw(), in.numel(), counts, in.dtype(), g);
}

void all_to_all_v(const Tensor& out, std::span<const int64_t> recv_rows, const Tensor& in,
                  std::span<const int64_t> send_rows, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  check_tensor(out, "all_to_all_v", g, "output");
  check_tensor(in, "all_to_all_v", g, "input");
  check_same_dtype(out, in, "all_to_all_v", g);
  const int64_t row = row_elems(in, "all_to_all_v", g);
  if (row_elems(out, "all_to_all_v", g) != row)
    MOECORE_FAIL("comm: all_to_all_v on group ", g.name(), ": output ", out.str(), " and input ", in.str(),
                 " differ in their trailing dims");
  const auto recv = rows_to_elems(recv_rows, row);
  const auto send = rows_to_elems(send_rows, row);
  detail::all_to_all_v_raw(out.raw(), out.numel(), recv, in.raw(), in.numel(), send, in.dtype(), g);
}

void broadcast(const Tensor& buf, int root, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  check_tensor(buf, "broadcast", g, "buffer");
  detail::broadcast_raw(buf.raw(), buf.numel(), buf.dtype(), root, g);
}

}  // namespace moecore
