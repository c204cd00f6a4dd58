#!/usr/bin/python3
"""Float64 PyTorch reference of ONE Megatron-Core MoE layer (router, token dropping, experts, shared expert, biases).

Interface (layer.json keys, tensor names, dtypes): docs/moe-layer-golden.md.  Semantics: the Megatron MoE
spec, docs/megatron-moe-spec.md (router §2, losses §3, capacity §4, permutation §5, experts §7, shared expert §8),
with moecore's choices where the spec leaves one open:
  * tokens in Megatron's order: the layer input is [S, B, H] flattened sequence-major, token t = s*B + b
    (S = T / micro_batch_size); seq_aux_loss views the [T, E] scores as [S, B*E] (Megatron's reshape), so
    sequence b is the tokens t % B == b; the padding mask follows the same order
  * every top-k is a stable descending sort: largest first, ties to the lower index (group choice too)
  * sinkhorn selection is computed in float64 here (Megatron: fp32), tol 1e-4, eps 1e-8
  * capacity = ceil((T*K/E) * cf), no dropping when capacity > T; policy `probs` keeps per expert the
    `capacity` routed tokens with the largest prob (ties: lower token), then non-routed tokens by ascending
    index; policy `position` keeps routed tokens in token order (= the earliest positions across all
    sequences), then non-routed ones (pad fillers)
  * add_bias_linear (default false here; Megatron's default is true): router logits + router.bias, expert
    fc1 bias added before the activation, expert fc2 bias times the routing probability, so an expert's
    output is p * (act(x W1^T + b1) W2^T + b2) (experts.py TEGroupedMLP._apply_bias / MLP.forward with
    per_token_scale); shared experts refuse biases (shared_experts.py asserts add_bias_linear == False)
  * aux losses with one process: N = valid tokens (seq_aux_loss: valid tokens / B); global_aux_loss of a
    single micro-batch = aux_loss; loss.* hold coefficient-free values, z_loss = mean valid lse(z)^2
Everything runs in float64 on the float32 inputs (upcast exactly); outputs are rounded once to F32.

Objective differentiated: sum(out.output * input.output_grad)
    + aux_grad_scale * (sum_type coeff_type * loss_type + moe_z_loss_coeff * z_loss)

Mode (a), compare any implementation:
    /usr/bin/python3 tools/moe_reference.py --config layer.json --inputs in.safetensors --out out.safetensors
  writes out.output, routing.{map,probs,tokens_per_expert}, loss.* (configured ones), grad.input.hidden and
  grad.param.<name> (every param except router.expert_bias).  --config may be omitted when the inputs file
  carries __metadata__["config"] (every golden file does; its out/routing/loss/grad tensors are ignored).
Mode (b), regenerate the golden files (deterministic: a rerun writes identical bytes):
    /usr/bin/python3 tools/moe_reference.py            # writes tests/golden/moe_<variant>.safetensors
    /usr/bin/python3 tools/moe_reference.py --check    # recompute each golden from its inputs, compare bitwise
  Each file = inputs (input.*, param.*) + expected outputs + __metadata__["config"] (compact layer.json).
  Before writing, gradients are checked by central finite differences, intended drops are asserted and the
  routing margins (gaps at every top-k cut: selection, groups, sinkhorn, aux map, drop ranking) must
  exceed MIN_MARGIN so a float32 implementation routes identically.  Sizes: T = 24 (B = 2, S = 12), H = 16,
  F = 12, E = 8; init N(0, std^2): router weight/bias 0.2, expert/shared weights and biases 0.1, gate 0.2,
  expert_bias 0.1, hidden/grad 1.
"""
import argparse
import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

GOLDEN_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
DT = torch.float64
SEED = 31337
MIN_MARGIN = 1e-4
ST2NP = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4", "BOOL": "|b1"}
NP2ST = {np.float32: "F32", np.float64: "F64", np.int64: "I64", np.int32: "I32", np.bool_: "BOOL"}
AUX_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
DEFAULTS = dict(  # Megatron TransformerConfig defaults for the keys of docs/moe-layer-golden.md
    moe_router_topk=2, micro_batch_size=1, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
    moe_z_loss_coeff=None, moe_router_score_function="softmax", moe_router_pre_softmax=False,
    moe_router_topk_scaling_factor=None, moe_router_dtype=None, moe_router_num_groups=None,
    moe_router_group_topk=None, moe_router_enable_expert_bias=False, moe_expert_capacity_factor=None,
    moe_token_drop_policy="probs", moe_pad_expert_input_to_capacity=False,
    moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, gated_linear_unit=False,
    params_dtype="fp32", aux_grad_scale=1.0, add_bias_linear=False)


