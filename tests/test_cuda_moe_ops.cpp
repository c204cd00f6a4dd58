// GPU tests (ctest label "gpu"): the MoE permutation, router and attention ops with CUDA kernels against the CPU
// backend, as test_cuda_ops.cpp does for the dense ops (NaN-poisoned outputs, seeded inputs, bitwise where the result
// is a selection, a count or a copy). Every test skips when no CUDA device is present.
#include "cuda_test_util.h"

namespace moecore {
namespace {
using namespace testing_cuda;

// ---- MoE permutation ----------------------------------------------------------------------------------------------
// A routing map [T, E] bool with about K experts per token from a seed; column `empty` stays empty and every ninth
// token is routed nowhere.
Tensor routing_map(int64_t T, int64_t E, int64_t K, int64_t empty, uint64_t seed) {
  Tensor m = Tensor::zeros({T, E}, DType::boolean, MemCategory::other);
  for (int64_t t = 0; t < T; ++t) {
    if (t % 9 == 4) continue;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = static_cast<int64_t>(testing::mix(seed * 7919 + t * 31 + k) % E);
      if (e != empty) m.data<bool>()[t * E + e] = true;
    }
  }
  return m;
}
int64_t routed_pairs(const Tensor& map) {
  int64_t n = 0;
  for (int64_t i = 0; i < map.numel(); ++i) n += map.data<bool>()[i] ? 1 : 0;
  return n;
}

TEST(CudaOps, MoePlanPermuteAndUnpermuteMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 301, E = 7, H = 45;
  const Tensor map_h = routing_map(T, E, 2, 3, 1800);
  const int64_t M = routed_pairs(map_h) + 5;  // padding rows past offsets[E]
  Both map = both(map_h), n = nans({E}, DType::i64), off = nans({E + 1}, DType::i64);
  Both token_rows = nans({T, E}, DType::i32), row_token = nans({M}, DType::i32);
  for (bool g : {false, true})
    ops::moe_plan(n.on(g), off.on(g), token_rows.on(g), row_token.on(g), map.on(g), ctx_of(g));
  for (const Both* b : {&n, &off, &token_rows, &row_token}) expect_bitwise(*b);
  Both probs = randn({T, E}, "probs", 1801);
  for (DType tx : kFloat)
    for (DType tr : kFloat) {
      SCOPED_TRACE(::testing::Message() << "x " << dtype_name(tx) << " rows " << dtype_name(tr));
      Both x = randn({T, H + 3}, "x", 1802, tx), rows = nans({M, H}, tr), row_probs = nans({M});
      for (bool g : {false, true})
        ops::moe_permute(rows.on(g), row_probs.on(g), x.on(g).slice(1, 0, H), probs.on(g), row_token.on(g), off.on(g),
                         ctx_of(g));
      expect_bitwise(rows);  // padding rows stay NaN on both
      expect_bitwise(row_probs);
      Tensor none;
      Both rows_only = nans({M, H}, tr);
      for (bool g : {false, true})
        ops::moe_permute(rows_only.on(g), none, x.on(g).slice(1, 0, H), none, row_token.on(g), off.on(g), ctx_of(g));
      expect_bitwise(rows_only);
      for (bool acc : {false, true}) {
        Both y = acc ? randn({T, H + 2}, "y", 1803) : nans({T, H + 2});
        for (bool g : {false, true}) {
          Tensor yv = y.on(g).slice(1, 0, H);
          ops::moe_unpermute(yv, rows.on(g), token_rows.on(g), acc, ctx_of(g));
        }
        expect_bitwise(y);  // the f32 sums in e order, one rounding each: the same bits
      }
    }
  Both values = randn({M}, "values", 1804), out = nans({T, E + 3});
  for (bool g : {false, true}) {
    Tensor ov = out.on(g).slice(1, 1, E + 1);
    ops::moe_unpermute_probs(ov, values.on(g), token_rows.on(g), ctx_of(g));
  }
  expect_bitwise(out);
}

// The CPU raises when the routed pairs exceed row_token's M rows; CUDA cannot read the map, so it cuts the plan at M
// rows and keeps it consistent (ops_cuda.h).
TEST(CudaOps, MoePlanCutsPairsPastTheRowsOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 50, E = 4;
  const Tensor map_h = routing_map(T, E, 2, -1, 1850);
  const int64_t pairs = routed_pairs(map_h), M = pairs - 9;
  Both map = both(map_h), n = nans({E}, DType::i64), off = nans({E + 1}, DType::i64);
  Both token_rows = nans({T, E}, DType::i32), row_token = nans({M}, DType::i32);
  testing::expect_error([&] { ops::moe_plan(n.cpu, off.cpu, token_rows.cpu, row_token.cpu, map.cpu, ctx_of(false)); },
                        {"moe_plan", "routed pairs"});
  ops::moe_plan(n.gpu, off.gpu, token_rows.gpu, row_token.gpu, map.gpu, ctx_of(true));
  const auto o = testing::to_vector_i64(off.gpu), c = testing::to_vector_i64(n.gpu);
  EXPECT_EQ(o[E], M);
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(o[e + 1] - o[e], c[e]);
  const Tensor tr = testing::host(token_rows.gpu), rt = testing::host(row_token.gpu);
  int64_t given = 0;
  for (int64_t i = 0; i < T * E; ++i) {
    const int32_t r = tr.data<int32_t>()[i];
    if (r < 0) continue;
    ++given;
    ASSERT_LT(r, M);
    EXPECT_EQ(rt.data<int32_t>()[r], i / E);
  }
  EXPECT_EQ(given, M);
}

TEST(CudaOps, MoeSortChunksAndChunkCountsMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t P = 3, El = 4, W = 7;
  const std::vector<int64_t> chunk = {5, 0, 2, 9, 0, 3, 11, 1, 4, 0, 0, 6};  // 41 rows
  Both cc = counts(chunk), n = nans({El}, DType::i64), off = nans({El + 1}, DType::i64);
  for (bool g : {false, true}) ops::moe_chunk_counts(n.on(g), off.on(g), cc.on(g), P, ctx_of(g));
  expect_bitwise(n);
  expect_bitwise(off);
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i32})
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " inverse " << inverse);
      Both in = both(testing::randn({48, W}, "in", 1.0f, 1900).to(t)), out = nans({50, W}, t);
      for (bool g : {false, true}) ops::moe_sort_chunks(out.on(g), in.on(g), cc.on(g), P, El, inverse, ctx_of(g));
      expect_bitwise(out);  // rows 41.. untouched on both
    }
}

