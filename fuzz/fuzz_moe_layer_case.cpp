// libFuzzer harness: a `moecore moe-layer` case. The first input byte picks the token count (1 + low 3 bits) and
// how the inputs are spoiled (bits 3-5: none, one tensor missing, one tensor of the wrong shape, input.hidden 1-D,
// an i64 tensor, ...); the rest is layer.json. The JSON goes through model::moe_layer_case_parse; when it parses and
// the layer is small enough to run in milliseconds, inputs of the declared shapes are made and
// model::moe_layer_case_run does forward and backward. moecore::Error is the expected outcome of bad input;
// anything else is a finding to fix in the reader. Seeds (fuzz/seeds/moe_layer_case/): the control byte plus the
// layer.json of golden-like cases written by hand.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

#include "moecore/model/moe_layer_case.h"

using namespace moecore;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("OMP_NUM_THREADS", "1", 1);  // tiny layers: thread start-up would dominate
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int control = data[0];
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  model::MoeLayerCase c;
  try {
    c = model::moe_layer_case_parse(text);
  } catch (const Error&) {
    return 0;
  }
  const int64_t T = 1 + (control & 7), H = c.H, E = c.cfg.num_experts, F = c.F, Fs = c.Fs;
  const int64_t fc1 = c.cfg.swiglu ? 2 * F : F, sfc1 = c.cfg.swiglu ? 2 * Fs : Fs;
  if (H > 64 || E > 32 || F > 64 || Fs > 64) return 0;  // valid but slow to run: the parse was the test
  std::map<std::string, Tensor> in;
  auto add = [&](const char* name, const Shape& shape) { in[name] = Tensor::zeros(shape, DType::f32); };
  add("input.hidden", {T, H});
  add("input.output_grad", {T, H});
  add("input.padding_mask", {T});
  add("param.router.weight", {E, H});
  add("param.experts.linear_fc1.weight", {E, fc1, H});
  add("param.experts.linear_fc2.weight", {E, H, F});
  add("param.router.bias", {E});
  add("param.experts.linear_fc1.bias", {E, fc1});
  add("param.experts.linear_fc2.bias", {E, H});
  add("param.router.expert_bias", {E});
  if (Fs > 0) {
    add("param.shared_experts.linear_fc1.weight", {sfc1, H});
    add("param.shared_experts.linear_fc2.weight", {H, Fs});
    add("param.shared_experts.gate_weight", {1, H});
  }
  for (auto& [name, t] : in) t.fill_(0.01f);
  const auto victim = std::next(in.begin(), static_cast<long>((control >> 6) % in.size()));
  switch ((control >> 3) & 7) {
    case 1:
      in.erase(victim);
      break;
    case 2:
      victim->second = Tensor::zeros({victim->second.numel() + 1}, DType::f32);
      break;
    case 3:
      in["input.hidden"] = Tensor::zeros({T * H}, DType::f32);
      break;
    case 4:
      victim->second = victim->second.to(DType::i64);
      break;
    case 5:
      in["input.hidden"] = Tensor::zeros({0, H}, DType::f32);
      in["input.output_grad"] = Tensor::zeros({0, H}, DType::f32);
      in["input.padding_mask"] = Tensor::zeros({0}, DType::f32);
      break;
    default:
      break;
  }
  try {
    (void)model::moe_layer_case_run(c, in);
  } catch (const Error&) {
  }
  return 0;
}
