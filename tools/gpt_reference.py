#!/usr/bin/python3
"""Golden reference for moecore's dense GPT decoder (Megatron-Core semantics).

Produces eight golden files in tests/golden/ (variant names in brackets):
  gpt_tiny.safetensors          [untied]   RMSNorm + SwiGLU, untied output layer
  gpt_tiny_tied.safetensors     [tied]     RMSNorm + SwiGLU, output layer reuses
                                           embedding.word_embeddings.weight
  gpt_tiny_gelu_ln.safetensors  [gelu_ln]  LayerNorm + GeLU MLP, tied
  gpt_tiny_bias_learned.safetensors         [bias_learned]  LayerNorm + GeLU,
        untied, add_bias_linear, learned absolute positions (no RoPE)
  gpt_tiny_qkvbias_partial_rope.safetensors [qkvbias_partial_rope]  RMSNorm +
        SwiGLU, untied, add_qkv_bias only, RoPE on half of each head
  gpt_tiny_bias_swiglu_nopos.safetensors    [bias_swiglu_nopos]  RMSNorm +
        SwiGLU, tied, add_bias_linear, no position embedding at all
  gpt_tiny_qknorm.safetensors               [qknorm]  RMSNorm + SwiGLU,
        untied, RoPE, qk_layernorm (Qwen3-MoE's attention)
  gpt_tiny_qknorm_ln.safetensors            [qknorm_ln]  LayerNorm + GeLU,
        untied, RoPE, add_qkv_bias, qk_layernorm with biases
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

Variants with linear biases / other position embeddings (Megatron semantics,
dropout 0; same sizes, inputs and optimizer; the base parameters are drawn
exactly as above, the new ones afterwards from a second generator, seed+2, in
the order: embedding.position_embeddings.weight, then per layer qkv, proj,
fc1, fc2 biases; init: position embeddings ~ N(0, 0.5^2), biases ~ N(0, 0.1^2)):
  add_bias_linear: biases on all four linear layers of each layer (prefix
    decoder.layers.{i}.): self_attention.linear_qkv.bias [(nh+2*nkv)*D] in the
    same interleaved [nkv, r+2, D] layout as the weight rows, added right after
    the GEMM (before RoPE); self_attention.linear_proj.bias [H] and
    mlp.linear_fc2.bias [H] added to the block output before the residual add
    (x = x + (attn @ proj^T + b_proj)); mlp.linear_fc1.bias [2F SwiGLU, as
    [gate; up] like the weight rows | F GeLU] added before the activation.
  add_qkv_bias (without add_bias_linear): only linear_qkv.bias.
  learned_absolute: embedding.position_embeddings.weight [P, H] with
    P = max_position_embeddings = S + 8 (rows S..P-1 unused: zero gradient);
    x = word_embeddings[tokens] + position_embeddings[s], s = 0..S-1 per sample;
    no RoPE.
  none: no position information at all (no table, no RoPE).
  rotary_percent < 1: RoPE rotates only the first Dr = int(D * rotary_percent)
    channels of each q/k head (pairs (j, j + Dr/2), inv_freq_j =
    base^(-2j/Dr), j < Dr/2); channels Dr..D-1 pass unchanged.
  [bias_learned]          LayerNorm, GeLU, untied, add_bias_linear, learned_absolute
  [qkvbias_partial_rope]  RMSNorm, SwiGLU, untied, add_qkv_bias, rope, rotary_percent 0.5
  [bias_swiglu_nopos]     RMSNorm, SwiGLU, tied, add_bias_linear, none
  [qknorm]                RMSNorm, SwiGLU, untied, no bias, rope, qk_layernorm
  [qknorm_ln]             LayerNorm, GeLU, untied, add_qkv_bias, rope, qk_layernorm
qk_layernorm (Megatron's --qk-layernorm, attention.py: q_layernorm / k_layernorm
applied to query [sq, b, np, hn] and key [sq, b, ng, hn] over hn, after the
qkv GEMM and its bias, before apply_rotary_pos_emb): every query head and every
key head (a row of D channels) goes through the model's norm with
decoder.layers.{i}.self_attention.q_layernorm.weight [D] (shared by all query
heads) and ...k_layernorm.weight [D] (all key heads), plus .bias [D] each under
LayerNorm; epsilon as for the other norms; value heads untouched. Init (second
generator, per layer after that layer's linear biases, in the order q weight,
q bias, k weight, k bias): weight = 1 + 0.1*N(0,1), bias = 0.1*N(0,1). These
1-D parameters are not decayed. With qk_layernorm the key bias is no longer
softmax-cancelled (it passes through the norm), so no entry is dead.
(qkvbias_partial_rope is untied because, tied, its steep first steps (loss 32
-> 6) amplify float32 noise past the final-parameter tolerance even in PyTorch
float32.) The key slot of linear_qkv.bias in the channels RoPE does not rotate
(all D channels without RoPE) shifts every score of a query by the same amount,
which softmax cancels: its gradient is identically zero (here ~1e-21, far below
adam_eps; as a 1-D bias it is not decayed, so it ends where it starts). An fp32
implementation sees rounding noise there (~1e-10), which Adam's normalised
step turns into moves of up to lr per step; consumers compare those entries'
final values with atol train_iters * lr.
These variants compute everything from the float32-rounded initial values
(exactly the stored param.* tensors, where an fp32 implementation starts; the
first three files start from the float64 draws). Their files carry the extra
metadata keys add_qkv_bias, max_position_embeddings (0 = seq_length),
rotary_percent, hidden_dropout, attention_dropout; the first three files do
not (readers default them: no qkv bias, P = S, 1.0, 0, 0), so they regenerate
byte for byte. The qk variants add the key qk_layernorm = "true"; the files
before them lack it (readers default it to false).

[fp8_tensorwise] (gpt_tiny_fp8_tensorwise.safetensors): the untied RMSNorm + SwiGLU + RoPE model with FP8
training, Megatron's --fp8-format hybrid --fp8-recipe tensorwise: every linear layer (linear_qkv, linear_proj,
linear_fc1, linear_fc2; not the output layer) quantises its input and weight per tensor to E4M3 and, in backward, its
output gradient to E5M2, each from its float32 value with TE's current scale fp32(fp8_max / amax) (saturating casts,
PyTorch's float8 dtypes rounding); dgrad and wgrad use the forward's FP8 x and W; the products run in float64 on the
dequantised values. Metadata fp8_format = "hybrid", fp8_recipe = "tensorwise".

Then 10 AdamW steps on the same batch (explicit float64 implementation): global
L2 grad-norm clipping (grads *= clip/(norm+1e-6) when that factor is < 1, as in
torch clip_grad_norm_ / Megatron), decoupled weight decay on 2-D weights only
(p -= lr*wd*p; norm weights and biases are not decayed), bias-corrected Adam
update p -= lr*mhat/(sqrt(vhat)+eps). Linear biases are 1-D and so are not
decayed either; embedding.position_embeddings.weight (2-D) is (Megatron's
rule: no decay for names ending in .bias or 1-D parameters).

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
# name -> golden file, tied embeddings, normalization, activation and (optional, the defaults of the first three)
# bias: "none" | "qkv" | "all", pos: "rope" | "learned_absolute" | "none", rotary_percent, max_pos (0 = S),
# qk (qk_layernorm: the model's norm over each query / key head before RoPE)
VARIANTS = {
    "untied": dict(file="gpt_tiny.safetensors", tied=False, norm="RMSNorm", act="swiglu"),
    "tied": dict(file="gpt_tiny_tied.safetensors", tied=True, norm="RMSNorm", act="swiglu"),
    "gelu_ln": dict(file="gpt_tiny_gelu_ln.safetensors", tied=True, norm="LayerNorm", act="gelu"),
    "bias_learned": dict(file="gpt_tiny_bias_learned.safetensors", tied=False, norm="LayerNorm", act="gelu",
                         bias="all", pos="learned_absolute", max_pos=CFG["seq_length"] + 8),
    "qkvbias_partial_rope": dict(file="gpt_tiny_qkvbias_partial_rope.safetensors", tied=False, norm="RMSNorm",
                                 act="swiglu", bias="qkv", pos="rope", rotary_percent=0.5),
    "bias_swiglu_nopos": dict(file="gpt_tiny_bias_swiglu_nopos.safetensors", tied=True, norm="RMSNorm",
                              act="swiglu", bias="all", pos="none"),
    "qknorm": dict(file="gpt_tiny_qknorm.safetensors", tied=False, norm="RMSNorm", act="swiglu", pos="rope",
                   rotary_percent=1.0, qk=True),
    "qknorm_ln": dict(file="gpt_tiny_qknorm_ln.safetensors", tied=False, norm="LayerNorm", act="gelu", bias="qkv",
                      pos="rope", qk=True),
    "fp8_tensorwise": dict(file="gpt_tiny_fp8_tensorwise.safetensors", tied=False, norm="RMSNorm", act="swiglu",
                           pos="rope", fp8="tensorwise"),
}
EXTENDED = ("bias", "pos", "rotary_percent", "max_pos", "qk", "fp8")  # keys only the later variants set
FP8_FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
linear_fp8 = None  # the FP8 recipe of the linear layers of the variant being run (None: float64 GEMMs)


def feat(var):
    """The variant's features with defaults filled in."""
    return dict(bias=var.get("bias", "none"), pos=var.get("pos", "rope"),
                rotary_percent=var.get("rotary_percent", 1.0), max_pos=var.get("max_pos", 0), qk=var.get("qk", False))


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
    f, gen2 = feat(var), torch.Generator().manual_seed(SEED + 2)  # new tensors: the draws above stay as they were
    extra = lambda *shape, std: torch.randn(*shape, generator=gen2, dtype=DT) * std
    if f["pos"] == "learned_absolute":
        p["embedding.position_embeddings.weight"] = extra(f["max_pos"] or c["seq_length"], H, std=0.5)
    for i in range(c["num_layers"]):
        pre = f"decoder.layers.{i}."
        if f["bias"] != "none":
            p[pre + "self_attention.linear_qkv.bias"] = extra((nh + 2 * nkv) * D, std=0.1)
        if f["bias"] == "all":
            p[pre + "self_attention.linear_proj.bias"] = extra(H, std=0.1)
            p[pre + "mlp.linear_fc1.bias"] = extra(2 * F_ if var["act"] == "swiglu" else F_, std=0.1)
            p[pre + "mlp.linear_fc2.bias"] = extra(H, std=0.1)
        for qk in ("q_layernorm", "k_layernorm") if f["qk"] else ():  # weight, then (LayerNorm) bias, per head dim
            p[pre + f"self_attention.{qk}.weight"] = 1.0 + extra(D, std=0.1)
            if ln:
                p[pre + f"self_attention.{qk}.bias"] = extra(D, std=0.1)
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


