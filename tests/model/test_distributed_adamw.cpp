// Single-rank tests of optim::DistributedAdamW (comm_single(), no backend) and of AdamW's external-norm
// step: bitwise equal to AdamW over several steps (f32 and bf16 states, several bucket sizes), the clip
// rule, gather/load of the moments, and clear errors for bad inputs. Multi-rank behaviour lives in
// mpi_distributed_optimizer_test.cpp. Parameters (and so the optimizers' states) live on testing::test_device();
// values and gradients are written and read through host copies.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "moecore/core/error.h"
#include "moecore/optim/distributed_adamw.h"
#include "moecore/parallel/comm.h"
#include "test_util.h"

namespace moecore {
namespace {

// optim::global_grad_norm with its accumulator on the parameters' device.
double grad_norm(const std::vector<Param>& params) {
  Tensor acc = Tensor::zeros({1}, DType::f64, MemCategory::other, params.front().grad.device());
  return optim::global_grad_norm(params, acc);
}

using optim::AdamW;
using optim::AdamWConfig;
using optim::DistributedAdamW;
using optim::DistributedAdamWOptions;

float value_at(uint64_t seed, int64_t i) {  // exact floats of assorted magnitudes
  uint64_t h = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 31)) * 0x94d049bb133111ebull;
  h ^= h >> 29;
  const auto mantissa = static_cast<int64_t>(h >> 40) - (int64_t{1} << 23);
  return std::ldexp(static_cast<float>(mantissa), static_cast<int>(h % 10) - 29);
}

Tensor dev_zeros(const Shape& shape, MemCategory category) {
  return Tensor::zeros(shape, DType::f32, category, testing::test_device());
}

// A host f32 tensor of `shape` whose element k is value_at(seed, k).
Tensor values(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32, MemCategory::other);
  for (int64_t k = 0; k < t.numel(); ++k) t.data<float>()[k] = value_at(seed, k);
  return t;
}

std::vector<Param> make_params() {
  const std::vector<std::pair<Shape, bool>> specs = {{{10, 15}, true}, {{7}, false},  {{1}, false},
                                                     {{3, 5}, true},   {{13}, false}, {{4, 8}, true}};
  std::vector<Param> ps;
  for (size_t i = 0; i < specs.size(); ++i) {
    Param p;
    p.name = "p" + std::to_string(i);
    p.value = Tensor::empty(specs[i].first, DType::f32, MemCategory::parameters, testing::test_device());
    p.value.copy_from(values(specs[i].first, 100 + i));
    p.grad = dev_zeros(specs[i].first, MemCategory::gradients);
    p.weight_decay = specs[i].second;
    p.compute = p.value;
    ps.push_back(std::move(p));
  }
  return ps;
}

void set_grads(std::vector<Param>& ps, int step) {
  for (size_t i = 0; i < ps.size(); ++i) ps[i].grad.copy_from(values(ps[i].grad.shape(), 1000 * uint64_t(step) + i));
}

std::vector<Param*> pointers(std::vector<Param>& ps) {
  std::vector<Param*> out;
  for (Param& p : ps) out.push_back(&p);
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (!(a.shape() == b.shape()) || a.dtype() != b.dtype()) return false;
  const Tensor ha = testing::host(a), hb = testing::host(b);
  return std::memcmp(ha.raw(), hb.raw(), a.nbytes()) == 0;
}

AdamWConfig config(DType state, float clip) {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.clip_grad = clip;
  c.state_dtype = state;
  return c;
}

TEST(DistributedAdamW, ClipScaleRule) {
  EXPECT_EQ(optim::clip_scale_for(10.0, 0.0f), 1.0f);  // disabled
  EXPECT_EQ(optim::clip_scale_for(0.5, 1.0f), 1.0f);   // under the limit
  EXPECT_EQ(optim::clip_scale_for(4.0, 1.0f), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_EQ(optim::clip_scale_for(std::numeric_limits<double>::quiet_NaN(), 1.0f), 1.0f);
}

TEST(DistributedAdamW, AdamWStepWithNormEqualsStep) {
  for (float clip : {1.0f, 0.0f, 1e6f}) {
    std::vector<Param> a = make_params(), b = make_params();
    AdamW oa(a, config(DType::f32, clip)), ob(b, config(DType::f32, clip));
    for (int s = 1; s <= 3; ++s) {
      set_grads(a, s);
      set_grads(b, s);
      const optim::StepStats sa = oa.step(1e-2f);
      const optim::StepStats sb = ob.step(1e-2f, grad_norm(b));
      EXPECT_EQ(sa.grad_norm, sb.grad_norm);
      EXPECT_EQ(sa.clip_scale, sb.clip_scale);
      EXPECT_EQ(sa.clip_scale, optim::clip_scale_for(sa.grad_norm, clip));
      for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i].value, b[i].value)) << a[i].name;
    }
  }
}

