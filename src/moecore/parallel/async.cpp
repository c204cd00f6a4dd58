// comm.h, part 3: the nonblocking machinery — the progress engine that advances every pending operation, the
// CommHandle's wait/test with the group's timeout, the mailbox that matches a size-1 group's transfers to
// itself — and the point-to-point transfers (send, recv, batch_send_recv, isend, irecv) with their
// debug-mode descriptor exchange. The nonblocking collectives live in async_collectives.cpp.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"
#include "moecore/parallel/async_op.h"

namespace moecore {
namespace detail {
namespace {

// A size-1 group's unmatched transfers to itself, by message number: (operation, index of its transfer).
struct Mailbox {
  std::map<uint64_t, std::pair<AsyncOp*, size_t>> sends, recvs;
};

Mailbox& mailbox(GroupState& st) {
  if (!st.mailbox) st.mailbox = std::make_shared<Mailbox>();
  return *static_cast<Mailbox*>(st.mailbox.get());
}

// Operations in flight (the engine's references keep their buffers alive until they complete), and failed
// ones whose transfers may still be pending: kept for good, since MPI may still read or write their buffers.
// (Never destroyed: the progress thread may still look at them while the process exits.)
std::vector<std::shared_ptr<AsyncOp>>& pending_ops() {
  static auto* ops = new std::vector<std::shared_ptr<AsyncOp>>;
  return *ops;
}
std::vector<std::shared_ptr<AsyncOp>>& abandoned_ops() {
  static auto* ops = new std::vector<std::shared_ptr<AsyncOp>>;
  return *ops;
}
bool g_in_progress = false;
std::atomic<size_t> g_pending{0};  // pending_ops().size(), readable without the lock
std::atomic<int> g_wanted{0};      // calling threads waiting for comm_mutex() (BlockedScope)

// The progress thread's state (never destroyed, like the lists above).
struct ProgressThread {
  std::thread thread;
  std::atomic<bool> stop{false};
  std::mutex wake_mutex;
  std::condition_variable wake;
};
ProgressThread*& progress_thread() {
  static ProgressThread* t = nullptr;
  return t;
}
// Polling period while operations are pending: short enough that a bucket's phases follow each other within a
// layer's backward, long enough that the thread takes little from the computing threads.
constexpr auto kProgressInterval = std::chrono::microseconds(100);

// One round over the pending operations, one operation per hold of the lock, giving way as soon as the calling thread
// wants it (g_wanted): a comm call waits at most one operation's step (a transfer's copy, a chunk's sum), never a whole
// round. Strong references are taken and dropped under the lock, so an operation's last reference (and the tensors it
// keeps) never goes on this thread while its handle lives.
void progress_round() {
  static std::vector<std::weak_ptr<AsyncOp>> ops;  // this thread's only: reused, no allocation per round
  ops.clear();
  {
    std::unique_lock<std::recursive_mutex> l(comm_mutex(), std::try_to_lock);
    if (!l.owns_lock()) return;  // inside a comm call the calling thread makes the progress itself
    ops.assign(pending_ops().begin(), pending_ops().end());
  }
  for (const std::weak_ptr<AsyncOp>& w : ops) {
    if (g_wanted.load() > 0) return;
    std::unique_lock<std::recursive_mutex> l(comm_mutex(), std::try_to_lock);
    if (!l.owns_lock()) return;
    if (g_in_progress) continue;
    if (const std::shared_ptr<AsyncOp> op = w.lock()) {
      g_in_progress = true;
      op->poll();  // (failures are kept in the op and rethrown by its wait)
      g_in_progress = false;
    }
  }
  const std::lock_guard<std::recursive_mutex> l(comm_mutex());
  std::erase_if(pending_ops(), [](const std::shared_ptr<AsyncOp>& op) {
    if (!op->finished() || op.use_count() == 1) return false;  // (an orphan goes on the calling thread's next round)
    if (op->has_pending_requests()) abandoned_ops().push_back(op);
    return true;
  });
  g_pending.store(pending_ops().size());
}

void progress_thread_main(ProgressThread* t) {
  const DeviceAccess access;  // the engine moves and sums device (sim) memory, as a collective does
  while (!t->stop.load()) {
    if (g_pending.load() == 0) {
      std::unique_lock<std::mutex> l(t->wake_mutex);
      t->wake.wait_for(l, std::chrono::milliseconds(10), [t] { return t->stop.load() || g_pending.load() > 0; });
      continue;
    }
    progress_round();
    std::this_thread::sleep_for(kProgressInterval);
  }
}

std::string rank_text(const ProcessGroup& g) {
  return str_cat("rank ", g.rank(), " (world rank ", g.world_rank(), ")");
}

// The polling policy of the blocking collectives (mpi_backend.cpp): yield for the first 50 ms, while a
// transfer is likely still moving (Open MPI moves data only inside MPI_Test), then nap with growing back-off up
// to 1 ms so oversubscribed ranks leave the cores to the peers they wait for.
class Poller {
 public:
  explicit Poller(double timeout_s) : timeout_s_(timeout_s) {}
  bool expired() const { return timeout_s_ > 0 && clock::now() >= deadline_; }
  void pause() {
    if (clock::now() < busy_until_) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap_);
      nap_ = std::min(nap_ * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  using clock = std::chrono::steady_clock;
  double timeout_s_;
  clock::time_point deadline_ =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s_));
  clock::time_point busy_until_ = clock::now() + std::chrono::milliseconds(50);
  std::chrono::microseconds nap_{10};
};

[[noreturn]] void throw_unusable(const AsyncOp& op, const std::string& why) {
  MOECORE_FAIL("comm: ", op.name(), " on group ", op.group().name(), " on ", rank_text(op.group()),
               ": the group is unusable after an earlier failure (", why, "); end the job with comm_abort()");
}

void wait_for(AsyncOp& op) {
  if (!op.finished()) {
    GroupState& st = op.group().state();
    if (!st.broken.empty()) throw_unusable(op, st.broken);
    Poller poller(op.timeout_s());
    for (;;) {
      progress_async();
      if (op.finished()) break;
      if (op.group().size() == 1) {  // nothing else can ever match a one-rank group's transfer
        const std::string what = op.pending_text();
        op.withdraw_self_transfers();
        MOECORE_FAIL("comm: ", op.name(), " on group ", op.group().name(),
                     " (size 1) can never complete: nothing was posted to match ", what,
                     "; on a one-rank group post the matching transfer first (batch_send_recv, or isend/irecv "
                     "before the wait)");
      }
      if (poller.expired()) {
        const std::string text = op.name() + " (still pending: " + op.pending_text() + ")";
        try {
          throw_timeout(op.info(text));
        } catch (const Error& e) {
          if (st.broken.empty()) st.broken = e.what();
          mark_broken();
          throw;
        }
      }
      poller.pause();
    }
  }
  op.rethrow_failure();
}

void report_dropped(const AsyncOp& op) {
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  const ProcessGroup& g = op.group();
  const std::string phase = comm_phase();
  const std::string msg =
      str_cat("comm: the CommHandle of ", op.name(), " on group ", g.name(), " (call #", op.seq(), ") on ",
              rank_text(g), phase.empty() ? "" : ", " + phase,
              " was destroyed without wait(); every nonblocking operation must be waited for (its buffers may still "
              "be in use and its peers may be waiting for it)");
  std::fprintf(stderr, "moecore: %s\n", msg.c_str());
  GroupState& st = g.state();
  if (st.broken.empty()) st.broken = msg;
  if (!op.finished()) mark_broken();
}

}  // namespace

int collective_tag(uint64_t seq, int phase) {
  const uint64_t half = static_cast<uint64_t>(backend_tag_limit() / 2);
  return static_cast<int>(2 * (seq % (half / 2)) + static_cast<uint64_t>(phase));
}

int p2p_tag(uint64_t msg, int slot) {
  const uint64_t half = static_cast<uint64_t>(backend_tag_limit() / 2);
  return static_cast<int>(half + 4 * (msg % (half / 4)) + static_cast<uint64_t>(slot));
}

AsyncOp::AsyncOp(const ProcessGroup& g, std::string op, uint64_t seq)
    : g_(g), op_(std::move(op)), seq_(seq), timeout_s_(comm_options().timeout_s) {}

bool AsyncOp::has_pending_requests() const {
  for (const Transfer& x : xfers_)
    if (!x.done && x.req) return true;
  return false;
}

void AsyncOp::poll() {
  if (finished_) return;
  try {
    bool all = true;
    for (Transfer& x : xfers_) {
      if (!x.done && x.req) x.done = backend_test(*x.req, info(op_));
      all = all && x.done;
    }
    if (all) step();
  } catch (const Error& e) {  // a backend failure: peers may be stuck in this operation
    error_ = std::current_exception();
    finished_ = true;
    GroupState& st = g_.state();
    if (st.broken.empty()) st.broken = e.what();
    mark_broken();
  }
}

void AsyncOp::rethrow_failure() const {
  if (error_) std::rethrow_exception(error_);
}

void AsyncOp::fail_quietly(const std::string& what) {
  try {
    MOECORE_FAIL(what);
  } catch (const Error&) {
    error_ = std::current_exception();
  }
  finished_ = true;
}

std::string AsyncOp::pending_text() const {
  std::string s;
  for (const Transfer& x : xfers_) {
    if (x.done) continue;
    if (!s.empty()) s += ", ";
    s += str_cat(x.send ? "send to rank " : "recv from rank ", x.peer, " (", x.n, " ", dtype_name(x.t),
                 " elements, message #", x.msg, ")");
  }
  return s.empty() ? "nothing" : s;
}

CallInfo AsyncOp::info(std::string_view op_text) const {
  return CallInfo{op_text, g_.name(), g_.rank(), g_.world_rank(), seq_, timeout_s_};
}

void AsyncOp::post_send(const void* buf, int64_t n, DType t, int peer, int tag, bool synchronous, uint64_t msg) {
  Transfer x{true, const_cast<void*>(buf), n, t, peer, msg, nullptr, false};
  x.req = backend_isend(buf, n, t, peer, tag, synchronous, *g_.state().comm, info(op_));
  xfers_.push_back(std::move(x));
}

void AsyncOp::post_recv(void* buf, int64_t n, DType t, int peer, int tag, uint64_t msg) {
  Transfer x{false, buf, n, t, peer, msg, nullptr, false};
  x.req = backend_irecv(buf, n, t, peer, tag, *g_.state().comm, info(op_));
  xfers_.push_back(std::move(x));
}

void AsyncOp::post_self(bool send, void* buf, int64_t n, DType t, uint64_t msg) {
  Mailbox& mb = mailbox(g_.state());
  auto& others = send ? mb.recvs : mb.sends;
  xfers_.push_back(Transfer{send, buf, n, t, 0, msg, nullptr, false});
  const auto it = others.find(msg);
  if (it == others.end()) {
    (send ? mb.sends : mb.recvs)[msg] = {this, xfers_.size() - 1};
    return;
  }
  Transfer& o = it->second.first->xfers_[it->second.second];
  Transfer& me = xfers_.back();
  const Transfer& s = send ? me : o;
  const Transfer& r = send ? o : me;
  if (s.n != r.n || s.t != r.t)
    MOECORE_FAIL("comm: ", op_, " on group ", g_.name(), " (size 1): message #", msg, " to itself has ", s.n, " ",
                 dtype_name(s.t), " elements but its recv expects ", r.n, " ", dtype_name(r.t),
                 "; send and recv must agree on element count and dtype");
  if (s.n > 0) local_copy(r.buf, s.buf, s.n * static_cast<int64_t>(dtype_size(s.t)));
  o.done = me.done = true;
  others.erase(it);
}

void AsyncOp::withdraw_self_transfers() {
  if (!g_.state().mailbox) return;
  Mailbox& mb = mailbox(g_.state());
  for (auto* box : {&mb.sends, &mb.recvs})
    std::erase_if(*box, [this](const auto& kv) { return kv.second.first == this; });
  bool unmatched = false;
  for (const Transfer& x : xfers_) unmatched = unmatched || (!x.done && !x.req);
  if (unmatched && !finished_)
    fail_quietly("comm: " + op_ + " on group " + g_.name() + " was withdrawn: nothing was posted to match it");
}

std::recursive_mutex& comm_mutex() {
  static auto* m = new std::recursive_mutex;
  return *m;
}

std::unique_lock<std::recursive_mutex> lock_for_call() {
  g_wanted.fetch_add(1);
  std::unique_lock<std::recursive_mutex> l(comm_mutex());
  g_wanted.fetch_sub(1);
  return l;
}

void start_progress_thread() {
  if (progress_thread()) return;
  auto* t = new ProgressThread;
  t->thread = std::thread(progress_thread_main, t);
  progress_thread() = t;
}

void stop_progress_thread() {
  ProgressThread* t = progress_thread();
  if (!t) return;
  t->stop.store(true);
  t->wake.notify_all();
  t->thread.join();
  delete t;
  progress_thread() = nullptr;
}

bool progress_thread_running() {
  return progress_thread() != nullptr;
}

bool progress_async() {
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  auto& ops = pending_ops();
  if (ops.empty()) return false;
  if (g_in_progress) return true;  // a poll's own backend call polling again
  struct Guard {
    Guard() { g_in_progress = true; }
    ~Guard() { g_in_progress = false; }
  } guard;
  for (size_t i = 0; i < ops.size(); ++i) ops[i]->poll();
  std::erase_if(ops, [](const std::shared_ptr<AsyncOp>& op) {
    if (!op->finished()) return false;
    if (op->has_pending_requests()) abandoned_ops().push_back(op);
    return true;
  });
  g_pending.store(ops.size());
  return !ops.empty();
}

void forget_finished(const AsyncOp* op) {
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  auto& ops = pending_ops();
  std::erase_if(ops, [op](const std::shared_ptr<AsyncOp>& o) {
    if (o.get() != op) return false;
    if (o->has_pending_requests()) abandoned_ops().push_back(o);
    return true;
  });
  g_pending.store(ops.size());
}

CommHandle start_async(std::shared_ptr<AsyncOp> op) {
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  if (!op->finished()) {
    pending_ops().push_back(op);
    g_pending.store(pending_ops().size());
    if (ProgressThread* t = progress_thread()) t->wake.notify_one();
  }
  return CommHandle(std::move(op));
}

namespace {

// ---- Point-to-point ----

struct P2PItem {
  bool send = false;
  void* buf = nullptr;
  int64_t n = 0;
  DType t = DType::f32;
  int peer = 0;
  uint64_t msg = 0;
};

enum Slot { kData = 0, kDesc = 1, kDescReply = 2 };

// One batch of sends and receives. Debug mode first exchanges (kind, dtype, count) with each peer and posts
// the data only once both sides agree, so a mismatch leaves nothing half-moved.
class P2PBatch final : public AsyncOp {
 public:
  P2PBatch(const ProcessGroup& g, std::string op, std::vector<P2PItem> items)
      : AsyncOp(g, std::move(op), g.state().seq), items_(std::move(items)) {}

