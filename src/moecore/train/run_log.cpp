// The training run's log lines and metrics (run_log.h).
#include "moecore/train/run_log.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <span>
#include <string>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/memory.h"
#include "moecore/train/gemm_peak.h"

namespace moecore::train {

namespace {
EchoLayers echo_layers(const model::GptModel& gpt) {
  EchoLayers v;
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) v.push_back(gpt.moe_echo_stats(l));
  return v;
}
// Over the layers: the worst max/mean received load per EP rank before and after the plan, clones made and bytes of
// weights moved (summed). nullopt without ECHO.
struct EchoSummary {
  double before = 0, after = 0;
  int64_t clones = 0, weight_bytes = 0;
};
std::optional<EchoSummary> echo_summary(const EchoLayers& layers) {
  std::optional<EchoSummary> sum;
  for (const std::optional<moe::EchoStatsHost>& e : layers) {
    if (!e) continue;
    if (!sum) sum.emplace();
    sum->before = std::max(sum->before, e->max_over_mean_before());
    sum->after = std::max(sum->after, e->max_over_mean_after());
    sum->clones += e->clones;
    sum->weight_bytes += e->weight_bytes;
  }
  return sum;
}

// Per-layer router statistics of the last micro-batch: tokens per expert, max/mean load, drops and losses.
void log_moe_layers(const model::GptModel& gpt, const EchoLayers& echo, std::FILE* log) {
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) {
    const moe::RouterStats* stats = gpt.moe_stats(l);
    if (!stats) continue;
    const moe::RouterStatsHost st = moe::router_stats_host(*stats);  // once per logged step
    std::string tpe;
    for (size_t e = 0; e < st.tokens_per_expert.size(); ++e)
      tpe += (e ? "," : "") + std::to_string(st.tokens_per_expert[e]);
    std::fprintf(log,
                 "   moe layer %lld | max/mean load %.3f | dropped %lld | aux %.4f seq %.4f global %.4f z %.4f | "
                 "tokens per expert [%s]\n",
                 static_cast<long long>(l), st.max_over_mean_load(), static_cast<long long>(st.dropped), st.aux_loss,
                 st.seq_aux_loss, st.global_aux_loss, st.z_loss, tpe.c_str());
    if (const std::optional<moe::EchoStatsHost>& e = echo[static_cast<size_t>(l)])
      std::fprintf(log,
                   "   moe layer %lld | echo max/mean received %.3f -> %.3f | clones %lld | weights moved %.3f MiB\n",
                   static_cast<long long>(l), e->max_over_mean_before(), e->max_over_mean_after(),
                   static_cast<long long>(e->clones), static_cast<double>(e->weight_bytes) / (1 << 20));
  }
}
}  // namespace

namespace {

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return buf;
}

std::string progress_bar(int64_t done, int64_t total) {
  constexpr int kWidth = 20;
  const int filled = total > 0 ? static_cast<int>(kWidth * done / total) : kWidth;
  return "[" + std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(kWidth - filled), '.') +
         "]";
}

