#include "moecore/moe/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "moecore/core/error.h"
#include "moecore/moe/echo.h"

namespace moecore::moe {

const char* load_balancing_name(LoadBalancing t) {
  switch (t) {
    case LoadBalancing::aux_loss:
      return "aux_loss";
    case LoadBalancing::seq_aux_loss:
      return "seq_aux_loss";
    case LoadBalancing::global_aux_loss:
      return "global_aux_loss";
    case LoadBalancing::sinkhorn:
      return "sinkhorn";
    case LoadBalancing::none:
      return "none";
  }
  return "?";
}

LoadBalancing parse_load_balancing(const std::string& s) {
  for (auto t : {LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss, LoadBalancing::global_aux_loss,
                 LoadBalancing::sinkhorn, LoadBalancing::none})
    if (s == load_balancing_name(t)) return t;
  MOECORE_FAIL("--moe-router-load-balancing-type '", s,
               "' is not one of aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none");
}

ScoreFunction parse_score_function(const std::string& s) {
  if (s == "softmax") return ScoreFunction::softmax;
  if (s == "sigmoid") return ScoreFunction::sigmoid;
  if (s == "sqrtsoftplus") return ScoreFunction::sqrtsoftplus;
  MOECORE_FAIL("--moe-router-score-function '", s, "' is not one of softmax, sigmoid, sqrtsoftplus");
}

bool MoeConfig::uses(LoadBalancing t) const {
  return std::find(load_balancing_type.begin(), load_balancing_type.end(), t) != load_balancing_type.end();
}

float MoeConfig::coeff(LoadBalancing t) const {
  for (size_t i = 0; i < load_balancing_type.size(); ++i) {
    if (load_balancing_type[i] != t) continue;
    if (aux_loss_coeff.size() == 1) return aux_loss_coeff[0];
    return i < aux_loss_coeff.size() ? aux_loss_coeff[i] : 0.0f;
  }
  return 0.0f;
}

void MoeConfig::validate(bool fp8) const {
  if (!enabled()) return;
  if (num_experts < 0) MOECORE_FAIL("--num-experts (", num_experts, ") must be positive");
  if (router_topk <= 0 || router_topk > num_experts)
    MOECORE_FAIL("--moe-router-topk (", router_topk, ") must lie in [1, --num-experts (", num_experts, ")]");
  if (load_balancing_type.empty()) MOECORE_FAIL("--moe-router-load-balancing-type needs at least one type");
  if (aux_loss_coeff.size() != 1 && aux_loss_coeff.size() != load_balancing_type.size())
    MOECORE_FAIL("--moe-aux-loss-coeff has ", aux_loss_coeff.size(),
                 " values but --moe-router-load-balancing-type has ", load_balancing_type.size(),
                 " types (give one coefficient, or one per type)");
  for (float c : aux_loss_coeff)
    if (c < 0) MOECORE_FAIL("--moe-aux-loss-coeff (", c, ") must not be negative");
  if (z_loss_coeff < 0) MOECORE_FAIL("--moe-z-loss-coeff (", z_loss_coeff, ") must not be negative");
  if (input_jitter_eps < 0 || input_jitter_eps >= 1)
    MOECORE_FAIL("--moe-input-jitter-eps (", input_jitter_eps, ") must lie in [0, 1)");
  const bool sinkhorn = uses(LoadBalancing::sinkhorn);
  if (sinkhorn) {
    if (load_balancing_type.size() != 1)
      MOECORE_FAIL("--moe-router-load-balancing-type sinkhorn cannot be combined with other types");
    if (coeff(LoadBalancing::sinkhorn) != 0.0f)
      MOECORE_FAIL("--moe-router-load-balancing-type sinkhorn requires --moe-aux-loss-coeff 0, got ",
                   coeff(LoadBalancing::sinkhorn));
    if (capacity_factor > 0)
      MOECORE_FAIL("--moe-expert-capacity-factor (", capacity_factor,
                   ") cannot be used with --moe-router-load-balancing-type sinkhorn");
    if (score_function != ScoreFunction::softmax || enable_expert_bias || num_groups > 0)
      MOECORE_FAIL("--moe-router-load-balancing-type sinkhorn does not combine with --moe-router-score-function ",
                   score_function == ScoreFunction::softmax ? "softmax" : "sigmoid/sqrtsoftplus",
                   ", --moe-router-enable-expert-bias or --moe-router-num-groups");
  }
  if (router_topk == 1 && score_function == ScoreFunction::softmax && !pre_softmax && !sinkhorn)
    MOECORE_FAIL(
        "--moe-router-topk 1 with softmax after top-k gives every token weight 1; use "
        "--moe-router-pre-softmax (as Megatron requires)");
  if (num_groups > 0 || group_topk > 0) {
    if (num_groups <= 0 || group_topk <= 0)
      MOECORE_FAIL("--moe-router-num-groups (", num_groups, ") and --moe-router-group-topk (", group_topk,
                   ") must be set together");
    if (num_experts % num_groups != 0)
      MOECORE_FAIL("--num-experts (", num_experts, ") must be divisible by --moe-router-num-groups (", num_groups, ")");
    if (group_topk > num_groups)
      MOECORE_FAIL("--moe-router-group-topk (", group_topk, ") must not exceed --moe-router-num-groups (", num_groups,
                   ")");
    if (router_topk < group_topk)
      MOECORE_FAIL("--moe-router-topk (", router_topk, ") must be at least --moe-router-group-topk (", group_topk, ")");
    if (group_score_topk < 0 || group_score_topk > num_experts / num_groups)
      MOECORE_FAIL("--moe-router-group-score-topk (", group_score_topk, ") must be in [0, experts per group (",
                   num_experts / num_groups, ")]");
    if (router_topk > group_topk * (num_experts / num_groups))
      MOECORE_FAIL("--moe-router-topk (", router_topk, ") exceeds the experts in --moe-router-group-topk (", group_topk,
                   ") groups of ", num_experts / num_groups);
  }
  if (enable_expert_bias && score_function == ScoreFunction::softmax)
    MOECORE_FAIL(
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or sqrtsoftplus, "
        "not softmax");
  if (bias_update_rate < 0) MOECORE_FAIL("--moe-router-bias-update-rate (", bias_update_rate, ") must not be negative");
  if (router_dtype != DType::f32 && router_dtype != DType::f64) MOECORE_FAIL("--moe-router-dtype must be fp32 or fp64");
  if (pad_expert_input_to_capacity && capacity_factor <= 0)
    MOECORE_FAIL("--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor");
  if (router_padding_alignment > 0 && !fp8)
    MOECORE_FAIL("--moe-router-padding-for-fp8 requires FP8 training (--fp8-format); it pads expert inputs to ",
                 router_padding_alignment, "-row multiples for FP8 GEMMs");
  if (router_padding_alignment < 0) MOECORE_FAIL("router padding alignment (", router_padding_alignment, ") < 0");
  if (shared_expert_intermediate_size < 0)
    MOECORE_FAIL("--moe-shared-expert-intermediate-size (", shared_expert_intermediate_size, ") must not be negative");
  if (shared_expert_gate && shared_expert_intermediate_size == 0)
    MOECORE_FAIL("--moe-shared-expert-gate requires --moe-shared-expert-intermediate-size");
  if (topk_scaling_factor < 0)
    MOECORE_FAIL("--moe-router-topk-scaling-factor (", topk_scaling_factor, ") must not be negative");
  if (ffn_hidden_size < 0) MOECORE_FAIL("--moe-ffn-hidden-size (", ffn_hidden_size, ") must not be negative");
  if (force_biased != 0 && router_dtype != DType::f32)
    MOECORE_FAIL("--moe-router-force-biased (", force_biased, ") needs --moe-router-dtype fp32");
  if (enable_echo && num_echo_experts <= 0)
    MOECORE_FAIL(
        "--moe-enable-echo needs --moe-num-echo-experts (the global clone slots, a multiple of "
        "--expert-model-parallel-size), got ",
        num_echo_experts);
  if (!enable_echo && num_echo_experts != 0)
    MOECORE_FAIL("--moe-num-echo-experts (", num_echo_experts, ") needs --moe-enable-echo");
  if (!enable_echo && (echo_recompute_expert_dispatch || echo_random_offloading))
    MOECORE_FAIL("--moe-echo-recompute-expert-dispatch and --moe-echo-enable-random-offloading need --moe-enable-echo");
  echo_check_dispatcher_type(echo_dispatcher_type);
  if (received_token_capacity < 0 || (received_token_capacity > 0 && !enable_echo && received_token_capacity < 1))
    MOECORE_FAIL("--moe-received-token-capacity / --moe-expert-rank-capacity-factor (", received_token_capacity,
                 ") must be > 0, and >= 1 without --moe-enable-echo (below the average every step would overflow)");
  if (received_token_capacity > 0 && capacity_factor > 0)
    MOECORE_FAIL("--moe-received-token-capacity (", received_token_capacity,
                 ") is the dropless static capacity; it does not combine with --moe-expert-capacity-factor (",
                 capacity_factor, ")");
}

int64_t expert_capacity(int64_t num_tokens, int64_t num_experts, float capacity_factor) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(num_tokens) / static_cast<double>(num_experts) *
                                        static_cast<double>(capacity_factor)));
}

}  // namespace moecore::moe