// MoE ECHO: the planner (one thread, the CPU's arithmetic), the rerouting and the fold equal the CPU's bit for bit,
// for the bin packing (one slot per rank), the water-filling (two) and the debug mode's random clones.
TEST(CudaOps, MoeEchoPlanRerouteAndFoldMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t P = 4, E = 12, T = 97;
  std::vector<Tensor> maps;
  std::vector<int64_t> c(static_cast<size_t>(P * E), 0);
  for (int64_t s = 0; s < P; ++s) {
    Tensor m = routing_map(T, E, 3, -1, 2000 + static_cast<uint64_t>(s));
    for (int64_t t = 0; t < T; ++t)  // a hot expert on rank 1
      if (t % 3 != 0) m.data<bool>()[t * E + 4] = true;
    for (int64_t i = 0; i < T * E; ++i) c[static_cast<size_t>(i % E + s * E)] += m.data<bool>()[i] ? 1 : 0;
    maps.push_back(m);
  }
  Tensor counts_h = Tensor::zeros({P, E}, DType::i64, MemCategory::other);
  std::copy(c.begin(), c.end(), counts_h.data<int64_t>());
  Both counts_both = both(counts_h);
  for (int64_t Sl : {1, 2})
    for (uint64_t seed : {uint64_t{0}, uint64_t{77}}) {
      SCOPED_TRACE(::testing::Message() << "slots per rank " << Sl << " seed " << seed);
      const int64_t S = P * Sl, W = P * (E / P + Sl);
      Both se = nans({S}, DType::i64), st = nans({P, S}, DType::i64), ld = nans({2, P}, DType::i64);
      for (bool g : {false, true})
        ops::moe_echo_plan(se.on(g), st.on(g), ld.on(g), counts_both.on(g), Sl, seed, ctx_of(g));
      expect_bitwise(se);
      expect_bitwise(st);
      expect_bitwise(ld);
      for (int64_t s = 0; s < P; ++s) {
        Both map = both(maps[static_cast<size_t>(s)]), probs = randn({T, E}, "probs", 2100 + static_cast<uint64_t>(s));
        Both map2 = nans({T, W}, DType::boolean), probs2 = nans({T, W});
        for (bool g : {false, true})
          ops::moe_echo_reroute(map2.on(g), probs2.on(g), map.on(g), probs.on(g), se.on(g), st.on(g), s, Sl, ctx_of(g));
        expect_bitwise(map2);
        expect_bitwise(probs2);
        Both mf = nans({T, E}, DType::boolean), pf = nans({T, E});
        for (bool g : {false, true}) {
          ops::moe_echo_fold(mf.on(g), map2.on(g), se.on(g), Sl, ctx_of(g));
          ops::moe_echo_fold(pf.on(g), probs2.on(g), se.on(g), Sl, ctx_of(g));
        }
        expect_bitwise(mf);
        expect_bitwise(pf);
      }
    }
}