// The metrics after the head fields (lm loss, learning rate, grad norm, throughput), in the order both sinks write
// them: the step's loss list, the communication shares, the MoE capacity retries and ECHO's plans, the per-layer MoE
// statistics, then the logging flags' metrics (extra).
void emit_metrics(MetricSinks& sinks, const model::GptModel& gpt, int64_t step, double loss, double lr,
                  double grad_norm, const IntervalStats& st, const StepMetrics& losses, bool per_layer,
                  double capacity_retries, const EchoLayers& echo,
                  const std::vector<std::pair<std::string, double>>& extra) {
  std::vector<std::pair<std::string, double>> scalars;
  for (const StepMetric& m : losses.items()) scalars.emplace_back(m.key, m.value);
  if (st.comm_share >= 0) scalars.emplace_back("moe/dispatcher_comm_share", st.comm_share);
  if (st.exposed_share >= 0) scalars.emplace_back("comm/exposed_share", st.exposed_share);
  if (st.grad_reduce_share >= 0) scalars.emplace_back("comm/grad_reduce_share", st.grad_reduce_share);
  if (st.pipeline_wait_share >= 0) scalars.emplace_back("comm/pipeline_wait_share", st.pipeline_wait_share);
  if (capacity_retries >= 0) scalars.emplace_back("moe/capacity_retries", capacity_retries);
  if (const std::optional<EchoSummary> e = echo_summary(echo)) {
    scalars.emplace_back("moe/echo_max_over_mean_before", e->before);
    scalars.emplace_back("moe/echo_max_over_mean_after", e->after);
    scalars.emplace_back("moe/echo_clones", static_cast<double>(e->clones));
    scalars.emplace_back("moe/echo_weight_bytes", static_cast<double>(e->weight_bytes));
  }
  if (per_layer) {
    for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) {
      const moe::RouterStats* stats = gpt.moe_stats(l);
      if (!stats) continue;
      const moe::RouterStatsHost rs = moe::router_stats_host(*stats);  // once per logged step
      const std::string sfx = "_layer_" + std::to_string(l);
      scalars.emplace_back("moe/load_balancing_loss" + sfx, rs.aux_loss);
      scalars.emplace_back("moe/max_over_mean_load" + sfx, rs.max_over_mean_load());
      scalars.emplace_back("moe/dropped_tokens" + sfx, static_cast<double>(rs.dropped));
      for (size_t e = 0; e < rs.tokens_per_expert.size(); ++e)
        scalars.emplace_back("moe/tokens_per_expert" + sfx + "_expert_" + std::to_string(e),
                             static_cast<double>(rs.tokens_per_expert[e]));
      if (const std::optional<moe::EchoStatsHost>& e = echo[static_cast<size_t>(l)]) {
        scalars.emplace_back("moe/echo_max_over_mean_before" + sfx, e->max_over_mean_before());
        scalars.emplace_back("moe/echo_max_over_mean_after" + sfx, e->max_over_mean_after());
        scalars.emplace_back("moe/echo_clones" + sfx, static_cast<double>(e->clones));
        scalars.emplace_back("moe/echo_weight_bytes" + sfx, static_cast<double>(e->weight_bytes));
      }
    }
  }
  scalars.insert(scalars.end(), extra.begin(), extra.end());
  if (sinks.tb) {  // (Megatron's TensorBoard names of the head fields)
    std::vector<std::pair<std::string, double>> all = {{"lm loss", loss},
                                                       {"learning-rate", lr},
                                                       {"grad-norm", grad_norm},
                                                       {"throughput/tokens_per_s", st.tokens_per_s},
                                                       {"throughput/tflops", st.tflops}};
    all.insert(all.end(), scalars.begin(), scalars.end());
    sinks.tb->add_scalars(step, all);
    sinks.tb->flush();
  }
  if (sinks.jsonl) {
    io::MetricFields f = {{"iteration", step},
                          {"lm_loss", loss},
                          {"grad_norm", grad_norm},
                          {"lr", lr},
                          {"tokens_per_s", st.tokens_per_s},
                          {"tflops", st.tflops}};
    for (const auto& [key, v] : scalars) f.emplace_back(key, v);
    sinks.jsonl->write(f);
  }
}

// " | name value" pieces of the log line.
void append(std::string& s, const char* fmt, auto... v) {
  char b[128];
  std::snprintf(b, sizeof b, fmt, v...);
  s += b;
}

// The logged step's optimizer fields: the loss scale under loss scaling, the grad norm, and Megatron's num zeros and
// params norm with their flags.
std::string format_optimizer_fields(const StepResult& r, bool loss_scaling) {
  std::string s;
  if (loss_scaling) append(s, "loss scale %.1f | ", static_cast<double>(r.loss_scale));
  if (r.skipped)
    s += "grad norm - (step skipped)";  // a skipped step has no update, so no norm to show
  else
    append(s, "grad norm %.3f", r.stats.grad_norm);
  if (!std::isnan(r.num_zeros)) append(s, " | num zeros: %.1f", r.num_zeros);
  if (!std::isnan(r.params_norm)) append(s, " | params norm: %.3f", r.params_norm);
  return s;
}

}  // namespace

