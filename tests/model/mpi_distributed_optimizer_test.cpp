// Multi-rank tests of optim::DistributedAdamW, run under mpirun with 2 and 4 ranks: every rank's parameters
// stay bitwise equal to a plain AdamW on the rank-ordered gradient sum (f32 and bf16 states, several bucket
// sizes; with several instances, on the instance-ordered sum), the sharded squared norm, gathered/loaded moments,
// non-finite detection, mismatched parameters across ranks, and the 1/P state memory. Own main like
// tests/parallel/mpi_collectives_test.cpp. Parameters (and so both optimizers' states) live on testing::test_device();
// values and gradients are written and read through host copies.
#include <gtest/gtest.h>

#include "mpi_test_support.h"
#include "test_util.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include "moecore/core/error.h"
#include "moecore/optim/distributed_adamw.h"
#include "moecore/parallel/comm.h"

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

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

class Mpi : public testing_mpi::MpiTest {
 protected:
  int64_t sum_over_ranks(int64_t x) const {
    std::vector<int64_t> v = {x};
    all_reduce_sum(v, world);
    return v[0];
  }
};

using testing::mix;

// Exact floats over several magnitudes (up to ~4), so the summation order changes the rounding.
float value_at(uint64_t seed, int64_t i) {
  const uint64_t h = mix(seed * 1000003u + static_cast<uint64_t>(i));
  const auto mantissa = static_cast<int64_t>(h >> 40) - (int64_t{1} << 23);
  return std::ldexp(static_cast<float>(mantissa), static_cast<int>(h % 10) - 8 - 23 + 2);
}
float grad_at(int rank, int step, size_t param, int64_t i) {
  return value_at(mix(static_cast<uint64_t>(rank) * 131 + static_cast<uint64_t>(step) * 7 + param + 1), i);
}

struct Spec {
  std::string name;
  Shape shape;
  bool weight_decay;
};

// Assorted sizes: not divisible by 2 or 4, one larger than a 64-element bucket, a single element.
std::vector<Spec> assorted() {
  return {{"embedding.word_embeddings.weight", {10, 15}, true},
          {"decoder.layers.0.input_layernorm.weight", {7}, false},
          {"decoder.layers.0.router.scale", {1}, false},
          {"decoder.layers.0.self_attention.linear_qkv.weight", {3, 5}, true},
          {"decoder.layers.0.self_attention.linear_qkv.bias", {13}, false},
          {"decoder.layers.0.mlp.linear_fc1.weight", {4, 8}, true},
          {"decoder.final_layernorm.weight", {33}, false}};
}

std::vector<Param> make_params(const std::vector<Spec>& specs) {
  std::vector<Param> ps;
  for (size_t i = 0; i < specs.size(); ++i) {
    Param p;
    p.name = specs[i].name;
    Tensor host = Tensor::empty(specs[i].shape, DType::f32, MemCategory::other);
    float* v = host.data<float>();
    for (int64_t k = 0; k < host.numel(); ++k) v[k] = value_at(9000 + i, k);
    p.value = Tensor::empty(specs[i].shape, DType::f32, MemCategory::parameters, testing::test_device());
    p.value.copy_from(host);
    p.grad = Tensor::zeros(specs[i].shape, DType::f32, MemCategory::gradients, testing::test_device());
    p.weight_decay = specs[i].weight_decay;
    p.compute = p.value;
    ps.push_back(std::move(p));
  }
  return ps;
}

std::vector<Param*> pointers(std::vector<Param>& ps) {
  std::vector<Param*> out;
  for (Param& p : ps) out.push_back(&p);
  return out;
}

