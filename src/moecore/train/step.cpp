#include "moecore/train/step.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "moecore/parallel/comm.h"

namespace moecore::train {
namespace {
// The MoE balancing losses as Megatron logs them, in its order: the router's loss slot, the name, and the reduction
// over the data-parallel ranks (global_load_balancing_loss is the sum over DP: its ranks' parts add up to the full
// loss); each is listed when the model computes it.
struct MoeLossMetric {
  int64_t slot;  // ops::router_loss
  const char* name;
  MetricReduce over_dp;
  bool (*used)(const moe::MoeConfig& mc);
};
constexpr MoeLossMetric kMoeLossMetrics[] = {
    {ops::router_loss::aux, "load_balancing_loss", MetricReduce::mean,
     [](const moe::MoeConfig& mc) { return mc.uses(moe::LoadBalancing::aux_loss); }},
    {ops::router_loss::seq_aux, "seq_load_balancing_loss", MetricReduce::mean,
     [](const moe::MoeConfig& mc) { return mc.uses(moe::LoadBalancing::seq_aux_loss); }},
    {ops::router_loss::global_aux, "global_load_balancing_loss", MetricReduce::sum,
     [](const moe::MoeConfig& mc) { return mc.uses(moe::LoadBalancing::global_aux_loss); }},
    {ops::router_loss::z, "z_loss", MetricReduce::mean, [](const moe::MoeConfig& mc) { return mc.z_loss_coeff > 0; }},
};

// The step's loss list of this model (zeros): Megatron's "mtp_<k> loss" per depth, averaged over a log interval,
// then the MoE losses it computes, the logged step's (means over micro-batches and MoE layers).
StepMetrics step_metrics_of(const model::ModelConfig& c) {
  StepMetrics m;
  for (int64_t k = 1; k <= c.mtp_num_layers; ++k)
    m.add({"mtp_" + std::to_string(k) + " loss", "mtp_" + std::to_string(k) + "_loss", MetricReduce::mean,
           MetricInterval::mean});
  if (!c.moe.enabled()) return m;
  for (const MoeLossMetric& l : kMoeLossMetrics)
    if (l.used(c.moe)) m.add({l.name, l.name, l.over_dp, MetricInterval::last, /*per_moe_layer=*/true});
  return m;
}

// Adds the router losses of every MoE layer of `chunk` from its last forward into the list's MoE entries (which
// follow the model's mtp_depths entries, in kMoeLossMetrics' order). The statistics live on the router's device; only
// the losses come to the host, 40 bytes per layer and micro-batch after its forward (the logging price; no kernel
// launch waits on it, nothing is allocated).
void accumulate_moe_losses(const model::GptModel& gpt, int64_t chunk, StepMetrics& acc) {
  const moe::MoeConfig& mc = gpt.config().moe;
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) {
    const moe::RouterStats* st = gpt.chunk_of_layer(l) == chunk ? gpt.moe_stats(l) : nullptr;
    if (!st) continue;
    double v[ops::router_loss::count];
    st->losses.copy_to_host(v, ops::router_loss::count);
    auto item = acc.items().begin() + gpt.config().mtp_num_layers;
    for (const MoeLossMetric& m : kMoeLossMetrics)
      if (m.used(mc)) (item++)->value += v[m.slot];
  }
}

// Sums the router counts over the data-parallel group.
void reduce_router_counts_over_dp(model::GptModel& gpt, const ProcessGroup& dp) {
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) {
    moe::RouterState* st = gpt.router_state(l);
    if (st) all_reduce_sum(st->local_tokens_per_expert, dp);  // a device tensor: the collective moves it
  }
}

// Adds the blocked time of its scope to `acc`.
struct BlockedIn {
  explicit BlockedIn(double& a) : acc(a) {}
  BlockedIn(const BlockedIn&) = delete;
  BlockedIn& operator=(const BlockedIn&) = delete;
  ~BlockedIn() { acc += comm_blocked_seconds() - start; }
  double& acc;
  double start = comm_blocked_seconds();
};

// Removes a model hook when its scope ends (an exception included): the hooks refer to the step's scope.
struct HookGuard {
  explicit HookGuard(model::GptModel& model) : m(model) {}
  model::GptModel& m;
  HookGuard(const HookGuard&) = delete;
  HookGuard& operator=(const HookGuard&) = delete;
  ~HookGuard() { m.set_grad_ready({}); }
};
}  // namespace

