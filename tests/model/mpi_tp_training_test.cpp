// Tensor-, sequence- and context-parallel training equivalence (issue 12: each layout matches the single-process run),
// under mpirun with 2, 4 and 8 ranks. Every rank also trains the single-process reference itself (same config, seed,
// global batch), then the same model under each layout this world size allows: TP = P, TP = P with sequence
// parallelism, CP, and at 4 ranks TP 2 x DP 2 (with and without SP) and TP 2 x CP 2; at 8 ranks TP 2 x EP 2 x DP 2
// with the distributed optimizer and TP 2 x CP 2 x DP 2. Two dense models and two MoE models (under SP, also with the
// experts over EP 2: Parallel Folding). The dense models: RMSNorm + SwiGLU + RoPE with tied embeddings
// and MHA, and LayerNorm + GeLU + linear biases + learned absolute positions + QK-norm with GQA and an untied output
// layer. Checked: step-1 loss and global grad norm (1e-6 rel), every parameter's reduced gradient after step 1 (the
// tensor-parallel shards gathered into the whole tensor; element-wise rtol 1e-5 with an absolute floor of 1e-6 x the
// tensor's largest value, and 1e-9), 20-step losses (rtol 1e-5), the final validation loss, bitwise-identical losses
// across two identical runs; overlapped gradient reduction (and the distributed optimizer's overlapped reduce-scatter
// and parameter gather) bitwise equal to the plain one; the distributed optimizer under TP and CP (x DP; MoE with EP)
// matches too; checkpoints saved under TP (MoE: with EP) with it load at one process with bitwise-identical parameters
// and resume with the uninterrupted run's losses at 1 process, under TP and under CP; the partial distributed optimizer
// (--num-distributed-optimizer-instances 2 and 4 at DP 4, dense and MoE) matches too, its checkpoints resume at N 1;
// bad layouts fail at construction naming the values; FP8 delayed scaling leaves the same quantizer state on every
// rank (its amax reduction over TP x DP x CP). Every model lives on testing::test_device().
#include <gtest/gtest.h>

#include "model/mpi_training_support.h"
#include "model/synthetic_training.h"
#include "mpi_test_support.h"
#include "test_util.h"

#include <unistd.h>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "moecore/core/error.h"
#include "moecore/nn/fp8_delayed.h"
#include "moecore/optim/muon.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/parallel/shards.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/optimizer.h"
#include "moecore/train/trainer.h"

