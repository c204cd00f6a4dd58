// GPT decoder assembly from its specs: parameters, initialisation, per-layer modules, and the step's forward/backward
// sequence (decoder layers, then the multi-token-prediction depths).
#include "moecore/model/gpt.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

#include "moecore/core/rng.h"
#include "moecore/model/param_specs.h"
#include "moecore/model/rope_table.h"
#include "moecore/nn/norm.h"

namespace moecore::model {
int64_t MemoryPlan::total() const {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

std::string MemoryPlan::format() const {
  std::string s = "memory plan:\n";
  for (int c = 0; c < kNumMemCategories; ++c) {
    if (!bytes[c]) continue;
    char line[96];
    std::snprintf(line, sizeof line, "  %-16s %12s\n", mem_category_name(static_cast<MemCategory>(c)),
                  memory_format_bytes(bytes[c]).c_str());
    s += line;
  }
  char line[96];
  std::snprintf(line, sizeof line, "  %-16s %12s\n", "total", memory_format_bytes(total()).c_str());
  return s + line;
}

// Every size constraint of tensor and sequence parallelism, checked from the configuration alone (no collective),
// so a bad layout fails identically on every rank.
void GptModel::check_tensor_parallel() const {
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
void GptModel::check_expert_tensor_parallel() const {
  const int64_t Q = par_.etp.size(), EP = par_.ep.size();
  if (Q == 1 || !cfg_.moe.enabled()) return;
  if (cfg_.moe_ffn() % Q != 0)
    MOECORE_FAIL("model: the expert ffn size (--moe-ffn-hidden-size, else --ffn-hidden-size: ", cfg_.moe_ffn(),
                 ") must be divisible by --expert-tensor-parallel-size (", Q, "): each rank holds a slice of it");
  if (par_.etp_ep.size() != Q * EP)
    MOECORE_FAIL("model: the etp_ep group has ", par_.etp_ep.size(), " ranks, not expert-tensor-parallel (", Q,
                 ") x expert-parallel (", EP, ")");
}

// The stage's model chunks from the split (one chunk of every layer at PP 1), and the chunk of each layer.
void GptModel::check_pipeline() {
  const int64_t PP = par_.pp.size(), L = cfg_.num_layers, V = par_.virtual_stages;
  chunks_.clear();
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
  if (holds_loss_heads())
    for (int64_t l = L; l < L + cfg_.mtp_num_layers; ++l) layer_chunk_[static_cast<size_t>(l)] = num_chunks() - 1;
  slot_.assign(chunks_.size(), 0);
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

// Megatron's load-balanced split needs 2 x CP equal chunks of every sequence.
void GptModel::check_context_parallel() const {
  const int64_t CP = par_.cp.size();
  if (CP == 1) return;
  if (cfg_.seq_length % (2 * CP) != 0)
    MOECORE_FAIL("model: --seq-length (", cfg_.seq_length, ") must be divisible by 2 x --context-parallel-size (",
                 2 * CP, "): each rank holds two equal chunks of every sequence (Megatron's load-balanced split)");
  if (par_.tp_cp.size() != par_.tp.size() * CP)
    MOECORE_FAIL("model: the tp_cp group has ", par_.tp_cp.size(), " ranks, not tensor-parallel (", par_.tp.size(),
                 ") x context-parallel (", CP, ")");
}

// This rank's positions of every sequence of a host batch [B*S] (rows b * S/CP + s: position
// context_parallel_position(s)), written into out (host [B*S/CP]); the batch itself without CP.
Tensor GptModel::local_positions(const Tensor& batch_h, const Tensor& out) const {
  const int CP = par_.cp.size();
  if (CP == 1) return batch_h;
  const int64_t S = cfg_.seq_length, Sl = S / CP;
  const int32_t* src = batch_h.data<int32_t>();
  int32_t* dst = out.data<int32_t>();
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t s = 0; s < Sl; ++s)
      dst[b * Sl + s] = src[b * S + nn::context_parallel_position(s, S, par_.cp.rank(), CP)];
  return out;
}

GptModel::GptModel(const ModelConfig& cfg, int64_t micro_batch_size, uint64_t seed, const ModelParallel& parallel,
                   Device device)
    : cfg_(cfg), B_(micro_batch_size), device_(device), seed_(seed), par_(parallel) {
  cfg_.validate();
  if (B_ <= 0) MOECORE_FAIL("model: micro_batch_size (", B_, ") must be positive");
  const int64_t EP = par_.ep.size();
  if (EP > 1 && !cfg_.moe.enabled())
    MOECORE_FAIL("model: --expert-model-parallel-size ", EP, " needs routed experts (--num-experts)");
  if (cfg_.moe.enabled() && cfg_.moe.num_experts % EP != 0)
    MOECORE_FAIL("model: --num-experts (", cfg_.moe.num_experts,
                 ") must be divisible by --expert-model-parallel-size (", EP, ")");
  if (EP > 1 && par_.dispatcher == moe::DispatcherKind::local)
    MOECORE_FAIL("model: expert parallelism needs the alltoall or allgather dispatcher");
  check_expert_tensor_parallel();
  check_pipeline();
  const int64_t ETP = par_.etp.size();
  const int64_t P = par_.tp.size();
  if (P == 1) par_.sequence_parallel = false;  // as Megatron: sequence parallelism needs TP > 1
  check_context_parallel();
  check_tensor_parallel();
  const int CP = par_.cp.size();
  // S: this rank's positions of each sequence (all of them without context parallelism)
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size, S = cfg_.seq_length / CP;
  const int64_t T = B_ * S, D = cfg_.head_dim(), G = cfg_.query_groups(), R = cfg_.num_attention_heads / G;
  const int64_t N = par_.sequence_parallel ? T / P : T;  // rows of the residual stream on this rank
  const DType c = cfg_.compute_dtype;
  dims_.N = N;
  dims_.H = H;
  dims_.F = cfg_.ffn() / P;
  dims_.qkv = {B_, S, G / P, R, D};
  dims_.tp = &par_.tp;
  dims_.sequence_parallel = par_.sequence_parallel;
  dims_.cp = CP > 1 ? &par_.cp : nullptr;
  dims_.eps = cfg_.norm_epsilon;
  dims_.layernorm = cfg_.normalization == Normalization::layernorm;
  dims_.swiglu = cfg_.swiglu;
  dims_.rope = cfg_.rope();
  dims_.qk_norm = cfg_.qk_layernorm;
  dims_.dropout = cfg_.hidden_dropout > 0.0f;
  dims_.compute = c;
  dims_.device = device_;
  layers_ = layer_specs(cfg_);
  const bool mla =
      std::any_of(layers_.begin(), layers_.end(), [](const LayerSpec& s) { return s.attention == AttentionKind::mla; });
  standard_attention_ = std::any_of(layers_.begin(), layers_.end(),
                                    [](const LayerSpec& s) { return s.attention == AttentionKind::standard; });
  if (mla) {
    mla_dims_ = {B_,
                 S,
                 H,
                 cfg_.num_attention_heads / P,  // this rank's heads under TP
                 cfg_.q_lora_rank,
                 cfg_.kv_lora_rank,
                 cfg_.qk_head_dim,
                 cfg_.qk_pos_emb_head_dim,
                 cfg_.v_head_dim,
                 cfg_.qk_layernorm,
                 cfg_.mla_softmax_scale_mult(),
                 CP};
    dims_.qk_norm = false;  // with MLA, --qk-layernorm is the latent norms
  }
  // The MoE layers take this rank's rows: under sequence parallelism its slice of every sequence.
  moe_dims_ = {N, B_, H, cfg_.moe_ffn(), cfg_.moe.shared_expert_intermediate_size, c};
  moe_dims_.sequence_group = sequence_group();
  moe_dims_.ep = EP;
  moe_dims_.etp = ETP;
  moe_dims_.etp_rank = par_.etp.rank();
  moe_dims_.device = device_;
  moe_dims_.dispatcher = EP * ETP > 1 ? par_.dispatcher : moe::DispatcherKind::local;
  moe_dims_.recompute_act = cfg_.recompute.selects("moe_act");
  if (cfg_.moe.enabled()) {
    moe::echo_check_layout(cfg_.moe, EP, ETP, par_.dispatcher);
    moe_dims_.received_capacity = cfg_.moe.received_token_capacity;
  }
  if (cfg_.moe.enabled() && cfg_.moe.enable_echo) {
    moe::EchoDims& e = moe_dims_.echo;
    e.slots = cfg_.moe.num_echo_experts;
    e.recompute_dispatch = cfg_.moe.echo_recompute_expert_dispatch;
    e.random = cfg_.moe.echo_random_offloading;
    e.seed = seed_;
    e.biases = cfg_.add_bias_linear;
    e.group = &par_.ep;
  }
  if (EP * ETP > 1 && par_.dispatcher == moe::DispatcherKind::alltoall)
    dispatcher_ = std::make_unique<moe::AllToAllDispatcher>(par_.ep, par_.etp);
  else if (EP * ETP > 1)
    dispatcher_ = std::make_unique<moe::AllGatherDispatcher>(ETP > 1 ? par_.etp_ep : par_.ep, ETP);
  else
    dispatcher_ = std::make_unique<moe::LocalDispatcher>();

  // Allocation from the parameter table. Expert weights are [E/EP, ...] shards of the global [E, ...] tensor, and
  // under TP the split weights are this rank's TensorShard; both are filled with the values the global tensor has at
  // those positions (initialisation depends on (seed, name, global element index)). Pointers into params_ stay
  // valid: the vector is reserved for its final size first.
  // This pipeline stage's part of the table (every parameter at PP 1).
  std::vector<ParamSpec> specs;
  const bool embedding_copy = pipeline_word_embeddings_copy(cfg_, par_.pp);
  for (const ParamSpec& s : parameter_specs(cfg_))
    if (pipeline_stage_holds(s.name, cfg_, par_)) specs.push_back(s);
  params_.reserve(specs.size());
  std::map<std::string, Param*> by_name;
  for (const ParamSpec& s : specs) {
    Param& p = params_.emplace_back();
    p.pipeline_copy = embedding_copy && s.name == "embedding.word_embeddings.weight";
    p.name = s.name;
    Shape shape = s.shape;
    if (s.expert) shape[0] /= EP;
    // The tensor-parallel split: over tp, or for the routed experts' weights over etp (within this rank's experts).
    const ProcessGroup& split = s.expert ? par_.etp : par_.tp;
    if (split.size() > 1 && s.tp_dim >= 0) p.tp = {s.tp_dim, s.tp_parts, split.rank(), split.size()};
    const Shape block = shape;  // this rank's part before the split: [E/EP, ...] of experts, else the global shape
    shape = p.tp.local_shape(shape);
    // (Expert weights are summed over the expert-data-parallel group, which holds the TP ranks.)
    p.tp_grad_sum = P > 1 && !p.tp.sharded() && !s.expert &&
                    (s.tp_grad == ParamSpec::TpGrad::head_partial ||
                     (s.tp_grad == ParamSpec::TpGrad::sequence_partial && par_.sequence_parallel));
    p.value = Tensor::empty(shape, DType::f32, MemCategory::parameters, device_);
    p.grad = Tensor::zeros(shape, DType::f32, MemCategory::gradients, device_);
    // Megatron decays weights only: norms and biases (of any rank, e.g. experts' [E, W]) are not decayed.
    p.weight_decay = shape.ndim >= 2 && !p.name.ends_with(".bias");
    p.expert_parallel = s.expert;
    const uint64_t first = s.expert ? static_cast<uint64_t>(par_.ep.rank() * block.numel()) : 0;
    if (s.init == ParamInit::normal && p.tp.sharded()) {  // run by run of the shard, then one upload
      Tensor host = Tensor::empty(shape, DType::f32, MemCategory::workspace);
      Tensor flat = host.view({host.numel()});
      p.tp.for_each_run(block, [&](int64_t lo, int64_t go, int64_t n) {
        Tensor run = flat.slice(0, lo, lo + n);
        rng_fill_normal(run, seed, p.name, 0.0f, s.std, first + static_cast<uint64_t>(go));
      });
      p.value.copy_from(host);
    } else if (s.init == ParamInit::normal)
      rng_fill_normal(p.value, seed, p.name, 0.0f, s.std, first);
    else
      p.value.fill_(s.init == ParamInit::ones ? 1.0f : 0.0f);
    p.compute =
        (c == DType::f32 || !p.weight_decay) ? p.value : Tensor::empty(shape, c, MemCategory::parameters, device_);
    by_name[p.name] = &p;
  }
  if (par_.pp.size() > 1 && (!cfg_.untie_embeddings_and_output_weights || cfg_.mtp_num_layers > 0))
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].name == "embedding.word_embeddings.weight") pipeline_shared_ = static_cast<int64_t>(i);
  // The backward-order groups of parameters (set_grad_ready): each a contiguous run of the table.
  auto range_of = [&](const std::string& prefix) {
    size_t first = params_.size(), end = 0, n = 0;
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].name.starts_with(prefix)) {
        first = std::min(first, i);
        end = i + 1;
        ++n;
      }
    MOECORE_CHECK(n == 0 || n == end - first, "model: the parameters named ", prefix, "* are not contiguous");
    return n ? std::make_pair(first, end) : std::make_pair(size_t{0}, size_t{0});
  };
  for (int64_t l = 0; l < cfg_.num_layers; ++l)
    layer_params_.push_back(range_of("decoder.layers." + std::to_string(l) + "."));
  for (int64_t k = 0; k < cfg_.mtp_num_layers; ++k)
    layer_params_.push_back(range_of("mtp.layers." + std::to_string(k) + "."));
  final_norm_params_ = range_of("decoder.final_layernorm.");
  output_params_ = range_of("output_layer.");
  embedding_params_ = range_of("embedding.");
  auto find = [&](const std::string& name) -> Param* {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  // Points a module's weight view and gradient at a parameter (undefined when the model has none of that name):
  // the weight in the compute dtype, which is the f32 master itself for norms and biases.
  auto bind = [&](Tensor& weight, Tensor& gradient, const std::string& name) {
    Param* p = find(name);
    weight = p ? p->compute : Tensor();
    gradient = p ? p->grad : Tensor();
  };
  embedding_ = find("embedding.word_embeddings.weight");
  position_embedding_ = find("embedding.position_embeddings.weight");
  const moe::MoeConfig& mc = cfg_.moe;
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {  // decoder layers, then one per MTP depth
    const LayerSpec& spec = layers_[static_cast<size_t>(l)];
    const std::string& pre = spec.prefix;
    const bool is_moe = spec.mlp == MlpKind::moe, layer_mla = spec.attention == AttentionKind::mla;
    // The attention half (and the norms) of every layer; the MLP half only for dense layers.
    nn::DenseLayerWeights& w = layer_w_.emplace_back();
    nn::DenseLayerGrads& g = layer_g_.emplace_back();
    if (!local_layer(static_cast<size_t>(l))) {  // another pipeline stage's: nothing here
      mla_w_.emplace_back();
      mla_g_.emplace_back();
      moe_.push_back(nullptr);
      continue;
    }
    bind(w.input_norm, g.input_norm, pre + "input_layernorm.weight");
    bind(w.input_norm_bias, g.input_norm_bias, pre + "input_layernorm.bias");
    bind(w.mlp_norm, g.mlp_norm, pre + "pre_mlp_layernorm.weight");
    bind(w.mlp_norm_bias, g.mlp_norm_bias, pre + "pre_mlp_layernorm.bias");
    bind(w.qkv, g.qkv, pre + "self_attention.linear_qkv.weight");
    bind(w.proj, g.proj, pre + "self_attention.linear_proj.weight");
    bind(w.qkv_bias, g.qkv_bias, pre + "self_attention.linear_qkv.bias");
    bind(w.proj_bias, g.proj_bias, pre + "self_attention.linear_proj.bias");
    nn::MlaWeights& mw = mla_w_.emplace_back();  // left empty for standard attention
    nn::MlaGrads& mg = mla_g_.emplace_back();
    if (layer_mla) {
      const std::string sa = pre + "self_attention.";
      bind(mw.q, mg.q, sa + "linear_q_proj.weight");
      bind(mw.q_down, mg.q_down, sa + "linear_q_down_proj.weight");
      bind(mw.q_up, mg.q_up, sa + "linear_q_up_proj.weight");
      bind(mw.q_norm, mg.q_norm, sa + "q_layernorm.weight");
      bind(mw.q_norm_bias, mg.q_norm_bias, sa + "q_layernorm.bias");
      bind(mw.kv_down, mg.kv_down, sa + "linear_kv_down_proj.weight");
      bind(mw.kv_up, mg.kv_up, sa + "linear_kv_up_proj.weight");
      bind(mw.kv_norm, mg.kv_norm, sa + "kv_layernorm.weight");
      bind(mw.kv_norm_bias, mg.kv_norm_bias, sa + "kv_layernorm.bias");
    } else {
      bind(w.q_norm, g.q_norm, pre + "self_attention.q_layernorm.weight");
      bind(w.q_norm_bias, g.q_norm_bias, pre + "self_attention.q_layernorm.bias");
      bind(w.k_norm, g.k_norm, pre + "self_attention.k_layernorm.weight");
      bind(w.k_norm_bias, g.k_norm_bias, pre + "self_attention.k_layernorm.bias");
    }
    if (!is_moe) {
      bind(w.fc1, g.fc1, pre + "mlp.linear_fc1.weight");
      bind(w.fc2, g.fc2, pre + "mlp.linear_fc2.weight");
      bind(w.fc1_bias, g.fc1_bias, pre + "mlp.linear_fc1.bias");
      bind(w.fc2_bias, g.fc2_bias, pre + "mlp.linear_fc2.bias");
      moe_.push_back(nullptr);
      continue;
    }
    auto m = std::make_unique<MoeBlock>();
    Param* router = find(pre + "mlp.router.weight");
    m->w.router = {router->value, router->compute};
    m->g.router = router->grad;
    bind(m->w.router.bias, m->g.router_bias, pre + "mlp.router.bias");
    bind(m->w.experts.fc1, m->g.experts.fc1, pre + "mlp.experts.linear_fc1.weight");
    bind(m->w.experts.fc2, m->g.experts.fc2, pre + "mlp.experts.linear_fc2.weight");
    bind(m->w.experts.fc1_bias, m->g.experts.fc1_bias, pre + "mlp.experts.linear_fc1.bias");
    bind(m->w.experts.fc2_bias, m->g.experts.fc2_bias, pre + "mlp.experts.linear_fc2.bias");
    bind(m->w.shared.fc1, m->g.shared.fc1, pre + "mlp.shared_experts.linear_fc1.weight");
    bind(m->w.shared.fc2, m->g.shared.fc2, pre + "mlp.shared_experts.linear_fc2.weight");
    // The gate is read in f32 (its master), as before.
    Param* gate = find(pre + "mlp.shared_experts.gate_weight");
    m->w.shared.gate = gate ? gate->value : Tensor();
    m->g.shared.gate = gate ? gate->grad : Tensor();
    m->state = moe::router_state_init(mc, device_);
    // The layer's noise stream (jitter, forced balancing); under sequence parallelism each TP rank's tokens draw
    // from their own.
    m->state.stream = static_cast<uint64_t>(l) + (par_.sequence_parallel ? (uint64_t{1} << 32) * par_.tp.rank() : 0);
    moe_.push_back(std::move(m));
  }
  final_norm_ = find("decoder.final_layernorm.weight");
  final_norm_bias_ = find("decoder.final_layernorm.bias");
  output_ = cfg_.untie_embeddings_and_output_weights ? find("output_layer.weight") : embedding_;
  auto act = [&](Shape shape, DType t) { return Tensor::empty(shape, t, MemCategory::activations, device_); };
  for (int64_t k = 0; k < (holds_loss_heads() ? cfg_.mtp_num_layers : 0); ++k) {  // (the last stage's)
    const std::string pre = "mtp.layers." + std::to_string(k) + ".";
    MtpDepth& d = mtp_.emplace_back();
    d.enorm = find(pre + "enorm.weight");
    d.enorm_b = find(pre + "enorm.bias");
    d.hnorm = find(pre + "hnorm.weight");
    d.hnorm_b = find(pre + "hnorm.bias");
    d.eh = find(pre + "eh_proj.weight");
    d.fnorm = find(pre + "final_layernorm.weight");
    d.fnorm_b = find(pre + "final_layernorm.bias");
    d.ids = act({T}, DType::i32);  // every token (the vocabulary-parallel embedding and loss need them all)
    d.labels = act({T}, DType::i32);
    // (rolled over the whole batch: under CP the rolled token of a chunk's last position is another rank's)
    d.ids_h = Tensor::empty({B_ * cfg_.seq_length}, DType::i32, MemCategory::workspace);
    d.labels_h = Tensor::empty({B_ * cfg_.seq_length}, DType::i32, MemCategory::workspace);
    for (Tensor* t : {&d.e, &d.hin, &d.x, &d.y}) *t = act({N, H}, DType::f32);
    for (Tensor* t : {&d.en, &d.hn, &d.h}) *t = act({N, H}, c);
    for (Tensor* t : {&d.e_rstd, &d.h_rstd, &d.f_rstd}) *t = act({N}, DType::f32);
    if (dims_.layernorm)
      for (Tensor* t : {&d.e_mean, &d.h_mean, &d.f_mean}) *t = act({N}, DType::f32);
  }
  if (!mtp_.empty()) {
    if (par_.sequence_parallel) mtp_h_full_ = Tensor::empty({T, H}, c, MemCategory::workspace, device_);
    mtp_dx_c_ = Tensor::empty({N, H}, c, MemCategory::workspace, device_);
    for (Tensor* t : {&mtp_carry_, &mtp_dn_, &mtp_dfn_})
      *t = Tensor::empty({N, H}, DType::f32, MemCategory::workspace, device_);
  }

  plan_recompute();
  slots_.resize(chunks_.size());
  for (size_t c = 0; c < chunks_.size(); ++c) slots_[c].push_back(alloc_activations(static_cast<int64_t>(c)));
  // The final norm's output is read by the loss heads within forward: one buffer for every slot.
  final_h_ = Tensor::empty({N, H}, c, MemCategory::workspace, device_);
  if (par_.sequence_parallel) final_full_ = Tensor::empty({T, H}, c, MemCategory::workspace, device_);
  // Constant tables are computed on the host and uploaded once.
  // The global position of this rank's position s of a sequence (context parallelism: its two chunks).
  if (CP > 1)
    for (Tensor* t : {&cp_tokens_h_, &cp_labels_h_}) *t = Tensor::empty({T}, DType::i32, MemCategory::workspace);
  const auto position = [&](int64_t s) {
    return CP > 1 ? nn::context_parallel_position(s, cfg_.seq_length, par_.cp.rank(), CP) : s;
  };
  if (cfg_.rope()) {  // row s: the rotation of position(s)
    Tensor rope = Tensor::empty({cfg_.seq_length, cfg_.rotary_dim()}, DType::f32, MemCategory::workspace);
    fill_rope_table(rope, cfg_);
    Tensor local = Tensor::empty({S, cfg_.rotary_dim()}, DType::f32, MemCategory::workspace);
    for (int64_t s = 0; s < S; ++s) local.slice(0, s, s + 1).copy_from(rope.slice(0, position(s), position(s) + 1));
    rope_ = local.to_device(device_, MemCategory::workspace);
  }
  if (position_embedding_) {  // token b*S + s sits at position(s) (positions restart with each sample)
    Tensor positions = Tensor::empty({T}, DType::i32, MemCategory::workspace);
    int32_t* pos = positions.data<int32_t>();
    for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(position(i % S));
    positions_ = positions.to_device(device_, MemCategory::workspace);
    if (par_.sequence_parallel) {  // this rank's rows b * S/P + s hold positions position(rank * S/P + s)
      Tensor local = Tensor::empty({N}, DType::i32, MemCategory::workspace);
      int32_t* lp = local.data<int32_t>();
      const int64_t Sl = S / P;
      for (int64_t i = 0; i < N; ++i) lp[i] = static_cast<int32_t>(position(par_.tp.rank() * Sl + i % Sl));
      positions_local_ = local.to_device(device_, MemCategory::workspace);
    }
  }
  ws_ = nn::dense_layer_workspace_alloc(dims_, /*with_attention=*/standard_attention_);
  if (mla) mla_ws_ = nn::mla_workspace_alloc(mla_dims_, c, device_);
  if (holds_loss_heads()) head_ws_ = nn::lm_head_workspace_alloc(T, V / P, c, device_, P);
  auto work = [&](Shape shape, DType t) { return Tensor::empty(shape, t, MemCategory::workspace, device_); };
  dres_ = work({N, H}, DType::f32);
  if (cfg_.moe.enabled()) {
    moe_x_ = work({N, H}, c);
    moe_out_ = work({N, H}, DType::f32);
  }
  dh_ = work({T, H}, DType::f32);
  labels_ = work({T}, DType::i32);
  refresh_compute_weights();
}

