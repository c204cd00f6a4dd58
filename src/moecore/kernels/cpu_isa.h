// The instruction set moecore's own CPU kernels run (the GEMMs are oneDNN's, which chooses its own): the binary is
// built for AVX2 + FMA (GCC 12 gets -mno-avx512f: CMakeLists.txt says why), and kernels with an AVX-512 variant --
// a function given AVX-512 by a target attribute alone -- take it where the CPU has AVX-512 F, BW, DQ and VL. One
// binary, both kinds of machine; the variants give the same bits (each variant's test runs both where it can).
#pragma once
#include <cstdint>
#include <string_view>

// A kernel's AVX-512 variant: the function compiled for AVX-512 F, BW, DQ and VL with 512-bit vectors (GCC; clang
// has no vector width in target attributes).
#if defined(__clang__)
#define MOECORE_TARGET_AVX512 [[gnu::target("avx512f,avx512bw,avx512dq,avx512vl")]]
#else
#define MOECORE_TARGET_AVX512 [[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")]]
#endif

namespace moecore::ops {

enum class CpuIsa : uint8_t { avx2, avx512 };
std::string_view cpu_isa_name(CpuIsa isa);  // "avx2", "avx512"
// Whether this CPU has the instruction set (avx2: AVX2 and FMA; avx512: AVX-512 F, BW, DQ and VL).
bool cpu_has_isa(CpuIsa isa);
// The widest set the kernels use: the widest the CPU has, capped by MOECORE_CPU_ISA=avx2 (read once; another value
// is an Error naming it) and by cap_cpu_kernel_isa.
CpuIsa cpu_kernel_isa();
// Caps the kernels at `isa` (tests and benchmarks comparing the variants; not while kernels run). An Error when the
// CPU lacks it.
void cap_cpu_kernel_isa(CpuIsa isa);

}  // namespace moecore::ops