namespace moecore {
namespace {

class Mpi : public testing_mpi::EightRanksApartTest {};
using testing::synthetic_batch;
using testing_mpi::expect_close;
using testing_mpi::rel;
using testing_mpi::shared_dir;

// RMSNorm, SwiGLU, RoPE, tied embeddings, MHA (4 query groups: TP up to 4).
model::ModelConfig llama_like() {
  model::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 4;
  c.ffn_hidden_size = 48;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.untie_embeddings_and_output_weights = false;
  return c;
}

// LayerNorm, GeLU, biases on every linear, learned absolute positions, QK-norm, GQA (2 groups: TP up to 2), untied.
model::ModelConfig gpt2_like() {
  model::ModelConfig c = llama_like();
  c.num_query_groups = 2;
  c.normalization = model::Normalization::layernorm;
  c.swiglu = false;
  c.add_bias_linear = true;
  c.position_embedding_type = model::PositionEmbedding::learned_absolute;
  c.qk_layernorm = true;
  c.untie_embeddings_and_output_weights = true;
  return c;
}

// The small MoE model (a dense layer, then MoE: 8 experts, top-2) with aux_loss, seq_aux_loss and the z-loss, a
// gated shared expert; `sigmoid`: sigmoid routing with the aux-loss-free expert bias and global_aux_loss instead.
model::ModelConfig moe_model(bool sigmoid) {
  model::ModelConfig c = testing::small_moe_model(8);
  c.num_query_groups = 4;  // TP up to 4
  c.moe.z_loss_coeff = 1e-3f;
  c.moe.shared_expert_intermediate_size = 16;
  c.moe.shared_expert_gate = true;
  if (!sigmoid) {
    c.moe.load_balancing_type = {moe::LoadBalancing::aux_loss, moe::LoadBalancing::seq_aux_loss};
    c.moe.aux_loss_coeff = {1e-2f, 1e-2f};
    return c;
  }
  c.moe.score_function = moe::ScoreFunction::sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 1e-2f;
  c.moe.load_balancing_type = {moe::LoadBalancing::global_aux_loss};
  c.moe.aux_loss_coeff = {1e-2f};
  return c;
}

// DeepSeek-style attention: MLA with q LoRA (or, `lite`, without), latent norms and YaRN, on the MoE model (4 heads).
model::ModelConfig mla_model(bool lite) {
  model::ModelConfig c = moe_model(false);
  c.multi_latent_attention = c.qk_layernorm = true;
  c.yarn = !lite;
  c.q_lora_rank = lite ? 0 : 12;
  c.kv_lora_rank = 8;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;
  c.yarn_config.scaling_factor = 4.0f;
  c.yarn_config.original_max_position_embeddings = 8;
  c.yarn_config.mscale_all_dim = 1.0f;
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
  return t;
}

struct Layout {
  int tp = 1;
  bool sp = false;
  int ep = 1;   // MoE models: experts over ETP x EP x EDP on the same ranks (Parallel Folding)
  int cp = 1;   // context parallel
  int etp = 1;  // expert tensor parallel
  moe::DispatcherKind dispatcher = moe::DispatcherKind::alltoall;
  int instances = 1;  // --num-distributed-optimizer-instances
  // Megatron-FSDP: the model built whole (its layers' memory then given back by the optimizer), not born in the shards
  // as `moecore train` builds it (train::fsdp_model_parallel)
  bool built_whole = false;
  std::string name() const {
    return "TP " + std::to_string(tp) + (sp ? " + SP" : "") + (cp > 1 ? " x CP " + std::to_string(cp) : "") +
           (etp > 1 ? ", ETP " + std::to_string(etp) : "") + (ep > 1 ? ", EP " + std::to_string(ep) : "") +
           (dispatcher == moe::DispatcherKind::allgather ? ", allgather" : "") +
           (instances > 1 ? ", " + std::to_string(instances) + " optimizer instances" : "");
  }
};

struct Result {
  std::vector<double> loss, grad_norm;
  std::vector<double> params_norm, num_zeros;  // per step (NaN where the logging flags did not ask)
  double valid = 0;
  std::map<std::string, Tensor> grads;   // whole tensors (tensor-parallel shards gathered), after the last step
  std::map<std::string, Tensor> values;  // whole parameters at the end
  std::vector<float> fp8_state;          // FP8 delayed scaling's records on this rank, in name order
};

// The model and groups of a layout over `world` (tp 0: one process, no communication at all).
struct Built {
  train::TrainGroups groups;
  model::ModelParallel par;
};
Built build(const ProcessGroup& world, const Layout& l, int64_t num_experts = 0) {
  Built b;
  if (l.tp == 0) return b;
  ParallelConfig pc;
  pc.tensor_model_parallel_size = l.tp;
  pc.expert_model_parallel_size = l.ep;
  pc.expert_tensor_parallel_size = l.etp;
  pc.context_parallel_size = l.cp;
  pc.num_distributed_optimizer_instances = l.instances;
  const ProcessGroups pg = make_process_groups(pc, static_cast<int>(num_experts), world);
  b.groups = train::train_groups(pg);
  b.par = model::model_parallel(pg, l.sp, l.dispatcher);
  return b;
}

using TrainTweak = std::function<void(train::TrainConfig&)>;
Result run(const ProcessGroup& world, const model::ModelConfig& mc, const Layout& l, int64_t iters,
           const std::string& save = "", const std::string& load = "", int64_t exit_at = 0, bool zero = false,
           bool overlap = false, bool gather = false, const TrainTweak& tweak = {},
           const optim::AdamWConfig& ocfg = {}) {
  const Built b = build(world, l, mc.moe.num_experts);
  train::TrainConfig tc = train_config(iters);
  tc.use_distributed_optimizer = zero;
  tc.num_distributed_optimizer_instances = l.instances;
  tc.overlap_grad_reduce = overlap;
  tc.overlap_param_gather = gather;
  tc.ddp_bucket_size = 3000;
  tc.save = save;
  tc.load = load;
  tc.exit_interval = exit_at;
  if (tweak) tweak(tc);
  model::GptModel gpt(mc, 2, 42, l.built_whole ? b.par : train::fsdp_model_parallel(b.par, tc), testing::test_device());
  // The start-up memory check's count (apps: check_model_fits) is what this rank allocates.
  EXPECT_EQ(model::parameters_per_rank(mc, static_cast<int>(gpt.ep_size()), static_cast<int>(gpt.tp_size()),
                                       static_cast<int>(gpt.etp_size())),
            gpt.num_parameters());
  optim::AdamW opt(gpt.params(), ocfg, /*allocate_state=*/!zero);
  const train::TrainLog log = train::train(gpt, opt, tc, synthetic_batch, nullptr, {}, l.tp ? &b.groups : nullptr);
  Result r;
  r.loss = log.train_loss;
  r.grad_norm = log.grad_norm;
  r.params_norm = log.params_norm;
  r.num_zeros = log.num_zeros;
  if (!log.valid_loss.empty()) r.valid = log.valid_loss.back().second;
  if (const nn::Fp8Delayed* d = gpt.fp8_delayed())
    for (const auto& [name, rec] : d->records())
      r.fp8_state.insert(r.fp8_state.end(), rec.slots.begin(), rec.slots.end());
  for (const auto& p : gpt.params()) {
    if (p.expert_parallel) {  // expert shards: the whole [E, ...] tensor over the ETP and EP groups
      const TensorShard ep{0, 1, static_cast<int>(gpt.ep_rank()), static_cast<int>(gpt.ep_size())};
      auto whole = [&](const Tensor& t) {
        return all_gather_shards(all_gather_shards(t, p.tp, b.par.etp), ep, b.par.ep).clone();
      };
      if (p.grad.resident()) r.grads[p.name] = whole(p.grad);
      r.values[p.name] = whole(p.value);
      continue;
    }
    // (Megatron-FSDP's optim_grads*: a decoder layer's gradients live in the shards only)
    if (p.grad.resident()) r.grads[p.name] = all_gather_shards(p.grad, p.tp, b.par.tp).clone();
    r.values[p.name] = all_gather_shards(p.value, p.tp, b.par.tp).clone();
  }
  return r;
}

// zero: the layout runs with the distributed optimizer (the reference with plain AdamW).
void check_layout(const ProcessGroup& world, const model::ModelConfig& mc, const Layout& l, bool zero = false) {
  SCOPED_TRACE(l.name() + " x DP " + std::to_string(world.size() / (l.tp * l.cp)) + (mc.moe.enabled() ? ", MoE" : "") +
               (zero ? ", distributed optimizer" : ""));
  const Result ref1 = run(world, mc, Layout{0, false}, 1);
  const Result got1 = run(world, mc, l, 1, "", "", 0, zero);
  EXPECT_LE(rel(got1.loss[0], ref1.loss[0]), 1e-6) << got1.loss[0] << " vs " << ref1.loss[0];
  EXPECT_LE(rel(got1.grad_norm[0], ref1.grad_norm[0]), 1e-6) << got1.grad_norm[0] << " vs " << ref1.grad_norm[0];
  if (!zero) {  // (the distributed optimizer reduces into its shards)
    ASSERT_EQ(got1.grads.size(), ref1.grads.size());
    expect_close(got1.grads, ref1.grads);
  }  // (the distributed optimizer reduces into its shards)
  const Result ref = run(world, mc, Layout{0, false}, 20);
  const Result got = run(world, mc, l, 20, "", "", 0, zero);
  const Result again = run(world, mc, l, 20, "", "", 0, zero);
  ASSERT_EQ(got.loss.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_LE(rel(got.loss[i], ref.loss[i]), 1e-5) << "step " << i + 1 << ": " << got.loss[i] << " vs " << ref.loss[i];
    EXPECT_EQ(std::memcmp(&got.loss[i], &again.loss[i], sizeof(double)), 0) << "step " << i + 1 << " not bitwise";
  }
  EXPECT_LE(rel(got.valid, ref.valid), 1e-5) << "validation loss " << got.valid << " vs " << ref.valid;
}

TEST_F(Mpi, TensorParallelMatchesOneProcess) {
  check_layout(world, llama_like(), {P, false});
  check_layout(world, gpt2_like(), {2, false});
}

TEST_F(Mpi, SequenceParallelMatchesOneProcess) {
  check_layout(world, llama_like(), {P, true});
  check_layout(world, gpt2_like(), {2, true});
}

// MoE layers under TP + SP (Megatron requires SP): each rank routes its slice of every sequence; the aux,
// seq-aux, global-aux and z losses over the group's gathered logits; the router and shared expert replicated with
// their gradients summed over TP; experts over EP x EDP on the same ranks (folding); expert-bias counts over TP x DP.
TEST_F(Mpi, MoeUnderSequenceParallelMatchesOneProcess) {
  check_layout(world, moe_model(false), {P, true});
  check_layout(world, moe_model(false), {2, true});
  // global_aux_loss averages counts over the micro-batches one rank has seen, so it matches one process only at DP 1.
  check_layout(world, moe_model(true), {P, true});
  if (P == 4) check_layout(world, moe_model(false), {2, true, 2});  // attention TP 2 x DP 2, experts EP 2 x EDP 2
  if (P == 2) check_layout(world, moe_model(true), {2, true, 2});   // attention TP 2, experts EP 2
}

// Expert tensor parallelism (MoE Parallel Folding): every expert's fc1 columns and fc2 rows split over ETP 2, the
// alltoall dispatcher gathering the rows over ETP after its all-to-all and reduce-scattering the partial outputs, the
// allgather dispatcher over the ETP x EP group. Attention TP 2 with ETP 2 (x EP 2 at 4 ranks: the experts over 4
// ranks while attention runs TP 2 x DP 2), attention TP 1 x DP 2 with the experts split over the DP ranks, TP 2 x CP 2
// with ETP 2 x EP 2, and the distributed optimizer.
TEST_F(Mpi, ExpertTensorParallelMatchesOneProcess) {
  using moe::DispatcherKind;
  const int ep = P / 2;
  check_layout(world, moe_model(false), {2, true, ep, 1, 2});
  check_layout(world, moe_model(false), {2, true, ep, 1, 2, DispatcherKind::allgather});
  if (P == 2) check_layout(world, moe_model(false), {1, false, 1, 1, 2, DispatcherKind::allgather});
  if (P == 4) {
    check_layout(world, moe_model(false), {1, false, 2, 1, 2});
    check_layout(world, moe_model(false), {2, true, 2, 2, 2});
    check_layout(world, mla_model(false), {2, true, 2, 1, 2});  // MLA + QK-norm (latent norms), folded
  }
  check_layout(world, moe_model(false), {2, true, ep, 1, 2}, /*zero=*/true);
  // Linear biases (Megatron's default): the fc1 bias split like fc1, the fc2 bias whole on the ETP ranks, added by
  // the first; with the distributed optimizer its replicas are counted once in the grad norm.
  model::ModelConfig biased = moe_model(false);
  biased.moe.shared_expert_intermediate_size = 0;
  biased.moe.shared_expert_gate = false;
  biased.add_bias_linear = true;
  check_layout(world, biased, {2, true, ep, 1, 2});
  check_layout(world, biased, {2, true, ep, 1, 2}, /*zero=*/true);
}

// Multi-latent attention under TP: the up-projections split by head, linear_proj row-parallel, the down-projections
// and latent norms replicated with their head-partial gradients summed over TP; with and without SP, with q LoRA and
// YaRN, and V2-Lite style (no q LoRA).
TEST_F(Mpi, MultiLatentAttentionUnderTensorParallelismMatchesOneProcess) {
  check_layout(world, mla_model(false), {P, true});
  check_layout(world, mla_model(true), {2, true});
  model::ModelConfig dense = mla_model(false);  // a dense MLA model without SP
  dense.moe = {};
  dense.moe_layer_freq = "1";
  check_layout(world, dense, {2, false});
}

// Multi-token prediction under TP: each depth's embedding vocabulary-parallel, its eh_proj replicated (gradients
// summed over TP under SP), its transformer layer split like the decoder's, its loss through the vocabulary-parallel
// head (h_k all-gathered under SP). DeepSeek-V3 style (MLA, MoE, one depth) under TP + SP, and a dense model with two
// depths under TP alone.
TEST_F(Mpi, MultiTokenPredictionUnderTensorParallelismMatchesOneProcess) {
  model::ModelConfig v3 = mla_model(false);
  v3.mtp_num_layers = 1;
  check_layout(world, v3, {2, true});
  model::ModelConfig dense = llama_like();
  dense.mtp_num_layers = 2;
  check_layout(world, dense, {P, false});
}

TEST_F(Mpi, BfloatTensorParallelTracksOneProcess) {
  // bf16 compute: the GEMM operands are rounded, so the layouts agree to bf16 accuracy, not 1e-5.
  model::ModelConfig mc = llama_like();
  mc.compute_dtype = DType::bf16;
  const Result ref = run(world, mc, Layout{0, false}, 5);
  const Result got = run(world, mc, Layout{P, true}, 5);
  for (size_t i = 0; i < 5; ++i) EXPECT_LE(rel(got.loss[i], ref.loss[i]), 2e-2) << "step " << i + 1;
  // The MoE model with its experts over ETP 2: the slices' bf16 partial outputs are summed in f32 by the alltoall
  // dispatcher's reduce-scatter.
  model::ModelConfig moe = moe_model(false);
  moe.compute_dtype = DType::bf16;
  const Result moe_ref = run(world, moe, Layout{0, false}, 5);
  const Result moe_got = run(world, moe, Layout{2, true, P / 2, 1, 2}, 5);
  for (size_t i = 0; i < 5; ++i) EXPECT_LE(rel(moe_got.loss[i], moe_ref.loss[i]), 2e-2) << "MoE, step " << i + 1;
}

// Muon (--optimizer muon, f32 products) under TP: duplicated gathers each shard's matrix -- QKV per piece, SwiGLU's
// [gate_r; up_r] halves a row permutation of the whole, to which the orthogonalisation is equivariant -- and keeps its
// part; distributed sums the norm and every Gram over the group instead; both follow one process, the experts' matrices
// over ETP 2 too, and so do the replicas of plain data and context parallelism. blockwise orthogonalises each shard
// alone, which Megatron defines to depend on the TP size: it differs from one process.
TEST_F(Mpi, MuonUnderTensorParallelismMatchesOneProcess) {
  const auto muon = [](optim::MuonTpMode mode) {
    return TrainTweak([mode](train::TrainConfig& t) {
      t.optimizer = optim::OptimizerKind::muon;
      t.muon.tp_mode = mode;
      t.muon.fp32_matmul_prec = optim::MuonMatmulPrecision::high;
      t.muon.extra_scale_factor = 0.2f;
    });
  };
  // The largest difference of the final parameters relative to each tensor's largest value.
  const auto worst = [](const Result& got, const Result& ref) {
    double w = 0;
    for (const auto& [name, r] : ref.values) {
      const Tensor& g = got.values.at(name);
      double maxref = 1e-30, diff = 0;
      for (int64_t i = 0; i < r.numel(); ++i) {
        maxref = std::max(maxref, std::fabs(double(r.data<float>()[i])));
        diff = std::max(diff, std::fabs(double(g.data<float>()[i]) - r.data<float>()[i]));
      }
      w = std::max(w, diff / maxref);
    }
    return w;
  };
  std::vector<std::pair<model::ModelConfig, Layout>> cases = {{llama_like(), Layout{P, false}},
                                                              {moe_model(false), Layout{2, true, P / 2, 1, 2}}};
  if (P == 2) cases.push_back({llama_like(), Layout{1}});               // DP alone
  if (P == 2) cases.push_back({llama_like(), Layout{1, false, 1, 2}});  // CP 2
  for (auto mode : {optim::MuonTpMode::duplicated, optim::MuonTpMode::distributed})
    for (const auto& [mc, l] : cases) {
      SCOPED_TRACE(std::string(enum_name(mode)) + ", " + l.name() + (mc.moe.enabled() ? ", MoE" : ""));
      const Result ref = run(world, mc, Layout{0, false}, 6, "", "", 0, false, false, false, muon(mode));
      const Result got = run(world, mc, l, 6, "", "", 0, false, false, false, muon(mode));
      ASSERT_EQ(got.loss.size(), 6u);
      for (size_t i = 0; i < 6; ++i)
        EXPECT_LE(rel(got.loss[i], ref.loss[i]), 2e-5)
            << "step " << i + 1 << ": " << got.loss[i] << " vs " << ref.loss[i];
      EXPECT_LE(worst(got, ref), 2e-5);
    }
  const Result ref =
      run(world, llama_like(), Layout{0, false}, 3, "", "", 0, false, false, false, muon(optim::MuonTpMode::blockwise));
  const Result got =
      run(world, llama_like(), Layout{P, false}, 3, "", "", 0, false, false, false, muon(optim::MuonTpMode::blockwise));
  EXPECT_GT(worst(got, ref), 1e-3) << "blockwise should orthogonalise each shard alone";
}

// Distributed Muon (--use-distributed-optimizer with --optimizer muon: Megatron's layer-wise deal) is bitwise the
// replicated Muon at the same layout -- each owner steps its parameters from the same reduced gradients and broadcasts
// them -- dense under DP, MoE with TP 2 + SP and the experts over ETP 2 (its owners' TP peers orthogonalising their
// shards together), with Adam's and with Lion's scalar optimizer; each rank holds its owned parameters' state (about
// 1/DP); a checkpoint it saves holds every parameter's state and resumes at other layouts with the uninterrupted run's
// losses (Lion's too).
TEST_F(Mpi, DistributedMuonIsBitwiseReplicatedMuon) {
  const auto muon = [](bool distributed, optim::ScalarOptimizer scalar = optim::ScalarOptimizer::adam) {
    return TrainTweak([distributed, scalar](train::TrainConfig& t) {
      t.optimizer = optim::OptimizerKind::muon;
      t.muon.extra_scale_factor = 0.2f;
      t.muon.scalar_optimizer = scalar;
      t.use_distributed_optimizer = distributed;
    });
  };
  std::vector<std::pair<model::ModelConfig, Layout>> cases = {{moe_model(false), Layout{2, true, P / 2, 1, 2}}};
  if (P == 2) cases.push_back({llama_like(), Layout{1}});  // (DP alone; at 4 ranks the MoE case has DP 2)
  for (const auto& [mc, l] : cases)
    for (const auto scalar : {optim::ScalarOptimizer::adam, optim::ScalarOptimizer::lion}) {  // (and Lion's scalars)
      SCOPED_TRACE(l.name() + (mc.moe.enabled() ? ", MoE" : "") + ", " + std::string(enum_name(scalar)));
      const Result plain = run(world, mc, l, 6, "", "", 0, false, false, false, muon(false, scalar));
      const Result dist = run(world, mc, l, 6, "", "", 0, false, false, false, muon(true, scalar));
      ASSERT_EQ(dist.loss.size(), 6u);
      for (size_t i = 0; i < 6; ++i)
        EXPECT_EQ(std::memcmp(&dist.loss[i], &plain.loss[i], sizeof(double)), 0) << "step " << i + 1;
      for (const auto& [name, v] : plain.values)
        EXPECT_EQ(std::memcmp(v.raw(), dist.values.at(name).raw(), static_cast<size_t>(v.nbytes())), 0) << name;
    }
  {  // the state each rank holds
    const Built b = build(world, Layout{1});
    model::GptModel gpt(llama_like(), 2, 42, b.par, testing::test_device());
    std::vector<optim::MuonParam> kinds;
    for (const Param& p : gpt.params())
      kinds.push_back({optim::muon_managed(p.name, p.value.dim(), p.expert_parallel), {}});
    const optim::MuonGroups whole{b.groups.tp, b.groups.etp, b.groups.dp, b.groups.edp, false};
    optim::MuonGroups dealt = whole;
    dealt.distributed = true;
    const int64_t all = optim::Muon(gpt.params(), kinds, {}, {}, whole).state_bytes();
    const optim::Muon mine(gpt.params(), kinds, {}, {}, dealt);
    std::vector<int64_t> bytes = {mine.state_bytes()};
    all_reduce_sum(std::span<int64_t>(bytes), world);
    EXPECT_EQ(bytes[0], all);  // every parameter's state on exactly one rank
    EXPECT_LE(mine.state_bytes(), all / P * 2) << "the deal leaves one rank most of the state";
  }
  const std::string dir = shared_dir(world, "moecore_mpi_tp_", "muon");
  const Result straight =
      run(world, moe_model(false), Layout{0, false}, 8, "", "", 0, false, false, false, muon(false));
  run(world, moe_model(false), Layout{2, true, P / 2, 1, 2}, 8, dir, "", 4, false, false, false, muon(true));
  std::vector<Layout> resume_at = {Layout{0, false}};
  if (P == 2) resume_at.push_back(Layout{1, false, 1, 2});  // CP 2
  for (const Layout& at : resume_at) {
    const Result resumed = run(world, moe_model(false), at, 8, "", dir, 0, false, false, false, muon(at.tp == 1));
    ASSERT_EQ(resumed.loss.size(), 4u) << at.name();
    for (size_t i = 0; i < 4; ++i)
      EXPECT_LE(rel(resumed.loss[i], straight.loss[4 + i]), 1e-4) << at.name() << " step " << 5 + i;
  }
  barrier(world);
  if (world.rank() == 0) std::filesystem::remove_all(dir);
  barrier(world);
  {  // Lion's scalars: a distributed save (each owner's momentum broadcast) resumed at one process
    const auto lion = optim::ScalarOptimizer::lion;
    const Result whole =
        run(world, moe_model(false), Layout{0, false}, 8, "", "", 0, false, false, false, muon(false, lion));
    run(world, moe_model(false), Layout{2, true, P / 2, 1, 2}, 8, dir, "", 4, false, false, false, muon(true, lion));
    const Result resumed =
        run(world, moe_model(false), Layout{0, false}, 8, "", dir, 0, false, false, false, muon(false, lion));
    ASSERT_EQ(resumed.loss.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_LE(rel(resumed.loss[i], whole.loss[4 + i]), 1e-4) << "Lion, step " << 5 + i;
    barrier(world);
    if (world.rank() == 0) std::filesystem::remove_all(dir);
  }
}

// The distributed optimizer (ZeRO-1) under TP: the moments sharded over DP (experts over EDP), the tensor-parallel
// shards in an instance of their own so the grad norm counts each parameter once; 20-step losses and the step-1
// grad norm match one process, and a checkpoint it saves under TP resumes at one process with the plain optimizer.
TEST_F(Mpi, DistributedOptimizerUnderTensorParallelismMatchesOneProcess) {
  struct Case {
    model::ModelConfig mc;
    Layout l;
  };
  std::vector<Case> cases = {{gpt2_like(), {2, true}},
                             {moe_model(false), {2, true, P == 4 ? 2 : 1}},
                             {llama_like(), {1, false, 1, 2}}};  // shards over DP x CP
  for (const Case& c : cases) {
    SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : ""));
    const Result ref = run(world, c.mc, Layout{0, false}, 20);
    const Result got = run(world, c.mc, c.l, 20, "", "", 0, /*zero=*/true);
    ASSERT_EQ(got.loss.size(), 20u);
    EXPECT_LE(rel(got.grad_norm[0], ref.grad_norm[0]), 1e-6) << got.grad_norm[0] << " vs " << ref.grad_norm[0];
    for (size_t i = 0; i < 20; ++i) EXPECT_LE(rel(got.loss[i], ref.loss[i]), 1e-5) << "step " << i + 1;
  }
}

// --log-params-norm and --log-num-zeros-in-grad count every parameter once over the groups (Megatron's
// calc_params_l2_norm and count_zeros_fp32): under TP (untied), TP + SP (tied embeddings, vocabulary-parallel; the
// norms replicated over TP) and the MoE model with linear biases and its experts over ETP 2 x EP (folding; the fc2 bias
// whole on both ETP ranks), with the replicated and with the distributed optimizer (its shards over DP, the TP shards
// and the experts apart; with --overlap-param-gather the norm comes from the shards while the gathers are in flight),
// the values of every step equal the single-process run's: the norm to 1e-6, the zeros -- the gradient rows of the
// tokens the data never uses, experts without tokens -- exactly. The distributed runs time every phase (level 2).
TEST_F(Mpi, ParamsNormAndNumZerosMatchOneProcess) {
  const TrainTweak flags = [](train::TrainConfig& t) {
    t.log_interval = 1;
    t.log_params_norm = true;
    t.log_num_zeros_in_grad = true;
  };
  const TrainTweak timed = [&](train::TrainConfig& t) {
    flags(t);
    t.timing_log_level = 2;
  };
  model::ModelConfig biased = moe_model(false);  // the experts' fc2 bias whole on both ETP ranks: counted once
  biased.moe.shared_expert_intermediate_size = 0;
  biased.moe.shared_expert_gate = false;
  biased.add_bias_linear = true;
  struct Case {
    model::ModelConfig mc;
    Layout l;
  };
  const Case cases[] = {{gpt2_like(), {2, false}}, {llama_like(), {P, true}}, {biased, {2, true, P / 2, 1, 2}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : ""));
    const Result ref = run(world, c.mc, Layout{0, false}, 3, "", "", 0, false, false, false, flags);
    ASSERT_EQ(ref.num_zeros.size(), 3u);
    if (c.mc.untie_embeddings_and_output_weights) {
      EXPECT_GE(ref.num_zeros[0], 3 * 32);  // tokens 61..63's embedding rows
    }
    for (const bool zero : {false, true}) {
      const Result got = run(world, c.mc, c.l, 3, "", "", 0, zero, zero, zero, zero ? timed : flags);
      ASSERT_EQ(got.num_zeros.size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_LE(rel(got.params_norm[i], ref.params_norm[i]), 1e-6) << "step " << i + 1 << (zero ? ", ZeRO" : "");
        EXPECT_EQ(got.num_zeros[i], ref.num_zeros[i]) << "step " << i + 1 << (zero ? ", ZeRO" : "");
      }
    }
  }
}

