// ParallelConfig validation, Megatron's rank generator (masked orthogonal groups) and the layout of every
// group kind, all pure; then make_process_groups, the only function here that communicates (it splits
// the world once per distinct partition). Follows docs/echo-folding-perf.md §B exactly.
#include "moecore/parallel/process_groups.h"

#include <algorithm>
#include <utility>

#include "moecore/core/error.h"

namespace moecore {
namespace {

struct Dim {
  std::string_view name;
  int size;
};

// The order string with missing size-1 dims appended; `what` says which layout, for messages.
std::vector<Dim> parse_order(const RankGeneratorSizes& s, std::string_view order, std::string_view what) {
  const Dim all[5] = {{"tp", s.tp}, {"cp", s.cp}, {"ep", s.ep}, {"dp", s.dp}, {"pp", s.pp}};
  if (order.empty()) MOECORE_FAIL("parallel config: order is empty; use e.g. \"tp-cp-ep-dp-pp\"");
  std::vector<Dim> dims;
  size_t pos = 0;
  while (pos <= order.size()) {
    const size_t end = std::min(order.find('-', pos), order.size());
    const std::string_view tok = order.substr(pos, end - pos);
    const Dim* d = std::find_if(std::begin(all), std::end(all), [&](const Dim& x) { return x.name == tok; });
    if (d == std::end(all))
      MOECORE_FAIL("parallel config: order \"", order, "\" has unknown dim \"", tok,
                   "\"; use tp, cp, ep, dp and pp separated by '-' (e.g. \"tp-cp-ep-dp-pp\")");
    if (std::any_of(dims.begin(), dims.end(), [&](const Dim& x) { return x.name == tok; }))
      MOECORE_FAIL("parallel config: order \"", order, "\" lists \"", tok, "\" twice");
    dims.push_back(*d);
    pos = end + 1;
  }
  for (const Dim& d : all) {
    if (std::any_of(dims.begin(), dims.end(), [&](const Dim& x) { return x.name == d.name; })) continue;
    if (d.size != 1)
      MOECORE_FAIL("parallel config: order \"", order, "\" leaves out ", d.name, ", whose size is ", d.size, " in the ",
                   what, " layout; every dim of size > 1 must appear in the order");
    dims.push_back(d);
  }
  return dims;
}

std::vector<std::vector<int>> generate(const std::vector<Dim>& dims, std::string_view order, std::string_view token) {
  std::vector<bool> mask(dims.size(), false);
  size_t pos = 0;
  while (pos <= token.size()) {
    const size_t end = std::min(token.find('-', pos), token.size());
    const std::string_view tok = token.substr(pos, end - pos);
    auto it = std::find_if(dims.begin(), dims.end(), [&](const Dim& x) { return x.name == tok; });
    MOECORE_CHECK(it != dims.end(), "rank generator: token \"", token, "\" names \"", tok, "\", not a dim of \"", order,
                  "\"");
    mask[static_cast<size_t>(it - dims.begin())] = true;
    pos = end + 1;
  }
  // Global strides: leftmost fastest. Masked dims enumerate members, unmasked ones enumerate groups.
  std::vector<int> in_shape, in_stride, out_shape, out_stride;
  int stride = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    (mask[i] ? in_shape : out_shape).push_back(dims[i].size);
    (mask[i] ? in_stride : out_stride).push_back(stride);
    stride *= dims[i].size;
  }
  const int world = stride;
  int group_size = 1;
  for (int v : in_shape) group_size *= v;
  auto offset = [](int index, const std::vector<int>& shape, const std::vector<int>& strides) {
    int r = 0;
    for (size_t i = 0; i < shape.size(); ++i) {
      r += (index % shape[i]) * strides[i];
      index /= shape[i];
    }
    return r;
  };
  std::vector<std::vector<int>> groups(static_cast<size_t>(world / group_size));
  for (int gi = 0; gi < world / group_size; ++gi) {
    const int base = offset(gi, out_shape, out_stride);
    auto& grp = groups[static_cast<size_t>(gi)];
    grp.resize(static_cast<size_t>(group_size));
    for (int k = 0; k < group_size; ++k) grp[static_cast<size_t>(k)] = base + offset(k, in_shape, in_stride);
  }
  return groups;
}

std::string groups_str(const std::vector<std::vector<int>>& groups) {  // "[0,2] [1,3] ... (8 groups)"
  std::string s;
  for (size_t g = 0; g < groups.size() && g < 4; ++g) {
    s += g ? " [" : "[";
    for (size_t i = 0; i < groups[g].size(); ++i) s += (i ? "," : "") + std::to_string(groups[g][i]);
    s += "]";
  }
  if (groups.size() > 4) s += detail::str_cat(" ... (", groups.size(), " groups)");
  return s;
}

constexpr std::string_view kNames[kNumGroupKinds] = {
    "tp",  "cp", "dp",     "pp",        "dp_cp", "tp_cp",       "tp_dp",     "tp_dp_cp",      "mp",
    "etp", "ep", "etp_ep", "etp_ep_pp", "edp",   "intra_dp_cp", "intra_edp", "inter_dist_opt"};
constexpr std::string_view kTokens[kNumGroupKinds] = {"tp",       "cp",       "dp",    "pp", "dp-cp", "tp-cp",
                                                      "tp-dp",    "tp-dp-cp", "tp-pp", "tp", "ep",    "tp-ep",
                                                      "tp-ep-pp", "dp",       "dp-cp", "dp", "dp"};

// Each group of `whole` cut into n consecutive slices (instances); with `across`, the groups joining the j-th member
// of every slice instead (create_hierarchical_groups' second level).
std::vector<std::vector<int>> instances(const std::vector<std::vector<int>>& whole, int n, bool across) {
  std::vector<std::vector<int>> out;
  for (const auto& g : whole) {
    const size_t len = g.size() / static_cast<size_t>(n);
    if (!across) {
      for (size_t i = 0; i < static_cast<size_t>(n); ++i)
        out.emplace_back(g.begin() + i * len, g.begin() + (i + 1) * len);
      continue;
    }
    for (size_t j = 0; j < len; ++j) {
      auto& grp = out.emplace_back();
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) grp.push_back(g[i * len + j]);
    }
  }
  return out;
}

}  // namespace

