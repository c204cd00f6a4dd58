// The training run's log lines and metrics (run_log.h).
#include "moecore/train/run_log.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <span>
#include <string>

#include "moecore/train/gemm_peak.h"

namespace moecore::train {

namespace {
std::string format_moe_losses(const moe::MoeConfig& mc, const MoeStepLosses& l) {
  std::string s;
  if (!mc.enabled()) return s;
  char buf[64];
  auto add = [&](const char* name, double v) {
    std::snprintf(buf, sizeof buf, " | %s %.4f", name, v);
    s += buf;
  };
  if (mc.uses(moe::LoadBalancing::aux_loss)) add("load_balancing_loss", l.aux_loss);
  if (mc.uses(moe::LoadBalancing::seq_aux_loss)) add("seq_load_balancing_loss", l.seq_aux_loss);
  if (mc.uses(moe::LoadBalancing::global_aux_loss)) add("global_load_balancing_loss", l.global_aux_loss);
  if (mc.z_loss_coeff > 0) add("z_loss", l.z_loss);
  return s;
}
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

void emit_metrics(MetricSinks& sinks, const model::GptModel& gpt, int64_t step, double loss, double lr,
                  double grad_norm, double tokens_per_s, double tflops, const MoeStepLosses& moe_losses, bool per_layer,
                  double comm_share, double exposed_comm_share, double grad_reduce_share, double pipeline_wait_share,
                  const std::vector<double>& mtp_losses, double capacity_retries, const EchoLayers& echo) {
  const moe::MoeConfig& mc = gpt.config().moe;
  std::vector<std::pair<std::string, double>> scalars = {{"lm loss", loss},
                                                         {"learning-rate", lr},
                                                         {"grad-norm", grad_norm},
                                                         {"throughput/tokens_per_s", tokens_per_s},
                                                         {"throughput/tflops", tflops}};
  for (size_t k = 0; k < mtp_losses.size(); ++k)  // Megatron's "mtp_<k> loss", one per depth
    scalars.emplace_back("mtp_" + std::to_string(k + 1) + "_loss", mtp_losses[k]);
  if (mc.enabled() && mc.uses(moe::LoadBalancing::aux_loss))
    scalars.emplace_back("load_balancing_loss", moe_losses.aux_loss);
  if (mc.enabled() && mc.uses(moe::LoadBalancing::seq_aux_loss))
    scalars.emplace_back("seq_load_balancing_loss", moe_losses.seq_aux_loss);
  if (mc.enabled() && mc.uses(moe::LoadBalancing::global_aux_loss))
    scalars.emplace_back("global_load_balancing_loss", moe_losses.global_aux_loss);
  if (mc.enabled() && mc.z_loss_coeff > 0) scalars.emplace_back("z_loss", moe_losses.z_loss);
  if (comm_share >= 0) scalars.emplace_back("moe/dispatcher_comm_share", comm_share);
  if (exposed_comm_share >= 0) scalars.emplace_back("comm/exposed_share", exposed_comm_share);
  if (grad_reduce_share >= 0) scalars.emplace_back("comm/grad_reduce_share", grad_reduce_share);
  if (pipeline_wait_share >= 0) scalars.emplace_back("comm/pipeline_wait_share", pipeline_wait_share);
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
      const moe::RouterStatsHost st = moe::router_stats_host(*stats);  // once per logged step
      const std::string sfx = "_layer_" + std::to_string(l);
      scalars.emplace_back("moe/load_balancing_loss" + sfx, st.aux_loss);
      scalars.emplace_back("moe/max_over_mean_load" + sfx, st.max_over_mean_load());
      scalars.emplace_back("moe/dropped_tokens" + sfx, static_cast<double>(st.dropped));
      for (size_t e = 0; e < st.tokens_per_expert.size(); ++e)
        scalars.emplace_back("moe/tokens_per_expert" + sfx + "_expert_" + std::to_string(e),
                             static_cast<double>(st.tokens_per_expert[e]));
      if (const std::optional<moe::EchoStatsHost>& e = echo[static_cast<size_t>(l)]) {
        scalars.emplace_back("moe/echo_max_over_mean_before" + sfx, e->max_over_mean_before());
        scalars.emplace_back("moe/echo_max_over_mean_after" + sfx, e->max_over_mean_after());
        scalars.emplace_back("moe/echo_clones" + sfx, static_cast<double>(e->clones));
        scalars.emplace_back("moe/echo_weight_bytes" + sfx, static_cast<double>(e->weight_bytes));
      }
    }
  }
  if (sinks.tb) {
    sinks.tb->add_scalars(step, scalars);
    sinks.tb->flush();
  }
  if (sinks.jsonl) {
    io::MetricFields f = {
        {"iteration", step}, {"lm_loss", loss}, {"grad_norm", grad_norm}, {"lr", lr}, {"tokens_per_s", tokens_per_s},
        {"tflops", tflops}};
    for (size_t i = 5; i < scalars.size(); ++i) f.emplace_back(scalars[i].first, scalars[i].second);
    sinks.jsonl->write(f);
  }
}

}  // namespace