RunLog::RunLog(model::GptModel& gpt, const TrainConfig& cfg, const TrainGroups& g, int64_t first_iteration,
               std::FILE* log, Timers* timers)
    : gpt_(gpt),
      cfg_(cfg),
      g_(g),
      micro_per_rank_(cfg.micro_batches() / g.dp.size()),
      log_(log),
      timers_(timers),
      first_iteration_(first_iteration),
      world_size_(g.world_size()),
      flops_per_step_(gpt.flops_per_step() * static_cast<double>(cfg.micro_batches())),
      peak_gflops_(cfg.peak_gflops) {
  const bool writes_metrics = g.dp.rank() == 0 && g.tp.rank() == 0 && g.cp.rank() == 0 && g.pp.rank() == 0;
  if (writes_metrics && !cfg.metrics_jsonl.empty())
    sinks_.jsonl = std::make_unique<io::JsonlMetricsWriter>(cfg.metrics_jsonl);
  if (writes_metrics && !cfg.tensorboard_dir.empty())
    sinks_.tb = std::make_unique<io::TensorBoardWriter>(cfg.tensorboard_dir);
}

void RunLog::step(int64_t it, const StepResult& r, float lr, int64_t consumed_samples, double grad_reduce_blocked,
                  double pipeline_wait) {
  if (r.skipped && !r.overflow && log_ && cfg_.logs_at(TrainConfig::kLogWarning))  // (overflows: the line's count)
    std::fprintf(log_, " iteration %lld: non-finite value in %s, step skipped\n", static_cast<long long>(it + 1),
                 r.nonfinite.c_str());
  loss_acc_ += r.skipped ? 0.0 : r.loss;
  const std::vector<StepMetric>& m = r.metrics.items();
  metric_acc_.resize(m.size(), 0.0);  // (the list is the model's: the same every step)
  for (size_t k = 0; k < m.size() && !r.skipped; ++k) metric_acc_[k] += m[k].value;
  logged_steps_ += r.skipped ? 0 : 1;
  skipped_ += r.skipped ? 1 : 0;
  retries_ += r.retried ? 1 : 0;
  grad_reduce_blocked_ += grad_reduce_blocked;
  pipeline_wait_ += pipeline_wait;
  if (cfg_.logs_step(it)) interval(it, r, lr, consumed_samples);
}

void RunLog::validation(int64_t it, double v) {
  if (log_) {
    std::fprintf(log_, " validation loss at iteration %lld: %.4f (ppl %.2f)\n", static_cast<long long>(it + 1), v,
                 std::exp(v));
    std::fflush(log_);
  }
  if (sinks_.tb) sinks_.tb->add_scalar("lm loss validation", it + 1, v);
  if (sinks_.tb && cfg_.log_validation_ppl) sinks_.tb->add_scalar("lm loss validation ppl", it + 1, std::exp(v));
  if (!sinks_.jsonl) return;
  io::MetricFields f = {{"iteration", it + 1}, {"valid_lm_loss", v}};
  if (cfg_.log_validation_ppl) f.emplace_back("valid_lm_loss_ppl", std::exp(v));
  sinks_.jsonl->write(f);
}

void RunLog::exclude(std::chrono::steady_clock::duration d) {
  t_last_ += d;
  gpt_.reset_dispatcher_comm_seconds();
  blocked_last_ = comm_blocked_seconds();
}

