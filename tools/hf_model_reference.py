#!/usr/bin/env python3
"""Golden files for moecore's Hugging Face MoE checkpoint import (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3/V2-Lite,
DeepSeek-V2, GLM-4.5, OLMoE).

Uses Hugging Face transformers' own modeling code (written against transformers 5.23.0, torch 2.x, CPU; the
deepseek_v2*, glm4_moe and olmoe cases generated with transformers 5.24.0, torch 2.15) to build tiny random models, saves each with `save_pretrained` (float32, hub tensor names: per-expert tensors such as
`model.layers.0.block_sparse_moe.experts.0.w1.weight` or `model.layers.0.mlp.experts.0.gate_proj.weight`, even though
transformers 5.x keeps experts fused in memory as `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`), reloads the
saved checkpoint with `from_pretrained`, and records the forward/backward of a next-token cross-entropy on random ids.

Per case, <out>/<case>/ holds exactly:
  config.json         written by save_pretrained (generation_config.json is deleted)
  model.safetensors   written by save_pretrained: float32 weights, hub names, the values the golden uses
  tokens.safetensors  `tokens` int32 [2, 12], random ids in [0, vocab)
  golden.safetensors  `logits` F32 [2, 12, vocab]; `loss` F64 [] = model(input_ids=tokens, labels=tokens).loss
                      (mean cross-entropy, position s predicts token s+1, last position ignored, no router aux loss);
                      `grad.<name>` F32 for every tensor <name> of model.safetensors: d loss / d that tensor,
                      except the DeepSeek router buffers `*.mlp.gate.e_score_correction_bias` (saved, nonzero, used
                      for expert selection only, not trained by backprop): they have no grad entry.
Cases (hidden 32, vocab 96):
  mixtral         2 layers, 4 experts top-2 (softmax, top-k renormalised), GQA 4/2.
  qwen2_moe       3 layers, layer 1 dense (mlp_only_layers=[1]), 6 experts top-2 without renormalisation,
                  sigmoid-gated shared expert, q/k/v biases.
  qwen3_moe       2 layers, 8 experts top-3 with norm_topk_prob, head_dim 16 != hidden/heads, q/k RMSNorm.
  qwen3_moe_tied  qwen3_moe with tie_word_embeddings, norm_topk_prob false, layer 0 dense (mlp_only_layers=[0]).
  deepseek_v3     DeepseekV3ForCausalLM (model_type deepseek_v3), 3 layers, layer 0 dense (first_k_dense_replace=1);
                  MLA: 4 heads, q_lora_rank 24 (q_a_proj/q_a_layernorm/q_b_proj), kv_lora_rank 16, qk_nope 8,
                  qk_rope 4 (rope_interleave true, the default), v_head 6; YaRN (factor 4, original 8, mscale =
                  mscale_all_dim = 1); 16 routed experts (moe_intermediate 12) top-4, n_group 4, topk_group 2, sigmoid
                  scores + e_score_correction_bias, norm_topk_prob, routed_scaling_factor 2.5, 1 shared expert;
                  no MTP layer (num_nextn_predict_layers 0). 4 experts per group: the group score is the sum of the
                  top-2 of the group, top-4 picks among the 8 experts of the 2 kept groups (both choices have margins).
  deepseek_v3_group_top2
                  deepseek_v3 with 2 layers (layer 0 dense, layer 1 MoE), plain RoPE (theta 10000, no YaRN), no MTP,
                  and top-2 (num_experts_per_tok 2) of the 16 experts, n_group 4, topk_group 2, so
                  num_experts_per_tok // topk_group = 1: transformers scores a group by the sum of its top-2 biased
                  scores, Megatron-Core by the sum of its top-(num_experts_per_tok // topk_group), here the group max.
                  The golden pins transformers' rule and is chosen so that the rules differ: >= 2 tokens get another
                  expert set under Megatron-Core's group score (see "Group-score rules" below).
  deepseek_v2lite same class, 2 layers, layer 0 dense, q_lora_rank null (q_proj), plain RoPE, n_group = topk_group = 1,
                  top-2 with renormalisation (norm_topk_prob true: Megatron always renormalises sigmoid top-k > 1),
                  routed_scaling_factor 1.
  deepseek_v2     DeepseekV2ForCausalLM (model_type deepseek_v2), 2 layers, layer 0 dense; MLA with q_lora_rank 24
                  (interleaved RoPE), YaRN (factor 4, original 8, mscale = mscale_all_dim = 0.707); 16 experts top-4,
                  softmax scores, topk_method group_limited_greedy (n_group 4, topk_group 2: a group scores its best
                  expert), no renormalisation, routed_scaling_factor 2, 1 shared expert. 16 / 4 groups and k 4: Megatron-
                  Core's default group score (top-2 sum) differs from transformers' max on >= 2 tokens (GROUP_RULE_MIN_DIFF).
  deepseek_v2_greedy
                  deepseek_v2 in V2-Lite's shape: q_lora_rank null, greedy top-2 of 8, plain RoPE.
  glm4_moe        Glm4MoeForCausalLM, 3 layers, layer 0 dense; GQA 4/2 with head_dim 16, q/k/v biases (attention_bias),
                  per-head QK-norm (use_qk_norm), partial_rotary_factor 0.5; DeepSeek-V3's router (16 experts top-4,
                  n_group 4, topk_group 2, sigmoid + e_score_correction_bias, renormalised, scaling 2.5), 1 shared
                  expert; no MTP layer (transformers' Glm4Moe model has none).
  olmoe           OlmoeForCausalLM, 2 layers, GQA 4/2, q_norm / k_norm over the whole q / k projections, 8 experts
                  top-2 without renormalisation.
  deepseek_v3_mtp deepseek_v3's sizes with 2 layers plus one multi-token-prediction layer model.layers.2.* (hub names,
                  num_nextn_predict_layers 1), trained as Megatron-Core trains MTP: golden adds `mtp_loss` (F64) and
                  `mtp_logits` (F32), grads are of loss + 0.1 * mtp_loss. Generated / checked by tools/mtp_reference.py
                  (see its docstring for the exact formulas and file layout).

How:
  * Weights are re-initialised (std 0.2 linear, 0.5 router, 0.3 embedding, norms 1 + 0.1*randn, biases 0.1*randn)
    so that no norm weight is 1 and routing is not degenerate; DeepSeek's e_score_correction_bias buffers are set
    to 0.05*randn; the model is then saved.
  * The golden runs the reloaded model in float64 (`.double()`, attn_implementation="eager",
    experts_implementation="eager", train() mode, every dropout 0, router jitter 0). HF hard-codes float32 islands
    (RMSNorm `.to(torch.float32)`, router softmax, DeepSeek's router `F.linear(h.type(torch.float32), ...)`,
    eager-attention softmax, RoPE cos/sin, the loss `logits.float()`); a TorchFunctionMode maps those float32
    requests to float64 and RoPE's inv_freq (default or YaRN) is recomputed in float64, so the golden is float64
    throughout. The plain HF float64 run (with its float32 islands) and the plain float32 run are
    computed too and must agree closely and pick the same experts.
  * Gradients of the fused in-memory parameters are mapped back to hub names without assuming the layout: every
    saved tensor is located (exact equality) among the in-memory parameters and their per-expert slices
    (row/column blocks, strided rows, transposes); each must match exactly one slice and the slices must cover every
    parameter element exactly once. The grad of a hub tensor is the same slice of the parameter's grad.
  * Routing margin: for every token and MoE layer the gap between the k-th and (k+1)-th largest router probability
    must be >= 1e-3 * the largest probability, so a float32 implementation picks the same experts. Otherwise the
    seed is bumped (base, base+1, ...); the seed used is printed and stored in golden.safetensors' metadata
    (key `reference`, a JSON object). DeepSeek routing (recomputed in float64 from the router logits and checked
    against HF's choice and weights): both the group choice, (g_{topk_group} - g_{topk_group+1}) / g_1 over the group
    scores (sum of the top-2 biased scores per group), and the expert choice among the allowed experts,
    (c_k - c_{k+1}) / c_1 over the biased scores, must be >= 1e-3 (a gap that does not exist is skipped).
  * Group-score rules (DeepSeek, group-limited routers): the expert sets are also recomputed with Megatron-Core's
    group score (sum of the top-(num_experts_per_tok // topk_group) biased scores of the group instead of
    transformers' top-2); the (MoE layer, token) pairs whose set differs are counted (from the float64 router logits,
    and the same pairs must come out of the float32 run's router logits). Cases in GROUP_RULE_MIN_DIFF need at least
    that many such pairs (otherwise the seed is bumped); their count is printed and stored in the metadata
    (`group_rule_diff_tokens`).
  * Self-checks: loss == cross-entropy recomputed from the float64 logits; central finite differences agree with one
    gradient entry of every tensor kind; layout / name sets as above (grad names == saved names minus the
    e_score_correction_bias ones, which must equal the in-memory buffers exactly).

Regenerate (all cases, or one with --case NAME):
  python3 -m venv V && V/bin/pip install torch transformers safetensors numpy
  V/bin/python tools/hf_model_reference.py --out tests/golden/hf_models
Verify the committed files (recomputes from the committed model.safetensors + tokens, compares with the golden):
  V/bin/python tools/hf_model_reference.py --out tests/golden/hf_models --check
"""
import argparse
import copy
import json
import os
import re
import shutil
import tempfile

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

