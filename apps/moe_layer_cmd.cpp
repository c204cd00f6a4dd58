// `moecore moe-layer`: forward and backward of one MoE layer on given weights, input and output gradient
// (docs/moe-layer-golden.md). This is how moecore is compared with other implementations.
#include <cstdio>

#include "apps/args.h"
#include "apps/commands.h"
#include "moecore/io/file_util.h"
#include "moecore/io/input_file.h"
#include "moecore/io/safetensors.h"
#include "moecore/model/moe_layer_case.h"

namespace moecore::apps {

int moe_layer_main(int argc, char** argv) {
  Args a("moe-layer");
  a.option("--config", "", "layer.json with Megatron config keys (see docs/moe-layer-golden.md)")
      .option("--inputs", "", "safetensors file with input.* and param.* tensors")
      .option("--out", "", "safetensors file to write out.*, routing.*, loss.* and grad.* tensors");
  if (!a.parse(argc, argv)) return 0;
  for (const char* f : {"--config", "--inputs", "--out"})
    if (a.str(f).empty()) MOECORE_FAIL("moe-layer: ", f, " is required (see moecore moe-layer --help)");
  io::require_regular_file(a.str("--config"), "moe-layer: --config");  // a FIFO would block the read
  io::check_output_file({"--out", a.str("--out")}, {{"--config", a.str("--config")}, {"--inputs", a.str("--inputs")}});
  const model::MoeLayerCase c = model::moe_layer_case_parse(io::read_file(a.str("--config")));
  const io::SafetensorsFile in = io::safetensors_load(a.str("--inputs"));
  const auto out = model::moe_layer_case_run(c, in.tensors);
  io::safetensors_save(a.str("--out"), out, {{"producer", "moecore moe-layer"}});
  std::printf("moe-layer: wrote %zu tensors to %s\n", out.size(), a.str("--out").c_str());
  return 0;
}

}  // namespace moecore::apps