// "" when a and b hold the same bits, else where they first differ.
std::string bitwise_diff(const Tensor& a, const Tensor& b) {
  if (!(a.shape() == b.shape()) || a.dtype() != b.dtype()) return "shape/dtype " + a.str() + " vs " + b.str();
  const size_t es = dtype_size(a.dtype());
  const Tensor ha = testing::host(a), hb = testing::host(b);
  const auto* x = static_cast<const unsigned char*>(ha.raw());
  const auto* y = static_cast<const unsigned char*>(hb.raw());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(x + i * es, y + i * es, es) != 0)
      return "element " + std::to_string(i) + " of " + std::to_string(a.numel()) + " differs";
  return "";
}

// The world cut into n distributed-optimizer instances as Megatron cuts a data-parallel group: instance i is the
// ranks [i P/n, (i+1) P/n); with `across`, the groups joining the same place of every instance instead.
ProcessGroup instance_groups(const ProcessGroup& world, int n, bool across) {
  const int len = world.size() / n;
  std::vector<std::vector<int>> part(static_cast<size_t>(across ? len : n));
  for (int r = 0; r < world.size(); ++r) part[static_cast<size_t>(across ? r % len : r / len)].push_back(r);
  return group_split(world, across ? "inter_dist_opt" : "intra_dp_cp", part);
}

// One distributed optimizer and, on every rank, the plain AdamW it must reproduce. Not movable: AdamW keeps
// a reference to `ref`. With n instances the optimizer shards over this rank's instance and all-reduces over the
// instances; the reference sums each instance in rank order, then the instances in order.
class Harness {
 public:
  Harness(const ProcessGroup& world, const AdamWConfig& cfg, int64_t bucket, const std::vector<Spec>& specs,
          bool overlap = false, int n = 1)
      : world_(world),
        n_(n),
        g_(n == 1 ? world : instance_groups(world, n, false)),
        cfg_(cfg),
        dist_(make_params(specs)),
        ref_(make_params(specs)),
        plain_(ref_, cfg) {
    const ProcessGroup across = n == 1 ? ProcessGroup() : instance_groups(world, n, true);
    opt_ =
        std::make_unique<DistributedAdamW>(pointers(dist_), cfg, g_, DistributedAdamWOptions{bucket, overlap}, across);
  }
  Harness(const Harness&) = delete;

  // This rank's gradients into the distributed params; their sum (above) into the reference.
  void set_grads(int step) {
    const int len = world_.size() / n_;
    for (size_t i = 0; i < dist_.size(); ++i) {
      Tensor dh = Tensor::empty(dist_[i].grad.shape(), DType::f32, MemCategory::other);
      Tensor rh = Tensor::empty(ref_[i].grad.shape(), DType::f32, MemCategory::other);
      float* d = dh.data<float>();
      float* r = rh.data<float>();
      for (int64_t k = 0; k < dh.numel(); ++k) {
        d[k] = grad_at(world_.rank(), step, i, k);
        float acc = 0;
        for (int inst = 0; inst < n_; ++inst) {
          float part = grad_at(inst * len, step, i, k);
          for (int q = 1; q < len; ++q) part += grad_at(inst * len + q, step, i, k);
          acc = inst == 0 ? part : acc + part;
        }
        r[k] = acc;
      }
      dist_[i].grad.copy_from(dh);
      ref_[i].grad.copy_from(rh);
    }
  }
  // The trainer's sequence: reduce-scatter, global norm from the shards, clip scale, both updates.
  double step(int step, float lr) {
    set_grads(step);
    opt_->reduce_scatter_grads();
    std::vector<double> sq = {opt_->shard_grad_sq()};
    all_reduce_sum(sq, g_);
    const double norm = std::sqrt(sq[0]);
    opt_->step(lr, optim::clip_scale_for(norm, cfg_.clip_grad));
    plain_.step(lr, norm);
    return norm;
  }
  void expect_params_match(const std::string& when) const {
    for (size_t i = 0; i < dist_.size(); ++i)
      EXPECT_EQ(bitwise_diff(dist_[i].value, ref_[i].value), "") << when << ": " << dist_[i].name;
  }