std::string_view group_kind_name(GroupKind k) {
  return kNames[static_cast<int>(k)];
}
std::string_view group_kind_token(GroupKind k) {
  return kTokens[static_cast<int>(k)];
}
bool group_kind_is_expert(GroupKind k) {
  return k != GroupKind::intra_dp_cp && static_cast<int>(k) >= static_cast<int>(GroupKind::etp);
}

std::vector<std::vector<int>> rank_generator_groups(const RankGeneratorSizes& sizes, std::string_view order,
                                                    std::string_view token) {
  for (int v : {sizes.tp, sizes.cp, sizes.ep, sizes.dp, sizes.pp})
    MOECORE_CHECK(v >= 1, "rank generator: sizes must be >= 1, got ", v);
  // Megatron: CP only in the decoder generator, EP only in the expert one (issue #1459).
  MOECORE_CHECK(sizes.ep == 1 || sizes.cp == 1, "rank generator: ep (", sizes.ep, ") and cp (", sizes.cp,
                ") cannot both exceed 1 in one generator");
  return generate(parse_order(sizes, order, "rank generator"), order, token);
}

ParallelSizes ParallelConfig::validate(int world_size, int num_experts) const {
  auto positive = [](const char* field, int v) {
    if (v < 1) MOECORE_FAIL("parallel config: ", field, " (", v, ") must be >= 1");
  };
  if (world_size < 1) MOECORE_FAIL("parallel config: world_size (", world_size, ") must be >= 1");
  positive("tensor_model_parallel_size", tensor_model_parallel_size);
  positive("context_parallel_size", context_parallel_size);
  positive("pipeline_model_parallel_size", pipeline_model_parallel_size);
  positive("expert_model_parallel_size", expert_model_parallel_size);
  positive("num_distributed_optimizer_instances", num_distributed_optimizer_instances);
  if (expert_tensor_parallel_size < 0)
    MOECORE_FAIL("parallel config: expert_tensor_parallel_size (", expert_tensor_parallel_size,
                 ") must be >= 1, or 0 for \"same as tensor_model_parallel_size\"");
  if (num_experts < 0) MOECORE_FAIL("parallel config: num_experts (", num_experts, ") must be >= 0 (0 = dense model)");

  ParallelSizes s;
  s.world = world_size;
  s.tp = tensor_model_parallel_size;
  s.cp = context_parallel_size;
  s.pp = pipeline_model_parallel_size;
  s.ep = expert_model_parallel_size;
  s.etp = expert_tensor_parallel_size == 0 ? s.tp : expert_tensor_parallel_size;
  s.order = order;
  const int64_t attn = int64_t{s.tp} * s.cp * s.pp;
  if (world_size % attn != 0)
    MOECORE_FAIL("parallel config: world_size (", world_size, ") must be divisible by tensor_model_parallel_size (",
                 s.tp, ") x context_parallel_size (", s.cp, ") x pipeline_model_parallel_size (", s.pp, ") = ", attn,
                 ", since the data-parallel size is their quotient; launch a multiple of ", attn,
                 " ranks or change the sizes");
  s.dp = static_cast<int>(world_size / attn);
  const int64_t moe = int64_t{s.etp} * s.ep * s.pp;
  if (world_size % moe != 0)
    MOECORE_FAIL("parallel config: world_size (", world_size, ") must be divisible by expert_tensor_parallel_size (",
                 s.etp, expert_tensor_parallel_size == 0 ? ", from tensor_model_parallel_size" : "",
                 ") x expert_model_parallel_size (", s.ep, ") x pipeline_model_parallel_size (", s.pp, ") = ", moe,
                 ", since the expert data-parallel size is their quotient; launch a multiple of ", moe,
                 " ranks or change the sizes");
  s.edp = static_cast<int>(world_size / moe);
  if (num_experts == 0 && s.ep > 1)
    MOECORE_FAIL("parallel config: expert_model_parallel_size (", s.ep,
                 ") > 1 needs an MoE model, but num_experts is 0 (dense)");
  if (num_experts > 0 && num_experts % s.ep != 0)
    MOECORE_FAIL("parallel config: num_experts (", num_experts, ") must be divisible by expert_model_parallel_size (",
                 s.ep, ")");

  const RankGeneratorSizes dec{s.tp, s.cp, 1, s.dp, s.pp}, exp{s.etp, 1, s.ep, s.edp, s.pp};
  const auto dec_dims = parse_order(dec, order, "attention");
  const auto exp_dims = parse_order(exp, order, "expert");
  const bool pp_last = order.size() >= 2 && order.compare(order.size() - 2, 2, "pp") == 0;
  if (!pp_last && s.pp > 1 && s.edp != s.dp)
    MOECORE_FAIL("parallel config: order \"", order, "\" does not end in pp, so with pipeline_model_parallel_size (",
                 s.pp, ") > 1 the attention data-parallel size DP (", s.dp,
                 ") must equal the expert data-parallel size EDP (", s.edp, "); put pp last (\"tp-cp-ep-dp-pp\")");
  const auto dec_pp = generate(dec_dims, order, "pp");
  const auto exp_pp = generate(exp_dims, order, "pp");
  if (dec_pp != exp_pp)
    MOECORE_FAIL("parallel config: order \"", order, "\" gives different pipeline groups to attention (",
                 groups_str(dec_pp), ") and MoE layers (", groups_str(exp_pp), ") with tensor_model_parallel_size ",
                 s.tp, ", expert_tensor_parallel_size ", s.etp, ", expert_model_parallel_size ", s.ep,
                 "; a stage must hold both halves of its layers: put pp last "
                 "(\"tp-cp-ep-dp-pp\")");
  // Megatron's assertions (parallel_state.initialize_model_parallel), quoted, then the values.
  const int inst = num_distributed_optimizer_instances;
  if ((s.dp * s.cp) % inst != 0)
    MOECORE_FAIL(
        "parallel config: Data parallel size should be divisible by partial DistOpt shard factor: "
        "data-parallel size x context_parallel_size (",
        s.dp, " x ", s.cp, " = ", s.dp * s.cp, ") must be divisible by num_distributed_optimizer_instances (", inst,
        "); set --num-distributed-optimizer-instances to a divisor of it");
  if (s.edp % inst != 0)
    MOECORE_FAIL(
        "parallel config: Expert data parallel size should be divisible by partial DistOpt shard factor: "
        "expert data-parallel size (",
        s.edp, ") must be divisible by num_distributed_optimizer_instances (", inst,
        "); set --num-distributed-optimizer-instances to a divisor of it");
  return s;
}

