// `moecore train`: Megatron-style training of a GPT (dense or MoE) on .bin/.idx data made by
// `moecore preprocess` or Megatron's own tools, with checkpoints, metrics and a generated sample at the end.
#include <cstdio>
#include <string>

#include "apps/args.h"
#include "apps/commands.h"
#include "moecore/core/error.h"
#include "apps/data_flags.h"
#include "apps/model_flags.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/io/checkpoint.h"
#include "moecore/model/upcycling.h"
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/gemm_peak.h"
#include "moecore/train/trainer.h"

namespace moecore::apps {
namespace {

void add_training_flags(Args& a) {
  a.list_option("--data-path", "dataset prefixes (.bin/.idx), optionally weighted: \"w1 p1 w2 p2 ...\"")
      .option("--split", "969,30,1", "train,valid,test proportions")
      .flag("--eod-mask-loss", "no loss on end-of-document tokens")
      .option("--micro-batch-size", "8", "sequences per forward/backward")
      .option("--global-batch-size", "8", "sequences per optimizer step")
      .option("--train-iters", "200", "optimizer steps")
      .option("--lr", "3e-3", "peak learning rate")
      .option("--min-lr", "3e-4", "final learning rate of the decay")
      .option("--lr-warmup-iters", "20", "linear warmup steps")
      .option("--lr-decay-style", "cosine", "constant | linear | cosine | WSD")
      .option("--lr-decay-iters", "0", "end of the decay (0: --train-iters)")
      .option("--lr-wsd-decay-iters", "0", "WSD: length of the final decay")
      .option("--lr-wsd-decay-style", "exponential", "WSD: exponential | linear | cosine | minus_sqrt")
      .option("--weight-decay", "0.1", "decoupled weight decay on 2-D weights")
      .option("--adam-beta1", "0.9", "AdamW beta1")
      .option("--adam-beta2", "0.95", "AdamW beta2")
      .option("--adam-eps", "1e-8", "AdamW epsilon")
      .option("--clip-grad", "1.0", "global gradient-norm clip (0: off)")
      .flag("--use-precision-aware-optimizer", "allow reduced-precision optimizer states (--exp-avg-dtype)")
      .option("--exp-avg-dtype", "fp32", "fp32 | bf16 (with --use-precision-aware-optimizer)")
      .option("--exp-avg-sq-dtype", "fp32", "fp32 | bf16 (with --use-precision-aware-optimizer)")
      .option("--seed", "1234", "random seed (weights, data order, router noise)")
      .option("--log-interval", "10", "steps between log lines")
      .option("--eval-interval", "50", "steps between validations")
      .option("--eval-iters", "8", "validation batches per evaluation")
      .option("--metrics-jsonl", "", "write one JSON object per logged iteration to this file")
      .option("--tensorboard-dir", "", "write TensorBoard event files here")
      .flag("--moe-per-layer-logging", "log tokens per expert, load, drops and losses of every MoE layer")
      .option("--save", "", "checkpoint directory")
      .option("--load", "", "resume from the newest committed checkpoint under this directory")
      .option("--save-interval", "0", "steps between checkpoints (0: only at the end)")
      .option("--exit-interval", "0", "stop (after saving) at multiples of this iteration")
      .option("--keep-last-checkpoints", "0", "keep only the newest N checkpoints (0: all)")
      .flag("--exit-signal-handler", "save and stop on SIGTERM/SIGINT (the default here)")
      .flag("--no-exit-signal-handler", "let SIGTERM/SIGINT kill the process")
      .flag("--no-check-for-nan-in-loss-and-grad", "do not check loss and gradients for NaN/Inf")
      .option("--nan-action", "stop", "on NaN/Inf: stop (error naming the tensor) | skip (drop the step)")
      .option("--tensor-model-parallel-size", "1", "TP (only 1 in this version)")
      .option("--pipeline-model-parallel-size", "1", "PP (only 1 in this version)")
      .option("--context-parallel-size", "1", "CP (only 1 in this version)")
      .option("--expert-model-parallel-size", "1", "EP: ranks the routed experts are spread over (mpirun -np a multiple)")
      .flag("--use-distributed-optimizer", "ZeRO-1: optimizer state sharded over data-parallel ranks (experts: expert-DP)")
      .option("--ddp-bucket-size", "40000000", "gradient elements per all-reduce (or reduce-scatter) bucket")
      .option("--moe-token-dispatcher-type", "allgather", "token dispatcher under EP: allgather | alltoall")
      .option("--expert-tensor-parallel-size", "1", "ETP (only 1 in this version)")
      .flag("--moe-use-upcycling", "start the MoE model from the dense checkpoint given by --load")
      .option("--moe-upcycling-granularity", "1", "experts per dense MLP copy: dense ffn = g * moe ffn")
      .option("--generate-tokens", "200", "tokens sampled after training (0: none)")
      .option("--prompt", "The ", "text the sample starts from");
}

DType state_dtype(const Args& a, const char* flag) {
  const std::string v = a.str(flag);
  if (v != "fp32" && v != "bf16") MOECORE_FAIL(flag, " '", v, "' is not one of fp32, bf16");
  if (v == "bf16" && !a.on("--use-precision-aware-optimizer"))
    MOECORE_FAIL(flag, " bf16 requires --use-precision-aware-optimizer");
  return v == "bf16" ? DType::bf16 : DType::f32;
}

train::TrainConfig train_config_from(const Args& a) {
  train::TrainConfig t;
  t.micro_batch_size = a.i64("--micro-batch-size");
  t.global_batch_size = a.i64("--global-batch-size");
  t.train_iters = a.i64("--train-iters");
  t.lr = static_cast<float>(a.f64("--lr"));
  t.min_lr = static_cast<float>(a.f64("--min-lr"));
  t.lr_warmup_iters = a.i64("--lr-warmup-iters");
  t.lr_decay_style = a.str("--lr-decay-style");
  t.lr_decay_iters = a.i64("--lr-decay-iters");
  t.lr_wsd_decay_iters = a.i64("--lr-wsd-decay-iters");
  t.lr_wsd_decay_style = a.str("--lr-wsd-decay-style");
  t.log_interval = a.i64("--log-interval");
  t.eval_interval = a.i64("--eval-interval");
  t.eval_iters = a.i64("--eval-iters");
  t.seed = static_cast<uint64_t>(a.i64("--seed"));
  t.moe_per_layer_logging = a.on("--moe-per-layer-logging");
  t.save = a.str("--save");
  t.load = a.str("--load");
  t.save_interval = a.i64("--save-interval");
  t.exit_interval = a.i64("--exit-interval");
  t.keep_last = static_cast<int>(a.i64("--keep-last-checkpoints"));
  t.exit_signal_handler = !a.on("--no-exit-signal-handler");
  t.check_for_nan = !a.on("--no-check-for-nan-in-loss-and-grad");
  t.nan_action = a.str("--nan-action");
  t.use_distributed_optimizer = a.on("--use-distributed-optimizer");
  t.ddp_bucket_size = a.i64("--ddp-bucket-size");
  if (t.ddp_bucket_size <= 0) MOECORE_FAIL("--ddp-bucket-size (", t.ddp_bucket_size, ") must be positive");
  t.metrics_jsonl = a.str("--metrics-jsonl");
  t.tensorboard_dir = a.str("--tensorboard-dir");
  t.validate();
  return t;
}

optim::AdamWConfig optimizer_config_from(const Args& a) {
  optim::AdamWConfig o;
  o.beta1 = static_cast<float>(a.f64("--adam-beta1"));
  o.beta2 = static_cast<float>(a.f64("--adam-beta2"));
  o.eps = static_cast<float>(a.f64("--adam-eps"));
  o.weight_decay = static_cast<float>(a.f64("--weight-decay"));
  o.clip_grad = static_cast<float>(a.f64("--clip-grad"));
  const DType m = state_dtype(a, "--exp-avg-dtype"), v = state_dtype(a, "--exp-avg-sq-dtype");
  if (m != v) MOECORE_FAIL("--exp-avg-dtype and --exp-avg-sq-dtype must be equal");
  o.state_dtype = m;
  o.validate();
  return o;
}

// --moe-use-upcycling: the dense model of the same flags (without experts) is loaded from --load and
// converted (spec §10); the MoE model then trains from iteration 0 with a fresh optimizer.
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
  model::GptModel dense(dc, 1, tcfg.seed);
  optim::AdamW dense_opt(dense.params(), optim::AdamWConfig{});
  const auto dir = io::checkpoint_find_latest(tcfg.load);
  if (!dir) MOECORE_FAIL("--load ", tcfg.load, ": no committed checkpoint to upcycle");
  train::load_training_checkpoint(*dir, dense, dense_opt, tcfg.seed);
  model::upcycle_dense_to_moe(dense, gpt);
  std::printf(" upcycled the dense checkpoint %s into %lld experts (granularity %lld)\n", dir->c_str(),
              static_cast<long long>(mc.moe.num_experts), static_cast<long long>(g));
}

}  // namespace