  void begin() {
    GroupState& st = g_.state();
    const auto p = static_cast<size_t>(g_.size());
    if (st.sent.size() < p) st.sent.resize(p, 0), st.received.resize(p, 0);
    for (P2PItem& it : items_) {
      const auto peer = static_cast<size_t>(it.peer);
      it.msg = it.send ? st.sent[peer]++ : st.received[peer]++;
    }
    if (g_.size() == 1) {
      for (const P2PItem& it : items_) post_self(it.send, it.buf, it.n, it.t, it.msg);
      data_posted_ = true;
      return;
    }
    if (!comm_options().debug) return post_data();
    descs_.resize(6 * items_.size());
    for (size_t i = 0; i < items_.size(); ++i) {
      const P2PItem& it = items_[i];
      int64_t* mine = &descs_[6 * i];
      mine[0] = it.send ? 1 : 2, mine[1] = static_cast<int64_t>(it.t), mine[2] = it.n;
      // The sender's descriptor travels on the message's kDesc tag, the receiver's answer on kDescReply.
      post_send(mine, 3, DType::i64, it.peer, p2p_tag(it.msg, it.send ? kDesc : kDescReply), false, it.msg);
      post_recv(mine + 3, 3, DType::i64, it.peer, p2p_tag(it.msg, it.send ? kDescReply : kDesc), it.msg);
    }
  }