TEST(CudaOps, MoeScaleRowsAndSharedGateMatchCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> rows = {40, 0, 77, 3};  // 120 of M = 131 rows
  const int64_t M = 131, F = 300;
  uint64_t seed = 1950;
  Both group_rows = counts(rows), p = randn({M}, "p", ++seed);
  for (DType t : kFloat)
    for (bool acc : {false, true}) {
      Both act = randn({M, F}, "act", ++seed, t), a = nans({M, F}, t);
      for (bool g : {false, true}) ops::moe_scale_rows(a.on(g), act.on(g), p.on(g), group_rows.on(g), ctx_of(g));
      expect_bitwise(a);  // one f32 product, one rounding
      Both da = randn({M, F}, "da", ++seed, t), a2 = nans({M, F}, t);
      Both dp = acc ? randn({M}, "dp", ++seed) : nans({M});
      for (bool g : {false, true})
        ops::moe_scale_rows_backward(dp.on(g), da.on(g), a2.on(g), act.on(g), p.on(g), group_rows.on(g), acc,
                                     ctx_of(g));
      expect_bitwise(da);
      expect_bitwise(a2);
      expect_near(dp, 1e-5, 1e-5);
    }
  const int64_t N = 300, H = 70;
  for (DType t : kFloat) {
    Both x = randn({N, H}, "x", ++seed, t), gw = randn({H}, "g", ++seed, DType::f32, 0.2f);
    Both out = randn({N, H}, "out", ++seed), y = randn({N, H}, "y", ++seed), s = nans({N});
    for (bool g : {false, true})
      ops::moe_shared_gate_forward(y.on(g), s.on(g), x.on(g), gw.on(g), out.on(g), ctx_of(g));
    expect_near(s, 1e-5, 1e-6);
    expect_near(y, 1e-5, 1e-5);
    Both dy = randn({N, H}, "dy", ++seed), dout = nans({N, H}, t), dx = randn({N, H}, "dx", ++seed);
    Both dg = randn({H}, "dg", ++seed);
    for (bool g : {false, true})
      ops::moe_shared_gate_backward(dout.on(g), dx.on(g), dg.on(g), dy.on(g), x.on(g), gw.on(g), out.on(g),
                                    s.cpu.to_device(g ? Device::cuda : Device::cpu), ctx_of(g));
    expect_near(dout, rtol_of(t), 1e-6);
    expect_near(dx, 1e-5, 1e-5);
    expect_near(dg, 1e-4, 1e-4);
  }
}