// Recompute (ModelConfig::recompute): selective's shared buffers; full's groups of each model chunk's decoder layers
// (Megatron applies --recompute-num-layers per virtual pipeline stage) and the cache sets they share.
void GptModel::plan_recompute() {
  recompute_group_.assign(layers_.size(), -1);
  const RecomputeConfig& rc = cfg_.recompute;
  // Selective: one buffer of each dropped output for all layers (taken from a cache allocated for its shapes).
  bool dense_layers = false, moe_layers = false;
  for (size_t l = 0; l < static_cast<size_t>(cfg_.num_layers); ++l)
    if (local_layer(l)) (moe_[l] ? moe_layers : dense_layers) = true;
  if (rc.selects("layernorm") && (dense_layers || moe_layers)) {
    const nn::DenseLayerCache dense = nn::dense_layer_cache_alloc(dims_, true, false);
    selective_h1_ = dense.h1;
    if (dense_layers) selective_h2_dense_ = dense.h2;
    if (moe_layers) selective_h2_moe_ = nn::dense_layer_cache_alloc(dims_, false, false).h2;
  }
  // (moe refills whole MoE layers: their experts' activations and shared expert with them)
  if (rc.selects("moe") && moe_layers) selective_moe_ = moe::moe_layer_cache_alloc(moe_dims_, cfg_.moe);
  if (rc.selects("moe_act") && moe_layers && !rc.selects("moe"))
    selective_act_ = moe::moe_layer_cache_alloc(moe_dims_, cfg_.moe).experts.act;
  if (rc.selects("shared_experts") && moe_layers && !rc.selects("moe") && moe_dims_.Fs > 0) {
    const moe::MoeLayerCache c = moe::moe_layer_cache_alloc(moe_dims_, cfg_.moe);
    selective_shared_h_ = c.shared.h;
    selective_shared_act_ = c.shared.act;
  }
  bool standard = false;
  for (size_t l = 0; l < static_cast<size_t>(cfg_.num_layers); ++l)
    standard |= local_layer(l) && layers_[l].attention == AttentionKind::standard;
  bool mla_layers = false;
  for (size_t l = 0; l < static_cast<size_t>(cfg_.num_layers); ++l)
    mla_layers |= local_layer(l) && layers_[l].attention == AttentionKind::mla;
  if (rc.selects("mla_up_proj") && mla_layers)
    selective_mla_qkv_ = nn::mla_cache_alloc(mla_dims_, cfg_.compute_dtype, dims_.layernorm, device_).qkv;
  if (rc.selects("core_attn") && standard) {
    const nn::DenseLayerCache c = nn::dense_layer_cache_alloc(dims_, false, true);
    selective_attn_ = c.attn;
    selective_lse_ = c.lse;
  }
  if (rc.selects("mlp") && dense_layers) {
    const nn::DenseLayerCache c = nn::dense_layer_cache_alloc(dims_, true, false);
    selective_fc1_ = c.fc1;
    selective_mlp_act_ = c.act;
    if (!selective_h2_dense_.defined()) selective_h2_dense_ = c.h2;
  }
  if (!rc.full()) return;
  for (const auto& [first, end] : chunks_)
    for (int64_t l = first; l < end; ++l) {
      const int64_t i = l - first;
      if (rc.method == "uniform")
        recompute_group_[static_cast<size_t>(l)] = first + i / rc.num_layers * rc.num_layers;
      else if (i < rc.num_layers)  // block: the chunk's first layers, each alone
        recompute_group_[static_cast<size_t>(l)] = l;
    }
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (recompute_group_[l] < 0 || recompute_caches_.count(recompute_key(l))) continue;
    const bool layer_mla = layers_[l].attention == AttentionKind::mla;
    RecomputeCaches& c = recompute_caches_[recompute_key(l)];
    c.layer = nn::dense_layer_cache_alloc(dims_, /*with_mlp=*/!moe_[l], /*with_attention=*/!layer_mla);
    if (layer_mla) c.mla = nn::mla_cache_alloc(mla_dims_, cfg_.compute_dtype, dims_.layernorm, device_);
    if (!moe_[l]) continue;
    const moe::MoeLayerCache* donor = nullptr;
    for (const auto& [key, other] : recompute_caches_)
      if (other.moe.probs.defined() && !donor) donor = &other.moe;
    c.moe = moe::moe_layer_cache_alloc(moe_dims_, cfg_.moe, donor);
  }
}