const std::vector<int>& RankLayout::group(GroupKind k, int rank) const {
  const auto& w = where[static_cast<size_t>(k)];
  MOECORE_CHECK(rank >= 0 && rank < static_cast<int>(w.size()), "rank ", rank, " outside world of ", w.size());
  return groups[static_cast<size_t>(k)][static_cast<size_t>(w[static_cast<size_t>(rank)][0])];
}

int RankLayout::index_in_group(GroupKind k, int rank) const {
  const auto& w = where[static_cast<size_t>(k)];
  MOECORE_CHECK(rank >= 0 && rank < static_cast<int>(w.size()), "rank ", rank, " outside world of ", w.size());
  return w[static_cast<size_t>(rank)][1];
}

RankCoords RankLayout::coords(int rank) const {
  // For a one-dim token the position inside the group is that dim's coordinate.
  return {index_in_group(GroupKind::tp, rank),  index_in_group(GroupKind::cp, rank),
          index_in_group(GroupKind::dp, rank),  index_in_group(GroupKind::pp, rank),
          index_in_group(GroupKind::etp, rank), index_in_group(GroupKind::ep, rank),
          index_in_group(GroupKind::edp, rank)};
}

namespace {
// The dense parameters' shards are all-reduced over the experts' inter-instance group (as in Megatron), and the grad
// norm sums every shard of an instance once: both need each rank in the same instance of its dp-cp and its edp group,
// and its inter-instance group to join the same place of every dp-cp instance. Megatron's two orders always give
// that; another order may not (an Error: it is the order string's doing).
void check_instances(const RankLayout& l, int n) {
  if (n == 1) return;
  const int dense = l.sizes.dp * l.sizes.cp / n, expert = l.sizes.edp / n;
  for (int r = 0; r < l.sizes.world; ++r) {
    const int d = l.index_in_group(GroupKind::dp_cp, r), e = l.index_in_group(GroupKind::edp, r);
    std::vector<int> want;
    const auto& dp_cp = l.group(GroupKind::dp_cp, r);
    for (int i = 0; i < n; ++i) want.push_back(dp_cp[static_cast<size_t>(i * dense + d % dense)]);
    const auto& inter = l.group(GroupKind::inter_dist_opt, r);
    if (d / dense == e / expert && want == inter) continue;
    MOECORE_FAIL(
        "parallel config: order \"", l.sizes.order, "\" with num_distributed_optimizer_instances (", n, ") gives rank ",
        r, " different distributed-optimizer instances for attention and MoE layers: ",
        d / dense != e / expert
            ? detail::str_cat("instance ", d / dense, " of its dp-cp group ", groups_str({dp_cp}), " but instance ",
                              e / expert, " of its edp group ", groups_str({l.group(GroupKind::edp, r)}))
            : detail::str_cat("its inter-instance group ", groups_str({inter}), " is not ", groups_str({want}),
                              ", the same place in its dp-cp group's instances"),
        "; use Megatron's order \"tp-cp-ep-dp-pp\" or \"tp-cp-ep-pp-dp\"");
  }
}
}  // namespace

