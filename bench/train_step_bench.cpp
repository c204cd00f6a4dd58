#include "bench/train_step_bench.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "bench/bench_util.h"
#include "moecore/core/rng.h"
#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "moecore/train/async_save.h"

namespace moecore::bench {
namespace {

// The model (on `device`), its optimizer and plan, and one random batch in host memory.
struct TrainStepSetup {
  model::GptModel gpt;
  optim::AdamW opt;
  model::MemoryPlan plan;
  int64_t N;  // tokens per step
  Tensor tokens, labels;

  TrainStepSetup(const model::ModelConfig& cfg, int64_t micro_batch, Device device)
      : gpt(cfg, micro_batch, 1234, {}, device),
        opt(gpt.params(), optim::AdamWConfig{}),
        plan(gpt.memory_plan([&](const Param&) { return opt.state_bytes_per_param(); })),
        N(micro_batch * cfg.seq_length) {
    std::fprintf(stderr, "train-step: %s, micro-batch %lld, %lld parameters%s%s\n%s", cfg.summary().c_str(),
                 static_cast<long long>(micro_batch), static_cast<long long>(gpt.num_parameters()),
                 device == Device::cpu ? "" : ", on ", device == Device::cpu ? "" : device_name(device),
                 plan.format().c_str());
    tokens = Tensor::empty({micro_batch, cfg.seq_length}, DType::i32, MemCategory::other);
    labels = Tensor::empty({micro_batch, cfg.seq_length}, DType::i32, MemCategory::other);
    for (int64_t i = 0; i < N; ++i) {
      tokens.data<int32_t>()[i] =
          static_cast<int32_t>(philox_uniform(philox_key(1, "bench.tokens"), i) * cfg.vocab_size);
      labels.data<int32_t>()[i] =
          static_cast<int32_t>(philox_uniform(philox_key(1, "bench.labels"), i) * cfg.vocab_size);
    }
  }
  double step() {
    gpt.zero_grad();
    const auto r = gpt.forward_backward(tokens, labels, 1.0f);
    opt.step(1e-4f);
    gpt.refresh_compute_weights();
    return r.mean();
  }
};

// The head of a train_step line (host and device): the model's sizes and its FLOPs per step.
JsonLine train_step_line_head(const model::ModelConfig& cfg, int64_t micro_batch, double flops,
                              const char* name = "train_step") {
  JsonLine line;
  line.add("name", name)
      .add("dtype", std::string(dtype_name(cfg.compute_dtype)))
      .add("layers", cfg.num_layers)
      .add("hidden", cfg.hidden_size)
      .add("seq", cfg.seq_length)
      .add("micro_batch", micro_batch)
      .add("model_gflop_per_step", flops / 1e9);
  return line;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}
double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
double minimum(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
}

// Step time while an asynchronous checkpoint save (--async-save, persistent worker at nice `worker_nice`; -1: the
// training thread's) of this model and its AdamW moments is written in the background, against steps without a save:
// kCycles times `steps` steps without a save then a save and the steps until it is committed, then `steps` more without
// (alternated because a shared host's load drifts; the medians and minima resist it too). The worker's CRC32C and
// writes compete with the step's threads for the host's cores; the training thread's own costs of a save are the
// snapshot at the save point and the commit at the step boundary where every file is durable; a synchronous save of
// the same checkpoint is timed first. The checkpoints go to a temporary directory, removed after.
JsonLine async_save_line(TrainStepSetup& s, const model::ModelConfig& cfg, int64_t micro_batch, int steps,
                         int worker_nice) {
  namespace fs = std::filesystem;
  constexpr int kCycles = 3;
  constexpr size_t kMaxSteps = 200;  // a bound on the steps timed during one save
  const fs::path dir = fs::temp_directory_path() / ("moecore_bench_async_save_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::vector<double> without, during, snapshot, commit, write, writer_cpu;
  auto timed_step = [&](std::vector<double>& into) {
    const double t0 = now_seconds();
    s.step();
    into.push_back(now_seconds() - t0);
  };
  double t_sync = now_seconds();  // the same checkpoint saved synchronously: what the step would wait for
  train::save_training_checkpoint(dir.string(), s.gpt, s.opt, {0, 0}, 1234, 1);
  t_sync = now_seconds() - t_sync;
  train::AsyncCheckpointSaver saver(/*persistent_worker=*/true, worker_nice);
  int64_t bytes = 0, outlasted = 0;
  for (int c = 0; c < kCycles; ++c) {
    for (int i = 0; i < steps; ++i) timed_step(without);
    double t0 = now_seconds();
    saver.save(dir.string(), s.gpt,
               train::OptimizerState::adam(s.opt.exp_avg(), s.opt.exp_avg_sq(), s.opt.steps_taken()), {c + 1, c + 1},
               1234, 1, nullptr, {});
    snapshot.push_back(now_seconds() - t0);
    bytes = saver.snapshot_bytes();
    for (size_t n = 0; saver.in_flight() && n < kMaxSteps; ++n) {
      timed_step(during);
      t0 = now_seconds();
      if (saver.finalize(/*blocking=*/false)) commit.push_back(now_seconds() - t0);
    }
    if (saver.in_flight()) {
      ++outlasted;
      saver.finalize(/*blocking=*/true);
    }
    write.push_back(saver.last_write_seconds());
    writer_cpu.push_back(saver.last_writer_cpu_seconds());
  }
  for (int i = 0; i < steps; ++i) timed_step(without);
  fs::remove_all(dir);
  const double base = mean(without), busy = mean(during);
  JsonLine line = train_step_line_head(cfg, micro_batch, s.gpt.flops_per_step(), "train_step_async_save");
  line.add("host_threads", static_cast<int64_t>(std::thread::hardware_concurrency()))
      .add("worker_nice", worker_nice)
      .add("checkpoint_bytes", bytes)
      .add("saves", kCycles)
      .add("saves_outlasting_the_steps", outlasted)
      .add("steps_without_save", static_cast<int64_t>(without.size()))
      .add("steps_during_save", static_cast<int64_t>(during.size()))
      .add("step_seconds_mean_without_save", base)
      .add("step_seconds_mean_during_save", busy)
      .add("ratio_during_save", base > 0 ? busy / base : 0.0)
      .add("ratio_of_medians", median(without) > 0 ? median(during) / median(without) : 0.0)
      .add("ratio_of_minima", minimum(without) > 0 ? minimum(during) / minimum(without) : 0.0)
      .add("write_seconds_mean", mean(write))
      .add("writer_cpu_seconds_mean", mean(writer_cpu))
      .add("snapshot_seconds_mean", mean(snapshot))
      .add("snapshot_over_step", base > 0 ? mean(snapshot) / base : 0.0)
      .add("commit_seconds_mean", mean(commit))
      .add("synchronous_save_seconds", t_sync);
  return line;
}

}  // namespace

std::vector<std::string> bench_train_step(const model::ModelConfig& cfg, int64_t micro_batch, int steps) {
  const int64_t rss_before = memory_resident_bytes();
  TrainStepSetup s(cfg, micro_batch, Device::cpu);
  const model::GptModel& gpt = s.gpt;
  const model::MemoryPlan& plan = s.plan;
  const int64_t N = s.N;
  double loss = s.step();  // warm-up: primitive creation, first touch of every buffer
  double best = 1e30, total = 0;
  for (int i = 0; i < steps; ++i) {
    const double t0 = now_seconds();
    loss = s.step();
    const double dt = now_seconds() - t0;
    best = std::min(best, dt);
    total += dt;
  }
  const double flops = gpt.flops_per_step();
  // The peak of the compute dtype through ops::gemm; for bf16 also the f32 peak, since where the bf16 GEMMs are
  // widened to f32 (kernels/cpu_isa.h) the two are close and the f32 one is the stricter reference.
  const double peak = gemm_peak_gflops(cfg.compute_dtype);
  const double f32_peak = cfg.compute_dtype == DType::f32 ? peak : gemm_peak_gflops(DType::f32);
  const double achieved = flops / best / 1e9;
  const int64_t hwm = memory_resident_peak_bytes();
  const MemoryStats ms = memory_stats();
  JsonLine line = train_step_line_head(cfg, micro_batch, flops);
  line.add("step_seconds_best", best)
      .add("step_seconds_mean", total / std::max(steps, 1))
      .add("tokens_per_s", static_cast<double>(N) / best)
      .add("gflops", achieved)
      .add("peak_gflops", peak)
      .add("ratio", achieved / peak)
      .add("f32_peak_gflops", f32_peak)
      .add("ratio_to_f32_peak", achieved / f32_peak)
      .add("loss", loss)
      .add("plan_bytes", plan.total())
      .add("tracked_peak_bytes", ms.total_peak)
      .add("rss_peak_bytes", hwm)
      .add("rss_before_model_bytes", rss_before)
      .add("rss_peak_over_plan", static_cast<double>(hwm) / static_cast<double>(plan.total()));
  add_bf16_gemm(line, cfg.compute_dtype);
  // The writer at Megatron's default nice value, then at the training thread's (-1: unchanged).
  return {line.str(), async_save_line(s, cfg, micro_batch, std::max(steps, 1), 10).str(),
          async_save_line(s, cfg, micro_batch, std::max(steps, 1), -1).str()};
}

std::vector<std::string> bench_train_step_device(const model::ModelConfig& cfg, int64_t micro_batch,
                                                 const DeviceRun& run, const DevicePeaks& peaks) {
  memory_reset_peaks();  // the peak measurement's buffers are gone: tracked_peak_bytes is the step's
  TrainStepSetup s(cfg, micro_batch, run.device);
  double loss = 0;
  const StageTimes t = device_time_stages(run, {[&] { loss = s.step(); }});
  const double flops = s.gpt.flops_per_step();
  JsonLine line = train_step_line_head(cfg, micro_batch, flops);
  line.add("tokens_per_s", static_cast<double>(s.N) / (t.total_ms * 1e-3))
      .add("loss", loss)
      .add("plan_bytes", s.plan.total())
      .add("tracked_peak_bytes", memory_stats().total_peak);
  return {add_device_speed(line, run, peaks, t.total_ms, flops).str()};
}

}  // namespace moecore::bench