  ProcessGroup world_;
  int n_ = 1;
  ProcessGroup g_;  // the instance (the world when n is 1)
  AdamWConfig cfg_;
  std::vector<Param> dist_, ref_;
  AdamW plain_;
  std::unique_ptr<DistributedAdamW> opt_;
};

const int64_t kDefaultBucket = DistributedAdamWOptions{}.bucket_elems;

AdamWConfig clipped_config() {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.clip_grad = 1.0f;  // the assorted gradients have norm > 10: every step clips
  return c;
}

// Megatron-FSDP's reduction (reduce_bucket every micro-batch, FSDP units as buckets): with f32 gradients the summed
// shard after one micro-batch is reduce_scatter_grads' (the update then bitwise the plain AdamW's); with bf16
// communication and main gradients, each micro-batch's gradients are rounded to bf16, summed over the ranks in rank
// order with every addition rounded to bf16, and added into a bf16 accumulator (in f32, rounded): the shard's squared
// norm after finish_main_grads is that of the reference's owned elements. With shard_params the masters live in the
// shards: the values, released, are gathered back on demand bitwise the plain AdamW's.
TEST_F(Mpi, FsdpBucketReductionsAccumulateEachMicroBatch) {
  const std::vector<Spec> specs = assorted();
  for (DType t : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    std::vector<Param> params = make_params(specs);
    DistributedAdamWOptions o;
    o.bucket_ends = {1, 2, 5, 6, 7};  // the embedding, a norm, a "unit" of three, two more alone
    o.grad_dtype = o.comm_dtype = t;
    DistributedAdamW opt(pointers(params), {}, world, o);
    const int micro = 2;
    opt.zero_shard_grads();
    for (int m = 0; m < micro; ++m) {
      for (size_t i = 0; i < params.size(); ++i) {
        Tensor h = Tensor::empty(params[i].grad.shape(), DType::f32, MemCategory::other);
        for (int64_t k = 0; k < h.numel(); ++k) h.data<float>()[k] = grad_at(me, m, i, k);
        params[i].grad.copy_from(h);
      }
      for (size_t b = 0; b < o.bucket_ends.size(); ++b) opt.reduce_bucket(b);
    }
    opt.finish_main_grads();
    // The reference: per bucket, this rank's owned elements [me * shard, (me + 1) * shard) of the padded bucket.
    double want = 0;
    size_t first = 0;
    for (size_t end : o.bucket_ends) {
      int64_t n = 0;
      for (size_t i = first; i < end; ++i) n += params[i].value.numel();
      const int64_t shard = (n + P - 1) / P;
      int64_t at = 0;
      for (size_t i = first; i < end; ++i) {
        for (int64_t k = 0; k < params[i].value.numel(); ++k, ++at) {
          if (at < me * shard || at >= (me + 1) * shard) continue;
          float acc = 0;
          for (int m = 0; m < micro; ++m) {
            float sum = 0;
            for (int q = 0; q < P; ++q) {
              const float g = grad_at(q, m, i, k);
              sum = t == DType::bf16 ? bf16_to_float(float_to_bf16((q ? sum : 0.0f) + bf16_to_float(float_to_bf16(g))))
                                     : (q ? sum + g : g);
            }
            acc = t == DType::bf16 ? bf16_to_float(float_to_bf16(acc + sum)) : acc + sum;
          }
          want += static_cast<double>(acc) * acc;
        }
      }
      first = end;
    }
    EXPECT_NEAR(opt.shard_grad_sq(), want, 1e-12 * want);
  }
  {  // shard_params: the values released between uses, gathered on demand
    std::vector<Param> dist = make_params(specs), ref = make_params(specs);
    DistributedAdamWOptions o;
    o.bucket_ends = {1, 2, 5, 6, 7};
    o.shard_params = true;
    const AdamWConfig cfg = clipped_config();
    DistributedAdamW opt(pointers(dist), cfg, world, o);
    AdamW plain(ref, cfg);
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < dist.size(); ++i) {
        Tensor d = Tensor::empty(dist[i].grad.shape(), DType::f32, MemCategory::other);
        Tensor r = Tensor::empty(ref[i].grad.shape(), DType::f32, MemCategory::other);
        for (int64_t k = 0; k < d.numel(); ++k) {
          d.data<float>()[k] = grad_at(me, step, i, k);
          float acc = grad_at(0, step, i, k);
          for (int q = 1; q < P; ++q) acc += grad_at(q, step, i, k);
          r.data<float>()[k] = acc;
        }
        dist[i].grad.copy_from(d);
        ref[i].grad.copy_from(r);
      }
      opt.zero_shard_grads();
      for (size_t b = 0; b < o.bucket_ends.size(); ++b) opt.reduce_bucket(b);
      std::vector<double> sq = {opt.shard_grad_sq()};
      all_reduce_sum(sq, world);
      for (size_t i = 2; i < 5; ++i) dist[i].value.release_storage();  // the "unit", released
      opt.step(1e-2f, optim::clip_scale_for(std::sqrt(sq[0]), cfg.clip_grad));
      plain.step(1e-2f, std::sqrt(sq[0]));
      EXPECT_FALSE(dist[3].value.resident());
      for (size_t i = 2; i < 5; ++i) dist[i].value.reacquire_storage();
      opt.post_gather(2);
      opt.wait_gather(2);
      for (size_t i = 0; i < dist.size(); ++i)
        EXPECT_EQ(bitwise_diff(dist[i].value, ref[i].value), "") << "step " << step + 1 << ": " << dist[i].name;
    }
  }
}