RankLayout rank_layout(const ParallelConfig& config, int world_size, int num_experts) {
  RankLayout layout;
  layout.sizes = config.validate(world_size, num_experts);
  const ParallelSizes& s = layout.sizes;
  const auto dec = parse_order({s.tp, s.cp, 1, s.dp, s.pp}, s.order, "attention");
  const auto exp = parse_order({s.etp, 1, s.ep, s.edp, s.pp}, s.order, "expert");
  const int n = config.num_distributed_optimizer_instances;
  for (int k = 0; k < kNumGroupKinds; ++k) {
    const auto kind = static_cast<GroupKind>(k);
    auto& groups = layout.groups[static_cast<size_t>(k)];
    if (kind == GroupKind::intra_dp_cp)
      groups = instances(layout.groups[static_cast<size_t>(GroupKind::dp_cp)], n, false);
    else if (kind == GroupKind::intra_edp || kind == GroupKind::inter_dist_opt)
      groups = instances(layout.groups[static_cast<size_t>(GroupKind::edp)], n, kind == GroupKind::inter_dist_opt);
    else
      groups = generate(group_kind_is_expert(kind) ? exp : dec, s.order, group_kind_token(kind));
    auto& where = layout.where[static_cast<size_t>(k)];
    where.assign(static_cast<size_t>(world_size), {-1, -1});
    for (size_t g = 0; g < groups.size(); ++g)
      for (size_t i = 0; i < groups[g].size(); ++i) {
        auto& w = where[static_cast<size_t>(groups[g][i])];
        MOECORE_CHECK(w[0] < 0, "rank ", groups[g][i], " in two ", group_kind_name(kind), " groups");
        w = {static_cast<int>(g), static_cast<int>(i)};
      }
    for (size_t r = 0; r < where.size(); ++r)
      MOECORE_CHECK(where[r][0] >= 0, "rank ", r, " in no ", group_kind_name(kind), " group");
  }
  check_instances(layout, n);
  return layout;
}

