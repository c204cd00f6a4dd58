// The optimizers of a training run: AdamW or Muon after an all-reduce of the gradients, and AdamW's distributed
// optimizer.
#include "moecore/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <span>

#include "moecore/optim/distributed_adamw.h"
#include "moecore/train/async_save.h"
#include "moecore/train/trainer.h"

namespace moecore::train {
namespace {

// Per-step checks of the gradients, on the device, each read back once: the squared norms of the replicated and
// the expert-parallel parameters, and a non-finite flag per parameter; with the logging flags the zero counts and the
// parameters' squares.
struct GradChecks {
  Tensor sq;  // [3] f64: squares of the replicated, the expert-parallel and the tensor-parallel gradients (or values)
  Tensor zeros;  // [3] i64: the same parts' zero gradient elements
  Tensor flags;  // [params] i32
  std::vector<int32_t> host_flags;
  explicit GradChecks(const model::GptModel& gpt)
      : sq(Tensor::zeros({3}, DType::f64, MemCategory::workspace, gpt.device())),
        zeros(Tensor::zeros({3}, DType::i64, MemCategory::workspace, gpt.device())),
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

// A stage's sum (of squares, of zeros) summed over the pipeline's stages (each holds its own parameters).
template <class T>
T over_pipeline(T v, const TrainGroups& g) {
  if (g.pp.size() > 1) all_reduce_sum(std::span<T>(&v, 1), g.pp);
  return v;
}

// A sum over the model's parameters, every parameter counted once: add(part, p) adds parameter p's term into acc's
// slot for its part -- [0] the replicated parameters, identical on every rank; [1] the expert shards, summed over the
// ETP x EP group; [2] the tensor-parallel shards, summed over the TP group -- then the parts are added and summed over
// the stages. acc: [3] f64 or i64 on the model's device.
template <class T, class Add>
T sum_over_groups(const model::GptModel& gpt, const TrainGroups& g, Tensor& acc, Add&& add) {
  acc.zero_();
  Tensor part[3] = {acc.slice(0, 0, 1), acc.slice(0, 1, 2), acc.slice(0, 2, 3)};
  for (const auto& p : gpt.params())
    if ((!etp_replica(p, g) || g.etp.rank() == 0) && !p.pipeline_copy)
      add(part[p.expert_parallel ? 1 : p.tp.sharded() ? 2 : 0], p);
  const ProcessGroup& experts = g.etp.size() > 1 ? g.etp_ep : g.ep;
  if (experts.size() > 1) all_reduce_sum(part[1], experts);
  if (g.tp.size() > 1) all_reduce_sum(part[2], g.tp);
  T v[3];
  acc.copy_to_host(v, 3);
  return over_pipeline(v[0] + v[1] + v[2], g);
}

// The global L2 norm of the reduced gradients.
double grad_norm_over_groups(const model::GptModel& gpt, const TrainGroups& g, GradChecks& c) {
  const ops::Context ctx{gpt.device()};
  return std::sqrt(sum_over_groups<double>(gpt, g, c.sq,
                                           [&](Tensor& part, const Param& p) { ops::sum_squares(part, p.grad, ctx); }));
}
// Megatron-FSDP's buckets over the parameters idx (model indices, in order) of one distributed-optimizer instance: one
// per unit (unit_of, fsdp_unit_of), one per parameter outside the units (DistributedAdamWOptions::bucket_ends).
std::vector<size_t> fsdp_bucket_ends(const std::vector<size_t>& idx, const std::vector<int>& unit_of) {
  std::vector<size_t> ends;
  for (size_t j = 0; j < idx.size(); ++j) {
    const int u = unit_of[idx[j]];
    if (u < 0 || j + 1 == idx.size() || unit_of[idx[j + 1]] != u) ends.push_back(j + 1);
  }
  return ends;
}

// Megatron-FSDP: each parameter's unit (GptModel::fsdp_units), -1 outside them.
std::vector<int> fsdp_unit_of(const model::GptModel& gpt) {
  std::vector<int> of(gpt.params().size(), -1);
  const auto units = gpt.fsdp_units();
  for (size_t u = 0; u < units.size(); ++u)
    for (size_t i = units[u].first; i < units[u].second; ++i) of[i] = static_cast<int>(u);
  return of;
}

// The distributed optimizer (ZeRO-1) of a run: non-expert parameters sharded over dp, expert parameters
// over edp. Gradients are reduce-scattered in buckets; the masters are all-gathered after each step. Under TP the
// tensor-parallel shards get an instance of their own (over dp as well), so the grad norm counts the replicated
// parameters once and sums the shards over TP. With N > 1 distributed-optimizer instances (Megatron's partial
// distributed optimizer) each shards over one instance -- intra_dp_cp, intra_edp -- and all-reduces its shards over
// inter_dist_opt; the norm then sums over one instance (its ranks of the stage: intra_dp_cp x tp, which
// rank_layout makes the same ranks as intra_edp x ep x etp).
struct ZeroOptimizers {
  // expert_replica: etp_replica(); pipeline_copy: Param::pipeline_copy (out of the norm: the first stage counts it)
  enum Kind { replicated, tensor_parallel, expert, expert_replica, pipeline_copy, kinds };
  static Kind kind_of(const Param& p, int etp_size) {
    return p.pipeline_copy                                        ? pipeline_copy
           : p.expert_parallel && !p.tp.sharded() && etp_size > 1 ? expert_replica  // (etp_replica)
           : p.expert_parallel                                    ? expert
           : p.tp.sharded()                                       ? tensor_parallel
                                                                  : replicated;
  }
  static bool expert_kind(int k) { return k == expert || k == expert_replica; }
  std::unique_ptr<optim::DistributedAdamW> opt[kinds];
  std::vector<size_t> idx[kinds];              // parameter indices of each instance, in model order
  std::vector<std::pair<Kind, size_t>> where;  // per model parameter: its instance and index there
  const TrainGroups& g;
  const ProcessGroup& dense;  // the ranks the non-expert state is sharded over (and the norm summed over)
  const ProcessGroup& experts;

