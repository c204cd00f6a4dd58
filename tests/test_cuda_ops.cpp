// GPU tests (ctest label "gpu"): every dense op with CUDA kernels (kernels/cuda/ops_cuda.h: GEMMs, elementwise, norms,
// RoPE, layout, biases, dropout, embedding, losses, AdamW) against the CPU backend on fresh seeded random inputs, with
// odd sizes, strided views, every float dtype (f32, bf16, f16), empty groups and padding rows. Outputs that an op
// writes start as NaN on both devices (an op that skipped an element shows it); dropout masks, copies and the
// order-fixed sums must match bit for bit, everything else within the stated tolerances. Every test skips when no CUDA
// device is present, so the label is safe to run anywhere. The MoE, router and attention ops: test_cuda_moe_ops.cpp.
#include <algorithm>

#include "cuda_test_util.h"

namespace moecore {
namespace {
using namespace testing_cuda;
// ---- GEMM ------------------------------------------------------------------------------------------------------
TEST(CudaOps, GemmMatchesCpuWithTransposesStridedViewsAndBeta) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 37, N = 29, K = 53;
  uint64_t seed = 100;
  for (DType tin : kFloat)
    for (DType tout : kFloat)
      for (int t = 0; t < 4; ++t)
        for (float beta : {0.0f, 0.5f}) {
          const bool ta = t & 1, tb = t & 2;
          SCOPED_TRACE(::testing::Message() << "in " << dtype_name(tin) << " out " << dtype_name(tout) << " ta " << ta
                                            << " tb " << tb << " beta " << beta);
          Both a = randn(ta ? Shape{K, M + 5} : Shape{M, K + 5}, "a", ++seed, tin);
          Both b = randn(tb ? Shape{N, K} : Shape{K, N}, "b", ++seed, tin);
          Both c = beta == 0.0f ? nans({M, N + 7}, tout) : randn({M, N + 7}, "c", ++seed, tout);
          for (bool g : {false, true}) {
            Tensor cv = c.on(g).slice(1, 0, N);
            ops::gemm(cv, a.on(g).slice(1, 0, ta ? M : K), ta, b.on(g), tb, 0.7f, beta, ctx_of(g));
          }
          // Only c's first N columns are written: compare the view's columns, and the rest must stay as they were.
          const Tensor gh = testing::host(c.gpu);
          EXPECT_TENSOR_NEAR(gh.slice(1, 0, N).clone(), c.cpu.slice(1, 0, N).clone(), rtol_of(tout), 2e-6 * K);
          if (beta != 0.0f) {
            const Tensor rest_g = gh.slice(1, N, N + 7).clone(), rest_c = c.cpu.slice(1, N, N + 7).clone();
            EXPECT_EQ(std::memcmp(rest_g.raw(), rest_c.raw(), static_cast<size_t>(rest_c.nbytes())), 0);
          }
        }
}

TEST(CudaOps, GemmBatchedMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t G = 3, M = 17, N = 23, K = 31;
  uint64_t seed = 200;
  for (DType tin : kFloat)
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      Both a = randn(ta ? Shape{G, K, M} : Shape{G, M, K}, "a", ++seed, tin);
      Both b = randn(tb ? Shape{G, N, K} : Shape{G, K, N}, "b", ++seed, tin);
      Both c = randn({G, M, N}, "c", ++seed);
      for (bool g : {false, true}) ops::gemm_batched(c.on(g), a.on(g), ta, b.on(g), tb, 1.3f, 1.0f, ctx_of(g));
      expect_near(c, kRtolF32, 2e-6 * K);
    }
}

// Groups with an empty one and padding rows past the sum; K and N not multiples of the 64 x 64 x 16 tiles.
TEST(CudaOps, GemmGroupedMatchesCpuWithEmptyGroupsAndPadding) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> rows = {13, 0, 131, 9};  // 153 of R = 170 rows
  const int64_t R = 170, K = 45, N = 33, G = 4, covered = 153;
  uint64_t seed = 300;
  for (DType tin : kFloat)
    for (DType tout : kFloat)
      for (bool tb : {false, true})
        for (float beta : {0.0f, 0.5f}) {
          SCOPED_TRACE(::testing::Message()
                       << "in " << dtype_name(tin) << " out " << dtype_name(tout) << " tb " << tb << " beta " << beta);
          Both a = randn({R, K + 3}, "a", ++seed, tin);
          Both b = randn(tb ? Shape{G, N, K} : Shape{G, K, N}, "b", ++seed, tin);
          Tensor c0 = testing::randn({R, N + 5}, "c", 1.0f, ++seed).to(tout);
          if (beta == 0.0f) {  // the covered rows of the view: written without being read
            Tensor cov = c0.slice(0, 0, covered).slice(1, 0, N);
            cov.fill_(std::numeric_limits<float>::quiet_NaN());
          }
          Both c = both(c0), n = counts(rows);
          for (bool g : {false, true}) {
            Tensor cv = c.on(g).slice(1, 0, N);
            ops::gemm_grouped(cv, a.on(g).slice(1, 0, K), b.on(g), tb, n.on(g), beta, ctx_of(g));
          }
          expect_near(c, rtol_of(tout), 2e-6 * K);  // padding rows and the columns past N: untouched on both
        }
}

