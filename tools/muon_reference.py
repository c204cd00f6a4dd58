#!/usr/bin/python3
"""Golden reference for moecore's Muon optimizer (optim/muon.h), written from Megatron-LM's description of its
Muon (megatron/core/optimizer/emerging_optimizers.py on emerging_optimizers v0.3.0; docs/muon-spec.md) and the
Muon write-ups, not from their code.

Produces tests/golden/muon_steps_<variant>.safetensors. Each holds a small MoE model's parameters (Megatron names
and shapes), the gradients of three steps, and the parameters after each step of the chained optimizer:
  Muon for the 2-D weights other than the word embeddings and the output layer (the router too), each routed
  expert's fc1 / fc2 matrix separately, the fused QKV weight [G*(R+2)*D, H] cut into its Q rows (R*D per query
  group), K rows (D) and V rows (D) of every group unless split_qkv is false;
  AdamW (bias-corrected, decoupled decay) for the rest (embeddings, output layer, norms, biases);
  one global gradient-norm clip over every parameter: g *= clip / (norm + 1e-6) when that is below 1.
For a Muon matrix W (gradient g after clipping; lr, wd = weight_decay for 2-D weights):
  W <- (1 - lr wd) W;  M <- beta M + (1 - beta) g;  U = (1 - beta) g + beta M with nesterov, else M
  X = U^T when rows > cols else U;  X /= max(||X||_F, 1e-7)
  steps k = 0..n-1:  A = X X^T;  B = b_k A + c_k A A;  X = a_k X + B X   (the coefficient type's (a, b, c) schedule)
  O = (undo the transpose of X) * scale(rows, cols) * extra_scale_factor;  W <- W - lr O
  scale: spectral sqrt(max(rows, cols)) | unit_rms_norm sqrt(rows / cols) | shape_scaling sqrt(max(1, rows / cols)),
  rows x cols the matrix (or QKV piece) orthogonalised.
Variants:
  f64: --muon-fp32-matmul-prec high, computed in float64 throughout (the mathematics; moecore runs f32).
  bf16: Megatron's default precision "medium": X cast to bfloat16 after the normalisation, every product computed as
        PyTorch's bf16 addmm does (f32 accumulation, one rounding to bf16 per product: A = X X^T; B = addmm(A, A, A,
        beta=b, alpha=c); X = addmm(X, B, X, beta=a)), the result cast back to float32; the rest in float32.
Usage: tools/muon_reference.py [--check]   (--check recomputes each golden from its stored inputs and compares)
"""
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_reference import load_safetensors, save_safetensors  # noqa: E402

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden")
SEED = 1234
STEPS = 3
H, V, NH, NKV, D, E, FM = 16, 24, 4, 2, 4, 4, 12  # hidden, vocab, heads, query groups, head dim, experts, expert ffn

