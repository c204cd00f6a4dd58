// Muon (Megatron's --optimizer muon, on emerging_optimizers v0.3.0; docs/muon-spec.md): the weight matrices are
// updated by the orthogonalised momentum, every other parameter by a scalar optimizer (AdamW with the run's Adam
// hyperparameters, or Lion: --muon-scalar-optimizer), as Megatron's chained Muon + Adam optimizer. For a Muon matrix W
// with gradient g (clipped), learning rate lr and decay wd:
//   W <- (1 - lr wd) W;  M <- beta M + (1 - beta) g;  U = nesterov ? (1 - beta) g + beta M : M;
//   W <- W - lr * s(rows, cols) * extra_scale_factor * NS(U)
// with NS the Newton-Schulz orthogonalisation (ops::newton_schulz) and s the --muon-scale-mode's shape scale of the
// whole logical matrix. Each routed expert's fc1 and fc2 is its own matrix (the [E, rows, cols] stack is orthogonalised
// per expert), the fused QKV weight is cut into its Q, K and V rows unless --muon-no-split-qkv, and a tensor-parallel
// shard is orthogonalised as --muon-tp-mode says. Not here: the gradient reduction, the norm and the checkpoints
// (train/optimizer.h), sharding the state over data parallelism.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <variant>
#include "moecore/core/enum_names.h"

#include "moecore/core/param.h"
#include "moecore/kernels/ops.h"
#include "moecore/optim/adamw.h"
#include "moecore/optim/lion.h"
#include "moecore/parallel/comm.h"