TEST(CudaOps, GemmGroupedWgradMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> rows = {130, 0, 77, 1};  // 208 of R = 220 rows
  const int64_t R = 220, M = 27, N = 70, G = 4;
  uint64_t seed = 400;
  for (DType tin : kFloat)
    for (float beta : {0.0f, 1.0f}) {
      Both a = randn({R, M + 2}, "a", ++seed, tin);
      Both b = randn({R, N}, "b", ++seed, tin);
      Both c = beta == 0.0f ? nans({G, M, N}) : randn({G, M, N}, "c", ++seed);
      Both n = counts(rows);
      for (bool g : {false, true})
        ops::gemm_grouped_wgrad(c.on(g), a.on(g).slice(1, 0, M), b.on(g), n.on(g), beta, ctx_of(g));
      expect_near(c, kRtolF32, 2e-6 * 130);
    }
}

// The tensor-core path of both grouped GEMMs (Hopper, CUTLASS: kernels/cuda/grouped_gemm_sm90.h) against the CPU. The
// dims are 16-byte aligned so that it takes them (the two tests above use odd dims: the SIMT kernel); K is not a
// multiple of the 64-wide K tile and N not of the 128-wide tile. bf16 and f16; both transposes; c of the operands'
// dtype and f32 (dgrad); beta 0 and 0.5 (1 for wgrad); groups: empty ones, one holding every row, uneven ones, 256.
TEST(CudaOps, GroupedGemmsOnTensorCoresMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t K = 200, N = 136, M = 72;
  std::vector<std::vector<int64_t>> groups = {{0, 64, 0, 192}, {300}, {37, 1, 200, 18}, {}};
  for (int64_t g = 0; g < 256; ++g) groups.back().push_back(static_cast<int64_t>(testing::mix(7000 + g) % 10));
  uint64_t seed = 450;
  for (const std::vector<int64_t>& rows : groups) {
    const auto G = static_cast<int64_t>(rows.size());
    int64_t R = 0;
    for (int64_t r : rows) R += r;
    Both n = counts(rows);
    for (DType t : {DType::bf16, DType::f16}) {
      for (bool tb : {true, false})
        for (DType tout : {t, DType::f32}) {
          if (tb && tout == DType::f32) continue;  // (fprop writes the operands' dtype)
          for (float beta : {0.0f, 0.5f}) {
            SCOPED_TRACE(::testing::Message() << G << " groups, " << dtype_name(t) << " -> " << dtype_name(tout)
                                              << " tb " << tb << " beta " << beta);
            Both a = randn({R, K}, "a", ++seed, t), b = randn(tb ? Shape{G, N, K} : Shape{G, K, N}, "b", ++seed, t);
            Both c = beta == 0.0f ? nans({R, N}, tout) : randn({R, N}, "c", ++seed, tout);
            const std::string kernel = ops::grouped_gemm_kernel(c.gpu, a.gpu, b.gpu, tb);
            if (kernel != "tensor cores") GTEST_SKIP() << "the grouped GEMM runs on " << kernel;
            for (bool g : {false, true}) ops::gemm_grouped(c.on(g), a.on(g), b.on(g), tb, n.on(g), beta, ctx_of(g));
            expect_near(c, rtol_of(tout), 1e-5 * K);
          }
        }
      for (float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(::testing::Message() << "wgrad, " << G << " groups, " << dtype_name(t) << " beta " << beta);
        Both a = randn({R, M}, "a", ++seed, t), b = randn({R, N}, "b", ++seed, t);
        Both c = beta == 0.0f ? nans({G, M, N}) : randn({G, M, N}, "c", ++seed);
        const std::string kernel = ops::grouped_wgrad_kernel(c.gpu, a.gpu, b.gpu);
        if (kernel != "tensor cores") GTEST_SKIP() << "the grouped wgrad runs on " << kernel;
        for (bool g : {false, true}) ops::gemm_grouped_wgrad(c.on(g), a.on(g), b.on(g), n.on(g), beta, ctx_of(g));
        expect_near(c, kRtolF32, 1e-5 * 300);
      }
    }
  }
}