RunLog::RunLog(model::GptModel& gpt, const TrainConfig& cfg, const TrainGroups& g, int64_t first_iteration,
               std::FILE* log)
    : gpt_(gpt),
      cfg_(cfg),
      pp_(g.pp),
      micro_per_rank_(cfg.micro_batches() / g.dp.size()),
      log_(log),
      first_iteration_(first_iteration),
      world_size_(g.world_size()),
      flops_per_step_(gpt.flops_per_step() * static_cast<double>(cfg.micro_batches())),
      peak_gflops_(cfg.peak_gflops),
      mtp_acc_(static_cast<size_t>(gpt.config().mtp_num_layers), 0.0) {
  const bool writes_metrics = g.dp.rank() == 0 && g.tp.rank() == 0 && g.cp.rank() == 0 && g.pp.rank() == 0;
  if (writes_metrics && !cfg.metrics_jsonl.empty())
    sinks_.jsonl = std::make_unique<io::JsonlMetricsWriter>(cfg.metrics_jsonl);
  if (writes_metrics && !cfg.tensorboard_dir.empty())
    sinks_.tb = std::make_unique<io::TensorBoardWriter>(cfg.tensorboard_dir);
}

void RunLog::step(int64_t it, const StepResult& r, float lr, int64_t consumed_samples, double grad_reduce_blocked,
                  double pipeline_wait) {
  if (r.skipped && log_)
    std::fprintf(log_, " iteration %lld: non-finite value in %s, step skipped\n", static_cast<long long>(it + 1),
                 r.nonfinite.c_str());
  loss_acc_ += r.skipped ? 0.0 : r.loss;
  for (size_t k = 0; k < mtp_acc_.size() && !r.skipped; ++k) mtp_acc_[k] += r.mtp_loss[k];
  logged_steps_ += r.skipped ? 0 : 1;
  skipped_ += r.skipped ? 1 : 0;
  retries_ += r.retried ? 1 : 0;
  grad_reduce_blocked_ += grad_reduce_blocked;
  pipeline_wait_ += pipeline_wait;
  if ((it + 1) % cfg_.log_interval == 0) interval(it, r, lr, consumed_samples);
}

void RunLog::validation(int64_t it, double v) {
  if (log_) {
    std::fprintf(log_, " validation loss at iteration %lld: %.4f (ppl %.2f)\n", static_cast<long long>(it + 1), v,
                 std::exp(v));
    std::fflush(log_);
  }
  if (sinks_.tb) sinks_.tb->add_scalar("lm loss validation", it + 1, v);
  if (sinks_.jsonl) sinks_.jsonl->write({{"iteration", it + 1}, {"valid_lm_loss", v}});
}

void RunLog::exclude(std::chrono::steady_clock::duration d) {
  t_last_ += d;
  gpt_.reset_dispatcher_comm_seconds();
  blocked_last_ = comm_blocked_seconds();
}

