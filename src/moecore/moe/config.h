// MoE configuration with Megatron's flag names (docs/megatron-moe-spec.md §1), validated once at
// start-up with errors that name the flags and values. One struct serves the router, the dispatcher, the
// experts and the layer; each reads only its own fields.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/dtype.h"
#include "moecore/kernels/common/glu.h"
#include "moecore/kernels/ops_router.h"

namespace moecore::moe {

// The router ops' enums (kernels/ops_router.h), under the names moe code and the flags use.
using ScoreFunction = ops::ScoreFunction;
using DropPolicy = ops::DropPolicy;
enum class LoadBalancing : uint8_t { aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none };

struct MoeConfig {
  int64_t num_experts = 0;      // --num-experts: E routed experts (0: dense model)
  int64_t ffn_hidden_size = 0;  // --moe-ffn-hidden-size: F per expert (0: the model's ffn size)
  int64_t router_topk = 2;      // --moe-router-topk: K experts per token
  std::vector<LoadBalancing> load_balancing_type{LoadBalancing::aux_loss};  // --moe-router-load-balancing-type
  std::vector<float> aux_loss_coeff{0.0f};                // --moe-aux-loss-coeff: one per type, or one for all
  float z_loss_coeff = 0.0f;                              // --moe-z-loss-coeff (0: off; 1e-3 is typical)
  float input_jitter_eps = 0.0f;                          // --moe-input-jitter-eps: x *= U(1-eps, 1+eps) (0: off)
  ScoreFunction score_function = ScoreFunction::softmax;  // --moe-router-score-function
  bool pre_softmax = false;                               // --moe-router-pre-softmax: softmax over all E before top-k
  float topk_scaling_factor = 0.0f;                       // --moe-router-topk-scaling-factor (0: none)
  DType router_dtype = DType::f32;                        // --moe-router-dtype fp32|fp64: logits and probs precision
  int64_t num_groups = 0;  // --moe-router-num-groups: expert groups for group-limited top-k (0: off)
  int64_t group_topk = 0;  // --moe-router-group-topk: groups each token may use
  // --moe-router-group-score-topk (moecore): a group's score sums its top this-many scores; 0 = K / group_topk,
  // Megatron's rule (transformers' DeepSeek-V3 always sums the top 2)
  int64_t group_score_topk = 0;
  int64_t group_score_k() const {  // (0 for a group_topk of 0, which validate refuses with groups)
    return group_score_topk ? group_score_topk : group_topk > 0 ? router_topk / group_topk : 0;
  }
  bool enable_expert_bias = false;    // --moe-router-enable-expert-bias (aux-loss-free balancing)
  float bias_update_rate = 1e-3f;     // --moe-router-bias-update-rate
  bool force_load_balancing = false;  // --moe-router-force-load-balancing: random logits (benchmarks)
  // --moe-router-force-biased STD: random logits plus a per-expert bias ~ N(0, |STD|) shared by every rank, drawn anew
  // each forward (STD > 0) or once per layer (STD < 0); skewed routing for benchmarks. 0: off (Megatron's None).
  float force_biased = 0.0f;
  float capacity_factor = 0.0f;                 // --moe-expert-capacity-factor (<= 0: dropless)
  DropPolicy drop_policy = DropPolicy::probs;   // --moe-token-drop-policy
  bool pad_expert_input_to_capacity = false;    // --moe-pad-expert-input-to-capacity
  int64_t router_padding_alignment = 0;         // --moe-router-padding-for-fp8 sets 16 (32 for MXFP8); 0: off
  bool grouped_gemm = true;                     // --moe-grouped-gemm (false: the sequential per-expert reference)
  int64_t shared_expert_intermediate_size = 0;  // --moe-shared-expert-intermediate-size (0: none)
  bool shared_expert_gate = false;              // --moe-shared-expert-gate: sigmoid(x . g) scales the shared output
  bool swiglu = true;                           // expert activation: SwiGLU (fc1 [2F, H]) or GeLU (fc1 [F, H])
  // The gated linear unit's activation, offset and clamps (the model's --quick-geglu, --glu-linear-offset,
  // --activation-func-clamp-value); GluParams{} is SiLU.
  ops::GluParams glu;
  ops::MlpActivation activation() const { return {swiglu, glu}; }
  uint64_t seed = 1234;  // jitter / forced-balancing stream seed
  // MoE ECHO (echo.h; docs/echo-folding-perf.md §A): clones of hot experts on under-loaded EP ranks.
  bool enable_echo = false;      // --moe-enable-echo
  int64_t num_echo_experts = 0;  // --moe-num-echo-experts: global clone slots, a multiple of EP (e.g. 2 x EP)
  std::string echo_dispatcher_type = "alltoall";  // --moe-echo-expert-dispatcher-type: alltoall (hybridep: GPU only)
  bool echo_recompute_expert_dispatch = false;    // --moe-echo-recompute-expert-dispatch: re-fetch clones in backward
  bool echo_random_offloading = false;            // --moe-echo-enable-random-offloading: random clones (debug)
  // --moe-received-token-capacity / --moe-expert-rank-capacity-factor: token-expert rows an EP rank can receive, as a
  // multiple of the average (T x K); 0: unset (the synced dropless path). e.g. 1.25
  float received_token_capacity = 0.0f;

  bool enabled() const { return num_experts > 0; }
  bool uses(LoadBalancing t) const;
  float coeff(LoadBalancing t) const;  // the coefficient of type t (0 when t is not configured)
  // Throws Error naming the flags and values. fp8 tells whether FP8 training is on (router padding needs it).
  void validate(bool fp8 = false) const;
};

const char* load_balancing_name(LoadBalancing t);  // "aux_loss", ...
LoadBalancing parse_load_balancing(const std::string& s);
ScoreFunction parse_score_function(const std::string& s);

// Expert capacity per Megatron: ceil(num_tokens / E * capacity_factor), num_tokens = T * K.
int64_t expert_capacity(int64_t num_tokens, int64_t num_experts, float capacity_factor);

}  // namespace moecore::moe