// The MoE cache that owns the scratch every other MoE cache shares (dead between a layer's forward and its backward,
// so dead between micro-batches too): the first shared recompute set's, else the first slot's first MoE layer's.
const moe::MoeLayerCache* GptModel::moe_scratch_donor() const {
  if (selective_moe_.probs.defined()) return &selective_moe_;
  for (const auto& [key, c] : recompute_caches_)
    if (c.moe.probs.defined()) return &c.moe;
  for (const auto& chunk : slots_)
    for (const Activations& a : chunk)
      for (const moe::MoeLayerCache& mc : a.moe)
        if (mc.probs.defined()) return &mc;
  return nullptr;
}

// One slot's buffers of a model chunk: every layer's cache of the chunk by its kind (a recomputed layer's: the shared
// set of its group position).
GptModel::Activations GptModel::alloc_activations(int64_t chunk) const {
  const int64_t N = dims_.N, H = cfg_.hidden_size, T = B_ * (cfg_.seq_length / par_.cp.size());
  auto act = [&](Shape shape, DType t) { return Tensor::empty(shape, t, MemCategory::activations, device_); };
  const moe::MoeLayerCache* donor = moe_scratch_donor();
  Activations a;
  a.moe.reserve(layers_.size());  // (donor points into it)
  a.layer.resize(layers_.size());
  a.mla.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (layer_chunk_[l] != chunk) {
      a.moe.emplace_back();
      continue;
    }
    const bool layer_mla = layers_[l].attention == AttentionKind::mla;
    if (recompute_group_[l] >= 0) {  // the shared set; an MoE layer keeps its own routing
      const RecomputeCaches& shared = recompute_caches_.at(recompute_key(l));
      a.layer[l] = shared.layer;
      a.mla[l] = shared.mla;
      a.moe.push_back(moe_[l] ? moe::moe_layer_cache_alloc(moe_dims_, cfg_.moe, donor) : moe::MoeLayerCache{});
      if (moe_[l]) moe::moe_layer_cache_share_refilled(a.moe.back(), shared.moe);
      continue;
    }
    a.layer[l] = nn::dense_layer_cache_alloc(dims_, /*with_mlp=*/!moe_[l], /*with_attention=*/!layer_mla);
    nn::DenseLayerCache& c = a.layer[l];  // selective recompute: the shared buffers (the layer's own are freed again)
    if (drops_norms(l)) c.h1 = selective_h1_;
    if (drops_norms(l) || drops_mlp(l)) c.h2 = moe_[l] ? selective_h2_moe_ : selective_h2_dense_;
    if (drops_attention(l)) {
      c.attn = selective_attn_;
      c.lse = selective_lse_;
    }
    if (drops_mlp(l)) {
      c.fc1 = selective_fc1_;
      c.act = selective_mlp_act_;
    }
    if (layer_mla) a.mla[l] = nn::mla_cache_alloc(mla_dims_, cfg_.compute_dtype, dims_.layernorm, device_);
    if (drops_mla_up(l)) a.mla[l].qkv = selective_mla_qkv_;
    a.moe.push_back(moe_[l] ? moe::moe_layer_cache_alloc(moe_dims_, cfg_.moe, donor) : moe::MoeLayerCache{});
    if (moe_[l] && !donor) donor = &a.moe.back();
    if (moe_[l] && selective_act_.defined()) {  // selective moe_act: the shared buffer
      a.moe.back().experts.act = selective_act_;
      a.moe.back().owns_expert_act = false;
    }
    if (drops_moe(l)) moe::moe_layer_cache_share_refilled(a.moe.back(), selective_moe_);
    if (drops_shared_expert(l)) {
      a.moe.back().shared.h = selective_shared_h_;
      a.moe.back().shared.act = selective_shared_act_;
      a.moe.back().owns_shared_act = false;
    }
  }
  a.drops.resize(layers_.size());
  const auto [first, end] = chunk_layers(chunk);
  a.residual.resize(static_cast<size_t>(cfg_.num_layers + 1));  // [first, end] of the chunk
  for (int64_t l = first; l <= end; ++l) a.residual[static_cast<size_t>(l)] = act({N, H}, DType::f32);
  if (post_process(chunk)) {
    a.final_rstd = act({N}, DType::f32);
    if (dims_.layernorm) a.final_mean = act({N}, DType::f32);
  }
  if (pre_process(chunk))
    a.ids = act({T}, DType::i32);
  else if (par_.pp.size() > 1)
    a.dinput = act({N, H}, DType::f32);
  a.dfinal = act({N, H}, DType::f32);
  return a;
}

