// GEMM sweep: square shapes and the shapes of a GPT-2-small training step, f32 and bf16.
#pragma once
#include <string>
#include <vector>

namespace moecore::bench {
std::vector<std::string> bench_gemm_lines();
}