Schedule step_schedule(const TrainConfig& cfg, int64_t dp, int64_t pp, int64_t pp_rank, int64_t chunks) {
  const int64_t micro = cfg.micro_batches();
  if (micro % dp != 0)
    MOECORE_FAIL("training: global_batch_size (", cfg.global_batch_size, ") must be divisible by micro_batch_size (",
                 cfg.micro_batch_size, ") x data-parallel size (", dp, ")");
  if (chunks == 1) return one_f_one_b(micro / dp, pp, pp_rank);
  const int64_t group = cfg.microbatch_group_size_per_vp_stage > 0 ? cfg.microbatch_group_size_per_vp_stage : pp;
  return interleaved_one_f_one_b(micro / dp, pp, pp_rank, chunks, group);
}

TrainStep::TrainStep(model::GptModel& gpt, Optimizer& opt, const TrainConfig& cfg, const TrainGroups& groups,
                     const BatchFn& batches, GradScaler& scaler, Timers* timers)
    : gpt_(gpt),
      opt_(opt),
      cfg_(cfg),
      g_(groups),
      batches_(batches),
      scaler_(scaler),
      timers_(timers),
      micro_(cfg.micro_batches()) {
  gpt_.set_calculate_per_token_loss(cfg.calculate_per_token_loss);
  const int64_t pp = g_.pp.size();
  schedule_ = step_schedule(cfg, g_.dp.size(), pp, g_.pp.rank(), gpt.num_chunks());
  micro_local_ = micro_ / g_.dp.size();
  gpt_.set_micro_batch_slots(schedule_.in_flight);
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) moe_layers_ += gpt.is_moe_layer(l) ? 1 : 0;
  metrics_ = step_metrics_of(gpt.config());
  if (pp > 1) {
    transfers_ = pipeline_transfers(schedule_, pp, g_.pp.rank());
    pp_grads_ = group_split(g_.pp, g_.pp.name() + "_grads", {g_.pp.ranks()});
    for (auto& h : handles_)
      for (int64_t n : schedule_.in_flight) h.emplace_back(static_cast<size_t>(n));
  }
  const int64_t S = gpt.config().seq_length;
  tokens_ = Tensor::empty({cfg.micro_batch_size, S}, DType::i32, MemCategory::workspace);
  labels_ = Tensor::empty({cfg.micro_batch_size, S}, DType::i32, MemCategory::workspace);
  if (gpt.pipeline_shared_param() >= 0) {
    const Tensor& g = gpt.params()[static_cast<size_t>(gpt.pipeline_shared_param())].grad;
    shared_grad_ = Tensor::empty(g.shape(), DType::f32, MemCategory::workspace, gpt.device());
  }
}

double TrainStep::take_grad_reduce_blocked() {
  const double s = grad_reduce_blocked_;
  grad_reduce_blocked_ = 0;
  return s;
}

// The schedule with its transfers (pipeline_transfers): receives into the slots' stage inputs and output gradients,
// sends from their outputs and input gradients; activations go to the next stage and come from the previous one
// (wrapping around between the last stage and the first's next chunk), gradients the other way.
void TrainStep::run_transfers(const std::function<void(const ScheduleOp&)>& run_op) {
  const ProcessGroup& pp = g_.pp;
  const int p = pp.size(), up = (pp.rank() + 1) % p, down = (pp.rank() + p - 1) % p;
  for (const P2PAction& a : transfers_) {
    if (a.kind == P2PAction::run) {
      run_op(schedule_.ops[static_cast<size_t>(a.op)]);
      continue;
    }
    const model::Slot slot{schedule_.slot({ScheduleOp::forward, a.micro_batch, a.chunk}), a.chunk};
    const bool sends = a.kind == P2PAction::post_send || a.kind == P2PAction::wait_send;
    CommHandle& h =
        handles_[a.stream * 2 + (sends ? 1 : 0)][static_cast<size_t>(a.chunk)][static_cast<size_t>(slot.index)];
    const bool acts = a.stream == P2PAction::activations;
    const ProcessGroup& group = acts ? pp : pp_grads_;
    if (a.kind == P2PAction::post_recv) {
      h = irecv(acts ? gpt_.stage_input(slot) : gpt_.stage_output_grad(slot), acts ? down : up, group);
    } else if (a.kind == P2PAction::post_send) {
      h = isend(acts ? gpt_.stage_output(slot) : gpt_.stage_input_grad(slot), acts ? up : down, group);
    } else {
      const TimerScope t(timers_, acts ? (sends ? TimerName::forward_send : TimerName::forward_recv)
                                       : (sends ? TimerName::backward_send : TimerName::backward_recv));
      const BlockedIn waiting{pipeline_wait_};
      h.wait();
    }
  }
}

double TrainStep::take_pipeline_wait() {
  const double s = pipeline_wait_;
  pipeline_wait_ = 0;
  return s;
}

