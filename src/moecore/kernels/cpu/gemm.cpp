// CPU GEMM on oneDNN matmul primitives (f32, bf16 or f16 inputs, f32 accumulation, f32, bf16 or f16 output).
// Primitive creation costs far more than a small matmul, so primitives are cached per (shape, strides,
// dtypes, alpha, beta) and reused; model shapes are fixed after the first step, so the cache stays small.
// bf16 operands run natively where oneDNN has a bf16 matmul and the CPU's bf16 arithmetic is the faster
// (cpu_bf16_gemm: AMX, or AVX512-BF16 dot products that outrun the f32 FMAs). Elsewhere (AVX2-only hosts, and
// AVX512-BF16 CPUs whose VDPBF16PS is the slower) they are widened to f32 in reused scratch buffers and multiplied
// in f32: bf16 then saves memory, not time, and the result is the exact f32 product of the bf16 values. f16 operands
// and f16 outputs are always widened this way: oneDNN 2.6 has an f16 matmul only on AVX-512 FP16 CPUs, where nothing
// here could test it.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>

#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/cpu_isa.h"
#include "moecore/kernels/ops.h"

namespace moecore::ops {
namespace {

using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

memory::data_type dnnl_type(DType t) {
  return t == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
}

// A logical [G, rows, cols] operand: element (g, i, j) lives at g*sg + i*si + j*sj.
struct Operand {
  int64_t rows, cols, sg, si, sj;
};

// op(x) of a 2-D or 3-D tensor whose last dim is contiguous.
Operand operand_of(const Tensor& x, bool trans) {
  const int d = x.dim();
  const int64_t r = x.size(d - 2), c = x.size(d - 1), ld = x.stride(d - 2);
  const int64_t sg = d == 3 ? x.stride(0) : 0;
  return trans ? Operand{c, r, sg, 1, ld} : Operand{r, c, sg, ld, 1};
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int, int, float, float>;

struct Entry {
  dnnl::matmul prim;
  memory::desc a, b, c;
};

struct Cache {
  std::mutex mu;
  std::map<Key, Entry> prims;
};

Cache& cache() {
  static Cache c;
  return c;
}

Entry get_primitive(int64_t G, const Operand& a, const Operand& b, const Operand& c, DType in, DType out, float alpha,
                    float beta) {
  const Key key{G,
                a.rows,
                a.cols,
                b.cols,
                a.sg,
                a.si,
                a.sj,
                b.sg,
                b.si,
                b.sj,
                c.sg,
                c.si,
                c.sj,
                static_cast<int>(in),
                static_cast<int>(out),
                alpha,
                beta};
  Cache& cc = cache();
  std::lock_guard<std::mutex> lock(cc.mu);
  auto it = cc.prims.find(key);
  if (it != cc.prims.end()) return it->second;
  auto md = [&](const Operand& o, DType t) {
    if (G > 1) return memory::desc({G, o.rows, o.cols}, dnnl_type(t), {o.sg, o.si, o.sj});
    return memory::desc({o.rows, o.cols}, dnnl_type(t), {o.si, o.sj});
  };
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops po;
    po.append_sum(beta);
    attr.set_post_ops(po);
  }
  Entry e{{}, md(a, in), md(b, in), md(c, out)};
  e.prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(e.a, e.b, e.c), attr, cpu_engine()));
  cc.prims.emplace(key, e);
  return e;
}

void check_operands(const char* op, const Tensor& c, const Tensor& a, const Tensor& b, int rank, const Context& ctx) {
  cpu::check_context(
      ctx, [&](auto&&... m) { MOECORE_FAIL(op, ": ", m...); }, cpu::Backends::cpu_and_cuda);
  const bool ok_rank = a.dim() == rank && b.dim() == rank && c.dim() == rank;
  const bool ok_dtype = a.dtype() == b.dtype() && cpu::is_float_storage(a.dtype()) && cpu::is_float_storage(c.dtype());
  const bool ok_dev = a.device() == ctx.device && b.device() == ctx.device && c.device() == ctx.device;
  const bool ok_inner = ok_rank && a.stride(-1) == 1 && b.stride(-1) == 1 && c.stride(-1) == 1;
  if (!(ok_rank && ok_dtype && ok_dev && ok_inner)) {
    MOECORE_FAIL(op, ": expected ", rank, "-D operands on ", device_name(ctx.device),
                 " with a unit last stride, a and b of one dtype (f32|bf16|f16), c f32|bf16|f16; got c ", c.str(),
                 ", a ", a.str(), ", b ", b.str());
  }
}

