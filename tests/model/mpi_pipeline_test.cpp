// Pipeline-parallel training equivalence (issue 13), under mpirun with 2 and 4 ranks. Every rank trains the
// single-process reference itself (same config, seed, global batch), then the same model split over pipeline stages:
// PP = P with the 1F1B schedule (even and uneven splits: --decoder-first/last-pipeline-num-layers, layout strings), the
// interleaved 1F1B schedule (PP 2 x VPP 2, even, uneven, by layout and with a larger micro-batch group; at 4 ranks
// PP 4 x VPP 2 and PP 2 x VPP 2 with DP 2 or EP 2), and at 4 ranks PP 2 x DP 2 (plain AdamW, the distributed optimizer,
// with overlapped reduction and parameter gathers; also in Megatron's tp-pp-dp rank order, bitwise the default order),
// PP 2 x EP 2, PP 2 x TP 2 with SP and PP 2 x CP 2; full recompute
// under PP is bitwise the run without it. Models: dense with tied embeddings (RMSNorm, SwiGLU, RoPE: the last stage
// holds a copy of the word embeddings whose gradient is summed with the first stage's), dense untied with learned
// positions and biases (LayerNorm, GeLU), and MoE with aux and z losses and one MTP depth (its embedding on the last
// stage too). Checked: step-1 loss and global grad norm (1e-6 rel), the gradient of every parameter a stage holds after
// step 1 against the reference's (rtol 1e-5 with an absolute floor of 1e-6 x the tensor's largest value), 20-step
// losses (rtol 1e-5), the validation loss, the MoE and MTP losses, bitwise-identical losses across two identical runs;
// bad splits fail at construction naming the values; checkpoints reshard across PP sizes, and --async-save writes the
// synchronous saves' files. Every model lives on testing::test_device().
#include <gtest/gtest.h>

#include "model/mpi_training_support.h"
#include "model/synthetic_training.h"
#include "mpi_test_support.h"
#include "test_util.h"

#include <unistd.h>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "moecore/core/error.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/parallel/shards.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/step.h"
#include "moecore/train/trainer.h"