StepResult TrainStep::run(int64_t it, float lr) {
  gpt_.set_moe_synced_dropless(false);  // (a retry or an evaluation may have left every row's buffers)
  (void)gpt_.take_moe_overflow();
  StepResult r = pass(it);
  if (moe_overflow_anywhere(gpt_)) {
    gpt_.finish_step(/*update=*/false);  // the dropped pass's router counters
    gpt_.set_moe_synced_dropless(true);
    r = pass(it);
    r.retried = true;
    MOECORE_CHECK(!moe_overflow_anywhere(gpt_), "training: the synced dropless path overflowed");
  }
  check_and_update(r, it, lr);
  if (cfg_.log_params_norm && cfg_.logs_step(it)) r.params_norm = opt_.params_norm();
  return r;
}

StepResult TrainStep::pass(int64_t it) {
  const int64_t first = g_.dp.rank() * micro_local_;  // this rank's first micro-batch of the global batch
  // The losses' gradient factor (Megatron's forward_step): the loss scale over the global batch's micro-batches, or
  // with per-token loss the loss scale alone (the step divides by the counted tokens after the reduction).
  const float loss_scale = scaler_.scale();
  const float grad_scale = cfg_.calculate_per_token_loss ? loss_scale : loss_scale / static_cast<float>(micro_);
  double loss_sum = 0, tokens = 0;  // (per-token loss)
  const ProcessGroup& pp = g_.pp;
  const int64_t shared = gpt_.pipeline_shared_param();
  StepResult r;
  r.metrics = metrics_;
  std::vector<StepMetric>& mtp = r.metrics.items();  // (the first mtp_num_layers entries)
  gpt_.zero_grad();
  const TimerScope forward_backward(timers_, TimerName::forward_backward);
  opt_.begin_grad_reduction();
  HookGuard hook_guard{gpt_};
  // With overlap the gradients are reported final as the passes finish them (below). The parameter shared between the
  // first and the last stage is reported after the stages have summed its gradient.
  const auto hook = [&](size_t a, size_t b) {
    const BlockedIn in_reduction{grad_reduce_blocked_};
    const auto sh = static_cast<size_t>(shared);
    if (shared < 0 || sh < a || sh >= b) return opt_.grad_ready(a, b);
    if (a < sh) opt_.grad_ready(a, sh);
    if (sh + 1 < b) opt_.grad_ready(sh + 1, b);
  };
  // One op of the schedule: a forward or backward of one micro-batch through one model chunk.
  const auto run_op = [&](const ScheduleOp& op) {
    const model::Slot slot{schedule_.slot(op), op.chunk};
    const int64_t mb = op.micro_batch;
    const bool forward = op.kind == ScheduleOp::forward;
    // With overlap, each chunk's last micro-batch reports its gradients final as they are: the loss heads' from that
    // micro-batch's forward through the last chunk, the rest from its backwards (Megatron-FSDP's optim_grads*: every
    // micro-batch reports its contribution).
    const bool final = opt_.overlaps_grad_reduction() && (mb + 1 == micro_local_ || opt_.reduces_every_micro_batch()) &&
                       (!forward || gpt_.post_process(op.chunk));
    if (final) gpt_.set_grad_ready(hook);
    if (forward) {
      {
        const TimerScope t(timers_, TimerName::batch_generator);
        batches_(tokens_, labels_, false, it * micro_ + first + mb);
      }
      gpt_.set_dropout_step(it, first + mb);
      const TimerScope t(timers_, TimerName::forward_compute);
      const model::LossResult l = gpt_.forward(slot, tokens_, labels_, grad_scale);
      if (gpt_.post_process(op.chunk)) {
        r.loss += l.mean();
        loss_sum += l.loss_sum;
        tokens += static_cast<double>(l.tokens);
        for (int64_t k = 0; k < gpt_.config().mtp_num_layers; ++k)
          mtp[static_cast<size_t>(k)].value += l.mtp_mean(static_cast<size_t>(k)) / static_cast<double>(micro_local_);
      }
      accumulate_moe_losses(gpt_, op.chunk, r.metrics);
    } else {
      const TimerScope t(timers_, TimerName::backward_compute);
      gpt_.backward(slot, grad_scale);
    }
    if (final) gpt_.set_grad_ready({});
  };
  if (transfers_.empty()) {
    for (const ScheduleOp& op : schedule_.ops) run_op(op);
  } else {
    run_transfers(run_op);
  }
  if (shared >= 0) sum_shared_grad(static_cast<size_t>(shared));
  // The step's losses: the loss heads' from the last stage, the MoE layers' from every stage.
  r.loss /= static_cast<double>(micro_local_);
  r.metrics.reduce(r.loss, moe_layers_, micro_local_, pp, g_.dp);
  if (g_.dp.size() > 1) reduce_router_counts_over_dp(gpt_, g_.dp);
  if (cfg_.calculate_per_token_loss) {  // the loss: the global batch's sum over its counted tokens (the last stages')
    double v[2] = {loss_sum, tokens};
    for (const ProcessGroup* grp : {&pp, &g_.dp})
      if (grp->size() > 1) all_reduce_sum(std::span<double>(v, 2), *grp);
    r.tokens = static_cast<int64_t>(v[1]);
    r.loss = v[0] / std::max(v[1], 1.0);
  }
  // The expert-bias counts over TP x CP x DP (docs/megatron-moe-spec.md §2.10): each TP and CP rank routed its own
  // rows.
  for (const ProcessGroup* grp : {&g_.tp, &g_.cp})
    if (grp->size() > 1)
      for (int64_t l = 0; l < gpt_.config().num_transformer_layers(); ++l)
        if (moe::RouterState* st = gpt_.router_state(l)) all_reduce_sum(st->local_tokens_per_expert, *grp);
  {
    const TimerScope t(timers_, TimerName::all_grads_sync);
    const BlockedIn in_reduction{grad_reduce_blocked_};
    opt_.finish_grad_reduction();
  }
  return r;
}

