#include "moecore/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "moecore/core/rng.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/metrics.h"
#include "moecore/optim/distributed_adamw.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/gemm_peak.h"
#include "moecore/train/signals.h"

namespace moecore::train {

void TrainConfig::validate() const {
  if (micro_batch_size <= 0 || global_batch_size <= 0 || global_batch_size % micro_batch_size != 0)
    MOECORE_FAIL("training: global_batch_size (", global_batch_size, ") must be a positive multiple of ",
                 "micro_batch_size (", micro_batch_size, ")");
  if (train_iters <= 0) MOECORE_FAIL("training: train_iters (", train_iters, ") must be positive");
  if (overlap_param_gather && (!use_distributed_optimizer || !overlap_grad_reduce))
    MOECORE_FAIL(
        "training: --overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in "
        "Megatron)");
  if (lr_decay_style != "constant" && lr_decay_style != "linear" && lr_decay_style != "cosine" &&
      lr_decay_style != "WSD")
    MOECORE_FAIL("--lr-decay-style '", lr_decay_style, "' is not one of constant, linear, cosine, WSD");
  if (lr_decay_style == "WSD") {
    const std::string& w = lr_wsd_decay_style;
    if (w != "exponential" && w != "linear" && w != "cosine" && w != "minus_sqrt")
      MOECORE_FAIL("--lr-wsd-decay-style '", w, "' is not one of exponential, linear, cosine, minus_sqrt");
    if (lr_wsd_decay_iters <= 0) MOECORE_FAIL("--lr-decay-style WSD needs --lr-wsd-decay-iters > 0");
  }
  if (lr_decay_iters < 0) MOECORE_FAIL("--lr-decay-iters (", lr_decay_iters, ") must not be negative");
  if (!(lr >= 0) || !(min_lr >= 0) || min_lr > lr)
    MOECORE_FAIL("training: need 0 <= min_lr (", min_lr, ") <= lr (", lr, ")");
  if (log_interval <= 0 || eval_iters <= 0 || eval_interval < 0 || lr_warmup_iters < 0)
    MOECORE_FAIL("training: log_interval (", log_interval, ") and eval_iters (", eval_iters,
                 ") must be positive; eval_interval (", eval_interval, ") and lr_warmup_iters (", lr_warmup_iters,
                 ") must not be negative");
  if (nan_action != "stop" && nan_action != "skip")
    MOECORE_FAIL("--nan-action '", nan_action, "' is not one of stop, skip");
  if (save_interval < 0 || keep_last < 0)
    MOECORE_FAIL("--save-interval (", save_interval, ") and --keep-last-checkpoints (", keep_last,
                 ") must not be negative");
  if (save_interval > 0 && save.empty()) MOECORE_FAIL("--save-interval needs --save DIR");
  if (exit_interval < 0) MOECORE_FAIL("--exit-interval (", exit_interval, ") must not be negative");
  if (ckpt_step < -1) MOECORE_FAIL("--ckpt-step (", ckpt_step, ") must not be negative");
  if (ckpt_step >= 0 && load.empty())
    MOECORE_FAIL("--ckpt-step (", ckpt_step, ") needs --load DIR: it picks which iteration of DIR to load");
  if (override_opt_param_scheduler && use_checkpoint_opt_param_scheduler)
    MOECORE_FAIL("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other ",
                 "(both override and use-checkpoint are set): keep the command line's LR schedule or the checkpoint's");
}

float lr_at(const TrainConfig& c, int64_t it) {
  if (c.lr_warmup_iters > 0 && it < c.lr_warmup_iters)
    return c.lr * static_cast<float>(it + 1) / static_cast<float>(c.lr_warmup_iters);
  if (c.lr_decay_style == "constant") return c.lr;
  const int64_t end = c.lr_decay_iters > 0 ? c.lr_decay_iters : c.train_iters;
  if (it >= end) return c.min_lr;
  double coeff;
  if (c.lr_decay_style == "WSD") {
    const int64_t anneal_start = end - c.lr_wsd_decay_iters;
    if (it < anneal_start) return c.lr;
    const double r =
        static_cast<double>(it - anneal_start) / static_cast<double>(std::max<int64_t>(c.lr_wsd_decay_iters, 1));
    const std::string& w = c.lr_wsd_decay_style;
    coeff = w == "linear"       ? 1.0 - r
            : w == "cosine"     ? 0.5 * (std::cos(M_PI * r) + 1.0)
            : w == "minus_sqrt" ? 1.0 - std::sqrt(r)
                                : 2.0 * std::pow(0.5, r) - 1.0;  // exponential
  } else {
    const int64_t decay_steps = std::max<int64_t>(end - c.lr_warmup_iters, 1);
    const double r = static_cast<double>(it - c.lr_warmup_iters) / static_cast<double>(decay_steps);
    coeff = c.lr_decay_style == "linear" ? 1.0 - r : 0.5 * (std::cos(M_PI * r) + 1.0);
  }
  return static_cast<float>(c.min_lr + coeff * (c.lr - c.min_lr));
}

double evaluate(model::GptModel& gpt, const TrainConfig& cfg, const BatchFn& batches, const ProcessGroup* dp) {
  const auto& m = gpt.config();
  Tensor tokens = Tensor::empty({gpt.micro_batch_size(), m.seq_length}, DType::i32, MemCategory::workspace);
  Tensor labels = Tensor::empty({gpt.micro_batch_size(), m.seq_length}, DType::i32, MemCategory::workspace);
  const int64_t P = dp ? dp->size() : 1, r = dp ? dp->rank() : 0;
  // Rank r takes batches r, r + P, ...; every rank runs the same number of forwards (the EP dispatchers
  // communicate in each), the surplus ones uncounted.
  const int64_t rounds = (cfg.eval_iters + P - 1) / P;
  double sums[2] = {0, 0};  // loss sum, counted tokens
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t i = k * P + r;
    batches(tokens, labels, true, std::min(i, cfg.eval_iters - 1));
    const auto res = gpt.evaluate(tokens, labels);
    if (i >= cfg.eval_iters) continue;
    sums[0] += res.loss_sum;
    sums[1] += static_cast<double>(res.tokens);
  }
  if (P > 1) all_reduce_sum(std::span<double>(sums, 2), *dp);
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

namespace {
// Adds this micro-batch's router statistics of every MoE layer into acc; returns the number of MoE layers.
// The statistics live on the router's device; only the losses come to the host, 40 bytes per layer and
// micro-batch after its backward (the logging price; no kernel launch waits on it, nothing is allocated).
int64_t accumulate_moe_losses(const model::GptModel& gpt, MoeStepLosses& acc) {
  int64_t n = 0;
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) {
    const moe::RouterStats* st = gpt.moe_stats(l);
    if (!st) continue;
    ++n;
    double v[ops::router_loss::count];
    st->losses.copy_to_host(v, ops::router_loss::count);
    acc.aux_loss += v[ops::router_loss::aux];
    acc.seq_aux_loss += v[ops::router_loss::seq_aux];
    acc.global_aux_loss += v[ops::router_loss::global_aux];
    acc.z_loss += v[ops::router_loss::z];
  }
  return n;
}

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
// Per-layer router statistics of the last micro-batch: tokens per expert, max/mean load, drops and losses.
void log_moe_layers(const model::GptModel& gpt, std::FILE* log) {
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
  }
}
}  // namespace