def fp8_tensorwise(x, fmt):
    """x held in float32 (as an fp32 implementation holds it), quantised with one current scale for the whole tensor
    (TE's compute_scale_from_amax: scale = fp32(fp8_max / amax), 1 when amax is 0) and dequantised, in float64."""
    dtype, fp8_max = FP8_FORMATS[fmt]
    xf = x.detach().float()
    amax = xf.abs().amax()
    one = torch.tensor(1.0, dtype=torch.float32)
    scale = one if amax == 0 else torch.tensor(fp8_max, dtype=torch.float32) / amax
    q = torch.clamp((xf * scale).float(), -fp8_max, fp8_max).to(dtype)
    return q.double() * (one / scale).double()


class Fp8TensorwiseLinear(torch.autograd.Function):
    """y = x W^T with both operands quantised per tensor (E4M3), the backward's output gradient too (E5M2: the hybrid
    format); dgrad and wgrad reuse the forward's FP8 W and x (their columnwise copies hold the same bytes)."""

    @staticmethod
    def forward(ctx, x, w):
        xq, wq = fp8_tensorwise(x, "e4m3"), fp8_tensorwise(w, "e4m3")
        ctx.save_for_backward(xq, wq)
        return xq @ wq.T

    @staticmethod
    def backward(ctx, dy):
        xq, wq = ctx.saved_tensors
        dyq = fp8_tensorwise(dy, "e5m2")
        dw = dyq.reshape(-1, dyq.shape[-1]).T @ xq.reshape(-1, xq.shape[-1])
        return dyq @ wq, dw


