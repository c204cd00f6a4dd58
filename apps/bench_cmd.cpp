// `moecore bench <what>`: benchmark lines as JSON objects, one per line, on stdout.
#include <cstdio>
#include <string>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/hf_config.h"
#include "apps/model_flags.h"
#include "bench/attention_bench.h"
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

}  // namespace

int bench_main(int argc, char** argv) {
  const std::string what = argc >= 2 ? argv[1] : "";
  if (what == "gemm") {
    Args a("bench gemm");
    if (!a.parse(argc - 1, argv + 1)) return 0;
    print_lines(bench::bench_gemm_lines());
    return 0;
  }
  if (what == "attention") {
    Args a("bench attention");
    a.option("--micro-batch-size", "1", "batch B")
        .option("--seq-length", "1024", "sequence length S")
        .option("--num-attention-heads", "12", "query heads")
        .option("--num-query-groups", "12", "key/value heads")
        .option("--kv-channels", "64", "head dim D")
        .option("--iters", "3", "timed iterations (best is reported)")
        .flag("--bf16", "bf16 inputs (f32 math)");
    if (!a.parse(argc - 1, argv + 1)) return 0;
    print_lines(bench::bench_attention_lines(
        a.i64("--micro-batch-size"), a.i64("--seq-length"), a.i64("--num-attention-heads"), a.i64("--num-query-groups"),
        a.i64("--kv-channels"), a.on("--bf16") ? DType::bf16 : DType::f32, static_cast<int>(a.i64("--iters"))));
    return 0;
  }
  if (what == "experts") {
    Args a("bench experts");
    a.option("--tokens", "4096", "tokens N")
        .option("--hidden-size", "1024", "hidden size H")
        .option("--moe-ffn-hidden-size", "1408", "expert ffn size F")
        .option("--num-experts", "8", "experts E")
        .option("--moe-router-topk", "2", "top-k K")
        .flag("--bf16", "bf16 compute");
    if (!a.parse(argc - 1, argv + 1)) return 0;
    print_lines(bench::bench_experts_lines(a.i64("--tokens"), a.i64("--hidden-size"), a.i64("--moe-ffn-hidden-size"),
                                           a.i64("--num-experts"), a.i64("--moe-router-topk"),
                                           a.on("--bf16") ? DType::bf16 : DType::f32));
    return 0;
  }
  if (what == "moe-layer") {
    Args a("bench moe-layer");
    a.option("--tokens", "4096", "tokens N")
        .option("--hidden-size", "1024", "hidden size H")
        .option("--moe-ffn-hidden-size", "1408", "expert ffn size F")
        .option("--num-experts", "8", "experts E")
        .option("--moe-router-topk", "2", "top-k K")
        .option("--iters", "3", "timed iterations (best is reported)")
        .flag("--bf16", "bf16 compute")
        .flag("--preset-coarse", "N=4096 H=1024 F=1408 E=8 K=2 (the default shape)")
        .flag("--preset-fine", "N=4096 H=1024 F=256 E=64 K=8");
    if (!a.parse(argc - 1, argv + 1)) return 0;
    const bool fine = a.on("--preset-fine");
    print_lines(bench::bench_moe_layer(a.i64("--tokens"), a.i64("--hidden-size"),
                                       fine ? 256 : a.i64("--moe-ffn-hidden-size"), fine ? 64 : a.i64("--num-experts"),
                                       fine ? 8 : a.i64("--moe-router-topk"), a.on("--bf16") ? DType::bf16 : DType::f32,
                                       static_cast<int>(a.i64("--iters"))));
    return 0;
  }
  if (what == "mla") {
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
    if (!a.parse(argc - 1, argv + 1)) return 0;
    s = {a.i64("--micro-batch-size"),    a.i64("--seq-length"),          a.i64("--hidden-size"),
         a.i64("--num-attention-heads"), a.i64("--q-lora-rank"),         a.i64("--kv-lora-rank"),
         a.i64("--qk-head-dim"),         a.i64("--qk-pos-emb-head-dim"), a.i64("--v-head-dim")};
    print_lines(
        bench::bench_mla_lines(s, a.on("--bf16") ? DType::bf16 : DType::f32, static_cast<int>(a.i64("--iters"))));
    return 0;
  }
  if (what == "train-step") {
    Args a("bench train-step");
    add_model_flags(a, gpt2_small());
    add_hf_config_flag(a);
    a.option("--micro-batch-size", "1", "sequences per step").option("--steps", "3", "timed steps");
    if (!a.parse(argc - 1, argv + 1)) return 0;
    hf_config_apply(a);
    print_lines(bench::bench_train_step(model_config_from(a, a.str("--hf-config").empty() ? 50257 : 0),
                                        a.i64("--micro-batch-size"), static_cast<int>(a.i64("--steps"))));
    return 0;
  }
  std::fprintf(what.empty() || what == "--help" ? stdout : stderr,
               "usage: moecore bench <gemm|attention|mla|train-step|moe-layer|experts> [options]\n"
               "  gemm        GEMM sweep (square and GPT-2-small shapes), f32 and bf16\n"
               "  attention   causal attention forward+backward\n"
               "  mla         multi-latent attention (one layer's) forward+backward\n"
               "  train-step  one training step (default: GPT-2 small, S=1024; --hf-config FILE with shrinking flags)\n"
               "  moe-layer   one MoE layer forward+backward (router, dispatch, grouped experts)\n"
               "  experts     the grouped experts alone, forward+backward\n"
               "Each prints JSON lines with gflops, the in-run GEMM peak_gflops and their ratio.\n");
  return what.empty() || what == "--help" ? 0 : 2;
}

}  // namespace moecore::apps
