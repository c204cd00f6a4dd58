// comm.h, part 2: the collectives over backend primitives — local argument checks, the debug-mode
// agreement checks, and the deterministic reductions (all-to-all the chunks, sum them in rank order on
// their owner, all-gather the sums), so every rank gets identical bits whatever the timing.
// No backend calls of its own: only the primitives declared in backend.h.
#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"
#include "moecore/parallel/call.h"

namespace moecore::detail {
namespace {

const char* op_name(int64_t op) {
  switch (static_cast<OpId>(op)) {
    case OpId::all_reduce_sum:
      return "all_reduce_sum";
    case OpId::all_gather:
      return "all_gather";
    case OpId::all_gather_v:
      return "all_gather_v";
    case OpId::reduce_scatter_sum:
      return "reduce_scatter_sum";
    case OpId::all_to_all_v:
      return "all_to_all_v";
    case OpId::broadcast:
      return "broadcast";
    case OpId::barrier:
      return "barrier";
    case OpId::split:
      return "group_split";
    case OpId::all_reduce_sum_async:
      return "all_reduce_sum_async";
    case OpId::all_gather_async:
      return "all_gather_async";
    case OpId::reduce_scatter_sum_async:
      return "reduce_scatter_sum_async";
    case OpId::all_gather_into:
      return "all_gather_into";
    case OpId::reduce_scatter_from:
      return "reduce_scatter_from";
    case OpId::reduce_scatter_v_sum:
      return "reduce_scatter_v_sum";
  }
  return "unknown op";
}

uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void check_counts(Call& c, std::span<const int64_t> counts, const char* what) {
  if (static_cast<int>(counts.size()) != c.g.size())
    c.fail(detail::str_cat(what, " has ", counts.size(), " entries but the group has ", c.g.size(), " ranks"));
  for (size_t i = 0; i < counts.size(); ++i)
    if (counts[i] < 0) c.fail(detail::str_cat(what, "[", i, "] = ", counts[i], " is negative"));
}

int64_t sum(std::span<const int64_t> v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// dst[i] = ((src_0[i] + src_1[i]) + src_2[i]) + ...: the rank order fixes the rounding.
template <class T>
void sum_rank_order(T* dst, const T* src, int p, int64_t n) {
  if (n == 0) return;  // (a rank's empty share of a short all-reduce: its buffers may be null)
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
  for (int r = 1; r < p; ++r) {
    const T* s = src + static_cast<int64_t>(r) * n;
    for (int64_t i = 0; i < n; ++i) dst[i] += s[i];
  }
}

// bf16: each partial sum rounded to bf16, as NCCL's reductions of bf16 buffers round at every addition.
void sum_rank_order(bf16* dst, const bf16* src, int p, int64_t n) {
  if (n == 0) return;
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(bf16));
  for (int r = 1; r < p; ++r) {
    const bf16* s = src + static_cast<int64_t>(r) * n;
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(bf16_to_float(dst[i]) + bf16_to_float(s[i]));
  }
}

}  // namespace

std::string describe(const OpDesc& d) {
  const OpId op = static_cast<OpId>(d.op);
  std::string s = std::string(op_name(d.op)) + "(";
  if (op == OpId::split) {
    s += detail::str_cat(d.count, " groups, partition hash ", d.hash);
  } else if (op != OpId::barrier) {
    s += detail::str_cat(dtype_name(static_cast<DType>(d.dtype)));
    if (op != OpId::all_to_all_v) s += detail::str_cat(", ", d.count, " elements");
    if (op == OpId::all_gather_v || op == OpId::reduce_scatter_v_sum) s += detail::str_cat(", counts hash ", d.hash);
    if (op == OpId::broadcast) s += detail::str_cat(", root ", d.extra);
    if (op == OpId::all_gather_into || op == OpId::reduce_scatter_from)
      s += detail::str_cat(", dim ", d.extra, ", shape hash ", d.hash);
  }
  return s + detail::str_cat(op == OpId::barrier ? "" : ", ", "call #", d.seq, ")");
}

// (Plain FNV-1a on whole words collides on swapped -1/1 patterns, e.g. the partitions {{0,1},{2}} and
// {{0},{1,2}}.)
int64_t hash_words(std::span<const int64_t> v) {
  uint64_t h = 0x243f6a8885a308d3ull;
  for (int64_t x : v) h = mix64(h ^ mix64(static_cast<uint64_t>(x)));
  return static_cast<int64_t>(h >> 1);
}

void check_disjoint(Call& c, const void* out, int64_t out_n, const void* in, int64_t in_n, DType t) {
  const auto* a = static_cast<const std::byte*>(out);
  const auto* b = static_cast<const std::byte*>(in);
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  if (out_n > 0 && in_n > 0 && a < b + in_n * es && b < a + out_n * es)
    c.fail("input and output buffers overlap; use separate buffers");
}

void check_reducible(Call& c, DType t) {
  if (t != DType::f32 && t != DType::f64 && t != DType::i64 && t != DType::bf16)
    c.fail(detail::str_cat("dtype ", dtype_name(t), " cannot be reduced; reductions take f32, f64, i64 or bf16"));
}

void* scratch(GroupState& st, int64_t bytes) {
  if (static_cast<int64_t>(st.scratch.size()) < bytes) st.scratch.resize(static_cast<size_t>(bytes));
  return st.scratch.data();
}

int64_t* counts_ws(GroupState& st, int p) {
  if (st.counts.size() < static_cast<size_t>(4 * p)) st.counts.resize(static_cast<size_t>(4 * p));
  return st.counts.data();
}

void sum_rank_order(DType t, void* dst, const void* src, int p, int64_t n) {
  switch (t) {
    case DType::f32:
      return sum_rank_order(static_cast<float*>(dst), static_cast<const float*>(src), p, n);
    case DType::f64:
      return sum_rank_order(static_cast<double*>(dst), static_cast<const double*>(src), p, n);
    case DType::i64:  // two's-complement wrap-around instead of signed-overflow UB
      return sum_rank_order(static_cast<uint64_t*>(dst), static_cast<const uint64_t*>(src), p, n);
    case DType::bf16:
      return sum_rank_order(static_cast<bf16*>(dst), static_cast<const bf16*>(src), p, n);
    default:
      MOECORE_CHECK(false, "sum_rank_order on ", dtype_name(t));
  }
}

void debug_check(Call& c, OpDesc d) {
  if (!comm_options().debug || c.single()) return;
  d.seq = static_cast<int64_t>(c.info.seq);
  const int p = c.g.size();
  std::vector<OpDesc> all(static_cast<size_t>(p));
  const std::string label = std::string(c.op) + " (debug check)";
  CallInfo info = c.info;
  info.op = label;
  c.guarded([&] { backend_all_gather(all.data(), &d, kDescWords, DType::i64, *c.st.comm, info); });
  for (int j = 0; j < p; ++j) {
    if (all[static_cast<size_t>(j)] == d) continue;
    MOECORE_FAIL("comm debug: collective mismatch on group ", c.g.name(), " (size ", p, ") seen on rank ", c.g.rank(),
                 " (world rank ", c.g.world_rank(), "): rank ", c.g.rank(), " (world rank ", c.g.world_rank(),
                 ") calls ", describe(d), " but rank ", j, " (world rank ", c.g.ranks()[static_cast<size_t>(j)],
                 ") calls ", describe(all[static_cast<size_t>(j)]));
  }
}

namespace {

// Debug mode for all_to_all_v: send_counts[j] on rank i must equal recv_counts[i] on rank j.
void debug_check_pairs(Call& c, std::span<const int64_t> send, std::span<const int64_t> recv) {
  if (!comm_options().debug || c.single()) return;
  const int p = c.g.size();
  std::vector<int64_t> ones(static_cast<size_t>(p), 1), idx(static_cast<size_t>(p)), got(static_cast<size_t>(p));
  for (int j = 0; j < p; ++j) idx[static_cast<size_t>(j)] = j;
  const std::string label = std::string(c.op) + " (debug check of counts)";
  CallInfo info = c.info;
  info.op = label;
  int64_t bad[3] = {-1, 0, 0};  // peer, what it sends me, what I expect
  c.guarded([&] {
    backend_all_to_all_v(got.data(), ones.data(), idx.data(), send.data(), ones.data(), idx.data(), DType::i64,
                         *c.st.comm, info);
    for (int j = 0; j < p && bad[0] < 0; ++j)
      if (got[static_cast<size_t>(j)] != recv[static_cast<size_t>(j)])
        bad[0] = j, bad[1] = got[static_cast<size_t>(j)], bad[2] = recv[static_cast<size_t>(j)];
    std::vector<int64_t> all(static_cast<size_t>(3 * p));
    backend_all_gather(all.data(), bad, 3, DType::i64, *c.st.comm, info);
    got.assign(all.begin(), all.end());  // now [p, 3]: every rank's first mismatch
  });
  for (int i = 0; i < p; ++i) {
    const int64_t j = got[static_cast<size_t>(3 * i)];
    if (j < 0) continue;
    const auto& ranks = c.g.ranks();
    MOECORE_FAIL("comm debug: all_to_all_v count mismatch on group ", c.g.name(), " (call #", c.info.seq,
                 ") seen on rank ", c.g.rank(), " (world rank ", c.g.world_rank(), "): rank ", j, " (world rank ",
                 ranks[static_cast<size_t>(j)], ") sends ", got[static_cast<size_t>(3 * i + 1)], " elements to rank ",
                 i, " (world rank ", ranks[static_cast<size_t>(i)], ") but rank ", i, " expects ",
                 got[static_cast<size_t>(3 * i + 2)]);
  }
}

constexpr int64_t kSegment = int64_t{1} << 27;  // elements per all-reduce round: keeps MPI counts in int

}  // namespace

void debug_check_split(const ProcessGroup& parent, GroupState& st, const CallInfo& call,
                       const std::vector<std::vector<int>>& partition) {
  if (!comm_options().debug || parent.size() == 1) return;
  std::vector<int64_t> words;
  for (const auto& grp : partition) {
    words.push_back(-1);
    words.insert(words.end(), grp.begin(), grp.end());
  }
  OpDesc d{static_cast<int64_t>(OpId::split), 0, static_cast<int64_t>(partition.size()), 0, hash_words(words),
           static_cast<int64_t>(call.seq)};
  std::vector<OpDesc> all(static_cast<size_t>(parent.size()));
  try {
    backend_all_gather(all.data(), &d, kDescWords, DType::i64, *st.comm, call);
  } catch (const Error& e) {
    st.broken = e.what();
    mark_broken();
    throw;
  }
  for (int j = 0; j < parent.size(); ++j)
    if (!(all[static_cast<size_t>(j)] == d))
      MOECORE_FAIL("comm debug: collective mismatch on group ", parent.name(), " seen on rank ", parent.rank(),
                   " (world rank ", parent.world_rank(), "): rank ", parent.rank(), " calls ", describe(d),
                   " but rank ", j, " (world rank ", parent.ranks()[static_cast<size_t>(j)], ") calls ",
                   describe(all[static_cast<size_t>(j)]));
}

void all_reduce_sum_raw(void* buf, int64_t n, DType t, const ProcessGroup& g) {
  Call c(g, "all_reduce_sum");
  check_reducible(c, t);
  if (n < 0) c.fail(detail::str_cat("negative element count ", n));
  if (c.single()) return;
  debug_check(c, {static_cast<int64_t>(OpId::all_reduce_sum), static_cast<int64_t>(t), n, 0, 0, 0});
  const int p = g.size(), me = g.rank();
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  int64_t* w = counts_ws(c.st, p);
  int64_t *send = w, *sdispl = w + p, *recv = w + 2 * p, *rdispl = w + 3 * p;
  for (int64_t start = 0; start < n; start += kSegment) {
    const int64_t len = std::min(kSegment, n - start);
    for (int r = 0; r < p; ++r) {  // rank r owns elements [len·r/p, len·(r+1)/p) of the segment
      sdispl[r] = len * r / p;
      send[r] = len * (r + 1) / p - sdispl[r];
    }
    const int64_t mine = send[me];
    for (int r = 0; r < p; ++r) recv[r] = mine, rdispl[r] = r * mine;
    auto* ws = static_cast<std::byte*>(scratch(c.st, (p + 1) * mine * es));
    std::byte* parts = ws;                    // [p, mine]: every rank's contribution to my chunk
    std::byte* reduced = ws + p * mine * es;  // [mine]
    std::byte* seg = static_cast<std::byte*>(buf) + start * es;
    c.guarded([&] { backend_all_to_all_v(parts, recv, rdispl, seg, send, sdispl, t, *c.st.comm, c.info); });
    sum_rank_order(t, reduced, parts, p, mine);
    c.guarded([&] { backend_all_gather_v(seg, send, sdispl, reduced, t, *c.st.comm, c.info); });
  }
}

void reduce_scatter_sum_raw(void* out, int64_t out_n, const void* in, int64_t in_n, DType t, const ProcessGroup& g) {
  Call c(g, "reduce_scatter_sum");
  check_reducible(c, t);
  if (in_n != out_n * g.size())
    c.fail(detail::str_cat("input has ", in_n, " elements but must hold group size × output = ", g.size(), " × ", out_n,
                           " = ", out_n * g.size()));
  check_disjoint(c, out, out_n, in, in_n, t);
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  if (c.single()) {
    if (out_n > 0) local_copy(out, in, out_n * es);
    return;
  }
  debug_check(c, {static_cast<int64_t>(OpId::reduce_scatter_sum), static_cast<int64_t>(t), out_n, 0, 0, 0});
  const int p = g.size();
  int64_t* w = counts_ws(c.st, p);
  for (int r = 0; r < p; ++r) w[r] = out_n, w[p + r] = r * out_n;
  void* parts = scratch(c.st, p * out_n * es);
  c.guarded([&] { backend_all_to_all_v(parts, w, w + p, in, w, w + p, t, *c.st.comm, c.info); });
  sum_rank_order(t, out, parts, p, out_n);
}

void reduce_scatter_v_sum_raw(void* out, int64_t out_n, const void* in, int64_t in_n, std::span<const int64_t> counts,
                              DType t, const ProcessGroup& g) {
  Call c(g, "reduce_scatter_v_sum");
  check_reducible(c, t);
  check_counts(c, counts, "counts");
  const int64_t total = sum(counts), mine = counts[static_cast<size_t>(g.rank())];
  if (in_n != total) c.fail(detail::str_cat("input has ", in_n, " elements but the counts sum to ", total));
  if (out_n != mine) c.fail(detail::str_cat("output has ", out_n, " elements but counts[", g.rank(), "] = ", mine));
  check_disjoint(c, out, out_n, in, in_n, t);
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  if (c.single()) {
    if (out_n > 0) local_copy(out, in, out_n * es);
    return;
  }
  debug_check(
      c, {static_cast<int64_t>(OpId::reduce_scatter_v_sum), static_cast<int64_t>(t), total, 0, hash_words(counts), 0});
  // Block r of every input goes to rank r, which sums the P blocks it receives in rank order.
  const int p = g.size();
  int64_t* w = counts_ws(c.st, p);
  int64_t *sdispl = w, *recv = w + p, *rdispl = w + 2 * p;
  for (int r = 0; r < p; ++r) {
    sdispl[r] = r ? sdispl[r - 1] + counts[static_cast<size_t>(r - 1)] : 0;
    recv[r] = mine;
    rdispl[r] = r * mine;
  }
  void* parts = scratch(c.st, p * mine * es);
  c.guarded([&] { backend_all_to_all_v(parts, recv, rdispl, in, counts.data(), sdispl, t, *c.st.comm, c.info); });
  sum_rank_order(t, out, parts, p, mine);
}

void all_gather_raw(void* out, int64_t out_n, const void* in, int64_t in_n, DType t, const ProcessGroup& g) {
  Call c(g, "all_gather");
  if (out_n != in_n * g.size())
    c.fail(detail::str_cat("output has ", out_n, " elements but must hold group size × input = ", g.size(), " × ", in_n,
                           " = ", in_n * g.size()));
  check_disjoint(c, out, out_n, in, in_n, t);
  if (c.single()) {
    if (in_n > 0) local_copy(out, in, in_n * static_cast<int64_t>(dtype_size(t)));
    return;
  }
  debug_check(c, {static_cast<int64_t>(OpId::all_gather), static_cast<int64_t>(t), in_n, 0, 0, 0});
  c.guarded([&] { backend_all_gather(out, in, in_n, t, *c.st.comm, c.info); });
}

void all_gather_v_raw(void* out, int64_t out_n, const void* in, int64_t in_n, std::span<const int64_t> counts, DType t,
                      const ProcessGroup& g) {
  Call c(g, "all_gather_v");
  check_counts(c, counts, "counts");
  const int64_t total = sum(counts);
  if (in_n != counts[static_cast<size_t>(g.rank())])
    c.fail(detail::str_cat("input has ", in_n, " elements but counts[", g.rank(),
                           "] = ", counts[static_cast<size_t>(g.rank())]));
  if (out_n != total) c.fail(detail::str_cat("output has ", out_n, " elements but the counts sum to ", total));
  check_disjoint(c, out, out_n, in, in_n, t);
  if (c.single()) {
    if (in_n > 0) local_copy(out, in, in_n * static_cast<int64_t>(dtype_size(t)));
    return;
  }
  debug_check(c, {static_cast<int64_t>(OpId::all_gather_v), static_cast<int64_t>(t), total, 0, hash_words(counts), 0});
  const int p = g.size();
  int64_t* displ = counts_ws(c.st, p);
  for (int r = 0; r < p; ++r) displ[r] = r ? displ[r - 1] + counts[static_cast<size_t>(r - 1)] : 0;
  c.guarded([&] { backend_all_gather_v(out, counts.data(), displ, in, t, *c.st.comm, c.info); });
}

void all_to_all_v_raw(void* out, int64_t out_n, std::span<const int64_t> recv_counts, const void* in, int64_t in_n,
                      std::span<const int64_t> send_counts, DType t, const ProcessGroup& g) {
  Call c(g, "all_to_all_v");
  check_counts(c, send_counts, "send_counts");
  check_counts(c, recv_counts, "recv_counts");
  if (in_n != sum(send_counts))
    c.fail(detail::str_cat("input has ", in_n, " elements but send_counts sum to ", sum(send_counts)));
  if (out_n != sum(recv_counts))
    c.fail(detail::str_cat("output has ", out_n, " elements but recv_counts sum to ", sum(recv_counts)));
  check_disjoint(c, out, out_n, in, in_n, t);
  if (c.single()) {
    if (send_counts[0] != recv_counts[0])
      c.fail(detail::str_cat("send_counts[0] = ", send_counts[0], " but recv_counts[0] = ", recv_counts[0],
                             " on a one-rank group"));
    if (in_n > 0) local_copy(out, in, in_n * static_cast<int64_t>(dtype_size(t)));
    return;
  }
  debug_check(c, {static_cast<int64_t>(OpId::all_to_all_v), static_cast<int64_t>(t), 0, 0, 0, 0});
  debug_check_pairs(c, send_counts, recv_counts);
  const int p = g.size();
  int64_t* w = counts_ws(c.st, p);
  int64_t *sdispl = w, *rdispl = w + p;
  for (int r = 0; r < p; ++r) {
    sdispl[r] = r ? sdispl[r - 1] + send_counts[static_cast<size_t>(r - 1)] : 0;
    rdispl[r] = r ? rdispl[r - 1] + recv_counts[static_cast<size_t>(r - 1)] : 0;
  }
  c.guarded([&] {
    backend_all_to_all_v(out, recv_counts.data(), rdispl, in, send_counts.data(), sdispl, t, *c.st.comm, c.info);
  });
}

void broadcast_raw(void* buf, int64_t n, DType t, int root, const ProcessGroup& g) {
  Call c(g, "broadcast");
  if (root < 0 || root >= g.size())
    c.fail(detail::str_cat("root ", root, " is not a rank of the group (0 .. ", g.size() - 1, ")"));
  if (n < 0) c.fail(detail::str_cat("negative element count ", n));
  if (c.single()) return;
  debug_check(c, {static_cast<int64_t>(OpId::broadcast), static_cast<int64_t>(t), n, root, 0, 0});
  c.guarded([&] { backend_broadcast(buf, n, t, root, *c.st.comm, c.info); });
}

}  // namespace moecore::detail

namespace moecore {

void barrier(const ProcessGroup& g) {
  detail::Call c(g, "barrier");
  if (c.single()) return;
  detail::debug_check(c, {static_cast<int64_t>(detail::OpId::barrier), 0, 0, 0, 0, 0});
  c.guarded([&] { detail::backend_barrier(*c.st.comm, c.info); });
}

}  // namespace moecore
