#include "moecore/model/parallel_layout.h"

#include <algorithm>
#include <cctype>

namespace moecore::model {

namespace {

// Every size constraint of tensor and sequence parallelism, checked from the configuration alone (no collective),
// so a bad layout fails identically on every rank.
void check_tensor_parallel(const ModelConfig& cfg_, const ModelParallel& par_) {
  const int64_t P = par_.tp.size();
  if (P == 1) return;
  if (cfg_.moe.enabled() && !par_.sequence_parallel)
    MOECORE_FAIL(
        "model: MoE layers (--num-experts) with --tensor-model-parallel-size ", P,
        " need --sequence-parallel (as Megatron: \"when using MoE and tensor parallelism, sequence parallelism "
        "must be used\")");
  auto need = [&](int64_t v, const char* what, const char* why) {
    if (v % P != 0)
      MOECORE_FAIL("model: ", what, " (", v, ") must be divisible by --tensor-model-parallel-size (", P, "): ", why);
  };
  need(cfg_.num_attention_heads, "--num-attention-heads", "each rank holds whole heads");
  need(cfg_.query_groups(), "the query groups (--num-query-groups, else --num-attention-heads)",
       "linear_qkv is split by query group");
  need(cfg_.ffn(), "--ffn-hidden-size", "linear_fc1 and linear_fc2 are split along it");
  need(cfg_.vocab_size, "the padded vocabulary size", "the embedding and output layer are split along it");
  if (par_.sequence_parallel)  // of the positions each context-parallel rank holds
    need(cfg_.seq_length / par_.cp.size(),
         par_.cp.size() > 1 ? "--seq-length / --context-parallel-size" : "--seq-length",
         "sequence parallelism splits it");
}

// Expert tensor parallelism splits every expert's ffn; its groups must agree with the EP group. (A dense model has
// nothing to split: the size, which defaults to TP as in Megatron, is then without effect.)
void check_expert_tensor_parallel(const ModelConfig& cfg_, const ModelParallel& par_) {
  const int64_t Q = par_.etp.size(), EP = par_.ep.size();
  if (Q == 1 || !cfg_.moe.enabled()) return;
  if (cfg_.moe_ffn() % Q != 0)
    MOECORE_FAIL("model: the expert ffn size (--moe-ffn-hidden-size, else --ffn-hidden-size: ", cfg_.moe_ffn(),
                 ") must be divisible by --expert-tensor-parallel-size (", Q, "): each rank holds a slice of it");
  if (par_.etp_ep.size() != Q * EP)
    MOECORE_FAIL("model: the etp_ep group has ", par_.etp_ep.size(), " ranks, not expert-tensor-parallel (", Q,
                 ") x expert-parallel (", EP, ")");
}

// Megatron's load-balanced split needs 2 x CP equal chunks of every sequence.
void check_context_parallel(const ModelConfig& cfg_, const ModelParallel& par_) {
  const int64_t CP = par_.cp.size();
  if (CP == 1) return;
  if (cfg_.seq_length % (2 * CP) != 0)
    MOECORE_FAIL("model: --seq-length (", cfg_.seq_length, ") must be divisible by 2 x --context-parallel-size (",
                 2 * CP, "): each rank holds two equal chunks of every sequence (Megatron's load-balanced split)");
  if (par_.tp_cp.size() != par_.tp.size() * CP)
    MOECORE_FAIL("model: the tp_cp group has ", par_.tp_cp.size(), " ranks, not tensor-parallel (", par_.tp.size(),
                 ") x context-parallel (", CP, ")");
}

// The stage's model chunks from the split (one chunk of every layer at PP 1), and the chunk of each layer.
StageLayout stage_layout(const ModelConfig& cfg_, const ModelParallel& par_) {
  StageLayout st;
  auto& chunks_ = st.chunks;
  auto& layer_chunk_ = st.layer_chunk;
  st.first_stage = par_.pp.rank() == 0;
  st.last_stage = par_.pp.rank() == par_.pp.size() - 1;
  const int64_t PP = par_.pp.size(), L = cfg_.num_layers, V = par_.virtual_stages;
  if (PP == 1) {
    if (V != 1) MOECORE_FAIL("model: ", V, " virtual pipeline stages per rank need --pipeline-model-parallel-size > 1");
    chunks_.emplace_back(0, L);
  } else {
    const auto& split = par_.pipeline_layers;
    int64_t total = 0;
    for (int64_t n : split) total += n;
    if (V < 1 || static_cast<int64_t>(split.size()) != PP * V || total != L)
      MOECORE_FAIL("model: the pipeline split gives ", split.size(), " virtual stages holding ", total,
                   " decoder layers, not --pipeline-model-parallel-size (", PP, ") x virtual stages per rank (", V,
                   ") holding --num-layers (", L, ")");
    int64_t first = 0;
    for (int64_t k = 0; k < PP * V; ++k) {
      const int64_t n = split[static_cast<size_t>(k)];
      if (k % PP == par_.pp.rank()) chunks_.emplace_back(first, first + n);
      first += n;
    }
  }
  layer_chunk_.assign(static_cast<size_t>(L + cfg_.mtp_num_layers), -1);
  for (size_t c = 0; c < chunks_.size(); ++c)
    for (int64_t l = chunks_[c].first; l < chunks_[c].second; ++l)
      layer_chunk_[static_cast<size_t>(l)] = static_cast<int64_t>(c);
  if (st.last_stage)
    for (int64_t l = L; l < L + cfg_.mtp_num_layers; ++l)
      layer_chunk_[static_cast<size_t>(l)] = static_cast<int64_t>(chunks_.size()) - 1;
  return st;
}

}  // namespace

StageLayout check_layout(const ModelConfig& cfg, ModelParallel& par) {
  const int64_t EP = par.ep.size();
  if (EP > 1 && !cfg.moe.enabled())
    MOECORE_FAIL("model: --expert-model-parallel-size ", EP, " needs routed experts (--num-experts)");
  if (cfg.moe.enabled() && cfg.moe.num_experts % EP != 0)
    MOECORE_FAIL("model: --num-experts (", cfg.moe.num_experts, ") must be divisible by --expert-model-parallel-size (",
                 EP, ")");
  if (EP > 1 && par.dispatcher == moe::DispatcherKind::local)
    MOECORE_FAIL("model: expert parallelism needs the alltoall or allgather dispatcher");
  check_expert_tensor_parallel(cfg, par);
  StageLayout st = stage_layout(cfg, par);
  if (par.tp.size() == 1) par.sequence_parallel = false;
  check_context_parallel(cfg, par);
  check_tensor_parallel(cfg, par);
  return st;
}

bool pipeline_word_embeddings_copy(const ModelConfig& cfg, const ProcessGroup& pp) {
  return pp.size() > 1 && pp.rank() == pp.size() - 1 &&
         (!cfg.untie_embeddings_and_output_weights || cfg.mtp_num_layers > 0);
}

bool pipeline_stage_holds(const std::string& name, const ModelConfig& cfg, const ModelParallel& par) {
  const int pp = par.pp.size(), rank = par.pp.rank();
  if (pp == 1) return true;
  const std::string layers = "decoder.layers.";
  if (name.starts_with(layers)) {  // the virtual stage holding the layer, on rank k % pp
    int64_t l = std::stoll(name.substr(layers.size())), k = 0;
    for (; k < static_cast<int64_t>(par.pipeline_layers.size()); ++k) {
      l -= par.pipeline_layers[static_cast<size_t>(k)];
      if (l < 0) break;
    }
    return k % pp == rank;
  }
  if (name.starts_with("embedding."))
    return rank == 0 || (pipeline_word_embeddings_copy(cfg, par.pp) && name == "embedding.word_embeddings.weight");
  return rank == pp - 1;  // decoder.final_layernorm, output_layer, mtp
}

std::vector<int64_t> pipeline_stage_layers(int64_t num_layers, int64_t pp, int64_t first, int64_t last, int64_t vpp,
                                           bool embedding, bool loss) {
  if (pp < 1) MOECORE_FAIL("model: --pipeline-model-parallel-size (", pp, ") must be positive");
  if (vpp < 1) MOECORE_FAIL("model: the virtual pipeline stages per rank (", vpp, ") must be positive");
  if (vpp > 1 && pp == 1)
    MOECORE_FAIL("model: a virtual pipeline (--num-virtual-stages-per-pipeline-rank ", vpp,
                 " or --num-layers-per-virtual-pipeline-stage) needs --pipeline-model-parallel-size > 1");
  if (embedding || loss) {  // Megatron: the embedding and the loss count as a layer each, split evenly
    if (first >= 0 || last >= 0)
      MOECORE_FAIL(
          "model: --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split exclude "
          "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (as in Megatron)");
    const int64_t total = num_layers + (embedding ? 1 : 0) + (loss ? 1 : 0), stages = pp * vpp;
    if (pp == 1 || total % stages != 0)
      MOECORE_FAIL("model: --num-layers (", num_layers, ")", embedding ? " + 1 for the embedding" : "",
                   loss ? " + 1 for the loss" : "", " = ", total,
                   " must be divisible by --pipeline-model-parallel-size (", pp, ")",
                   vpp > 1 ? " x virtual stages per rank (" + std::to_string(vpp) + ")" : "",
                   pp == 1 ? ", which must be > 1" : "");
    std::vector<int64_t> split(static_cast<size_t>(stages), total / stages);
    split.front() -= embedding ? 1 : 0;
    split.back() -= loss ? 1 : 0;
    return split;
  }
  if (pp == 1) {
    if (first >= 0 || last >= 0)
      MOECORE_FAIL(
          "model: --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
          "--pipeline-model-parallel-size > 1");
    return {num_layers};
  }
  std::vector<int64_t> split(static_cast<size_t>(pp), 0);
  int64_t rest = num_layers, middle = pp;
  if (first >= 0) {
    split.front() = first;
    rest -= first;
    --middle;
  }
  if (last >= 0) {
    split.back() = last;
    rest -= last;
    --middle;
  }
  if (middle == pp && num_layers % pp != 0)
    MOECORE_FAIL("model: --num-layers (", num_layers, ") must be divisible by --pipeline-model-parallel-size (", pp,
                 "), or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers");
  if (first == 0 || last == 0 || first < -1 || last < -1 || rest < middle ||
      (middle == 0 ? rest != 0 : rest % middle != 0))
    MOECORE_FAIL("model: --num-layers (", num_layers, ") does not split over --pipeline-model-parallel-size (", pp,
                 ") stages with --decoder-first-pipeline-num-layers ", first,
                 " and --decoder-last-pipeline-num-layers ", last, " (-1: unset): ", rest,
                 " layers would remain for the other ", middle,
                 " stages, which must share them equally, at least one layer each");
  for (int64_t r = 0; r < pp; ++r)
    if (!((r == 0 && first >= 0) || (r == pp - 1 && last >= 0))) split[static_cast<size_t>(r)] = rest / middle;
  if (vpp == 1) return split;
  std::vector<int64_t> chunks(static_cast<size_t>(pp * vpp));
  for (int64_t r = 0; r < pp; ++r) {
    const int64_t n = split[static_cast<size_t>(r)];
    if (n % vpp != 0)
      MOECORE_FAIL("model: pipeline stage ", r, " holds ", n, " decoder layers (--num-layers ", num_layers,
                   " over --pipeline-model-parallel-size ", pp, ", first ", first, ", last ", last,
                   "), which do not split evenly over its ", vpp, " virtual pipeline stages");
    for (int64_t c = 0; c < vpp; ++c) chunks[static_cast<size_t>(c * pp + r)] = n / vpp;
  }
  return chunks;
}

namespace {
// Expands Megatron's layout syntax from s[at] on until a ')' (consumed) or the end: symbols, '|', 'x*N', '(...)*N'.
std::string expand_layout(const std::string& s, size_t& at, const std::string& layout, int depth) {
  auto fail = [&](const std::string& why) {
    MOECORE_FAIL("--pipeline-model-parallel-layout '", layout, "': ", why, " at character ", at + 1);
  };
  std::string out;
  while (at < s.size()) {
    const char c = s[at];
    std::string item;
    if (c == ')') {
      if (depth == 0) fail("unmatched ')'");
      ++at;
      return out;
    }
    if (c == '(') {
      ++at;
      item = expand_layout(s, at, layout, depth + 1);
    } else if (c == 'E' || c == 't' || c == 'm' || c == 'L' || c == '|') {
      item = std::string(1, c);
      ++at;
    } else if (c == ',' || c == ' ') {
      ++at;
      continue;
    } else {
      fail(std::string("'") + c + "' is not one of E t m L | , ( ) *");
    }
    if (at < s.size() && s[at] == '*') {
      size_t end = ++at;
      while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
      if (end == at || end - at > 6) fail("'*' needs a repeat count");
      const int64_t n = std::stoll(s.substr(at, end - at));
      at = end;
      std::string rep;
      for (int64_t k = 0; k < n; ++k) rep += item;
      item = rep;
    }
    out += item;
  }
  if (depth > 0) fail("unclosed '('");
  return out;
}
}  // namespace

std::vector<int64_t> pipeline_layout_stage_layers(const std::string& layout, int64_t num_layers, int64_t mtp_num_layers,
                                                  int64_t pp) {
  size_t at = 0;
  const std::string flat = expand_layout(layout, at, layout, 0);
  std::vector<std::string> stages(1);
  for (char c : flat) {
    if (c == '|')
      stages.emplace_back();
    else
      stages.back().push_back(c);
  }
  const auto count = [](const std::string& st, char c) { return std::count(st.begin(), st.end(), c); };
  auto fail = [&](const auto&... why) { MOECORE_FAIL("--pipeline-model-parallel-layout '", layout, "': ", why...); };
  const auto S = static_cast<int64_t>(stages.size());
  if (S % pp != 0)  // (S / pp model chunks per rank)
    fail(S, " stages for --pipeline-model-parallel-size ", pp, " (the stages must be a multiple of it)");
  int64_t t = 0, m = 0, e = 0, l = 0;
  for (const std::string& st : stages)
    t += count(st, 't'), m += count(st, 'm'), e += count(st, 'E'), l += count(st, 'L');
  if (t != num_layers) fail("it names ", t, " decoder layers (t), --num-layers is ", num_layers);
  if (m != mtp_num_layers) fail("it names ", m, " MTP layers (m), --mtp-num-layers is ", mtp_num_layers);
  if (e != 1 || stages.front().empty() || stages.front().front() != 'E')
    fail("the embedding (E) must appear once, first on the first stage");
  if (l != 1 || stages.back().empty() || stages.back().back() != 'L')
    fail("the loss (L) must appear once, last on the last stage");
  const std::string& last = stages.back();
  if (m > 0 && (count(last, 'm') != m || (last.rfind('t') != std::string::npos && last.find('m') < last.rfind('t'))))
    fail(
        "moecore runs the MTP layers (m) on the last stage, after its decoder layers and before the loss; other "
        "placements are not supported yet");
  std::vector<int64_t> split;
  for (const std::string& st : stages) split.push_back(count(st, 't'));
  return split;
}

ModelParallel model_parallel(const ProcessGroups& pg, bool sequence_parallel, moe::DispatcherKind dispatcher,
                             std::vector<int64_t> pipeline_layers) {
  ModelParallel m;
  m.tp = pg.tp();
  m.sequence_parallel = sequence_parallel;
  m.cp = pg.cp();
  m.tp_cp = pg.tp_cp();
  m.ep = pg.ep();
  m.etp = pg.etp();
  m.etp_ep = pg.etp_ep();
  m.dispatcher = dispatcher;
  m.dp = pg.dp();
  m.pp = pg.pp();
  m.pipeline_layers = std::move(pipeline_layers);
  if (!m.pipeline_layers.empty()) m.virtual_stages = static_cast<int64_t>(m.pipeline_layers.size()) / m.pp.size();
  return m;
}

}  // namespace moecore::model