// ---- elementwise -----------------------------------------------------------------------------------------------
TEST(CudaOps, ElementwiseMatchCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 500;
  for (DType t : kFloat) {
    const Shape s{37, 45}, s2{37, 90};
    Both a = randn(s, "a", ++seed, t), b = randn(s, "b", ++seed, DType::f32), out = nans(s, t);
    for (bool g : {false, true}) ops::add(out.on(g), a.on(g), b.on(g), ctx_of(g));
    expect_bitwise(out);
    Both gu = randn(s2, "gate_up", ++seed, t), dout = randn(s, "dout", ++seed, t);
    // SwiGLU, and GPT-OSS's clamped quick-GEGLU with the clamp at 1 so that it binds on a good share of the inputs.
    for (const ops::GluParams& p : {ops::GluParams{}, ops::GluParams{ops::kQuickGeluAlpha, 1.0f, 1.0f}}) {
      Both y = nans(s, t), dgu = nans(s2, t);
      for (bool g : {false, true}) {
        ops::glu_forward(y.on(g), gu.on(g), p, ctx_of(g));
        ops::glu_backward(dgu.on(g), dout.on(g), gu.on(g), p, ctx_of(g));
      }
      expect_near(y, rtol_of(t), 1e-6);
      expect_near(dgu, rtol_of(t), 1e-6);
    }
    Both gy = nans(s, t), gdx = nans(s, t);
    for (bool g : {false, true}) {
      ops::gelu_forward(gy.on(g), a.on(g), ctx_of(g));
      ops::gelu_backward(gdx.on(g), dout.on(g), a.on(g), ctx_of(g));
    }
    expect_near(gy, rtol_of(t), 1e-6);
    expect_near(gdx, rtol_of(t), 1e-6);
  }
  Both x = randn({1001}, "x", ++seed);
  for (bool g : {false, true}) ops::scale(x.on(g), -0.37f, ctx_of(g));
  expect_bitwise(x);
}

TEST(CudaOps, SumSquaresAndNonfiniteFlagMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloat) {
    Both x = randn({3 * 8192 + 17}, "x", 600, t);
    Tensor acc0 = Tensor::empty({1}, DType::f64, MemCategory::other);
    acc0.data<double>()[0] = 2.5;
    Both acc = both(acc0);
    for (bool g : {false, true}) ops::sum_squares(acc.on(g), x.on(g), ctx_of(g));
    double gv = 0;
    acc.gpu.copy_to_host(&gv, 1);
    EXPECT_NEAR(gv, acc.cpu.data<double>()[0], 1e-12 * acc.cpu.data<double>()[0]);
    Both flag = both(Tensor::zeros({1}, DType::i32, MemCategory::other));
    for (bool g : {false, true}) ops::flag_nonfinite(flag.on(g), x.on(g), ctx_of(g));
    expect_bitwise(flag);
    Tensor bad = testing::randn({1000}, "bad", 1.0f, 601).to(t);
    bad.slice(0, 777, 778).fill_(std::numeric_limits<float>::infinity());
    Both xb = both(bad);
    for (bool g : {false, true}) ops::flag_nonfinite(flag.on(g), xb.on(g), ctx_of(g));
    int32_t f = 0;
    flag.gpu.copy_to_host(&f, 1);
    EXPECT_EQ(f, 1);
    expect_bitwise(flag);
  }
}

TEST(CudaOps, CountZerosMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloat) {
    Tensor h = testing::randn({3 * 8192 + 17}, "x", 1.0f, 602);
    for (int64_t i = 0; i < h.numel(); i += 97) h.data<float>()[i] = i % 2 ? -0.0f : 0.0f;
    h.data<float>()[5] = 1e-30f;  // zero once scaled by 1e-20
    Both x = both(h.to(t));
    for (float scale : {1.0f, 1e-20f}) {
      Both acc = both(Tensor::zeros({1}, DType::i64, MemCategory::other));
      for (bool g : {false, true}) ops::count_zeros(acc.on(g), x.on(g), scale, ctx_of(g));
      expect_bitwise(acc);
    }
  }
}

// ---- norms -----------------------------------------------------------------------------------------------------
TEST(CudaOps, RmsNormAndLayerNormMatchCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 700;
  for (const int64_t N : {37, 1000})
    for (const int64_t H : {45, 300})
      for (DType t : kFloat)
        for (bool acc : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "N " << N << " H " << H << " " << dtype_name(t) << " acc " << acc);
          Both x = randn({N, H}, "x", ++seed, DType::f32, 2.0f), w = randn({H}, "w", ++seed),
               b = randn({H}, "b", ++seed);
          Both y = nans({N, H}, t), rstd = nans({N}), mean = nans({N});
          for (bool g : {false, true}) ops::rmsnorm_forward(y.on(g), rstd.on(g), x.on(g), w.on(g), 1e-5f, ctx_of(g));
          expect_near(y, rtol_of(t), 1e-6);
          expect_near(rstd, kRtolF32, 0);
          Both dy = randn({N, H}, "dy", ++seed, t), dw = randn({H}, "dw", ++seed), db = randn({H}, "db", ++seed);
          Both dx = acc ? randn({N, H}, "dx", ++seed) : nans({N, H});
          for (bool g : {false, true})
            ops::rmsnorm_backward(dx.on(g), dw.on(g), dy.on(g), x.on(g), w.on(g), rstd.on(g), acc, ctx_of(g));
          expect_near(dx, 1e-4, 1e-5);
          expect_near(dw, 1e-4, 1e-5 * std::sqrt(static_cast<double>(N)));
          for (bool g : {false, true})
            ops::layernorm_forward(y.on(g), mean.on(g), rstd.on(g), x.on(g), w.on(g), b.on(g), 1e-5f, ctx_of(g));
          expect_near(y, rtol_of(t), 1e-5);
          expect_near(mean, kRtolF32, 1e-6);
          expect_near(rstd, kRtolF32, 0);
          for (bool g : {false, true})
            ops::layernorm_backward(dx.on(g), dw.on(g), db.on(g), dy.on(g), x.on(g), w.on(g), mean.on(g), rstd.on(g),
                                    acc, ctx_of(g));
          expect_near(dx, 1e-4, 1e-5);
          expect_near(dw, 1e-4, 1e-5 * std::sqrt(static_cast<double>(N)));
          expect_near(db, 1e-4, 1e-5 * std::sqrt(static_cast<double>(N)));
        }
}