void GptModel::set_micro_batch_slots(const std::vector<int64_t>& per_chunk) {
  if (per_chunk.size() != chunks_.size())
    MOECORE_FAIL("model: micro-batch slots given for ", per_chunk.size(), " model chunks, the stage has ",
                 chunks_.size());
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const int64_t n = per_chunk[c];
    if (n < 1) MOECORE_FAIL("model: micro-batch slots (", n, ") must be at least 1");
    std::vector<Activations>& pool = slots_[c];
    pool.reserve(static_cast<size_t>(n));  // (the MoE scratch donor lives in the first slot of chunk 0: kept)
    while (static_cast<int64_t>(pool.size()) < n) pool.push_back(alloc_activations(static_cast<int64_t>(c)));
    if (static_cast<int64_t>(pool.size()) > n) pool.erase(pool.begin() + n, pool.end());
    slot_[c] = 0;
  }
}

bool GptModel::take_moe_overflow() {
  const bool o = moe_overflow_;
  moe_overflow_ = false;
  return o;
}

void GptModel::set_moe_synced_dropless(bool on) {
  if (!moe_static_capacity() || on == moe_synced_) return;
  moe_synced_ = on;
  moe_dims_.received_capacity = on ? 0.0f : cfg_.moe.received_token_capacity;
  std::vector<size_t> slots(chunks_.size());
  for (size_t c = 0; c < chunks_.size(); ++c) slots[c] = slots_[c].size();
  // Free the old buffers first (the scratch donor lives among them), then plan and allocate as at construction.
  slots_.assign(chunks_.size(), {});
  recompute_caches_.clear();
  selective_moe_ = moe::MoeLayerCache{};
  plan_recompute();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    slots_[c].reserve(slots[c]);
    while (slots_[c].size() < slots[c]) slots_[c].push_back(alloc_activations(static_cast<int64_t>(c)));
    slot_[c] = 0;
  }
}

const char* GptModel::dispatcher_name() const {
  return moe_dims_.dispatcher == moe::DispatcherKind::alltoall    ? "all-to-all"
         : moe_dims_.dispatcher == moe::DispatcherKind::allgather ? "all-gather"
                                                                  : "local";
}

void GptModel::finish_step(bool update) {
  for (auto& m : moe_)
    if (m) moe::router_finish_step(m->state, cfg_.moe, update, ops::Context{device_});
}

const moe::RouterStats* GptModel::moe_stats(int64_t layer) const {
  const auto& m = moe_.at(static_cast<size_t>(layer));
  const int64_t c = layer_chunk_.at(static_cast<size_t>(layer));
  if (!m || c < 0) return nullptr;
  const auto cs = static_cast<size_t>(c);
  return &slots_[cs][slot_[cs]].moe[static_cast<size_t>(layer)].stats;
}