def linear(p, name, x):  # x @ W^T (+ b when the variant has this bias)
    if linear_fp8 == "tensorwise":
        y = Fp8TensorwiseLinear.apply(x, p[name + ".weight"])
    else:
        y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def mlp(p, pre, h):  # SwiGLU when fc1 has 2F rows, else exact (erf) GeLU
    u = linear(p, pre + "mlp.linear_fc1", h)
    Fh = CFG["ffn_hidden_size"]
    if u.shape[-1] == 2 * Fh:
        a = F.silu(u[..., :Fh]) * u[..., Fh:]
    else:
        a = u * 0.5 * (1.0 + torch.erf(u / math.sqrt(2.0)))
    return linear(p, pre + "mlp.linear_fc2", a)


def rope(x, rotary_percent=1.0):  # x: [B, S, heads, D]; rotates channels [0, Dr), Dr = int(D * rotary_percent)
    S, D = x.shape[1], x.shape[-1]
    Dr = int(D * rotary_percent)
    inv_freq = CFG["rotary_base"] ** (-torch.arange(0, Dr, 2, dtype=DT) / Dr)  # [Dr/2]
    ang = torch.arange(S, dtype=DT)[:, None] * inv_freq[None, :]               # [S, Dr/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2, rest = x[..., : Dr // 2], x[..., Dr // 2:Dr], x[..., Dr:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def attention(p, pre, h, f):
    c = CFG
    B, S, _ = h.shape
    nh, nkv, D = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    r = nh // nkv
    pe = (lambda t: rope(t, f["rotary_percent"])) if f["pos"] == "rope" else (lambda t: t)
    qkv = linear(p, pre + "self_attention.linear_qkv", h).view(B, S, nkv, r + 2, D)  # bias before RoPE
    qn = (lambda n, t: norm(p, pre + f"self_attention.{n}", t)) if f["qk"] else (lambda n, t: t)
    q = pe(qn("q_layernorm", qkv[:, :, :, :r, :].reshape(B, S, nh, D)))  # QK-norm over D, before RoPE
    k = pe(qn("k_layernorm", qkv[:, :, :, r, :]))                 # [B, S, nkv, D]
    v = qkv[:, :, :, r + 1, :]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))              # [B, heads, S, D]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(B, S, nh * D)       # head-major columns
    return linear(p, pre + "self_attention.linear_proj", out)