IntervalStats RunLog::take_interval_stats() {
  IntervalStats st;
  const auto now = std::chrono::steady_clock::now();
  const double span = std::max(std::chrono::duration<double>(now - t_last_).count(), 1e-9);
  t_last_ = now;
  st.dt = span / static_cast<double>(cfg_.log_interval);
  st.tokens_per_s = static_cast<double>(cfg_.global_batch_size * gpt_.config().seq_length) / std::max(st.dt, 1e-9);
  st.tflops = flops_per_step_ / std::max(st.dt, 1e-9) / 1e12;
  // Expert parallelism: the share of step time inside the dispatcher's collectives on this rank.
  if (gpt_.ep_size() > 1) st.comm_share = gpt_.dispatcher_comm_seconds() / span;
  gpt_.reset_dispatcher_comm_seconds();
  // Every collective's blocking time (this rank): the share of the interval the computation waited for peers; and
  // the part of it spent in the gradient reduction.
  const double blocked = comm_blocked_seconds();
  if (world_size_ > 1) st.exposed_share = (blocked - blocked_last_) / span;
  blocked_last_ = blocked;
  if (world_size_ > 1) st.grad_reduce_share = grad_reduce_blocked_ / span;
  grad_reduce_blocked_ = 0;
  // Pipelines: the share of the interval the stages waited for each other, averaged over the stages (collective over
  // pp), next to the schedule's bubble (p - 1) / (v * m + p - 1) for this rank's m micro-batches per step through v
  // model chunks (v = 1: 1F1B; interleaved, each chunk's passes take 1 / v of the time).
  if (g_.pp.size() > 1) {
    double w = pipeline_wait_ / span;
    all_reduce_sum(std::span<double>(&w, 1), g_.pp);
    const double p = g_.pp.size();
    st.pipeline_wait_share = w / p;
    st.bubble = (p - 1) / (static_cast<double>(gpt_.num_chunks() * micro_per_rank_) + p - 1);
  }
  pipeline_wait_ = 0;
  return st;
}

// The log line's fields after the model TFLOP/s: Megatron's throughput per GPU, MFU, the communication shares, the
// MoE capacity retries, skipped steps and ECHO's plans.
std::string RunLog::format_run_fields(const IntervalStats& st, const EchoLayers& echo) {
  std::string s;
  if (cfg_.log_throughput) append(s, " | throughput per GPU (TFLOP/s/GPU): %.1f", st.tflops / world_size_);
  if (peak_gflops_ > 0) {
    // Above 100% the start-up peak was measured on a busy machine: measure again, keep the best.
    // The peak is one rank's: the run's is world_size times that (every rank measured its own threads).
    if (st.tflops * 1e3 > peak_gflops_ * world_size_)
      peak_gflops_ = std::max(peak_gflops_, gemm_peak_gflops(gpt_.config().compute_dtype, gpt_.device()));
    append(s, " | MFU %.1f%%", 100.0 * st.tflops * 1e3 / (peak_gflops_ * world_size_));
  }
  if (st.comm_share >= 0) append(s, " | %s %.1f%%", gpt_.dispatcher_name(), 100.0 * st.comm_share);
  if (st.exposed_share >= 0) append(s, " | comm %.1f%%", 100.0 * st.exposed_share);
  if (st.pipeline_wait_share >= 0)
    append(s, " | pipeline wait %.1f%% (%s bubble %.1f%%)", 100.0 * st.pipeline_wait_share,
           gpt_.num_chunks() > 1 ? "interleaved 1F1B" : "1F1B", 100.0 * st.bubble);
  if (gpt_.moe_static_capacity()) append(s, " | capacity retries %lld", static_cast<long long>(retries_));
  if (skipped_ > 0)  // Megatron's "number of skipped iterations"
    append(s, " | skipped iterations %lld", static_cast<long long>(skipped_));
  if (const std::optional<EchoSummary> e = echo_summary(echo))
    append(s, " | echo max/mean %.2f -> %.2f, %lld clones", e->before, e->after, static_cast<long long>(e->clones));
  return s;
}

