// The router's loss stage (docs/megatron-moe-spec.md §3): the order of the loss ops (kernels/ops_router.h) and
// global_aux_loss's all-reduce between them. aux_loss, seq_aux_loss and global_aux_loss use their own recomputed scores
// and top-k map, the z-loss the logits; the ops also write the gradient of the weighted sum with respect to the logits.
// Not here: the loss math (kernels/cpu/router_losses.cpp).
#include "moecore/moe/router_internal.h"

namespace moecore::moe::router_detail {

ops::RouterLossCoeffs router_loss_coeffs(const MoeConfig& cfg) {
  return {cfg.coeff(LoadBalancing::aux_loss), cfg.coeff(LoadBalancing::seq_aux_loss),
          cfg.coeff(LoadBalancing::global_aux_loss), cfg.z_loss_coeff};
}

namespace {
// The loss stage over [T', E] rows: logits in, dlogits_loss out, dlogits as workspace.
void losses_over(RouterStats& stats, RouterState& st, const Tensor& logits, Tensor& dlogits_loss, Tensor& dlogits,
                 const Tensor& padding, const RouterDims& d, const MoeConfig& cfg, const ops::Context& ctx) {
  const ops::RouterLossCoeffs k = router_loss_coeffs(cfg);
  const bool global = k.global_aux > 0;
  if (k.aux > 0 || k.seq_aux > 0 || global) {
    // The aux scores go to dlogits_loss (the aux op turns them into their gradient in place) and the aux map to
    // the backward workspace, free during forward.
    Tensor none;
    Tensor& counts = global ? st.global_aux_counts : none;
    ops::router_aux_scores(dlogits_loss, dlogits, counts, logits, padding, cfg.score_function, d.K, ctx);
    if (global) {
      // This micro-batch's counts and valid tokens summed over the data-parallel group (spec §3.3: TP x DP x
      // CP); each rank's partial P with the group's counts adds up to the full loss.
      if (d.global_aux_group && d.global_aux_group->size() > 1) all_reduce_sum(counts, *d.global_aux_group);
      st.global_aux_steps += 1;
    }
    const ops::RouterAuxLoss p{k, cfg.score_function, d.K, d.B, st.global_aux_steps};
    ops::router_aux_losses(dlogits_loss, stats.losses, st.global_tokens_per_expert, dlogits, logits, counts, padding, p,
                           ctx);
  } else {
    dlogits_loss.zero_();
  }
  if (k.z > 0) ops::router_z_loss(dlogits_loss, stats.losses, logits, padding, k.z, ctx);
  ops::router_loss_weighted(stats.losses, k, ctx);
}
}  // namespace

void router_losses(RouterStats& stats, RouterState& st, RouterCache& c, const Tensor& padding, const RouterDims& d,
                   const MoeConfig& cfg, const ops::Context& ctx) {
  if (d.sequence_size() == 1) {
    losses_over(stats, st, c.logits, c.dlogits_loss, c.dlogits, padding, d, cfg, ctx);
    return;
  }
  // Sequence parallelism: the group's logits (and padding) gathered in rank order are the whole micro-batch's, in
  // its token order; the losses over them are the single-rank losses, and this rank keeps its rows' gradient.
  const ProcessGroup& g = *d.sequence_group;
  all_gather(c.logits_all, c.logits, g);
  Tensor padding_all;
  if (padding.defined()) {
    all_gather(c.padding_all, padding, g);
    padding_all = c.padding_all;
  }
  losses_over(stats, st, c.logits_all, c.dlogits_loss_all, c.dlogits_all, padding_all, d, cfg, ctx);
  c.dlogits_loss.copy_from(c.dlogits_loss_all.slice(0, g.rank() * d.T, (g.rank() + 1) * d.T));
}

}  // namespace moecore::moe::router_detail
