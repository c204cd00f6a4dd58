// The MoE experts' grouped GEMMs on Hopper's tensor cores (grouped_gemm_sm90.h): CUTLASS's pointer-array grouped GEMM
// (kGrouped mode, TMA loads, WGMMA, the warp-specialised cooperative schedule, 128 x 128 x 64 tiles, f32
// accumulation, a LinearCombination epilogue for beta) in three operand layouts, all row-major tensors:
//   fprop  c[seg_g] [rows, N] = a[seg_g] [rows, K] @ b[g]^T, b[g] [N, K]: A row-major, B column-major (K-major)
//   dgrad  c[seg_g] [rows, N] = a[seg_g] [rows, K] @ b[g],   b[g] [K, N]: A row-major, B row-major
//   wgrad  c[g] [M, N] = a[seg_g]^T @ b[seg_g], a [rows, M], b [rows, N]: A column-major, B row-major, K = the rows
// A one-thread-per-group kernel writes each group's problem shape, operand pointers and strides from the device's row
// offsets (segment_plan), and the device-side problem shapes go to CUTLASS with no host copy (its scheduler reads
// them on the device). A group with no rows has an empty problem (no tiles); for wgrad its c[g] = beta * c[g] is a
// separate scaling kernel. Instantiated for what the experts call (bf16 and f16: fprop to the operands' dtype,
// dgrad to it or to f32, wgrad to f32), in this translation unit only, built for sm_90a.
#include "moecore/kernels/cuda/grouped_gemm_sm90.h"

#include <cstdio>