std::optional<moe::EchoStatsHost> GptModel::moe_echo_stats(int64_t layer) const {
  const auto& m = moe_.at(static_cast<size_t>(layer));
  const int64_t c = layer_chunk_.at(static_cast<size_t>(layer));
  if (!m || c < 0 || !moe_dims_.echo.enabled()) return std::nullopt;
  const auto cs = static_cast<size_t>(c);
  return moe::echo_stats_host(slots_[cs][slot_[cs]].moe[static_cast<size_t>(layer)].echo, m->w.experts);
}

moe::RouterState* GptModel::router_state(int64_t layer) {
  auto& m = moe_.at(static_cast<size_t>(layer));
  return m ? &m->state : nullptr;
}

const moe::RouterState* GptModel::router_state(int64_t layer) const {
  const auto& m = moe_.at(static_cast<size_t>(layer));
  return m ? &m->state : nullptr;
}

Param& GptModel::param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return p;
  MOECORE_FAIL("model: no parameter named '", name, "'");
}

int64_t GptModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.value.numel();
  return n;
}

void GptModel::zero_grad() {
  for (auto& p : params_) p.grad.zero_();
}

void GptModel::sum_tensor_parallel_grads(size_t first, size_t end) {
  if (!tensor_parallel()) return;
  for (size_t i = first; i < std::min(end, params_.size()); ++i)
    if (params_[i].tp_grad_sum) all_reduce_sum(params_[i].grad, par_.tp);
}

void GptModel::refresh_compute_weights(size_t first, size_t end) {
  for (size_t i = first; i < std::min(end, params_.size()); ++i)
    if (!params_[i].compute.same_data(params_[i].value)) params_[i].compute.copy_from(params_[i].value);
}

// Keys are named "dropout/it<i>/mb<m>/layer<l>/<site>" (formatted on the stack: the step allocates nothing).
void GptModel::set_dropout_keys(bool training) {
  // Under TP a mask over data that differs between the group's ranks (attention probabilities of their heads; with
  // sequence parallelism the hidden dropout of their rows) gets a key of its own per rank, as Megatron's
  // model-parallel RNG tracker; masks over replicated data stay equal on every rank. Under CP every mask gets a key
  // per CP rank.
  const int tp_rank = par_.tp.rank();
  Activations& a = act();
  auto key = [&](float p, int64_t layer, const char* site, bool per_rank) {
    ops::Dropout d;
    if (!training || p <= 0.0f) return d;
    char name[112];
    int n = std::snprintf(name, sizeof name, "dropout/it%lld/mb%lld/layer%lld/%s",
                          static_cast<long long>(dropout_iteration_), static_cast<long long>(dropout_micro_batch_),
                          static_cast<long long>(layer), site);
    if (per_rank && tensor_parallel())
      n += std::snprintf(name + n, sizeof name - static_cast<size_t>(n), "/tp%d", tp_rank);
    if (par_.cp.size() > 1)  // every mask covers this rank's positions alone
      n += std::snprintf(name + n, sizeof name - static_cast<size_t>(n), "/cp%d", par_.cp.rank());
    d.p = p;
    d.key = philox_key(seed_, std::string_view(name, static_cast<size_t>(n)));
    return d;
  };
  const bool sp = par_.sequence_parallel;
  a.embedding_drop = key(cfg_.hidden_dropout, -1, "embedding", sp);
  for (size_t j = 0; j < mtp_.size(); ++j)
    mtp_[j].drop = key(cfg_.hidden_dropout, cfg_.num_layers + static_cast<int64_t>(j), "mtp_embedding", sp);
  for (size_t l = 0; l < a.drops.size(); ++l) {  // the chunk's layers (and the MTP depths' in the last)
    if (layer_chunk_[l] != static_cast<int64_t>(chunk_)) continue;
    const auto i = static_cast<int64_t>(l);
    a.drops[l] = {key(cfg_.attention_dropout, i, "attention", true), key(cfg_.hidden_dropout, i, "attn_out", sp),
                  key(cfg_.hidden_dropout, i, "mlp_out", sp)};
  }
}

void GptModel::forward_trunk(const Tensor& tokens, bool training) {
  const ops::Context ctx{device_};
  Activations& a = act();
  const int64_t T = B_ * (cfg_.seq_length / par_.cp.size());
  if (tokens.dtype() != DType::i32 || tokens.numel() != T)
    MOECORE_FAIL("model: tokens must be i32 [", B_, ", ", T / B_, "], got ", tokens.str());
  // Set here: pointers into this object stay valid across moves.
  moe_dims_.global_aux_group = &par_.dp;
  moe_dims_.sequence_group = sequence_group();
  dims_.tp = &par_.tp;
  if (dims_.cp) dims_.cp = &par_.cp;
  set_dropout_keys(training);
  const auto chunk = static_cast<int64_t>(chunk_);
  // (on the last pipeline stage: the word embeddings' copy)
  if (pre_process(chunk) || post_process(chunk)) params_needed(embedding_params_);
  if (pre_process(chunk)) {  // else the previous virtual stage's output is in stage_input
    a.ids.copy_from(tokens.view({T}));
    Tensor& x0 = a.residual[0];
    embed(x0, a.ids, ctx);
    if (position_embedding_) {
      ops::embedding_forward(dres_, par_.sequence_parallel ? positions_local_ : positions_, position_embedding_->value,
                             ctx);
      ops::add(x0, x0, dres_, ctx);
    }
    if (a.embedding_drop.active()) ops::dropout_forward(x0, x0, a.embedding_drop, ctx);
  }
  for (size_t l = first_layer(); l < end_layer(); ++l) {
    params_needed(layer_params_[l]);
    layer_forward(l, a.residual[l], a.residual[l + 1], training, ctx);
  }
  if (!post_process(chunk)) return;
  params_needed(final_norm_params_);
  params_needed(output_params_);  // (read by every loss head after the trunk; empty when tied)
  nn::norm_forward(final_h_, a.final_mean, a.final_rstd, a.residual.back(), final_norm_->value,
                   final_norm_bias_ ? final_norm_bias_->value : Tensor(), cfg_.norm_epsilon, ctx);
  if (par_.sequence_parallel) all_gather_into(by_sequence(final_full_), by_sequence(final_h_), 1, par_.tp);
}

// out [N, H] f32 (this rank's rows) = the word embeddings of ids [T]. Under TP vocabulary-parallel: each rank's rows,
// summed over the group (reduce-scattered along the sequence under SP).
void GptModel::embed(Tensor& out, const Tensor& ids, const ops::Context& ctx) {
  if (!tensor_parallel()) {
    ops::embedding_forward(out, ids, embedding_->value, ctx);
    return;
  }
  Tensor& part = par_.sequence_parallel ? ws_.dh : out;
  ops::embedding_forward_shard(part, ids, embedding_->value, vocab_start(), cfg_.vocab_size, ctx);
  if (par_.sequence_parallel)
    reduce_scatter_from(by_sequence(out), by_sequence(part), 1, par_.tp);
  else
    all_reduce_sum(out, par_.tp);
}

// Its backward: dtable += the gradient dx [N, H] of this rank's rows (all-gathered into dh_ under SP) for ids [T].
void GptModel::embed_backward(const Tensor& dx, const Tensor& ids, const ops::Context& ctx) {
  Tensor dfull = dx;
  if (par_.sequence_parallel) {
    dfull = dh_;
    all_gather_into(by_sequence(dfull), by_sequence(dx), 1, par_.tp);
  }
  if (tensor_parallel())
    ops::embedding_backward_shard(embedding_->grad, ids, dfull, vocab_start(), ctx);
  else
    ops::embedding_backward(embedding_->grad, ids, dfull, ctx);
}

int64_t GptModel::vocab_start() const {
  return tensor_parallel() ? par_.tp.rank() * (cfg_.vocab_size / par_.tp.size()) : 0;
}

Tensor GptModel::by_sequence(const Tensor& t) const {
  return nn::by_sequence(t, B_);
}

// Transformer layer l (a decoder layer, or for l >= num_layers an MTP depth's): y from x, both [N, H] f32.
void GptModel::layer_forward(size_t l, const Tensor& x, Tensor& y, bool training, const ops::Context& ctx,
                             bool recompute) {
  Activations& a = act();
  if (layers_[l].attention == AttentionKind::standard)
    nn::attention_block_forward(x, layer_w_[l], a.layer[l], ws_, rope_, dims_, a.drops[l], ctx);
  else
    nn::mla_block_forward(x, layer_w_[l], mla_w_[l], a.layer[l], a.mla[l], ws_, mla_ws_, rope_, dims_, mla_dims_,
                          a.drops[l], ctx);
  if (moe_[l])
    moe_mlp_forward(l, y, training, ctx, recompute);
  else
    nn::mlp_block_forward(y, layer_w_[l], a.layer[l], ws_, dims_, a.drops[l], ctx);
}