TEST(DistributedAdamW, SingleRankMatchesAdamWBitwise) {
  for (DType state : {DType::f32, DType::bf16}) {
    for (int64_t bucket : {int64_t{1}, int64_t{40}, DistributedAdamWOptions{}.bucket_elems}) {
      const AdamWConfig cfg = config(state, 1.0f);
      std::vector<Param> ref = make_params(), dist = make_params();
      AdamW plain(ref, cfg);
      DistributedAdamW opt(pointers(dist), cfg, comm_single(), DistributedAdamWOptions{bucket});
      EXPECT_EQ(opt.state_bytes(), 218 * plain.state_bytes_per_param());  // no padding with one rank
      for (int s = 1; s <= 4; ++s) {
        set_grads(ref, s);
        set_grads(dist, s);
        memory_reset_peaks();
        const int64_t bytes = memory_stats().total_current;
        opt.reduce_scatter_grads();
        EXPECT_EQ(opt.first_nonfinite_grad(), "");
        const double norm = std::sqrt(opt.shard_grad_sq());
        opt.step(1e-2f, optim::clip_scale_for(norm, cfg.clip_grad));
        EXPECT_EQ(memory_stats().total_peak, bytes) << "reduce_scatter_grads and step must not allocate";
        EXPECT_NEAR(norm, grad_norm(ref), 1e-12 * norm);
        plain.step(1e-2f, norm);
        for (size_t i = 0; i < ref.size(); ++i)
          EXPECT_TRUE(same_bits(dist[i].value, ref[i].value))
              << dtype_name(state) << " bucket " << bucket << " step " << s << " " << ref[i].name;
      }
      EXPECT_EQ(opt.steps_taken(), 4);
      std::vector<Tensor> m, v;
      opt.gather_state(m, v);
      for (size_t i = 0; i < ref.size(); ++i) {
        EXPECT_TRUE(same_bits(m[i], plain.exp_avg()[i])) << ref[i].name;
        EXPECT_TRUE(same_bits(v[i], plain.exp_avg_sq()[i])) << ref[i].name;
      }
      // Reloaded into a fresh instance, one more step still matches.
      std::vector<Param> fresh = make_params();
      for (size_t i = 0; i < fresh.size(); ++i) fresh[i].value.copy_from(dist[i].value);
      DistributedAdamW again(pointers(fresh), cfg, comm_single(), DistributedAdamWOptions{bucket});
      again.load_state(m, v);
      again.set_steps_taken(opt.steps_taken());
      set_grads(ref, 5);
      set_grads(fresh, 5);
      again.reduce_scatter_grads();
      const double norm = std::sqrt(again.shard_grad_sq());
      again.step(1e-2f, optim::clip_scale_for(norm, cfg.clip_grad));
      plain.step(1e-2f, norm);
      for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(same_bits(fresh[i].value, ref[i].value)) << ref[i].name;
    }
  }
}

// The logging statistics of a shard (one rank: the whole model): the squares of the parameters after update(), before
// the gathers (the owned ranges are current), and the gradient's zeros after scaling -- exact zeros, and a value that
// underflows once scaled.
TEST(DistributedAdamW, ShardParamSquaresAndGradZeros) {
  std::vector<Param> ps = make_params();
  DistributedAdamW opt(pointers(ps), config(DType::f32, 1.0f), comm_single(), DistributedAdamWOptions{40});
  set_grads(ps, 1);
  Tensor g0 = testing::host(ps[0].grad).clone();
  for (int64_t i : {3, 4, 99}) g0.data<float>()[i] = 0.0f;
  g0.data<float>()[5] = 1e-30f;
  ps[0].grad.copy_from(g0);
  opt.reduce_scatter_grads();
  int64_t zeros = 0;
  for (const Param& p : ps) {
    const Tensor g = testing::host(p.grad);
    for (int64_t i = 0; i < g.numel(); ++i) zeros += g.data<float>()[i] == 0.0f ? 1 : 0;
  }
  EXPECT_EQ(opt.shard_grad_zeros(1.0f), zeros);
  EXPECT_EQ(opt.shard_grad_zeros(1e-20f), zeros + 1);
  opt.update(1e-2f, 1.0f);
  double sq = 0;
  for (const Param& p : ps) sq += testing::sum_squares(p.value);
  EXPECT_NEAR(opt.shard_param_sq(), sq, 1e-12 * sq);
  opt.gather_params(false);
  EXPECT_NEAR(opt.shard_param_sq(), sq, 1e-12 * sq);
}

TEST(DistributedAdamW, FirstNonfiniteGradNamesTheParam) {
  std::vector<Param> ps = make_params();
  DistributedAdamW opt(pointers(ps), config(DType::f32, 1.0f), comm_single(), DistributedAdamWOptions{40});
  set_grads(ps, 1);
  Tensor g4 = testing::host(ps[4].grad).clone(), g5 = testing::host(ps[5].grad).clone();
  g4.data<float>()[12] = std::numeric_limits<float>::quiet_NaN();
  g5.data<float>()[0] = std::numeric_limits<float>::infinity();
  ps[4].grad.copy_from(g4);
  ps[5].grad.copy_from(g5);
  opt.reduce_scatter_grads();
  EXPECT_EQ(opt.first_nonfinite_grad(), "p4");
}

TEST(DistributedAdamW, BadInputsGiveClearErrors) {
  std::vector<Param> ps = make_params();
  try {
    DistributedAdamW opt(pointers(ps), config(DType::f32, 1.0f), comm_single(), DistributedAdamWOptions{0});
    ADD_FAILURE() << "bucket_elems 0 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bucket_elems"), std::string::npos) << e.what();
  }
  DistributedAdamW opt(pointers(ps), config(DType::f32, 1.0f), comm_single());
  std::vector<Tensor> m, v;
  opt.gather_state(m, v);
  v[2] = dev_zeros({2}, MemCategory::other);
  try {
    opt.load_state(m, v);
    ADD_FAILURE() << "a wrongly shaped moment was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("p2"), std::string::npos) << e.what();
  }
  ps[3].grad = dev_zeros({4}, MemCategory::gradients);
  try {
    opt.reduce_scatter_grads();
    ADD_FAILURE() << "a wrongly sized gradient was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("p3"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore
