// comm.h, part 4: the nonblocking collectives on point-to-point transfers (async.cpp's engine). Each sums in
// group-rank order exactly as collectives.cpp does, so the bits equal the blocking forms'; MPI's reductions
// are never used. Phases are matched by tags derived from the group's call number, so a phase posted late
// (when a test or wait finds the previous one complete) can never pair with another call's messages.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"
#include "moecore/parallel/async_op.h"

namespace moecore {
namespace detail {
namespace {

// Staging buffers of the nonblocking collectives, reused across calls: a fresh multi-megabyte allocation per call
// costs the posting thread its page faults (and std::vector's zeroing), milliseconds per gradient bucket. Released
// buffers are kept (grow-only, bounded by the most ever in flight at once) and handed out smallest-fitting first.
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (!buf_) return;
    const std::lock_guard<std::mutex> lock(pool_mutex());
    pool().emplace(cap_, std::move(buf_));
  }
  void resize(size_t n) {  // once per op, before use; contents unspecified
    const std::lock_guard<std::mutex> lock(pool_mutex());
    auto& p = pool();
    const auto it = p.lower_bound(n);
    if (it != p.end()) {
      cap_ = it->first;
      buf_ = std::move(it->second);
      p.erase(it);
    } else {
      cap_ = n;
      buf_.reset(new std::byte[std::max<size_t>(n, 1)]);
    }
  }
  std::byte* data() { return buf_.get(); }

 private:
  // (Never destroyed: an operation kept for good after a failure may release its buffer at exit.)
  static std::multimap<size_t, std::unique_ptr<std::byte[]>>& pool() {
    static auto* p = new std::multimap<size_t, std::unique_ptr<std::byte[]>>;
    return *p;
  }
  static std::mutex& pool_mutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  std::unique_ptr<std::byte[]> buf_;
  size_t cap_ = 0;
};

// all_gather: block q of out comes from rank q, in one phase.
class GatherOp final : public AsyncOp {
 public:
  GatherOp(Call& c, std::byte* out, const std::byte* in, int64_t n, DType t) : AsyncOp(c.g, c.op, c.info.seq) {
    const int p = g_.size(), me = g_.rank();
    const int64_t es = static_cast<int64_t>(dtype_size(t));
    if (n > 0) local_copy(out + me * n * es, in, n * es);
    if (p == 1) {
      finish();
      return;
    }
    const int tag = collective_tag(seq_, 0);
    for (int q = 0; q < p; ++q) {
      if (q == me) continue;
      post_recv(out + q * n * es, n, t, q, tag);
      post_send(in, n, t, q, tag, false);
    }
  }

 private:
  void step() override { finish(); }
};

// reduce_scatter_sum: rank q's block of every input comes to q, which sums the blocks in rank order.
class ReduceScatterOp final : public AsyncOp {
 public:
  ReduceScatterOp(Call& c, std::byte* out, const std::byte* in, int64_t n, DType t)
      : AsyncOp(c.g, c.op, c.info.seq), out_(out), n_(n), t_(t) {
    const int p = g_.size(), me = g_.rank();
    const int64_t es = static_cast<int64_t>(dtype_size(t));
    if (p == 1) {
      if (n > 0) local_copy(out, in, n * es);
      finish();
      return;
    }
    parts_.resize(static_cast<size_t>(p * n * es));
    if (n > 0) std::memcpy(parts_.data() + me * n * es, in + me * n * es, static_cast<size_t>(n * es));
    const int tag = collective_tag(seq_, 0);
    for (int q = 0; q < p; ++q) {
      if (q == me) continue;
      post_recv(parts_.data() + q * n * es, n, t, q, tag);
      post_send(in + q * n * es, n, t, q, tag, false);
    }
  }

 private:
  void step() override {
    sum_rank_order(t_, out_, parts_.data(), g_.size(), n_);
    finish();
  }
  std::byte* out_;
  int64_t n_;
  DType t_;
  Staging parts_;  // [p, n]: every rank's block for this rank
};

// all_reduce_sum in two phases, as collectives.cpp: rank r owns elements [n·r/p, n·(r+1)/p); phase 0 brings
// every rank's part of the owned chunk (summed in rank order), phase 1 sends the sum to every rank.
class AllReduceOp final : public AsyncOp {
 public:
  AllReduceOp(Call& c, std::byte* buf, int64_t n, DType t) : AsyncOp(c.g, c.op, c.info.seq), buf_(buf), t_(t) {
    const int p = g_.size(), me = g_.rank();
    if (p == 1) {
      finish();
      return;
    }
    es_ = static_cast<int64_t>(dtype_size(t));
    displ_.resize(static_cast<size_t>(p) + 1);
    for (int r = 0; r <= p; ++r) displ_[static_cast<size_t>(r)] = n * r / p;
    const int64_t mine = count(me);
    parts_.resize(static_cast<size_t>(p * mine * es_));
    if (mine > 0) std::memcpy(parts_.data() + me * mine * es_, at(me), static_cast<size_t>(mine * es_));
    const int tag = collective_tag(seq_, 0);
    for (int q = 0; q < p; ++q) {
      if (q == me) continue;
      post_recv(parts_.data() + q * mine * es_, mine, t, q, tag);
      post_send(at(q), count(q), t, q, tag, false);
    }
  }

