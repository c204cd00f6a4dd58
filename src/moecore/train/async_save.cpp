// The asynchronous save: checkpoint_save_begin and a serialized snapshot at the save point, the worker's writes in the
// background, and the agreement and checkpoint_save_finish at a step boundary, all collectives on the training thread.
#include "moecore/train/async_save.h"

#include <span>
#include <utility>
#include <vector>

#include "moecore/core/memory.h"
#include "moecore/io/safetensors.h"
#include "moecore/model/param_specs.h"

namespace moecore::train {
namespace {

// The sum of `v` over every rank of the run (each group is a factor of the world, so summing over one after the other
// counts every rank once).
int64_t sum_over_run(int64_t v, const TrainGroups& g) {
  for (const ProcessGroup* grp : {&g.dp, &g.tp, &g.cp, &g.pp})
    if (grp->size() > 1) all_reduce_sum(std::span<int64_t>(&v, 1), *grp);
  return v;
}

}  // namespace

AsyncCheckpointSaver::AsyncCheckpointSaver(bool persistent_worker, int cpu_priority)
    : persistent_(persistent_worker), worker_(persistent_worker, cpu_priority) {}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (held_bytes_ > 0) memory_record_free(MemCategory::other, held_bytes_, Device::cpu);
}

std::optional<int64_t> AsyncCheckpointSaver::in_flight() const {
  return flight_ ? std::optional<int64_t>(flight_->iteration) : std::nullopt;
}

void AsyncCheckpointSaver::save(const std::string& root, const model::GptModel& gpt, const OptimizerState& opt,
                                const TrainProgress& progress, uint64_t seed, int keep_last, const TrainGroups* groups,
                                const CheckpointSaveOptions& options) {
  finalize(/*blocking=*/true);
  groups_ = groups ? *groups : TrainGroups{};
  CheckpointSaveInFlight s = checkpoint_save_begin(root, gpt, opt, progress, seed, keep_last, groups, options);
  // The snapshot: each file serialized now, so the next steps cannot change what is written (the tensors of `files`
  // may be the model's own). The worker then only writes and checksums. A persistent worker's buffers are reused.
  std::vector<io::CheckpointWorkerFile> files;
  snapshot_bytes_ = 0;
  for (const auto& [name, tensors] : s.files) {
    auto kept = kept_.find(name);
    files.push_back({name, kept != kept_.end() ? std::move(kept->second) : io::HostBuffer()});
    io::HostBuffer& buf = files.back().bytes;
    io::safetensors_serialize_to(tensors, [&](size_t n) { return buf.resize(n); });
    snapshot_bytes_ += static_cast<int64_t>(buf.size());
  }
  s.files.clear();
  kept_.clear();  // (buffers of files this save does not write)
  int64_t held = 0;
  for (const io::CheckpointWorkerFile& f : files) held += static_cast<int64_t>(f.bytes.capacity());
  account(held);
  if (!files.empty()) worker_.submit(s.staging_dir, std::move(files));
  flight_ = std::move(s);
}

void AsyncCheckpointSaver::account(int64_t held) {
  if (held > held_bytes_) memory_record_alloc(MemCategory::other, held - held_bytes_, Device::cpu);
  if (held < held_bytes_) memory_record_free(MemCategory::other, held_bytes_ - held, Device::cpu);
  held_bytes_ = held;
}

std::optional<int64_t> AsyncCheckpointSaver::finalize(bool blocking) {
  if (!flight_) return std::nullopt;
  // Megatron's is_current_async_call_done: every rank tells whether its writer is still busy; all decide alike.
  if (!blocking && sum_over_run(worker_.busy() && !worker_.done() ? 1 : 0, groups_) > 0) return std::nullopt;
  io::CheckpointWorkerResult r;
  std::vector<io::CheckpointWorkerFile> files;
  if (worker_.busy()) r = worker_.take(&files);
  last_write_seconds_ = r.seconds;
  last_writer_cpu_seconds_ = r.cpu_seconds;
  int64_t held = 0;
  if (persistent_)
    for (io::CheckpointWorkerFile& f : files) {
      held += static_cast<int64_t>(f.bytes.capacity());
      kept_[f.name] = std::move(f.bytes);
    }
  account(held);
  const CheckpointSaveInFlight s = std::move(*flight_);
  flight_.reset();  // whatever the finish does, this save is no longer in flight
  checkpoint_save_finish(s, r.written, r.error, &groups_);
  return s.iteration;
}

int64_t async_save_snapshot_bytes(const model::ModelConfig& cfg, DType moment_dtype, bool save_optim) {
  int64_t n = 0;
  for (const model::ParamSpec& p : model::parameter_specs(cfg)) n += p.shape.numel();
  int64_t bytes = n * static_cast<int64_t>(dtype_size(DType::f32));
  if (save_optim) bytes += 2 * n * static_cast<int64_t>(dtype_size(moment_dtype));
  if (cfg.moe.enabled() && cfg.moe.enable_expert_bias)
    for (const model::LayerSpec& l : model::layer_specs(cfg))
      if (l.mlp == model::MlpKind::moe) bytes += cfg.moe.num_experts * static_cast<int64_t>(dtype_size(DType::f32));
  return bytes;
}

}  // namespace moecore::train
