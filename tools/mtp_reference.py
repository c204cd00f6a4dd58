#!/usr/bin/env python3
"""Golden for DeepSeek-V3 with one multi-token-prediction (MTP) layer, trained as Megatron-Core trains it
(case `deepseek_v3_mtp` of tools/hf_model_reference.py, which runs it: `--case deepseek_v3_mtp [--check]`).

transformers' DeepseekV3ForCausalLM ignores the hub checkpoint's MTP layer `model.layers.{num_hidden_layers}.*` in
training, so the MTP part is written here, after megatron/core/transformer/multi_token_prediction.py
(MultiTokenPredictionBlock / MultiTokenPredictionLayer / roll_tensor / process_mtp_loss / MTPLossAutoScaler) and its
use in megatron/core/models/gpt/gpt_model.py (GPTModel._postprocess), with transformers' own modules for everything
it can: the main model is the reloaded DeepseekV3ForCausalLM itself, the MTP transformer layer is a
DeepseekV3DecoderLayer (layer index L = num_hidden_layers >= first_k_dense_replace, so MoE, as Megatron uses the
spec of the last decoder layer) whose weights transformers itself loads from the hub tensors `model.layers.L.*`.

Model: the deepseek_v3 case's sizes (MLA, YaRN, 16 experts top-4 in 4 groups / 2 kept, shared expert, sigmoid +
e_score_correction_bias routing) with 2 main layers (layer 0 dense, layer 1 MoE) and num_nextn_predict_layers = 1.
Notation: tok [B, S]; H = hidden; V = vocab; D = 1 MTP depth; L = 2.

Forward (float64; all norms are DeepSeek RMSNorm with rms_norm_eps):
  h0     = main model output AFTER its final norm `model.norm` (the tensor that enters lm_head)
  logits = lm_head(h0);  loss = mean over b, s < S-1 of CE(logits[b, s], tok[b, s+1])   (HF's own loss)
  Megatron's view of the same batch: labels = roll(tok, -1), loss_mask = 1 except position S-1 (= 0).
  depth k = 1..D (roll(x) = shift left by one along s, the vacated last position filled with 0):
    ids_k   = roll(ids_{k-1}) (ids_0 = tok);  labels_k = roll(labels_{k-1});  mask_k = roll(mask_{k-1})
    x_k     = eh_proj(cat([enorm(embed_tokens(ids_k)), hnorm(h_{k-1})], -1))      eh_proj: [H, 2H], no bias
    h_k     = shared_head.norm(DecoderLayer_L(x_k; same causal mask, same positions 0..S-1 / RoPE as the main model))
    mtp_logits_k = lm_head(h_k)                   (embed_tokens and lm_head ARE the main model's parameters)
    mtp_loss_k   = sum(mask_k * CE(mtp_logits_k, labels_k)) / sum(mask_k)      (for k = 1: positions s < S-2,
                                                                               target tok[s+2], B*(S-2) tokens)
  mtp_loss = mean over k of mtp_loss_k (Megatron logs each depth's mtp_loss_k as "mtp_k loss")
  objective = loss + (mtp_loss_scaling_factor / D) * sum_k mtp_loss_k,  mtp_loss_scaling_factor = 0.1
The vacated last position of ids_k (filled with token 0) only reaches masked positions (causal attention, per-token
MoE without capacity limits): checked by recomputing both losses with another filler.

Files in <out>/deepseek_v3_mtp/ (as for the other cases):
  config.json         save_pretrained of the main model (model_type deepseek_v3, num_nextn_predict_layers 1)
  model.safetensors   save_pretrained's main tensors PLUS the MTP layer `model.layers.2.*` in hub format (per-expert
                      tensors as transformers writes them for a decoder layer), metadata {"format": "pt"}, float32:
                      enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H], shared_head.norm.weight [H],
                      shared_head.head.weight [V, H] == lm_head.weight and embed_tokens.weight [V, H] ==
                      model.embed_tokens.weight (bitwise copies of the shared parameters), input_layernorm,
                      self_attn.*, post_attention_layernorm, mlp.{gate.weight, gate.e_score_correction_bias,
                      experts.E.{gate,up,down}_proj.weight, shared_experts.*}
  tokens.safetensors  `tokens` int32 [2, 12]
  golden.safetensors  `logits` F32 [B, S, V] (main), `loss` F64 (main mean next-token CE), `mtp_loss` F64 (as
                      above, unscaled), `mtp_logits` F32 [B, S, V] (depth 1, all positions), `grad.<name>` F32 =
                      d objective / d tensor for every tensor of model.safetensors except the two copies (the whole
                      gradient of the shared embedding / output head is under model.embed_tokens.weight /
                      lm_head.weight) and the e_score_correction_bias buffers; metadata `reference` JSON holds
                      mtp_loss_scaling_factor and mtp_num_layers.
"""
import copy
import json
import logging
import os
import re
import shutil
import tempfile

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import transformers
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3MoE,
                                                                  DeepseekV3RMSNorm)