 private:
  int64_t count(int r) const { return displ_[static_cast<size_t>(r) + 1] - displ_[static_cast<size_t>(r)]; }
  std::byte* at(int r) const { return buf_ + displ_[static_cast<size_t>(r)] * es_; }

  void step() override {
    if (phase_ == 1) return finish();
    const int p = g_.size(), me = g_.rank();
    sum_rank_order(t_, at(me), parts_.data(), p, count(me));  // every phase-0 send has left the buffer
    phase_ = 1;
    xfers_.clear();
    const int tag = collective_tag(seq_, 1);
    for (int q = 0; q < p; ++q) {
      if (q == me) continue;
      post_recv(at(q), count(q), t_, q, tag);
      post_send(at(me), count(me), t_, q, tag, false);
    }
  }

  std::byte* buf_;
  DType t_;
  int64_t es_ = 0;
  std::vector<int64_t> displ_;  // [p + 1]: chunk boundaries
  Staging parts_;               // [p, my chunk]
  int phase_ = 0;
};

template <class Op, class... Args>
CommHandle post_collective(Call& c, std::initializer_list<Tensor> tensors, Args&&... args) {
  std::shared_ptr<Op> op;
  try {
    op = std::make_shared<Op>(c, std::forward<Args>(args)...);
  } catch (const Error& e) {  // a failed post leaves peers waiting for this rank's messages
    c.st.broken = e.what();
    mark_broken();
    throw;
  }
  op->keep.assign(tensors);
  return start_async(std::move(op));
}

}  // namespace
}  // namespace detail

CommHandle all_reduce_sum_async(const Tensor& buf, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  detail::check_tensor(buf, "all_reduce_sum_async", g, "buffer");
  detail::Call c(g, "all_reduce_sum_async");
  detail::check_reducible(c, buf.dtype());
  detail::debug_check(c, {static_cast<int64_t>(detail::OpId::all_reduce_sum_async), static_cast<int64_t>(buf.dtype()),
                          buf.numel(), 0, 0, 0});
  return detail::post_collective<detail::AllReduceOp>(c, {buf}, static_cast<std::byte*>(buf.raw()), buf.numel(),
                                                      buf.dtype());
}

CommHandle all_gather_async(const Tensor& out, const Tensor& in, const ProcessGroup& g) {
  const DeviceAccess access;
  detail::check_tensor(out, "all_gather_async", g, "output");
  detail::check_tensor(in, "all_gather_async", g, "input");
  detail::check_same_dtype(out, in, "all_gather_async", g);
  detail::Call c(g, "all_gather_async");
  if (out.numel() != in.numel() * g.size())
    c.fail(detail::str_cat("output ", out.str(), " has ", out.numel(), " elements but must hold group size × input = ",
                           g.size(), " × ", in.numel(), " = ", in.numel() * g.size()));
  detail::check_disjoint(c, out.raw(), out.numel(), in.raw(), in.numel(), in.dtype());
  detail::debug_check(
      c, {static_cast<int64_t>(detail::OpId::all_gather_async), static_cast<int64_t>(in.dtype()), in.numel(), 0, 0, 0});
  return detail::post_collective<detail::GatherOp>(c, {out, in}, static_cast<std::byte*>(out.raw()),
                                                   static_cast<const std::byte*>(in.raw()), in.numel(), in.dtype());
}

CommHandle reduce_scatter_sum_async(const Tensor& out, const Tensor& in, const ProcessGroup& g) {
  const DeviceAccess access;
  detail::check_tensor(out, "reduce_scatter_sum_async", g, "output");
  detail::check_tensor(in, "reduce_scatter_sum_async", g, "input");
  detail::check_same_dtype(out, in, "reduce_scatter_sum_async", g);
  detail::Call c(g, "reduce_scatter_sum_async");
  detail::check_reducible(c, in.dtype());
  if (in.numel() != out.numel() * g.size())
    c.fail(detail::str_cat("input ", in.str(), " has ", in.numel(), " elements but must hold group size × output = ",
                           g.size(), " × ", out.numel(), " = ", out.numel() * g.size()));
  detail::check_disjoint(c, out.raw(), out.numel(), in.raw(), in.numel(), in.dtype());
  detail::debug_check(c, {static_cast<int64_t>(detail::OpId::reduce_scatter_sum_async),
                          static_cast<int64_t>(in.dtype()), out.numel(), 0, 0, 0});
  return detail::post_collective<detail::ReduceScatterOp>(c, {out, in}, static_cast<std::byte*>(out.raw()),
                                                          static_cast<const std::byte*>(in.raw()), out.numel(),
                                                          in.dtype());
}

}  // namespace moecore
