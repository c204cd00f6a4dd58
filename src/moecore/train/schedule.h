// Pipeline schedules: the order in which one stage runs the forward and backward passes of a step's micro-batches,
// and how many micro-batches it holds between the two at once (the model's activation slots). Megatron's
// non-interleaved 1F1B (PipeDream-Flush): stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates one
// forward and one backward, then drains the remaining backwards. With one stage it is forward, backward per
// micro-batch -- gradient accumulation without pipelining. Megatron's interleaved 1F1B (virtual pipeline): each
// stage holds v model chunks and runs each micro-batch through all of them. Not here: the passes themselves (step.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moecore::train {

struct ScheduleOp {
  enum Kind : uint8_t { forward, backward };
  Kind kind = forward;
  int64_t micro_batch = 0;  // 0-based, within this rank's micro-batches of the step
  int64_t chunk = 0;        // the model chunk (virtual pipeline stage of this rank; 0 without interleaving)
};

struct Schedule {
  std::vector<ScheduleOp> ops;
  // Per model chunk: the most micro-batches between their forward and their backward through it at any point.
  std::vector<int64_t> in_flight = {1};
  // An op's activation slot of its chunk: each chunk runs its backwards in the order of its forwards, so micro-batch i
  // modulo in_flight is free again by the time i's forward starts.
  int64_t slot(const ScheduleOp& op) const { return op.micro_batch % in_flight[static_cast<size_t>(op.chunk)]; }
  std::string str() const;  // "F0 F1 B0 F2 B1 B2" (tests, logs); with chunks "F0.1": micro-batch 0 in chunk 1
};

// The 1F1B schedule of `stage` (0-based) in a pipeline of `stages`, for `micro_batches` micro-batches (Error unless
// micro_batches >= 1 and 0 <= stage < stages).
Schedule one_f_one_b(int64_t micro_batches, int64_t stages = 1, int64_t stage = 0);

// Megatron's interleaved 1F1B for `chunks` >= 2 model chunks per stage: the forwards go through the micro-batches in
// groups of group_size (the last group takes the rest), each group through chunk 0, then chunk 1, ...; the backwards in
// the same order with the chunks reversed. Stage s runs (stages - s - 1) * 2 + (chunks - 1) * group_size warm-up
// forwards (all of them when that is at least micro_batches * chunks), then one forward and one backward at a time,
// then the remaining backwards. Error naming the values unless stages >= 2, stages <= group_size <= micro_batches and
// micro_batches % group_size is 0 or at least stages (Megatron's conditions: no dependency bubbles).
Schedule interleaved_one_f_one_b(int64_t micro_batches, int64_t stages, int64_t stage, int64_t chunks,
                                 int64_t group_size);

// The transfers between the virtual stages of a pipeline around one stage's schedule: each forward of a chunk after
// the first virtual stage receives its input activations from the previous stage (stage - 1; the first stage's chunk c
// from the last stage's chunk c - 1), each one before the last virtual stage sends its output to the next; the
// backwards send and receive the gradients the other way. Activations and gradients are two streams (in Megatron's
// order on each: the k-th message one way is the receiver's k-th of that stream from that sender). Sends never block
// the schedule: a send is waited for only before its buffer is used again (the slot's backward). Receives are posted
// as early as their slot's buffer is free (its previous micro-batch's backward has run), in the order they are used,
// and waited for just before the pass that reads them -- so the stages wait only for data (test: every stage's plan
// completes, matched in order, for pipelines of any size).
struct P2PAction {
  enum Kind : uint8_t { run, post_recv, wait_recv, post_send, wait_send };
  enum Stream : uint8_t { activations, gradients };
  Kind kind = run;
  Stream stream = activations;
  int64_t op = 0;                      // run: the index of the op in Schedule::ops
  int64_t chunk = 0, micro_batch = 0;  // the transfer's buffer: the slot of micro_batch in chunk (this stage's)
};
std::vector<P2PAction> pipeline_transfers(const Schedule& schedule, int64_t stages, int64_t stage);

}  // namespace moecore::train