TEST(CudaOps, EmbeddingShardMatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 400, V = 40, Vl = 13, start = 13, H = 150;
  Both ids = ints(random_ints(N, 0, V, 1960)), table = randn({Vl, H}, "table", 1961), out = nans({N, H});
  for (bool g : {false, true}) ops::embedding_forward_shard(out.on(g), ids.on(g), table.on(g), start, V, ctx_of(g));
  expect_bitwise(out);
  Both dout = randn({N, H}, "dout", 1962), dtable = randn({Vl, H}, "dtable", 1963);
  for (bool g : {false, true}) ops::embedding_backward_shard(dtable.on(g), ids.on(g), dout.on(g), start, ctx_of(g));
  expect_bitwise(dtable);
}

// ---- router --------------------------------------------------------------------------------------------------------
const DType kRouter[] = {DType::f32, DType::f64};

TEST(CudaOps, RouterGatingOpsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 67, H = 90, E = 12;
  const PhiloxKey key = philox_key(19, "cuda.router");
  uint64_t seed = 2000;
  for (DType t : kFloat) {
    Both x = randn({T, H}, "x", ++seed, t), xj = nans({T, H}, t), u = nans({T, H});
    for (bool g : {false, true}) ops::router_jitter_forward(xj.on(g), u.on(g), x.on(g), 0.01f, key, 5, ctx_of(g));
    expect_near(u, 1e-7, 0);
    expect_near(xj, rtol_of(t), 1e-7);
    Both w = randn({E, H}, "w", ++seed), bias = randn({E}, "b", ++seed), logits = nans({T, E}, DType::f64);
    for (bool g : {false, true}) ops::router_gating_f64(logits.on(g), xj.on(g), w.on(g), bias.on(g), ctx_of(g));
    expect_near(logits, 1e-6, 1e-9);
    Both dl = randn({T, E}, "dl", ++seed, DType::f64), dx = randn({T, H}, "dx", ++seed),
         dw = randn({E, H}, "dw", ++seed);
    for (bool g : {false, true})
      ops::router_gating_f64_backward(dx.on(g), dw.on(g), dl.on(g), xj.on(g), w.on(g), u.on(g), ctx_of(g));
    expect_near(dx, 1e-6, 1e-6);
    expect_near(dw, 1e-6, 1e-6);
    Both db = randn({E}, "db", ++seed);
    for (bool g : {false, true}) ops::router_gating_f64_bias_grad(db.on(g), dl.on(g), ctx_of(g));
    expect_bitwise(db);  // double sums in token order, as the CPU
  }
  Both g_in = randn({T, H}, "g", ++seed), u2 = randn({T, H}, "u", ++seed), dx2 = randn({T, H}, "dx2", ++seed);
  for (bool g : {false, true}) ops::router_jitter_backward(dx2.on(g), g_in.on(g), u2.on(g), ctx_of(g));
  expect_near(dx2, 1e-6, 1e-7);
  for (DType r : kRouter) {
    Both z = nans({T, E}, r);
    for (bool g : {false, true}) ops::router_normal_logits(z.on(g), key, 77, ctx_of(g));
    expect_near(z, 1e-6, 1e-7);
  }
  Both bias = randn({E}, "bias", ++seed), c = counts({5, 9, 7, 7, 0, 12, 7, 7, 3, 8, 6, 13});  // mean 7: ties
  for (bool g : {false, true}) ops::router_expert_bias_update(bias.on(g), c.on(g), 1e-3f, ctx_of(g));
  expect_bitwise(bias);
}

struct RouteCase {
  const char* name;
  ops::RouterRouting p;
  int64_t K;
  bool bias;
};
std::vector<RouteCase> route_cases() {
  std::vector<RouteCase> v;
  ops::RouterRouting p;
  v.push_back({"softmax after top-k", p, 3, false});
  p.pre_softmax = true;
  v.push_back({"pre-softmax", p, 3, false});
  p.num_groups = 4;
  p.group_topk = 2;
  p.group_score_k = 2;
  v.push_back({"pre-softmax, group-limited", p, 4, false});
  p = {};
  p.score_function = ops::ScoreFunction::sigmoid;
  p.scaling_factor = 2.5f;
  v.push_back({"sigmoid with expert bias and scaling", p, 3, true});
  p.num_groups = 4;
  p.group_topk = 3;
  p.group_score_k = 2;
  v.push_back({"sigmoid, group-limited with bias", p, 4, true});
  p = {};
  p.score_function = ops::ScoreFunction::sqrtsoftplus;
  v.push_back({"sqrtsoftplus", p, 2, false});
  v.push_back({"sqrtsoftplus k=1", p, 1, false});
  p = {};
  p.sinkhorn = true;
  v.push_back({"sinkhorn k=1", p, 1, false});
  v.push_back({"sinkhorn k=2", p, 2, false});
  p.training = false;
  v.push_back({"sinkhorn k=2, eval", p, 2, false});
  return v;
}