namespace moecore::optim {

// --optimizer: the optimizers moecore has (Megatron's others are refused by the flag).
enum class OptimizerKind : uint8_t { adam, muon };
inline constexpr EnumName<OptimizerKind> kOptimizerKindNames[] = {{OptimizerKind::adam, "adam"},
                                                                  {OptimizerKind::muon, "muon"}};
constexpr std::span<const EnumName<OptimizerKind>> enum_names(OptimizerKind) {
  return kOptimizerKindNames;
}

// --muon-scale-mode: s(rows, cols) = sqrt(max(rows, cols)) | sqrt(rows / cols) | sqrt(max(1, rows / cols)).
enum class MuonScaleMode : uint8_t { spectral, unit_rms_norm, shape_scaling };
// --muon-tp-mode (a tensor-parallel shard of a matrix): duplicated gathers the whole matrix on every rank,
// orthogonalises it and keeps this rank's part; distributed orthogonalises the shards together (the norm and every Gram
// summed over the group, the Gram on the unsplit side); blockwise orthogonalises each shard alone and scales it by its
// own shape (so its result depends on the TP size).
enum class MuonTpMode : uint8_t { blockwise, duplicated, distributed };
// --muon-fp32-matmul-prec: the precision PyTorch's f32 matmuls run at while Megatron orthogonalises. medium: the
// iterate and every product in bf16 (emerging_optimizers casts explicitly); high: f32 (TF32 allowed on a GPU; moecore's
// GEMMs stay f32); low: not a PyTorch setting, which PyTorch ignores with a warning, so the default (highest: f32).
enum class MuonMatmulPrecision : uint8_t { low, medium, high };
// --muon-scalar-optimizer: what updates the parameters Muon does not.
enum class ScalarOptimizer : uint8_t { adam, lion };

inline constexpr EnumName<MuonScaleMode> kMuonScaleModeNames[] = {{MuonScaleMode::spectral, "spectral"},
                                                                  {MuonScaleMode::unit_rms_norm, "unit_rms_norm"},
                                                                  {MuonScaleMode::shape_scaling, "shape_scaling"}};
inline constexpr EnumName<MuonTpMode> kMuonTpModeNames[] = {{MuonTpMode::blockwise, "blockwise"},
                                                            {MuonTpMode::duplicated, "duplicated"},
                                                            {MuonTpMode::distributed, "distributed"}};
inline constexpr EnumName<MuonMatmulPrecision> kMuonMatmulPrecisionNames[] = {
    {MuonMatmulPrecision::low, "low"}, {MuonMatmulPrecision::medium, "medium"}, {MuonMatmulPrecision::high, "high"}};
inline constexpr EnumName<ScalarOptimizer> kScalarOptimizerNames[] = {{ScalarOptimizer::adam, "adam"},
                                                                      {ScalarOptimizer::lion, "lion"}};
constexpr std::span<const EnumName<MuonScaleMode>> enum_names(MuonScaleMode) {
  return kMuonScaleModeNames;
}
constexpr std::span<const EnumName<MuonTpMode>> enum_names(MuonTpMode) {
  return kMuonTpModeNames;
}
constexpr std::span<const EnumName<MuonMatmulPrecision>> enum_names(MuonMatmulPrecision) {
  return kMuonMatmulPrecisionNames;
}
constexpr std::span<const EnumName<ScalarOptimizer>> enum_names(ScalarOptimizer) {
  return kScalarOptimizerNames;
}

// Megatron's --muon-* flags and defaults (megatron/training/arguments.py). Learning rate, weight decay and clipping are
// the run's (--lr, --weight-decay, --clip-grad: AdamWConfig).
struct MuonConfig {
  float momentum = 0.9f;                                                // --muon-momentum
  bool nesterov = false;                                                // --muon-nesterov
  bool split_qkv = true;                                                // cleared by --muon-no-split-qkv
  int num_ns_steps = 5;                                                 // --muon-num-ns-steps
  ops::NsCoefficients coefficient_type = ops::NsCoefficients::quintic;  // --muon-coefficient-type
  MuonScaleMode scale_mode = MuonScaleMode::spectral;                   // --muon-scale-mode
  float extra_scale_factor = 1.0f;                                      // --muon-extra-scale-factor
  MuonTpMode tp_mode = MuonTpMode::duplicated;                          // --muon-tp-mode
  MuonMatmulPrecision fp32_matmul_prec = MuonMatmulPrecision::medium;   // --muon-fp32-matmul-prec
  ScalarOptimizer scalar_optimizer = ScalarOptimizer::adam;             // --muon-scalar-optimizer
  float lion_beta1 = 0.95f;                                             // --lion-beta1 (lion scalars)
  float lion_beta2 = 0.98f;                                             // --lion-beta2
  LionConfig lion() const { return {lion_beta1, lion_beta2}; }
  void validate() const;
  ops::NewtonSchulz newton_schulz() const;  // the op's settings (orientation by shape)
};

// Megatron's rule for which parameters Muon updates: the 2-D weights other than the word embeddings and the output
// layer (position embeddings and the router included), and here each routed expert's matrix of an expert stack.
bool muon_managed(const std::string& name, int ndim, bool expert_parallel);

// How Muon sees one parameter (what the model knows and the optimizer does not).
struct MuonParam {
  bool managed = false;         // muon_managed(); else the scalar optimizer updates it
  std::vector<int64_t> pieces;  // the fused QKV weight: the rows of one query group's Q, K and V ([q, kv, kv]),
                                // orthogonalised apart (Megatron's split_qkv); empty: the matrix whole
};

// The groups Muon works over. tp, etp: the groups a tensor-parallel shard's parts are on (the dense weights', the
// experts'). With `distributed` (Megatron's layer-wise distributed optimizer, --use-distributed-optimizer with Muon),
// each parameter is owned by one rank of its data-parallel group -- dp for the dense parameters, edp for the experts'
// -- dealt in Megatron's order (ascending size, ranks 0..D-1 then D-1..0, repeating): the owner alone holds its state
// (Muon's momentum or AdamW's moments) and updates it, from the gradient every rank holds reduced, then broadcasts
// the new values. The tensor-parallel peers of an owner own their shards of the same parameter (same sizes, same deal).
struct MuonGroups {
  ProcessGroup tp, etp;
  ProcessGroup dp, edp;
  bool distributed = false;
};

class Muon {
 public:
  // params: the model's parameters (outliving this), kinds: one per parameter. The scalar optimizer holds its state
  // for the others; Muon a momentum for each managed one (zeros).
  Muon(std::vector<Param>& params, const std::vector<MuonParam>& kinds, const MuonConfig& cfg, const AdamWConfig& adam,
       const MuonGroups& groups);
  const MuonConfig& config() const { return cfg_; }
  const AdamWConfig& adam_config() const { return adam_; }  // (the run's, which Lion reads too)
  // One update with learning rate lr and the global gradient norm (the clip scale: clip_scale_for(norm, clip_grad)):
  // the scalar optimizer's step, then each Muon matrix's. Collective over the groups' shards (TP modes other than
  // blockwise).
  StepStats step(float lr, double grad_norm);
  int64_t steps_taken() const;
  void set_steps_taken(int64_t s);
  // Per parameter: Muon's momentum (undefined for the scalar optimizer's), Adam's moments or Lion's momentum (exp_avg;
  // no exp_avg_sq) (undefined for Muon's); with `distributed`, undefined too where another rank owns the parameter.
  const std::vector<Tensor>& momentum() const { return momentum_; }
  std::vector<Tensor> exp_avg() const;
  std::vector<Tensor> exp_avg_sq() const;
  // The state of every parameter, as a checkpoint holds it: these handles where this rank owns the parameter (all, when
  // not distributed), else fresh tensors -- with `gather`, filled by a broadcast from the owner over the parameter's
  // data-parallel group (collective), else zeros (for a load to write into and drop). [0] momentum, [1] exp_avg,
  // [2] exp_avg_sq.
  std::array<std::vector<Tensor>, 3> checkpoint_state(bool gather) const;
  // The data-parallel rank that owns parameter i (0 when not distributed).
  int owner(size_t i) const { return owner_[i]; }
  // Bytes of state per parameter of each kind (the memory plan's, before an optimizer exists): Muon's, and the scalar
  // optimizer's.
  static int64_t muon_bytes_per_param() { return 4; }
  static int64_t scalar_bytes_per_param(const MuonConfig& cfg, const AdamWConfig& adam) {
    return cfg.scalar_optimizer == ScalarOptimizer::lion ? Lion::state_bytes_per_param()
                                                         : AdamW::state_bytes_per_param(adam);
  }
  int64_t state_bytes() const;
  // The shape scale times --muon-extra-scale-factor for a rows x cols matrix.
  double scale(int64_t rows, int64_t cols) const;

 private:
  void step_matrix(size_t i, float lr, float clip_scale);
  const ProcessGroup& data_parallel(size_t i) const { return params_[i].expert_parallel ? groups_.edp : groups_.dp; }
  bool owned(size_t i) const { return !groups_.distributed || owner_[i] == data_parallel(i).rank(); }
  void orthogonalise(Tensor& piece, int shard_dim, const ProcessGroup& group, int64_t rows, int64_t cols);
  std::vector<Tensor> spread(const std::vector<Tensor>& scalar_state) const;

  std::vector<Param>& params_;
  std::vector<MuonParam> kinds_;
  MuonConfig cfg_;
  MuonGroups groups_;
  std::vector<int> owner_;            // per parameter: its owner's rank in data_parallel(i)
  std::vector<size_t> scalar_index_;  // the scalar optimizer's parameters' indices in params_ (filled before ...)
  std::vector<Param> scalar_params_;  // ... their handles, which the scalar optimizer holds
  AdamWConfig adam_;
  std::variant<AdamW, Lion> scalar_;
  std::vector<Tensor> momentum_;
};

}  // namespace moecore::optim
