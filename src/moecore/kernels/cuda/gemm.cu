// CUDA GEMMs. gemm / gemm_batched run cuBLAS (cublasGemmEx / cublasGemmStridedBatchedEx, CUBLAS_COMPUTE_32F: f32
// accumulation, no TF32). cuBLAS is column-major, so a row-major C [M, N] = op(A) op(B) is computed as the
// column-major C^T [N, M] = op(B)^T op(A)^T: B is passed first with B's transpose flag, then A with A's, and every
// leading dimension is the tensor's row stride. cuBLAS multiplies f32, bf16 or f16 (CUDA_R_16F) operands into c of
// their own dtype or f32, and has no mixed product such as f32 x f32 -> bf16 or bf16 x bf16 -> f16, so such a c is
// computed in an f32 workspace and rounded once (as the CPU backend does).
// gemm_grouped / gemm_grouped_wgrad: on Hopper, bf16 and f16 go to CUTLASS's tensor-core grouped GEMM
// (grouped_gemm_sm90.h); everything else (f32, other architectures, unaligned strides, a build without CUTLASS) runs a
// tiled SIMT grouped GEMM of moecore's own (64 x 64 tiles, f32 FMA accumulation, bf16 and f16 widened on load) that
// reads group_rows on the device: a one-thread plan kernel turns the counts into row offsets and tile prefix sums,
// and each CTA finds its group by binary search in those. No host read, no per-group launch on either path.
#include <cublas_v2.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "moecore/kernels/cuda/cuda_util.cuh"
#include "moecore/kernels/cuda/grouped_gemm_sm90.h"