TEST(CudaOps, RouterRouteAndItsBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 203, E = 16;
  uint64_t seed = 2100;
  for (const RouteCase& rc : route_cases())
    for (DType r : kRouter) {
      SCOPED_TRACE(::testing::Message() << rc.name << " " << dtype_name(r));
      const int64_t K = rc.K;
      Both logits = randn({T, E}, "z", ++seed, r, 2.0f), bias = randn({E}, "eb", ++seed, DType::f32, 0.1f);
      Both scores = both(Tensor::zeros({T, E}, r, MemCategory::other)), idx = nans({T, K}, DType::i32);
      Both w = nans({T, K}, r), sparse = nans({T, E}, r), map = nans({T, E}, DType::boolean);
      Tensor none;
      for (bool g : {false, true})
        ops::router_route(scores.on(g), idx.on(g), w.on(g), sparse.on(g), map.on(g), logits.on(g),
                          rc.bias ? bias.on(g) : none, rc.p, ctx_of(g));
      expect_bitwise(idx);  // the selections
      expect_bitwise(map);
      expect_near(scores, 1e-5, 1e-7);
      expect_near(w, 1e-5, 1e-7);
      expect_near(sparse, 1e-5, 1e-7);
      Tensor kept_h = Tensor::empty({T, K}, DType::boolean, MemCategory::other);
      for (int64_t i = 0; i < T * K; ++i) kept_h.data<bool>()[i] = i % 7 != 3;
      Both kept = both(kept_h), dprobs = randn({T, E}, "dp", ++seed), dll = randn({T, E}, "dll", ++seed, r);
      Both dlogits = nans({T, E}, r);
      for (bool g : {false, true})
        ops::router_route_backward(dlogits.on(g), dprobs.on(g), logits.on(g), scores.on(g), idx.on(g), w.on(g),
                                   kept.on(g), dll.on(g), rc.p, 0.5f, ctx_of(g));
      expect_near(dlogits, 1e-5, 1e-6);
    }
}

