// The training layout: which ranks form each process group, Megatron-Core style with MoE Parallel Folding
// (attention/dense layers over TP × CP × DP × PP, MoE layers over ETP × EP × EDP × PP on the same world).
// ParallelConfig::validate and rank_layout are pure (no communication, any world size, unit-testable);
// make_process_groups then creates the communicators. Design notes: docs/echo-folding-perf.md §B.
#pragma once
#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/parallel/comm.h"

namespace moecore {

// Resolved sizes: DP = world / (TP·CP·PP), EDP = world / (ETP·EP·PP).
struct ParallelSizes {
  int world = 1, tp = 1, cp = 1, dp = 1, pp = 1;  // attention / dense layers
  int etp = 1, ep = 1, edp = 1;                   // MoE layers (same pp)
  std::string order;                              // validated order string
};

// Parallel sizes as given on the command line (Megatron's flag names). DP and EDP are derived.
struct ParallelConfig {
  // --tensor-model-parallel-size: TP, attention/dense tensor split (e.g. 2).
  int tensor_model_parallel_size = 1;
  // --context-parallel-size: CP, sequence split inside attention (e.g. 2).
  int context_parallel_size = 1;
  // --pipeline-model-parallel-size: PP, pipeline stages (e.g. 4).
  int pipeline_model_parallel_size = 1;
  // --expert-model-parallel-size: EP, ranks the routed experts are spread over (e.g. 8).
  int expert_model_parallel_size = 1;
  // --expert-tensor-parallel-size: ETP, tensor split inside one expert; 0 = same as TP (Megatron's default).
  int expert_tensor_parallel_size = 0;
  // --num-distributed-optimizer-instances: N copies of the distributed optimizer's state, each sharded over DP·CP / N
  // ranks (EDP / N for experts); must divide DP·CP and EDP (e.g. 2). Shapes the intra_* and inter_dist_opt groups.
  int num_distributed_optimizer_instances = 1;
  // Rank order, fastest-varying dim first, for both generators; Megatron's --use-tp-pp-dp-mapping selects
  // "tp-cp-ep-pp-dp" (then DP must equal EDP when PP > 1).
  std::string order = "tp-cp-ep-dp-pp";

  // Checks every constraint for `world_size` ranks and a model with `num_experts` routed experts (0 =
  // dense) and returns the resolved sizes; throws Error naming the fields and values otherwise. Pure and
  // deterministic, so a bad layout fails identically on every rank before any collective.
  ParallelSizes validate(int world_size, int num_experts) const;
};

// Megatron's RankGenerator.get_ranks: dims listed in `order` (leftmost varies fastest; size-1 dims missing
// from it are appended, larger ones must appear), rank = Σ coord_i · Π_{j<i} size_j. A group for `token`
// (e.g. "tp-ep") is the set of ranks sharing every coordinate not in the token; groups are enumerated by
// the remaining coordinates and members by the token's coordinates, both in mixed radix, leftmost fastest.
struct RankGeneratorSizes {
  int tp = 1, cp = 1, ep = 1, dp = 1, pp = 1;
};
std::vector<std::vector<int>> rank_generator_groups(const RankGeneratorSizes& sizes, std::string_view order,
                                                    std::string_view token);

// Every group kind moecore creates. Attention/dense groups come from the decoder generator
// (tp=TP, cp=CP, ep=1, dp=DP, pp=PP), MoE groups from the expert generator (tp=ETP, cp=1, ep=EP, dp=EDP,
// pp=PP). The last three are the partial distributed optimizer's (N = num_distributed_optimizer_instances), built as
// Megatron's initialize_model_parallel builds them: instance i of a dp-cp group is its members
// [i·DP·CP/N, (i+1)·DP·CP/N); of an edp group its members [i·EDP/N, (i+1)·EDP/N); the inter-instance group joins the
// members at the same place in the N instances of an edp group (member j, j + EDP/N, ...), and serves the dense
// parameters too (Megatron's get_inter_distributed_optimizer_instance_group; rank_layout checks that it joins the
// same places of the dp-cp instances). With N = 1: intra_dp_cp = dp_cp, intra_edp = edp, inter_dist_opt = singletons.
enum class GroupKind : int {
  tp,              // "tp": tensor parallel
  cp,              // "cp": context parallel
  dp,              // "dp": data parallel
  pp,              // "pp": pipeline; identical in both generators
  dp_cp,           // "dp-cp": gradient reduction of non-expert parameters
  tp_cp,           // "tp-cp"
  tp_dp,           // "tp-dp"
  tp_dp_cp,        // "tp-dp-cp": all ranks of one pipeline stage
  mp,              // "tp-pp": model parallel
  etp,             // expert "tp": tensor parallel inside an expert
  ep,              // expert "ep": expert parallel
  etp_ep,          // expert "tp-ep": the token dispatcher's group
  etp_ep_pp,       // expert "tp-ep-pp"
  edp,             // expert "dp": gradient reduction of expert parameters
  intra_dp_cp,     // one distributed-optimizer instance of a dp-cp group (Megatron's intra_partial_dp_group_with_cp)
  intra_edp,       // one instance of an edp group (intra_partial_expert_data_parallel_group)
  inter_dist_opt,  // the same shard in every instance (inter_partial_expert_data_parallel_group)
};
inline constexpr int kNumGroupKinds = 17;
std::string_view group_kind_name(GroupKind k);  // "tp", "dp_cp", "ep", "edp", "intra_dp_cp", ...
// Megatron's token: "tp", "dp-cp", "ep", "dp", ...; for the three instance kinds the token of the group they split
// ("dp-cp", "dp", "dp").
std::string_view group_kind_token(GroupKind k);
bool group_kind_is_expert(GroupKind k);

// The coordinates of one rank in both generators.
struct RankCoords {
  int tp = 0, cp = 0, dp = 0, pp = 0;  // attention / dense
  int etp = 0, ep = 0, edp = 0;        // MoE
};

// Every group of every kind for a whole world: a pure function of the config (no communication).
struct RankLayout {
  ParallelSizes sizes;
  // groups[kind]: a partition of the world ranks, in Megatron's enumeration order.
  std::array<std::vector<std::vector<int>>, kNumGroupKinds> groups;
  // where[kind][rank] = {index of the group in groups[kind], index of the rank inside that group}
  std::array<std::vector<std::array<int, 2>>, kNumGroupKinds> where;

