// The CPU kernels' instruction set (kernels/cpu_isa.h).
#include "moecore/kernels/cpu_isa.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>

#include "moecore/core/env.h"
#include "moecore/core/error.h"

namespace moecore::ops {
namespace {

CpuIsa widest() {
  return cpu_has_isa(CpuIsa::avx512) ? CpuIsa::avx512 : CpuIsa::avx2;
}

// The environment's cap (MOECORE_CPU_ISA), checked once.
CpuIsa environment_cap() {
  static const CpuIsa cap = [] {
    const std::optional<std::string> v =
        env_choice("MOECORE_CPU_ISA", {"avx2", "avx512"}, "the widest instruction set of moecore's CPU kernels");
    if (!v) return widest();
    if (*v == "avx2") return CpuIsa::avx2;
    MOECORE_CHECK(cpu_has_isa(CpuIsa::avx512), "MOECORE_CPU_ISA=avx512, but this CPU has no AVX-512 (F, BW, DQ, VL)");
    return CpuIsa::avx512;
  }();
  return cap;
}

std::atomic<int> g_cap{-1};  // cap_cpu_kernel_isa's, -1: none

#if defined(__x86_64__)
// Seconds for `rounds` of 16 independent VDPBF16PS (bf16) or VFMADD231PS on zmm registers: 16 accumulators cover
// either instruction's latency, so the loop runs at its issue rate; nothing touches memory.
#define MOECORE_ZMM16(OP)                                                                                  \
  OP " %%zmm16, %%zmm17, %%zmm0\n" OP " %%zmm16, %%zmm17, %%zmm1\n" OP " %%zmm16, %%zmm17, %%zmm2\n" OP    \
     " %%zmm16, %%zmm17, %%zmm3\n" OP " %%zmm16, %%zmm17, %%zmm4\n" OP " %%zmm16, %%zmm17, %%zmm5\n" OP    \
     " %%zmm16, %%zmm17, %%zmm6\n" OP " %%zmm16, %%zmm17, %%zmm7\n" OP " %%zmm16, %%zmm17, %%zmm8\n" OP    \
     " %%zmm16, %%zmm17, %%zmm9\n" OP " %%zmm16, %%zmm17, %%zmm10\n" OP " %%zmm16, %%zmm17, %%zmm11\n" OP  \
     " %%zmm16, %%zmm17, %%zmm12\n" OP " %%zmm16, %%zmm17, %%zmm13\n" OP " %%zmm16, %%zmm17, %%zmm14\n" OP \
     " %%zmm16, %%zmm17, %%zmm15\n"
#define MOECORE_ZMM_LOOP(OP)                                                                                    \
  asm volatile("vpxord %%zmm16, %%zmm16, %%zmm16\n vpxord %%zmm17, %%zmm17, %%zmm17\n 1:\n" MOECORE_ZMM16(      \
                   OP) "dec %0\n jnz 1b\n vzeroupper\n"                                                         \
               : "+r"(n)                                                                                        \
               :                                                                                                \
               : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17")
[[gnu::target("avx512f")]] double zmm_loop_seconds(bool bf16, int64_t rounds) {
  int64_t n = rounds;
  const auto t0 = std::chrono::steady_clock::now();
  if (bf16)
    MOECORE_ZMM_LOOP("vdpbf16ps");
  else
    MOECORE_ZMM_LOOP("vfmadd231ps");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
#undef MOECORE_ZMM_LOOP
#undef MOECORE_ZMM16
#endif

}  // namespace

std::string_view cpu_isa_name(CpuIsa isa) {
  return isa == CpuIsa::avx512 ? "avx512" : "avx2";
}

bool cpu_has_isa(CpuIsa isa) {
  if (isa == CpuIsa::avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

CpuIsa cpu_kernel_isa() {
  const int cap = g_cap.load(std::memory_order_relaxed);
  const CpuIsa env = environment_cap();
  return cap >= 0 && static_cast<CpuIsa>(cap) < env ? static_cast<CpuIsa>(cap) : env;
}

void cap_cpu_kernel_isa(CpuIsa isa) {
  MOECORE_CHECK(cpu_has_isa(isa), "cap_cpu_kernel_isa: this CPU has no ", cpu_isa_name(isa));
  g_cap.store(static_cast<int>(isa), std::memory_order_relaxed);
}

std::string_view bf16_gemm_name(Bf16Gemm path) {
  return path == Bf16Gemm::native ? "native" : "widened";
}

double cpu_bf16_dot_flop_ratio() {
  static const double ratio = [] {
#if defined(__x86_64__)
    if (!cpu_has_isa(CpuIsa::avx512) || !__builtin_cpu_supports("avx512bf16")) return 0.0;
    constexpr int64_t kRounds = 1 << 16;  // 2^20 instructions: about 0.2-1 ms each
    double bf16 = 1e30, fma = 1e30;
    for (int r = 0; r < 7; ++r) {
      fma = std::min(fma, zmm_loop_seconds(false, kRounds));
      bf16 = std::min(bf16, zmm_loop_seconds(true, kRounds));
    }
    return 2.0 * fma / bf16;  // a VDPBF16PS does twice a VFMADD231PS's flops (32 multiply-adds against 16)
#else
    return 0.0;
#endif
  }();
  return ratio;
}

std::optional<Bf16Gemm> cpu_bf16_gemm_env() {
  static const std::optional<Bf16Gemm> v = []() -> std::optional<Bf16Gemm> {
    const std::optional<std::string> s =
        env_choice("MOECORE_CPU_BF16_GEMM", {"native", "widened"}, "how the CPU GEMMs multiply bf16 operands");
    if (!s) return std::nullopt;
    return *s == "native" ? Bf16Gemm::native : Bf16Gemm::widened;
  }();
  return v;
}

}  // namespace moecore::ops
