// `moecore train`: Megatron-style training of a GPT (dense or MoE) on .bin/.idx data made by
// `moecore preprocess` or Megatron's own tools, with checkpoints, metrics and a generated sample at the end.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/data_flags.h"
#include "apps/device_flag.h"
#include "apps/hf_config.h"
#include "apps/hf_load.h"
#include "apps/model_flags.h"
#include "apps/train_flags.h"
#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"
#include "moecore/core/memory.h"
#include "moecore/core/memory_limit.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/kernels/attention_scratch.h"
#include "moecore/model/hf_weights.h"
#include "moecore/model/param_specs.h"
#include "moecore/model/upcycling.h"
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/train/async_save.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/gemm_peak.h"
#include "moecore/train/schedule.h"
#include "moecore/train/step.h"
#include "moecore/train/trainer.h"

namespace moecore::apps {
namespace {

// --overlap-moe-expert-parallel-comm is accepted without effect (a schedule choice); Megatron's preconditions
// (TransformerConfig.__post_init__) still hold, so a configuration Megatron refuses is refused here too.
void check_overlap_moe_expert_parallel_comm(const Args& a) {
  const char* f = "--overlap-moe-expert-parallel-comm";
  if (!a.given(f)) return;
  const auto need = [&](bool ok, const char* megatron) {
    if (!ok) MOECORE_FAIL(f, ": ", megatron, " (Megatron's check)");
  };
  need(a.i64("--expert-model-parallel-size") > 1,
       "overlap_moe_expert_parallel_comm is only supported with expert model parallelism");
  need(a.str("--moe-token-dispatcher-type") == "alltoall",
       "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher");
  need(a.str("--recompute-granularity") != "full",
       "disable full recomputation when enabling overlap_moe_expert_parallel_comm");
  need(a.str("--recompute-method").empty(),
       "disable recomputation method when enabling overlap_moe_expert_parallel_comm");
  need(a.str("--recompute-num-layers").empty(),
       "recompute_num_layers must be None when enabling overlap_moe_expert_parallel_comm");
  need(a.i64("--pipeline-model-parallel-size") == 1 || !a.str("--num-virtual-stages-per-pipeline-rank").empty() ||
           !a.str("--num-layers-per-virtual-pipeline-stage").empty() ||
           !a.str("--pipeline-model-parallel-layout").empty(),
       "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
       "pipeline_model_parallel_size > 1");
}

// The flag the user typed for the model's config.json: --load-hf when it set --hf-config (errors must name it).
std::string hf_config_flag(const Args& a) {
  const std::string load_hf = a.str("--load-hf");
  return !load_hf.empty() && a.str("--hf-config") == load_hf ? "--load-hf" : "--hf-config";
}

// --hf-config's flags fill those unset; with --load-hf, after hf_mtp_adjust (a checkpoint that transformers'
// save_pretrained wrote: MTP off, or fresh under --mtp-num-layers). Returns whether the MTP layers are fresh.
bool hf_config_apply_for_load(Args& a) {
  const std::string flag = hf_config_flag(a), path = a.str("--hf-config"), dir = a.str("--load-hf");
  if (dir.empty() || path.empty()) {
    hf_config_apply(a, flag);
    return false;
  }
  nlohmann::json config = hf_config_load(path, flag);
  const std::optional<int64_t> given =
      a.given("--mtp-num-layers") ? std::optional<int64_t>(a.i64("--mtp-num-layers")) : std::nullopt;
  std::FILE* out = comm_initialized() && comm_world().rank() != 0 ? nullptr : stdout;
  const bool fresh = hf_mtp_adjust(config, io::HfCheckpointReader(dir), given, "moecore train", out);
  hf_config_fill(a, config, flag + " " + path);
  return fresh;
}

// --moe-use-upcycling: the dense model of the same flags (without experts) is loaded from --load and
// converted (docs/megatron-moe-spec.md §10); the MoE model then trains from iteration 0 with a fresh optimizer.
void upcycle_from_dense(model::GptModel& gpt, const Args& a, const train::TrainConfig& tcfg) {
  const model::ModelConfig& mc = gpt.config();
  if (!mc.moe.enabled()) MOECORE_FAIL("--moe-use-upcycling needs --num-experts");
  if (tcfg.load.empty()) MOECORE_FAIL("--moe-use-upcycling needs --load with the dense checkpoint");
  const int64_t g = a.i64("--moe-upcycling-granularity");
  if (g <= 0 || mc.ffn() != g * mc.moe_ffn())
    MOECORE_FAIL("--moe-upcycling-granularity (", g, ") must equal --ffn-hidden-size (", mc.ffn(),
                 ") / --moe-ffn-hidden-size (", mc.moe_ffn(), ")");
  model::ModelConfig dc = mc;
  dc.moe = moe::MoeConfig{};
  dc.moe.swiglu = mc.swiglu;
  dc.moe.glu = mc.moe.glu;
  model::GptModel dense(dc, 1, tcfg.seed);
  optim::AdamW dense_opt(dense.params(), optim::AdamWConfig{});
  const auto dir = io::checkpoint_find_latest(
      tcfg.load, tcfg.ckpt_step >= 0 ? std::optional<int64_t>(tcfg.ckpt_step) : std::nullopt);
  if (!dir) MOECORE_FAIL("--load ", tcfg.load, ": no committed checkpoint to upcycle");
  train::load_training_checkpoint(*dir, dense, dense_opt, tcfg.seed);
  model::upcycle_dense_to_moe(dense, gpt);
  std::printf(" upcycled the dense checkpoint %s into %lld experts (granularity %lld)\n", dir->c_str(),
              static_cast<long long>(mc.moe.num_experts), static_cast<long long>(g));
}

// A model whose parameters and gradients alone (fp32, 8 bytes per parameter, before optimizer state and
// activations) exceed this machine's memory is refused before anything is allocated, instead of swapping or
// being killed minutes later.
// Model chunks per pipeline rank from Megatron's two flags (1 when neither is set):
// --num-virtual-stages-per-pipeline-rank directly, --num-layers-per-virtual-pipeline-stage as num_layers / pp / it
// (even splits only, as in Megatron).
int64_t virtual_pipeline_stages(const Args& a, int64_t num_layers, int64_t pp, bool uneven) {
  const bool per_rank = !a.str("--num-virtual-stages-per-pipeline-rank").empty(),
             per_stage = !a.str("--num-layers-per-virtual-pipeline-stage").empty();
  if (per_rank && per_stage)
    MOECORE_FAIL(
        "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank exclude each other (as "
        "in Megatron)");
  if (per_rank) return a.i64("--num-virtual-stages-per-pipeline-rank");
  if (!per_stage) return 1;
  const int64_t n = a.i64("--num-layers-per-virtual-pipeline-stage");
  if (uneven)
    MOECORE_FAIL(
        "--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers: use "
        "--num-virtual-stages-per-pipeline-rank for an uneven virtual pipeline (as Megatron asks)");
  if (pp <= 1) MOECORE_FAIL("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1");
  if (num_layers % pp != 0 || (num_layers / pp) % n != 0)
    MOECORE_FAIL("--num-layers-per-virtual-pipeline-stage ", n, ": --num-layers (", num_layers,
                 ") / --pipeline-model-parallel-size (", pp, ") must be a multiple of it");
  return num_layers / pp / n;
}

// The start-up memory check (host devices: cpu and sim; a cuda run's tensors fail by the device's own message).
// `limit` is the tightest limit of core/memory_limit.h, read before the model is built. The margin is left for
// what the plan does not count: 64 MiB for the heap's overhead, OpenMP's threads, the batches and the data's pages,
// and an eighth of the plan for the kernels' smaller scratch (measured on 1 layer, H 16, S 16, --micro-batch-size
// 100000: a peak resident set of 5.19 GB against a plan, attention scratch included, of 5.36 GB).
int64_t memory_margin(int64_t planned) {
  return (int64_t{64} << 20) + planned / 8;
}

// The tightest limit (core/memory_limit.h; the machine's RAM when none can be read), shared by the ranks that mpirun
// started on this node (OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS): each reads it before any has allocated.
MemoryLimit node_memory_limit() {
  MemoryLimit l = memory_limit();
  if (!l.known()) l = {memory_physical_bytes(), memory_physical_bytes(), "of the machine's RAM (sysconf)"};
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (!local) local = std::getenv("MPI_LOCALNRANKS");
  const int64_t ranks = local ? std::max<int64_t>(1, std::atoll(local)) : 1;
  if (ranks > 1) {
    l.room /= ranks;
    l.name += "; this rank's share: 1/" + std::to_string(ranks) + " of the free memory, for the " +
              std::to_string(ranks) + " ranks on this node";
  }
  return l;
}

// On a GPU: the device's free memory before the model exists (cudaMemGetInfo); unknown when the device does not answer.
MemoryLimit device_memory_limit() {
  int64_t free_bytes = 0, total_bytes = 0;
  const std::string dev = device_description(&free_bytes, &total_bytes);
  if (total_bytes <= 0) return {};
  return {free_bytes, total_bytes, "memory of " + dev};
}

std::string memory_hint(bool activations) {
  return std::string("hint: ") +
         (activations ? "a smaller --micro-batch-size or --seq-length, activation recompute (--recompute-granularity "
                        "full), "
                      : "a smaller model, ") +
         "--use-distributed-optimizer, or more tensor-, expert- or pipeline-parallel ranks lowers the need";
}

// Before the model is built (its constructor writes every parameter, gradient and optimizer moment): the parts
// sized by the parameters alone, from the configuration.
void check_model_fits(const model::ModelConfig& mc, const model::ModelParallel& par, DType state_dtype,
                      int64_t state_shards, train::FsdpStrategy fsdp, const MemoryLimit& limit) {
  const int64_t params = model::parameters_per_rank(
      mc, std::max(1, par.ep.size()), std::max(1, par.tp.size()), std::max(1, par.etp.size()),
      [&](const std::string& name) { return model::pipeline_stage_holds(name, mc, par); });
  // f32 value and gradient, the compute-dtype copy of the weights (bf16), the two AdamW moments (sharded over the
  // data-parallel ranks by the distributed optimizer; Megatron-FSDP shards the gradients too, and optim_grads_params
  // the values and copies: the plan then counts the one layer gathered at a time)
  const int64_t compute = mc.compute_dtype == DType::f32 ? 0 : static_cast<int64_t>(dtype_size(mc.compute_dtype));
  const bool zero3 = fsdp == train::FsdpStrategy::optim_grads_params;
  const int64_t weight_shards = zero3 ? state_shards : 1,
                grad_shards = zero3 || fsdp == train::FsdpStrategy::optim_grads ? state_shards : 1;
  const int64_t state = 2 * static_cast<int64_t>(dtype_size(state_dtype));
  const auto share = [&](int64_t shards) { return shards == 1 ? params : params / shards + 1; };
  int64_t need = 0, grad_need = 0, state_need = 0;
  const bool overflow = __builtin_mul_overflow(share(weight_shards), 4 + compute, &need) ||
                        __builtin_mul_overflow(share(grad_shards), 4, &grad_need) ||
                        __builtin_mul_overflow(params / state_shards + 1, state, &state_need) ||
                        __builtin_add_overflow(need, grad_need, &need) ||
                        __builtin_add_overflow(need, state_need, &need);
  if (overflow || (limit.known() && need > limit.room - memory_margin(need)))
    MOECORE_FAIL("train: the model has ", params, " parameters per rank (", mc.summary(), "); their fp32 values and ",
                 "gradients", compute ? ", compute copy" : "", " and optimizer state alone need ",
                 overflow ? "more than 2^63 bytes" : memory_format_bytes(need), " (plus a margin of ",
                 memory_format_bytes(overflow ? 0 : memory_margin(need)), "), more than the ", limit.describe(), "\n",
                 memory_hint(false));
}

// The CPU attention kernels' f32 copies of q, k, v and dq (kernels/attention_scratch.h): host memory the model's
// plan does not hold (its tensors only), as large as the activations themselves for small head dims. MLA's attention
// is not counted.
int64_t attention_scratch_bytes(const model::ModelConfig& mc, int64_t micro_batch, const model::ModelParallel& par) {
  const auto layers = model::layer_specs(mc);
  if (std::none_of(layers.begin(), layers.end(),
                   [](const model::LayerSpec& l) { return l.attention == model::AttentionKind::standard; }))
    return 0;
  const int64_t cp = std::max(1, par.cp.size()), tp = std::max(1, par.tp.size()), g = mc.query_groups();
  const ops::QkvDims q{micro_batch,   mc.seq_length / cp,        g / tp, mc.num_attention_heads / g,
                       mc.head_dim(), cp > 1 ? mc.seq_length : 0};
  return ops::attention_host_scratch_bytes(q);
}

// Before the model is built: the whole plan (activations and workspaces included), printed with the refusal.
void check_plan_fits(const model::MemoryPlan& plan, const MemoryLimit& limit) {
  if (!limit.known() || plan.total() <= limit.room - memory_margin(plan.total())) return;
  MOECORE_FAIL("train: the run's memory plan needs ", memory_format_bytes(plan.total()), " (plus a margin of ",
               memory_format_bytes(memory_margin(plan.total())), "), more than the ", limit.describe(),
               "; nothing was trained.\n", plan.format(), memory_hint(true));
}

// --save, --tensorboard-dir and the folder of --metrics-jsonl must be writable before the first step, not at
// the first save after hours of training: each is created if missing (as Megatron does) and a probe file is
// written and removed.
void check_writable_dir(const char* flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) MOECORE_FAIL(flag, " ", dir, ": cannot create the directory: ", ec.message());
  const std::string probe =
      (std::filesystem::path(dir) / (".moecore-write-test-" + std::to_string(::getpid()))).string();
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  const bool ok = f && std::fputc('x', f) != EOF && std::fflush(f) == 0;
  const int err = errno;
  if (f) std::fclose(f);
  std::filesystem::remove(probe, ec);
  if (!ok) MOECORE_FAIL(flag, " ", dir, ": cannot write there: ", std::strerror(err));
}

// The outputs before the first step: the directories writable, --metrics-jsonl (appended to) none of the files the
// run reads (datasets, tokenizer files, the HF config). --save and --tensorboard-dir add new files only.
void check_output_paths(const Args& a, const train::TrainConfig& t) {
  if (!t.save.empty()) check_writable_dir("--save", t.save);
  if (!t.tensorboard_dir.empty()) check_writable_dir("--tensorboard-dir", t.tensorboard_dir);
  if (t.metrics_jsonl.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(t.metrics_jsonl).parent_path();
  check_writable_dir("--metrics-jsonl", parent.empty() ? "." : parent.string());
  std::vector<io::FlagPath> inputs;
  for (const std::string& prefix : a.list("--data-path"))  // (weights too: no file has a number's name)
    for (const char* ext : {".bin", ".idx"}) inputs.push_back({"--data-path", prefix + ext});
  for (const char* flag : {"--vocab-file", "--merge-file", "--tokenizer-model"}) inputs.push_back({flag, a.str(flag)});
  if (!a.str("--hf-config").empty())
    inputs.push_back({hf_config_flag(a), hf_config_path(a.str("--hf-config"), hf_config_flag(a))});
  io::check_output_file({"--metrics-jsonl", t.metrics_jsonl}, inputs);
}

// The data's sample indices hold every sample of the run, built up front as Megatron's: at least 24 bytes a sample
// (sample_index and shuffle_index). Counts no memory holds are refused here, naming the flags that give them, instead
// of a std::bad_alloc (or a count of epochs) from the dataset. The dataset checks again with its real sizes.
void check_sample_counts(const train::TrainConfig& t) {
  const int64_t evaluations = t.eval_interval > 0 ? t.train_iters / t.eval_interval + 1 : 1;
  const double ram = static_cast<double>(memory_physical_bytes()), limit = ram > 0 ? ram : 0x1p62;
  const auto check = [&](double samples, const std::string& product, const char* which, const char* lower) {
    const double bytes = 24.0 * samples;
    if (bytes <= limit) return;
    char count[32];
    std::snprintf(count, sizeof count, "%.4g", samples);
    MOECORE_FAIL(
        "train: ", product, " = ", count, " ", which, " samples, whose sample index (24 bytes a sample, built ",
        "before training as Megatron's) needs ",
        bytes < 0x1p62 ? memory_format_bytes(static_cast<int64_t>(bytes)) : std::string("more than 2^62 bytes"),
        ram > 0 ? ", more than this machine's " + memory_format_bytes(static_cast<int64_t>(ram)) : "", ": lower ",
        lower);
  };
  const std::string gbs = " x --global-batch-size " + std::to_string(t.global_batch_size);
  check(static_cast<double>(t.train_iters) * static_cast<double>(t.global_batch_size),
        "--train-iters " + std::to_string(t.train_iters) + gbs, "training", "--train-iters or --global-batch-size");
  check(static_cast<double>(evaluations) * static_cast<double>(t.eval_iters) * static_cast<double>(t.global_batch_size),
        "--eval-iters " + std::to_string(t.eval_iters) + gbs + " x " + std::to_string(evaluations) + " evaluation" +
            (evaluations == 1 ? "" : "s"),
        "validation", "--eval-iters or --global-batch-size, or evaluate less often (--eval-interval)");
}

// The closing lines of a run: what was trained, how long it took, where the validation loss went, and where
// the checkpoint and the metrics are.
void print_summary(std::FILE* out, const train::TrainLog& log, const train::TrainConfig& t, int64_t seq_length,
                   double seconds) {
  const auto steps = static_cast<int64_t>(log.train_loss.size());
  const double tokens = static_cast<double>(steps * t.global_batch_size * seq_length);
  std::fprintf(out,
               "\n---- summary ----\ntrained %lld steps (iterations %lld -> %lld%s%s): %.0f tokens in %.0f s "
               "(%.0f tokens/s)\n",
               static_cast<long long>(steps - log.skipped_steps), static_cast<long long>(log.first_iteration),
               static_cast<long long>(log.first_iteration + steps),
               log.skipped_steps > 0 ? (", " + std::to_string(log.skipped_steps) + " skipped: non-finite").c_str() : "",
               log.stopped_by_signal ? ", stopped by a signal" : "", tokens, seconds,
               seconds > 0 ? tokens / seconds : 0.0);
  if (!log.train_loss.empty())
    std::fprintf(out, "training loss %.4f (first step) -> %.4f (last step)\n", log.train_loss.front(),
                 log.train_loss.back());
  if (!log.valid_loss.empty())
    std::fprintf(out, "validation loss %.4f (iteration %lld) -> %.4f (iteration %lld)\n", log.valid_loss.front().second,
                 static_cast<long long>(log.valid_loss.front().first), log.valid_loss.back().second,
                 static_cast<long long>(log.valid_loss.back().first));
  if (!t.save.empty()) {
    const auto dir = io::checkpoint_find_latest(t.save);
    std::fprintf(out, "checkpoint: %s\n", dir ? dir->c_str() : "(none committed)");
  }
  if (!t.metrics_jsonl.empty()) std::fprintf(out, "metrics: %s\n", t.metrics_jsonl.c_str());
  if (!t.tensorboard_dir.empty()) std::fprintf(out, "TensorBoard: %s\n", t.tensorboard_dir.c_str());
  std::fflush(out);
}

// `moecore train`'s flags: the model's (small defaults: a first run trains in seconds), the tokenizer's,
// --hf-config and the training table's.
void add_train_cmd_flags(Args& a) {
  model::ModelConfig defaults;
  defaults.num_layers = 4;
  defaults.hidden_size = 128;
  defaults.num_attention_heads = 4;
  defaults.vocab_size = 0;
  defaults.seq_length = 128;
  add_model_flags(a, defaults);
  add_tokenizer_flags(a);
  add_hf_config_flag(a);
  add_training_flags(a);
}

// Megatron's rules between flags, then --hf-config's (or --load-hf's) values in the flags left unset, checked the
// same on every rank, and the collectives' timeout. Returns whether --load-hf's MTP layers are fresh.
bool apply_flag_rules(Args& a) {
  if (a.on("--overlap-param-gather") && !(a.on("--use-distributed-optimizer") && a.on("--overlap-grad-reduce")))
    MOECORE_FAIL("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron)");
  check_overlap_moe_expert_parallel_comm(a);
  if (!a.str("--load-hf").empty()) a.fill_unset("--hf-config", a.str("--load-hf"), " by --load-hf");
  const bool hf_mtp_fresh = hf_config_apply_for_load(a);
  if (!a.str("--hf-config").empty()) a.check_same_on_every_rank();  // the file's values too
  if (comm_initialized() && !comm_timeout_from_env()) {             // the variable, when set, overrides the flag
    CommOptions o = comm_options();
    o.timeout_s = 60.0 * static_cast<double>(a.i64("--distributed-timeout-minutes"));
    comm_set_options(o);
  }
  return hf_mtp_fresh;
}

// What the flags give before the parallel layout is known.
struct RunFlags {
  optim::AdamWConfig ocfg;
  moe::DispatcherKind dispatcher{};
  int world_size = 1;  // every process of the run (mpirun -np P)
  Device device{};
  std::vector<std::string> data_path;
  std::unique_ptr<data::Tokenizer> tok;
  int64_t tp_size = 1;
  model::ModelConfig mcfg;
};

// Flags whose values name a feature moecore lacks fail before any data is read.
RunFlags read_run_flags(const Args& a) {
  RunFlags r;
  r.ocfg = optimizer_config_from(a);
  r.dispatcher = moe::parse_dispatcher_kind(a.str("--moe-token-dispatcher-type"));
  r.world_size = comm_initialized() ? comm_world().size() : 1;
  r.device = device_from_flag(a, r.world_size);
  r.data_path = a.list("--data-path");
  if (r.data_path.empty()) MOECORE_FAIL("train: --data-path is required (prefixes made by moecore preprocess)");
  r.tok = tokenizer_from(a);
  r.tp_size = a.i64("--tensor-model-parallel-size");
  // An explicit --vocab-size (an HF config's) needs to cover the tokenizer's ids, not its padding to 128 x TP.
  r.mcfg = model_config_from(a, padded_vocab_size(*r.tok, a, r.tp_size), r.tok->vocab_size());
  if (r.mcfg.moe.router_padding_alignment > 0 && r.dispatcher == moe::DispatcherKind::allgather)
    MOECORE_FAIL(
        "train: --moe-router-padding-for-quantization with --moe-token-dispatcher-type allgather (Megatron refuses "
        "the pair too): use alltoall");
  if (r.mcfg.fp8.on && r.device == Device::cuda)
    MOECORE_FAIL(
        "train: --fp8-format on --device cuda: the CUDA FP8 GEMMs (cuBLASLt, CUTLASS) are not built yet; FP8 "
        "training runs on --device cpu (the reference emulation)");
  return r;
}

// The decoder layers of each pipeline stage (virtual stages included), from --pipeline-model-parallel-layout or
// Megatron's split flags (Megatron's split, checked here on every rank).
std::vector<int64_t> pipeline_stage_layers_from(const Args& a, const model::ModelConfig& mcfg, int64_t pp_size) {
  auto layers_flag = [&](const char* name) { return a.str(name).empty() ? int64_t{-1} : a.i64(name); };
  const std::string layout = a.str("--pipeline-model-parallel-layout");
  const int64_t first_layers = layers_flag("--decoder-first-pipeline-num-layers"),
                last_layers = layers_flag("--decoder-last-pipeline-num-layers");
  if (!layout.empty() && (first_layers >= 0 || last_layers >= 0))
    MOECORE_FAIL(
        "--pipeline-model-parallel-layout and --decoder-first/last-pipeline-num-layers exclude each other (as "
        "in Megatron)");
  const int64_t vpp = virtual_pipeline_stages(a, mcfg.num_layers, pp_size, first_layers >= 0 || last_layers >= 0);
  const bool account_embedding = a.on("--account-for-embedding-in-pipeline-split"),
             account_loss = a.on("--account-for-loss-in-pipeline-split");
  if (!layout.empty() && (account_embedding || account_loss))
    MOECORE_FAIL(
        "--pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split exclude each other (the "
        "layout places E and L itself)");
  const std::vector<int64_t> stage_layers =
      layout.empty() ? model::pipeline_stage_layers(mcfg.num_layers, pp_size, first_layers, last_layers, vpp,
                                                    account_embedding, account_loss)
                     : model::pipeline_layout_stage_layers(layout, mcfg.num_layers, mcfg.mtp_num_layers, pp_size);
  if (!layout.empty() && vpp > 1 && static_cast<int64_t>(stage_layers.size()) != pp_size * vpp)
    MOECORE_FAIL("--pipeline-model-parallel-layout '", layout, "' has ", stage_layers.size() / pp_size,
                 " virtual stages per rank, the virtual pipeline flags ask for ", vpp);
  if (!a.str("--microbatch-group-size-per-virtual-pipeline-stage").empty() &&
      static_cast<int64_t>(stage_layers.size()) <= pp_size)
    MOECORE_FAIL(
        "--microbatch-group-size-per-virtual-pipeline-stage needs a virtual pipeline "
        "(--num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage or a layout with "
        "more stages than --pipeline-model-parallel-size)");
  return stage_layers;
}

// The layout over every process of the run: tensor parallel, context parallel, data parallel, expert parallel
// (folded into data parallel for the attention layers) and expert data parallel.
struct RunLayout {
  ParallelConfig pcfg;
  std::vector<int64_t> stage_layers;  // decoder layers per pipeline stage, virtual stages included
  ParallelSizes sizes;
};

// Validated before any collective, so a bad layout fails the same way on every rank. The experts are split over
// ETP, by default the TP size (Megatron's default), within the same ranks (Parallel Folding). Pipeline stages hold
// their share of the decoder layers.
RunLayout plan_parallel_layout(const Args& a, const RunFlags& r) {
  RunLayout l;
  l.pcfg.tensor_model_parallel_size = static_cast<int>(r.tp_size);
  l.pcfg.pipeline_model_parallel_size = static_cast<int>(a.i64("--pipeline-model-parallel-size"));
  l.stage_layers = pipeline_stage_layers_from(a, r.mcfg, l.pcfg.pipeline_model_parallel_size);
  l.pcfg.context_parallel_size = static_cast<int>(a.i64("--context-parallel-size"));
  l.pcfg.expert_model_parallel_size = static_cast<int>(a.i64("--expert-model-parallel-size"));
  l.pcfg.expert_tensor_parallel_size =
      a.str("--expert-tensor-parallel-size").empty() ? 0 : static_cast<int>(a.i64("--expert-tensor-parallel-size"));
  l.pcfg.num_distributed_optimizer_instances = static_cast<int>(a.i64("--num-distributed-optimizer-instances"));
  if (a.on("--use-tp-pp-dp-mapping")) l.pcfg.order = "tp-cp-ep-pp-dp";
  l.sizes = l.pcfg.validate(r.world_size, static_cast<int>(r.mcfg.moe.num_experts));
  moe::echo_check_layout(r.mcfg.moe, l.sizes.ep, l.sizes.etp, r.dispatcher);
  return l;
}

// The TrainConfig of the flags at the layout's data-parallel size, checked before anything is sized by it (the data's
// indices, a pipeline's schedule) and with its outputs writable.
train::TrainConfig train_config_checked(const Args& a, const RunLayout& l) {
  train::TrainConfig tcfg = train_config_from(a, l.sizes.dp);
  if (!a.str("--hf-config").empty())
    tcfg.hf_config_json = io::read_file(hf_config_path(a.str("--hf-config"), hf_config_flag(a)));
  check_sample_counts(tcfg);
  const int64_t pp_size = l.pcfg.pipeline_model_parallel_size;
  if (static_cast<int64_t>(l.stage_layers.size()) > pp_size && tcfg.micro_batches() % l.sizes.dp == 0)  // (validated)
    train::interleaved_one_f_one_b(
        tcfg.micro_batches() / l.sizes.dp, pp_size, 0,  // Megatron's conditions, checked now
        static_cast<int64_t>(l.stage_layers.size()) / pp_size,
        tcfg.microbatch_group_size_per_vp_stage > 0 ? tcfg.microbatch_group_size_per_vp_stage : pp_size);
  check_output_paths(a, tcfg);
  return tcfg;
}

// The training and validation splits of --data-path, sized by the run.
data::GptDataSourceConfig data_source_config(const Args& a, const RunFlags& r, const train::TrainConfig& tcfg) {
  data::GptDataSourceConfig dcfg;
  dcfg.data_path = r.data_path;
  dcfg.split = a.str("--split");
  const auto n =
      data::gpt_split_num_samples(tcfg.train_iters, tcfg.global_batch_size, tcfg.eval_interval, tcfg.eval_iters);
  dcfg.num_samples[0] = n[0];
  dcfg.num_samples[1] = n[1];
  dcfg.num_samples[2] = 0;  // the test split is not used by training
  dcfg.dataset.seq_length = r.mcfg.seq_length;
  dcfg.dataset.seed = static_cast<uint32_t>(tcfg.seed);
  dcfg.dataset.pad_id = r.tok->pad();
  dcfg.dataset.eod_id = r.tok->eod();
  dcfg.dataset.eod_mask_loss = a.on("--eod-mask-loss");
  dcfg.dataset.vocab_size = r.mcfg.vocab_size;  // a token id outside the model's vocabulary is an Error naming it
  return dcfg;
}

// The groups of the training loop and the model's parallel layout (one process: single-rank groups).
struct RunGroups {
  train::TrainGroups groups;
  model::ModelParallel par;
};

RunGroups make_run_groups(const Args& a, const RunFlags& r, const RunLayout& l) {
  RunGroups g;
  g.par.dispatcher = r.dispatcher;
  if (comm_initialized()) {
    const ProcessGroups pg = make_process_groups(l.pcfg, static_cast<int>(r.mcfg.moe.num_experts), comm_world());
    g.groups = train::train_groups(pg);
    g.par = model::model_parallel(pg, false, g.par.dispatcher,
                                  l.pcfg.pipeline_model_parallel_size > 1 ? l.stage_layers : std::vector<int64_t>{});
  }
  g.par.sequence_parallel = a.on("--sequence-parallel");
  return g;
}

// --moe-use-upcycling converts one whole dense model: every parallel size that splits it must be 1.
void check_upcycling_layout(const Args& a, const model::ModelParallel& ep) {
  if (ep.ep.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --expert-model-parallel-size ", ep.ep.size(),
                 " is not supported yet: upcycle at EP 1, save, and load the checkpoint at any EP");
  if (ep.tp.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --tensor-model-parallel-size ", ep.tp.size(),
                 " is not supported yet: upcycle at TP 1, save, and load the checkpoint at any TP");
  if (ep.pp.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --pipeline-model-parallel-size ", ep.pp.size(),
                 " is not supported yet: start at PP 1, save, and load the checkpoint at any PP");
  if (ep.etp.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --expert-tensor-parallel-size ", ep.etp.size(),
                 " is not supported yet: upcycle at ETP 1, save, and load the checkpoint at any ETP");
}

// The distributed optimizer shards the dense state over DP x CP and the experts' over EDP, within each of the
// --num-distributed-optimizer-instances groups (each holds a whole copy).
int64_t optimizer_state_shards(const train::TrainConfig& tcfg, const ParallelSizes& sizes) {
  return tcfg.shards_optimizer_state()
             ? std::max<int64_t>(1, std::min(sizes.dp * sizes.cp, sizes.edp) / tcfg.num_distributed_optimizer_instances)
             : 1;
}

// The run's memory plan before anything is allocated (GptModel::memory_plan of the model built on the meta device, with
// the micro-batch slots of this rank's pipeline schedule), with what the model does not hold (the optimizer state's
// shard, the CPU attention scratch, --async-save's snapshot); recorded for out-of-memory errors and checked against
// `limit`.
model::MemoryPlan run_memory_plan(const RunFlags& r, const RunGroups& g, const train::TrainConfig& tcfg,
                                  int64_t state_shards, const MemoryLimit& limit) {
  model::ModelParallel par = g.par;  // (check_layout settles it as the model's constructor will)
  const int64_t chunks = static_cast<int64_t>(model::check_layout(r.mcfg, par).chunks.size());
  const train::Schedule schedule =
      train::step_schedule(tcfg, g.groups.dp.size(), g.groups.pp.size(), g.groups.pp.rank(), chunks);
  model::GptModel meta(r.mcfg, tcfg.micro_batch_size, /*seed=*/0, g.par, Device::meta);  // (allocates nothing)
  if (!schedule.in_flight.empty()) meta.set_micro_batch_slots(schedule.in_flight);
  model::MemoryPlan plan = meta.memory_plan(train::optimizer_state_bytes(tcfg, r.ocfg));
  int64_t& state_bytes = plan.bytes[static_cast<int>(MemCategory::optimizer_state)];
  state_bytes = (state_bytes + state_shards - 1) / state_shards;     // the distributed optimizer's shard
  const bool hybrid = tcfg.num_distributed_optimizer_instances > 1;  // (sharded within one instance)
  plan =
      train::fsdp_memory_plan(meta, plan, tcfg, r.ocfg, (hybrid ? g.groups.intra_dp_cp : g.groups.dense_grads()).size(),
                              (hybrid ? g.groups.intra_edp : g.groups.edp).size(),
                              g.groups.etp.size());  // (Megatron-FSDP's optim_grads*: its own shards)
  if (r.device != Device::cuda)
    plan.bytes[static_cast<int>(MemCategory::workspace)] +=
        attention_scratch_bytes(r.mcfg, tcfg.micro_batch_size, g.par);
  if (tcfg.async_save && !tcfg.save.empty())  // the snapshot of --async-save (an upper bound: rank 0's share at most)
    plan.bytes[static_cast<int>(MemCategory::other)] +=
        train::async_save_snapshot_bytes(r.mcfg, r.ocfg.state_dtype, tcfg.save_optim);
  memory_set_plan(plan.format());  // quoted by an out-of-memory error
  check_plan_fits(plan, limit);
  return plan;
}

// The starting weights other than the fresh initialisation: --load-hf's (unless --load holds a checkpoint to resume
// from) or, with --moe-use-upcycling, the dense checkpoint of --load (the run then starts at iteration 0).
void load_start_weights(model::GptModel& gpt, const Args& a, const model::ModelConfig& mcfg, train::TrainConfig& tcfg,
                        bool hf_mtp_fresh, std::FILE* out) {
  if (!a.str("--load-hf").empty()) {
    if (a.on("--moe-use-upcycling")) MOECORE_FAIL("--load-hf and --moe-use-upcycling exclude each other");
    const auto step = tcfg.ckpt_step >= 0 ? std::optional<int64_t>(tcfg.ckpt_step) : std::nullopt;
    if (tcfg.load.empty() || !io::checkpoint_find_latest(tcfg.load, step)) {
      const std::string dir = a.str("--load-hf");
      const model::HfWeightMap map =
          hf_load_weight_map(hf_config_load(a.str("--hf-config"), hf_config_flag(a)), mcfg, hf_mtp_fresh);
      const io::HfCheckpointReader hf(dir);
      model::hf_check_tensors(map, hf);
      model::hf_import(map, hf, gpt);
      if (out)
        std::printf("moecore train: weights of %s (%s) loaded (--load-hf)\n", dir.c_str(),
                    model::hf_family_name(map.family));
    }
  }
  if (a.on("--moe-use-upcycling")) {
    upcycle_from_dense(gpt, a, tcfg);
    tcfg.load.clear();  // the run starts at iteration 0 from the upcycled weights, as in Megatron
  }
}

// The opening lines of a run: the model, the tokenizer, the GEMM peak, the data and the memory plan (and, on a
// GPU, the plan against the device's memory).
void print_run_header(std::FILE* out, const RunFlags& r, const model::GptModel& gpt, const train::TrainConfig& tcfg,
                      const data::GptDataSource& source, const model::MemoryPlan& plan) {
  if (!out) return;
  std::printf(
      "moecore train: %s\n  %lld parameters, tokenizer %s (vocab %lld, padded to %lld), GEMM peak %.1f "
      "GFLOP/s (%s)\n%s%s",
      r.mcfg.summary().c_str(), static_cast<long long>(gpt.num_parameters()), r.tok->name().c_str(),
      static_cast<long long>(r.tok->vocab_size()), static_cast<long long>(r.mcfg.vocab_size), tcfg.peak_gflops,
      device_name(r.device), source.summary().c_str(), plan.format().c_str());
  if (r.device == Device::cuda) {  // the model and its optimizer state are allocated by now: against the total
    int64_t free_bytes = 0, total_bytes = 0;
    const std::string dev = device_description(&free_bytes, &total_bytes);
    std::printf("  device memory: %s; the plan's %s is %.0f%% of the device's %s\n", dev.c_str(),
                memory_format_bytes(plan.total()).c_str(),
                total_bytes ? 100.0 * static_cast<double>(plan.total()) / static_cast<double>(total_bytes) : 0.0,
                memory_format_bytes(total_bytes).c_str());
  }
}

// Micro-batch `index` of B samples of S tokens from the training (or validation) split, wrapping around the split;
// labels whose loss is masked become -1.
train::BatchFn batch_source(const data::GptDataSource& source, int64_t B, int64_t S) {
  return [&source, B, S, mask = std::vector<float>(static_cast<size_t>(S))](Tensor& t, Tensor& l, bool valid,
                                                                            int64_t index) mutable {
    const data::GptSampleSource* src = valid ? source.valid() : source.train();
    int32_t* tp = t.data<int32_t>();
    int32_t* lp = l.data<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = (index * B + b) % static_cast<int64_t>(src->size());
      src->get(i, tp + b * S, lp + b * S, mask.data());
      for (int64_t s = 0; s < S; ++s)
        if (mask[static_cast<size_t>(s)] == 0.0f) lp[b * S + s] = -1;
    }
  };
}

// The closing sample (--generate-tokens after --prompt), unless a signal stopped the run, then the summary.
void finish_run(const Args& a, model::GptModel& gpt, const RunFlags& r, const train::TrainConfig& tcfg,
                const RunGroups& g, const train::TrainLog& log, double seconds, std::FILE* out) {
  const int64_t count = log.stopped_by_signal ? 0 : a.i64("--generate-tokens");
  // When experts are spread over ranks (EP, or ETP: the group of ETP x EP ranks holds one copy of every expert),
  // every rank takes part in the forward passes; otherwise the ranks of data-parallel rank 0 (every stage of a
  // pipeline, every TP and CP rank) do. Rank 0 prints.
  if (count > 0 && (g.groups.dp.rank() == 0 || g.par.etp_ep.size() > 1)) {
    const std::string prompt = a.str("--prompt");
    const auto ids =
        train::generate(gpt, prompt_tokens(*r.tok, prompt), count, 0.8f, tcfg.seed, r.tok->eod(), r.tok->vocab_size());
    if (out) std::printf("\n---- sample ----\n%s%s\n----------------\n", prompt.c_str(), r.tok->decode(ids).c_str());
  }
  if (out) print_summary(out, log, tcfg, r.mcfg.seq_length, seconds);
}

}  // namespace