void TrainStep::check_and_update(StepResult& r, int64_t it, float lr) {
  const TimerScope optimizer(timers_, TimerName::optimizer);
  r.loss_scale = scaler_.scale();
  {
    const TimerScope t(timers_, TimerName::optimizer_unscale_and_check_inf);
    // Megatron's unscaling of the main gradients and finalize_model_grads' per-token division, as one product.
    double unscale = 1.0 / static_cast<double>(r.loss_scale);
    if (cfg_.calculate_per_token_loss) unscale /= std::max<double>(static_cast<double>(r.tokens), 1.0);
    if (unscale != 1.0) opt_.scale_grads(static_cast<float>(unscale));
    const bool loss_bad = cfg_.check_for_nan && !std::isfinite(r.loss);  // (every rank holds the step's loss)
    if (loss_bad) {
      r.nonfinite = "lm loss";
    } else if (cfg_.check_for_nan || scaler_.active()) {
      r.nonfinite = opt_.first_nonfinite_grad();
      if (g_.world_size() > 1) {  // shards differ between ranks: all must take the same decision
        int64_t flag = r.nonfinite.empty() ? 0 : 1;
        for (const ProcessGroup* grp : {&g_.dp, &g_.tp, &g_.cp, &g_.pp})
          all_reduce_sum(std::span<int64_t>(&flag, 1), *grp);
        if (flag > 0 && r.nonfinite.empty()) r.nonfinite = "a gradient on another rank";
      }
      r.overflow = scaler_.active() && !r.nonfinite.empty();
    }
    if (!r.nonfinite.empty() && !r.overflow && cfg_.nan_action == NanAction::stop)
      MOECORE_FAIL("training: non-finite value in ", r.nonfinite, " at iteration ", it + 1,
                   " (use --nan-action skip to drop such steps)");
    r.skipped = !r.nonfinite.empty();
  }
  scaler_.update(r.overflow);
  if (!r.skipped) r.stats = opt_.step(lr);
  if (!r.skipped && cfg_.log_num_zeros_in_grad && cfg_.logs_step(it)) {
    const TimerScope t(timers_, TimerName::optimizer_count_zeros);
    r.num_zeros = static_cast<double>(opt_.count_zeros_in_grad(r.stats.clip_scale));
  }
  gpt_.finish_step(/*update=*/!r.skipped);
}

// Megatron's embedding-group all-reduce: the first and the last stage exchange their gradients of the shared parameter
// and both add them in the order first + last (equal bits on both), before the data-parallel reduction.
void TrainStep::sum_shared_grad(size_t index) {
  const TimerScope t(timers_, TimerName::embedding_grads_all_reduce);
  const ProcessGroup& pp = g_.pp;
  const int peer = gpt_.pre_process(0) ? pp.size() - 1 : 0;
  Tensor& grad = gpt_.params()[index].grad;
  const P2POp exchange[2] = {{P2PKind::send, grad, peer}, {P2PKind::recv, shared_grad_, peer}};
  {
    const BlockedIn in_reduction{grad_reduce_blocked_};
    batch_send_recv(exchange, pp);
  }
  const ops::Context ctx{gpt_.device()};
  if (gpt_.pre_process(0))
    ops::add(grad, grad, shared_grad_, ctx);
  else
    ops::add(grad, shared_grad_, grad, ctx);
  if (opt_.overlaps_grad_reduction()) {
    const BlockedIn in_reduction{grad_reduce_blocked_};
    opt_.grad_ready(index, index + 1);
  }
}

}  // namespace moecore::train