// --overlap-grad-reduce: each bucket's nonblocking all-reduce starts during the last backward as soon as its
// gradients are final (buckets of 3000 elements, linear_fc1 wider than one: reduced alone); losses, every gradient and
// every parameter bitwise equal to the run that reduces after backward. DP = P, TP 2 (x DP), MoE with EP 2 (expert
// gradients over EDP), CP 2. With the distributed optimizer (zero) the same for its bucketed reduce-scatters, and with
// --overlap-param-gather for its all-gathers left in flight until forward (and validation) reads each bucket; bf16
// compute checks that every compute copy is refreshed from the late masters.
TEST_F(Mpi, OverlappedGradientReductionIsBitwiseEqual) {
  struct Case {
    model::ModelConfig mc;
    Layout l;
    bool zero = false;
  };
  model::ModelConfig bf16 = llama_like();
  bf16.compute_dtype = DType::bf16;
  for (const Case& c :
       {Case{llama_like(), {1, false}}, Case{gpt2_like(), {2, true}}, Case{moe_model(false), {2, true, 2}},
        Case{gpt2_like(), {1, false, 1, 2}}, Case{gpt2_like(), {1, false}, true},
        Case{moe_model(false), {2, true, 2}, true}, Case{bf16, {1, false}, true}}) {
    SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : "") + (c.zero ? ", distributed optimizer" : ""));
    const Result plain = run(world, c.mc, c.l, 6, "", "", 0, c.zero);
    std::vector<Result> overlapped = {run(world, c.mc, c.l, 6, "", "", 0, c.zero, /*overlap=*/true)};
    if (c.zero) overlapped.push_back(run(world, c.mc, c.l, 6, "", "", 0, true, true, /*gather=*/true));
    for (const Result& o : overlapped) {
      ASSERT_EQ(o.loss.size(), plain.loss.size());
      for (size_t i = 0; i < plain.loss.size(); ++i)
        EXPECT_EQ(std::memcmp(&o.loss[i], &plain.loss[i], sizeof(double)), 0) << "step " << i + 1;
      EXPECT_EQ(std::memcmp(&o.valid, &plain.valid, sizeof(double)), 0) << "validation loss";
      for (auto m : {&Result::grads, &Result::values})
        for (const auto& [name, t] : plain.*m) {
          const Tensor& v = (o.*m).at(name);
          ASSERT_EQ(v.nbytes(), t.nbytes()) << name;
          EXPECT_EQ(std::memcmp(v.raw(), t.raw(), static_cast<size_t>(t.nbytes())), 0) << name;
        }
    }
  }
}

