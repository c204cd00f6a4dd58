// The marks of arithmetic shared by the CPU and the CUDA backend (kernels/common/*.h, moe_echo_plan.h): MOECORE_HD
// makes an inline function callable from host and device code when nvcc compiles it, and a plain inline function for
// the host compiler; MOECORE_HD_FORCEINLINE also forces inlining on the device, where the CUDA helpers it replaces
// were __forceinline__. Both backends then run the same source with the same operations in the same order.
#pragma once

#ifdef __CUDACC__
#define MOECORE_HD __host__ __device__
#define MOECORE_HD_FORCEINLINE __host__ __device__ __forceinline__
#else
#define MOECORE_HD
#define MOECORE_HD_FORCEINLINE inline
#endif
