// Attention bench (see attention_bench.h). FLOPs count only the matmuls of the causal half of the score
// matrix, per batch and query head: forward QK^T and PV, 2 * (2 * S^2 * D / 2) = 2 S^2 D; backward
// recomputes S and forms dV, dP, dQ, dK, 5 S^2 D; so fwd+bwd = 7 * B * H * S^2 * D. Softmax work is
// not counted. On the CPU the peak is a dense oneDNN matmul (1024^3, f32 accumulate and output), best of a few;
// on a device (--device) it is the in-run bf16 GEMM of device_bench.h, and the times are medians.
#include "bench/attention_bench.h"

#include <algorithm>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>

#include "bench/bench_util.h"
#include "moecore/core/rng.h"
#include "moecore/kernels/ops.h"

namespace moecore::bench {
namespace {

// Peak of a 1024^3 oneDNN matmul with inputs of `dtype`; 0 when oneDNN has no kernel for it on this CPU
// (bf16 needs AVX-512 in oneDNN 2.x), so the caller can fall back to the f32 peak and say so.
double dnnl_peak_gflops(DType dtype) {
  using dnnl::memory;
  constexpr int64_t n = 1024;
  const auto in = dtype == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  try {
    dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    dnnl::stream strm(eng);
    const memory::desc a({n, n}, in, memory::format_tag::ab), c({n, n}, memory::data_type::f32, memory::format_tag::ab);
    const dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, a, c), eng));
    memory ma(a, eng), mb(a, eng), mc(c, eng);
    std::fill_n(static_cast<char*>(ma.get_data_handle()), a.get_size(), 0);  // bf16/f32 zero bits
    std::fill_n(static_cast<char*>(mb.get_data_handle()), a.get_size(), 0);
    double best = 1e30;
    for (int r = 0; r < 6; ++r) {
      const double t0 = now_seconds();
      prim.execute(strm, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
      strm.wait();
      if (r > 0) best = std::min(best, now_seconds() - t0);  // run 0 warms up
    }
    return 2.0 * n * n * n / best / 1e9;
  } catch (const dnnl::error&) {
    return 0.0;
  }
}

// The attention's tensors on one device: inputs drawn on the host, one same-dtype transfer each.
struct AttentionSetup {
  ops::QkvDims dims;
  Tensor qkv, dout, out, lse, dqkv;
  double fwd_bytes() const { return static_cast<double>(qkv.nbytes() + out.nbytes() + lse.nbytes()); }
  double bwd_bytes() const {
    return static_cast<double>(qkv.nbytes() + out.nbytes() + lse.nbytes() + dout.nbytes() + dqkv.nbytes());
  }
};

AttentionSetup attention_setup(int64_t B, int64_t S, int64_t heads, int64_t kv_heads, int64_t D, DType dtype,
                               Device dev) {
  if (kv_heads <= 0 || heads % kv_heads != 0) {
    MOECORE_FAIL("bench attention: heads (", heads, ") must be a multiple of kv_heads (", kv_heads, ")");
  }
  constexpr MemCategory ws = MemCategory::workspace;
  AttentionSetup a{ops::QkvDims{B, S, kv_heads, heads / kv_heads, D}, {}, {}, {}, {}, {}};
  a.qkv = random_normal_on(dev, {B, S, a.dims.width()}, dtype, "bench.qkv", 1.0f);
  a.dout = random_normal_on(dev, {B, S, heads * D}, dtype, "bench.dout", 1.0f);
  a.out = Tensor::empty({B, S, heads * D}, dtype, ws, dev);
  a.lse = Tensor::empty({B, heads, S}, DType::f32, ws, dev);
  a.dqkv = Tensor::empty(a.qkv.shape(), dtype, ws, dev);
  return a;
}

}  // namespace

