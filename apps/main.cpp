// The moecore command-line program: one binary, one subcommand per job.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "apps/commands.h"
#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"
#include "moecore/core/memory.h"
#include "moecore/core/memory_limit.h"
#include "moecore/kernels/cpu_isa.h"
#include "moecore/parallel/comm.h"

namespace {
void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: moecore <command> [options]\n\n"
               "commands:\n"
               "  train       train a GPT model, dense or MoE (see moecore train --help)\n"
               "  preprocess  text or JSONL -> Megatron .bin/.idx\n"
               "  generate    sample text from a checkpoint\n"
               "  bench       benchmarks: gemm, attention, train-step, moe-layer, experts\n"
               "  moe-layer   forward+backward of one MoE layer on given tensors (golden comparisons)\n"
               "  convert     Hugging Face checkpoints in (--from-hf) and out (--to-hf)\n"
               "  model-step  forward+backward of a Hugging Face model on given tokens (golden comparisons)\n");
}
// Prints the error (naming the rank under mpirun) and returns the exit code. In a multi-process job the ranks
// that fail together finalize together; a rank failing alone ends the whole job (comm_error_exit), so no peer
// sits in a collective or in MPI_Finalize forever.
int fail(bool multi, const std::string& cmd, const char* kind, const char* what, int code) {
  if (multi && moecore::comm_world().size() > 1) {
    const moecore::ProcessGroup w = moecore::comm_world();
    std::fprintf(stderr, "moecore %s: %s (rank %d of %d): %s\n", cmd.c_str(), kind, w.rank(), w.size(), what);
    std::fflush(stderr);
    return moecore::comm_error_exit(code);
  }
  std::fprintf(stderr, "moecore %s: %s: %s\n", cmd.c_str(), kind, what);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  // Under mpirun every rank joins the world; a plain launch stays a single process without MPI.
  const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE");
  struct CommScope {
    bool on;
    ~CommScope() {
      if (on) moecore::comm_finalize();
    }
  } comm{false};
  try {
    // moecore's environment variables are checked like flags, whether or not this run uses them (core/env.h).
    (void)moecore::comm_options_from_env();
    (void)moecore::device_sync_each_launch();
    (void)moecore::ops::cpu_kernel_isa();                                     // (MOECORE_CPU_ISA)
    if (moecore::ops::cpu_bf16_gemm_env() == moecore::ops::Bf16Gemm::native)  // (MOECORE_CPU_BF16_GEMM)
      (void)moecore::ops::cpu_bf16_gemm();  // refused here where oneDNN has no bf16 matmul
    if (under_mpirun && moecore::comm_available()) {
      moecore::comm_init(argc, argv);
      comm.on = true;
    }
    if (cmd == "train") return moecore::apps::train_main(argc - 1, argv + 1);
    if (cmd == "bench") return moecore::apps::bench_main(argc - 1, argv + 1);
    if (cmd == "moe-layer") return moecore::apps::moe_layer_main(argc - 1, argv + 1);
    if (cmd == "preprocess") return moecore::apps::preprocess_main(argc - 1, argv + 1);
    if (cmd == "generate") return moecore::apps::generate_main(argc - 1, argv + 1);
    if (cmd == "convert") return moecore::apps::convert_main(argc - 1, argv + 1);
    if (cmd == "model-step") return moecore::apps::model_step_main(argc - 1, argv + 1);
  } catch (const moecore::Error& e) {
    return fail(comm.on, cmd, "error", e.what(), 1);
  } catch (const std::bad_alloc& e) {  // outside a tensor (those name themselves): the limit and the plan
    const std::string plan = moecore::memory_plan_text();
    const std::string what = std::string("out of host memory (") + e.what() + " outside a tensor allocation); " +
                             moecore::memory_limit().describe() +
                             (plan.empty() ? "" : "; the memory plan of this run:\n" + plan);
    return fail(comm.on, cmd, "error", what.c_str(), 1);
  } catch (const std::exception& e) {
    return fail(comm.on, cmd, "internal error", e.what(), 3);
  }
  std::fprintf(stderr, "moecore: unknown command '%s'\n", cmd.c_str());
  usage(stderr);
  return 2;
}