std::vector<const Tensor*> GptModel::dropped(const nn::DenseLayerCache& c, size_t l) const {
  std::vector<const Tensor*> d;
  if (drops_norms(l)) d.push_back(&c.h1);
  if (drops_norms(l) || drops_mlp(l)) d.push_back(&c.h2);
  if (drops_attention(l)) d.insert(d.end(), {&c.attn, &c.lse});
  if (drops_mlp(l)) d.insert(d.end(), {&c.fc1, &c.act});
  return d;
}

// dres_: dL/dy on entry, dL/dx on return. Selective recompute refills each half's dropped outputs first: the norm
// output (layernorm, and mlp for a dense MLP), the MLP's fc1 output and activation (mlp), the attention output and
// log-sum-exp (core_attn).
void GptModel::layer_backward(size_t l, const Tensor& x, float grad_scale, const ops::Context& ctx) {
  Activations& a = act();
  if (drops_norms(l) || drops_mlp(l))
    nn::mlp_norm_refill(layer_w_[l], a.layer[l], ws_, dims_, /*dense_mlp=*/!moe_[l], ctx);
  if (drops_mlp(l)) nn::mlp_refill(layer_w_[l], a.layer[l], dims_, ctx);
  if (moe_[l])
    moe_mlp_backward(l, grad_scale, ctx);
  else
    nn::mlp_block_backward(dres_, layer_g_[l], layer_w_[l], a.layer[l], ws_, dims_, a.drops[l], ctx);
  // dres is dL/dx_mid here.
  if (drops_norms(l)) nn::attention_norm_refill(x, layer_w_[l], a.layer[l], ws_, dims_, ctx);
  if (drops_attention(l)) nn::core_attention_refill(a.layer[l], ws_, dims_, a.drops[l], ctx);
  if (drops_mla_up(l)) nn::mla_up_refill(a.layer[l].h1, mla_w_[l], a.mla[l], mla_ws_, rope_, mla_dims_, ctx);
  if (layers_[l].attention == AttentionKind::standard)
    nn::attention_block_backward(dres_, layer_g_[l], x, layer_w_[l], a.layer[l], ws_, rope_, dims_, a.drops[l], ctx);
  else
    nn::mla_block_backward(dres_, layer_g_[l], mla_g_[l], x, layer_w_[l], mla_w_[l], a.layer[l], a.mla[l], ws_, mla_ws_,
                           rope_, dims_, mla_dims_, a.drops[l], ctx);
}

// Megatron's roll_tensor along each sequence: out[b, s] = in[b, s + 1], the last position `fill`. Host tensors: the
// batch is prepared on the host, like the data loader's output it comes from.
void GptModel::roll_left(Tensor& out, const Tensor& in, int32_t fill) const {
  const int64_t S = cfg_.seq_length;
  const int32_t* src = in.data<int32_t>();
  int32_t* dst = out.data<int32_t>();
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t s = 0; s < S; ++s) dst[b * S + s] = s + 1 < S ? src[b * S + s + 1] : fill;
}

// Megatron's MultiTokenPredictionBlock, depth k = j + 1: the input ids and labels rolled once more (vacated last
// position: id 0, label masked), h_k = final_norm_k(layer(eh_proj([enorm(emb(ids_k)); hnorm(h_{k-1})]))), with h_0 the
// decoder's output after the final norm; depth k's logits come from the shared output layer.
void GptModel::mtp_forward(const Tensor& tokens, const Tensor& labels, bool training, const ops::Context& ctx) {
  const int64_t H = cfg_.hidden_size;
  for (size_t j = 0; j < mtp_.size(); ++j) {
    MtpDepth& d = mtp_[j];
    params_needed(layer_params_[static_cast<size_t>(cfg_.num_layers) + j]);
    roll_left(d.ids_h, j ? mtp_[j - 1].ids_h : tokens, 0);
    d.ids.copy_from(local_positions(d.ids_h, cp_tokens_h_));
    if (training) {
      roll_left(d.labels_h, j ? mtp_[j - 1].labels_h : labels, -1);
      d.labels.copy_from(local_positions(d.labels_h, cp_labels_h_));
    }
    embed(d.e, d.ids, ctx);
    if (d.drop.active()) ops::dropout_forward(d.e, d.e, d.drop, ctx);
    nn::norm_forward(d.en, d.e_mean, d.e_rstd, d.e, d.enorm->value, d.enorm_b ? d.enorm_b->value : Tensor(),
                     cfg_.norm_epsilon, ctx);
    d.hin.copy_from(j ? mtp_[j - 1].h : final_h_);
    nn::norm_forward(d.hn, d.h_mean, d.h_rstd, d.hin, d.hnorm->value, d.hnorm_b ? d.hnorm_b->value : Tensor(),
                     cfg_.norm_epsilon, ctx);
    ops::gemm(d.x, d.en, false, d.eh->compute.slice(1, 0, H), true, 1.0f, 0.0f, ctx);
    ops::gemm(d.x, d.hn, false, d.eh->compute.slice(1, H, 2 * H), true, 1.0f, 1.0f, ctx);
    layer_forward(static_cast<size_t>(cfg_.num_layers) + j, d.x, d.y, training, ctx);
    nn::norm_forward(d.h, d.f_mean, d.f_rstd, d.y, d.fnorm->value, d.fnorm_b ? d.fnorm_b->value : Tensor(),
                     cfg_.norm_epsilon, ctx);
  }
}

// The MTP losses and their gradients, deepest depth first: each depth's cross-entropy over its rolled labels is
// weighted mtp_loss_scaling_factor / mtp_num_layers (mean over that depth's counted tokens). Leaves in mtp_carry_
// the gradient reaching h_0 (the decoder's normed output) through the first depth's hnorm.
void GptModel::mtp_backward(LossResult& r, float grad_scale, const ops::Context& ctx) {
  const int64_t H = cfg_.hidden_size, N = B_ * cfg_.seq_length;
  const float weight = cfg_.mtp_loss_scaling_factor / static_cast<float>(mtp_.size());
  r.mtp_loss_sum.assign(mtp_.size(), 0.0);
  r.mtp_tokens.assign(mtp_.size(), 0);
  Tensor no_grad;
  auto grad_of = [&](Param* p) -> Tensor& { return p ? p->grad : no_grad; };
  auto value_of = [](Param* p) { return p ? p->value : Tensor(); };
  for (size_t j = mtp_.size(); j-- > 0;) {
    MtpDepth& d = mtp_[j];
    const int32_t* lp = d.labels_h.data<int32_t>();
    for (int64_t i = 0; i < N; ++i) r.mtp_tokens[j] += lp[i] >= 0;
    // (per-token loss: the depth's sum times the main head's count over its own, as Megatron's MTP)
    const float per = per_token_loss_ ? static_cast<float>(r.tokens) : 1.0f;
    const float scale = r.mtp_tokens[j] ? grad_scale * weight * per / static_cast<float>(r.mtp_tokens[j]) : 0.0f;
    if (!par_.sequence_parallel) {
      nn::lm_head_loss(&mtp_dfn_, &output_->grad, d.h, output_->compute, d.labels, scale, head_ws_, ctx, head_group());
    } else {  // every token's h into the vocabulary-parallel head; its partial gradient reduce-scattered back
      all_gather_into(by_sequence(mtp_h_full_), by_sequence(d.h), 1, par_.tp);
      nn::lm_head_loss(&dh_, &output_->grad, mtp_h_full_, output_->compute, d.labels, scale, head_ws_, ctx,
                       head_group(), /*reduce_dh=*/false);
      reduce_scatter_from(by_sequence(mtp_dfn_), by_sequence(dh_), 1, par_.tp);
    }
    r.mtp_loss_sum[j] = read_loss_sum();
    if (par_.cp.size() > 1) all_reduce_sum(std::span<double>(&r.mtp_loss_sum[j], 1), par_.cp);
    if (j + 1 < mtp_.size()) ops::add(mtp_dfn_, mtp_dfn_, mtp_carry_, ctx);  // depth j + 2 read h_{j+1} too
    nn::norm_backward(dres_, d.fnorm->grad, grad_of(d.fnorm_b), mtp_dfn_, d.y, d.fnorm->value, value_of(d.fnorm_b),
                      d.f_mean, d.f_rstd, false, ctx);
    layer_backward(static_cast<size_t>(cfg_.num_layers) + j, d.x, grad_scale, ctx);
    mtp_dx_c_.copy_from(dres_);
    Tensor g_e = d.eh->grad.slice(1, 0, H), g_h = d.eh->grad.slice(1, H, 2 * H);
    ops::gemm(g_e, mtp_dx_c_, true, d.en, false, 1.0f, 1.0f, ctx);
    ops::gemm(g_h, mtp_dx_c_, true, d.hn, false, 1.0f, 1.0f, ctx);
    ops::gemm(mtp_dn_, mtp_dx_c_, false, d.eh->compute.slice(1, 0, H), false, 1.0f, 0.0f, ctx);
    nn::norm_backward(dres_, d.enorm->grad, grad_of(d.enorm_b), mtp_dn_, d.e, d.enorm->value, value_of(d.enorm_b),
                      d.e_mean, d.e_rstd, false, ctx);
    if (d.drop.active()) ops::dropout_backward(dres_, dres_, d.drop, ctx);
    embed_backward(dres_, d.ids, ctx);
    ops::gemm(mtp_dn_, mtp_dx_c_, false, d.eh->compute.slice(1, H, 2 * H), false, 1.0f, 0.0f, ctx);
    nn::norm_backward(mtp_carry_, d.hnorm->grad, grad_of(d.hnorm_b), mtp_dn_, d.hin, d.hnorm->value,
                      value_of(d.hnorm_b), d.h_mean, d.h_rstd, false, ctx);
    grad_ready(layer_params_[static_cast<size_t>(cfg_.num_layers) + j]);
  }
}