  // overlap: the instances can reduce during backward and gather during the next forward (--overlap-*). n: the
  // distributed-optimizer instances. Megatron-FSDP: unit_of gives each model parameter's FSDP unit (-1: none), and
  // every instance's buckets follow them -- one per unit, one per parameter outside the units; `fsdp` gives the
  // instances' shard_params and dtypes.
  ZeroOptimizers(model::GptModel& gpt, const optim::AdamWConfig& cfg, const TrainGroups& groups, int64_t bucket,
                 bool overlap, int n, const std::vector<int>* unit_of = nullptr,
                 const optim::DistributedAdamWOptions& fsdp = {})
      : g(groups), dense(n > 1 ? g.intra_dp_cp : g.dense_grads()), experts(n > 1 ? g.intra_edp : g.edp) {
    std::vector<Param*> p[kinds];
    auto& params = gpt.params();
    for (size_t i = 0; i < params.size(); ++i) {
      const Kind k = kind_of(params[i], g.etp.size());
      where.emplace_back(k, p[k].size());
      p[k].push_back(&params[i]);
      idx[k].push_back(i);
    }
    const ProcessGroup across = n > 1 ? g.inter_dist_opt : ProcessGroup();
    for (int k = 0; k < kinds; ++k) {
      if (k != replicated && p[k].empty()) continue;
      optim::DistributedAdamWOptions o = unit_of ? fsdp : optim::DistributedAdamWOptions{};
      o.bucket_elems = bucket;
      o.overlap = overlap;
      if (unit_of) {
        o.bucket_ends = fsdp_bucket_ends(idx[k], *unit_of);
        o.initial_values = [&gpt, &ix = idx[k]](size_t i, int64_t first, Tensor& dst) {
          gpt.initial_values(ix[i], first, dst);
        };
      }
      opt[k] = std::make_unique<optim::DistributedAdamW>(p[k], cfg, expert_kind(k) ? experts : dense, o, across);
    }
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
  void scale_grads(float s) {
    each([&](optim::DistributedAdamW& o, const auto&) { o.scale_shard_grads(s); });
  }
  std::string first_nonfinite_grad() const {
    std::string s;
    each([&](const optim::DistributedAdamW& o, const auto&) {
      if (s.empty()) s = o.first_nonfinite_grad();
    });
    return s;
  }
  // A sum over every shard once of shard(instance): replicated shards sum over dp (x cp); tensor-parallel shards over
  // dp (x cp) x tp; expert shards over edp x ep x etp, which is tp x dp x cp (every rank), those whole on every ETP
  // rank from ETP rank 0. With instances, over one instance's part of each (the others hold the same shards), or under
  // HFSDP over every instance's pieces.
  template <class T, class Shard>
  T sum_shards(Shard&& shard) const {
    const T rep = shard(*opt[replicated]);
    T rest = (opt[tensor_parallel] ? shard(*opt[tensor_parallel]) : T{0}) + (opt[expert] ? shard(*opt[expert]) : T{0}) +
             (opt[expert_replica] && g.etp.rank() == 0 ? shard(*opt[expert_replica]) : T{0});
    const ProcessGroup& dp = dense;
    if (g.tp.size() == 1) {  // one sum over dp (the layout before TP: unchanged bits)
      T v = rep + rest;
      if (dp.size() > 1) all_reduce_sum(std::span<T>(&v, 1), dp);
      return over_pipeline(over_instances(v), g);
    }
    T v[2] = {rep, rest};
    all_reduce_sum(std::span<T>(v, 2), dp);
    all_reduce_sum(std::span<T>(&v[1], 1), g.tp);
    return over_pipeline(over_instances(v[0] + v[1]), g);
  }
  // HFSDP: each instance updates its own pieces of the shards, so their sums add up.
  template <class T>
  T over_instances(T v) const {
    if (opt[replicated]->shards_over_instances()) all_reduce_sum(std::span<T>(&v, 1), g.inter_dist_opt);
    return v;
  }
  double grad_norm() const {
    return std::sqrt(sum_shards<double>([](const optim::DistributedAdamW& o) { return o.shard_grad_sq(); }));
  }
  double params_norm() const {
    return std::sqrt(sum_shards<double>([](const optim::DistributedAdamW& o) { return o.shard_param_sq(); }));
  }
  int64_t grad_zeros(float clip_scale) const {
    return sum_shards<int64_t>([&](const optim::DistributedAdamW& o) { return o.shard_grad_zeros(clip_scale); });
  }
  // The update of every instance, then their gathers (in the instances' order, as the collectives need).
  void update(float lr, float clip) {
    each([&](optim::DistributedAdamW& o, const auto&) { o.update(lr, clip); });
  }
  void gather_params(bool later) {
    each([&](optim::DistributedAdamW& o, const auto&) { o.gather_params(later); });
  }
  int64_t state_bytes() const {
    int64_t n = 0;
    each([&](const optim::DistributedAdamW& o, const auto&) { n += o.state_bytes(); });
    return n;
  }
  // Collective: the full moments of every parameter this rank holds (for checkpoints).
  OptimizerState gather(size_t n) const {
    std::vector<Tensor> exp_avg(n), exp_avg_sq(n);
    each([&](const optim::DistributedAdamW& o, const std::vector<size_t>& ix) {
      std::vector<Tensor> m, v;
      o.gather_state(m, v);
      for (size_t k = 0; k < ix.size(); ++k) {
        exp_avg[ix[k]] = m[k];
        exp_avg_sq[ix[k]] = v[k];
      }
    });
    return OptimizerState::adam(std::move(exp_avg), std::move(exp_avg_sq), opt[replicated]->steps_taken());
  }
  void load(const OptimizerState& st) {
    each([&](optim::DistributedAdamW& o, const std::vector<size_t>& ix) {
      std::vector<Tensor> m, v;
      for (size_t i : ix) {
        m.push_back(st.slots[0].per_param[i]);
        v.push_back(st.slots[1].per_param[i]);
      }
      o.load_state(m, v);
      o.set_steps_taken(st.steps);
    });
  }
  // After update(): the updated masters gathered into every Param::value and the compute copies refreshed, or with
  // `later` (--overlap-param-gather) the gathers posted and left in flight: current(first, end) completes those of
  // params()[first, end) and refreshes their copies before forward reads them, settle_gathers() all of them.
  void publish(model::GptModel& gpt, bool later, Timers* timers) {
    {
      const TimerScope t(timers, TimerName::params_all_gather);
      gather_params(later);
    }
    if (later) {
      stale.assign(gpt.params().size(), 1);
      pending = true;
      return;
    }
    const TimerScope t(timers, TimerName::optimizer_copy_main_to_model_params);
    gpt.refresh_compute_weights();
  }
  void current(model::GptModel& gpt, size_t first, size_t end) {
    if (!pending) return;
    wait_params(first, end);
    for (size_t i = first; i < end; ++i)
      if (stale[i]) {
        gpt.refresh_compute_weights(i, i + 1);
        stale[i] = 0;
      }
  }
  void settle_gathers(model::GptModel& gpt) {
    if (!pending) return;
    finish_param_gather();
    current(gpt, 0, stale.size());
    pending = false;
  }
  std::vector<char> stale;  // per parameter: its compute copy predates the last step (publish with `later`)
  bool pending = false;     // gathers posted by the last step and not all waited for

  // The step's global norm, clip scale and update of every shard, timed as Megatron's phases.
  optim::StepStats norm_and_update(float lr, float clip_grad, Timers* timers) {
    optim::StepStats st;
    {
      const TimerScope t(timers, TimerName::optimizer_clip_main_grad);
      st.grad_norm = grad_norm();
      st.clip_scale = optim::clip_scale_for(st.grad_norm, clip_grad);
    }
    const TimerScope t(timers, TimerName::optimizer_inner_step);
    update(lr, st.clip_scale);
    return st;
  }
  // A checkpoint of gpt's parameters (whole on this rank) with the gathered moments. Collective (every rank skips the
  // gather alike: same flags).
  void save(const model::GptModel& gpt, const std::string& root, const TrainProgress& progress, uint64_t seed,
            int keep_last, const CheckpointSaveOptions& parts, AsyncCheckpointSaver* async) const {
    const OptimizerState st = parts.save_optim ? gather(gpt.params().size()) : OptimizerState{};
    if (async)
      async->save(root, gpt, st, progress, seed, keep_last, &g, parts);
    else
      save_training_checkpoint(root, gpt, st, progress, seed, keep_last, &g, parts);
  }
  // A checkpoint into gpt's (whole) parameters and, when it holds them and parts ask, the moments into the shards;
  // without them the fresh shards stay as they are.
  LoadedTrainingState load(model::GptModel& gpt, const std::string& dir, uint64_t seed,
                           const CheckpointLoadOptions& parts, DType state_dtype) {
    OptimizerState st = OptimizerState::adam({}, {}, 0);
    if (parts.load_optim && !parts.finetune)
      for (const auto& p : gpt.params())
        for (OptimizerState::Slot& s : st.slots)
          s.per_param.push_back(Tensor::zeros(p.value.shape(), state_dtype, MemCategory::workspace));
    LoadedTrainingState loaded = load_training_state(dir, gpt, st, seed, parts);
    if (loaded.optimizer_loaded) load(st);
    return loaded;
  }
};

// The state of an update as a checkpoint holds it: handles, so a load writes through them. Distributed Muon: the
// owners' handles, and for the other parameters copies broadcast from their owners (`gather`, a save) or zeros a load
// fills and drops.
OptimizerState state_of(optim::AdamW& a, bool) {
  return OptimizerState::adam(a.exp_avg(), a.exp_avg_sq(), a.steps_taken());
}
OptimizerState state_of(optim::Muon& m, bool gather) {
  auto [momentum, exp_avg, exp_avg_sq] = m.checkpoint_state(gather);
  OptimizerState st;
  st.optimizer = optim::OptimizerKind::muon;
  st.scalar = m.config().scalar_optimizer;
  st.slots = {
      {"exp_avg", std::move(exp_avg)}, {"exp_avg_sq", std::move(exp_avg_sq)}, {"momentum_buffer", std::move(momentum)}};
  st.steps = m.steps_taken();
  return st;
}
int64_t state_bytes_of(const optim::AdamW& a, const model::GptModel& gpt) {
  return a.state_bytes_per_param() * gpt.num_parameters();
}
int64_t state_bytes_of(const optim::Muon& m, const model::GptModel&) {
  return m.state_bytes();
}

// How Muon sees each of the model's parameters: which it updates (optim::muon_managed), and the fused QKV weight's
// rows per query group -- Q (the group's heads), K, V -- to orthogonalise apart unless --muon-no-split-qkv. MLA's
// projections are orthogonalised whole (as Megatron, which splits only linear_qkv).
std::vector<optim::MuonParam> muon_params(const model::GptModel& gpt, const optim::MuonConfig& cfg) {
  const model::ModelConfig& c = gpt.config();
  const int64_t D = c.head_dim(), q = c.num_attention_heads / c.query_groups() * D;
  std::vector<optim::MuonParam> out;
  for (const Param& p : gpt.params()) {
    optim::MuonParam m;
    m.managed = optim::muon_managed(p.name, p.value.dim(), p.expert_parallel);
    if (m.managed && cfg.split_qkv && p.name.ends_with("linear_qkv.weight")) m.pieces = {q, D, D};
    out.push_back(std::move(m));
  }
  return out;
}

// An optimizer whose gradients are summed in buckets (GradBuckets) on every data-parallel rank, the norm over the
// groups, and one update: AdamW with its state on every rank (U = optim::AdamW), or Muon with AdamW for the rest (U =
// optim::Muon), its state on every rank or, distributed, each parameter's on its owner.
template <class U>
class AllReduceOptimizer final : public Optimizer {
 public:
  AllReduceOptimizer(model::GptModel& gpt, U& opt, std::unique_ptr<U> owned, const TrainGroups& g, int64_t bucket,
                     bool overlap, Timers* timers)
      : gpt_(gpt), owned_(std::move(owned)), opt_(opt), g_(g), timers_(timers), checks_(gpt) {
    // Expert gradients reduce over edp, which may span the TP ranks (TP 2 x DP 1 has EDP 2 with ETP 1).
    const bool reduces = g.dense_grads().size() > 1 || g.edp.size() > 1;
    overlap_ = overlap && reduces;
    if (reduces) buckets_ = std::make_unique<GradBuckets>(gpt, g_, bucket, overlap_);
  }
  bool overlaps_grad_reduction() const override { return overlap_; }
  void begin_grad_reduction() override {
    if (buckets_) buckets_->begin();
  }
  void grad_ready(size_t first, size_t end) override {
    gpt_.sum_tensor_parallel_grads(first, end);
    buckets_->ready(gpt_, first, end);
  }
  void finish_grad_reduction() override {
    if (!overlap_) {
      gpt_.sum_tensor_parallel_grads();
      if (buckets_) buckets_->ready(gpt_, 0, gpt_.params().size());
    }
    if (buckets_) buckets_->finish(gpt_);  // (with overlap the TP sums ran as the gradients became final)
  }
  void scale_grads(float s) override {
    const ops::Context ctx{gpt_.device()};
    for (Param& p : gpt_.params()) ops::scale(p.grad, s, ctx);
  }
  std::string first_nonfinite_grad() override { return first_nonfinite_gradient(gpt_, checks_); }
  optim::StepStats step(float lr) override {
    double norm = 0;
    {
      const TimerScope t(timers_, TimerName::optimizer_clip_main_grad);
      norm = grad_norm_over_groups(gpt_, g_, checks_);
    }
    optim::StepStats st;
    {
      const TimerScope t(timers_, TimerName::optimizer_inner_step);
      st = opt_.step(lr, norm);
    }
    const TimerScope t(timers_, TimerName::optimizer_copy_main_to_model_params);
    gpt_.refresh_compute_weights();
    return st;
  }
  int64_t count_zeros_in_grad(float clip_scale) override {
    const ops::Context ctx{gpt_.device()};
    return sum_over_groups<int64_t>(gpt_, g_, checks_.zeros, [&](Tensor& part, const Param& p) {
      ops::count_zeros(part, p.grad, clip_scale, ctx);
    });
  }
  double params_norm() override {
    const ops::Context ctx{gpt_.device()};
    return std::sqrt(sum_over_groups<double>(
        gpt_, g_, checks_.sq, [&](Tensor& part, const Param& p) { ops::sum_squares(part, p.value, ctx); }));
  }
  void save(const std::string& root, const TrainProgress& progress, uint64_t seed, int keep_last,
            const CheckpointSaveOptions& parts, AsyncCheckpointSaver* async) override {
    const OptimizerState st = state_of(opt_, /*gather=*/true);
    if (async)
      async->save(root, gpt_, st, progress, seed, keep_last, &g_, parts);
    else
      save_training_checkpoint(root, gpt_, st, progress, seed, keep_last, &g_, parts);
  }
  LoadedTrainingState load(const std::string& dir, uint64_t seed, const CheckpointLoadOptions& parts) override {
    OptimizerState st = state_of(opt_, /*gather=*/false);
    const LoadedTrainingState loaded = load_training_state(dir, gpt_, st, seed, parts);
    opt_.set_steps_taken(st.steps);
    return loaded;
  }
  int64_t state_bytes() const override { return state_bytes_of(opt_, gpt_); }

