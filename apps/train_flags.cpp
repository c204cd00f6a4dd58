// The training flags (train_flags.h): kTrainFlags declares each flag once -- name, kind, the field it fills (whose
// initializer is its default), help, domain and, where one is needed, the cross-field rule that reads it. It drives
// the declaration (--help, --list-flags, --config), the domains checked at start-up, and train_config_from /
// optimizer_config_from, which are one loop over it.
#include "apps/train_flags.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "apps/megatron_flags.h"
#include "moecore/core/enum_names.h"
#include "moecore/core/error.h"

namespace moecore::apps {
namespace {

using optim::AdamWConfig;
using optim::MuonConfig;
using train::TrainConfig;

enum class Kind : uint8_t { value, flag, list };  // list: VALUE...

// ---- Fields: what a row fills, typed by its member pointer ------------------------------------------------------
// A value row reads its text (the given value, or the default, which is the field's own) into the field; an unset
// row (Megatron's None) leaves the field's "unset" value unless given; a switch sets the field (on) or clears it (off)
// when given, so two spellings of one switch fill one field.
template <class M>
struct Member;
template <class C, class T>
struct Member<T C::*> {
  using Class = C;
  using Type = T;
};
template <class T>
struct Optional : std::false_type {};
template <class T>
struct Optional<std::optional<T>> : std::true_type {
  using Type = T;
};

template <class T>
T parse_text(const Args& a, const char* f) {
  if constexpr (Optional<T>::value)
    return parse_text<typename Optional<T>::Type>(a, f);
  else if constexpr (std::is_enum_v<T>)
    return enum_parse<T>(a.str(f), f);
  else if constexpr (std::is_same_v<T, std::string>)
    return a.str(f);
  else if constexpr (std::is_floating_point_v<T>)
    return static_cast<T>(a.f64(f));
  else
    return static_cast<T>(a.i64(f));
}

// The text --help shows for a field's value: enums by name, numbers in their shortest exact spelling.
template <class T>
std::string format_value(const T& v) {
  if constexpr (Optional<T>::value) {
    return v ? format_value(*v) : std::string();
  } else if constexpr (std::is_enum_v<T>) {
    return enum_name(v);
  } else if constexpr (std::is_same_v<T, std::string>) {
    return v;
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else {
    char b[64];
    const auto r = std::to_chars(b, b + sizeof b, v);
    return std::string(b, r.ptr);
  }
}

struct Configs {
  TrainConfig* t = nullptr;
  AdamWConfig* o = nullptr;
  MuonConfig* m = nullptr;  // (t->muon when t is given)
  template <class C>
  C* of() const {
    if constexpr (std::is_same_v<C, TrainConfig>)
      return t;
    else if constexpr (std::is_same_v<C, MuonConfig>)
      return m;
    else
      return o;
  }
};

enum class FieldKind : uint8_t { none, value, unset, on, off };
struct Field {
  FieldKind kind = FieldKind::none;
  void (*read)(const Args& a, const char* flag, const Configs& c) = nullptr;  // nothing when c lacks its struct
  std::string (*show)(const Configs& c) = nullptr;                            // the field's value in c, formatted
  std::vector<std::string> (*choices)() = nullptr;                            // enums: the accepted names
};

template <auto M>
std::string show(const Configs& c) {
  using C = typename Member<decltype(M)>::Class;
  return c.of<C>() ? format_value(c.of<C>()->*M) : std::string();
}

template <auto M>
Field value_field(FieldKind kind) {
  using C = typename Member<decltype(M)>::Class;
  using T = typename Member<decltype(M)>::Type;
  Field f{kind,
          [](const Args& a, const char* flag, const Configs& c) {
            if (C* s = c.of<C>(); s && !a.str(flag).empty()) s->*M = parse_text<T>(a, flag);
          },
          show<M>, nullptr};
  if constexpr (std::is_enum_v<T>) f.choices = enum_name_list<T>;
  return f;
}
// The field's initializer is the default.
template <auto M>
Field value() {
  return value_field<M>(FieldKind::value);
}
// Megatron's None: the flag defaults to unset, and the field's initializer is its "unset" value.
template <auto M>
Field unset() {
  return value_field<M>(FieldKind::unset);
}
template <auto M>
Field on() {
  using C = typename Member<decltype(M)>::Class;
  return {FieldKind::on,
          [](const Args& a, const char* flag, const Configs& c) {
            if (C* s = c.of<C>(); s && a.on(flag)) s->*M = true;
          },
          show<M>, nullptr};
}
// A --no-... switch: given, it clears the field (whose default is true).
template <auto M>
Field off() {
  using C = typename Member<decltype(M)>::Class;
  return {FieldKind::off,
          [](const Args& a, const char* flag, const Configs& c) {
            if (C* s = c.of<C>(); s && a.on(flag)) s->*M = false;
          },
          show<M>, nullptr};
}

using Rule = void (*)(const Args& a, const char* flag, TrainConfig& t);

struct TrainFlag {
  const char* name;
  Kind kind;
  Field field;      // the field it fills ({}: read by a rule or elsewhere in the command)
  const char* def;  // rows without a field: the default ("" = Megatron's None: unset); with one, nullptr
  const char* help;
  std::optional<FlagDomain> domain = {};  // enum fields: their names when not given here
  Rule rule = nullptr;                    // run after every field is read, in the table's order
};

// ---- Rules that read more than their own flag --------------------------------------------------------------------
// Megatron's rule (training.py get_optimizer_param_scheduler): warm-up = fraction x the decay's length (samples there,
// iterations here, fractional too), and it excludes --lr-warmup-iters.
void lr_warmup_fraction(const Args& a, const char* f, TrainConfig& t) {
  if (!a.given(f)) return;
  if (a.i64("--lr-warmup-iters") != 0)
    MOECORE_FAIL("--lr-warmup-fraction and --lr-warmup-iters exclude each other (as in Megatron: give one)");
  const int64_t decay = t.lr_decay_iters > 0 ? t.lr_decay_iters : t.train_iters;
  t.lr_warmup_iters = a.f64(f) * static_cast<double>(decay);  // (fractional as in Megatron)
}

void persistent_save_interval(const Args& a, const char* f, TrainConfig& t) {
  if (!a.given(f)) return;
  if (a.given("--save-interval") && a.i64("--save-interval") != a.i64(f))
    MOECORE_FAIL("--save-interval (", a.str("--save-interval"), ") and ", f, " (", a.str(f),
                 ") name one setting (Megatron's alias); give one");
  t.save_interval = a.i64(f);
}

// torch and torch_dist are Megatron's resharding formats; moecore writes its own, which reshards too (any TP, PP, EP,
// DP on load) and commits atomically. Megatron ties torch_dcp to torch FSDP2 and fsdp_dtensor to Megatron-FSDP.
// Under either FSDP the checkpoint is the same format, written from whole parameters and loadable at any layout.
void ckpt_format(const Args& a, const char* f, TrainConfig&) {
  const std::string v = a.str(f);
  const bool megatron = a.on("--use-megatron-fsdp"), torch = a.on("--use-torch-fsdp2");
  if (v == "fsdp_dtensor" && !megatron)
    MOECORE_FAIL(f, " fsdp_dtensor is only tested with Megatron FSDP (Megatron's check): add --use-megatron-fsdp, or ",
                 "use --ckpt-format torch_dist");
  if (megatron && v != "fsdp_dtensor")
    MOECORE_FAIL("Megatron-FSDP requires the `fsdp_dtensor` checkpointing format (Megatron's check): add ", f,
                 " fsdp_dtensor");
  if (v == "torch_dcp" && !torch)
    MOECORE_FAIL(f, " torch_dcp is only tested with FSDP (Megatron's check): add --use-torch-fsdp2, or use ", f,
                 " torch_dist");
  if (torch && v != "torch_dist" && v != "torch_dcp")
    MOECORE_FAIL("--use-torch-fsdp2 requires ", f, " torch_dist or torch_dcp (Megatron's check), got ", v);
  const auto above_one = [&](const char* g) { return a.given(g) && a.i64(g) > 1; };
  if (v == "torch_dcp" && (above_one("--tensor-model-parallel-size") || above_one("--pipeline-model-parallel-size")))
    MOECORE_FAIL(f, " torch_dcp needs --tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1 (Megatron's ",
                 "check)");
}

// Megatron-FSDP (--use-megatron-fsdp, v1) and torch FSDP2 (--use-torch-fsdp2), Megatron's validate_args rules:
// Megatron-FSDP forces the distributed optimizer (with Megatron's warning) and shards as
// --data-parallel-sharding-strategy says; FSDP2 is the optim_grads_params algorithm under Megatron's other name, with
// its restrictions (its per-parameter shards and the averaging inside its collective change the rounding only). moecore
// keeps f32 main parameters, and reduces and accumulates the gradients in f32 or bf16 (auto: bf16 under --bf16, as
// Megatron); fp16 is refused naming what to pass.
void fsdp_flags(const Args& a, const char*, TrainConfig& t) {
  const bool megatron = a.on("--use-megatron-fsdp"), torch = a.on("--use-torch-fsdp2");
  const char* fsdp_only[] = {"--data-parallel-sharding-strategy", "--outer-dp-sharding-strategy",
                             "--megatron-fsdp-version",           "--megatron-fsdp-main-params-dtype",
                             "--megatron-fsdp-main-grads-dtype",  "--megatron-fsdp-grad-comm-dtype"};
  if (!megatron)
    for (const char* f : fsdp_only)
      if (a.given(f) && !megatron_is_default(*megatron_flag(f), a.str(f)))
        MOECORE_FAIL(f, " ", a.str(f), " sets Megatron-FSDP: add --use-megatron-fsdp");
  if (!torch && a.on("--torch-fsdp2-no-reshard-after-forward"))
    MOECORE_FAIL("--torch-fsdp2-no-reshard-after-forward sets torch FSDP2: add --use-torch-fsdp2");
  const auto above_one = [&](const char* f) { return a.given(f) && a.i64(f) > 1; };
  if (a.on("--init-model-with-meta-device") && megatron && a.str("--data-parallel-sharding-strategy") == "no_shard")
    MOECORE_FAIL("--init-model-with-meta-device is not supported with --data-parallel-sharding-strategy no_shard ",
                 "(Megatron's check)");
  if (megatron && torch)
    MOECORE_FAIL("--use-megatron-fsdp and --use-torch-fsdp2 exclude each other (Megatron's check): give one");
  if (torch) {  // (Megatron's validate_args for torch FSDP2)
    if (a.on("--use-distributed-optimizer"))
      MOECORE_FAIL("--use-torch-fsdp2 is not supported with the distributed optimizer (Megatron's check): drop ",
                   "--use-distributed-optimizer");
    if (above_one("--pipeline-model-parallel-size") || above_one("--expert-model-parallel-size"))
      MOECORE_FAIL("--use-torch-fsdp2 needs --pipeline-model-parallel-size 1 and --expert-model-parallel-size 1 (",
                   "Megatron's check); Megatron-FSDP (--use-megatron-fsdp) works with both");
    if (!a.on("--no-gradient-accumulation-fusion"))
      MOECORE_FAIL("--use-torch-fsdp2 needs --no-gradient-accumulation-fusion (Megatron's check)");
    if (!a.on("--untie-embeddings-and-output-weights"))
      MOECORE_FAIL("--use-torch-fsdp2 needs --untie-embeddings-and-output-weights (Megatron's check)");
    if (a.on("--fp16")) MOECORE_FAIL("--use-torch-fsdp2 is not supported with --fp16 (Megatron's check)");
    if (a.on("--torch-fsdp2-no-reshard-after-forward"))
      MOECORE_FAIL("--torch-fsdp2-no-reshard-after-forward (every layer kept gathered from its forward to its ",
                   "backward) is not supported; leave it out to gather each layer again before its backward");
    t.fsdp = train::FsdpStrategy::optim_grads_params;
    t.use_distributed_optimizer = true;  // (moecore's sharded optimizer state; FSDP2 steps the local shards too)
    // FSDP2 reduces and accumulates in the parameters' dtype (here averaged by pre-scaling, not in the collective)
    t.fsdp_main_grads_dtype = t.fsdp_grad_comm_dtype = a.on("--bf16") ? DType::bf16 : DType::f32;
    return;
  }
  if (!megatron) return;
  if (a.str("--megatron-fsdp-version") != "1")
    MOECORE_FAIL("--megatron-fsdp-version ", a.str("--megatron-fsdp-version"),
                 " (Megatron's experimental FSDP v2) is not supported; use 1, the default");
  if (!t.use_distributed_optimizer) {
    std::fprintf(stderr,
                 "warning: Megatron-FSDP v1 is only compatible with --use-distributed-optimizer. Using "
                 "DistributedOptimizer... (Megatron's check)\n");
    t.use_distributed_optimizer = true;
  }
  const std::string s = a.str("--data-parallel-sharding-strategy");
  t.fsdp = s == "no_shard"      ? train::FsdpStrategy::no_shard
           : s == "optim"       ? train::FsdpStrategy::optim
           : s == "optim_grads" ? train::FsdpStrategy::optim_grads
                                : train::FsdpStrategy::optim_grads_params;
  if (a.str("--outer-dp-sharding-strategy") == "optim") {
    if (t.fsdp != train::FsdpStrategy::optim_grads_params)
      MOECORE_FAIL("--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy optim_grads_params ",
                   "(Megatron's check), got ", s);
    t.fsdp_outer = train::FsdpStrategy::optim;
  }
  // auto: the parameters' dtype (the main gradients'), as Megatron's mixed-precision policy
  const DType params = a.on("--bf16") ? DType::bf16 : a.on("--fp16") ? DType::f16 : DType::f32;
  const auto dtype_of = [&](const char* f, DType auto_dtype) {
    const std::string v = a.str(f);
    return v == "auto" ? auto_dtype : v == "bf16" ? DType::bf16 : v == "fp16" ? DType::f16 : DType::f32;
  };
  t.fsdp_main_params_dtype = dtype_of("--megatron-fsdp-main-params-dtype", params);
  const auto dtype = [&](const char* f, DType auto_dtype) {
    const std::string v = a.str(f);
    const DType t = dtype_of(f, auto_dtype);
    if (t == DType::f16)
      MOECORE_FAIL(f, " ", v, v == "auto" ? " (fp16 under --fp16)" : "", " is not supported: moecore reduces and ",
                   "accumulates Megatron-FSDP's gradients in fp32 or bf16; pass ", f, " fp32");
    return t;
  };
  t.fsdp_main_grads_dtype = dtype("--megatron-fsdp-main-grads-dtype", params);
  t.fsdp_grad_comm_dtype = dtype("--megatron-fsdp-grad-comm-dtype", t.fsdp_main_grads_dtype);
}

// Megatron's validate_args: an asynchronous save needs the persistent worker, or it is switched off with a warning.
void async_save(const Args& a, const char*, TrainConfig& t) {
  if (t.async_save && !a.on("--use-persistent-ckpt-worker")) {
    std::fprintf(stderr,
                 "warning: --async-save is not supported without --use-persistent-ckpt-worker. Disabling "
                 "--async-save. (Megatron's check)\n");
    t.async_save = false;
  }
}

// Megatron's validate_args: without an asynchronous save the strategy is mcore.
void async_strategy(const Args&, const char*, TrainConfig& t) {
  if (!t.async_save) t.async_strategy = train::AsyncStrategy::mcore;
}

// Megatron: above 19 is 19 (below 0 leaves the priority as it is: the writer's rule).
void async_ckpt_cpu_priority(const Args&, const char*, TrainConfig& t) {
  t.async_ckpt_cpu_priority = std::min(t.async_ckpt_cpu_priority, 19);
}

// Megatron's training/determinism.py: the options that are not deterministic are refused (never switched off).
// moecore's kernels use no atomics and its collectives reduce in rank order, so the rest holds already.
void deterministic_mode(const Args& a, const char* f, TrainConfig&) {
  if (!a.on(f)) return;
  if (a.given("--cross-entropy-loss-fusion"))
    MOECORE_FAIL("--deterministic-mode requires: cross_entropy_loss_fusion=False (got True). Adjust these options to ",
                 "continue (Megatron's check; drop --cross-entropy-loss-fusion)");
}

// --optimizer: adam and muon (Megatron's emerging-optimizer rules: dist_muon is muon with the layer-wise distributed
// optimizer, which is refused with --use-distributed-optimizer by TrainConfig::validate); Megatron's others are
// refused.
void optimizer_choice(const Args& a, const char* f, TrainConfig& t) {
  const std::string v = a.str(f);
  if (v == "adam" || v == "muon" || v == "dist_muon") {
    t.optimizer = v == "adam" ? optim::OptimizerKind::adam : optim::OptimizerKind::muon;
    if (v == "dist_muon") {
      std::fprintf(stderr,
                   "warning: --optimizer dist_muon is deprecated (Megatron): it is --optimizer muon with "
                   "--use-distributed-optimizer\n");
      t.use_distributed_optimizer = true;
    }
  } else {
    MOECORE_FAIL(f, " ", v, " is not supported yet: use adam (AdamW) or muon");
  }
  if (t.optimizer != optim::OptimizerKind::muon)
    for (const char* m : {"--muon-momentum", "--muon-nesterov", "--muon-no-split-qkv", "--muon-num-ns-steps",
                          "--muon-coefficient-type", "--muon-scale-mode", "--muon-extra-scale-factor", "--muon-tp-mode",
                          "--muon-fp32-matmul-prec", "--muon-scalar-optimizer"})
      if (a.given(m)) MOECORE_FAIL(m, " sets the Muon optimizer, but --optimizer is ", v, ": add --optimizer muon");
  if (t.optimizer != optim::OptimizerKind::muon || a.str("--muon-scalar-optimizer") != "lion")
    for (const char* l : {"--lion-beta1", "--lion-beta2"})
      if (a.given(l) && !megatron_is_default(*megatron_flag(l), a.str(l)))
        MOECORE_FAIL(l, " ", a.str(l),
                     " sets Lion, which only --optimizer muon --muon-scalar-optimizer lion uses here ",
                     "(--optimizer lion is not supported yet)");
}

// Megatron's get_megatron_optimizer: --loss-scale is the constant scaler (with --fp16 or --bf16), --fp16 without it the
// dynamic one, whose validate_args also switches the NaN check off (overflows are the dynamic scaler's signal). The
// dynamic scaler's settings apply only to it: given another value without it they are refused (Megatron ignores them).
void loss_scaling(const Args& a, const char* f, TrainConfig& t) {
  using GKind = train::GradScalerConfig::Kind;
  const bool fp16 = a.on("--fp16"), bf16 = a.on("--bf16");
  train::GradScalerConfig& g = t.grad_scaler;
  if (a.given(f)) {
    if (!fp16 && !bf16)
      MOECORE_FAIL(f, " scales the loss of --fp16 or --bf16 training (Megatron's mixed-precision optimizer); fp32 ",
                   "training has no loss scale: drop it, or add --fp16");
    g.kind = GKind::constant;
    g.scale = static_cast<float>(a.f64(f));
  } else if (fp16) {
    g.kind = GKind::dynamic;
    g.scale = static_cast<float>(a.f64("--initial-loss-scale"));
    if (t.check_for_nan) {
      std::fprintf(stderr,
                   "warning: Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss scaling "
                   "is being used (Megatron's validation: a non-finite gradient lowers the loss scale and "
                   "skips the step)\n");
      t.check_for_nan = false;
    }
  }
  const double window = a.f64("--loss-scale-window");
  if (window != std::floor(window))
    MOECORE_FAIL("--loss-scale-window (", a.str("--loss-scale-window"),
                 ") must be a whole number of steps (the scale doubles when the steps since an overflow reach it)");
  g.min_scale = static_cast<float>(a.f64("--min-loss-scale"));
  g.window = static_cast<int64_t>(window);
  g.hysteresis = a.i64("--hysteresis");
  if (g.kind == GKind::dynamic) return;
  for (const char* d : {"--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"})
    if (a.given(d) && a.f64(d) != std::stod(megatron_flag(d)->def))
      MOECORE_FAIL(d, " sets the dynamic loss scaler, which only --fp16 without --loss-scale has",
                   fp16 ? " (this run has --loss-scale: a constant scale)" : " (this run is not --fp16)",
                   "; drop it or use --fp16");
}

using D = FlagDomain;
using T = TrainConfig;
using M = MuonConfig;
using O = AdamWConfig;
constexpr Kind V = Kind::value, S = Kind::flag;
const Field kNone{};

// clang-format off
const TrainFlag kTrainFlags[] = {
  // ---- Data
  {"--data-path", Kind::list, kNone, "", "dataset prefixes (.bin/.idx), optionally weighted: \"w1 p1 w2 p2 ...\""},
  {"--split", V, kNone, "969,30,1", "train,valid,test proportions (Megatron: unset = 969,30,1)", D::numbers(0.0)},
  {"--eod-mask-loss", S, kNone, "", "no loss on end-of-document tokens"},
  // ---- Batches and iterations
  {"--micro-batch-size", V, value<&T::micro_batch_size>(), nullptr,
   "sequences per forward/backward (Megatron: required)", D::integer(1)},
  {"--global-batch-size", V, kNone, "", "sequences per optimizer step (unset: micro-batch x data-parallel size)",
   D::integer(1)},  // (train_config_from: its default is the data-parallel size's)
  {"--train-iters", V, value<&T::train_iters>(), nullptr, "optimizer steps (Megatron: required)",
   D::integer(0, 1e12)},
  {"--seed", V, value<&T::seed>(), nullptr, "random seed (weights, data order, dropout, router noise)",
   D::integer(0, 4294967295.0)},
  // ---- Learning-rate schedule
  {"--lr", V, value<&T::lr>(), nullptr, "peak learning rate (Megatron: required)", D::number(0.0)},
  {"--min-lr", V, value<&T::min_lr>(), nullptr, "final learning rate of the decay", D::number(0.0)},
  {"--lr-warmup-iters", V, value<&T::lr_warmup_iters>(), nullptr, "linear warmup steps", D::integer(0, 1e12)},
  {"--lr-warmup-fraction", V, kNone, "",
   "warm-up as a fraction of the decay (--lr-decay-iters, else --train-iters); excludes --lr-warmup-iters",
   D::number(0.0, 1.0), lr_warmup_fraction},
  {"--lr-decay-style", V, value<&T::lr_decay_style>(), nullptr, "constant | linear | cosine | WSD"},
  {"--lr-decay-iters", V, unset<&T::lr_decay_iters>(), nullptr, "end of the decay (unset: --train-iters)",
   D::integer(1, 1e12)},
  {"--lr-wsd-decay-iters", V, unset<&T::lr_wsd_decay_iters>(), nullptr, "WSD: length of the final decay",
   D::integer(0, 1e12)},
  {"--lr-wsd-decay-style", V, value<&T::lr_wsd_decay_style>(), nullptr,
   "WSD: exponential | linear | cosine | minus_sqrt"},
  {"--override-opt_param-scheduler", S, on<&T::override_opt_param_scheduler>(), nullptr,
   "the command line's LR schedule wins over the checkpoint's"},
  {"--override-opt-param-scheduler", S, on<&T::override_opt_param_scheduler>(), nullptr,
   "the same as --override-opt_param-scheduler"},
  {"--use-checkpoint-opt_param-scheduler", S, on<&T::use_checkpoint_opt_param_scheduler>(), nullptr,
   "the checkpoint's LR schedule wins over the command line's"},
  {"--use-checkpoint-opt-param-scheduler", S, on<&T::use_checkpoint_opt_param_scheduler>(), nullptr,
   "the same as --use-checkpoint-opt_param-scheduler"},
  // ---- Optimizer (optimizer_config_from)
  {"--weight-decay", V, value<&O::weight_decay>(), nullptr,
   "decoupled weight decay on weight matrices (not norms or biases)", D::number(0.0)},
  {"--adam-beta1", V, value<&O::beta1>(), nullptr, "AdamW beta1", D::fraction()},
  {"--adam-beta2", V, value<&O::beta2>(), nullptr, "AdamW beta2", D::fraction()},
  {"--adam-eps", V, value<&O::eps>(), nullptr, "AdamW epsilon", D::positive_number()},
  {"--clip-grad", V, value<&O::clip_grad>(), nullptr, "global gradient-norm clip (0: off)", D::number(0.0)},
  {"--optimizer", V, kNone, "adam",
   "adam (AdamW, Megatron's adam) | muon (Muon for the weight matrices, AdamW for the rest) | dist_muon (deprecated: "
   "muon with --use-distributed-optimizer); Megatron's others (sgd, lion, ...) are not supported yet",
   D::one_of({"adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"}),  // (Megatron's choices)
   optimizer_choice},
  {"--muon-momentum", V, value<&M::momentum>(), nullptr, "Muon's momentum (an EMA of the gradients)", D::fraction()},
  {"--muon-nesterov", S, on<&M::nesterov>(), nullptr, "Muon orthogonalises the Nesterov look-ahead of the momentum"},
  {"--muon-no-split-qkv", S, off<&M::split_qkv>(), nullptr,
   "orthogonalise the fused QKV weight whole (default: its Q, K and V rows apart)"},
  {"--muon-num-ns-steps", V, value<&M::num_ns_steps>(), nullptr, "Newton-Schulz iterations per update",
   D::integer(1, 1000)},
  {"--muon-coefficient-type", V, value<&M::coefficient_type>(), nullptr,
   "the Newton-Schulz coefficients: quintic | simple | polar_express | cans | aol | deepseekv4"},
  {"--muon-scale-mode", V, value<&M::scale_mode>(), nullptr,
   "the update's shape scale: spectral sqrt(max(rows, cols)) | unit_rms_norm sqrt(rows/cols) | shape_scaling "
   "sqrt(max(1, rows/cols))"},
  {"--muon-extra-scale-factor", V, value<&M::extra_scale_factor>(), nullptr,
   "a further factor on Muon's update (0.2 matches AdamW's update size)", D::number(-std::numeric_limits<double>::infinity())},
  {"--muon-tp-mode", V, value<&M::tp_mode>(), nullptr,
   "a tensor-parallel matrix: duplicated (gathered whole on every rank) | distributed (the shards orthogonalised "
   "together) | blockwise (each shard alone)"},
  {"--muon-fp32-matmul-prec", V, value<&M::fp32_matmul_prec>(), nullptr,
   "the orthogonalisation's products: medium (bf16, Megatron's default) | high (f32) | low (PyTorch ignores it: f32)"},
  {"--muon-scalar-optimizer", V, value<&M::scalar_optimizer>(), nullptr,
   "the optimizer of the parameters Muon leaves (embeddings, output layer, norms, biases): adam (AdamW with the "
   "--adam-* settings) | lion (Lion with --lion-beta1/--lion-beta2; the run's --lr, --weight-decay, --clip-grad)"},
  {"--lion-beta1", V, value<&M::lion_beta1>(), nullptr,
   "Lion's interpolation of momentum and gradient whose sign is the step (with --muon-scalar-optimizer lion)",
   D::fraction()},
  {"--lion-beta2", V, value<&M::lion_beta2>(), nullptr,
   "Lion's momentum decay (with --muon-scalar-optimizer lion)", D::fraction()},
  {"--use-precision-aware-optimizer", S, kNone, "", "allow reduced-precision optimizer states (--exp-avg-dtype)"},
  {"--exp-avg-dtype", V, kNone, "fp32", "fp32 | bf16 (with --use-precision-aware-optimizer)",
   D::one_of({"fp32", "bf16"})},
  {"--exp-avg-sq-dtype", V, kNone, "fp32", "fp32 | bf16 (with --use-precision-aware-optimizer)",
   D::one_of({"fp32", "bf16"})},
  {"--use-distributed-optimizer", S, on<&T::use_distributed_optimizer>(), nullptr,
   "ZeRO-1: optimizer state sharded over data-parallel ranks (experts: expert-DP)"},
  {"--num-distributed-optimizer-instances", V, value<&T::num_distributed_optimizer_instances>(), nullptr,
   "with --use-distributed-optimizer: the optimizer state is sharded within each of N groups of data-parallel ranks "
   "and gradients are all-reduced across the groups (Megatron's partial distributed optimizer)",
   D::integer(1, 1e6)},  // (train_cmd.cpp reads it into the ParallelConfig too)
  {"--use-megatron-fsdp", S, kNone, "",
   "Megatron-FSDP (v1): parameters, gradients and optimizer state sharded over the data-parallel ranks (experts: "
   "expert-DP) as --data-parallel-sharding-strategy says; sets --use-distributed-optimizer",
   {}, fsdp_flags},
  {"--data-parallel-sharding-strategy", V, kNone, "optim_grads_params",
   "with --use-megatron-fsdp: no_shard (plain data parallelism) | optim (the optimizer state: the distributed "
   "optimizer) | optim_grads (and the gradients, reduce-scattered after each layer's backward every micro-batch) | "
   "optim_grads_params (and the parameters, each decoder layer gathered before its forward and its backward, the next "
   "prefetched)",
   D::one_of({"no_shard", "optim", "optim_grads", "optim_grads_params"})},
  {"--outer-dp-sharding-strategy", V, kNone, "no_shard",
   "with --use-megatron-fsdp and --num-distributed-optimizer-instances N > 1 (hybrid sharding): no_shard (HSDP), "
   "each instance shards alone and the gradients are all-reduced across them; optim (HFSDP, with optim_grads_params), "
   "the optimizer state and its update sharded across the instances too",
   D::one_of({"no_shard", "optim"})},
  {"--megatron-fsdp-version", V, kNone, "1", "Megatron-FSDP's implementation: 1 (2, Megatron's experimental one, is "
   "not supported)", D::one_of({"1", "2"})},
  {"--megatron-fsdp-main-params-dtype", V, kNone, "fp32",
   "with --use-megatron-fsdp: the dtype of the main parameters AdamW updates, kept in each rank's shard under "
   "optim_grads and optim_grads_params and gathered in it: fp32 | bf16 | fp16 | auto (the parameters': bf16 under "
   "--bf16); no_shard and optim take fp32",
   D::one_of({"fp32", "bf16", "fp16", "auto"})},
  {"--megatron-fsdp-main-grads-dtype", V, kNone, "auto",
   "with --use-megatron-fsdp: the dtype optim_grads and optim_grads_params accumulate the reduced gradients in over "
   "the micro-batches: fp32 | bf16 | auto (the parameters': bf16 under --bf16); no_shard and optim take fp32",
   D::one_of({"fp32", "bf16", "fp16", "auto"})},
  {"--megatron-fsdp-grad-comm-dtype", V, kNone, "auto",
   "with --use-megatron-fsdp: the dtype the gradients are reduce-scattered in: fp32 | bf16 | auto (the main "
   "gradients')", D::one_of({"fp32", "bf16", "fp16", "auto"})},
  {"--use-torch-fsdp2", S, kNone, "",
   "torch FSDP2's sharding (each layer's parameters gathered before use, gradients reduce-scattered, state sharded): "
   "the optim_grads_params algorithm, gradients in the parameters' dtype, under Megatron's restrictions (PP 1, EP 1, untied "
   "embeddings, --no-gradient-accumulation-fusion, no --use-distributed-optimizer)"},
  {"--init-model-with-meta-device", S, kNone, "",
   "build the model on the meta device and initialise it module by module into FSDP's shards: what moecore always "
   "does (Megatron-FSDP's optim_grads_params draws each layer's initial values into its shards, its gradients and "
   "optim_grads' are born released; no rank holds the whole model), so the flag changes nothing; without FSDP each "
   "tensor is allocated and initialised once anyway"},
  {"--torch-fsdp2-no-reshard-after-forward", S, kNone, "",
   "with --use-torch-fsdp2: keep the layers gathered from forward to backward (not supported)"},
  // ---- Loss scaling and non-finite values
  {"--loss-scale", V, kNone, "",
   "a constant loss scale for --fp16 or --bf16 (without it --fp16 scales dynamically); steps whose gradients overflow "
   "are skipped", D::positive_number(), loss_scaling},
  {"--initial-loss-scale", V, kNone, "4294967296", "the dynamic loss scale's start (--fp16)",
   D::positive_number()},  // (the four below: read by --loss-scale's rule)
  {"--min-loss-scale", V, kNone, "1.0", "the dynamic loss scale's floor (--fp16)", D::positive_number()},
  {"--loss-scale-window", V, kNone, "1000",
   "steps without an overflow after which the dynamic loss scale doubles (--fp16)", D::number(1)},
  {"--hysteresis", V, kNone, "2",
   "overflowing steps (since the last doubling) after which the dynamic loss scale halves (--fp16)", D::integer(1)},
  {"--no-check-for-nan-in-loss-and-grad", S, off<&T::check_for_nan>(), nullptr,
   "do not check loss and gradients for NaN/Inf"},
  {"--nan-action", V, value<&T::nan_action>(), nullptr,
   "on NaN/Inf: stop (error naming the tensor) | skip (drop the step; 10 skipped in a row stop the run with an error; "
   "moecore)"},
  {"--calculate-per-token-loss", S, on<&T::calculate_per_token_loss>(), nullptr,
   "the loss and its gradient over the global batch's counted tokens (each token weighs alike; without it each "
   "micro-batch's mean does); the MoE auxiliary losses keep their weight, as Megatron"},
  {"--deterministic-mode", S, kNone, "",
   "bitwise reproducible runs: refuses --cross-entropy-loss-fusion as Megatron; moecore's kernels and reductions are "
   "deterministic already", {}, deterministic_mode},
  // ---- Device
  {"--device", V, kNone, "cpu",
   "cpu | cuda | sim: where parameters, activations and every op live (moecore; sim is the simulated device of the "
   "test suite: host memory that only ops touch)", D::one_of({"cpu", "cuda", "sim"})},
  // ---- Checkpoints
  {"--save", V, value<&T::save>(), nullptr, "checkpoint directory"},
  {"--load", V, value<&T::load>(), nullptr, "resume from the newest committed checkpoint under this directory"},
  {"--ckpt-step", V, unset<&T::ckpt_step>(), nullptr,
   "with --load: load this iteration instead of the newest (Megatron)", D::integer(0, 1e12)},
  {"--load-hf", V, kNone, "",
   "start from a Hugging Face model directory's weights (its config.json fills the model flags as --hf-config); a "
   "committed checkpoint under --load takes precedence, so restarts resume (moecore only)"},
  {"--save-interval", V, unset<&T::save_interval>(), nullptr, "steps between checkpoints (unset: only at the end)",
   D::integer(1, 1e12)},
  {"--persistent-save-interval", V, kNone, "", "Megatron's other name of --save-interval", D::integer(1, 1e12),
   persistent_save_interval},
  {"--exit-interval", V, unset<&T::exit_interval>(), nullptr, "stop (after saving) at multiples of this iteration",
   D::integer(1, 1e12)},
  {"--exit-duration-in-mins", V, unset<&T::exit_duration_mins>(), nullptr,
   "save (with --save) and stop once the run has trained this many minutes (the slowest rank decides)",
   D::integer(1, 1e9)},
  {"--exit-signal-handler", S, on<&T::exit_signal_handler>(), nullptr,
   "on SIGTERM/SIGINT save a checkpoint and stop (without it the signal kills)"},
  {"--keep-last-checkpoints", V, value<&T::keep_last>(), nullptr,
   "keep only the newest N checkpoints (0: all; moecore)", D::integer(0)},
  {"--allow-other-models-in-save", S, on<&T::allow_other_models_in_save>(), nullptr,
   "save into a --save directory that holds checkpoints of another model (refused otherwise); "
   "--keep-last-checkpoints still removes only this model's (moecore)"},
  {"--no-load-optim", S, off<&T::load_optim>(), nullptr, "load weights and progress, not the optimizer state"},
  {"--no-load-rng", S, off<&T::load_rng>(), nullptr, "do not restore the random state (router noise positions)"},
  {"--no-save-optim", S, off<&T::save_optim>(), nullptr, "checkpoints without the optimizer state"},
  {"--no-save-rng", S, off<&T::save_rng>(), nullptr, "checkpoints without the random state"},
  {"--finetune", S, on<&T::finetune>(), nullptr,
   "load only the weights: iteration 0, fresh optimizer and random state"},
  {"--ckpt-format", V, kNone, "torch_dist",
   "torch_dist | torch: moecore's checkpoint format (safetensors + COMMIT manifest; resharded on load to any TP, PP, "
   "EP, DP, as torch_dist); fsdp_dtensor names it under --use-megatron-fsdp (which requires it, as Megatron), "
   "torch_dcp under --use-torch-fsdp2",
   D::one_of({"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"}), ckpt_format},
  {"--dist-ckpt-strictness", V, value<&T::ckpt_strictness>(), nullptr,
   "on load, checkpoint tensors the model does not take: raise_all refuses them, the other modes load the rest and name "
   "them in a warning; tensors the model needs that the checkpoint lacks: assume_ok_unexpected and the raise modes "
   "refuse the load, the others leave them at their initial values and name them in a warning"},
  {"--check-weight-hash-across-dp-replicas-interval", V, unset<&T::check_weight_hash_interval>(), nullptr,
   "every N steps, compare a hash of each parameter across its data-parallel replicas; a divergence stops the run "
   "naming the tensor and the ranks (unset: never)", D::integer(1, 1e12)},
  {"--async-save", S, on<&T::async_save>(), nullptr,
   "checkpoints written by a background worker while training goes on (a snapshot in host memory at the save point; "
   "committed at a later step boundary once every rank's files are durable; the save in flight is finished before the "
   "run ends); needs --use-persistent-ckpt-worker, as in Megatron", {}, async_save},
  {"--use-persistent-ckpt-worker", S, on<&T::use_persistent_ckpt_worker>(), nullptr,
   "one long-lived writer thread for --async-save (its snapshot buffers are kept from save to save)"},
  {"--async-strategy", V, value<&T::async_strategy>(), nullptr,
   "nvrx | mcore: Megatron's two writer implementations; both are moecore's writer here (mcore without --async-save, "
   "as Megatron)", {}, async_strategy},
  {"--async-ckpt-use-cpu-shm", S, on<&T::async_ckpt_use_cpu_shm>(), nullptr,
   "stage device tensors in shared host memory: the snapshot is always in this process's host memory here"},
  {"--async-ckpt-cpu-priority", V, value<&T::async_ckpt_cpu_priority>(), nullptr,
   "the writer thread's nice value (above 19: 19; below 0: left as it is, as Megatron)", D::integer(-20, 1e6),
   async_ckpt_cpu_priority},
  // ---- Logging and metrics
  {"--log-interval", V, value<&T::log_interval>(), nullptr, "steps between log lines", D::integer(1, 1e12)},
  {"--eval-interval", V, unset<&T::eval_interval>(), nullptr,
   "steps between validations (Megatron: required for validation; unset here: only at the end)",
   D::integer(1, 1e12)},
  {"--eval-iters", V, value<&T::eval_iters>(), nullptr, "validation batches per evaluation", D::integer(0, 1e12)},
  {"--metrics-jsonl", V, value<&T::metrics_jsonl>(), nullptr,
   "write one JSON object per logged iteration to this file (moecore)"},
  {"--tensorboard-dir", V, value<&T::tensorboard_dir>(), nullptr, "write TensorBoard event files here"},
  {"--moe-per-layer-logging", S, on<&T::moe_per_layer_logging>(), nullptr,
   "log tokens per expert, load, drops and losses of every MoE layer"},
  {"--log-params-norm", S, on<&T::log_params_norm>(), nullptr,
   "the L2 norm of all parameters (each counted once over TP, PP, EP) on the log line and as params-norm"},
  {"--log-num-zeros-in-grad", S, on<&T::log_num_zeros_in_grad>(), nullptr,
   "the number of zero gradient elements after clipping on the log line and as num-zeros"},
  {"--log-throughput", S, on<&T::log_throughput>(), nullptr,
   "Megatron's 'throughput per GPU (TFLOP/s/GPU)' on the log line (with --log-timers-to-tensorboard also the "
   "throughput metric); moecore's tokens/s, TFLOP/s and MFU are always there"},
  {"--log-timers-to-tensorboard", S, on<&T::log_timers_to_tensorboard>(), nullptr,
   "the timers of --timing-log-level as <name>-time metrics (the slowest rank's seconds per step)"},
  {"--timing-log-level", V, value<&T::timing_log_level>(), nullptr,
   "0: the iteration time; 1: and the step's phases (forward-backward, gradient reduction, parameter gather, "
   "optimizer parts), with Megatron's '(min, max) time across ranks (ms)' block after each log line; 2: and the "
   "per-micro-batch ones (batch-generator, forward/backward compute, pipeline sends and receives)",
   D::one_of({"0", "1", "2"})},
  {"--timing-log-option", V, value<&T::timing_log_option>(), nullptr,
   "the timers block: max (the slowest rank) | minmax | all (every rank)"},
  {"--log-memory-to-tensorboard", S, on<&T::log_memory_to_tensorboard>(), nullptr,
   "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count and mem-reserved-bytes (the CUDA pool's; on "
   "the host the resident set) in the metrics"},
  {"--logging-level", V, unset<&T::logging_level>(), nullptr,
   "Python's logging levels: above 20 (INFO) hides the notes (timers block, MoE per-layer lines, load notes), above 30 "
   "(WARNING) the warnings too; the step, validation and checkpoint lines and errors always show, as in Megatron",
   D::integer(0, 100)},
  {"--no-log-loss-scale-to-tensorboard", S, off<&T::log_loss_scale_to_tensorboard>(), nullptr,
   "no loss-scale metric"},
  {"--disable-log-loss-scale-to-tensorboard", S, off<&T::log_loss_scale_to_tensorboard>(), nullptr,
   "Megatron's other name of --no-log-loss-scale-to-tensorboard"},
  {"--log-validation-ppl-to-tensorboard", S, on<&T::log_validation_ppl>(), nullptr,
   "validation perplexity as 'lm loss validation ppl' in TensorBoard (valid_lm_loss_ppl in --metrics-jsonl)"},
  // ---- Parallel layout (read into the ParallelConfig by train_cmd.cpp)
  {"--tensor-model-parallel-size", V, kNone, "1",
   "TP: ranks each attention and dense layer is split over (Megatron's column/row-parallel linears)",
   D::integer(1, 1e6)},
  {"--sequence-parallel", S, kNone, "",
   "with TP > 1: norms, dropout and the residual stream split along the sequence"},
  {"--pipeline-model-parallel-size", V, kNone, "1",
   "PP: pipeline stages the decoder layers are split over (1F1B schedule; embeddings on the first, loss on the last)",
   D::integer(1, 1e6)},
  {"--context-parallel-size", V, kNone, "1",
   "CP: ranks each sequence is split over (two load-balanced chunks per rank; attention all-gathers K/V)",
   D::integer(1, 1e6)},
  {"--cp-comm-type", V, kNone, "p2p",
   "CP attention's communication: p2p (Megatron's ring) | allgather; moecore all-gathers for both (the same "
   "attention, without the ring's overlap)", D::one_of({"p2p", "allgather"})},
  {"--expert-tensor-parallel-size", V, kNone, "",
   "ETP: ranks each routed expert's fc1 and fc2 are split over (Parallel Folding: independent of TP); unset: the TP "
   "size, as Megatron", D::integer(1, 1e6)},
  {"--expert-model-parallel-size", V, kNone, "1",
   "EP: ranks the routed experts are spread over (mpirun -np a multiple)", D::integer(1, 1e6)},
  {"--num-layers-per-virtual-pipeline-stage", V, kNone, "",
   "with PP: decoder layers per virtual pipeline stage (model chunk): the interleaved 1F1B schedule with "
   "num-layers / PP / this chunks per rank", D::integer(1, 1e6)},
  {"--decoder-first-pipeline-num-layers", V, kNone, "",
   "with PP: decoder layers of the first stage (the others split the rest evenly)", D::integer(1, 1e6)},
  {"--decoder-last-pipeline-num-layers", V, kNone, "",
   "with PP: decoder layers of the last stage (the others split the rest evenly)", D::integer(1, 1e6)},
  {"--pipeline-model-parallel-layout", V, kNone, "",
   "with PP: Megatron's layout string, e.g. 'Et*3|(tt|)*2,tmL' (E embedding, t decoder layer, m MTP, L loss; "
   "'|' between stages)"},
  {"--num-virtual-stages-per-pipeline-rank", V, kNone, "",
   "with PP: model chunks per pipeline rank (the interleaved 1F1B schedule; each stage's layers split evenly over "
   "its chunks)", D::integer(1, 1e6)},
  {"--account-for-embedding-in-pipeline-split", S, kNone, "",
   "with PP: the embedding counts as a decoder layer when the layers are split (the first stage holds one fewer)"},
  {"--account-for-loss-in-pipeline-split", S, kNone, "",
   "with PP: the output layer and loss count as a decoder layer when the layers are split (the last stage holds one "
   "fewer)"},
  {"--microbatch-group-size-per-virtual-pipeline-stage", V, unset<&T::microbatch_group_size_per_vp_stage>(), nullptr,
   "interleaved schedule: micro-batches run through one chunk in a row (unset: the pipeline size)",
   D::integer(1, 1e6)},
  {"--use-tp-pp-dp-mapping", S, kNone, "",
   "rank order tp-cp-ep-pp-dp (pipeline stages before data-parallel replicas) instead of tp-cp-ep-dp-pp, as Megatron"},
  // ---- Gradient reduction
  {"--overlap-grad-reduce", S, on<&T::overlap_grad_reduce>(), nullptr,
   "start each gradient bucket's all-reduce (distributed optimizer: reduce-scatter) during backward, as soon as it "
   "is final"},
  {"--overlap-param-gather", S, on<&T::overlap_param_gather>(), nullptr,
   "with --use-distributed-optimizer and --overlap-grad-reduce: leave the updated parameters' all-gathers in flight "
   "until forward reads each bucket"},
  {"--ddp-bucket-size", V, kNone, "",
   "gradient elements per all-reduce / reduce-scatter bucket (unset: max(40000000, 1000000 x DP))",
   D::integer(1, 1e15)},  // (train_config_from: its default is the data-parallel size's)
  {"--distributed-timeout-minutes", V, kNone, "10",
   "how long a collective waits for its peers before the job is aborted naming the operation "
   "(MOECORE_COMM_TIMEOUT_S, in seconds, overrides it)", D::integer(1, 1e6)},
  // ---- MoE
  {"--moe-token-dispatcher-type", V, kNone, "allgather",
   "token dispatcher under EP: allgather | alltoall (flex, DeepEP/HybridEP, is not supported yet)",
   D::one_of({"allgather", "alltoall", "flex"})},  // (Megatron's choices)
  {"--moe-use-upcycling", S, kNone, "", "start the MoE model from the dense checkpoint given by --load"},
  {"--moe-upcycling-granularity", V, kNone, "1", "experts per dense MLP copy: dense ffn = g * moe ffn",
   D::integer(1, 1e6)},
  // ---- The sample after training
  {"--generate-tokens", V, kNone, "200", "tokens sampled after training (0: none; moecore)", D::integer(0, 1e6)},
  {"--prompt", V, kNone, "The ", "text the sample starts from (empty: a new document; moecore)"},
};
// clang-format on

// The default text of a row: its field's initializer, or the row's own.
std::string default_text(const TrainFlag& f) {
  if (f.field.kind == FieldKind::none) return f.def;
  if (f.field.kind != FieldKind::value) return "";  // unset, or a switch
  TrainConfig t;
  AdamWConfig o;
  return f.field.show(Configs{&t, &o, &t.muon});
}

void read_fields(const Args& a, const Configs& c) {
  for (const TrainFlag& f : kTrainFlags)
    if (f.field.read) f.field.read(a, f.name, c);
}

DType state_dtype(const Args& a, const char* flag) {
  const std::string v = a.str(flag);
  if (v != "fp32" && v != "bf16") MOECORE_FAIL(flag, " '", v, "' is not one of fp32, bf16");
  if (v == "bf16" && !a.on("--use-precision-aware-optimizer"))
    MOECORE_FAIL(flag, " bf16 requires --use-precision-aware-optimizer");
  return v == "bf16" ? DType::bf16 : DType::f32;
}

}  // namespace

// Defaults are Megatron's (megatron/training/arguments.py); "" is Megatron's None (unset).
void add_training_flags(Args& a) {
  for (const TrainFlag& f : kTrainFlags) {
    if (f.kind == Kind::flag)
      a.flag(f.name, f.help);
    else if (f.kind == Kind::list)
      a.list_option(f.name, f.help);
    else
      a.option(f.name, default_text(f), f.help);
    if (f.domain)
      a.domain(f.name, *f.domain);
    else if (f.field.choices)
      a.domain(f.name, FlagDomain::one_of(f.field.choices()));
  }
}

train::TrainConfig train_config_from(const Args& a, int64_t dp_size) {
  TrainConfig t;
  read_fields(a, Configs{&t, nullptr, &t.muon});
  // The two defaults that depend on the data-parallel size.
  t.global_batch_size = a.i64_or("--global-batch-size", t.micro_batch_size * dp_size);
  t.ddp_bucket_size = a.i64_or("--ddp-bucket-size", std::max<int64_t>(40'000'000, 1'000'000 * dp_size));
  for (const TrainFlag& f : kTrainFlags)
    if (f.rule) f.rule(a, f.name, t);
  t.validate();
  return t;
}

optim::AdamWConfig optimizer_config_from(const Args& a) {
  AdamWConfig o;
  read_fields(a, Configs{nullptr, &o});
  const DType m = state_dtype(a, "--exp-avg-dtype"), v = state_dtype(a, "--exp-avg-sq-dtype");
  if (m != v) MOECORE_FAIL("--exp-avg-dtype and --exp-avg-sq-dtype must be equal");
  o.state_dtype = m;
  o.validate();
  return o;
}

std::vector<TrainFlagField> train_flag_fields(const train::TrainConfig& t, const optim::AdamWConfig& o) {
  std::vector<TrainFlagField> out;
  TrainConfig tc = t;
  AdamWConfig oc = o;
  for (const TrainFlag& f : kTrainFlags)
    if (f.field.show) out.push_back({f.name, f.field.show(Configs{&tc, &oc, &tc.muon}), f.rule != nullptr});
  return out;
}

}  // namespace moecore::apps