void check_shapes(const Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, const char* op) {
  const Operand oa = operand_of(a, ta), ob = operand_of(b, tb), oc = operand_of(c, false);
  if (oa.cols != ob.rows || oa.rows != oc.rows || ob.cols != oc.cols) {
    MOECORE_FAIL(op, ": shapes do not match: c ", c.str(), " = op(a ", a.str(), (ta ? "^T" : ""), ") @ op(b ", b.str(),
                 (tb ? "^T" : ""), ")");
  }
}

void run(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta, int64_t G,
         const char* op) {
  check_shapes(c, a, ta, b, tb, op);
  const Operand oa = operand_of(a, ta), ob = operand_of(b, tb), oc = operand_of(c, false);
  if (oc.rows == 0 || oc.cols == 0 || G == 0) return;
  if (oa.cols == 0) {  // empty reduction: c = beta * c
    Tensor cc = c;
    if (beta == 0.0f)
      cc.zero_();
    else
      MOECORE_CHECK(beta == 1.0f, op, ": K = 0 with beta ", beta, " is not supported");
    return;
  }
  const Entry e = get_primitive(G, oa, ob, oc, a.dtype(), c.dtype(), alpha, beta);
  memory ma(e.a, cpu_engine(), a.raw());
  memory mb(e.b, cpu_engine(), b.raw());
  memory mc(e.c, cpu_engine(), c.raw());
  dnnl::stream strm(cpu_engine());
  e.prim.execute(strm, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  strm.wait();
}

// Reused f32 scratch for widened bf16 / f16 operands (grown on demand, never shrunk), on the operands' device (cpu or
// sim: copies between the two are transfers, which do not convert).
Tensor& scratch(int slot, int64_t elems, Device device) {
  static thread_local Tensor bufs[3];
  Tensor& t = bufs[slot];
  if (!t.defined() || t.numel() < elems || t.device() != device)
    t = Tensor::empty({elems}, DType::f32, MemCategory::workspace, device);
  return t;
}

// oneDNN's bf16 matmul implementation ("brg:avx512_core_bf16", "brg:avx512_core_amx", ...), empty where it has none.
const std::string& onednn_bf16_impl() {
  static const std::string impl = [] {
    try {
      const memory::desc md({16, 16}, memory::data_type::bf16, {16, 1});
      const memory::desc out({16, 16}, memory::data_type::f32, {16, 1});
      return std::string(dnnl::matmul::primitive_desc(dnnl::matmul::desc(md, md, out), cpu_engine()).impl_info_str());
    } catch (const dnnl::error&) {
      return std::string();
    }
  }();
  return impl;
}

Bf16Gemm native_or_error(const char* who) {
  if (onednn_bf16_impl().empty())
    MOECORE_FAIL(who,
                 ": native bf16 GEMMs need oneDNN's bf16 matmul, which this CPU lacks (AVX512-BF16 or AMX, within "
                 "ONEDNN_MAX_CPU_ISA); hint: use widened");
  return Bf16Gemm::native;
}

std::atomic<int> g_bf16_gemm{-1};  // set_cpu_bf16_gemm's, -1: none

bool native_bf16() {
  return cpu_bf16_gemm() == Bf16Gemm::native;
}

// A contiguous f32 copy of a bf16 or f16 2-D or 3-D operand, in its stored (untransposed) layout.
Tensor widen(const Tensor& x, int slot) {
  Tensor w = scratch(slot, x.numel(), x.device()).slice(0, 0, x.numel()).view(x.shape());
  w.copy_from(x);
  return w;
}

// Widens one bf16 or f16 product tile by tile (M, N and K tiles), so that scratch stays within kWidenBudget
// elements per operand whatever the GEMM's size, and every element is widened about once. A c that is not f32
// accumulates in an f32 tile and is rounded once.
constexpr int64_t kWidenBudget = int64_t{4} << 20;

void run_widened(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta,
                 const char* op) {
  const int64_t M = c.size(0), N = c.size(1), K = ta ? a.size(0) : a.size(1);
  if (M == 0 || N == 0 || K == 0) {  // nothing to widen; run() handles the empty cases
    run(c, a, ta, b, tb, alpha, beta, 1, op);
    return;
  }
  auto tile = [](int64_t want, int64_t extent) { return std::min(extent, std::max<int64_t>(want, 64)); };
  const int64_t kc = std::min<int64_t>(K, 2048);
  const int64_t mc = tile(kWidenBudget / kc, M);
  int64_t nc = tile(kWidenBudget / kc, N);
  if (c.dtype() != DType::f32) nc = std::min(nc, tile(kWidenBudget / mc, N));
  for (int64_t m0 = 0; m0 < M; m0 += mc) {
    const int64_t m1 = std::min(M, m0 + mc);
    for (int64_t n0 = 0; n0 < N; n0 += nc) {
      const int64_t n1 = std::min(N, n0 + nc);
      Tensor ct = c.slice(0, m0, m1).slice(1, n0, n1);
      Tensor acc = ct;
      if (c.dtype() != DType::f32) {
        acc = scratch(2, ct.numel(), ct.device()).slice(0, 0, ct.numel()).view(ct.shape());
        if (beta != 0.0f) acc.copy_from(ct);
      }
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = std::min(K, k0 + kc);
        const Tensor at = ta ? a.slice(0, k0, k1).slice(1, m0, m1) : a.slice(0, m0, m1).slice(1, k0, k1);
        const Tensor bt = tb ? b.slice(0, n0, n1).slice(1, k0, k1) : b.slice(0, k0, k1).slice(1, n0, n1);
        const Tensor a32 = widen(at, 0), b32 = widen(bt, 1);
        run(acc, a32, ta, b32, tb, alpha, k0 == 0 ? beta : 1.0f, 1, op);
      }
      if (c.dtype() != DType::f32) ct.copy_from(acc);
    }
  }
}