 private:
  model::GptModel& gpt_;
  std::unique_ptr<U> owned_;  // the update when this optimizer made it (Muon), else null (the caller's AdamW)
  U& opt_;
  const TrainGroups& g_;
  Timers* timers_;
  GradChecks checks_;
  bool overlap_ = false;
  std::unique_ptr<GradBuckets> buckets_;
};

// ZeRO-1 (ZeroOptimizers). With --overlap-param-gather the masters arrive bucket by bucket after a step; every forward
// waits for the ranges it reads and refreshes their compute copies.
class DistributedOptimizer final : public Optimizer {
 public:
  DistributedOptimizer(model::GptModel& gpt, const optim::AdamWConfig& cfg, const TrainGroups& g, int64_t bucket,
                       bool overlap_grads, bool gather_later, int instances, Timers* timers)
      : gpt_(gpt),
        cfg_(cfg),
        zero_(gpt, cfg, g, bucket, overlap_grads, instances),
        timers_(timers),
        overlap_(overlap_grads),
        gather_later_(gather_later) {}
  bool overlaps_grad_reduction() const override { return overlap_; }
  void begin_grad_reduction() override {
    if (overlap_) zero_.begin_grad_reduction();
  }
  void grad_ready(size_t first, size_t end) override {
    gpt_.sum_tensor_parallel_grads(first, end);
    zero_.grad_ready(first, end);
  }
  void finish_grad_reduction() override {
    if (overlap_) {
      zero_.finish_grad_reduction();  // (the TP sums ran as the gradients became final)
      return;
    }
    gpt_.sum_tensor_parallel_grads();
    zero_.reduce_scatter_grads();
  }
  void scale_grads(float s) override { zero_.scale_grads(s); }
  std::string first_nonfinite_grad() override { return zero_.first_nonfinite_grad(); }
  optim::StepStats step(float lr) override {
    const optim::StepStats st = zero_.norm_and_update(lr, cfg_.clip_grad, timers_);
    zero_.publish(gpt_, gather_later_, timers_);
    return st;
  }
  int64_t count_zeros_in_grad(float clip_scale) override { return zero_.grad_zeros(clip_scale); }
  double params_norm() override { return zero_.params_norm(); }
  bool gathers_params_later() const override { return gather_later_; }
  void params_needed(size_t first, size_t end) override { zero_.current(gpt_, first, end); }
  void settle() override { zero_.settle_gathers(gpt_); }
  void save(const std::string& root, const TrainProgress& progress, uint64_t seed, int keep_last,
            const CheckpointSaveOptions& parts, AsyncCheckpointSaver* async) override {
    zero_.save(gpt_, root, progress, seed, keep_last, parts, async);
  }
  LoadedTrainingState load(const std::string& dir, uint64_t seed, const CheckpointLoadOptions& parts) override {
    return zero_.load(gpt_, dir, seed, parts, cfg_.state_dtype);
  }
  int64_t state_bytes() const override { return zero_.state_bytes(); }

