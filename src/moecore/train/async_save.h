// Asynchronous checkpoint saves (Megatron's --async-save): at the save point the state is snapshotted into host memory
// (serialized into page-aligned buffers: device tensors copied too), a background worker (io/checkpoint_worker.h)
// writes this rank's files into the staging directory while training goes on, and the commit (rename, COMMIT, tracker,
// retention) runs on the training thread at a later step boundary once every rank's files are durable: a non-blocking
// check of the local worker, a small collective to agree, then the collective finish of checkpointing.h (Megatron's
// maybe_finalize_async_save). The files are those of save_training_checkpoint, byte for byte. At most one save is in
// flight: a new one first finishes the previous (Megatron's persistent worker does the same).
// Not here: what a checkpoint holds (checkpointing.h), when the run saves (trainer.h).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "moecore/io/checkpoint_worker.h"
#include "moecore/train/checkpointing.h"

namespace moecore::train {

// Threading: every method runs on the training thread; only the worker's file writes run on another.
class AsyncCheckpointSaver {
 public:
  // persistent_worker (--use-persistent-ckpt-worker): one writer thread for the saver's life; else one per save.
  // cpu_priority (--async-ckpt-cpu-priority): the writer's nice value (io/checkpoint_worker.h).
  explicit AsyncCheckpointSaver(bool persistent_worker, int cpu_priority = io::CheckpointWorker::kDefaultCpuPriority);
  // A save still in flight (the run is ending with an Error) is abandoned: its worker is waited for and nothing is
  // committed, so the previous committed checkpoint stays the newest; its staging directory is removed by the next
  // save.
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // The arguments of save_training_checkpoint; collective as it. First finishes the save in flight (blocking; its
  // failure is thrown here), then snapshots this rank's files and hands them to the worker. On return training may
  // change gpt and opt: the snapshot holds the state of the call.
  void save(const std::string& root, const model::GptModel& gpt, const OptimizerState& opt,
            const TrainProgress& progress, uint64_t seed, int keep_last, const TrainGroups* groups,
            const CheckpointSaveOptions& options);

  // At a step boundary (every rank calls it alike; collective over the ranks of the save while one is in flight):
  // commits the save in flight once every rank's worker has finished and returns its iteration; nullopt when nothing
  // is in flight or some rank is still writing. blocking: waits for this rank's worker first (the end of a run). A
  // write that failed on any rank throws Error on every rank (the failing rank's names the file, the byte offset and
  // the errno's text); nothing is committed and the staging directory is removed.
  std::optional<int64_t> finalize(bool blocking);

  std::optional<int64_t> in_flight() const;                   // the iteration of the save in flight
  int64_t snapshot_bytes() const { return snapshot_bytes_; }  // host bytes of this rank's last snapshot (0: none)
  // This rank's writer on the last save finalized: wall time and CPU time (0 when it had nothing to write).
  double last_write_seconds() const { return last_write_seconds_; }
  double last_writer_cpu_seconds() const { return last_writer_cpu_seconds_; }

 private:
  void account(int64_t held);  // the memory accounting's record of the snapshot buffers (category other)

  const bool persistent_;
  // The snapshot's buffers between saves (persistent worker: reused, so a snapshot after the first costs no page
  // faults; the host memory stays held from the first save on). Declared before the worker, which may still hold the
  // others when the saver is destroyed.
  std::map<std::string, io::HostBuffer> kept_;
  io::CheckpointWorker worker_;
  std::optional<CheckpointSaveInFlight> flight_;
  TrainGroups groups_;
  int64_t snapshot_bytes_ = 0, held_bytes_ = 0;
  double last_write_seconds_ = 0, last_writer_cpu_seconds_ = 0;
};

// An upper bound of the host memory one rank's snapshot holds while a save is in flight: the whole checkpoint's data
// (f32 weights and expert biases, with save_optim both AdamW moments in moment_dtype): the committer (rank 0) holds at
// most that, the other ranks their expert files or nothing. A memory plan adds it when --async-save is on.
int64_t async_save_snapshot_bytes(const model::ModelConfig& cfg, DType moment_dtype, bool save_optim);

}  // namespace moecore::train