#ifdef MOECORE_HAVE_CUTLASS
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace moecore::ops::cuda {

#ifdef MOECORE_HAVE_CUTLASS
namespace {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;

template <class T>
struct CutlassType;  // moecore's element types as CUTLASS's (the same bits)
template <>
struct CutlassType<bf16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassType<f16> {
  using type = cutlass::half_t;
};
template <>
struct CutlassType<float> {
  using type = float;
};

// One grouped GEMM kernel: operands T (bf16 or f16) in CUTLASS layouts LA (A: M x K) and LB (B: K x N), output D
// row-major.
template <class T, class D, class LA, class LB>
struct GroupedGemm {
  using EA = typename CutlassType<T>::type;
  using ED = typename CutlassType<D>::type;
  static constexpr int kAlignAB = 16 / sizeof(EA), kAlignD = 16 / sizeof(ED);
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ED, cutlass::layout::RowMajor*, kAlignD, ED,
      cutlass::layout::RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ED, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, LA*, kAlignAB, EA, LB*, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
};

using Row = cutlass::layout::RowMajor;
using Col = cutlass::layout::ColumnMajor;
template <class T, class D>
using Fprop = GroupedGemm<T, D, Row, Col>;
template <class T, class D>
using Dgrad = GroupedGemm<T, D, Row, Row>;
template <class T>
using Wgrad = GroupedGemm<T, float, Col, Row>;

// A pointer-array stride (one dynamic leading dimension, a unit stride, no batch mode) with leading dimension ld.
template <class S>
__host__ __device__ S leading_stride(int64_t ld) {
  S s{};
  if constexpr (cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>, int64_t>)
    cute::get<0>(s) = ld;
  else
    cute::get<1>(s) = ld;
  return s;
}

// The per-group arguments CUTLASS reads on the device.
template <class Cfg>
struct GroupArrays {
  GroupShape* shapes;
  const typename Cfg::EA** a;
  const typename Cfg::EA** b;
  const typename Cfg::ED** c;
  typename Cfg::ED** d;
  typename Cfg::StrideA* sa;
  typename Cfg::StrideB* sb;
  typename Cfg::StrideC* sc;
  typename Cfg::StrideD* sd;
};

// The operands as the host passes them: base pointers, row strides (elements) and the per-group stride of the
// per-group operand (b's for gemm_grouped, c's for wgrad).
template <class Cfg>
struct Operands {
  const typename Cfg::EA* a;
  const typename Cfg::EA* b;
  typename Cfg::ED* c;
  int64_t lda, ldb, ldc, group_stride;
  int m, n, k;  // wgrad: c[g] is m x n; gemm_grouped: n and k
};

// Group g's problem and pointers from the row offsets [G + 1]. gemm_grouped: (rows, N, K), a's and c's rows of the
// group, b[g]. wgrad: (M, N, rows), a's and b's rows of the group, c[g]; an empty group gets the empty problem.
template <class Cfg, bool kWgrad>
__global__ void group_arrays_kernel(GroupArrays<Cfg> out, Operands<Cfg> op, const int64_t* offsets, int64_t G) {
  MOECORE_GRID_STRIDE(g, G) {
    const int64_t first = offsets[g];
    const int rows = static_cast<int>(offsets[g + 1] - first);
    out.a[g] = op.a + first * op.lda;
    if constexpr (kWgrad) {
      out.shapes[g] = rows > 0 ? GroupShape{op.m, op.n, rows} : GroupShape{0, op.n, 1};
      out.b[g] = op.b + first * op.ldb;
      out.d[g] = op.c + g * op.group_stride;
    } else {
      out.shapes[g] = GroupShape{rows, op.n, op.k};
      out.b[g] = op.b + g * op.group_stride;
      out.d[g] = op.c + first * op.ldc;
    }
    out.c[g] = out.d[g];
    out.sa[g] = leading_stride<typename Cfg::StrideA>(op.lda);
    out.sb[g] = leading_stride<typename Cfg::StrideB>(op.ldb);
    out.sc[g] = leading_stride<typename Cfg::StrideC>(op.ldc);
    out.sd[g] = out.sc[g];
  }
}

// wgrad's empty groups: c[g] = beta * c[g] (c contiguous [G, M, N] f32; beta 0 writes zeros).
__global__ void scale_empty_groups_kernel(float* c, const int64_t* offsets, int64_t G, int64_t MN, float beta) {
  MOECORE_GRID_STRIDE(i, G * MN) {
    const int64_t g = i / MN;
    if (offsets[g + 1] == offsets[g]) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
  }
}

// The persistent scheduler's hardware: this process's device (one per process) and its SM count.
cutlass::KernelHardwareInfo hardware() {
  static const cutlass::KernelHardwareInfo hw = [] {
    cutlass::KernelHardwareInfo h;
    if (cudaGetDevice(&h.device_id) != cudaSuccess) h.device_id = 0;
    h.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(h.device_id);
    return h;
  }();
  return hw;
}

// Runs one grouped GEMM of configuration Cfg: the row offsets, the group arrays and CUTLASS's workspace carved from one
// workspace request, then CUTLASS on the op's stream.
template <class Cfg, bool kWgrad>
void run_grouped(const Launch& l, const Operands<Cfg>& op, const int64_t* group_rows, int64_t G, int64_t R,
                 float beta) {
  using Gemm = typename Cfg::Gemm;
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(G), nullptr, nullptr};  // device shapes only: no host copy of the counts
  args.hw_info = hardware();
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = beta;
  const size_t cutlass_bytes = Gemm::get_workspace_size(args);
  WorkspaceCarver w;
  w.reserve<int64_t>(G + 1, 2);
  w.reserve<GroupShape>(G);
  w.reserve<const void*>(G, 4);
  w.reserve<typename Cfg::StrideA>(G);
  w.reserve<typename Cfg::StrideB>(G);
  w.reserve<typename Cfg::StrideC>(G);
  w.reserve<typename Cfg::StrideD>(G);
  w.reserve_bytes(cutlass_bytes);
  w.allocate(l);
  int64_t* offsets = w.take<int64_t>(G + 1);
  int64_t* tiles = w.take<int64_t>(G + 1);
  GroupArrays<Cfg> arrays{w.take<GroupShape>(G),
                          w.take<const typename Cfg::EA*>(G),
                          w.take<const typename Cfg::EA*>(G),
                          w.take<const typename Cfg::ED*>(G),
                          w.take<typename Cfg::ED*>(G),
                          w.take<typename Cfg::StrideA>(G),
                          w.take<typename Cfg::StrideB>(G),
                          w.take<typename Cfg::StrideC>(G),
                          w.take<typename Cfg::StrideD>(G)};
  void* cutlass_workspace = w.take_bytes(cutlass_bytes);
  segment_plan(l, offsets, tiles, group_rows, G, R, 1);
  group_arrays_kernel<Cfg, kWgrad><<<grid_for(G), kThreads, 0, l.stream()>>>(arrays, op, offsets, G);
  l.launched("group_arrays_kernel");
  args.problem_shape.problem_shapes = arrays.shapes;
  args.mainloop.ptr_A = arrays.a;
  args.mainloop.dA = arrays.sa;
  args.mainloop.ptr_B = arrays.b;
  args.mainloop.dB = arrays.sb;
  args.epilogue.ptr_C = arrays.c;
  args.epilogue.dC = arrays.sc;
  args.epilogue.ptr_D = arrays.d;
  args.epilogue.dD = arrays.sd;
  Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s == cutlass::Status::kSuccess) s = gemm.initialize(args, cutlass_workspace, l.stream());
  if (s == cutlass::Status::kSuccess) s = gemm.run(l.stream());
  if (s != cutlass::Status::kSuccess)
    l.fail("CUTLASS sm90 grouped GEMM", cutlass::cutlassGetStatusString(s), "(initialize or run)");
  l.enqueued("CUTLASS sm90 grouped GEMM");
  if constexpr (kWgrad) {
    if (beta != 1.0f) {
      const int64_t MN = int64_t{op.m} * op.n;
      scale_empty_groups_kernel<<<grid_for(G * MN), kThreads, 0, l.stream()>>>(op.c, offsets, G, MN, beta);
      l.launched("scale_empty_groups_kernel");
    }
  }
}

bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.device_ptr()) % 16 == 0;
}
// A 16-byte aligned base and row stride (in bytes), a unit last stride.
bool tma_operand(const Tensor& t) {
  return aligned16(t) && t.stride(-1) == 1 &&
         (t.stride(t.dim() - 2) * static_cast<int64_t>(dtype_size(t.dtype()))) % 16 == 0 &&
         (t.dim() < 3 || (t.stride(0) * static_cast<int64_t>(dtype_size(t.dtype()))) % 16 == 0);
}

bool device_is_sm90() {
  static const bool yes = [] {
    int dev = 0, major = 0, minor = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
           minor == 0;
  }();
  return yes;
}

// The reasons shared by both grouped GEMMs (null: none).
const char* declines_common(const Tensor& a, const Tensor& b, std::initializer_list<int64_t> contiguous_dims) {
  if (!device_is_sm90()) return "the device is not compute capability 9.0";
  if (a.dtype() != DType::bf16 && a.dtype() != DType::f16) return "the operands are not bf16 or f16";
  if (b.dtype() != a.dtype()) return "the operands' dtypes differ";
  if (a.size(0) > 0x7fffffff) return "more than 2^31 - 1 rows";
  for (int64_t d : contiguous_dims)
    if (d % 8 != 0 || d > 0x7fffffff) return "a contiguous dim is not a multiple of 8 elements (16 bytes)";
  if (!tma_operand(a) || !tma_operand(b)) return "an operand's base or row stride is not 16-byte aligned";
  return nullptr;
}

}  // namespace

std::string sm90_grouped_unavailable_reason() {
  return device_is_sm90() ? std::string()
                          : "the device is not compute capability 9.0 (its kernels are built for sm_90a)";
}