namespace {

// Per-step checks of the gradients, on the device, each read back once: the squared norms of the replicated and
// the expert-parallel parameters, and a non-finite flag per parameter.
struct GradChecks {
  Tensor sq;     // [3] f64: squares of the replicated, the expert-parallel and the tensor-parallel gradients
  Tensor flags;  // [params] i32
  std::vector<int32_t> host_flags;
  explicit GradChecks(const model::GptModel& gpt)
      : sq(Tensor::zeros({3}, DType::f64, MemCategory::workspace, gpt.device())),
        flags(Tensor::zeros({std::max<int64_t>(1, static_cast<int64_t>(gpt.params().size()))}, DType::i32,
                            MemCategory::workspace, gpt.device())),
        host_flags(static_cast<size_t>(flags.numel())) {}
};

// The first parameter gradient that is not finite, or "" when all are.
std::string first_nonfinite_gradient(const model::GptModel& gpt, GradChecks& c) {
  const auto& params = gpt.params();
  c.flags.zero_();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor flag = c.flags.slice(0, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
    ops::flag_nonfinite(flag, params[i].grad, ops::Context{gpt.device()});
  }
  c.flags.copy_to_host(c.host_flags.data(), c.flags.numel());
  for (size_t i = 0; i < params.size(); ++i)
    if (c.host_flags[i]) return params[i].name;
  return "";
}

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

// Writers for --metrics-jsonl and --tensorboard-dir, opened once per run.
struct MetricSinks {
  std::unique_ptr<io::JsonlMetricsWriter> jsonl;
  std::unique_ptr<io::TensorBoardWriter> tb;
};

void emit_metrics(MetricSinks& sinks, const model::GptModel& gpt, int64_t step, double loss, double lr,
                  double grad_norm, double tokens_per_s, double tflops, const MoeStepLosses& moe_losses, bool per_layer,
                  double comm_share, double exposed_comm_share, double grad_reduce_share,
                  const std::vector<double>& mtp_losses) {
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

namespace {
// Sums the step's losses and the router counts over the data-parallel group (the losses are then averaged).
void reduce_stats_over_dp(model::GptModel& gpt, double& step_loss, MoeStepLosses& moe_losses, const ProcessGroup& dp) {
  double v[5] = {step_loss, moe_losses.aux_loss, moe_losses.seq_aux_loss, moe_losses.global_aux_loss,
                 moe_losses.z_loss};
  all_reduce_sum(std::span<double>(v, 5), dp);
  const double inv = 1.0 / dp.size();
  step_loss = v[0] * inv;
  // global_load_balancing_loss is logged as the sum over DP (its ranks' parts add up to the full loss).
  moe_losses = {v[1] * inv, v[2] * inv, v[3], v[4] * inv};
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) {
    moe::RouterState* st = gpt.router_state(l);
    if (st) all_reduce_sum(st->local_tokens_per_expert, dp);  // a device tensor: the collective moves it
  }
}

// Sums gradients over their groups: expert shards over edp, everything else over dp. Gradients are packed into
// buckets of up to `bucket` elements in backward order (whole parameters; a larger one goes alone and is reduced in
// place), one all-reduce per bucket. The reduction is element-wise in rank order, so neither bucketing nor overlap
// changes a bit.
// Per step: begin(), ready(first, end) as the gradients of params()[first, end) become final, finish(). Without
// overlap the trainer marks everything ready after the last backward and each bucket is reduced in turn through one
// bucket-sized buffer; with overlap (--overlap-grad-reduce) a bucket's nonblocking all-reduce is posted as soon as
// its last parameter is ready, during backward (the model's set_grad_ready), from a buffer holding every bucket,
// and finish() waits for them all.
class GradBuckets {
 public:
  GradBuckets(const model::GptModel& gpt, const TrainGroups& g, int64_t bucket, bool overlap)
      : g_(g), overlap_(overlap) {
    const auto& params = gpt.params();
    bucket_of_.assign(params.size(), -1);
    int64_t offset[2] = {0, 0}, widest = 0;
    for (int kind = 0; kind < 2; ++kind) {
      if (group(kind).size() <= 1) continue;
      for (size_t i = params.size(); i-- > 0;) {  // backward order: the last parameters' gradients are final first
        if (params[i].expert_parallel != (kind == 1)) continue;
        const int64_t n = params[i].grad.numel();
        const bool alone = n > bucket;
        if (alone || buckets_.empty() || buckets_.back().kind != kind || buckets_.back().alone ||
            buckets_.back().elems + n > bucket)
          buckets_.push_back(Bucket{kind, alone, {}, 0, alone ? 0 : offset[kind], 0, {}});
        Bucket& b = buckets_.back();
        b.params.push_back(i);
        b.elems += n;
        if (!alone) offset[kind] += n;
        widest = std::max(widest, alone ? 0 : b.elems);
        bucket_of_[i] = static_cast<int>(buckets_.size() - 1);
      }
    }
    for (int kind = 0; kind < 2; ++kind) {
      const int64_t n = overlap ? offset[kind] : (kind == 0 ? widest : 0);
      if (n > 0) flat_[kind] = Tensor::empty({n}, DType::f32, MemCategory::workspace, gpt.device());
    }
  }

  void begin() {
    for (Bucket& b : buckets_) {
      b.pending = static_cast<int64_t>(b.params.size());
      b.handle = CommHandle();
    }
  }
  void ready(model::GptModel& gpt, size_t first, size_t end) {
    for (size_t i = first; i < end; ++i) {
      const int k = bucket_of_[i];
      if (k >= 0 && --buckets_[static_cast<size_t>(k)].pending == 0) post(gpt, buckets_[static_cast<size_t>(k)]);
    }
    // Without the progress thread the comm layer advances the buckets in flight inside comm calls only: test them.
    // With it, testing would only make this thread do the transfers and sums the progress thread does meanwhile.
    if (overlap_ && !comm_progress_thread_running())
      for (Bucket& b : buckets_)
        if (b.pending == 0) b.handle.test();
  }
  void finish(model::GptModel& gpt) {
    for (Bucket& b : buckets_) {
      MOECORE_CHECK(b.pending == 0, "gradient bucket with ", b.pending, " parameters never marked ready");
      if (!overlap_) continue;
      b.handle.wait();
      if (!b.alone) unpack(gpt, b, flat_[b.kind]);
    }
  }

 private:
  struct Bucket {
    int kind = 0;        // 0: dense over dp, 1: experts over edp
    bool alone = false;  // one parameter wider than a bucket: reduced in place
    std::vector<size_t> params;
    int64_t elems = 0, offset = 0;  // its elements and, with overlap, where they sit in flat_[kind]
    int64_t pending = 0;            // parameters not ready yet this step
    CommHandle handle;
  };
  const ProcessGroup& group(int kind) const { return kind == 1 ? g_.edp : g_.dense_grads(); }
  // The bucket's slice of flat (device copies: the buffer lives where the gradients do).
  void pack(model::GptModel& gpt, const Bucket& b, Tensor& flat) {
    int64_t o = overlap_ ? b.offset : 0;
    for (size_t i : b.params) {
      const Tensor& g = gpt.params()[i].grad;
      flat.slice(0, o, o + g.numel()).copy_from(g.view({g.numel()}));
      o += g.numel();
    }
  }
  void unpack(model::GptModel& gpt, const Bucket& b, const Tensor& flat) {
    int64_t o = overlap_ ? b.offset : 0;
    for (size_t i : b.params) {
      Tensor g = gpt.params()[i].grad.view({gpt.params()[i].grad.numel()});
      g.copy_from(flat.slice(0, o, o + g.numel()));
      o += g.numel();
    }
  }
  void post(model::GptModel& gpt, Bucket& b) {
    const ProcessGroup& grp = group(b.kind);
    if (b.alone) {
      Tensor& g = gpt.params()[b.params[0]].grad;
      if (overlap_)
        b.handle = all_reduce_sum_async(g, grp);
      else
        all_reduce_sum(g, grp);
      return;
    }
    Tensor& flat = flat_[overlap_ ? b.kind : 0];
    pack(gpt, b, flat);
    const int64_t at = overlap_ ? b.offset : 0;
    if (overlap_) {
      b.handle = all_reduce_sum_async(flat.slice(0, at, at + b.elems), grp);
      return;
    }
    all_reduce_sum(flat.slice(0, 0, b.elems), grp);
    unpack(gpt, b, flat);
  }

  const TrainGroups& g_;
  bool overlap_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // per parameter, its bucket (-1: its group has one rank)
  Tensor flat_[2];              // with overlap one buffer per kind holding its buckets; else [0]: one bucket's
};

// An expert parameter whole on every ETP rank (with ETP > 1: the fc2 bias): its gradient is identical on them, so the
// norm counts it on ETP rank 0 only.
bool etp_replica(const Param& p, const TrainGroups& g) {
  return p.expert_parallel && !p.tp.sharded() && g.etp.size() > 1;
}

// The global L2 norm of the reduced gradients, every parameter counted once: the replicated parameters'
// squares are identical on every rank; the expert shards' squares are summed over the ETP x EP group and the
// tensor-parallel shards' over the TP group.
double grad_norm_over_groups(const model::GptModel& gpt, const TrainGroups& g, GradChecks& c) {
  c.sq.zero_();
  Tensor sq_dense = c.sq.slice(0, 0, 1), sq_expert = c.sq.slice(0, 1, 2), sq_tp = c.sq.slice(0, 2, 3);
  for (const auto& p : gpt.params())
    if (!etp_replica(p, g) || g.etp.rank() == 0)
      ops::sum_squares(p.expert_parallel ? sq_expert
                       : p.tp.sharded()  ? sq_tp
                                         : sq_dense,
                       p.grad, ops::Context{gpt.device()});
  const ProcessGroup& experts = g.etp.size() > 1 ? g.etp_ep : g.ep;
  if (experts.size() > 1) all_reduce_sum(sq_expert, experts);
  if (g.tp.size() > 1) all_reduce_sum(sq_tp, g.tp);
  double sq[3];
  c.sq.copy_to_host(sq, 3);
  return std::sqrt(sq[0] + sq[1] + sq[2]);
}
// The distributed optimizer (ZeRO-1) of a run: non-expert parameters sharded over dp, expert parameters
// over edp. Gradients are reduce-scattered in buckets; the masters are all-gathered after each step. Under TP the
// tensor-parallel shards get an instance of their own (over dp as well), so the grad norm counts the replicated
// parameters once and sums the shards over TP.
struct ZeroOptimizers {
  enum Kind { replicated, tensor_parallel, expert, expert_replica, kinds };  // expert_replica: etp_replica()
  std::unique_ptr<optim::DistributedAdamW> opt[kinds];
  std::vector<size_t> idx[kinds];              // parameter indices of each instance, in model order
  std::vector<std::pair<Kind, size_t>> where;  // per model parameter: its instance and index there
  const TrainGroups& g;

  // overlap: the instances can reduce during backward and gather during the next forward (--overlap-*).
  ZeroOptimizers(model::GptModel& gpt, const optim::AdamWConfig& cfg, const TrainGroups& groups, int64_t bucket,
                 bool overlap)
      : g(groups) {
    std::vector<Param*> p[kinds];
    auto& params = gpt.params();
    for (size_t i = 0; i < params.size(); ++i) {
      const Kind k = etp_replica(params[i], g)   ? expert_replica
                     : params[i].expert_parallel ? expert
                     : params[i].tp.sharded()    ? tensor_parallel
                                                 : replicated;
      where.emplace_back(k, p[k].size());
      p[k].push_back(&params[i]);
      idx[k].push_back(i);
    }
    for (int k = 0; k < kinds; ++k)
      if (k == replicated || !p[k].empty())
        opt[k] = std::make_unique<optim::DistributedAdamW>(p[k], cfg,
                                                           k == expert || k == expert_replica ? g.edp : g.dense_grads(),
                                                           optim::DistributedAdamWOptions{bucket, overlap});
  }
  // --overlap-grad-reduce: begin before the last backward, grad_ready as the model reports gradients final, finish.
  void begin_grad_reduction() {
    each([](optim::DistributedAdamW& o, const auto&) { o.begin_grad_reduction(); });
  }
  void grad_ready(size_t first, size_t end) {
    for (size_t i = first; i < end; ++i) opt[where[i].first]->grad_ready(where[i].second);
  }
  void finish_grad_reduction() {
    each([](optim::DistributedAdamW& o, const auto&) { o.finish_grad_reduction(); });
  }
  // --overlap-param-gather: the masters of params [first, end) current (their buckets' gathers waited for).
  void wait_params(size_t first, size_t end) {
    for (size_t i = first; i < end; ++i) opt[where[i].first]->wait_param(where[i].second);
  }
  void finish_param_gather() {
    each([](optim::DistributedAdamW& o, const auto&) { o.finish_param_gather(); });
  }
  template <class Fn>
  void each(Fn&& fn) const {
    for (int k = 0; k < kinds; ++k)
      if (opt[k]) fn(*opt[k], idx[k]);
  }
  void reduce_scatter_grads() {
    each([](optim::DistributedAdamW& o, const auto&) { o.reduce_scatter_grads(); });
  }
  std::string first_nonfinite_grad() const {
    std::string s;
    each([&](const optim::DistributedAdamW& o, const auto&) {
      if (s.empty()) s = o.first_nonfinite_grad();
    });
    return s;
  }
  // Every shard once: replicated shards sum over dp (x cp); tensor-parallel shards over dp (x cp) x tp; expert
  // shards over edp x ep x etp, which is tp x dp x cp (every rank), those whole on every ETP rank from ETP rank 0.
  double grad_norm() const {
    const double rep = opt[replicated]->shard_grad_sq();
    double rest = (opt[tensor_parallel] ? opt[tensor_parallel]->shard_grad_sq() : 0.0) +
                  (opt[expert] ? opt[expert]->shard_grad_sq() : 0.0) +
                  (opt[expert_replica] && g.etp.rank() == 0 ? opt[expert_replica]->shard_grad_sq() : 0.0);
    const ProcessGroup& dp = g.dense_grads();
    if (g.tp.size() == 1) {  // one sum over dp (the layout before TP: unchanged bits)
      double sq = rep + rest;
      if (dp.size() > 1) all_reduce_sum(std::span<double>(&sq, 1), dp);
      return std::sqrt(sq);
    }
    double v[2] = {rep, rest};
    all_reduce_sum(std::span<double>(v, 2), dp);
    all_reduce_sum(std::span<double>(&v[1], 1), g.tp);
    return std::sqrt(v[0] + v[1]);
  }
  void step(float lr, float clip, bool gather_later) {
    each([&](optim::DistributedAdamW& o, const auto&) { o.step(lr, clip, gather_later); });
  }
  int64_t state_bytes() const {
    int64_t n = 0;
    each([&](const optim::DistributedAdamW& o, const auto&) { n += o.state_bytes(); });
    return n;
  }
  // Collective: the full moments of every parameter this rank holds (for checkpoints).
  OptimizerState gather(size_t n) const {
    OptimizerState st;
    st.exp_avg.resize(n);
    st.exp_avg_sq.resize(n);
    each([&](const optim::DistributedAdamW& o, const std::vector<size_t>& ix) {
      std::vector<Tensor> m, v;
      o.gather_state(m, v);
      for (size_t k = 0; k < ix.size(); ++k) {
        st.exp_avg[ix[k]] = m[k];
        st.exp_avg_sq[ix[k]] = v[k];
      }
    });
    st.steps = opt[replicated]->steps_taken();
    return st;
  }
  void load(const OptimizerState& st) {
    each([&](optim::DistributedAdamW& o, const std::vector<size_t>& ix) {
      std::vector<Tensor> m, v;
      for (size_t i : ix) {
        m.push_back(st.exp_avg[i]);
        v.push_back(st.exp_avg_sq[i]);
      }
      o.load_state(m, v);
      o.set_steps_taken(st.steps);
    });
  }
};

OptParamSchedulerState opt_param_scheduler_of(const TrainConfig& c, int64_t num_steps) {
  return {c.lr,
          c.min_lr,
          c.lr_warmup_iters,
          c.lr_decay_iters > 0 ? c.lr_decay_iters : c.train_iters,
          c.lr_decay_style,
          c.lr_wsd_decay_iters,
          c.lr_wsd_decay_style,
          num_steps};
}

// After a load: settles the LR schedule the run continues with (written into cfg) and returns the iteration at
// which its step 0 falls (lr_at(cfg, it - start)).
int64_t lr_schedule_resume(TrainConfig& cfg, const LoadedTrainingState& loaded, const std::string& dir,
                           std::FILE* log) {
  const int64_t it = loaded.progress.iteration;
  if (!loaded.optimizer_loaded) {  // Megatron's scheduler is saved and loaded with the optimizer: it restarts
    if (it > 0 && log)
      std::fprintf(log, " optimizer state not loaded: fresh moments; the LR schedule restarts at iteration %lld\n",
                   static_cast<long long>(it));
    return it;
  }
  if (!loaded.scheduler) return 0;  // saved before the scheduler state was: nothing to check, step = iteration
  const OptParamSchedulerState s =
      opt_param_scheduler_resolve(opt_param_scheduler_of(cfg, it), *loaded.scheduler, it,
                                  cfg.override_opt_param_scheduler, cfg.use_checkpoint_opt_param_scheduler, dir);
  cfg.lr = s.max_lr;
  cfg.min_lr = s.min_lr;
  cfg.lr_warmup_iters = s.lr_warmup_steps;
  cfg.lr_decay_iters = s.lr_decay_steps;
  cfg.lr_decay_style = s.lr_decay_style;
  cfg.lr_wsd_decay_iters = s.wsd_decay_steps;
  cfg.lr_wsd_decay_style = s.lr_wsd_decay_style;
  cfg.validate();
  if (log && cfg.use_checkpoint_opt_param_scheduler)
    std::fprintf(log, " using the checkpoint's LR schedule: lr %.3e, min lr %.3e, warmup %lld, %s decay to %lld\n",
                 static_cast<double>(cfg.lr), static_cast<double>(cfg.min_lr),
                 static_cast<long long>(cfg.lr_warmup_iters), cfg.lr_decay_style.c_str(),
                 static_cast<long long>(cfg.lr_decay_iters));
  return it - s.num_steps;
}
}  // namespace

TrainLog train(model::GptModel& gpt, optim::AdamW& opt, const TrainConfig& config, const BatchFn& batches,
               std::FILE* log, const StepObserver& observer, const TrainGroups* groups_in) {
  config.validate();
  TrainConfig cfg = config;  // the LR schedule may come from the checkpoint (--use-checkpoint-opt_param-scheduler)
  const TrainGroups groups = groups_in ? *groups_in : TrainGroups{};
  const ProcessGroup* dp = &groups.dp;
  const int dp_size = dp->size(), dp_rank = dp->rank();
  if (groups.ep.size() != gpt.ep_size())
    MOECORE_FAIL("training: the model was built for expert-parallel size ", gpt.ep_size(), " but the ep group has ",
                 groups.ep.size(), " ranks");
  if (groups.tp.size() != gpt.tp_size())
    MOECORE_FAIL("training: the model was built for tensor-parallel size ", gpt.tp_size(), " but the tp group has ",
                 groups.tp.size(), " ranks");
  if (groups.cp.size() != gpt.cp_size())
    MOECORE_FAIL("training: the model was built for context-parallel size ", gpt.cp_size(), " but the cp group has ",
                 groups.cp.size(), " ranks");
  if (groups.cp.size() > 1 && groups.dp_cp.size() != dp_size * groups.cp.size())
    MOECORE_FAIL("training: the dp_cp group has ", groups.dp_cp.size(), " ranks, not data-parallel (", dp_size,
                 ") x context-parallel (", groups.cp.size(), ")");
  if (groups.etp.size() != gpt.etp_size())
    MOECORE_FAIL("training: the model was built for expert-tensor-parallel size ", gpt.etp_size(),
                 " but the etp group has ", groups.etp.size(), " ranks");
  if (groups.etp.size() > 1 && groups.etp_ep.size() != groups.etp.size() * groups.ep.size())
    MOECORE_FAIL("training: the etp_ep group has ", groups.etp_ep.size(), " ranks, not expert-tensor-parallel (",
                 groups.etp.size(), ") x expert-parallel (", groups.ep.size(), ")");
  if (groups.etp.size() * groups.ep.size() * groups.edp.size() != groups.world_size())
    MOECORE_FAIL("training: expert-tensor-parallel (", groups.etp.size(), ") x expert-parallel (", groups.ep.size(),
                 ") x expert-data-parallel (", groups.edp.size(), ") must equal tensor-parallel (", groups.tp.size(),
                 ") x context-parallel (", groups.cp.size(), ") x data-parallel (", dp_size, ") when PP = 1");
  const auto& m = gpt.config();
  if (gpt.micro_batch_size() != cfg.micro_batch_size)
    MOECORE_FAIL("training: the model was built for micro-batch ", gpt.micro_batch_size(), ", not ",
                 cfg.micro_batch_size);
  std::unique_ptr<ZeroOptimizers> zero;
  if (cfg.use_distributed_optimizer) {
    zero = std::make_unique<ZeroOptimizers>(gpt, opt.config(), groups, cfg.ddp_bucket_size, cfg.overlap_grad_reduce);
    if (log)
      std::fprintf(log, " distributed optimizer: %s of optimizer state on this rank (%s unsharded)\n",
                   memory_format_bytes(zero->state_bytes()).c_str(),
                   memory_format_bytes(opt.state_bytes_per_param() * gpt.num_parameters()).c_str());
  } else if (!opt.has_state()) {
    MOECORE_FAIL("training: the optimizer holds no state; build it with state or set use_distributed_optimizer");
  }
  std::unique_ptr<GradBuckets> buckets;
  // Expert gradients reduce over edp, which may span the TP ranks (TP 2 x DP 1 has EDP 2 with ETP 1).
  const bool reduces_grads = groups.dense_grads().size() > 1 || groups.edp.size() > 1;
  const bool overlap = cfg.overlap_grad_reduce && (zero || reduces_grads);
  if (!zero && reduces_grads) buckets = std::make_unique<GradBuckets>(gpt, groups, cfg.ddp_bucket_size, overlap);
  GradChecks checks(gpt);
  TrainProgress progress;
  int64_t schedule_start = 0;  // the iteration at which the LR schedule's step 0 falls
  if (!cfg.load.empty()) {
    // As in Megatron, an empty --load directory starts from scratch, so one command serves the first launch
    // and every restart; a directory holding a damaged newest checkpoint is an Error (checkpoint_find_latest).
    const auto dir =
        io::checkpoint_find_latest(cfg.load, cfg.ckpt_step >= 0 ? std::optional<int64_t>(cfg.ckpt_step) : std::nullopt);
    const CheckpointLoadOptions parts{cfg.load_optim, cfg.load_rng, cfg.finetune};
    LoadedTrainingState loaded;
    if (dir && zero) {
      OptimizerState st;  // stays empty without the optimizer state: the fresh shards are kept as they are
      if (parts.load_optim && !parts.finetune) {
        for (const auto& p : gpt.params()) {
          st.exp_avg.push_back(Tensor::zeros(p.value.shape(), opt.config().state_dtype, MemCategory::workspace));
          st.exp_avg_sq.push_back(Tensor::zeros(p.value.shape(), opt.config().state_dtype, MemCategory::workspace));
        }
      }
      loaded = load_training_state(*dir, gpt, st, cfg.seed, parts);
      if (loaded.optimizer_loaded) zero->load(st);
    } else if (dir) {
      loaded = load_training_state(*dir, gpt, opt, cfg.seed, parts);
    } else if (log) {
      std::fprintf(log, " no committed checkpoint under --load %s: training from scratch\n", cfg.load.c_str());
    }
    if (dir) {
      progress = loaded.progress;
      if (log)
        std::fprintf(log, " loaded checkpoint %s at iteration %lld%s%s%s\n", dir->c_str(),
                     static_cast<long long>(progress.iteration), cfg.finetune ? " (--finetune: weights only)" : "",
                     !cfg.finetune && !loaded.optimizer_loaded ? " without the optimizer state" : "",
                     !cfg.finetune && !loaded.rng_loaded ? " without the rng state" : "");
      schedule_start = lr_schedule_resume(cfg, loaded, *dir, log);
    }
  }
  std::unique_ptr<ExitSignalGuard> signals;
  if (cfg.exit_signal_handler) signals = std::make_unique<ExitSignalGuard>();
  // Written by the first rank only (data- and tensor-parallel rank 0): every rank holds the same reduced values.
  MetricSinks sinks;
  const bool writes_metrics = dp_rank == 0 && groups.tp.rank() == 0 && groups.cp.rank() == 0;
  if (writes_metrics && !cfg.metrics_jsonl.empty())
    sinks.jsonl = std::make_unique<io::JsonlMetricsWriter>(cfg.metrics_jsonl);
  if (writes_metrics && !cfg.tensorboard_dir.empty())
    sinks.tb = std::make_unique<io::TensorBoardWriter>(cfg.tensorboard_dir);

  Tensor tokens = Tensor::empty({cfg.micro_batch_size, m.seq_length}, DType::i32, MemCategory::workspace);
  Tensor labels = Tensor::empty({cfg.micro_batch_size, m.seq_length}, DType::i32, MemCategory::workspace);
  const int64_t micro = cfg.micro_batches();
  if (micro % dp_size != 0)
    MOECORE_FAIL("training: global_batch_size (", cfg.global_batch_size, ") must be divisible by micro_batch_size (",
                 cfg.micro_batch_size, ") x data-parallel size (", dp_size, ")");
  const int64_t micro_local = micro / dp_size;
  const double flops_per_step = gpt.flops_per_step() * static_cast<double>(micro);
  TrainLog out;
  out.first_iteration = progress.iteration;
  double peak_gflops = cfg.peak_gflops;
  const auto t_start = std::chrono::steady_clock::now();
  auto t_last = t_start;
  const int world_size = groups.world_size();  // ranks of the run (PP = 1)
  double blocked_last = comm_blocked_seconds();
  // The part of it spent in the gradient reduction (the TP sums and the DP all-reduce or reduce-scatter): with
  // --overlap-grad-reduce the posting during backward plus the final wait, else the whole reduction after backward.
  double grad_reduce_blocked = 0;
  struct BlockedIn {  // adds the blocked time of its scope to `acc`
    explicit BlockedIn(double& a) : acc(a) {}
    BlockedIn(const BlockedIn&) = delete;
    BlockedIn& operator=(const BlockedIn&) = delete;
    ~BlockedIn() { acc += comm_blocked_seconds() - start; }
    double& acc;
    double start = comm_blocked_seconds();
  };
  double loss_acc = 0;
  std::vector<double> mtp_acc(static_cast<size_t>(m.mtp_num_layers), 0.0);  // MTP losses over the log interval
  int64_t logged_steps = 0;
  // --overlap-param-gather: after a step the masters arrive bucket by bucket; every forward waits for the ranges it
  // reads (the model's params_needed hook) and refreshes their compute copies; settle() completes them all (before
  // a checkpoint and at the end).
  struct PendingParams {
    ZeroOptimizers* zero;
    model::GptModel& gpt;
    std::vector<char> stale;  // per parameter: its compute copy predates the last step
    bool any = false;
    void after_step() {
      stale.assign(gpt.params().size(), 1);
      any = true;
    }
    void need(size_t first, size_t end) {
      if (!any) return;
      zero->wait_params(first, end);
      for (size_t i = first; i < end; ++i)
        if (stale[i]) {
          gpt.refresh_compute_weights(i, i + 1);
          stale[i] = 0;
        }
    }
    void settle() {
      if (!any) return;
      zero->finish_param_gather();
      need(0, stale.size());
      any = false;
    }
  } gathers{zero.get(), gpt, {}, false};
  const bool gather_later = zero && cfg.overlap_param_gather;
  struct NeedGuard {  // the hook refers to this scope: never left behind (an exception included)
    model::GptModel& m;
    ~NeedGuard() { m.set_params_needed({}); }
  } need_guard{gpt};
  if (gather_later) gpt.set_params_needed([&](size_t first, size_t end) { gathers.need(first, end); });
  auto save = [&]() {
    gathers.settle();
    if (cfg.save.empty()) return;
    const CheckpointSaveOptions parts{cfg.save_optim, cfg.save_rng,
                                      opt_param_scheduler_of(cfg, progress.iteration - schedule_start),
                                      cfg.hf_config_json};
    // A failed save stops the run (Megatron's behaviour): retrying would need free space the job cannot make,
    // and going on would risk losing more steps than the last committed checkpoint holds.
    try {
      if (zero)  // the gather is collective: every rank skips it alike (same flags)
        save_training_checkpoint(cfg.save, gpt, cfg.save_optim ? zero->gather(gpt.params().size()) : OptimizerState{},
                                 progress, cfg.seed, cfg.keep_last, &groups, parts);
      else
        save_training_checkpoint(cfg.save, gpt, opt, progress, cfg.seed, cfg.keep_last, &groups, parts);
    } catch (const Error& e) {
      const auto kept = io::checkpoint_read_tracker(cfg.save);
      MOECORE_FAIL(e.what(), "; training stops at iteration ", progress.iteration, " without this checkpoint; ",
                   kept ? "the newest valid checkpoint is still iteration " + std::to_string(*kept) +
                              " (resume with --load " + cfg.save + ")"
                        : std::string("no checkpoint was committed under ") + cfg.save,
                   ", free space or fix the error first");
    }
    if (log)
      std::fprintf(log, " saved checkpoint at iteration %lld to %s\n", static_cast<long long>(progress.iteration),
                   cfg.save.c_str());
  };
  for (int64_t it = progress.iteration; it < cfg.train_iters; ++it) {
    comm_set_phase("iteration " + std::to_string(it + 1));  // named by timeouts, aborts and fatal signals
    gpt.zero_grad();
    double step_loss = 0;
    std::vector<double> mtp_loss(static_cast<size_t>(m.mtp_num_layers), 0.0);  // per depth
    MoeStepLosses moe_losses;
    int64_t moe_layers = 0;
    if (buckets) buckets->begin();
    for (int64_t mb = 0; mb < micro_local; ++mb) {
      batches(tokens, labels, false, it * micro + dp_rank * micro_local + mb);
      gpt.set_dropout_step(it, dp_rank * micro_local + mb);
      struct HookGuard {  // the hook refers to this scope: never left behind (an exception included)
        model::GptModel& m;
        ~HookGuard() { m.set_grad_ready({}); }
      } hook_guard{gpt};
      if (overlap && mb + 1 == micro_local) {  // the last backward: each bucket is reduced once its gradients are final
        if (zero) zero->begin_grad_reduction();
        gpt.set_grad_ready([&](size_t first, size_t end) {
          const BlockedIn in_reduction{grad_reduce_blocked};
          gpt.sum_tensor_parallel_grads(first, end);
          if (zero)
            zero->grad_ready(first, end);
          else
            buckets->ready(gpt, first, end);
        });
      }
      const model::LossResult r = gpt.forward_backward(tokens, labels, 1.0f / static_cast<float>(micro));
      step_loss += r.mean();
      for (size_t k = 0; k < mtp_loss.size(); ++k) mtp_loss[k] += r.mtp_mean(k) / static_cast<double>(micro_local);
      moe_layers = accumulate_moe_losses(gpt, moe_losses);
    }
    step_loss /= static_cast<double>(micro_local);
    if (dp_size > 1 && !mtp_loss.empty()) {
      all_reduce_sum(std::span<double>(mtp_loss), *dp);
      for (double& v : mtp_loss) v /= static_cast<double>(dp_size);
    }
    if (moe_layers > 0) {
      const double div = static_cast<double>(micro_local * moe_layers);
      moe_losses = {moe_losses.aux_loss / div, moe_losses.seq_aux_loss / div, moe_losses.global_aux_loss / div,
                    moe_losses.z_loss / div};
    }
    if (dp_size > 1) reduce_stats_over_dp(gpt, step_loss, moe_losses, *dp);
    // The expert-bias counts over TP x CP x DP (spec §2.10): each TP and CP rank routed its own rows.
    for (const ProcessGroup* grp : {&groups.tp, &groups.cp})
      if (grp->size() > 1)
        for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l)
          if (moe::RouterState* st = gpt.router_state(l)) all_reduce_sum(st->local_tokens_per_expert, *grp);
    std::optional<BlockedIn> in_reduction(std::in_place, grad_reduce_blocked);
    if (zero && overlap) {
      zero->finish_grad_reduction();  // (the TP sums ran as the gradients became final)
    } else if (zero) {
      gpt.sum_tensor_parallel_grads();
      zero->reduce_scatter_grads();
    } else if (overlap) {
      buckets->finish(gpt);  // (the TP sums ran as the gradients became final)
    } else {
      gpt.sum_tensor_parallel_grads();
      if (buckets) {
        buckets->ready(gpt, 0, gpt.params().size());
        buckets->finish(gpt);
      }
    }
    in_reduction.reset();
    bool skip = false;
    if (cfg.check_for_nan) {
      std::string bad = !std::isfinite(step_loss) ? std::string("lm loss")
                        : zero                    ? zero->first_nonfinite_grad()
                                                  : first_nonfinite_gradient(gpt, checks);
      if (groups.world_size() > 1) {  // shards differ between ranks: all must take the same decision
        int64_t flag = bad.empty() ? 0 : 1;
        all_reduce_sum(std::span<int64_t>(&flag, 1), *dp);
        all_reduce_sum(std::span<int64_t>(&flag, 1), groups.tp);
        all_reduce_sum(std::span<int64_t>(&flag, 1), groups.cp);
        if (flag > 0 && bad.empty()) bad = "a gradient on another rank";
      }
      if (!bad.empty()) {
        if (cfg.nan_action == "stop")
          MOECORE_FAIL("training: non-finite value in ", bad, " at iteration ", it + 1,
                       " (use --nan-action skip to drop such steps)");
        skip = true;
        ++out.skipped_steps;
        if (log)
          std::fprintf(log, " iteration %lld: non-finite value in %s, step skipped\n", static_cast<long long>(it + 1),
                       bad.c_str());
      }
    }
    const float lr = lr_at(cfg, it - schedule_start);
    optim::StepStats st;
    if (!skip && zero) {
      st.grad_norm = zero->grad_norm();
      st.clip_scale = optim::clip_scale_for(st.grad_norm, opt.config().clip_grad);
      zero->step(lr, st.clip_scale, gather_later);
      if (gather_later)
        gathers.after_step();
      else
        gpt.refresh_compute_weights();
    } else if (!skip) {
      st = opt.step(lr, grad_norm_over_groups(gpt, groups, checks));
      gpt.refresh_compute_weights();
    }
    gpt.finish_step(/*update=*/!skip);
    progress.iteration = it + 1;
    progress.consumed_samples += cfg.global_batch_size;
    out.train_loss.push_back(step_loss);
    out.grad_norm.push_back(st.grad_norm);
    out.lr.push_back(lr);
    out.moe_losses.push_back(moe_losses);
    if (observer) observer(it, step_loss, skip);
    loss_acc += skip ? 0.0 : step_loss;
    for (size_t k = 0; k < mtp_loss.size() && !skip; ++k) mtp_acc[k] += mtp_loss[k];
    logged_steps += skip ? 0 : 1;
    if ((it + 1) % cfg.log_interval == 0) {
      const auto now = std::chrono::steady_clock::now();
      const double dt = std::chrono::duration<double>(now - t_last).count() / static_cast<double>(cfg.log_interval);
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      t_last = now;
      const double tokens_per_s = static_cast<double>(cfg.global_batch_size * m.seq_length) / std::max(dt, 1e-9);
      // Expert parallelism: the share of step time inside the dispatcher's collectives on this rank.
      const double comm_share =
          gpt.ep_size() > 1 ? gpt.dispatcher_comm_seconds() / std::max(dt * static_cast<double>(cfg.log_interval), 1e-9)
                            : -1.0;
      gpt.reset_dispatcher_comm_seconds();
      // Every collective's blocking time (this rank): the share of the interval the computation waited for peers.
      const double blocked = comm_blocked_seconds();
      const double exposed_share =
          world_size > 1 ? (blocked - blocked_last) / std::max(dt * static_cast<double>(cfg.log_interval), 1e-9) : -1.0;
      blocked_last = blocked;
      const double grad_reduce_share =
          world_size > 1 ? grad_reduce_blocked / std::max(dt * static_cast<double>(cfg.log_interval), 1e-9) : -1.0;
      grad_reduce_blocked = 0;
      const double tflops = flops_per_step / std::max(dt, 1e-9) / 1e12;
      const double mean_loss = logged_steps ? loss_acc / static_cast<double>(logged_steps) : NAN;
      std::vector<double> mtp_mean(mtp_acc.size());
      std::string mtp_text;
      for (size_t k = 0; k < mtp_acc.size(); ++k) {
        mtp_mean[k] = logged_steps ? mtp_acc[k] / static_cast<double>(logged_steps) : NAN;
        char b[48];
        std::snprintf(b, sizeof b, " | mtp_%zu loss %.4f", k + 1, mtp_mean[k]);
        mtp_text += b;
      }
      std::fill(mtp_acc.begin(), mtp_acc.end(), 0.0);
      const double eta =
          elapsed / static_cast<double>(it + 1 - out.first_iteration) * static_cast<double>(cfg.train_iters - it - 1);
      if (log) {
        std::string mfu, comm;
        if (comm_share >= 0) {
          char b[48];
          std::snprintf(b, sizeof b, " | %s %.1f%%", gpt.dispatcher_name(), 100.0 * comm_share);
          comm = b;
        }
        if (exposed_share >= 0) {
          char b[48];
          std::snprintf(b, sizeof b, " | comm %.1f%%", 100.0 * exposed_share);
          comm += b;
        }
        if (peak_gflops > 0) {
          // Above 100% the start-up peak was measured on a busy machine: measure again, keep the best.
          // The peak is one rank's: the run's is world_size times that (every rank measured its own threads).
          const double run_peak = peak_gflops * world_size;
          if (tflops * 1e3 > run_peak) peak_gflops = std::max(peak_gflops, gemm_peak_gflops(m.compute_dtype));
          char b[32];
          std::snprintf(b, sizeof b, " | MFU %.1f%%", 100.0 * tflops * 1e3 / (peak_gflops * world_size));
          mfu = b;
        }
        std::fprintf(log,
                     " iteration %6lld/%6lld | consumed tokens %10lld | lr %.3e | lm loss %.4f%s%s | grad norm %.3f | "
                     "%.0f tokens/s | %.3f TFLOP/s%s%s | ETA %s %s\n",
                     static_cast<long long>(it + 1), static_cast<long long>(cfg.train_iters),
                     static_cast<long long>(progress.consumed_samples * m.seq_length), lr, mean_loss, mtp_text.c_str(),
                     format_moe_losses(m.moe, moe_losses).c_str(), st.grad_norm, tokens_per_s, tflops, mfu.c_str(),
                     comm.c_str(), format_duration(eta).c_str(), progress_bar(it + 1, cfg.train_iters).c_str());
        if (cfg.moe_per_layer_logging) log_moe_layers(gpt, log);
        std::fflush(log);
      }
      emit_metrics(sinks, gpt, it + 1, mean_loss, lr, st.grad_norm, tokens_per_s, tflops, moe_losses,
                   cfg.moe_per_layer_logging, comm_share, exposed_share, grad_reduce_share, mtp_mean);
      loss_acc = 0;
      logged_steps = 0;
    }
    const bool last = it + 1 == cfg.train_iters;
    if (cfg.has_validation && (last || (cfg.eval_interval > 0 && (it + 1) % cfg.eval_interval == 0))) {
      const auto t_eval = std::chrono::steady_clock::now();
      comm_set_phase("validation after iteration " + std::to_string(it + 1));
      const double v = evaluate(gpt, cfg, batches, dp);
      // Evaluation time (and its dispatcher traffic) stays out of the next interval's throughput.
      t_last += std::chrono::steady_clock::now() - t_eval;
      gpt.reset_dispatcher_comm_seconds();
      blocked_last = comm_blocked_seconds();
      out.valid_loss.emplace_back(it + 1, v);
      if (log) {
        std::fprintf(log, " validation loss at iteration %lld: %.4f (ppl %.2f)\n", static_cast<long long>(it + 1), v,
                     std::exp(v));
        std::fflush(log);
      }
      if (sinks.tb) sinks.tb->add_scalar("lm loss validation", it + 1, v);
      if (sinks.jsonl) sinks.jsonl->write({{"iteration", it + 1}, {"valid_lm_loss", v}});
    }
    bool stop = signals && ExitSignalGuard::requested();
    if (groups.world_size() > 1) {  // every rank stops at the same step, or the others would wait in a collective
      int64_t flag = stop ? 1 : 0;
      for (const ProcessGroup* grp : {dp, &groups.tp, &groups.cp})
        if (grp->size() > 1) all_reduce_sum(std::span<int64_t>(&flag, 1), *grp);
      stop = flag > 0;
    }
    if (stop) {
      if (log)
        std::fprintf(log, " received signal %d: saving and stopping at iteration %lld\n", ExitSignalGuard::signal(),
                     static_cast<long long>(it + 1));
      save();
      out.stopped_by_signal = true;
      return out;
    }
    if (!last && cfg.exit_interval > 0 && (it + 1) % cfg.exit_interval == 0) {
      if (log) std::fprintf(log, " exiting at iteration %lld (--exit-interval)\n", static_cast<long long>(it + 1));
      save();
      return out;
    }
    if (!last && cfg.save_interval > 0 && (it + 1) % cfg.save_interval == 0) save();
  }
  save();
  return out;
}