 private:
  void post_data() {
    xfers_.clear();
    for (const P2PItem& it : items_) {
      if (it.send)
        post_send(it.buf, it.n, it.t, it.peer, p2p_tag(it.msg, kData), true, it.msg);
      else
        post_recv(it.buf, it.n, it.t, it.peer, p2p_tag(it.msg, kData), it.msg);
    }
    data_posted_ = true;
  }

  void step() override {
    if (data_posted_) return finish();
    for (size_t i = 0; i < items_.size(); ++i) {
      const int64_t* mine = &descs_[6 * i];
      const int64_t* theirs = mine + 3;
      if (mine[1] == theirs[1] && mine[2] == theirs[2]) continue;
      const P2PItem& it = items_[i];
      const int64_t* s = it.send ? mine : theirs;
      const int64_t* r = it.send ? theirs : mine;
      const int sender = it.send ? g_.rank() : it.peer, receiver = it.send ? it.peer : g_.rank();
      const auto& ranks = g_.ranks();
      return fail_quietly(str_cat("comm debug: point-to-point mismatch on group ", g_.name(), " seen on ",
                                  rank_text(g_), ": rank ", sender, " (world rank ", ranks[static_cast<size_t>(sender)],
                                  ") sends ", s[2], " ", dtype_name(static_cast<DType>(s[1])), " elements to rank ",
                                  receiver, " (world rank ", ranks[static_cast<size_t>(receiver)], ") as message #",
                                  it.msg, " between them, but rank ", receiver, " receives ", r[2], " ",
                                  dtype_name(static_cast<DType>(r[1])), " elements (in ", op_, ")"));
    }
    post_data();
  }