TEST_F(Mpi, ParamsBitwiseEqualPlainAdamWOnSummedGradients) {
  for (int64_t bucket : {int64_t{1}, int64_t{64}, kDefaultBucket}) {
    Harness h(world, clipped_config(), bucket, assorted());
    for (int s = 1; s <= 3; ++s) {
      const double norm = h.step(s, 1e-2f);
      EXPECT_LT(optim::clip_scale_for(norm, 1.0f), 1.0f) << "the test should exercise clipping";
      h.expect_params_match("bucket " + std::to_string(bucket) + ", step " + std::to_string(s));
    }
    EXPECT_EQ(h.opt_->steps_taken(), 3);
    const int64_t want_buckets = bucket == 1 ? 7 : bucket == 64 ? 4 : 1;  // 150 | 7+1+15+13 | 32 | 33
    EXPECT_EQ(h.opt_->num_buckets(), want_buckets) << "bucket " << bucket;
  }
}

// The overlapped forms (--overlap-grad-reduce, --overlap-param-gather): gradients declared ready one by one in
// backward order (some never: finish takes them), the gathers left in flight and the parameters waited for in forward
// order, some only by finish_param_gather; every step bitwise equal to plain AdamW, as the blocking forms are. Misuse
// fails naming it.
TEST_F(Mpi, OverlappedReductionAndGatherBitwiseEqualPlainAdamW) {
  for (int64_t bucket : {int64_t{1}, int64_t{64}, kDefaultBucket}) {
    Harness h(world, clipped_config(), bucket, assorted(), /*overlap=*/true);
    const size_t n = h.dist_.size();
    for (int s = 1; s <= 3; ++s) {
      const std::string when = "bucket " + std::to_string(bucket) + ", step " + std::to_string(s);
      if (s > 1)  // the previous step's gathers: forward reads the parameters from the first, skipping the last
        for (size_t i = 0; i + 1 < n; ++i) h.opt_->wait_param(i);
      h.set_grads(s);
      h.opt_->begin_grad_reduction();
      for (size_t i = n; i-- > 1;) h.opt_->grad_ready(i);  // parameter 0 never declared: finish takes it
      h.opt_->finish_grad_reduction();
      std::vector<double> sq = {h.opt_->shard_grad_sq()};
      all_reduce_sum(sq, world);
      const double norm = std::sqrt(sq[0]);
      h.opt_->step(1e-2f, optim::clip_scale_for(norm, 1.0f), /*gather_later=*/true);
      EXPECT_TRUE(h.opt_->param_gather_pending() || world.size() == 1 || n == 0) << when;
      h.plain_.step(1e-2f, norm);
      h.opt_->finish_param_gather();
      EXPECT_FALSE(h.opt_->param_gather_pending()) << when;
      h.expect_params_match(when);
    }
  }
  Harness plain(world, clipped_config(), 64, assorted());
  testing::expect_error([&] { plain.opt_->begin_grad_reduction(); }, {"DistributedAdamWOptions::overlap"});
  Harness h(world, clipped_config(), 64, assorted(), true);
  testing::expect_error([&] { h.opt_->grad_ready(0); }, {"outside begin/finish_grad_reduction"});
  h.set_grads(1);
  h.opt_->begin_grad_reduction();
  h.opt_->grad_ready(1);
  testing::expect_error([&] { h.opt_->grad_ready(1); }, {"declared ready twice"});
  h.opt_->finish_grad_reduction();
}