 private:
  model::GptModel& gpt_;
  optim::AdamWConfig cfg_;
  ZeroOptimizers zero_;
  Timers* timers_;
  bool overlap_, gather_later_;
};

// The memory of the last FSDP unit given back (its values, or its gradients), kept for the next unit to take: the
// decoder layers are alike, so the next one's tensors find storages of their sizes, and a gather or a backward writes
// pages already mapped. The allocator hands back fresh pages, which fault in on first touch: a 51 MB tensor is written
// in 32 ms then against 9 ms again (docs/performance.md), and optim_grads_params takes a unit's memory twice per
// micro-batch. What the next unit does not take is given back to the allocator before it allocates the rest, so at
// any time the kept memory and the units' hold no more than releasing and taking anew would (the memory plan stands).
// (Where consecutive units differ -- a dense layer before the MoE ones -- the tensors the other lacks are allocated.)
class SpareUnitMemory {
 public:
  // Shells for a unit's tensors: per (bytes, category), as many as the unit holding the most of them has.
  explicit SpareUnitMemory(const std::vector<std::vector<const Tensor*>>& units) {
    std::map<std::pair<int64_t, MemCategory>, std::pair<size_t, Tensor>> most;  // (count, an example)
    for (const std::vector<const Tensor*>& unit : units) {
      std::map<std::pair<int64_t, MemCategory>, size_t> n;
      for (const Tensor* t : unit) {
        auto& [count, example] = most[{t->nbytes(), t->category()}];
        count = std::max(count, ++n[{t->nbytes(), t->category()}]);
        example = *t;
      }
    }
    for (const auto& [key, m] : most)
      for (size_t i = 0; i < m.first; ++i)
        shells_.push_back(Tensor::released(m.second.shape(), m.second.dtype(), key.second, m.second.device()));
  }
  // A unit's tensors given back: when it holds memory, what was kept before goes to the allocator and its memory is
  // kept (a tensor sharing a storage given back before is skipped).
  void keep(const std::vector<const Tensor*>& unit) {
    if (std::none_of(unit.begin(), unit.end(), [](const Tensor* t) { return t->resident(); })) return;
    give_back();
    for (const Tensor* t : unit) {
      if (!t->resident()) continue;
      Tensor* shell = find(*t, /*resident=*/false);
      if (shell)
        shell->take_storage_of(*t);
      else
        t->release_storage();
    }
  }
  // A unit's released tensors made resident, the kept memory first (contents undefined); returns which were given
  // memory (a buffer reused by the next call: the step allocates nothing).
  const std::vector<char>& take(const std::vector<const Tensor*>& unit) {
    taken_.assign(unit.size(), 0);
    for (size_t i = 0; i < unit.size(); ++i) {
      if (unit[i]->resident()) continue;
      taken_[i] = 1;
      if (Tensor* shell = find(*unit[i], /*resident=*/true)) unit[i]->take_storage_of(*shell);
    }
    give_back();
    for (const Tensor* t : unit) t->reacquire_storage();
    return taken_;
  }
  void give_back() {
    for (const Tensor& s : shells_) s.release_storage();
  }