  std::vector<P2PItem> items_;
  std::vector<int64_t> descs_;  // debug mode: per item, its descriptor and the peer's
  bool data_posted_ = false;
};

std::shared_ptr<P2PBatch> post_p2p(const ProcessGroup& g, const std::string& op, std::vector<P2PItem> items) {
  const std::lock_guard<std::recursive_mutex> lock(comm_mutex());
  GroupState& st = Call::checked_state(g, op.c_str());
  for (const P2PItem& it : items) {
    if (it.peer < 0 || it.peer >= g.size())
      MOECORE_FAIL("comm: ", op, " on group ", g.name(), " (size ", g.size(), ") on ", rank_text(g), ": ",
                   it.send ? "destination " : "source ", it.peer, " is not a rank of the group (0 .. ", g.size() - 1,
                   ")");
    if (it.n < 0) MOECORE_FAIL("comm: ", op, " on group ", g.name(), ": negative element count ", it.n);
  }
  auto batch = std::make_shared<P2PBatch>(g, op, std::move(items));
  note_call(batch->info(op));
  try {
    batch->begin();
  } catch (const Error& e) {
    batch->withdraw_self_transfers();
    if (batch->has_pending_requests()) {
      if (st.broken.empty()) st.broken = e.what();
      mark_broken();
      abandoned_ops().push_back(batch);
    }
    throw;
  }
  return batch;
}

P2PItem tensor_item(bool send, const Tensor& t, int peer, const char* op, const ProcessGroup& g) {
  check_tensor(t, op, g, send ? "send" : "recv");
  return P2PItem{send, t.raw(), t.numel(), t.dtype(), peer, 0};
}

std::string p2p_name(const char* op, bool send, int peer) {
  return str_cat(op, send ? " to rank " : " from rank ", peer);
}

CommHandle post_tensor(const char* op, bool send, const Tensor& t, int peer, const ProcessGroup& g) {
  const DeviceAccess access;  // a transfer reads or writes device memory, as NCCL does
  auto batch = post_p2p(g, p2p_name(op, send, peer), {tensor_item(send, t, peer, op, g)});
  batch->keep.push_back(t);
  return start_async(std::move(batch));
}

}  // namespace

void send_raw(const void* buf, int64_t n, DType t, int dst, const ProcessGroup& g) {
  start_async(post_p2p(g, p2p_name("send", true, dst), {P2PItem{true, const_cast<void*>(buf), n, t, dst, 0}})).wait();
}

void recv_raw(void* buf, int64_t n, DType t, int src, const ProcessGroup& g) {
  start_async(post_p2p(g, p2p_name("recv", false, src), {P2PItem{false, buf, n, t, src, 0}})).wait();
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------
// CommHandle
// ---------------------------------------------------------------------------------------------------

CommHandle& CommHandle::operator=(CommHandle&& o) noexcept {
  if (this != &o) {
    if (op_) detail::report_dropped(*op_);
    op_ = std::move(o.op_);
  }
  return *this;
}

CommHandle::~CommHandle() {
  if (op_) detail::report_dropped(*op_);
}

void CommHandle::wait() {
  if (!op_) return;
  const detail::BlockedScope blocked;
  const std::shared_ptr<detail::AsyncOp> op = std::move(op_);
  detail::wait_for(*op);
  // The engine lets go of it here, so the last reference (and the tensors it keeps) goes on this thread, never on
  // the progress thread.
  detail::forget_finished(op.get());
}

bool CommHandle::completed() const {
  if (!op_) return true;
  const std::lock_guard<std::recursive_mutex> lock(detail::comm_mutex());
  return op_->finished();
}

bool CommHandle::test() {
  if (!op_) return true;
  const detail::BlockedScope blocked;
  detail::progress_async();
  if (!op_->finished()) return false;
  wait();
  return true;
}

// ---------------------------------------------------------------------------------------------------
// Point-to-point tensor forms
// ---------------------------------------------------------------------------------------------------

CommHandle isend(const Tensor& t, int dst, const ProcessGroup& g) {
  return detail::post_tensor("isend", true, t, dst, g);
}

CommHandle irecv(const Tensor& t, int src, const ProcessGroup& g) {
  return detail::post_tensor("irecv", false, t, src, g);
}

// The blocking forms hold their tensors too: after a timeout the transfer may still use them.
void send(const Tensor& t, int dst, const ProcessGroup& g) {
  detail::post_tensor("send", true, t, dst, g).wait();
}

void recv(const Tensor& t, int src, const ProcessGroup& g) {
  detail::post_tensor("recv", false, t, src, g).wait();
}

CommHandle batch_send_recv_async(std::span<const P2POp> ops, const ProcessGroup& g) {
  const DeviceAccess access;
  std::vector<detail::P2PItem> items;
  for (const P2POp& o : ops)
    items.push_back(detail::tensor_item(o.kind == P2PKind::send, o.tensor, o.peer, "batch_send_recv", g));
  auto op = detail::post_p2p(g, detail::str_cat("batch_send_recv (", ops.size(), " transfers)"), std::move(items));
  for (const P2POp& o : ops) op->keep.push_back(o.tensor);
  return detail::start_async(std::move(op));
}

void batch_send_recv(std::span<const P2POp> ops, const ProcessGroup& g) {
  batch_send_recv_async(ops, g).wait();
}

bool comm_progress_thread_running() {
  return detail::progress_thread_running();
}

}  // namespace moecore