// The MoE half of layer l: y = x_mid + dropout(moe(norm2(x_mid))). The MoE layer takes Megatron's sequence-major
// token order (token s*B + b): it decides which tokens the "position" drop policy keeps and which tokens form a
// sequence for seq_aux_loss.
void GptModel::moe_mlp_forward(size_t l, Tensor& y, bool training, const ops::Context& ctx, bool recompute) {
  const int64_t S = dims_.N / B_, H = cfg_.hidden_size;  // S: this rank's positions of each sequence
  MoeBlock& m = *moe_[l];
  Activations& a = act();
  nn::mlp_norm_forward(layer_w_[l], a.layer[l], dims_, ctx);
  Tensor x_sb = moe_x_.view({S, B_, H}), out_sb = moe_out_.view({S, B_, H});
  Tensor out_bs = ws_.dh.slice(0, 0, dims_.N).view({B_, S, H});
  ops::transpose_01(x_sb, a.layer[l].h2.view({B_, S, H}), ctx);
  moe::moe_layer_forward(moe_out_, moe_x_, Tensor(), m.w, m.state, a.moe[l], *dispatcher_, moe_dims_, cfg_.moe,
                         training, ctx, /*route=*/!recompute);
  moe_overflow_ = moe_overflow_ || moe::moe_layer_overflowed(a.moe[l]);
  ops::transpose_01(out_bs, out_sb, ctx);
  ops::bias_dropout_add(y, a.layer[l].x_mid, ws_.dh.slice(0, 0, dims_.N), Tensor(), a.drops[l].mlp_out, ctx);
}

// dres is dL/d(layer output) on entry, dL/dx_mid on return. The MoE output's gradient goes through the dropout and
// into sequence-major order; the input gradient comes back batch-major in ws_.dh.
void GptModel::moe_mlp_backward(size_t l, float grad_scale, const ops::Context& ctx) {
  const int64_t N = dims_.N, S = N / B_, H = cfg_.hidden_size;  // S: this rank's positions of each sequence
  MoeBlock& m = *moe_[l];
  Activations& a = act();
  Tensor dx = dh_.slice(0, 0, N), dh2_flat = ws_.dh.slice(0, 0, N);
  Tensor dout_sb = moe_out_.view({S, B_, H}), dx_sb = dx.view({S, B_, H}), dh2 = dh2_flat.view({B_, S, H});
  Tensor x_sb = moe_x_.view({S, B_, H}), no_bias;
  ops::transpose_01(x_sb, a.layer[l].h2.view({B_, S, H}), ctx);
  if (drops_moe(l))  // selective moe: the layer again from its routing (its output, in moe_out_, is not needed)
    moe::moe_layer_forward(moe_out_, moe_x_, Tensor(), m.w, m.state, a.moe[l], *dispatcher_, moe_dims_, cfg_.moe,
                           /*training=*/true, ctx, /*route=*/false);
  if (drops_shared_expert(l)) moe::shared_expert_refill(moe_x_, m.w.shared, a.moe[l].shared, cfg_.moe.swiglu, ctx);
  ops::bias_dropout_add_backward(dh2_flat, no_bias, dres_, a.drops[l].mlp_out, ctx);
  ops::transpose_01(dout_sb, dh2, ctx);
  // (per-token loss: times the micro-batch's tokens, which the step's division by the global count cancels, Megatron's
  // router rule)
  const float aux_scale = per_token_loss_ ? grad_scale * static_cast<float>(B_ * cfg_.seq_length) : grad_scale;
  moe::moe_layer_backward(dx, m.g, moe_out_, moe_x_, m.w, a.moe[l], *dispatcher_, moe_dims_, cfg_.moe, aux_scale, ctx);
  ops::transpose_01(dh2, dx_sb, ctx);
  nn::mlp_norm_backward(dres_, layer_g_[l], dh2_flat, layer_w_[l], a.layer[l], dims_, ctx);
}

namespace {
// The batch on the host (an explicit transfer when the caller's is on a device), checked: i32 [B*S].
Tensor host_batch(const Tensor& t, const char* what, int64_t B, int64_t S) {
  if (t.dtype() != DType::i32 || t.numel() != B * S)
    MOECORE_FAIL("model: ", what, " must be i32 [", B, ", ", S, "], got ", t.str());
  return t.to_device(Device::cpu).view({B * S});
}
int64_t counted_labels(const Tensor& labels_h) {
  const int32_t* lp = labels_h.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < labels_h.numel(); ++i) n += lp[i] >= 0;
  return n;
}
}  // namespace

double GptModel::read_loss_sum() const {
  double totals[2];
  head_ws_.totals.copy_to_host(totals, 2);
  return totals[0];
}

GptModel::Activations& GptModel::slot_at(Slot s) {
  if (s.chunk < 0 || s.chunk >= num_chunks())
    MOECORE_FAIL("model: model chunk ", s.chunk, " out of range: the stage has ", num_chunks());
  if (s.index < 0 || s.index >= micro_batch_slots(s.chunk))
    MOECORE_FAIL("model: micro-batch slot ", s.index, " out of range: chunk ", s.chunk, " has ",
                 micro_batch_slots(s.chunk), " (set_micro_batch_slots)");
  return slots_[static_cast<size_t>(s.chunk)][static_cast<size_t>(s.index)];
}

void GptModel::use_slot(Slot s) {
  slot_at(s);
  chunk_ = static_cast<size_t>(s.chunk);
  slot_[chunk_] = static_cast<size_t>(s.index);
}

LossResult GptModel::forward(Slot slot, const Tensor& tokens, const Tensor& labels, float grad_scale) {
  use_slot(slot);
  Activations& a = act();
  const ops::Context ctx{device_};
  const int64_t S = cfg_.seq_length;
  const Tensor tokens_h = host_batch(tokens, "tokens", B_, S), labels_h = host_batch(labels, "labels", B_, S);
  forward_trunk(local_positions(tokens_h, cp_tokens_h_), true);
  if (!post_process(slot.chunk)) return {};  // (before the last virtual stage: its output is in stage_output)
  labels_.copy_from(local_positions(labels_h, cp_labels_h_));
  LossResult r;
  r.tokens = counted_labels(labels_h);  // the whole batch's (every CP rank holds it)
  const float token_scale = per_token_loss_ ? grad_scale : r.tokens ? grad_scale / static_cast<float>(r.tokens) : 0.0f;
  if (!mtp_.empty()) {
    mtp_forward(tokens_h, labels_h, true, ctx);
    mtp_backward(r, grad_scale, ctx);
  }
  const bool sp = par_.sequence_parallel;
  // (under SP the head's partial input gradients of every token, reduce-scattered to this rank's rows)
  nn::lm_head_loss(sp ? &dh_ : &a.dfinal, &output_->grad, head_input(), output_->compute, labels_, token_scale,
                   head_ws_, ctx, head_group(), /*reduce_dh=*/!sp);
  r.loss_sum = read_loss_sum();
  if (par_.cp.size() > 1) all_reduce_sum(std::span<double>(&r.loss_sum, 1), par_.cp);
  if (output_ != embedding_) grad_ready(output_params_);
  if (sp) reduce_scatter_from(by_sequence(a.dfinal), by_sequence(dh_), 1, par_.tp);
  if (!mtp_.empty()) ops::add(a.dfinal, a.dfinal, mtp_carry_, ctx);  // h_0 also fed the first MTP depth
  return r;
}

void GptModel::backward(Slot slot, float grad_scale) {
  use_slot(slot);
  Activations& a = act();
  const ops::Context ctx{device_};
  Tensor no_grad;
  if (post_process(slot.chunk)) {
    nn::norm_backward(dres_, final_norm_->grad, final_norm_bias_ ? final_norm_bias_->grad : no_grad, a.dfinal,
                      a.residual[end_layer()], final_norm_->value,
                      final_norm_bias_ ? final_norm_bias_->value : Tensor(), a.final_mean, a.final_rstd, false, ctx);
    grad_ready(final_norm_params_);
  } else {  // the next virtual stage's gradient of this chunk's output
    dres_.copy_from(a.dfinal);
  }
  for (size_t l = end_layer(); l-- > first_layer();) {
    const int64_t group = recompute_group_[l];
    if (group >= 0 && (l + 1 == end_layer() || recompute_group_[l + 1] != group))
      for (auto k = static_cast<size_t>(group); k <= l; ++k)  // the group's forward again, from its kept input
        layer_forward(k, a.residual[k], a.residual[k + 1], /*training=*/true, ctx, /*recompute=*/true);
    layer_backward(l, a.residual[l], grad_scale, ctx);
    grad_ready(layer_params_[l]);
  }
  if (pre_process(slot.chunk)) {
    if (a.embedding_drop.active()) ops::dropout_backward(dres_, dres_, a.embedding_drop, ctx);
    embed_backward(dres_, a.ids, ctx);
    // (under SP embed_backward left every token's gradient in dh_: the positions' table is whole on every rank)
    if (position_embedding_)
      ops::embedding_backward(position_embedding_->grad, positions_, par_.sequence_parallel ? dh_ : dres_, ctx);
  } else if (a.dinput.defined()) {  // the gradient of the chunk's input, for the previous virtual stage
    a.dinput.copy_from(dres_);
  }
  // (the output layer too when tied: it is the embedding, or on the last stage its copy)
  if (pre_process(slot.chunk) || post_process(slot.chunk)) grad_ready(embedding_params_);
}