 private:
  Tensor* find(const Tensor& t, bool resident) {
    for (Tensor& s : shells_)
      if (s.resident() == resident && s.nbytes() == t.nbytes() && s.category() == t.category()) return &s;
    return nullptr;
  }
  std::vector<Tensor> shells_;
  std::vector<char> taken_;
};

// Megatron-FSDP's optim_grads and optim_grads_params over the distributed optimizer's shards (ZeroOptimizers), with
// one bucket per FSDP unit (a decoder layer or an MTP depth, GptModel::fsdp_units) and one per parameter outside them.
// Gradients: a unit's are taken (zeroed) before its backward, reduce-scattered and added into this rank's shard once it
// is done, then released; the others stay whole and are zeroed after each micro-batch's reduction. With shard_params
// (optim_grads_params) the f32 masters live in the shards: a unit's values (and compute copies) are taken and gathered
// before its forward or backward reads them -- the next unit in the pass's direction prefetched meanwhile, its gather
// in flight -- and released when another unit is needed after the pass has finished with it; the parameters outside the
// units stay whole and are gathered after each step. Arithmetic: each micro-batch's gradients are summed over the group
// in rank order, then added to the shard (Megatron's reduce-then-accumulate); with one micro-batch per step that is
// the distributed optimizer's sum, and AdamW updates the same elements alike.
class FsdpOptimizer final : public Optimizer {
 public:
  // gather_later (--overlap-param-gather, optim_grads): the updated parameters' gathers left in flight until forward
  // reads them, as the distributed optimizer's (optim_grads_params gathers every layer on demand anyway).
  // instances: hybrid sharding (HSDP, --num-distributed-optimizer-instances N > 1 with the outer strategy no_shard):
  // everything sharded within one instance, the summed shards all-reduced across the instances once per step.
  // shard_params: the units' values released between uses (optim_grads_params). `fsdp`: the shards' options (whether
  // the masters live in them -- with shard_params, or when narrower than f32 -- and the dtypes); masters in the shards
  // are gathered after each step, not later.
  FsdpOptimizer(model::GptModel& gpt, const optim::AdamWConfig& cfg, const TrainGroups& g, bool shard_params,
                bool gather_later, int instances, const optim::DistributedAdamWOptions& fsdp, Timers* timers)
      : gpt_(gpt),
        cfg_(cfg),
        units_(gpt.fsdp_units()),
        unit_of_(fsdp_unit_of(gpt)),
        zero_(gpt, cfg, g, /*bucket=*/1, /*overlap=*/gather_later && !fsdp.shard_params, instances, &unit_of_, fsdp),
        timers_(timers),
        shard_params_(shard_params),
        gather_later_(gather_later && !fsdp.shard_params),
        unit_values_(unit_tensors(gpt, units_, &Param::value, &Param::compute)),
        unit_grads_(unit_tensors(gpt, units_, &Param::grad)),
        spare_values_(shard_params ? unit_values_ : std::vector<std::vector<const Tensor*>>{}),
        spare_grads_(unit_grads_) {
    for (const auto& u : units_) unit_buckets_.push_back(buckets_of(u.first, u.second));
    for (size_t k = 0; k < ZeroOptimizers::kinds; ++k)
      if (zero_.opt[k]) reported_[k].assign(static_cast<size_t>(zero_.opt[k]->num_buckets()), 0);
    resident_.assign(units_.size(), 0);
    done_.assign(units_.size(), 0);
    for (size_t u = 0; u < units_.size(); ++u) {
      release_grads(u);
      if (shard_params_) release_params(u);
    }
    spare_grads_.give_back();
    spare_values_.give_back();
  }
  bool overlaps_grad_reduction() const override { return true; }
  bool reduces_every_micro_batch() const override { return true; }
  bool follows_units() const override { return true; }
  void begin_grad_reduction() override {
    zero_.each([](optim::DistributedAdamW& o, const auto&) { o.zero_shard_grads(); });
    for (std::vector<char>& r : reported_) std::fill(r.begin(), r.end(), 0);
  }
  // A range's gradients hold this micro-batch's contribution: its tensor-parallel sums, its buckets' reductions, then
  // a unit's gradients released and the others zeroed for the next micro-batch.
  void grad_ready(size_t first, size_t end) override {
    gpt_.sum_tensor_parallel_grads(first, end);
    auto it = range_buckets_.find({first, end});  // (the model reports the same ranges every micro-batch)
    if (it == range_buckets_.end()) it = range_buckets_.emplace(std::pair{first, end}, buckets_of(first, end)).first;
    for (const auto& [k, b] : it->second) {
      zero_.opt[k]->reduce_bucket(b);
      reported_[k][b] = 1;
    }
    const int u = unit_of_[first];
    if (u >= 0 && units_[static_cast<size_t>(u)] == std::pair{first, end}) return release_grads(static_cast<size_t>(u));
    for (size_t i = first; i < end; ++i) gpt_.params()[i].grad.zero_();
  }
  // Buckets whose gradients were never reported this step (none when the model reports every range) are reduced now.
  void finish_grad_reduction() override {
    for (size_t k = 0; k < ZeroOptimizers::kinds; ++k) {
      if (!zero_.opt[k]) continue;
      for (size_t b = 0; b < static_cast<size_t>(zero_.opt[k]->num_buckets()); ++b) {
        if (reported_[k][b]) continue;
        const auto [first, end] = zero_.opt[k]->bucket_params(b);
        bool resident = true;
        for (size_t j = first; j < end; ++j) resident = resident && gpt_.params()[zero_.idx[k][j]].grad.resident();
        if (resident) zero_.opt[k]->reduce_bucket(b);
      }
    }
    zero_.each([](optim::DistributedAdamW& o, const auto&) { o.finish_main_grads(); });
  }
  void scale_grads(float s) override { zero_.scale_grads(s); }
  std::string first_nonfinite_grad() override { return zero_.first_nonfinite_grad(); }
  optim::StepStats step(float lr) override {
    if (shard_params_)  // (no pass reads them before the next gathers)
      for (size_t u = 0; u < units_.size(); ++u) release_params(u);
    const optim::StepStats st = zero_.norm_and_update(lr, cfg_.clip_grad, timers_);
    zero_.publish(gpt_, gather_later_, timers_);  // (shard_params: the parameters outside the units)
    return st;
  }
  int64_t count_zeros_in_grad(float clip_scale) override { return zero_.grad_zeros(clip_scale); }
  double params_norm() override { return zero_.params_norm(); }
  void params_needed(size_t first, size_t end) override {
    zero_.current(gpt_, first, end);  // (gather_later)
    if (!shard_params_ || unit_of_[first] < 0) return;
    const auto u = static_cast<size_t>(unit_of_[first]);
    for (size_t v = 0; v < units_.size(); ++v)
      if (v != u && done_[v] && resident_[v]) release_params(v);
    done_[u] = 0;
    if (last_needed_ >= 0 && u != static_cast<size_t>(last_needed_)) forward_ = u > static_cast<size_t>(last_needed_);
    last_needed_ = static_cast<int64_t>(u);
    gather(u);
    const size_t next = forward_ ? u + 1 : u - 1;  // (u - 1 wraps past 0 to SIZE_MAX: none)
    if (next < units_.size() && !resident_[next])
      for (const auto& [k, b] : unit_buckets_[next]) zero_.opt[k]->post_gather(b);
  }
  void params_released(size_t first, size_t) override {
    if (shard_params_ && unit_of_[first] >= 0) done_[static_cast<size_t>(unit_of_[first])] = 1;
  }
  void grads_needed(size_t first, size_t end) override {
    const int u = unit_of_[first];
    if (u < 0 || units_[static_cast<size_t>(u)] != std::pair{first, end}) {  // (outside the units: always resident)
      for (size_t i = first; i < end; ++i)
        MOECORE_CHECK(gpt_.params()[i].grad.resident(), "fsdp: the gradient of ", gpt_.params()[i].name,
                      " is released outside its unit");
      return;
    }
    const std::vector<const Tensor*>& grads = unit_grads_[static_cast<size_t>(u)];
    const std::vector<char>& taken = spare_grads_.take(grads);
    for (size_t i = 0; i < grads.size(); ++i)
      if (taken[i]) Tensor(*grads[i]).zero_();
  }
  // Every unit whole and current, left as done (released when the next pass needs another unit).
  void settle() override {
    zero_.settle_gathers(gpt_);
    if (!shard_params_) return;
    for (size_t u = 0; u < units_.size(); ++u) {
      gather(u);
      done_[u] = 1;
    }
  }
  void save(const std::string& root, const TrainProgress& progress, uint64_t seed, int keep_last,
            const CheckpointSaveOptions& parts, AsyncCheckpointSaver* async) override {
    settle();  // (the checkpoint holds whole parameters: any layout loads them)
    zero_.save(gpt_, root, progress, seed, keep_last, parts, async);
  }
  LoadedTrainingState load(const std::string& dir, uint64_t seed, const CheckpointLoadOptions& parts) override {
    settle();
    const LoadedTrainingState loaded = zero_.load(gpt_, dir, seed, parts, cfg_.state_dtype);
    zero_.each([](optim::DistributedAdamW& o, const auto&) { o.take_masters_from_values(); });
    return loaded;
  }
  int64_t state_bytes() const override { return zero_.state_bytes(); }

