#!/usr/bin/python3
"""Golden reference for moecore's dense GPT decoder (Megatron-Core semantics).

Produces three golden files in tests/golden/ (variant names in brackets):
  gpt_tiny.safetensors          [untied]   RMSNorm + SwiGLU, untied output layer
  gpt_tiny_tied.safetensors     [tied]     RMSNorm + SwiGLU, output layer reuses
                                           embedding.word_embeddings.weight
  gpt_tiny_gelu_ln.safetensors  [gelu_ln]  LayerNorm + GeLU MLP, tied
Everything is computed in float64 with torch autograd on CPU from weights
initialized here with a fixed-seed torch.Generator, and stored as F32 (I32 for
the integer inputs).

Model (B=2, S=16, H=32, nh=4, nkv=2, D=8, F=48, V=64, 2 layers, no biases):
  x = word_embeddings[tokens]                         (no position embedding)
  per layer i (prefix decoder.layers.{i}.):
    h   = RMSNorm(x; input_layernorm.weight), RMSNorm(x) = x/sqrt(mean(x^2)+eps)*w
    qkv = h @ linear_qkv.weight^T; output dim viewed as [nkv, r+2, D], r=nh/nkv:
          group g holds query heads g*r..g*r+r-1, then key head g, then value head g
    RoPE (rotate-half over full D, pos = 0..S-1, inv_freq_j = base^(-2j/D)) on q, k
    causal softmax attention, scale 1/sqrt(D), query head h uses kv head h//r,
    output [B,S,nh*D] head-major;  x = x + attn @ linear_proj.weight^T
    h = RMSNorm(x; pre_mlp_layernorm.weight); u = h @ linear_fc1.weight^T
    x = x + (silu(u[..., :F]) * u[..., F:]) @ linear_fc2.weight^T
  logits = RMSNorm(x; decoder.final_layernorm.weight) @ output_layer.weight^T
  loss = mean cross-entropy over positions with label != -1 (labels[1, 13:] = -1)
Init: embedding ~ N(0, 1), linear weights ~ N(0, 0.02^2), norms = 1 + 0.1*N(0,1).

Variant gelu_ln differs only in (same sizes, inputs, attention and optimizer):
  every norm is LayerNorm with weight and bias <norm>.weight, <norm>.bias [H]:
    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * w + b  (biased variance)
    init: weight = 1 + 0.1*N(0,1), bias = 0.1*N(0,1)
  MLP: linear_fc1.weight is [F, H];  x = x + gelu(h @ fc1^T) @ linear_fc2.weight^T
    with exact gelu(u) = u * 0.5 * (1 + erf(u / sqrt(2)))
  embeddings tied (no output_layer.weight), embedding init as in [tied].

Then 10 AdamW steps on the same batch (explicit float64 implementation): global
L2 grad-norm clipping (grads *= clip/(norm+1e-6) when that factor is < 1, as in
torch clip_grad_norm_ / Megatron), decoupled weight decay on 2-D weights only
(p -= lr*wd*p; norm weights and biases are not decayed), bias-corrected Adam
update p -= lr*mhat/(sqrt(vhat)+eps).

Tensors: input.tokens, input.labels, param.<name>, out.logits, out.loss (shape
[]), grad.<name>, traj.loss [10] (loss before each step), traj.grad_norm [10]
(pre-clip norm), final.param.<name>. Config is in __metadata__ (strings).

Regenerate all golden files:    /usr/bin/python3 tools/gpt_reference.py
Verify (round trip + recompute): /usr/bin/python3 tools/gpt_reference.py --check
"""
import argparse
import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
           kv_channels=8, ffn_hidden_size=48, vocab_size=64, seq_length=16,
           micro_batch_size=2, norm_epsilon=1e-5, rotary_base=10000)
OPT = dict(lr=1e-2, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1,
           clip_grad=1.0, train_iters=10)
SEED = 1234
GOLDEN_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
DT = torch.float64
VARIANTS = {  # name -> (golden file, tied embeddings, normalization, activation)
    "untied": dict(file="gpt_tiny.safetensors", tied=False, norm="RMSNorm", act="swiglu"),
    "tied": dict(file="gpt_tiny_tied.safetensors", tied=True, norm="RMSNorm", act="swiglu"),
    "gelu_ln": dict(file="gpt_tiny_gelu_ln.safetensors", tied=True, norm="LayerNorm", act="gelu"),
}