// ---- rotary embeddings and layout --------------------------------------------------------------------------------
TEST(CudaOps, RopeMatchesCpuForWholeAndPartialRotation) {
  SKIP_WITHOUT_GPU();
  const ops::QkvDims d{2, 7, 2, 3, 16};
  uint64_t seed = 800;
  for (const int64_t Dr : {int64_t{16}, int64_t{12}})
    for (DType t : kFloat) {
      Both table = nans({19, Dr});
      for (bool g : {false, true}) ops::rope_table(table.on(g), 10000.0f, ctx_of(g));
      expect_near(table, 1e-6, 1e-7);
      Both qkv = randn({d.B, d.S, d.width()}, "qkv", ++seed, t);
      for (bool g : {false, true})
        ops::rope_forward(qkv.on(g), table.cpu.to_device(g ? Device::cuda : Device::cpu), d, ctx_of(g));
      expect_near(qkv, rtol_of(t), 1e-6);
      for (bool g : {false, true})
        ops::rope_backward(qkv.on(g), table.cpu.to_device(g ? Device::cuda : Device::cpu), d, ctx_of(g));
      expect_near(qkv, rtol_of(t), 1e-6);
    }
}

TEST(CudaOps, LayoutCopiesMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloat) {
    Both in = randn({5, 3, 7}, "in", 900, t), out = nans({3, 5, 7}, t);
    for (bool g : {false, true}) ops::transpose_01(out.on(g), in.on(g), ctx_of(g));
    expect_bitwise(out);
    const ops::QkvDims d{2, 3, 2, 3, 6};
    Both qkv = randn({d.B, d.S, d.width()}, "qkv", 901);
    Both packed = nans({d.B * d.S * d.G * 3, d.D}, t);
    for (bool g : {false, true}) ops::qkv_slots_gather(packed.on(g), qkv.on(g), d, 0, 3, ctx_of(g));
    expect_bitwise(packed);
    Both key = randn({d.B * d.S * d.G, d.D}, "key", 902, t);
    for (bool g : {false, true}) ops::qkv_slots_scatter(qkv.on(g), key.on(g), d, d.R, 1, ctx_of(g));
    expect_bitwise(qkv);
  }
}

// ---- biases and dropout ------------------------------------------------------------------------------------------
TEST(CudaOps, BiasOpsMatchCpuWithStridedRowsGroupsAndPadding) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> rows = {5, 0, 300, 2};  // a group longer than one 256-row chunk; 13 padding rows
  const int64_t R = 320, W = 45, G = 4;
  uint64_t seed = 1000;
  for (DType t : kFloat) {
    Both y = randn({R, W + 3}, "y", ++seed, t), bias1 = randn({W}, "b1", ++seed), bias = randn({G, W}, "b", ++seed);
    Both scale = randn({R}, "s", ++seed), n = counts(rows);
    for (bool g : {false, true}) {
      Tensor yv = y.on(g).slice(1, 0, W);
      ops::bias_add(yv, bias1.on(g), ctx_of(g));
      ops::bias_add_grouped(yv, bias.on(g), n.on(g), ctx_of(g));
      ops::bias_add_grouped_scaled(yv, bias.on(g), scale.on(g), n.on(g), ctx_of(g));
    }
    expect_near(y, rtol_of(t), 1e-6);
    Both dy = randn({R, W + 3}, "dy", ++seed, t), db1 = randn({W}, "db1", ++seed), db = randn({G, W}, "db", ++seed);
    Tensor ds0 = testing::randn({R}, "ds", 1.0f, ++seed);
    ds0.slice(0, 0, 307).fill_(std::numeric_limits<float>::quiet_NaN());  // covered rows written, padding untouched
    Both ds = both(ds0);
    for (bool g : {false, true}) {
      const Tensor dyv = dy.on(g).slice(1, 0, W);
      Tensor none;
      ops::bias_grad(db1.on(g), dyv, ctx_of(g));
      ops::bias_grad_grouped(db.on(g), dyv, n.on(g), ctx_of(g));
      ops::bias_grad_grouped_scaled(db.on(g), ds.on(g), dyv, bias.on(g), scale.on(g), n.on(g), ctx_of(g));
      ops::bias_grad_grouped_scaled(db.on(g), none, dyv, bias.on(g), scale.on(g), n.on(g), ctx_of(g));
    }
    expect_near(db1, 1e-6, 1e-6);
    expect_near(db, 1e-6, 1e-6);
    expect_near(ds, 1e-6, 1e-6);
  }
}