COEFFS = {
    "quintic": ([(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)], "cycle"),
    "simple": ([(3.4445, -4.7750, 2.0315)], "cycle"),
    "polar_express": ([(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                       (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                       (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)], "repeat_last"),
}

VARIANTS = {
    "f64": dict(precision="high", momentum=0.9, nesterov=False, split_qkv=True, ns_steps=5, coefficients="quintic",
                scale_mode="spectral", extra_scale_factor=0.2, lr=0.02, weight_decay=0.1, clip_grad=1.0,
                adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8),
    "f64_nesterov": dict(precision="high", momentum=0.95, nesterov=True, split_qkv=False, ns_steps=7,
                         coefficients="polar_express", scale_mode="unit_rms_norm", extra_scale_factor=1.0, lr=0.01,
                         weight_decay=0.0, clip_grad=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8),
    "bf16": dict(precision="medium", momentum=0.9, nesterov=False, split_qkv=True, ns_steps=5, coefficients="quintic",
                 scale_mode="shape_scaling", extra_scale_factor=0.2, lr=0.02, weight_decay=0.1, clip_grad=1.0,
                 adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8),
}


def shapes():
    q = NH // NKV * D
    pre = "decoder.layers.0."
    return {
        "embedding.word_embeddings.weight": [V, H],
        pre + "input_layernorm.weight": [H],
        pre + "self_attention.linear_qkv.weight": [NKV * (q + 2 * D), H],
        pre + "self_attention.linear_proj.weight": [H, NH * D],
        pre + "self_attention.linear_proj.bias": [H],
        pre + "pre_mlp_layernorm.weight": [H],
        pre + "mlp.router.weight": [E, H],
        pre + "mlp.experts.linear_fc1.weight": [E, 2 * FM, H],
        pre + "mlp.experts.linear_fc2.weight": [E, H, FM],
        "decoder.final_layernorm.weight": [H],
        "output_layer.weight": [V, H],
    }


def is_muon(name, shape):
    if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
        return False
    return len(shape) == (3 if ".experts." in name else 2)


def decays(shape):
    return len(shape) >= 2


def coefficient(cfg, k):
    sets, mode = COEFFS[cfg["coefficients"]]
    return sets[k % len(sets)] if mode == "cycle" else sets[min(k, len(sets) - 1)]


def newton_schulz(u, cfg):
    """u: one matrix (float64 or float32). Returns NS(u) in u's dtype."""
    tr = u.shape[0] > u.shape[1]
    x = u.T if tr else u
    x = x / torch.clamp(torch.linalg.norm(x), min=1e-7)
    if cfg["precision"] == "medium":
        x = x.to(torch.bfloat16)
    for k in range(cfg["ns_steps"]):
        a, b, c = coefficient(cfg, k)
        A = x @ x.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        x = torch.addmm(x, B, x, beta=a, alpha=1.0)
    x = x.to(u.dtype)
    return x.T if tr else x


def scale(cfg, rows, cols):
    m, n = float(rows), float(cols)
    s = {"spectral": math.sqrt(max(m, n)), "unit_rms_norm": math.sqrt(m / n),
         "shape_scaling": math.sqrt(max(1.0, m / n))}[cfg["scale_mode"]]
    return s * cfg["extra_scale_factor"]


def orthogonalised(name, u, cfg):
    """The scaled update O of one parameter's U (expert stacks per expert, QKV per piece)."""
    if u.dim() == 3:
        return torch.stack([orthogonalised(name, u[e], cfg) for e in range(u.shape[0])])
    if cfg["split_qkv"] and name.endswith("linear_qkv.weight"):
        q = NH // NKV * D
        pieces = [q, D, D]
        g = u.view(NKV, sum(pieces), u.shape[1])
        out, at = torch.empty_like(g), 0
        for r in pieces:
            part = g[:, at:at + r, :].reshape(NKV * r, u.shape[1])
            o = newton_schulz(part, cfg) * scale(cfg, part.shape[0], part.shape[1])
            out[:, at:at + r, :] = o.view(NKV, r, u.shape[1])
            at += r
        return out.view_as(u)
    return newton_schulz(u, cfg) * scale(cfg, u.shape[0], u.shape[1])


def step(p, grads, state, cfg, t):
    dt = torch.float64 if cfg["precision"] == "high" else torch.float32
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    clip = 1.0
    if cfg["clip_grad"] > 0:
        clip = min(1.0, cfg["clip_grad"] / (norm + 1e-6))
    lr, wd = cfg["lr"], cfg["weight_decay"]
    for n, w in p.items():
        g = grads[n].to(dt) * clip
        d = wd if decays(w.shape) else 0.0
        if is_muon(n, list(w.shape)):
            beta = cfg["momentum"]
            m = state.setdefault(n, torch.zeros_like(w))
            m.mul_(beta).add_((1 - beta) * g)
            u = (1 - beta) * g + beta * m if cfg["nesterov"] else m
            w.mul_(1 - lr * d)
            w.sub_(lr * orthogonalised(n, u, cfg))
        else:
            b1, b2, eps = cfg["adam_beta1"], cfg["adam_beta2"], cfg["adam_eps"]
            m = state.setdefault(n + ".m", torch.zeros_like(w))
            v = state.setdefault(n + ".v", torch.zeros_like(w))
            w.mul_(1 - lr * d)
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            w.sub_(lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps))
    return norm


def run(params, grads_per_step, cfg):
    dt = torch.float64 if cfg["precision"] == "high" else torch.float32
    p = {n: torch.from_numpy(a.astype(np.float64)).to(dt) for n, a in params.items()}
    state, after, norms = {}, [], []
    for t, grads in enumerate(grads_per_step, start=1):
        norms.append(step(p, {n: torch.from_numpy(a.astype(np.float64)) for n, a in grads.items()}, state, cfg, t))
        after.append({n: w.detach().numpy().astype(np.float32) for n, w in p.items()})
    return after, norms


def path(variant):
    return os.path.join(GOLDEN_DIR, "muon_steps_%s.safetensors" % variant)


def inputs():
    gen = torch.Generator().manual_seed(SEED)
    params, grads = {}, []
    for n, s in shapes().items():
        std = 1.0 if "embedding" in n else (0.1 if len(s) == 1 else 0.05)
        params[n] = (torch.randn(s, generator=gen, dtype=torch.float64) * std + (1.0 if "norm" in n else 0.0)).numpy()
    for t in range(STEPS):  # step 1's gradients large (the clip acts), the others small
        size = 0.5 if t == 0 else 0.02
        grads.append({n: (torch.randn(s, generator=gen, dtype=torch.float64) * size).numpy() for n, s in shapes().items()})
    # Store float32 values and compute from exactly those.
    params = {n: a.astype(np.float32) for n, a in params.items()}
    grads = [{n: a.astype(np.float32) for n, a in g.items()} for g in grads]
    return params, grads


def generate(variant):
    torch.set_num_threads(1)
    cfg = VARIANTS[variant]
    params, grads = inputs()
    after, norms = run(params, grads, cfg)
    out = {"traj.grad_norm": np.array(norms, np.float32)}
    for n, a in params.items():
        out["param." + n] = a
    for t in range(STEPS):
        for n in params:
            out["grad%d.%s" % (t, n)] = grads[t][n]
            out["after%d.%s" % (t, n)] = after[t][n]
    meta = {"format": "pt", "seed": str(SEED), "steps": str(STEPS), "num_attention_heads": str(NH),
            "num_query_groups": str(NKV), "kv_channels": str(D), **{k: json.dumps(v) for k, v in cfg.items()}}
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    save_safetensors(path(variant), out, meta)


def check(variant):
    t, _ = load_safetensors(path(variant))
    params = {k[6:]: v for k, v in t.items() if k.startswith("param.")}
    grads = [{n: t["grad%d.%s" % (s, n)] for n in params} for s in range(STEPS)]
    after, _ = run(params, grads, VARIANTS[variant])
    worst = max(float(np.abs(after[s][n] - t["after%d.%s" % (s, n)]).max()) for s in range(STEPS) for n in params)
    print("%s: max |recomputed - golden| = %.3g" % (variant, worst))
    return worst == 0.0


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if all(check(v) for v in VARIANTS) else 1)
    for v in VARIANTS:
        generate(v)
        print("wrote", path(v))