// Context parallelism: every sequence split over the CP ranks in Megatron's load-balanced order (two chunks each),
// attention over the all-gathered keys and values, dK/dV reduce-scattered back; RoPE and learned positions at each
// row's global position; the loss and its token count over the CP group, gradients summed over DP x CP. CP = P and
// CP 2 (x DP 2 at 4 ranks); TP 2 x CP 2 at 4 ranks, with and without SP; the MoE model (router losses over TP x CP,
// experts folded over EP x EDP), MLA and multi-token prediction.
TEST_F(Mpi, ContextParallelMatchesOneProcess) {
  check_layout(world, llama_like(), {1, false, 1, P});
  check_layout(world, gpt2_like(), {1, false, 1, 2});
  check_layout(world, moe_model(false), {1, false, 1, 2});
  // global_aux_loss matches one process at DP 1 only: CP = P, with the experts over EP 2.
  check_layout(world, moe_model(true), {1, false, 2, P});
  check_layout(world, mla_model(false), {1, false, 1, P});
  // Multi-token prediction: each depth's rolled ids and labels are rolled over the whole batch, then split.
  model::ModelConfig v3 = mla_model(false);
  v3.mtp_num_layers = 1;
  check_layout(world, v3, {1, false, 1, 2});
  model::ModelConfig dense_mtp = llama_like();
  dense_mtp.mtp_num_layers = 2;
  check_layout(world, dense_mtp, {1, false, 1, P});
  if (P == 4) {
    check_layout(world, llama_like(), {2, true, 1, 2});
    check_layout(world, gpt2_like(), {2, false, 1, 2});
    check_layout(world, moe_model(false), {2, true, 2, 2});  // attention TP 2 x CP 2, experts EP 2 x EDP 2
    check_layout(world, mla_model(false), {2, true, 1, 2});
  }
}

// Eight ranks: TP 2 x EP 2 x DP 2 in Megatron's sense -- attention TP 2 x DP 4, experts EP 2 x EDP 4
// -- with the distributed optimizer, and with the overlapped reduction and gather; TP 2 x CP 2 x DP 2 with the experts
// over EP 2; a dense model under TP 2 x CP 2 x DP 2 with the distributed optimizer; MLA with the experts over ETP 2 x
// EP 2 x EDP 2; the MoE model with two distributed-optimizer instances.
TEST_F(Mpi, EightRanksMatchOneProcess) {
  check_layout(world, moe_model(false), {2, true, 2});
  check_layout(world, moe_model(false), {2, true, 2}, /*zero=*/true);
  const Result plain = run(world, moe_model(false), {2, true, 2}, 6, "", "", 0, true);
  const Result overlapped = run(world, moe_model(false), {2, true, 2}, 6, "", "", 0, true, true, true);
  for (size_t i = 0; i < plain.loss.size(); ++i)
    EXPECT_EQ(std::memcmp(&overlapped.loss[i], &plain.loss[i], sizeof(double)), 0) << "step " << i + 1;
  check_layout(world, moe_model(false), {2, true, 2, 2});
  check_layout(world, gpt2_like(), {2, false, 1, 2}, /*zero=*/true);
  // MLA + QK-norm with the experts split over ETP 2 (Megatron's default: ETP = TP) x EP 2 x EDP 2, distributed
  // optimizer.
  check_layout(world, mla_model(false), {2, true, 2, 1, 2}, /*zero=*/true);
  // Two distributed-optimizer instances under TP 2 x DP 4 (EP 2 x EDP 4): the grad norm over one instance and TP.
  Layout instances{2, true, 2};
  instances.instances = 2;
  check_layout(world, moe_model(false), instances, /*zero=*/true);
}