# ----------------------------------------------------------------------------- safetensors I/O
def save_safetensors(path, tensors, metadata):
    header, chunks, off = {"__metadata__": metadata}, [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])  # (not ascontiguousarray: it turns shape () into (1,))
        st = NP2ST[a.dtype.type]
        raw = a.astype(np.dtype(ST2NP[st])).tobytes(order="C")
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
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
    meta, data, out = header.pop("__metadata__", None) or {}, buf[8 + n:], {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        if info["dtype"] == "BF16":
            a = (np.frombuffer(data[b:e], "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(data[b:e], ST2NP[info["dtype"]])
        out[name] = a.reshape(info["shape"])
    return out, meta


# ----------------------------------------------------------------------------- config
def load_config(cfg):
    c = {**DEFAULTS, **cfg}
    types = c["moe_router_load_balancing_type"]
    types = [types] if isinstance(types, str) else list(types)
    coeffs = c["moe_aux_loss_coeff"]
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    assert len(coeffs) == len(types), "moe_aux_loss_coeff: one per type, or one for all"
    assert set(types) <= set(AUX_TYPES + ("sinkhorn", "none")), f"unsupported load balancing type {types}"
    c["coeffs"] = {t: float(x) for t, x in zip(types, coeffs) if t in AUX_TYPES and x > 0}
    c["sinkhorn"] = "sinkhorn" in types
    c["zc"] = float(c["moe_z_loss_coeff"] or 0.0)
    cf = c["moe_expert_capacity_factor"]
    c["cf"] = None if cf is None or cf < 0 else float(cf)
    E, K, fn = c["num_moe_experts"], c["moe_router_topk"], c["moe_router_score_function"]
    G, g = c["moe_router_num_groups"], c["moe_router_group_topk"]
    assert 1 <= K <= E and fn in ("softmax", "sigmoid", "sqrtsoftplus")
    assert not (K == 1 and fn == "softmax" and not c["moe_router_pre_softmax"] and not c["sinkhorn"]), \
        "top-1 with softmax after top-k: use moe_router_pre_softmax"
    assert not (c["sinkhorn"] and any(x > 0 for x in coeffs)), "sinkhorn requires moe_aux_loss_coeff == 0"
    assert not (c["moe_router_enable_expert_bias"] and fn == "softmax"), "expert bias needs sigmoid/sqrtsoftplus"
    if G or g:
        assert G and g and E % G == 0 and g <= G <= E and K <= g * (E // G), "bad group-limited routing"
    assert c["cf"] is not None or not c["moe_pad_expert_input_to_capacity"], "pad to capacity needs cf"
    assert c["cf"] is None or not c["sinkhorn"], "capacity is not allowed with sinkhorn"
    assert c["moe_token_drop_policy"] in ("probs", "position")
    assert not (c["add_bias_linear"] and c["moe_shared_expert_intermediate_size"]), \
        "shared experts do not support add_bias_linear (Megatron: use --disable-bias-linear)"
    return c


# ----------------------------------------------------------------------------- router
def topk(x, k, info=None, what="top-k"):
    """Indices [.., k] of the k largest entries per row: largest first, ties to the lower index.
    Records the smallest gap between the k-th and (k+1)-th value in info["margins"][what]."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    if info is not None and k < x.shape[-1]:
        gap = vals[..., k - 1] - vals[..., k]
        gap = gap[torch.isfinite(gap)]
        if gap.numel():
            info["margins"][what] = min(info["margins"].get(what, math.inf), gap.min().item())
    return idx[..., :k]


def score(z, fn):
    return torch.sigmoid(z) if fn == "sigmoid" else torch.sqrt(F.softplus(z))


def group_limit(key, K, G, g, info):
    """Group score = sum of the top K//g values in each of G contiguous groups; mask all but the best g."""
    T, E = key.shape
    top = torch.sort(key.view(T, G, E // G), dim=-1, descending=True).values[..., :K // g]
    keep = torch.zeros(T, G, dtype=torch.bool).scatter(1, topk(top.sum(-1), g, info, "group"), True)
    return key.masked_fill(~keep.repeat_interleave(E // G, dim=1), -math.inf)


def sinkhorn(cost, tol=1e-4, eps=1e-8):
    T, E = cost.shape
    d0, d1 = torch.ones(T, dtype=cost.dtype), torch.ones(E, dtype=cost.dtype)
    err, d1_old = 1e9, d1
    while err > tol:
        d0 = (1.0 / T) / (cost @ d1 + eps)      # row scaling: sum over experts
        d1 = (1.0 / E) / (cost.T @ d0 + eps)    # column scaling: sum over tokens
        err = (d1_old - d1).abs().mean().item()
        d1_old = d1
    return d1[None, :] * cost * d0[:, None]


def route(z, c, bias, info):
    """Sparse probs [T, E] (differentiable) and routing map [T, E] bool, before capacity dropping."""
    T, E = z.shape
    K, fn = c["moe_router_topk"], c["moe_router_score_function"]
    if c["sinkhorn"]:
        with torch.no_grad():
            idx = topk(sinkhorn(torch.exp(z.detach())), K, info, "sinkhorn")
        w = (torch.sigmoid(z) if K == 1 else torch.softmax(z, -1)).gather(1, idx)  # not renormalized
    else:
        pre = c["moe_router_pre_softmax"]
        if fn == "softmax":
            s = torch.softmax(z, -1) if pre else z      # post-softmax: select on raw logits
            key = s.detach()
        else:
            s = score(z, fn)
            key = s.detach() if bias is None else s.detach() + bias   # bias only steers selection
        if c["moe_router_num_groups"]:
            key = group_limit(key, K, c["moe_router_num_groups"], c["moe_router_group_topk"], info)
        idx = topk(key, K, info)
        w = s.gather(1, idx)
        if fn == "softmax" and not pre:
            w = torch.softmax(w, -1)
        elif fn != "softmax" and K > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if c["moe_router_topk_scaling_factor"]:
            w = w * c["moe_router_topk_scaling_factor"]
    probs = torch.zeros(T, E, dtype=z.dtype).scatter(1, idx, w)
    return probs, torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)


def drop(probs, rmap, c, info):
    """Capacity dropping (spec §4.2) with moecore's deterministic ranking; returns (probs, map)."""
    T, E = rmap.shape
    cap = math.ceil((T * c["moe_router_topk"] / E) * c["cf"])
    info["capacity"] = cap
    if cap > T:
        keep = torch.ones(T, E, dtype=torch.bool)
    else:
        if c["moe_token_drop_policy"] == "probs":   # by prob (stable: ties to the lower token) ...
            order = torch.sort(probs.detach(), dim=0, descending=True, stable=True).indices
        else:
            order = torch.arange(T)[:, None].expand(T, E)
        routed = rmap.gather(0, order).to(torch.int64)   # ... then routed tokens before the others
        order = order.gather(0, torch.sort(routed, dim=0, descending=True, stable=True).indices)
        keep = torch.zeros(T, E, dtype=torch.bool).scatter(0, order[:cap], True)
        over = rmap.sum(0) > cap
        if c["moe_token_drop_policy"] == "probs" and cap < T and over.any():
            sp = probs.detach().gather(0, order)
            info["margins"]["drop"] = (sp[cap - 1] - sp[cap])[over].min().item()
    info["dropped"] = int((rmap & ~keep).sum())
    rmap = keep if c["moe_pad_expert_input_to_capacity"] else rmap & keep
    return probs * rmap.to(probs.dtype), rmap


def aux_losses(z, c, pad, info):
    """Coefficient-free loss values {type: scalar} (differentiable through the scores only)."""
    T, E = z.shape
    K, B, fn = c["moe_router_topk"], c["micro_batch_size"], c["moe_router_score_function"]
    S = T // B
    valid = torch.ones(T, dtype=torch.bool) if pad is None else ~pad
    nvalid = int(valid.sum())
    out = {}
    if c["coeffs"]:
        if fn == "softmax":
            s = torch.softmax(z, -1)
        else:
            s = score(z, fn)
            s = s / (s.sum(-1, keepdim=True) + 1e-20)
        m = torch.zeros(T, E, dtype=torch.bool).scatter(1, topk(s.detach(), K, info, "aux"), True)
        s, cnt = s * valid[:, None].to(s.dtype), (m & valid[:, None]).to(s.dtype)     # constant counts

        def switch(s_, c_, N):
            return E / (K * N * N) * (s_.sum(0) * c_.sum(0)).sum()

        for t in c["coeffs"]:
            if t == "seq_aux_loss":   # Megatron's view [S*B, E] -> [S, B*E]: column b*E + e = expert e of
                N = nvalid / B        # sequence b; N = (average) valid tokens per sequence
                Ps, cs = s.reshape(S, B * E).sum(0), cnt.reshape(S, B * E).sum(0)
                out[t] = E / (K * N * N) * (Ps * cs).sum() / B
            else:                     # aux_loss; global_aux_loss = aux_loss on one micro-batch
                out[t] = switch(s, cnt, nvalid)
    if c["zc"] > 0:
        lse = torch.logsumexp(z, -1)
        out["z_loss"] = (lse * lse * valid.to(z.dtype)).sum() / max(nvalid, 1)
    return out


# ----------------------------------------------------------------------------- layer
def mlp(x, w1, w2, glu, scale=None, b1=None, b2=None):
    """fc1 (+ b1) -> SwiGLU ([gate; up]) or exact GeLU -> optional per-row prob -> fc2 (+ prob * b2)."""
    h = x @ w1.T
    if b1 is not None:
        h = h + b1
    if glu:
        f = h.shape[-1] // 2
        a = F.silu(h[:, :f]) * h[:, f:]
    else:
        a = h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))
    if scale is not None:
        a = a * scale[:, None]
    y = a @ w2.T
    if b2 is not None:
        y = y + (b2[None, :] if scale is None else scale[:, None] * b2[None, :])
    return y


def forward(c, x, p, pad, info):
    z = x @ p["router.weight"].T
    if c["add_bias_linear"]:
        z = z + p["router.bias"]
    bias = p["router.expert_bias"] if c["moe_router_enable_expert_bias"] else None
    probs, rmap = route(z, c, bias, info)
    info["dropped"] = 0
    if c["cf"] is not None:
        probs, rmap = drop(probs, rmap, c, info)
    losses = aux_losses(z, c, pad, info)   # aux map: plain top-k, no bias/groups/capacity
    out = torch.zeros_like(x)
    for e in range(c["num_moe_experts"]):
        tok = rmap[:, e].nonzero()[:, 0]
        if tok.numel():
            b1, b2 = ((p["experts.linear_fc1.bias"][e], p["experts.linear_fc2.bias"][e]) if c["add_bias_linear"]
                      else (None, None))
            y = mlp(x[tok], p["experts.linear_fc1.weight"][e], p["experts.linear_fc2.weight"][e],
                    c["gated_linear_unit"], probs[tok, e], b1, b2)
            out = out.index_add(0, tok, y)
    if c["moe_shared_expert_intermediate_size"]:
        sh = mlp(x, p["shared_experts.linear_fc1.weight"], p["shared_experts.linear_fc2.weight"],
                 c["gated_linear_unit"])
        if c["moe_shared_expert_gate"]:
            sh = sh * torch.sigmoid(x @ p["shared_experts.gate_weight"].T)
        out = out + sh
    return out, probs, rmap, losses


def objective(c, out, og, losses):
    reg = sum(cf * losses[t] for t, cf in c["coeffs"].items())
    if c["zc"] > 0:
        reg = reg + c["zc"] * losses["z_loss"]
    return (out * og).sum() + c["aux_grad_scale"] * reg


def expected_params(c):
    H, E, Fe, g = c["hidden_size"], c["num_moe_experts"], c["moe_ffn_hidden_size"], c["gated_linear_unit"]
    shapes = {"router.weight": (E, H), "experts.linear_fc1.weight": (E, 2 * Fe if g else Fe, H),
              "experts.linear_fc2.weight": (E, H, Fe)}
    if c["add_bias_linear"]:
        shapes["router.bias"] = (E,)
        shapes["experts.linear_fc1.bias"] = (E, 2 * Fe if g else Fe)
        shapes["experts.linear_fc2.bias"] = (E, H)
    if c["moe_router_enable_expert_bias"]:
        shapes["router.expert_bias"] = (E,)
    Fs = c["moe_shared_expert_intermediate_size"]
    if Fs:
        shapes["shared_experts.linear_fc1.weight"] = (2 * Fs if g else Fs, H)
        shapes["shared_experts.linear_fc2.weight"] = (H, Fs)
        if c["moe_shared_expert_gate"]:
            shapes["shared_experts.gate_weight"] = (1, H)
    return shapes


def run(cfg, arrays):
    """Mode (a) core: returns ({name: numpy array} of outputs, info, state for finite differences)."""
    torch.set_num_threads(1)
    c = load_config(cfg)
    f64 = lambda a: torch.from_numpy(np.array(a, dtype=np.float64))
    x, og = f64(arrays["input.hidden"]).requires_grad_(), f64(arrays["input.output_grad"])
    T, H = x.shape
    assert H == c["hidden_size"] and og.shape == x.shape and T % c["micro_batch_size"] == 0
    pad = arrays.get("input.padding_mask")
    pad = None if pad is None else torch.from_numpy(np.array(pad, dtype=bool)).reshape(T)
    p = {n[6:]: f64(a).requires_grad_(n != "param.router.expert_bias")
         for n, a in arrays.items() if n.startswith("param.")}
    shapes = expected_params(c)
    assert set(p) == set(shapes), f"params {sorted(p)} != expected {sorted(shapes)}"
    for n, t in p.items():
        assert tuple(t.shape) == shapes[n], f"param.{n}: shape {tuple(t.shape)} != {shapes[n]}"
    info = {"margins": {}}
    out, probs, rmap, losses = forward(c, x, p, pad, info)
    objective(c, out, og, losses).backward()
    f32 = lambda t: t.detach().numpy().astype(np.float32)
    res = {"out.output": f32(out), "routing.map": rmap.numpy().copy(), "routing.probs": f32(probs),
           "routing.tokens_per_expert": rmap.sum(0).numpy().astype(np.int64), "grad.input.hidden": f32(x.grad)}
    res.update({"loss." + k: np.asarray(v.item(), dtype=np.float64) for k, v in losses.items()})
    res.update({"grad.param." + n: f32(t.grad) for n, t in p.items() if n != "router.expert_bias"})
    return res, info, (c, x, og, p, pad)


# ----------------------------------------------------------------------------- golden variants
BASE = dict(hidden_size=16, num_moe_experts=8, moe_ffn_hidden_size=12, moe_router_topk=2, micro_batch_size=2,
            gated_linear_unit=True, params_dtype="fp32")
AUX = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
VARIANTS = {  # name -> (layer.json overrides of BASE, generation extras)
    "softmax_aux": (AUX, {}),
    "presoftmax_seq_z": (dict(moe_router_pre_softmax=True, moe_router_load_balancing_type="seq_aux_loss",
                              moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001), {}),
    "sigmoid_groups_bias_global": (dict(
        moe_router_score_function="sigmoid", moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01), {}),
    "sqrtsoftplus_padding": (dict(moe_router_score_function="sqrtsoftplus", **AUX), {"pad_last": 5}),
    "sinkhorn_k1": (dict(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0), {}),
    "capacity_probs": (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs", **AUX),
                       {"skew": 0.3, "drops": True}),
    "capacity_position_pad": (dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position",
                                   moe_pad_expert_input_to_capacity=True, **AUX), {"skew": 0.3, "drops": True}),
    "shared_gate": (dict(moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True, **AUX), {}),
    "gelu_fp64_multi": (dict(gated_linear_unit=False, moe_router_dtype="fp64",
                             moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                             moe_aux_loss_coeff=[0.01, 0.02], aux_grad_scale=0.5), {}),
    "bias_dropless": (dict(add_bias_linear=True, moe_router_load_balancing_type="seq_aux_loss",
                           moe_aux_loss_coeff=0.01), {}),
    "bias_capacity_gelu": (dict(add_bias_linear=True, gated_linear_unit=False, moe_expert_capacity_factor=1.0,
                                moe_token_drop_policy="probs", moe_pad_expert_input_to_capacity=True, **AUX),
                           {"skew": 0.3, "drops": True}),
}
T_GOLDEN = 24


def golden_path(name):
    return os.path.join(GOLDEN_DIR, f"moe_{name}.safetensors")


def make_case(index, name):
    over, extra = VARIANTS[name]
    cfg = {**BASE, **over}
    c = load_config(cfg)
    gen = torch.Generator().manual_seed(SEED + index)
    normal = lambda *shape, std: torch.randn(*shape, generator=gen, dtype=DT) * std
    H, T = c["hidden_size"], T_GOLDEN
    shapes = expected_params(c)
    arrays = {"input.hidden": normal(T, H, std=1.0), "input.output_grad": normal(T, H, std=1.0)}
    for n, shape in shapes.items():   # draw order = expected_params order
        std = 0.2 if n in ("router.weight", "router.bias", "shared_experts.gate_weight") else 0.1
        arrays["param." + n] = normal(*shape, std=std)
    if extra.get("skew"):             # make expert 0 popular so that capacity drops happen
        arrays["param.router.weight"][0] += extra["skew"]
    arrays = {n: t.numpy().astype(np.float32) for n, t in arrays.items()}
    if extra.get("pad_last"):         # the last positions of sequence 1 are padding ([S, B], t = s*B + b)
        B = c["micro_batch_size"]
        mask = np.zeros((T // B, B), dtype=bool)
        mask[T // B - extra["pad_last"]:, 1] = True
        arrays["input.padding_mask"] = mask.reshape(T)
    return cfg, arrays, extra


def fd_check(c, x, og, p, pad, gen, eps=1e-6):
    """Central finite differences of the objective on 2 elements of every differentiated tensor."""
    leaves = {"input.hidden": x, **{"param." + n: t for n, t in p.items() if n != "router.expert_bias"}}

    def f():
        with torch.no_grad():
            out, _, _, losses = forward(c, x, p, pad, {"margins": {}})
            return objective(c, out, og, losses).item()

    worst = 0.0
    for name, t in leaves.items():
        g = t.grad.reshape(-1)
        for i in (int(g.abs().argmax()), int(torch.randint(g.numel(), (1,), generator=gen))):
            flat, old, fd = t.data.view(-1), t.data.view(-1)[i].item(), 0.0
            for sign in (1.0, -1.0):
                flat[i] = old + sign * eps
                fd += sign * f() / (2 * eps)
            flat[i] = old
            err = abs(fd - g[i].item()) / (1.0 + abs(g[i].item()))
            assert err < 1e-6, f"finite differences disagree for {name}[{i}]: rel err {err:.3g}"
            worst = max(worst, err)
    return worst


def generate(index, name):
    cfg, arrays, extra = make_case(index, name)
    res, info, state = run(cfg, arrays)
    c, rmap = state[0], res["routing.map"]
    margin = min(info["margins"].values())
    assert margin > MIN_MARGIN, f"{name}: routing margin {margin:.3g} too small for a float32 comparison"
    assert (info["dropped"] > 0) == bool(extra.get("drops")), f"{name}: dropped {info['dropped']}"
    if c["moe_pad_expert_input_to_capacity"]:
        assert (res["routing.tokens_per_expert"] == info["capacity"]).all()
    if c["moe_router_num_groups"]:
        G = c["moe_router_num_groups"]
        groups = rmap.reshape(len(rmap), G, -1).any(-1).sum(-1)
        assert (groups <= c["moe_router_group_topk"]).all()
    fd = fd_check(*state, torch.Generator().manual_seed(SEED + 100 + index))
    meta = {"config": json.dumps(cfg, separators=(",", ":"))}
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    save_safetensors(golden_path(name), {**arrays, **res}, meta)
    losses = " ".join(f"{k[5:]}={float(v):.6f}" for k, v in res.items() if k.startswith("loss."))
    print(f"moe_{name}: {losses or 'no losses'} dropped={info['dropped']} capacity={info.get('capacity', '-')} "
          f"tokens_per_expert={res['routing.tokens_per_expert'].tolist()} min_margin={margin:.2e} fd_err={fd:.1e}")


def check(name):
    path = golden_path(name)
    t, meta = load_safetensors(path)
    res, _, _ = run(json.loads(meta["config"]), t)
    stored = {k for k in t if k.split(".")[0] in ("out", "routing", "loss", "grad")}
    assert stored == set(res), f"{path}: tensor names {sorted(stored ^ set(res))} differ"
    for k, v in res.items():
        assert t[k].dtype == v.dtype and t[k].shape == v.shape and np.array_equal(t[k], v), f"{path}: {k}"
    print(f"{path}: {len(t)} tensors, recomputed bitwise identical")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="layer.json (default: __metadata__['config'] of --inputs)")
    ap.add_argument("--inputs", help="in.safetensors with input.* and param.* tensors")
    ap.add_argument("--out", help="out.safetensors to write")
    ap.add_argument("--check", action="store_true", help="verify the golden files")
    args = ap.parse_args()
    if args.inputs or args.out:
        assert args.inputs and args.out, "mode (a) needs --inputs and --out"
        arrays, meta = load_safetensors(args.inputs)
        cfg = json.loads(open(args.config).read() if args.config else meta["config"])
        res, info, _ = run(cfg, arrays)
        save_safetensors(args.out, res, {"config": json.dumps(cfg, separators=(",", ":"))})
        print(f"wrote {args.out}: {len(res)} tensors, dropped={info['dropped']}")
    else:
        for i, name in enumerate(VARIANTS, start=1):
            check(name) if args.check else generate(i, name)
