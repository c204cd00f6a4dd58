// Entry points of the subcommands; each takes (argc, argv) with argv[0] = the subcommand name.
#pragma once

namespace moecore::apps {
int train_main(int argc, char** argv);
int bench_main(int argc, char** argv);
int moe_layer_main(int argc, char** argv);
int preprocess_main(int argc, char** argv);
int generate_main(int argc, char** argv);
int model_step_main(int argc, char** argv);
int convert_main(int argc, char** argv);
}  // namespace moecore::apps