import transformers
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig, GptOssConfig,
                          MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

BATCH, SEQ = 2, 12
MARGIN = 1e-3  # required (p_k - p_{k+1}) / p_1 for every token and MoE layer (DeepSeek: see routing_margins)
NO_GRAD = ".e_score_correction_bias"  # saved router buffers (DeepSeek): not trained by backprop, no grad entry
MAX_TRIES = 400
FILES = ["config.json", "golden.safetensors", "model.safetensors", "tokens.safetensors"]
MTP_CASE = "deepseek_v3_mtp"  # generated / checked by tools/mtp_reference.py

COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, attention_dropout=0.0)
DEEPSEEK = dict(  # MLA + sigmoid group-limited routing with e_score_correction_bias; no MTP layer
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=6, n_routed_experts=8, n_shared_experts=1, max_position_embeddings=64, attention_dropout=0.0,
    tie_word_embeddings=False, rms_norm_eps=1e-6, num_mtp_layers=0)
CASES = {
    "mixtral": (MixtralConfig, 100, dict(
        COMMON, intermediate_size=40, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False, rms_norm_eps=1e-5,
        router_jitter_noise=0.0)),
    "qwen2_moe": (Qwen2MoeConfig, 200, dict(
        COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False)),
    "qwen3_moe": (Qwen3MoeConfig, 300, dict(
        COMMON, intermediate_size=48, moe_intermediate_size=20, num_hidden_layers=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False)),
    "qwen3_moe_tied": (Qwen3MoeConfig, 400, dict(
        COMMON, intermediate_size=48, moe_intermediate_size=20, num_hidden_layers=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True)),
    "deepseek_v3": (DeepseekV3Config, 500, dict(
        DEEPSEEK, num_hidden_layers=3, q_lora_rank=24, n_routed_experts=16, moe_intermediate_size=12, n_group=4,
        topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0})),
    "deepseek_v3_group_top2": (DeepseekV3Config, 800, dict(
        DEEPSEEK, num_hidden_layers=2, q_lora_rank=24, n_routed_experts=16, moe_intermediate_size=12, n_group=4,
        topk_group=2, num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "deepseek_v2lite": (DeepseekV3Config, 600, dict(
        DEEPSEEK, num_hidden_layers=2, q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=2,
        routed_scaling_factor=1.0, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "glm4_moe": (Glm4MoeConfig, 900, dict(
        COMMON, intermediate_size=48, moe_intermediate_size=12, num_hidden_layers=3, first_k_dense_replace=1,
        head_dim=16, attention_bias=True, use_qk_norm=True, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, rms_norm_eps=1e-5, num_nextn_predict_layers=0)),
    "deepseek_v2": (DeepseekV2Config, 1000, dict(
        {k: v for k, v in DEEPSEEK.items() if k != "num_mtp_layers"}, num_hidden_layers=2, q_lora_rank=24,
        n_routed_experts=16, moe_intermediate_size=12, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        num_experts_per_tok=4, routed_scaling_factor=2.0, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707})),
    "olmoe": (OlmoeConfig, 1200, dict(
        COMMON, intermediate_size=20, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False, rms_norm_eps=1e-5,
        clip_qkv=None)),
    "gpt_oss": (GptOssConfig, 1300, dict(
        COMMON, head_dim=16, intermediate_size=12, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
        swiglu_limit=1.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False},
        tie_word_embeddings=False, rms_norm_eps=1e-5, router_aux_loss_coef=0.9)),
    "deepseek_v2_greedy": (DeepseekV2Config, 1100, dict(
        {k: v for k, v in DEEPSEEK.items() if k != "num_mtp_layers"}, num_hidden_layers=2, q_lora_rank=None,
        topk_method="greedy", num_experts_per_tok=2, routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
LOAD_KW = dict(attn_implementation="eager", experts_implementation="eager")
# cases whose golden must tell transformers' DeepSeek group score (sum of the top-2 biased scores of a group) from
# Megatron-Core's (sum of the top-(num_experts_per_tok // topk_group), here top-1 = the group max): the minimum number
# of (MoE layer, token) pairs whose expert set differs between the two rules (see group_rule_differences)
GROUP_RULE_MIN_DIFF = {"deepseek_v3_group_top2": 2, "deepseek_v2": 2}


class Float64Mode(TorchFunctionMode):
    """Turns HF's explicit float32 upcasts (x.float(), x.to(torch.float32), softmax(dtype=torch.float32), ...) into
    float64 and makes float64 the default dtype, so a .double() model computes in float64 throughout."""

    def __enter__(self):
        self._old_default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._old_default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# model construction


def make_config(case):
    cls, _, kw = CASES[case]
    return cls(**kw)


def reinit_(model, gen):
    """Deterministic, non-degenerate weights (std well above HF's 0.02, norm weights not 1, biases not 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            randn = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * randn)
            elif name.endswith(".bias"):
                p.copy_(0.1 * randn)
            elif "embed_tokens" in name:  # also the output projection when tied
                p.copy_(0.3 * randn)
            elif name.endswith("mlp.gate.weight"):  # router
                p.copy_(0.5 * randn)
            else:
                p.copy_(0.2 * randn)
        for name, b in model.named_buffers():  # DeepSeek router bias (none in the other models)
            if name.endswith(NO_GRAD):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def load(case_dir):
    model = AutoModelForCausalLM.from_pretrained(case_dir, dtype=torch.float32, **LOAD_KW)
    assert model.config._attn_implementation == "eager" and model.config._experts_implementation == "eager"
    return model


# ----------------------------------------------------------------------------------------------------------------
# hub tensor <-> in-memory parameter layout


def _views(t):
    """(description, view-function) for slices of a parameter that a hub tensor may be."""
    out = [("", lambda x: x)]
    if t.dim() == 3:
        for e in range(t.shape[0]):
            out.append((f"[{e}]", lambda x, e=e: x[e]))
    res = []
    for desc, fn in out:
        base = fn(t)
        res.append((desc, fn))
        if base.dim() != 2:
            continue
        res.append((desc + ".T", lambda x, fn=fn: fn(x).transpose(0, 1)))
        for tdesc, tfn in (("", lambda x, fn=fn: fn(x)), (".T", lambda x, fn=fn: fn(x).transpose(0, 1))):
            b = tfn(t)
            for n in range(2, b.shape[0] + 1):
                if b.shape[0] % n:
                    continue
                rows = b.shape[0] // n
                for c in range(n):
                    res.append((f"{desc}{tdesc}[{c * rows}:{(c + 1) * rows}]",
                                lambda x, tfn=tfn, c=c, rows=rows: tfn(x)[c * rows:(c + 1) * rows]))
                    res.append((f"{desc}{tdesc}[{c}::{n}]", lambda x, tfn=tfn, c=c, n=n: tfn(x)[c::n]))
    return res


def find_layout(model, hub):
    """Map each hub tensor name to (param name, slice description, view fn) by exact value equality."""
    params = dict(model.named_parameters())
    cands = {pn: _views(p.detach()) for pn, p in params.items()}
    layout = {}
    for hn, ht in hub.items():
        hits = []
        for pn, p in params.items():
            if p.numel() < ht.numel():
                continue
            for desc, fn in cands[pn]:
                v = fn(p.detach())
                if v.shape == ht.shape and torch.equal(v, ht):
                    hits.append((pn, desc, fn))
        assert len(hits) == 1, f"hub tensor {hn}: {len(hits)} matching parameter slices {[h[:2] for h in hits]}"
        layout[hn] = hits[0]
    for pn, p in params.items():  # every element of every parameter saved exactly once
        cover = torch.zeros(p.shape, dtype=torch.int32)
        for hpn, _, fn in layout.values():
            if hpn == pn:
                fn(cover).add_(1)
        assert bool((cover == 1).all()), f"parameter {pn} not covered exactly once by the saved tensors"
    return layout


def layout_summary(layout):
    """Distinct non-identity mappings with layer index -> L and (matching) expert index -> E, e.g.
    'model.layers.L.mlp.experts.gate_up_proj[E][0:40] -> model.layers.L.block_sparse_moe.experts.E.w1.weight'."""
    lines = set()
    for hn, (pn, desc, _) in layout.items():
        if pn == hn and not desc:
            continue
        lay = re.search(r"layers\.(\d+)\.", hn)
        exp = re.search(r"experts\.(\d+)\.", hn)
        if lay and re.search(rf"layers\.{lay.group(1)}\.", pn):
            hn, pn = (re.sub(r"layers\.\d+\.", "layers.L.", x, count=1) for x in (hn, pn))
        if exp and desc.startswith(f"[{exp.group(1)}]"):
            hn = re.sub(r"experts\.\d+\.", "experts.E.", hn, count=1)
            desc = "[E]" + desc[len(exp.group(1)) + 2:]
        lines.add(f"{pn}{desc} -> {hn}")
    return sorted(lines)


# ----------------------------------------------------------------------------------------------------------------
# forward / backward


def _router_modules(model):  # MixtralTopKRouter, Qwen*MoeTopKRouter, DeepseekV3TopkRouter
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]


def run(model, tokens, backward):
    """Forward (train mode) with labels; returns logits, loss, per-router (name, logits, chosen indices, router
    module, routing weights)."""
    routers = []
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: routers.append((n, out[0].detach(), out[2].detach(),
                                                                                  mod, out[1].detach())))
             for n, m in _router_modules(model)]
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens, output_router_logits=False, use_cache=False)
        if backward:
            out.loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return out.logits.detach(), out.loss.detach(), routers


def to_fp64(model32):
    """Deep copy in float64 with RoPE inverse frequencies (default or YaRN) recomputed in float64."""
    model = copy.deepcopy(model32).double()
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "compute_default_rope_parameters"):
            assert m.rope_type in ("default", "yarn"), m.rope_type
            init_fn = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS["yarn"]
            with Float64Mode():
                inv, scale = init_fn(model.config)
            assert inv.dtype == torch.float64 and scale == m.attention_scaling, (inv.dtype, scale)
            assert m.rope_type != "default" or scale == 1.0
            assert torch.allclose(inv, m.inv_freq, rtol=1e-6, atol=0)
            m.inv_freq = inv
            m.original_inv_freq = inv.clone()
    return model


def check_train_setup(model):
    cfg = model.config
    assert getattr(cfg, "attention_dropout", 0.0) == 0.0 and getattr(cfg, "router_jitter_noise", 0.0) == 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            assert m.p == 0.0
        if hasattr(m, "attention_dropout"):
            assert m.attention_dropout == 0.0


def _grouped_router(mod):
    """(scores fn, bias, G, TG, per_group, renormalise) of a DeepSeek-style router, or None for a plain softmax top-k:
    DeepseekV3 / Glm4Moe (sigmoid scores, choice = scores + e_score_correction_bias, group score = sum of the top-2
    choice scores, weights renormalised when norm_topk_prob) or DeepseekV2 (softmax scores, choice = scores, group
    score = the group max under group_limited_greedy, one group under greedy; weights never renormalised)."""
    if hasattr(mod, "e_score_correction_bias"):
        return (torch.sigmoid, mod.e_score_correction_bias.detach(), mod.num_group, mod.topk_group, 2,
                mod.norm_topk_prob)
    if hasattr(mod, "topk_method"):
        grouped = mod.topk_method == "group_limited_greedy"
        assert grouped or mod.topk_method == "greedy", mod.topk_method
        return (lambda x: torch.softmax(x, dim=-1), None, mod.num_group if grouped else 1,
                mod.topk_group if grouped else 1, 1, False)
    return None


def _deepseek_margins(logits, idx, weights, mod):
    """DeepSeek routing (see _grouped_router) recomputed in float64 from the router logits: keep the topk_group best
    groups by group score, top-k choice scores within them; weights = scores of the chosen (renormalised: / (sum +
    1e-20)) * routed_scaling_factor. Returns the min over tokens of the relative gaps (group: (g_{topk_group} -
    g_{topk_group+1}) / g_1; experts, among the allowed ones: (c_k - c_{k+1}) / c_1; a gap that does not exist, e.g.
    n_group == topk_group, is skipped) and the min absolute gap of the two kinds."""
    score_fn, bias, G, TG, per_group, renorm = _grouped_router(mod)
    k, E = mod.top_k, mod.num_experts
    scores = score_fn(logits.double())
    choice = scores + bias.double() if bias is not None else scores
    group = choice.view(-1, G, E // G).topk(per_group, dim=-1).values.sum(-1)
    rel, gap = float("inf"), float("inf")
    gs = group.sort(dim=-1, descending=True).values
    if TG < G:
        rel = min(rel, float(((gs[:, TG - 1] - gs[:, TG]) / gs[:, 0].abs()).min()))
        gap = min(gap, float((gs[:, TG - 1] - gs[:, TG]).min()))
    keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(TG, dim=-1).indices, True)
    allowed = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    top = allowed.topk(min(k + 1, E), dim=-1)
    assert torch.equal(top.indices[:, :k].sort(-1).values, idx.sort(-1).values), "router picked other experts"
    if k < TG * (E // G):
        d = top.values[:, k - 1] - top.values[:, k]
        rel = min(rel, float((d / top.values[:, 0].abs()).min()))
        gap = min(gap, float(d.min()))
    w = scores.gather(1, idx)
    if renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * mod.routed_scaling_factor
    assert torch.allclose(w, weights.double(), rtol=1e-5, atol=0), "routing weights differ"
    return rel, gap


def _group_limited_topk(choice, G, TG, k, per_group):
    """Expert sets (bool [T, E]) of group-limited top-k on the biased scores `choice` [T, E]: group score = sum of the
    top-`per_group` scores of each of the G groups, keep the TG best groups, top-k among their experts."""
    T, E = choice.shape
    group = choice.view(T, G, E // G).topk(per_group, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(TG, dim=-1).indices, True)
    allowed = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    return torch.zeros_like(choice, dtype=torch.bool).scatter_(1, allowed.topk(k, dim=-1).indices, True)


def group_rule_differences(routers):
    """(router name, token) pairs whose DeepSeek expert set under Megatron-Core's group score (sum of the top-
    (num_experts_per_tok // topk_group) choice scores of a group; top-1 = the group max when that is 1) differs from
    the set under transformers' (DeepSeek-V3 / GLM-4.5: sum of the top-2; DeepSeek-V2: the max), computed in the router
    logits' dtype. The transformers-rule sets are checked against the router's choice. Plain routers and n_group ==
    topk_group contribute nothing."""
    diffs = []
    for name, logits, idx, mod, _ in routers:
        grouped = _grouped_router(mod)
        if grouped is None:
            continue
        score_fn, bias, G, TG, per_group, _ = grouped
        k = mod.top_k
        choice = score_fn(logits) + (bias.to(logits.dtype) if bias is not None else 0)
        hf = _group_limited_topk(choice, G, TG, k, per_group)
        assert torch.equal(hf, torch.zeros_like(hf).scatter_(1, idx, True)), "router picked other experts"
        if TG >= G:
            continue
        mc = _group_limited_topk(choice, G, TG, k, k // TG)
        diffs += [(name, int(t)) for t in (hf != mc).any(-1).nonzero().flatten()]
    return diffs


def group_rule_problem(case, rep):
    """None if the case's golden distinguishes the two group-score rules as GROUP_RULE_MIN_DIFF asks, else why not."""
    need = GROUP_RULE_MIN_DIFF.get(case, 0)
    if rep["group_rule_diff"] < need:
        return f"{rep['group_rule_diff']} tokens differ between the group-score rules < {need}"
    if not rep["group_rule_same_fp32"]:
        return "the float32 run's router logits give other group-rule differences"
    return None


def routing_margins(routers):
    """min over tokens/layers of (p_k - p_{k+1}) / p_1, and min logit gap; probabilities from float64 logits.
    DeepSeek routers (sigmoid, group-limited, biased): see _deepseek_margins."""
    rel, gap = float("inf"), float("inf")
    for _, logits, idx, mod, weights in routers:
        if _grouped_router(mod) is not None:
            r, g = _deepseek_margins(logits, idx, weights, mod)
            rel, gap = min(rel, r), min(gap, g)
            continue
        k = mod.top_k
        probs = torch.softmax(logits.double(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1)
        assert torch.equal(top.indices[:, :k].sort(-1).values, idx.sort(-1).values), "router picked other experts"
        rel = min(rel, float(((top.values[:, k - 1] - top.values[:, k]) / top.values[:, 0]).min()))
        lg = torch.topk(logits.double(), k + 1, dim=-1).values
        gap = min(gap, float((lg[:, k - 1] - lg[:, k]).min()))
    return rel, gap


def compute(case_dir, tokens, fd_checks=True):
    """Golden for the checkpoint in case_dir; returns (golden tensors, report dict). Asserts all self-checks."""
    tok = tokens.long()
    model32 = load(case_dir)
    check_train_setup(model32)
    hub, no_grad = {}, {}
    with safe_open(os.path.join(case_dir, "model.safetensors"), "pt") as f:
        for k in f.keys():
            (no_grad if k.endswith(NO_GRAD) else hub)[k] = f.get_tensor(k)
    assert all(t.dtype == torch.float32 for t in list(hub.values()) + list(no_grad.values()))
    layout = find_layout(model32, hub)
    buffers = dict(model32.named_buffers())  # the saved non-trainable tensors are the in-memory buffers, exactly
    assert set(no_grad) == {n for n in buffers if n.endswith(NO_GRAD)}, (sorted(no_grad), sorted(buffers))
    for n, t in no_grad.items():
        assert buffers[n].dtype == torch.float32 and torch.equal(buffers[n], t), n

    # float64 golden
    model = to_fp64(model32)
    with Float64Mode():
        logits, loss, routers = run(model, tok, backward=True)
    assert logits.dtype == torch.float64 and loss.dtype == torch.float64
    params = dict(model.named_parameters())
    grads = {}
    for hn, (pn, _, fn) in layout.items():
        g = params[pn].grad
        assert g is not None and g.dtype == torch.float64, f"no float64 grad for {pn}"
        grads[hn] = fn(g)
    saved = set(hub) | set(no_grad)
    assert set(grads) == {n for n in saved if not n.endswith(NO_GRAD)}, "grad names != saved names - NO_GRAD ones"
    assert all(b.dtype == torch.float64 for b in model.buffers())
    for hn in hub:
        assert grads[hn].shape == hub[hn].shape

    # loss == cross-entropy recomputed from the logits (position s predicts token s+1)
    V = logits.shape[-1]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), tok[:, 1:].reshape(-1))
    assert abs(float(ce) - float(loss)) < 1e-12, (float(ce), float(loss))

    rel, gap = routing_margins(routers)
    n_moe = len({r[0] for r in routers})
    sel64 = [r[2] for r in routers]

    # plain HF float64 (its own float32 islands) and plain float32: close, same experts
    with torch.no_grad():
        hf_logits, hf_loss, _ = run(copy.deepcopy(model32).double(), tok, backward=False)
        l32, loss32, routers32 = run(model32, tok, backward=False)
    assert all(torch.equal(a, r[2]) for a, r in zip(sel64, routers32)), "float32 run picked other experts"
    rep = dict(loss=float(loss), min_rel_margin=rel, min_logit_gap=gap, moe_layers=n_moe,
               diff_hf64=float((hf_logits - logits).abs().max()), diff_hf64_loss=abs(float(hf_loss - loss)),
               diff_fp32=float((l32.double() - logits).abs().max()), diff_fp32_loss=abs(float(loss32) - float(loss)),
               logits_std=float(logits.std()), layout=layout_summary(layout))
    assert rep["diff_hf64"] < 1e-4 and rep["diff_fp32"] < 1e-3, rep
    diffs = group_rule_differences(routers)
    rep["group_rule_diff"] = len(diffs)
    rep["group_rule_same_fp32"] = diffs == group_rule_differences(routers32)

    if fd_checks:  # central differences on a few entries of the hub tensors, through the fused parameters
        picks, worst = finite_difference_check(
            hub, layout, params, grads, lambda n: re.sub(r"\.\d+\.", ".#.", n),
            lambda: float(run(model, tok, backward=False)[1]))
        rep["fd_checked"] = len(picks)
        rep["fd_worst_rel_err"] = worst

    golden = {"logits": logits.float().contiguous(), "loss": loss.double().reshape(())}
    for hn, g in grads.items():
        golden["grad." + hn] = g.float().contiguous()
    return golden, rep


def finite_difference_check(hub, layout, params, grads, kind_of, objective):
    """Central differences (h = 1e-5, float64) of objective() on one random entry of one hub tensor of every kind
    (kind_of(name) groups names), through the in-memory parameter slice `layout` maps it to; asserts each against
    the analytic gradient in grads. Returns (the names checked, the worst relative error)."""
    kinds = {}
    for n in sorted(hub):
        kinds.setdefault(kind_of(n), n)
    picks = sorted(kinds.values())
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for hn in picks:
        pn, _, fn = layout[hn]
        view = fn(params[pn].data)
        i = int(torch.randint(view.numel(), (1,), generator=gen))
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), view.shape))
        h, orig = 1e-5, float(view[idx])
        vals = []
        for s in (1, -1):
            view[idx] = orig + s * h
            with torch.no_grad(), Float64Mode():
                vals.append(objective())
        view[idx] = orig
        fd, an = (vals[0] - vals[1]) / (2 * h), float(grads[hn][idx])
        assert abs(fd - an) < 1e-8 + 1e-5 * abs(an), (hn, idx, fd, an)
        worst = max(worst, abs(fd - an) / (1e-6 + abs(an)))
    return picks, worst


# ----------------------------------------------------------------------------------------------------------------
# generate / check


def publish_case(tmp, out_root, case, golden, meta):
    """Writes golden.safetensors (with meta as its one metadata key: safetensors writes a multi-key metadata map in
    a nondeterministic order) into the staged case directory tmp, checks it holds exactly FILES, and renames it to
    out_root/case (replacing an older one). Returns the final path."""
    save_file(golden, os.path.join(tmp, "golden.safetensors"), metadata={"reference": json.dumps(meta, sort_keys=True)})
    assert sorted(os.listdir(tmp)) == FILES, os.listdir(tmp)
    os.chmod(tmp, 0o755)
    for f in FILES:
        os.chmod(os.path.join(tmp, f), 0o644)
    final = os.path.join(out_root, case)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def generate(case, out_root):
    _, base_seed, _ = CASES[case]
    os.makedirs(out_root, exist_ok=True)
    for seed in range(base_seed, base_seed + MAX_TRIES):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        cfg = make_config(case)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **LOAD_KW)
        reinit_(model, gen)
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen, dtype=torch.int64).to(torch.int32)
        with torch.no_grad(), Float64Mode():  # cheap early routing-margin test on the in-memory model
            routers = run(to_fp64(model), tokens.long(), backward=False)[2]
            margin, ndiff = routing_margins(routers)[0], len(group_rule_differences(routers))
        if margin < MARGIN:
            print(f"[{case}] seed {seed}: routing margin {margin:.2e} < {MARGIN}, next seed")
            continue
        if ndiff < GROUP_RULE_MIN_DIFF.get(case, 0):
            print(f"[{case}] seed {seed}: {ndiff} tokens differ between the group-score rules "
                  f"< {GROUP_RULE_MIN_DIFF[case]}, next seed")
            continue
        tmp = tempfile.mkdtemp(prefix=f".{case}.", dir=out_root)
        try:
            model.save_pretrained(tmp)
            gc = os.path.join(tmp, "generation_config.json")
            if os.path.exists(gc):
                os.remove(gc)
            # the reloaded checkpoint must hold exactly the in-memory values
            reloaded = load(tmp)
            re = dict(reloaded.named_parameters())
            for n, p in model.named_parameters():
                assert torch.equal(re[n].detach(), p.detach()), f"reload differs: {n}"
            re = dict(reloaded.named_buffers())
            for n, b in model.named_buffers():
                if n.endswith(NO_GRAD):
                    assert bool(b.abs().min() > 0) and torch.equal(re[n], b), f"reload differs: {n}"
            save_file({"tokens": tokens.contiguous()}, os.path.join(tmp, "tokens.safetensors"))
            golden, rep = compute(tmp, tokens, fd_checks=False)
            if rep["min_rel_margin"] < MARGIN:
                print(f"[{case}] seed {seed}: routing margin {rep['min_rel_margin']:.2e} < {MARGIN}, next seed")
                shutil.rmtree(tmp)
                continue
            why = group_rule_problem(case, rep)
            if why:
                print(f"[{case}] seed {seed}: {why}, next seed")
                shutil.rmtree(tmp)
                continue
            golden, rep = compute(tmp, tokens, fd_checks=True)
            meta = {"case": case, "seed": str(seed), "transformers": transformers.__version__,
                    "torch": torch.__version__, "min_rel_routing_margin": f"{rep['min_rel_margin']:.6g}"}
            if case in GROUP_RULE_MIN_DIFF:
                meta["group_rule_diff_tokens"] = str(rep["group_rule_diff"])
            final = publish_case(tmp, out_root, case, golden, meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        report(case, final, seed, rep)
        return
    raise RuntimeError(f"{case}: no seed in [{base_seed}, {base_seed + MAX_TRIES}) gives routing margin {MARGIN}")


MXFP4_CASE = "gpt_oss_mxfp4"


def generate_mxfp4(out_root, check=False):
    """GPT-OSS with MXFP4 experts, as the hub ships gpt-oss: a 1-layer model (hidden 32, 4 experts of intermediate 32,
    so both expert matrices have an in-dim that is a multiple of 32) whose experts' gate_up_proj / down_proj are stored
    as `<name>_blocks` U8 [E, out, in / 32, 16] and `<name>_scales` U8 [E, out, in / 32] (random bytes, exponents
    124..129) and config.json has quantization_config {"quant_method": "mxfp4"}. expected.safetensors holds the two
    tensors as transformers' own convert_moe_packed_tensors dequantises them (float32, in the in-memory [E, in, out]
    layout): moecore's import must give exactly these values. --check regenerates and compares bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(1400)
    cfg = GptOssConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=32, num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=4, layer_types=["sliding_attention"], max_position_embeddings=32,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **LOAD_KW)
    reinit_(model, gen)
    E, H, F = 4, 32, 32
    packed, expected = {}, {}
    for proj, out_dim, in_dim in (("gate_up_proj", 2 * F, H), ("down_proj", H, F)):
        blocks = torch.randint(0, 256, (E, out_dim, in_dim // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(124, 130, (E, out_dim, in_dim // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        name = f"model.layers.0.mlp.experts.{proj}"
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        assert tuple(expected[name].shape) == (E, in_dim, out_dim)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
        config = json.load(open(os.path.join(tmp, "config.json")))
    for name in expected:
        assert tuple(tensors.pop(name).shape) == tuple(expected[name].shape)
    tensors.update(packed)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    config.pop("transformers_version", None)
    case_dir = os.path.join(out_root, MXFP4_CASE)
    files = {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}
    if check:
        assert open(os.path.join(case_dir, "config.json")).read() == files["config.json"]
        for f, want in (("model.safetensors", tensors), ("expected.safetensors", expected)):
            got = load_file(os.path.join(case_dir, f))
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), f
        print(f"== {MXFP4_CASE}: check OK")
        return
    os.makedirs(case_dir, exist_ok=True)
    open(os.path.join(case_dir, "config.json"), "w").write(files["config.json"])
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(case_dir, "model.safetensors"))
    save_file(expected, os.path.join(case_dir, "expected.safetensors"))
    print(f"== {MXFP4_CASE}: wrote {case_dir} ({len(tensors)} tensors, {len(packed)} of them MXFP4 blocks / scales)")


def report(case, case_dir, seed, rep):
    cfg = json.load(open(os.path.join(case_dir, "config.json")))
    sizes = {f: os.path.getsize(os.path.join(case_dir, f)) for f in sorted(os.listdir(case_dir))}
    print(f"== {case}: seed {seed}, loss {rep['loss']:.12f}, {rep['moe_layers']} MoE layers, "
          f"min routing margin (p_k-p_k+1)/p_1 {rep['min_rel_margin']:.3e}, min logit gap {rep['min_logit_gap']:.3e}")
    print(f"   logits std {rep['logits_std']:.3f}; max|logits - HF-as-is float64| {rep['diff_hf64']:.2e} "
          f"(loss {rep['diff_hf64_loss']:.2e}); max|logits - float32| {rep['diff_fp32']:.2e} "
          f"(loss {rep['diff_fp32_loss']:.2e}); float32 picks the same experts")
    if case in GROUP_RULE_MIN_DIFF:
        print(f"   group-score rules: {rep['group_rule_diff']} (MoE layer, token) pairs get another expert set under "
              f"Megatron-Core's group score (top-(k // topk_group) sum) than under transformers' (DeepSeek-V3, "
              f"GLM-4.5: top-2 sum; DeepSeek-V2: the max); "
              f"float32 router logits give the same pairs: {rep['group_rule_same_fp32']}")
    if "fd_checked" in rep:
        print(f"   finite differences: {rep['fd_checked']} entries, worst rel err {rep['fd_worst_rel_err']:.2e}")
    print(f"   files: {sizes} total {sum(sizes.values())} bytes")
    print(f"   config.json: {json.dumps(cfg, sort_keys=True)}")
    print("   non-identity hub <- in-memory mappings (L = layer, E = expert):")
    for line in rep["layout"]:
        print("     " + line)


def check(case, out_root):
    case_dir = os.path.join(out_root, case)
    assert sorted(os.listdir(case_dir)) == FILES, f"{case_dir}: {sorted(os.listdir(case_dir))}"
    tokens = load_file(os.path.join(case_dir, "tokens.safetensors"))["tokens"]
    assert tokens.dtype == torch.int32 and tuple(tokens.shape) == (BATCH, SEQ)
    committed = load_file(os.path.join(case_dir, "golden.safetensors"))
    with safe_open(os.path.join(case_dir, "golden.safetensors"), "pt") as f:
        seed = json.loads((f.metadata() or {}).get("reference", "{}")).get("seed", "?")
    golden, rep = compute(case_dir, tokens, fd_checks=True)
    assert rep["min_rel_margin"] >= MARGIN, rep["min_rel_margin"]
    why = group_rule_problem(case, rep)
    assert why is None, f"{case}: {why}"
    assert set(committed) == set(golden), set(committed) ^ set(golden)
    worst = 0.0
    for k, ref in committed.items():
        new = golden[k]
        assert ref.dtype == new.dtype and ref.shape == new.shape, k
        d = float((ref.double() - new.double()).abs().max()) if ref.numel() else 0.0
        tol = 1e-12 if k == "loss" else 1e-6 * max(1.0, float(ref.abs().max()))
        assert d <= tol, f"{case}: {k} differs by {d}"
        worst = max(worst, d)
    report(case, case_dir, seed, rep)
    print(f"   check OK: {len(committed)} tensors, max abs diff {worst:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/golden/hf_models")
    ap.add_argument("--case", choices=sorted(CASES) + [MTP_CASE, MXFP4_CASE], action="append",
                    help="only this case (repeatable)")
    ap.add_argument("--check", action="store_true", help="verify committed files instead of writing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for case in args.case or list(CASES) + [MTP_CASE, MXFP4_CASE]:
        if case == MXFP4_CASE:
            generate_mxfp4(args.out, check=args.check)
        elif case == MTP_CASE:  # DeepSeek-V3 + multi-token prediction (Megatron-Core semantics): tools/mtp_reference.py
            import mtp_reference
            (mtp_reference.check if args.check else mtp_reference.generate)(args.out)
        else:
            (check if args.check else generate)(case, args.out)


if __name__ == "__main__":
    main()