std::vector<std::string> bench_attention_lines(int64_t B, int64_t S, int64_t heads, int64_t kv_heads, int64_t D,
                                               DType dtype, int iters) {
  AttentionSetup a = attention_setup(B, S, heads, kv_heads, D, dtype, Device::cpu);
  const ops::QkvDims& dims = a.dims;
  Tensor &qkv = a.qkv, &dout = a.dout, &out = a.out, &lse = a.lse, &dqkv = a.dqkv;

  double peak = dnnl_peak_gflops(dtype);
  std::string peak_dtype(dtype_name(dtype));
  if (peak == 0.0) {
    peak = dnnl_peak_gflops(DType::f32);
    peak_dtype = "f32";
  }
  // Warm-up: grows the kernels' scratch buffers and the OpenMP team.
  ops::attention_forward(out, lse, qkv, dims, ops::Dropout{}, {});
  ops::attention_backward(dqkv, dout, qkv, out, lse, dims, ops::Dropout{}, {});
  double fwd = 1e30, bwd = 1e30, both = 1e30;
  for (int it = 0; it < std::max(iters, 1); ++it) {
    const double t0 = now_seconds();
    ops::attention_forward(out, lse, qkv, dims, ops::Dropout{}, {});
    const double t1 = now_seconds();
    ops::attention_backward(dqkv, dout, qkv, out, lse, dims, ops::Dropout{}, {});
    const double t2 = now_seconds();
    fwd = std::min(fwd, t1 - t0);
    bwd = std::min(bwd, t2 - t1);
    both = std::min(both, t2 - t0);
  }
  const double unit = static_cast<double>(B) * heads * static_cast<double>(S) * S * D;  // S^2 D per head
  std::vector<std::string> lines;
  for (const auto& [name, mults, secs] : {std::tuple{"attention_fwd", 2.0, fwd}, std::tuple{"attention_bwd", 5.0, bwd},
                                          std::tuple{"attention_fwd_bwd", 7.0, both}}) {
    const double gflops = mults * unit / secs / 1e9;
    lines.push_back(JsonLine()
                        .add("name", name)
                        .add("dtype", std::string(dtype_name(dtype)))
                        .add("B", B)
                        .add("S", S)
                        .add("heads", heads)
                        .add("kv_heads", kv_heads)
                        .add("D", D)
                        .add("gflops", gflops)
                        .add("peak_gflops", peak)
                        .add("peak_dtype", peak_dtype)
                        .add("ratio", gflops / peak)
                        .add("seconds", secs)
                        .str());
  }
  return lines;
}

std::vector<std::string> bench_attention_device_lines(int64_t B, int64_t S, int64_t heads, int64_t kv_heads, int64_t D,
                                                      DType dtype, const DeviceRun& run, const DevicePeaks& peaks) {
  AttentionSetup a = attention_setup(B, S, heads, kv_heads, D, dtype, run.device);
  const ops::Context ctx{run.device};
  const StageTimes t = device_time_stages(
      run, {[&] { ops::attention_forward(a.out, a.lse, a.qkv, a.dims, ops::Dropout{}, ctx); },
            [&] { ops::attention_backward(a.dqkv, a.dout, a.qkv, a.out, a.lse, a.dims, ops::Dropout{}, ctx); }});
  const double unit = static_cast<double>(B) * heads * static_cast<double>(S) * S * D;
  std::vector<std::string> lines;
  for (const auto& [name, mults, ms, bytes] :
       {std::tuple{"attention_fwd", 2.0, t.stage_ms[0], a.fwd_bytes()},
        std::tuple{"attention_bwd", 5.0, t.stage_ms[1], a.bwd_bytes()},
        std::tuple{"attention_fwd_bwd", 7.0, t.total_ms, a.fwd_bytes() + a.bwd_bytes()}}) {
    JsonLine line;
    line.add("name", name)
        .add("dtype", std::string(dtype_name(dtype)))
        .add("B", B)
        .add("S", S)
        .add("heads", heads)
        .add("kv_heads", kv_heads)
        .add("D", D);
    lines.push_back(add_device_speed(line, run, peaks, ms, mults * unit, bytes).str());
  }
  return lines;
}

}  // namespace moecore::bench
