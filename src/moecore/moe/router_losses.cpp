// The router's loss stage (spec §3): the order of the loss ops (kernels/ops_router.h) and global_aux_loss's
// all-reduce between them. aux_loss, seq_aux_loss and global_aux_loss use their own recomputed scores and top-k
// map, the z-loss the logits; the ops also write the gradient of the weighted sum with respect to the logits.
// Not here: the loss math (kernels/cpu/router_losses.cpp).
#include "moecore/moe/router_internal.h"

namespace moecore::moe::router_detail {

ops::RouterLossCoeffs router_loss_coeffs(const MoeConfig& cfg) {
  return {cfg.coeff(LoadBalancing::aux_loss), cfg.coeff(LoadBalancing::seq_aux_loss),
          cfg.coeff(LoadBalancing::global_aux_loss), cfg.z_loss_coeff};
}

void router_losses(RouterStats& stats, RouterState& st, RouterCache& c, const Tensor& padding, const RouterDims& d,
                   const MoeConfig& cfg, const ops::Context& ctx) {
  const ops::RouterLossCoeffs k = router_loss_coeffs(cfg);
  const bool global = k.global_aux > 0;
  if (k.aux > 0 || k.seq_aux > 0 || global) {
    // The aux scores go to dlogits_loss (the aux op turns them into their gradient in place) and the aux map to
    // the backward workspace, free during forward.
    Tensor none;
    Tensor& counts = global ? st.global_aux_counts : none;
    ops::router_aux_scores(c.dlogits_loss, c.dlogits, counts, c.logits, padding, cfg.score_function, d.K, ctx);
    if (global) {
      // This micro-batch's counts and valid tokens summed over the data-parallel group (spec §3.3: TP x DP x
      // CP); each rank's partial P with the group's counts adds up to the full loss.
      if (d.global_aux_group && d.global_aux_group->size() > 1) all_reduce_sum(counts, *d.global_aux_group);
      st.global_aux_steps += 1;
    }
    const ops::RouterAuxLoss p{k, cfg.score_function, d.K, d.B, st.global_aux_steps};
    ops::router_aux_losses(c.dlogits_loss, stats.losses, st.global_tokens_per_expert, c.dlogits, c.logits, counts,
                           padding, p, ctx);
  } else {
    c.dlogits_loss.zero_();
  }
  if (k.z > 0) ops::router_z_loss(c.dlogits_loss, stats.losses, c.logits, padding, k.z, ctx);
  ops::router_loss_weighted(stats.losses, k, ctx);
}

}  // namespace moecore::moe::router_detail