std::vector<int32_t> generate(model::GptModel& gpt, const std::vector<int32_t>& prompt, int64_t count,
                              float temperature, uint64_t seed, int32_t stop_token, int64_t vocab_limit) {
  const auto& m = gpt.config();
  const int64_t B = gpt.micro_batch_size(), S = m.seq_length, Vm = m.vocab_size;
  if (vocab_limit < 0 || vocab_limit > Vm)
    MOECORE_FAIL("generate: vocab_limit ", vocab_limit, " is outside the model's vocabulary of ", Vm);
  const int64_t V = vocab_limit > 0 ? vocab_limit : Vm;  // candidates: the first V logits of a row
  Tensor tokens = Tensor::zeros({B, S}, DType::i32, MemCategory::workspace);
  Tensor logits = Tensor::empty({B * S, Vm}, DType::f32, MemCategory::workspace, gpt.device());
  std::vector<float> row(static_cast<size_t>(Vm));  // the last position's logits, read back to sample from
  std::vector<int32_t> ctx = prompt, out;
  const PhiloxKey key = philox_key(seed, "generate");
  std::vector<std::pair<float, int32_t>> cand(static_cast<size_t>(V));
  for (int64_t t = 0; t < count; ++t) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ctx.size()), S);
    int32_t* tp = tokens.data<int32_t>();
    std::copy(ctx.end() - n, ctx.end(), tp);
    gpt.forward_logits(logits, tokens);
    logits.slice(0, n - 1, n).copy_to_host(row.data(), Vm);
    for (int64_t v = 0; v < V; ++v) cand[v] = {row[v], static_cast<int32_t>(v)};
    const int64_t k = std::min<int64_t>(40, V);
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), std::greater<>());
    double z = 0;
    std::vector<double> p(static_cast<size_t>(k));
    // The stop token may end the sample only after a quarter of the requested tokens (no empty samples).
    const bool may_stop = 4 * t >= count;
    for (int64_t i = 0; i < k; ++i) {
      p[i] = (!may_stop && cand[i].second == stop_token)
                 ? 0.0
                 : std::exp((cand[i].first - cand[0].first) / std::max(temperature, 1e-4f));
      z += p[i];
    }
    double u = philox_uniform(key, static_cast<uint64_t>(t)) * z;
    int64_t pick = 0;
    while (pick + 1 < k && (u -= p[pick]) > 0) ++pick;
    if (cand[pick].second == stop_token) break;
    ctx.push_back(cand[pick].second);
    out.push_back(cand[pick].second);
  }
  return out;
}

}  // namespace moecore::train