TEST(CudaOps, DropoutMasksMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const ops::Dropout d{0.3f, philox_key(11, "cuda.dropout")};
  for (DType t : kFloat) {
    Both x = randn({37, 53}, "x", 1100, t), y = nans({37, 53}, t);
    for (bool g : {false, true}) ops::dropout_forward(y.on(g), x.on(g), d, ctx_of(g));
    expect_bitwise(y);
    for (bool g : {false, true}) ops::dropout_backward(x.on(g), x.on(g), d, ctx_of(g));  // in place
    expect_bitwise(x);
    for (bool g : {false, true}) ops::dropout_forward(y.on(g), x.on(g), ops::Dropout{}, ctx_of(g));  // p = 0: copy
    expect_bitwise(y);
  }
}

TEST(CudaOps, BiasDropoutAddMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 37, H = 300;
  uint64_t seed = 1200;
  for (const float p : {0.0f, 0.25f})
    for (DType t : kFloat)
      for (bool with_bias : {false, true}) {
        const ops::Dropout d{p, philox_key(12, "cuda.bda")};
        Both x = randn({N, H}, "x", ++seed, t), bias = randn({H}, "b", ++seed);
        Both residual = both(Tensor::zeros({N, H}, DType::f32, MemCategory::other)), y = nans({N, H});
        Tensor none;
        for (bool g : {false, true})
          ops::bias_dropout_add(y.on(g), residual.on(g), x.on(g), with_bias ? bias.on(g) : none, d, ctx_of(g));
        expect_near(y, kRtolF32, 1e-6);
        // The masks exactly: with a zero residual, an element is 0 iff dropped.
        const auto yg = testing::to_vector(y.gpu), yc = testing::to_vector(y.cpu);
        for (size_t i = 0; i < yc.size(); ++i) ASSERT_EQ(yg[i] == 0.0f, yc[i] == 0.0f) << "element " << i;
        Both dy = randn({N, H}, "dy", ++seed), dx = nans({N, H}, t), dbias = randn({H}, "db", ++seed);
        for (bool g : {false, true})
          ops::bias_dropout_add_backward(dx.on(g), with_bias ? dbias.on(g) : none, dy.on(g), d, ctx_of(g));
        expect_bitwise(dx);
        expect_near(dbias, 1e-6, 1e-6);
      }
}

// ---- embedding and losses ----------------------------------------------------------------------------------------
TEST(CudaOps, EmbeddingMatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 500, V = 13, H = 150;  // every id repeats many times
  Both ids = ints(random_ints(N, 0, V, 1300)), table = randn({V, H}, "table", 1301);
  for (DType t : kFloat) {
    Both out = nans({N, H}, t);
    for (bool g : {false, true}) ops::embedding_forward(out.on(g), ids.on(g), table.on(g), ctx_of(g));
    expect_bitwise(out);
  }
  Both dout = randn({N, H}, "dout", 1302), dtable = randn({V, H}, "dtable", 1303);
  for (bool g : {false, true}) ops::embedding_backward(dtable.on(g), ids.on(g), dout.on(g), ctx_of(g));
  expect_bitwise(dtable);  // the same f32 additions in the same (token) order
}

TEST(CudaOps, CrossEntropyAndLossTotalsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 37, V = 1500;
  std::vector<int32_t> lab = random_ints(N, 0, V, 1400);
  lab[3] = -1;
  lab[20] = -1;
  Both labels = ints(lab);
  for (bool grad : {false, true}) {
    Both logits = randn({N, V + 9}, "logits", 1401, DType::f32, 3.0f), loss = nans({N});
    for (bool g : {false, true}) {
      Tensor z = logits.on(g).slice(1, 0, V);
      ops::softmax_cross_entropy(loss.on(g), z, labels.on(g), 0.125f, grad, ctx_of(g));
    }
    expect_near(loss, 1e-5, 1e-6);
    expect_near(logits, 1e-5, 1e-8);
    Tensor t0 = Tensor::empty({2}, DType::f64, MemCategory::other);
    t0.data<double>()[0] = 1.25;
    t0.data<double>()[1] = 3.0;
    Both totals = both(t0), loss_c = both(loss.cpu);  // the same losses on both: the sums must agree bit for bit
    for (bool g : {false, true}) ops::loss_totals(totals.on(g), loss_c.on(g), labels.on(g), ctx_of(g));
    expect_bitwise(totals);
  }
}