int train_main(int argc, char** argv) {
  Args a("train");
  add_train_cmd_flags(a);
  if (!a.parse(argc, argv)) return 0;
  const bool hf_mtp_fresh = apply_flag_rules(a);
  const RunFlags r = read_run_flags(a);
  const RunLayout layout = plan_parallel_layout(a, r);
  train::TrainConfig tcfg = train_config_checked(a, layout);

  const data::GptDataSource source(data_source_config(a, r, tcfg));
  if (!source.train()) MOECORE_FAIL("train: --split ", a.str("--split"), " leaves no training data");
  tcfg.has_validation = source.valid() != nullptr;

  const RunGroups g = make_run_groups(a, r, layout);
  check_upcycling_layout(a, g.par);
  std::FILE* out = comm_initialized() && comm_world().rank() != 0 ? nullptr : stdout;
  const int64_t state_shards = optimizer_state_shards(tcfg, layout.sizes);
  const MemoryLimit limit =
      r.device == Device::cuda ? device_memory_limit() : node_memory_limit();  // (before the model exists)
  check_model_fits(r.mcfg, g.par, r.ocfg.state_dtype, state_shards, tcfg.fsdp, limit);
  const model::MemoryPlan plan = run_memory_plan(r, g, tcfg, state_shards, limit);
  // Megatron-FSDP's layers are born in their shards (their values unless --load-hf or --moe-use-upcycling write whole
  // weights into them first): no rank holds the whole model.
  model::ModelParallel par = train::fsdp_model_parallel(g.par, tcfg);
  if (!a.str("--load-hf").empty() || a.on("--moe-use-upcycling")) par.fsdp_params = false;
  model::GptModel gpt(r.mcfg, tcfg.micro_batch_size, tcfg.seed, par, r.device);
  // (the distributed optimizer and Muon hold their own state)
  optim::AdamW opt(gpt.params(), r.ocfg,
                   /*allocate_state=*/!tcfg.shards_optimizer_state() && tcfg.optimizer == optim::OptimizerKind::adam);
  load_start_weights(gpt, a, r.mcfg, tcfg, hf_mtp_fresh, out);
  tcfg.peak_gflops = train::gemm_peak_gflops(r.mcfg.compute_dtype, r.device);
  print_run_header(out, r, gpt, tcfg, source, plan);

  const train::BatchFn batches = batch_source(source, tcfg.micro_batch_size, r.mcfg.seq_length);
  const auto t0 = std::chrono::steady_clock::now();
  const train::TrainLog log = train::train(gpt, opt, tcfg, batches, out, {}, &g.groups);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  finish_run(a, gpt, r, tcfg, g, log, seconds, out);
  return 0;
}

}  // namespace moecore::apps