namespace moecore {
namespace {

class Mpi : public testing_mpi::EightRanksApartTest {};
using testing::synthetic_batch;
using testing_mpi::expect_close;
using testing_mpi::rel;
using testing_mpi::shared_dir;

// 4 layers; RMSNorm, SwiGLU, RoPE, tied embeddings.
model::ModelConfig tied_dense() {
  model::ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 48;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.untie_embeddings_and_output_weights = false;
  return c;
}

// LayerNorm, GeLU, biases on every linear, learned absolute positions (on the first stage), untied output layer.
model::ModelConfig untied_dense() {
  model::ModelConfig c = tied_dense();
  c.normalization = model::Normalization::layernorm;
  c.swiglu = false;
  c.add_bias_linear = true;
  c.position_embedding_type = model::PositionEmbedding::learned_absolute;
  c.untie_embeddings_and_output_weights = true;
  return c;
}

// Dense and MoE layers alternating (8 experts, top-2, aux + z loss), untied, one MTP depth on the last stage.
model::ModelConfig moe_mtp() {
  model::ModelConfig c = testing::small_moe_model(8);
  c.num_layers = 4;
  c.moe_layer_freq = "[0,1,0,1]";
  c.moe.z_loss_coeff = 1e-3f;
  c.mtp_num_layers = 1;
  return c;
}

train::TrainConfig train_config(int64_t iters) {
  train::TrainConfig t;
  t.micro_batch_size = 2;
  t.global_batch_size = 8;
  t.train_iters = iters;
  t.lr = 5e-3f;
  t.lr_warmup_iters = 2;
  t.eval_iters = 3;
  t.has_validation = true;
  // Values these tests were written against where TrainConfig's defaults (the command line's) differ.
  t.lr_decay_style = train::LrDecayStyle::cosine;
  t.log_interval = 10;
  t.exit_signal_handler = true;
  t.ddp_bucket_size = 3000;
  return t;
}

struct Layout {
  int pp = 0;  // 0: one process, no groups
  int ep = 1;
  int64_t first = -1, last = -1;  // --decoder-first/last-pipeline-num-layers
  bool zero = false, overlap = false;
  std::string layout = {};                     // --pipeline-model-parallel-layout
  int tp = 1, cp = 1;                          // within each stage (TP with sequence parallelism)
  int64_t vpp = 1;                             // model chunks per stage (a layout string gives its own)
  int64_t group = 0;                           // --microbatch-group-size-per-virtual-pipeline-stage (0: PP)
  std::string order = ParallelConfig{}.order;  // "tp-cp-ep-pp-dp": Megatron's --use-tp-pp-dp-mapping
  bool log_stats = false;  // --log-params-norm and --log-num-zeros-in-grad every step, the timers at level 2
  bool per_token = false;  // --calculate-per-token-loss, on batches whose micro-batches count uneven tokens
  float loss_scale = 0;    // > 0: a dynamic loss scale starting there (--fp16's scaler on the f32 model)
  bool muon = false;       // --optimizer muon (f32 products, --muon-extra-scale-factor 0.2)
  train::FsdpStrategy fsdp = train::FsdpStrategy::off;  // --use-megatron-fsdp's --data-parallel-sharding-strategy
  std::string name() const {
    return "PP " + std::to_string(pp) + (vpp > 1 ? " x VPP " + std::to_string(vpp) : "") +
           (group > 0 ? " (groups of " + std::to_string(group) + ")" : "") +
           (layout.empty() ? "" : " '" + layout + "'") + (first >= 0 ? " first " + std::to_string(first) : "") +
           (last >= 0 ? " last " + std::to_string(last) : "") + (ep > 1 ? ", EP " + std::to_string(ep) : "") +
           (zero ? ", distributed optimizer" : "") + (overlap ? ", overlapped" : "") +
           (tp > 1 ? ", TP " + std::to_string(tp) + " + SP" : "") + (cp > 1 ? ", CP " + std::to_string(cp) : "") +
           (order != ParallelConfig{}.order ? ", order " + order : "") + (per_token ? ", per-token loss" : "") +
           (loss_scale > 0 ? ", loss scale " + std::to_string(loss_scale) : "") + (muon ? ", Muon" : "") +
           (fsdp != train::FsdpStrategy::off ? ", FSDP strategy " + std::to_string(static_cast<int>(fsdp)) : "");
  }
};

struct Result {
  std::vector<double> loss, grad_norm;
  std::vector<double> params_norm, num_zeros;  // per step, with Layout::log_stats
  std::vector<train::StepMetrics> moe;
  double valid = 0;
  std::map<std::string, Tensor> grads;   // the parameters this rank holds (expert shards gathered over EP)
  std::map<std::string, Tensor> values;  // likewise, at the end
};

// The groups of a layout (none for Layout{}: one process) and the model's parallel layout on them.
std::pair<train::TrainGroups, model::ModelParallel> layout_groups(const ProcessGroup& world,
                                                                  const model::ModelConfig& mc, const Layout& l) {
  train::TrainGroups groups;
  model::ModelParallel par;
  if (l.pp > 0) {
    ParallelConfig pc;
    pc.pipeline_model_parallel_size = l.pp;
    pc.expert_model_parallel_size = l.ep;
    pc.tensor_model_parallel_size = l.tp;
    pc.context_parallel_size = l.cp;
    pc.order = l.order;
    const ProcessGroups pg = make_process_groups(pc, static_cast<int>(mc.moe.num_experts), world);
    groups = train::train_groups(pg);
    par = model::model_parallel(
        pg, l.tp > 1, moe::DispatcherKind::alltoall,
        l.layout.empty() ? model::pipeline_stage_layers(mc.num_layers, l.pp, l.first, l.last, l.vpp)
                         : model::pipeline_layout_stage_layers(l.layout, mc.num_layers, mc.mtp_num_layers, l.pp));
  }
  return {groups, par};
}

Result run(const ProcessGroup& world, const model::ModelConfig& mc, const Layout& l, int64_t iters,
           const std::string& save = "", const std::string& load = "", int64_t exit_at = 0, int64_t save_interval = 0,
           bool async_save = false) {
  const auto made = layout_groups(world, mc, l);  // (no structured binding: clang 14's lambdas cannot capture one)
  const train::TrainGroups& groups = made.first;
  const model::ModelParallel& par = made.second;
  model::GptModel gpt(mc, 2, 42, par, testing::test_device());
  if (l.pp > 0 && l.layout.empty()) {
    EXPECT_EQ(gpt.num_chunks(), l.vpp);
  }
  // The start-up memory check counts this stage's parameters.
  EXPECT_EQ(model::parameters_per_rank(mc, l.ep, l.tp, par.etp.size(),
                                       [&](const std::string& n) { return model::pipeline_stage_holds(n, mc, par); }),
            gpt.num_parameters());
  optim::AdamW opt(gpt.params(), {}, /*allocate_state=*/!l.zero);
  train::TrainConfig tc = train_config(iters);
  tc.use_distributed_optimizer = l.zero;
  tc.overlap_grad_reduce = l.overlap;
  tc.overlap_param_gather = l.overlap && l.zero;
  tc.microbatch_group_size_per_vp_stage = l.group;
  tc.save = save;
  tc.load = load;
  tc.exit_interval = exit_at;
  tc.save_interval = save_interval;
  tc.async_save = async_save;
  tc.use_persistent_ckpt_worker = true;
  tc.calculate_per_token_loss = l.per_token;
  if (l.fsdp != train::FsdpStrategy::off) {
    tc.fsdp = l.fsdp;
    tc.use_distributed_optimizer = true;
  }
  if (l.muon) {
    tc.optimizer = optim::OptimizerKind::muon;
    tc.muon.fp32_matmul_prec = optim::MuonMatmulPrecision::high;
    tc.muon.extra_scale_factor = 0.2f;
  }
  if (l.loss_scale > 0) {
    tc.grad_scaler.kind = train::GradScalerConfig::Kind::dynamic;
    tc.grad_scaler.scale = l.loss_scale;
    tc.check_for_nan = false;
  }
  if (l.log_stats) {
    tc.log_interval = 1;
    tc.log_params_norm = true;
    tc.log_num_zeros_in_grad = true;
    tc.timing_log_level = 2;
  }
  // (per-token loss: every other micro-batch of the global batch keeps a few labels, so the micro-batches weigh unlike)
  const train::BatchFn uneven = [](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    synthetic_batch(tok, lab, valid, i);
    if (i % 2 == 0)
      for (int64_t k = 3 + i % 5; k < lab.numel(); ++k) lab.data<int32_t>()[k] = -1;
  };
  const train::TrainLog log =
      train::train(gpt, opt, tc, l.per_token ? uneven : synthetic_batch, nullptr, {}, l.pp ? &groups : nullptr);
  // The start-up memory plan, taken before the model exists with the slots of this stage's schedule, is the model's
  // after the schedule sized its slots.
  model::ModelParallel settled = par;
  const auto chunks = static_cast<int64_t>(model::check_layout(mc, settled).chunks.size());
  const train::Schedule schedule =
      train::step_schedule(tc, groups.dp.size(), groups.pp.size(), groups.pp.rank(), chunks);
  EXPECT_EQ(model::GptModel::plan_memory(mc, 2, par, schedule.in_flight, model::GptModel::no_optimizer_state).total(),
            gpt.memory_plan(model::GptModel::no_optimizer_state).total());
  Result r;
  r.loss = log.train_loss;
  r.grad_norm = log.grad_norm;
  r.params_norm = log.params_norm;
  r.num_zeros = log.num_zeros;
  r.moe = log.metrics;
  if (!log.valid_loss.empty()) r.valid = log.valid_loss.back().second;
  for (const auto& p : gpt.params()) {
    const TensorShard ep{0, 1, static_cast<int>(gpt.ep_rank()), static_cast<int>(gpt.ep_size())};
    auto whole = [&](const Tensor& t) {  // expert shards over ETP and EP, tensor-parallel ones over TP
      return p.expert_parallel ? all_gather_shards(all_gather_shards(t, p.tp, par.etp), ep, par.ep).clone()
                               : all_gather_shards(t, p.tp, par.tp).clone();
    };
    if (p.grad.resident()) r.grads[p.name] = whole(p.grad);  // (FSDP's optim_grads*: a layer's live in the shards)
    r.values[p.name] = whole(p.value);
  }
  return r;
}

void check_layout(const ProcessGroup& world, const model::ModelConfig& mc, const Layout& l, int64_t iters = 20) {
  SCOPED_TRACE(l.name() + " x DP " + std::to_string(world.size() / (l.pp * l.tp * l.cp)) +
               (mc.moe.enabled() ? ", MoE" : "") + (mc.untie_embeddings_and_output_weights ? "" : ", tied"));
  Layout one;
  one.per_token = l.per_token;
  one.loss_scale = l.loss_scale;
  one.muon = l.muon;
  const Result ref1 = run(world, mc, one, 1);
  const Result got1 = run(world, mc, l, 1);
  EXPECT_LE(rel(got1.loss[0], ref1.loss[0]), 1e-6) << got1.loss[0] << " vs " << ref1.loss[0];
  EXPECT_LE(rel(got1.grad_norm[0], ref1.grad_norm[0]), 1e-6) << got1.grad_norm[0] << " vs " << ref1.grad_norm[0];
  if (!l.zero && l.fsdp == train::FsdpStrategy::off)  // (the distributed optimizer and FSDP reduce into their shards)
    expect_close(got1.grads, ref1.grads);
  const Result ref = run(world, mc, one, iters);
  const Result got = run(world, mc, l, iters);
  const Result again = run(world, mc, l, iters);
  ASSERT_EQ(got.loss.size(), static_cast<size_t>(iters));
  for (size_t i = 0; i < got.loss.size(); ++i) {
    EXPECT_LE(rel(got.loss[i], ref.loss[i]), 1e-5) << "step " << i + 1 << ": " << got.loss[i] << " vs " << ref.loss[i];
    EXPECT_EQ(std::memcmp(&got.loss[i], &again.loss[i], sizeof(double)), 0) << "step " << i + 1 << " not bitwise";
    EXPECT_LE(rel(got.moe[i].value("load_balancing_loss"), ref.moe[i].value("load_balancing_loss")), 1e-5)
        << "step " << i + 1;
    EXPECT_LE(rel(got.moe[i].value("z_loss"), ref.moe[i].value("z_loss")), 1e-5) << "step " << i + 1;
  }
  EXPECT_LE(rel(got.valid, ref.valid), 1e-5) << "validation loss " << got.valid << " vs " << ref.valid;
}

TEST_F(Mpi, PipelineMatchesOneProcess) {
  for (const model::ModelConfig& mc : {tied_dense(), untied_dense(), moe_mtp()}) check_layout(world, mc, {P});
}

// --log-params-norm and --log-num-zeros-in-grad over the stages: each stage counts its own parameters, the tied
// embedding's copy on the last stage not at all (its gradient is the first stage's after the embedding all-reduce);
// every step's values equal the single-process run's (the norm to 1e-6, the zeros exactly), also with the distributed
// optimizer over PP 2 x DP 2. The runs time every phase (timers at level 2, the pipeline's waits among them).
TEST_F(Mpi, PipelineParamsNormAndNumZerosMatchOneProcess) {
  Layout one;
  one.log_stats = true;
  std::vector<Layout> layouts = {Layout{P}};
  if (P == 4) layouts.push_back(Layout{2, 1, -1, -1, /*zero=*/true});
  for (const model::ModelConfig& mc : {tied_dense(), moe_mtp()}) {
    const Result ref = run(world, mc, one, 3);
    for (Layout l : layouts) {
      l.log_stats = true;
      SCOPED_TRACE(l.name() + (mc.untie_embeddings_and_output_weights ? "" : ", tied"));
      const Result got = run(world, mc, l, 3);
      ASSERT_EQ(got.num_zeros.size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_LE(rel(got.params_norm[i], ref.params_norm[i]), 1e-6) << "step " << i + 1;
        EXPECT_EQ(got.num_zeros[i], ref.num_zeros[i]) << "step " << i + 1;
      }
    }
  }
}

TEST_F(Mpi, UnevenPipelineStagesMatchOneProcess) {
  model::ModelConfig mc = moe_mtp();
  if (P == 2) {
    check_layout(world, mc, {2, 1, 1, -1});  // stages of 1 and 3 layers
    check_layout(world, tied_dense(), {2, 1, -1, 1});
    return;
  }
  mc.num_layers = 6;
  mc.moe_layer_freq = "[0,1,0,1,0,1]";
  check_layout(world, mc, {4, 1, 1, 1});  // 1, 2, 2, 1
  // Megatron's layout string, with stages that hold no decoder layer (the embedding alone, an empty one).
  Layout l{4};
  l.layout = "E|ttt||tttmL";
  check_layout(world, mc, l);
  l.layout = "Et|tt|tt|tmL";
  check_layout(world, mc, l);
}

// Megatron's interleaved 1F1B: each stage holds two model chunks (virtual stage k = chunk * PP + stage), the
// activations wrap from the last stage's chunk 0 to the first stage's chunk 1, the gradients back.
TEST_F(Mpi, InterleavedPipelineMatchesOneProcess) {
  Layout l{2};
  l.vpp = 2;
  if (P == 2) {
    for (const model::ModelConfig& mc : {tied_dense(), untied_dense(), moe_mtp()}) check_layout(world, mc, l);
    model::ModelConfig mc = moe_mtp();
    mc.num_layers = 6;
    mc.moe_layer_freq = "[0,1,0,1,0,1]";
    Layout uneven{2, 1, 2, 4};  // chunks of 1, 2, 1, 2 layers
    uneven.vpp = 2;
    check_layout(world, mc, uneven);
    Layout layout{2};
    layout.layout = "Et|tt|t|ttmL";
    check_layout(world, mc, layout);
    Layout grouped = l;  // all 4 micro-batches through chunk 0 before chunk 1
    grouped.group = 4;
    check_layout(world, tied_dense(), grouped);
    return;
  }
  if (P != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  model::ModelConfig deep = tied_dense();
  deep.num_layers = 8;
  Layout four{4};
  four.vpp = 2;
  check_layout(world, deep, four);
  Layout zero{2, 1, -1, -1, /*zero=*/true, /*overlap=*/true};
  zero.vpp = 2;
  check_layout(world, moe_mtp(), zero);
  Layout ep{2, 2};
  ep.vpp = 2;
  check_layout(world, moe_mtp(), ep);
}

TEST_F(Mpi, PipelineWithDataAndExpertParallelismMatchesOneProcess) {
  if (P != 4) GTEST_SKIP() << "needs 4 ranks";
  check_layout(world, tied_dense(), {2});
  check_layout(world, tied_dense(), {2, 1, -1, -1, /*zero=*/true});
  check_layout(world, tied_dense(), {2, 1, -1, -1, /*zero=*/true, /*overlap=*/true});
  check_layout(world, moe_mtp(), {2, 1, -1, -1, /*zero=*/false, /*overlap=*/true});
  check_layout(world, moe_mtp(), {2, 2});  // the experts over EP 2 within each stage
  check_layout(world, moe_mtp(), {2, 2, -1, -1, /*zero=*/true});
}

// Megatron's --use-tp-pp-dp-mapping (order tp-cp-ep-pp-dp: the stages of a pipeline are neighbouring ranks, the
// data-parallel replicas far apart) at PP 2 x DP 2: matches one process, and every loss is bitwise the default order's
// (each group holds the same coordinates in the same order, only on other ranks). Dense with plain AdamW, MoE (EDP =
// DP, as Megatron requires when pp is not last) with the distributed optimizer and its overlap.
TEST_F(Mpi, TpPpDpMappingMatchesOneProcessAndTheDefaultOrder) {
  if (P != 4) GTEST_SKIP() << "needs 4 ranks";
  Layout dense{2};
  dense.order = "tp-cp-ep-pp-dp";
  Layout moe{2, 1, -1, -1, /*zero=*/true, /*overlap=*/true};
  moe.order = dense.order;
  for (auto [mc, l] : {std::pair{tied_dense(), dense}, std::pair{moe_mtp(), moe}}) {
    check_layout(world, mc, l);
    SCOPED_TRACE(l.name());
    const Result mapped = run(world, mc, l, 6);
    l.order = ParallelConfig{}.order;
    const Result plain = run(world, mc, l, 6);
    ASSERT_EQ(mapped.loss.size(), plain.loss.size());
    for (size_t i = 0; i < plain.loss.size(); ++i)
      EXPECT_EQ(std::memcmp(&mapped.loss[i], &plain.loss[i], sizeof(double)), 0) << "step " << i + 1;
    EXPECT_EQ(std::memcmp(&mapped.valid, &plain.valid, sizeof(double)), 0) << "validation loss";
  }
}

// Full and selective recompute are bitwise the run without them under pipeline (1F1B and interleaved), expert and
// tensor parallelism too (the recomputed MoE layers run their dispatcher's collectives again, the refilled norm outputs
// their all-gathers, alike on every rank).
TEST_F(Mpi, RecomputeUnderPipelineAndExpertParallelismIsBitwise) {
  std::vector<Layout> layouts = {Layout{P}};
  if (P == 2) {
    layouts.push_back(Layout{2});
    layouts.back().vpp = 2;  // groups per model chunk
  }
  if (P == 4) {
    layouts.push_back(Layout{2, 2});
    layouts.push_back(Layout{2});
    layouts.back().tp = 2;  // the norm outputs refilled under sequence parallelism (all-gathered again)
  }
  const std::vector<model::RecomputeConfig> settings = {{"full", "uniform", 2, {}},
                                                        {"full", "block", 1, {}},
                                                        {"selective", "", 0, {"layernorm", "moe_act"}},
                                                        {"selective", "", 0, {"core_attn", "mlp"}},
                                                        {"selective", "", 0, {"moe", "shared_experts"}}};
  for (const Layout& l : layouts)
    for (const model::RecomputeConfig& rc : settings) {
      SCOPED_TRACE(l.name() + ", " + rc.granularity + " " + rc.method);
      model::ModelConfig mc = moe_mtp();
      mc.num_query_groups = 4;
      const Result plain = run(world, mc, l, 3);
      mc.recompute = rc;
      const Result recomputed = run(world, mc, l, 3);
      ASSERT_EQ(recomputed.loss.size(), 3u);
      for (size_t i = 0; i < 3; ++i)
        EXPECT_EQ(std::memcmp(&recomputed.loss[i], &plain.loss[i], sizeof(double)), 0) << "step " << i + 1;
      for (const auto& [name, g] : plain.grads)
        EXPECT_EQ(std::memcmp(recomputed.grads.at(name).raw(), g.raw(), static_cast<size_t>(g.nbytes())), 0) << name;
    }
}

// Tensor (with sequence parallelism) and context parallelism within each stage: the stages exchange each rank's rows.
TEST_F(Mpi, PipelineWithTensorAndContextParallelismMatchesOneProcess) {
  if (P != 4) GTEST_SKIP() << "needs 4 ranks";
  Layout tp{2};
  tp.tp = 2;
  Layout cp{2};
  cp.cp = 2;
  model::ModelConfig moe = moe_mtp();
  moe.num_query_groups = 4;
  for (const model::ModelConfig& mc : {tied_dense(), untied_dense(), moe}) {
    check_layout(world, mc, tp);
    if (mc.position_embedding_type == model::PositionEmbedding::rope) check_layout(world, mc, cp);
  }
}

// --calculate-per-token-loss over the stages, the data-parallel replicas and the context-parallel ranks: the global
// batch's token count is the last stages' sum over DP (each CP group counts its sequences whole), so every layout
// weighs each token as one process does; and a dynamic loss scale (2^12 on this f32 model, where it is exact) with it.
TEST_F(Mpi, PerTokenLossAndLossScalingMatchOneProcess) {
  Layout pp{P};
  pp.per_token = true;
  check_layout(world, moe_mtp(), pp, 4);
  if (P != 4) return;
  Layout dp{2, 1, -1, -1, /*zero=*/true, /*overlap=*/true};
  dp.per_token = true;
  dp.loss_scale = 4096;
  check_layout(world, moe_mtp(), dp, 4);
  Layout cp{2};
  cp.cp = 2;
  cp.per_token = true;
  check_layout(world, tied_dense(), cp, 4);
}

// Muon over the pipeline's stages (each stage's matrices orthogonalised where they live; the tied embedding and its
// last-stage copy under AdamW, their gradients summed first), and with the distributed Muon over PP 2 x DP 2.
TEST_F(Mpi, MuonUnderPipelineMatchesOneProcess) {
  Layout pp{P};
  pp.muon = true;
  check_layout(world, moe_mtp(), pp, 8);
  check_layout(world, tied_dense(), pp, 8);
  if (P != 4) return;
  Layout dp{2, 1, -1, -1, /*zero=*/true};
  dp.muon = true;
  check_layout(world, moe_mtp(), dp, 8);
}

// Megatron-FSDP over the pipeline's stages: each stage shards its own decoder layers and MTP depth (the tied
// embedding and its last-stage copy outside the units, their gradients summed across the stages before the reduction),
// under PP = P and at 4 ranks PP 2 x DP 2 (MoE: with the experts over EP 2 at DP 2 inside each stage).
TEST_F(Mpi, MegatronFsdpUnderPipelineMatchesOneProcess) {
  for (train::FsdpStrategy s : {train::FsdpStrategy::optim_grads, train::FsdpStrategy::optim_grads_params}) {
    Layout pp{P};
    pp.fsdp = s;
    check_layout(world, moe_mtp(), pp, 8);
    check_layout(world, tied_dense(), pp, 8);
    if (P != 4) continue;
    Layout dp{2, 2};
    dp.fsdp = s;
    check_layout(world, moe_mtp(), dp, 8);
    dp.ep = 1;
    check_layout(world, tied_dense(), dp, 8);
  }
}

// Every kind of parallelism at once: PP 2 x TP 2 (SP) x DP 2 with the MoE layers' experts over ETP 2 (the default:
// TP) and EP 2 within each stage, with the distributed optimizer and its overlap, and with full recompute; and PP 2 x
// VPP 2 x CP 2 x DP 2.
TEST_F(Mpi, EightRanksMatchOneProcess) {
  model::ModelConfig mc = moe_mtp();
  mc.num_query_groups = 4;
  Layout l{2, 2, -1, -1, /*zero=*/true, /*overlap=*/true};
  l.tp = 2;
  check_layout(world, mc, l);
  mc.recompute = {"full", "uniform", 1, {}};
  check_layout(world, mc, l);
  // Context parallelism under an interleaved pipeline: PP 2 x VPP 2 x CP 2 x DP 2.
  Layout cp{2};
  cp.cp = 2;
  cp.vpp = 2;
  check_layout(world, tied_dense(), cp);
}

// Checkpoints hold every layer whatever the PP size: saved at step 4 of 8 under PP = P (dense tied; MoE + MTP with the
// distributed optimizer, at 4 ranks as PP 2 x EP 2 with its gathers overlapped), one process loads every parameter
// bitwise, and one process, PP = P and at 4 ranks PP 2 (x DP 2) and PP 4 resume with the uninterrupted run's losses.
TEST_F(Mpi, CheckpointsReshardAcrossPipelineSizes) {
  struct Case {
    model::ModelConfig mc;
    Layout saved_at;
  };
  const Layout moe_saved = P == 4 ? Layout{2, 2, -1, -1, true, true} : Layout{2, 1, -1, -1, true, false};
  Layout interleaved{2};
  interleaved.vpp = 2;
  for (const Case& c : {Case{tied_dense(), {P}}, Case{moe_mtp(), moe_saved}, Case{tied_dense(), interleaved}}) {
    SCOPED_TRACE("saved at " + c.saved_at.name() + (c.mc.moe.enabled() ? ", MoE" : ""));
    const std::string dir = shared_dir(world, "moecore_mpi_pp_", "reshard");
    const Result straight = run(world, c.mc, c.saved_at, 8);
    const Result saved = run(world, c.mc, c.saved_at, 8, dir, "", 4);
    model::GptModel hub(c.mc, 2, 42, {}, testing::test_device());
    optim::AdamW hub_opt(hub.params(), {});
    train::load_training_checkpoint(dir + "/iter_0000004", hub, hub_opt, 1234);
    for (const auto& p : hub.params()) {
      if (!saved.values.count(p.name)) continue;  // another stage's
      const Tensor v = testing::host(p.value);
      const Tensor& s = saved.values.at(p.name);
      ASSERT_EQ(v.nbytes(), s.nbytes()) << p.name;
      EXPECT_EQ(std::memcmp(v.raw(), s.raw(), static_cast<size_t>(v.nbytes())), 0) << p.name;
    }
    std::vector<Layout> resume_at = {Layout{}, Layout{P}, interleaved};
    if (P == 4) resume_at.push_back(Layout{2});
    for (const Layout& l : resume_at) {
      const Result resumed = run(world, c.mc, l, 8, "", dir);
      ASSERT_EQ(resumed.loss.size(), 4u) << l.name();
      for (size_t i = 0; i < 4; ++i)
        EXPECT_LE(rel(resumed.loss[i], straight.loss[4 + i]), 1e-5) << l.name() << " step " << 5 + i;
    }
    barrier(world);
    if (world.rank() == 0) std::filesystem::remove_all(dir);
  }
}

// --async-save under PP = P (MoE + MTP, distributed optimizer; at 4 ranks PP 2 x EP 2 with its gathers overlapped):
// the first stage's ranks write in the background what the other stages sent them, every stage takes part in the
// agreement at each step boundary, and the files equal the synchronous saves' byte for byte; the resumed run continues
// bit-identically.
TEST_F(Mpi, AsyncSaveUnderPipelineWritesTheSynchronousFiles) {
  const Layout l = P == 4 ? Layout{2, 2, -1, -1, true, true} : Layout{2, 1, -1, -1, true, false};
  const model::ModelConfig mc = moe_mtp();
  const std::string sync = shared_dir(world, "moecore_mpi_pp_", "sync"),
                    async = shared_dir(world, "moecore_mpi_pp_", "async");
  const Result straight = run(world, mc, l, 6);
  run(world, mc, l, 6, sync, "", 4, 2, false);
  run(world, mc, l, 6, async, "", 4, 2, true);
  barrier(world);
  if (world.rank() == 0) {
    for (int64_t it : {2, 4}) testing_mpi::expect_same_checkpoint_files(async, sync, it);
  }
  const Result resumed = run(world, mc, l, 6, async, async, 0, 0, true);
  ASSERT_EQ(resumed.loss.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_EQ(std::memcmp(&resumed.loss[i], &straight.loss[4 + i], sizeof(double)), 0) << "step " << 5 + i;
  barrier(world);
  if (world.rank() == 0) {
    EXPECT_EQ(io::checkpoint_read_tracker(async), 6);
    std::filesystem::remove_all(sync);
    std::filesystem::remove_all(async);
  }
}

// Generation through the pipeline: every stage runs each step's forward, the last samples and tells the others; the
// tokens equal one process's from the same weights (1F1B and interleaved splits, dense tied and MoE).
TEST_F(Mpi, GenerationThroughThePipelineMatchesOneProcess) {
  Layout interleaved{2};
  interleaved.vpp = 2;
  for (const Layout& l : {Layout{P}, interleaved})
    for (const model::ModelConfig& mc : {tied_dense(), moe_mtp()}) {
      if (l.vpp > 1 && P != 2) continue;
      SCOPED_TRACE(l.name() + (mc.moe.enabled() ? ", MoE" : ""));
      model::GptModel one(mc, 2, 42, {}, testing::test_device());
      const auto want = train::generate(one, {1, 2, 3}, 12, 0.8f, 7, -1, 0);
      const model::ModelParallel par = layout_groups(world, mc, l).second;
      model::GptModel staged(mc, 2, 42, par, testing::test_device());
      const auto got = train::generate(staged, {1, 2, 3}, 12, 0.8f, 7, -1, 0);
      ASSERT_EQ(want.size(), 12u);
      EXPECT_EQ(got, want) << "stage " << par.pp.rank();
    }
}

TEST_F(Mpi, BadPipelineSplitsAreErrorsNamingTheValues) {
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { model::pipeline_stage_layers(5, 2); })
                .find("--num-layers (5) must be divisible by "
                      "--pipeline-model-parallel-size (2)"),
            std::string::npos);
  EXPECT_NE(message([] { model::pipeline_stage_layers(7, 4, 1, 1); }).find("5 layers would remain for the other 2"),
            std::string::npos);
  EXPECT_NE(message([] { model::pipeline_stage_layers(6, 4, 3, 3); }).find("0 layers would remain"), std::string::npos);
  EXPECT_NE(message([] { model::pipeline_stage_layers(4, 1, 2, -1); }).find("need --pipeline-model-parallel-size > 1"),
            std::string::npos);
  EXPECT_EQ(model::pipeline_stage_layers(6, 4, 1, 1), (std::vector<int64_t>{1, 2, 2, 1}));
  EXPECT_EQ(model::pipeline_stage_layers(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(model::pipeline_stage_layers(7, 3, 3, -1), (std::vector<int64_t>{3, 2, 2}));
  // Virtual pipelines: each stage's layers split evenly over its chunks, listed by virtual stage (chunk-major).
  EXPECT_EQ(model::pipeline_stage_layers(6, 2, 2, 4, 2), (std::vector<int64_t>{1, 2, 1, 2}));
  EXPECT_EQ(model::pipeline_stage_layers(8, 2, -1, -1, 4), (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_NE(message([] {
              model::pipeline_stage_layers(6, 2, -1, -1, 2);
            }).find("pipeline stage 0 holds 3 decoder layers (--num-layers 6 over --pipeline-model-parallel-size 2"),
            std::string::npos);
  EXPECT_NE(message([] { model::pipeline_stage_layers(4, 1, -1, -1, 2); }).find("a virtual pipeline"),
            std::string::npos);
  // The embedding and the loss counted as layers (Megatron's --account-for-*-in-pipeline-split).
  EXPECT_EQ(model::pipeline_stage_layers(7, 2, -1, -1, 1, true, false), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(model::pipeline_stage_layers(6, 2, -1, -1, 1, true, true), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(model::pipeline_stage_layers(6, 4, -1, -1, 1, true, true), (std::vector<int64_t>{1, 2, 2, 1}));
  EXPECT_EQ(model::pipeline_stage_layers(7, 2, -1, -1, 2, false, true), (std::vector<int64_t>{2, 2, 2, 1}));
  EXPECT_NE(message([] { model::pipeline_stage_layers(6, 4, -1, -1, 1, true, false); })
                .find("--num-layers (6) + 1 for the embedding = 7 must be divisible by --pipeline-model-parallel-size "
                      "(4)"),
            std::string::npos);
  EXPECT_NE(message([] { model::pipeline_stage_layers(6, 2, 1, -1, 1, true, false); }).find("exclude"),
            std::string::npos);
  // A model given a split of another shape.
  EXPECT_NE(message([] {
              model::ModelParallel par;
              par.virtual_stages = 2;
              model::GptModel(tied_dense(), 2, 1, par);
            }).find("virtual pipeline stages per rank need --pipeline-model-parallel-size > 1"),
            std::string::npos);
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing_mpi::run_mpi_tests(argc, argv, 120.0);
}