// Through every virtual stage in turn, without gradients (slot 0 of each chunk): a chain, so plain sends and receives
// cannot deadlock. tokens: this rank's positions.
void GptModel::forward_stages(const Tensor& tokens) {
  const int p = par_.pp.size(), up = (par_.pp.rank() + 1) % p, down = (par_.pp.rank() + p - 1) % p;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    use_slot({0, c});
    if (!pre_process(c)) recv(stage_input({0, c}), down, par_.pp);
    forward_trunk(tokens, false);
    if (!post_process(c)) send(stage_output({0, c}), up, par_.pp);
  }
}

LossResult GptModel::evaluate(const Tensor& tokens, const Tensor& labels) {
  const ops::Context ctx{device_};
  const int64_t S = cfg_.seq_length;
  const Tensor tokens_h = host_batch(tokens, "tokens", B_, S), labels_h = host_batch(labels, "labels", B_, S);
  forward_stages(local_positions(tokens_h, cp_tokens_h_));
  if (!holds_loss_heads()) return {};  // (the last stage's loss)
  labels_.copy_from(local_positions(labels_h, cp_labels_h_));
  LossResult r;
  r.tokens = counted_labels(labels_h);
  nn::lm_head_loss(nullptr, nullptr, head_input(), output_->compute, labels_, 1.0f, head_ws_, ctx, head_group());
  r.loss_sum = read_loss_sum();
  if (par_.cp.size() > 1) all_reduce_sum(std::span<double>(&r.loss_sum, 1), par_.cp);
  return r;
}

void GptModel::forward_logits(Tensor& logits, const Tensor& tokens) {
  const ops::Context ctx{device_};
  const int CP = par_.cp.size();
  const int64_t S = cfg_.seq_length;
  forward_stages(CP == 1 ? tokens : local_positions(host_batch(tokens, "tokens", B_, S), cp_tokens_h_));
  if (!holds_loss_heads()) return;  // (the last stage's logits)
  Tensor h;                         // every position's hidden state, [B*S, H]
  if (CP == 1) {
    h = head_input();
  } else {  // this rank's positions, then the group's all-gathered and put in position order
    const Tensor& mine = head_input();
    const Shape all{B_ * S, mine.size(1)};
    Tensor gathered = Tensor::empty(all, mine.dtype(), MemCategory::workspace, device_);
    h = Tensor::empty(all, mine.dtype(), MemCategory::workspace, device_);
    all_gather(gathered, mine, par_.cp);
    nn::context_parallel_to_positions(h, gathered, B_, S, CP);
  }
  if (!tensor_parallel()) {
    ops::gemm(logits, h, false, output_->compute, true, 1.0f, 0.0f, ctx);
    return;
  }
  // Each rank's vocabulary columns, gathered along the vocabulary (generation and tests: not the step loop).
  Tensor part = Tensor::empty({logits.size(0), output_->compute.size(0)}, DType::f32, MemCategory::workspace, device_);
  ops::gemm(part, h, false, output_->compute, true, 1.0f, 0.0f, ctx);
  all_gather_into(logits, part, 1, par_.tp);
}

MemoryPlan GptModel::memory_plan(int64_t optimizer_state_bytes_per_param) const {
  MemoryPlan plan;
  auto at = [&](MemCategory c) -> int64_t& { return plan.bytes[static_cast<int>(c)]; };
  for (const auto& p : params_) {
    at(MemCategory::parameters) += p.value.nbytes() + (p.compute.same_data(p.value) ? 0 : p.compute.nbytes());
    at(MemCategory::gradients) += p.grad.nbytes();
  }
  at(MemCategory::optimizer_state) = optimizer_state_bytes_per_param * num_parameters();
  for (const auto& m : moe_) {
    if (m && m->state.expert_bias.defined()) at(MemCategory::parameters) += m->state.expert_bias.nbytes();
    if (m) at(MemCategory::other) += moe::router_state_bytes(m->state);  // the router's device-resident counters
  }
  auto count = [&](MemCategory c, std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts)
      if (t->defined()) at(c) += t->nbytes();
  };
  // Every slot's activations (set_micro_batch_slots). The MoE caches' backward scratch, which they all share (allocated
  // by one cache, moe_scratch_donor), is counted once; the plan counts it as activations.
  if (const moe::MoeLayerCache* donor = moe_scratch_donor())
    at(MemCategory::activations) += moe::moe_layer_scratch_bytes(*donor);
  for (size_t chunk = 0; chunk < slots_.size(); ++chunk)
    for (const Activations& a : slots_[chunk]) {
      for (size_t l = 0; l < layers_.size(); ++l) {
        if (layer_chunk_[l] != static_cast<int64_t>(chunk)) continue;
        if (recompute_group_[l] >= 0) {  // its routing; the caches are the shared sets'
          if (moe_[l]) at(MemCategory::activations) += moe::moe_layer_cache_bytes(a.moe[l]);
          continue;
        }
        const bool layer_mla = layers_[l].attention == AttentionKind::mla;
        at(MemCategory::activations) += nn::dense_layer_cache_bytes(dims_, moe_[l] == nullptr, !layer_mla);
        for (const Tensor* t : dropped(a.layer[l], l))  // (selective recompute's shared buffers: counted once below)
          at(MemCategory::activations) -= t->nbytes();
        if (layer_mla)  // (selective mla_up_proj: the kernel's input is shared, counted once below)
          at(MemCategory::activations) += nn::mla_cache_bytes(mla_dims_, cfg_.compute_dtype, dims_.layernorm) -
                                          (drops_mla_up(l) ? a.mla[l].qkv.nbytes() : 0);
        if (moe_[l]) at(MemCategory::activations) += moe::moe_layer_cache_bytes(a.moe[l]);
      }
      for (const Tensor& r : a.residual) count(MemCategory::activations, {&r});
      count(MemCategory::activations, {&a.final_mean, &a.final_rstd, &a.ids, &a.dfinal, &a.dinput});
    }
  at(MemCategory::workspace) =
      nn::dense_layer_workspace_bytes(dims_, standard_attention_) +
      (mla_ws_.q.defined() ? nn::mla_workspace_bytes(mla_dims_, cfg_.compute_dtype) : 0) +
      (holds_loss_heads() ? nn::lm_head_workspace_bytes(dims_.tokens(), cfg_.vocab_size / par_.tp.size(),
                                                        cfg_.compute_dtype, par_.tp.size())
                          : 0);
  for (const auto& [key, c] : recompute_caches_) {  // full recompute: each shared set once
    const bool is_moe = key % 4 & 1, is_mla = key % 4 & 2;
    at(MemCategory::activations) += nn::dense_layer_cache_bytes(dims_, !is_moe, !is_mla);
    if (is_mla) at(MemCategory::activations) += nn::mla_cache_bytes(mla_dims_, cfg_.compute_dtype, dims_.layernorm);
    if (is_moe) at(MemCategory::activations) += moe::moe_layer_cache_bytes(c.moe);
  }
  if (selective_moe_.probs.defined()) at(MemCategory::activations) += moe::moe_layer_cache_bytes(selective_moe_);
  for (const Tensor* t :
       {&selective_h1_, &selective_h2_dense_, &selective_h2_moe_, &selective_act_, &selective_attn_, &selective_lse_,
        &selective_fc1_, &selective_mlp_act_, &selective_shared_h_, &selective_shared_act_, &selective_mla_qkv_})
    if (t->defined()) at(MemCategory::activations) += t->nbytes();  // selective recompute's shared buffers
  // The model's own buffers, by the tensors themselves (each is allocated in one place, the constructor).
  for (const MtpDepth& d : mtp_) {
    count(MemCategory::activations, {&d.ids, &d.labels, &d.e, &d.hin, &d.x, &d.y, &d.en, &d.hn, &d.h, &d.e_mean,
                                     &d.e_rstd, &d.h_mean, &d.h_rstd, &d.f_mean, &d.f_rstd});
    count(MemCategory::workspace, {&d.ids_h, &d.labels_h});  // host: the rolled batch before its upload
  }
  count(MemCategory::workspace,
        {&rope_, &positions_, &positions_local_, &dres_, &dh_, &labels_, &final_h_, &final_full_, &moe_x_, &moe_out_,
         &mtp_dx_c_, &mtp_carry_, &mtp_dn_, &mtp_dfn_, &mtp_h_full_, &cp_tokens_h_, &cp_labels_h_});
  return plan;
}

double GptModel::flops_per_step() const {
  return model_flops_per_step(cfg_, B_);
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