// The partial distributed optimizer (Megatron's --num-distributed-optimizer-instances): with every n dividing P above
// 1, the state sharded over P/n ranks and the shards all-reduced over the instances, blocking and overlapped (some
// all-reduces posted during the reduction, the rest by finish), several bucket sizes: parameters bitwise equal to
// plain AdamW on the instance-ordered sum (n = P: the plain rank-ordered sum), the moments gathered within one
// instance equal plain AdamW's, and the state is 1/(P/n) of it.
TEST_F(Mpi, InstancesBitwiseEqualPlainAdamWOnInstanceSums) {
  for (int n = 2; n <= P; ++n) {
    if (P % n != 0) continue;
    for (int64_t bucket : {int64_t{1}, int64_t{64}, kDefaultBucket})
      for (bool overlap : {false, true}) {
        const std::string when =
            "n " + std::to_string(n) + ", bucket " + std::to_string(bucket) + (overlap ? ", overlapped" : "");
        Harness h(world, clipped_config(), bucket, assorted(), overlap, n);
        EXPECT_EQ(h.opt_->group().size(), P / n) << when;
        EXPECT_EQ(h.opt_->instances().size(), n) << when;
        const size_t count = h.dist_.size();
        for (int s = 1; s <= 3; ++s) {
          if (!overlap) {
            h.step(s, 1e-2f);
          } else {
            h.set_grads(s);
            h.opt_->begin_grad_reduction();
            for (size_t i = count; i-- > 1;) h.opt_->grad_ready(i);  // parameter 0 left to finish
            h.opt_->finish_grad_reduction();
            std::vector<double> sq = {h.opt_->shard_grad_sq()};
            all_reduce_sum(sq, h.g_);
            const double norm = std::sqrt(sq[0]);
            h.opt_->step(1e-2f, optim::clip_scale_for(norm, 1.0f), /*gather_later=*/true);
            h.plain_.step(1e-2f, norm);
            h.opt_->finish_param_gather();
          }
          h.expect_params_match(when + ", step " + std::to_string(s));
        }
        std::vector<Tensor> m, v;
        h.opt_->gather_state(m, v);
        for (size_t i = 0; i < m.size(); ++i) {
          EXPECT_EQ(bitwise_diff(m[i], h.plain_.exp_avg()[i]), "") << when << " exp_avg " << h.ref_[i].name;
          EXPECT_EQ(bitwise_diff(v[i], h.plain_.exp_avg_sq()[i]), "") << when << " exp_avg_sq " << h.ref_[i].name;
        }
        int64_t numel = 0;
        for (const Param& p : h.ref_) numel += p.value.numel();
        EXPECT_GE(h.opt_->shard_elems() * (P / n), numel) << when;
        EXPECT_LE(h.opt_->shard_elems() * (P / n), numel + h.opt_->num_buckets() * (P / n)) << when;
      }
  }
}