 private:
  // The (instance, bucket) pairs of params()[first, end), in order; the buckets must lie inside the range.
  std::vector<std::pair<size_t, size_t>> buckets_of(size_t first, size_t end) const {
    std::vector<std::pair<size_t, size_t>> out;
    for (size_t i = first; i < end; ++i) {
      const auto k = static_cast<size_t>(zero_.where[i].first);
      const size_t b = zero_.opt[k]->bucket_of(zero_.where[i].second);
      if (!out.empty() && out.back() == std::pair<size_t, size_t>{k, b}) continue;
      if (std::find(out.begin(), out.end(), std::pair<size_t, size_t>{k, b}) != out.end()) continue;
      const auto [bf, be] = zero_.opt[k]->bucket_params(b);
      MOECORE_CHECK(zero_.idx[k][bf] >= first && zero_.idx[k][be - 1] < end, "fsdp: parameters [", first, ", ", end,
                    ") cut a bucket of ", gpt_.params()[i].name);
      out.emplace_back(k, b);
    }
    return out;
  }
  // Per unit: its parameters' tensors of the given members (a compute copy that is the value counted once).
  template <class... Member>
  static std::vector<std::vector<const Tensor*>> unit_tensors(const model::GptModel& gpt,
                                                              const std::vector<std::pair<size_t, size_t>>& units,
                                                              Member... member) {
    std::vector<std::vector<const Tensor*>> out;
    for (const auto& [first, end] : units) {
      std::vector<const Tensor*>& ts = out.emplace_back();
      for (size_t i = first; i < end; ++i)
        for (const Tensor* t : {&(gpt.params()[i].*member)...})
          if (std::none_of(ts.begin(), ts.end(), [&](const Tensor* o) { return o->same_data(*t); })) ts.push_back(t);
    }
    return out;
  }
  void release_grads(size_t u) { spare_grads_.keep(unit_grads_[u]); }
  void release_params(size_t u) {
    spare_values_.keep(unit_values_[u]);
    resident_[u] = 0;
    done_[u] = 0;
  }
  // Unit u whole: its storages taken, its buckets' gathers completed into them, its compute copies refreshed.
  void gather(size_t u) {
    if (resident_[u]) return;
    spare_values_.take(unit_values_[u]);
    for (const auto& [k, b] : unit_buckets_[u]) zero_.opt[k]->wait_gather(b);
    resident_[u] = 1;
    gpt_.refresh_compute_weights(units_[u].first, units_[u].second);
  }

