// Tensor-parallel building blocks (issue 12) against the single-rank computation, under mpirun with 2 and 4 ranks
// (the whole world is the tensor-parallel group). Every rank also computes the single-rank reference itself.
// The vocabulary-parallel LM head: each rank holds the output-layer rows of its vocabulary range; the loss totals,
// the input gradient and each rank's slice of the weight gradient match the single-rank LM head (losses 1e-6
// relative; gradients element-wise rtol 1e-5 with an absolute floor of 1e-6 x the largest element), with ignored
// labels, chunking (a tiny chunk size forces several chunks), forward-only evaluation, bf16 compute, and a label in
// every rank's range. Two identical tensor-parallel runs are bitwise identical.
#include <gtest/gtest.h>

#include "mpi_test_support.h"
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/nn/lm_head.h"

namespace moecore {
namespace {

using Mpi = testing_mpi::MpiTest;

struct HeadResult {
  double loss_sum = 0, tokens = 0;
  std::vector<float> dh, dw;  // dw: this rank's rows
};

// The LM head over h [N, H] with output rows [first, first + rows) of w [V, H] on group g (null: one rank).
HeadResult run_head(const Tensor& h, const Tensor& w, const Tensor& labels, int64_t first, int64_t rows,
                    const ProcessGroup* g, DType compute, bool backward, int64_t chunk) {
  const int64_t N = h.size(0), H = h.size(1);
  const ops::Context ctx{testing::test_device()};
  const Tensor hc = testing::on_test_device(h.to(compute)), lab = testing::on_test_device(labels);
  const Tensor wc = testing::on_test_device(w.slice(0, first, first + rows).clone().to(compute));
  Tensor dh = Tensor::zeros({N, H}, DType::f32, MemCategory::other, ctx.device);
  Tensor dw = Tensor::zeros({rows, H}, DType::f32, MemCategory::other, ctx.device);
  nn::LmHeadWorkspace ws = nn::lm_head_workspace_alloc(N, rows, compute, ctx.device, g ? g->size() : 1);
  if (chunk > 0) {  // fewer tokens per chunk than the workspace holds: several chunks per call
    ws.chunk = chunk;
  }
  nn::lm_head_loss(backward ? &dh : nullptr, backward ? &dw : nullptr, hc, wc, lab, 0.25f, ws, ctx, g);
  HeadResult r;
  double totals[2];
  ws.totals.copy_to_host(totals, 2);
  r.loss_sum = totals[0];
  r.tokens = totals[1];
  if (backward) {
    r.dh = testing::to_vector(dh);
    r.dw = testing::to_vector(dw);
  }
  return r;
}

// a within rtol of b element-wise, with an absolute floor of 1e-6 x the largest |b|.
void expect_close(const std::vector<float>& a, const std::vector<float>& b, double rtol, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  float big = 0;
  for (float v : b) big = std::max(big, std::fabs(v));
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_LE(std::fabs(double(a[i]) - b[i]), rtol * std::fabs(double(b[i])) + 1e-6 * big) << what << " [" << i << "]";
}

TEST_F(Mpi, VocabParallelLmHeadMatchesOneRank) {
  const int64_t N = 37, H = 24, Vl = 11, V = Vl * P;
  const Tensor h = testing::randn({N, H}, "tp.h"), w = testing::randn({V, H}, "tp.w", 0.3f);
  Tensor labels = Tensor::empty({N}, DType::i32, MemCategory::other);
  for (int64_t i = 0; i < N; ++i)  // every rank's range, plus ignored tokens
    labels.data<int32_t>()[i] = i % 7 == 3 ? -1 : static_cast<int32_t>((i * 5 + i / 3) % V);
  for (DType compute : {DType::f32, DType::bf16})
    for (bool backward : {true, false})
      for (int64_t chunk : {int64_t{0}, int64_t{8}}) {
        SCOPED_TRACE(std::string(dtype_name(compute)) + (backward ? " backward" : " forward") + " chunk " +
                     std::to_string(chunk));
        const HeadResult one = run_head(h, w, labels, 0, V, nullptr, compute, backward, chunk);
        const HeadResult tp = run_head(h, w, labels, me * Vl, Vl, &world, compute, backward, chunk);
        EXPECT_EQ(tp.tokens, one.tokens);
        EXPECT_LE(std::fabs(tp.loss_sum - one.loss_sum), 1e-6 * std::fabs(one.loss_sum));
        if (!backward) continue;
        expect_close(tp.dh, one.dh, 1e-5, "dh");
        const std::vector<float> mine(one.dw.begin() + me * Vl * H, one.dw.begin() + (me + 1) * Vl * H);
        expect_close(tp.dw, mine, 1e-5, "dw");
        const HeadResult again = run_head(h, w, labels, me * Vl, Vl, &world, compute, backward, chunk);
        EXPECT_EQ(again.loss_sum, tp.loss_sum);
        EXPECT_EQ(again.dh, tp.dh);
        EXPECT_EQ(again.dw, tp.dw);
      }
}

TEST_F(Mpi, VocabParallelLmHeadRefusesAWorkspaceForAnotherGroupSize) {
  const int64_t N = 4, H = 8, Vl = 3;
  const ops::Context ctx{testing::test_device()};
  const Tensor h = testing::on_test_device(testing::randn({N, H}, "tp.h"));
  const Tensor w = testing::on_test_device(testing::randn({Vl, H}, "tp.w"));
  const Tensor labels = testing::on_test_device(Tensor::zeros({N}, DType::i32, MemCategory::other));
  nn::LmHeadWorkspace ws = nn::lm_head_workspace_alloc(N, Vl, DType::f32, ctx.device, 1);
  const std::string msg =
      testing::error_of([&] { nn::lm_head_loss(nullptr, nullptr, h, w, labels, 1.0f, ws, ctx, &world); });
  EXPECT_NE(msg.find("tensor-parallel size"), std::string::npos) << msg;
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing_mpi::run_mpi_tests(argc, argv, 60);
}