int train_main(int argc, char** argv) {
  Args a("train");
  model::ModelConfig defaults;
  defaults.num_layers = 4;
  defaults.hidden_size = 128;
  defaults.num_attention_heads = 4;
  defaults.vocab_size = 0;
  defaults.seq_length = 128;
  add_model_flags(a, defaults);
  add_tokenizer_flags(a);
  add_training_flags(a);
  if (!a.parse(argc, argv)) return 0;
  const std::vector<std::string> data_path = a.list("--data-path");
  if (data_path.empty()) MOECORE_FAIL("train: --data-path is required (prefixes made by moecore preprocess)");
  const auto tok = tokenizer_from(a);
  const model::ModelConfig mcfg = model_config_from(a, padded_vocab_size(*tok, a));
  train::TrainConfig tcfg = train_config_from(a);

  data::GptDataSourceConfig dcfg;
  dcfg.data_path = data_path;
  dcfg.split = a.str("--split");
  const auto n = data::gpt_split_num_samples(tcfg.train_iters, tcfg.global_batch_size, tcfg.eval_interval,
                                             tcfg.eval_iters);
  dcfg.num_samples[0] = n[0];
  dcfg.num_samples[1] = n[1];
  dcfg.num_samples[2] = 0;  // the test split is not used by training
  dcfg.dataset.seq_length = mcfg.seq_length;
  dcfg.dataset.seed = static_cast<uint32_t>(tcfg.seed);
  dcfg.dataset.pad_id = tok->pad();
  dcfg.dataset.eod_id = tok->eod();
  dcfg.dataset.eod_mask_loss = a.on("--eod-mask-loss");
  const data::GptDataSource source(dcfg);
  if (!source.train()) MOECORE_FAIL("train: --split ", dcfg.split, " leaves no training data");
  tcfg.has_validation = source.valid() != nullptr;

  // The layout over every process of the run (mpirun -np P): data parallel, expert parallel (folded into
  // data parallel for the attention layers) and expert data parallel. Validated before any collective, so a
  // bad layout fails the same way on every rank.
  for (const char* f : {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                        "--expert-tensor-parallel-size"})
    if (a.i64(f) != 1)
      MOECORE_FAIL(f, " (", a.i64(f), ") is not supported yet: this version runs data and expert parallel only");
  ParallelConfig pcfg;
  pcfg.expert_model_parallel_size = static_cast<int>(a.i64("--expert-model-parallel-size"));
  pcfg.expert_tensor_parallel_size = 1;
  const int world_size = comm_initialized() ? comm_world().size() : 1;
  (void)pcfg.validate(world_size, static_cast<int>(mcfg.moe.num_experts));
  train::TrainGroups groups;
  model::ExpertParallel ep;
  ep.dispatcher = moe::parse_dispatcher_kind(a.str("--moe-token-dispatcher-type"));
  if (comm_initialized()) {
    const ProcessGroups pg = make_process_groups(pcfg, static_cast<int>(mcfg.moe.num_experts), comm_world());
    groups.dp = pg.dp();
    groups.ep = pg.ep();
    groups.edp = pg.edp();
    ep.group = pg.ep();
    ep.dp = pg.dp();
  }
  const ProcessGroup& dp = groups.dp;
  if (ep.group.size() > 1 && a.on("--moe-use-upcycling"))
    MOECORE_FAIL("--moe-use-upcycling with --expert-model-parallel-size ", ep.group.size(),
                 " is not supported yet: upcycle at EP 1, save, and load the checkpoint at any EP");
  std::FILE* out = comm_initialized() && comm_world().rank() != 0 ? nullptr : stdout;
  model::GptModel gpt(mcfg, tcfg.micro_batch_size, tcfg.seed, ep);
  optim::AdamW opt(gpt.params(), optimizer_config_from(a), /*allocate_state=*/!tcfg.use_distributed_optimizer);
  if (a.on("--moe-use-upcycling")) {
    upcycle_from_dense(gpt, a, tcfg);
    tcfg.load.clear();  // the run starts at iteration 0 from the upcycled weights, as in Megatron
  }
  tcfg.peak_gflops = train::gemm_peak_gflops(mcfg.compute_dtype);
  if (out) std::printf("moecore train: %s\n  %lld parameters, tokenizer %s (vocab %lld, padded to %lld), GEMM peak %.1f "
              "GFLOP/s\n%s%s",
              mcfg.summary().c_str(), static_cast<long long>(gpt.num_parameters()), tok->name().c_str(),
              static_cast<long long>(tok->vocab_size()), static_cast<long long>(mcfg.vocab_size), tcfg.peak_gflops,
              source.summary().c_str(), gpt.memory_plan(opt.state_bytes_per_param()).format().c_str());
  const int64_t B = tcfg.micro_batch_size, S = mcfg.seq_length;
  std::vector<float> mask(static_cast<size_t>(S));
  const train::BatchFn batches = [&](Tensor& t, Tensor& l, bool valid, int64_t index) {
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
  const train::TrainLog log = train::train(gpt, opt, tcfg, batches, out, {}, &groups);
  if (log.stopped_by_signal) return 0;
  const int64_t count = a.i64("--generate-tokens");
  // Under EP every rank takes part in the forward passes (the experts are spread); rank 0 prints.
  if (count > 0 && (dp.rank() == 0 || ep.group.size() > 1)) {
    const std::string prompt = a.str("--prompt");
    const auto ids = train::generate(gpt, tok->encode(prompt), count, 0.8f, tcfg.seed, tok->eod());
    if (out) std::printf("\n---- sample ----\n%s%s\n----------------\n", prompt.c_str(), tok->decode(ids).c_str());
  }
  return 0;
}

}  // namespace moecore::apps