// FP8 delayed scaling (Megatron's default recipe) under DP x EP and TP + SP (x DP x EP): the amaxes are MAX-reduced
// over TP x DP x CP after every pass, so every rank ends with the same quantizer state, an expert slot by its local
// index as Megatron reduces it (without the reduction the DP ranks, which see other micro-batches, would differ);
// the runs track one process within FP8's band (the scales follow other micro-batches' amaxes, so not closer).
TEST_F(Mpi, Fp8DelayedScalingStateIsTheSameOnEveryRank) {
  if (P > 4) GTEST_SKIP() << "covered at 2 and 4 ranks (TP 2 x DP 2 x EP 2)";
  model::ModelConfig c = moe_model(false);
  c.compute_dtype = DType::bf16;
  c.fp8.on = true;
  c.fp8.format = nn::Fp8Format::hybrid;
  c.fp8.recipe = nn::Fp8Recipe::delayed;
  c.fp8.amax_history_len = 2;
  // (no validation: an evaluation's amaxes wait in row 0 for the next update, each rank's its own)
  const TrainTweak no_eval = [](train::TrainConfig& t) { t.has_validation = false; };
  const Result ref = run(world, c, Layout{0, false}, 4, "", "", 0, false, false, false, no_eval);
  for (const Layout& l : {Layout{1, false, 2}, Layout{2, true, P >= 4 ? 2 : 1}}) {
    SCOPED_TRACE(l.name());
    const Result got = run(world, c, l, 4, "", "", 0, false, false, false, no_eval);
    ASSERT_FALSE(got.fp8_state.empty());
    std::vector<float> all(got.fp8_state.size() * static_cast<size_t>(P));
    all_gather(std::span<float>(all), std::span<const float>(got.fp8_state), world);
    for (int r = 1; r < P; ++r)
      EXPECT_EQ(std::memcmp(all.data() + r * got.fp8_state.size(), all.data(), got.fp8_state.size() * sizeof(float)), 0)
          << "rank " << r << "'s FP8 state differs from rank 0's";
    ASSERT_EQ(got.loss.size(), ref.loss.size());
    for (size_t i = 0; i < got.loss.size(); ++i)
      EXPECT_LE(std::fabs(got.loss[i] - ref.loss[i]), 0.05) << "step " << i + 1;
  }
}

// Generation's forward under CP (and TP 2 x CP 2): every position's logits, gathered over the group, equal one
// process's.
TEST_F(Mpi, ContextParallelLogitsMatchOneProcess) {
  std::vector<Layout> layouts = {{1, false, 1, P}};
  if (P == 4) layouts.push_back({2, true, 1, 2});
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.name());
    const model::ModelConfig mc = llama_like();
    Tensor tokens = Tensor::empty({2, mc.seq_length}, DType::i32, MemCategory::other);
    for (int64_t i = 0; i < tokens.numel(); ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + 3) % 64);
    model::GptModel one(mc, 2, 42, {}, testing::test_device());
    const Built b = build(world, l);
    model::GptModel split(mc, 2, 42, b.par, testing::test_device());
    Tensor want =
        Tensor::empty({tokens.numel(), mc.vocab_size}, DType::f32, MemCategory::other, testing::test_device());
    Tensor got = Tensor::empty({tokens.numel(), mc.vocab_size}, DType::f32, MemCategory::other, testing::test_device());
    one.forward_logits(want, tokens);
    split.forward_logits(got, tokens);
    const Tensor w = testing::host(want), g = testing::host(got);
    for (int64_t i = 0; i < w.numel(); ++i)
      ASSERT_NEAR(g.data<float>()[i], w.data<float>()[i], 1e-5 * std::fabs(w.data<float>()[i]) + 1e-6) << i;
  }
}

// Saved at step 4 of 8 with the distributed optimizer (its parameter all-gathers overlapped: the save completes
// them) under TP 2 + SP (x DP at 4 ranks), and for the MoE model under TP 2 + SP with EP 2: one process loads the
// whole parameters bitwise, and one process, TP = P (dense) and CP 2 (plain AdamW) resume with the uninterrupted
// run's losses.
TEST_F(Mpi, CheckpointSavedUnderTensorParallelismLoadsAtAnyLayout) {
  struct Case {
    model::ModelConfig mc;
    Layout saved_at;
    std::vector<Layout> resume_at;
  };
  for (const Case& c :
       {Case{gpt2_like(), {2, true}, {{0, false}, {P == 4 ? 1 : 2, false}, {1, false, 1, 2}}},
        Case{moe_model(false), {2, true, 2}, {{0, false}, {1, false, 1, 2}, {2, true, P / 2, 1, 2}}},
        Case{moe_model(false), {2, true, P / 2, 1, 2}, {{0, false}, {1, false, 1, 2}, {2, true, P == 4 ? 2 : 1}}}}) {
    SCOPED_TRACE(c.saved_at.name() + (c.mc.moe.enabled() ? ", MoE" : ""));
    const std::string dir = shared_dir(world, "moecore_mpi_tp_", "reshard");
    const Result straight = run(world, c.mc, c.saved_at, 8);
    const Result saved = run(world, c.mc, c.saved_at, 8, dir, "", 4, /*zero=*/true, true, true);
    model::GptModel hub(c.mc, 2, 42, {}, testing::test_device());
    optim::AdamW hub_opt(hub.params(), {});
    train::load_training_checkpoint(dir + "/iter_0000004", hub, hub_opt, 1234);
    for (const auto& p : hub.params()) {
      const Tensor v = testing::host(p.value);
      const Tensor& s = saved.values.at(p.name);
      ASSERT_EQ(v.nbytes(), s.nbytes()) << p.name;
      EXPECT_EQ(std::memcmp(v.raw(), s.raw(), static_cast<size_t>(v.nbytes())), 0) << p.name;
    }
    for (const Layout& l : c.resume_at) {
      const Result resumed = run(world, c.mc, l, 8, "", dir);
      ASSERT_EQ(resumed.loss.size(), 4u) << l.name();
      for (size_t i = 0; i < 4; ++i)
        EXPECT_LE(rel(resumed.loss[i], straight.loss[4 + i]), 1e-5) << l.name() << " step " << 5 + i;
    }
    barrier(world);
    if (world.rank() == 0) std::filesystem::remove_all(dir);
  }
}

// The partial distributed optimizer (--num-distributed-optimizer-instances N) at DP 4: N = 2 (the state sharded over 2
// ranks, the shards all-reduced over the 2 instances), N = 4 (a whole copy on every rank: all-reduce semantics) and,
// by the tests above, N = 1; dense, and MoE with the experts over EP 2 (EDP 2, N 2) and EP 1 (EDP 4, N 4). As
// check_layout: step-1 loss and grad norm 1e-6, 20-step losses and validation 1e-5, bitwise repeatable; and every
// parameter after the 20 steps within kParamLimit of AdamW's movement over them. With --overlap-grad-reduce and
// --overlap-param-gather bitwise the plain N = 2 run. A checkpoint saved at N = 2 resumes at N = 1, N = 4 and at one
// process with the uninterrupted run's losses.
TEST_F(Mpi, PartialDistributedOptimizerMatchesOneProcess) {
  constexpr double kParamLimit = 1e-4;  // of AdamW's movement over the run (steps x lr)
  if (P != 4) GTEST_SKIP() << "needs 4 ranks (DP 4)";
  auto with = [](Layout l, int n) {
    l.instances = n;
    return l;
  };
  const Layout dp{1, false}, ep2{1, false, 2};
  struct Case {
    model::ModelConfig mc;
    Layout l;
  };
  for (const Case& c : {Case{llama_like(), with(dp, 2)}, Case{llama_like(), with(dp, 4)},
                        Case{moe_model(false), with(ep2, 2)}, Case{moe_model(false), with(dp, 4)}}) {
    check_layout(world, c.mc, c.l, /*zero=*/true);
    SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : ""));
    const Result ref = run(world, c.mc, Layout{0, false}, 20);
    const Result got = run(world, c.mc, c.l, 20, "", "", 0, /*zero=*/true);
    // AdamW moves a weight by about lr a step, so a rounding difference in a gradient can move it by up to that; the
    // plain distributed optimizer (N 1) differs from one process as much (about 3e-5 of the movement under EP 2).
    const double movement = 20 * double(train_config(20).lr);
    for (const auto& [name, t] : ref.values) {
      const Tensor& v = got.values.at(name);
      for (int64_t i = 0; i < t.numel(); ++i)
        ASSERT_NEAR(v.data<float>()[i], t.data<float>()[i], kParamLimit * movement) << name << " element " << i;
    }
  }
  for (const Case& c : {Case{llama_like(), with(dp, 2)}, Case{moe_model(false), with(ep2, 2)}}) {
    SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : "") + ", overlapped");
    const Result plain = run(world, c.mc, c.l, 6, "", "", 0, true);
    const Result overlapped = run(world, c.mc, c.l, 6, "", "", 0, true, /*overlap=*/true, /*gather=*/true);
    for (size_t i = 0; i < plain.loss.size(); ++i)
      EXPECT_EQ(std::memcmp(&overlapped.loss[i], &plain.loss[i], sizeof(double)), 0) << "step " << i + 1;
    for (const auto& [name, t] : plain.values)
      EXPECT_EQ(std::memcmp(overlapped.values.at(name).raw(), t.raw(), static_cast<size_t>(t.nbytes())), 0) << name;
  }
  const std::string dir = shared_dir(world, "moecore_mpi_tp_", "instances");
  const Result straight = run(world, moe_model(false), with(ep2, 2), 8, "", "", 0, true);
  run(world, moe_model(false), with(ep2, 2), 8, dir, "", 4, /*zero=*/true);
  for (const Layout& l : {ep2, Layout{0, false}, with(dp, 4)}) {
    const Result resumed = run(world, moe_model(false), l, 8, "", dir, 0, /*zero=*/l.tp > 0);
    ASSERT_EQ(resumed.loss.size(), 4u) << l.name();
    for (size_t i = 0; i < 4; ++i)
      EXPECT_LE(rel(resumed.loss[i], straight.loss[4 + i]), 1e-5) << l.name() << " step " << 5 + i;
  }
  barrier(world);
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

