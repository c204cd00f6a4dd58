// Hopper's tensor-core grouped GEMMs for the MoE experts (grouped_gemm_sm90.cu: CUTLASS's pointer-array grouped GEMM,
// TMA + WGMMA, warp-specialised cooperative schedule, f32 accumulation). gemm.cu offers every grouped GEMM to these
// first; false means "not here" and gemm.cu runs its SIMT kernel. They take it when the build has them (CUTLASS found
// at configure time, sm_90a code), the device is compute capability 9.0, the operands are bf16 or f16, c is the
// operands' dtype or f32 as listed below, and every row stride, the fixed dims and the base pointers are 16-byte
// aligned (TMA). The group counts stay on the device: the per-group problem shapes and pointers are written there
// from the row offsets. Deterministic (one CTA per output tile, a fixed K order; no split-K).
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>
#include <string>

#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda {

// gemm_grouped on tensor cores: c[seg_g] = a[seg_g] @ op(b[g]) + beta * c[seg_g] for c of a's dtype, and for c f32
// with trans_b false (the experts' input gradient).
bool sm90_grouped_gemm(const Launch& l, Tensor& c, const Tensor& a, const Tensor& b, bool trans_b,
                       const int64_t* group_rows, int64_t G, float beta);
// gemm_grouped_wgrad on tensor cores: c[g] = a[seg_g]^T @ b[seg_g] + beta * c[g], c f32.
bool sm90_grouped_wgrad(const Launch& l, Tensor& c, const Tensor& a, const Tensor& b, const int64_t* group_rows,
                        int64_t G, float beta);
// (Why it declines given operands: sm90_grouped_gemm_declines / sm90_grouped_wgrad_declines, ops_cuda.h.)
// Why the tensor-core path does not run here ("" when it does): not built, or the device is not compute capability
// 9.0. Printed once, as a notice, by the first grouped GEMM that falls back for this reason.
std::string sm90_grouped_unavailable_reason();

}  // namespace moecore::ops::cuda
