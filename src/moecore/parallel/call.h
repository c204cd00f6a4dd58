// Internal to parallel/: one collective call on one group (the Call record with its error wording), the
// debug-mode op descriptions, the rank-ordered sum and the argument checks that collectives.cpp,
// dim_collectives.cpp and async.cpp share. Nothing outside parallel/*.cpp includes this.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/parallel/backend.h"
#include "moecore/parallel/comm.h"

namespace moecore::detail {

enum class OpId : int64_t {
  all_reduce_sum = 1,
  all_gather,
  all_gather_v,
  reduce_scatter_sum,
  all_to_all_v,
  broadcast,
  barrier,
  split,
  all_reduce_sum_async,
  all_gather_async,
  reduce_scatter_sum_async,
  all_gather_into,
  reduce_scatter_from,
  reduce_scatter_v_sum
};

// What a rank is about to do; debug mode all-gathers these and compares them field by field.
struct OpDesc {
  int64_t op = 0, dtype = 0, count = 0, extra = 0, hash = 0, seq = 0;
  bool operator==(const OpDesc&) const = default;
};
inline constexpr int kDescWords = 6;

std::string describe(const OpDesc& d);
// Order-sensitive hash of the words, kept non-negative.
int64_t hash_words(std::span<const int64_t> v);

// Wall-clock time the calling thread spends inside communication (comm_blocked_seconds): a scope opened inside
// another (a collective built on others, a wait inside a blocking form) is not counted twice. It also holds
// comm_mutex() for its lifetime: the progress thread runs only while the calling thread is outside comm calls.
class BlockedScope {
 public:
  BlockedScope();
  ~BlockedScope();
  BlockedScope(const BlockedScope&) = delete;
  BlockedScope& operator=(const BlockedScope&) = delete;

 private:
  int64_t start_ns_ = -1;                        // -1: nested, not counted
  std::unique_lock<std::recursive_mutex> lock_;  // taken after the clock starts: waiting for it is blocked time
};

// One collective in flight on one group: the call description and the group's shared state.
struct Call {
  BlockedScope blocked;  // first: the checks and the transfer count as communication time
  const ProcessGroup& g;
  GroupState& st;
  const char* op;
  CallInfo info;
  Call(const ProcessGroup& group, const char* op_name)
      : g(group), st(checked_state(group, op_name)), op(op_name), info{op,       g.name(),
                                                                       g.rank(), g.world_rank(),
                                                                       ++st.seq, comm_options().timeout_s} {
    note_call(info);
  }
  static GroupState& checked_state(const ProcessGroup& group, const char* op_name) {
    if (!group.valid())
      MOECORE_FAIL("comm: ", op_name,
                   " on a default-constructed ProcessGroup; pass a group from comm_world(), "
                   "group_split() or make_process_groups()");
    GroupState& st = group.state();
    if (!st.broken.empty())
      MOECORE_FAIL("comm: ", op_name, " on group ", group.name(), ": the group is unusable after an earlier failure (",
                   st.broken, "); end the job with comm_abort()");
    return st;
  }
  [[noreturn]] void fail(const std::string& what) const {
    MOECORE_FAIL("comm: ", op, " on group ", g.name(), " (size ", g.size(), ") on rank ", g.rank(), " (world rank ",
                 g.world_rank(), "): ", what);
  }
  // Backend failures leave peers mid-collective: the communicator cannot be trusted any more.
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      st.broken = e.what();
      mark_broken();
      // A request left pending may still read the counts or write the workspace: keep both alive for good.
      new Abandoned{std::move(st.scratch), st.comm};
      throw;
    }
  }
  struct Abandoned {
    std::vector<std::byte> scratch;
    std::shared_ptr<BackendComm> comm;
  };
  bool single() const { return g.size() == 1; }
};

void check_disjoint(Call& c, const void* out, int64_t out_n, const void* in, int64_t in_n, DType t);
void check_reducible(Call& c, DType t);
void* scratch(GroupState& st, int64_t bytes);  // the group's grow-only workspace
int64_t* counts_ws(GroupState& st, int p);     // four arrays of p entries
// dst[i] = ((src_0[i] + src_1[i]) + src_2[i]) + ... over src [p, n]: the rank order fixes the rounding.
void sum_rank_order(DType t, void* dst, const void* src, int p, int64_t n);
// Debug mode: every rank all-gathers its description; any difference throws on every rank.
void debug_check(Call& c, OpDesc d);

// Tensor forms (comm.cpp): defined, not on the GPU, contiguous; equal dtypes.
void check_tensor(const Tensor& t, const char* op, const ProcessGroup& g, const char* which);
void check_same_dtype(const Tensor& out, const Tensor& in, const char* op, const ProcessGroup& g);

}  // namespace moecore::detail