// Megatron's checks of --num-distributed-optimizer-instances, quoted, on every rank before any collective: N must
// divide the data-parallel size (and the expert one), needs the distributed optimizer, and the groups must be built
// for the same N.
// Megatron-FSDP (--use-megatron-fsdp): every sharding strategy trains as plain data parallelism at the same layout --
// DP alone (dense), the MoE model with its experts over EP 2 (sharded over EDP), TP 2 (each TP rank's FSDP over its
// slice), the MoE model under TP 2 + SP, CP 2 (the shards over DP x CP), MTP with full recompute, and at 4 ranks hybrid
// sharding (--num-distributed-optimizer-instances 2: dense and MoE with EP 2), also as HFSDP (the state sharded over
// the instances too; its checkpoint resumed at one process) -- with 20-step losses within 1e-5 and every parameter
// close at the end (bf16 main gradients and communication: within 1e-2, and not the f32 run's bits); no_shard and optim
// are the all-reduce and the distributed optimizer themselves. With one micro-batch per rank and no clipping,
// optim_grads and optim_grads_params are bitwise the distributed optimizer (each micro-batch's reduction is then the
// step's). A checkpoint saved under optim_grads_params resumes at one process, and under optim_grads at another layout,
// with the uninterrupted run's losses.
TEST_F(Mpi, MegatronFsdpMatchesDataParallel) {
  using S = train::FsdpStrategy;
  const auto fsdp = [](S s, int64_t global_batch = 8) {
    return TrainTweak([=](train::TrainConfig& t) {
      t.fsdp = s;
      t.use_distributed_optimizer = s != S::off || t.use_distributed_optimizer;
      t.global_batch_size = global_batch;
    });
  };
  struct Case {
    model::ModelConfig mc;
    Layout l;
  };
  model::ModelConfig mtp = llama_like();  // two MTP depths (units of their own) and full recompute (gathers again)
  mtp.mtp_num_layers = 2;
  mtp.recompute.granularity = "full";
  mtp.recompute.method = "uniform";
  mtp.recompute.num_layers = 2;
  std::vector<Case> cases = {{llama_like(), {1}},
                             {moe_model(false), {1, false, 2}},
                             {gpt2_like(), {2, false}},
                             {moe_model(false), {2, true}},     // TP 2 + SP (the experts over ETP 2)
                             {llama_like(), {1, false, 1, 2}},  // CP 2: the shards over DP x CP
                             {mtp, {1}}};
  if (P == 4) {  // hybrid sharding: two instances of DP 2, the shards' sums all-reduced across them
    Layout hybrid{1};
    hybrid.instances = 2;
    cases.push_back({llama_like(), hybrid});
    hybrid.ep = 2;
    cases.push_back({moe_model(false), hybrid});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : "") + (c.mc.mtp_num_layers ? ", MTP, recompute" : ""));
    Layout replicated = c.l;  // (the reference: plain DP, one instance)
    replicated.instances = 1;
    const Result plain = run(world, c.mc, replicated, 20);
    for (S s : {S::no_shard, S::optim, S::optim_grads, S::optim_grads_params}) {
      SCOPED_TRACE("strategy " + std::to_string(static_cast<int>(s)));
      const Result got = run(world, c.mc, c.l, 20, "", "", 0, false, false, false, fsdp(s));
      ASSERT_EQ(got.loss.size(), 20u);
      EXPECT_LE(rel(got.grad_norm[0], plain.grad_norm[0]), 1e-6) << got.grad_norm[0] << " vs " << plain.grad_norm[0];
      for (size_t i = 0; i < 20; ++i)
        EXPECT_LE(rel(got.loss[i], plain.loss[i]), 1e-5)
            << "step " << i + 1 << ": " << got.loss[i] << " vs " << plain.loss[i];
      // Every parameter after 20 steps, within 5e-3 relative and 1e-5 of the tensor's largest value: the reduction's
      // order (and, clipping, the norm's) changes the rounding, which Adam's normalisation amplifies in the elements
      // whose gradients are near zero. (The key-norm bias's gradient vanishes in exact arithmetic -- softmax ignores a
      // shift shared by every key -- so Adam steps it by rounding noise alone: left out.)
      ASSERT_EQ(got.values.size(), plain.values.size());
      std::map<std::string, Tensor> values = got.values;
      std::erase_if(values, [](const auto& v) { return v.first.ends_with("k_layernorm.bias"); });
      expect_close(values, plain.values, 5e-3, 1e-5);
    }
  }
  {  // one micro-batch per rank, no clipping: bitwise the distributed optimizer
    optim::AdamWConfig no_clip;
    no_clip.clip_grad = 0;
    const Result zero =
        run(world, llama_like(), Layout{1}, 6, "", "", 0, true, false, false, fsdp(S::off, 2 * P), no_clip);
    for (S s : {S::optim_grads, S::optim_grads_params}) {
      const Result got =
          run(world, llama_like(), Layout{1}, 6, "", "", 0, false, false, false, fsdp(s, 2 * P), no_clip);
      ASSERT_EQ(got.loss.size(), 6u);
      for (size_t i = 0; i < 6; ++i)
        EXPECT_EQ(std::memcmp(&got.loss[i], &zero.loss[i], sizeof(double)), 0) << "step " << i + 1;
      for (const auto& [name, v] : zero.values)
        EXPECT_EQ(std::memcmp(v.raw(), got.values.at(name).raw(), static_cast<size_t>(v.nbytes())), 0) << name;
    }
  }
  {  // optim_grads with --overlap-param-gather: the updated parameters gathered while the next forward runs, bitwise
    const Result now =
        run(world, moe_model(false), Layout{1, false, 2}, 6, "", "", 0, false, false, false, fsdp(S::optim_grads));
    const Result later =
        run(world, moe_model(false), Layout{1, false, 2}, 6, "", "", 0, false, true, true, fsdp(S::optim_grads));
    for (size_t i = 0; i < 6; ++i)
      EXPECT_EQ(std::memcmp(&later.loss[i], &now.loss[i], sizeof(double)), 0) << "step " << i + 1;
    for (const auto& [name, v] : now.values)
      EXPECT_EQ(std::memcmp(v.raw(), later.values.at(name).raw(), static_cast<size_t>(v.nbytes())), 0) << name;
  }
  {  // bf16 main gradients and communication (Megatron's auto under --bf16): the run tracks the f32 one, not bitwise
    const Result f32 =
        run(world, llama_like(), Layout{1}, 20, "", "", 0, false, false, false, fsdp(S::optim_grads_params));
    const Result bf16 =
        run(world, llama_like(), Layout{1}, 20, "", "", 0, false, false, false, TrainTweak([&](train::TrainConfig& t) {
              fsdp(S::optim_grads_params)(t);
              t.fsdp_main_grads_dtype = t.fsdp_grad_comm_dtype = DType::bf16;
            }));
    ASSERT_EQ(bf16.loss.size(), 20u);
    for (size_t i = 0; i < 20; ++i) EXPECT_LE(rel(bf16.loss[i], f32.loss[i]), 1e-2) << "step " << i + 1;
    EXPECT_NE(bf16.grad_norm[0], f32.grad_norm[0]);
  }
  {  // bf16 main parameters (--megatron-fsdp-main-params-dtype bf16, auto under --bf16): every value stays a bf16
     // number -- the masters' updates rounded, the gathers exact -- and the run tracks the f32 one; optim_grads (the
     // masters in the shards, the values whole) and optim_grads_params run the same arithmetic, bitwise.
    const auto bf16_masters = [&](S s) {
      return TrainTweak([=](train::TrainConfig& t) {
        fsdp(s)(t);
        t.fsdp_main_params_dtype = DType::bf16;
      });
    };
    const Layout moe{1, false, 2};
    const Result f32 = run(world, moe_model(false), moe, 20, "", "", 0, false, false, false, fsdp(S::optim_grads));
    const Result grads =
        run(world, moe_model(false), moe, 20, "", "", 0, false, false, false, bf16_masters(S::optim_grads));
    const Result params =
        run(world, moe_model(false), moe, 20, "", "", 0, false, false, false, bf16_masters(S::optim_grads_params));
    ASSERT_EQ(params.loss.size(), 20u);
    for (size_t i = 0; i < 20; ++i) {
      EXPECT_LE(rel(params.loss[i], f32.loss[i]), 1e-2) << "step " << i + 1;
      EXPECT_EQ(std::memcmp(&params.loss[i], &grads.loss[i], sizeof(double)), 0) << "step " << i + 1;
    }
    EXPECT_NE(params.loss.back(), f32.loss.back());
    for (const auto& [name, v] : params.values) {
      EXPECT_EQ(std::memcmp(v.raw(), grads.values.at(name).raw(), static_cast<size_t>(v.nbytes())), 0) << name;
      const Tensor rounded = v.to(DType::bf16).to(DType::f32);
      EXPECT_EQ(std::memcmp(v.raw(), rounded.raw(), static_cast<size_t>(v.nbytes())), 0) << name << ": not bf16";
    }
  }
  if (P ==
      4) {  // HFSDP (--outer-dp-sharding-strategy optim): the state and its update sharded over the 2 instances too
    const auto hfsdp = TrainTweak([&](train::TrainConfig& t) {
      fsdp(S::optim_grads_params)(t);
      t.fsdp_outer = S::optim;
    });
    Layout hybrid{1};
    hybrid.instances = 2;
    Layout experts = hybrid;
    experts.ep = 2;
    for (const Case& c : {Case{llama_like(), hybrid}, Case{moe_model(false), experts}}) {
      SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : "") + ", HFSDP");
      Layout replicated = c.l;
      replicated.instances = 1;
      const Result plain = run(world, c.mc, replicated, 20);
      const Result got = run(world, c.mc, c.l, 20, "", "", 0, false, false, false, hfsdp);
      ASSERT_EQ(got.loss.size(), 20u);
      EXPECT_LE(rel(got.grad_norm[0], plain.grad_norm[0]), 1e-6) << got.grad_norm[0] << " vs " << plain.grad_norm[0];
      for (size_t i = 0; i < 20; ++i) EXPECT_LE(rel(got.loss[i], plain.loss[i]), 1e-5) << "step " << i + 1;
      std::map<std::string, Tensor> values = got.values;
      std::erase_if(values, [](const auto& v) { return v.first.ends_with("k_layernorm.bias"); });
      expect_close(values, plain.values, 5e-3, 1e-5);
    }
    // Saved under HFSDP (the moments gathered from the instances' pieces), resumed at one process.
    const std::string dir = shared_dir(world, "moecore_mpi_tp_", "hfsdp");
    const Result straight = run(world, moe_model(false), Layout{0, false}, 8);
    run(world, moe_model(false), experts, 8, dir, "", 4, false, false, false, hfsdp);
    const Result resumed = run(world, moe_model(false), Layout{0, false}, 8, "", dir);
    ASSERT_EQ(resumed.loss.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_LE(rel(resumed.loss[i], straight.loss[4 + i]), 1e-4) << "step " << 5 + i;
    barrier(world);
    if (world.rank() == 0) std::filesystem::remove_all(dir);
    barrier(world);
  }
  const std::string dir = shared_dir(world, "moecore_mpi_tp_", "fsdp");
  const Result straight = run(world, moe_model(false), Layout{0, false}, 8);
  for (S s : {S::optim_grads_params, S::optim_grads}) {
    run(world, moe_model(false), Layout{1, false, 2}, 8, dir, "", 4, false, false, false, fsdp(s));
    const Layout at = s == S::optim_grads_params ? Layout{0, false} : Layout{1};
    const Result resumed = run(world, moe_model(false), at, 8, "", dir, 0, false, false, false,
                               at.tp == 0 ? TrainTweak() : fsdp(S::optim_grads_params));
    ASSERT_EQ(resumed.loss.size(), 4u) << at.name();
    for (size_t i = 0; i < 4; ++i)
      EXPECT_LE(rel(resumed.loss[i], straight.loss[4 + i]), 1e-4) << at.name() << " step " << 5 + i;
    barrier(world);
    if (world.rank() == 0) std::filesystem::remove_all(dir);
    barrier(world);
  }
}

