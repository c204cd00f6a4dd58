#include "moecore/model/moe_layer_case.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "moecore/io/json.h"

namespace moecore::model {
namespace {

using nlohmann::json;

// Largest accepted size of one dimension (hidden, ffn, experts, batch): far above real layers (H 7168, E 256), and
// small enough that the products the layer forms ([E, 2F, H], T * K) stay inside int64.
constexpr int64_t kMaxSize = int64_t{1} << 24;

[[noreturn]] void bad_key(const char* key, const json& v, const std::string& why) {
  MOECORE_FAIL("moe-layer: config key '", key, "' = ", v.dump(), ": ", why);
}

// The key's value when present and not null, else nullptr.
const json* find_key(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

int64_t get_int(const json& j, const char* key, int64_t def, int64_t lo, int64_t hi) {
  const json* v = find_key(j, key);
  if (!v) return def;
  if (!v->is_number_integer()) bad_key(key, *v, "expected an integer");
  // nlohmann stores 0 and every positive literal as unsigned: compare above INT64_MAX first, then both bounds.
  if ((v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) || v->get<int64_t>() < lo ||
      v->get<int64_t>() > hi)
    bad_key(key, *v, "must lie in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v->get<int64_t>();
}

float to_float(const char* key, const json& v, double lo, double hi) {
  if (!v.is_number()) bad_key(key, v, "expected a number");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    bad_key(key, v, detail::str_cat("must be a finite number in [", lo, ", ", hi, "]"));
  return static_cast<float>(x);
}

float get_float(const json& j, const char* key, float def, double lo, double hi) {
  const json* v = find_key(j, key);
  return v ? to_float(key, *v, lo, hi) : def;
}

bool get_bool(const json& j, const char* key, bool def) {
  const json* v = find_key(j, key);
  if (!v) return def;
  if (!v->is_boolean()) bad_key(key, *v, "expected true or false");
  return v->get<bool>();
}

std::string get_string(const json& j, const char* key, const std::string& def) {
  const json* v = find_key(j, key);
  if (!v) return def;
  if (!v->is_string()) bad_key(key, *v, "expected a string");
  return v->get<std::string>();
}

// A string or a list of strings.
std::vector<std::string> get_strings(const json& j, const char* key) {
  const json& v = j.at(key);
  if (v.is_string()) return {v.get<std::string>()};
  if (!v.is_array() || v.empty()) bad_key(key, v, "expected a string or a non-empty list of strings");
  std::vector<std::string> out;
  for (const json& e : v) {
    if (!e.is_string()) bad_key(key, v, "expected a string or a non-empty list of strings");
    out.push_back(e.get<std::string>());
  }
  return out;
}

// A number or a list of numbers, each finite and non-negative.
std::vector<float> get_floats(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_array()) return {to_float(key, v, 0.0, 3.0e38)};
  if (v.empty()) bad_key(key, v, "expected a number or a non-empty list of numbers");
  std::vector<float> out;
  for (const json& e : v) out.push_back(to_float(key, e, 0.0, 3.0e38));
  return out;
}

const Tensor& need(const std::map<std::string, Tensor>& in, const std::string& name, const Shape& shape) {
  auto it = in.find(name);
  if (it == in.end()) MOECORE_FAIL("moe-layer: input tensor '", name, "' is missing (expected ", shape.str(), ")");
  if (!(it->second.shape() == shape))
    MOECORE_FAIL("moe-layer: input tensor '", name, "' has shape ", it->second.shape().str(), ", expected ",
                 shape.str());
  return it->second;
}

// A host copy of t that shares no storage with it (outputs are read after the layer moves on).
Tensor host_copy(const Tensor& t) {
  return t.device() == Device::cpu ? t.clone() : t.to_device(Device::cpu);
}

Tensor scalar_f64(double v) {
  Tensor t = Tensor::empty(Shape{}, DType::f64, MemCategory::other);
  t.data<double>()[0] = v;
  return t;
}

// Every key is one the command knows (Megatron's names with '_').
void check_keys(const json& j) {
  static const std::set<std::string> known = {"hidden_size",
                                              "num_moe_experts",
                                              "moe_ffn_hidden_size",
                                              "moe_router_topk",
                                              "micro_batch_size",
                                              "moe_router_load_balancing_type",
                                              "moe_aux_loss_coeff",
                                              "moe_z_loss_coeff",
                                              "moe_router_score_function",
                                              "moe_router_pre_softmax",
                                              "moe_router_topk_scaling_factor",
                                              "moe_router_dtype",
                                              "moe_router_num_groups",
                                              "moe_router_group_topk",
                                              "moe_router_enable_expert_bias",
                                              "moe_expert_capacity_factor",
                                              "moe_token_drop_policy",
                                              "moe_pad_expert_input_to_capacity",
                                              "moe_shared_expert_intermediate_size",
                                              "moe_shared_expert_gate",
                                              "gated_linear_unit",
                                              "params_dtype",
                                              "aux_grad_scale",
                                              "moe_input_jitter_eps",
                                              "add_bias_linear"};
  for (const auto& [k, v] : j.items())
    if (!known.count(k)) MOECORE_FAIL("moe-layer: unknown config key '", k, "'");
}

// The router's keys: load balancing, losses, score function, top-k scaling, dtype, groups, expert bias.
void parse_router(const json& j, moe::MoeConfig& m) {
  if (find_key(j, "moe_router_load_balancing_type")) {
    m.load_balancing_type.clear();
    for (const auto& t : get_strings(j, "moe_router_load_balancing_type"))
      m.load_balancing_type.push_back(moe::parse_load_balancing(t));
  }
  if (find_key(j, "moe_aux_loss_coeff")) m.aux_loss_coeff = get_floats(j, "moe_aux_loss_coeff");
  m.z_loss_coeff = get_float(j, "moe_z_loss_coeff", 0.0f, 0.0, 3.0e38);
  m.input_jitter_eps = get_float(j, "moe_input_jitter_eps", 0.0f, 0.0, 1.0);
  m.score_function = moe::parse_score_function(get_string(j, "moe_router_score_function", "softmax"));
  m.pre_softmax = get_bool(j, "moe_router_pre_softmax", false);
  m.topk_scaling_factor = get_float(j, "moe_router_topk_scaling_factor", 0.0f, 0.0, 3.0e38);
  const std::string rd = get_string(j, "moe_router_dtype", "fp32");
  if (rd != "fp32" && rd != "fp64") MOECORE_FAIL("moe-layer: moe_router_dtype '", rd, "' is not fp32 or fp64");
  m.router_dtype = rd == "fp64" ? DType::f64 : DType::f32;
  m.num_groups = get_int(j, "moe_router_num_groups", 0, 0, kMaxSize);
  m.group_topk = get_int(j, "moe_router_group_topk", 0, 0, kMaxSize);
  m.enable_expert_bias = get_bool(j, "moe_router_enable_expert_bias", false);
}

// The layer's parameters from the case's tensors ("param.*"), in the case's compute dtype (router and biases f32).
moe::MoeLayerWeights case_weights(const MoeLayerCase& c, const std::map<std::string, Tensor>& in, Device device) {
  const moe::MoeConfig& m = c.cfg;
  const int64_t H = c.H, E = m.num_experts, F = c.F, Fs = c.Fs;
  const int64_t fc1 = m.swiglu ? 2 * F : F, sfc1 = m.swiglu ? 2 * Fs : Fs;
  auto on_device = [&](const Tensor& t, DType dt) {
    return t.to(dt, MemCategory::parameters).to_device(device, MemCategory::parameters);
  };
  auto compute = [&](const Tensor& t) { return on_device(t, c.compute); };
  auto f32 = [&](const Tensor& t) { return on_device(t, DType::f32); };
  moe::MoeLayerWeights w;
  const Tensor router = f32(need(in, "param.router.weight", {E, H}));
  w.router = {router, compute(router)};
  w.experts = {compute(need(in, "param.experts.linear_fc1.weight", {E, fc1, H})),
               compute(need(in, "param.experts.linear_fc2.weight", {E, H, F}))};
  if (c.add_bias_linear) {
    w.router.bias = f32(need(in, "param.router.bias", {E}));
    w.experts.fc1_bias = f32(need(in, "param.experts.linear_fc1.bias", {E, fc1}));
    w.experts.fc2_bias = f32(need(in, "param.experts.linear_fc2.bias", {E, H}));
  }
  if (Fs > 0) {
    w.shared.fc1 = compute(need(in, "param.shared_experts.linear_fc1.weight", {sfc1, H}));
    w.shared.fc2 = compute(need(in, "param.shared_experts.linear_fc2.weight", {H, Fs}));
    if (m.shared_expert_gate) w.shared.gate = f32(need(in, "param.shared_experts.gate_weight", {1, H}));
  }
  return w;
}

moe::MoeLayerGrads case_grads(const MoeLayerCase& c, Device device) {
  const moe::MoeConfig& m = c.cfg;
  const int64_t H = c.H, E = m.num_experts, F = c.F, Fs = c.Fs;
  const int64_t fc1 = m.swiglu ? 2 * F : F, sfc1 = m.swiglu ? 2 * Fs : Fs;
  auto grad = [&](const Shape& s) { return Tensor::zeros(s, DType::f32, MemCategory::gradients, device); };
  moe::MoeLayerGrads g;
  g.router = grad({E, H});
  g.experts = {grad({E, fc1, H}), grad({E, H, F})};
  if (c.add_bias_linear) {
    g.router_bias = grad({E});
    g.experts.fc1_bias = grad({E, fc1});
    g.experts.fc2_bias = grad({E, H});
  }
  if (Fs > 0) {
    g.shared.fc1 = grad({sfc1, H});
    g.shared.fc2 = grad({H, Fs});
    if (m.shared_expert_gate) g.shared.gate = grad({1, H});
  }
  return g;
}

// The parameters' gradients as the case's outputs ("grad.param.*").
void add_grads(std::map<std::string, Tensor>& out, const MoeLayerCase& c, const moe::MoeLayerGrads& g) {
  out["grad.param.router.weight"] = host_copy(g.router);
  out["grad.param.experts.linear_fc1.weight"] = host_copy(g.experts.fc1);
  out["grad.param.experts.linear_fc2.weight"] = host_copy(g.experts.fc2);
  if (c.add_bias_linear) {
    out["grad.param.router.bias"] = host_copy(g.router_bias);
    out["grad.param.experts.linear_fc1.bias"] = host_copy(g.experts.fc1_bias);
    out["grad.param.experts.linear_fc2.bias"] = host_copy(g.experts.fc2_bias);
  }
  if (c.Fs > 0) {
    out["grad.param.shared_experts.linear_fc1.weight"] = host_copy(g.shared.fc1);
    out["grad.param.shared_experts.linear_fc2.weight"] = host_copy(g.shared.fc2);
    if (c.cfg.shared_expert_gate) out["grad.param.shared_experts.gate_weight"] = host_copy(g.shared.gate);
  }
}

}  // namespace

MoeLayerCase moe_layer_case_parse(const std::string& text) {
  const json j = io::parse_json(text, "moe-layer: config");
  if (!j.is_object()) MOECORE_FAIL("moe-layer: config is ", j.type_name(), ", not a JSON object of config keys");
  check_keys(j);
  MoeLayerCase c;
  moe::MoeConfig& m = c.cfg;
  c.H = get_int(j, "hidden_size", 0, 1, kMaxSize);
  m.num_experts = get_int(j, "num_moe_experts", 0, 1, kMaxSize);
  c.F = get_int(j, "moe_ffn_hidden_size", 0, 1, kMaxSize);
  m.ffn_hidden_size = c.F;
  m.router_topk = get_int(j, "moe_router_topk", 2, 1, kMaxSize);
  c.B = get_int(j, "micro_batch_size", 1, 1, kMaxSize);
  if (c.H == 0 || c.F == 0 || m.num_experts == 0)
    MOECORE_FAIL("moe-layer: hidden_size (", c.H, "), moe_ffn_hidden_size (", c.F, ") and num_moe_experts (",
                 m.num_experts, ") must be set");
  parse_router(j, m);
  // Above num_moe_experts the capacity exceeds every routed token (and the padded buffers grow with it).
  m.capacity_factor = get_float(j, "moe_expert_capacity_factor", 0.0f, 0.0, static_cast<double>(m.num_experts));
  const std::string pol = get_string(j, "moe_token_drop_policy", "probs");
  if (pol != "probs" && pol != "position")
    MOECORE_FAIL("moe-layer: moe_token_drop_policy '", pol, "' is not probs or position");
  m.drop_policy = pol == "position" ? moe::DropPolicy::position : moe::DropPolicy::probs;
  m.pad_expert_input_to_capacity = get_bool(j, "moe_pad_expert_input_to_capacity", false);
  c.Fs = get_int(j, "moe_shared_expert_intermediate_size", 0, 0, kMaxSize);
  m.shared_expert_intermediate_size = c.Fs;
  m.shared_expert_gate = get_bool(j, "moe_shared_expert_gate", false);
  m.swiglu = get_bool(j, "gated_linear_unit", false);  // Megatron default: no GLU
  const std::string pd = get_string(j, "params_dtype", "fp32");
  if (pd != "fp32" && pd != "bf16" && pd != "fp16")
    MOECORE_FAIL("moe-layer: params_dtype '", pd, "' is not fp32, bf16 or fp16");
  c.compute = pd == "bf16" ? DType::bf16 : pd == "fp16" ? DType::f16 : DType::f32;
  c.aux_grad_scale = get_float(j, "aux_grad_scale", 1.0f, -3.0e38, 3.0e38);
  c.add_bias_linear = get_bool(j, "add_bias_linear", false);
  if (c.add_bias_linear && c.Fs > 0)
    MOECORE_FAIL(
        "moe-layer: add_bias_linear is not supported with shared experts (Megatron's SharedExpertMLP "
        "asserts add_bias_linear == False); unset moe_shared_expert_intermediate_size (",
        c.Fs, ")");
  try {
    m.validate();
  } catch (const Error& e) {
    MOECORE_FAIL("moe-layer: ", e.what(), " (config keys use Megatron's names with '_')");
  }
  return c;
}

std::map<std::string, Tensor> moe_layer_case_run(const MoeLayerCase& c, const std::map<std::string, Tensor>& in,
                                                 Device device) {
  const moe::MoeConfig& m = c.cfg;
  auto hit = in.find("input.hidden");
  if (hit == in.end()) MOECORE_FAIL("moe-layer: input tensor 'input.hidden' is missing");
  if (hit->second.dim() != 2)
    MOECORE_FAIL("moe-layer: input tensor 'input.hidden' has shape ", hit->second.shape().str(), ", expected [T, ", c.H,
                 "]");
  if (c.B <= 0 || c.H <= 0 || c.F <= 0 || c.Fs < 0 || m.num_experts <= 0)
    MOECORE_FAIL("moe-layer: micro_batch_size (", c.B, "), hidden_size (", c.H, "), moe_ffn_hidden_size (", c.F,
                 ") and num_moe_experts (", m.num_experts, ") must be positive (moe_layer_case_parse checks them)");
  const int64_t T = hit->second.size(0), H = c.H, E = m.num_experts, F = c.F, Fs = c.Fs;
  if (T <= 0) MOECORE_FAIL("moe-layer: input tensor 'input.hidden' ", hit->second.shape().str(), " holds no tokens");
  if (T % c.B != 0) MOECORE_FAIL("moe-layer: ", T, " tokens are not divisible by micro_batch_size ", c.B);
  auto on_device = [&](const Tensor& t, DType dt) {
    return t.to(dt, MemCategory::parameters).to_device(device, MemCategory::parameters);
  };
  const Tensor x = on_device(need(in, "input.hidden", {T, H}), c.compute);
  const Tensor dy = on_device(need(in, "input.output_grad", {T, H}), DType::f32);
  Tensor mask;
  if (in.count("input.padding_mask")) mask = need(in, "input.padding_mask", {T}).to(DType::boolean).to_device(device);

  const moe::MoeLayerWeights w = case_weights(c, in, device);
  moe::RouterState st = moe::router_state_init(m, device);
  if (m.enable_expert_bias)
    st.expert_bias.copy_from(need(in, "param.router.expert_bias", {E}).to(st.expert_bias.dtype()));
  moe::MoeLayerGrads g = case_grads(c, device);
  moe::MoeLayerDims d{T, c.B, H, F, Fs, c.compute};
  d.device = device;
  const ops::Context ctx{device};
  moe::MoeLayerCache cache = moe::moe_layer_cache_alloc(d, m);
  moe::LocalDispatcher dispatcher;
  Tensor y = Tensor::empty({T, H}, DType::f32, MemCategory::activations, device);
  Tensor dx = Tensor::empty({T, H}, DType::f32, MemCategory::activations, device);
  moe::moe_layer_forward(y, x, mask, w, st, cache, dispatcher, d, m, /*training=*/true, ctx);
  std::map<std::string, Tensor> out;
  out["out.output"] = host_copy(y);
  out["routing.map"] = host_copy(cache.map);
  out["routing.probs"] = host_copy(cache.probs);
  out["routing.tokens_per_expert"] = host_copy(cache.stats.tokens_per_expert);
  const moe::RouterStatsHost stats = moe::router_stats_host(cache.stats);
  if (m.uses(moe::LoadBalancing::aux_loss)) out["loss.aux_loss"] = scalar_f64(stats.aux_loss);
  if (m.uses(moe::LoadBalancing::seq_aux_loss)) out["loss.seq_aux_loss"] = scalar_f64(stats.seq_aux_loss);
  if (m.uses(moe::LoadBalancing::global_aux_loss)) out["loss.global_aux_loss"] = scalar_f64(stats.global_aux_loss);
  if (m.z_loss_coeff > 0) out["loss.z_loss"] = scalar_f64(stats.z_loss);

  moe::moe_layer_backward(dx, g, dy, x, w, cache, dispatcher, d, m, c.aux_grad_scale, ctx);
  out["grad.input.hidden"] = host_copy(dx);
  add_grads(out, c, g);
  return out;
}

}  // namespace moecore::model