ProcessGroups make_process_groups(const ParallelConfig& config, int num_experts, const ProcessGroup& world) {
  if (!world.valid()) MOECORE_FAIL("make_process_groups: the world group is default-constructed; pass comm_world()");
  ProcessGroups pg;
  try {
    pg.layout = rank_layout(config, world.size(), num_experts);
  } catch (const Error& e) {
    if (world.size() == 1 && !comm_available())
      MOECORE_FAIL(e.what(),
                   " (moecore was built without MPI, so the world has one rank; configure with "
                   "-DMOECORE_MPI=ON and launch with mpirun)");
    throw;
  }
  pg.world = world;
  // Layout rank i is the world group's i-th rank; identical partitions share one communicator.
  std::vector<std::pair<std::vector<std::vector<int>>, ProcessGroup>> made;
  for (int k = 0; k < kNumGroupKinds; ++k) {
    const auto kind = static_cast<GroupKind>(k);
    auto partition = pg.layout.groups[static_cast<size_t>(k)];
    for (auto& grp : partition)
      for (int& r : grp) r = world.ranks()[static_cast<size_t>(r)];
    const std::string name(group_kind_name(kind));
    auto same = std::find_if(made.begin(), made.end(), [&](const auto& m) { return m.first == partition; });
    if (same != made.end()) {
      pg.groups[static_cast<size_t>(k)] = same->second.renamed(name);
    } else {
      pg.groups[static_cast<size_t>(k)] = group_split(world, name, partition);
      made.emplace_back(std::move(partition), pg.groups[static_cast<size_t>(k)]);
    }
  }
  return pg;
}

}  // namespace moecore