  model::GptModel& gpt_;
  optim::AdamWConfig cfg_;
  std::vector<std::pair<size_t, size_t>> units_;
  std::vector<int> unit_of_;  // per parameter: its unit, or -1
  ZeroOptimizers zero_;
  Timers* timers_;
  bool shard_params_, gather_later_;
  std::vector<std::vector<std::pair<size_t, size_t>>> unit_buckets_;  // per unit: its (instance, bucket) pairs
  // The (instance, bucket) pairs of each range grad_ready has been given, and per instance the buckets reduced this
  // step (filled once: the step allocates nothing).
  std::map<std::pair<size_t, size_t>, std::vector<std::pair<size_t, size_t>>> range_buckets_;
  std::vector<char> reported_[ZeroOptimizers::kinds];
  std::vector<char> resident_, done_;  // per unit (shard_params): values whole and current; the pass is past it
  std::vector<std::vector<const Tensor*>> unit_values_, unit_grads_;  // per unit: its values (and compute copies)...
  SpareUnitMemory spare_values_, spare_grads_;                        // ...and gradients, and their spare memory
  int64_t last_needed_ = -1;
  bool forward_ = true;  // the direction of the running pass (the next unit to prefetch)
};
}  // namespace

model::GptModel::StateBytesPerElement optimizer_state_bytes(const TrainConfig& cfg, const optim::AdamWConfig& adam) {
  const int64_t moments = optim::AdamW::state_bytes_per_param(adam);
  if (cfg.optimizer != optim::OptimizerKind::muon) return [=](const Param&) { return moments; };
  const int64_t scalar = optim::Muon::scalar_bytes_per_param(cfg.muon, adam);
  return [=](const Param& p) {
    return optim::muon_managed(p.name, p.value.dim(), p.expert_parallel) ? optim::Muon::muon_bytes_per_param() : scalar;
  };
}

model::MemoryPlan fsdp_memory_plan(const model::GptModel& gpt, model::MemoryPlan plan, const TrainConfig& cfg,
                                   const optim::AdamWConfig& adam, int dense_ranks, int expert_ranks, int etp_ranks) {
  if (cfg.fsdp != FsdpStrategy::optim_grads && cfg.fsdp != FsdpStrategy::optim_grads_params) return plan;
  const bool params = cfg.fsdp == FsdpStrategy::optim_grads_params;
  // The masters in the shards (FsdpOptimizer's rule), with the two gather staging areas.
  const bool masters = params || cfg.fsdp_main_params_dtype != DType::f32;
  const auto master = static_cast<int64_t>(dtype_size(cfg.fsdp_main_params_dtype));
  // HFSDP: every shard padded to N pieces, the moments one piece of each, and a piece of scratch per dtype.
  const int64_t N =
      cfg.fsdp_outer == FsdpStrategy::optim ? std::max<int64_t>(1, cfg.num_distributed_optimizer_instances) : 1;
  auto at = [&](MemCategory c) -> int64_t& { return plan.bytes[static_cast<int>(c)]; };
  const auto units = gpt.fsdp_units();
  const std::vector<int> unit_of = fsdp_unit_of(gpt);
  const auto param_bytes = [](const Param& p) {
    return p.value.nbytes() + (p.compute.same_data(p.value) ? 0 : p.compute.nbytes());
  };
  // Whole: the gradients (and, sharded parameters, the values) of the parameters outside the units, and of one unit.
  int64_t unit_grads = 0, unit_params = 0;
  for (const auto& [first, end] : units) {
    int64_t g = 0, v = 0;
    for (size_t i = first; i < end; ++i) {
      g += gpt.params()[i].grad.nbytes();
      v += param_bytes(gpt.params()[i]);
    }
    unit_grads = std::max(unit_grads, g);
    unit_params = std::max(unit_params, v);
  }
  for (size_t i = 0; i < gpt.params().size(); ++i) {
    if (unit_of[i] < 0) continue;
    at(MemCategory::gradients) -= gpt.params()[i].grad.nbytes();
    if (params) at(MemCategory::parameters) -= param_bytes(gpt.params()[i]);
  }
  at(MemCategory::gradients) += unit_grads;
  if (params) at(MemCategory::parameters) += unit_params;
  // The shards of each distributed-optimizer instance (ZeroOptimizers' kinds and buckets): moments, summed gradients,
  // masters, and the staging buffers of the largest bucket.
  at(MemCategory::optimizer_state) = 0;
  const int64_t moment = static_cast<int64_t>(dtype_size(adam.state_dtype));
  for (int k = 0; k < ZeroOptimizers::kinds; ++k) {
    const int64_t P = ZeroOptimizers::expert_kind(k) ? expert_ranks : dense_ranks;
    std::vector<size_t> idx;  // the instance's parameters, and its buckets padded to the group as DistributedAdamW's
    for (size_t i = 0; i < gpt.params().size(); ++i)
      if (ZeroOptimizers::kind_of(gpt.params()[i], etp_ranks) == k) idx.push_back(i);
    int64_t shard = 0, widest = 0;
    size_t first = 0;
    for (size_t end : fsdp_bucket_ends(idx, unit_of)) {
      int64_t n = 0;
      for (size_t j = first; j < end; ++j) n += gpt.params()[idx[j]].value.numel();
      const int64_t s = (n + P * N - 1) / (P * N) * N;
      shard += s;
      widest = std::max(widest, s * P);
      first = end;
    }
    at(MemCategory::optimizer_state) += 2 * shard / N * moment;
    const auto bytes = [](DType t) { return static_cast<int64_t>(dtype_size(t)); };
    at(MemCategory::gradients) += 4 * shard;  // (the f32 shard the update reads)
    if (cfg.fsdp_main_grads_dtype != DType::f32) at(MemCategory::gradients) += bytes(cfg.fsdp_main_grads_dtype) * shard;
    if (masters) at(MemCategory::parameters) += master * shard;
    at(MemCategory::workspace) += 4 * (widest + widest / P) + (masters ? 2 * widest * master : 0);
    if (cfg.fsdp_grad_comm_dtype != DType::f32)
      at(MemCategory::workspace) += bytes(cfg.fsdp_grad_comm_dtype) * (widest + widest / P);
    if (N > 1) at(MemCategory::workspace) += widest / P / N * (master + bytes(cfg.fsdp_main_grads_dtype));
    if (!masters && cfg.overlap_param_gather) at(MemCategory::workspace) += 4 * (shard * P + shard);  // (gathers later)
  }
  return plan;
}

model::ModelParallel fsdp_model_parallel(model::ModelParallel par, const TrainConfig& cfg) {
  par.fsdp_params = cfg.fsdp == FsdpStrategy::optim_grads_params;
  par.fsdp_grads = par.fsdp_params || cfg.fsdp == FsdpStrategy::optim_grads;
  return par;
}

std::unique_ptr<Optimizer> make_optimizer(model::GptModel& gpt, optim::AdamW& adamw, const TrainConfig& cfg,
                                          const TrainGroups& groups, Timers* timers) {
  if (cfg.optimizer == optim::OptimizerKind::muon) {
    if (gpt.config().compute_dtype == DType::f16)  // (Megatron's get_megatron_optimizer raises the same)
      MOECORE_FAIL("training: --optimizer muon does not support --fp16 (Megatron's Muon steps bf16 or fp32 only)");
    auto muon = std::make_unique<optim::Muon>(
        gpt.params(), muon_params(gpt, cfg.muon), cfg.muon, adamw.config(),
        optim::MuonGroups{groups.tp, groups.etp, groups.dense_grads(), groups.edp, cfg.use_distributed_optimizer});
    optim::Muon& m = *muon;
    return std::make_unique<AllReduceOptimizer<optim::Muon>>(gpt, m, std::move(muon), groups, cfg.ddp_bucket_size,
                                                             cfg.overlap_grad_reduce, timers);
  }
  if (cfg.fsdp == FsdpStrategy::optim_grads || cfg.fsdp == FsdpStrategy::optim_grads_params) {
    const bool params = cfg.fsdp == FsdpStrategy::optim_grads_params;
    optim::DistributedAdamWOptions o;
    o.shard_params = params || cfg.fsdp_main_params_dtype != DType::f32;
    o.grad_dtype = cfg.fsdp_main_grads_dtype;
    o.comm_dtype = cfg.fsdp_grad_comm_dtype;
    o.master_dtype = cfg.fsdp_main_params_dtype;
    o.shard_over_instances = cfg.fsdp_outer == FsdpStrategy::optim && cfg.num_distributed_optimizer_instances > 1;
    return std::make_unique<FsdpOptimizer>(gpt, adamw.config(), groups, params, cfg.overlap_param_gather,
                                           cfg.num_distributed_optimizer_instances, o, timers);
  }
  if (cfg.shards_optimizer_state())
    return std::make_unique<DistributedOptimizer>(gpt, adamw.config(), groups, cfg.ddp_bucket_size,
                                                  cfg.overlap_grad_reduce, cfg.overlap_param_gather,
                                                  cfg.num_distributed_optimizer_instances, timers);
  if (!adamw.has_state())
    MOECORE_FAIL("training: the optimizer holds no state; build it with state or set use_distributed_optimizer (",
                 "Megatron-FSDP's no_shard keeps it on every rank)");
  return std::make_unique<AllReduceOptimizer<optim::AdamW>>(gpt, adamw, nullptr, groups, cfg.ddp_bucket_size,
                                                            cfg.overlap_grad_reduce, timers);
}

}  // namespace moecore::train