// Capacity on the same sparse weights on both devices, quantised so that columns hold ties: the kept sets (ties to the
// lower token), maps, probabilities and drop counts must be identical.
TEST(CudaOps, RouterCapacityPadMapAndCountsMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 157, E = 8, K = 2;
  for (DType r : kRouter) {
    Tensor z = testing::randn({T, E}, "z", 1.0f, 2200).to(r);
    Tensor w_tmp = Tensor::empty({T, K}, r, MemCategory::other), s_tmp = Tensor::empty({T, E}, r, MemCategory::other);
    Tensor idx_h = Tensor::empty({T, K}, DType::i32, MemCategory::other);
    Tensor sparse_h = Tensor::empty({T, E}, r, MemCategory::other),
           map_h = Tensor::empty({T, E}, DType::boolean, MemCategory::other);
    Tensor none;
    ops::router_route(s_tmp, idx_h, w_tmp, sparse_h, map_h, z, none, ops::RouterRouting{}, ops::Context{});
    Tensor sq = sparse_h.to(DType::f32);
    for (int64_t i = 0; i < T * E; ++i) sq.data<float>()[i] = std::round(sq.data<float>()[i] * 8.0f) / 8.0f;
    sparse_h = sq.to(r);
    Both sparse = both(sparse_h), idx = both(idx_h);
    for (const int64_t cap : {int64_t{0}, int64_t{9}, int64_t{40}, T + 3})
      for (ops::DropPolicy policy : {ops::DropPolicy::probs, ops::DropPolicy::position})
        for (bool pad : {false, true}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(r) << " capacity " << cap << " position "
                                            << (policy == ops::DropPolicy::position) << " pad " << pad);
          const ops::RouterCapacity p{cap, policy, pad};
          Both map = both(map_h), probs = nans({T, E}), kept = nans({T, K}, DType::boolean);
          Both dropped = nans({1}, DType::i64);
          for (bool g : {false, true})
            ops::router_capacity(probs.on(g), map.on(g), kept.on(g), dropped.on(g), sparse.on(g), idx.on(g), p,
                                 ctx_of(g));
          for (const Both* b : {&probs, &map, &kept, &dropped}) expect_bitwise(*b);
        }
    Both map = both(map_h);
    for (bool g : {false, true}) ops::router_pad_map(map.on(g), 16, ctx_of(g));
    expect_bitwise(map);
    Tensor pad_h = Tensor::zeros({T}, DType::boolean, MemCategory::other);
    for (int64_t t = 0; t < T; t += 5) pad_h.data<bool>()[t] = true;
    Both padding = both(pad_h), c = counts(std::vector<int64_t>(E, 3));
    Tensor none2;
    for (bool acc : {false, true})
      for (bool with_pad : {false, true}) {
        for (bool g : {false, true})
          ops::router_map_counts(c.on(g), map.on(g), with_pad ? padding.on(g) : none2, acc, ctx_of(g));
        expect_bitwise(c);
      }
  }
}

TEST(CudaOps, RouterLossesMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t B = 3, T = 3 * 41, E = 10, K = 3;
  Tensor pad_h = Tensor::zeros({T}, DType::boolean, MemCategory::other);
  for (int64_t t = 100; t < T; t += 3) pad_h.data<bool>()[t] = true;  // the tail of sequence 1 is padding
  Both padding = both(pad_h);
  uint64_t seed = 2300;
  for (DType r : kRouter)
    for (ops::ScoreFunction sf :
         {ops::ScoreFunction::softmax, ops::ScoreFunction::sigmoid, ops::ScoreFunction::sqrtsoftplus})
      for (bool with_pad : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(r) << " score " << static_cast<int>(sf) << " pad " << with_pad);
        Tensor none;
        Both logits = randn({T, E}, "z", ++seed, r, 2.0f), scores = nans({T, E}, r), amap = nans({T, E}, r);
        Both cnt = nans({E + 1}, DType::i64);
        for (bool g : {false, true})
          ops::router_aux_scores(scores.on(g), amap.on(g), cnt.on(g), logits.on(g), with_pad ? padding.on(g) : none, sf,
                                 K, ctx_of(g));
        expect_near(scores, 1e-5, 1e-7);
        expect_bitwise(amap);
        expect_bitwise(cnt);
        ops::RouterAuxLoss p;
        p.coeffs = {0.01, 0.02, 0.03, 0.0};
        p.score_function = sf;
        p.K = K;
        p.B = B;
        p.global_steps = 2;
        // The same aux scores on both devices (the CPU's), so the losses differ only by the kernels' own rounding.
        Both dll = both(scores.cpu),
             losses = both(Tensor::zeros({ops::router_loss::count}, DType::f64, MemCategory::other));
        Both gtok = counts(std::vector<int64_t>(E, 11));
        for (bool g : {false, true})
          ops::router_aux_losses(dll.on(g), losses.on(g), gtok.on(g), amap.on(g), logits.on(g), cnt.on(g),
                                 with_pad ? padding.on(g) : none, p, ctx_of(g));
        expect_near(losses, 1e-6, 1e-12);
        expect_bitwise(gtok);
        expect_near(dll, 1e-5, 1e-9);
        for (bool g : {false, true})
          ops::router_z_loss(dll.on(g), losses.on(g), logits.on(g), with_pad ? padding.on(g) : none, 1e-3, ctx_of(g));
        for (bool g : {false, true}) ops::router_loss_weighted(losses.on(g), {0.01, 0.02, 0.03, 1e-3}, ctx_of(g));
        expect_near(losses, 1e-6, 1e-12);
        expect_near(dll, 1e-5, 1e-9);
      }
}

