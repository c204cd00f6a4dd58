// The instruction set moecore's own CPU kernels run (the GEMMs are oneDNN's, which chooses its own): the binary is
// built for AVX2 + FMA (GCC 12 gets -mno-avx512f: CMakeLists.txt says why), and kernels with an AVX-512 variant --
// a function given AVX-512 by a target attribute alone -- take it where the CPU has AVX-512 F, BW, DQ and VL. One
// binary, both kinds of machine; the variants give the same bits (each variant's test runs both where it can).
#pragma once
#include <cstdint>
#include <optional>
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

// How the CPU GEMMs (ops::gemm, gemm_batched) multiply bf16 operands: `native` runs oneDNN's bf16 matmul (AVX512-BF16
// dot products or AMX tiles); `widened` converts the operands to f32 in scratch and runs the f32 matmul -- the exact
// products of the bf16 values accumulated in f32, so both are bf16 GEMMs with f32 accumulation (their bits differ).
// Native only pays where the CPU's bf16 arithmetic outruns its f32 FMAs: on some AVX512-BF16 CPUs VDPBF16PS (32
// multiply-adds) issues at a quarter of VFMADD231PS's rate (16), making bf16 GEMMs half as fast as f32 ones.
enum class Bf16Gemm : uint8_t { native, widened };
std::string_view bf16_gemm_name(Bf16Gemm path);  // "native", "widened"
// This core's bf16 dot-product rate over its f32 FMA rate, in flops (VDPBF16PS against VFMADD231PS on registers,
// best of a few interleaved rounds, a few milliseconds, measured once); 0 where the CPU has no AVX512-BF16.
double cpu_bf16_dot_flop_ratio();
// MOECORE_CPU_BF16_GEMM (native or widened; read once, another value is an Error naming it); nullopt when unset.
std::optional<Bf16Gemm> cpu_bf16_gemm_env();
// The path in use: where oneDNN has a bf16 matmul, native when it runs on AMX or cpu_bf16_dot_flop_ratio() is at
// least kNativeBf16MinRatio, else widened (the ratios met are 0.5, 1 or 2, far from it, so the choice does not
// depend on noise); MOECORE_CPU_BF16_GEMM or set_cpu_bf16_gemm overrides it. Without a bf16 matmul (oneDNN on
// AVX2) always widened, and asking for native is an Error.
inline constexpr double kNativeBf16MinRatio = 1.25;
Bf16Gemm cpu_bf16_gemm();
// Sets the path (tests and benchmarks comparing the two; not while GEMMs run).
void set_cpu_bf16_gemm(Bf16Gemm path);

}  // namespace moecore::ops