def forward(p, tokens, labels, var):
    """Norm biases, linear biases, fc1 rows, output_layer and the position table follow from the parameter
    names/shapes; the variant gives the position embedding type, rotary_percent and the linears' FP8 recipe."""
    global linear_fp8
    linear_fp8 = var.get("fp8")
    f = feat(var)
    x = p["embedding.word_embeddings.weight"][tokens]
    if f["pos"] == "learned_absolute":
        x = x + p["embedding.position_embeddings.weight"][torch.arange(tokens.shape[1])][None]
    for i in range(CFG["num_layers"]):
        pre = f"decoder.layers.{i}."
        x = x + attention(p, pre, norm(p, pre + "input_layernorm", x), f)
        x = x + mlp(p, pre, norm(p, pre + "pre_mlp_layernorm", x))
    x = norm(p, "decoder.final_layernorm", x)
    logits = x @ p.get("output_layer.weight", p["embedding.word_embeddings.weight"]).T
    logp = torch.log_softmax(logits, dim=-1)
    mask = labels != -1
    nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return logits, (nll * mask).sum() / mask.sum()


def train(p, tokens, labels, var):
    """Runs the AdamW steps in place; returns (logits0, loss0, grads0, losses, norms)."""
    o = OPT
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    losses, norms, first = [], [], None
    for step in range(1, o["train_iters"] + 1):
        for t in p.values():
            t.requires_grad_(True)
            t.grad = None
        logits, loss = forward(p, tokens, labels, var)
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
                if t.dim() == 2:                        # no decay on norm weights or any bias
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
        t = tensors[name]  # an array, or (an FP8 dtype name, its bytes as a uint8 array)
        tag, a = (t[0], np.asarray(t[1])) if isinstance(t, tuple) else (None, np.asarray(t))
        # (not ascontiguousarray: it turns shape () into (1,))
        assert (a.dtype == np.uint8 and tag in ("F8_E4M3", "F8_E5M2")) or (tag is None and a.dtype in (np.float32,
                                                                                                       np.int32))
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes(order="C")
        header[name] = {"dtype": tag or ("F32" if a.dtype == np.float32 else "I32"),
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
        dt = {"F32": "<f4", "I32": "<i4", "F8_E4M3": "u1", "F8_E5M2": "u1"}[info["dtype"]]
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(info["shape"])
        end = e
    assert end == len(data), "tensors do not tile the data buffer"
    return out, meta


def golden_path(name):
    return os.path.join(GOLDEN_DIR, VARIANTS[name]["file"])


def generate(name):
    torch.set_num_threads(1)
    var = VARIANTS[name]
    f = feat(var)
    p, (tokens, labels) = init_params(var), make_batch()
    if any(k in var for k in EXTENDED):  # start from exactly the float32 values stored in param.*
        p = {n: t.float().double() for n, t in p.items()}
    init = {n: t.clone() for n, t in p.items()}
    logits, loss, grads, losses, norms = train(p, tokens, labels, var)
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
            "normalization": var["norm"], "activation": var["act"], "position_embedding": f["pos"],
            "add_bias_linear": "true" if f["bias"] == "all" else "false", "ignore_index": "-1",
            "decay_params": "2-D weights only", **{k: str(val) for k, val in {**CFG, **OPT}.items()}}
    if any(k in var for k in EXTENDED):
        meta.update(add_qkv_bias="true" if f["bias"] == "qkv" else "false", max_position_embeddings=str(f["max_pos"]),
                    rotary_percent=str(f["rotary_percent"]), hidden_dropout="0", attention_dropout="0")
    if f["qk"]:
        meta["qk_layernorm"] = "true"
    if var.get("fp8"):
        meta.update(fp8_format="hybrid", fp8_recipe=var["fp8"])
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    save_safetensors(golden_path(name), out, meta)
    return out