void dispatch(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta, int64_t G,
              const char* op) {
  // oneDNN has no f32 x f32 -> bf16 (or f16) matmul
  if (a.dtype() == DType::f32 && c.dtype() != DType::f32) {
    Tensor c32 = scratch(2, c.numel(), c.device()).slice(0, 0, c.numel()).view(c.shape());
    if (beta != 0.0f) c32.copy_from(c);
    run(c32, a, ta, b, tb, alpha, beta, G, op);
    c.copy_from(c32);
  } else if (a.dtype() == DType::f32 || (a.dtype() == DType::bf16 && c.dtype() != DType::f16 && native_bf16())) {
    run(c, a, ta, b, tb, alpha, beta, G, op);
  } else if (G == 1) {
    run_widened(c, a, ta, b, tb, alpha, beta, op);
  } else {
    for (int64_t g = 0; g < G; ++g) {
      Tensor cg = c.select(0, g);
      run_widened(cg, a.select(0, g), ta, b.select(0, g), tb, alpha, beta, op);
    }
  }
}

}  // namespace

Bf16Gemm cpu_bf16_gemm() {
  const int set = g_bf16_gemm.load(std::memory_order_relaxed);
  if (set >= 0) return static_cast<Bf16Gemm>(set);
  static const Bf16Gemm chosen = [] {
    if (const std::optional<Bf16Gemm> env = cpu_bf16_gemm_env())
      return *env == Bf16Gemm::native ? native_or_error("MOECORE_CPU_BF16_GEMM=native") : Bf16Gemm::widened;
    const std::string& impl = onednn_bf16_impl();
    if (impl.empty()) return Bf16Gemm::widened;
    const bool faster = impl.find("amx") != std::string::npos || cpu_bf16_dot_flop_ratio() >= kNativeBf16MinRatio;
    return faster ? Bf16Gemm::native : Bf16Gemm::widened;
  }();
  return chosen;
}

void set_cpu_bf16_gemm(Bf16Gemm path) {
  if (path == Bf16Gemm::native) native_or_error("set_cpu_bf16_gemm");
  g_bf16_gemm.store(static_cast<int>(path), std::memory_order_relaxed);
}

void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Context& ctx) {
  check_operands("gemm", c, a, b, 2, ctx);
  check_shapes(c, a, trans_a, b, trans_b, "gemm");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::gemm(c, a, trans_a, b, trans_b, alpha, beta, ctx);
  const DeviceAccess access;
  dispatch(c, a, trans_a, b, trans_b, alpha, beta, 1, "gemm");
}

void gemm_batched(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
                  const Context& ctx) {
  check_operands("gemm_batched", c, a, b, 3, ctx);
  if (a.size(0) != c.size(0) || b.size(0) != c.size(0)) {
    MOECORE_FAIL("gemm_batched: batch sizes differ: c ", c.str(), ", a ", a.str(), ", b ", b.str());
  }
  check_shapes(c, a, trans_a, b, trans_b, "gemm_batched");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::gemm_batched(c, a, trans_a, b, trans_b, alpha, beta, ctx);
  const DeviceAccess access;
  if (c.size(0) == 1) {
    Tensor c2 = c.select(0, 0);
    dispatch(c2, a.select(0, 0), trans_a, b.select(0, 0), trans_b, alpha, beta, 1, "gemm_batched");
    return;
  }
  dispatch(c, a, trans_a, b, trans_b, alpha, beta, c.size(0), "gemm_batched");
}

}  // namespace moecore::ops
