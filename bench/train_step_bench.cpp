#include "bench/train_step_bench.h"

#include <algorithm>
#include <cstdio>

#include "bench/bench_util.h"
#include "moecore/core/rng.h"
#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"

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
        plan(gpt.memory_plan(opt.state_bytes_per_param())),
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
JsonLine train_step_line_head(const model::ModelConfig& cfg, int64_t micro_batch, double flops) {
  JsonLine line;
  line.add("name", "train_step")
      .add("dtype", std::string(dtype_name(cfg.compute_dtype)))
      .add("layers", cfg.num_layers)
      .add("hidden", cfg.hidden_size)
      .add("seq", cfg.seq_length)
      .add("micro_batch", micro_batch)
      .add("model_gflop_per_step", flops / 1e9);
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
  // The peak of the compute dtype through ops::gemm; for bf16 also the f32 peak, since hosts without a bf16
  // matmul widen bf16 operands to f32 (then the two are close and the f32 one is the stricter reference).
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
  return {line.str()};
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