void RunLog::interval(int64_t it, const StepResult& r, float lr, int64_t consumed_samples) {
  const auto& m = gpt_.config();
  const EchoLayers echo = echo_layers(gpt_);
  const auto now = std::chrono::steady_clock::now();
  const double span = std::max(std::chrono::duration<double>(now - t_last_).count(), 1e-9);
  const double dt = span / static_cast<double>(cfg_.log_interval);
  const double elapsed = std::chrono::duration<double>(now - t_start_).count();
  t_last_ = now;
  const double tokens_per_s = static_cast<double>(cfg_.global_batch_size * m.seq_length) / std::max(dt, 1e-9);
  // Expert parallelism: the share of step time inside the dispatcher's collectives on this rank.
  const double comm_share = gpt_.ep_size() > 1 ? gpt_.dispatcher_comm_seconds() / span : -1.0;
  gpt_.reset_dispatcher_comm_seconds();
  // Every collective's blocking time (this rank): the share of the interval the computation waited for peers; and
  // the part of it spent in the gradient reduction.
  const double blocked = comm_blocked_seconds();
  const double exposed_share = world_size_ > 1 ? (blocked - blocked_last_) / span : -1.0;
  blocked_last_ = blocked;
  const double grad_reduce_share = world_size_ > 1 ? grad_reduce_blocked_ / span : -1.0;
  grad_reduce_blocked_ = 0;
  // Pipelines: the share of the interval the stages waited for each other, averaged over the stages (collective over
  // pp), next to the schedule's bubble (p - 1) / (v * m + p - 1) for this rank's m micro-batches per step through v
  // model chunks (v = 1: 1F1B; interleaved, each chunk's passes take 1 / v of the time).
  double pipeline_wait_share = -1.0, bubble = 0.0;
  if (pp_.size() > 1) {
    double w = pipeline_wait_ / span;
    all_reduce_sum(std::span<double>(&w, 1), pp_);
    const double p = pp_.size();
    pipeline_wait_share = w / p;
    bubble = (p - 1) / (static_cast<double>(gpt_.num_chunks() * micro_per_rank_) + p - 1);
  }
  pipeline_wait_ = 0;
  const double tflops = flops_per_step_ / std::max(dt, 1e-9) / 1e12;
  const double mean_loss = logged_steps_ ? loss_acc_ / static_cast<double>(logged_steps_) : NAN;
  std::vector<double> mtp_mean(mtp_acc_.size());
  std::string mtp_text;
  for (size_t k = 0; k < mtp_acc_.size(); ++k) {
    mtp_mean[k] = logged_steps_ ? mtp_acc_[k] / static_cast<double>(logged_steps_) : NAN;
    char b[48];
    std::snprintf(b, sizeof b, " | mtp_%zu loss %.4f", k + 1, mtp_mean[k]);
    mtp_text += b;
  }
  std::fill(mtp_acc_.begin(), mtp_acc_.end(), 0.0);
  const double eta =
      elapsed / static_cast<double>(it + 1 - first_iteration_) * static_cast<double>(cfg_.train_iters - it - 1);
  if (log_) {
    std::string mfu, comm;
    if (comm_share >= 0) {
      char b[48];
      std::snprintf(b, sizeof b, " | %s %.1f%%", gpt_.dispatcher_name(), 100.0 * comm_share);
      comm = b;
    }
    if (exposed_share >= 0) {
      char b[48];
      std::snprintf(b, sizeof b, " | comm %.1f%%", 100.0 * exposed_share);
      comm += b;
    }
    if (pipeline_wait_share >= 0) {
      char b[80];
      std::snprintf(b, sizeof b, " | pipeline wait %.1f%% (%s bubble %.1f%%)", 100.0 * pipeline_wait_share,
                    gpt_.num_chunks() > 1 ? "interleaved 1F1B" : "1F1B", 100.0 * bubble);
      comm += b;
    }
    if (gpt_.moe_static_capacity()) {
      char b[48];
      std::snprintf(b, sizeof b, " | capacity retries %lld", static_cast<long long>(retries_));
      comm += b;
    }
    if (skipped_ > 0) {  // Megatron's "number of skipped iterations"
      char b[48];
      std::snprintf(b, sizeof b, " | skipped iterations %lld", static_cast<long long>(skipped_));
      comm += b;
    }
    if (const std::optional<EchoSummary> e = echo_summary(echo)) {
      char b[96];
      std::snprintf(b, sizeof b, " | echo max/mean %.2f -> %.2f, %lld clones", e->before, e->after,
                    static_cast<long long>(e->clones));
      comm += b;
    }
    if (peak_gflops_ > 0) {
      // Above 100% the start-up peak was measured on a busy machine: measure again, keep the best.
      // The peak is one rank's: the run's is world_size times that (every rank measured its own threads).
      const double run_peak = peak_gflops_ * world_size_;
      if (tflops * 1e3 > run_peak)
        peak_gflops_ = std::max(peak_gflops_, gemm_peak_gflops(m.compute_dtype, gpt_.device()));
      char b[32];
      std::snprintf(b, sizeof b, " | MFU %.1f%%", 100.0 * tflops * 1e3 / (peak_gflops_ * world_size_));
      mfu = b;
    }
    char grad[48] = "grad norm - (step skipped)";  // a skipped step has no update, so no norm to show
    if (!r.skipped) std::snprintf(grad, sizeof grad, "grad norm %.3f", r.stats.grad_norm);
    std::fprintf(log_,
                 " iteration %6lld/%6lld | consumed tokens %10lld | lr %.3e | lm loss %.4f%s%s | %s | "
                 "%.0f tokens/s | %.3f TFLOP/s%s%s | ETA %s %s\n",
                 static_cast<long long>(it + 1), static_cast<long long>(cfg_.train_iters),
                 static_cast<long long>(consumed_samples * m.seq_length), lr, mean_loss, mtp_text.c_str(),
                 format_moe_losses(m.moe, r.moe_losses).c_str(), grad, tokens_per_s, tflops, mfu.c_str(), comm.c_str(),
                 format_duration(eta).c_str(), progress_bar(it + 1, cfg_.train_iters).c_str());
    if (cfg_.moe_per_layer_logging) log_moe_layers(gpt_, echo, log_);
    std::fflush(log_);
  }
  emit_metrics(sinks_, gpt_, it + 1, mean_loss, lr, r.skipped ? NAN : r.stats.grad_norm, tokens_per_s, tflops,
               r.moe_losses, cfg_.moe_per_layer_logging, comm_share, exposed_share, grad_reduce_share,
               pipeline_wait_share, mtp_mean, gpt_.moe_static_capacity() ? static_cast<double>(retries_) : -1.0, echo);
  retries_ = 0;
  skipped_ = 0;
  loss_acc_ = 0;
  logged_steps_ = 0;
}

}  // namespace moecore::train