def init_params(var):
    c, gen, ln = CFG, torch.Generator().manual_seed(SEED), var["norm"] == "LayerNorm"
    H, F_, V = c["hidden_size"], c["ffn_hidden_size"], c["vocab_size"]
    nh, nkv, D = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    normal = lambda *shape, std: torch.randn(*shape, generator=gen, dtype=DT) * std
    p = {"embedding.word_embeddings.weight": normal(V, H, std=1.0)}

    def add_norm(prefix):  # draw order: weight, then (LayerNorm only) bias
        p[prefix + ".weight"] = 1.0 + normal(H, std=0.1)
        if ln:
            p[prefix + ".bias"] = normal(H, std=0.1)

    for i in range(c["num_layers"]):
        pre = f"decoder.layers.{i}."
        add_norm(pre + "input_layernorm")
        p[pre + "self_attention.linear_qkv.weight"] = normal((nh + 2 * nkv) * D, H, std=0.02)
        p[pre + "self_attention.linear_proj.weight"] = normal(H, nh * D, std=0.02)
        add_norm(pre + "pre_mlp_layernorm")
        fc1_rows = 2 * F_ if var["act"] == "swiglu" else F_
        p[pre + "mlp.linear_fc1.weight"] = normal(fc1_rows, H, std=0.02)
        p[pre + "mlp.linear_fc2.weight"] = normal(H, F_, std=0.02)
    add_norm("decoder.final_layernorm")
    out_w = normal(V, H, std=0.02)  # always drawn so untied/tied share the other weights
    if not var["tied"]:
        p["output_layer.weight"] = out_w
    return p


def make_batch():
    gen = torch.Generator().manual_seed(SEED + 1)
    B, S, V = CFG["micro_batch_size"], CFG["seq_length"], CFG["vocab_size"]
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[1, 13:] = -1
    return tokens, labels


def rms_norm(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + CFG["norm_epsilon"]) * w


def layer_norm(x, w, b):
    d = x - x.mean(-1, keepdim=True)
    return d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + CFG["norm_epsilon"]) * w + b


def norm(p, prefix, x):
    if prefix + ".bias" in p:
        return layer_norm(x, p[prefix + ".weight"], p[prefix + ".bias"])
    return rms_norm(x, p[prefix + ".weight"])


def mlp(p, pre, h):  # SwiGLU when fc1 has 2F rows, else exact (erf) GeLU
    u = h @ p[pre + "mlp.linear_fc1.weight"].T
    Fh = CFG["ffn_hidden_size"]
    if u.shape[-1] == 2 * Fh:
        a = F.silu(u[..., :Fh]) * u[..., Fh:]
    else:
        a = u * 0.5 * (1.0 + torch.erf(u / math.sqrt(2.0)))
    return a @ p[pre + "mlp.linear_fc2.weight"].T


def rope(x):  # x: [B, S, heads, D]
    S, D = x.shape[1], x.shape[-1]
    inv_freq = CFG["rotary_base"] ** (-torch.arange(0, D, 2, dtype=DT) / D)   # [D/2]
    ang = torch.arange(S, dtype=DT)[:, None] * inv_freq[None, :]              # [S, D/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(h, w_qkv, w_proj):
    c = CFG
    B, S, _ = h.shape
    nh, nkv, D = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    r = nh // nkv
    qkv = (h @ w_qkv.T).view(B, S, nkv, r + 2, D)
    q = rope(qkv[:, :, :, :r, :].reshape(B, S, nh, D))
    k = rope(qkv[:, :, :, r, :])                                  # [B, S, nkv, D]
    v = qkv[:, :, :, r + 1, :]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))              # [B, heads, S, D]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(B, S, nh * D)       # head-major columns
    return out @ w_proj.T


def forward(p, tokens, labels):
    """Variant is implied by the parameter names/shapes (norm biases, fc1 rows, output_layer)."""
    x = p["embedding.word_embeddings.weight"][tokens]
    for i in range(CFG["num_layers"]):
        pre = f"decoder.layers.{i}."
        h = norm(p, pre + "input_layernorm", x)
        x = x + attention(h, p[pre + "self_attention.linear_qkv.weight"],
                          p[pre + "self_attention.linear_proj.weight"])
        x = x + mlp(p, pre, norm(p, pre + "pre_mlp_layernorm", x))
    x = norm(p, "decoder.final_layernorm", x)
    logits = x @ p.get("output_layer.weight", p["embedding.word_embeddings.weight"]).T
    logp = torch.log_softmax(logits, dim=-1)
    mask = labels != -1
    nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return logits, (nll * mask).sum() / mask.sum()


def train(p, tokens, labels):
    """Runs the AdamW steps in place; returns (logits0, loss0, grads0, losses, norms)."""
    o = OPT
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    losses, norms, first = [], [], None
    for step in range(1, o["train_iters"] + 1):
        for t in p.values():
            t.requires_grad_(True)
            t.grad = None
        logits, loss = forward(p, tokens, labels)
        loss.backward()
        grads = {n: t.grad.detach().clone() for n, t in p.items()}
        if first is None:
            first = (logits.detach().clone(), loss.detach().clone(), dict(grads))
        norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
        losses.append(loss.item())
        norms.append(norm.item())
        coef = o["clip_grad"] / (norm.item() + 1e-6)
        with torch.no_grad():
            for n, t in p.items():
                g = grads[n] * coef if coef < 1.0 else grads[n]
                t.requires_grad_(False)
                if t.dim() == 2:                        # no decay on norm weights/biases
                    t.mul_(1.0 - o["lr"] * o["weight_decay"])
                m[n] = o["adam_beta1"] * m[n] + (1 - o["adam_beta1"]) * g
                v[n] = o["adam_beta2"] * v[n] + (1 - o["adam_beta2"]) * g * g
                mhat = m[n] / (1 - o["adam_beta1"] ** step)
                vhat = v[n] / (1 - o["adam_beta2"] ** step)
                t.sub_(o["lr"] * mhat / (vhat.sqrt() + o["adam_eps"]))
    return (*first, losses, norms)