// The metrics of Megatron's logging flags (trainer.h): params-norm, num-zeros, iteration-time, throughput, the
// "<timer>-time"s and the device memory.
std::vector<std::pair<std::string, double>> RunLog::flag_metrics(const StepResult& r, const IntervalStats& st,
                                                                 const TimerReport& timers) const {
  std::vector<std::pair<std::string, double>> out;
  if (cfg_.log_loss_scale_to_tensorboard) out.emplace_back("loss-scale", static_cast<double>(r.loss_scale));
  if (!std::isnan(r.num_zeros)) out.emplace_back("num-zeros", r.num_zeros);
  if (!std::isnan(r.params_norm)) out.emplace_back("params-norm", r.params_norm);
  if (cfg_.log_timers_to_tensorboard) {
    out.emplace_back("iteration-time", st.dt);
    if (cfg_.log_throughput) out.emplace_back("throughput", st.tflops / world_size_);
    const auto t = timers_metrics(timers, cfg_.log_interval);
    out.insert(out.end(), t.begin(), t.end());
  }
  if (cfg_.log_memory_to_tensorboard) {
    // (run_log.h: what each counts)
    const Device d = gpt_.device();
    const DeviceMemoryStats m = memory_device_stats(d);
    const int64_t reserved = d == Device::cuda ? device_memory_reserved_bytes() : memory_resident_bytes();
    out.emplace_back("mem-reserved-bytes", static_cast<double>(reserved));
    out.emplace_back("mem-allocated-bytes", static_cast<double>(m.current));
    out.emplace_back("mem-max-allocated-bytes", static_cast<double>(m.peak));
    out.emplace_back("mem-allocated-count", static_cast<double>(m.count));
  }
  return out;
}

void RunLog::interval(int64_t it, const StepResult& r, float lr, int64_t consumed_samples) {
  const auto& m = gpt_.config();
  const EchoLayers echo = echo_layers(gpt_);
  const IntervalStats st = take_interval_stats();
  const double elapsed = std::chrono::duration<double>(t_last_ - t_start_).count();
  const TimerReport timers = timers_ ? timers_gather(*timers_, g_) : TimerReport{};  // (collective)
  const double mean_loss = logged_steps_ ? loss_acc_ / static_cast<double>(logged_steps_) : NAN;
  StepMetrics losses = r.metrics;  // the interval's: the mean of the averaged entries, the logged step's others
  std::string loss_text;
  for (size_t k = 0; k < losses.items().size(); ++k) {
    StepMetric& l = losses.items()[k];
    if (l.over_interval == MetricInterval::mean)
      l.value = logged_steps_ ? metric_acc_[k] / static_cast<double>(logged_steps_) : NAN;
    append(loss_text, " | %s %.4f", l.label.c_str(), l.value);
  }
  std::fill(metric_acc_.begin(), metric_acc_.end(), 0.0);
  const double eta =
      elapsed / static_cast<double>(it + 1 - first_iteration_) * static_cast<double>(cfg_.train_iters - it - 1);
  if (log_) {
    std::fprintf(log_,
                 " iteration %6lld/%6lld | consumed tokens %10lld | lr %.3e | lm loss %.4f%s | %s | "
                 "%.0f tokens/s | %.3f TFLOP/s%s | ETA %s %s\n",
                 static_cast<long long>(it + 1), static_cast<long long>(cfg_.train_iters),
                 static_cast<long long>(consumed_samples * m.seq_length), lr, mean_loss, loss_text.c_str(),
                 format_optimizer_fields(r, cfg_.grad_scaler.kind != GradScalerConfig::Kind::none).c_str(),
                 st.tokens_per_s, st.tflops, format_run_fields(st, echo).c_str(), format_duration(eta).c_str(),
                 progress_bar(it + 1, cfg_.train_iters).c_str());
    if (cfg_.logs_at(TrainConfig::kLogInfo)) {
      if (cfg_.moe_per_layer_logging) log_moe_layers(gpt_, echo, log_);
      const std::string block = timers_format(timers, cfg_.timing_log_option, cfg_.log_interval);
      if (!block.empty()) std::fprintf(log_, "%s\n", block.c_str());
    }
    std::fflush(log_);
  }
  emit_metrics(sinks_, gpt_, it + 1, mean_loss, lr, r.skipped ? NAN : r.stats.grad_norm, st, losses,
               cfg_.moe_per_layer_logging, gpt_.moe_static_capacity() ? static_cast<double>(retries_) : -1.0, echo,
               flag_metrics(r, st, timers));
  retries_ = 0;
  skipped_ = 0;
  loss_acc_ = 0;
  logged_steps_ = 0;
}

}  // namespace moecore::train
