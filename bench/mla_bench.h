// Multi-latent attention (nn/mla.h) forward+backward on one layer's worth of tokens, as a ratio to the in-run GEMM
// peak. Model FLOPs, as flops_per_step counts them: 6 T P_attn (projections) + 6 B S^2 A_core (QK^T and AV over
// the causal half), P_attn and A_core from docs/echo-folding-perf.md's MLA formula; the padding of v inside the kernel
// is work done but not counted.
#pragma once
#include <string>
#include <vector>

#include "moecore/core/dtype.h"

namespace moecore::bench {
// Default: DeepSeek-V3's head geometry (qk 128 + 64 RoPE, v 128, kv LoRA 512) at 8 heads, hidden 2048, q LoRA 768.
struct MlaBenchShape {
  int64_t B = 1, S = 1024, H = 2048, heads = 8, q_lora = 768, kv_lora = 512, dn = 128, dr = 64, dv = 128;
};
std::vector<std::string> bench_mla_lines(const MlaBenchShape& shape, DType dtype, int iters);
}  // namespace moecore::bench