TEST(CudaOps, VocabParallelCrossEntropyStepsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 29, Vl = 700, P = 3, start = 700;
  std::vector<int32_t> lab = random_ints(N, 0, static_cast<int32_t>(P * Vl), 1500);
  lab[7] = -1;
  Both labels = ints(lab);
  Both logits = randn({N, Vl + 4}, "logits", 1501, DType::f32, 2.0f), stats = nans({N, 3});
  for (bool g : {false, true})
    ops::vocab_parallel_ce_stats(stats.on(g), logits.on(g).slice(1, 0, Vl), labels.on(g), start, ctx_of(g));
  expect_near(stats, 1e-5, 1e-6);
  Tensor gh = testing::randn({P, N, 3}, "gathered", 1.0f, 1502);
  for (int64_t i = 0; i < P * N; ++i) gh.data<float>()[3 * i + 1] = std::fabs(gh.data<float>()[3 * i + 1]) + 0.5f;
  Both gathered = both(gh), lse = nans({N, 2});
  for (bool g : {false, true}) ops::vocab_parallel_ce_merge(lse.on(g), gathered.on(g), labels.on(g), P * Vl, ctx_of(g));
  expect_near(lse, 1e-5, 1e-6);
  Both lse_in = both(testing::randn({N, 2}, "lse", 4.0f, 1503)), loss = nans({N});
  for (bool g : {false, true}) {
    Tensor z = logits.on(g).slice(1, 0, Vl);
    ops::vocab_parallel_ce_finish(loss.on(g), z, lse_in.on(g), labels.on(g), start, 0.5f, true, ctx_of(g));
  }
  expect_near(loss, 1e-6, 1e-6);
  expect_near(logits, 1e-5, 1e-8);
}

// ---- optimizer -------------------------------------------------------------------------------------------------
TEST(CudaOps, AdamWMatchesCpu) {
  SKIP_WITHOUT_GPU();
  ops::AdamWParams p;
  p.lr = 3e-3f;
  p.weight_decay = 0.1f;
  p.step = 3;
  p.grad_scale = 0.5f;
  for (DType t : kFloat) {
    Both param = randn({1001}, "p", 1600), grad = randn({1001}, "g", 1601);
    Tensor v0 = testing::randn({1001}, "v", 0.1f, 1603);
    for (int64_t i = 0; i < v0.numel(); ++i) v0.data<float>()[i] *= v0.data<float>()[i];  // a second moment: >= 0
    Both m = randn({1001}, "m", 1602, t, 0.1f), v = both(v0.to(t));
    for (bool g : {false, true}) ops::adamw_step(param.on(g), grad.on(g), m.on(g), v.on(g), p, ctx_of(g));
    expect_near(param, 1e-6, 1e-7);
    expect_near(m, rtol_of(t), 1e-7);
    expect_near(v, rtol_of(t), 1e-9);
  }
}

// Muon's momentum and update kernels (common/muon.h's arithmetic) and the Newton-Schulz orthogonalisation (cuBLAS's
// batched GEMMs in f32 and bf16, the norms, the casts) against the CPU, a batch of tall matrices (the transposed
// orientation) and one wide.
TEST(CudaOps, MuonMatchesCpu) {
  SKIP_WITHOUT_GPU();
  ops::MuonMomentumParams p;
  p.beta = 0.9f;
  p.grad_scale = 0.7f;
  for (bool nesterov : {false, true}) {
    p.nesterov = nesterov;
    Both u = randn({777}, "u", 1700), m = randn({777}, "m", 1701), g = randn({777}, "g", 1702);
    for (bool d : {false, true}) ops::muon_momentum(u.on(d), m.on(d), g.on(d), p, ctx_of(d));
    expect_near(m, 1e-6, 1e-7);
    expect_near(u, 1e-6, 1e-7);
  }
  Both w = randn({777}, "w", 1703), o = randn({777}, "o", 1704);
  for (bool d : {false, true}) ops::muon_update(w.on(d), o.on(d), 0.02f, 0.1f, ctx_of(d));
  expect_near(w, 1e-6, 1e-7);
  for (bool bf16 : {false, true}) {
    ops::NewtonSchulz ns;
    ns.bf16 = bf16;
    Both tall = randn({3, 48, 20}, "ns.tall", 1705), wide = randn({20, 64}, "ns.wide", 1706);
    for (bool d : {false, true}) {
      ops::newton_schulz(tall.on(d), ns, {}, ctx_of(d));
      ops::newton_schulz(wide.on(d), ns, {}, ctx_of(d));
    }
    expect_near(tall, 0.0, bf16 ? 3e-2 : 1e-5);
    expect_near(wide, 0.0, bf16 ? 3e-2 : 1e-5);
  }
}