// ---- attention -----------------------------------------------------------------------------------------------------
// Causal S not a multiple of the 32-row tiles, GQA (R > 1), head dims of every kernel instance (including one that is
// not a multiple of 8), both dtypes, dropout off and on (the masks must be the CPU's: a different mask moves outputs
// by O(1), far outside the tolerance).
TEST(CudaOps, AttentionForwardAndBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const ops::QkvDims cases[] = {{2, 37, 2, 2, 16}, {1, 70, 1, 3, 64}, {1, 33, 2, 1, 128}, {1, 40, 1, 2, 202}};
  uint64_t seed = 2400;
  for (const ops::QkvDims& d : cases)
    for (DType t : kFloat)
      for (const float p : {0.0f, 0.3f}) {
        SCOPED_TRACE(::testing::Message() << "B " << d.B << " S " << d.S << " G " << d.G << " R " << d.R << " D " << d.D
                                          << " " << dtype_name(t) << " p " << p);
        const ops::Dropout drop{p, philox_key(23, "cuda.attn")};
        const int64_t Hq = d.q_heads();
        Both qkv = randn({d.B, d.S, d.width()}, "qkv", ++seed, t), out = nans({d.B, d.S, Hq * d.D}, t);
        Both lse = nans({d.B, Hq, d.S});
        for (bool g : {false, true}) ops::attention_forward(out.on(g), lse.on(g), qkv.on(g), d, drop, ctx_of(g));
        const double rtol = t == DType::f32 ? 1e-4 : 2e-2, atol = t == DType::f32 ? 1e-5 : 2e-2;
        expect_near(out, rtol, atol);
        expect_near(lse, 1e-5, 1e-5);
        Both dout = randn({d.B, d.S, Hq * d.D}, "dout", ++seed, t), dqkv = nans({d.B, d.S, d.width()}, t);
        for (bool g : {false, true})
          ops::attention_backward(dqkv.on(g), dout.on(g), qkv.on(g), out.cpu.to_device(g ? Device::cuda : Device::cpu),
                                  lse.cpu.to_device(g ? Device::cuda : Device::cpu), d, drop, ctx_of(g));
        expect_near(dqkv, rtol, t == DType::f32 ? 1e-4 : 5e-2);
      }
}

TEST(CudaOps, AttentionAndRoutingRepeatBitForBit) {
  SKIP_WITHOUT_GPU();
  const ops::QkvDims d{2, 75, 2, 2, 64};
  const ops::Dropout drop{0.1f, philox_key(29, "cuda.attn.repeat")};
  const ops::Context gpu = ctx_of(true);
  const Tensor qkv = testing::randn({d.B, d.S, d.width()}, "qkv", 1.0f, 2500).to_device(Device::cuda);
  const Tensor dout = testing::randn({d.B, d.S, d.q_heads() * d.D}, "dout", 1.0f, 2501).to_device(Device::cuda);
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    Tensor out = Tensor::empty({d.B, d.S, d.q_heads() * d.D}, DType::f32, MemCategory::other, Device::cuda);
    Tensor lse = Tensor::empty({d.B, d.q_heads(), d.S}, DType::f32, MemCategory::other, Device::cuda);
    Tensor dqkv = Tensor::empty({d.B, d.S, d.width()}, DType::f32, MemCategory::other, Device::cuda);
    ops::attention_forward(out, lse, qkv, d, drop, gpu);
    ops::attention_backward(dqkv, dout, qkv, out, lse, d, drop, gpu);
    std::vector<float> all = testing::to_vector(out);
    for (float v : testing::to_vector(dqkv)) all.push_back(v);
    if (run == 0)
      first = all;
    else
      EXPECT_EQ(std::memcmp(first.data(), all.data(), all.size() * sizeof(float)), 0);
  }
}

}  // namespace
}  // namespace moecore