def check(name):
    var, path = VARIANTS[name], golden_path(name)
    t, meta = load_safetensors(path)
    p = {n[6:]: torch.from_numpy(a.astype(np.float64)).requires_grad_() for n, a in t.items()
         if n.startswith("param.")}  # recompute from the stored float32 params
    tok, lab = (torch.from_numpy(t[k].astype(np.int64)) for k in ("input.tokens", "input.labels"))
    logits, loss = forward(p, tok, lab, var)
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
    f, D = feat(var), CFG["kv_channels"]
    assert meta.get("qk_layernorm", "false") == ("true" if f["qk"] else "false")
    for i in range(CFG["num_layers"]):
        for qk in ("q_layernorm", "k_layernorm"):
            n = f"param.decoder.layers.{i}.self_attention.{qk}."
            assert (n + "weight" in t) == f["qk"] and (n + "bias" in t) == (f["qk"] and ln), n
            assert not f["qk"] or t[n + "weight"].shape == (D,), n
    assert t["param.decoder.layers.0.mlp.linear_fc1.weight"].shape == \
        ((2 * Fh if var["act"] == "swiglu" else Fh), H)
    S = CFG["seq_length"]
    assert meta["position_embedding"] == f["pos"]
    assert meta["add_bias_linear"] == ("true" if f["bias"] == "all" else "false")
    assert float(meta.get("rotary_percent", "1.0")) == f["rotary_percent"]
    assert meta.get("add_qkv_bias", "false") == ("true" if f["bias"] == "qkv" else "false")
    assert ("param.decoder.layers.0.self_attention.linear_qkv.bias" in t) == (f["bias"] != "none")
    for b in ("self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        assert ("param.decoder.layers.1." + b + ".bias" in t) == (f["bias"] == "all"), b
    pos = "embedding.position_embeddings.weight"
    assert ("param." + pos in t) == (f["pos"] == "learned_absolute")
    if f["pos"] == "learned_absolute":
        assert t["param." + pos].shape == (f["max_pos"], CFG["hidden_size"]) and f["max_pos"] > S
        assert not t["grad." + pos][S:].any() and t["grad." + pos][:S].all(), "position-table gradient rows"
    if f["bias"] != "none" and not f["qk"]:  # the softmax-cancelled key-bias channels: zero gradient, never moved
        nh, nkv, D = CFG["num_attention_heads"], CFG["num_query_groups"], CFG["kv_channels"]
        Dr = int(D * f["rotary_percent"]) if f["pos"] == "rope" else 0
        for i in range(CFG["num_layers"]):
            n = f"decoder.layers.{i}.self_attention.linear_qkv.bias"
            dead = lambda k: t[k + n].reshape(nkv, nh // nkv + 2, D)[:, nh // nkv, Dr:]
            assert np.abs(dead("grad.")).max() < 1e-12 and (dead("final.param.") == dead("param.")).all(), n
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