  const std::vector<int>& group(GroupKind k, int rank) const;  // the group of kind k holding `rank`
  int index_in_group(GroupKind k, int rank) const;             // that rank's position in it
  RankCoords coords(int rank) const;
};
RankLayout rank_layout(const ParallelConfig& config, int world_size, int num_experts);

// This rank's communicators for every kind (identical rank sets share one communicator).
struct ProcessGroups {
  RankLayout layout;
  ProcessGroup world;
  std::array<ProcessGroup, kNumGroupKinds> groups;

  const ProcessGroup& get(GroupKind k) const { return groups[static_cast<size_t>(k)]; }
  const ProcessGroup& tp() const { return get(GroupKind::tp); }
  const ProcessGroup& cp() const { return get(GroupKind::cp); }
  const ProcessGroup& dp() const { return get(GroupKind::dp); }
  const ProcessGroup& pp() const { return get(GroupKind::pp); }
  const ProcessGroup& dp_cp() const { return get(GroupKind::dp_cp); }
  const ProcessGroup& tp_cp() const { return get(GroupKind::tp_cp); }
  const ProcessGroup& tp_dp() const { return get(GroupKind::tp_dp); }
  const ProcessGroup& tp_dp_cp() const { return get(GroupKind::tp_dp_cp); }
  const ProcessGroup& mp() const { return get(GroupKind::mp); }
  const ProcessGroup& etp() const { return get(GroupKind::etp); }
  const ProcessGroup& ep() const { return get(GroupKind::ep); }
  const ProcessGroup& etp_ep() const { return get(GroupKind::etp_ep); }
  const ProcessGroup& etp_ep_pp() const { return get(GroupKind::etp_ep_pp); }
  const ProcessGroup& edp() const { return get(GroupKind::edp); }
  const ProcessGroup& intra_dp_cp() const { return get(GroupKind::intra_dp_cp); }
  const ProcessGroup& intra_edp() const { return get(GroupKind::intra_edp); }
  const ProcessGroup& inter_dist_opt() const { return get(GroupKind::inter_dist_opt); }
};

// Validates (pure; a bad layout throws on every rank before any collective), then creates the
// communicators: collective over `world`, which every rank calls with the same arguments.
ProcessGroups make_process_groups(const ParallelConfig& config, int num_experts, const ProcessGroup& world);

}  // namespace moecore