import hf_model_reference as H

CASE = "deepseek_v3_mtp"
BASE_SEED = 700
MTP_LOSS_SCALING_FACTOR = 0.1  # Megatron-Core TransformerConfig.mtp_loss_scaling_factor default
NUM_MTP = 1
CONFIG = dict(H.CASES["deepseek_v3"][2], num_hidden_layers=2, num_mtp_layers=NUM_MTP)
COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # under model.layers.L.: copies of shared parameters


def make_config():
    return H.DeepseekV3Config(**CONFIG)


class MTPLayer(DeepseekV3DecoderLayer):
    """One DeepSeek-V3 MTP module: a DeepseekV3DecoderLayer (transformers' own attention / MoE) plus enorm, hnorm,
    eh_proj and shared_head.norm; its parameter names are the hub names under `model.layers.L.` (experts fused as
    transformers keeps them in memory). Embedding and output head are the main model's, passed in."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        assert isinstance(self.mlp, DeepseekV3MoE)
        h = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)

    def mtp_forward(self, hidden, ids, embed_tokens, layer_kwargs):
        e = self.enorm(embed_tokens(ids))
        h = self.hnorm(hidden)
        x = self.eh_proj(torch.cat([e, h], dim=-1))  # Megatron: cat((decoder_input, hidden_states), -1)
        x = DeepseekV3DecoderLayer.forward(self, x, **layer_kwargs)
        return self.shared_head.norm(x)


def roll(t, fill=0):
    """Megatron roll_tensor without context parallelism: shift left by one along the last dim, last = fill."""
    r = torch.roll(t, shifts=-1, dims=-1)
    r[..., -1] = fill
    return r


def run_mtp(main, mtps, tok, backward, filler=0):
    """Main model (HF forward with labels) + MTP depths. Returns logits, loss, [mtp_logits_k], [mtp_loss_k], routers
    (as H.run: name, logits, chosen indices, router module, weights; main routers first)."""
    routers, cap = [], {}
    mods = H._router_modules(main) + [(f"mtp{k}.{n}", m) for k, mtp in enumerate(mtps)
                                      for n, m in H._router_modules(mtp)]
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: routers.append((n, out[0].detach(), out[2].detach(),
                                                                                  mod, out[1].detach())))
             for n, m in mods]
    # the tensor entering lm_head (after the final norm) and the exact mask / positions / RoPE of the main layers
    hooks.append(main.model.norm.register_forward_hook(lambda mod, inp, out: cap.__setitem__("h", out)))
    hooks.append(main.model.layers[-1].register_forward_pre_hook(
        lambda mod, args, kw: cap.__setitem__("kw", dict(kw)), with_kwargs=True))
    try:
        main.train()
        main.zero_grad(set_to_none=True)
        for mtp in mtps:
            mtp.train()
            mtp.zero_grad(set_to_none=True)
        out = main(input_ids=tok, labels=tok, output_router_logits=False, use_cache=False)
        kw = cap["kw"]
        mask4 = kw["attention_mask"]
        S = tok.shape[1]
        assert mask4 is not None and mask4.dim() == 4 and mask4.shape[-2:] == (S, S)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        assert bool((mask4[..., causal] == 0).all()) and bool((mask4[..., ~causal] < -1e30).all()), "not causal"
        layer_kwargs = dict(attention_mask=mask4, position_ids=kw["position_ids"],
                            position_embeddings=kw["position_embeddings"], use_cache=False)
        V = out.logits.shape[-1]
        labels = roll(tok)  # Megatron labels / loss mask equivalent to HF's shifted loss
        lmask = torch.ones_like(tok, dtype=out.logits.dtype)
        lmask[:, -1] = 0
        ids, h = tok, cap["h"]
        mtp_logits, mtp_losses = [], []
        for mtp in mtps:
            ids = roll(ids, filler)
            labels, lmask = roll(labels), roll(lmask)
            h = mtp.mtp_forward(h, ids, main.model.embed_tokens, layer_kwargs)
            lg = main.lm_head(h)
            ce = F.cross_entropy(lg.reshape(-1, V).double(), labels.reshape(-1), reduction="none").view_as(lmask)
            mtp_losses.append((lmask * ce).sum() / lmask.sum().clamp(min=1))
            mtp_logits.append(lg)
        if backward:
            total = out.loss + (MTP_LOSS_SCALING_FACTOR / len(mtps)) * sum(mtp_losses)
            total.backward()
    finally:
        for hk in hooks:
            hk.remove()
    return (out.logits.detach(), out.loss.detach(), [x.detach() for x in mtp_logits],
            [x.detach() for x in mtp_losses], routers)


def objective(loss, mtp_losses):
    return float(loss) + (MTP_LOSS_SCALING_FACTOR / len(mtp_losses)) * sum(float(x) for x in mtp_losses)


# ----------------------------------------------------------------------------------------------------------------


def load_models(case_dir):
    """main: the reloaded DeepseekV3ForCausalLM (ignores model.layers.L.*); MTP decoder layer: loaded by transformers
    from the same file as layer L of a DeepseekV3ForCausalLM with L+1 layers (its hub -> fused conversion);
    enorm / hnorm / eh_proj / shared_head.norm read from the file."""
    # quiet the load reports (layer L's tensors are "unexpected" for the main model, the MTP extras for the donor;
    # every saved tensor is matched to a loaded parameter slice in compute()); at level ERROR modeling_utils also
    # runs verify_tp_plan, whose warnings go to the tensor_parallel logger
    lgs = [transformers.utils.logging.get_logger(n)
           for n in ("transformers.modeling_utils", "transformers.distributed.tensor_parallel")]
    old = [lg.level for lg in lgs]
    for lg in lgs:
        lg.setLevel(logging.ERROR)
    try:
        main = H.load(case_dir)
        L = main.config.num_hidden_layers
        donor = AutoModelForCausalLM.from_pretrained(case_dir, dtype=torch.float32, num_hidden_layers=L + 1,
                                                     **H.LOAD_KW)
    finally:
        for lg, lv in zip(lgs, old):
            lg.setLevel(lv)
    assert main.config.num_nextn_predict_layers == NUM_MTP == 1
    mp, dp = dict(main.named_parameters()), dict(donor.named_parameters())
    assert set(dp) - set(mp) == {n for n in dp if n.startswith(f"model.layers.{L}.")}
    for n, p in mp.items():
        assert torch.equal(p, dp[n]), f"donor differs from main: {n}"
    mtp = MTPLayer(main.config, L).float()
    missing, unexpected = mtp.load_state_dict(donor.model.layers[L].state_dict(), strict=False)
    extra = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    assert set(missing) == extra and not unexpected, (missing, unexpected)
    with safe_open(os.path.join(case_dir, "model.safetensors"), "pt") as f:
        sd = {n: f.get_tensor(f"model.layers.{L}.{n}") for n in extra}
    mtp.load_state_dict(sd, strict=False)
    return main, [mtp]


def read_checkpoint(case_dir, L):
    hub, no_grad, copies = {}, {}, {}
    with safe_open(os.path.join(case_dir, "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}, f.metadata()
        for k in f.keys():
            t = f.get_tensor(k)
            assert t.dtype == torch.float32, k
            if k.endswith(H.NO_GRAD):
                no_grad[k] = t
            elif k in [f"model.layers.{L}.{c}" for c in COPIES]:
                copies[k] = t
            else:
                hub[k] = t
    assert torch.equal(copies[f"model.layers.{L}.embed_tokens.weight"], hub["model.embed_tokens.weight"])
    assert torch.equal(copies[f"model.layers.{L}.shared_head.head.weight"], hub["lm_head.weight"])
    return hub, no_grad, copies


def to_fp64(main32, mtps32):
    return H.to_fp64(main32), [copy.deepcopy(m).double() for m in mtps32]


def compute(case_dir, tokens, fd_checks=True):
    tok = tokens.long()
    main32, mtps32 = load_models(case_dir)
    L = main32.config.num_hidden_layers
    H.check_train_setup(main32)
    for m in mtps32:
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                assert mod.p == 0.0
            if hasattr(mod, "attention_dropout"):
                assert mod.attention_dropout == 0.0
    hub, no_grad, copies = read_checkpoint(case_dir, L)
    # hub name <-> in-memory slice: main parameters under "main.", the MTP layer's under "mtp0."
    both32 = torch.nn.ModuleDict({"main": main32, "mtp0": mtps32[0]})
    layout = H.find_layout(both32, hub)
    for hn, (pn, _, _) in layout.items():  # MTP hub tensors map into the MTP module and nothing else
        assert hn.startswith(f"model.layers.{L}.") == pn.startswith("mtp0."), (hn, pn)
    buffers = {n: b for n, b in both32.named_buffers() if n.endswith(H.NO_GRAD)}
    bname = {n: (f"model.layers.{L}." + n[len("mtp0."):] if n.startswith("mtp0.") else n[len("main."):])
             for n in buffers}
    assert sorted(bname.values()) == sorted(no_grad), (sorted(bname.values()), sorted(no_grad))
    for n, b in buffers.items():
        assert b.dtype == torch.float32 and torch.equal(b, no_grad[bname[n]]), n

    main, mtps = to_fp64(main32, mtps32)
    both = torch.nn.ModuleDict({"main": main, "mtp0": mtps[0]})
    with H.Float64Mode():
        logits, loss, mtp_logits, mtp_losses, routers = run_mtp(main, mtps, tok, backward=True)
    assert logits.dtype == torch.float64 and loss.dtype == torch.float64 and mtp_losses[0].dtype == torch.float64
    assert all(b.dtype == torch.float64 for b in both.buffers())
    params = dict(both.named_parameters())
    grads = {}
    for hn, (pn, _, fn) in layout.items():
        g = params[pn].grad
        assert g is not None and g.dtype == torch.float64, f"no float64 grad for {pn}"
        grads[hn] = fn(g)
        assert grads[hn].shape == hub[hn].shape
    assert set(grads) == set(hub) and not set(hub) & set(copies) and len(copies) == len(COPIES)

    # main part == plain HF forward of the main model; loss / mtp_loss == CE recomputed from the logits
    with torch.no_grad(), H.Float64Mode():
        l_hf, loss_hf, _ = H.run(main, tok, backward=False)
    assert torch.equal(l_hf, logits) and float(loss_hf) == float(loss)
    V, S = logits.shape[-1], tok.shape[1]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), tok[:, 1:].reshape(-1))
    assert abs(float(ce) - float(loss)) < 1e-12, (float(ce), float(loss))
    ce = F.cross_entropy(mtp_logits[0][:, :S - 2].reshape(-1, V), tok[:, 2:].reshape(-1))
    assert abs(float(ce) - float(mtp_losses[0])) < 1e-12, (float(ce), float(mtp_losses[0]))
    # the filler of the vacated last position only reaches masked positions
    with torch.no_grad(), H.Float64Mode():
        _, loss_f, mtp_l_f, mtp_losses_f, _ = run_mtp(main, mtps, tok, backward=False, filler=V - 1)
    assert float(loss_f) == float(loss) and abs(float(mtp_losses_f[0]) - float(mtp_losses[0])) < 1e-13
    assert float((mtp_l_f[0][:, :S - 1] - mtp_logits[0][:, :S - 1]).abs().max()) < 1e-12

    rel, gap = H.routing_margins(routers)
    n_moe = len({r[0] for r in routers})
    sel64 = [r[2] for r in routers]
    with torch.no_grad():
        l32, loss32, ml32, mlo32, routers32 = run_mtp(main32, mtps32, tok, backward=False)
        hf_main, hf_mtps = copy.deepcopy(main32).double(), [copy.deepcopy(m).double() for m in mtps32]
        hl, hloss, hml, hmlo, _ = run_mtp(hf_main, hf_mtps, tok, backward=False)
    assert len(routers32) == len(routers)
    assert all(torch.equal(a, r[2]) for a, r in zip(sel64, routers32)), "float32 run picked other experts"
    rep = dict(loss=float(loss), mtp_loss=float(mtp_losses[0]), min_rel_margin=rel, min_logit_gap=gap,
               moe_layers=n_moe,
               diff_hf64=float(torch.maximum((hl - logits).abs().max(), (hml[0] - mtp_logits[0]).abs().max())),
               diff_hf64_loss=max(abs(float(hloss - loss)), abs(float(hmlo[0] - mtp_losses[0]))),
               diff_fp32=float(torch.maximum((l32.double() - logits).abs().max(),
                                             (ml32[0].double() - mtp_logits[0]).abs().max())),
               diff_fp32_loss=max(abs(float(loss32) - float(loss)), abs(float(mlo32[0]) - float(mtp_losses[0]))),
               logits_std=float(logits.std()), layout=H.layout_summary(
                   {hn: (re.sub(r"^mtp0\.", f"model.layers.{L}.", re.sub(r"^main\.", "", pn)), d, fn)
                    for hn, (pn, d, fn) in layout.items()}))
    assert rep["diff_hf64"] < 1e-4 and rep["diff_fp32"] < 1e-3, rep

    if fd_checks:  # central differences of the objective on one entry of every tensor kind (MTP layer separately)
        def objective_now():
            r = run_mtp(main, mtps, tok, backward=False)
            return objective(r[1], r[3])

        picks, worst = H.finite_difference_check(
            hub, layout, params, grads,
            lambda n: ("mtp:" if n.startswith(f"model.layers.{L}.") else "") + re.sub(r"\.\d+\.", ".#.", n),
            objective_now)
        rep["fd_checked"] = len(picks)
        rep["fd_mtp_checked"] = sum(n.startswith(f"model.layers.{L}.") for n in picks)
        rep["fd_worst_rel_err"] = worst

    golden = {"logits": logits.float().contiguous(), "loss": loss.double().reshape(()),
              "mtp_loss": (sum(mtp_losses) / len(mtp_losses)).double().reshape(()),
              "mtp_logits": mtp_logits[0].float().contiguous()}
    for hn, g in grads.items():
        golden["grad." + hn] = g.float().contiguous()
    return golden, rep


# ----------------------------------------------------------------------------------------------------------------


def _hub_tensors_of_layer(cfg, main, layer, L, tmp):
    """Hub-format tensors of `layer` as transformers' save_pretrained writes layer L of a DeepseekV3ForCausalLM
    with L+1 layers (whose first L layers / embedding / norm / head are the main model's)."""
    cfg_d = copy.deepcopy(cfg)
    cfg_d.num_hidden_layers = L + 1
    donor = AutoModelForCausalLM.from_config(cfg_d, dtype=torch.float32, **H.LOAD_KW)
    sd = main.state_dict()
    sd.update({f"model.layers.{L}.{k}": v for k, v in layer.state_dict().items()
               if not k.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head."))})
    donor.load_state_dict(sd, strict=True)
    d = os.path.join(tmp, "donor")
    donor.save_pretrained(d)
    t = load_file(os.path.join(d, "model.safetensors"))
    main_saved = load_file(os.path.join(tmp, "model.safetensors"))
    for k, v in main_saved.items():  # the donor writes the main tensors exactly as the main model does
        assert torch.equal(t[k], v), k
    shutil.rmtree(d)
    out = {k: v for k, v in t.items() if k.startswith(f"model.layers.{L}.")}
    assert set(t) == set(main_saved) | set(out)
    return out


def generate(out_root):
    os.makedirs(out_root, exist_ok=True)
    for seed in range(BASE_SEED, BASE_SEED + H.MAX_TRIES):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        cfg = make_config()
        L = cfg.num_hidden_layers
        main = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **H.LOAD_KW)
        H.reinit_(main, gen)
        mtp = MTPLayer(main.config, L).float()
        H.reinit_(mtp, gen)  # same rules: norms 1 + 0.1 randn, router 0.5, other matrices (eh_proj too) 0.2
        tokens = torch.randint(0, cfg.vocab_size, (H.BATCH, H.SEQ), generator=gen, dtype=torch.int64).to(torch.int32)
        m64, mtps64 = to_fp64(main, [mtp])
        with torch.no_grad(), H.Float64Mode():
            margin = H.routing_margins(run_mtp(m64, mtps64, tokens.long(), backward=False)[4])[0]
        if margin < H.MARGIN:
            print(f"[{CASE}] seed {seed}: routing margin {margin:.2e} < {H.MARGIN}, next seed")
            continue
        tmp = tempfile.mkdtemp(prefix=f".{CASE}.", dir=out_root)
        try:
            main.save_pretrained(tmp)
            gc = os.path.join(tmp, "generation_config.json")
            if os.path.exists(gc):
                os.remove(gc)
            path = os.path.join(tmp, "model.safetensors")
            tensors = load_file(path)
            with safe_open(path, "pt") as f:
                assert f.metadata() == {"format": "pt"}, f.metadata()
            mtp_t = _hub_tensors_of_layer(main.config, main, mtp, L, tmp)
            for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
                mtp_t[f"model.layers.{L}.{n}"] = dict(mtp.named_parameters())[n].detach().clone()
            mtp_t[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            mtp_t[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
            assert not set(mtp_t) & set(tensors)
            tensors.update(mtp_t)
            save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
            # the reloaded checkpoint must hold exactly the in-memory values
            main_r, (mtp_r,) = load_models(tmp)
            for a, b in ((main, main_r), (mtp, mtp_r)):
                rp = dict(b.named_parameters())
                assert set(rp) == {n for n, _ in a.named_parameters()}
                for n, p in a.named_parameters():
                    assert torch.equal(rp[n].detach(), p.detach()), f"reload differs: {n}"
                rb = dict(b.named_buffers())
                for n, buf in a.named_buffers():
                    if n.endswith(H.NO_GRAD):
                        assert bool(buf.abs().min() > 0) and torch.equal(rb[n], buf), f"reload differs: {n}"
            save_file({"tokens": tokens.contiguous()}, os.path.join(tmp, "tokens.safetensors"))
            golden, rep = compute(tmp, tokens, fd_checks=False)
            if rep["min_rel_margin"] < H.MARGIN:
                print(f"[{CASE}] seed {seed}: routing margin {rep['min_rel_margin']:.2e} < {H.MARGIN}, next seed")
                shutil.rmtree(tmp)
                continue
            golden, rep = compute(tmp, tokens, fd_checks=True)
            meta = {"case": CASE, "seed": str(seed), "transformers": transformers.__version__,
                    "torch": torch.__version__, "min_rel_routing_margin": f"{rep['min_rel_margin']:.6g}",
                    "mtp_loss_scaling_factor": MTP_LOSS_SCALING_FACTOR, "mtp_num_layers": NUM_MTP,
                    "objective": "loss + mtp_loss_scaling_factor / mtp_num_layers * sum_k mtp_loss_k",
                    "mtp_hidden_input": "main model output after model.norm",
                    "mtp_rolled_fill": 0}
            final = H.publish_case(tmp, out_root, CASE, golden, meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        report(final, seed, rep)
        return
    raise RuntimeError(f"{CASE}: no seed in [{BASE_SEED}, {BASE_SEED + H.MAX_TRIES}) gives routing margin {H.MARGIN}")


def report(case_dir, seed, rep):
    H.report(CASE, case_dir, seed, rep)
    print(f"   mtp_loss {rep['mtp_loss']:.12f} (objective = loss + {MTP_LOSS_SCALING_FACTOR}/{NUM_MTP} * mtp_loss);"
          f" finite differences on {rep.get('fd_mtp_checked', 0)} MTP-layer tensors")


def check(out_root):
    case_dir = os.path.join(out_root, CASE)
    assert sorted(os.listdir(case_dir)) == H.FILES, f"{case_dir}: {sorted(os.listdir(case_dir))}"
    tokens = load_file(os.path.join(case_dir, "tokens.safetensors"))["tokens"]
    assert tokens.dtype == torch.int32 and tuple(tokens.shape) == (H.BATCH, H.SEQ)
    committed = load_file(os.path.join(case_dir, "golden.safetensors"))
    with safe_open(os.path.join(case_dir, "golden.safetensors"), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("reference", "{}"))
    assert meta.get("mtp_loss_scaling_factor") == MTP_LOSS_SCALING_FACTOR and meta.get("mtp_num_layers") == NUM_MTP
    golden, rep = compute(case_dir, tokens, fd_checks=True)
    assert rep["min_rel_margin"] >= H.MARGIN, rep["min_rel_margin"]
    assert set(committed) == set(golden), set(committed) ^ set(golden)
    worst = 0.0
    for k, ref in committed.items():
        new = golden[k]
        assert ref.dtype == new.dtype and ref.shape == new.shape, k
        d = float((ref.double() - new.double()).abs().max()) if ref.numel() else 0.0
        tol = 1e-12 if k in ("loss", "mtp_loss") else 1e-6 * max(1.0, float(ref.abs().max()))
        assert d <= tol, f"{CASE}: {k} differs by {d}"
        worst = max(worst, d)
    report(case_dir, meta.get("seed", "?"), rep)
    print(f"   check OK: {len(committed)} tensors, max abs diff {worst:.2e}")
