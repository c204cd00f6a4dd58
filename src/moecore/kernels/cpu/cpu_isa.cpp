// The CPU kernels' instruction set (kernels/cpu_isa.h).
#include "moecore/kernels/cpu_isa.h"

#include <atomic>
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

}  // namespace moecore::ops