TEST_F(Mpi, ShardSquaresSumToGlobalNorm) {
  for (int64_t bucket : {int64_t{1}, int64_t{64}, kDefaultBucket}) {
    Harness h(world, clipped_config(), bucket, assorted());
    h.set_grads(1);
    h.opt_->reduce_scatter_grads();
    std::vector<double> sq = {h.opt_->shard_grad_sq()};
    all_reduce_sum(sq, world);
    const double want = std::pow(grad_norm(h.ref_), 2);
    EXPECT_LE(std::abs(sq[0] - want), 1e-12 * want) << "bucket " << bucket << ": " << sq[0] << " vs " << want;
  }
}

TEST_F(Mpi, Bf16StateBitwiseEqualPlainAdamW) {
  AdamWConfig cfg = clipped_config();
  cfg.state_dtype = DType::bf16;
  for (float clip : {1.0f, 0.0f}) {
    cfg.clip_grad = clip;
    Harness h(world, cfg, 64, assorted());
    for (int s = 1; s <= 3; ++s) {
      h.step(s, 1e-2f);
      h.expect_params_match("clip " + std::to_string(clip) + ", step " + std::to_string(s));
    }
  }
}

TEST_F(Mpi, GatheredStateEqualsPlainMomentsAndLoadsIntoFreshInstance) {
  for (DType state : {DType::f32, DType::bf16}) {
    AdamWConfig cfg = clipped_config();
    cfg.state_dtype = state;
    Harness h(world, cfg, 64, assorted());
    for (int s = 1; s <= 3; ++s) h.step(s, 1e-2f);
    std::vector<Tensor> m, v;
    h.opt_->gather_state(m, v);
    ASSERT_EQ(m.size(), h.ref_.size());
    ASSERT_EQ(v.size(), h.ref_.size());
    for (size_t i = 0; i < m.size(); ++i) {
      EXPECT_EQ(bitwise_diff(m[i], h.plain_.exp_avg()[i]), "") << dtype_name(state) << " exp_avg " << h.ref_[i].name;
      EXPECT_EQ(bitwise_diff(v[i], h.plain_.exp_avg_sq()[i]), "")
          << dtype_name(state) << " exp_avg_sq " << h.ref_[i].name;
    }

    // A restart: fresh parameters holding the saved values, a fresh optimizer loading the moments.
    std::vector<Param> fresh = make_params(assorted());
    for (size_t i = 0; i < fresh.size(); ++i) fresh[i].value.copy_from(h.dist_[i].value);
    DistributedAdamW opt(pointers(fresh), cfg, world, DistributedAdamWOptions{64});
    opt.load_state(m, v);
    opt.set_steps_taken(h.opt_->steps_taken());
    h.set_grads(4);
    for (size_t i = 0; i < fresh.size(); ++i) fresh[i].grad.copy_from(h.dist_[i].grad);
    opt.reduce_scatter_grads();
    std::vector<double> sq = {opt.shard_grad_sq()};
    all_reduce_sum(sq, world);
    const double norm = std::sqrt(sq[0]);
    opt.step(1e-2f, optim::clip_scale_for(norm, cfg.clip_grad));
    h.plain_.step(1e-2f, norm);
    for (size_t i = 0; i < fresh.size(); ++i)
      EXPECT_EQ(bitwise_diff(fresh[i].value, h.ref_[i].value), "") << dtype_name(state) << " " << fresh[i].name;
  }
}