namespace moecore::ops::cuda {
namespace {

// cuBLAS is opened on the first GEMM on a GPU, not linked: loading libcublasLt relocates ~200 MB of its data, which
// every process that never touches a GPU (a checkpoint converter, a CPU training run) would otherwise carry in its
// resident set. Its directory is searched first as the loader would (RUNPATH, LD_LIBRARY_PATH), then where the
// toolkit that built moecore keeps it.
struct Cublas {
  decltype(&::cublasCreate_v2) create;
  decltype(&::cublasSetStream_v2) set_stream;
  decltype(&::cublasGemmEx_64) gemm;
  decltype(&::cublasGemmStridedBatchedEx_64) gemm_batched;
  decltype(&::cublasGetStatusName) status_name;
  decltype(&::cublasGetStatusString) status_string;
};

#define MOECORE_STR2(x) #x
#define MOECORE_STR(x) MOECORE_STR2(x)

const char* const kCublasName = "libcublas.so." MOECORE_STR(CUBLAS_VER_MAJOR);

// cuBLAS through the loader (LD_LIBRARY_PATH, then the ldconfig cache), then from the toolkit moecore was built with;
// null with *why naming where it was looked for.
void* open_cublas_library(std::string* why) {
  void* lib = ::dlopen(kCublasName, RTLD_NOW | RTLD_LOCAL);
  if (lib) return lib;
  const char* first = ::dlerror();
  const std::string loader_error = first ? first : "";
  std::string where = "the loader path (LD_LIBRARY_PATH=";
  const char* ld = std::getenv("LD_LIBRARY_PATH");
  where += ld && *ld ? ld : "(unset)";
  where += ", then the ldconfig cache)";
#ifdef MOECORE_CUDA_LIBRARY_DIR
  lib = ::dlopen((std::string(MOECORE_CUDA_LIBRARY_DIR) + "/" + kCublasName).c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib) return lib;
  where += " and " MOECORE_CUDA_LIBRARY_DIR " (the toolkit of the build)";
#endif
  *why = std::string(kCublasName) + " (cuBLAS) was not found on " + where + ": " + loader_error +
         "; on a machine with PyTorch it is in <site-packages>/nvidia/cu13/lib or nvidia/cublas/lib: add that folder "
         "to LD_LIBRARY_PATH";
  return nullptr;
}

Cublas open_cublas(const Launch& l) {
  std::string why;
  void* lib = open_cublas_library(&why);
  const std::string name = kCublasName;
  if (!lib) l.fail(("dlopen " + name).c_str(), "cuBLAS not found", why.c_str());
  const auto sym = [&](const char* symbol) {
    void* f = ::dlsym(lib, symbol);
    if (!f)
      l.fail(("dlsym " + name).c_str(), symbol, "symbol missing (a cuBLAS older than the one moecore was built with?)");
    return f;
  };
  Cublas api{};
  api.create = reinterpret_cast<decltype(api.create)>(sym("cublasCreate_v2"));
  api.set_stream = reinterpret_cast<decltype(api.set_stream)>(sym("cublasSetStream_v2"));
  api.gemm = reinterpret_cast<decltype(api.gemm)>(sym("cublasGemmEx_64"));
  api.gemm_batched = reinterpret_cast<decltype(api.gemm_batched)>(sym("cublasGemmStridedBatchedEx_64"));
  api.status_name = reinterpret_cast<decltype(api.status_name)>(sym("cublasGetStatusName"));
  api.status_string = reinterpret_cast<decltype(api.status_string)>(sym("cublasGetStatusString"));
  return api;  // the library stays open for the process
}

const Cublas& cublas(const Launch& l) {
  static const Cublas api = open_cublas(l);  // a failed open throws and is retried by the next caller
  return api;
}

void check_cublas(const Launch& l, cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    l.fail(call, cublas(l).status_name(s), cublas(l).status_string(s));
}

// One cuBLAS handle per device and host thread (a handle must not be used by two threads at once), created on first
// use and kept for the process; cuBLAS's default workspace pool serves it.
cublasHandle_t cublas_handle(const Launch& l) {
  int device = 0;
  l.check(cudaGetDevice(&device), "cudaGetDevice");
  thread_local std::map<int, cublasHandle_t> handles;
  cublasHandle_t& h = handles[device];
  if (!h) check_cublas(l, cublas(l).create(&h), "cublasCreate");
  check_cublas(l, cublas(l).set_stream(h, l.stream()), "cublasSetStream");
  return h;
}

cudaDataType_t cuda_type(DType t) {
  return t == DType::bf16 ? CUDA_R_16BF : t == DType::f16 ? CUDA_R_16F : CUDA_R_32F;
}

// A row-major [G, rows, cols] operand with a unit last stride.
struct Mat {
  void* p;
  DType t;
  int64_t rows, cols, ld, batch;
};
Mat mat_of(const Tensor& x) {
  const int d = x.dim();
  const int64_t rows = x.size(d - 2), cols = x.size(d - 1);
  // A single row's stride is never used to address memory; cuBLAS still wants ld >= the column count.
  const int64_t ld = rows == 1 ? std::max(x.stride(d - 2), cols) : x.stride(d - 2);
  return {x.device_ptr(), x.dtype(), rows, cols, ld, d == 3 ? x.stride(0) : 0};
}

// c = beta * c (beta = 0 writes zeros, reading nothing) or c = src (convert), over [G, M, N] strided views.
template <class TD, class TS>
__global__ void copy_scaled_kernel(TD* dst, int64_t dg, int64_t dr, const TS* src, int64_t sg, int64_t sr, int64_t G,
                                   int64_t M, int64_t N, float scale, bool zero) {
  MOECORE_GRID_STRIDE(i, G * M * N) {
    const int64_t g = i / (M * N), m = (i / N) % M, n = i % N;
    st(dst[g * dg + m * dr + n], zero ? 0.0f : scale * ld(src[g * sg + m * sr + n]));
  }
}

template <class TD, class TS>
void copy_scaled(const Launch& l, const Mat& dst, const Mat& src, int64_t G, float scale, bool zero) {
  const int64_t n = G * dst.rows * dst.cols;
  copy_scaled_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(static_cast<TD*>(dst.p), dst.batch, dst.ld,
                                                               static_cast<const TS*>(src.p), src.batch, src.ld, G,
                                                               dst.rows, dst.cols, scale, zero);
  l.launched("copy_scaled_kernel");
}

void copy_mat(const Launch& l, const Mat& dst, const Mat& src, int64_t G, float scale, bool zero) {
  with_float_type(dst.t, [&](auto td) {
    with_float_type(src.t, [&](auto ts) { copy_scaled<decltype(td), decltype(ts)>(l, dst, src, G, scale, zero); });
  });
}

void cublas_gemm(const Launch& l, const Mat& c, const Mat& a, bool ta, const Mat& b, bool tb, int64_t K, float alpha,
                 float beta, int64_t G) {
  cublasHandle_t h = cublas_handle(l);
  const cublasOperation_t op_a = ta ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (G == 1) {
    check_cublas(
        l,
        cublas(l).gemm(h, op_b, op_a, c.cols, c.rows, K, &alpha, b.p, cuda_type(b.t), b.ld, a.p, cuda_type(a.t), a.ld,
                       &beta, c.p, cuda_type(c.t), c.ld, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx_64");
    l.enqueued("cublasGemmEx_64");
    return;
  }
  check_cublas(l,
               cublas(l).gemm_batched(h, op_b, op_a, c.cols, c.rows, K, &alpha, b.p, cuda_type(b.t), b.ld, b.batch, a.p,
                                      cuda_type(a.t), a.ld, a.batch, &beta, c.p, cuda_type(c.t), c.ld, c.batch, G,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx_64");
  l.enqueued("cublasGemmStridedBatchedEx_64");
}

void run_gemm(const Launch& l, Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta,
              int64_t G) {
  const Mat mc = mat_of(c), ma = mat_of(a), mb = mat_of(b);
  const int64_t K = ta ? ma.rows : ma.cols;
  if (mc.rows == 0 || mc.cols == 0 || G == 0) return;
  if (K == 0) {  // empty reduction: c = beta * c
    copy_mat(l, mc, mc, G, beta, beta == 0.0f);
    return;
  }
  if (c.dtype() != DType::f32 && c.dtype() != a.dtype()) {
    WorkspaceCarver w;
    w.reserve<float>(G * mc.rows * mc.cols);
    w.allocate(l);
    const Mat acc{w.take<float>(G * mc.rows * mc.cols), DType::f32, mc.rows, mc.cols, mc.cols, mc.rows * mc.cols};
    if (beta != 0.0f) copy_mat(l, acc, mc, G, 1.0f, false);
    cublas_gemm(l, acc, ma, ta, mb, tb, K, alpha, beta, G);
    copy_mat(l, mc, acc, G, 1.0f, false);
    return;
  }
  cublas_gemm(l, mc, ma, ta, mb, tb, K, alpha, beta, G);
}

// ---- grouped GEMM ---------------------------------------------------------------------------------
constexpr int kBM = 64, kBN = 64, kBK = 16, kTM = 4, kTN = 4;  // 256 threads as 16 x 16, each 4 x 4 outputs
constexpr int kGemmThreads = (kBM / kTM) * (kBN / kTN);

struct TileAcc {
  float v[kTM][kTN];
};

// acc += As[0..kBK) x Bs[0..kBK) for this thread's 4 x 4 outputs (rows ty*4.., columns tx*4..).
__device__ __forceinline__ void tile_fma(TileAcc& acc, const float (*As)[kBM + 4], const float (*Bs)[kBN + 4], int tx,
                                         int ty) {
#pragma unroll
  for (int k = 0; k < kBK; ++k) {
    const float4 av = *reinterpret_cast<const float4*>(&As[k][ty * kTM]);
    const float4 bv = *reinterpret_cast<const float4*>(&Bs[k][tx * kTN]);
    const float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int i = 0; i < kTM; ++i)
#pragma unroll
      for (int j = 0; j < kTN; ++j) acc.v[i][j] = fmaf(ar[i], br[j], acc.v[i][j]);
  }
}

// c[r, n] = acc + beta * c[r, n] for the rows < row_end and columns < N of this thread (beta = 0 reads nothing).
template <class TC>
__device__ __forceinline__ void tile_store(const TileAcc& acc, TC* c, int64_t ldc, int64_t row0, int64_t row_end,
                                           int64_t col0, int64_t N, float beta, int tx, int ty) {
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    const int64_t r = row0 + ty * kTM + i;
    if (r >= row_end) continue;
#pragma unroll
    for (int j = 0; j < kTN; ++j) {
      const int64_t n = col0 + tx * kTN + j;
      if (n >= N) continue;
      TC& dst = c[r * ldc + n];
      st(dst, beta == 0.0f ? acc.v[i][j] : acc.v[i][j] + beta * ld(dst));
    }
  }
}

// c[seg_g] = a[seg_g] @ op(b[g]) + beta * c[seg_g]. Grid: (row tiles upper bound, column tiles).
template <class TA, class TC, bool TransB>
__global__ void __launch_bounds__(kGemmThreads)
    grouped_gemm_kernel(TC* c, int64_t ldc, const TA* a, int64_t lda, const TA* b, int64_t sbg, int64_t ldb,
                        const int64_t* offsets, const int64_t* tiles, int64_t G, int64_t N, int64_t K, float beta) {
  const int64_t t = blockIdx.x;
  if (t >= tiles[G]) return;
  const int64_t g = segment_of(tiles, G, t);
  const int64_t row0 = offsets[g] + (t - tiles[g]) * kBM, row_end = offsets[g + 1], col0 = int64_t{blockIdx.y} * kBN;
  const TA* bg = b + g * sbg;
  __shared__ __align__(16) float As[kBK][kBM + 4];
  __shared__ __align__(16) float Bs[kBK][kBN + 4];
  const int tx = threadIdx.x % (kBN / kTN), ty = threadIdx.x / (kBN / kTN);
  TileAcc acc = {};
  for (int64_t k0 = 0; k0 < K; k0 += kBK) {
    for (int i = threadIdx.x; i < kBM * kBK; i += kGemmThreads) {  // k fastest: a's rows are contiguous in k
      const int m = i / kBK, k = i % kBK;
      const int64_t r = row0 + m, kk = k0 + k;
      As[k][m] = r < row_end && kk < K ? ld(a[r * lda + kk]) : 0.0f;
    }
    for (int i = threadIdx.x; i < kBN * kBK; i += kGemmThreads) {
      const int k = TransB ? i % kBK : i / kBN, n = TransB ? i / kBK : i % kBN;
      const int64_t nn = col0 + n, kk = k0 + k;
      const bool in = nn < N && kk < K;
      Bs[k][n] = in ? ld(TransB ? bg[nn * ldb + kk] : bg[kk * ldb + nn]) : 0.0f;
    }
    __syncthreads();
    tile_fma(acc, As, Bs, tx, ty);
    __syncthreads();
  }
  tile_store(acc, c, ldc, row0, row_end, col0, N, beta, tx, ty);
}

// c[g] = a[seg_g]^T @ b[seg_g] + beta * c[g]. Grid: (column tiles, row tiles of M, G).
template <class T>
__global__ void __launch_bounds__(kGemmThreads)
    grouped_wgrad_kernel(float* c, int64_t scg, int64_t ldc, const T* a, int64_t lda, const T* b, int64_t ldb,
                         const int64_t* offsets, int64_t M, int64_t N, float beta) {
  const int64_t g = blockIdx.z, m0 = int64_t{blockIdx.y} * kBM, n0 = int64_t{blockIdx.x} * kBN;
  const int64_t r0 = offsets[g], r1 = offsets[g + 1];
  __shared__ __align__(16) float As[kBK][kBM + 4];
  __shared__ __align__(16) float Bs[kBK][kBN + 4];
  const int tx = threadIdx.x % (kBN / kTN), ty = threadIdx.x / (kBN / kTN);
  TileAcc acc = {};
  for (int64_t k0 = r0; k0 < r1; k0 += kBK) {
    for (int i = threadIdx.x; i < kBM * kBK; i += kGemmThreads) {  // m fastest: a's rows are contiguous in m
      const int k = i / kBM, m = i % kBM;
      const int64_t r = k0 + k, mm = m0 + m;
      As[k][m] = r < r1 && mm < M ? ld(a[r * lda + mm]) : 0.0f;
    }
    for (int i = threadIdx.x; i < kBN * kBK; i += kGemmThreads) {
      const int k = i / kBN, n = i % kBN;
      const int64_t r = k0 + k, nn = n0 + n;
      Bs[k][n] = r < r1 && nn < N ? ld(b[r * ldb + nn]) : 0.0f;
    }
    __syncthreads();
    tile_fma(acc, As, Bs, tx, ty);
    __syncthreads();
  }
  tile_store(acc, c + g * scg, ldc, m0, M, n0, N, beta, tx, ty);
}

}  // namespace

std::string cublas_unavailable_reason() {
  std::string why;
  return open_cublas_library(&why) ? std::string() : why;
}

void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Context& ctx) {
  const Launch l("gemm", ctx, {{"c", &c}, {"a", &a}, {"b", &b}});
  run_gemm(l, c, a, trans_a, b, trans_b, alpha, beta, 1);
}

void gemm_batched(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
                  const Context& ctx) {
  const Launch l("gemm_batched", ctx, {{"c", &c}, {"a", &a}, {"b", &b}});
  run_gemm(l, c, a, trans_a, b, trans_b, alpha, beta, c.size(0));
}

namespace {
// Once per process, when a 16-bit grouped GEMM first falls back for want of the tensor-core path (not for f32 or a
// stride it cannot take: those are the caller's choice), a one-line notice says why.
void note_simt_grouped_gemm(const Tensor& a) {
  if (a.dtype() == DType::f32) return;
  static const bool once = [] {
    if (const std::string why = sm90_grouped_unavailable_reason(); !why.empty())
      std::fprintf(stderr, "moecore: note: the experts' grouped GEMMs run on CUDA cores (SIMT), not tensor cores: %s\n",
                   why.c_str());
    return true;
  }();
  (void)once;
}
}  // namespace

void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const Tensor& group_rows, float beta,
                  const Context& ctx) {
  const Launch l("gemm_grouped", ctx, {{"c", &c}, {"a", &a}, {"b", &b}, {"group_rows", &group_rows}});
  const int64_t R = a.size(0), K = a.size(1), G = b.size(0), N = trans_b ? b.size(1) : b.size(2);
  if (R == 0 || N == 0 || G == 0) return;
  if (K > 0 && sm90_grouped_gemm(l, c, a, b, trans_b, Launch::ptr<const int64_t>(group_rows), G, beta)) return;
  note_simt_grouped_gemm(a);
  WorkspaceCarver w;
  w.reserve<int64_t>(G + 1, 2);
  w.allocate(l);
  int64_t* offsets = w.take<int64_t>(G + 1);
  int64_t* tiles = w.take<int64_t>(G + 1);
  segment_plan(l, offsets, tiles, Launch::ptr<const int64_t>(group_rows), G, R, kBM);
  MOECORE_CHECK((R + kBM - 1) / kBM + G <= 0x7fffffff && (N + kBN - 1) / kBN <= 65535, "gemm_grouped (cuda): R = ", R,
                ", G = ", G, ", N = ", N, " exceed the grid (N at most ", 65535 * kBN, ")");
  const dim3 grid(static_cast<unsigned>((R + kBM - 1) / kBM + G), static_cast<unsigned>((N + kBN - 1) / kBN));
  with_float_type(a.dtype(), [&](auto ta) {
    with_float_type(c.dtype(), [&](auto tc) {
      using TA = decltype(ta);
      using TC = decltype(tc);
      auto* kernel = trans_b ? grouped_gemm_kernel<TA, TC, true> : grouped_gemm_kernel<TA, TC, false>;
      kernel<<<grid, kGemmThreads, 0, l.stream()>>>(Launch::ptr<TC>(c), c.stride(0), Launch::ptr<const TA>(a),
                                                    a.stride(0), Launch::ptr<const TA>(b), b.stride(0), b.stride(1),
                                                    offsets, tiles, G, N, K, beta);
    });
  });
  l.launched("grouped_gemm_kernel");
}

void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const Tensor& group_rows, float beta,
                        const Context& ctx) {
  const Launch l("gemm_grouped_wgrad", ctx, {{"c", &c}, {"a", &a}, {"b", &b}, {"group_rows", &group_rows}});
  const int64_t R = a.size(0), M = a.size(1), N = b.size(1), G = c.size(0);
  if (M == 0 || N == 0 || G == 0) return;
  if (R > 0 && sm90_grouped_wgrad(l, c, a, b, Launch::ptr<const int64_t>(group_rows), G, beta)) return;
  note_simt_grouped_gemm(a);
  WorkspaceCarver w;
  w.reserve<int64_t>(G + 1, 2);
  w.allocate(l);
  int64_t* offsets = w.take<int64_t>(G + 1);
  int64_t* tiles = w.take<int64_t>(G + 1);
  segment_plan(l, offsets, tiles, Launch::ptr<const int64_t>(group_rows), G, R, kBK);
  MOECORE_CHECK(G <= 65535, "gemm_grouped_wgrad (cuda): G = ", G, " groups exceed the grid's z limit of 65535");
  MOECORE_CHECK((M + kBM - 1) / kBM <= 65535 && (N + kBN - 1) / kBN <= 0x7fffffff, "gemm_grouped_wgrad (cuda): M = ", M,
                ", N = ", N, " exceed the grid (M at most ", 65535 * kBM, ")");
  const dim3 grid(static_cast<unsigned>((N + kBN - 1) / kBN), static_cast<unsigned>((M + kBM - 1) / kBM),
                  static_cast<unsigned>(G));
  with_float_type(a.dtype(), [&](auto t) {
    using T = decltype(t);
    grouped_wgrad_kernel<T><<<grid, kGemmThreads, 0, l.stream()>>>(
        Launch::ptr<float>(c), c.stride(0), c.stride(1), Launch::ptr<const T>(a), a.stride(0), Launch::ptr<const T>(b),
        b.stride(0), offsets, M, N, beta);
  });
  l.launched("grouped_wgrad_kernel");
}

}  // namespace moecore::ops::cuda