// Megatron-FSDP's memory plan (train::fsdp_memory_plan) is what a rank allocates while it trains: the peak parameter,
// gradient and optimizer-state bytes of steps 2 and 3 equal the plan's, for optim_grads (also with
// --overlap-param-gather, and with bf16 main parameters) and optim_grads_params (f32 and bf16 main gradients, bf16 main
// parameters), dense
// at DP P and MoE with the experts over EP 2. (Which strategy holds least depends on the model's shape: test_fsdp_plan
// shows the ordering on a full-size one; these two-layer models gather half their layers at once.)
TEST_F(Mpi, MegatronFsdpMemoryPlanEqualsAllocation) {
  struct Case {
    model::ModelConfig mc;
    Layout l;
  };
  std::vector<Case> cases = {{llama_like(), {1}}, {moe_model(false), {1, false, 2}}};
  if (P == 4) {  // and HFSDP over 2 instances (optim_grads_params runs only: the moments a half of the shards)
    Layout hybrid{1, false, 2};
    hybrid.instances = 2;
    cases.push_back({moe_model(false), hybrid});
  }
  for (const Case& c : cases) {
    using S = train::FsdpStrategy;
    const bool hfsdp = c.l.instances > 1;
    struct Run {
      S s;
      DType t;
      bool gather_later;
      DType masters = DType::f32;
    };
    for (const Run& x : {Run{S::optim_grads, DType::f32, false}, Run{S::optim_grads, DType::f32, true},
                         Run{S::optim_grads, DType::f32, false, DType::bf16},
                         Run{S::optim_grads_params, DType::f32, false}, Run{S::optim_grads_params, DType::bf16, false},
                         Run{S::optim_grads_params, DType::bf16, false, DType::bf16}}) {
      const auto [s, t, gather_later, masters] = x;
      if (hfsdp && s != S::optim_grads_params) continue;
      SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : "") + ", strategy " + enum_name(s) + ", gradients " +
                   std::string(dtype_name(t)) + ", main parameters " + std::string(dtype_name(masters)) +
                   (gather_later ? ", --overlap-param-gather" : ""));
      const Built b = build(world, c.l, c.mc.moe.num_experts);
      train::TrainConfig tc = train_config(3);
      tc.has_validation = false;
      tc.use_distributed_optimizer = true;
      tc.fsdp = s;
      tc.fsdp_main_grads_dtype = tc.fsdp_grad_comm_dtype = t;
      tc.fsdp_main_params_dtype = masters;
      tc.num_distributed_optimizer_instances = c.l.instances;
      if (hfsdp) tc.fsdp_outer = S::optim;
      tc.overlap_grad_reduce = tc.overlap_param_gather = gather_later;
      model::GptModel gpt(c.mc, 2, 42, train::fsdp_model_parallel(b.par, tc), testing::test_device());
      optim::AdamW opt(gpt.params(), {}, /*allocate_state=*/false);
      const model::MemoryPlan plan =
          train::fsdp_memory_plan(gpt, gpt.memory_plan(train::optimizer_state_bytes(tc, {})), tc, {},
                                  (hfsdp ? b.groups.intra_dp_cp : b.groups.dense_grads()).size(),
                                  (hfsdp ? b.groups.intra_edp : b.groups.edp).size(), b.groups.etp.size());
      MemoryStats seen;
      const auto observe = [&](int64_t it, double, bool) {
        if (it == 0) memory_reset_peaks();
        if (it == 2) seen = memory_stats();
      };
      train::train(gpt, opt, tc, synthetic_batch, nullptr, observe, &b.groups);
      for (MemCategory m : {MemCategory::parameters, MemCategory::gradients, MemCategory::optimizer_state}) {
        const auto k = static_cast<size_t>(m);
        EXPECT_EQ(seen.peak[k], plan.bytes[k]) << mem_category_name(m);
      }
    }
  }
}