TEST_F(Mpi, FirstNonfiniteGradNamesTheParam) {
  Harness h(world, clipped_config(), 64, assorted());
  h.set_grads(1);
  h.opt_->reduce_scatter_grads();
  EXPECT_EQ(h.opt_->first_nonfinite_grad(), "");
  const size_t bad = 4;  // decoder.layers.0.self_attention.linear_qkv.bias
  for (float poison : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    h.set_grads(1);
    if (me == P - 1) {
      Tensor g = testing::host(h.dist_[bad].grad).clone();
      g.data<float>()[5] = poison;
      h.dist_[bad].grad.copy_from(g);
    }
    h.opt_->reduce_scatter_grads();
    const std::string name = h.opt_->first_nonfinite_grad();
    // The element lives in exactly one rank's shard; an all-reduced flag lets every rank agree to skip.
    EXPECT_EQ(sum_over_ranks(name.empty() ? 0 : 1), 1);
    EXPECT_EQ(sum_over_ranks(name == h.dist_[bad].name ? 1 : 0), 1) << "rank " << me << " named '" << name << "'";
  }
}

TEST_F(Mpi, MismatchedParamsThrowOnEveryRankNamingTheParam) {
  auto expect_throw = [&](std::vector<Spec> specs, const std::string& part) {
    std::vector<Param> ps = make_params(specs);
    try {
      DistributedAdamW opt(pointers(ps), clipped_config(), world);
      ADD_FAILURE() << "no error; expected one mentioning " << part;
    } catch (const Error& e) {
      EXPECT_HAS(std::string(e.what()), part);
      EXPECT_HAS(std::string(e.what()), "rank");
    }
  };
  std::vector<Spec> transposed = assorted();
  if (me == 1) transposed[3].shape = {5, 3};  // same element count, another shape
  expect_throw(transposed, "decoder.layers.0.self_attention.linear_qkv.weight");
  std::vector<Spec> longer = assorted();
  if (me == P - 1) longer[4].shape = {14};
  expect_throw(longer, "decoder.layers.0.self_attention.linear_qkv.bias");
  std::vector<Spec> fewer = assorted();
  if (me == 0) fewer.pop_back();
  expect_throw(fewer, "parameters");
  // The group is still usable afterwards.
  Harness h(world, clipped_config(), 64, assorted());
  h.step(1, 1e-2f);
  h.expect_params_match("after the mismatches");
}

TEST_F(Mpi, StateBytesAreAboutOneOverP) {
  const std::vector<Spec> specs = {{"w1", {100, 100}, true}, {"b1", {100}, false}, {"w2", {64, 99}, true}};
  for (DType state : {DType::f32, DType::bf16}) {
    AdamWConfig cfg;
    cfg.state_dtype = state;
    std::vector<Param> ref = make_params(specs), dist = make_params(specs);
    const int64_t before = memory_stats().current[static_cast<int>(MemCategory::optimizer_state)];
    AdamW plain(ref, cfg);
    const int64_t plain_bytes = memory_stats().current[static_cast<int>(MemCategory::optimizer_state)] - before;
    int64_t numel = 0;
    for (const Param& p : ref) numel += p.value.numel();
    EXPECT_EQ(plain_bytes, numel * plain.state_bytes_per_param());
    DistributedAdamW opt(pointers(dist), cfg, world);
    const int64_t dist_bytes =
        memory_stats().current[static_cast<int>(MemCategory::optimizer_state)] - before - plain_bytes;
    EXPECT_EQ(dist_bytes, opt.state_bytes()) << "moments must be accounted as optimizer_state";
    EXPECT_EQ(opt.state_bytes(), 2 * opt.shard_elems() * static_cast<int64_t>(dtype_size(state)));
    // At most one padding element per rank and bucket on top of the exact 1/P share.
    EXPECT_GE(opt.state_bytes() * P, plain_bytes);
    EXPECT_LE(opt.state_bytes() * P, plain_bytes + opt.num_buckets() * P * plain.state_bytes_per_param());
    EXPECT_EQ(sum_over_ranks(opt.shard_elems()), P * opt.shard_elems()) << "every rank holds an equal share";
  }
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing_mpi::run_mpi_tests(argc, argv, 30);
}
