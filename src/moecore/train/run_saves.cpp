#include "moecore/train/run_saves.h"

#include <string>

#include "moecore/core/memory.h"
#include "moecore/io/checkpoint.h"

namespace moecore::train {

RunSaves::RunSaves(const TrainConfig& cfg, Optimizer& opt, std::FILE* log) : cfg_(cfg), opt_(opt), log_(log) {
  if (cfg.async_save && !cfg.save.empty()) async_.emplace(cfg.use_persistent_ckpt_worker, cfg.async_ckpt_cpu_priority);
}

void RunSaves::save(const TrainProgress& progress, const OptParamSchedulerState& scheduler,
                    const std::optional<GradScalerState>& grad_scaler) {
  opt_.settle();
  if (cfg_.save.empty()) return;
  commit(/*blocking=*/true, progress.iteration);  // at most one save in flight
  const CheckpointSaveOptions parts{cfg_.save_optim, cfg_.save_rng, scheduler, grad_scaler, cfg_.hf_config_json};
  try {
    opt_.save(cfg_.save, progress, cfg_.seed, cfg_.keep_last, parts, async_ ? &*async_ : nullptr);
  } catch (const Error& e) {
    failed(e, progress.iteration, progress.iteration);
  }
  if (log_ && async_)
    std::fprintf(log_, " saving checkpoint at iteration %lld to %s in the background (a snapshot of %s in memory)\n",
                 static_cast<long long>(progress.iteration), cfg_.save.c_str(),
                 memory_format_bytes(async_->snapshot_bytes()).c_str());
  else if (log_)
    std::fprintf(log_, " saved checkpoint at iteration %lld to %s\n", static_cast<long long>(progress.iteration),
                 cfg_.save.c_str());
}

void RunSaves::commit(bool blocking, int64_t iteration) {
  const std::optional<int64_t> pending = async_ ? async_->in_flight() : std::nullopt;
  if (!pending) return;
  std::optional<int64_t> done;
  try {
    done = async_->finalize(blocking);
  } catch (const Error& e) {
    failed(e, *pending, iteration);
  }
  if (done && log_)
    std::fprintf(log_,
                 " saved checkpoint at iteration %lld to %s (written in the background in %.1f s, %.1f s of the "
                 "writer's CPU; committed after iteration %lld)\n",
                 static_cast<long long>(*done), cfg_.save.c_str(), async_->last_write_seconds(),
                 async_->last_writer_cpu_seconds(), static_cast<long long>(iteration));
}

// The save of iteration `checkpoint` failed, found with `iteration` steps done.
void RunSaves::failed(const Error& e, int64_t checkpoint, int64_t iteration) const {
  const auto kept = io::checkpoint_read_tracker(cfg_.save);
  MOECORE_FAIL(e.what(), "; training stops at iteration ", iteration, " without ",
               checkpoint == iteration ? std::string("this checkpoint")
                                       : "the checkpoint of iteration " + std::to_string(checkpoint),
               "; ",
               kept ? "the newest valid checkpoint is still iteration " + std::to_string(*kept) +
                          " (resume with --load " + cfg_.save + ")"
                    : std::string("no checkpoint was committed under ") + cfg_.save,
               ", free space or fix the error first");
}

}  // namespace moecore::train
