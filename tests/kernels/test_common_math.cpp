// The host/device arithmetic of kernels/common/ on the host, against values worked out by hand: the router's score
// functions and top-k ties, the aux losses' scalar tail and the routing Jacobian of one token, AdamW's first step, the
// dropout threshold and the norms' row chunks. Both backends run these
// functions; the ops' own tests compare the backends.
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/kernels/common/adamw.h"
#include "moecore/kernels/common/dropout_mask.h"
#include "moecore/kernels/common/norm_chunks.h"
#include "moecore/kernels/common/router_grads.h"

namespace moecore::ops::router_math {
namespace {

TEST(CommonRouterMath, ScoreFunctionsAndTheirDerivatives) {
  EXPECT_EQ(sigmoid(0.0), 0.5);
  EXPECT_EQ(softplus(0.0), std::log1p(1.0));
  EXPECT_EQ(softplus(-0.0), std::log(2.0));
  EXPECT_EQ(softplus(-1000.0f), 0.0f);  // exp underflows: max(z, 0) + log1p(0)
  EXPECT_EQ(score_fn(ScoreFunction::sigmoid, 0.0), 0.5);
  EXPECT_EQ(score_fn_grad(ScoreFunction::sigmoid, 0.0, 0.5), 0.25);
  EXPECT_EQ(score_fn(ScoreFunction::sqrtsoftplus, 0.0), std::sqrt(std::log(2.0)));
  EXPECT_EQ(score_fn_grad(ScoreFunction::sqrtsoftplus, 0.0, 0.0), 0.0);  // f -> 0: derivative 0, not inf
}

TEST(CommonRouterMath, TopkTiesGoToTheLowerIndex) {
  const double v[] = {1, 3, 2, 3, 0};
  int32_t idx[3] = {};
  topk(idx, v, 5, 3);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(idx[1], 3);
  EXPECT_EQ(idx[2], 2);
  const uint8_t allowed[] = {1, 0, 1, 1, 1};
  topk(idx, v, 5, 2, allowed);
  EXPECT_EQ(idx[0], 3);
  EXPECT_EQ(idx[1], 2);
  double out[2];
  const double z[] = {0.0, std::log(3.0)};
  softmax_row(out, z, 2);
  EXPECT_DOUBLE_EQ(out[0], 0.25);
  EXPECT_DOUBLE_EQ(logsumexp_row(z, 2), std::log(4.0));
}

// E = 2, K = 1, B = 1, 4 valid tokens: P = (3, 1), c = (2, 2); aux = E / (K N^2) sum P c = 2 / 16 * 8 = 1;
// dL/ds[e] = ca * E / (K N^2) * c[e] = 0.5 * 2 / 16 * 2 = 0.125.
TEST(CommonRouterMath, AuxLossTailGivesTheSwitchLossAndItsGradient) {
  const double P[] = {3, 1}, cnt[] = {2, 2};
  double losses[router_loss::count] = {}, g[2], Pt[2], ct[2], cavg[2];
  RouterAuxLoss p;
  p.coeffs.aux = 0.5;
  p.K = 1;
  p.B = 1;
  aux_loss_tail(losses, nullptr, g, Pt, ct, cavg, P, cnt, nullptr, 4, 2, p);
  EXPECT_EQ(losses[router_loss::aux], 1.0);
  EXPECT_EQ(losses[router_loss::seq_aux], 0.0);
  EXPECT_EQ(losses[router_loss::global_aux], 0.0);
  EXPECT_EQ(g[0], 0.125);
  EXPECT_EQ(g[1], 0.125);
  EXPECT_EQ(switch_loss(P, cnt, 2, 1, 0.0), 0.0);  // no valid token: no loss
}

// Post-softmax top-2 of one token: dz[idx_j] = w_j (dw_j - sum_i w_i dw_i), dw = scale * dprobs at the selection.
TEST(CommonRouterMath, RouteBackwardRowOfAPostSoftmaxToken) {
  RouterRouting r;
  r.scaling_factor = 2.0f;
  const auto c = route_backward_consts<double>(r, 2, 0.5f);
  EXPECT_TRUE(c.post_softmax);
  const float dp[] = {1.0f, 0.0f, 3.0f};
  const int32_t idx[] = {2, 0};
  const double w[] = {0.75, 0.25}, z[3] = {}, s[3] = {}, dll[] = {2, 4, 6};
  const bool kept[] = {true, true};
  double dl[3], dw[2];
  route_backward_row(dl, dw, dp, idx, w, z, s, kept, dll, 3, 2, c);
  // dw = (6, 2), dot = 0.75 * 6 + 0.25 * 2 = 5; dz = (0.25 * (2 - 5), 0, 0.75 * (6 - 5)) + 0.5 * dll
  EXPECT_EQ(dl[0], -0.75 + 1.0);
  EXPECT_EQ(dl[1], 2.0);
  EXPECT_EQ(dl[2], 0.75 + 3.0);
}

}  // namespace
}  // namespace moecore::ops::router_math

namespace moecore::ops {
namespace {

// Adam's first step moves every parameter by lr against the gradient's sign (bias-corrected m / sqrt(v) = sign(g)),
// less eps's share; decoupled weight decay scales the parameter first.
TEST(CommonAdamW, FirstStepMovesByTheLearningRate) {
  AdamWParams p;
  p.lr = 1e-3f;
  p.eps = 0.0f;
  p.weight_decay = 0.5f;
  p.grad_scale = 2.0f;
  const adamw::Consts k(p);
  const float g = adamw::scaled_grad(-3.0f, k);
  EXPECT_EQ(g, -6.0f);
  const float m = adamw::first_moment(0.0f, g, k), v = adamw::second_moment(0.0f, g, k);
  EXPECT_FLOAT_EQ(m, (1.0f - 0.9f) * -6.0f);
  EXPECT_FLOAT_EQ(v, (1.0f - 0.999f) * 36.0f);
  EXPECT_NEAR(adamw::param(1.0f, m, v, k), 1.0f * (1.0f - 5e-4f) + 1e-3f, 1e-6f);
}

// The threshold is the least word whose uniform reaches p: the word below it falls short.
TEST(CommonDropout, ThresholdIsTheLeastKeptWord) {
  EXPECT_EQ(dropout::keep_threshold(0.0f), 0u);
  for (float p : {0.1f, 0.5f, 0.013f, 0.999f}) {
    const uint32_t t = dropout::keep_threshold(p);
    EXPECT_GE(dropout::word_to_uniform(t), p);
    EXPECT_LT(dropout::word_to_uniform(t - 1), p);
  }
  EXPECT_EQ(dropout::keep_scale(0.5f), 2.0f);
}

// At most 128 chunks of at least 8 rows, covering N exactly.
TEST(CommonNorms, RowChunksCoverTheRows) {
  EXPECT_EQ(RowChunks(0).count, 0);
  EXPECT_EQ(RowChunks(1).count, 1);
  EXPECT_EQ(RowChunks(9).count, 2);
  EXPECT_EQ(RowChunks(9).rows_per, 5);
  EXPECT_EQ(RowChunks(100000).count, 128);
  for (int64_t N : {1, 7, 8, 9, 1000, 1025, 100000}) {
    const RowChunks c(N);
    EXPECT_LE(c.count, 128);
    EXPECT_GE(c.count * c.rows_per, N);
    EXPECT_LT((c.count - 1) * c.rows_per, N);
  }
}

}  // namespace
}  // namespace moecore::ops
