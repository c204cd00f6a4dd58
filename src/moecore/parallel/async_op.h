// Internal to parallel/: one nonblocking operation in flight (what a CommHandle points to) and the progress
// engine that advances every pending one. async.cpp defines the engine and the point-to-point operations;
// async_collectives.cpp builds the nonblocking collectives on it. Nothing outside parallel/*.cpp includes this.
#pragma once
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "moecore/parallel/call.h"

namespace moecore::detail {

// One send or receive of an operation's current phase.
struct Transfer {
  bool send = false;
  void* buf = nullptr;  // read-only for a send
  int64_t n = 0;
  DType t = DType::f32;
  int peer = 0;                         // group index
  uint64_t msg = 0;                     // point-to-point: the message number on the (sender, receiver) pair
  std::shared_ptr<BackendRequest> req;  // null for a size-1 group's transfer to itself
  bool done = false;
};

// Tag layout: [0, H) the nonblocking collectives, two phases per call number; [H, 2H) point-to-point
// messages, three slots (data, descriptor, descriptor reply) per message number. H = backend_tag_limit() / 2.
int collective_tag(uint64_t seq, int phase);
int p2p_tag(uint64_t msg, int slot);

class AsyncOp {
 public:
  // `op` names it in errors; seq is the group's call number (collectives) or its current count (point-to-point).
  AsyncOp(const ProcessGroup& g, std::string op, uint64_t seq);
  virtual ~AsyncOp() = default;
  AsyncOp(const AsyncOp&) = delete;
  AsyncOp& operator=(const AsyncOp&) = delete;

  const ProcessGroup& group() const { return g_; }
  const std::string& name() const { return op_; }
  uint64_t seq() const { return seq_; }
  double timeout_s() const { return timeout_s_; }
  bool finished() const { return finished_; }
  bool failed() const { return error_ != nullptr; }
  bool has_pending_requests() const;
  // Tests the posted transfers; once all are complete runs step(). A failure is kept for wait() to rethrow;
  // one that may leave peers stuck (a backend error) also makes the group unusable.
  void poll();
  void rethrow_failure() const;
  // "recv from rank 1 (message #0)", ...: the transfers still pending, for a timeout message.
  std::string pending_text() const;
  CallInfo info(std::string_view op_text) const;
  // Size-1 group: withdraws this operation's unmatched transfers to itself (the wait that can never complete).
  void withdraw_self_transfers();

  std::vector<Tensor> keep;  // tensors held alive until the operation is complete

 protected:
  virtual void step() = 0;  // every posted transfer is complete: post the next phase or finish()
  void post_send(const void* buf, int64_t n, DType t, int peer, int tag, bool synchronous, uint64_t msg = 0);
  void post_recv(void* buf, int64_t n, DType t, int peer, int tag, uint64_t msg = 0);
  void post_self(bool send, void* buf, int64_t n, DType t, uint64_t msg);  // size-1 group: matched in a mailbox
  void finish() { finished_ = true; }
  void fail_quietly(const std::string& what);  // an Error for wait() that leaves the group usable

  ProcessGroup g_;
  std::string op_;
  uint64_t seq_;
  double timeout_s_;
  std::vector<Transfer> xfers_;  // the current phase's

 private:
  std::exception_ptr error_;
  bool finished_ = false;
};

// Registers a posted operation with the progress engine and wraps it in its handle.
CommHandle start_async(std::shared_ptr<AsyncOp> op);
// After a wait: the engine drops its reference to a finished operation.
void forget_finished(const AsyncOp* op);

}  // namespace moecore::detail
