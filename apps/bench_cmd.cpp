// `moecore bench <what>`: benchmark lines as JSON objects, one per line, on stdout. On the CPU (the default) each
// bench reports GFLOP/s against a CPU GEMM peak of the same run; with --device cuda (or sim, the simulated device of
// the test suite) it first prints a device_peaks line (a bf16 GEMM and a device-to-device copy measured in this
// process), then medians of timed runs in TFLOP/s and GB/s against those peaks (bench/device_bench.h).
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/device_flag.h"
#include "apps/hf_config.h"
#include "apps/model_flags.h"
#include "bench/attention_bench.h"
#include "bench/device_bench.h"
#include "bench/experts_bench.h"
#include "bench/gemm_bench.h"
#include "bench/mla_bench.h"
#include "bench/moe_layer_bench.h"
#include "bench/train_step_bench.h"

namespace moecore::apps {
namespace {

void print_lines(const std::vector<std::string>& lines) {
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  std::fflush(stdout);
}

// GPT-2 small's sizes (its vocabulary, 50257, is passed as the tokenizer's); Megatron's defaults give the rest
// of GPT-2's architecture: LayerNorm, learned positions, biases, GeLU, dropout 0.1.
model::ModelConfig gpt2_small() {
  model::ModelConfig c;
  c.num_layers = 12;
  c.hidden_size = 768;
  c.num_attention_heads = 12;
  c.seq_length = 1024;
  return c;
}

DType dtype_flag(const Args& a) {
  return a.on("--bf16") ? DType::bf16 : DType::f32;
}

// --device and the flags of the device path. `iters` names the command's count of timed runs ("--iters" or
// "--steps"); cpu_default is its default on the CPU ("": the CPU path has no such flag).
void add_device_flags(Args& a, const char* iters, const std::string& cpu_default) {
  const std::string runs = cpu_default.empty() ? "timed runs on a device: the median is reported (default 20)"
                                               : "timed runs (cpu: default " + cpu_default +
                                                     ", the best is reported; cuda | sim: default 20, the median)";
  a.option("--device", "cpu",
           "cpu | cuda | sim: where the bench runs (cuda: CUDA-event medians against in-run bf16 GEMM and copy "
           "peaks; sim: the simulated device of the test suite, the same path with a wall clock)")
      .option(iters, "", runs)
      .option("--warmup", "", "untimed runs before the timed ones on a device (default 3)")
      .option("--peak-gemm-size", "", "M = N = K of the bf16 GEMM measured as peak_tflops on a device (default 8192)")
      .option("--peak-copy-mib", "", "MiB of the device-to-device copy measured as peak_gbps (default 1024)")
      .domain("--device", FlagDomain::one_of({"cpu", "cuda", "sim"}))
      .domain(iters, FlagDomain::integer(1, 1e6))
      .domain("--warmup", FlagDomain::integer(0, 1e6))
      .domain("--peak-gemm-size", FlagDomain::integer(1, 65536))
      .domain("--peak-copy-mib", FlagDomain::integer(1, 1048576));
}

// The device run of --device cuda | sim, or nothing for cpu. Runs before any work, so --device cuda without the
// CUDA kernels or a visible GPU fails at start-up (device_from_flag, shared with train). Device-only flags given
// with --device cpu are refused rather than ignored.
std::optional<bench::DeviceRun> device_run_from(const Args& a, const char* command, const char* iters,
                                                bool cpu_has_iters) {
  const Device device = device_from_flag(a);
  if (device == Device::cpu) {
    for (const char* f : {"--warmup", "--peak-gemm-size", "--peak-copy-mib", cpu_has_iters ? "" : iters})
      if (*f && a.given(f))
        MOECORE_FAIL(command, ": ", f, " applies to --device cuda | sim only (the cpu bench times itself)");
    return std::nullopt;
  }
  bench::DeviceRun run;
  run.device = device;
  run.iters = static_cast<int>(a.i64_or(iters, run.iters));
  run.warmup = static_cast<int>(a.i64_or("--warmup", run.warmup));
  run.peak_gemm = a.i64_or("--peak-gemm-size", run.peak_gemm);
  run.peak_copy_bytes = a.i64_or("--peak-copy-mib", run.peak_copy_bytes >> 20) << 20;
  return run;
}

// The device path's output: the peaks line as soon as it is measured, then the bench's lines.
void print_device_lines(const bench::DeviceRun& run,
                        const std::function<std::vector<std::string>(const bench::DevicePeaks&)>& lines) {
  const bench::DevicePeaks peaks = bench::device_peaks_measure(run);
  print_lines({bench::device_peaks_line(run, peaks)});
  print_lines(lines(peaks));
}

int bench_gemm_main(int argc, char** argv) {
  Args a("bench gemm");
  a.option("--shapes", "", "MxNxK,... to sweep (default: 1024^3, 2048^3 and GPT-2 small's shapes at 1024 tokens)");
  add_device_flags(a, "--iters", "");
  if (!a.parse(argc, argv)) return 0;
  const auto shapes = a.str("--shapes").empty() ? bench::gemm_default_shapes()
                                                : bench::gemm_parse_shapes(a.str("--shapes"), "--shapes");
  const auto run = device_run_from(a, "bench gemm", "--iters", false);
  if (!run) {
    print_lines(bench::bench_gemm_lines(shapes));
    return 0;
  }
  print_device_lines(*run, [&](const auto& p) { return bench::bench_gemm_device_lines(shapes, *run, p); });
  return 0;
}

int bench_attention_main(int argc, char** argv) {
  Args a("bench attention");
  a.option("--micro-batch-size", "1", "batch B")
      .option("--seq-length", "1024", "sequence length S")
      .option("--num-attention-heads", "12", "query heads")
      .option("--num-query-groups", "12", "key/value heads")
      .option("--kv-channels", "64", "head dim D")
      .flag("--bf16", "bf16 inputs (f32 math)");
  add_device_flags(a, "--iters", "3");
  if (!a.parse(argc, argv)) return 0;
  const int64_t B = a.i64("--micro-batch-size"), S = a.i64("--seq-length"), heads = a.i64("--num-attention-heads"),
                kv = a.i64("--num-query-groups"), D = a.i64("--kv-channels");
  const auto run = device_run_from(a, "bench attention", "--iters", true);
  if (!run) {
    print_lines(
        bench::bench_attention_lines(B, S, heads, kv, D, dtype_flag(a), static_cast<int>(a.i64_or("--iters", 3))));
    return 0;
  }
  print_device_lines(*run, [&](const auto& p) {
    return bench::bench_attention_device_lines(B, S, heads, kv, D, dtype_flag(a), *run, p);
  });
  return 0;
}

void add_moe_shape_flags(Args& a) {
  a.option("--tokens", "4096", "tokens N")
      .option("--hidden-size", "1024", "hidden size H")
      .option("--moe-ffn-hidden-size", "1408", "expert ffn size F")
      .option("--num-experts", "8", "experts E")
      .option("--moe-router-topk", "2", "top-k K")
      .flag("--bf16", "bf16 compute");
}

int bench_experts_main(int argc, char** argv) {
  Args a("bench experts");
  add_moe_shape_flags(a);
  add_device_flags(a, "--iters", "");
  if (!a.parse(argc, argv)) return 0;
  const int64_t N = a.i64("--tokens"), H = a.i64("--hidden-size"), F = a.i64("--moe-ffn-hidden-size"),
                E = a.i64("--num-experts"), K = a.i64("--moe-router-topk");
  const auto run = device_run_from(a, "bench experts", "--iters", false);
  if (!run) {
    print_lines(bench::bench_experts_lines(N, H, F, E, K, dtype_flag(a)));
    return 0;
  }
  print_device_lines(
      *run, [&](const auto& p) { return bench::bench_experts_device_lines(N, H, F, E, K, dtype_flag(a), *run, p); });
  return 0;
}

int bench_moe_layer_main(int argc, char** argv) {
  Args a("bench moe-layer");
  add_moe_shape_flags(a);
  a.flag("--preset-coarse", "N=4096 H=1024 F=1408 E=8 K=2 (the default shape)")
      .flag("--preset-fine", "N=4096 H=1024 F=256 E=64 K=8");
  add_device_flags(a, "--iters", "3");
  if (!a.parse(argc, argv)) return 0;
  const bool fine = a.on("--preset-fine");
  const int64_t N = a.i64("--tokens"), H = a.i64("--hidden-size"), F = fine ? 256 : a.i64("--moe-ffn-hidden-size"),
                E = fine ? 64 : a.i64("--num-experts"), K = fine ? 8 : a.i64("--moe-router-topk");
  const auto run = device_run_from(a, "bench moe-layer", "--iters", true);
  if (!run) {
    print_lines(bench::bench_moe_layer(N, H, F, E, K, dtype_flag(a), static_cast<int>(a.i64_or("--iters", 3))));
    return 0;
  }
  print_device_lines(
      *run, [&](const auto& p) { return bench::bench_moe_layer_device(N, H, F, E, K, dtype_flag(a), *run, p); });
  return 0;
}

int bench_mla_main(int argc, char** argv) {
  Args a("bench mla");
  bench::MlaBenchShape s;
  a.option("--micro-batch-size", std::to_string(s.B), "sequences")
      .option("--seq-length", std::to_string(s.S), "tokens per sequence")
      .option("--hidden-size", std::to_string(s.H), "hidden size")
      .option("--num-attention-heads", std::to_string(s.heads), "heads")
      .option("--q-lora-rank", std::to_string(s.q_lora), "q LoRA rank (0: none)")
      .option("--kv-lora-rank", std::to_string(s.kv_lora), "kv LoRA rank")
      .option("--qk-head-dim", std::to_string(s.dn), "q/k channels without RoPE")
      .option("--qk-pos-emb-head-dim", std::to_string(s.dr), "q/k channels with RoPE")
      .option("--v-head-dim", std::to_string(s.dv), "value channels")
      .option("--iters", "3", "timed iterations (best is reported)")
      .flag("--bf16", "bf16 compute");
  if (!a.parse(argc, argv)) return 0;
  s = {a.i64("--micro-batch-size"),    a.i64("--seq-length"),          a.i64("--hidden-size"),
       a.i64("--num-attention-heads"), a.i64("--q-lora-rank"),         a.i64("--kv-lora-rank"),
       a.i64("--qk-head-dim"),         a.i64("--qk-pos-emb-head-dim"), a.i64("--v-head-dim")};
  print_lines(bench::bench_mla_lines(s, dtype_flag(a), static_cast<int>(a.i64("--iters"))));
  return 0;
}

int bench_train_step_main(int argc, char** argv) {
  Args a("bench train-step");
  add_model_flags(a, gpt2_small());
  add_hf_config_flag(a);
  a.option("--micro-batch-size", "1", "sequences per step");
  add_device_flags(a, "--steps", "3");
  if (!a.parse(argc, argv)) return 0;
  hf_config_apply(a, "--hf-config");
  const auto run = device_run_from(a, "bench train-step", "--steps", true);
  const model::ModelConfig cfg = model_config_from(a, a.str("--hf-config").empty() ? 50257 : 0);
  if (!run) {
    print_lines(bench::bench_train_step(cfg, a.i64("--micro-batch-size"), static_cast<int>(a.i64_or("--steps", 3))));
    return 0;
  }
  print_device_lines(
      *run, [&](const auto& p) { return bench::bench_train_step_device(cfg, a.i64("--micro-batch-size"), *run, p); });
  return 0;
}

}  // namespace

int bench_main(int argc, char** argv) {
  const std::string what = argc >= 2 ? argv[1] : "";
  if (what == "gemm") return bench_gemm_main(argc - 1, argv + 1);
  if (what == "attention") return bench_attention_main(argc - 1, argv + 1);
  if (what == "experts") return bench_experts_main(argc - 1, argv + 1);
  if (what == "moe-layer") return bench_moe_layer_main(argc - 1, argv + 1);
  if (what == "mla") return bench_mla_main(argc - 1, argv + 1);
  if (what == "train-step") return bench_train_step_main(argc - 1, argv + 1);
  std::fprintf(what.empty() || what == "--help" ? stdout : stderr,
               "usage: moecore bench <gemm|attention|mla|train-step|moe-layer|experts> [options]\n"
               "  gemm        GEMM sweep (square and GPT-2-small shapes), f32 and bf16\n"
               "  attention   causal attention forward+backward\n"
               "  mla         multi-latent attention (one layer's) forward+backward\n"
               "  train-step  one training step (default: GPT-2 small, S=1024; --hf-config FILE with shrinking flags)\n"
               "  moe-layer   one MoE layer forward+backward (router, dispatch, grouped experts)\n"
               "  experts     the grouped experts alone, forward+backward\n"
               "Each prints JSON lines with gflops, the in-run GEMM peak_gflops and their ratio.\n"
               "All but mla take --device cuda (or sim): a device_peaks line first (a bf16 GEMM, 8192^3, and a\n"
               "device-to-device copy, measured in the same run), then medians of CUDA-event-timed runs with\n"
               "tflops, peak_tflops, ratio and, where bytes are counted, gbps and peak_gbps.\n");
  return what.empty() || what == "--help" ? 0 : 2;
}

}  // namespace moecore::apps