const char* sm90_grouped_gemm_declines(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_b) {
  const int64_t K = a.size(1), N = trans_b ? b.size(1) : b.size(2);
  if (const char* why = declines_common(a, b, {K, N})) return why;
  if (c.dtype() != a.dtype() && (c.dtype() != DType::f32 || trans_b))
    return "c is neither the operands' dtype nor f32 (f32 only with trans_b false)";
  if (!tma_operand(c)) return "c's base or row stride is not 16-byte aligned";
  return nullptr;
}

const char* sm90_grouped_wgrad_declines(const Tensor& c, const Tensor& a, const Tensor& b) {
  if (const char* why = declines_common(a, b, {a.size(1), b.size(1)})) return why;
  if (c.dtype() != DType::f32 || !c.is_contiguous() || !aligned16(c))
    return "c is not a contiguous, aligned f32 tensor";
  return nullptr;
}

bool sm90_grouped_gemm(const Launch& l, Tensor& c, const Tensor& a, const Tensor& b, bool trans_b,
                       const int64_t* group_rows, int64_t G, float beta) {
  if (sm90_grouped_gemm_declines(c, a, b, trans_b)) return false;
  const int64_t R = a.size(0), K = a.size(1), N = trans_b ? b.size(1) : b.size(2);
  with_float_type(a.dtype(), [&](auto t) {
    using T = decltype(t);
    auto go = [&](auto cfg) {
      using Cfg = decltype(cfg);
      const Operands<Cfg> op{Launch::ptr<const typename Cfg::EA>(a),
                             Launch::ptr<const typename Cfg::EA>(b),
                             Launch::ptr<typename Cfg::ED>(c),
                             a.stride(0),
                             b.stride(1),
                             c.stride(0),
                             b.stride(0),
                             0,
                             static_cast<int>(N),
                             static_cast<int>(K)};
      run_grouped<Cfg, false>(l, op, group_rows, G, R, beta);
    };
    if constexpr (!std::is_same_v<T, float>) {
      if (trans_b)
        go(Fprop<T, T>{});
      else if (c.dtype() == a.dtype())
        go(Dgrad<T, T>{});
      else
        go(Dgrad<T, float>{});
    }
  });
  return true;
}

bool sm90_grouped_wgrad(const Launch& l, Tensor& c, const Tensor& a, const Tensor& b, const int64_t* group_rows,
                        int64_t G, float beta) {
  if (sm90_grouped_wgrad_declines(c, a, b)) return false;
  const int64_t R = a.size(0), M = a.size(1), N = b.size(1);
  with_float_type(a.dtype(), [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, float>) {
      using Cfg = Wgrad<T>;
      const Operands<Cfg> op{Launch::ptr<const typename Cfg::EA>(a),
                             Launch::ptr<const typename Cfg::EA>(b),
                             Launch::ptr<float>(c),
                             a.stride(0),
                             b.stride(0),
                             c.stride(1),
                             c.stride(0),
                             static_cast<int>(M),
                             static_cast<int>(N),
                             0};
      run_grouped<Cfg, true>(l, op, group_rows, G, R, beta);
    }
  });
  return true;
}

#else  // built without CUTLASS

std::string sm90_grouped_unavailable_reason() {
  return "this build has no CUTLASS (configure with $(bash scripts/cuda-build-deps.sh), as scripts/gpu-bundle.sh does)";
}
const char* sm90_grouped_gemm_declines(const Tensor&, const Tensor&, const Tensor&, bool) {
  return "this build has no CUTLASS";
}
const char* sm90_grouped_wgrad_declines(const Tensor&, const Tensor&, const Tensor&) {
  return "this build has no CUTLASS";
}
bool sm90_grouped_gemm(const Launch&, Tensor&, const Tensor&, const Tensor&, bool, const int64_t*, int64_t, float) {
  return false;
}
bool sm90_grouped_wgrad(const Launch&, Tensor&, const Tensor&, const Tensor&, const int64_t*, int64_t, float) {
  return false;
}

#endif

}  // namespace moecore::ops::cuda