// An f16 GEMM output beyond 65504 is ±inf on both backends (cuBLAS's f16 store must not saturate: loss scaling
// watches for the overflow), from f16 and from f32 operands, and flag_nonfinite sees it.
TEST(CudaOps, GemmF16OutputOverflowsToInfLikeCpu) {
  SKIP_WITHOUT_GPU();
  for (DType tin : {DType::f32, DType::f16}) {
    SCOPED_TRACE(dtype_name(tin));
    Tensor a32 = Tensor::zeros({4, 2}, DType::f32, MemCategory::other);
    Tensor b32 = Tensor::zeros({2, 3}, DType::f32, MemCategory::other);
    const float av[] = {2, 0, -2, 0, 0, 1, 0, 0.5f}, bv[] = {40000, 1, -1, 65504, 2, 3};
    std::copy(av, av + 8, a32.data<float>());
    std::copy(bv, bv + 6, b32.data<float>());
    Both a = both(a32.to(tin)), b = both(b32.to(tin)), c = nans({4, 3}, DType::f16);
    for (bool g : {false, true}) ops::gemm(c.on(g), a.on(g), false, b.on(g), false, 1.0f, 0.0f, ctx_of(g));
    expect_bitwise(c);
    const auto v = testing::to_vector(c.gpu);
    EXPECT_EQ(v[0], std::numeric_limits<float>::infinity());
    EXPECT_EQ(v[3], -std::numeric_limits<float>::infinity());
    EXPECT_EQ(v[6], 65504.0f);
    Both flag = both(Tensor::zeros({1}, DType::i32, MemCategory::other));
    for (bool g : {false, true}) ops::flag_nonfinite(flag.on(g), c.on(g), ctx_of(g));
    int32_t f = 0;
    flag.gpu.copy_to_host(&f, 1);
    EXPECT_EQ(f, 1);
  }
}

// ---- attention: queries as the last S of Sk keys -------------------------------------------------------------------
// Context parallelism's form: q [B, S, W] and kv a dim-1 slice of a longer tensor (batch stride > Sk * W), off = Sk - S
// not a multiple of the 32-row tiles, GQA, both dtypes, dropout off and on (the masks index the full problem's rows).
// dq and dkv's parent start random (the same on both): a slot the GPU failed to write, or a column or row outside the
// slice it wrongly wrote, differs from the CPU's. Tolerances as in test_cuda_moe_ops.cpp's attention test.
TEST(CudaOps, AttentionWithMoreKeysThanQueriesMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const ops::QkvDims d{2, 37, 2, 2, 16, 75};
  const int64_t first = 6, S_long = 90, Hq = d.q_heads();
  uint64_t seed = 2600;
  for (DType t : kFloat)
    for (const float p : {0.0f, 0.3f}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " p " << p);
      const ops::Dropout drop{p, philox_key(31, "cuda.attn.keys")};
      Both q = randn({d.B, d.S, d.width()}, "q", ++seed, t), kv = randn({d.B, S_long, d.width()}, "kv", ++seed, t);
      Both out = nans({d.B, d.S, Hq * d.D}, t), lse = nans({d.B, Hq, d.S});
      for (bool g : {false, true})
        ops::attention_forward(out.on(g), lse.on(g), q.on(g), kv.on(g).slice(1, first, first + d.Sk), d, drop,
                               ctx_of(g));
      const double rtol = t == DType::f32 ? 1e-4 : 2e-2, atol = t == DType::f32 ? 1e-5 : 2e-2;
      expect_near(out, rtol, atol);
      expect_near(lse, 1e-5, 1e-5);
      Both dout = randn({d.B, d.S, Hq * d.D}, "dout", ++seed, t), dq = randn({d.B, d.S, d.width()}, "dq", ++seed, t);
      Both dkv = randn({d.B, S_long, d.width()}, "dkv", ++seed, t);
      for (bool g : {false, true}) {
        Tensor dkv_view = dkv.on(g).slice(1, first, first + d.Sk);
        const Device dev = g ? Device::cuda : Device::cpu;
        ops::attention_backward(dq.on(g), dkv_view, dout.on(g), q.on(g), kv.on(g).slice(1, first, first + d.Sk),
                                out.cpu.to_device(dev), lse.cpu.to_device(dev), d, drop, ctx_of(g));
      }
      expect_near(dq, rtol, t == DType::f32 ? 1e-4 : 5e-2);
      expect_near(dkv, rtol, t == DType::f32 ? 1e-4 : 5e-2);
    }
}