def save_safetensors(path, tensors, metadata):
    header, chunks, off = {"__metadata__": metadata}, [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])  # (not ascontiguousarray: it turns shape () into (1,))
        assert a.dtype in (np.float32, np.int32)
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes(order="C")
        header[name] = {"dtype": "F32" if a.dtype == np.float32 else "I32",
                        "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))


def load_safetensors(path):
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    meta, data, out, end = header.pop("__metadata__"), buf[8 + n:], {}, 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        b, e = info["data_offsets"]
        assert b == end, f"gap/overlap at {name}"
        dt = {"F32": "<f4", "I32": "<i4"}[info["dtype"]]
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(info["shape"])
        end = e
    assert end == len(data), "tensors do not tile the data buffer"
    return out, meta


def golden_path(name):
    return os.path.join(GOLDEN_DIR, VARIANTS[name]["file"])


def generate(name):
    torch.set_num_threads(1)
    var = VARIANTS[name]
    p, (tokens, labels) = init_params(var), make_batch()
    init = {n: t.clone() for n, t in p.items()}
    logits, loss, grads, losses, norms = train(p, tokens, labels)
    f32 = lambda t: t.detach().numpy().astype(np.float32)
    out = {"input.tokens": tokens.numpy().astype(np.int32),
           "input.labels": labels.numpy().astype(np.int32),
           "out.logits": f32(logits), "out.loss": f32(loss),
           "traj.loss": np.array(losses, np.float32),
           "traj.grad_norm": np.array(norms, np.float32)}
    for n in init:
        out["param." + n], out["grad." + n], out["final.param." + n] = f32(init[n]), f32(grads[n]), f32(p[n])
    meta = {"format": "pt", "seed": str(SEED), "compute_dtype": "float64",
            "untie_embeddings_and_output_weights": "false" if var["tied"] else "true",
            "normalization": var["norm"], "activation": var["act"], "position_embedding": "rope",
            "add_bias_linear": "false", "ignore_index": "-1", "decay_params": "2-D weights only",
            **{k: str(val) for k, val in {**CFG, **OPT}.items()}}
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    save_safetensors(golden_path(name), out, meta)
    return out


def check(name):
    var, path = VARIANTS[name], golden_path(name)
    t, meta = load_safetensors(path)
    p = {n[6:]: torch.from_numpy(a.astype(np.float64)).requires_grad_() for n, a in t.items()
         if n.startswith("param.")}  # recompute from the stored float32 params
    tok, lab = (torch.from_numpy(t[k].astype(np.int64)) for k in ("input.tokens", "input.labels"))
    logits, loss = forward(p, tok, lab)
    assert np.allclose(logits.detach().numpy(), t["out.logits"], atol=1e-4), "logits mismatch"
    assert abs(loss.item() - float(t["out.loss"])) < 1e-4, "loss mismatch"
    loss.backward()
    for n, w in p.items():
        g = t["grad." + n]
        assert np.allclose(w.grad.numpy(), g, atol=1e-5 + 1e-3 * np.abs(g).max()), n
    tl = t["traj.loss"]
    assert tl[0] == t["out.loss"] and tl[-1] < tl[0], "trajectory does not decrease"
    assert meta["untie_embeddings_and_output_weights"] == ("false" if var["tied"] else "true")
    assert meta["normalization"] == var["norm"] and meta["activation"] == var["act"]
    assert ("param.output_layer.weight" in t) != var["tied"] and t["out.loss"].shape == ()
    ln, H, Fh = var["norm"] == "LayerNorm", CFG["hidden_size"], CFG["ffn_hidden_size"]
    assert ("param.decoder.final_layernorm.bias" in t) == ln
    assert all(("param." + n[:-len("weight")] + "bias" in t) == ln
               for n in p if n.endswith("layernorm.weight")), "norm bias presence"
    assert t["param.decoder.layers.0.mlp.linear_fc1.weight"].shape == \
        ((2 * Fh if var["act"] == "swiglu" else Fh), H)
    print(f"{path}: {os.path.getsize(path)} bytes, {len(t)} tensors, ok")
    print("  traj.loss      =", " ".join(f"{x:.6f}" for x in tl))
    print("  traj.grad_norm =", " ".join(f"{x:.6f}" for x in t["traj.grad_norm"]))
    print("  monotone decrease:", bool(np.all(np.diff(tl) < 0)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tied", action="store_true", help="only the tied-embedding variant")
    ap.add_argument("--variant", choices=list(VARIANTS), action="append",
                    help="only these variants (repeatable; default: all)")
    ap.add_argument("--check", action="store_true", help="verify existing golden files")
    args = ap.parse_args()
    names = (args.variant or []) + (["tied"] if args.tied else []) or list(VARIANTS)
    for name in names:
        if args.check:
            check(name)
        else:
            generate(name)
            print("wrote", golden_path(name))