// Megatron-FSDP's units pass their memory on (train::FsdpOptimizer's spare unit memory): once training runs, a step
// takes no more memory from the allocator than the distributed optimizer's step does, although optim_grads takes each
// unit's gradients for every micro-batch's backward and optim_grads_params its values too, twice per micro-batch --
// fresh pages would fault in on every write (docs/performance.md). Dense at DP P and MoE (3 layers, all MoE: alike
// units) with the experts over EP 2, 2 micro-batches per step.
TEST_F(Mpi, MegatronFsdpStepsTakeNoMemoryFromTheAllocator) {
  using S = train::FsdpStrategy;
  struct Case {
    model::ModelConfig mc;
    Layout l;
  };
  model::ModelConfig moe = moe_model(false);
  moe.num_layers = 3;
  moe.moe_layer_freq = "[1,1,1]";
  for (const Case& c : {Case{llama_like(), {1}}, Case{moe, {1, false, 2}}}) {
    std::map<S, int64_t> taken;
    for (S s : {S::off, S::optim_grads, S::optim_grads_params}) {
      SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : "") + ", strategy " + enum_name(s));
      const Built b = build(world, c.l, c.mc.moe.num_experts);
      train::TrainConfig tc = train_config(5);
      tc.has_validation = false;
      tc.use_distributed_optimizer = true;
      tc.global_batch_size = 2 * tc.micro_batch_size * b.groups.dp.size();
      tc.fsdp = s;  // (off: the distributed optimizer)
      model::GptModel gpt(c.mc, 2, 42, train::fsdp_model_parallel(b.par, tc), testing::test_device());
      optim::AdamW opt(gpt.params(), {}, /*allocate_state=*/false);
      int64_t after_two = 0;
      const auto observe = [&](int64_t it, double, bool) {
        if (it == 1) after_two = memory_device_stats(testing::test_device()).taken;
        if (it == 4) taken[s] = memory_device_stats(testing::test_device()).taken - after_two;
      };
      const train::TrainLog log = train::train(gpt, opt, tc, synthetic_batch, nullptr, observe, &b.groups);
      ASSERT_EQ(log.train_loss.size(), 5u);
    }
    EXPECT_EQ(taken[S::optim_grads], taken[S::off]);
    EXPECT_EQ(taken[S::optim_grads_params], taken[S::off]);
    if (world.rank() == 0)
      std::printf(
          "memory taken from the allocator in steps 3-5: distributed optimizer %lld, optim_grads %lld, "
          "optim_grads_params %lld\n",
          static_cast<long long>(taken[S::off]), static_cast<long long>(taken[S::optim_grads]),
          static_cast<long long>(taken[S::optim_grads_params]));
  }
}

// Megatron-FSDP's layers born in their shards (train::fsdp_model_parallel, as `moecore train` builds the model): the
// masters drawn from the initial values are the ones a whole-built model gives, so 6 steps are bitwise the whole-built
// run's (dense, MoE with EP 2, TP 2); and from before the model exists until the optimizer holds its shards a rank's
// parameter and gradient bytes never exceed its training plan (a whole-built 6-layer model holds far more).
TEST_F(Mpi, MegatronFsdpBuildsTheLayersInTheirShards) {
  using S = train::FsdpStrategy;
  const auto fsdp = [](S s) {
    return TrainTweak([=](train::TrainConfig& t) {
      t.fsdp = s;
      t.use_distributed_optimizer = true;
    });
  };
  struct Case {
    model::ModelConfig mc;
    Layout l;
  };
  for (const Case& c : {Case{llama_like(), {1}}, Case{moe_model(false), {1, false, 2}}, Case{gpt2_like(), {2, false}}})
    for (S s : {S::optim_grads, S::optim_grads_params}) {
      SCOPED_TRACE(c.l.name() + (c.mc.moe.enabled() ? ", MoE" : "") + ", strategy " + enum_name(s));
      Layout whole = c.l;
      whole.built_whole = true;
      const Result born = run(world, c.mc, c.l, 6, "", "", 0, false, false, false, fsdp(s));
      const Result built = run(world, c.mc, whole, 6, "", "", 0, false, false, false, fsdp(s));
      ASSERT_EQ(born.loss.size(), 6u);
      for (size_t i = 0; i < 6; ++i)
        EXPECT_EQ(std::memcmp(&born.loss[i], &built.loss[i], sizeof(double)), 0) << "step " << i + 1;
      for (const auto& [name, v] : built.values)
        EXPECT_EQ(std::memcmp(v.raw(), born.values.at(name).raw(), static_cast<size_t>(v.nbytes())), 0) << name;
    }
  model::ModelConfig deep = llama_like();
  deep.num_layers = 6;
  for (bool born : {true, false}) {
    const Built b = build(world, Layout{1});
    train::TrainConfig tc = train_config(1);
    fsdp(S::optim_grads_params)(tc);
    const auto at = [](const MemoryStats& m, MemCategory c) { return m.current[static_cast<size_t>(c)]; };
    const auto peak = [](const MemoryStats& m, MemCategory c) { return m.peak[static_cast<size_t>(c)]; };
    memory_reset_peaks();
    const MemoryStats before = memory_stats();
    model::GptModel gpt(deep, 2, 42, born ? train::fsdp_model_parallel(b.par, tc) : b.par, testing::test_device());
    optim::AdamW opt(gpt.params(), {}, /*allocate_state=*/false);
    const auto o = train::make_optimizer(gpt, opt, tc, b.groups);
    const MemoryStats after = memory_stats();
    const model::MemoryPlan plan =
        train::fsdp_memory_plan(gpt, gpt.memory_plan(train::optimizer_state_bytes(tc, {})), tc, {},
                                b.groups.dense_grads().size(), b.groups.edp.size(), b.groups.etp.size());
    for (MemCategory m : {MemCategory::parameters, MemCategory::gradients}) {
      const int64_t most = peak(after, m) - at(before, m);
      SCOPED_TRACE(std::string(born ? "born in the shards, " : "built whole, ") + mem_category_name(m));
      if (born)
        EXPECT_LE(most, plan.bytes[static_cast<size_t>(m)]);
      else
        EXPECT_GT(most, plan.bytes[static_cast<size_t>(m)]);  // (what the bound above rules out)
    }
  }
}

TEST_F(Mpi, BadDistributedOptimizerInstancesFailNamingTheValues) {
  Layout three{1, false};
  three.instances = P + 1;
  testing::expect_error([&] { build(world, three); },
                        {"Data parallel size should be divisible by partial DistOpt shard factor",
                         "must be divisible by num_distributed_optimizer_instances (" + std::to_string(P + 1) + ")"});
  Layout two{1, false};
  two.instances = 2;
  testing::expect_error([&] { run(world, llama_like(), two, 2); },
                        {"Partial DistOpt cannot be used without DistOpt", "--use-distributed-optimizer"});
  const Built one = build(world, Layout{1, false});
  model::GptModel gpt(llama_like(), 2, 42, one.par, testing::test_device());
  optim::AdamW opt(gpt.params(), {}, /*allocate_state=*/false);
  train::TrainConfig tc = train_config(2);
  tc.use_distributed_optimizer = true;
  tc.num_distributed_optimizer_instances = 2;
  testing::expect_error([&] { train::train(gpt, opt, tc, synthetic_batch, nullptr, {}, &one.groups); },
                        {"--num-distributed-optimizer-instances is 2 but the process groups were built for 1"});
  model::GptModel alone(llama_like(), 2, 42, {}, testing::test_device());
  optim::AdamW alone_opt(alone.params(), {}, /*allocate_state=*/false);
  testing::expect_error([&] { train::train(alone, alone_opt, tc, synthetic_batch, nullptr); },
                        {"Data parallel size should be divisible by partial DistOpt shard factor",
                         "(1) must be divisible by --num-distributed-optimizer-instances (2)"});
}

// Every size constraint fails at construction on every rank (no collective), naming the values.
TEST_F(Mpi, BadTensorAndContextParallelLayoutsFailNamingTheValues) {
  const Built b = build(world, {P, true});
  auto make = [&](const model::ModelConfig& mc) { model::GptModel m(mc, 2, 42, b.par, testing::test_device()); };
  model::ModelConfig c = llama_like();
  c.num_attention_heads = 6;
  c.num_query_groups = 6;
  c.kv_channels = 8;
  if (6 % P != 0) testing::expect_error([&] { make(c); }, {"--num-attention-heads (6)", "divisible"});
  c = llama_like();
  c.vocab_size = 66;
  if (66 % P != 0 || P == 4) testing::expect_error([&] { make(c); }, {"vocabulary size (66)"});
  c = llama_like();
  c.seq_length = 18;
  if (P == 4) testing::expect_error([&] { make(c); }, {"--seq-length (18)"});
  c = llama_like();
  c.num_query_groups = 1;
  testing::expect_error([&] { make(c); }, {"query groups", "(1)"});
  const Built cp = build(world, {1, false, 1, P});
  c = llama_like();
  c.seq_length = 18;
  testing::expect_error([&] { model::GptModel m(c, 2, 42, cp.par, testing::test_device()); },
                        {"--seq-length (18)", "2 x --context-parallel-size (" + std::to_string(2 * P) + ")"});
  // Expert tensor parallelism splits the expert ffn.
  const Built etp = build(world, {1, false, 1, 1, P}, 8);
  c = moe_model(false);
  c.moe.ffn_hidden_size = 25;
  testing::expect_error([&] { model::GptModel m(c, 2, 42, etp.par, testing::test_device()); },
                        {"expert ffn size", "25)", "--expert-tensor-parallel-size (" + std::to_string(P) + ")"});
  const Built no_sp = build(world, {P, false});
  testing::expect_error(
      [&] { model::GptModel m(testing::small_moe_model(4), 2, 42, no_sp.par, testing::test_device()); },
      {"MoE layers", "need --sequence-parallel"});
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing_mpi::run_mpi_tests(argc, argv, 120.0);
}