// ---- attention sinks and sliding windows (gpt-oss) --------------------------------------------------------------
// The CUDA kernel's window (key blocks outside it skipped) and sinks (off-by-one, learnable with their gradient)
// against the CPU's, in the queries-as-the-last-S-of-Sk form, GQA, both dtypes.
TEST(CudaOps, AttentionSinksAndWindowMatchCpu) {
  SKIP_WITHOUT_GPU();
  const ops::QkvDims d{2, 37, 2, 2, 16, 75};
  const int64_t Hq = d.q_heads();
  uint64_t seed = 2700;
  Both sinks = randn({Hq}, "sinks", ++seed, DType::f32);
  for (DType t : kFloat)
    for (int64_t window : {int64_t{-1}, int64_t{5}, int64_t{40}})
      for (int sink : {0, 1, 2}) {  // none, off-by-one, learnable
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " window " << window << " sink " << sink);
        Both q = randn({d.B, d.S, d.width()}, "q", ++seed, t), kv = randn({d.B, d.Sk, d.width()}, "kv", ++seed, t);
        Both out = nans({d.B, d.S, Hq * d.D}, t), lse = nans({d.B, Hq, d.S});
        auto options = [&](bool g) {
          ops::AttentionOptions o;
          o.window = window;
          o.off_by_one = sink == 1;
          o.sinks = sink == 2 ? &sinks.on(g) : nullptr;
          return o;
        };
        for (bool g : {false, true})
          ops::attention_forward(out.on(g), lse.on(g), q.on(g), kv.on(g), d, ops::Dropout{}, options(g), ctx_of(g));
        const double rtol = t == DType::f32 ? 1e-4 : 2e-2, atol = t == DType::f32 ? 1e-5 : 2e-2;
        expect_near(out, rtol, atol);
        expect_near(lse, 1e-5, 1e-5);
        Both dout = randn({d.B, d.S, Hq * d.D}, "dout", ++seed, t), dq = randn({d.B, d.S, d.width()}, "dq", ++seed, t);
        Both dkv = randn({d.B, d.Sk, d.width()}, "dkv", ++seed, t), dsinks = randn({Hq}, "dsinks", ++seed, DType::f32);
        for (bool g : {false, true}) {
          const Device dev = g ? Device::cuda : Device::cpu;
          ops::attention_backward(dq.on(g), dkv.on(g), sink == 2 ? &dsinks.on(g) : nullptr, dout.on(g), q.on(g),
                                  kv.on(g), out.cpu.to_device(dev), lse.cpu.to_device(dev), d, ops::Dropout{},
                                  options(g), ctx_of(g));
        }
        expect_near(dq, rtol, t == DType::f32 ? 1e-4 : 5e-2);
        expect_near(dkv, rtol, t == DType::f32 ? 1e-4 : 5e-2);
        if (sink == 2) expect_near(dsinks, 1e-4, 1e-5);
      }
}

// ---- determinism and refusals -----------------------------------------------------------------
TEST(CudaOps, ReductionsRepeatBitForBit) {
  SKIP_WITHOUT_GPU();
  const ops::Context gpu = ctx_of(true);
  const Tensor dy = testing::randn({1000, 300}, "dy", 1.0f, 1700).to_device(Device::cuda);
  const Tensor x = testing::randn({1000, 300}, "x", 1.0f, 1701).to_device(Device::cuda);
  const Tensor w = testing::randn({300}, "w", 1.0f, 1702).to_device(Device::cuda);
  std::vector<float> first_db, first_dw;
  for (int run = 0; run < 2; ++run) {
    Tensor db = Tensor::zeros({300}, DType::f32, MemCategory::other, Device::cuda);
    Tensor dw = Tensor::zeros({300}, DType::f32, MemCategory::other, Device::cuda);
    Tensor y = Tensor::empty({1000, 300}, DType::f32, MemCategory::other, Device::cuda);
    Tensor dx = Tensor::empty({1000, 300}, DType::f32, MemCategory::other, Device::cuda);
    Tensor rstd = Tensor::empty({1000}, DType::f32, MemCategory::other, Device::cuda);
    ops::bias_grad(db, dy, gpu);
    ops::rmsnorm_forward(y, rstd, x, w, 1e-5f, gpu);
    ops::rmsnorm_backward(dx, dw, dy, x, w, rstd, false, gpu);
    if (run == 0) {
      first_db = testing::to_vector(db);
      first_dw = testing::to_vector(dw);
    } else {
      EXPECT_EQ(std::memcmp(first_db.data(), testing::to_vector(db).data(), 300 * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(first_dw.data(), testing::to_vector(dw).data(), 300 * sizeof(float)), 0);
    }
  }
}

// Every op has CUDA kernels now: a cuda context with a tensor left on the host is refused, naming the op and the
// tensor, before any kernel runs.
TEST(CudaOps, CpuTensorWithACudaContextIsRefusedNamingTheOp) {
  SKIP_WITHOUT_GPU();
  Tensor map = Tensor::zeros({4, 2}, DType::boolean, MemCategory::other);  // host
  Tensor counts_t = Tensor::empty({2}, DType::i64, MemCategory::other, Device::cuda);
  Tensor offsets = Tensor::empty({3}, DType::i64, MemCategory::other, Device::cuda);
  Tensor token_rows = Tensor::empty({4, 2}, DType::i32, MemCategory::other, Device::cuda);
  Tensor row_token = Tensor::empty({8}, DType::i32, MemCategory::other, Device::cuda);
  testing::expect_error([&] { ops::moe_plan(counts_t, offsets, token_rows, row_token, map, ctx_of(true)); },
                        {"moe_plan", "map", "is on cpu", "cuda"});
  const ops::QkvDims d{1, 3, 1, 1, 4};
  Tensor qkv = Tensor::zeros({1, 3, d.width()}, DType::f32, MemCategory::other, Device::cuda);
  Tensor out = Tensor::empty({1, 3, 4}, DType::f32, MemCategory::other, Device::cuda);
  Tensor lse = Tensor::empty({1, 1, 3}, DType::f32, MemCategory::other);  // host
  testing::expect_error([&] { ops::attention_forward(out, lse, qkv, d, ops::Dropout{}, ctx_of(true)); },
                        {"attention_forward", "lse", "is on cpu"});
}

}  // namespace
}  // namespace moecore
